"""`train-feature --data answers`, `feature-quality --answers` and `vocab-map` (`make draft-feature`):
the answer shards (store.py) as training windows, and a vocabulary map rebuilt from them.

`AnswerCorpus` cuts every stored sequence (prompt + the target's answer, with the target's
features at all but its last position) into windows of at most WINDOW positions and serves
them as `FeatureCorpus` does (`batch`, `sample`, `train_rows`, `eval_rows`), plus a loss mask:
the positions whose next token is part of the answer (what the draft will be asked to draft),
the prompt's positions being context only. About one sequence in HELDOUT_EVERY (by a hash of
its place, stable as data grows) is held out: the in-distribution check. Out-of-distribution
numbers come from a separate store of the target's answers to the OOD prompt set
(assets/prompts/ood/), which no training stage reads.

`token_counts` / `frequency_map` / `coverage`: the draft's reduced vocabulary (core/vocab.py) as the
most frequent answer tokens, and the share of a text's tokens such a map can propose.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

from dynatree_core.core.vocab import TokenMap
from dynatree_core.runs.environment import portable
from dynatree_core.training.answers.sources import SOURCES
from dynatree_core.training.answers.store import STAGES, AnswerStore
from dynatree_core.training.token.train import ranked_ids

WINDOW = 512
HELDOUT_EVERY = 50


class AnswerCorpus:
    """Windows over the shards of `store` that have features (memory-mapped, read per batch)."""

    def __init__(self, store: AnswerStore, *, stages: tuple[str, ...] = STAGES, window: int = WINDOW, heldout=None):
        self.window = window
        self.features: list[np.ndarray] = []
        self.ids: list[np.ndarray] = []
        self.stages: list[str] = []  # the stage of each part
        rows = []  # (part, start in ids/features, length, answer start within the window, heldout)
        for stage in stages:
            for k in store.shards(stage):
                if not store.has_features(stage, k):
                    continue
                data = np.load(store.ids_path(stage, k))
                part = len(self.ids)
                self.ids.append(data["ids"])
                self.stages.append(stage)
                self.features.append(np.load(store.features_path(stage, k), mmap_mode="r"))
                off, plens = data["offsets"], data["prompt_lens"]
                for i in range(len(off) - 1):
                    usable = int(off[i + 1] - off[i]) - 1  # the last token has no feature
                    held = zlib.crc32(f"{stage}/{k}/{i}".encode()) % HELDOUT_EVERY == 0 if heldout is None else heldout
                    for start in range(0, max(usable, 0), window):
                        length = min(window, usable - start)
                        if length >= 2:
                            # feature row of position p of sequence i: off[i] - i + p
                            rows.append((part, int(off[i]), int(off[i] - i), start, length, int(plens[i]), held))
        self.rows = np.asarray(rows, dtype=np.int64).reshape(-1, 7)
        self.lengths = self.rows[:, 4] if len(self.rows) else np.zeros(0, dtype=np.int64)
        self.train_rows = np.flatnonzero(self.rows[:, 6] == 0) if len(self.rows) else np.zeros(0, dtype=np.int64)
        self.eval_rows = np.flatnonzero(self.rows[:, 6] == 1) if len(self.rows) else np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.rows)

    def tokens(self, rows: np.ndarray | None = None) -> int:
        rows = np.arange(len(self.rows)) if rows is None else rows
        return int(self.lengths[rows].sum())

    def batch(self, rows: np.ndarray, device: torch.device, *, with_loss_mask: bool = False):
        """x (B, W) target ids, f (B, W, H) float32 features, valid (B, W) bool; with
        `with_loss_mask` also answer (B, W) bool: position j's next token is an answer token."""
        width = int(self.lengths[rows].max())
        hidden = self.features[0].shape[-1]
        x = np.zeros((len(rows), width), dtype=np.int64)
        f = np.zeros((len(rows), width, hidden), dtype=np.float32)
        answer = np.zeros((len(rows), width), dtype=bool)
        for b, r in enumerate(rows):
            part, id_off, f_off, start, length, plen, _ = self.rows[r]
            x[b, :length] = self.ids[part][id_off + start : id_off + start + length]
            f[b, :length] = self.features[part][f_off + start : f_off + start + length]
            answer[b, :length] = np.arange(start, start + length) + 1 >= plen
        valid = torch.arange(width)[None, :] < torch.from_numpy(self.lengths[rows])[:, None]
        out = (torch.from_numpy(x).to(device), torch.from_numpy(f).to(device), valid.to(device))
        return (*out, torch.from_numpy(answer).to(device) & valid.to(device)) if with_loss_mask else out

    def sample(self, rng: np.random.Generator, n: int, onpolicy_share: float = 1.0) -> np.ndarray:
        """n training windows (every window here is on-policy: the share is accepted for the
        FeatureCorpus interface)."""
        return rng.choice(self.train_rows, n, replace=len(self.train_rows) < n)

    def stage_of(self, rows: np.ndarray) -> np.ndarray:
        """The stage name of each window of `rows`."""
        return np.asarray(self.stages, dtype=object)[self.rows[rows, 0]] if len(rows) else np.zeros(0, dtype=object)

    def answer_tokens(self, rows: np.ndarray) -> int:
        """Loss positions of `rows`: window positions whose next token belongs to the answer."""
        r = self.rows[rows]
        start, length, plen = r[:, 3], r[:, 4], r[:, 5]
        return int(np.clip(start + length - np.maximum(start, plen - 1), 0, None).sum())

    def describe(self) -> dict:
        """What the card and curve.json say about the training data."""
        return {
            "training_windows": int(len(self.train_rows)),
            "training_positions": self.tokens(self.train_rows),
            "training_answer_positions": self.answer_tokens(self.train_rows),
            "heldout_windows": int(len(self.eval_rows)),
        }


def source_summary(store: AnswerStore, stages: tuple[str, ...] = STAGES) -> dict[str, dict[str, int]]:
    """Per source kind (sources.SOURCES): prompts answered, prompt tokens and answer tokens."""
    out: dict[str, dict[str, int]] = {}
    for stage in stages:
        for k in store.shards(stage):
            for ids, plen, src in store.sequences(stage, k):
                row = out.setdefault(
                    SOURCES[src] if 0 <= src < len(SOURCES) else "ood",
                    dict.fromkeys(("prompts", "prompt_tokens", "answer_tokens"), 0),
                )
                row["prompts"] += 1
                row["prompt_tokens"] += plen
                row["answer_tokens"] += len(ids) - plen
    return out


def token_counts(store: AnswerStore, vocab: int, *, answers_only: bool = True) -> np.ndarray:
    """How often each target token occurs in the stored answers (or whole sequences)."""
    counts = np.zeros(vocab, dtype=np.int64)
    for stage in STAGES:
        for k in store.shards(stage):
            for ids, plen, _ in store.sequences(stage, k):
                counts += np.bincount(ids[plen:] if answers_only else ids, minlength=vocab)[:vocab]
    return counts


def frequency_map(counts: np.ndarray, size: int, *, always: list[int] = ()) -> TokenMap:
    """A reduced vocabulary of `size` slots: OTHER, then `always` (e.g. EOS), then the most frequent."""
    return TokenMap([-1, *ranked_ids(counts, size - 1, always)], len(counts))


def coverage(token_map: TokenMap, ids: np.ndarray) -> float:
    """Share of `ids` the map can propose (the rest read as OTHER and can never be drafted)."""
    if not len(ids):
        return 0.0
    return float((token_map.target_to_draft[torch.from_numpy(ids.astype(np.int64))] != 0).float().mean())


def answer_splits(store: AnswerStore, ood: AnswerStore, stages: tuple[str, ...] = STAGES) -> dict:
    """`agreement_report`'s splits: the held-out windows of the answers (`stages`) and every window of
    the OOD answers (stage "ood"), side by side."""
    seen = AnswerCorpus(store, stages=stages)
    far = AnswerCorpus(ood, stages=("ood",), heldout=True)
    return {"in-distribution (held out)": (seen, seen.eval_rows), "out-of-distribution": (far, far.eval_rows)}


def agreement_report(target, drafts: list, token_draft, splits: dict) -> dict:
    """Held-out agreement by depth of each feature draft (and the token draft's, the same at every
    depth given accepted ancestors) on each split: {split: (corpus, rows)} -> {split: {...}}."""
    from dynatree_core.drafts.feature import FeatureDraft
    from dynatree_core.training.feature.train import agreement_by_depth, token_draft_agreement

    head = target.get_output_embeddings()
    out = {}
    for name, (data, rows) in splits.items():
        if not len(rows):
            continue
        part = {"windows": int(len(rows)), "tokens": int(data.lengths[rows].sum())}
        if token_draft is not None:
            part["token draft"] = {
                "agreement": token_draft_agreement(token_draft.model, token_draft.token_map, head, data, rows)
            }
        for path in drafts:
            draft = FeatureDraft.load(path, target)
            part[portable(str(path))] = {"agreement_by_depth": agreement_by_depth(draft, head, data, rows)}
        out[name] = part
    return out


def answer_ids(store: AnswerStore, stages: tuple[str, ...]) -> np.ndarray:
    """Every answer token of the store's `stages`, concatenated (what a draft must be able to propose)."""
    parts = [ids[plen:] for s in stages for k in store.shards(s) for ids, plen, _ in store.sequences(s, k)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def vocab_report(store: AnswerStore, ood: AnswerStore, sizes: list[int], vocab: int, *, current=None, always=()):
    """OOD coverage of the current map and of frequency maps of each size rebuilt from the answers;
    returns (report, {size: TokenMap})."""
    counts = token_counts(store, vocab)
    target_ood = answer_ids(ood, ("ood",))
    maps = {n: frequency_map(counts, n, always=list(always)) for n in sizes}
    report = {"answer_tokens_counted": int(counts.sum()), "ood_answer_tokens": int(len(target_ood))}
    if current is not None:
        report[f"current map ({len(current)})"] = round(coverage(current, target_ood), 4)
    report |= {f"rebuilt {n}": round(coverage(m, target_ood), 4) for n, m in maps.items()}
    return report, maps
