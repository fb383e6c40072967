"""The one training loop every recipe runs (nanochat: one loop, the stages differ in data and loss).

A recipe hands `train` a `Recipe` (its model, the parameters that train, its batches, its loss,
its evaluation, the record of its run and how it saves the result) and a `Loop` (its own
hyper-parameters: learning rate, warm-up, gradient clip, the schedule's length, the log and
evaluation cadence). The loop owns what every recipe did alike:

- AdamW (betas 0.9 / 0.95), a linear warm-up, then cosine decay to zero over the schedule's
  progress: by steps, by units of data seen (`total`), or by training seconds (`budget_s`, so two
  losses of different cost per step get equal compute, each a complete schedule);
- gradient-norm clipping at the recipe's `clip` (the token draft 1.0, the heads 0.5);
- evaluations every `eval_every` steps or every `eval_every_s` training seconds, into the run's
  `curve.json` (the model card's learning curve);
- `checkpoint.pt` at every log line and evaluation, written whole (`core.weights.save_whole`) and
  resumed only by the same run (`core.weights.check_same_run` on the recipe's record, resume.py);
  a rerun continues the same schedule, its place in the data included;
- the compute ledger (ledger.py): the training seconds of each block of `log_every` steps;
- data-parallel workers where torchrun started several (parallel.py): worker r steps on batches
  r, r + N, ... with the gradients averaged over the workers, and worker 0 alone writes.

Training seconds are the steps' own time: a step that took over PAUSED times the recent median
(the process was stopped with SIGSTOP while tests ran) counts as that median (`counted_s`). On a
GPU a step's host time is its launches (a step that never reads the device, as the packed one,
runs ahead of the kernels): the device is synchronised before each log line's clock reading, so
every block of steps counts the kernels it queued.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from dynatree_core.core.weights import check_same_run, load_weights, save_whole
from dynatree_core.training.ledger import record
from dynatree_core.training.parallel import mean_gradients, same_start, shared_counts, world


@dataclasses.dataclass
class Loop:
    """A recipe's loop settings (its own hyper-parameters; the defaults change nothing)."""

    name: str  # the log lines' prefix and the ledger's stage: "train", "train-feature", "train-packed"
    lr: float
    warmup: int
    clip: float  # gradient-norm clip
    weight_decay: float = 0.0
    steps: int = 0  # > 0: the schedule ends after this many steps
    total: float = 0.0  # > 0: the schedule is this many units of data seen (packed: passes x answer pairs)
    budget_s: float = 0.0  # > 0: the schedule is this much training time (cosine over time)
    log_every: int = 25
    # > 0: a log line checkpoints only when this many seconds have passed since the last checkpoint
    # (a fast device's steps are shorter than writing the checkpoint); 0: every log line
    checkpoint_every_s: float = 0.0
    eval_every: int = 0  # > 0: evaluate every this many steps and when the schedule ends
    eval_every_s: float = 0.0  # > 0: every this many training seconds and when the process ends
    eval_first: bool = False  # with eval_every_s: also before the first step
    stop_after_s: float = 0.0  # > 0: end this process after this much training time (the schedule stays)
    autocast: str = "bfloat16"  # mixed precision of the loss ("" for float32)
    device: str = "cpu"
    unit: str = "tokens"  # what the log's rate counts


@dataclasses.dataclass
class Recipe:
    """What a recipe hands the loop.

    batches(state): yields (batch, place): `place` (a dict) is merged into the state after the
        batch's step, so a resumed run starts after it (e.g. the sampler's RNG state).
    loss(batch, parts): (loss, parts for the log (when `parts`), units seen, tokens read).
    evaluate(state, loss): the learning curve's point at this step (it may log it).
    save(out): writes the trained model when the schedule is complete.
    """

    model: torch.nn.Module
    params: list[torch.nn.Parameter]
    batches: Callable[[dict], Iterator[tuple[object, dict]]]
    loss: Callable[[object, bool], tuple[torch.Tensor, dict, int, int]]
    evaluate: Callable[[dict, float], dict]
    save: Callable[[Path], None]
    run: dict  # what a resumed run must share with this one (resume.py)
    info: dict = dataclasses.field(default_factory=dict)  # what curve.json says beside the curve
    extra: dict = dataclasses.field(default_factory=dict)  # more for the checkpoint (e.g. the token map)
    note: Callable[[dict], str] | None = None  # more for each log line


def lr_at(loop: Loop, step: int, progress: float) -> float:
    """Linear warm-up over `warmup` steps, then cosine to zero over the run's progress (0..1)."""
    warm = min(1.0, (step + 1) / max(loop.warmup, 1))
    return loop.lr * warm * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


PAUSED = 10.0  # a step this many times its recent median was paused (SIGSTOP) or starved: not training


def counted_s(dt: float, recent: list[float]) -> float:
    """The training seconds a step of wall time `dt` counts: `dt`, unless it took over PAUSED times
    the median of the recent steps (the process was stopped while the suite ran), then that median.
    Keeps a background run's curve, eval interval and ledger in training time; `recent` is updated."""
    typical = sorted(recent)[len(recent) // 2] if len(recent) >= 5 else None
    counted = typical if typical is not None and dt > PAUSED * typical else dt
    recent[:] = [*recent[-19:], counted]
    return counted


def open_checkpoint(path: Path, run: dict, device: torch.device | str = "cpu") -> dict | None:
    """The checkpoint at `path` if this run may resume it (None: none there); refused, naming the
    settings, when it was written by another run (before anything is built from it)."""
    if not path.exists():
        return None
    saved = torch.load(path, map_location=device, weights_only=False)
    check_same_run(saved.get("run"), run, where=str(path))
    if "state" not in saved:  # written before the one loop: the state's keys at the top level
        keys = ("step", "curve", "spent_s", "seen", "rng")
        saved["state"] = {k: saved[k] for k in keys if k in saved}
    return saved


def progress(loop: Loop, state: dict) -> float:
    """Of the whole schedule, 0..1: by training time under a budget, else by data seen or by steps."""
    if loop.budget_s > 0:
        return state["spent_s"] / loop.budget_s
    return state["seen"] / loop.total if loop.total > 0 else state["step"] / max(loop.steps, 1)


def finished(loop: Loop, state: dict) -> bool:
    return progress(loop, state) >= 1 or (loop.steps > 0 and state["step"] >= loop.steps)


def _autocast(device: torch.device, dtype: str):
    return torch.autocast(device.type, dtype=getattr(torch, dtype)) if dtype else contextlib.nullcontext()


class _Run:
    """One process of a recipe's run: its optimiser, its state (what the checkpoint keeps of the
    schedule: step, data seen, training seconds, the curve, the data's place) and the block of
    steps since the last log line."""

    def __init__(self, recipe: Recipe, out: Path, loop: Loop, saved: dict | None, log):
        self.recipe, self.out, self.loop = recipe, out, loop
        self.world = world()  # parallel.py: rank 0 of 1 alone
        self.log = log if self.world.main else (lambda message: None)
        cuda = torch.device(loop.device).type == "cuda"  # one fused kernel for the update, not one per op
        self.opt = torch.optim.AdamW(recipe.params, lr=loop.lr, weight_decay=loop.weight_decay, betas=(0.9, 0.95),
                                     fused=cuda or None)  # fmt: skip
        first_eval = 0.0 if loop.eval_first else loop.eval_every_s
        self.state = {"step": 0, "seen": 0, "spent_s": 0.0, "curve": [], "next_eval_s": first_eval}
        if saved is not None:
            load_weights(recipe.model, saved["model"], what=str(out / "checkpoint.pt"))
            self.opt.load_state_dict(saved["opt"])
            self.state |= saved["state"]
            self.log(f"{loop.name}: resumed at step {self.state['step']} ({self.state['seen']:,} {loop.unit} seen)")
        self.block_s, self.block_tokens, self.loss, self.parts, self.lr = 0.0, 0, None, {}, loop.lr
        self.saved_at: float | None = None  # the loop's clock at the last checkpoint (or the first step)
        same_start(recipe.params, self.world)

    def step(self, batch) -> tuple[int, int]:
        """One optimiser step on `batch` at the schedule's learning rate (module docstring), the
        gradients averaged over the workers; returns the batch's (units seen, tokens read)."""
        loop, state = self.loop, self.state
        self.lr = lr_at(loop, state["step"], progress(loop, state))
        for group in self.opt.param_groups:
            group["lr"] = self.lr
        logging = (state["step"] + 1) % loop.log_every == 0
        with _autocast(torch.device(loop.device), loop.autocast):
            self.loss, self.parts, seen, tokens = self.recipe.loss(batch, logging)
        self.opt.zero_grad(set_to_none=True)
        self.loss.backward()
        mean_gradients(self.recipe.params, self.world)
        torch.nn.utils.clip_grad_norm_(self.recipe.params, loop.clip)
        self.opt.step()
        state["step"] += 1
        return seen, tokens

    def checkpoint(self) -> None:  # written whole, then renamed: a run killed while saving keeps the last one
        if not self.world.main:
            return
        body = {"model": self.recipe.model.state_dict(), "opt": self.opt.state_dict(), "state": self.state}
        save_whole(body | {"run": self.recipe.run} | self.recipe.extra, self.out / "checkpoint.pt")

    def log_block(self, now: float) -> None:
        """The block's line and its ledger entry (training seconds), then the checkpoint when it is
        due (`Loop.checkpoint_every_s`; `now` on the loop's clock)."""
        loop, step = self.loop, self.state["step"]
        if not self.world.main:
            self.block_s, self.block_tokens = 0.0, 0
            return
        record(loop.name, self.block_s, tokens=self.block_tokens, item=f"steps to {step}", run=str(self.out))
        terms = "".join(f" {k} {v:.3f}" for k, v in self.parts.items())
        note = self.recipe.note(self.state) if self.recipe.note else ""
        rate = self.block_tokens / max(self.block_s, 1e-9)
        self.log(f"{loop.name}: step {step} loss {self.loss.item():.4f}{terms} lr {self.lr:.2e}{note} "
                 f"({rate:.0f} {loop.unit}/s)")  # fmt: skip
        if loop.checkpoint_every_s <= 0 or now - (self.saved_at or 0.0) >= loop.checkpoint_every_s:
            self.checkpoint()
            self.saved_at = now
        self.block_s, self.block_tokens = 0.0, 0

    def evaluate(self) -> None:
        """The curve's point at this step (once a step), into curve.json."""
        curve, model = self.state["curve"], self.recipe.model
        if not self.world.main:
            return
        if curve and curve[-1]["step"] == self.state["step"] and self.state["step"]:
            return
        model.eval()
        curve.append(self.recipe.evaluate(self.state, float("nan") if self.loss is None else self.loss.item()))
        model.train()
        (self.out / "curve.json").write_text(json.dumps(self.recipe.info | {"curve": curve}, indent=1))


def train(recipe: Recipe, out: Path, loop: Loop, *, saved: dict | None = None, clock=None, log=print) -> dict:
    """Run (or resume, from `saved`: `open_checkpoint`) the recipe's schedule; returns the run's
    state (`finished(loop, state)`: complete, the model saved by `recipe.save(out)`; else the
    process stopped early and a rerun continues it)."""
    clock = clock or time.perf_counter  # read at call time: a test's fake clock is seen
    out.mkdir(parents=True, exist_ok=True)
    run = _Run(recipe, out, loop, saved, log)
    state, recent, started = run.state, [], run.state["spent_s"]
    cuda = torch.device(loop.device).type == "cuda"
    recipe.model.train()
    batches = iter(recipe.batches(state))
    while not finished(loop, state) and not (loop.stop_after_s > 0 and state["spent_s"] - started >= loop.stop_after_s):
        if loop.eval_every_s > 0 and state["spent_s"] >= state["next_eval_s"]:
            run.evaluate()
            state["next_eval_s"] = state["spent_s"] + loop.eval_every_s
        t0 = clock()  # a step's training time: its batch, forward, backward and update
        run.saved_at = t0 if run.saved_at is None else run.saved_at  # the checkpoints' interval starts here
        drawn = [next(batches) for _ in range(run.world.size)]  # worker r takes batches r, r + N, ...
        batch, place = drawn[run.world.rank][0], drawn[-1][1]
        seen, tokens = run.step(batch)
        state.update(place)  # a resumed run starts after this batch (every worker's)
        if cuda and (state["step"] % loop.log_every == 0 or finished(loop, state)):
            torch.cuda.synchronize()  # the queued steps finish inside the block they belong to
        t1 = clock()
        seen, tokens, dt = shared_counts(seen, tokens, t1 - t0, run.world, recipe.params[0].device)
        state["seen"] += seen
        run.block_tokens += tokens
        dt = counted_s(dt, recent)
        state["spent_s"] += dt
        run.block_s += dt
        end = finished(loop, state)
        if state["step"] % loop.log_every == 0 or end:
            run.log_block(t1)
        if loop.eval_every > 0 and (state["step"] % loop.eval_every == 0 or end):
            run.evaluate()
            run.checkpoint()
    if loop.eval_every_s > 0:
        run.evaluate()
    run.checkpoint()
    recipe.model.eval()
    if finished(loop, state) and run.world.main:
        recipe.save(out)
    return state
