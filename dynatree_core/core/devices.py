"""Device and dtype names as users type them ("auto", "cuda:1", "bfloat16") -> torch objects.

Nothing here loads a model; a device that cannot be used here raises DynaTreeError with the fix.
"""

from __future__ import annotations

import torch

from dynatree_core.errors import DynaTreeError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str = "auto") -> torch.device:
    """'auto' picks cuda when available, else cpu. Any torch device string is accepted."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise DynaTreeError(f"unknown device {device!r} (use auto, cpu, cuda, cuda:N)") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise DynaTreeError(f"device {device!r} requested but CUDA is not available on this machine")
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """'auto' is bfloat16 on GPUs that support it, float32 elsewhere (exact greedy on CPU)."""
    if dtype == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if dtype not in DTYPES:
        raise DynaTreeError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]
