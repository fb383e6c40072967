"""`draft-gpu`: the feature draft from a prompt pack in one sitting on a GPU, stage by stage.

    answers   the pack's jobs answered in large batches, features and the compact teacher kept
              as it decodes, from the decoding's own states and logits (answering.py)
    follow    the follow-up rounds the pack's jobs ask for (the target writes the user's next
              question, then answers it)
    relabel   the OOD answers' features and teacher (store.relabel, teacher-forced), and the
              teacher of any answer shard that lacks it; with `prior_answers`, answers made before
              (the committed ones) copied in and given features and teacher, trained on too
    train     the packed feature recipe (`make draft-feature-long`'s flags: feature kind, one level,
              CE share 0.25), cosine to zero over the training share of the budget
    quality   held-out and OOD agreement by depth (feature-quality --answers)
    export    the draft and its card (with the pack's sources) into RUN/export, at most EXPORT_MB

The budget (`budget_s`, seconds of the stages' own work, summed over calls) is split: the answers
get ANSWER_SHARE (the follow-ups, when the pack asks for any, FOLLOW_SHARE of it), training what
the data stages left of all but REPORT_SHARE (or `train_s`; fixed when training starts, so a resumed
schedule stays the same), quality and export the rest. Answers stop early at `answer_tokens`.

Resume: each stage that completes is marked in RUN/stages.json (its seconds, items and tokens); a
call skips marked stages, answers resume by shard and training from its checkpoint. `stop_after_s`
ends a call (between shards, or the trainer's own stop) so one call fits a machine's per-command
limit; `until` ends it after that stage. Everything is written under the run directory, the
compute ledger included (ledger.kept_in).
"""

from __future__ import annotations

import json
import shutil
import time

import numpy as np

from dynatree_core.core.devices import resolve_device
from dynatree_core.errors import DynaTreeError
from dynatree_core.runs.environment import portable
from dynatree_core.training.answers.pack import read_pack
from dynatree_core.training.answers.store import AnswerStore
from dynatree_core.training.cli import COMMITTED, SHIPPED
from dynatree_core.training.gpu import answering
from dynatree_core.training.gpu.book import Book
from dynatree_core.training.gpu.settings import STAGES, GpuRecipe, command_line
from dynatree_core.training.ledger import kept_in

ANSWER_SHARE = 0.55  # of the budget: the target's answers (and follow-ups)
FOLLOW_SHARE = 0.2  # of the answers' share, kept for the follow-ups when the pack asks for them
REPORT_SHARE = 0.1  # of the budget, kept for quality and export
MIN_TRAIN_SHARE = 0.2  # training gets at least this share, whatever the data stages took
# why an answer stage stopped before its last shard (GpuRun._room)
STOPPED = {"goal": "the answer-token goal is met", "share": "its share of the budget is spent",
           "call": "this call's time is up", "disk": "the disk is nearly full"}  # fmt: skip
DISK_MARGIN_GB = 2.0  # free disk kept beyond what the teacher and training will write
EXPORT_MB = 16.0
MAP_SIZE = 24576  # a map rebuilt from the answers: the shipped feature draft's size
# `make draft-feature-long`'s LONG_FLAGS (the feature kind's long schedule), over a time budget
# (a checkpoint each 30 s, not each log line: on a GPU ten steps take less time than writing ~110 MB)
TRAIN_SETTINGS = dict(levels=1, ce_share=0.25, lr=5e-4, warmup=50, passes=15.0, log_every=10, checkpoint_every_s=30.0)


class GpuRun:
    """One call of the recipe over its run directory (module docstring)."""

    def __init__(self, cfg: GpuRecipe, log=print):
        self.cfg, self.started = cfg, time.perf_counter()
        # every line with this call's seconds so far: a cut-off call's log still says where its time went
        self.log = lambda line: log(f"[{time.perf_counter() - self.started:4.0f} s] {line}")
        self.out = cfg.out
        self.book = Book(self.out / "stages.json")
        self.device = resolve_device(cfg.device)
        cuda = self.device.type == "cuda"
        self.batch = cfg.batch_rows or (1024 if cuda else 16)
        self.store = AnswerStore(self.out / "answers", self.out / "answer-features")
        self._models: dict[str, object] = {}

    # ----- where things are, what is left -------------------------------------------------------

    def ood_store(self) -> AnswerStore:
        """The OOD answers: the committed ids of the embedded target, else generated into the run."""
        ids = COMMITTED / "ood-answers" if self.cfg.target == "embedded" else self.out / "ood-answers"
        return AnswerStore(ids, self.out / "ood-features")

    def answer_stages(self) -> tuple[str, ...]:
        n = self.book.data["plan"].get("rounds", 0)
        prior = tuple(self.book.data["plan"].get("prior", ()))
        return ("main", *(f"{s}{r}" for r in range(1, n + 1) for s in ("ask", "follow")), *prior)

    def call_left(self) -> float:
        """Seconds this call may still start work in (inf without `stop_after_s`)."""
        if self.cfg.stop_after_s <= 0:
            return float("inf")
        return self.cfg.stop_after_s - (time.perf_counter() - self.started)

    def target(self, dtype: str):
        """The target (LoadedModel) in `dtype`, loaded once per call (CPU: linears packed)."""
        if dtype not in self._models:
            from dynatree_core.core.models import load_model
            from dynatree_core.core.packing import pack_linears, packing_enabled

            target = load_model(self.cfg.target, device=str(self.device), dtype=dtype)
            if dtype != "float32" and packing_enabled(target.device, target.dtype):
                pack_linears(target.model)
            self._models[dtype] = target
        return self._models[dtype]

    def disk_needed(self) -> float:
        """Bytes the next answer shard must leave free: what the teacher (about a tenth of the
        features) and the training run will write, and a margin."""
        features = sum(p.stat().st_size for p in self.store.features_dir.glob("*.npy"))
        return 0.25 * features + DISK_MARGIN_GB * 2**30

    def stored_tokens(self) -> int:
        return self.book.stage("answers")["tokens"] + self.book.stage("follow")["tokens"]

    # ----- the call ----------------------------------------------------------------------------

    def run(self) -> bool:
        """The stages up to `until` that are not done; returns True when `until` is done."""
        if self.cfg.until not in STAGES:
            raise ValueError(f"until: one of {', '.join(STAGES)}, not {self.cfg.until!r}")
        self.out.mkdir(parents=True, exist_ok=True)
        with kept_in(self.out / "compute.jsonl"):
            try:
                for name in STAGES[: STAGES.index(self.cfg.until) + 1]:
                    if self.book.stage(name)["done"]:
                        continue
                    if self.call_left() <= 0:
                        self.log(f"draft-gpu: this call's time is up before {name}; rerun to continue")
                        return False
                    self.log(f"draft-gpu: stage {name} (device {self.device})")
                    if not getattr(self, f"stage_{name}")():
                        self.log(f"draft-gpu: stopped in {name}; rerun the same command to continue")
                        return False
            finally:
                self.write_summary()
        return True

    def write_summary(self) -> None:
        """RUN/summary.json, after every call: per stage its seconds, items, tokens and whether it is
        done; the device, the budget, the export's size."""
        summary = {"device": str(self.device), "target": self.cfg.target, "budget_s": self.cfg.budget_s,
                   "batch_rows": self.batch, "stages": self.book.data["stages"]}  # fmt: skip
        export = self.out / "export"
        if export.is_dir():
            summary["export_bytes"] = sum(p.stat().st_size for p in export.rglob("*") if p.is_file())
        (self.out / "summary.json").write_text(json.dumps(summary, indent=1))

    # ----- the stages (each returns True when it completed) -----------------------------------

    def _pack_jobs(self) -> list:
        """The pack's jobs, saved into the run the first time (a resumed run reads its own copy)."""
        jobs = answering.saved_jobs(self.store, "main")
        if jobs is None:
            header, jobs = read_pack(self.cfg.pack)
            (self.out / "pack.json").write_text(json.dumps(header, indent=1))
            answering.save_jobs(self.store, "main", jobs)
        self.book.plan("rounds", lambda: answering.rounds(jobs))
        return jobs

    def _room(self, stage: str, share_s: float):
        """Whether another shard of `stage` may start: the answer-token goal, the stage's share, the
        call's time and the free disk allow it (the first shard of a run always may); a refusal's
        reason is kept."""

        def room(next_s: float) -> bool:
            if self.cfg.answer_tokens and self.stored_tokens() >= self.cfg.answer_tokens:
                self.refused = "goal"
            elif self.book.stage(stage)["items"] == 0:
                return True
            elif self.book.seconds(stage) + next_s > share_s:
                self.refused = "share"
            elif next_s > self.call_left():
                self.refused = "call"
            elif shutil.disk_usage(self.out).free < self.disk_needed():
                self.refused = "disk"
            else:
                return True
            return False

        self.refused = ""
        return room

    def _decode(self, stage: str, book_stage: str, jobs: list, share_s: float) -> answering.Decoded:
        from dynatree_core.training.answers.decode_batch import BatchDecoder

        target = self.target(self.cfg.dtype)
        shard = self.book.plan(
            "shard_jobs", lambda: self.cfg.shard_jobs or (8 * self.batch if self.device.type == "cuda" else 512)
        )
        room = self._room(book_stage, share_s)

        def wrote(tokens: int, seconds: float) -> None:
            self.book.add(book_stage, seconds, 1, tokens)
            row = self.book.stage(book_stage)
            rate, eta = row["tokens"] / max(row["seconds"], 1e-9), max(share_s - row["seconds"], 0.0)
            self.log(f"draft-gpu: {book_stage}: {row['tokens']:,} answer tokens ({rate:.0f}/s), "
                     f"{self.stored_tokens():,} in all; ETA at most {eta:.0f} s (its share)")  # fmt: skip

        decoder = BatchDecoder(target.model)
        done = answering.decode_stage(self.store, decoder, target, stage, jobs, shard_jobs=shard, batch=self.batch,
                                      seed=self.cfg.seed, room=room, wrote=wrote, log=self.log)  # fmt: skip
        why = STOPPED.get(self.refused, "every job is answered")
        rate = done.tokens / max(done.seconds, 1e-9)
        self.log(f"draft-gpu: {stage}: {done.tokens:,} answer tokens in {done.seconds:.0f} s ({rate:.0f} tokens/s); "
                 f"{self.stored_tokens():,} stored in all; stopped: {why}")  # fmt: skip
        return done

    def _stopped_by_call(self, done: answering.Decoded) -> bool:
        """The stage stopped because this call's time ran out (not its share or the token goal)."""
        return not done.complete and self.refused == "call"

    def stage_answers(self) -> bool:
        jobs = self._pack_jobs()
        share = self.cfg.budget_s * ANSWER_SHARE * (1 - FOLLOW_SHARE if self.book.data["plan"]["rounds"] else 1)
        done = self._decode("main", "answers", jobs, share)
        if self._stopped_by_call(done):
            return False
        self.book.add("answers", 0.0, done=True)
        return True

    def stage_follow(self) -> bool:
        share = self.cfg.budget_s * ANSWER_SHARE - self.book.seconds("answers")
        shard = self.book.data["plan"].get("shard_jobs", 1)
        tokenizer = self.target(self.cfg.dtype).tokenizer
        for n in range(1, self.book.data["plan"]["rounds"] + 1):
            before, ask, follow = ("main" if n == 1 else f"follow{n - 1}"), f"ask{n}", f"follow{n}"
            turns = answering.answered(self.store, before, tokenizer, shard)
            asks = answering.saved_jobs(self.store, ask) or answering.save_jobs(
                self.store, ask, answering.ask_jobs(turns, n)
            )
            done = self._decode(ask, "follow", asks, share)
            if self._stopped_by_call(done):
                return False
            written = [text for _, text in answering.answered(self.store, ask, tokenizer, shard)]
            follows = answering.saved_jobs(self.store, follow) or answering.save_jobs(
                self.store, follow, answering.follow_jobs(turns, written, n)
            )
            done = self._decode(follow, "follow", follows, share)
            if self._stopped_by_call(done):
                return False
        self.book.add("follow", 0.0, done=True)
        return True

    def stage_relabel(self) -> bool:
        """The OOD answers (generated first for a target without committed ones) with their features
        and teacher, and the teacher of any answer shard without one (the answers keep theirs as
        they decode); one shard per call of store.relabel, so a call out of time stops between shards."""
        from dynatree_core.training.answers.store import ood_answers, relabel

        target = self.target(self.cfg.dtype)
        ood = self.ood_store()
        if not ood.shards("ood"):
            t0 = time.perf_counter()
            ood_answers(ood, target, max_new=self.cfg.ood_max_new, log=self.log)
            self.book.add("relabel", time.perf_counter() - t0, 1)
        if self.cfg.prior_answers is not None:
            prior = self.book.plan("prior", lambda: answering.import_prior(self.store, self.cfg.prior_answers))
            self.log(f"draft-gpu: relabel: prior answers, stages {', '.join(prior) or 'none'}")
        batch = 64 if self.device.type == "cuda" else 16
        work = [(store, stage, k) for store, stages in ((self.store, self.answer_stages()), (ood, ("ood",)))
                for stage in stages for k in store.shards(stage) if not store.has_teacher(stage, k)]  # fmt: skip
        spent = 0.0
        for i, (store, stage, _) in enumerate(work):
            if self.call_left() <= 0:
                return False
            t0 = time.perf_counter()
            relabel(store, target, batch=batch, teacher=True, stages=(stage,), max_shards=1, log=self.log)
            spent += time.perf_counter() - t0
            self.book.add("relabel", time.perf_counter() - t0, 1)
            self.log(
                f"draft-gpu: relabel: {i + 1}/{len(work)} shards, ETA {spent / (i + 1) * (len(work) - i - 1):.0f} s"
            )
        self.book.add("relabel", 0.0, done=True)
        return True

    def train_share(self) -> float:
        """Seconds of training: `train_s`, else what the data stages left of all but the report's share."""
        if self.cfg.train_s > 0:
            return self.cfg.train_s
        left = self.cfg.budget_s * (1 - REPORT_SHARE) - self.book.seconds("answers", "follow", "relabel")
        return max(left, self.cfg.budget_s * MIN_TRAIN_SHARE)

    def token_map(self, target):
        """The draft's vocabulary: `token_map`, the shipped feature draft's for the embedded target, else
        the MAP_SIZE most frequent answer tokens of this run (vocab-map's rule), saved into the run."""
        from dynatree_core.core.vocab import TokenMap
        from dynatree_core.training.answers.windows import answer_ids, frequency_map

        path = self.cfg.token_map or (SHIPPED / "smollm2-feature-draft" if self.cfg.target == "embedded" else None)
        if path is None:
            path = self.out / "token-map"
            if not path.is_dir():
                vocab = target.model.config.get_text_config(decoder=True).vocab_size
                counts = np.bincount(answer_ids(self.store, self.answer_stages()), minlength=vocab)[:vocab]
                path.mkdir(parents=True)
                frequency_map(counts, min(MAP_SIZE, vocab), always=sorted(target.eos_token_ids)).save(path)
        return TokenMap.load(path)

    def stage_train(self) -> bool:
        from dynatree_core.training.answers.windows import source_summary
        from dynatree_core.training.packed.commands import eval_splits, start_draft
        from dynatree_core.training.packed.data import PackedAnswers
        from dynatree_core.training.packed.step import PackedTrainConfig
        from dynatree_core.training.packed.train import train_packed

        target, run = self.target("float32"), self.out / "train"
        token_map, stages = self.token_map(target), self.answer_stages()
        data = PackedAnswers(self.store, token_map, stages=stages)
        ood = PackedAnswers(self.ood_store(), token_map, stages=("ood",), heldout=True)
        budget = self.book.plan("train_s", self.train_share)
        stop = 0.0 if self.call_left() == float("inf") else max(self.call_left(), 1e-9)  # 0: no stop
        cfg = PackedTrainConfig(**TRAIN_SETTINGS, budget_s=budget, eval_every_s=budget, device=str(self.device),
                                seed=self.cfg.seed, stop_after_s=stop,
                                pairs_per_step=self.cfg.pairs_per_step)  # fmt: skip
        pairs = data.answer_pairs()
        self.log(f"draft-gpu: train: {len(data.train_rows):,} windows, {pairs:,} answer pairs, a {budget:.0f} s "
                 f"schedule ({budget - self.book.seconds('train'):.0f} s left)")  # fmt: skip
        draft = start_draft("feature", target.model, token_map, None, cfg.seed, init_from=self.cfg.init_from, out=run)
        prior = tuple(s for s in stages if s.startswith("prior-"))  # answers made before the run
        about = {"kind": "answers", **data.windows.describe(), "sources": source_summary(self.store, stages),
                 "pack_answers": source_summary(self.store, tuple(s for s in stages if s not in prior)),
                 "pack": json.loads((self.out / "pack.json").read_text()).get("sources", {})}  # fmt: skip
        if prior:
            tokens = sum(row["answer_tokens"] for row in source_summary(self.store, prior).values())
            about["prior"] = {"stages": list(prior), "answer_tokens": tokens}
        if self.cfg.init_from:
            about["init_from"] = portable(str(self.cfg.init_from))
        t0 = time.perf_counter()
        head = target.model.get_output_embeddings()
        train_packed(
            draft, data, run, cfg, target_head=head, evals=eval_splits(data, ood, cfg), about=about, log=self.log
        )
        last = json.loads((run / "curve.json").read_text())["curve"][-1]
        self.book.add("train", time.perf_counter() - t0, done=(run / "draft").is_dir())
        self.book.set("train", items=last["step"], tokens=last["seen"], passes=round(last["seen"] / max(pairs, 1), 2))
        return self.book.stage("train")["done"]

    def stage_quality(self) -> bool:
        """Held-out and OOD agreement by depth of the trained draft (feature-quality --answers)."""
        from dynatree_core.training.answers.windows import agreement_report, answer_splits

        t0 = time.perf_counter()
        splits = answer_splits(self.store, self.ood_store(), self.answer_stages())
        report = agreement_report(self.target("float32").model, [self.out / "train" / "draft"], None, splits)
        (self.out / "quality.json").write_text(portable(json.dumps(report, indent=1)))
        for split, part in report.items():
            depths = next(v["agreement_by_depth"] for v in part.values() if isinstance(v, dict))
            self.log(f"draft-gpu: quality: {split}: agreement by depth {' / '.join(f'{a:.3f}' for a in depths)}")
        windows = sum(part["windows"] for part in report.values())
        self.book.add("quality", time.perf_counter() - t0, windows, done=True)
        return True

    def stage_export(self) -> bool:
        """The draft and its card into RUN/export; refused when over EXPORT_MB."""
        from dynatree_core.training.card import export_feature_draft

        t0, dest = time.perf_counter(), self.out / "export"
        quality = json.loads((self.out / "quality.json").read_text())
        export_feature_draft(self.out / "train", dest, self.target("float32").model, quality=quality,
                             command=command_line(self.cfg, self.batch))  # fmt: skip
        size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
        if size > EXPORT_MB * 2**20:
            raise DynaTreeError(
                f"draft-gpu: the export is {size / 2**20:.1f} MB, over the {EXPORT_MB:.0f} MB to bring back"
            )
        self.book.add("export", time.perf_counter() - t0, 1, size, done=True)
        self.log(f"draft-gpu: exported {size / 2**20:.1f} MB: bring back {portable(str(dest))}")
        return True
