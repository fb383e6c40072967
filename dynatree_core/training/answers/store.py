"""`make draft-feature`'s answer data (answers, ood-answers, answers-relabel): the target answers
the source pool, features kept, in shards.

Stages, each a list of jobs (sources.py) cut into shards of SHARD_JOBS jobs, run in order:

    questions  self-instruct: the target writes user questions from seed topics
    main       the source pool + the target's own questions, shuffled together

A shard is decoded by `BatchDecoder.generate` (continuous batching, features in the same pass)
and written as two files: the token ids, small enough to commit (`answers/main_00003.npz`:
flat ids, offsets, prompt lengths, source and temperature per sequence), and the features,
which are not (`<cache>/draft-data/answer-features/main_00003.npy`, float16 (tokens - sequences,
H), plus a `.sum` with the ids' checksum). A shard whose files exist is skipped, so a run that
stops resumes at the next shard; on a machine where only the ids exist (a fresh clone),
`relabel` recomputes the features teacher-forced. The job lists are saved beside the ids.
`decode_shard(teacher=True)` (the GPU recipe, training/gpu/) also keeps the compact teacher as it
decodes, from the logits each answer token was drawn from.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from dynatree_core.decoding.pairs import encode_prompt
from dynatree_core.training.answers import sources
from dynatree_core.training.answers.decode_batch import BatchDecoder
from dynatree_core.training.answers.decode_ops import TEACHER_K, compact_teacher, host_f16
from dynatree_core.training.ledger import record
from dynatree_core.training.token.corpus import checksum

SHARD_JOBS = 512
STAGES = ("questions", "main")


def _source_index(source: str) -> int:
    return sources.SOURCES.index(source) if source in sources.SOURCES else -1  # -1: the OOD evaluation set


def _ids_dtype(vocab: int):
    return np.uint16 if vocab <= np.iinfo(np.uint16).max + 1 else np.uint32


class AnswerStore:
    """The shards of one data directory (ids) and its features directory."""

    def __init__(self, ids_dir: Path, features_dir: Path, limits: dict[str, int] | None = None):
        """`limits`: stage -> only its first this-many shards are seen (a run's fixed data set)."""
        self.ids_dir, self.features_dir, self.limits = ids_dir, features_dir, dict(limits or {})

    def ids_path(self, stage: str, k: int) -> Path:
        return self.ids_dir / f"{stage}_{k:05d}.npz"

    def features_path(self, stage: str, k: int) -> Path:
        return self.features_dir / f"{stage}_{k:05d}.npy"

    def taps_path(self, stage: str, k: int, taps: tuple[int, ...]) -> Path:
        """The tapped layer inputs (core/taps.py), float16 (tokens - sequences, len(taps), H)."""
        return self.features_dir / f"{stage}_{k:05d}.taps-{'-'.join(str(t) for t in taps)}.npy"

    def teacher_path(self, stage: str, k: int) -> Path:
        """The compact teacher (`compact_teacher`) at the shard's loss positions."""
        return self.features_dir / f"{stage}_{k:05d}.teacher.npz"

    def has_features(self, stage: str, k: int) -> bool:
        return self._valid(self.features_path(stage, k), stage, k)

    def has_taps(self, stage: str, k: int, taps: tuple[int, ...]) -> bool:
        return self._valid(self.taps_path(stage, k, taps), stage, k)

    def has_teacher(self, stage: str, k: int) -> bool:
        return self._valid(self.teacher_path(stage, k), stage, k)

    def _valid(self, path: Path, stage: str, k: int) -> bool:
        """The file exists and was made from the shard's current ids (its `.sum` says so)."""
        check = path.with_suffix(".sum")
        if not (path.exists() and check.exists() and self.ids_path(stage, k).exists()):
            return False
        return check.read_text().strip() == str(checksum(np.load(self.ids_path(stage, k))["ids"]))

    def _write_part(self, path: Path, save, ids: np.ndarray) -> None:
        """`save(tmp)` writes the part; renamed into place, then its checksum: a killed run leaves no half file."""
        self.features_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.stem + ".tmp" + path.suffix)
        save(tmp)
        tmp.rename(path)
        path.with_suffix(".sum").write_text(str(checksum(ids)))

    def shards(self, stage: str) -> list[int]:
        found = sorted(int(p.stem.split("_")[1]) for p in self.ids_dir.glob(f"{stage}_*.npz") if ".tmp" not in p.stem)
        limit = self.limits.get(stage)
        return [k for k in found if limit is None or k < limit]

    def sequences(self, stage: str, k: int) -> list[tuple[np.ndarray, int, int]]:
        """(ids, prompt length, source index) of every sequence of a shard."""
        with np.load(self.ids_path(stage, k)) as data:  # each member read once: an NpzFile inflates on every access
            ids, off, plens, source = (data[name] for name in ("ids", "offsets", "prompt_lens", "source"))
        return [(ids[off[i] : off[i + 1]].astype(np.int64), int(plens[i]), int(source[i])) for i in range(len(off) - 1)]

    def write(self, stage: str, k: int, rows, jobs: list[sources.Job], vocab: int) -> None:
        """A decoded shard: its features (and its teacher, when the rows kept it), then its ids
        (the ids last: they mark the shard done)."""
        ids = np.concatenate([r.ids for r in rows]).astype(_ids_dtype(vocab))
        self.write_features(stage, k, [r.features for r in rows], ids)
        if rows and rows[0].teacher is not None:
            self.write_teacher(stage, k, _rows_teacher(rows, vocab), ids)
        temps = np.asarray([j.temperature for j in jobs], dtype=np.float16)
        self.write_ids(stage, k, [(r.ids, r.prompt_len) for r in rows], [j.source for j in jobs], temps, vocab)

    def write_ids(self, stage: str, k: int, seqs, kinds: list[str], temperature: np.ndarray, vocab: int) -> None:
        """The shard's ids file: `seqs` (ids, prompt length), each sequence's source kind and
        temperature (NaN: not sampled from the target, e.g. written text)."""
        self.ids_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.ids_dir / f"{stage}_{k:05d}.tmp.npz"
        np.savez_compressed(
            tmp,
            ids=np.concatenate([np.asarray(ids) for ids, _ in seqs]).astype(_ids_dtype(vocab)),
            offsets=np.cumsum([0] + [len(ids) for ids, _ in seqs]).astype(np.int64),
            prompt_lens=np.asarray([plen for _, plen in seqs], dtype=np.int32),
            source=np.asarray([_source_index(s) for s in kinds], dtype=np.int8),
            temperature=temperature,
        )
        tmp.rename(self.ids_path(stage, k))

    def write_features(self, stage: str, k: int, feats: list[np.ndarray], ids: np.ndarray) -> None:
        self._write_part(self.features_path(stage, k), lambda tmp: np.save(tmp, np.concatenate(feats)), ids)

    def write_taps(self, stage: str, k: int, taps: tuple[int, ...], parts: list[np.ndarray], ids: np.ndarray) -> None:
        self._write_part(self.taps_path(stage, k, taps), lambda tmp: np.save(tmp, np.concatenate(parts)), ids)

    def write_teacher(self, stage: str, k: int, teacher: dict[str, np.ndarray], ids: np.ndarray) -> None:
        self._write_part(self.teacher_path(stage, k), lambda tmp: np.savez(tmp, **teacher), ids)


def _stage_jobs(store: AnswerStore, stage: str, tokenizer, seed: int, log) -> list[sources.Job] | None:
    """The stage's job list: saved beside the ids the first time, read back after (None: the stage
    before it has not finished)."""
    path = store.ids_dir / f"{stage}.jobs.gz"
    if path.exists():
        return sources.load_jobs(path)
    if stage == "questions":
        questions, pool = sources.build_pool(seed, log=log)
        sources.save_jobs(store.ids_dir / "pool.jobs.gz", pool)
        jobs = questions
    else:  # main
        asked = _stage_jobs(store, "questions", tokenizer, seed, log)
        if len(store.shards("questions")) < _n_shards(len(asked)):
            return None
        written = []
        for k in store.shards("questions"):
            for ids, plen, _ in store.sequences("questions", k):
                q = sources.question_from_answer(tokenizer.decode(ids[plen:], skip_special_tokens=True))
                if q:
                    written.append(q)
        log(f"answers: {len(written)} usable self-instruct questions")
        jobs = sources.load_jobs(store.ids_dir / "pool.jobs.gz") + sources.answered_jobs(written, seed)
        jobs = [jobs[i] for i in np.random.default_rng(seed).permutation(len(jobs))]
    sources.save_jobs(path, jobs)
    return jobs


def _n_shards(jobs: int) -> int:
    return (jobs + SHARD_JOBS - 1) // SHARD_JOBS


def encode_job(tokenizer, job: sources.Job) -> list[int]:
    return encode_prompt(tokenizer, job.text, chat=job.chat, history=job.history)


def decode_shard(
    store: AnswerStore, decoder: BatchDecoder, target, stage: str, k: int, part: list[sources.Job], *,
    batch: int, seed: int, teacher: bool = False, log=print,
) -> tuple[int, int, float]:  # fmt: skip
    """Decode the jobs `part` (prompts of similar length share batches) and write them as shard `k`
    of `stage` (with `teacher`, its compact teacher too, from the decoding's own logits), its time
    in the ledger; returns (answer tokens, prompt tokens, seconds)."""
    prompts = [encode_job(target.tokenizer, j) for j in part]
    order = np.argsort([len(p) for p in prompts], kind="stable")
    t0 = time.perf_counter()
    rows = decoder.generate(
        [prompts[i] for i in order],
        max_new=[part[i].max_new for i in order],
        temperature=[part[i].temperature for i in order],
        eos=target.eos_token_ids,
        seed=seed,
        batch=batch,
        teacher=teacher,
    )
    back = np.argsort(order)
    rows = [rows[i] for i in back]
    store.write(stage, k, rows, part, decoder.model.config.get_text_config(decoder=True).vocab_size)
    made = sum(len(r.ids) - r.prompt_len for r in rows)
    read = sum(r.prompt_len for r in rows)
    dt = time.perf_counter() - t0
    record("answers", dt, tokens=made, prompt_tokens=read, item=f"{stage} {k}")
    log(
        f"answers: {stage} shard {k}: {made} answer tokens (+{read} prompt) in {dt:.0f} s, "
        f"{made / dt:.0f} answer tokens/s, {(made + read) / dt:.0f} featurised tokens/s; step: {decoder.captured}"
    )
    return made, read, dt


def generate(
    store: AnswerStore,
    target,
    *,
    stages: tuple[str, ...] = STAGES,
    max_shards: int | None = None,
    main_shards: int | None = None,
    batch: int = 64,
    seed: int = 0,
    log=print,
) -> int:
    """Decode the missing shards of `stages`, in order; returns the number of shards written.
    `max_shards`: at most this many in this call; `main_shards`: the main stage ends at this many
    shards in all (a recipe that stops there reproduces the same data, and a rerun writes none)."""
    decoder = BatchDecoder(target.model)
    written = 0
    for stage in stages:
        jobs = _stage_jobs(store, stage, target.tokenizer, seed, log)
        if jobs is None:
            log(f"answers: stage {stage} waits for the one before it")
            break
        have = set(store.shards(stage))
        n_shards = _n_shards(len(jobs))
        if stage == "main" and main_shards is not None:
            n_shards = min(n_shards, main_shards)
        for k in range(n_shards):
            if k in have or (max_shards is not None and written >= max_shards):
                continue
            part = jobs[k * SHARD_JOBS : (k + 1) * SHARD_JOBS]
            decode_shard(store, decoder, target, stage, k, part, batch=batch,
                         seed=seed * 100_003 + k * 7 + STAGES.index(stage), log=log)  # fmt: skip
            written += 1
        if len(store.shards(stage)) < n_shards:
            break  # later stages build on this one
    return written


def ood_answers(store: AnswerStore, target, *, max_new: int = 256, log=print) -> None:
    """The target's greedy answers to the out-of-distribution prompt set (assets/prompts/ood/),
    features kept, as stage "ood" of its own store: what OOD agreement and coverage are measured
    on. No training stage reads this store."""
    from dynatree_core.measure.prompt_sets import load_prompts

    if store.shards("ood"):
        log("answers: the OOD answers exist")
        return
    prompts = load_prompts("ood")
    jobs = [sources.Job(p.domain, p.text, p.chat, 0.0, max_new, p.history) for p in prompts]
    ids = [encode_prompt(target.tokenizer, p.text, chat=p.chat, history=p.history) for p in prompts]
    t0 = time.perf_counter()
    rows = BatchDecoder(target.model).generate(
        ids, max_new=[max_new] * len(ids), temperature=[0.0] * len(ids), eos=target.eos_token_ids, seed=0
    )
    vocab = target.model.config.get_text_config(decoder=True).vocab_size
    store.write("ood", 0, rows, jobs, vocab)
    made = sum(len(r.ids) - r.prompt_len for r in rows)
    log(f"answers: {len(rows)} OOD answers, {made} tokens in {time.perf_counter() - t0:.0f} s")


def _teacher_arrays(rows: int, k: int, vocab: int) -> dict[str, np.ndarray]:
    return {
        "ids": np.zeros((rows, k), dtype=_ids_dtype(vocab)),
        "logits": np.zeros((rows, k), dtype=np.float16),
        "lse": np.full(rows, np.nan, dtype=np.float32),  # NaN: not a loss position (the prompt's context)
    }


def _rows_teacher(rows, vocab: int) -> dict[str, np.ndarray]:
    """Decoded rows' teachers (`BatchDecoder.generate(teacher=True)`) in the stored layout: a row per
    feature position of the shard, NaN lse at the prompts' context positions (as `relabel` writes)."""
    starts = np.cumsum([0] + [len(r.ids) - 1 for r in rows])
    labels = _teacher_arrays(int(starts[-1]), TEACHER_K, vocab)
    for row, start, end in zip(rows, starts[:-1], starts[1:], strict=True):
        for key, part in row.teacher.items():
            labels[key][start + row.prompt_len - 1 : end] = part
    return labels


# head rows a relabel computes at once (their float32 logits over the vocabulary): many on a GPU, few
# enough on a CPU that the logits stay in its caches
TEACHER_ROWS = {"cuda": 4096}


def _split(array: np.ndarray, lens: list[int]) -> list[np.ndarray]:
    return np.split(array, np.cumsum(lens)[:-1])


def _teacher_rows(decoder: BatchDecoder, states: torch.Tensor) -> dict[str, np.ndarray]:
    """compact_teacher of the target's head at `states` (n, H), TEACHER_ROWS at a time, read back once."""
    step = TEACHER_ROWS.get(states.device.type, 256)
    parts = [compact_teacher(decoder.lean.head(states[a : a + step])) for a in range(0, len(states), step)]
    if not parts:
        return {"ids": np.zeros((0, TEACHER_K), np.int64), "logits": np.zeros((0, TEACHER_K), np.float32),
                "lse": np.zeros(0, np.float32)}  # fmt: skip
    return {key: torch.cat([p[key] for p in parts]).cpu().numpy() for key in parts[0]}


@torch.inference_mode()
def relabel(
    store: AnswerStore,
    target,
    *,
    batch: int = 16,
    taps: tuple[int, ...] = (),
    teacher: bool = False,
    stages: tuple[str, ...] = (*STAGES, "ood"),
    max_shards: int | None = None,
    log=print,
) -> int:
    """What the shards that have ids lack, teacher-forced in one batched forward per group of
    sequences: the final features; with `taps` the inputs of those layers (the fused kind's
    features); with `teacher` the compact teacher at every loss position (row p of a sequence
    whose next token p + 1 is part of its answer). `max_shards`: at most this many in this call.
    Returns the number of shards written to."""
    decoder = BatchDecoder(target.model)
    vocab = target.model.config.get_text_config(decoder=True).vocab_size
    done = 0
    for stage in stages:
        for k in store.shards(stage):
            want_f = not store.has_features(stage, k)
            want_t = bool(taps) and not store.has_taps(stage, k, taps)
            want_h = teacher and not store.has_teacher(stage, k)
            if not (want_f or want_t or want_h):
                continue
            if max_shards is not None and done >= max_shards:
                return done
            t0 = time.perf_counter()
            seqs = store.sequences(stage, k)
            order = np.argsort([len(s) for s, _, _ in seqs])
            starts = np.cumsum([0] + [max(len(s) - 1, 0) for s, _, _ in seqs])
            feats: list[np.ndarray | None] = [None] * len(seqs)
            tapped: list[np.ndarray | None] = [None] * len(seqs)
            labels = _teacher_arrays(int(starts[-1]), TEACHER_K, vocab)
            for start in range(0, len(seqs), batch):  # a group's results come back in one copy each
                part = order[start : start + batch]
                rows = decoder.teacher_forced([seqs[i][0].tolist() for i in part], taps=taps if want_t else ())
                lens = [len(row["features"]) for row in rows]
                for i, f in zip(part, _split(host_f16(torch.cat([r["features"] for r in rows])), lens), strict=True):
                    feats[i] = f
                if want_t:
                    for i, t in zip(part, _split(host_f16(torch.cat([r["taps"] for r in rows])), lens), strict=True):
                        tapped[i] = t
                if want_h:  # from the row whose next token is the answer's first
                    firsts = [min(max(seqs[i][1] - 1, 0), n) for i, n in zip(part, lens, strict=True)]
                    answer = torch.cat([r["features"][f:] for r, f in zip(rows, firsts, strict=True)])
                    counts = [n - f for n, f in zip(lens, firsts, strict=True)]
                    for key, value in _teacher_rows(decoder, answer).items():
                        for i, f, got in zip(part, firsts, _split(value, counts), strict=True):
                            labels[key][starts[i] + f : starts[i + 1]] = got
            ids = np.load(store.ids_path(stage, k))["ids"]
            if want_f:
                store.write_features(stage, k, feats, ids)
            if want_t:
                store.write_taps(stage, k, taps, tapped, ids)
            if want_h:
                store.write_teacher(stage, k, labels, ids)
            tokens, dt = sum(len(s) for s, _, _ in seqs), time.perf_counter() - t0
            record("answers-relabel", dt, tokens=tokens, item=f"{stage} {k}")
            what = ", ".join(n for n, w in (("features", want_f), ("taps", want_t), ("teacher", want_h)) if w)
            rate = f"{tokens} tokens in {dt:.0f} s ({tokens / dt:.0f} tokens/s)"
            log(f"answers: relabelled {stage} shard {k} ({what}): {rate}")
            done += 1
    return done
