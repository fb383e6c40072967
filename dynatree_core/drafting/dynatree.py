"""DynaTree (dynatree-confidence-aware-adaptive-tree.md §3.3, Algorithm 1): adaptive branching
and depth from the draft's confidence, one draft forward per level."""

from __future__ import annotations

import collections
import dataclasses
import math

import torch

from dynatree_core.core.transfer import to_device, upload_into
from dynatree_core.core.tree import DraftTree
from dynatree_core.drafting.admission import LeafGate, budget_gate
from dynatree_core.drafting.common import drafter_of, leaf_reason, safe_log
from dynatree_core.drafting.device import admitted_levels, children
from dynatree_core.drafting.policy import Param, Policy, register_policy
from dynatree_core.drafting.request import DraftRequest
from dynatree_core.errors import DynaTreeError


# ----- DynaTree ----------------------------------------------------------------------------------
@register_policy
class DynaTreeAdaptive(Policy):
    """DynaTree adaptive drafting: confidence-aware branching, dynamic depth, pruning, history.

    Level by level (one draft forward per level) over the nodes Algorithm 1 would pop:
      * depth gating, Alg. 1 lines 17-25: u is expanded iff d(u) < D_max and p(u) >= rho_stop and
        (d(u) < D0 or p(u) >= rho_deep); otherwise it stays a leaf with the failing rule as reason;
      * branching, §3.3 B(u) and Alg. 1 line 27: B_min children if c(u) >= tau_h, B_max if
        c(u) < tau_l, else B_mid, with c(u) the draft's top probability at u;
      * pruning, §3.3: a child with cumulative probability p < tau is pruned; the node budget
        N_max admits each level's children most probable first (Alg. 1 line 28).
    History (§3.3 "Historical adjustment"; the paper defers the schedule, ours is): a_r is the
    accepted length over the deepest verified depth of iteration r; after W iterations, if their
    mean is >= 0.6 drafting gets more aggressive (D0 + 1, tau_h - 0.05: deeper, narrower), if
    <= 0.3 more conservative (D0 - 1, tau_h + 0.05), and the window restarts. Each mechanism can be
    switched off to reproduce the paper's ablation (Table 4).
    """

    name = "dynatree"
    summary = "DynaTree adaptive: confidence-aware branching, dynamic depth, pruning, history"
    params = (
        Param("b_min", int, 1, 1, 8, "Children of a confident node: c(u) >= tau_h"),
        Param("b_mid", int, 2, 1, 8, "Children when tau_l <= c(u) < tau_h (and every node's, without adaptive_branch)"),
        Param("b_max", int, 3, 1, 8, "Children of an uncertain node: c(u) < tau_l"),
        Param("tau_h", float, 0.9, 0.0, 1.0, "High confidence threshold on the draft's top probability c(u)"),
        Param("tau_l", float, 0.4, 0.0, 1.0, "Low confidence threshold on c(u)"),
        Param("d0", int, 5, 1, 16, "Base depth D0: deeper only along paths with cumulative p >= rho_deep"),
        Param("d_max", int, 8, 1, 32, "Hard maximum depth D_max"),
        Param("rho_stop", float, 0.02, 0.0, 1.0, "Early stop: no expansion below this cumulative p", log_scale=True),
        Param("rho_deep", float, 0.3, 0.0, 1.0, "Cumulative p needed to grow beyond D0", log_scale=True),
        Param("tau", float, 0.01, 0.0, 1.0, "Prune a node whose cumulative draft p is below tau", log_scale=True),
        Param("budget", int, 32, 1, 256, "Node budget N_max: most drafted nodes sent to the target"),
        Param("window", int, 4, 1, 64, "History window W: iterations averaged before an adjustment"),
        Param("adaptive_branch", bool, True, help="Confidence-aware branching (off: b_mid children everywhere)"),
        Param("dynamic_depth", bool, True, help="Depth gating by rho_stop / rho_deep up to d_max (off: depth d0)"),
        Param("history", bool, True, help="Adjust d0 and tau_h from the last W iterations' acceptance"),
    )
    HIGH, LOW = 0.6, 0.3

    def __init__(self, **values):
        super().__init__(**values)
        c = self.config
        if not c["b_min"] <= c["b_mid"] <= c["b_max"]:
            raise DynaTreeError("dynatree needs b_min <= b_mid <= b_max")
        if not c["tau_l"] < c["tau_h"]:
            raise DynaTreeError("dynatree needs tau_l < tau_h")
        if not c["d0"] <= c["d_max"]:
            raise DynaTreeError("dynatree needs d0 <= d_max")
        if c["dynamic_depth"] and not c["rho_stop"] <= c["rho_deep"]:
            raise DynaTreeError("dynatree needs rho_stop <= rho_deep")
        self.reset()

    def reset(self) -> None:
        super().reset()
        self.d0, self.tau_h = self.config["d0"], self.config["tau_h"]
        self.window: collections.deque[float] = collections.deque(maxlen=self.config["window"])
        self._last_depth = 0  # deepest verified depth of the tree just drafted

    def observe(self, outcome) -> None:
        if not self.config["history"] or self._last_depth <= 0:
            return
        self.window.append(len(outcome.accepted) / self._last_depth)
        if len(self.window) < self.window.maxlen:
            return
        mean, c = sum(self.window) / len(self.window), self.config
        if mean >= self.HIGH:
            self.d0 = min(self.d0 + 1, c["d_max"])
            self.tau_h = max(self.tau_h - 0.05, c["tau_l"] + 0.05)
        elif mean <= self.LOW:
            self.d0 = max(self.d0 - 1, 1)
            self.tau_h = min(self.tau_h + 0.05, 0.99)
        else:
            return
        self.window.clear()

    def _gate(self, cap: int, policy_depth: int) -> LeafGate:
        """Why a child will not be expanded (Alg. 1 lines 17-25, then the node budget) as a leaf
        code, decided with its admission: the depth cap; below rho_stop (early stop); at or past D0
        below rho_deep (depth gate); the budget spent."""
        c, gate = self.config, budget_gate(cap, policy_depth, self.config["budget"])
        if not c["dynamic_depth"]:
            return gate
        deep = dict(log_rho_stop=safe_log(c["rho_stop"]), log_rho_deep=safe_log(c["rho_deep"]), deep_from=self.d0)
        return dataclasses.replace(gate, **deep)

    def _log_tau_h(self, drafter) -> torch.Tensor:
        """log tau_h on the device: uploaded each iteration where the branch adapts (it drifts by
        0.05 steps: in a captured step's key it would capture a graph per value), else unused."""
        steps, device = drafter.steps, drafter.steps.device
        if not self.config["adaptive_branch"]:
            return steps.constant(("unused",), lambda: torch.zeros((), dtype=torch.float64, device=device))
        value = torch.tensor(safe_log(self.tau_h), dtype=torch.float64)
        if not steps.capture:
            return to_device(value, device)
        # captured steps read it in place: one upload an iteration, not a copy into every level's step
        held = steps.buffer(("log tau_h",), lambda: torch.zeros((), dtype=torch.float64, device=device))
        upload_into(held, value)
        return held

    def _propose(self, level: int, top, cum, log_tau_h):
        """A level's candidates (device.admitted_levels): each row (a child `_gate` let through)
        proposes its top-B(u) children, B(u) from c(u), the draft's top probability at u, compared
        as log-probabilities (§3.3; Alg. 1 line 27); the rest are not real (NaN)."""
        c = self.config
        most = max(c["b_min"], c["b_mid"], c["b_max"])
        tokens, lp, cum_c = children(top, cum, most)
        branch = c["b_mid"]
        if c["adaptive_branch"]:
            head = top[0][:, :1].double()  # c(u) as a log-probability, one a row
            wide = torch.where(head < safe_log(c["tau_l"]), c["b_max"], branch)
            branch = torch.where(head >= log_tau_h, c["b_min"], wide)
        rank = torch.arange(most, device=cum.device)
        kept = (rank < branch).expand(cum.shape[0], most).flatten()
        return tokens, lp, torch.where(kept, cum_c, math.nan)

    def draft(self, request: DraftRequest) -> DraftTree:
        drafter, c = drafter_of(request), self.config
        tree = DraftTree.with_root(request.root_token)
        tree.notes = {"d0": [float(self.d0)], "tau_h": [self.tau_h]}
        policy_depth = c["d_max"] if c["dynamic_depth"] else self.d0
        cap = min(policy_depth, request.max_depth)
        self._last_depth = 0
        if cap <= 0:
            tree.mark_leaf(0, leaf_reason(cap, policy_depth))
            return tree
        # what _propose and _gate read: the config and d0 (a few values) in the key, tau_h (it drifts) as a tensor
        tree = admitted_levels(
            request,
            tree,
            cap,
            log_tau=safe_log(c["tau"]),
            k=max(c["b_min"], c["b_mid"], c["b_max"]),
            propose=self._propose,
            gate=self._gate(cap, policy_depth),
            key_of=("dynatree", tuple(sorted(c.items())), self.d0, cap, policy_depth),
            inputs=(self._log_tau_h(drafter),),
        )
        self._last_depth = max((tree.depths[n] for n in range(len(tree)) if tree.is_verified(n)), default=0)
        return tree
