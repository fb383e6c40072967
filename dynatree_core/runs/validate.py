"""Validation of imported run files (the app's "Import run JSON"): everything a replay draws must
be the right type, in range and consistent, or the file is refused with one message.

An imported file is data only: it is parsed with `json.loads` (no pickle, no eval), its size and
nesting are bounded before parsing, and nothing in it names code to run. Limits are generous
for real runs (a 4096-token run with 64-node trees is ~20 MB) and stop hostile files early.
"""

from __future__ import annotations

import math
import re

MAX_BYTES = 64 * 2**20
MAX_DEPTH = 64  # JSON nesting; a real file nests 5-6 levels
MAX_RECORDS = 100_000
MAX_NODES = 4096  # nodes in one tree
MAX_TOKEN_ID = 10_000_000  # larger than any vocabulary
MAX_LIST = 1_000_000  # prompt / generated token lists
MAX_VOCAB = 2**22  # a sampled draw's distribution: larger than any vocabulary


def check_size_and_depth(data: str | bytes) -> None:
    """Refuse files that are too large or nested too deeply, before `json.loads` sees them
    (deep nesting would otherwise end in a RecursionError inside the parser)."""
    if len(data) > MAX_BYTES:
        raise ValueError(f"the file is {len(data) / 2**20:.0f} MB; the limit is {MAX_BYTES // 2**20} MB")
    text = data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data
    depth = deepest = 0
    for match in re.finditer(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', text):  # strings skipped: brackets in text
        token = match.group()
        if token in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_DEPTH:
                raise ValueError(f"the file nests deeper than {MAX_DEPTH} levels")
        elif token in "]}":
            depth -= 1


def _int(value, name: str, lo: int = 0, hi: int = MAX_TOKEN_ID) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {_show(value)}")
    return value


def _num(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {_show(value)}")
    if abs(value) > 1e12:
        raise ValueError(f"{name} is out of range: {_show(value)}")
    return float(value)


def _ints(values, name: str, lo: int = 0, hi: int = MAX_TOKEN_ID, most: int = MAX_LIST) -> list[int]:
    if not isinstance(values, list) or len(values) > most:
        raise ValueError(f"{name} must be a list of at most {most} integers")
    return [_int(v, f"{name}[{i}]", lo, hi) for i, v in enumerate(values)]


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_run(raw: dict) -> None:
    """Types, ranges and consistency of a run file's top level and of every record."""
    for name in ("policy", "text", "stop_reason", "device", "dtype", "forward_path", "draft_kind"):
        if name in raw and not isinstance(raw[name], str):
            raise ValueError(f"{name} must be a string")
    if "threads" in raw and not (type(raw["threads"]) is int and 0 <= raw["threads"] <= 4096):
        raise ValueError("threads must be a whole number in [0, 4096]")
    for name in ("prompt_ids", "token_ids"):
        if name in raw:
            _ints(raw[name], name)
    if "params" in raw and not (
        isinstance(raw["params"], dict)
        and all(isinstance(v, (str, int, float, bool)) or v is None for v in raw["params"].values())
    ):
        raise ValueError("params must map names to plain values")
    for name in ("settings", "token_texts"):
        if name in raw and raw[name] is not None and not isinstance(raw[name], dict):
            raise ValueError(f"{name} must be an object")
    texts = raw.get("token_texts") or {}
    for key, value in texts.items():
        if not (isinstance(key, str) and key.lstrip("-").isdigit() and isinstance(value, str)):
            raise ValueError("token_texts must map token ids to strings")
    records = raw.get("records", [])
    if not isinstance(records, list) or len(records) > MAX_RECORDS:
        raise ValueError(f"records must be a list of at most {MAX_RECORDS}")
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise ValueError(f"record {i} is not an object")
        try:
            check_record(rec)
        except ValueError as exc:
            raise ValueError(f"record {i}: {exc}") from None


def _check_sampled(sampled, n: int) -> None:
    """tree.sampled: per node with drawn children, the draws and q: float16 weights, zlib'd, in
    base64 (`w16`; inflated within 2 * size bytes by tree.SampledDraw), or an older file's nonzero
    entries (`ids`, `q`)."""
    if not isinstance(sampled, dict) or len(sampled) > n:
        raise ValueError("tree.sampled must map nodes to their draws")
    for key, draw in sampled.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) < n and isinstance(draw, dict)):
            raise ValueError("tree.sampled must map node ids of the tree to their draws")
        _ints(draw.get("tokens"), "tree.sampled tokens", most=MAX_NODES)
        _int(draw.get("size"), "tree.sampled size", lo=1, hi=MAX_VOCAB)
        legacy = isinstance(draw.get("ids"), str) and isinstance(draw.get("q"), str)
        if not (isinstance(draw.get("w16"), str) or legacy):
            raise ValueError("tree.sampled must hold q as base64 strings")


def check_record(rec: dict) -> None:
    tree = rec.get("tree")
    if not isinstance(tree, dict):
        raise ValueError("tree must be an object")
    tokens = _ints(tree.get("tokens"), "tree.tokens", most=MAX_NODES)
    n = len(tokens)
    if n == 0:
        raise ValueError("the tree has no root")
    parents = _ints(tree.get("parents"), "tree.parents", lo=-1, hi=MAX_NODES, most=MAX_NODES)
    _ints(tree.get("depths"), "tree.depths", hi=MAX_NODES, most=MAX_NODES)
    for name in ("logp", "cum_logp"):
        values = tree.get(name)
        if not isinstance(values, list) or len(values) != n:
            raise ValueError(f"tree.{name} must list one number per node")
        for v in values:
            if v is not None:
                _num(v, f"tree.{name}")
    for name in ("status", "reason"):
        values = tree.get(name)
        if not isinstance(values, list) or len(values) != n or not all(v is None or isinstance(v, str) for v in values):
            raise ValueError(f"tree.{name} must list one string per node")
    notes = tree.get("notes") or {}
    if not isinstance(notes, dict) or not all(isinstance(v, list) for v in notes.values()):
        raise ValueError("tree.notes must map names to lists of numbers")
    for values in notes.values():
        for v in values:
            _num(v, "tree.notes")
    if len(parents) != n or any((i == 0) != (p == -1) or p >= i for i, p in enumerate(parents)):
        raise ValueError("tree.parents must point from each node to an earlier one (root: -1)")
    _check_sampled(tree.get("sampled") or {}, n)

    order = _ints(rec.get("order"), "order", hi=n - 1, most=n)
    if not order or order[0] != 0 or len(set(order)) != len(order):
        raise ValueError("order must list distinct nodes, root first")
    m = len(order)
    mask = rec.get("mask")
    if not (isinstance(mask, list) and len(mask) == m and all(isinstance(r, str) and len(r) == m for r in mask)):
        raise ValueError("mask must hold one string of '0'/'1' per verified node, as long as the order")
    if any(set(r) - {"0", "1"} for r in mask):
        raise ValueError("mask rows may only hold '0' and '1'")
    _ints(rec.get("position_ids"), "position_ids", hi=2**31, most=m)
    if len(rec["position_ids"]) != m:
        raise ValueError("position_ids must give one position per verified node")
    accepted = _ints(rec.get("accepted"), "accepted", hi=n - 1, most=m)
    if not set(accepted) <= set(order[1:]):
        raise ValueError("accepted nodes must be verified non-root nodes")
    _ints(rec.get("committed"), "committed", most=m + 1)
    targets = _ints(rec.get("target_tokens"), "target_tokens", most=m)
    if len(targets) != m:
        raise ValueError("target_tokens must give one token per verified node")
    if rec.get("bonus_token") is not None:
        _int(rec["bonus_token"], "bonus_token")
    _int(rec.get("index"), "index", lo=1, hi=10**9)
    for name in ("prefix_len", "chain_len"):
        _int(rec.get(name), name, hi=2**31)
    _int(rec.get("draft_forwards"), "draft_forwards", hi=10**6)
    for name in ("draft_ms", "verify_ms", "commit_ms", "overhead_ms", "memory_mb"):
        if _num(rec.get(name), name) < 0:
            raise ValueError(f"{name} must not be negative")
    for name in ("draft_forward_ms", "capture_ms"):
        if name in rec:
            _num(rec[name], name)
    for name in ("stop", "verifier", "forward_path"):
        if rec.get(name) is not None and not isinstance(rec[name], str):
            raise ValueError(f"{name} must be a string")
    steps = rec.get("verification", [])
    if not isinstance(steps, list) or len(steps) > 4 * MAX_NODES:
        raise ValueError("verification must be a list of steps")
    for step in steps:
        _check_step(step, n)
    analysis = rec.get("analysis", {})
    if not isinstance(analysis, dict):
        raise ValueError("analysis must map nodes to objects")
    for key, info in analysis.items():
        if not (key.isdigit() and int(key) < n and isinstance(info, dict) and "reach" in info):
            raise ValueError("analysis must map node ids to {reach, expected_acceptance}")
        for name, value in info.items():
            _num(value, f"analysis.{name}")


# the fields each kind of verification step carries (verify/otlp.py, traversal.py, greedy.py)
_STEP_FIELDS = {
    "test": {"token": "token?", "prob": "num", "u": "num", "accepted": "bool", "node": "node?", "child": "node?"},
    "residual": {"top": "top", "node": "node?", "weight": "num"},
    "sample": {"token": "token", "source": "str", "node": "node?"},
    "argmax": {"token": "token", "node": "node?", "child": "node?"},
}
_REQUIRED = {"test": {"prob", "u", "accepted"}, "residual": {"top"}, "sample": {"token", "source"}, "argmax": {"token"}}


def _check_step(step, n: int) -> None:
    if not isinstance(step, dict) or step.get("kind") not in _STEP_FIELDS:
        raise ValueError(f"verification steps must be objects of kind {', '.join(_STEP_FIELDS)}")
    kind = step["kind"]
    fields = _STEP_FIELDS[kind]
    missing = _REQUIRED[kind] - set(step)
    if missing:
        raise ValueError(f"a {kind} step lacks {', '.join(sorted(missing))}")
    for name, value in step.items():
        if name == "kind":
            continue
        expected = fields.get(name)
        if expected is None:
            raise ValueError(f"a {kind} step has an unknown field {name!r}")
        optional = expected.endswith("?")
        expected = expected.rstrip("?")
        if value is None and optional:
            continue
        if expected == "num":
            _num(value, f"{kind}.{name}")
        elif expected == "bool" and not isinstance(value, bool):
            raise ValueError(f"{kind}.{name} must be true or false")
        elif expected == "str" and not isinstance(value, str):
            raise ValueError(f"{kind}.{name} must be a string")
        elif expected == "token":
            _int(value, f"{kind}.{name}")
        elif expected == "node":
            _int(value, f"{kind}.{name}", hi=n - 1)
        elif expected == "top":
            if not isinstance(value, list) or len(value) > 64:
                raise ValueError(f"{kind}.top must list at most 64 (token, probability) pairs")
            for pair in value:
                if not (isinstance(pair, list) and len(pair) == 2):
                    raise ValueError(f"{kind}.top must list (token, probability) pairs")
                _int(pair[0], f"{kind}.top token")
                _num(pair[1], f"{kind}.top probability")
