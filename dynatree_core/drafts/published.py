"""Published EAGLE heads read into this project's head kinds, and a fused draft written in their layout.

Four layouts (docs/published-heads.md names the sources each is read from):

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
`export_eagle3` writes a fused draft in the eagle3 layout with both engines' layer-id keys, and
only a draft both engines compute exactly: one without tap norms (fc_norm "none"; the others
are refused with the reason).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from dynatree_core.core.taps import check_taps, eagle3_taps, from_output_ids
from dynatree_core.core.vocab import TokenMap
from dynatree_core.core.weights import load_weights
from dynatree_core.drafts.feature import FeatureDraft
from dynatree_core.drafts.fused import FusedDraft, check_fits
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

    from dynatree_core.core.hub import hub_reachable

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


SIZES = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
         "vocab_size", "head_dim")  # fmt: skip


def check_layer_fields(fields: dict, path: Path) -> None:
    """DynaTreeError (one line) unless a head's layer sizes are whole numbers that agree with each
    other the way the layer built from them needs: heads divide the width, KV heads divide the
    heads, head_dim (when given) is width / heads. Checked before any module is made from them."""
    from transformers import LlamaConfig

    defaults = {k: v for k, v in LlamaConfig().to_dict().items() if k in SIZES and k != "head_dim"}
    sizes = defaults | {k: fields[k] for k in SIZES if fields.get(k) is not None}
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DynaTreeError(f"{path}: config.json's {name} is {value!r}; a positive whole number is needed")
    hidden, heads = sizes["hidden_size"], sizes["num_attention_heads"]
    kv_heads = sizes.get("num_key_value_heads", heads)
    if hidden % heads:
        raise DynaTreeError(
            f"{path}: config.json's hidden_size {hidden} is not a multiple of num_attention_heads {heads}"
        )
    if heads % kv_heads:
        raise DynaTreeError(
            f"{path}: config.json's num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
        )
    if sizes.get("head_dim", hidden // heads) != hidden // heads:
        raise DynaTreeError(
            f"{path}: config.json's head_dim {sizes['head_dim']} is not hidden_size / num_attention_heads "
            f"({hidden} / {heads}); heads with another head width are not supported"
        )


def _llama_config(fields: dict, path: Path):
    from transformers import LlamaConfig

    check_layer_fields(fields, path)
    known = LlamaConfig().to_dict().keys() | {"rope_theta", "rope_scaling", "head_dim"}
    try:
        config = LlamaConfig(**{k: v for k, v in fields.items() if k in known})
    except Exception as exc:  # transformers' own validation: its message, on one line
        reason = " ".join(str(exc).split())
        raise DynaTreeError(f"{path}: config.json does not describe a Llama layer: {reason}") from None
    if config.num_hidden_layers != 1:
        raise DynaTreeError(f"heads of {config.num_hidden_layers} decoder layers are not supported (one layer only)")
    return config


def _check_vocab(path: Path, vocab: int, target: torch.nn.Module) -> None:
    want = target.config.get_text_config(decoder=True).vocab_size
    if vocab != want:
        raise DynaTreeError(f"the head in {path} is for a vocabulary of {vocab} tokens; the target's has {want}")


def _eagle1(path: Path, fields: dict, state: dict, target: torch.nn.Module) -> FeatureDraft:
    config = _llama_config(fields, path)
    check_fits(config.hidden_size, (), target, where=str(path))
    _check_vocab(path, config.vocab_size, target)
    draft = FeatureDraft.from_target(target, None, intermediate_size=config.intermediate_size, input_norm=False)
    own = draft.lm.config
    for name in ("num_attention_heads", "num_key_value_heads", "rope_theta"):
        if getattr(config, name, None) != getattr(own, name, None):
            raise DynaTreeError(
                f"{path}: {name} {getattr(config, name, None)} differs from the target's {getattr(own, name, None)}"
            )
    # every tensor of the file has its place: the layer (under the draft's `lm`), fc, the embedding
    weights = {("lm.model." + k if k.startswith("layers.0.") else k): v for k, v in state.items()}
    weights.pop("embed_tokens.weight", None)  # read by _own_embedding
    if not fields.get("bias", True) and "fc.bias" not in weights:  # SafeAILab: config "bias" false, no fc.bias
        weights["fc.bias"] = torch.zeros(config.hidden_size)
    # the draft's unused one-row embedding and its head (the target's rows) are not in a published file
    load_weights(draft, weights, what=str(path), allow_missing=("lm.model.embed_tokens", "lm.lm_head"))
    _own_embedding(draft, state)
    return draft.to(dtype=target.dtype).eval()


def _own_embedding(draft, state: dict) -> None:
    """A head that saved its embedding reads through it (published heads save the target's own copy)."""
    weight = state.get("embed_tokens.weight")
    if weight is not None and weight.shape == draft.embed.weight.shape:
        object.__setattr__(draft, "embed", torch.nn.Embedding.from_pretrained(weight.to(draft.dtype), freeze=True))


def _eagle3(path: Path, fields: dict, state: dict, target: torch.nn.Module, *, speculators: bool) -> FusedDraft:
    n_layers = target.config.get_text_config(decoder=True).num_hidden_layers
    if speculators:
        layer_fields = dict(fields.get("transformer_layer_config") or {})
        config = _llama_config(layer_fields, path)
        ids = fields.get("eagle_aux_hidden_state_layer_ids")
        taps = tuple(ids) if ids else eagle3_taps(n_layers)  # vLLM: id i = the input of layer i
        prefix = "layers.0."
    else:
        config = _llama_config(fields, path)
        ids = (fields.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        taps = from_output_ids(ids) if ids else eagle3_taps(n_layers)  # SGLang: id i = the output of layer i
        prefix = "midlayer."
    hidden = fields.get("target_hidden_size") or config.hidden_size
    if hidden != config.hidden_size:
        raise DynaTreeError(
            f"{path}: target_hidden_size {hidden} differs from the head's hidden_size {config.hidden_size}; "
            "heads narrower or wider than their target are not supported"
        )
    check_fits(hidden, taps, target, where=str(path))
    taps = check_taps(taps, n_layers)
    vocab = int(config.vocab_size)
    _check_vocab(path, vocab, target)
    token_map = _draft_vocab(path, fields, state, vocab)
    fc_norm = "per_tap" if "fc_norm.0.weight" in state else "concat" if "input_norm.weight" in state else "none"
    residual = bool(fields.get("norm_before_residual", False)) if speculators else False
    draft = FusedDraft(config, taps, target.get_input_embeddings(), token_map, fc_norm=fc_norm,
                       norm_before_residual=residual)  # fmt: skip
    weights = {("midlayer." + k.removeprefix(prefix) if k.startswith(prefix) else k): v for k, v in state.items()}
    weights = {k: v for k, v in weights.items() if k not in ("d2t", "t2d", "embed_tokens.weight")}
    rows = state["lm_head.weight"]
    weights["lm_head.weight"] = torch.cat([torch.zeros(1, rows.shape[1], dtype=rows.dtype), rows])  # slot 0: OTHER
    load_weights(draft, weights, what=str(path))
    _own_embedding(draft, state)
    device = target.get_input_embeddings().weight.device
    return draft.to(device=device, dtype=target.dtype).eval()


def _draft_vocab(path: Path, fields: dict, state: dict, vocab: int) -> TokenMap:
    """The head's token map from its lm_head rows, `draft_vocab_size`, `d2t` and `t2d`, which must
    agree: D rows, D offsets, t2d marking exactly the D target ids d2t names (DynaTreeError otherwise)."""
    rows = state.get("lm_head.weight")
    if rows is None or rows.dim() != 2:
        raise DynaTreeError(f"{path}: no lm_head.weight [draft_vocab_size, hidden] (an EAGLE-3 head has its own)")
    size = len(rows)
    declared = fields.get("draft_vocab_size")
    if declared is not None and declared != size:
        raise DynaTreeError(f"{path}: draft_vocab_size is {declared} but lm_head.weight has {size} rows")
    offsets = state.get("d2t", torch.zeros(size, dtype=torch.long))  # no d2t: the draft's vocabulary is the target's
    if offsets.shape != (size,):
        raise DynaTreeError(f"{path}: d2t has shape {tuple(offsets.shape)}; lm_head.weight has {size} rows")
    ids = torch.arange(size) + offsets.long()  # d2t: target id = draft slot + offset
    if ids.min() < 0 or ids.max() >= vocab or len(set(ids.tolist())) != size:
        raise DynaTreeError(f"{path}: d2t maps draft slots outside the target's vocabulary or twice")
    mask = state.get("t2d")
    if mask is not None:
        if mask.shape != (vocab,):
            raise DynaTreeError(f"{path}: t2d has shape {tuple(mask.shape)}; the vocabulary has {vocab} tokens")
        marked = mask.bool().nonzero().flatten()
        if not torch.equal(marked, torch.sort(ids).values):
            raise DynaTreeError(f"{path}: t2d marks {len(marked)} target tokens, not the {size} that d2t maps to")
    return TokenMap([-1, *ids.tolist()], vocab)


# why a fused draft of each other form has no eagle3 file that both engines compute exactly
NOT_EXPORTABLE = {
    "per_tap": (
        "this draft norms each tap before fc (fc_norm per_tap, EAGLE 3.1's fc_norm.{i} weights): SGLang's "
        "LlamaForCausalLMEagle3 has no such weights and skips them silently (it would serve another draft), "
        "vLLM's eagle3 reader refuses names it does not know, and a per-tap RMS norm cannot be folded into fc"
    ),
    "concat": (
        "this draft norms the joined taps before fc (fc_norm concat, speculators' input_norm): neither SGLang's "
        "nor vLLM's eagle3 reader has that weight, and an RMS norm cannot be folded into fc"
    ),
}


def export_eagle3(
    draft: FusedDraft, dest: str | Path, *, target_name: str = "", dtype: torch.dtype = torch.bfloat16
) -> Path:
    """Write `draft` in the eagle3 layout (SafeAILab / SpecForge names; `config.json` +
    `model.safetensors`, bfloat16 unless `dtype`: float32 keeps every weight as it is, so the
    file reads back with identical logits) that SGLang (`--speculative-algorithm EAGLE3`) and vLLM
    (`"method": "eagle3"`) load: only the tensors both engines' readers have (`fc`, `midlayer.*`,
    `norm`, `lm_head`, `d2t` as offsets, `t2d` as a mask), both engines' layer-id keys, `rope_theta`
    at the top level beside `rope_parameters`; fixed tap scales (fc_norm "scale") folded into `fc`.
    A draft those readers cannot compute exactly (per-tap or joined tap norms, a normed residual,
    the final state as a tap) is refused, saying why."""
    from safetensors.torch import save_file

    if draft.fc_norm_kind in NOT_EXPORTABLE:
        raise DynaTreeError(
            f"no eagle3 export: {NOT_EXPORTABLE[draft.fc_norm_kind]}; "
            "a draft that exports is the fused kind without tap norms or with fixed tap scales, folded into fc "
            "(train-packed --kind fused --fc-norm none, or scale)"
        )
    if draft.norm_before_residual:
        raise DynaTreeError("a head whose residual is normed has no eagle3 (SGLang) form: export refused")
    if min(draft.taps) < 1:
        raise DynaTreeError(
            f"taps {list(draft.taps)}: eagle3 layouts read layer inputs 1 and up (the final state is not one)"
        )
    out = Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    slots = draft.token_map.draft_to_target[1:]  # every slot but OTHER
    d2t = slots - torch.arange(len(slots))
    t2d = torch.zeros(draft.token_map.target_vocab, dtype=torch.bool)
    t2d[slots] = True
    state = {k: v for k, v in draft.state_dict().items() if not k.startswith("rotary.")}
    state["lm_head.weight"] = state["lm_head.weight"][1:]
    if draft.fc_norm_kind == "scale":  # fc(s_i * tap_i) = (fc's columns of tap i times s_i)(tap_i): folded
        scale = state.pop("tap_scale").float().repeat_interleave(draft.llama_config.hidden_size)
        state["fc.weight"] = state["fc.weight"].float() * scale
    state = {k: v.detach().to(dtype).contiguous().cpu() for k, v in state.items()}
    state["d2t"], state["t2d"] = d2t.long().contiguous(), t2d
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = draft.llama_config.to_dict()
    rope = config.get("rope_parameters") or {}
    fields = config | {
        "architectures": ["LlamaForCausalLMEagle3"],
        "vocab_size": draft.token_map.target_vocab,  # the target's; the head's own rows are draft_vocab_size
        "draft_vocab_size": len(slots),
        "torch_dtype": str(dtype).removeprefix("torch."),
        "rope_theta": rope.get("rope_theta", config.get("rope_theta")),  # older readers read only this key
        "tie_word_embeddings": False,  # SGLang: true would make lm_head the embedding
        "norm_before_residual": False,  # vLLM's default for flat configs, said
        "eagle_aux_hidden_state_layer_ids": list(draft.taps),  # vLLM: the input of layer i
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [t - 1 for t in draft.taps], "use_aux_hidden_state": True},
        "dynatree": {"taps": list(draft.taps), "fc_norm": "none", "target": target_name},  # a scale is folded
    }
    (out / "config.json").write_text(json.dumps(fields, indent=1))
    return out
