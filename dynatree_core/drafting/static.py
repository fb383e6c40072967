"""Static-shape policies: `ar` (no draft), `linear` (a chain) and `fixed_tree` (DynaTree base).

fixed_tree follows DynaTree (dynatree-adaptive-pruning.md §3.3, Algorithm 1): expand the top-B
children of every frontier node, one level per draft forward, up to depth D; prune a node whose
cumulative draft log-probability is below log(tau) (Alg. 1 lines 17-19); stop adding nodes at
the node budget N_max (lines 12 and 22). Two deliberate differences:
our root is the last committed token (the paper's root u0 is the draft's top-1 token,
which equals our depth-1 with B=1), and within a level candidates are admitted in order of
cumulative probability, so the budget keeps the most probable nodes.
"""

from __future__ import annotations

from dynatree_core.core.tree import DraftTree
from dynatree_core.drafting.device import grow_topk_levels
from dynatree_core.drafting.policy import Param, Policy, register_policy
from dynatree_core.drafting.request import DraftRequest


@register_policy
class Autoregressive(Policy):
    name = "ar"
    family = "none"
    summary = "Target only, one token per forward (our own loop; the reference for speedups)"
    needs_draft_model = False
    draws = ("top", "iid", "without_replacement")  # it draws nothing: every verifier applies
    single_path = True

    def local_shape(self) -> bool:
        return True

    def draft(self, request: DraftRequest) -> DraftTree:
        tree = DraftTree.with_root(request.root_token)
        tree.mark_leaf(0, "no_draft")
        return tree


@register_policy
class Linear(Policy):
    name = "linear"
    draws = ("top", "iid", "without_replacement")
    summary = "A single chain of K greedy draft tokens (classic speculative decoding)"
    params = (Param("k", int, 5, 1, 32, "Draft tokens per iteration (chain length)"),)
    single_path = True

    def local_shape(self) -> bool:
        return True

    def draft(self, request: DraftRequest) -> DraftTree:
        k = self.config["k"]
        return grow_topk_levels(request, depth=k, branch=1, tau=0.0, budget=k)


@register_policy
class FixedTree(Policy):
    name = "fixed_tree"
    draws = ("top", "iid", "without_replacement")
    summary = "DynaTree base: top-B branching to depth D, threshold pruning, node budget"
    params = (
        # depth 3, branch 3: the measured best on the OOD tuning prompts with the shipped draft on
        # CPU (benchmarks/ood_defaults.py; BENCHMARKS, "Defaults fitted on OOD prompts")
        Param("depth", int, 3, 1, 16, "Maximum tree depth D (draft levels per iteration)"),
        Param("branch", int, 3, 1, 8, "Children per expanded node B (top-B of the draft)"),
        Param(
            "tau",
            float,
            0.03,
            0.0,
            1.0,
            "Prune a node when its cumulative draft probability is below tau",
            log_scale=True,
        ),
        Param("budget", int, 32, 1, 256, "Node budget N_max: most drafted nodes sent to the target"),
    )

    def full_size(self) -> int:
        c = self.config
        return sum(c["branch"] ** d for d in range(1, c["depth"] + 1))

    def local_shape(self) -> bool:
        return self.config["budget"] >= self.full_size()  # the budget can never bind

    def local_shape_hint(self) -> str:
        return f"budget >= {self.full_size()}"

    def draft(self, request: DraftRequest) -> DraftTree:
        c = self.config
        return grow_topk_levels(request, depth=c["depth"], branch=c["branch"], tau=c["tau"], budget=c["budget"])
