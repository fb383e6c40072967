"""Width-invariant attention at fixed shapes: the form a captured forward replays.

invariant.py's grouped form (RowGroups) puts rows with the same number of keys into one call, so
its shapes change every iteration and no CUDA graph can replay it. Here every row of a run
attends over the same number of gathered slots, the run's *span* (`static_span`: fixed when the
run starts, so `ar` and a tree policy with the same settings give every position the same span):
its visible slots in sequence order, then padding whose scores get -inf added (weight exactly 0).
Rows go in calls of ATTENTION_ROWS (padded), so every call has one shape whatever the forward's
width, and a row's bits never depend on which rows share its call. `static_attention_agrees`
probes that on a device, eagerly or replayed from graphs as the run's forwards are
(docs/engine.md, "Width invariance at fixed shapes").

Contract: knows tensors and cache slots; never trees or policies.
"""

from __future__ import annotations

import dataclasses

import torch

from dynatree_core.forward import capture, kernels
from dynatree_core.forward.invariant import ATTENTION_ROWS, LinearRows
from dynatree_core.forward.slots import side_by_side


@dataclasses.dataclass(frozen=True)
class StaticRows:
    """The rows of one forward at fixed shapes, the form a captured forward replays.

    Every row attends over `span` gathered slots, the run's span (the same for every forward of the
    run): its visible slots in sequence order, then padding that `tail` masks out (-inf added to
    those scores: they weigh exactly 0); rows go in calls of ATTENTION_ROWS (the forward's rows
    padded to a multiple, a padding row seeing slot 0). A row's operations then have one shape
    whatever the forward's width and whichever rows share its call, so `ar` and a tree give it the
    same bits without grouping rows by key count, which changes shape every iteration.

    slots: (R, span) long, tail: (R, span) float32, on the model's device."""

    slots: torch.Tensor
    tail: torch.Tensor
    positions_end: int = 0  # sizes the RoPE table (the run's span: every position is below it)
    linear_rows: LinearRows = LinearRows()

    @staticmethod
    def build(visible: torch.Tensor, span: int, *, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """visible (q, L) bool -> (slots, tail) on its device, R = q rounded up to ATTENTION_ROWS.
        Fixed shapes and no host read (without `check`), so a captured step builds them too
        (graphs.PaddedForward.filled). `check`: refuse a row that sees more than `span` keys (a
        read of the counts; a caller that knows a bound passes False rather than wait for it)."""
        q, length = visible.shape
        device = visible.device
        counts = visible.sum(1)
        if check and q and int(counts.max()) > span:
            raise ValueError(f"a row sees {int(counts.max())} keys, more than the span of {span}")
        rows = -(-max(q, 1) // ATTENTION_ROWS) * ATTENTION_ROWS
        # a visible slot's place in its row is the count of visible slots before it, so each row's
        # slots land in ascending (= sequence) order; the others go to a column cut off after (no
        # row sees more than `span` keys: checked, or the caller's bound)
        place = torch.where(visible, visible.cumsum(1) - 1, span)
        slots = torch.zeros(rows, span + 1, dtype=torch.long, device=device)
        slots[:q].scatter_(1, place, torch.arange(length, device=device).expand(q, length))
        tail = torch.full((rows, span), float("-inf"), device=device)
        tail[:q].masked_fill_(torch.arange(span, device=device)[None] < counts[:, None], 0.0)
        tail[q:, 0] = 0.0
        return slots[:, :span].contiguous(), tail

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        return static_sequence_attention(q, keys, values, self, scale)


def static_sequence_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rows: StaticRows, scale: float
) -> torch.Tensor:
    """sequence_attention at fixed shapes (StaticRows): q (1, heads, W, d), keys / values
    (1, kv_heads, S, d) holding every slot `rows.slots` names -> (1, heads, W, d), a view of
    (1, W, heads * d) rows (what the o projection reads, without a copy); a kernel a step, or on
    a device that takes Triton's kernels, two launches for the whole (kernels.static_attention)."""
    if kernels.enabled(q.device.type) and not q.requires_grad:
        return kernels.static_attention(q, keys[0], values[0], rows.slots, rows.tail, scale)
    _, heads, width, d = q.shape
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    count, span = rows.slots.shape
    per_kv, c = q[0].view(kv_heads, groups, width, d), ATTENTION_ROWS
    out = q.new_empty(count, kv_heads, groups, d)  # row-major: (1, W, heads * d) once cut to W
    qs = q.new_empty(kv_heads, c, groups, d, dtype=torch.float32)  # rows past W pad: dropped
    both = side_by_side(keys[0], values[0])  # side by side in the static cache's store (slots.py)
    for at in range(0, count, c):
        index, real = rows.slots[at : at + c].reshape(-1), min(c, width - at)
        qs[:, :real].copy_(per_kv[:, :, at : at + real].transpose(1, 2))  # layout and float32: one copy
        if both is not None:  # keys and values in one gather and one conversion
            kv = both.index_select(2, index).float()
            ks, vs = kv[0].view(kv_heads * c, span, d), kv[1].view(kv_heads * c, span, d)
        else:
            ks = keys[0].index_select(1, index).view(kv_heads * c, span, d).float()
            vs = values[0].index_select(1, index).view(kv_heads * c, span, d).float()
        scores = torch.bmm(qs.view(kv_heads * c, groups, d), ks.transpose(1, 2)).view(kv_heads, c, groups, span)
        # tail (0, or -inf: padding weighs 0) + scale * score in one kernel: round(scale * score) as before
        scores = torch.add(rows.tail[at : at + c, None], scores, alpha=scale)
        mixed = torch.bmm(torch.softmax(scores.view(kv_heads * c, groups, span), dim=-1), vs)
        out[at : at + c].copy_(mixed.view(kv_heads, c, groups, d).transpose(0, 1))
    return out[:width].view(1, width, heads, d).transpose(1, 2)


def static_span(capacity: int) -> int:
    """The span every row of a run attends over at fixed shapes: the next power of two (at least
    256) above the run's capacity, fixed when the run starts, so two runs of the same settings
    (`ar` and a tree policy) give each position the same span."""
    span = 256
    while span < capacity:
        span *= 2
    return span


def static_attention_agrees(lean, dtype: torch.dtype, device: torch.device, *, captured: bool = False) -> bool:
    """StaticRows attention gives rows 0 and 7 the same bits alone and among 33 rows (other
    padding, other rows in their call), at spans 256 and 1024; `captured`: each call replayed from
    a graph, as the run's forwards are (capture.replayed). Cached per (dtype, device, captured)."""
    cache = lean.__dict__.setdefault("_static_verdicts", {})
    key = (dtype, str(device), captured)
    if key not in cache:
        block, gen = lean.blocks[0], torch.Generator().manual_seed(1)
        kv_heads = block.qk_heads - block.heads
        ok = True
        for span in (256, 1024):
            keys, values = (torch.randn(1, kv_heads, span, block.head_dim, generator=gen) for _ in "kv")
            keys, values = keys.to(device=device, dtype=dtype), values.to(device=device, dtype=dtype)
            q = torch.randn(1, block.heads, 33, block.head_dim, generator=gen).to(device=device, dtype=dtype)
            visible = torch.rand(33, span, generator=gen) < 0.6
            visible[:, 0] = True

            def attend(which, q=q, keys=keys, values=values, visible=visible, span=span):
                rows = StaticRows(*(t.to(device) for t in StaticRows.build(visible[which], span)))
                fn = lambda part: static_sequence_attention(part, keys, values, rows, 0.125)  # noqa: E731
                return (capture.replayed(fn, device) if captured else fn)(q[:, :, which])

            many = attend(list(range(33)))
            ok = ok and all(torch.equal(many[:, :, i], attend([i])[:, :, 0]) for i in (0, 7))
        cache[key] = ok
    return cache[key]
