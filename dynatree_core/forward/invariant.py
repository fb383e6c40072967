"""Width-invariant forwards: a row's result does not depend on the other rows of its forward.

Greedy tree decoding is exact only if the target's logits for a path node in the verify forward
equal, bit for bit, the logits `ar` computes for the same sequence one token at a time. Two
things make a row's result depend on its neighbours (docs/engine.md, "Width invariance"):

1. kernels chosen by the row count: a one-row GEMV against a many-row GEMM (float32 `F.linear`
   on this CPU without oneDNN packing; cuBLAS float32), attention kernels that block the queries;
2. the key layout: a tree node's ancestors sit at scattered slots with masked slots between
   them, and blocked attention reductions (online softmax over key tiles, vector lanes) group
   the same terms differently than for the same keys at consecutive slots.

`sequence_attention` removes both for attention. Each row attends over exactly its visible keys,
gathered in sequence order (the prefix, then its ancestors by depth: ascending slots, since the
engine sends parents before children), with no mask. Rows with the same number of keys share one
`bmm` whose batch items are (key head, row) pairs of fixed shape (query-head group x keys), so a
row's scores, float32 softmax and weighted sum of values are the same operations whether it is
alone (`ar`) or one of many (a tree): only the batch count changes. Where a library picks its
kernel by the batch count too (a batched GEMM may choose its tiles, or split the reduction over
keys, by how many items it has), every call runs a fixed number of rows (`attention_rows`, the
last call padded by repeating its last row), so the call's shape depends on the key count
alone, which is the same for a row alone and in a tree.

Elementwise transcendental ops are row-wise too, but a vectorised kernel computes the last few
elements of a tensor on a scalar path with other rounding, so cos/sin of a position could change
with the number of rows: `RopeTable` computes them once per position, in fixed chunks, and a
forward looks them up.

Linears are row-wise by nature, but a library may still pick its kernel by the row count.
`width_verdict` checks the model's own linears, its norm and this attention at the widths a run
uses, and finds the fewest rows from which each linear agrees with its widest call: the forward
pads that linear's input to that many rows (`min_rows`; a one-row GEMV then runs as the GEMM).
Where no padding helps (a row's bits change with every row count: cuBLAS's float32 GEMM at some
shapes), that linear's calls run exactly LINEAR_CALL_ROWS rows, wider inputs in chunks of that
many: one shape, one kernel, and a deterministic GEMM's row does not read the other rows. Each
linear gets its own rule (`LinearRows`): a padded call costs (bfloat16 `ar` 1.14x with every linear
padded to 2 rows on a Zen host, where only the down projection needs it).
The same probe runs the attention at short and long key counts and pads its calls to
`attention_rows` where the batch count changes a row's bits. Where the run's forwards replay CUDA
graphs, the probe's calls do too (`captured`: a library may pick other kernels under stream
capture). A run on a device where something stays variant says so in its forward path (never
silently different).

Contract: knows tensors, cache slots and the lean forward's linears; never trees or policies.
"""

from __future__ import annotations

import dataclasses

import torch

from dynatree_core.core.settings import env
from dynatree_core.core.transfer import to_device
from dynatree_core.forward import capture

PROBE_WIDTHS = (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 32, 33, 64)  # row counts a run's forwards take
PROBE_KEYS = (96, 200, 500, 1100, 2600)  # key counts the attention probe sees: a GEMM may split long reductions
ATTENTION_ROWS = 16  # rows per attention call where the batch count must not change (WidthVerdict)
LINEAR_CALL_ROWS = 16  # rows per linear call where no padding makes a linear invariant (min_rows(-16))


@dataclasses.dataclass(frozen=True)
class LinearRows:
    """How each linear of a width-invariant forward is called (`min_rows`): with at least this many
    rows (1: as it comes; more: padded up), or, negative, always exactly -rows rows. One entry per
    linear of a block (q/k/v and gate/up one each, fused or not) and the head."""

    qkv: int = 1
    o: int = 1
    gate_up: int = 1
    down: int = 1
    head: int = 1

    @classmethod
    def every(cls, rows: int) -> LinearRows:
        return cls(rows, rows, rows, rows, rows)


@dataclasses.dataclass(frozen=True)
class RowGroups:
    """The rows of one forward grouped by how many keys they see.

    groups: per distinct key count n, (rows (r,), slots (r, n)) on the model's device: the rows
    and, per row, its visible cache slots in ascending (= sequence) order."""

    groups: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    positions_end: int = 0  # one past the largest position of the forward (sizes the RoPE table)
    linear_rows: LinearRows = LinearRows()  # how each linear is called (WidthVerdict)
    attention_rows: int = 1  # >1: every attention call runs exactly this many rows (WidthVerdict)
    real: tuple[int, ...] = ()  # per group: its real rows (the rest repeat its last row); () = all real

    @classmethod
    def of(
        cls,
        visible: torch.Tensor,
        device: torch.device,
        positions_end: int = 0,
        linear_rows: LinearRows = LinearRows(),
        attention_rows: int = 1,
    ) -> RowGroups:
        """visible (q, L) bool (host): row i may attend to slot j. One upload for every group.
        With attention_rows > 1 a group holds exactly that many rows: larger sets of rows with the
        same key count are split, the last part padded by repeating its last row."""
        counts = visible.sum(1)
        parts, shapes, real = [], [], []
        for n in sorted(set(counts.tolist())):
            rows = (counts == n).nonzero().flatten()
            step = attention_rows if attention_rows > 1 else len(rows)
            for start in range(0, len(rows), step):
                part = rows[start : start + step]
                real.append(len(part))
                if len(part) < step:
                    part = torch.cat([part, part[-1:].expand(step - len(part))])
                slots = visible[part].nonzero()[:, 1]  # row-major: each row's slots ascending
                parts += [part, slots]
                shapes.append((len(part), n))
        flat = to_device(torch.cat(parts), device)
        groups, at = [], 0
        for r, n in shapes:
            groups.append((flat[at : at + r], flat[at + r : at + r + r * n].view(r, n)))
            at += r + r * n
        return cls(tuple(groups), positions_end, linear_rows, attention_rows, tuple(real) if attention_rows > 1 else ())

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        return sequence_attention(q, keys, values, self, scale)


def sequence_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rows: RowGroups, scale: float
) -> torch.Tensor:
    """Attention of each row over its own keys in sequence order (module docstring).

    Args:
        q: (1, heads, T, d) rotated queries.
        keys, values: (1, kv_heads, S, d) the cache buffers (slots 0..S).
        rows: every one of the T rows in exactly one group.
        scale: the scores' factor (1/sqrt(d) for Llama).
    Returns:
        (1, heads, T, d), head j * groups + i reading key head j (transformers' repeat_kv).
    """
    _, heads, width, d = q.shape
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    per_kv = q[0].view(kv_heads, groups, width, d)
    out = torch.empty_like(per_kv)
    for g, (index, slots) in enumerate(rows.groups):
        r, n = slots.shape
        # batch items ordered (key head, row): the gathers need no transpose; float32 throughout
        # (as SDPA accumulates; bfloat16 bmm is slow on CPUs without AMX)
        qs = per_kv.index_select(2, index).transpose(1, 2).reshape(kv_heads * r, groups, d).float()
        ks = keys[0].index_select(1, slots.flatten()).view(kv_heads * r, n, d).float()
        vs = values[0].index_select(1, slots.flatten()).view(kv_heads * r, n, d).float()
        scores = torch.bmm(qs, ks.transpose(1, 2)).mul_(scale)  # (items, groups, n)
        mixed = torch.bmm(torch.softmax(scores, dim=-1), vs).view(kv_heads, r, groups, d)
        keep = rows.real[g] if rows.real else r  # padding rows (repeats of the last) are dropped
        out.index_copy_(2, index[:keep], mixed[:, :keep].transpose(1, 2).to(out.dtype))
    return out.view(1, heads, width, d)


def invariant_wanted(model: torch.nn.Module, choice: bool | None = None) -> bool:
    """Whether the target's forwards run width-invariant: an explicit choice wins, then
    DYNATREE_INVARIANT=0/1; else on for reduced precision (bfloat16, float16), where rows that
    share a forward differ by ~1e-2 and flip near-tied tokens, and off for float32, where they
    differ by ~1e-7 and the shared kernels are faster (BENCHMARKS.md, "Width invariance")."""
    if choice is not None:
        return choice
    override = env("DYNATREE_INVARIANT")
    if override in ("0", "1"):
        return override == "1"
    return model.dtype in (torch.bfloat16, torch.float16)


ROPE_CHUNK = 4096  # positions per table chunk: a multiple of any vector width, so no scalar tail


class RopeTable:
    """cos/sin of every position up to the largest seen, computed by the model's own rotary
    embedding in chunks of ROPE_CHUNK positions (each chunk alone: a position's value never
    depends on how long the table is), looked up by position."""

    def __init__(self, rotary: torch.nn.Module):
        self.rotary = rotary
        self.tables: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # (dtype, device) -> chunks
        self.joined: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # the chunks concatenated

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x (1, q, hidden) for dtype and device; positions (1, q), all below `end` -> cos, sin (1, q, head_dim)."""
        key = (x.dtype, x.device)
        chunks = self.tables.setdefault(key, [])  # [(cos, sin) (ROPE_CHUNK, head_dim) each]
        if end > len(chunks) * ROPE_CHUNK:
            for start in range(len(chunks) * ROPE_CHUNK, end, ROPE_CHUNK):
                cos, sin = self.rotary(x[:, :1], torch.arange(start, start + ROPE_CHUNK, device=x.device)[None])
                chunks.append((cos[0], sin[0]))
            self.joined[key] = torch.cat([c for c, _ in chunks]), torch.cat([s for _, s in chunks])
        cos, sin = self.joined[key]
        return cos[positions], sin[positions]


def min_rows(fn, x: torch.Tensor, rows: int) -> torch.Tensor:
    """fn(x) computed with x padded to at least `rows` rows (dim -2) and cut back: where a library
    runs a one-row product as a GEMV and more rows as a GEMM, padding keeps every call a GEMM.
    rows < 0: every call exactly -rows rows, a wider x in chunks of that many (the last padded)."""
    n, size = x.shape[-2], abs(rows)
    if rows < 0 and n > size:
        return torch.cat([min_rows(fn, x[..., i : i + size, :], rows) for i in range(0, n, size)], dim=-2)
    if n >= size:
        return fn(x)
    pad = x.new_zeros(*x.shape[:-2], size - n, x.shape[-1])
    return fn(torch.cat([x, pad], dim=-2))[..., :n, :]


def linears_note(rows: LinearRows) -> str:
    """How a verdict's `linear_rows` shapes the linears' calls, for reports; "" when it does not."""
    form = lambda r: f"in calls of {-r} rows" if r < 0 else f"padded to {r} rows"  # noqa: E731
    values = dataclasses.astuple(rows)
    if len(set(values)) == 1:
        return f"linears {form(values[0])}" if values[0] != 1 else ""
    names = [f.name.replace("_", "/").replace("qkv", "q/k/v") for f in dataclasses.fields(rows)]
    return ", ".join(f"{name} {form(r)}" for name, r in zip(names, values, strict=True) if r != 1)


def _agrees_at(fn, x: torch.Tensor, full: torch.Tensor, w: int) -> bool:
    """fn over x's rows in calls of w rows (tiled from the top; every row alone for w = 1) gives
    each row the bits of `full`. Every row, not only the first: whether a one-row kernel (a GEMV)
    rounds a row as the GEMM does can depend on the row's values (oneDNN's bfloat16 down projection
    on a Zen host: 3 of 65 random rows differ alone, the first does not)."""
    return all(torch.equal(fn(x[i : i + w]), full[i : i + w]) for i in range(0, x.shape[-2] - w + 1, w))


def _fewest_rows(fn, x: torch.Tensor) -> int | None:
    """The fewest rows from which fn gives each row the bits of the widest call (x's rows), with
    narrower calls padded up to it; 1 when every width agrees, None when no padding helps."""
    full = fn(x)
    differ = [w for w in PROBE_WIDTHS if not _agrees_at(fn, x, full, w)]
    if not differ:
        return 1
    rows = next((w for w in PROBE_WIDTHS if w > max(differ)), None)
    if rows is None:
        return None
    padded = lambda t: min_rows(fn, t, rows)  # noqa: E731
    return rows if all(_agrees_at(padded, x, full, w) for w in PROBE_WIDTHS if w < rows) else None


def _agrees_in_calls(fn, x: torch.Tensor, rows: int = LINEAR_CALL_ROWS) -> bool:
    """Whether fn, every call exactly `rows` rows (min_rows(-rows)), gives each row of x the same
    bits at every probed width: the form left where no padding helps."""
    full = min_rows(fn, x, -rows)
    return all(torch.equal(min_rows(fn, x[:w], -rows), full[:w]) for w in PROBE_WIDTHS)


def _attention_agrees(kv_heads: int, groups: int, d: int, dtype, device, gen, attention_rows: int = 1) -> bool:
    """sequence_attention, its calls of `attention_rows` rows, gives rows 0 and 7 the same bits
    alone and among 33 rows, all of one key count (one call of 33 rows: a wide tree level) or of
    several (the bmm batch count and the grouping change, nothing else), at every key count in
    PROBE_KEYS."""
    for n in PROBE_KEYS:
        size = n + 40
        keys, values = (torch.randn(1, kv_heads, size, d, generator=gen).to(device=device, dtype=dtype) for _ in "kv")
        q = torch.randn(1, kv_heads * groups, 33, d, generator=gen).to(device=device, dtype=dtype)
        mixed = torch.zeros(33, size, dtype=torch.bool)
        for i in range(33):  # rows 0, 8, 12, 20, 24, 32 see the same keys; row 7 shares with 19 and 31
            mixed[i, : n - 40 + i % 4] = True
            mixed[i, n - 30 : size : 3] = i % 3 == 1  # scattered "ancestors"
        same = torch.zeros(33, size, dtype=torch.bool)
        same[:, :n] = True
        for visible in (same, mixed):

            def attend(which: list[int], q=q, keys=keys, values=values, visible=visible) -> torch.Tensor:
                rows = RowGroups.of(visible[which], device, attention_rows=attention_rows)
                return sequence_attention(q[:, :, which], keys, values, rows, 0.125)

            many = attend(list(range(33)))
            if not all(torch.equal(many[:, :, i], attend([i])[:, :, 0]) for i in (0, 7)):
                return False
    return True


# the probe's linears (width_verdict) -> the LinearRows entry whose calls they make
_FIELDS = {"q/k/v": "qkv", "q": "qkv", "k": "qkv", "v": "qkv", "o": "o", "gate/up": "gate_up", "gate": "gate_up",
           "up": "gate_up", "down": "down", "head": "head"}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class WidthVerdict:
    """What width_verdict found: `reason` None when every row's bits are width-invariant (with the
    linears' inputs padded to `linear_rows` rows where the library needs it), else which op is not."""

    reason: str | None
    linear_rows: LinearRows = LinearRows()  # per linear: its fewest rows, or < 0: calls of exactly -rows
    attention_rows: int = 1  # >1: attention calls padded to this many rows (the batch count mattered)


@torch.inference_mode()
def width_verdict(
    lean, dtype: torch.dtype, device: torch.device, *, attention: bool = True, captured: bool = False
) -> WidthVerdict:
    """Probe every operation of the lean forward whose result could depend on the number of rows:
    each linear of one layer (o and down also with their residual add, where it rides in the
    GEMM) and the head (the fewest rows from which they are invariant: float32 on this CPU without
    oneDNN packing needs 16, a one-row cuBLAS GEMV differs from its GEMM), the RMSNorm and
    sequence_attention, at the widths in PROBE_WIDTHS (the attention also at the key counts in
    PROBE_KEYS, in calls of ATTENTION_ROWS rows where the batch count matters; not with
    `attention=False`, for runs whose attention is StaticRows', probed by static_attention_agrees).
    `captured`: each call replayed from a graph, as the run's forwards are. Cached per (dtype,
    device, attention, captured) on `lean`: a few dozen calls on the model's own weights, once."""
    cache, key = lean.__dict__.setdefault("_width_verdicts", {}), (dtype, str(device), attention, captured)
    if key in cache:
        return cache[key]
    block = lean.blocks[0]
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    x, mlp_in = rand(65, lean.embed.weight.shape[1]), rand(65, block.mlp_size)
    linears = {"o": (block.o, rand(65, block.heads * block.head_dim)), "down": (block.down, mlp_in)}
    linears |= {"head": (lean.head, x[:34])}
    fused = {"q/k/v": block.qkv, "gate/up": block.gate_up}
    linears |= {name: (fn, x) for name, fn in fused.items() if fn is not None}
    if block.qkv is None:
        linears |= {name: (getattr(block, name), x) for name in ("q", "k", "v", "gate", "up")}
    for name in ("o", "down"):  # the residual add inside the GEMM (fastpath._residual), where taken
        fused, inp = getattr(block, f"add_{name}"), linears[name][1]
        if fused is not None:  # x and the linear's input side by side, so a call's rows slice both
            h = x.shape[-1]
            both = torch.cat([x[: inp.shape[-2]], inp], dim=-1)
            add = lambda t, fused=fused, h=h: fused(t[..., :h].clone(), t[..., h:].contiguous())  # noqa: E731
            linears[f"x + {name}"] = (add, both)
    changes = "a row's bits change with the row count"
    rows, reason = dict.fromkeys(_FIELDS.values(), 1), None
    as_run = (lambda fn: capture.replayed(fn, device)) if captured else (lambda fn: fn)  # noqa: E731
    for name, (fn, inp) in linears.items():
        field = _FIELDS[name.removeprefix("x + ")]
        if rows[field] < 0:
            continue
        fewest = _fewest_rows(as_run(fn), inp)
        if fewest is None:  # no padding helps: this linear in calls of one shape, if that does
            rows[field] = -LINEAR_CALL_ROWS  # its residual then added apart (fastpath.residual)
            plain = {n: v for n, v in linears.items() if _FIELDS.get(n) == field}
            failed = next((n for n, (f, i) in plain.items() if not _agrees_in_calls(as_run(f), i)), None)
            if failed:
                reason = f"{failed}: {changes}, padded or not, in calls of {LINEAR_CALL_ROWS} rows or not"
                break
        else:  # the most any of its forms needs (padded, o and down take the plain linear: fastpath.residual)
            rows[field] = max(rows[field], fewest)
    if reason is None and _fewest_rows(as_run(block.norm1), x) != 1:
        reason = f"norm: {changes}"
    kv_heads = block.qk_heads - block.heads
    attention_rows = 1
    if reason is None and attention:
        shape = (kv_heads, block.groups, block.head_dim, dtype, device)
        if not _attention_agrees(*shape, gen):  # the batch count matters: every call at a fixed count
            attention_rows = ATTENTION_ROWS
            if not _attention_agrees(*shape, gen, attention_rows):
                reason = f"attention: {changes}, in calls of fixed size or not"
    cache[key] = WidthVerdict(reason, LinearRows(**rows), attention_rows)
    return cache[key]
