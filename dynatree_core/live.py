"""A run that advances one iteration at a time: what the live app keeps per browser session.

`LiveRun` wraps the engine's generator. Each `step()` runs exactly one iteration (one target
forward) under a lock, because the models are shared by every session of the app process. The
settings that define the run are frozen at start: `differs(settings)` tells the page that the
user changed something, so it can ask to restart instead of mixing settings in one run's
statistics. A finished or imported run replays its records without models: the export carries
the text of every token the run drew (`token_texts`), so an imported run shows the same words.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable, Iterator
from typing import Any

import torch

from dynatree_core.drafting.base import Policy
from dynatree_core.engine import DecodeConfig, decode
from dynatree_core.metrics import summarize
from dynatree_core.trace import IterationRecord, RunResult
from dynatree_core.trace_check import check_run, check_size_and_depth
from dynatree_core.vocab import TokenMap


@dataclasses.dataclass
class LiveRun:
    settings: dict[str, Any]
    prompt_ids: list[int]
    policy_name: str
    params: dict[str, Any]
    records: list[IterationRecord] = dataclasses.field(default_factory=list)
    device: str = "cpu"
    dtype: str = "float32"
    done: bool = False
    token_texts: dict[int, str] = dataclasses.field(default_factory=dict)
    _decode: Callable[[int], str] | None = dataclasses.field(default=None, repr=False)
    _steps: Iterator[IterationRecord] | None = dataclasses.field(default=None, repr=False)

    @classmethod
    def start(
        cls,
        target: torch.nn.Module,
        prompt_ids: list[int],
        policy: Policy,
        *,
        settings: dict[str, Any],
        draft: torch.nn.Module | None = None,
        config: DecodeConfig = DecodeConfig(),
        draft_token_map: TokenMap | None = None,
        detokenize: Callable[[int], str] | None = None,
    ) -> LiveRun:
        """Start decoding; `detokenize` maps one token id to its text (the target's tokenizer)."""
        steps = decode(target, prompt_ids, policy, draft=draft, config=config, draft_token_map=draft_token_map)
        return cls(
            settings=dict(settings),
            prompt_ids=list(prompt_ids),
            policy_name=policy.name,
            params=dict(policy.config),
            device=str(target.get_input_embeddings().weight.device),
            dtype=str(target.dtype).removeprefix("torch."),
            _decode=detokenize,
            _steps=steps,
        )

    def step(self, lock: contextlib.AbstractContextManager | None = None) -> IterationRecord | None:
        """Run one iteration; None (and `done`) once the run has stopped."""
        if self.done or self._steps is None:
            self.done = True
            return None
        try:
            with lock if lock is not None else contextlib.nullcontext():
                record = next(self._steps, None)
        except Exception:  # e.g. the prompt does not fit the context: the run cannot go on
            self.done, self._steps = True, None
            raise
        if record is None or record.stop is not None:
            self.done = True
            self._steps = None  # release the KV caches
        if record is not None:
            self.records.append(record)
        return record

    def differs(self, settings: dict[str, Any]) -> list[str]:
        """Names of the settings that changed since the run started."""
        keys = set(settings) | set(self.settings)
        return sorted(k for k in keys if settings.get(k) != self.settings.get(k))

    def text(self, token: int) -> str:
        """Text of one token id, decoded once and remembered (an imported run has no tokenizer)."""
        if token not in self.token_texts:
            if self._decode is None:
                return f"<{token}>"
            self.token_texts[token] = self._decode(token)
        return self.token_texts[token]

    def _all_tokens(self) -> set[int]:
        out: set[int] = set()
        for r in self.records:
            out.update(r.tree.tokens, r.committed, r.target_tokens)
            if r.bonus_token is not None:
                out.add(r.bonus_token)
        return out

    @property
    def token_ids(self) -> list[int]:
        return [t for r in self.records for t in r.committed]

    def result(self, text: str = "") -> RunResult:
        return summarize(
            self.records,
            policy=self.policy_name,
            params=self.params,
            text=text,
            prompt_ids=self.prompt_ids,
            target_forwards=len(self.records),
            device=self.device,
            dtype=self.dtype,
        )

    def to_json(self, text: str = "") -> str:
        """The run as RunResult JSON (records included) plus its settings, for export."""
        out = self.result(text).to_dict(with_records=True)
        out["settings"] = self.settings
        out["token_texts"] = {str(t): self.text(t) for t in sorted(self._all_tokens())}
        return json.dumps(out)

    @classmethod
    def from_json(cls, data: str | bytes) -> LiveRun:
        """A finished run to replay without models (raises ValueError on a malformed file)."""
        try:
            check_size_and_depth(data)
            raw = json.loads(data)
            if not isinstance(raw, dict):
                raise ValueError("expected a JSON object")
            check_run(raw)
            result = RunResult.from_dict(raw)
            texts = {int(k): str(v) for k, v in (raw.get("token_texts") or {}).items()}
        except (json.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError, RecursionError) as exc:
            raise ValueError(f"not a DynaTree run file: {exc}") from exc
        return cls(
            settings=dict(raw.get("settings") or {}),
            prompt_ids=result.prompt_ids,
            policy_name=result.policy,
            params=result.params,
            records=result.records,
            device=result.device,
            dtype=result.dtype,
            done=True,
            token_texts=texts,
        )
