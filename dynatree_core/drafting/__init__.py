"""Drafting policies. Importing this package registers every built-in policy (the black-box
baselines are decoding/baselines.py; decoding/methods.py lists both).

May import: errors, core, runs, verify.
"""

from dynatree_core.drafting import delayed, dynatree, dyspec, eagle2, salf, static  # noqa: F401
from dynatree_core.drafting.base import POLICIES, Drafter, DraftRequest, Param, Policy, make_policy, register_policy

# The order every list shows (CLI, pickers, benchmarks): plain decoding, static trees, the dynamic
# policies in the papers' order, then the delayed/n-gram family. A policy registered elsewhere
# keeps its place after the built-in ones.
ORDER = (
    "ar", "linear", "fixed_tree", "dynatree", "dyspec", "dyspec_threshold", "eagle2", "salf",
    "delayed", "delayed_auto", "ngram",
)  # fmt: skip


def _rank(name: str) -> int:
    return ORDER.index(name) if name in ORDER else len(ORDER)


for _name in sorted(POLICIES, key=_rank):
    POLICIES[_name] = POLICIES.pop(_name)

__all__ = ["ORDER", "POLICIES", "DraftRequest", "Drafter", "Param", "Policy", "make_policy", "register_policy"]
