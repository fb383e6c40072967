"""Pre-packed linear layers for CPU inference (docs/benchmark-log.md, "Profiling and making the engine fast").

On CPU, `F.linear` hands each call to a GEMM that re-packs the weight into its blocked layout
every time. For one token that is a cheap GEMV, but a forward over 2-16 tokens (a tree
verification, a draft level) pays for that re-packing on every call. oneDNN can reorder a weight
once and reuse it: `torch.ops.mkldnn._reorder_linear_weight` + `_linear_pointwise` (the pair
torch.compile's CPU freezing pass uses) take and return dense activations, so nothing is
converted per call. What it saves: BENCHMARKS.md, "The engine: forwards, ...", and the log.

`PackedLinear` keeps only the packed copy (no extra memory, except where a weight was tied: the
input embedding keeps its own dense copy). Code that reads `.weight` gets a dense copy on demand.
Outputs differ from `nn.Linear` only by float rounding (the accumulation order changes); greedy
exactness is always judged against AR decoding with the same (packed) model.
"""

from __future__ import annotations

import functools

import torch

from dynatree_core.core.settings import env_on


def linear_dtype(linear: torch.nn.Module) -> torch.dtype:
    """A linear layer's weight dtype, packed or not, without copying a packed weight."""
    return linear.dense_dtype if isinstance(linear, PackedLinear) else linear.weight.dtype


class PackedLinear(torch.nn.Module):
    """An `nn.Linear` whose weight lives in oneDNN's packed layout (CPU, float32 / bfloat16)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, None), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone(), persistent=False)
        self.dense_dtype = weight.dtype

    @property
    def weight(self) -> torch.Tensor:
        """A dense copy (for code that reads the weight, e.g. building a full-vocabulary head): a
        copy per read, so never read it for its dtype (`linear_dtype`)."""
        return self.packed.to_dense(self.dense_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def __deepcopy__(self, memo):  # oneDNN tensors have no storage to copy
        linear = torch.nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        linear = linear.to(self.dense_dtype)
        with torch.no_grad():
            linear.weight.copy_(self.weight)
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return PackedLinear(linear)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def packing_enabled(device: torch.device, dtype: torch.dtype) -> bool:
    """CPU, float32 or bfloat16, oneDNN present, and not switched off with DYNATREE_PACK=0."""
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and env_on("DYNATREE_PACK")
        and _packs(dtype)
    )


@functools.cache
def _packs(dtype: torch.dtype) -> bool:
    """oneDNN packs this dtype on this CPU: its bfloat16 path needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT
    and raises without them (a CPU with AVX512-BF16 as torch's cpuinfo reads it may still lack them)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), None)
    except RuntimeError:
        return False
    return True


@torch.no_grad()
def pack_linears(model: torch.nn.Module) -> int:
    """Replace every `nn.Linear` of an inference model by a `PackedLinear`; return how many."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(module, name, PackedLinear(child))
                count += 1
    if count and getattr(model.config, "tie_word_embeddings", False):
        model.config.tie_word_embeddings = False  # the head is its own (packed) copy now: never re-tie
    model._dynatree_packed = count
    return count


def is_packed(model: torch.nn.Module) -> bool:
    return bool(getattr(model, "_dynatree_packed", 0))
