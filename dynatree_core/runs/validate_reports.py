"""Validation of imported comparison files (Compare Policies) and benchmark reports (the Benchmark
page): every number in its domain, refused with one message naming the entry and the field.
Run files have their own checks (validate.py), whose helpers these share."""

from __future__ import annotations

from dynatree_core.core.tree import FAMILIES
from dynatree_core.runs.validate import MAX_NODES, _int, _ints, _num, _probability, _show, check_record

MAX_ENTRIES = 64
_NONNEGATIVE = (
    "throughput_tps", "throughput_std", "speedup", "tokens_per_iteration", "mean_accepted_length", "iterations",
    "ttft_ms", "tpot_ms", "draft_ms_per_iteration", "verify_ms_per_iteration", "overhead_ms_per_iteration",
    "peak_memory_mb", "tree_size_mean", "tree_size_max", "verify_rows_mean",
)  # fmt: skip
_SHARES = ("acceptance_rate", "outside_forwards_share")
REQUIRED_NUMBERS = (
    "throughput_tps", "throughput_std", "speedup", "tokens_per_iteration", "acceptance_rate", "mean_accepted_length",
    "iterations", "draft_ms_per_iteration", "verify_ms_per_iteration", "overhead_ms_per_iteration", "peak_memory_mb",
)  # fmt: skip


def _plain_map(value, name: str) -> None:
    if not (
        isinstance(value, dict) and all(isinstance(v, (str, int, float, bool)) or v is None for v in value.values())
    ):
        raise ValueError(f"{name} must map names to plain values")


def _measure_fields(row: dict, where: str) -> None:
    """The numbers a comparison entry or a benchmark row may carry, each in its domain."""
    for name in _NONNEGATIVE:
        if row.get(name) is not None and _num(row[name], f"{where}: {name}") < 0:
            raise ValueError(f"{where}: {name} must not be negative, got {_show(row[name])}")
    for name in _SHARES:
        if row.get(name) is not None:
            _probability(row[name], f"{where}: {name}")
    if row.get("memory_overhead") is not None and _num(row["memory_overhead"], f"{where}: memory_overhead") < -1:
        raise ValueError(f"{where}: memory_overhead is below -1 (less than no memory)")


def check_comparison(data: dict) -> None:
    """A comparison file's values, field by field (ValueError naming the entry and the field)."""
    if not isinstance(data.get("prompt"), str):
        raise ValueError("prompt must be a string")
    _ints(data.get("prompt_ids"), "prompt_ids")
    for name in ("models", "settings"):
        _plain_map(data.get(name), name)
    correct = data.get("correctness")
    if not (
        isinstance(correct, dict)
        and "ok" in correct
        and correct["ok"] in (True, False, None)
        and isinstance(correct.get("message"), str)
    ):
        raise ValueError("correctness must hold ok (true, false or null) and a message")
    for name in ("max_new_tokens", "temperature", "repetitions"):
        _num(data["settings"].get(name), f"settings.{name}")
    entries = data.get("entries")
    if not isinstance(entries, list) or not 1 <= len(entries) <= MAX_ENTRIES:
        raise ValueError(f"entries must be a list of 1 to {MAX_ENTRIES}")
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ValueError(f"entry {i} is not an object")
        where = f"entry {i} ({_show(entry.get('label'))})"
        for name in ("label", "policy", "verifier", "text"):
            if not isinstance(entry.get(name), str):
                raise ValueError(f"{where}: {name} must be a string")
        if entry.get("family") is not None and entry["family"] not in FAMILIES:
            raise ValueError(f"{where}: family must be one of {', '.join(FAMILIES)}")
        _plain_map(entry.get("params"), f"{where}: params")
        _int(entry.get("runs"), f"{where}: runs", hi=10**6)
        if entry.get("exact") is not None:
            _int(entry["exact"], f"{where}: exact", hi=entry["runs"])
        _measure_fields(entry, where)
        for name in REQUIRED_NUMBERS:  # the page's table rounds each of them
            _num(entry.get(name), f"{where}: {name}")
        _ints(entry.get("accepted_lengths"), f"{where}: accepted_lengths", hi=MAX_NODES)
        _ints(entry.get("committed_per_iteration"), f"{where}: committed_per_iteration", hi=MAX_NODES)
        depths = entry.get("acceptance_by_depth")
        if not isinstance(depths, list) or len(depths) > MAX_NODES:
            raise ValueError(f"{where}: acceptance_by_depth must be a list")
        for d, value in enumerate(depths, 1):
            _probability(value, f"{where}: acceptance_by_depth[depth {d}]")
        runs = entry.get("token_ids")
        if not isinstance(runs, list) or len(runs) > 10_000:
            raise ValueError(f"{where}: token_ids must list each run's tokens")
        for r, ids in enumerate(runs):
            _ints(ids, f"{where}: token_ids[{r}]")
        if not runs and not entry["text"]:
            raise ValueError(f"{where}: neither text nor token_ids")
        _check_sample(entry.get("sample"), where)


def _check_sample(sample, where: str) -> None:
    """A comparison entry's drawn iteration (measure/samples.py): a record and its token texts."""
    if sample is None:
        return
    if not isinstance(sample, dict) or not isinstance(sample.get("record"), dict):
        raise ValueError(f"{where}: sample must hold a record")
    _plain_map(sample.get("texts"), f"{where}: sample texts")
    try:
        check_record(sample["record"])
    except ValueError as exc:
        raise ValueError(f"{where}: sample: {exc}") from None


def check_bench_rows(data) -> list[dict]:
    """A benchmark report's result rows (`bench --out`, the Benchmark page's download), checked."""
    rows = data.get("results") if isinstance(data, dict) else None
    if not isinstance(rows, list) or len(rows) > 10_000:
        raise ValueError("not a benchmark report (no 'results' list)")
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("label"), str):
            raise ValueError(f"result {i} has no label")
        where = f"result {i} ({_show(row['label'])})"
        _num(row.get("throughput_tps"), f"{where}: throughput_tps")
        if row.get("verifier") is not None and not isinstance(row["verifier"], str):
            raise ValueError(f"{where}: verifier must be a string")
        _measure_fields(row, where)
    return rows
