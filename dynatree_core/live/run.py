"""A run that advances one iteration at a time: what the live app keeps per browser session.

`LiveRun` wraps the engine's generator. Each `step()` runs exactly one iteration (one target
forward) under a lock, because the models are shared by every session of the app process.
`start_worker()` runs the same steps in a background thread, so the engine decodes at its own
speed while the page draws the latest iteration at its own cadence: the worker only
appends to `records` and sets `done` after the last append, so a reader that reads `done` first
and then copies the list (`snapshot()`) always sees a consistent run. `pause()` takes effect after
the current iteration; a worker whose page stops calling `beat()` pauses itself, so a closed tab
never leaves a thread decoding; an exception in the worker ends the run and is kept in `error`.

The settings that define the run are frozen at start: `spec` (settings.RunSpec: models, sampling,
verifier, order, length, seed; typed) and `settings`, the page's own record of what it asked for
(the spec's fields plus policy, parameters and prompt), exported with the run. `differs(settings)`
tells the page that the user changed something, so it can ask to restart instead of mixing settings in one run's
statistics. A finished or imported run replays its records without models: the export carries
the text of every token the run drew (`token_texts`), so an imported run shows the same words.
Knows nothing of Streamlit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from dynatree_core.core.log import log_exception
from dynatree_core.core.vocab import TokenMap
from dynatree_core.decoding.engine import DecodeConfig, decode, draft_kind, vocab_size
from dynatree_core.decoding.methods import make_method, verifier_for
from dynatree_core.decoding.settings import RunSpec
from dynatree_core.drafting.policy import Policy
from dynatree_core.errors import DynaTreeError
from dynatree_core.runs.metrics import summarize
from dynatree_core.runs.records import TRACE_VERSION, IterationRecord, RunResult
from dynatree_core.runs.validate import check_run, check_size_and_depth

# A page polls (calls `beat()`) every render interval, well under a second; a worker that has not
# heard from its page for this long belongs to a closed tab and pauses.
IDLE_TIMEOUT_S = 60.0


@dataclasses.dataclass
class LiveRun:
    settings: dict[str, Any]
    prompt_ids: list[int]
    policy_name: str
    params: dict[str, Any]
    spec: RunSpec | None = None  # None: an imported file whose settings the registry refuses
    records: list[IterationRecord] = dataclasses.field(default_factory=list)
    device: str = "cpu"
    dtype: str = "float32"
    done: bool = False
    token_texts: dict[int, str] = dataclasses.field(default_factory=dict)
    threads: int = 0  # torch threads of the thread that ran the last iteration (0: not recorded)
    draft_kind: str = ""  # "token" / "feature" (engine.draft_kind); "" without a draft
    imported: bool = False  # replayed from an exported file (measured elsewhere)
    vocab_size: int | None = None  # the target's vocabulary: every token id a file holds lies below it
    error: Exception | None = None  # what ended the run, in step() or its worker (it is then done)
    idle_paused: bool = False  # the worker paused itself: its page stopped calling beat()
    _decode: Callable[[int], str] | None = dataclasses.field(default=None, repr=False)
    _steps: Iterator[IterationRecord] | None = dataclasses.field(default=None, repr=False)
    _worker: threading.Thread | None = dataclasses.field(default=None, init=False, repr=False)
    _pause: threading.Event = dataclasses.field(default_factory=threading.Event, init=False, repr=False)
    _gate: threading.Lock = dataclasses.field(default_factory=threading.Lock, init=False, repr=False)
    _last_beat: float = dataclasses.field(default=0.0, init=False, repr=False)

    @classmethod
    def start(
        cls,
        target: torch.nn.Module,
        prompt_ids: list[int],
        policy: Policy,
        *,
        settings: dict[str, Any],
        spec: RunSpec | None = None,
        draft: torch.nn.Module | None = None,
        config: DecodeConfig = DecodeConfig(),
        draft_token_map: TokenMap | None = None,
        detokenize: Callable[[int], str] | None = None,
    ) -> LiveRun:
        """Start decoding; `detokenize` maps one token id to its text (the target's tokenizer)."""
        steps = decode(target, prompt_ids, policy, draft=draft, config=config, draft_token_map=draft_token_map)
        return cls(
            settings=dict(settings),
            spec=spec,
            prompt_ids=list(prompt_ids),
            policy_name=policy.name,
            params=dict(policy.config),
            device=str(target.get_input_embeddings().weight.device),
            dtype=str(target.dtype).removeprefix("torch."),
            draft_kind=draft_kind(draft) if policy.needs_draft_model else "",
            vocab_size=vocab_size(target),
            _decode=detokenize,
            _steps=steps,
        )

    def step(self, lock: contextlib.AbstractContextManager | None = None) -> IterationRecord | None:
        """Run one iteration; None (and `done`) once the run has stopped. Refused (RuntimeError)
        while the worker is decoding: pause it first."""
        if self.worker_running and threading.current_thread() is not self._worker:
            raise RuntimeError("the run is decoding in its worker thread: pause it before stepping")
        with self._gate:  # one iteration at a time, whichever thread asks
            return self._advance(lock)

    def _advance(self, lock: contextlib.AbstractContextManager | None) -> IterationRecord | None:
        if self.done or self._steps is None:
            self.done = True
            return None
        # torch applies the process's thread count (core/threads.py) to a new thread lazily, at its first
        # parallel op; until then MKL matmuls in that thread use every core (measured: a fresh
        # thread's matmuls ran on 2 cores after set_num_threads(1)). Asking for it applies it.
        self.threads = torch.get_num_threads()
        try:
            with lock if lock is not None else contextlib.nullcontext():
                record = next(self._steps, None)
        except Exception as exc:  # e.g. the prompt does not fit the context: the run cannot go on
            log_exception(f"live run ({self.policy_name})", exc)
            self.error, self._steps = exc, None
            self.done = True
            raise
        if record is not None:
            self.records.append(record)  # before `done`: a reader that saw done has every record
        if record is None or record.stop is not None:
            self._steps = None  # release the KV caches
            self.done = True
        return record

    # ----- the background worker -----------------------------------------------------------------
    def start_worker(
        self, lock: contextlib.AbstractContextManager | None = None, *, idle_timeout_s: float = IDLE_TIMEOUT_S
    ) -> bool:
        """Decode in a daemon thread until the run is done, `pause()` is asked, or nobody has called
        `beat()` for `idle_timeout_s` seconds. False when there is nothing to start (done, running)."""
        if self.done:
            return False
        if self.worker_running and (not self._pause.is_set() or not self.wait(5.0)):
            return False  # already decoding, or still busy with the iteration it was paused in
        self._pause.clear()
        self.idle_paused = False
        self.beat()
        self._worker = threading.Thread(
            target=self._work, args=(lock, idle_timeout_s), name="dynatree-live-run", daemon=True
        )
        self._worker.start()
        return True

    def _work(self, lock: contextlib.AbstractContextManager | None, idle_timeout_s: float) -> None:
        while not self.done and not self._pause.is_set():
            if time.monotonic() - self._last_beat >= idle_timeout_s:
                self.idle_paused = True  # the page went away: stop using the cores
                return
            try:
                self.step(lock)
            except Exception:  # step() has ended the run and kept the exception in `error`
                return

    @property
    def worker_running(self) -> bool:
        return self._worker is not None and self._worker.is_alive()

    def beat(self) -> None:
        """The page is still watching (call it on every poll)."""
        self._last_beat = time.monotonic()

    def pause(self) -> None:
        """Ask the worker to stop after its current iteration (returns at once)."""
        self._pause.set()

    def wait(self, timeout_s: float, *, records: int | None = None) -> bool:
        """Wait up to `timeout_s` for the worker to end or, given `records`, until the run has that
        many records. True when no worker is running."""
        deadline = time.monotonic() + timeout_s
        while self.worker_running and (records is None or len(self.records) < records):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._worker.join(left if records is None else min(left, 0.02))  # records: poll every 20 ms
        return not self.worker_running

    def stop(self, timeout_s: float = 2.0) -> bool:
        """Pause and wait a little for the current iteration to end (never forever: a forward
        cannot be interrupted). True when the worker has ended."""
        self.pause()
        return self.wait(timeout_s)

    def close(self) -> None:
        """The page discards this run: stop decoding and free what it holds."""
        self.stop(timeout_s=0.0)

    def snapshot(self) -> LiveRun:
        """A copy that no worker touches, to draw while this run decodes: `done` is read before
        the records (the worker appends before it sets `done`), so a done snapshot is complete."""
        done = self.done
        return dataclasses.replace(self, records=self.records[:], done=done, _steps=None)

    def differs(self, settings: dict[str, Any]) -> list[str]:
        """Names of the settings that changed since the run started."""
        keys = set(settings) | set(self.settings)
        return sorted(k for k in keys if settings.get(k) != self.settings.get(k))

    def verifier(self) -> str:
        """The verifier this run used, as the engine resolved it; greedy for a file whose settings
        the registry refuses (its trees are greedy's)."""
        if self.spec is None:
            return "greedy"
        try:
            return verifier_for(make_method(self.policy_name, self.params), self.spec.decode_config())
        except DynaTreeError:
            return "greedy"

    def text(self, token: int) -> str:
        """Text of one token id, decoded once and remembered (an imported run has no tokenizer)."""
        if token not in self.token_texts:
            if self._decode is None:
                return f"<{token}>"
            self.token_texts[token] = self._decode(token)
        return self.token_texts[token]

    def _all_tokens(self) -> set[int]:
        return drawn_tokens(self.records[:])

    @property
    def token_ids(self) -> list[int]:
        return [t for r in self.records[:] for t in r.committed]

    def result(self, text: str = "", upto: int | None = None) -> RunResult:
        """The run's summary over its records (`upto`: the first this many only)."""
        records = self.records[:upto]  # one length, even while the worker appends
        return summarize(
            records,
            policy=self.policy_name,
            params=self.params,
            text=text,
            prompt_ids=self.prompt_ids,
            target_forwards=len(records),
            device=self.device,
            dtype=self.dtype,
            threads=self.threads,
            draft_kind=self.draft_kind,
        )

    def to_json(self, text: str = "") -> str:
        """The run as RunResult JSON (records included) plus its settings, for export."""
        return run_file(self.result(text), self.settings, self.text, vocab=self.vocab_size)

    @classmethod
    def from_json(cls, data: str | bytes) -> LiveRun:
        """A finished run to replay without models (raises ValueError on a malformed file)."""
        try:
            check_size_and_depth(data)
            raw = json.loads(data)
            if not isinstance(raw, dict):
                raise ValueError("expected a JSON object")
            check_run(raw)
            version = raw.get("version", TRACE_VERSION)
            if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= TRACE_VERSION:
                raise ValueError(f"file format version {version!r}; this DynaTree reads versions 1 to {TRACE_VERSION}")
            result = RunResult.from_dict(raw)
            texts = {int(k): str(v) for k, v in (raw.get("token_texts") or {}).items()}
        except (json.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError, RecursionError) as exc:
            raise ValueError(f"not a DynaTree run file: {exc}") from exc
        settings = dict(raw.get("settings") or {})
        return cls(
            settings=settings,
            spec=_spec_of(settings),
            prompt_ids=result.prompt_ids,
            policy_name=result.policy,
            params=result.params,
            records=result.records,
            device=result.device,
            dtype=result.dtype,
            threads=result.threads,
            draft_kind=result.draft_kind,
            imported=True,
            done=True,
            token_texts=texts,
            vocab_size=raw.get("vocab_size"),
        )


def drawn_tokens(records: list[IterationRecord]) -> set[int]:
    """Every token a run's records can show: trees, commits, the target's choices, bonuses."""
    out: set[int] = set()
    for r in records:
        out.update(r.tree.tokens, r.committed, r.target_tokens)
        if r.bonus_token is not None:
            out.add(r.bonus_token)
    return out


def run_file(
    result: RunResult, settings: dict[str, Any], decode: Callable[[int], str], *, vocab: int | None = None
) -> str:
    """A run as the app exports and imports it: the RunResult with its records, the settings the
    page asked for, the text of every token it draws (so a replay needs no tokenizer) and the
    target's vocabulary size (import checks every token id against it)."""
    out = result.to_dict(with_records=True)
    out["settings"] = settings
    if vocab is not None:
        out["vocab_size"] = vocab
    out["token_texts"] = {str(t): decode(t) for t in sorted(drawn_tokens(result.records) | set(result.prompt_ids))}
    return json.dumps(out)


def export_run(path, result: RunResult, spec: RunSpec, policy: Policy, prompt: str, chat: bool, target) -> None:
    """Write a CLI run as the app's run file (its settings as the live page records them);
    `target`: the loaded target (its tokenizer writes the token texts, its vocabulary the bound)."""
    settings = {**dataclasses.asdict(spec), "policy": policy.name, "params": policy.config, "prompt": prompt}
    settings["chat"] = chat
    decode_one = lambda t: target.tokenizer.decode([t])  # noqa: E731
    path.write_text(run_file(result, settings, decode_one, vocab=vocab_size(target.model)))


def _spec_of(settings: dict[str, Any]) -> RunSpec | None:
    """An imported file's RunSpec, or None when the registry refuses its settings (not trusted)."""
    try:
        return RunSpec.of(settings)
    except (DynaTreeError, TypeError, ValueError):
        return None
