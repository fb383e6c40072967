"""Drafting policies. Importing this package registers every built-in policy."""

from dynatree_core.drafting import baselines, delayed, dynatree, dyspec, eagle2, salf, static  # noqa: F401
from dynatree_core.drafting.base import POLICIES, Drafter, DraftRequest, Param, Policy, make_policy, register_policy

# The order every list shows (CLI, pickers, benchmarks): plain decoding, static trees, the dynamic
# policies in the papers' order, the delayed/n-gram family, then the HF black boxes. A policy
# registered elsewhere keeps its place after the built-in drafting policies, before the black boxes.
ORDER = (
    "ar", "linear", "fixed_tree", "dynatree", "dyspec", "dyspec_threshold", "eagle2", "salf",
    "delayed", "delayed_auto", "ngram", "hf_assisted", "hf_prompt_lookup", "hf_generate",
)  # fmt: skip


def _rank(name: str) -> tuple[int, int]:
    built_in = ORDER.index(name) if name in ORDER else len(ORDER)
    return (POLICIES[name].black_box, built_in)


for _name in sorted(POLICIES, key=_rank):
    POLICIES[_name] = POLICIES.pop(_name)

__all__ = ["ORDER", "POLICIES", "DraftRequest", "Drafter", "Param", "Policy", "make_policy", "register_policy"]
