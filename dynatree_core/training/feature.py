"""Train the feature draft (drafts/feature.py) on the target's own features: EAGLE's KD.

Stage `feature-label` (feature_data.py) stores the target's final hidden states at every window
position; the target's soft labels are head(f), recomputed from them here over the draft's vocabulary.

Stage `train-feature` (EAGLE, Li et al. 2024, sec. 4.2): for each window
position j >= 1 the draft reads (f_{j-1} + U(-noise, noise), x_j) and predicts f_j;

    loss = smooth_l1(pred_j, f_j) + ce_weight * CE(softmax(head(f_j)), log_softmax(head(pred_j)))

averaged over valid positions, both softmaxes over the draft's reduced vocabulary (OTHER never
proposed, so left out of both). The target's embedding and the LM head rows are frozen; fc and
the decoder layer train. AdamW, linear warm-up, cosine decay. Resumable (`checkpoint.pt`, written
whole; a rerun resumes it only with the same draft and settings: resume.py), and every stage's
compute goes to the ledger (ledger.py).

`agreement_by_depth` is the held-out measure BENCHMARKS.md reports: top-1 agreement of the draft's
best real token with the target's greedy token at tree depth 1 (true input features) and deeper
(the draft's own predicted features along the node's ancestors, as in a drafted tree).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dynatree_core.core.models import resolve_device
from dynatree_core.core.vocab import OTHER, TokenMap
from dynatree_core.core.weights import check_same_run, load_weights, save_whole
from dynatree_core.drafts.feature import FeatureDraft
from dynatree_core.runs.environment import portable
from dynatree_core.training.feature_data import FeatureCorpus
from dynatree_core.training.feature_talf import feature_talf_loss
from dynatree_core.training.ledger import record
from dynatree_core.training.resume import head_run
from dynatree_core.training.unrolled import depth_mask, unrolled_kd_loss


@dataclasses.dataclass
class FeatureTrainConfig:
    steps: int = 6000
    batch: int = 32
    lr: float = 1e-3
    warmup: int = 100
    weight_decay: float = 0.0
    ce_weight: float = 0.1
    noise: float = 0.1  # uniform noise on input features (EAGLE sec. 4.2)
    onpolicy_share: float = 0.5
    seed: int = 0
    eval_every: int = 250
    log_every: int = 25
    device: str = "auto"
    ce_share: float = 1.0  # share of positions the CE is taken over (< 1 saves head products on a CPU)
    autocast: str = "bfloat16"  # mixed precision for forward and loss ("" for float32)
    loss: str = "kd"  # "kd" (EAGLE: regression + CE), "unrolled" (unrolled.py) or "talf" (feature_talf.py)
    unroll_steps: int = 3  # "unrolled": levels the draft is unrolled over its own predicted features
    unroll_decay: float = 0.8  # "unrolled": weight of level k is decay^(k-1)
    regression_weight: float = 0.0  # TALF only: add the feature regression (the paper drops it)
    budget_s: float = 0.0  # > 0: stop after this much training wall time, cosine over time (equal-compute runs)


# what a resumed run must share with the one that wrote its checkpoint (besides the draft's form): the
# loss and the optimiser's settings; the schedule's length (steps, budget_s) may grow between runs
RUN_SETTINGS = ("batch", "lr", "warmup", "weight_decay", "ce_weight", "noise", "onpolicy_share", "seed", "ce_share",
                "loss", "unroll_steps", "unroll_decay", "regression_weight")  # fmt: skip


def feature_kd_loss(
    draft: FeatureDraft,
    x: torch.Tensor,
    f: torch.Tensor,
    valid: torch.Tensor,
    *,
    noise: float,
    ce_weight: float,
    ce_share: float = 1.0,
    answer: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """The KD loss over a batch of windows (module docstring); and (regression, ce, agreement).
    `answer` (B, W): the positions whose next token counts (None: every valid one).
    `ce_share` < 1 takes the cross-entropy (two LM-head products per position: most of a step's
    arithmetic on a CPU) over that random share of the valid positions only."""
    inputs = f[:, :-1]
    if noise > 0:
        inputs = inputs + (torch.rand_like(inputs) * 2 - 1) * noise
    tokens, goal = x[:, 1:], f[:, 1:]
    mask = valid[:, 1:]
    counted = mask if answer is None else mask & answer[:, 1:]
    width = tokens.shape[1]
    embeds = draft.inputs(tokens, inputs.to(draft.dtype))
    positions = torch.arange(1, width + 1, device=x.device)[None].expand(len(x), -1)
    pred = draft.lm.model(inputs_embeds=embeds, position_ids=positions, attention_mask=mask.long()).last_hidden_state
    pred = pred.float()
    m = counted.float()
    reg = (F.smooth_l1_loss(pred, goal, reduction="none").mean(-1) * m).sum() / m.sum().clamp(min=1)
    rows = counted if ce_share >= 1 else counted & (torch.rand(mask.shape, device=mask.device) < ce_share)
    logq = torch.log_softmax(draft.reduced_logits(pred[rows]), -1)
    with torch.no_grad():
        p = torch.softmax(draft.reduced_logits(goal[rows]), -1)
    ce = -(p * logq.nan_to_num(neginf=0.0)).sum(-1).sum() / max(int(rows.sum()), 1)
    hit = (logq.argmax(-1) == p.argmax(-1)).float().mean() if len(p) else torch.tensor(0.0)
    parts = {"regression": float(reg.detach()), "ce": float(ce.detach()), "agreement": float(hit)}
    return reg + ce_weight * ce, parts


@torch.no_grad()
def agreement_by_depth(
    draft: FeatureDraft,
    target_head: torch.nn.Module,
    data: FeatureCorpus,
    rows: np.ndarray,
    *,
    depths: int = 4,
    batch: int = 4,
    device: torch.device | None = None,
) -> list[float]:
    """Held-out top-1 agreement with the target's greedy token at tree depth 1..`depths`, given
    that the node's ancestors were accepted (their tokens are the true ones).

    Depth 1 is the root's prediction: every input feature is the target's. A node at depth k
    reads the predicted feature of its parent, which read its parent's, down to the root; it
    attends to the committed pairs (true features) and its ancestors, exactly as in a drafted
    tree (`depth_mask`). Each depth adds one stacked copy of the window and one forward. The
    target's greedy token is argmax of head(f) over its full vocabulary."""
    device = device or next(draft.parameters()).device
    hits, total = np.zeros(depths), np.zeros(depths)
    for start in range(0, len(rows), batch):
        x, f, valid, counted = data.batch(rows[start : start + batch], device, with_loss_mask=True)
        tokens, pair_valid = x[:, 1:], valid[:, 1:]  # pair j reads (f_{j-1}, x_j), predicts x_{j+1}
        width = tokens.shape[1]
        greedy = target_head(f[:, 1:].to(target_head.weight.dtype)).argmax(-1)
        features = [f[:, :-1]]  # level 1: true features; level k: level k-1's prediction one pair earlier
        for level in range(1, depths + 1):
            embeds = draft.inputs(tokens.repeat(1, level), torch.cat(features, 1).to(draft.dtype))
            positions = torch.arange(1, width + 1, device=device).repeat(level)[None].expand(len(x), -1)
            mask = depth_mask(level, width, pair_valid.cpu()).to(device=device, dtype=draft.dtype)
            out = draft.lm.model(inputs_embeds=embeds, position_ids=positions, attention_mask=mask).last_hidden_state
            pred = out[:, (level - 1) * width :]
            pick = draft.reduced_logits(pred).argmax(-1)
            if draft.token_map is not None:
                pick = draft.token_map.draft_to_target.to(device)[pick]
            ok = counted[:, 1:].clone()
            ok[:, : level - 1] = False  # the chain's root must be a real pair
            hits[level - 1] += float(((pick == greedy) & ok).sum())
            total[level - 1] += float(ok.sum())
            features.append(torch.cat([f[:, :1], pred[:, :-1].float()], 1))
    return [float(h / max(t, 1)) for h, t in zip(hits, total, strict=True)]


@torch.no_grad()
def token_draft_agreement(
    draft: torch.nn.Module, token_map: TokenMap | None, target_head: torch.nn.Module, data: FeatureCorpus, rows
) -> float:
    """The same held-out measure for a token draft: its top-1 (best real token) against the
    target's greedy token, teacher-forced. Given accepted ancestors a token draft reads the true
    tokens at every depth, so this one number is its agreement at depth 1..4."""
    device = target_head.weight.device
    hits = total = 0.0
    for start in range(0, len(rows), 4):
        x, f, valid, counted = data.batch(rows[start : start + 4], device, with_loss_mask=True)
        greedy = target_head(f.to(target_head.weight.dtype)).argmax(-1)
        ids = token_map.to_draft(x) if token_map is not None else x
        logits = draft(input_ids=ids, attention_mask=valid.long()).logits.float()
        if token_map is not None:
            logits[..., OTHER] = -torch.inf
            pick = token_map.draft_to_target.to(device)[logits.argmax(-1)]
        else:
            pick = logits.argmax(-1)
        hits += float(((pick == greedy) & counted).sum())
        total += float(counted.sum())
    return hits / max(total, 1.0)


def _autocast(device: torch.device, dtype: str):
    import contextlib

    if not dtype:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, dtype))


def train_feature_draft(
    target: torch.nn.Module,
    token_map: TokenMap | None,
    data: FeatureCorpus,
    out: Path,
    cfg: FeatureTrainConfig,
    *,
    init_from: Path | None = None,
    trees=None,
    about: dict | None = None,
    log=print,
) -> FeatureDraft:
    """KD or TALF training (resumable from `out/checkpoint.pt`); saves the draft to `out/draft`.

    `init_from`: a saved feature draft to start from (weights only: TALF fine-tunes a converged
    KD draft, Alg. 1). `trees`: the target trees (`feature_talf.TargetTrees`) for cfg.loss "talf".
    `about`: what to record of the data in curve.json (the model card reads it), beside the loss
    positions trained on so far (`seen`), from which the card counts passes over the data."""
    if cfg.loss not in ("kd", "talf", "unrolled"):
        raise SystemExit(f"--loss must be kd, unrolled or talf, not {cfg.loss!r}")
    if cfg.loss == "talf" and trees is None:
        raise SystemExit("--loss talf needs target trees (run talf-label first)")
    device = resolve_device(cfg.device)
    out.mkdir(parents=True, exist_ok=True)
    draft = FeatureDraft.from_target(target, token_map, seed=cfg.seed).float().to(device).train()
    if init_from is not None and not (out / "checkpoint.pt").exists():
        start = FeatureDraft.load(init_from, target)
        # fc and the layer only: the head is the target's rows for this run's token map (frozen),
        # which may differ from the starting draft's map
        weights = {k: v.float() for k, v in start.state_dict().items() if not k.startswith("lm.lm_head")}
        load_weights(draft, weights, what=str(init_from), allow_missing=("lm.lm_head",))
        log(f"train-feature: initialised from {init_from}")
    draft.lm.lm_head.weight.requires_grad_(False)  # the target's rows, frozen (EAGLE)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    step, curve = 0, []
    spent, seen = 0.0, 0  # training wall seconds (evaluations excluded); loss positions trained on
    ckpt = out / "checkpoint.pt"
    run = head_run(draft, **{k: getattr(cfg, k) for k in RUN_SETTINGS})
    if ckpt.exists():
        state = torch.load(ckpt, map_location=device, weights_only=False)
        check_same_run(state.get("run"), run, where=str(ckpt))
        load_weights(draft, state["model"], what=str(ckpt))
        opt.load_state_dict(state["opt"])
        step, curve = state["step"], state["curve"]
        spent, seen = state.get("spent_s", 0.0), state.get("seen", 0)
        log(f"train-feature: resumed at step {step}")
    rng = np.random.default_rng(cfg.seed + step)
    torch.manual_seed(cfg.seed + step)
    head = target.get_output_embeddings()
    t_last, tokens_since = time.perf_counter(), 0

    def done() -> bool:
        return step >= cfg.steps or (cfg.budget_s > 0 and spent >= cfg.budget_s)

    def checkpoint() -> None:  # at every log line too: a run stopped between evaluations loses little
        state = {"model": draft.state_dict(), "opt": opt.state_dict(), "step": step, "curve": curve}
        # written whole, then renamed: a run killed while saving keeps the last one
        save_whole(state | {"spent_s": spent, "seen": seen, "run": run}, ckpt)

    while not done():
        # cosine decay over the steps, or over the wall-time budget when one is set: two losses of
        # different cost per step then get the same compute and each a complete schedule
        progress = min(spent / cfg.budget_s, 1.0) if cfg.budget_s > 0 else step / cfg.steps
        lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * progress))
        t_step = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr
        if cfg.loss == "talf":  # windows with target trees (on-policy first: see talf.label_trees)
            pick = rng.choice(len(trees), cfg.batch, replace=len(trees) < cfg.batch)
            x, f, valid = data.batch(trees.rows[pick], device)
            with _autocast(device, cfg.autocast):
                loss, parts = feature_talf_loss(
                    draft,
                    x,
                    f,
                    valid,
                    trees.batch(pick),
                    noise=cfg.noise,
                    ce_share=cfg.ce_share,
                    regression_weight=cfg.regression_weight,
                )
        else:
            rows = data.sample(rng, cfg.batch, cfg.onpolicy_share)
            # answer shards (answer_data.py) count answer tokens only; the corpus every valid position
            x, f, valid, answer = data.batch(rows, device, with_loss_mask=True)
            kd = dict(noise=cfg.noise, ce_weight=cfg.ce_weight, ce_share=cfg.ce_share)
            with _autocast(device, cfg.autocast):
                if cfg.loss == "unrolled":
                    loss, parts = unrolled_kd_loss(
                        draft, x, f, valid, answer, steps=cfg.unroll_steps, decay=cfg.unroll_decay, **kd
                    )
                else:
                    loss, parts = feature_kd_loss(draft, x, f, valid, answer=answer, **kd)
            seen += int((answer[:, 1:] & valid[:, 1:]).sum())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        step += 1
        spent += time.perf_counter() - t_step
        tokens_since += int(valid.sum())
        if step % cfg.log_every == 0 or done():
            dt = time.perf_counter() - t_last
            record("train-feature", dt, tokens=tokens_since, item=f"steps to {step}", run=str(out))
            terms = " ".join(f"{k} {v:.3f}" for k, v in parts.items())
            rate = tokens_since / dt
            log(f"train-feature: step {step} loss {loss.item():.4f} {terms} lr {lr:.2e} ({rate:.0f} tokens/s)")
            checkpoint()
            t_last, tokens_since = time.perf_counter(), 0
        if step % cfg.eval_every == 0 or done():
            draft.eval()
            rows = data.eval_rows
            by_depth = agreement_by_depth(draft, head, data, rows, device=device) if len(rows) else []
            draft.train()
            point = {
                "step": step,
                "loss": loss.item(),
                "train_s": round(spent, 1),
                "seen": seen,
                "heldout_agreement_by_depth": by_depth,
            }
            curve.append(point)
            log(f"train-feature: step {step} held-out agreement by depth {[round(a, 3) for a in by_depth]}")
            checkpoint()
            t_last = time.perf_counter()  # the evaluation's time is not training throughput
            info = {"config": dataclasses.asdict(cfg), "curve": curve}
            if about is not None or init_from is not None:
                info["data"] = dict(about or {}) | ({"init_from": portable(str(init_from))} if init_from else {})
            (out / "curve.json").write_text(json.dumps(info, indent=1))
    draft.eval()
    draft.save(out / "draft")
    return draft
