"""Forwards whose inputs the device makes, captured with them as ONE step (KVState's part).

A captured forward (graphs.py) replays fixed shapes over fixed buffers, but its inputs (ids,
positions, the slots its keys go to, the mask) depend on the cache's length, a Python number that
changes every iteration, so built op by op they cost a dozen launches or more a forward around
the one replay. Here the length and the tokens go to the device in one upload into a buffer a
step reads in place, and a pure function makes every input from it there: that function and the
lean forward are one step (graphs.PaddedForward.filled) that forward/capture.py captures once per
key and replays. Every fill's rows come from the one builder, rows.Rows.batch. Two entries:

- `level`: the general form, the caller's function of device inputs (a draft level:
  drafts/session.py; the verify forward queued from the tree's rows on the device: decoding/batch.py);
- `uploaded`: rows the host knows, in one upload: a chain of pending tokens after the cache (the
  draft's root; the target's forward where a batch has no tree rows: every token of `ar` after
  the prefill), and a verify batch built on the host (the chain, then a tree's nodes with their
  lineages), padded to the width it runs at, so one graph serves every tree of that width.

A step may go on after its forward (`then`): a draft level's decision on its logits runs inside
the same step, so a level is one launch, its forward and its decision (drafting/device.py).

A fill hands the forward its rows (forward/rows.Rows), which slots each row sees a (width, span)
boolean built as every forward's is (rows.visibility); the step turns it into the additive mask,
or for width-invariant rows into each row's slots in sequence order (static_rows.StaticRows.build).
The prefill runs eagerly (its width is the prompt's).

Contract: knows a KVState's cache, padded forward and steps; never trees or policies.
"""

from __future__ import annotations

import torch

from dynatree_core.core.transfer import upload_into
from dynatree_core.forward.reference import Forward
from dynatree_core.forward.rows import Rows


class FilledForwards:
    """KVState's forwards with their inputs made on the device (module docstring); a mixin over
    KVState's `model`, `device`, `padded`, `steps`, `filled`, `length`, `watch` and `_done`."""

    def fills(self, q: int) -> bool:
        """Whether `level` runs a q-row forward as one captured step (its conditions below)."""
        return self.filled and self.padded.fits(q)

    def level(
        self,
        key: tuple,
        make_fill,
        inputs: tuple,
        q: int,
        *,
        embeds: bool,
        most_keys: int,
        keep: int | None = None,
        whole: bool = False,
        then: tuple | None = None,
    ):
        """One forward of q rows whose inputs a device function makes, that function and the
        forward captured as ONE step (graphs.PaddedForward.filled; a draft level: drafts/session.py,
        the verify forward: decoding/batch.py): `make_fill(width, span)` gives the function of
        `inputs` (its Python values all in `key`, whose first item names the kind: "level" or
        "verify") that returns the rows (rows.Rows) and any extra outputs; `most_keys` bounds the
        keys a row sees (width-invariant rows span them). `whole`: the inputs come padded to the
        width (`uploaded`'s tree), so the step, keyed by the width, not q, returns every row and
        the real ones are cut after it. `then` = (key, fn, inputs): fn(the kept logits, *inputs) runs after the
        forward inside the step, its outputs after the fill's extra ones. Returns (Forward with the
        last `keep` rows' logits (default: all) and every row's states, the fill's extra outputs),
        or None where this run cannot (`fills`): the caller then uses `run`."""
        if not self.fills(q):
            return None
        dtype = self.model.dtype
        width, span, epoch = self.padded.plan(q, self.length, dtype, self.device, embeds, most_keys)
        # release steps over buffers that moved, and over spans the cache has outgrown (a forward's
        # span doubles as the cache grows; one iteration's forwards straddle two spans at most, so
        # a span a quarter of this one is never used again; were it, it would be captured again)
        self.steps.forget(lambda k: k[:1] == key[:1] and (k[-1] != epoch or 4 * k[-2] <= span))
        captured = self.steps.capture_s
        self.watch.start()
        keep = q if keep is None else keep
        cut = (width, width) if whole else (q, keep)  # the rows the step hands out
        step = self.padded.filled(make_fill(width, span), width, span, *cut, dtype)
        if then is not None:  # the work after the forward, in its step (what it reads besides tensors: its key)
            then_key, fn, then_inputs = then
            step, key, inputs = _followed(step, fn, len(inputs)), (*key, then_key), (*inputs, *then_inputs)
        logits, states, *extra = self.steps((*key, *cut, width, span, epoch), step, *inputs)
        if whole:
            logits, states = logits[q - keep : q], states[:q]
        self.padded.advance(self.length + q)
        return self._done(q, Forward(logits, states), True, (self.steps.capture_s - captured) * 1e3), extra

    def uploaded(
        self, key: tuple, chain: list[int], first: int, keep: int, tree: tuple | None = None, *,
        ids=None, embeds=None, extra=(), then=None,
    ):  # fmt: skip
        """A forward whose rows the host knows, as ONE captured step with its inputs (`level`): the
        cache's length, `first` and the `chain` of pending tokens (at positions from `first`,
        causal after the cache's entries) go up in one upload, with, for a verify batch built on the
        host, `tree` = (tokens, positions, lines): the tree's rows after the chain, `lines` (n + 1,
        d) each row's lineage over the tree's rows, the root's (the chain's last) first
        (rows.lineage). The tree's rows go up padded to the width the batch runs at, so one graph
        serves every tree of that width and chain. `ids(chain)` maps the chain to the model's ids,
        `embeds(chain, width, *extra)` gives its input vectors (a feature draft's root); both are
        captured with the step, so `key` must name them. Returns (the Forward: the last `keep`
        rows' logits, every row's states; what `then`, as `level`'s, returned), or None where the
        run cannot (`fills`), and for the prefill (an empty cache): the caller then uses `run`."""
        n, nodes = len(chain), len(tree[0]) if tree else 0
        q = n + nodes
        if self.length == 0 or not self.fills(q):
            return None
        values = [self.length, first, q, *chain]
        if tree:  # padded to the width: the rows after q are padding, each its own lineage
            tokens, positions, lines = tree
            width = self.padded.width_for(q, self.length, self.model.dtype, self.device, embeds is not None)
            m, pad = width - n, [0] * (width - q)  # the root's row, the chain's last, leads the lines
            every = lines.tolist() + [[r - n + 1] for r in range(q, width)]  # rows counted from the root's
            values += [*tokens, *pad, *positions, *pad] + [
                j for line in every for j in line + line[:1] * (width - len(line))
            ]
        host = self.steps.buffer(
            ("uploaded", key, n, len(values)), lambda: torch.zeros(len(values), dtype=torch.long, device=self.device)
        )
        upload_into(host, torch.tensor(values))

        def make_fill(width: int, span: int):
            def fill(host, *extra):
                length, first, real, chain = host[0], host[1], host[2], host[3 : 3 + n]
                vectors = embeds(chain, width, *extra) if embeds is not None else None
                chain_ids = ids(chain) if ids is not None else chain
                if not tree:
                    return (Rows.batch(length, chain_ids, first, width=width, span=span, embeds=vectors),)
                tokens, positions = host[3 + n : 3 + n + 2 * m].view(2, m)
                lines = host[3 + n + 2 * m :].view(m + 1, width)
                args = (length, chain_ids, first, tokens, positions, lines)
                return (Rows.tree(*args, width=width, span=span, real=real, embeds=vectors),)

            return fill

        # a row sees at most the cache, the chain and its own lineage: the keys at positions 0 .. its own
        most_keys = self.length + n if not tree else max(tree[1]) + 1
        out, after = self.level(
            (*key, n, "tree" if tree else "chain"), make_fill, (host, *extra), q, embeds=embeds is not None,
            most_keys=most_keys, keep=keep, whole=bool(tree), then=then,
        )  # fmt: skip
        return out, tuple(after)


def _followed(step, fn, n: int):
    """`step` over the first `n` inputs, then fn(its logits, *the rest) in the same step, its
    outputs last."""

    def both(*inputs):
        logits, states, *extra = step(*inputs[:n])
        return (logits, states, *extra, *fn(logits, *inputs[n:]))

    return both
