"""The cheap training step for either head kind, and the long resumable schedule around it.

One step (packed.py: packed windows, no padding; the compact teacher, no target LM head):

    level 1   every pair reads the target's state: the feature kind fc([embed; f_j]), the fused
              kind fc over the normed taps (EAGLE-3)
    level k   pair j reads level k-1's output at pair j-1 (its parent in a drafted tree, detached),
              attending as a depth-k tree node does (packed.level_mask), through the keys and values
              of the earlier levels (EAGLE-3's training-time test; `levels` = 1 is plain KD)

    loss = sum_k 0.8^(k-1) [ CE(teacher, draft at level k) + regression_weight * smoothL1(pred, f_{j+1}) ]
           / sum_k 0.8^(k-1)

CE is the soft cross-entropy to the teacher's top-k renormalised over the draft's map, over the
counted pairs whose root lies in the same window; the regression term applies to the feature kind
only (the fused kind predicts no target state: EAGLE-3 dropped the feature loss).

`train_packed` runs the schedule: `passes` over the training pairs, linear warm-up then cosine
decay to zero over the whole run (by loss pairs seen, so a run stopped and resumed continues
the same schedule), a checkpoint at every log line (written whole; a rerun resumes it only for the
same draft and loss: resume.py), and held-out and OOD agreement by depth at fixed intervals of
training time into `curve.json` (the card's learning curve).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dynatree_core.core.vocab import OTHER
from dynatree_core.core.weights import check_same_run, load_weights, save_whole
from dynatree_core.drafts.fused import FusedDraft
from dynatree_core.training.ledger import record
from dynatree_core.training.packed import PackedAnswers, PackedBatch, level_mask, prefetch
from dynatree_core.training.resume import head_run

# what a resumed run must share with the one that wrote its checkpoint (besides the draft's form): the
# loss and the optimiser's settings. The schedule's length (passes, budget_s) may grow, and how the
# process runs (device, logging, evaluations, stop_after_s) may change between runs.
RUN_SETTINGS = ("pairs_per_step", "lr", "warmup", "weight_decay", "levels", "level_decay", "regression_weight",
                "ce_weight", "ce_share", "noise", "train_head", "seed")  # fmt: skip


@dataclasses.dataclass
class PackedTrainConfig:
    passes: float = 15.0  # over the training loss pairs: the schedule's length
    pairs_per_step: int = 8192  # packed pair slots a step reads (about 16 rows of 512)
    lr: float = 5e-4
    warmup: int = 50
    weight_decay: float = 0.0
    levels: int = 1  # 1: KD; > 1: unrolled over the draft's own outputs (training-time test)
    level_decay: float = 0.8
    regression_weight: float = 1.0  # feature kind: smooth L1 to the next feature (0 for the fused kind)
    ce_weight: float = 0.1  # feature kind's weight of the CE beside the regression (fused kind: CE alone)
    ce_share: float = (
        1.0  # CE over this random share of the counted pairs (fused kind: its whole loss), fewer head products
    )
    noise: float = 0.0  # uniform noise on the level-1 input states (EAGLE sec. 4.2)
    autocast: str = "bfloat16"  # "" for float32
    train_head: bool = False  # fused kind: train its head too (EAGLE-3 does; frozen = the target's rows)
    seed: int = 0
    log_every: int = 10
    eval_every_s: float = 1800.0  # training seconds between held-out / OOD evaluations (<= 0: none)
    eval_windows: int = 96  # held-out windows in each evaluation (OOD: all of them)
    eval_first: bool = False  # also evaluate before the first step (the curve's starting point)
    stop_after_s: float = 0.0  # > 0: end this process after this much training time (the schedule stays)
    budget_s: float = 0.0  # > 0: the schedule is this much training time instead of `passes` (equal-compute runs)
    device: str = "cpu"


def _autocast(device: torch.device, dtype: str):
    return torch.autocast(device.type, dtype=getattr(torch, dtype)) if dtype else contextlib.nullcontext()


def level_inputs(draft, batch: PackedBatch) -> torch.Tensor:
    """Level 1's hidden inputs (R, T, H) for the fused kind, or the features for the feature kind."""
    if isinstance(draft, FusedDraft):
        return draft.fuse(batch.inputs)
    return batch.inputs.to(draft.dtype)


def _layer_of(draft):
    """(decoder layer, rotary embedding) of either kind: both layers have the Llama block's parts."""
    if isinstance(draft, FusedDraft):
        return draft.midlayer, draft.rotary
    return draft.lm.model.layers[0], draft.lm.model.rotary_emb


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def _gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x (R, T, ...) at index (R, S) along T."""
    return x.gather(1, index.view(*index.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:]))


def level_forward(draft, tokens, hidden, positions, mask, past=None, select=None):
    """One pass of the draft's layer over packed rows, written out so that the query side runs
    only where an output is needed: keys and values for every pair (later pairs and levels read
    them), queries, attention, o and the MLP only at `select` (R, T) bool rows (None: all).
    Same arithmetic as the drafter's forward (tests/test_packed_training.py).

    Returns (outputs (R, S, H) at the selected rows in row-major order, S = the most selected in
    a row, and their validity (R, S) bool; (keys, values) including this pass's, for the next)."""
    layer, rotary = _layer_of(draft)
    attn = layer.self_attn
    if isinstance(draft, FusedDraft):
        resid = draft.residual(hidden)
        x = torch.cat([layer.input_layernorm(draft.token_embeds(tokens)), layer.hidden_norm(hidden)], dim=-1)
    else:
        resid = draft.inputs(tokens, hidden)
        x = layer.input_layernorm(resid)
    rows, width = tokens.shape
    config = draft.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = attn.q_proj.out_features // heads
    cos, sin = rotary(resid, positions)  # (R, T, d)
    k = attn.k_proj(x).view(rows, width, kv_heads, dim).transpose(1, 2)
    v = attn.v_proj(x).view(rows, width, kv_heads, dim).transpose(1, 2)
    k = _rope(k, cos[:, None], sin[:, None])
    if past is not None:
        k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
    if select is None:
        index = torch.arange(width, device=tokens.device)[None].expand(rows, -1)
        valid = torch.ones(rows, width, dtype=torch.bool, device=tokens.device)
    else:
        count = select.sum(1)
        index = torch.argsort((~select).to(torch.int8), dim=1, stable=True)[:, : max(int(count.max()), 1)]
        valid = torch.arange(index.shape[1], device=tokens.device)[None] < count[:, None]
    xq, rq = _gather_rows(x, index), _gather_rows(resid, index)
    q = attn.q_proj(xq).view(rows, -1, heads, dim).transpose(1, 2)
    q = _rope(q, _gather_rows(cos, index)[:, None], _gather_rows(sin, index)[:, None])
    m = mask.gather(2, index[:, None, :, None].expand(-1, 1, -1, mask.shape[-1])).to(q.dtype)
    groups = heads // kv_heads
    keys, values = (k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)) if groups > 1 else (k, v)
    a = F.scaled_dot_product_attention(q, keys, values, attn_mask=m)
    h = rq + attn.o_proj(a.transpose(1, 2).reshape(rows, -1, heads * dim))
    h = h + layer.mlp(layer.post_attention_layernorm(h))
    return h, valid, (k, v)


def unrolled_outputs(draft, batch: PackedBatch, levels: int, *, noise: float = 0.0, detach: bool = True, last=None):
    """Per level 1..levels, the draft's outputs (R, T, H) at every pair slot (module docstring).

    With `last` (R, T) bool, only what the last level's rows `last` depend on is computed: the
    last level at those rows, returned as (outputs, valid) (level_forward), and level m < levels
    at their ancestors, the pairs `levels - m` earlier, returned (R, T, H) with zeros elsewhere
    (keys and values are computed everywhere; no needed row attends to the rest)."""
    tokens, positions = batch.tokens, batch.positions
    hidden = level_inputs(draft, batch)
    if noise > 0:
        hidden = hidden + (torch.rand_like(hidden) * 2 - 1) * noise
    outs: list = []
    past = None
    for level in range(1, levels + 1):
        if level > 1:  # pair j reads its parent's output, at pair j-1 (pair 0 reads a placeholder: never counted)
            prev = outs[-1].detach() if detach else outs[-1]
            hidden = torch.cat([hidden[:, :1], prev[:, :-1].to(hidden.dtype)], dim=1)
        mask = level_mask(batch.seg.cpu(), level).to(device=tokens.device)
        select = None
        if last is not None:
            select = torch.zeros_like(last)
            select[:, : last.shape[1] - (levels - level)] = last[:, levels - level :]
        out, valid, past = level_forward(draft, tokens, hidden, positions, mask, past, select)
        if select is not None and level < levels:  # back to pair slots, for the next level's inputs
            index = torch.argsort((~select).to(torch.int8), dim=1, stable=True)[:, : out.shape[1]]
            full = torch.zeros(*select.shape, out.shape[-1], dtype=out.dtype, device=out.device)
            out = full.scatter(1, index[..., None].expand(-1, -1, out.shape[-1]), out * valid[..., None])
        outs.append((out, valid) if select is not None and level == levels else out)
    return outs


def root_ok(seg: torch.Tensor, level: int) -> torch.Tensor:
    """(R, T) bool: the pair's level-`level` chain starts inside its own window."""
    if level == 1:
        return seg >= 0
    shifted = torch.full_like(seg, -2)
    shifted[:, level - 1 :] = seg[:, : -(level - 1)]
    return (seg >= 0) & (shifted == seg)


def soft_ce(draft, h: torch.Tensor, slots: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean soft cross-entropy of the draft's head at outputs h (n, H) to the teacher's
    probabilities p (n, K) on draft slots `slots` (n, K), OTHER left out of the normaliser;
    and the logits (n, slots), for the agreement. As lse(z) - sum_k p_k z_k (sum_k p_k = 1): no
    (n, slots) log-softmax is materialised, in either direction."""
    z = draft.lm_head(draft.norm(h)) if isinstance(draft, FusedDraft) else draft.lm.lm_head(h)
    lse = torch.logsumexp(z[:, OTHER + 1 :], dim=-1).float()  # slot 0 is OTHER, never proposed
    picked = z.gather(1, slots).float()
    return (lse - (p * picked).sum(-1)).mean(), z


def packed_loss(draft, batch: PackedBatch, cfg: PackedTrainConfig, *, parts: bool = True) -> tuple[torch.Tensor, dict]:
    """The step's loss (module docstring); with `parts`, its terms and per-level agreement with
    the teacher's argmax (for the log)."""
    fused = isinstance(draft, FusedDraft)
    share = torch.rand(batch.counted.shape, device=batch.counted.device) < cfg.ce_share if cfg.ce_share < 1 else None
    last = batch.counted & root_ok(batch.seg, cfg.levels)
    if fused and share is not None:  # the fused kind's only loss is the CE: its outputs are needed there only
        last &= share
    outs = unrolled_outputs(draft, batch, cfg.levels, noise=cfg.noise, last=last)
    total, weights, info = 0.0, 0.0, {}
    for level, out in enumerate(outs, 1):
        if level < cfg.levels:  # levels before the last are computed at the last one's ancestors only
            rows = torch.zeros_like(last)
            rows[:, : last.shape[1] - (cfg.levels - level)] = last[:, cfg.levels - level :]
            rows &= batch.counted & root_ok(batch.seg, level)
        else:
            rows = last
        if not bool(rows.any()):
            continue
        h = out[0][out[1]] if isinstance(out, tuple) else out[rows]  # the selected rows, row-major like out[rows]
        on = share[rows] if share is not None and not fused else slice(None)  # feature kind: CE on the share only
        slots = batch.teacher_slots[rows][on]
        ce, z = soft_ce(draft, h[on], slots, batch.teacher_p[rows][on])
        term = ce if fused else cfg.ce_weight * ce
        if not fused and cfg.regression_weight > 0:
            reg = F.smooth_l1_loss(h.float(), batch.goal[rows].float(), reduction="none").mean(-1).mean()
            term = term + cfg.regression_weight * reg
            if parts:
                info[f"reg{level}"] = float(reg.detach())
        weight = cfg.level_decay ** (level - 1)
        total, weights = total + weight * term, weights + weight
        if parts:
            info[f"ce{level}"] = float(ce.detach())
            best = z.detach()[:, OTHER + 1 :].argmax(-1) + OTHER + 1
            info[f"agree{level}"] = float((best == slots[:, 0]).float().mean())
    return total / max(weights, 1e-9), info


@torch.no_grad()
def packed_agreement(draft, data: PackedAnswers, rows: np.ndarray, target_head, *, depths: int = 4) -> list[float]:
    """Top-1 agreement of the draft's best real token with the target's greedy token (argmax of
    its float32 head over the whole vocabulary at the stored next feature) at tree depth 1..`depths`,
    given accepted ancestors; over every answer pair of `rows`, as training/feature.py measures it."""
    hits, total = np.zeros(depths), np.zeros(depths)
    device = next(draft.parameters()).device
    step = 16
    for start in range(0, len(rows), step):
        batch = data.batch(rows[start : start + step], with_goal=True).to(device)
        greedy = target_head(batch.goal.to(target_head.weight.dtype)).argmax(-1)  # (R, T) target ids
        for level, out in enumerate(unrolled_outputs(draft, batch, depths, detach=False), 1):
            pick = draft.token_map.draft_to_target.to(device)[draft.reduced_logits(out).argmax(-1)]
            ok = batch.answer & root_ok(batch.seg, level)
            hits[level - 1] += float(((pick == greedy) & ok).sum())
            total[level - 1] += float(ok.sum())
    return [float(h / max(t, 1)) for h, t in zip(hits, total, strict=True)]


def lr_at(cfg: PackedTrainConfig, step: int, progress: float) -> float:
    """Linear warm-up over `warmup` steps, then cosine to zero over the run's progress (0..1)."""
    return cfg.lr * min(1.0, (step + 1) / max(cfg.warmup, 1)) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


PAUSED = 10.0  # a step this many times its recent median was paused (SIGSTOP) or starved: not training


def counted_s(dt: float, recent: list[float]) -> float:
    """The training seconds a step of wall time `dt` counts: `dt`, unless it took over PAUSED times
    the median of the recent steps (the process was stopped while the suite ran), then that median.
    Keeps a background run's curve, eval interval and ledger in training time; `recent` is updated."""
    typical = sorted(recent)[len(recent) // 2] if len(recent) >= 5 else None
    counted = typical if typical is not None and dt > PAUSED * typical else dt
    recent[:] = [*recent[-19:], counted]
    return counted


def train_packed(
    draft,
    data: PackedAnswers,
    out: Path,
    cfg: PackedTrainConfig,
    *,
    target_head,
    evals: dict[str, tuple[PackedAnswers, np.ndarray]] | None = None,
    about: dict | None = None,
    clock=time.perf_counter,
    log=print,
):
    """Train `draft` on `data` (resumable from `out/checkpoint.pt`); returns the draft, saved to
    `out/draft` when the schedule ends. `evals`: {name: (data, rows)} measured at every
    evaluation (the learning curve); `about`: what curve.json says of the data."""
    device = torch.device(cfg.device)
    out.mkdir(parents=True, exist_ok=True)
    draft = draft.float().to(device).train()
    # the feature kind's head is the target's rows, always frozen; the fused kind's may train
    frozen = ([] if cfg.train_head else ["lm_head"]) if isinstance(draft, FusedDraft) else ["lm.lm_head"]
    for name, param in draft.named_parameters():
        param.requires_grad_(not any(name.startswith(f) for f in frozen))
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    pass_pairs = max(data.answer_pairs(), 1)
    total_pairs = cfg.passes * pass_pairs
    # the first evaluation after one interval (a run from a trained draft measures its start with --eval-first)
    first_eval = 0.0 if cfg.eval_first else cfg.eval_every_s
    state = {"step": 0, "seen": 0, "spent_s": 0.0, "pass": 0, "cursor": 0, "curve": [], "next_eval_s": first_eval}
    ckpt = out / "checkpoint.pt"
    run = head_run(draft, **{k: getattr(cfg, k) for k in RUN_SETTINGS})
    if ckpt.exists():
        saved = torch.load(ckpt, map_location=device, weights_only=False)
        check_same_run(saved.get("run"), run, where=str(ckpt))
        load_weights(draft, saved["model"], what=str(ckpt))
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        log(f"train-packed: resumed at step {state['step']} (pass {state['pass']}, {state['seen']:,} pairs seen)")

    def checkpoint() -> None:  # written whole, then renamed: a run killed while saving keeps the last one
        save_whole({"model": draft.state_dict(), "opt": opt.state_dict(), "state": state, "run": run}, ckpt)

    def evaluate() -> None:
        draft.eval()
        point = {k: state[k] for k in ("step", "seen", "pass")} | {"train_s": round(state["spent_s"], 1)}
        for name, (split, rows) in (evals or {}).items():
            point[name] = [round(a, 4) for a in packed_agreement(draft, split, rows, target_head)]
        draft.train()
        state["curve"].append(point)
        log(f"train-packed: step {state['step']} agreement by depth " + json.dumps({k: point[k] for k in evals or {}}))
        info = {"config": dataclasses.asdict(cfg), "kind": draft.kind, "curve": state["curve"]}
        if about is not None:
            info["data"] = about
        (out / "curve.json").write_text(json.dumps(info, indent=1))

    def batches():  # on the prefetch thread: its own place in the data, handed over with each batch
        epoch, cursor = state["pass"], state["cursor"]
        while True:
            order = np.random.default_rng(cfg.seed + epoch).permutation(data.train_rows)
            while cursor < len(order):
                rows, cursor = data.step_rows(order, cursor, cfg.pairs_per_step)
                yield data.batch(rows), epoch, cursor
            epoch, cursor = epoch + 1, 0

    torch.manual_seed(cfg.seed + state["step"])
    started, pairs_since, block_s, recent = state["spent_s"], 0, 0.0, []

    def progress() -> float:  # of the whole schedule, 0..1: by pairs seen, or by training time under a budget
        return state["spent_s"] / cfg.budget_s if cfg.budget_s > 0 else state["seen"] / total_pairs

    for batch, epoch, cursor in prefetch(batches):
        if progress() >= 1 or (cfg.stop_after_s > 0 and state["spent_s"] - started >= cfg.stop_after_s):
            break
        if cfg.eval_every_s > 0 and state["spent_s"] >= state["next_eval_s"]:
            evaluate()
            state["next_eval_s"] = state["spent_s"] + cfg.eval_every_s
        t0 = clock()
        lr = lr_at(cfg, state["step"], progress())
        for group in opt.param_groups:
            group["lr"] = lr
        batch = batch.to(device)
        logging = (state["step"] + 1) % cfg.log_every == 0
        with _autocast(device, cfg.autocast):
            loss, parts = packed_loss(draft, batch, cfg, parts=logging)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        state["step"] += 1
        state["seen"] += int(batch.answer.sum())
        state["pass"], state["cursor"] = epoch, cursor  # a resumed run starts after this batch
        dt = counted_s(clock() - t0, recent)
        state["spent_s"] += dt
        pairs_since, block_s = pairs_since + batch.pairs, block_s + dt
        if state["step"] % cfg.log_every == 0:
            dt, block_s = block_s, 0.0  # training time of the block's steps (pauses left out)
            record("train-packed", dt, tokens=pairs_since, item=f"steps to {state['step']}", run=str(out))
            terms = " ".join(f"{k} {v:.3f}" for k, v in parts.items())
            log(
                f"train-packed: step {state['step']} loss {loss.item():.4f} {terms} lr {lr:.2e} "
                f"pass {state['seen'] / pass_pairs:.2f} ({pairs_since / dt:.0f} pairs/s)"
            )
            checkpoint()
            pairs_since = 0
    finished = progress() >= 1
    if cfg.eval_every_s > 0:
        evaluate()
    checkpoint()
    draft.eval()
    if finished:
        draft.save(out / "draft")
        log(f"train-packed: the schedule is complete; saved {out / 'draft'}")
    else:
        log(f"train-packed: stopped at {progress():.1%} of the schedule; rerun to continue")
    return draft
