"""What a result was measured on: the hardware and library fingerprint every report records.

Kept at the bottom of the layering (it reads /proc/cpuinfo and library versions, nothing of the
engine), so the dtype choice store, the benchmarks and the CLI all take it from one place.
"""

from __future__ import annotations

import functools
import os
import platform
from typing import Any

from dynatree_core.core.cache_dir import cache_dir
from dynatree_core.core.threads import threads_source


@functools.cache
def cpu_info() -> tuple[str, list[str]]:
    """(the CPU's model name, its feature flags) from /proc/cpuinfo; the platform's name elsewhere."""
    cpu, flags = platform.processor() or "unknown", ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            info = f.read()
        cpu = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), cpu)
        flags = next((ln for ln in info.splitlines() if ln.startswith("flags")), "")
    except OSError:
        pass
    return cpu, flags.split()


def portable(text: str, *, cache: bool = False) -> str:
    """`text` with this machine's paths made portable: the repository root dropped (paths become
    relative to it) and the home directory written as ~ (what reports record). `cache`: paths under
    the project's cache root ($DYNATREE_CACHE, default ~/.cache/dynatree) relative to that root too,
    `draft-runs/long-feature/draft` (what a shipped model card records: a run's name, not where this
    machine keeps it)."""
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2]) + os.sep
    text = text.replace(root, "").replace(str(Path.home()) + os.sep, "~" + os.sep)
    return text.replace(portable(str(cache_dir().expanduser().absolute())) + os.sep, "") if cache else text


def environment(
    device: str, dtype: str, packed: bool = False, dtype_source: str = "", *, forward_path: str = ""
) -> dict[str, Any]:
    """What a result was measured on: hardware, library versions, threads (and where that number
    came from), device, dtype, whether the linear layers ran pre-packed for oneDNN (core/packing.py)
    and how forwards ran (choice.forward_path: lean / static / dynamic)."""
    import torch
    import transformers

    cpu, flags = cpu_info()
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "amx_bf16": "amx_bf16" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
        "threads_source": threads_source(),
        "forward_path": forward_path,
        "device": device,
        "dtype": dtype,
        "dtype_source": dtype_source,  # asked / probe (a saved `dtype` probe) / rule (auto's static rule)
        "packed_linears": packed,
        "platform": platform.platform(),
    }
