"""EAGLE-2 beam search + rerank (salf-talf-tree-loss-and-stopping.md §2.3, App. B)."""

from __future__ import annotations

from dynatree_core.core.tree import DraftTree, Reason
from dynatree_core.drafting.common import leaf_reason
from dynatree_core.drafting.device import grow_all_levels
from dynatree_core.drafting.policy import Param, Policy, register_policy
from dynatree_core.drafting.request import DraftRequest


# ----- EAGLE-2 -----------------------------------------------------------------------------------
@register_policy
class Eagle2Beam(Policy):
    """EAGLE-2 dynamic tree (SALF paper §2.3 and App. B): for `depth` steps expand the top-k
    nodes of the newest level by path probability (one forward per step, k children each), then
    rerank: keep the global top-N drafted nodes by path probability, prune the rest."""

    name = "eagle2"
    summary = "EAGLE-2: beam of top-k per level for `depth` steps, then global top-N rerank"
    params = (
        # depth 3, N 8: the measured best on the OOD tuning prompts with the shipped draft on CPU
        # (benchmarks/ood_defaults.py; BENCHMARKS, "Defaults fitted on OOD prompts")
        Param("depth", int, 3, 1, 16, "Expansion steps (tree depth)"),
        Param("topk", int, 4, 1, 16, "Nodes expanded per step, and children per expanded node"),
        Param("total", int, 8, 1, 256, "N: drafted nodes kept by the rerank"),
    )

    def draft(self, request: DraftRequest) -> DraftTree:
        c = self.config
        cap = min(c["depth"], request.max_depth)  # the beam as tensor levels (device.py)
        reason = leaf_reason(cap, c["depth"]) if cap > 0 else Reason.LENGTH_LIMIT
        # the beam, then the rerank: keep the global top-N by path probability (a path's probability
        # never exceeds its parent's, so they form a tree), on the device (device.grow_all_levels)
        return grow_all_levels(request, [c["topk"]] * cap, reason=reason, beam=c["topk"], keep=c["total"])
