"""Validation of imported run files (the app's "Import run JSON"): everything a replay draws must
be the right type, in range and consistent, or the file is refused with one message.

An imported file is data only: it is parsed with `json.loads` (no pickle, no eval), its size and
nesting are bounded before parsing, and nothing in it names code to run. Limits are generous
for real runs (a 4096-token run with 64-node trees is ~20 MB) and stop hostile files early.
"""

from __future__ import annotations

import math
import re

from dynatree_core.core.tree import Source

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


LOGP_SLACK = 1e-6  # a log-probability may exceed 0 by float rounding, never more
CUM_SLACK = 1e-6  # |cum_logp - (parent's cum_logp + logp)|, relative to 1 or the value's size


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
    vocab = MAX_TOKEN_ID
    if raw.get("vocab_size") is not None:  # the target's vocabulary, when the file names it
        vocab = _int(raw["vocab_size"], "vocab_size", lo=1, hi=MAX_VOCAB) - 1
        for name in ("prompt_ids", "token_ids"):
            _ints(raw.get(name, []), name, hi=vocab)
    records = raw.get("records", [])
    if not isinstance(records, list) or len(records) > MAX_RECORDS:
        raise ValueError(f"records must be a list of at most {MAX_RECORDS}")
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise ValueError(f"record {i} is not an object")
        try:
            check_record(rec, vocab=vocab)
        except ValueError as exc:
            index = rec.get("index")
            where = f"record {i} (iteration {index})" if type(index) is int else f"record {i}"
            raise ValueError(f"{where}: {exc}") from None


def _check_sampled(sampled, n: int, vocab: int = MAX_TOKEN_ID) -> None:
    """tree.sampled: per node with drawn children, the draws and q: float16 weights, zlib'd, in
    base64 (`w16`; inflated within 2 * size bytes by tree.SampledDraw), or an older file's nonzero
    entries (`ids`, `q`)."""
    if not isinstance(sampled, dict) or len(sampled) > n:
        raise ValueError("tree.sampled must map nodes to their draws")
    for key, draw in sampled.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) < n and isinstance(draw, dict)):
            raise ValueError("tree.sampled must map node ids of the tree to their draws")
        _ints(draw.get("tokens"), "tree.sampled tokens", hi=vocab, most=MAX_NODES)
        _int(draw.get("size"), "tree.sampled size", lo=1, hi=MAX_VOCAB)
        legacy = isinstance(draw.get("ids"), str) and isinstance(draw.get("q"), str)
        if not (isinstance(draw.get("w16"), str) or legacy):
            raise ValueError("tree.sampled must hold q as base64 strings")


def _node_domains(tree: dict, parents: list[int], depths: list[int]) -> None:
    """Depths follow the parents; log-probabilities are <= 0 and each cumulative one is its
    parent's plus its own, as the engine computes it (core/tree.py; null stands for -inf)."""
    logp, cum = tree["logp"], tree["cum_logp"]
    if depths[0] != 0 or logp[0] != 0 or cum[0] != 0:
        raise ValueError("node 0: the root has depth 0 and log-probabilities 0")
    for i in range(1, len(parents)):
        p = parents[i]
        if depths[i] != depths[p] + 1:
            raise ValueError(f"node {i}: tree.depths is {depths[i]}, its parent {p} is at depth {depths[p]}")
        if logp[i] is not None and logp[i] > LOGP_SLACK:
            raise ValueError(f"node {i}: tree.logp is {_show(logp[i])}; a log-probability is at most 0")
        want = None if logp[i] is None or cum[p] is None else cum[p] + logp[i]
        if (want is None) != (cum[i] is None) or (
            want is not None and abs(cum[i] - want) > CUM_SLACK * max(1.0, abs(want))
        ):
            raise ValueError(
                f"node {i}: tree.cum_logp is {_show(cum[i])}, but its parent's ({_show(cum[p])}) plus its "
                f"own logp ({_show(logp[i])}) is {_show(want)}"
            )


def _probability(value, name: str) -> float:
    x = _num(value, name)
    if not -LOGP_SLACK <= x <= 1 + LOGP_SLACK:
        raise ValueError(f"{name} is {_show(value)}; a probability lies in [0, 1]")
    return x


def _mask_matches_tree(mask: list[str], order: list[int], parents: list[int]) -> None:
    """mask[a][b] is '1' exactly when order[b] is order[a] or one of its ancestors."""
    for a, node in enumerate(order):
        seen, n = set(), node
        while n != -1:
            seen.add(n)
            n = parents[n]
        want = "".join("1" if order[b] in seen else "0" for b in range(len(order)))
        if mask[a] != want:
            raise ValueError(f"node {node}: its mask row is not its ancestors and itself")


def check_record(rec: dict, *, vocab: int = MAX_TOKEN_ID) -> None:
    """One iteration's record; `vocab`: the largest token id the run's vocabulary holds. Checked in
    the order a replay reads it: the tree, what was verified, the outcome, the counters, the trace."""
    tree = rec.get("tree")
    if not isinstance(tree, dict):
        raise ValueError("tree must be an object")
    n, parents, depths = _check_tree(tree, vocab)
    order = _check_verified(rec, n, parents, depths)
    _check_outcome(rec, order, parents, vocab)
    _check_counters(rec)
    _check_trace(rec, n, vocab)


def _check_tree(tree: dict, vocab: int) -> tuple[int, list[int], list[int]]:
    """The tree's per-node lists (one entry per node, each of its type), notes and draws.
    Returns (nodes, parents, depths)."""
    tokens = _ints(tree.get("tokens"), "tree.tokens", hi=vocab, most=MAX_NODES)
    n = len(tokens)
    if n == 0:
        raise ValueError("the tree has no root")
    parents = _ints(tree.get("parents"), "tree.parents", lo=-1, hi=MAX_NODES, most=MAX_NODES)
    depths = _ints(tree.get("depths"), "tree.depths", hi=MAX_NODES, most=MAX_NODES)
    if len(depths) != n:
        raise ValueError("tree.depths must give one depth per node")
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
    _node_domains(tree, parents, depths)
    _check_sampled(tree.get("sampled") or {}, n, vocab)
    sources = tree.get("sources") or {}
    known = {s.value for s in Source}
    if not isinstance(sources, dict) or any(
        not (isinstance(k, str) and k.isdigit() and 0 < int(k) < n) or v not in known for k, v in sources.items()
    ):
        raise ValueError(f"tree.sources must map drafted node ids to one of {', '.join(sorted(known))}")
    return n, parents, depths


def _check_verified(rec: dict, n: int, parents: list[int], depths: list[int]) -> list[int]:
    """What the target read: the node order (root first), its ancestor mask and the position ids
    (root position + depth). Returns the order."""
    order = _ints(rec.get("order"), "order", hi=n - 1, most=n)
    if not order or order[0] != 0 or len(set(order)) != len(order):
        raise ValueError("order must list distinct nodes, root first")
    m = len(order)
    mask = rec.get("mask")
    if not (isinstance(mask, list) and len(mask) == m and all(isinstance(r, str) and len(r) == m for r in mask)):
        raise ValueError("mask must hold one string of '0'/'1' per verified node, as long as the order")
    if any(set(r) - {"0", "1"} for r in mask):
        raise ValueError("mask rows may only hold '0' and '1'")
    _mask_matches_tree(mask, order, parents)
    positions = _ints(rec.get("position_ids"), "position_ids", hi=2**31, most=m)
    if len(positions) != m:
        raise ValueError("position_ids must give one position per verified node")
    for node, pos in zip(order, positions, strict=True):
        if pos - positions[0] != depths[node]:
            raise ValueError(f"node {node}: position {pos} is not the root's ({positions[0]}) plus its depth")
    return order


def _check_outcome(rec: dict, order: list[int], parents: list[int], vocab: int) -> None:
    """The accepted path (a chain of verified nodes down from the root), the committed tokens, the
    target's token at every verified node and the bonus token."""
    m = len(order)
    accepted = _ints(rec.get("accepted"), "accepted", hi=len(parents) - 1, most=m)
    if not set(accepted) <= set(order[1:]):
        raise ValueError("accepted nodes must be verified non-root nodes")
    for k, node in enumerate(accepted):
        if parents[node] != (accepted[k - 1] if k else 0):
            raise ValueError(f"node {node}: accepted, but its parent is not the root or the accepted node before it")
    _ints(rec.get("committed"), "committed", hi=vocab, most=m + 1)
    targets = _ints(rec.get("target_tokens"), "target_tokens", hi=vocab, most=m)
    if len(targets) != m:
        raise ValueError("target_tokens must give one token per verified node")
    if rec.get("bonus_token") is not None:
        _int(rec["bonus_token"], "bonus_token", hi=vocab)


def _check_counters(rec: dict) -> None:
    """The iteration's index, lengths, forward count, timings (never negative) and labels."""
    _int(rec.get("index"), "index", lo=1, hi=10**9)
    for name in ("prefix_len", "chain_len"):
        _int(rec.get(name), name, hi=2**31)
    _int(rec.get("draft_forwards"), "draft_forwards", hi=10**6)
    for name in ("draft_ms", "verify_ms", "commit_ms", "overhead_ms", "memory_mb"):
        if _num(rec.get(name), name) < 0:
            raise ValueError(f"{name} must not be negative")
    for name in ("draft_forward_ms", "capture_ms"):
        if name in rec and _num(rec[name], name) < 0:
            raise ValueError(f"{name} must not be negative")
    if "verify_rows" in rec:
        _int(rec["verify_rows"], "verify_rows", hi=2**31)
    for name in ("stop", "verifier", "forward_path"):
        if rec.get(name) is not None and not isinstance(rec[name], str):
            raise ValueError(f"{name} must be a string")


def _check_trace(rec: dict, n: int, vocab: int) -> None:
    """The verifier's steps and, for sampled runs, the per-node reach probabilities."""
    steps = rec.get("verification", [])
    if not isinstance(steps, list) or len(steps) > 4 * MAX_NODES:
        raise ValueError("verification must be a list of steps")
    for step in steps:
        _check_step(step, n, vocab)
    analysis = rec.get("analysis", {})
    if not isinstance(analysis, dict):
        raise ValueError("analysis must map nodes to objects")
    for key, info in analysis.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) < n and isinstance(info, dict) and "reach" in info):
            raise ValueError("analysis must map node ids to {reach, expected_acceptance}")
        for name, value in info.items():
            _probability(value, f"node {key}: analysis.{name}")


# the fields each kind of verification step carries (verify/otlp.py, traversal.py, greedy.py)
_STEP_FIELDS = {
    "test": {"token": "token?", "prob": "prob", "u": "prob", "accepted": "bool", "node": "node?", "child": "node?"},
    "residual": {"top": "top", "node": "node?", "weight": "prob"},
    "sample": {"token": "token", "source": "str", "node": "node?"},
    "argmax": {"token": "token", "node": "node?", "child": "node?"},
}
_REQUIRED = {"test": {"prob", "u", "accepted"}, "residual": {"top"}, "sample": {"token", "source"}, "argmax": {"token"}}


def _check_step(step, n: int, vocab: int = MAX_TOKEN_ID) -> None:
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
        elif expected == "prob":
            _probability(value, f"{kind}.{name}")
        elif expected == "bool" and not isinstance(value, bool):
            raise ValueError(f"{kind}.{name} must be true or false")
        elif expected == "str" and not isinstance(value, str):
            raise ValueError(f"{kind}.{name} must be a string")
        elif expected == "token":
            _int(value, f"{kind}.{name}", hi=vocab)
        elif expected == "node":
            _int(value, f"{kind}.{name}", hi=n - 1)
        elif expected == "top":
            if not isinstance(value, list) or len(value) > 64:
                raise ValueError(f"{kind}.top must list at most 64 (token, probability) pairs")
            for pair in value:
                if not (isinstance(pair, list) and len(pair) == 2):
                    raise ValueError(f"{kind}.top must list (token, probability) pairs")
                _int(pair[0], f"{kind}.top token", hi=vocab)
                _probability(pair[1], f"{kind}.top probability")
