"""Drafting policies. Importing this package registers every built-in policy (the black-box
baselines are decoding/baselines.py; decoding/methods.py lists both).

Policies in one module per paper (their protocol and parameter registry: policy.py; the request
and the per-level helpers they share: request.py, common.py; greedy trees as tensor levels on any
device, device.py, and the one tree they grow, its read, view and verify rows, tensor_tree.py). The draft models
they expand are drafts/.

May import: errors, core, forward, runs, verify, drafts.
"""

from dynatree_core.drafting import delayed, dynatree, dyspec, eagle2, joined, recycle, salf, static, suffix  # noqa: F401
from dynatree_core.drafting.policy import POLICIES, Param, Policy, make_policy, register_policy
from dynatree_core.drafting.request import DraftRequest

# The order every list shows (CLI, pickers, benchmarks): plain decoding, static trees, the dynamic
# policies in the papers' order, the delayed family, the candidates that cost no draft forward
# (retrieved, recycled) and the joined trees. A policy registered elsewhere
# keeps its place after the built-in ones.
ORDER = (
    "ar", "linear", "fixed_tree", "dynatree", "dyspec", "dyspec_threshold", "eagle2", "salf",
    "delayed", "delayed_auto", "ngram", "suffix", "recycle", "joined_fixed_tree", "joined_dynatree",
)  # fmt: skip


def _rank(name: str) -> int:
    return ORDER.index(name) if name in ORDER else len(ORDER)


for _name in sorted(POLICIES, key=_rank):
    POLICIES[_name] = POLICIES.pop(_name)

__all__ = ["ORDER", "POLICIES", "DraftRequest", "Param", "Policy", "make_policy", "register_policy"]
