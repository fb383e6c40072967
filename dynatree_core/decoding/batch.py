"""What the iteration's ONE target forward reads, built two ways.

On the host (`VerifyBatch.of`): from the tree the policy returned, its nodes in `DecodeConfig.order`
with their ancestor mask and positions (sampled trees, dyspec, salf). From the
tree (`EarlyVerify`): where a policy drafts a greedy tree as tensors (drafting/tensor_tree.py),
on every device, the tree's rows, mask and positions are built where the tree is
(`TensorTree.rows`) and the verify forward is queued BEFORE the host reads the tree: on a GPU the
host makes the tree's view while the target runs, and the iteration's only draining read is the
verification's; the batch's record is made from the rows (`EarlyVerify.batch`). The rows are
the nodes in the bfs order, padded to a bound the host knows without reading (a padding row sees
only itself and nothing sees it); the view is made from the same read, and names the node of
each row, so the tree shown and the rows verified are one tree.
SGLang's EAGLE worker builds its verify input on the GPU the same way (docs/gpu.md).
"""

from __future__ import annotations

import dataclasses

import torch

from dynatree_core.core.taps import FINAL
from dynatree_core.core.transfer import to_device, upload_into
from dynatree_core.core.tree import DraftTree
from dynatree_core.forward.reference import Forward
from dynatree_core.forward.rows import Rows, lineage


@dataclasses.dataclass(frozen=True)
class VerifyBatch:
    """What the iteration's ONE target forward reads: the pending committed tokens (`chain`, the
    root last) then the tree's nodes in `order` (root excluded: it is the chain's last token)."""

    order: list[int]
    # (n, d) long over `order`, root first: each row's lineage (forward/rows.lineage; the record's mask)
    lines: torch.Tensor
    past: int  # tokens in the target's cache before this forward
    chain: list[int]
    root_pos: int
    tokens: list[int]  # q = len(chain) + n - 1
    positions: list[int]

    @classmethod
    def of(cls, tree: DraftTree, state, *, past: int | None = None) -> VerifyBatch:
        """`state`: the run's DecodeState; `past` the cache's length before the forward, where it
        ran already (queued from the device)."""
        order = tree.order(state.config.order)
        lines = lineage(tree.parent_rows(order))
        past = state.target_kv.length if past is None else past
        chain, root = state.target_kv.pending, len(state.committed) - 1
        tokens = chain + [tree.tokens[n] for n in order[1:]]
        positions = list(range(past, past + len(chain))) + tree.position_ids(order[1:], root)
        return cls(order, lines, past, chain, root, tokens, positions)

    def rows(self, keep: int, **fields) -> Rows:
        """The batch's rows (rows.Rows.batch): the chain causal after the cache, the tree's nodes
        seeing the cache, the chain and their ancestors (the root's row is the chain's last)."""
        n = len(self.chain)
        return Rows.tree(
            self.past, self.chain, self.past, self.tokens[n:], self.positions[n:], self.lines, keep=keep, **fields
        )


def verify_forward(state, rows: Rows) -> Forward:
    """The target's forward over a batch's rows; a feature draft gets the hidden states (or taps)
    it reads from the same forward."""
    drafter = state.drafter
    features = drafter is not None and drafter.wants_features
    hidden = (drafter.taps if drafter.taps != (FINAL,) else True) if features else False
    return state.target_kv.run(dataclasses.replace(rows, hidden=hidden))


def host_verify(state, batch: VerifyBatch, seed: int = 0) -> Forward:
    """The ONE target forward over a batch built on the host, as one captured step with its
    inputs where the run captures its steps (forward/filled.py; not for a feature draft's taps other
    than the final states): the chain, and a tree's rows padded to the width they run at, in one
    upload (KVState.uploaded: one graph a width and chain, whatever the tree's size within it;
    `ar`'s loop launches an upload and a replay a token). `seed`: the logits of that many chain
    rows before the root are kept too, first (a policy that reads the target's rows from the prefill)."""
    drafter, kv, keep = state.drafter, state.target_kv, len(batch.order)
    features = drafter is not None and drafter.wants_features
    if kv.filled and not seed and not (features and drafter.taps != (FINAL,)):
        n = len(batch.chain)
        tree = (batch.tokens[n:], batch.positions[n:], batch.lines) if keep > 1 else None
        done = kv.uploaded(("verify",), batch.chain, batch.past, keep, tree)
        if done is not None:
            out = done[0]
            return Forward(out.logits, out.states if features else None)
    return verify_forward(state, batch.rows(keep + seed))


def early_wanted(state) -> bool:
    """Where the verify forward is queued from the tree rows built from the levels: greedy
    verification of a tree drafted as tensor levels (on every device: with the levels' counts read
    at once too, as on a CPU), sent in bfs order (the rows' order), through a forward that builds
    its inputs from a mask on the device (not the width-invariant forward at free shapes, which
    groups its rows by key count on the host: forward/invariant.RowGroups)."""
    drafter, kv = state.drafter, state.target_kv
    return (
        state.device_verify
        and state.verifier == "greedy"
        and state.config.order == "bfs"
        and drafter is not None
        and drafter.ready
        and not (kv.invariant and kv.padded is None)
        and not state.policy.joins()  # a joined tree's rows are known after the policy returns
    )


class EarlyVerify:
    """The engine's side of `DraftRequest.early`: `launch` queues the target's forward over the
    tree's rows (drafting/tensor_tree.TreeRows) and marks the phases on the iteration's clock; the
    tree's view names the node of each row (`order`, set by drafting/device.viewed); after the
    policy returns its tree, `batch` gives the host record of the batch."""

    def __init__(self, state, clock):
        """`clock`: the iteration's (clock.IterationClock): it marks draft, rows and verify."""
        self.state, self.clock = state, clock
        self.out: Forward | None = None
        self.order: list[int] = []  # the tree view's node of each verified row, the root's first
        self.rows = None  # the tensor_tree.TreeRows verified
        # the cache's length before the forward, the chain, the root's position
        self.past, self.chain, self.root = 0, [], 0

    def launch(self, rows, *, depth: int) -> None:
        """Queue the forward over the chain then `rows` (`depth`: the levels drafted, so no row
        sits deeper), marking the clock's three phases as the host build does."""
        self.clock.mark("draft")
        kv, device = self.state.target_kv, rows.tokens.device
        past, chain, root = kv.length, kv.pending, len(self.state.committed) - 1
        self.past, self.chain, self.root, self.rows = past, list(chain), root, rows
        # no row sees more than the past, the chain and its ancestors (`depth` at most, itself included)
        most_keys = past + len(chain) + depth
        self.out = None
        if kv.filled:  # where the target's steps are captured: inputs and forward in one step
            self.out = self._captured(rows, past, chain, root, most_keys)
        if self.out is None:
            chain_ids, tree = to_device(torch.tensor(chain), device), (rows.tokens, root + rows.depths, rows.lines)
            batch = Rows.tree(past, chain_ids, past, *tree, keep=rows.tokens.shape[0] + 1, most_keys=most_keys)
            self.clock.mark("rows")
            self.out = verify_forward(self.state, batch)
        self.clock.mark("verify", len(chain) + rows.tokens.shape[0])

    def _captured(self, rows, past: int, chain: list[int], root: int, most_keys: int) -> Forward | None:
        """The verify forward and its inputs (ids, positions, slots, mask) as ONE captured step
        (KVState.level) where the target's steps are captured and its forward is at fixed shapes,
        width-invariant rows included (else None): the chain, the cache's length and the root's
        position go up in one upload into a buffer the step reads; the rows are the rows step's
        outputs, read where they are. The prefill (an empty cache: its width is the prompt's) and a
        feature draft's taps other than the final states: None."""
        state, kv = self.state, self.state.target_kv
        drafter = state.drafter
        if kv.length == 0 or not kv.fills(len(chain) + rows.tokens.shape[0]):  # the prefill runs eagerly (filled.py)
            return None
        if drafter.wants_features and drafter.taps != (FINAL,):
            return None
        n, w = len(chain), rows.tokens.shape[0]
        host = kv.steps.buffer(("verify inputs", n), lambda: torch.zeros(n + 2, dtype=torch.long, device=kv.device))
        upload_into(host, torch.tensor([past, root, *chain]))
        self.clock.mark("rows")
        inputs = (host, rows.tokens, rows.depths, rows.lines)
        out, _ = kv.level(("verify", n, w), _verify_fill, inputs, n + w, embeds=False, most_keys=most_keys, keep=w + 1)
        return Forward(out.logits, out.states if drafter.wants_features else None)

    def batch(self, tree: DraftTree) -> VerifyBatch:
        """The host's record of what was verified: the rows' nodes in the tree's view, in the rows'
        order, and their ancestor rows as the device built them."""
        order = self.order
        n, nodes = len(order) - 1, order[1:]
        tokens = self.chain + [tree.tokens[v] for v in nodes]
        positions = list(range(self.past, self.past + len(self.chain))) + tree.position_ids(nodes, self.root)
        lines = self.rows.lines[: n + 1]
        return VerifyBatch(order, lines, self.past, self.chain, self.root, tokens, positions)


def _verify_fill(width: int, span: int):
    """The verify forward's inputs at a fixed width and span (KVState.level) from the uploaded
    [past, root, *chain] and the tree's rows (rows.Rows.tree): the chain (causal) then the rows,
    which see the past, the chain and their lineage (TreeRows.lines, the root's row, the chain's
    last, first); padding sees itself."""

    def fill(host, tokens, depths, lines):
        past, root, chain = host[0], host[1], host[2:]
        return (Rows.tree(past, chain, past, tokens, root + depths, lines, width=width, span=span),)

    return fill
