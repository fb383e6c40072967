"""`draft-gpu`'s record of a run (RUN/stages.json): what each stage has done over every call, and the
values fixed when the run first needed them. Knows files only, never models or stages' work."""

from __future__ import annotations

import json
from pathlib import Path


class Book:
    """RUN/stages.json: per stage, its seconds, items and tokens over every call, and whether it is
    done; `plan` values fixed the first time they are asked for (the pack's shard size, the
    training budget)."""

    def __init__(self, path: Path):
        self.path = path
        self.data = json.loads(path.read_text()) if path.exists() else {"stages": {}, "plan": {}}

    def stage(self, name: str) -> dict:
        """The stage's row (a stage never started: zeros, not done)."""
        return self.data["stages"].get(name) or {"seconds": 0.0, "items": 0, "tokens": 0, "done": False}

    def add(self, name: str, seconds: float, items: int = 0, tokens: int = 0, *, done: bool = False) -> None:
        row = self.data["stages"].setdefault(name, self.stage(name))
        for key, value in (("seconds", seconds), ("items", items), ("tokens", tokens)):
            row[key] += value
        row["done"] = row["done"] or done
        self.save()

    def plan(self, key: str, make):
        """The run's value of `key`: `make()` the first time, the recorded one after."""
        if key not in self.data["plan"]:
            self.data["plan"][key] = make()
            self.save()
        return self.data["plan"][key]

    def set(self, name: str, **values) -> None:
        self.data["stages"].setdefault(name, self.stage(name)).update(values)
        self.save()

    def seconds(self, *names: str) -> float:
        return sum(self.stage(n)["seconds"] for n in names)

    def save(self) -> None:
        """Written whole (a temporary file, renamed): a killed call leaves the last record."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.rename(self.path)
