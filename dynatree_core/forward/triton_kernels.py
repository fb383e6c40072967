"""The Triton programs behind forward/kernels.py's ops (imported only where they run). Without a GPU
Triton only interprets: TRITON_INTERPRET=1 must be set before Triton is first imported (torch may
import it), as tests/conftest.py does; elsewhere this module refuses to load and the torch forms stay.

Every program computes one row (or one row's block of keys) with the same code, block sizes and
reduction order whatever the number of programs in the launch: a row's bits never depend on the
rows beside it. Products and sums in float32; results rounded to the output's dtype once.
"""

import os

import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    raise ImportError("Triton runs without a GPU only in its interpreter: set TRITON_INTERPRET=1 before torch")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def attention_part(
    q_ptr, k_ptr, v_ptr, slot_ptr, tail_ptr, m_ptr, l_ptr, acc_ptr,
    sq_w, sq_h, sk_h, sk_s, sv_h, sv_s, s_row, t_row, scale, span,
    GROUPS: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # one (row, key head, block of slots): its scores, their max, the sum of their weights and
    # the weighted values (float32), for attention_merge
    row, head, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    blocks, heads = tl.num_programs(2), tl.num_programs(1)
    g, d = tl.arange(0, G), tl.arange(0, DP)
    n = block * BLOCK + tl.arange(0, BLOCK)
    in_g, in_d, in_n = g < GROUPS, d < D, n < span
    q = tl.load(
        q_ptr + row * sq_w + (head * GROUPS + g)[:, None] * sq_h + d[None, :],
        mask=in_g[:, None] & in_d[None, :], other=0.0,
    ).to(tl.float32)  # fmt: skip
    slot = tl.load(slot_ptr + row * s_row + n, mask=in_n, other=0)
    tail = tl.load(tail_ptr + row * t_row + n, mask=in_n, other=float("-inf"))
    kv_mask = in_n[:, None] & in_d[None, :]
    k = tl.load(k_ptr + head * sk_h + slot[:, None] * sk_s + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
    scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale + tail[None, :]  # (G, BLOCK)
    m = tl.max(scores, axis=1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # a block of padding only: weights 0, not NaN
    p = tl.exp(scores - m_safe[:, None])
    v = tl.load(v_ptr + head * sv_h + slot[:, None] * sv_s + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
    acc = tl.sum(p[:, :, None] * v[None, :, :], axis=1)  # (G, DP)
    at = (row * heads + head) * blocks + block
    tl.store(m_ptr + at * G + g, m)
    tl.store(l_ptr + at * G + g, tl.sum(p, axis=1))
    tl.store(acc_ptr + (at * G + g)[:, None] * DP + d[None, :], acc)


@triton.jit
def attention_merge(
    m_ptr, l_ptr, acc_ptr, out_ptr, so_w, so_h, blocks,
    GROUPS: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BP: tl.constexpr,
):  # fmt: skip
    # one (row, key head): its blocks' parts merged in block order (the same for every width)
    row, head, heads = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    b, g, d = tl.arange(0, BP), tl.arange(0, G), tl.arange(0, DP)
    at = ((row * heads + head) * blocks + b)[:, None] * G + g[None, :]  # (BP, G)
    in_b = (b < blocks)[:, None]
    m = tl.load(m_ptr + at, mask=in_b, other=float("-inf"))
    top = tl.max(m, axis=0)  # (G,): finite, every row sees its first slot
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - top[None, :]))
    total = tl.sum(w * tl.load(l_ptr + at, mask=in_b, other=0.0), axis=0)
    acc = tl.load(acc_ptr + at[:, :, None] * DP + d[None, None, :], mask=in_b[:, :, None], other=0.0)
    out = tl.sum(w[:, :, None] * acc, axis=0) / total[:, None]  # (G, DP)
    where = out_ptr + row * so_w + (head * GROUPS + g)[:, None] * so_h + d[None, :]
    tl.store(where, out.to(out_ptr.dtype.element_ty), mask=(g < GROUPS)[:, None] & (d < D)[None, :])


@triton.jit
def rotate_kernel(
    x_ptr, cos_ptr, sin_ptr, sx_b, sx_h, sx_q, sc_b, sc_q, ss_b, ss_q, rows, heads,
    D: tl.constexpr, HALF: tl.constexpr, HP: tl.constexpr,
):  # fmt: skip
    # one (batch row, position), every head: x * cos + roll(x, D / 2) * signed_sin, written over x.
    # Each half is loaded as its own tensor of one shape, so the thread that writes element j and
    # j + D / 2 is the one that read both (no thread reads what another writes: no barrier needed)
    at = tl.program_id(0)
    b, r = at // rows, at % rows
    h, j = tl.arange(0, HP), tl.arange(0, HALF)
    inside = (h < heads)[:, None] & (j < D // 2)[None, :]
    lo_ptr = x_ptr + b * sx_b + r * sx_q + h[:, None] * sx_h + j[None, :]
    hi_ptr = lo_ptr + D // 2
    lo = tl.load(lo_ptr, mask=inside, other=0.0).to(tl.float32)
    hi = tl.load(hi_ptr, mask=inside, other=0.0).to(tl.float32)
    c, s = cos_ptr + b * sc_b + r * sc_q + j, sin_ptr + b * ss_b + r * ss_q + j
    half = j < D // 2
    cos_lo = tl.load(c, mask=half, other=0.0).to(tl.float32)[None, :]
    cos_hi = tl.load(c + D // 2, mask=half, other=0.0).to(tl.float32)[None, :]
    sin_lo = tl.load(s, mask=half, other=0.0).to(tl.float32)[None, :]
    sin_hi = tl.load(s + D // 2, mask=half, other=0.0).to(tl.float32)[None, :]
    tl.store(lo_ptr, (lo * cos_lo + hi * sin_lo).to(x_ptr.dtype.element_ty), mask=inside)
    tl.store(hi_ptr, (hi * cos_hi + lo * sin_hi).to(x_ptr.dtype.element_ty), mask=inside)


@triton.jit
def silu_mul_kernel(in_ptr, out_ptr, s_in, size, BLOCK: tl.constexpr):
    # one (row, block of columns): silu(gate) * up, gate and up the row's two halves
    row, block = tl.program_id(0), tl.program_id(1)
    c = block * BLOCK + tl.arange(0, BLOCK)
    inside = c < size
    gate = tl.load(in_ptr + row * s_in + c, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(in_ptr + row * s_in + size + c, mask=inside, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * size + c, out.to(out_ptr.dtype.element_ty), mask=inside)
