"""EngineRun: a LiveRun (run.py) decoded by an `Engine` (engine.py) through an
EngineBackend (engine_backend.py), the live page's default. It adds only how such a run starts:
the run's API, its state and its snapshots are LiveRun's."""

from __future__ import annotations

from typing import Any

from dynatree_core.decoding.engine import DecodeConfig
from dynatree_core.decoding.settings import RunSpec
from dynatree_core.drafting.policy import Policy
from dynatree_core.live.engine import Engine, StartRun
from dynatree_core.live.engine_backend import EngineBackend
from dynatree_core.live.run import LiveRun
from dynatree_core.live.state import RunState


class EngineRun(LiveRun):
    """A LiveRun whose models, KV caches and decoding loop live in an engine (a Ray actor), so
    drawing the page never takes time (or the GIL) from decoding. Its snapshots are EngineRuns too (the
    page says where they were measured), with nothing attached."""

    @classmethod
    def start_in(
        cls,
        engine: Engine,
        prompt_ids: list[int],
        policy: Policy,
        *,
        settings: dict[str, Any],
        spec: RunSpec | None = None,
        config: DecodeConfig = DecodeConfig(),
    ) -> EngineRun:
        """Start decoding in `engine` (waits for its models to load; DynaTreeError if they cannot)."""
        info = engine.wait_ready()
        tokenizer = info.tokenizer
        state = RunState.new(
            prompt_ids,
            policy,
            settings=settings,
            spec=spec,
            device=info.device,
            dtype=info.dtype,
            threads=info.threads,
            draft_kind=info.draft_kind if policy.needs_draft_model else "",
            vocab_size=info.vocab_size,
            detokenize=lambda tok: tokenizer.decode([tok]),
        )
        start = StartRun(list(prompt_ids), policy.name, dict(policy.config), config)
        return cls(state, EngineBackend(state, engine, start))

    @property
    def _rid(self) -> int:
        """The engine's name for this run (tests ask the child whether it still holds it)."""
        return self.backend.rid
