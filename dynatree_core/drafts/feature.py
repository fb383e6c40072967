"""The feature-level draft (EAGLE-style): a one-layer head that reads the target's own features.

A token draft is a separate small LM that has to guess the target from tokens alone. A feature
draft reads what the target already computed: at position i its input is the target's final
hidden state f_i (post-norm, what the target's LM head reads) together with the embedding of the
token x_{i+1} that followed, and it predicts the next feature f_{i+1}, decoded by an LM head
(EAGLE, Li et al. 2024, sec. 4.1; the SALF & TALF paper trains TALF on exactly such drafts):

    e_i = fc([embed(x_{i+1}); f_i])          (2H -> H)
    h_i = LlamaDecoderLayer(e_<=i)[i]        (one layer, the target's width, causal/tree attention)
    p(x_{i+2}) = softmax(head(h_i))          (head: rows of the target's LM head over a reduced vocabulary)

Deeper tree levels feed the head's own predicted feature of the parent (h of the parent node)
in place of the target's feature, which the target has not computed yet.

`FeatureDraft` holds the trainable parts as a stock one-layer `LlamaForCausalLM` whose final
norm is the identity (features are already normalised) and whose embedding table is unused
(inputs come from `fc`), so the static cache, the lean forward and the HF reference path of
forward/kv.py all run it unchanged; plus `fc` and a reference to the target's (frozen) input embedding.

`FeatureDrafter` is its `Drafter`: the same `expand_level` / `commit` contract as the token drafter,
so every policy runs unchanged. What differs is what it is fed: the engine hands it the target's
hidden states for the root and the accepted nodes from the verification forward it already ran
(`add_features`), and it cannot draft before the target's first forward (`ready`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dynatree_core.core.packing import linear_dtype
from dynatree_core.core.taps import FINAL
from dynatree_core.core.transfer import to_device
from dynatree_core.core.tree import DraftTree
from dynatree_core.core.vocab import OTHER, TokenMap
from dynatree_core.core.weights import load_weights
from dynatree_core.drafts.session import Drafter
from dynatree_core.errors import DynaTreeError
from dynatree_core.forward.kv import KVState
from dynatree_core.forward.rows import Rows

CONFIG_FILE = "feature_draft.json"
WEIGHTS_FILE = "feature_draft.safetensors"
KIND = "feature"


def _text_config(model: torch.nn.Module):
    return model.config.get_text_config(decoder=True)


def head_config(target: torch.nn.Module, vocab: int, *, intermediate_size: int | None = None):
    """The one-layer LlamaConfig of a feature draft for `target`: its width, its attention heads
    when they divide the width, its rotary base and norm epsilon."""
    from transformers import LlamaConfig

    cfg = _text_config(target)
    hidden = cfg.hidden_size
    heads = getattr(cfg, "num_attention_heads", None) or max(1, hidden // 64)
    if hidden % heads:
        heads = max(1, hidden // 64)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    if heads % kv_heads:
        kv_heads = heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate_size or getattr(cfg, "intermediate_size", None) or 4 * hidden,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=getattr(cfg, "max_position_embeddings", None) or 2048,
        rms_norm_eps=getattr(cfg, "rms_norm_eps", None) or 1e-5,
        rope_theta=rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)),
        tie_word_embeddings=False,
    )


class FeatureDraft(torch.nn.Module):
    """fc + one decoder layer + LM head over a (reduced) vocabulary, reading target features.

    `lm` is the one-layer LlamaForCausalLM (identity final norm, 1-row placeholder embedding);
    `embed` is the target's input embedding, shared and frozen (not part of the saved weights).
    `token_map` maps the head's rows to target ids (None: the head covers the target's vocabulary).
    """

    kind = KIND

    def __init__(self, lm: torch.nn.Module, fc: torch.nn.Linear, embed: torch.nn.Module, token_map: TokenMap | None):
        super().__init__()
        self.lm = lm
        self.fc = fc
        self.token_map = token_map
        object.__setattr__(self, "embed", embed)  # a reference, not a submodule: never saved or trained here

    # -- shapes the engine asks of any draft --
    @property
    def config(self):
        return self.lm.config

    @property
    def dtype(self) -> torch.dtype:
        return linear_dtype(self.fc)  # a packed fc's .weight is a copy made per read

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm.get_output_embeddings()

    def reduced_logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 head logits of features `h`, OTHER (never proposed) masked out (training's view)."""
        logits = self.lm.lm_head(h).float()
        if self.token_map is not None:
            logits[..., OTHER] = -torch.inf
        return logits

    def inputs(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """(q, H) layer inputs for q (token, feature) pairs: fc([embed(token); feature])."""
        emb = self.embed(to_device(tokens, self.embed.weight.device)).to(self.dtype)
        return self.fc(torch.cat([emb, features.to(emb.dtype)], dim=-1))

    # -- construction and files --
    @classmethod
    def from_target(
        cls,
        target: torch.nn.Module,
        token_map: TokenMap | None = None,
        *,
        seed: int = 0,
        intermediate_size: int | None = None,
        input_norm: bool = True,
    ) -> FeatureDraft:
        """A new (untrained) feature draft for `target`: random fc and layer, the LM head copied
        from the target's head rows (the token map's rows when given), in the target's dtype.
        `input_norm` False drops the layer's input norm (EAGLE-1's layout: fc feeds attention directly)."""
        from transformers import LlamaForCausalLM

        vocab = len(token_map) if token_map is not None else _text_config(target).vocab_size
        torch.manual_seed(seed)
        lm = LlamaForCausalLM(head_config(target, vocab, intermediate_size=intermediate_size))
        lm.model.norm = torch.nn.Identity()
        if not input_norm:
            lm.model.layers[0].input_layernorm = torch.nn.Identity()
        lm.model.embed_tokens = torch.nn.Embedding(1, lm.config.hidden_size)  # unused: inputs come from fc
        hidden = lm.config.hidden_size
        fc = torch.nn.Linear(2 * hidden, hidden, bias=True)
        target_head = target.get_output_embeddings()
        weight = getattr(target_head, "weight", None)
        if weight is not None and weight.shape[-1] == hidden:
            with torch.no_grad():
                rows = weight.detach().float()
                if token_map is not None:
                    ids = token_map.draft_to_target.clamp(min=0)
                    rows = rows[ids.to(rows.device)]
                lm.lm_head.weight.copy_(rows[:vocab].to(lm.lm_head.weight.device))
        draft = cls(lm, fc, target.get_input_embeddings(), token_map)
        device = target.get_input_embeddings().weight.device
        return draft.to(device=device, dtype=target.dtype).eval()

    def save(self, directory: str | Path, *, with_head: bool = False, dtype: torch.dtype | None = None) -> None:
        """fc and the layer (and the head only when `with_head`: a frozen head is the target's rows,
        rebuilt from the target and the token map at load, so files stay small)."""
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        skip = ("model.embed_tokens",) if with_head else ("model.embed_tokens", "lm_head")
        state = {f"lm.{k}": v for k, v in self.lm.state_dict().items() if not k.startswith(skip)}
        state |= {f"fc.{k}": v for k, v in self.fc.state_dict().items()}
        dtype = dtype or self.dtype  # a shipped draft may be stored smaller (load casts to the target's dtype)
        save_file({k: v.detach().to(dtype).contiguous().cpu() for k, v in state.items()}, str(out / WEIGHTS_FILE))
        config = {
            "kind": KIND,
            "llama_config": self.lm.config.to_dict(),
            "dtype": str(dtype).removeprefix("torch."),
            "head": "saved" if with_head else "target rows",
            "input_norm": not isinstance(self.lm.model.layers[0].input_layernorm, torch.nn.Identity),
        }
        (out / CONFIG_FILE).write_text(json.dumps(config, indent=1))
        if self.token_map is not None:
            self.token_map.save(out)

    @classmethod
    def load(cls, directory: str | Path, target: torch.nn.Module) -> FeatureDraft:
        """A saved feature draft, attached to `target` (its embedding, device and dtype)."""
        from safetensors.torch import load_file
        from transformers import LlamaConfig

        path = Path(directory)
        meta = read_meta(path, CONFIG_FILE, "a feature draft")
        token_map = TokenMap.load(path)
        config = LlamaConfig.from_dict(meta["llama_config"])
        if config.hidden_size != _text_config(target).hidden_size:
            raise DynaTreeError(
                f"the feature draft in {path} reads features of width {config.hidden_size}; "
                f"the target's are {_text_config(target).hidden_size}"
            )
        draft = cls.from_target(
            target, token_map, intermediate_size=config.intermediate_size, input_norm=meta.get("input_norm", True)
        )
        state = load_file(str(path / WEIGHTS_FILE))
        # never saved: the unused one-row embedding; a head saved as "target rows" is rebuilt above
        kept = ("lm.model.embed_tokens",) if meta.get("head") == "saved" else ("lm.model.embed_tokens", "lm.lm_head")
        load_weights(draft, state, what=str(path), allow_missing=kept)
        return draft.to(dtype=target.dtype).eval()


def read_meta(path: Path, name: str, what: str) -> dict:
    """A saved draft's JSON description (DynaTreeError naming `what` when it is missing or unreadable)."""
    try:
        return json.loads((path / name).read_text())
    except (OSError, ValueError) as exc:
        raise DynaTreeError(f"{path} is not {what} ({name} missing or unreadable)") from exc


def is_feature_draft(model: torch.nn.Module | None) -> bool:
    return isinstance(model, FeatureDraft)


def is_feature_draft_dir(spec: str | None) -> bool:
    """True for a directory that holds a saved feature draft."""
    return bool(spec) and (Path(spec).expanduser() / CONFIG_FILE).is_file()


class FeatureDrafter(Drafter):
    """The feature draft's per-run session: its own KV cache (entries are (feature, token) pairs,
    one per position from 1 on), the pairs the target has confirmed but the draft has not read
    yet, and each tree row's predicted feature for its children's inputs.

    Cache layout: entry j holds the pair (f_j, x_{j+1}) at position j + 1, so after the root's
    forward the root's pair (f of the token before it, root) is the last committed entry. Tree
    nodes follow level by level, as in the token drafter. Commit keeps the committed entries and
    drops every tree entry: the accepted nodes were read with *predicted* parent features, and
    the target has now computed the true ones, which arrive as new pending pairs (EAGLE does the
    same; this is reading new inputs, not recomputing the same KV).
    """

    wants_features = True
    taps: tuple[int, ...] = (FINAL,)  # which target hidden states the verification forward hands over

    def __init__(self, draft: FeatureDraft, vocab_size: int, *, kv: KVState):
        super().__init__(kv.model, [], vocab_size, draft.token_map, kv=kv)
        kv.pending = []  # the cache reads pairs, never bare tokens
        self.draft = draft
        self.pending_features: list[torch.Tensor] = []  # (n_i, H) blocks, in order
        self.pending_tokens: list[int] = []
        self.root_state: torch.Tensor | None = None  # the root's predicted feature (H,): its children read it
        self.level_states: torch.Tensor | None = None  # expand_level: the last level's predicted features
        self.row_states: torch.Tensor | None = None  # expand_rows: every row's predicted feature, the root's first
        self.root_position = 0

    @property
    def ready(self) -> bool:
        """False until the target's first forward has produced features (the prefill iteration)."""
        return bool(self.pending_tokens) or self.kv.length > 0

    def replace_root(self, token: int) -> None:
        """The next root becomes `token` (engine.replace_root): the last confirmed pair's token."""
        self.pending_tokens[-1] = int(token)

    def add_features(self, features: torch.Tensor, tokens: list[int]) -> None:
        """Pairs the target confirmed: features[i] is its hidden state at the position before
        tokens[i] (the engine passes the root's and the accepted nodes' rows of its forward)."""
        if features.shape[0] != len(tokens):
            raise ValueError(f"{features.shape[0]} features for {len(tokens)} tokens")
        if tokens:
            self.pending_features.append(features.detach())
            self.pending_tokens.extend(int(t) for t in tokens)

    def _root(self, then: tuple | None) -> tuple[torch.Tensor, tuple | None]:
        """The root's forward over the pairs the target confirmed (root last)."""
        kv = self.kv
        if not self.pending_tokens:
            raise DynaTreeError("the feature draft has no target features yet: it drafts from the second iteration")
        self.slots = {}
        feats = torch.cat(self.pending_features) if len(self.pending_features) > 1 else self.pending_features[0]
        past = kv.length
        done = self._captured_root(self.pending_tokens, past + 1, then, feats) if kv.filled else None
        if done is None:
            embeds = self._pair_rows(torch.tensor(self.pending_tokens), feats, fused=True)
            rows = Rows.batch(past, self.pending_tokens, past + 1, embeds=embeds, hidden=True)
            done = kv.run(rows), None  # pair j sits at position j + 1
        out, after = done
        self.pending_features, self.pending_tokens = [], []
        self.committed = kv.length
        self.root_position = kv.length
        self.slots[0] = kv.length - 1
        self.root_state = out.states[-1]
        return out.logits, after

    def _rows_logits(self, tokens, parents, positions, lines: torch.Tensor) -> torch.Tensor:
        """expand_rows' forward: each row reads its parent row's predicted feature (`row_states`:
        every row's of the iteration, the root's first)."""
        if len(self.level_starts) == 1:
            self.row_states = self.root_state[None]
        embeds = self._pair_rows(tokens, self.row_states[parents], fused=False)
        out = self.kv.run(self._level_rows(tokens, positions, lines, embeds=embeds, hidden=True))
        self.row_states = torch.cat([self.row_states, out.states])
        return out.logits

    def _level_logits(self, tokens, parents, depth: int) -> torch.Tensor:
        """A device level (Drafter.expand_level): each row reads its parent row's predicted feature."""
        p = tokens.shape[0]
        if depth == 1:  # the root's children read the root's predicted feature
            self.level_states = self.root_state[None]
        feats = self.level_states[parents]
        positions = torch.full((p,), self.root_position + depth, dtype=torch.long, device=tokens.device)
        embeds = self._pair_rows(tokens, feats, fused=False)
        out = self.kv.run(self._level_rows(tokens, positions, self.ancestors, embeds=embeds, hidden=True))
        self.level_states = out.states
        return out.logits

    position_shift = 0  # the root's pair sits at the committed length's position

    def _level_inputs(self, depth: int) -> tuple[torch.Tensor, ...]:
        """A captured level reads its parents' predicted features (the root's, then the last level's)."""
        return (self.root_state[None] if depth == 1 else self.level_states,)

    def _level_embeds(self, tokens, parents, width: int, features) -> torch.Tensor:
        return self._padded(self._pair_rows(tokens, features[parents], fused=False), width)

    def _root_embeds(self, chain, width: int, features) -> torch.Tensor:
        return self._padded(self._pair_rows(chain, features, fused=True), width)

    def _padded(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """(q, H) input rows as a fixed-width forward's (width, H) inputs, zero rows after."""
        rows = rows.to(self.kv.model.dtype)
        return torch.cat([rows, rows.new_zeros(width - rows.shape[0], rows.shape[1])])

    def _level_done(self, out) -> None:
        self.level_states = out.states

    def _pair_rows(self, tokens: torch.Tensor, features: torch.Tensor, *, fused: bool) -> torch.Tensor:
        """The layer's input rows for (token, feature) pairs: the target's features (`fused`: as
        the target handed them over) or a parent node's predicted one; here both read the same way."""
        return self.draft.inputs(tokens, features)

    def commit(self, tree: DraftTree, accepted: list[int], new_tokens: list[int]) -> None:
        """Keep the committed entries (through the root's pair); the new pairs come from
        `add_features` (the target's true features for the root and the accepted nodes)."""
        if 0 in self.slots:
            self.kv.keep(list(range(self.committed)))
        self.slots = {}
