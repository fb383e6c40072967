"""Drafting policies. Importing this package registers every built-in policy."""

from dynatree_core.drafting import baselines, delayed, dynamic, static  # noqa: F401
from dynatree_core.drafting.base import POLICIES, Drafter, DraftRequest, Param, Policy, make_policy, register_policy

for _name in sorted(POLICIES, key=lambda n: POLICIES[n].black_box):  # stable: HF baselines go last
    POLICIES[_name] = POLICIES.pop(_name)

__all__ = ["POLICIES", "DraftRequest", "Drafter", "Param", "Policy", "make_policy", "register_policy"]
