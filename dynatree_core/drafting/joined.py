"""Joined trees registered under names of their own (family `joined`): a model-draft policy with
its `retrieved` (and, where it pays, `recycled`) branches on by default (Policy.propose,
drafting/sources.py).

Any model-draft tree policy joins them through its `retrieved` and `recycled` parameters; these
names are the joined forms Compare and `bench` run by name, with their defaults fitted on the OOD
tuning prompts (benchmarks/ood_defaults.py; BENCHMARKS, "Candidates that cost no draft forward").
"""

from __future__ import annotations

import dataclasses

from dynatree_core.drafting.dynatree import DynaTreeAdaptive
from dynatree_core.drafting.policy import Policy, register_policy
from dynatree_core.drafting.static import FixedTree


def joined(base: type[Policy], name: str, summary: str, **defaults) -> type[Policy]:
    """Register `base` under `name` with the `defaults` of its parameters changed, family `joined`."""
    params = tuple(dataclasses.replace(p, default=defaults.pop(p.name, p.default)) for p in base.params)
    if defaults:
        raise ValueError(f"{base.name} has no parameter {', '.join(defaults)}")
    body = {"name": name, "summary": summary, "family": "joined", "params": params}
    cls = type(base.__name__ + "Joined", (base,), body)
    return register_policy(cls)


# retrieved 8, recycled 0: the measured best on the OOD tuning prompts on CPU for each form, fitted
# on its own (recycled 4-16 added tokens an iteration, up to 3.11 for joined_dynatree, but cost more
# verify time than they saved; benchmarks/ood_defaults.py, assets/benchmarks/ood-defaults-cost-free/)
JoinedFixedTree = joined(
    FixedTree,
    "joined_fixed_tree",
    "fixed_tree joined by the continuation of the context's suffix match, under its budget",
    retrieved=8,
    recycled=0,
)
JoinedDynaTree = joined(
    DynaTreeAdaptive,
    "joined_dynatree",
    "dynatree joined by the continuation of the context's suffix match, under its budget",
    retrieved=8,
    recycled=0,
)
