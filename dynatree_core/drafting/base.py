"""The policy protocol, its parameter registry, and the draft model session policies call.

A policy turns a `DraftRequest` into a `DraftTree`. It never touches the target, caches or
masks directly: it asks the `Drafter` for the draft distributions of a whole tree level at
once (`drafter.expand(tree, nodes)`, one draft forward), and records for every node why it was
pruned or not expanded. `observe(outcome)` lets adaptive policies learn from verification.

Each policy declares its parameters as `Param` specs (name, type, default, range, help). The
same registry produces the CLI's `--param` validation, `policies --json` and the app's sliders.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import torch

from dynatree_core.core.kv import KVState, chain_then_tree_visibility
from dynatree_core.core.transfer import to_host, to_list
from dynatree_core.core.tree import DraftTree
from dynatree_core.core.vocab import TokenMap
from dynatree_core.errors import DynaTreeError
from dynatree_core.verify.registry import Capabilities


@dataclasses.dataclass(frozen=True)
class Param:
    """One tunable policy parameter: drives CLI validation and app widgets alike."""

    name: str
    type: type  # int, float or bool
    default: Any
    min: float | None = None
    max: float | None = None
    help: str = ""
    log_scale: bool = False  # a hint for sliders (thresholds span decades)

    def parse(self, raw: Any) -> Any:
        """Convert and validate a value (from a CLI string, JSON, or a widget)."""
        try:
            if self.type is bool:
                value = raw if isinstance(raw, bool) else _parse_bool(str(raw))
            elif self.type is int:
                value = float(raw) if isinstance(raw, str) else raw
                if isinstance(value, float) and not value.is_integer():
                    raise ValueError
                value = int(value)
            else:
                value = float(raw)
        except (TypeError, ValueError, OverflowError):
            raise DynaTreeError(f"parameter {self.name}: {raw!r} is not a valid {self.type.__name__}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise DynaTreeError(f"parameter {self.name}: {raw!r} is not a finite number")
        too_low = self.min is not None and value < self.min
        too_high = self.max is not None and value > self.max
        if self.type is not bool and (too_low or too_high):
            raise DynaTreeError(f"parameter {self.name}={value} is out of range [{self.min}, {self.max}]")
        return value

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "type": self.type.__name__,
            "default": self.default,
            "min": self.min,
            "max": self.max,
            "help": self.help,
            "log_scale": self.log_scale,
        }


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


class Drafter:
    """The draft model for one run: its own KV cache, expanded one tree level per forward.

    Cache layout during an iteration: [committed tokens (root last)] [tree nodes, level by level].
    Siblings never share mutable state: every node has its own cache slot and sees only its
    ancestors through the mask.
    """

    wants_features = False  # a feature draft (drafting/feature.py) also reads the target's hidden states
    ready = True  # it can draft now (a feature draft waits for the target's first forward)

    def __init__(
        self,
        model: torch.nn.Module,
        prompt_ids: list[int],
        vocab_size: int,
        token_map: TokenMap | None = None,
        *,
        kv: KVState | None = None,
    ):
        self.kv = kv if kv is not None else KVState(model, prompt_ids)
        self.vocab_size = vocab_size
        self.token_map = token_map  # reduced-vocabulary draft: map ids in and log-probs out
        self.slots: dict[int, int] = {}  # node id -> cache index, for the current tree
        self.committed = 0  # cache entries that are committed tokens

    @property
    def forwards(self) -> int:
        return self.kv.forwards

    def expand(self, tree: DraftTree, nodes: list[int]) -> torch.Tensor:
        """Draft log-probabilities for the children of `nodes`, in one forward.

        `nodes` is either [0] (the root: runs the pending committed tokens, root last) or a
        list of verified nodes whose parents were expanded earlier in this iteration.
        Returns: (len(nodes), vocab) float32 log-probabilities.
        """
        kv = self.kv
        if nodes == [0]:
            self.slots = {}
            chain = self._draft_ids(kv.pending)
            visible = chain_then_tree_visibility(kv.length, len(chain), torch.zeros(0, 0, dtype=torch.bool))
            logits = kv.forward(chain, list(range(kv.length, kv.length + len(chain))), visible, 1)
            kv.pending = []
            self.committed = kv.length
            self.slots[0] = kv.length - 1
        else:
            positions = [self.committed - 1 + tree.depths[n] for n in nodes]
            start = kv.length
            logits = kv.forward(
                self._draft_ids([tree.tokens[n] for n in nodes]),
                positions,
                self._level_visibility(tree, nodes),
                len(nodes),
            )
            self.slots.update({n: start + i for i, n in enumerate(nodes)})
        return self._logp(logits)

    def _level_visibility(self, tree: DraftTree, nodes: list[int]) -> torch.Tensor:
        """(q, length + q) visibility of one tree level: the committed entries (the root's
        included), each node's ancestors' slots, and itself."""
        q, length = len(nodes), self.kv.length
        visible = torch.zeros(q, length + q, dtype=torch.bool)
        visible[:, : self.committed] = True
        for i, node in enumerate(nodes):
            for anc in tree.path(node)[1:-1]:  # the root is among the committed entries
                visible[i, self.slots[anc]] = True
            visible[i, length + i] = True
        return visible

    def _logp(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits -> (q, target vocab) log-probabilities (through the token map if any)."""
        if self.token_map is not None:
            return self.token_map.to_target_logp(logits)
        return torch.log_softmax(logits[:, : self.vocab_size], dim=-1)

    def _draft_ids(self, target_ids: list[int]) -> list[int]:
        if self.token_map is None:
            return target_ids
        return self.token_map.to_draft(torch.tensor(target_ids)).tolist()

    def commit(self, tree: DraftTree, accepted: list[int], new_tokens: list[int]) -> None:
        """Keep the accepted nodes' KV (compaction); tokens without draft KV become pending."""
        if 0 not in self.slots:  # the draft did not run this iteration
            self.kv.pending.extend(new_tokens)
            return
        cached = []
        for node in accepted:
            if node not in self.slots:
                break
            cached.append(self.slots[node])
        self.kv.keep(list(range(self.committed)) + cached)
        self.kv.pending = list(new_tokens[len(cached) :])
        self.slots = {}


@dataclasses.dataclass
class DraftRequest:
    """What the engine hands a policy each iteration."""

    root_token: int
    max_depth: int  # deepest level that max_new_tokens and the context window allow
    drafter: Drafter | None
    context: list[int] = dataclasses.field(default_factory=list)  # committed tokens, root last (read only)
    # Sampled drafting: "top" (deterministic top-k), "iid" or "without_replacement", with the
    # adjusted draft distribution (temperature / top-k / top-p, as the target's) and a generator
    draw: str = "top"
    sampling: Any = None
    gen: torch.Generator | None = None


def level_top(logp: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """The top-k log-probabilities and tokens of every row of a level, in ONE copy to the host
    (a per-row `.tolist()` of a GPU tensor is a host sync per node). Token ids ride along as
    float32, exact below 2^24 (every vocabulary we load)."""
    top_lp, top_tok = logp.topk(min(k, logp.shape[-1]), dim=-1)
    both = to_list(torch.cat([top_lp.float(), top_tok.float()], dim=-1))
    width = top_lp.shape[-1]
    return [row[:width] for row in both], [[int(t) for t in row[width:]] for row in both]


def level_q(request: DraftRequest, logp: torch.Tensor) -> torch.Tensor | None:
    """Sampled drafting: the adjusted draft distribution of every row of a level on the host, in
    ONE copy (the per-node draws need it there); None for top-k drafting."""
    if request.draw == "top":
        return None
    from dynatree_core.core.sampling_config import adjust

    return to_host(adjust(logp, request.sampling).to(torch.float16))  # rounded once: what a draw records


def pick_children(
    request: DraftRequest,
    tree: DraftTree,
    node: int,
    logp: torch.Tensor,
    k: int,
    top: tuple[list[float], list[int]] | None = None,
    q: torch.Tensor | None = None,
) -> list[tuple]:
    """(token, logp) of up to k children of `node`, best first for "top" (from `top`, the node's
    row of `level_top`, when given); for sampled drafting the k draws from the adjusted draft
    distribution (`q`, the node's row of `level_q`, when given; recorded on the tree for the
    verifier), their distinct tokens as children in drawing order, logp = log q_adjusted(token)."""
    if request.draw == "top":
        if top is not None:
            return list(zip(top[1][:k], top[0][:k], strict=True))
        top_lp, top_tok = logp.topk(k)
        return list(zip(top_tok.tolist(), top_lp.tolist(), strict=True))
    from dynatree_core.core.sampling_config import adjust

    draw = tree.record_draws(node, q if q is not None else to_host(adjust(logp, request.sampling)))
    q = draw.dense()  # the recorded q, exactly as the verifier and an export will read it
    k = min(k, int((q > 0).sum())) if request.draw == "without_replacement" else k
    draw.tokens.extend(torch.multinomial(q, k, replacement=request.draw == "iid", generator=request.gen).tolist())
    return [(tok, math.log(float(q[tok]))) for tok in dict.fromkeys(draw.tokens)]


class Tunable:
    """What every runnable method shares, drafting policy or baseline: a name, a one-line
    summary, `Param` specs validated on construction into `self.config`, and whether it needs a
    draft model. Policies (below) draft trees for our engine; baselines (decoding/baselines.py) run as one
    black-box call."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    params: ClassVar[tuple[Param, ...]] = ()
    needs_draft_model: ClassVar[bool] = True
    kind: ClassVar[str] = ""  # "policy" or "baseline"

    def __init__(self, **values: Any):
        specs = {p.name: p for p in self.params}
        unknown = set(values) - set(specs)
        if unknown:
            valid = ", ".join(specs) or "none"
            raise DynaTreeError(
                f"{self.kind} {self.name!r} has no parameter {', '.join(sorted(unknown))} (valid: {valid})"
            )
        self.config = {p.name: p.parse(values.get(p.name, p.default)) for p in self.params}

    @classmethod
    def describe(cls) -> dict:
        return {
            "name": cls.name,
            "summary": cls.summary,
            "needs_draft_model": cls.needs_draft_model,
            "black_box": cls.kind == "baseline",
            "params": [p.to_dict() for p in cls.params],
        }


class Policy(Tunable):
    """Base class of drafting policies. Subclasses set `name`, `params`, and `draft`; the class
    attributes `draws` and `single_path` and the method `local_shape` are its capabilities, which
    verifier resolution (verify/resolve.py) checks through `capabilities()`."""

    kind: ClassVar[str] = "policy"
    draws: ClassVar[tuple[str, ...]] = ("top",)  # how it can draw children (sampled: "iid", ...)
    single_path: ClassVar[bool] = False  # drafts one path (block verification applies)

    def draft(self, request: DraftRequest) -> DraftTree:
        raise NotImplementedError

    def local_shape(self) -> bool:
        """True when the shape below every drafted node depends only on that node's own draws
        (and its ancestors'): what bottom-up (Traversal) verification needs to stay lossless.
        A node budget shared across a level makes subtrees compete, so the default is False."""
        return False

    def local_shape_hint(self) -> str:
        """How to make `local_shape()` true with this policy's parameters ("" when there is no way)."""
        return ""

    def capabilities(self) -> Capabilities:
        """What this policy, as configured, offers the verifiers: data, not probes."""
        return Capabilities(
            name=self.name,
            drafted=self.needs_draft_model,
            draws=tuple(self.draws),
            single_path=self.single_path,
            local_shape=self.local_shape(),
            local_shape_hint=self.local_shape_hint(),
        )

    def reset(self) -> None:
        """Called when a run starts: policies with state across iterations clear it here."""

    def observe(self, outcome: Any) -> None:
        """Called after each verification; adaptive policies override it."""

    def observe_cost(self, tokens: int, verify_ms: float) -> None:
        """Called after each target forward: how many tokens it read and how long it took."""

    @classmethod
    def describe(cls) -> dict:
        return {**super().describe(), "draws": list(cls.draws), "single_path": cls.single_path}


POLICIES: dict[str, type[Policy]] = {}


def register_policy(cls: type[Policy]) -> type[Policy]:
    POLICIES[cls.name] = cls
    return cls


def make_policy(name: str, values: dict[str, Any] | None = None) -> Policy:
    """Instantiate a registered drafting policy by name, validating its parameters (a name that
    may also be a baseline: `methods.make_method`)."""
    import dynatree_core.drafting  # noqa: F401  (registers the built-in policies)

    if name not in POLICIES:
        raise DynaTreeError(f"unknown policy {name!r}; choose one of: {', '.join(POLICIES)}")
    return POLICIES[name](**(values or {}))
