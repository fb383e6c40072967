"""DynaTree (dynatree-confidence-aware-adaptive-tree.md §3.3, Algorithm 1): adaptive branching
and depth from the draft's confidence, one draft forward per level."""

from __future__ import annotations

import collections

import torch

from dynatree_core.core.transfer import to_device, upload_into
from dynatree_core.core.tree import DraftTree, Reason
from dynatree_core.drafting.common import admit_level, drafter_of, leaf_reason, safe_log
from dynatree_core.drafting.device import admitted_levels, children, replay_level
from dynatree_core.drafting.policy import Param, Policy, register_policy
from dynatree_core.drafting.request import DraftRequest, level_top
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

    def _branch(self, top_logp: float) -> int:
        """B(u) from c(u) = exp(top_logp), compared as log-probabilities (so the device path,
        `_propose`, compares the same floats)."""
        c = self.config
        if not c["adaptive_branch"]:
            return c["b_mid"]
        if top_logp >= safe_log(self.tau_h):
            return c["b_min"]
        return c["b_max"] if top_logp < safe_log(c["tau_l"]) else c["b_mid"]

    def _gate(self, tree: DraftTree, node: int, cap: int, policy_depth: int) -> Reason | None:
        """Why `node` may not be expanded (Alg. 1 lines 17-25), or None."""
        depth, cum = tree.depths[node], tree.cum_logp[node]
        if depth >= cap:
            return leaf_reason(cap, policy_depth)
        if self.config["dynamic_depth"]:
            if cum < safe_log(self.config["rho_stop"]):
                return Reason.EARLY_STOP
            if depth >= self.d0 and cum < safe_log(self.config["rho_deep"]):
                return Reason.DEPTH_GATE
        return None

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

    def _propose(self, level: int, logp, cum, valid, drafted, log_tau_h):
        """A level's candidates on the device (device.admitted_levels): the rows `_gate` and the
        budget let expand (their depth is level - 1) propose their top-B(u) children."""
        c, depth = self.config, level - 1
        ok = valid & (drafted < c["budget"])
        if c["dynamic_depth"]:
            ok = ok & (cum >= safe_log(c["rho_stop"]))
            if depth >= self.d0:
                ok = ok & (cum >= safe_log(c["rho_deep"]))
        tokens, lp, cum_c, rows = children(logp, cum, max(c["b_min"], c["b_mid"], c["b_max"]))
        top = logp.max(dim=-1).values.double()  # c(u) as a log-probability
        branch = torch.full((logp.shape[0],), c["b_mid"], dtype=torch.long, device=logp.device)
        if c["adaptive_branch"]:
            branch = torch.where(top < safe_log(c["tau_l"]), c["b_max"], branch)
            branch = torch.where(top >= log_tau_h, c["b_min"], branch)
        rank = torch.arange(tokens.shape[0], device=tokens.device) % (tokens.shape[0] // logp.shape[0])
        return tokens, lp, cum_c, rows, ok[rows] & (rank < branch[rows])

    def draft(self, request: DraftRequest) -> DraftTree:
        drafter, c = drafter_of(request), self.config
        tree = DraftTree.with_root(request.root_token)
        tree.notes = {"d0": [float(self.d0)], "tau_h": [self.tau_h]}
        policy_depth = c["d_max"] if c["dynamic_depth"] else self.d0
        cap = min(policy_depth, request.max_depth)
        self._last_depth = 0
        log_tau, widest = safe_log(c["tau"]), max(c["b_min"], c["b_mid"], c["b_max"])
        levels = None
        if request.on_device and cap > 0:  # the levels decided on the device, read once (device.py)
            # what _propose reads: the config and d0 (a few values) in the key, tau_h (it drifts) as a tensor
            key_of = ("dynatree", tuple(sorted(c.items())), self.d0)
            log_tau_h = self._log_tau_h(drafter)
            levels = admitted_levels(
                request,
                cap,
                log_tau=log_tau,
                budget=c["budget"],
                propose=self._propose,
                key_of=key_of,
                inputs=(log_tau_h,),
            )
            levels = iter(levels)
        frontier, drafted = [0], 0
        while frontier:
            expand = []
            for node in frontier:
                why = self._gate(tree, node, cap, policy_depth)
                if why is None and drafted >= c["budget"]:
                    why = Reason.BUDGET
                if why is None:
                    expand.append(node)
                else:
                    tree.mark_leaf(node, why)
            if not expand:
                break
            if levels is not None:  # the device ran every frontier row; the gated ones proposed nothing
                level = next(levels, None)
                if level is None:
                    raise RuntimeError("the device stopped drafting a level before the host's rules did")
                frontier = replay_level(tree, frontier, expand, level, drafter)
                drafted += len(frontier)
                continue
            logp = drafter.expand(tree, expand)  # ONE draft forward for the level
            lp_rows, tok_rows = level_top(logp, widest)  # one copy
            branches = [self._branch(row[0]) for row in lp_rows]  # c(u): the top-1 probability
            candidates = []
            for row, node in enumerate(expand):
                tree.mark_expanded(node)
                b = branches[row]
                for lp, tok in zip(lp_rows[row][:b], tok_rows[row][:b], strict=True):
                    candidates.append((tree.cum_logp[node] + lp, node, tok, lp))
            frontier = admit_level(tree, candidates, log_tau, c["budget"] - drafted)
            drafted += len(frontier)
        self._last_depth = max((tree.depths[n] for n in range(len(tree)) if tree.is_verified(n)), default=0)
        return tree
