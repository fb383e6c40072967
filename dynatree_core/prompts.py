"""Bundled prompt sets (assets/prompts/*.jsonl) and user prompt files.

A prompt set is a list of `Prompt(text, chat)`. `load_prompts("all")` gives every bundled
domain; a name loads one bundled file; a path loads a user's .jsonl (objects with "prompt" and
optional "chat") or .txt (one prompt per non-empty line, chat off).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from dynatree_core.errors import DynaTreeError

PROMPTS_DIR = Path(__file__).resolve().parent.parent / "assets" / "prompts"


@dataclasses.dataclass(frozen=True)
class Prompt:
    text: str
    chat: bool = False
    domain: str = ""


def bundled_sets() -> list[str]:
    return sorted(p.stem for p in PROMPTS_DIR.glob("*.jsonl"))


def _read_jsonl(path: Path, domain: str) -> list[Prompt]:
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            out.append(Prompt(str(item["prompt"]), bool(item.get("chat", False)), domain))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise DynaTreeError(f"{path}:{n}: expected a JSON object with a 'prompt' field") from exc
    return out


def load_prompts(spec: str) -> list[Prompt]:
    if spec == "all":
        return [p for name in bundled_sets() for p in load_prompts(name)]
    if spec in bundled_sets():
        return _read_jsonl(PROMPTS_DIR / f"{spec}.jsonl", spec)
    path = Path(spec).expanduser()
    if not path.is_file():
        raise DynaTreeError(f"unknown prompt set {spec!r}: use all, {', '.join(bundled_sets())} or a file path")
    if path.suffix == ".jsonl":
        return _read_jsonl(path, path.stem)
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [Prompt(line, False, path.stem) for line in lines]
