"""Where a width-invariant tree run first leaves `ar`'s bits: the diagnosis for a device whose
kernels break forward/invariant.py's promise without its probe seeing it (`gpu-check` runs it).

Both runs go through the engine (decoding/engine.py: `start_run` + `iterate`), width-invariant,
keeping their target forwards' logits. Every position on the committed path has one logits row
in each run: `ar` computed it alone, the tree run inside a verify forward (the root, or an
accepted node). They are compared bit for bit, position by position. At the first position whose
row differs, the two target caches are compared position by position, layer by layer, up to and
including that position (both runs committed the same tokens before it); the first (position,
layer) whose key or value differs says where the bits parted:

- no entry differs: the forward's final norm or head (after every cache write);
- layer 0: that position's embedding, first norm, or k / v projection;
- layer l > 0, layer l - 1 equal at that position: layer l - 1's attention, o projection or MLP,
  or layer l's norm or k / v projection.

Greedy tokens flip only where the difference beats ar's top-two gap, so a run can differ in bits
and still be token-identical; the report says both.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from dynatree_core.core.settings import ForwardSettings
from dynatree_core.decoding.engine import DecodeConfig, iterate, start_run
from dynatree_core.decoding.methods import make_method
from dynatree_core.measure.bench import encode_prompts
from dynatree_core.measure.prompt_sets import choose_prompts


@dataclasses.dataclass
class _Run:
    """A run's committed tokens, its logits per position, and its state (the caches)."""

    state: object
    logits: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # position -> row (host)
    widths: dict[int, int] = dataclasses.field(default_factory=dict)  # position -> rows in its forward
    last: torch.Tensor | None = None  # the latest target forward's logits (host, float32)

    @property
    def tokens(self) -> list[int]:
        return self.state.committed[self.state.prompt_len :]


def _start(target, draft, prompt: list[int], policy: str, max_new: int, token_map, graphs) -> tuple[_Run, object]:
    config = DecodeConfig(max_new_tokens=max_new, forward=ForwardSettings(width_invariant=True, graphs=graphs))
    method = make_method(policy)
    state = start_run(
        target, prompt, method, draft=None if policy == "ar" else draft, config=config, draft_token_map=token_map
    )
    run = _Run(state)
    done = state.target_kv._done  # every target forward ends there: eager, padded, or a captured step's

    def keeping(*args, **kwargs):  # the verify forward's logits, one row per node of its order
        out = done(*args, **kwargs)
        # a copy: a captured step's logits are its buffer, rewritten at the step's next replay
        run.last = out.logits.to("cpu", torch.float32, copy=True)
        return out

    state.target_kv._done = keeping
    return run, iterate(state)


def _keep_path(run: _Run, record) -> None:
    """The logits rows of the committed path (the root, then the accepted nodes) by position."""
    rows = [record.order.index(n) for n in [record.order[0], *record.accepted]]
    for row in rows:
        run.logits[record.position_ids[row]] = run.last[row]
        run.widths[record.position_ids[row]] = len(record.order) + record.chain_len - 1


def _first_cache_difference(a, b, upto: int) -> dict | None:
    """The first (position, layer) at or below `upto` whose key or value differs between two
    target caches (KVState), scanning positions first."""
    la, lb = a.target_kv.cache.layers, b.target_kv.cache.layers
    n = min(upto + 1, min(layer.length for layer in la), min(layer.length for layer in lb))
    for pos in range(n):
        for index, (x, y) in enumerate(zip(la, lb, strict=True)):
            for kind in ("keys", "values"):
                u, v = getattr(x, kind)[..., pos, :], getattr(y, kind)[..., pos, :]
                if not torch.equal(u, v):
                    diff = (u.float() - v.float()).abs().max().item()
                    return {"position": pos, "layer": index, "tensor": kind, "max_abs_diff": diff}
    return None


def _where(cache: dict | None) -> str:
    if cache is None:
        return "final norm or head (every cache entry up to it is equal)"
    if cache["layer"] == 0:
        return "layer 0 at that position: its embedding, first norm or k/v projection"
    layer = cache["layer"]
    return f"layer {layer - 1}'s attention, o projection or MLP, or layer {layer}'s norm or k/v projection"


@torch.inference_mode()
def divergence(
    target, draft, prompt: list[int], policy: str = "fixed_tree", *, max_new: int = 64, token_map=None, graphs=None
) -> dict:
    """The first position where `policy`'s width-invariant run leaves `ar`'s logits bits (module
    docstring): its position, the rows of its forward, the logits' largest difference, ar's
    top-two gap there, whether the tokens parted, and the first differing cache entry. `graphs`:
    DecodeConfig's (None: the device's default, captured forwards and steps on CUDA)."""
    ar, ar_steps = _start(target, draft, prompt, "ar", max_new, token_map, graphs)
    for record in ar_steps:
        _keep_path(ar, record)
    tree, tree_steps = _start(target, draft, prompt, policy, max_new, token_map, graphs)
    report = {
        "policy": policy,
        "dtype": str(target.dtype),
        "prompt_tokens": len(prompt),
        "new_tokens": max_new,
        "path": tree.state.target_kv.path,
    }
    for record in tree_steps:
        _keep_path(tree, record)
        differ = sorted(p for p in tree.logits if p in ar.logits and not torch.equal(tree.logits[p], ar.logits[p]))
        if not differ:
            continue
        pos = differ[0]
        mine, theirs = tree.logits[pos], ar.logits[pos]
        top2 = theirs.topk(2).values
        cache = _first_cache_difference(tree.state, ar.state, pos)
        report |= {
            "bitwise": False,
            "position": pos,
            "iteration": record.index,
            "rows_in_forward": tree.widths[pos],
            "max_abs_diff": (mine - theirs).abs().max().item(),
            "ar_top2_gap": (top2[0] - top2[1]).item(),
            "token_flipped": int(mine.argmax()) != int(theirs.argmax()),
            "cache": cache,
            "where": _where(cache),
        }
        return report
    same = tree.tokens == ar.tokens[: len(tree.tokens)]
    return report | {"bitwise": True, "token_identical": same, "positions": len(tree.logits)}


DIVERGENCE_POLICIES = ("fixed_tree", "eagle2", "dyspec_threshold")
# the OOD prompt traced, in bench's order (choose_prompts): the multi-turn one (0-based 3), where
# every tree policy but delayed_auto parted from bfloat16 `ar` on an H100 (2026-11-27) while the
# first prompt stayed token-identical
DIVERGENCE_PROMPT = 3


def divergence_checks(name: str, pair, *, dtype=torch.bfloat16, max_new: int = 128) -> list[dict]:
    """Per policy in DIVERGENCE_POLICIES: measure/divergence.py's trace on OOD prompt
    DIVERGENCE_PROMPT in `dtype`, width-invariant; a row {pair, check, ok, detail, trace}."""
    traced = choose_prompts("ood", DIVERGENCE_PROMPT + 1)[DIVERGENCE_PROMPT:]  # bench's order
    prompt = encode_prompts(pair.target.tokenizer, traced, None)[0]

    def in_dtype(model):  # gpu-check loads the pair in float32 (a CPU pair's packed linears cannot be cast)
        return model if model.dtype == dtype else copy.deepcopy(model).to(dtype)

    target = in_dtype(pair.target.model)
    rows = []
    for policy in DIVERGENCE_POLICIES:
        drafting = pair.drafting(make_method(policy))
        draft = in_dtype(drafting["draft"])
        trace = divergence(target, draft, prompt, policy, max_new=max_new, token_map=drafting["draft_token_map"])
        rows.append({"pair": name, "check": f"bits {policy}", "ok": trace["bitwise"], "detail": trace_line(trace)})
        rows[-1]["trace"] = trace
    return rows


def trace_line(trace: dict) -> str:
    """One line for a divergence trace (measure/divergence.py)."""
    label = str(trace.get("dtype", "")).removeprefix("torch.")
    if trace["bitwise"]:
        same = "token-identical" if trace["token_identical"] else "tokens differ (bits equal: a logic bug)"
        return f"bitwise over {trace['positions']} positions, {same} {label}".rstrip()
    flip = "token flipped" if trace["token_flipped"] else "token kept"
    return (
        f"position {trace['position']} (iteration {trace['iteration']}, {trace['rows_in_forward']} rows): "
        f"logits differ by {trace['max_abs_diff']:.3g}, ar's top-2 gap {trace['ar_top2_gap']:.3g}, {flip}; "
        f"first differing: {trace['where']}"
    )
