"""Per-run KV state and tree-masked forwards over stock transformers models.

`KVState` owns one model's cache for one run, plus the committed tokens that are not in the
cache yet (`pending`). The invariant the engine keeps: cache + pending == committed tokens.

`masked_forward` runs ONE forward of a stock HF causal LM over new tokens whose visibility is
given as a boolean matrix, using an additive float 4D mask and explicit position ids
(transformers 5.x returns a ready 4D mask unchanged; see ENGINEERING_NOTES). A boolean mask is
right under sdpa but silently wrong under eager, so we always pass the additive form.

`KVState.keep` compacts the cache with `index_select` on the sequence axis: accepted tree
tokens keep the KV the verification forward computed, nothing is recomputed.
"""

from __future__ import annotations

import time

import torch

from dynatree_core.errors import DynaTreeError


class KVState:
    """One model's cache for one run. Never shared between runs or sessions."""

    def __init__(self, model: torch.nn.Module, prompt_ids: list[int]):
        from transformers import DynamicCache

        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.length = 0  # tokens whose KV is in the cache
        self.pending: list[int] = list(prompt_ids)  # committed, not yet in the cache
        self.forwards = 0
        self.forward_ms = 0.0  # time inside model forwards (what "outside the forwards" is measured against)
        self.peak_bytes = 0  # the cache's largest size so far (right after a forward, before compaction)

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    def forward(
        self, token_ids: list[int], position_ids: list[int], visible: torch.Tensor, logits_to_keep: int
    ) -> torch.Tensor:
        """One forward over `token_ids`, appended to the cache.

        Args:
            token_ids: q new tokens.
            position_ids: q positions (prefix length + depth for tree nodes).
            visible: (q, length + q) bool, True where query i may attend to key j.
            logits_to_keep: return logits of the last this-many queries.
        Returns:
            (logits_to_keep, vocab) float32 logits.
        """
        q = len(token_ids)
        if visible.shape != (q, self.length + q):
            raise ValueError(f"mask shape {tuple(visible.shape)} != {(q, self.length + q)}")
        device = self.device
        dtype = self.model.dtype
        mask = torch.zeros(visible.shape, dtype=dtype, device=device)
        mask.masked_fill_(~visible.to(device), torch.finfo(dtype).min)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = self.model(
            input_ids=torch.tensor([token_ids], device=device),
            position_ids=torch.tensor([position_ids], device=device),
            attention_mask=mask[None, None],  # (1, 1, q, kv): used as-is by transformers
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
        logits = out.logits[0].float()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.forward_ms += (time.perf_counter() - t0) * 1e3
        self.length += q
        self.forwards += 1
        self.peak_bytes = max(self.peak_bytes, self.nbytes())
        return logits

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.cache.layers for t in (layer.keys, layer.values))

    def keep(self, index: list[int]) -> None:
        """Keep only the cache entries at `index` (ascending): compaction, no recompute.

        `index` is a kept prefix followed by a few scattered slots (the accepted path). The
        scattered entries are gathered in place right after the prefix, then the tail is cut,
        so the cache is never copied as a whole.
        """
        prefix = 0
        while prefix < len(index) and index[prefix] == prefix:
            prefix += 1
        src = torch.tensor(index[prefix:], dtype=torch.long)
        dst = torch.arange(prefix, len(index))
        for layer in self.cache.layers:
            _check_layer(layer)
            if len(src):  # sources lie at or after their destinations; RHS indexing copies first
                layer.keys[..., dst, :] = layer.keys[..., src.to(layer.keys.device), :]
                layer.values[..., dst, :] = layer.values[..., src.to(layer.values.device), :]
            layer.keys = layer.keys[..., : len(index), :]
            layer.values = layer.values[..., : len(index), :]
        self.length = len(index)


def _check_layer(layer) -> None:
    if getattr(layer, "is_sliding", False):
        raise DynaTreeError("models with sliding-window attention caches are not supported yet")


def chain_then_tree_visibility(past: int, n_chain: int, tree_ancestors: torch.Tensor) -> torch.Tensor:
    """Visibility for [chain tokens (causal)] + [tree nodes whose root is the last chain token].

    Args:
        past: tokens already in the cache (all visible to everyone).
        n_chain: pending committed tokens, causal among themselves; the last one is the root.
        tree_ancestors: (n, n) bool ancestor closure over the drafted nodes (root excluded).
    Returns:
        (n_chain + n, past + n_chain + n) bool.
    """
    n = tree_ancestors.shape[0]
    q = n_chain + n
    visible = torch.zeros(q, past + q, dtype=torch.bool)
    visible[:, :past] = True
    visible[:n_chain, past : past + n_chain] = torch.ones(n_chain, n_chain, dtype=torch.bool).tril()
    visible[n_chain:, past : past + n_chain] = True
    visible[n_chain:, past + n_chain :] = tree_ancestors
    return visible
