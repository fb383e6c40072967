"""RunState: everything a live run has, whichever backend decodes it, and what it says about itself.

The settings that define the run are frozen at start: `spec` (settings.RunSpec: models, sampling,
verifier, order, length, seed; typed) and `settings`, the page's own record of what it asked for
(the spec's fields plus policy, parameters and prompt), exported with the run. Where it was
measured (device, dtype, threads, draft kind) comes from the backend at start. `records`, `done`,
`error` and `idle_paused` are written by the backend that decodes the run (a thread backend's
worker, a process backend's dispatcher): a record is appended before `done` is set, so a reader
that reads `done` first and then copies the list (`snapshot()`) always sees a consistent run.

A finished or imported run replays its records without models: the run file (runs/run_file.py)
carries the text of every token the run drew (`token_texts`), so an imported run shows the same
words. Knows nothing of Streamlit, threads or processes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from dynatree_core.decoding.methods import make_method, verifier_for
from dynatree_core.decoding.settings import RunSpec
from dynatree_core.drafting.policy import Policy
from dynatree_core.errors import DynaTreeError
from dynatree_core.runs.metrics import summarize
from dynatree_core.runs.records import IterationRecord, RunResult
from dynatree_core.runs.run_file import dump_run_file, load_run_file


@dataclasses.dataclass
class RunState:
    settings: dict[str, Any]
    prompt_ids: list[int]
    policy_name: str
    params: dict[str, Any]
    spec: RunSpec | None = None  # None: an imported file whose settings the registry refuses
    records: list[IterationRecord] = dataclasses.field(default_factory=list)
    device: str = "cpu"
    dtype: str = "float32"
    threads: int = 0  # torch threads of the thread that ran the last iteration (0: not recorded)
    draft_kind: str = ""  # "token" / "feature" (engine.draft_kind); "" without a draft
    imported: bool = False  # replayed from an exported file (measured elsewhere)
    vocab_size: int | None = None  # the target's vocabulary: every token id a file holds lies below it
    token_texts: dict[int, str] = dataclasses.field(default_factory=dict)
    detokenize: Callable[[int], str] | None = dataclasses.field(default=None, repr=False)  # the target's tokenizer
    # what happened so far, written by the backend that decodes the run
    done: bool = False
    error: Exception | None = None  # what ended the run (it is then done)
    idle_paused: bool = False  # decoding paused itself: its page stopped calling beat()

    @classmethod
    def new(
        cls, prompt_ids: list[int], policy: Policy, *, settings: dict[str, Any], spec: RunSpec | None, **measured: Any
    ) -> RunState:
        """The state of a run about to start: copies of the settings and prompt (the caller's
        objects changing later do not change the run), the policy's name and parameters, and
        `measured`: where the backend decodes it (device, dtype, threads, draft_kind, vocab_size,
        detokenize)."""
        return cls(
            settings=dict(settings),
            spec=spec,
            prompt_ids=list(prompt_ids),
            policy_name=policy.name,
            params=dict(policy.config),
            **measured,
        )

    @classmethod
    def from_json(cls, data: str | bytes) -> RunState:
        """A finished run to replay without models (raises ValueError on a malformed file)."""
        file = load_run_file(data)
        result = file.result
        return cls(
            settings=file.settings,
            spec=_spec_of(file.settings),
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
            token_texts=file.token_texts,
            vocab_size=file.vocab_size,
        )

    def to_json(self, text: str = "") -> str:
        """The run file: RunResult JSON (records included) plus its settings and token texts."""
        return dump_run_file(self.result(text), self.settings, self.text, vocab=self.vocab_size)

    def snapshot(self) -> RunState:
        """A copy no backend writes to: `done` is read before the records (a backend appends
        before it sets `done`), so a done snapshot is complete."""
        done = self.done
        return dataclasses.replace(self, records=self.records[:], done=done)

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
            if self.detokenize is None:
                return f"<{token}>"
            self.token_texts[token] = self.detokenize(token)
        return self.token_texts[token]

    @property
    def token_ids(self) -> list[int]:
        return [t for r in self.records[:] for t in r.committed]

    def result(self, text: str = "", upto: int | None = None) -> RunResult:
        """The run's summary over its records (`upto`: the first this many only)."""
        records = self.records[:upto]  # one length, even while a backend appends
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


def _spec_of(settings: dict[str, Any]) -> RunSpec | None:
    """An imported file's RunSpec, or None when the registry refuses its settings (not trusted)."""
    try:
        return RunSpec.of(settings)
    except (DynaTreeError, TypeError, ValueError):
        return None
