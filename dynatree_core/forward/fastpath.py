"""The lean forward: a Llama-family causal LM's forward over the static cache, without the framework.

A small model's forward on a CPU is dispatch-bound: the embedded draft (6 layers, hidden 256)
does far less arithmetic than the stock transformers forward spends per call in Python (mask
preparation, output dataclasses, hooks, kwargs plumbing, per-module `__call__`; BENCHMARKS.md,
"The engine: forwards, ..."). This module runs the same weights through the same operations in
a straight line (gpt-fast style):

    x = embed(ids)
    for each layer:  x += o(attn(rope(q(n1(x))), rope(k(n1(x))), v(n1(x)), mask, cache))
                     x += down(silu(gate(n2(x))) * up(n2(x)))
    logits = head(norm(x)[-keep:])

It reads the model's own modules (weights, pre-packed oneDNN linears, the rotary embedding), so
there is no second copy of anything; the stock HF forward stays the reference path and tests
check that both give the same logits and the same greedy decoding. Only architectures whose
layers are exactly the Llama block (llama, qwen2, mistral without a sliding window) take this
path; everything else keeps the HF forward over the same static cache.

Contract: knows models and cache layers, never trees or policies.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from dynatree_core.core.settings import env_on
from dynatree_core.core.taps import stack_taps
from dynatree_core.forward import kernels
from dynatree_core.forward.invariant import LinearRows, RopeTable, RowGroups, min_rows
from dynatree_core.forward.reference import Forward
from dynatree_core.forward.static_rows import StaticRows

LEAN_TYPES = ("llama", "qwen2", "mistral")  # model_type values whose decoder layer is the Llama block


def fast_forward_enabled(fast: bool | None = None) -> bool:
    """An explicit choice wins; else on unless DYNATREE_FAST_FORWARD=0."""
    return fast if fast is not None else env_on("DYNATREE_FAST_FORWARD")


def supports_lean(model: torch.nn.Module) -> bool:
    """True when the model is a Llama-block causal LM the lean forward reproduces exactly."""
    config = model.config
    base = getattr(model, "model", None)
    rope = getattr(config, "rope_parameters", None) or {}
    return (
        config.model_type in LEAN_TYPES
        and base is not None
        and hasattr(base, "layers")
        and hasattr(base, "rotary_emb")
        and getattr(config, "hidden_act", "silu") == "silu"
        and getattr(config, "pretraining_tp", 1) == 1
        and "dynamic" not in str(rope.get("rope_type", "default"))  # positions change the frequencies
        and not getattr(config, "mlp_bias", False)
    )


FUSE_MAX_BYTES = 64 << 20  # fuse q/k/v and gate/up when the fused copy costs at most this much
# on a GPU the copy is cheap and every call a kernel launch (a small model is launch-bound there:
# docs/gpu.md), so the target is fused too: 5 -> 2 GEMMs and 2 -> 1 rotations a layer
FUSE_MAX_BYTES_BY_DEVICE = {"cuda": 1 << 30}
# devices whose F.rms_norm is one fused kernel (torch's _fused_rms_norm on CUDA) where transformers'
# formulation is eight: there the norm takes it (its own rounding, the same for every width); the
# CPU keeps transformers' formulation, bit for bit HF's
FUSED_NORM_DEVICES = ("cuda",)
# devices where the residual adds ride in the o and down GEMMs (x.addmm_(a, W.T): the GEMM's
# epilogue adds x, beta 1) and the rotation's add in one addcmul: 3 kernels fewer a layer, each
# with its own rounding, the same for every width (invariant.width_verdict probes the GEMM form)
FUSED_ADD_DEVICES = ("cuda",)


@contextlib.contextmanager
def device_forms(of: str, on: str) -> Iterator[None]:
    """Give device type `on` the forms the lean forward takes on `of` (fused norm, projections and
    adds), for lean forwards built inside: how the CPU runs and counts the GPU's forms."""
    global FUSED_NORM_DEVICES, FUSED_ADD_DEVICES
    saved = FUSED_NORM_DEVICES, FUSED_ADD_DEVICES, dict(FUSE_MAX_BYTES_BY_DEVICE)
    FUSED_NORM_DEVICES = (*FUSED_NORM_DEVICES, *((on,) if of in FUSED_NORM_DEVICES else ()))
    FUSED_ADD_DEVICES = (*FUSED_ADD_DEVICES, *((on,) if of in FUSED_ADD_DEVICES else ()))
    if of in FUSE_MAX_BYTES_BY_DEVICE:
        FUSE_MAX_BYTES_BY_DEVICE[on] = FUSE_MAX_BYTES_BY_DEVICE[of]
    try:
        yield
    finally:
        FUSED_NORM_DEVICES, FUSED_ADD_DEVICES = saved[:2]
        FUSE_MAX_BYTES_BY_DEVICE.clear()
        FUSE_MAX_BYTES_BY_DEVICE.update(saved[2])


def lean_forward_for(model: torch.nn.Module, fast: bool | None = None) -> LeanForward | None:
    """The lean forward of `model`, or None (switched off, or not a supported architecture).

    Built once per model and reused by every run (it holds no per-run state); rebuilt when the
    model's modules or weights change (packing replaces modules, training bumps tensor versions).
    A small model (the draft) also gets fused q/k/v and gate/up projections: 7 -> 4 linear calls
    per layer, worth ~10% of a draft level here; a large one (the target) keeps separate calls,
    since the fused copy would cost as much memory as its layers (on a GPU it is fused too:
    FUSE_MAX_BYTES_BY_DEVICE)."""
    if not fast_forward_enabled(fast) or not supports_lean(model):
        return None
    signature = _signature(model)
    cached = _LEAN.get(model)
    if cached is not None and cached[0] == signature:
        return cached[1]
    device = model.get_input_embeddings().weight.device.type
    lean = LeanForward(model, fuse=_fused_bytes(model) <= FUSE_MAX_BYTES_BY_DEVICE.get(device, FUSE_MAX_BYTES))
    _LEAN[model] = (signature, lean)
    return lean


_LEAN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _signature(model: torch.nn.Module) -> tuple:
    """Identity of every module and version of every weight: changes when either is replaced or updated."""
    weights = tuple((p.data_ptr(), 0 if p.is_inference() else p._version) for p in model.parameters())
    return tuple(id(m) for m in model.modules()) + weights  # inference tensors cannot be updated in place


def _fused_bytes(model: torch.nn.Module) -> int:
    size = torch.tensor([], dtype=model.dtype).element_size()
    per_layer = 0
    for layer in model.model.layers[:1]:
        attn, mlp = layer.self_attn, layer.mlp
        for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            per_layer += m.in_features * m.out_features
    return per_layer * len(model.model.layers) * size


def _linear(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The cheapest call of a linear layer: the packed oneDNN op or F.linear, no `Module.__call__`."""
    packed = getattr(module, "packed", None)
    if packed is not None:  # packing.PackedLinear
        bias = module.bias
        op = torch.ops.mkldnn._linear_pointwise
        return lambda x: op(x, packed, bias, "none", [], "")
    weight, bias = module.weight, module.bias
    return lambda x: F.linear(x, weight, bias)


def _fused(modules: list[torch.nn.Module]) -> Callable[[torch.Tensor], torch.Tensor]:
    """One linear over the concatenated weights of `modules` (same input): one call instead of
    len(modules). Costs a copy of their weights; packed for oneDNN when the originals are."""
    weight = torch.cat([m.weight for m in modules])  # PackedLinear.weight is a dense copy
    biases = [m.bias for m in modules]
    bias = (
        None
        if all(b is None for b in biases)
        else torch.cat(
            [b if b is not None else weight.new_zeros(m.out_features) for m, b in zip(modules, biases, strict=True)]
        )
    )
    if getattr(modules[0], "packed", None) is not None:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        op = torch.ops.mkldnn._linear_pointwise
        return lambda x: op(x, packed, bias, "none", [], "")
    return lambda x: F.linear(x, weight, bias)


def _residual(module: torch.nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """x + module(a) as one GEMM adding into x in place (addmm_, beta 1: the epilogue reads x), on
    FUSED_ADD_DEVICES for a plain linear without bias; None elsewhere. x (.., out) contiguous,
    a (.., in); returns x, updated."""
    if getattr(module, "packed", None) is not None or module.bias is not None:  # a packed .weight is a copy
        return None
    if module.weight.device.type not in FUSED_ADD_DEVICES:
        return None
    transposed = module.weight.t()

    def add(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        x.view(-1, x.shape[-1]).addmm_(a.reshape(-1, a.shape[-1]), transposed)
        return x

    return add


def _rms_norm(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """RMSNorm exactly as transformers computes it (in float32, then scaled in the model's dtype),
    or where the device fuses it (FUSED_NORM_DEVICES) as one F.rms_norm; an Identity (a layer
    without that norm: EAGLE-1's first) passes x through."""
    if isinstance(module, torch.nn.Identity):
        return lambda x: x
    weight, eps = module.weight, module.variance_epsilon
    if weight.device.type in FUSED_NORM_DEVICES:
        shape = (weight.shape[-1],)
        return lambda x: F.rms_norm(x, shape, weight, eps)

    def norm(x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    return norm


def fold_groups(q: torch.Tensor, groups: int) -> torch.Tensor:
    """q (B, heads, T, d) -> (B, kv_heads, groups * T, d): the query heads that share a key/value
    head become extra query rows of it (head j*groups + i, row t -> row i*T + t of head j), so
    SDPA sees equal head counts. With an explicit mask and fewer key/value heads than query heads,
    `enable_gqa` falls back to the math kernel over the whole cache (CUDA) or expands the cache
    per head (slow at decode widths on CPU); folded, neither happens."""
    b, heads, t, d = q.shape
    return q.reshape(b, heads // groups, groups * t, d)


def fold_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """The additive mask (B, 1, T, L) for folded queries: (B, 1, groups * T, L)."""
    return mask.repeat(1, 1, groups, 1) if groups > 1 else mask


def rope_pair(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary embedding's (cos, sin), (B, q, head_dim) each, as `_rotate` takes them, once per
    forward: broadcast over heads, and sin's first half negated (rotate_half's sign)."""
    half = sin.shape[-1] // 2
    return cos[:, None], torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)[:, None]


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE as in transformers' apply_rotary_pos_emb, x * cos + rotate_half(x) * sin, bit for bit:
    rotate_half(x) * sin = (-x2 * s1, x1 * s2) = roll(x, d/2) * (-s1, s2) (a sign flip is exact),
    so one roll stands for rotate_half's neg and cat (rope_pair made the signed sin once)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def _rotate_fused(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """_rotate with its add inside one addcmul (FUSED_ADD_DEVICES): 3 kernels for 4."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin)


def _rotate_in_place(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """_rotate_fused written over x (its products read x first): a fused q/k/v output keeps the
    rotated k beside v, so the cache takes both in one write (slots.side_by_side)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin, out=x)


class _Block:
    """One decoder layer's callables and shapes."""

    def __init__(self, layer: torch.nn.Module, fuse: bool):
        attn, mlp = layer.self_attn, layer.mlp
        self.norm1, self.norm2 = _rms_norm(layer.input_layernorm), _rms_norm(layer.post_attention_layernorm)
        self.o, self.down = _linear(attn.o_proj), _linear(mlp.down_proj)
        self.mlp_size = mlp.gate_proj.out_features
        self.qkv = _fused([attn.q_proj, attn.k_proj, attn.v_proj]) if fuse else None
        self.gate_up = _fused([mlp.gate_proj, mlp.up_proj]) if fuse else None
        self.q, self.k, self.v = (_linear(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj))
        self.gate, self.up = _linear(mlp.gate_proj), _linear(mlp.up_proj)
        self.add_o, self.add_down = _residual(attn.o_proj), _residual(mlp.down_proj)  # None: x + o(a)
        # the projection's own tensors (a packed one's .weight would be a copy made to be read)
        device = next(iter([*attn.o_proj.parameters(), *attn.o_proj.buffers()])).device.type
        self.rotate = _rotate_fused if device in FUSED_ADD_DEVICES else _rotate
        self.kernels = kernels.enabled(device)  # Triton's rotation and silu * up (forward/kernels.py)
        self.head_dim = attn.head_dim
        self.groups = attn.num_key_value_groups
        self.scaling = attn.scaling
        self.heads = attn.q_proj.out_features // attn.head_dim
        self.qk_heads = self.heads + attn.k_proj.out_features // attn.head_dim

    def mlp(self, x: torch.Tensor, rows: int = 1, down_rows: int = 1) -> torch.Tensor:
        """The block's second half: x + down(silu(gate(n2(x))) * up(n2(x))); `rows`, `down_rows`:
        how gate/up and down are called (invariant.min_rows, LinearRows)."""
        h = self.norm2(x)
        if self.gate_up is not None:
            both = min_rows(self.gate_up, h, rows)
            if self.kernels and not both.requires_grad:  # one kernel (its own rounding: once)
                return self.residual(x, "down", kernels.silu_mul(both), down_rows)
            gate, up = both.split(self.mlp_size, dim=-1)
        else:
            gate, up = min_rows(self.gate, h, rows), min_rows(self.up, h, rows)
        return self.residual(x, "down", F.silu(gate) * up, down_rows)

    def residual(self, x: torch.Tensor, name: str, a: torch.Tensor, rows: int) -> torch.Tensor:
        """x + the linear `name` ("o" or "down") of a: inside its GEMM (`add_<name>`, in place on
        x) unless the linear is padded (rows != 1: the form width_verdict chose the padding for)."""
        fused = getattr(self, f"add_{name}")
        if fused is not None and rows == 1:
            return fused(x, a)
        return x + min_rows(getattr(self, name), a, rows)

    def project(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: int = 1) -> tuple[torch.Tensor, ...]:
        """q, k, v as (B, heads, q, head_dim) for h (B, q, hidden), RoPE applied to q and k (one
        rotation when fused; cos and sin from rope_pair). The engine runs B = 1; batched data
        generation (training/) more."""
        heads = lambda t: t.view(h.shape[0], h.shape[1], -1, self.head_dim).transpose(1, 2)  # noqa: E731
        if self.qkv is None:
            q, k, v = (min_rows(f, h, rows) for f in (self.q, self.k, self.v))
            rotate = kernels.rotated if self.kernels and not q.requires_grad else self.rotate  # new tensors
            return rotate(heads(q), cos, sin), rotate(heads(k), cos, sin), heads(v)
        qkv = heads(min_rows(self.qkv, h, rows))
        if self.kernels and not qkv.requires_grad:  # Triton's rotation in one kernel, over q and k
            qk = kernels.rotated(qkv[:, : self.qk_heads], cos, sin)
        elif self.rotate is _rotate_fused and not qkv.requires_grad:  # out= has no autograd
            qk = _rotate_in_place(qkv[:, : self.qk_heads], cos, sin)
        else:
            qk = self.rotate(qkv[:, : self.qk_heads], cos, sin)
        return qk[:, : self.heads], qk[:, self.heads :], qkv[:, self.qk_heads :]


class LeanForward:
    """Callable: (ids (1, q), positions (1, q), additive mask (1, 1, q, L + q), cache layers, keep)
    -> Forward (logits (keep, vocab) [and hidden states (q, hidden)]), writing the q new
    keys/values into the cache layers (SlotLayer.update). A batch of b sequences (the recipes'
    batched answers: training/answers/decode_ops.py) is the same call with b in place of 1, each
    sequence over its own slots of the layers' buffers: logits (b, keep, vocab), states (b, q, hidden)."""

    def __init__(self, model: torch.nn.Module, fuse: bool = False):
        base = model.model
        self.embed = base.embed_tokens
        self.rotary = base.rotary_emb
        self.rope_table = RopeTable(base.rotary_emb)  # width-invariant forwards look cos/sin up
        self.blocks = [_Block(layer, fuse) for layer in base.layers]
        # a feature draft has no final norm of its own (its features are already post-norm)
        self.norm = (lambda x: x) if isinstance(base.norm, torch.nn.Identity) else _rms_norm(base.norm)
        self.head = _linear(model.lm_head)

    def __call__(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        layers: list,
        logits_to_keep: int,
        *,
        embeds: torch.Tensor | None = None,
        hidden: bool | tuple[int, ...] = False,
        rows: RowGroups | StaticRows | None = None,
    ) -> Forward:
        """`embeds` (1, q, hidden): inputs instead of the ids' embeddings; `hidden`: also return
        the final (post-norm) hidden states of all q rows, or for a tuple of taps (core/taps.py)
        those states stacked (q, len(taps), hidden) (see rows.Rows); `rows`: attend with
        forward/invariant.py's width-invariant attention over each row's own keys (`mask` unused)."""
        x = F.embedding(ids, self.embed.weight) if embeds is None else embeds  # (1, q, hidden)
        in_place = self.blocks[0].add_o is not None  # the residual adds write into x (_residual)
        if in_place and embeds is not None:
            x = x.clone()  # the caller's tensor stays as it was
        rope = self.rotary(x, positions) if rows is None else self.rope_table(x, positions, rows.positions_end)
        cos, sin = rope_pair(*rope)  # (1, 1, q, head_dim) each, sin signed for _rotate
        folded = None if rows is not None else fold_mask(mask, self.blocks[0].groups)  # once per forward
        pad = rows.linear_rows if rows is not None else LinearRows()  # how each linear is called (width_verdict)
        taps = hidden if isinstance(hidden, tuple) else ()
        tapped = {}
        one = ids.shape[0] == 1  # one sequence (every forward of a run): its rows, no batch dimension
        for i, (block, cache) in enumerate(zip(self.blocks, layers, strict=True)):
            if i in taps:
                tapped[i] = x.clone() if in_place else x
            q, k, v = block.project(block.norm1(x), cos, sin, pad.qkv)  # (1, heads, q, head_dim), q and k rotated
            keys, values = cache.update(k, v)  # views of slots 0 .. L + q
            if rows is not None:
                attn = rows.attend(q, keys, values, block.scaling)  # invariant.py: each row over its own keys
            else:
                attn = F.scaled_dot_product_attention(
                    fold_groups(q, block.groups), keys, values, attn_mask=folded, scale=block.scaling
                ).reshape(q.shape)  # CUDA kernels return it strided (rows, heads) major: a view would fail
            x = block.residual(x, "o", attn.transpose(1, 2).reshape(*ids.shape, -1), pad.o)
            x = block.mlp(x, pad.gate_up, pad.down)
        if one:
            x, tapped = x[0], {i: t[0] for i, t in tapped.items()}
        kept = x.shape[-2] - logits_to_keep  # the first row whose logits are kept (0 kept: none)
        if not hidden:
            return Forward(min_rows(self.head, self.norm(x[..., kept:, :]), pad.head))
        states = self.norm(x)
        logits = min_rows(self.head, states[..., kept:, :], pad.head) if logits_to_keep else None  # states alone
        return Forward(logits, stack_taps(taps, tapped, states) if taps else states)
