"""The run file: one run as the app exports and imports it (JSON), so a replay needs no models.

A run file is the RunResult with its records, plus the settings the page asked for, the text of
every token the run draws (a replay needs no tokenizer) and the target's vocabulary size (import
checks every token id against it). Reading validates the file (validate.py) before anything is
built from it. Pure I/O: this module knows records and JSON, not models, tokenizers or the method
registry (live/state.py turns a file's settings back into a RunSpec).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from dynatree_core.runs.records import TRACE_VERSION, IterationRecord, RunResult
from dynatree_core.runs.validate import check_run, check_size_and_depth


@dataclasses.dataclass(frozen=True)
class RunFile:
    """What one run file holds, validated."""

    result: RunResult  # with its records
    settings: dict[str, Any]  # what the page asked for (the live page's own record)
    token_texts: dict[int, str]  # token id -> its text, for every token the records draw
    vocab_size: int | None  # the target's vocabulary; None in files written before it was recorded


def drawn_tokens(records: list[IterationRecord]) -> set[int]:
    """Every token a run's records can show: trees, commits, the target's choices, bonuses."""
    out: set[int] = set()
    for r in records:
        out.update(r.tree.tokens, r.committed, r.target_tokens)
        if r.bonus_token is not None:
            out.add(r.bonus_token)
    return out


def dump_run_file(
    result: RunResult, settings: dict[str, Any], text: Callable[[int], str], *, vocab: int | None = None
) -> str:
    """The run file of `result` (JSON text); `text` maps one token id to its text."""
    out = result.to_dict(with_records=True)
    out["settings"] = settings
    if vocab is not None:
        out["vocab_size"] = vocab
    out["token_texts"] = {str(t): text(t) for t in sorted(drawn_tokens(result.records) | set(result.prompt_ids))}
    return json.dumps(out)


def load_run_file(data: str | bytes) -> RunFile:
    """A run file's content; ValueError ("not a DynaTree run file: ...") when it is not one."""
    try:
        check_size_and_depth(data)
        raw = json.loads(data)
        if not isinstance(raw, dict):
            raise ValueError("expected a JSON object")
        check_run(raw)
        version = raw.get("version", TRACE_VERSION)
        if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= TRACE_VERSION:
            raise ValueError(f"file format version {version!r}; this DynaTree reads versions 1 to {TRACE_VERSION}")
        result = RunResult.from_dict(raw)
        texts = {int(k): str(v) for k, v in (raw.get("token_texts") or {}).items()}
    except (json.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"not a DynaTree run file: {exc}") from exc
    return RunFile(
        result=result, settings=dict(raw.get("settings") or {}), token_texts=texts, vocab_size=raw.get("vocab_size")
    )
