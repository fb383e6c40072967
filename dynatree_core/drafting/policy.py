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
    verifier resolution (verify/registry.py: resolve_verifier) checks through `capabilities()`."""

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

    reads_target: ClassVar[bool] = False  # the engine calls observe_target after each verification

    def observe_target(self, tokens: list[int], logits: torch.Tensor) -> None:
        """With `reads_target`: the target's logits at every verified row (`logits[i]`: the
        distribution of the token after `tokens[i]`), accepted or not (drafting/recycle.py)."""

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
