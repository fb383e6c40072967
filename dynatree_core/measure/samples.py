"""One drawn iteration per compared policy, kept in its report so that a page can draw its tree
with no model loaded: the typical iteration of the first measured run (the first whose accepted
length is the run's median, after the prefill's), with the texts of the tokens it shows."""

from __future__ import annotations

import statistics
from collections.abc import Callable

from dynatree_core.runs.records import IterationRecord


def typical_iteration(records: list[IterationRecord]) -> IterationRecord | None:
    """The first iteration past the first whose accepted length is the median of those (the
    first iteration itself when it is the only one); None without records."""
    later = records[1:] or records
    if not later:
        return None
    median = statistics.median_low(len(rec.accepted) for rec in later)
    return next(rec for rec in later if len(rec.accepted) == median)


def iteration_sample(records: list[IterationRecord], decode: Callable[[int], str] | None) -> dict | None:
    """{"record": the typical iteration's to_dict, "texts": token id (str) -> its text} or None."""
    rec = typical_iteration(records)
    if rec is None:
        return None
    tokens = set(rec.tree.tokens) | set(rec.target_tokens) | set(rec.committed)
    tokens |= {rec.bonus_token} if rec.bonus_token is not None else set()
    return {"record": rec.to_dict(), "texts": {str(t): decode([t]) if decode else str(t) for t in sorted(tokens)}}
