"""A level's admission: its candidates' order, fates and leaf codes, the counts and the record.

After each row's top-k and the policy's candidates, a greedy level's decision (device._decision)
admits them under a threshold and a node budget (`admit`). As tensor ops (`admit_torch`) that is
about twenty small ops: a sort, four gathers, the fates' counts and bucketize, the leaf
gate, the counts to read late and the record to read once. On a GPU each is a kernel launch
(docs/gpu.md: a small model's draft is launch-bound). `admit_level` is all of them as ONE Triton
program (drafting/triton_level.py) that ranks the level's candidates by comparing every pair and
writes each where its rank puts it, a torch custom op (`dynatree::admit_level`), so dispatch modes
(measure/launches.py) see one launch and a captured step replays it.

The leaf rule it applies is `LeafGate`'s, the one rule fixed_tree, linear, dyspec_threshold
(DynaTree Alg. 1 lines 12, 22: the depth cap, the budget spent) and dynatree (lines 17-25: rho_stop's
early stop, D0's depth gate) share; `LeafGate.__call__` is the same rule as tensor ops, the form
every other device takes. Cumulative log-probabilities are only compared, never summed, so the
kernel decides exactly as the torch form does (tests/test_admit_kernel.py, in Triton's interpreter).

It runs where `enabled` says: on CUDA when Triton imports, DYNATREE_KERNELS is not 0 and a first
check against the torch form passes (a failure is logged and the torch form stays). Tests and
`benchmarks.launches --admit-kernel` run it on a CPU in Triton's interpreter (`admit_kernel_on("cpu")`).

Cumulative log-probabilities are float64, as Python's floats are, so every comparison (threshold,
order, ties) decides as the papers' host loops would.
"""

import dataclasses
import math

import torch

from dynatree_core.drafting.common import leaf_reason
from dynatree_core.drafting.tensor_tree import AT_DEPTH, DEPTH_GATE, EARLY_STOP, LEAF_REASONS, OVER_BUDGET
from dynatree_core.forward.kernels import KernelSwitch

MOST_CANDIDATES = 1024  # one program ranks at most this many (a level beyond it, rare, takes the torch form)
SWITCH = KernelSwitch("a level's admission kernel", "dynatree_core.drafting.triton_level", lambda d: check(d))


@dataclasses.dataclass(frozen=True)
class LeafGate:
    """Why an admitted candidate of a level is not expanded, as a leaf code (tensor_tree.LEAF_REASONS;
    0: it is): at the depth cap every one (`cap_code`); else the budget spent (total >= budget), then
    where dynatree gates depth (DynaTree Alg. 1 lines 17-25), below log rho_deep from level d0 on
    (`deep_from`) and below log rho_stop. -inf switches a threshold off. Its value where a candidate
    is not admitted is never read."""

    cap: int
    cap_code: int
    budget: int
    log_rho_stop: float = -math.inf
    log_rho_deep: float = -math.inf
    deep_from: int = 1 << 30

    def __call__(self, level: int, cum: torch.Tensor, total: torch.Tensor, *inputs) -> torch.Tensor:
        if level >= self.cap:
            return torch.full_like(cum, self.cap_code, dtype=torch.long)
        leaf = ((total >= self.budget) * OVER_BUDGET).expand(cum.shape)
        if level >= self.deep_from and self.log_rho_deep > -math.inf:
            leaf = torch.where(cum < self.log_rho_deep, DEPTH_GATE, leaf)
        if self.log_rho_stop > -math.inf:
            leaf = torch.where(cum < self.log_rho_stop, EARLY_STOP, leaf)
        return leaf

    def codes(self, level: int) -> tuple[int, float, float]:
        """What the kernel reads at `level`: the cap's code (0: not at the cap), log rho_stop, and
        log rho_deep where it applies (else -inf)."""
        deep = self.log_rho_deep if level >= self.deep_from else -math.inf
        return (self.cap_code if level >= self.cap else 0), self.log_rho_stop, deep


def enabled(device_type: str) -> bool:
    """Whether levels on this device type take the kernel (SWITCH: forward/kernels.KernelSwitch's
    rule: CUDA, Triton importable, DYNATREE_KERNELS not 0, the first check passed)."""
    return device_type in SWITCH.devices and SWITCH.enabled(device_type)


available = SWITCH.available  # whether its Triton program imports
admit_kernel_on = SWITCH.on  # levels on a device type take the kernel, as tests do (the CPU: the interpreter)


def most_probable_first(cum: torch.Tensor) -> torch.Tensor:
    """Candidate order: real candidates first (those that are not real hold NaN), by cumulative
    log-prob, highest first, ties in candidate order (the host's stable sort). One stable ascending
    sort of -cum, which places NaN last on every device; `0.0 - cum` makes no negative zero, whose
    place a device's sort may not keep."""
    return torch.sort(0.0 - cum, stable=True).indices


def fates(cum: torch.Tensor, log_tau: float, room: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Fates of candidates already in most-probable-first order (the papers' admit_level, kept in
    tests/reference_drafting.py, as tensors), and how many are admitted. The order runs admitted
    (the first `room` at or above log_tau), BUDGET (past the room), THRESHOLD (below log_tau),
    PADDING (not real: NaN), so a candidate's fate is the run its index falls in: one bucketize
    over the three run ends."""
    passing = (cum >= log_tau).sum()
    ends = torch.stack([torch.minimum(passing, room), passing, (cum == cum).sum()])
    return torch.bucketize(index, ends, right=True), ends[0]


def budget_gate(cap: int, policy_depth: int, budget: int) -> LeafGate:
    """The leaf rule of fixed_tree, linear and dyspec_threshold (DynaTree Alg. 1 lines 12, 22): the
    children at the depth cap are leaves (its depth limit, or the request's length limit below
    it: common.leaf_reason's, as its code), and so is every child of a level that spent the budget."""
    return LeafGate(cap, LEAF_REASONS.index(leaf_reason(cap, policy_depth)), budget)


def admit(
    tokens, lp, cum, rows, drafted, index, index64, *, log_tau: float, gate: LeafGate, level: int, record, kernel
):
    """The level's admission (module docstring): by the kernel with `kernel` (`enabled`, asked before
    any captured step: its first answer runs a check that drains the device), else as tensor ops."""
    if kernel and tokens.shape[0] <= MOST_CANDIDATES:
        return admit_level(tokens, lp, cum, rows, drafted, log_tau, gate.budget, *gate.codes(level), record)
    return admit_torch(tokens, lp, cum, rows, drafted, index, index64, log_tau, gate, level, record)


def admit_torch(tokens, lp, cum, rows, drafted, index, index64, log_tau: float, gate: LeafGate, level: int, record):
    """The level's admission as tensor ops (the kernel's reference): the candidates most probable
    first, their fates, leaf codes, the next level's rows' cumulative log-probs (NaN: not to
    expand), the (to expand, drafted) counts and, with `record`, the level's record to read."""
    n = tokens.shape[0]
    order = most_probable_first(cum)
    tokens, lp, cum, rows = tokens[order], lp[order], cum[order], rows[order]
    fate, admitted = fates(cum, log_tau, gate.budget - drafted, index[:n])
    total = drafted + admitted
    leaf = gate(level, cum, total)
    grows = (fate + leaf) == 0  # ADMITTED and EXPANDED: both codes 0
    count = torch.stack([grows.sum(), total])  # (to expand, drafted)
    width = min(n, gate.budget)  # the next level's rows: every node this one may admit
    # the record in one float64 row: a float64 part makes the cat promote, so no conversion follows
    flat = torch.cat([tokens, lp, rows, fate, leaf, index64[:width]]) if record else cum[:0]  # none: a view
    following = torch.where(grows[:width], cum[:width], math.nan)
    return tokens, lp, rows, fate, leaf, cum, following, total, count, flat


@torch.library.custom_op("dynatree::admit_level", mutates_args=())
def admit_level(
    tokens: torch.Tensor,
    lp: torch.Tensor,
    cum: torch.Tensor,
    rows: torch.Tensor,
    drafted: torch.Tensor,
    log_tau: float,
    budget: int,
    cap_code: int,
    log_rho_stop: float,
    log_rho_deep: float,
    record: bool,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
]:  # fmt: skip
    """admit_torch's outputs from one launch of triton_level.admit_level_kernel: the m candidates
    (tokens long, lp float32, cum float64, rows long) ranked in one program, a candidate written
    where its rank puts it."""
    outs = _outputs(tokens, lp, cum, budget, record)
    m, width = tokens.shape[0], outs[6].shape[0]
    block = _pow2(m)
    from dynatree_core.drafting.triton_level import admit_level_kernel

    admit_level_kernel[(1,)](
        tokens, lp, cum, rows, drafted, *outs,
        m, width, log_tau, budget, cap_code, log_rho_stop, log_rho_deep,
        M=block, CHUNK=min(block, 32), RECORD=record,
    )  # fmt: skip
    return outs


@admit_level.register_fake
def _(tokens, lp, cum, rows, drafted, log_tau, budget, cap_code, log_rho_stop, log_rho_deep, record):
    return _outputs(tokens, lp, cum, budget, record)


def _outputs(tokens, lp, cum, budget: int, record: bool) -> tuple[torch.Tensor, ...]:
    """admit_level's outputs, made (tokens, lp, rows, fate, leaf, cum, following, total, count, record)."""
    m = tokens.shape[0]
    width = min(m, budget)
    return (
        tokens.new_empty(m),
        lp.new_empty(m),
        tokens.new_empty(m),
        tokens.new_empty(m),
        tokens.new_empty(m),
        cum.new_empty(m),
        cum.new_empty(width),
        tokens.new_empty(()),  # the drafted total
        tokens.new_empty(2),
        cum.new_empty(5 * m + width if record else 0),
    )


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def check(device: torch.device) -> bool:
    """The kernel against the torch form on made-up levels full of ties, NaN (not real) and -inf,
    at and off the cap, under a threshold, a budget that binds and dynatree's gates: False, logged,
    where it raises or differs in any output (KernelSwitch.passes)."""
    gen = torch.Generator().manual_seed(0)
    return SWITCH.passes(device, lambda: all(_agrees(device, gen, case) for case in range(12)))


def _agrees(device: torch.device, gen: torch.Generator, case: int) -> bool:
    """One made-up level decided both ways (check's), every output equal (NaN where NaN)."""
    m = 1 + int(torch.randint(1, 90, (), generator=gen))
    cum = (torch.randint(0, 6, (m,), generator=gen).double() * -0.5).to(device)
    cum[torch.rand(m, generator=gen) < 0.2] = math.nan
    cum[torch.rand(m, generator=gen) < 0.1] = -math.inf
    tokens = torch.randint(0, 1000, (m,), generator=gen).to(device)
    lp = torch.randn(m, generator=gen).to(device)
    rows = torch.arange(m, device=device) // 3
    budget = int(torch.randint(1, 40, (), generator=gen))
    drafted = torch.tensor(int(torch.randint(0, budget, (), generator=gen)), device=device)
    gate = LeafGate(3, AT_DEPTH, budget, log_rho_stop=-2.0 if case % 2 else -math.inf, log_rho_deep=-1.0, deep_from=2)
    log_tau, level = (-1.5, -math.inf)[case % 2], 1 + case % 3
    index = torch.arange(m, device=device)
    args = (tokens, lp, cum, rows, drafted, index, index.double(), log_tau, gate, level, True)
    want = admit_torch(*args)
    got = admit_level(tokens, lp, cum, rows, drafted, log_tau, budget, *gate.codes(level), True)
    return all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in zip(got, want, strict=True))
