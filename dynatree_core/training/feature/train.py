"""The feature-KD recipe (`train-feature`): the feature draft (drafts/feature.py) trained on the
target's own features, EAGLE's KD, over the sampled corpus or the answer shards.

Stage `feature-label` (feature/labels.py) stores the target's final hidden states at every window
position; the target's soft labels are head(f), recomputed from them here over the draft's vocabulary.

Stage `train-feature` (EAGLE, Li et al. 2024, sec. 4.2): for each window
position j >= 1 the draft reads (f_{j-1} + U(-noise, noise), x_j) and predicts f_j;

    loss = smooth_l1(pred_j, f_j) + ce_weight * CE(softmax(head(f_j)), log_softmax(head(pred_j)))

averaged over valid positions, both softmaxes over the draft's reduced vocabulary (OTHER never
proposed, so left out of both). The target's embedding and the LM head rows are frozen; fc and
the decoder layer train, through the one loop (trainer.py: AdamW, linear warm-up, cosine decay by
steps or by `budget_s` seconds of training, gradient clip 0.5, resumable `checkpoint.pt`, ledger).

`agreement_by_depth` is the held-out measure BENCHMARKS.md reports: top-1 agreement of the draft's
best real token with the target's greedy token at tree depth 1 (true input features) and deeper
(the draft's own predicted features along the node's ancestors, as in a drafted tree).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dynatree_core.core.devices import resolve_device
from dynatree_core.core.vocab import OTHER, TokenMap
from dynatree_core.core.weights import load_weights
from dynatree_core.drafts.feature import FeatureDraft
from dynatree_core.runs.environment import portable
from dynatree_core.training import trainer
from dynatree_core.training.feature.depth import depth_mask
from dynatree_core.training.feature.labels import FeatureCorpus
from dynatree_core.training.resume import head_run
from dynatree_core.training.trainer import Loop, Recipe, open_checkpoint


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
    loss: str = "kd"  # EAGLE: regression + CE (the only one left: docs/training.md, "Removed recipes")
    budget_s: float = 0.0  # > 0: stop after this much training wall time, cosine over time (equal-compute runs)


# what a resumed run must share with the one that wrote its checkpoint (besides the draft's form): the
# loss and the optimiser's settings; the schedule's length (steps, budget_s) may grow between runs
RUN_SETTINGS = ("batch", "lr", "warmup", "weight_decay", "ce_weight", "noise", "onpolicy_share", "seed", "ce_share",
                "loss")  # fmt: skip
# the removed losses' settings at the values every KD run recorded: checkpoints written before resume
REMOVED_SETTINGS = {"unroll_steps": 3, "unroll_decay": 0.8, "regression_weight": 0.0}


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


def _recipe(draft: FeatureDraft, target, data, cfg: FeatureTrainConfig, run: dict, *, info: dict, log):
    """The feature draft's KD loss, batches and held-out agreement by depth, for the one loop."""
    device = next(draft.parameters()).device
    head = target.get_output_embeddings()
    kd = dict(noise=cfg.noise, ce_weight=cfg.ce_weight, ce_share=cfg.ce_share)

    def batches(state: dict):
        rng = np.random.default_rng(cfg.seed + state["step"])
        torch.manual_seed(cfg.seed + state["step"])
        while True:
            rows = data.sample(rng, cfg.batch, cfg.onpolicy_share)
            # answer shards (answers/windows.py) count answer tokens only; the corpus every valid position
            yield data.batch(rows, device, with_loss_mask=True), {}

    def loss(batch, parts: bool):
        x, f, valid, answer = batch
        value, terms = feature_kd_loss(draft, x, f, valid, answer=answer, **kd)
        return value, terms, int((answer[:, 1:] & valid[:, 1:]).sum()), int(valid.sum())

    def point(state: dict, loss: float) -> dict:
        rows = data.eval_rows
        by_depth = agreement_by_depth(draft, head, data, rows, device=device) if len(rows) else []
        log(f"train-feature: step {state['step']} held-out agreement by depth {[round(a, 3) for a in by_depth]}")
        return {"step": state["step"], "loss": loss, "train_s": round(state["spent_s"], 1), "seen": state["seen"],
                "heldout_agreement_by_depth": by_depth}  # fmt: skip

    params = [p for p in draft.parameters() if p.requires_grad]
    return Recipe(draft, params, batches, loss, point, lambda out: draft.save(out / "draft"), run, info=info)


def train_feature_draft(
    target: torch.nn.Module,
    token_map: TokenMap | None,
    data: FeatureCorpus,
    out: Path,
    cfg: FeatureTrainConfig,
    *,
    init_from: Path | None = None,
    about: dict | None = None,
    log=print,
) -> FeatureDraft:
    """KD training through the one loop (trainer.py; resumable from `out/checkpoint.pt`); saves
    the draft to `out/draft`.

    `init_from`: a saved feature draft to start from (weights only). `about`: what to record of
    the data in curve.json (the model card reads it), beside the loss positions trained on so far
    (`seen`), from which the card counts passes over the data."""
    if cfg.loss != "kd":
        raise SystemExit(f"--loss must be kd, not {cfg.loss!r} (unrolled and talf were removed: docs/training.md)")
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
    run = head_run(draft, **{k: getattr(cfg, k) for k in RUN_SETTINGS}, **REMOVED_SETTINGS)
    saved = open_checkpoint(out / "checkpoint.pt", run, device)
    info = {"config": dataclasses.asdict(cfg)}
    if about is not None or init_from is not None:
        info["data"] = dict(about or {}) | ({"init_from": portable(str(init_from))} if init_from else {})
    loop = Loop("train-feature", cfg.lr, cfg.warmup, clip=0.5, weight_decay=cfg.weight_decay, steps=cfg.steps,
                budget_s=cfg.budget_s, log_every=cfg.log_every, eval_every=cfg.eval_every, autocast=cfg.autocast,
                device=str(device))  # fmt: skip
    recipe = _recipe(draft, target, data, cfg, run, info=info, log=log)
    trainer.train(recipe, out, loop, saved=saved, log=log)
    return draft
