"""The fused-feature draft (EAGLE-3): one decoder layer over the target's low, middle and high features.

Where the feature draft (feature.py) reads the target's final hidden state, this kind reads
the inputs of three target layers (core/taps.py: `eagle3_taps(L)` = 2, L // 2, L - 3), each
RMS-normed and fused by `fc` (EAGLE-3, Li et al. 2025, sec. 3.2; the per-feature norms are
EAGLE 3.1's `fc_norm`). Per pair j (the target's taps at position j, the token x_{j+1}):

    g_j = fc([n_0(t0_j); n_1(t1_j); n_2(t2_j)])                          (3H -> H; level 1)
    a   = attn([input_layernorm(embed(x_{j+1})); hidden_norm(g_j)])   (2H-wide q/k/v, causal or tree mask)
    h_j = g_j + o(a);   h_j = h_j + mlp(post_attention_layernorm(h_j))
    p(x_{j+2}) = softmax(lm_head(norm(h_j)))                           (its own head over a reduced vocabulary)

A tree node at depth >= 2 reads its parent's output h in place of g (the target has not
computed its taps yet): EAGLE-3's test-time unrolling, which training repeats (its
"training-time test", training/packed/step.py), since nothing else makes h a valid input.

Weights are named as SafeAILab's and SpecForge's EAGLE-3 heads name them (`fc`, `midlayer.*`,
`norm`, `lm_head`; docs/published-heads.md), so export and import are renames at most.
The head covers the token map's slots (core/vocab.py); slot 0 (OTHER) is never proposed.

`FusedDrafter` is its `Drafter`: the same `expand_level` / `commit` contract as every drafter; its KV
cache is the project's static cache (forward/kv.py) driven by this module's own forward (`own_forward`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from dynatree_core.core.packing import linear_dtype
from dynatree_core.core.taps import check_taps, eagle3_taps
from dynatree_core.core.transfer import to_device
from dynatree_core.core.vocab import OTHER, TokenMap
from dynatree_core.core.weights import load_weights
from dynatree_core.drafts.feature import FeatureDrafter, head_config, read_meta
from dynatree_core.errors import DynaTreeError
from dynatree_core.forward.kv import KVState
from dynatree_core.forward.reference import Forward

CONFIG_FILE = "fused_draft.json"
# how the taps meet fc (fc_norm), in a model card's words
FC_NORMS = {
    "per_tap": "normed layer inputs",
    "none": "layer inputs as they are",
    "concat": "layer inputs, normed together",
    "scale": "layer inputs, each scaled by a fixed factor",
}
WEIGHTS_FILE = "fused_draft.safetensors"
KIND = "fused"


class FusedLayer(torch.nn.Module):
    """EAGLE-3's decoder layer: attention over [embedding ; hidden] (2H), residual on the hidden."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

        hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        attn = torch.nn.Module()
        attn.q_proj = torch.nn.Linear(2 * hidden, heads * self.head_dim, bias=False)
        attn.k_proj = torch.nn.Linear(2 * hidden, kv_heads * self.head_dim, bias=False)
        attn.v_proj = torch.nn.Linear(2 * hidden, kv_heads * self.head_dim, bias=False)
        attn.o_proj = torch.nn.Linear(heads * self.head_dim, hidden, bias=False)
        self.self_attn = attn
        self.mlp = LlamaMLP(config)

    def project(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q (B, heads, T, d), k and v (B, kv_heads, T, d) for embeds and hidden (B, T, H); RoPE on q, k."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        b, t = x.shape[:2]
        q = self.self_attn.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.self_attn.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.self_attn.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def finish(self, hidden: torch.Tensor, q: torch.Tensor, keys, values, mask: torch.Tensor) -> torch.Tensor:
        """The layer's output (B, T, H) given the queries and every key/value they may read
        (B, kv_heads, L, d) through the additive mask (B or 1, 1, T, L)."""
        b, _, t, _ = q.shape
        groups = self.heads // self.kv_heads
        if groups > 1:
            keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
        attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask.to(q.dtype))
        h = hidden + self.self_attn.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
        return h + self.mlp(self.post_attention_layernorm(h))


class FusedDraft(torch.nn.Module):
    """fc over the fused taps + EAGLE-3's layer + norm + its own head (module docstring).

    `embed` is the target's input embedding, shared and frozen (never saved); `taps` are the
    target layers it reads; `token_map` maps head rows to target ids (slot 0: OTHER)."""

    kind = KIND

    def __init__(
        self,
        config,
        taps: tuple[int, ...],
        embed: torch.nn.Module,
        token_map: TokenMap,
        *,
        fc_norm: str = "per_tap",
        norm_before_residual: bool = False,
    ):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.llama_config = config
        self.taps = tuple(taps)
        self.token_map = token_map
        # how the taps are normed before fc: one RMSNorm each (EAGLE 3.1 `fc_norm`, the default here),
        # "none" (SafeAILab's EAGLE-3), "concat", one over all of them (speculators' `norm_before_fc`), or
        # "scale": one fixed factor a tap (`tap_scale`, set from the data before training, never trained),
        # which the eagle3 export folds into fc's columns, so the engines compute it exactly
        if fc_norm not in FC_NORMS:
            raise DynaTreeError(f"fc_norm must be one of {', '.join(FC_NORMS)}, not {fc_norm!r}")
        self.fc_norm_kind = fc_norm
        self.norm_before_residual = norm_before_residual  # speculators: the residual is hidden_norm(h)
        if fc_norm == "per_tap":
            self.fc_norm = torch.nn.ModuleList(LlamaRMSNorm(hidden, eps=eps) for _ in taps)
        elif fc_norm == "concat":
            self.input_norm = LlamaRMSNorm(len(taps) * hidden, eps=eps)
        elif fc_norm == "scale":
            self.register_buffer("tap_scale", torch.ones(len(taps)))
        self.fc = torch.nn.Linear(len(taps) * hidden, hidden, bias=False)
        self.midlayer = FusedLayer(config)
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = torch.nn.Linear(hidden, len(token_map), bias=False)
        self.rotary = LlamaRotaryEmbedding(config)
        object.__setattr__(self, "embed", embed)  # a reference, not a submodule: never saved or trained here

    # -- what the engine and the drafter ask of any draft --
    @property
    def config(self):
        return self.llama_config

    @property
    def dtype(self) -> torch.dtype:
        return linear_dtype(self.fc)  # a packed fc's .weight is a copy made per read

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head

    # -- the computation --
    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """(..., len(taps), H) target layer inputs -> (..., H) level-1 hidden inputs g."""
        taps = taps.to(self.dtype)
        if self.fc_norm_kind == "per_tap":
            return self.fc(torch.cat([norm(taps[..., i, :]) for i, norm in enumerate(self.fc_norm)], dim=-1))
        if self.fc_norm_kind == "scale":
            taps = taps * self.tap_scale.to(taps.dtype)[:, None]
        flat = taps.flatten(-2)
        return self.fc(self.input_norm(flat) if self.fc_norm_kind == "concat" else flat)

    def residual(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the layer adds its attention output to: the hidden input (or its norm, speculators)."""
        return self.midlayer.hidden_norm(hidden) if self.norm_before_residual else hidden

    def token_embeds(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(to_device(tokens, self.embed.weight.device)).to(self.dtype)

    def reduced_logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits over the head's slots for layer outputs h, OTHER masked out."""
        logits = self.lm_head(self.norm(h)).float()
        logits[..., OTHER] = -torch.inf
        return logits

    def layer(self, embeds, hidden, positions, mask, past=None):
        """One layer pass: embeds, hidden (B, T, H) at positions (B, T), reading `past` (keys,
        values) before its own through the additive mask (B or 1, 1, T, past + T). Returns
        (h (B, T, H), (keys, values) including its own: what a later pass reads as past)."""
        cos, sin = self.rotary(hidden, positions)
        q, k, v = self.midlayer.project(embeds, hidden, cos, sin)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        return self.midlayer.finish(self.residual(hidden), q, k, v, mask), (k, v)

    def own_forward(self, ids, positions, mask, layers, logits_to_keep, *, embeds=None, hidden=False):
        """The static-cache forward KVState runs for this kind (forward/kv.py): `embeds` (1, q, 2H) =
        [token embedding ; hidden input] per row, written as one layer's keys/values into `layers[0]`."""
        if embeds is None:
            raise DynaTreeError("a fused-feature draft reads (token, hidden) pairs, never bare tokens")
        emb, hid = embeds.split(self.config.hidden_size, dim=-1)
        cos, sin = self.rotary(hid, positions)
        q, k, v = self.midlayer.project(emb, hid, cos, sin)
        keys, values = layers[0].update(k, v)
        h = self.midlayer.finish(self.residual(hid), q, keys, values, mask)[0]  # (q, H)
        logits = self.lm_head(self.norm(h[-logits_to_keep:]))
        return Forward(logits, h if hidden else None)

    def pair_inputs(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """(q, 2H) rows for `own_forward`: [embed(token) ; hidden input]."""
        return torch.cat([self.token_embeds(tokens), hidden.to(self.dtype)], dim=-1)

    # -- construction and files --
    @classmethod
    def from_target(
        cls,
        target: torch.nn.Module,
        token_map: TokenMap,
        *,
        taps: tuple[int, ...] | None = None,
        seed: int = 0,
        fc_norm: str = "per_tap",
    ) -> FusedDraft:
        """A new (untrained) fused draft for `target`: random fc and layer; the head starts as the
        target's head rows for the map's tokens and the final norm as the target's final norm.
        `fc_norm` "none" is the form the eagle3 export writes (published.export_eagle3)."""
        config = target.config.get_text_config(decoder=True)
        taps = check_taps(taps or eagle3_taps(config.num_hidden_layers), config.num_hidden_layers)
        torch.manual_seed(seed)
        embed = target.get_input_embeddings()
        draft = cls(head_config(target, len(token_map)), taps, embed, token_map, fc_norm=fc_norm)
        rows = target_rows(target, token_map)
        with torch.no_grad():
            if rows is not None:
                draft.lm_head.weight.copy_(rows.to(draft.lm_head.weight.device))
            norm = getattr(getattr(target, "model", None), "norm", None)
            if getattr(norm, "weight", None) is not None and norm.weight.shape[-1] == config.hidden_size:
                draft.norm.weight.copy_(norm.weight.detach().float())
        device = target.get_input_embeddings().weight.device
        return draft.to(device=device, dtype=target.dtype).eval()

    def save(self, directory: str | Path, *, with_head: bool = True, dtype: torch.dtype | None = None) -> None:
        """The draft's weights and description; without `with_head` the head is left out (a frozen
        head is the target's rows for the map's tokens, rebuilt from the target at load)."""
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        dtype = dtype or self.dtype
        skip = ("rotary.",) if with_head else ("rotary.", "lm_head.")
        state = {k: v for k, v in self.state_dict().items() if not k.startswith(skip)}
        save_file({k: v.detach().to(dtype).contiguous().cpu() for k, v in state.items()}, str(out / WEIGHTS_FILE))
        meta = {
            "kind": KIND,
            "taps": list(self.taps),
            "fc_norm": self.fc_norm_kind,
            "norm_before_residual": self.norm_before_residual,
            "head": "saved" if with_head else "target rows",
            "llama_config": self.llama_config.to_dict(),
            "dtype": str(dtype).removeprefix("torch."),
        }
        (out / CONFIG_FILE).write_text(json.dumps(meta, indent=1))
        self.token_map.save(out)

    @classmethod
    def load(cls, directory: str | Path, target: torch.nn.Module) -> FusedDraft:
        """A saved fused draft, checked against `target` and attached to it (embedding, device, dtype)."""
        from safetensors.torch import load_file
        from transformers import LlamaConfig

        path = Path(directory)
        meta = read_meta(path, CONFIG_FILE, "a fused-feature draft")
        config = LlamaConfig.from_dict(meta["llama_config"])
        check_fits(config.hidden_size, meta["taps"], target, where=str(path))
        options = {
            "fc_norm": meta.get("fc_norm", "per_tap"),
            "norm_before_residual": meta.get("norm_before_residual", False),
        }
        draft = cls(config, tuple(meta["taps"]), target.get_input_embeddings(), TokenMap.load(path), **options)
        state = load_file(str(path / WEIGHTS_FILE))
        if "lm_head.weight" not in state:  # saved without its head: the target's rows (save)
            rows = target_rows(target, draft.token_map)
            if rows is None:
                raise DynaTreeError(
                    f"the fused draft in {path} uses the target's head rows; this target has no such head"
                )
            state["lm_head.weight"] = rows
        load_weights(draft, state, what=str(path))
        device = target.get_input_embeddings().weight.device
        return draft.to(device=device, dtype=target.dtype).eval()


def target_rows(target: torch.nn.Module, token_map: TokenMap) -> torch.Tensor | None:
    """The target's LM head rows for the map's slots (float32, OTHER's slot holds row 0), or None
    when the target has no head of its hidden width."""
    head = getattr(target.get_output_embeddings(), "weight", None)
    if head is None or head.shape[-1] != target.config.get_text_config(decoder=True).hidden_size:
        return None
    return head.detach().float()[token_map.draft_to_target.clamp(min=0).to(head.device)].cpu()


def check_fits(hidden: int, taps, target: torch.nn.Module, *, where: str) -> None:
    """DynaTreeError (one line) unless a head of width `hidden` reading `taps` fits `target`."""
    config = target.config.get_text_config(decoder=True)
    if hidden != config.hidden_size:
        raise DynaTreeError(
            f"the draft in {where} has width {hidden}; the target's hidden size is {config.hidden_size}"
        )
    try:
        check_taps(tuple(taps), config.num_hidden_layers)
    except ValueError as exc:
        raise DynaTreeError(f"the draft in {where} reads target layers {list(taps)}: {exc}") from None


def is_fused_draft_dir(spec: str | None) -> bool:
    return bool(spec) and (Path(spec).expanduser() / CONFIG_FILE).is_file()


class FusedDrafter(FeatureDrafter):
    """The fused draft's per-run session: as the feature drafter's (pairs the target confirmed,
    each tree node's output for its children), except that a committed pair's hidden input is
    fc over the target's taps and a node's is its parent's output h."""

    def __init__(self, draft: FusedDraft, vocab_size: int, *, kv: KVState):
        super().__init__(draft, vocab_size, kv=kv)
        self.taps = draft.taps

    def _pair_rows(self, tokens: torch.Tensor, features: torch.Tensor, *, fused: bool) -> torch.Tensor:
        hidden = self.draft.fuse(features) if fused else features
        return self.draft.pair_inputs(tokens, hidden)
