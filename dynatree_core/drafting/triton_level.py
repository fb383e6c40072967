"""The Triton program behind drafting/admit_kernel.py's op (imported only where it runs). Without a GPU
Triton only interprets: TRITON_INTERPRET=1 must be set before Triton is first imported (torch may
import it), as tests/conftest.py does; elsewhere this module refuses to load and the torch form stays.

One program decides a whole level: its candidates are few (the rows times k, a few hundred at
most), so it ranks them by comparing every pair in blocks, and writes each candidate where its rank
puts it. Cumulative log-probabilities stay float64 and are only compared, never summed, so the
decision is the torch form's exactly.
"""

import os

import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    raise ImportError("Triton runs without a GPU only in its interpreter: set TRITON_INTERPRET=1 before torch")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def admit_level_kernel(
    tok_ptr, lp_ptr, cum_ptr, row_ptr, drafted_ptr,
    tok_out, lp_out, row_out, fate_out, leaf_out, cum_out, follow_out, total_out, count_out, record_out,
    m, width, log_tau, budget, cap_code, log_rho_stop, log_rho_deep,
    M: tl.constexpr, CHUNK: tl.constexpr, RECORD: tl.constexpr,
):  # fmt: skip
    # the level's m candidates, each at its rank: real ones (not NaN) first, by cumulative
    # log-prob, highest first, ties in candidate order (admission.most_probable_first's order)
    i = tl.arange(0, M)
    inside = i < m
    cum = tl.load(cum_ptr + i, mask=inside, other=float("nan"))
    real = cum == cum
    rank = tl.zeros([M], dtype=tl.int32)
    for j0 in range(0, M, CHUNK):
        j = j0 + tl.arange(0, CHUNK)
        other = tl.load(cum_ptr + j, mask=j < m, other=float("nan"))
        known = other == other
        earlier = j[:, None] < i[None, :]
        higher = (other[:, None] > cum[None, :]) | ((other[:, None] == cum[None, :]) & earlier)
        nan_tie = (~known[:, None]) & (~real[None, :]) & earlier
        first = known[:, None] & ((~real[None, :]) | higher)
        rank += tl.sum(((first | nan_tie) & (j < m)[:, None]).to(tl.int32), axis=0)
    # the fates (admission.fates): admitted while the room lasts, then BUDGET, THRESHOLD, PADDING
    passing = tl.sum((inside & real & (cum >= log_tau)).to(tl.int32), axis=0)
    reals = tl.sum((inside & real).to(tl.int32), axis=0)
    drafted = tl.load(drafted_ptr)
    admitted = tl.minimum(passing, (budget - drafted).to(tl.int32))
    fate = (rank >= admitted).to(tl.int32) + (rank >= passing).to(tl.int32) + (rank >= reals).to(tl.int32)
    total = drafted + admitted
    # the leaf codes (admit_kernel.LeafGate): the cap's, else the budget spent, dynatree's gates
    leaf = tl.where(total >= budget, 3, 0)  # OVER_BUDGET
    leaf = tl.where(cum < log_rho_deep, 5, leaf)  # DEPTH_GATE
    leaf = tl.where(cum < log_rho_stop, 4, leaf)  # EARLY_STOP
    leaf = tl.where(cap_code > 0, cap_code, leaf)
    grows = (fate + leaf) == 0
    tok = tl.load(tok_ptr + i, mask=inside)
    tl.store(tok_out + rank, tok, mask=inside)
    lp = tl.load(lp_ptr + i, mask=inside)
    tl.store(lp_out + rank, lp, mask=inside)
    row = tl.load(row_ptr + i, mask=inside)
    tl.store(row_out + rank, row, mask=inside)
    tl.store(fate_out + rank, fate.to(tl.int64), mask=inside)
    tl.store(leaf_out + rank, leaf.to(tl.int64), mask=inside)
    tl.store(cum_out + rank, cum, mask=inside)
    tl.store(follow_out + rank, tl.where(grows, cum, float("nan")), mask=inside & (rank < width))
    tl.store(count_out, tl.sum((inside & grows).to(tl.int64), axis=0))
    tl.store(count_out + 1, total.to(tl.int64))
    tl.store(total_out, total.to(tl.int64))
    if RECORD:  # the level's record (tensor_tree.Level.record): tokens, logp, rows, fate, leaf, 0 .. width - 1
        tl.store(record_out + rank, tok.to(tl.float64), mask=inside)
        tl.store(record_out + m + rank, lp.to(tl.float64), mask=inside)
        tl.store(record_out + 2 * m + rank, row.to(tl.float64), mask=inside)
        tl.store(record_out + 3 * m + rank, fate.to(tl.float64), mask=inside)
        tl.store(record_out + 4 * m + rank, leaf.to(tl.float64), mask=inside)
        tl.store(record_out + 5 * m + i, i.to(tl.float64), mask=i < width)
