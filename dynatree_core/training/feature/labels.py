"""`feature-label` and `train-feature` on the corpus (made smollm2-feature-draft-corpus): the
target's features over the corpus windows, and their loader.

Stage `feature-label`: teacher-forced target forwards over the corpus windows store the target's
final hidden states (post-norm, what its LM head reads) at every position as float16, one
memory-mappable file per shard of windows (`features/shard_00003.npy`, [SHARD, WINDOW, H], with
`shard_00003.sum` holding the windows' checksum, so a grown corpus relabels only what changed).
Batched, and on CUDA when one is present. `FeatureCorpus` reads them for training (feature/train.py).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from dynatree_core.training.ledger import record
from dynatree_core.training.token.corpus import SHARD, checksum


def feature_shard_valid(directory: Path, index: int, ids: np.ndarray) -> bool:
    path, check = directory / f"shard_{index:05d}.npy", directory / f"shard_{index:05d}.sum"
    return path.exists() and check.exists() and check.read_text().strip() == str(checksum(ids))


@torch.inference_mode()
def target_features(target: torch.nn.Module, ids: np.ndarray, lengths: np.ndarray, *, batch: int = 8) -> np.ndarray:
    """(n, width, H) float16 final hidden states of the target at every position of the windows."""
    device = target.get_input_embeddings().weight.device
    n, width = ids.shape
    out = np.zeros((n, width, target.config.get_text_config(decoder=True).hidden_size), dtype=np.float16)
    for start in range(0, n, batch):
        x = torch.from_numpy(ids[start : start + batch].astype(np.int64)).to(device)
        length = torch.from_numpy(lengths[start : start + batch].astype(np.int64)).to(device)
        attn = (torch.arange(width, device=device)[None, :] < length[:, None]).long()
        hidden = target.base_model(input_ids=x, attention_mask=attn).last_hidden_state
        out[start : start + len(x)] = hidden.float().cpu().numpy().astype(np.float16)
    return out


def label_features(
    corpus: Path,
    out_dir: Path,
    target: torch.nn.Module,
    *,
    shards: list[int] | None = None,
    batch: int = 8,
    log=print,
) -> list[int]:
    """Compute the missing feature shards (resumable); returns the shards computed now."""
    data = np.load(corpus)
    ids, lengths = data["ids"], data["lengths"]
    n_shards = (len(ids) + SHARD - 1) // SHARD
    out_dir.mkdir(parents=True, exist_ok=True)
    wanted = range(n_shards) if shards is None else [s for s in shards if 0 <= s < n_shards]
    todo = [s for s in wanted if not feature_shard_valid(out_dir, s, ids[s * SHARD : (s + 1) * SHARD])]
    log(f"feature-label: {len(wanted) - len(todo)}/{len(wanted)} shards present")
    for s in todo:
        t0 = time.perf_counter()
        sl = slice(s * SHARD, (s + 1) * SHARD)
        feats = target_features(target, ids[sl], lengths[sl], batch=batch)
        tmp = out_dir / f"shard_{s:05d}.tmp.npy"
        np.save(tmp, feats)
        tmp.rename(out_dir / f"shard_{s:05d}.npy")
        (out_dir / f"shard_{s:05d}.sum").write_text(str(checksum(ids[sl])))
        tokens, dt = int(lengths[sl].sum()), time.perf_counter() - t0
        record("feature-label", dt, tokens=tokens, item=f"shard {s}")
        log(f"feature-label: shard {s}: {tokens} tokens in {dt:.0f} s ({tokens / dt:.0f} tokens/s)")
    return todo


def onpolicy_shards(corpus: Path) -> list[int]:
    """The shards that hold on-policy windows (they sit at the corpus's end), held-out ones included."""
    data = np.load(corpus)
    rows = np.flatnonzero(data["source"] == 0)
    return sorted({int(r) // SHARD for r in rows})


class FeatureCorpus:
    """Windows whose feature shards exist; features stay on disk (memory-mapped)."""

    def __init__(self, corpus: Path, features_dir: Path):
        data = np.load(corpus)
        self.ids, self.lengths = data["ids"], data["lengths"]
        self.heldout, self.source = data["heldout"], data["source"]
        n_shards = (len(self.ids) + SHARD - 1) // SHARD
        self.shards: dict[int, np.ndarray] = {}
        for s in range(n_shards):
            if feature_shard_valid(features_dir, s, self.ids[s * SHARD : (s + 1) * SHARD]):
                self.shards[s] = np.load(features_dir / f"shard_{s:05d}.npy", mmap_mode="r")
        have = np.zeros(len(self.ids), dtype=bool)
        for s in self.shards:
            have[s * SHARD : (s + 1) * SHARD] = True
        self.train_rows = np.flatnonzero(have & ~self.heldout)
        self.eval_rows = np.flatnonzero(have & self.heldout)

    def features(self, rows: np.ndarray, width: int) -> np.ndarray:
        return np.stack([self.shards[int(r) // SHARD][int(r) % SHARD, :width] for r in rows])

    def batch(self, rows: np.ndarray, device: torch.device, *, with_loss_mask: bool = False):
        """x (B, W) target ids, f (B, W, H) float32 features, valid (B, W) bool; with
        `with_loss_mask` also the positions whose prediction counts (here: every valid one)."""
        length = torch.from_numpy(self.lengths[rows].astype(np.int64))
        width = int(length.max())
        x = torch.from_numpy(self.ids[rows, :width].astype(np.int64))
        f = torch.from_numpy(self.features(rows, width).astype(np.float32))
        valid = torch.arange(width)[None, :] < length[:, None]
        out = (x.to(device), f.to(device), valid.to(device))
        return (*out, out[2]) if with_loss_mask else out

    def sample(self, rng: np.random.Generator, n: int, onpolicy_share: float) -> np.ndarray:
        onp = self.train_rows[self.source[self.train_rows] == 0]
        rest = self.train_rows[self.source[self.train_rows] != 0]
        if onpolicy_share <= 0 or not len(onp):
            return rng.choice(self.train_rows, n, replace=len(self.train_rows) < n)
        k = round(n * onpolicy_share) if len(rest) else n
        pick = [rng.choice(onp, k, replace=len(onp) < k)]
        if n - k:
            pick.append(rng.choice(rest, n - k, replace=len(rest) < n - k))
        return np.concatenate(pick)


# ----- stage 2: KD on features -------------------------------------------------------------------
