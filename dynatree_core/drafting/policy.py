"""The policy protocol and its parameter registry.

A policy turns a `DraftRequest` (request.py) into a `DraftTree`. It never touches the target,
caches or masks directly: it asks the draft session (drafts/session.py) for the draft
distributions of a whole tree level at once, and records for every node why it was pruned or
not expanded. `observe(outcome)` lets adaptive policies learn from verification.

Each policy declares its parameters as `Param` specs (name, type, default, range, help). The
same registry produces the CLI's `--param` validation, `policies --json` and the app's sliders.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import torch

from dynatree_core.core.tree import DraftTree
from dynatree_core.drafting.request import DraftRequest
from dynatree_core.drafting.sources import Recycler, SuffixAutomaton, graft
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
    # where its candidates come from: "model" (a draft model), "recycled" (the target's own top-k),
    # "retrieved" (suffix matches), "joined" (a model tree joined by the others), "none" (no draft)
    family: ClassVar[str] = "model"

    def configured_family(self) -> str:
        """Its family as configured (a model-draft policy with joined sources is "joined")."""
        return self.family

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
            "family": cls.family,
            "black_box": cls.kind == "baseline",
            "params": [p.to_dict() for p in cls.params],
        }


class Policy(Tunable):
    """Base class of drafting policies. Subclasses set `name`, `params`, and `draft`; the class
    attributes `draws` and `single_path` and the method `local_shape` are its capabilities, which
    verifier resolution (verify/registry.py: resolve_verifier) checks through `capabilities()`."""

    kind: ClassVar[str] = "policy"
    draws: ClassVar[tuple[str, ...]] = ("top",)  # how it can draw children (sampled: "iid", ...)
    single_path: ClassVar[bool] = False  # drafts one path (block verification applies)
    _automaton: SuffixAutomaton | None = None  # the joined sources of a run (propose, observe_target)
    _recycler: Recycler | None = None

    def draft(self, request: DraftRequest) -> DraftTree:
        raise NotImplementedError

    def configured_family(self) -> str:
        return "joined" if self.family == "model" and self.joins() else self.family

    def joins(self) -> bool:
        """Whether retrieved or recycled branches join this policy's trees (JOIN_PARAMS)."""
        return self.config.get("retrieved", 0) > 0 or self.config.get("recycled", 0) > 0

    def propose(self, request: DraftRequest) -> DraftTree:
        """The tree the engine verifies: `draft`'s, joined by the sources that cost no draft
        forward when `joins()` (drafting/sources.py): the suffix match's continuation (when the
        match is at least MIN_MATCH tokens: SAM-Decoding's rule, Hu et al. §3.3) and the recycled
        walk, under the policy's node budget (the model drafts with the budget less their room).
        Top-k drafting only: a sampled tree's verifiers need every child drawn from q."""
        if not self.joins() or request.draw != "top":
            return self.draft(request)
        request = dataclasses.replace(request, early=None)  # the rows change after drafting
        extra = self._cost_free(request)
        budget = self.config.get("budget")
        if budget is not None:
            self.config["budget"] = max(1, budget - sum(len(t) - 1 for t in extra))
        try:
            tree = self.draft(request)
        finally:
            if budget is not None:
                self.config["budget"] = budget
        verified = sum(tree.is_verified(n) for n in range(1, len(tree)))
        room = budget - verified if budget is not None else sum(len(t) - 1 for t in extra)
        for other in extra:
            room -= graft(tree, other, room)
        return tree

    def _cost_free(self, request: DraftRequest) -> list[DraftTree]:
        """The retrieved and the recycled trees this iteration joins (at most their parameters'
        nodes each, no deeper than the request allows)."""
        c, depth, out = self.config, request.max_depth, []
        if depth <= 0:
            return out
        if c.get("retrieved", 0) > 0:
            if self._automaton is None:
                self._automaton = SuffixAutomaton()
            self._automaton.follow(request.context)
            length, state = self._automaton.match()
            if length >= MIN_MATCH:
                chain = self._automaton.walk(request.root_token, state, min(c["retrieved"], depth), 1, c["retrieved"])
                out.append(chain)
        if c.get("recycled", 0) > 0 and self._recycler is not None:
            out.append(self._recycler.ranked(request.root_token, min(depth, RECYCLED_DEPTH), c["recycled"]))
        return out

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
        """Called when a run starts: policies with state across iterations clear it here (the
        joined sources' automaton and matrix are a run's too)."""
        self._automaton = None
        self._recycler = None

    def observe(self, outcome: Any) -> None:
        """Called after each verification; adaptive policies override it."""

    @property
    def reads_target(self) -> bool:
        """Whether the engine calls observe_target with every row the target reads: a policy that
        recycles the target's top-k (drafting/recycle.py sets it True; here: recycled branches)."""
        return self.config.get("recycled", 0) > 0

    def observe_target(self, tokens: list[int], logits: torch.Tensor) -> None:
        """With `reads_target`: the target's logits at every row it read (`logits[i]`: the
        distribution of the token after `tokens[i]`), accepted or not (drafting/recycle.py)."""
        if self.config.get("recycled", 0) > 0:
            if self._recycler is None:
                self._recycler = Recycler(RECYCLED_K)
            self._recycler.observe(tokens, logits)

    def observe_cost(self, tokens: int, verify_ms: float) -> None:
        """Called after each target forward: how many tokens it read and how long it took."""

    @classmethod
    def describe(cls) -> dict:
        return {**super().describe(), "draws": list(cls.draws), "single_path": cls.single_path}


MIN_MATCH = 2  # a suffix match joins a tree from this many tokens on
RECYCLED_K, RECYCLED_DEPTH = 8, 6  # the joined matrix's columns and depth (its nodes: the best first)
JOIN_PARAMS = (
    Param("retrieved", int, 0, 0, 64, "Nodes of the context's suffix-match continuation joined to the tree (0: none)"),
    Param("recycled", int, 0, 0, 64, "Nodes of the target's recycled top-k joined to the tree (0: none)"),
)

POLICIES: dict[str, type[Policy]] = {}


def register_policy(cls: type[Policy]) -> type[Policy]:
    """Register a policy by name; a model-draft tree policy gets JOIN_PARAMS (any of them can be joined)."""
    if cls.needs_draft_model and not cls.single_path and not any(p.name == "retrieved" for p in cls.params):
        cls.params = (*cls.params, *JOIN_PARAMS)
    POLICIES[cls.name] = cls
    return cls


def make_policy(name: str, values: dict[str, Any] | None = None) -> Policy:
    """Instantiate a registered drafting policy by name, validating its parameters (a name that
    may also be a baseline: `methods.make_method`)."""
    import dynatree_core.drafting  # noqa: F401  (registers the built-in policies)

    if name not in POLICIES:
        raise DynaTreeError(f"unknown policy {name!r}; choose one of: {', '.join(POLICIES)}")
    return POLICIES[name](**(values or {}))
