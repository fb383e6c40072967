"""Distil a small Llama-architecture draft from the target's top-k labels (KD, optionally + TALF).

The draft is a stock `LlamaForCausalLM` over a reduced vocabulary (core/vocab.py): slot 0 is OTHER,
slots 1..N-1 are the target tokens ranked most useful (target argmax counts on on-policy text,
then input frequency). Its tied embeddings start as a PCA projection of the target's, so its LM
head starts close to the target's. Loss per position: cross-entropy to the target's top-k
distribution (forward KL up to a constant, renormalised over the k stored tokens; mass of
tokens outside the set goes to OTHER) plus `hard_weight` x cross-entropy to the target's
argmax, the token greedy verification accepts. With `talf_weight > 0` the TALF tree loss
(talf.py) is added. Seeded and resumable: `checkpoint.pt` (written whole) holds model, optimiser,
step, RNG state, the token map and the run's settings; a restarted job with the same settings
continues from it, one with others is refused (naming them).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dynatree_core.core.vocab import OTHER, TokenMap
from dynatree_core.core.weights import check_same_run, load_weights, save_whole
from dynatree_core.training.corpus import SHARD, TOPK, shard_valid
from dynatree_core.training.ledger import record


@dataclasses.dataclass
class TrainConfig:
    hidden: int = 256
    layers: int = 6
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 768
    vocab: int = 16384  # draft vocabulary slots, OTHER included
    steps: int = 3000
    batch: int = 8
    lr: float = 2e-3
    warmup: int = 100
    hard_weight: float = 0.5
    talf_weight: float = 0.0  # > 0: add the TALF tree loss (mean over nodes) with this weight
    onpolicy_share: float = 0.0  # > 0: this share of each batch comes from on-policy windows
    seed: int = 0
    eval_every: int = 250
    log_every: int = 25


# what a resumed run must share with the one that wrote its checkpoint: the draft's shape, the loss and the
# optimiser's settings (the schedule's length, steps, may grow between runs)
RUN_SETTINGS = ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "batch", "lr", "warmup",
                "hard_weight", "talf_weight", "onpolicy_share", "seed")  # fmt: skip


def draft_config(target_config, cfg: TrainConfig, vocab: int) -> LlamaConfig:
    rope = getattr(target_config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 1e4}
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=target_config.max_position_embeddings,
        tie_word_embeddings=True,
        rope_parameters=dict(rope),
        rms_norm_eps=1e-5,
    )


def select_vocab(data: LabelledCorpus, n: int, always: list[int]) -> list[int]:
    """Target ids for draft slots 1..n-1: `always` first, then by usefulness.

    Score = 4 x (times the token is the target's argmax on labelled on-policy windows) +
    (times it appears as input anywhere in the training windows).
    """
    vocab = data.target_vocab
    rows = data.train_rows
    valid = data.lengths[rows, None] > np.arange(data.ids.shape[1])[None, :]
    score = np.bincount(data.ids[rows][valid].astype(np.int64), minlength=vocab).astype(np.float64)
    onp = rows[data.source[rows] == 0]
    if len(onp):
        m = data.lengths[onp, None] > np.arange(data.ids.shape[1])[None, :]
        score += 4 * np.bincount(data.topk_ids[onp, :, 0][m].astype(np.int64), minlength=vocab)
    chosen = list(dict.fromkeys(int(t) for t in always if 0 <= t < vocab))
    taken = set(chosen)
    for tok in np.argsort(-score, kind="stable"):
        if len(chosen) >= n - 1:
            break
        if int(tok) not in taken:
            chosen.append(int(tok))
    return chosen


@torch.no_grad()
def init_draft(target: torch.nn.Module, cfg: TrainConfig, token_map: TokenMap) -> LlamaForCausalLM:
    """A fresh draft whose tied embeddings are the target's (mapped tokens), projected onto
    their top principal components; OTHER starts at the mean of the unmapped tokens."""
    torch.manual_seed(cfg.seed)
    draft = LlamaForCausalLM(draft_config(target.config, cfg, len(token_map)))
    emb = target.get_input_embeddings().weight.float()
    centred = emb - emb.mean(0, keepdim=True)
    _, _, v = torch.linalg.svd(centred[:: max(1, len(emb) // 16384)], full_matrices=False)
    proj = centred @ v[: cfg.hidden].T  # (target vocab, hidden)
    proj *= 0.02 / proj.std()  # the scale HF initialises embeddings with
    table = torch.empty(len(token_map), cfg.hidden)
    table[1:] = proj[token_map.draft_to_target[1:]]
    unmapped = token_map.target_to_draft == OTHER
    table[OTHER] = proj[unmapped].mean(0) if unmapped.any() else 0.0
    draft.get_input_embeddings().weight.copy_(table)
    return draft


def kd_loss(
    logits: torch.Tensor, topk_ids: torch.Tensor, topk_logp: torch.Tensor, mask: torch.Tensor, hard_weight: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Args: logits (B, T, V); topk_ids, topk_logp (B, T, K) labels in the draft's id space;
    mask (B, T) bool.

    Returns (loss, agreement): mean soft CE + hard_weight * CE to the target argmax, and the
    fraction of positions where the draft's argmax (OTHER excluded) equals the target's.
    """
    logq = torch.log_softmax(logits.float(), dim=-1)
    logq_k = logq.gather(-1, topk_ids)  # (B, T, K)
    p = torch.softmax(topk_logp.float(), dim=-1)  # renormalised over the stored top-k
    soft = -(p * logq_k).sum(-1)
    hard = -logq_k[..., 0]  # top-1 of the labels is the target's argmax
    m = mask.float()
    loss = ((soft + hard_weight * hard) * m).sum() / m.sum().clamp(min=1)
    return loss, agreement(logits.detach(), topk_ids[..., 0], mask)


def agreement(logits: torch.Tensor, target_top1: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Share of positions where the draft's best real token is the target's argmax."""
    pick = logits[..., 1:].argmax(-1) + 1  # OTHER is never proposed at decode time
    hit = (pick == target_top1) & (target_top1 != OTHER) & mask
    return hit.sum() / mask.sum().clamp(min=1)


class LabelledCorpus:
    """Windows + label shards, kept in memory (uint16/float16: ~80 bytes per token)."""

    def __init__(self, corpus: Path, labels_dir: Path, target_vocab: int):
        data = np.load(corpus)
        self.ids, self.lengths, self.heldout = data["ids"], data["lengths"], data["heldout"]
        self.source = data["source"]
        self.target_vocab = target_vocab
        n, width = self.ids.shape
        self.topk_ids = np.zeros((n, width, TOPK), np.uint16)
        self.topk_logp = np.zeros((n, width, TOPK), np.float16)
        labelled = np.zeros(n, dtype=bool)
        for path in sorted(labels_dir.glob("shard_[0-9][0-9][0-9][0-9][0-9].npz")):
            index = int(path.stem.split("_")[1])
            sl = slice(index * SHARD, (index + 1) * SHARD)
            if not shard_valid(path, self.ids[sl]):
                continue  # stale: the corpus changed after this shard was labelled
            with np.load(path) as shard:
                self.topk_ids[sl] = shard["topk_ids"]
                self.topk_logp[sl] = shard["topk_logp"]
            labelled[sl] = True
        self.train_rows = np.flatnonzero(labelled & ~self.heldout)
        self.eval_rows = np.flatnonzero(labelled & self.heldout)
        self.token_map: TokenMap | None = None

    def sample(self, rng: np.random.Generator, n: int, onpolicy_share: float = 0.0) -> np.ndarray:
        """n distinct training rows: uniform, or round(n x share) of them from on-policy windows."""
        if onpolicy_share <= 0:
            return rng.choice(self.train_rows, n, replace=False)
        onp = self.train_rows[self.source[self.train_rows] == 0]
        rest = self.train_rows[self.source[self.train_rows] != 0]
        k = min(len(onp), round(n * onpolicy_share))
        return np.concatenate([rng.choice(onp, k, replace=False), rng.choice(rest, n - k, replace=False)])

    def batch(self, rows: np.ndarray):
        """Inputs, mask and labels for these windows, in the draft's id space."""
        length = torch.from_numpy(self.lengths[rows].astype(np.int64))
        width = int(length.max())
        x = torch.from_numpy(self.ids[rows, :width].astype(np.int64))
        mask = torch.arange(width)[None, :] < length[:, None]
        tid = torch.from_numpy(self.topk_ids[rows, :width].astype(np.int64))
        tlp = torch.from_numpy(self.topk_logp[rows, :width].astype(np.float32))
        return self.token_map.to_draft(x), mask, self.token_map.to_draft(tid), tlp


@torch.no_grad()
def evaluate(draft: torch.nn.Module, data: LabelledCorpus, batch: int = 8) -> float:
    """Top-1 agreement with the target's greedy token on the held-out generations."""
    draft.eval()
    hits, total = 0.0, 0.0
    for start in range(0, len(data.eval_rows), batch):
        x, mask, tid, _ = data.batch(data.eval_rows[start : start + batch])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = draft(input_ids=x, attention_mask=mask.long()).logits
        hits += agreement(logits, tid[..., 0], mask).item() * mask.sum().item()
        total += mask.sum().item()
    draft.train()
    return hits / max(total, 1)


def load_trees(path: Path | None) -> dict[str, np.ndarray] | None:
    if not path or not Path(path).exists():
        return None
    with np.load(path) as data:
        return {key: data[key] for key in data.files}


def talf_step_loss(draft, data: LabelledCorpus, trees: dict[str, np.ndarray], index: int) -> torch.Tensor:
    """Mean per-node TALF loss for one window with target trees (see talf.py)."""
    from dynatree_core.training.talf import talf_node_loss

    row = int(trees["row"][index])
    window = torch.from_numpy(data.ids[row, : int(data.lengths[row])].astype(np.int64))
    t = {key: torch.from_numpy(trees[key][index].astype(np.int64)) for key in ("tokens", "parents", "depths")}
    t["topk_ids"] = data.token_map.to_draft(torch.from_numpy(trees["topk_ids"][index].astype(np.int64)))
    t["topk_logp"] = torch.from_numpy(trees["topk_logp"][index].astype(np.float32))
    t["tokens"] = data.token_map.to_draft(t["tokens"])
    roots = torch.from_numpy(trees["roots"][index].astype(np.int64))
    return talf_node_loss(draft, data.token_map.to_draft(window), roots, t) / t["tokens"].numel()


def _load_start(source: Path) -> dict:
    """A checkpoint.pt, or a saved draft directory (weights + token_map.json) to continue from."""
    source = Path(source)
    if source.is_dir():
        from safetensors.torch import load_file

        token_map = TokenMap.load(source)
        if token_map is None:
            raise SystemExit(f"{source} has no {'token_map.json'}: not a draft saved by this trainer")
        state = {k: v.float() for k, v in load_file(str(source / "model.safetensors")).items()}
        if "lm_head.weight" not in state:  # tied weights are saved once
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        return {"model": state, "draft_to_target": token_map.draft_to_target.tolist()}
    return torch.load(source, weights_only=False)


def train(
    out: Path,
    corpus: Path,
    labels_dir: Path,
    cfg: TrainConfig,
    target_spec: str = "embedded",
    talf_trees: Path | None = None,
    init_from: Path | None = None,
) -> Path:
    """Train (or resume) a draft; returns the directory of the saved model."""
    from dynatree_core.core.models import load_model

    out.mkdir(parents=True, exist_ok=True)
    target = load_model(target_spec, device="cpu", dtype="float32")
    data = LabelledCorpus(corpus, labels_dir, target.model.config.vocab_size)
    print(f"train: {len(data.train_rows)} train / {len(data.eval_rows)} held-out windows", flush=True)
    ckpt_path = out / "checkpoint.pt"
    source = ckpt_path if ckpt_path.exists() else init_from
    ckpt = _load_start(source) if source else None
    run = {k: getattr(cfg, k) for k in RUN_SETTINGS} | {"target": target_spec}
    if ckpt is not None and source == ckpt_path:  # before anything is built from it
        check_same_run(ckpt.get("run"), run, where=str(ckpt_path))
    if ckpt is not None:
        draft_to_target = ckpt["draft_to_target"]
    else:
        draft_to_target = [-1, *select_vocab(data, cfg.vocab, target.tokenizer.all_special_ids)]
    data.token_map = TokenMap(draft_to_target, data.target_vocab)
    draft = init_draft(target.model, cfg, data.token_map)
    opt = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, weight_decay=0.01, betas=(0.9, 0.95))
    step, curve = 0, []
    rng = np.random.default_rng(cfg.seed)
    if ckpt is not None:
        load_weights(draft, ckpt["model"], what=str(source))
        if source == ckpt_path:  # resume; --init-from only takes the weights
            opt.load_state_dict(ckpt["opt"])
            step, curve = ckpt["step"], ckpt["curve"]
            rng.bit_generator.state = ckpt["rng"]
        print(f"train: {'resumed at step ' + str(step) if source == ckpt_path else 'initialised from ' + str(source)}")
    trees = load_trees(talf_trees) if cfg.talf_weight > 0 else None
    if cfg.talf_weight > 0 and trees is None:
        raise SystemExit(f"--talf-weight needs target trees at {talf_trees} (run talf-label first)")
    draft.train()
    t0, tokens = time.perf_counter(), 0
    last_save, last_tokens = t0, 0
    while step < cfg.steps:
        lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        x, mask, tid, tlp = data.batch(data.sample(rng, cfg.batch, cfg.onpolicy_share))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = draft(input_ids=x, attention_mask=mask.long()).logits
            loss, agree = kd_loss(logits, tid, tlp, mask, cfg.hard_weight)
            if trees is not None:  # TALF (Alg. 1): one window's target trees per step
                index = int(rng.integers(len(trees["row"])))
                loss = loss + cfg.talf_weight * talf_step_loss(draft, data, trees, index)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += int(mask.sum())
        if step % cfg.log_every == 0:
            rate = tokens / (time.perf_counter() - t0)
            print(
                f"train: step {step} loss {loss.item():.3f} agree {agree.item():.3f} lr {lr:.2e} {rate:.0f} tok/s",
                flush=True,
            )
        if step % cfg.eval_every == 0 or step == cfg.steps:
            held = evaluate(draft, data)
            curve.append(
                {
                    "step": step,
                    "windows_seen": step * cfg.batch,
                    "heldout_agreement": held,
                    "loss": loss.item(),
                    "wall_s": time.perf_counter() - t0,
                }
            )
            print(f"train: step {step} held-out agreement {held:.3f}", flush=True)
            now = time.perf_counter()
            record("train", now - last_save, tokens=tokens - last_tokens, run=str(out), item=f"steps to {step}")
            last_save, last_tokens = now, tokens
            save_whole(  # written whole, then renamed: a run killed while saving keeps the last one
                {
                    "model": draft.state_dict(),
                    "opt": opt.state_dict(),
                    "step": step,
                    "curve": curve,
                    "rng": rng.bit_generator.state,
                    "config": dataclasses.asdict(cfg),
                    "run": run,
                    "draft_to_target": draft_to_target,
                },
                ckpt_path,
            )
    final = out / "model"
    draft.to(torch.bfloat16).save_pretrained(final)
    target.tokenizer.save_pretrained(final)
    data.token_map.save(final)
    (out / "curve.json").write_text(json.dumps({"config": dataclasses.asdict(cfg), "curve": curve}, indent=1))
    return final
