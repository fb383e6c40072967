"""`draft-gpu`'s answer data: the prompt pack's jobs answered by the target, then the follow-up turns.

Stages of the run's answer store (answers/store.py: ids and features in shards), in order:

    main       the pack's jobs, in the pack's order
    askN       round N of the follow-ups: every answered job with `follow_ups` >= N, the target shown
               the conversation so far and asked to write the user's next question
    followN    the target answers that question, the conversation so far as the earlier turns
    prior-S    stage S of answers made earlier (`--prior-answers`: an answer store's id shards, such as
               the committed ones), copied in as they are; the relabel stage computes their features
               and teacher (teacher-forced, far cheaper than decoding them again)

Every shard keeps its features and its compact teacher as it decodes (`decode_shard(teacher=True)`:
the logits each answer token was drawn from), so no teacher-forced pass follows. A stage's job list
is saved beside its ids (`STAGE.jobs.gz`) the first time and read back after, and
shard k holds jobs k*S .. (k+1)*S - 1 of it in order (S: the run's shard size), so a resumed run
decodes the same jobs and every stored sequence's job is known (the next round reads them). A stage
may stop early (its share of the budget, the answer-token goal): the next round builds on the
shards that exist.

Contract: knows the answer store and the target; never the schedule, the draft or the budget (the
recipe's `room` callback decides whether another shard may start).
"""

from __future__ import annotations

import dataclasses
import shutil
import time
import zlib
from collections.abc import Callable
from pathlib import Path

from dynatree_core.training.answers import sources
from dynatree_core.training.answers.decode_batch import BatchDecoder
from dynatree_core.training.answers.store import AnswerStore, decode_shard

# the user's request that makes the target write the user's next question (round N's ask stage)
FOLLOW_ASK = "Write the next question I would ask you about this, as I would write it. Reply with the question only."
ASK_TOKENS = 64  # a question is short


def rounds(jobs: list[sources.Job]) -> int:
    """How many follow-up rounds the jobs ask for (the most any one asks)."""
    return max((j.follow_ups for j in jobs), default=0)


def saved_jobs(store: AnswerStore, stage: str) -> list[sources.Job] | None:
    path = store.ids_dir / f"{stage}.jobs.gz"
    return sources.load_jobs(path) if path.exists() else None


def save_jobs(store: AnswerStore, stage: str, jobs: list[sources.Job]) -> list[sources.Job]:
    sources.save_jobs(store.ids_dir / f"{stage}.jobs.gz", jobs)
    return jobs


PRIOR_STAGES = ("questions", "main", "written")  # an answer store's stages with answers worth training on


def import_prior(store: AnswerStore, prior: Path) -> list[str]:
    """The id shards of `prior`'s PRIOR_STAGES copied into `store` as stages `prior-S` (once: a
    shard already there is kept); returns the stages that hold shards."""
    stages = []
    for stage in PRIOR_STAGES:
        found = AnswerStore(prior, prior).shards(stage)
        if not found:
            continue
        stages.append(f"prior-{stage}")
        store.ids_dir.mkdir(parents=True, exist_ok=True)
        for k in found:
            dest = store.ids_path(stages[-1], k)
            if not dest.exists():
                tmp = dest.with_name(dest.stem + ".tmp.npz")
                shutil.copyfile(prior / f"{stage}_{k:05d}.npz", tmp)
                tmp.rename(dest)
    return stages


@dataclasses.dataclass
class Decoded:
    """What one call of `decode_stage` did: shards written, answer tokens, seconds; `complete`:
    every shard of the stage exists."""

    shards: int = 0
    tokens: int = 0
    seconds: float = 0.0
    complete: bool = False


def decode_stage(
    store: AnswerStore,
    decoder: BatchDecoder,
    target,
    stage: str,
    jobs: list[sources.Job],
    *,
    shard_jobs: int,
    batch: int,
    seed: int,
    room: Callable[[float], bool],
    wrote: Callable[[int, float], None],
    log=print,
) -> Decoded:
    """Decode the missing shards of `stage` in order while `room(estimated seconds of the next
    shard)` allows (the estimate: the last shard's wall time here, 0 before the first); `wrote(answer
    tokens, wall seconds)` is told of each shard as it is written."""
    n_shards = (len(jobs) + shard_jobs - 1) // shard_jobs
    have, done, last_s = set(store.shards(stage)), Decoded(), 0.0
    for k in range(n_shards):
        if k in have:
            continue
        if not room(last_s):
            break
        part = jobs[k * shard_jobs : (k + 1) * shard_jobs]
        shard_seed = seed * 100_003 + k * 7 + zlib.crc32(stage.encode()) % 1000
        t0 = time.perf_counter()  # the shard's wall time: its prompts' encoding and its writing included
        made, _, _ = decode_shard(store, decoder, target, stage, k, part, batch=batch, seed=shard_seed,
                                  teacher=True, log=log)  # fmt: skip
        last_s = time.perf_counter() - t0
        wrote(made, last_s)
        done.shards, done.tokens, done.seconds = done.shards + 1, done.tokens + made, done.seconds + last_s
        log(f"answers: {stage}: {len(store.shards(stage))}/{n_shards} shards")
    done.complete = len(store.shards(stage)) >= n_shards
    return done


def answered(store: AnswerStore, stage: str, tokenizer, shard_jobs: int) -> list[tuple[sources.Job, str]]:
    """(job, the target's answer text) of every stored sequence of `stage`."""
    jobs = saved_jobs(store, stage) or []
    out = []
    for k in store.shards(stage):
        part = jobs[k * shard_jobs : (k + 1) * shard_jobs]
        for job, (ids, plen, _) in zip(part, store.sequences(stage, k), strict=True):
            out.append((job, tokenizer.decode(ids[plen:], skip_special_tokens=True).strip()))
    return out


def ask_jobs(turns: list[tuple[sources.Job, str]], n: int) -> list[sources.Job]:
    """Round `n`'s question-writing jobs: the conversation so far as earlier turns, then FOLLOW_ASK."""
    return [
        dataclasses.replace(
            job,
            text=FOLLOW_ASK,
            chat=True,
            temperature=1.0,
            max_new=ASK_TOKENS,
            history=(*job.history, (job.text, answer)),
        )  # fmt: skip
        for job, answer in turns
        if job.follow_ups >= n
    ]


def follow_jobs(turns: list[tuple[sources.Job, str]], written: list[str], n: int) -> list[sources.Job]:
    """Round `n`'s answers: each question the target wrote (`written`, in the order of `ask_jobs`;
    those that are not one question are dropped) asked after the conversation so far, with the
    job's own temperature and token limit (its later rounds read `follow_ups` from it again)."""
    asked = [(job, answer) for job, answer in turns if job.follow_ups >= n]
    out = []
    for (job, answer), text in zip(asked, written, strict=False):  # an ask stage cut short: its prefix
        question = sources.question_from_answer(text)
        if question:
            out.append(dataclasses.replace(job, text=question, chat=True, history=(*job.history, (job.text, answer))))
    return out
