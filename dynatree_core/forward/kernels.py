"""Fused kernels for the lean forward on a GPU (Triton): fewer launches, each row on its own.

A small model's forward on a GPU is launch-bound (docs/gpu.md): a layer of the
bfloat16 width-invariant forward launched 20 kernels, 8 of them its fixed-shape attention
(static_rows.py), 3 the rotation and 2 `silu` and its product. Here each of those is one or two
Triton kernels whose programs each compute one row (or one row's block of keys) with the same
code, block sizes and reduction order whatever the number of rows in the launch, so a row's bits
never depend on its neighbours: width invariance by construction, for float32 and bfloat16 alike
(docs/engine.md, "Width invariance at fixed shapes"). Every product and sum runs in float32; a
result is rounded to the model's dtype once.

- `static_attention`: each row over its `span` gathered slots (StaticRows: the run's visible
  slots in sequence order, then padding that `tail` masks). Split-KV (flash-decoding): one program
  per (row, key head, block of BLOCK_KEYS slots) scores its block against the head's query group
  and keeps its max, sum and weighted values; a second program per (row, key head) merges the
  blocks in block order. Two launches where the torch form took eight.
- `rotate_`: RoPE on q and k in place, `x * cos + roll(x, d/2) * signed_sin` (fastpath._rotate's
  formula, rounded once): one launch where it took three.
- `silu_mul`: silu(gate) * up from the fused gate/up output: one launch where it took two.

Each is a torch custom op (`dynatree::...`), so dispatch modes (measure/launches.py, the kernel
counts of benchmarks/forward_kernels.py) see it as one launch. They run where `enabled` says:
on CUDA when Triton imports and a first check against the torch forms passes (`check`; a failure
is logged and the torch forms stay), never under autograd. On a machine without a GPU Triton runs
them in its interpreter (TRITON_INTERPRET=1): `kernel_forms(on="cpu")` is how the tests run the
GPU's kernels here.

Contract: knows tensors; never models, trees or policies.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from dynatree_core.core.log import log_exception, log_info
from dynatree_core.core.settings import env_on

BLOCK_KEYS = 32  # slots per program of the attention's first pass (a span is a power of two >= 256)
SILU_BLOCK = 1024  # columns per program of silu * up


class KernelSwitch:
    """Where one family of Triton kernels runs (this module's, drafting/admission.py's): on a device
    type of `devices` (CUDA), where its Triton program module imports, DYNATREE_KERNELS is not 0
    and `check(device)` against its torch form passed, run once per device type, outside any
    capture. `on(device_type)` adds a device type as tests do (the CPU: Triton's interpreter)."""

    def __init__(self, what: str, program: str, check: Callable[[torch.device], bool]):
        self.what, self.program, self.check = what, program, check
        self.devices: tuple[str, ...] = ("cuda",)
        self.verdicts: dict[str, bool] = {}  # device type -> whether the kernels passed their check there

    def available(self) -> bool:
        """Whether the Triton program imports (no Triton, or no interpreter without a GPU: no)."""
        return _imports(self.program)

    def enabled(self, device_type: str) -> bool:
        if device_type not in self.devices or not self.available() or not env_on("DYNATREE_KERNELS"):
            return False
        if device_type not in self.verdicts:
            if device_type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"{self.what}: checked first under stream capture (run it once before capturing)")
            self.verdicts[device_type] = self.check(torch.device(device_type))
        return self.verdicts[device_type]

    def passes(self, device: torch.device, agrees: Callable[[], bool]) -> bool:
        """A check's verdict: `agrees()`, False (logged) where it raises or disagrees; on CUDA the
        device is drained inside it, so a kernel's fault surfaces here."""
        try:
            ok = agrees()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except Exception as exc:  # noqa: BLE001 - any failure means the torch forms
            log_exception(f"{self.what} on {device}: the torch forms stay", exc)
            return False
        if not ok:
            log_info("%s on %s: a kernel disagrees with its torch form; the torch forms stay", self.what, device)
        return ok

    @contextlib.contextmanager
    def on(self, device_type: str) -> Iterator[None]:
        saved = self.devices, dict(self.verdicts)
        self.devices, self.verdicts[device_type] = (*self.devices, device_type), True
        try:
            yield
        finally:
            self.devices = saved[0]
            self.verdicts.clear()
            self.verdicts.update(saved[1])


@functools.cache
def _imports(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


FORWARD = KernelSwitch("the lean forward's kernels", "dynatree_core.forward.triton_kernels", lambda d: check(d))


def enabled(device_type: str) -> bool:
    """Whether forwards on this device type take the kernels (FORWARD: KernelSwitch's rule)."""
    return FORWARD.enabled(device_type)


@contextlib.contextmanager
def kernel_forms(on: str, block_keys: int = BLOCK_KEYS) -> Iterator[None]:
    """Forwards on device type `on` take the kernels (the CPU: in Triton's interpreter), as tests
    do; `block_keys`: slots per attention program (the interpreter runs one program at a time, so
    tests of whole runs take fewer, larger blocks)."""
    global BLOCK_KEYS
    saved = BLOCK_KEYS
    BLOCK_KEYS = block_keys
    try:
        with FORWARD.on(on):
            yield
    finally:
        BLOCK_KEYS = saved


def check(device: torch.device) -> bool:
    """Each kernel against its torch form on small random inputs, in float32 (within 1e-4) and in
    bfloat16 (the torch form in float32 on the same rounded inputs, within 2e-2): False, logged,
    where one raises (a Triton too old for the code, a driver it cannot compile for) or disagrees.
    On CUDA the device is drained inside the check, so a kernel's fault surfaces here."""
    gen = torch.Generator().manual_seed(0)
    return FORWARD.passes(
        device, lambda: all([_agrees(device, torch.float32, 1e-4, gen), _agrees(device, torch.bfloat16, 2e-2, gen)])
    )


def _agrees(device: torch.device, dtype: torch.dtype, tol: float, gen: torch.Generator) -> bool:
    """check's comparisons in one dtype; the torch forms run in float32 on the same inputs."""
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)  # noqa: E731
    close = lambda got, want: torch.allclose(got.float(), want, atol=tol, rtol=tol)  # noqa: E731
    q, k, v = rand(1, 6, 5, 64), rand(1, 2, 300, 64), rand(1, 2, 300, 64)
    slots = torch.randint(0, 300, (5, 256), generator=gen).to(device)
    tail = torch.zeros(5, 256).masked_fill_(torch.arange(256) >= 200, float("-inf")).to(device)
    k32, v32 = k[0].float(), v[0].float()
    scores = torch.einsum("hgwd,hwsd->hgws", q[0].float().view(2, 3, 5, 64), k32[:, slots]) * 0.125 + tail
    want = torch.einsum("hgws,hwsd->hgwd", scores.softmax(-1), v32[:, slots]).reshape(1, 6, 5, 64)
    x, cos, sin = rand(1, 4, 5, 64), rand(1, 1, 5, 64), rand(1, 1, 5, 64)
    turned = x.float() * cos.float() + x.float().roll(32, -1) * sin.float()  # fastpath._rotate
    gate_up = rand(1, 5, 96)
    silu = F.silu(gate_up[..., :48].float()) * gate_up[..., 48:].float()
    return (
        close(static_attention(q, k[0], v[0], slots, tail, 0.125), want)
        and close(rotated(x.clone(), cos, sin), turned)
        and close(silu_mul(gate_up), silu)
    )


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@torch.library.custom_op("dynatree::attention_parts", mutates_args=())
def _attention_parts(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, tail: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first pass: per (row, key head, block) the max, weight sum and weighted values."""
    _, heads, width, d = q.shape
    kv_heads, span = keys.shape[0], slots.shape[1]
    groups, g, dp = heads // kv_heads, _pow2(heads // kv_heads), _pow2(d)
    blocks = -(-span // BLOCK_KEYS)
    m = q.new_empty(width, kv_heads, blocks, g, dtype=torch.float32)
    weights, acc = torch.empty_like(m), q.new_empty(width, kv_heads, blocks, g, dp, dtype=torch.float32)
    from dynatree_core.forward.triton_kernels import attention_part

    attention_part[(width, kv_heads, blocks)](
        q, keys, values, slots, tail, m, weights, acc,
        q.stride(2), q.stride(1), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        slots.stride(0), tail.stride(0), scale, span,
        GROUPS=groups, G=g, D=d, DP=dp, BLOCK=BLOCK_KEYS,
    )  # fmt: skip
    return m, weights, acc


@_attention_parts.register_fake
def _(q, keys, values, slots, tail, scale):
    width, kv_heads, blocks = q.shape[2], keys.shape[0], -(-slots.shape[1] // BLOCK_KEYS)
    g, dp = _pow2(q.shape[1] // kv_heads), _pow2(q.shape[3])
    m = q.new_empty(width, kv_heads, blocks, g, dtype=torch.float32)
    return m, torch.empty_like(m), q.new_empty(width, kv_heads, blocks, g, dp, dtype=torch.float32)


@torch.library.custom_op("dynatree::attention_merge", mutates_args=("out",))
def _attention_merge_op(m: torch.Tensor, weights: torch.Tensor, acc: torch.Tensor, out: torch.Tensor) -> None:
    """The second pass: each (row, key head)'s blocks merged, into out (width, heads, d)."""
    width, kv_heads, blocks, g = m.shape
    heads, d = out.shape[1], out.shape[2]
    from dynatree_core.forward.triton_kernels import attention_merge

    attention_merge[(width, kv_heads)](
        m, weights, acc, out, out.stride(0), out.stride(1), blocks,
        GROUPS=heads // kv_heads, G=g, D=d, DP=acc.shape[-1], BP=_pow2(blocks),
    )  # fmt: skip


def static_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, tail: torch.Tensor, scale: float
) -> torch.Tensor:
    """static_rows.static_sequence_attention in two launches: q (1, heads, W, d), keys / values
    (kv_heads, S, d) (any strides, head_dim contiguous), slots / tail (>= W, span) -> (1, heads, W,
    d), a view of (1, W, heads * d) rows."""
    _, heads, width, d = q.shape
    if q.stride(-1) != 1 or keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("static_attention: head_dim must be contiguous in q, keys and values")
    out = q.new_empty(width, heads, d)
    _attention_merge_op(*_attention_parts(q, keys, values, slots, tail, scale), out)
    return out.view(1, width, heads, d).transpose(1, 2)


@torch.library.custom_op("dynatree::rotate_", mutates_args=("x",))
def rotate_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
    """fastpath._rotate written over x (B, heads, q, d) (head_dim contiguous); cos and signed_sin
    (B, 1, q, d) from fastpath.rope_pair."""
    b, heads, rows, d = x.shape
    from dynatree_core.forward.triton_kernels import rotate_kernel

    batch = lambda t: t.stride(0) if t.shape[0] > 1 else 0  # noqa: E731 - one cos/sin for every batch row
    rotate_kernel[(b * rows,)](
        x, cos, signed_sin, x.stride(0), x.stride(1), x.stride(2), batch(cos), cos.stride(2),
        batch(signed_sin), signed_sin.stride(2), rows, heads, D=d, HALF=_pow2(d // 2), HP=_pow2(heads),
    )  # fmt: skip


def rotated(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """rotate_ as a function: x, rotated in place, returned (fastpath's rotation forms' signature)."""
    rotate_(x, cos, signed_sin)
    return x


@torch.library.custom_op("dynatree::silu_mul", mutates_args=())
def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up (..., 2 * size), its last dimension contiguous -> (..., size)."""
    size = gate_up.shape[-1] // 2
    flat = gate_up.reshape(-1, 2 * size)
    out = gate_up.new_empty(*gate_up.shape[:-1], size)
    from dynatree_core.forward.triton_kernels import silu_mul_kernel

    silu_mul_kernel[(flat.shape[0], -(-size // SILU_BLOCK))](flat, out, flat.stride(0), size, BLOCK=SILU_BLOCK)
    return out


@silu_mul.register_fake
def _(gate_up):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
