"""Published EAGLE heads read into this project's head kinds, and a fused draft written in their layout.

Four layouts (shared/EAGLE_LAYOUTS.md, read from the sources it names):

    eagle1      SafeAILab EAGLE-1 (yuhuili/EAGLE-*): a one-layer LlamaConfig, `fc` [H, 2H] over
                [embedding ; the target's final post-norm state] (bias per the config's "bias", default
                true), `layers.0.*` WITHOUT input_layernorm, no norm, the target's LM head -> the
                feature kind (feature.py) with no input norm and the target's full vocabulary
    eagle3      SafeAILab EAGLE-3 (yuhuili/EAGLE3-*) and SpecForge: a flat LlamaConfig with
                `draft_vocab_size`, `fc` [H, 3H] (no bias), `midlayer.*`, `norm`, `lm_head` [D, H],
                `d2t` (draft slot -> offset to the target id), `t2d`; taps: SafeAILab hard-codes inputs
                of layers 2, L/2, L-3; SpecForge may name them in `eagle_config.eagle_aux_hidden_state_layer_ids`
                in SGLang's convention (the OUTPUT of layer i = tap i + 1); optional `fc_norm.{i}`
                (EAGLE 3.1) -> the fused kind (fused.py)
    speculators vLLM speculators EAGLE-3: `speculators_model_type` "eagle3", the layer config nested in
                `transformer_layer_config`, weights `layers.0.*` instead of `midlayer.*`, top-level
                `eagle_aux_hidden_state_layer_ids` in vLLM's convention (the INPUT of layer i = tap i),
                `norm_before_residual`, optional `fc_norm.{i}` or `input_norm` [3H] -> the fused kind

A head is recognised by its files, not its architecture string (both `LlamaForCausalLM` and
`LlamaForCausalLMEagle3` occur in the wild). It is checked against the target at load: width,
vocabulary, the layers it reads; a head of more than one layer is refused (not supported here).
`export_eagle3` writes a fused draft in the eagle3 layout with both engines' layer-id keys.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from dynatree_core.core.taps import check_taps, eagle3_taps, from_output_ids
from dynatree_core.core.vocab import TokenMap
from dynatree_core.drafting.feature import FeatureDraft
from dynatree_core.drafting.fused import FusedDraft, check_fits
from dynatree_core.errors import DynaTreeError

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def _weights(path: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        if (path / name).is_file():
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(path / name))
            return torch.load(path / name, map_location="cpu", weights_only=True)
    raise DynaTreeError(f"{path}: no {' or '.join(WEIGHT_FILES)} beside config.json")


def layout_of(path: str | Path) -> str | None:
    """ "eagle1", "eagle3", "speculators", or None for a directory that holds no published head."""
    path = Path(path).expanduser()
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or not any((path / n).is_file() for n in WEIGHT_FILES):
        return None
    if config.get("speculators_model_type") == "eagle3":
        return "speculators"
    if "draft_vocab_size" in config:
        return "eagle3"
    if config.get("num_hidden_layers") == 1 and not (path / "tokenizer_config.json").exists():
        return "eagle1"  # a one-layer Llama config without a tokenizer: a head, not a model
    return None


def is_published_head_dir(spec: str | None) -> bool:
    return bool(spec) and layout_of(spec) is not None


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
HEAD_FILES = ["*.json", "*.safetensors", "*.bin"]  # a head's config and weights (and a tokenizer's json, if any)


def _could_be_head(config: dict) -> bool:
    """What a published head's config.json says before its weights are fetched (layout_of decides after)."""
    return (
        config.get("speculators_model_type") == "eagle3"
        or "draft_vocab_size" in config
        or config.get("num_hidden_layers") == 1
    )


def hub_head_dir(spec: str | None) -> Path | None:
    """The local directory of a published head named by a hub id ("org/name"): downloaded when the
    hub answers, else read from the local Hugging Face cache (offline: a warm cache). None when
    `spec` is a path, is not within reach, or names a model that is not a head (the caller then
    loads it as a standalone draft LM, whose loader gives the clear offline error). Only the
    config is fetched before the answer is known; a head's weights after."""
    if not spec or not HUB_ID.match(spec) or Path(spec).expanduser().exists():
        return None
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import EntryNotFoundError, GatedRepoError

    from dynatree_core.core.models import hub_reachable

    offline = not hub_reachable()
    try:
        config = json.loads(Path(hf_hub_download(spec, "config.json", local_files_only=offline)).read_text())
        if not isinstance(config, dict) or not _could_be_head(config):
            return None
        path = Path(snapshot_download(spec, allow_patterns=HEAD_FILES, local_files_only=offline))
    except GatedRepoError as exc:
        raise DynaTreeError(
            f"{spec}: the hub refuses access (a gated repository: log in with `hf auth login`)"
        ) from exc
    except (OSError, ValueError, EntryNotFoundError):  # not cached offline, no such repo, no config: not a head
        return None
    return path if layout_of(path) else None


def load_published(spec: str | Path, target: torch.nn.Module) -> FeatureDraft | FusedDraft:
    """The published head in directory `spec`, attached to `target` (DynaTreeError when it does not fit)."""
    path = Path(spec).expanduser()
    layout = layout_of(path)
    if layout is None:
        raise DynaTreeError(f"{path} holds no EAGLE head this project reads (config.json + weights)")
    config = json.loads((path / "config.json").read_text())
    state = _weights(path)
    if layout == "eagle1":
        return _eagle1(path, config, state, target)
    return _eagle3(path, config, state, target, speculators=layout == "speculators")


def _llama_config(fields: dict):
    from transformers import LlamaConfig

    known = LlamaConfig().to_dict().keys() | {"rope_theta", "rope_scaling", "head_dim"}
    config = LlamaConfig(**{k: v for k, v in fields.items() if k in known})
    if config.num_hidden_layers != 1:
        raise DynaTreeError(f"heads of {config.num_hidden_layers} decoder layers are not supported (one layer only)")
    return config


def _check_vocab(path: Path, vocab: int, target: torch.nn.Module) -> None:
    want = target.config.get_text_config(decoder=True).vocab_size
    if vocab != want:
        raise DynaTreeError(f"the head in {path} is for a vocabulary of {vocab} tokens; the target's has {want}")


def _eagle1(path: Path, fields: dict, state: dict, target: torch.nn.Module) -> FeatureDraft:
    config = _llama_config(fields)
    check_fits(config.hidden_size, (), target, where=str(path))
    _check_vocab(path, config.vocab_size, target)
    draft = FeatureDraft.from_target(target, None, intermediate_size=config.intermediate_size, input_norm=False)
    own = draft.lm.config
    for name in ("num_attention_heads", "num_key_value_heads", "rope_theta"):
        if getattr(config, name, None) != getattr(own, name, None):
            raise DynaTreeError(
                f"{path}: {name} {getattr(config, name, None)} differs from the target's {getattr(own, name, None)}"
            )
    hidden = config.hidden_size
    layer = {k.removeprefix("layers.0."): v for k, v in state.items() if k.startswith("layers.0.")}
    weights = {f"model.layers.0.{k}": v for k, v in layer.items()}
    fc = {"weight": state["fc.weight"], "bias": state.get("fc.bias", torch.zeros(hidden))}
    if fc["weight"].shape != (hidden, 2 * hidden):
        raise DynaTreeError(f"{path}: fc.weight is {tuple(fc['weight'].shape)}, EAGLE-1 has ({hidden}, {2 * hidden})")
    _load(draft.lm, weights, path)
    draft.fc.load_state_dict({k: v.to(draft.fc.weight.dtype) for k, v in fc.items()})
    _own_embedding(draft, state)
    return draft.to(dtype=target.dtype).eval()


def _load(module: torch.nn.Module, weights: dict, path: Path) -> None:
    """Load `weights` (names relative to `module`) over its own, refusing a missing or extra tensor."""
    own = module.state_dict()
    missing = [
        k for k in own if k not in weights and "embed_tokens" not in k and "lm_head" not in k and "rotary" not in k
    ]
    extra = [k for k in weights if k not in own]
    if missing or extra:
        raise DynaTreeError(
            f"{path}: the weights do not match the layout (missing {missing[:3]}, unexpected {extra[:3]})"
        )
    for k, v in weights.items():
        if own[k].shape != v.shape:
            raise DynaTreeError(f"{path}: {k} is {tuple(v.shape)}, expected {tuple(own[k].shape)}")
    module.load_state_dict({k: v.to(own[k].dtype) for k, v in weights.items()}, strict=False)


def _own_embedding(draft, state: dict) -> None:
    """A head that saved its embedding reads through it (published heads save the target's own copy)."""
    weight = state.get("embed_tokens.weight")
    if weight is not None and weight.shape == draft.embed.weight.shape:
        object.__setattr__(draft, "embed", torch.nn.Embedding.from_pretrained(weight.to(draft.dtype), freeze=True))


def _eagle3(path: Path, fields: dict, state: dict, target: torch.nn.Module, *, speculators: bool) -> FusedDraft:
    n_layers = target.config.get_text_config(decoder=True).num_hidden_layers
    if speculators:
        layer_fields = dict(fields.get("transformer_layer_config") or {})
        config = _llama_config(layer_fields)
        ids = fields.get("eagle_aux_hidden_state_layer_ids")
        taps = tuple(ids) if ids else eagle3_taps(n_layers)  # vLLM: id i = the input of layer i
        prefix = "layers.0."
    else:
        config = _llama_config(fields)
        ids = (fields.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        taps = from_output_ids(ids) if ids else eagle3_taps(n_layers)  # SGLang: id i = the output of layer i
        prefix = "midlayer."
    hidden = int(fields.get("target_hidden_size") or config.hidden_size)
    check_fits(hidden, taps, target, where=str(path))
    taps = check_taps(taps, n_layers)
    vocab = int(config.vocab_size)
    _check_vocab(path, vocab, target)
    rows = state["lm_head.weight"]
    offsets = state.get(
        "d2t", torch.zeros(rows.shape[0], dtype=torch.long)
    )  # no d2t: the draft's vocabulary is the target's
    ids = torch.arange(len(offsets)) + offsets.long()  # d2t: target id = draft slot + offset
    if ids.min() < 0 or ids.max() >= vocab or len(set(ids.tolist())) != len(ids):
        raise DynaTreeError(f"{path}: d2t maps draft slots outside the target's vocabulary or twice")
    token_map = TokenMap([-1, *ids.tolist()], vocab)
    fc_norm = "per_tap" if "fc_norm.0.weight" in state else "concat" if "input_norm.weight" in state else "none"
    residual = bool(fields.get("norm_before_residual", False)) if speculators else False
    draft = FusedDraft(config, taps, target.get_input_embeddings(), token_map, fc_norm=fc_norm,
                       norm_before_residual=residual)  # fmt: skip
    weights = {("midlayer." + k.removeprefix(prefix) if k.startswith(prefix) else k): v for k, v in state.items()}
    weights = {k: v for k, v in weights.items() if k not in ("d2t", "t2d", "embed_tokens.weight")}
    weights["lm_head.weight"] = torch.cat([torch.zeros(1, rows.shape[1], dtype=rows.dtype), rows])  # slot 0: OTHER
    _load(draft, weights, path)
    _own_embedding(draft, state)
    device = target.get_input_embeddings().weight.device
    return draft.to(device=device, dtype=target.dtype).eval()


def export_eagle3(
    draft: FusedDraft, dest: str | Path, *, target_name: str = "", dtype: torch.dtype = torch.bfloat16
) -> Path:
    """Write `draft` in the eagle3 layout (SafeAILab / SpecForge names; `config.json` +
    `model.safetensors`, bfloat16 unless `dtype`: float32 keeps every weight as it is, so the
    file reads back with identical logits) that SGLang (`--speculative-algorithm EAGLE3`) and vLLM
    (`"method": "eagle3"`) load: both engines' layer-id keys, d2t as offsets, t2d as a mask."""
    from safetensors.torch import save_file

    out = Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    if draft.norm_before_residual:
        raise DynaTreeError("a head whose residual is normed has no eagle3 (SGLang) form: export refused")
    if min(draft.taps) < 1:
        raise DynaTreeError(
            f"taps {list(draft.taps)}: eagle3 layouts read layer inputs 1 and up (the final state is not one)"
        )
    slots = draft.token_map.draft_to_target[1:]  # every slot but OTHER
    d2t = slots - torch.arange(len(slots))
    t2d = torch.zeros(draft.token_map.target_vocab, dtype=torch.bool)
    t2d[slots] = True
    state = {k: v for k, v in draft.state_dict().items() if not k.startswith("rotary.")}
    state["lm_head.weight"] = state["lm_head.weight"][1:]
    state = {k: v.detach().to(dtype).contiguous().cpu() for k, v in state.items()}
    state["d2t"], state["t2d"] = d2t.long().contiguous(), t2d
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    fields = draft.llama_config.to_dict() | {
        "architectures": ["LlamaForCausalLMEagle3"],
        "vocab_size": draft.token_map.target_vocab,  # the target's; the head's own rows are draft_vocab_size
        "draft_vocab_size": len(slots),
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_aux_hidden_state_layer_ids": list(draft.taps),  # vLLM: the input of layer i
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [t - 1 for t in draft.taps], "use_aux_hidden_state": True},
        "dynatree": {"taps": list(draft.taps), "fc_norm": draft.fc_norm_kind, "target": target_name},
    }
    (out / "config.json").write_text(json.dumps(fields, indent=1))
    return out
