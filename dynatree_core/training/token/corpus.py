"""`make draft`'s `corpus` and `label` stages: windows of token ids, and the target's top-k labels.

Sources (all offline):
  onpolicy  sequences sampled from the target itself (sample.py), the distribution the draft
            must match at decode time; chunk 0 is held out for evaluation
  docs      the Python documentation sources from Debian's `python3.11-doc` package
  fortunes  quotations from Debian's `fortunes` package

`corpus.npz` holds `ids` (uint16, [N, WINDOW], 0-padded), `lengths`, `source` and `heldout`.
Labels are the target's top-k next-token log-probabilities at every position, computed by
teacher-forced target forwards in resumable shards (labels/shard_00003.npz: `topk_ids` uint16
and `topk_logp` float16, [SHARD, WINDOW, K]). Only `corpus.npz` is small enough to commit;
labels are recomputed from it (`python -m dynatree_core.training label`).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from dynatree_core.training.ledger import record

WINDOW = 320
TOPK = 20
SHARD = 256
SOURCES = ("onpolicy", "docs", "fortunes")
DOCS_DIR = Path("/usr/share/doc/python3.11/html/_sources")
FORTUNES_DIR = Path("/usr/share/games/fortunes")


def _windows(ids: list[int], window: int, stride: int | None = None) -> list[np.ndarray]:
    stride = stride or window
    return [np.asarray(ids[i : i + window], dtype=np.uint16) for i in range(0, max(len(ids) - 32, 1), stride)]


def onpolicy_sequences(chunk_dir: Path) -> list[tuple[np.ndarray, bool]]:
    """(sequence, is_heldout) for every sampled sequence; chunk 0 is the held-out split."""
    out = []
    for path in sorted(chunk_dir.glob("chunk_*.npz")):
        if ".tmp" in path.name:
            continue
        data = np.load(path)
        ids, offsets = data["ids"], data["offsets"]
        heldout = path.name == "chunk_00000.npz"
        out.extend((ids[offsets[i] : offsets[i + 1]][:WINDOW], heldout) for i in range(len(offsets) - 1))
    return out


def text_files(source: str) -> list[Path]:
    if source == "docs":
        return sorted(DOCS_DIR.rglob("*.txt"))
    if source == "fortunes":
        return sorted(p for p in FORTUNES_DIR.glob("*") if p.is_file() and p.suffix == "" and "." not in p.name)
    raise ValueError(source)


def build_corpus(out: Path, chunk_dir: Path, tokenizer, *, max_text_windows: int = 6000, seed: int = 0) -> dict:
    """Assemble windows from all sources into one array file. Deterministic for a seed."""
    rows, source, heldout = [], [], []
    rng = np.random.default_rng(seed)
    for code, name in ((1, "docs"), (2, "fortunes")):  # fixed part first: shards stay valid
        windows = []
        for path in text_files(name):
            text = path.read_text(encoding="utf-8", errors="replace")
            windows.extend(_windows(tokenizer(text, add_special_tokens=False)["input_ids"], WINDOW))
        keep = rng.permutation(len(windows))[: max_text_windows // (1 if name == "docs" else 4)]
        for i in sorted(keep):
            rows.append(windows[i])
            source.append(code)
            heldout.append(False)
    for seq, is_heldout in onpolicy_sequences(chunk_dir):  # grows as sample.py adds chunks
        rows.append(seq)
        source.append(0)
        heldout.append(is_heldout)
    ids = np.zeros((len(rows), WINDOW), dtype=np.uint16)
    lengths = np.zeros(len(rows), dtype=np.int16)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        lengths[i] = len(r)
    data = {
        "ids": ids,
        "lengths": lengths,
        "source": np.asarray(source, dtype=np.int8),
        "heldout": np.asarray(heldout, dtype=bool),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, **data)
    return data


def checksum(ids: np.ndarray) -> int:
    return int(np.frombuffer(ids.tobytes(), dtype=np.uint8).astype(np.uint64).sum() + ids.shape[0] * 1_000_003)


def shard_valid(path: Path, ids: np.ndarray) -> bool:
    """A shard is reused only if it labels exactly these windows (the corpus may have grown)."""
    if not path.exists():
        return False
    with np.load(path) as shard:
        return "checksum" in shard and int(shard["checksum"]) == checksum(ids)


@torch.inference_mode()
def label_shard(model, ids: np.ndarray, lengths: np.ndarray, *, k: int = TOPK, batch: int = 8) -> dict:
    """Target top-k next-token log-probs at every position of the given windows."""
    n, w = ids.shape
    topk_ids = np.zeros((n, w, k), dtype=np.uint16)
    topk_logp = np.zeros((n, w, k), dtype=np.float16)
    device = model.get_input_embeddings().weight.device
    for start in range(0, n, batch):
        x = torch.from_numpy(ids[start : start + batch].astype(np.int64)).to(device)
        length = torch.from_numpy(lengths[start : start + batch].astype(np.int64)).to(device)
        attn = (torch.arange(w, device=device)[None, :] < length[:, None]).long()
        hidden = model.model(input_ids=x, attention_mask=attn).last_hidden_state  # (b, w, h)
        head = model.get_output_embeddings().weight
        for row in range(hidden.shape[0]):  # one window at a time: logits stay cache-sized
            logits = (hidden[row] @ head.T).float()  # (w, vocab)
            top, tok = logits.topk(k, dim=-1)
            lp = top - torch.logsumexp(logits, dim=-1, keepdim=True)
            topk_ids[start + row] = tok.cpu().numpy().astype(np.uint16)
            topk_logp[start + row] = lp.cpu().numpy().astype(np.float16)
    return {"topk_ids": topk_ids, "topk_logp": topk_logp}


def label_corpus(
    corpus: Path,
    labels_dir: Path,
    *,
    dtype: str = "bfloat16",
    shards: int | None = None,
    device: str = "auto",
    batch: int = 8,
) -> None:
    """Compute missing label shards (resumable: existing shards are skipped); batched, on CUDA
    when one is present (`device` "auto")."""
    from dynatree_core.core.models import load_model

    data = np.load(corpus)
    ids, lengths = data["ids"], data["lengths"]
    n_shards = (len(ids) + SHARD - 1) // SHARD
    labels_dir.mkdir(parents=True, exist_ok=True)
    todo = [
        s
        for s in range(n_shards if shards is None else min(shards, n_shards))
        if not shard_valid(labels_dir / f"shard_{s:05d}.npz", ids[s * SHARD : (s + 1) * SHARD])
    ]
    todo.sort(reverse=True)  # on-policy rows (held-out split included) sit at the end: label them first
    print(f"label: {n_shards - len(todo)}/{n_shards} shards present", flush=True)
    if not todo:
        return
    target = load_model("embedded", device=device, dtype=dtype).model
    for s in todo:
        t0 = time.perf_counter()
        sl = slice(s * SHARD, (s + 1) * SHARD)
        shard = label_shard(target, ids[sl], lengths[sl], batch=batch)
        shard["checksum"] = np.asarray(checksum(ids[sl]))
        tmp = labels_dir / f"shard_{s:05d}.tmp.npz"
        np.savez(tmp, **shard)
        tmp.rename(labels_dir / f"shard_{s:05d}.npz")
        tokens, dt = int(lengths[sl].sum()), time.perf_counter() - t0
        record("label", dt, tokens=tokens, item=f"shard {s}")
        print(f"label: shard {s} {tokens} tokens in {dt:.0f}s", flush=True)
