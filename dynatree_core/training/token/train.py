"""The token draft's recipe (`make draft`, stage `train`): distil a small Llama-architecture draft
from the target's top-k labels (KD).

The draft is a stock `LlamaForCausalLM` over a reduced vocabulary (core/vocab.py): slot 0 is OTHER,
slots 1..N-1 are the target tokens ranked most useful (target argmax counts on on-policy text,
then input frequency). Its tied embeddings start as a PCA projection of the target's, so its LM
head starts close to the target's. Loss per position: cross-entropy to the target's top-k
distribution (forward KL up to a constant, renormalised over the k stored tokens; mass of
tokens outside the set goes to OTHER) plus `hard_weight` x cross-entropy to the target's
argmax, the token greedy verification accepts. It trains through the one loop (trainer.py:
gradient clip 1.0, weight decay 0.01); seeded and resumable: `checkpoint.pt` (written whole)
holds model, optimiser, step, the sampler's RNG state, the token map and the run's settings; a
restarted job with the same settings continues from it, one with others is refused (naming them).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dynatree_core.core.vocab import OTHER, TokenMap
from dynatree_core.core.weights import load_weights
from dynatree_core.training import trainer
from dynatree_core.training.token.corpus import SHARD, TOPK, shard_valid
from dynatree_core.training.trainer import Loop, Recipe, open_checkpoint


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
    onpolicy_share: float = 0.0  # > 0: this share of each batch comes from on-policy windows
    seed: int = 0
    eval_every: int = 250
    log_every: int = 25


# what a resumed run must share with the one that wrote its checkpoint: the draft's shape, the loss and the
# optimiser's settings (the schedule's length, steps, may grow between runs)
RUN_SETTINGS = ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "batch", "lr", "warmup",
                "hard_weight", "onpolicy_share", "seed")  # fmt: skip


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
    return ranked_ids(score, n - 1, always)


def ranked_ids(score: np.ndarray, n: int, always=()) -> list[int]:
    """n ids: `always` first (those in range, once each), then by descending `score` (ties by id).
    The token draft's vocabulary (above) and the feature drafts' frequency maps (answers/windows.py)."""
    chosen = list(dict.fromkeys(int(t) for t in always if 0 <= t < len(score)))
    taken = set(chosen)
    for tok in np.argsort(-score, kind="stable"):
        if len(chosen) >= n:
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


def _recipe(draft, data: LabelledCorpus, cfg: TrainConfig, run: dict, save) -> Recipe:
    """The token draft's loss, batches (half of them on-policy windows with `onpolicy_share`) and
    held-out agreement, for the one loop (trainer.py)."""

    def batches(state: dict):
        rng = np.random.default_rng(cfg.seed)
        if "rng" in state:  # the sampler's place, saved with the checkpoint
            rng.bit_generator.state = state["rng"]
        while True:
            batch = data.batch(data.sample(rng, cfg.batch, cfg.onpolicy_share))
            yield batch, {"rng": rng.bit_generator.state}

    def loss(batch, parts: bool):
        x, mask, tid, tlp = batch
        logits = draft(input_ids=x, attention_mask=mask.long()).logits
        value, agree = kd_loss(logits, tid, tlp, mask, cfg.hard_weight)
        return value, {"agree": agree.item()}, len(x), int(mask.sum())

    def point(state: dict, loss: float) -> dict:
        held = evaluate(draft, data)
        print(f"train: step {state['step']} held-out agreement {held:.3f}", flush=True)
        return {"step": state["step"], "windows_seen": state["step"] * cfg.batch, "heldout_agreement": held,
                "loss": loss, "wall_s": state["spent_s"]}  # fmt: skip

    info = {"config": dataclasses.asdict(cfg)}
    extra = {"config": info["config"], "draft_to_target": data.token_map.draft_to_target.tolist()}
    params = list(draft.parameters())
    return Recipe(draft, params, batches, loss, point, save, run, info=info, extra=extra)


def train(
    out: Path,
    corpus: Path,
    labels_dir: Path,
    cfg: TrainConfig,
    target_spec: str = "embedded",
    init_from: Path | None = None,
) -> Path:
    """Train (or resume) a draft; returns the directory of the saved model."""
    from dynatree_core.core.models import load_model

    out.mkdir(parents=True, exist_ok=True)
    target = load_model(target_spec, device="cpu", dtype="float32")
    data = LabelledCorpus(corpus, labels_dir, target.model.config.vocab_size)
    print(f"train: {len(data.train_rows)} train / {len(data.eval_rows)} held-out windows", flush=True)
    # the record keeps the removed TALF loss's weight at 0: checkpoints written before its removal resume
    run = {k: getattr(cfg, k) for k in RUN_SETTINGS} | {"talf_weight": 0.0, "target": target_spec}
    saved = open_checkpoint(out / "checkpoint.pt", run)  # refused before anything is built from it
    start = saved if saved is not None else _load_start(init_from) if init_from else None
    if start is not None:
        draft_to_target = start["draft_to_target"]
    else:
        draft_to_target = [-1, *select_vocab(data, cfg.vocab, target.tokenizer.all_special_ids)]
    data.token_map = TokenMap(draft_to_target, data.target_vocab)
    draft = init_draft(target.model, cfg, data.token_map)
    if saved is None and start is not None:  # --init-from takes the weights only
        load_weights(draft, start["model"], what=str(init_from))
        print(f"train: initialised from {init_from}")
    final = out / "model"

    def save(out: Path) -> None:
        draft.to(torch.bfloat16).save_pretrained(final)
        target.tokenizer.save_pretrained(final)
        data.token_map.save(final)

    loop = Loop("train", cfg.lr, cfg.warmup, clip=1.0, weight_decay=0.01, steps=cfg.steps, log_every=cfg.log_every,
                eval_every=cfg.eval_every, unit="tokens")  # fmt: skip
    trainer.train(_recipe(draft, data, cfg, run, save), out, loop, saved=saved, log=lambda m: print(m, flush=True))
    return final
