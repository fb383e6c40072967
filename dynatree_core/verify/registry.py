"""The verifiers' registry and the one rule that pairs a policy with a verifier.

Every verifier is lossless on some drafting structures only (delayed-tree-expansion paper §3,
Table 1): a deterministic top-k tree, children drawn i.i.d. or without replacement, one drafted
path. A policy states what it drafts as `Capabilities` (drafting/policy.py `Policy.capabilities`)
and `resolve_verifier` checks the pairing here, with the verifiers that know the conditions,
refusing the ones that would not be lossless.
"""

from __future__ import annotations

import dataclasses

from dynatree_core.core.sampling_config import SamplingConfig
from dynatree_core.errors import DynaTreeError

# drafting structures a verifier can be lossless on
SINGLE_PATH, IID, WITHOUT_REPLACEMENT, DETERMINISTIC = "single_path", "iid", "without_replacement", "deterministic"


@dataclasses.dataclass(frozen=True)
class VerifierSpec:
    name: str
    accepts: tuple[str, ...]  # drafting structures it is lossless on, preferred draw first
    direction: str  # "top-down" or "bottom-up"
    summary: str
    reference: str

    @property
    def draw(self) -> str:
        """How a policy must draw children for it: "top" (any tree), "iid" or "without_replacement"."""
        if DETERMINISTIC in self.accepts:
            return "top"
        return next((a for a in self.accepts if a in (IID, WITHOUT_REPLACEMENT)), IID)  # a path: one i.i.d. draw

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "temperature": "0" if self.name == "greedy" else "> 0"}


ALL = (SINGLE_PATH, IID, WITHOUT_REPLACEMENT, DETERMINISTIC)
VERIFIERS = {
    v.name: v
    for v in (
        VerifierSpec(
            "greedy", ALL, "top-down", "temperature 0: the longest path matching the target's argmax", "DynaTree Alg. 1"
        ),
        VerifierSpec(
            "nss",
            ALL,
            "top-down",
            "sample from the target, follow the tree while it matches (any tree)",
            "App. B.1, Alg. 1",
        ),
        VerifierSpec(
            "naive",
            (IID, SINGLE_PATH),
            "top-down",
            "speculative sampling on the first child, residual (p - q)+ otherwise; on a path, Leviathan / Chen",
            "App. B.2, Alg. 2",
        ),
        VerifierSpec(
            "block",
            (SINGLE_PATH,),
            "bottom-up",
            "block verification: sequence-level weights, the deepest accepted draft wins",
            "Sun et al. 2024c; §3.1",
        ),
        VerifierSpec(
            "spectr", (IID, SINGLE_PATH), "top-down", "SpecTr K-SEQ with the division factor rho*", "App. B.3, Alg. 3"
        ),
        VerifierSpec(
            "specinfer",
            (IID, SINGLE_PATH),
            "top-down",
            "recursive rejection over i.i.d. children, residual updates",
            "App. B.4, Alg. 4",
        ),
        VerifierSpec(
            "khisti",
            (IID, SINGLE_PATH),
            "top-down",
            "importance-weighted tournament picks one child, then speculative sampling",
            "App. B.5, Alg. 5",
        ),
        VerifierSpec(
            "traversal",
            (IID, WITHOUT_REPLACEMENT, SINGLE_PATH),
            "bottom-up",
            "Traversal verification: post-order from the leaves, BV on each path",
            "Weng et al. 2025; §3.2",
        ),
        VerifierSpec(
            "without_replacement",
            (WITHOUT_REPLACEMENT, SINGLE_PATH),
            "top-down",
            "recursive rejection for children drawn without replacement (DySpec / Sequoia)",
            "DySpec App. A.3",
        ),
    )
}


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a configured policy drafts, in the verifiers' terms."""

    name: str  # the policy's, for messages
    drafted: bool = True  # draws from a draft model (ar and ngram do not)
    draws: tuple[str, ...] = ("top",)  # "top" (deterministic top-k), IID, WITHOUT_REPLACEMENT
    single_path: bool = False  # drafts one path (block verification applies)
    local_shape: bool = False  # the shape below a node depends on its own draws only (bottom-up verifiers)
    local_shape_hint: str = ""  # how to get local_shape with this policy's parameters, if there is a way


def resolve_verifier(caps: Capabilities, verifier: str, sampling: SamplingConfig) -> tuple[str, str]:
    """(verifier, draw mode) for this policy and these settings; invalid pairings are refused."""
    if sampling.greedy:
        if verifier not in ("auto", "greedy"):
            raise DynaTreeError(f"verifier {verifier!r} needs --temperature > 0 (temperature 0 is greedy)")
        return "greedy", "top"
    name = verifier
    if name == "auto":  # the best general top-down choice the policy's drafting allows
        if not caps.drafted or IID not in caps.draws and WITHOUT_REPLACEMENT not in caps.draws:
            name = "nss"  # nothing drawn from a draft model (ar, ngram) or a deterministic tree
        else:
            name = "specinfer" if IID in caps.draws else WITHOUT_REPLACEMENT
    if name not in VERIFIERS or name == "greedy":
        valid = ", ".join(v for v in VERIFIERS if v != "greedy")
        raise DynaTreeError(f"unknown sampling verifier {name!r}; choose one of: {valid}")
    spec = VERIFIERS[name]
    if spec.draw == "top":
        return name, "top"
    if spec.accepts == (SINGLE_PATH,):  # block verification: a path drawn from the draft
        if not caps.single_path or IID not in caps.draws:
            raise DynaTreeError(f"verifier {name!r} verifies one drafted path; policy {caps.name!r} drafts a tree")
        return name, IID
    if spec.direction == "bottom-up" and not caps.local_shape:
        hint = f" ({caps.local_shape_hint})" if caps.local_shape_hint else ""
        raise DynaTreeError(
            f"verifier {name!r} walks the tree bottom-up, which is lossless only when the shape below a node "
            f"depends on that node's own draws; policy {caps.name!r} lets subtrees compete for a node budget. "
            f"Raise the budget so it never binds{hint}, or choose a top-down verifier (specinfer, spectr, ...)"
        )
    draw = next((d for d in spec.accepts if d in caps.draws), None)
    if draw is None:
        needs = " or ".join(d.replace("_", " ") for d in spec.accepts if d != SINGLE_PATH)
        raise DynaTreeError(
            f"verifier {name!r} needs children drawn {needs} from the draft; policy {caps.name!r} "
            f"builds deterministic top-k trees, on which only 'nss' is lossless"
        )
    return name, draw
