"""DraftTree: the token tree one drafting step proposes, with the reason behind every node.

Node 0 is the root: the last committed token (depth 0), not a draft. Every other node is a
drafted token with its parent, depth, draft log-probability and cumulative (path) log-probability.
Each node has a status:

  kept          verified by the target and expanded by the draft (an inner node)
  not_expanded  verified by the target, but its children were never drafted (a leaf); `reason`
                says why (depth limit, node budget, ...)
  pruned        proposed by the draft but not sent to the target; `reason` says why
                (probability threshold, node budget, ...)

Every node also has a source, where its token came from: the draft model (`model`, the default),
the target's own top-k of earlier forwards (`recycled`, drafting/recycle.py), or a suffix match in
the context or a corpus (`retrieved`, drafting/suffix.py). A joined tree (drafting/joined.py)
mixes them; records, exports and the trace's acceptance by source read it.

Kept and not_expanded nodes are the *verified* nodes. Ancestors of a verified node are always
verified, so the verified nodes form a tree rooted at node 0. This module knows nothing about
models or caches: it holds integers and floats and builds masks and orders from them.

Sampled drafting (temperature > 0) also leaves, at every node whose children were drawn, a
`SampledDraw`: the adjusted draft distribution q they were drawn from and the draws with
multiplicity in drawing order. They are the sampling verifiers' inputs (verify/sampling.py)
and part of the tree's export (exactly: q is rounded to float16 before anything is drawn from it),
so an imported run can be verified again (`verify.sampling.analyze` on the imported tree).
"""

from __future__ import annotations

import base64
import dataclasses
import math
import zlib
from enum import StrEnum

import numpy as np
import torch


class Status(StrEnum):
    KEPT = "kept"
    NOT_EXPANDED = "not_expanded"
    PRUNED = "pruned"


class Source(StrEnum):
    """Where a node's token came from (`DraftTree.source`)."""

    MODEL = "model"  # a draft model's distribution
    RECYCLED = "recycled"  # the target's top-k at an earlier forward (Token Recycling)
    RETRIEVED = "retrieved"  # the continuation of a suffix match (SAM-Decoding, prompt lookup)


# A policy's family: where its candidates come from (a Source), "joined" (a model tree joined by
# the others) or "none" (no draft at all: ar, HF generate)
FAMILIES = ("model", "recycled", "retrieved", "joined", "none")


class Reason(StrEnum):
    """Why a node was pruned or not expanded. Policies may add their own strings."""

    THRESHOLD = "threshold"  # cumulative draft probability below tau (DynaTree Eq. in §3.3)
    BUDGET = "budget"  # node budget N_max reached
    DEPTH_LIMIT = "depth_limit"  # reached the policy's maximum depth
    LENGTH_LIMIT = "length_limit"  # max_new_tokens or the context window leaves no room
    NO_FEATURES = "no_features"  # a feature draft before the target's first forward: nothing to read yet
    BRANCH_LIMIT = "branch_limit"  # not among the top-B children of its parent
    EARLY_STOP = "early_stop"  # cumulative probability below rho_stop (DynaTree depth gating)
    DEPTH_GATE = "depth_gate"  # beyond the base depth D0 without rho_deep (DynaTree depth gating)
    BEAM = "beam"  # not among the top-k of its level (EAGLE-2 beam search)
    RERANK = "rerank"  # outside the global top-N after drafting (EAGLE-2 rerank)
    SALF_STOP = "salf_stop"  # drafting stopped: the next batch's probability mass was below th
    NO_SUCCESSORS = "no_successors"  # a recycled token no forward has read yet (Token Recycling)
    NO_MATCH = "no_match"  # a retrieved draft: no earlier occurrence of the context's suffix is long enough
    CONTEXT_END = "context_end"  # a retrieved continuation reached the end of the context
    CORPUS_END = "corpus_end"  # a retrieved continuation reached the end of a corpus answer


@dataclasses.dataclass
class SampledDraw:
    """How one node's children were drawn: q, the adjusted draft distribution they were drawn
    from, and the drawn tokens with multiplicity, in drawing order.

    q is held as float16 weights w (`of` rounds the adjusted distribution once, before anything is
    drawn) and read as w / sum(w) in float64 (`dense()`): the distribution the draws come from and
    the verifier divides by is exactly what an export holds, at 2 bytes an entry before zlib. An
    imported draw keeps its compressed bytes (checked on import) until a verifier reads it, so a
    long imported run costs what its file holds. Files written before float16 weights carry q's
    nonzero entries as float32 (`ids`, `q`); they import sparse and export the same way."""

    weights: torch.Tensor | None  # (V,) float16 (or a legacy file's sparse float32); None while packed
    tokens: list[int] = dataclasses.field(default_factory=list)
    packed: bytes | None = dataclasses.field(default=None, repr=False)  # zlib'd little-endian float16
    size: int = 0

    def __post_init__(self) -> None:
        if self.weights is not None:
            self.size = int(self.weights.shape[-1])

    @classmethod
    def of(cls, q: torch.Tensor, tokens: list[int] | None = None) -> SampledDraw:
        """A draw from the adjusted distribution q (any float dtype), rounded to float16 first."""
        return cls(q.detach().to("cpu", torch.float16).reshape(-1), list(tokens or []))

    def dense(self) -> torch.Tensor:
        """q over the vocabulary, float64, summing to 1."""
        w = self.weights if self.weights is not None else _unpack(self.packed, self.size)
        w = (w.to_dense() if w.is_sparse else w).double()
        return w / w.sum()

    def to_dict(self) -> dict:
        out = {"tokens": [int(t) for t in self.tokens], "size": self.size}
        if self.weights is not None and self.weights.is_sparse:  # a legacy file's draw, written back as it came
            q = self.weights.coalesce()
            return out | {"ids": _b64(q.indices()[0].to(torch.int32)), "q": _b64(q.values().to(torch.float32))}
        if self.packed is None:
            raw = self.weights.numpy().astype("<f2").tobytes()
            self.packed = zlib.compress(raw, 6)
        return out | {"w16": base64.b64encode(self.packed).decode("ascii")}

    @classmethod
    def from_dict(cls, data: dict) -> SampledDraw:
        size, tokens = int(data["size"]), [int(t) for t in data["tokens"]]
        if "w16" in data:
            packed = base64.b64decode(data["w16"].encode("ascii"), validate=True)
            _unpack(packed, size)  # refused now, not when a verifier first reads it
            return cls(None, tokens, packed=packed, size=size)
        ids = _unb64(data["ids"], torch.int32).long()
        values = _unb64(data["q"], torch.float32)
        if ids.numel() != values.numel() or (ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= size)):
            raise ValueError("a sampled draw's q does not fit its vocabulary")
        _check_weights(values)
        return cls(torch.sparse_coo_tensor(ids[None], values, (size,), check_invariants=True).coalesce(), tokens)


def _unpack(packed: bytes, size: int) -> torch.Tensor:
    """zlib'd float16 weights -> (size,) tensor; at most 2 * size bytes are ever inflated."""
    inflate = zlib.decompressobj()
    try:
        raw = inflate.decompress(packed, 2 * size + 1)
    except zlib.error:
        raise ValueError("a sampled draw's q is not zlib-compressed float16") from None
    if len(raw) != 2 * size or inflate.unconsumed_tail or not inflate.eof:
        raise ValueError("a sampled draw's q does not fit its vocabulary")
    w = torch.from_numpy(np.frombuffer(raw, dtype="<f2").astype(np.float16))
    _check_weights(w)
    return w


def _check_weights(w: torch.Tensor) -> None:
    """Finite, nonnegative, not all zero: weights that normalise to a distribution."""
    if w.numel() == 0 or not bool(torch.isfinite(w).all() and (w >= 0).all() and w.float().sum() > 0):
        raise ValueError("a sampled draw's q is not a distribution")


_WIRE = {torch.int32: "<i4", torch.float32: "<f4"}  # little-endian on the wire, whatever the host


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().astype(_WIRE[t.dtype]).tobytes()).decode("ascii")


def _unb64(text: str, dtype: torch.dtype) -> torch.Tensor:
    raw = np.frombuffer(base64.b64decode(text.encode("ascii"), validate=True), dtype=_WIRE[dtype])
    return torch.from_numpy(raw.astype(raw.dtype.newbyteorder("=")))


@dataclasses.dataclass
class DraftTree:
    """A draft token tree. Node ids are insertion order; parents always precede children."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    parents: list[int] = dataclasses.field(default_factory=list)
    depths: list[int] = dataclasses.field(default_factory=list)
    logp: list[float] = dataclasses.field(default_factory=list)
    cum_logp: list[float] = dataclasses.field(default_factory=list)
    status: list[Status] = dataclasses.field(default_factory=list)
    reason: list[str | None] = dataclasses.field(default_factory=list)
    # Per-tree numbers a policy wants shown (e.g. SALF's probability mass per drafting step)
    notes: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    # Sampled drafting only: how each expanded node's children were drawn (exported with the tree)
    sampled: dict[int, SampledDraw] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    # Where each node's token came from, for the nodes that did not come from the draft model
    # (absent: Source.MODEL; the root is the context's last token and has none)
    sources: dict[int, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def with_root(cls, root_token: int) -> DraftTree:
        tree = cls()
        tree._append(root_token, -1, 0, 0.0, 0.0, Status.NOT_EXPANDED, Reason.DEPTH_LIMIT.value)
        return tree

    def _append(self, token, parent, depth, logp, cum, status, reason) -> int:
        self.tokens.append(int(token))
        self.parents.append(int(parent))
        self.depths.append(int(depth))
        self.logp.append(float(logp))
        self.cum_logp.append(float(cum))
        self.status.append(Status(status))
        self.reason.append(None if reason is None else str(getattr(reason, "value", reason)))
        return len(self.tokens) - 1

    def add(
        self,
        parent: int,
        token: int,
        logp: float,
        *,
        status: Status = Status.NOT_EXPANDED,
        reason: str | Reason | None = Reason.DEPTH_LIMIT,
        source: Source = Source.MODEL,
    ) -> int:
        """Add a child of `parent`. New verified nodes start as leaves until expanded; under a
        pruned node only a pruned one (a withdrawn subtree, as EAGLE-2's rerank leaves it)."""
        if self.status[parent] == Status.PRUNED and status != Status.PRUNED:
            raise ValueError(f"cannot add a verified child under pruned node {parent}")
        if status == Status.PRUNED and reason is None:
            raise ValueError("a pruned node needs a reason")
        node = self._append(token, parent, self.depths[parent] + 1, logp, self.cum_logp[parent] + logp, status, reason)
        if source != Source.MODEL:
            self.sources[node] = Source(source).value
        return node

    def mark_expanded(self, node: int) -> None:
        self.status[node] = Status.KEPT
        self.reason[node] = None

    def mark_leaf(self, node: int, reason: str | Reason) -> None:
        """A verified node whose children will not be drafted, and why."""
        self.status[node] = Status.NOT_EXPANDED
        self.reason[node] = str(getattr(reason, "value", reason))

    def prune(self, node: int, reason: str | Reason) -> None:
        """Withdraw a node (and any descendants) from verification."""
        for n in [node, *self.descendants(node)]:
            self.status[n] = Status.PRUNED
            self.reason[n] = str(getattr(reason, "value", reason))

    def record_draws(self, node: int, q: torch.Tensor, tokens: list[int] | None = None) -> SampledDraw:
        """Sampled drafting: `node`'s children will be drawn from q as recorded (rounded to
        float16: draw from the returned draw's `dense()`); `tokens`: the draws so far."""
        self.sampled[node] = SampledDraw.of(q, tokens)
        return self.sampled[node]

    def draws(self, node: int) -> list[int]:
        """The tokens drawn at `node`, with multiplicity in drawing order ([] when none were)."""
        draw = self.sampled.get(node)
        return draw.tokens if draw is not None else []

    # ----- queries -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.tokens)

    def source(self, node: int) -> str:
        """Where `node`'s token came from (a `Source` value)."""
        return self.sources.get(node, Source.MODEL.value)

    def is_verified(self, node: int) -> bool:
        return self.status[node] != Status.PRUNED

    def child_map(self, *, verified_only: bool = True) -> dict[int, list[int]]:
        """Children of every node in one pass, most probable first."""
        kids: dict[int, list[int]] = {}
        for i in range(1, len(self)):
            if not verified_only or self.is_verified(i):
                kids.setdefault(self.parents[i], []).append(i)
        for lst in kids.values():
            lst.sort(key=lambda i: (-self.cum_logp[i], i))
        return kids

    def descendants(self, node: int) -> list[int]:
        kids = self.child_map(verified_only=False)
        out, stack = [], [node]
        while stack:
            below = kids.get(stack.pop(), [])
            out.extend(below)
            stack.extend(below)
        return out

    def path(self, node: int) -> list[int]:
        """Node ids from the root to `node`, both included."""
        out = [node]
        while self.parents[out[-1]] >= 0:
            out.append(self.parents[out[-1]])
        return out[::-1]

    # ----- orders, masks, positions ---------------------------------------------------------
    def order(self, kind: str = "bfs") -> list[int]:
        """Verified node ids, root first, parents before children.

        bfs: by depth, then by cumulative probability (most probable first).
        dfs: pre-order, children visited most probable first.
        """
        verified = [i for i in range(len(self)) if self.is_verified(i)]
        if kind == "bfs":
            return sorted(verified, key=lambda i: (self.depths[i], -self.cum_logp[i], i))
        if kind == "dfs":
            kids = self.child_map()
            out, stack = [], [0]
            while stack:
                node = stack.pop()
                out.append(node)
                stack.extend(reversed(kids.get(node, [])))
            return out
        raise ValueError(f"unknown order {kind!r} (bfs or dfs)")

    def parent_rows(self, order: list[int]) -> list[int]:
        """Each node's parent's index in `order` (root first; the root its own): what a forward's
        rows name their ancestors by (forward/rows.lineage)."""
        index = {node: i for i, node in enumerate(order)}
        return [index[self.parents[node]] if i else 0 for i, node in enumerate(order)]

    def position_ids(self, order: list[int], root_position: int) -> list[int]:
        """RoPE/absolute positions: the root's position plus the node's depth."""
        return [root_position + self.depths[n] for n in order]

    # ----- serialisation ----------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "tokens": self.tokens,
            "parents": self.parents,
            "depths": self.depths,
            "logp": [_finite(x) for x in self.logp],
            "cum_logp": [_finite(x) for x in self.cum_logp],
            "status": [s.value for s in self.status],
            "reason": self.reason,
            "notes": self.notes,
            **({"sampled": {str(n): d.to_dict() for n, d in self.sampled.items()}} if self.sampled else {}),
            **({"sources": {str(n): s for n, s in self.sources.items()}} if self.sources else {}),
        }

    @classmethod
    def from_dict(cls, data: dict) -> DraftTree:
        n = len(data["tokens"])
        fields = ("parents", "depths", "logp", "cum_logp", "status", "reason")
        if any(len(data[f]) != n for f in fields):
            raise ValueError("tree fields have different lengths")
        tree = cls(
            tokens=[int(t) for t in data["tokens"]],
            parents=[int(p) for p in data["parents"]],
            depths=[int(d) for d in data["depths"]],
            logp=[float(x) if x is not None else -math.inf for x in data["logp"]],
            cum_logp=[float(x) if x is not None else -math.inf for x in data["cum_logp"]],
            status=[Status(s) for s in data["status"]],
            reason=[None if r is None else str(r) for r in data["reason"]],
            notes={str(k): [float(x) for x in v] for k, v in (data.get("notes") or {}).items()},
            sampled={int(k): SampledDraw.from_dict(v) for k, v in (data.get("sampled") or {}).items()},
            sources={int(k): Source(v).value for k, v in (data.get("sources") or {}).items()},
        )
        if any(not 0 <= n < len(tree.tokens) for n in tree.sampled):
            raise ValueError("a sampled draw belongs to no node of the tree")
        if any(not 0 < n < len(tree.tokens) for n in tree.sources):
            raise ValueError("a source belongs to no drafted node of the tree")
        for i, p in enumerate(tree.parents):
            if (i == 0) != (p == -1) or p >= i:
                raise ValueError(f"node {i} has invalid parent {p}")
        return tree


def _finite(x: float) -> float | None:
    """JSON has no -inf: store it as null."""
    return None if math.isinf(x) or math.isnan(x) else x
