"""How forwards run, as one settings object, and every environment override the project reads.

`ForwardSettings` is the one object a run's forward switches travel in: the CLI's engine flags
(cli/commands.forward_settings), the app and the measuring code build one, `DecodeConfig.forward`
carries it, and the engine hands it to the target's and the draft's caches in one place
(decoding/engine.start_run), where forward/choice.py picks the forward from it. A field left None is
"auto": its environment override below if one is set, else the library's rule for the device.

`ENVIRONMENT` lists every `DYNATREE_*` variable with its default and what it sets; the library
reads them only through `env` (tests/test_settings.py checks both, and that docs/cli.md's
table names the same variables). Contract: knows nothing but the process environment.
"""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class Override:
    name: str
    default: str  # "" : unset, the library decides
    help: str


ENVIRONMENT: dict[str, Override] = {
    o.name: o
    for o in (
        # how forwards run (ForwardSettings' fields, when a run leaves them None)
        Override("DYNATREE_STATIC_CACHE", "1", "0: transformers' DynamicCache instead of the per-run static buffers"),
        Override("DYNATREE_FAST_FORWARD", "1", "0: the stock HF forward instead of the lean one"),
        Override("DYNATREE_GRAPHS", "1", "0: eager forwards on CUDA instead of captured CUDA graphs"),
        Override("DYNATREE_STEP_GRAPHS", "1", "0: the work between forwards op by op, not as captured steps"),
        Override("DYNATREE_INVARIANT", "", "0/1: width-invariant target forwards off/on (auto: on below float32)"),
        # how a model is built (once per model, not per run)
        Override(
            "DYNATREE_KERNELS",
            "1",
            "0: torch's ops instead of the Triton kernels in a GPU's lean forward and draft levels' admission",
        ),
        Override("DYNATREE_PACK", "1", "0: plain nn.Linear on a CPU (no oneDNN pre-packing)"),
        Override("DYNATREE_THREADS", "", "torch's CPU threads (default: every core; the app leaves one)"),
        # where things live
        Override("DYNATREE_CACHE", "", "the cache root (default ~/.cache/dynatree)"),
        Override("DYNATREE_LOG", "", "the server log's file (default ~/.cache/dynatree/server.log)"),
        # serving the app
        Override("DYNATREE_LIVE_ENGINE", "ray", "ray: a Ray actor a pair; thread: decode in the app's process"),
        Override("DYNATREE_MAX_PAIRS", "", "engines a node holds at once (default: what memory fits)"),
        Override("DYNATREE_REPLICAS", "1", "engines a pair gets (auto: one more a node while all are busy)"),
        Override("DYNATREE_LOAD_TIMEOUT", "", "seconds a page waits for a pair to load and warm up (default 900)"),
        Override("DYNATREE_JOB_TIMEOUT", "", "seconds a page waits for one job, queueing included (default 3600)"),
        Override("DYNATREE_PRESETS_ONLY", "", "1: serve the preset pairs only (a public instance)"),
        Override("DYNATREE_REPLAY", "1", "0: the live page opens on its form, not a recorded run"),
        # running beyond one process
        Override("DYNATREE_RAY_ADDRESS", "", "the Ray cluster `--ray` joins (else RAY_ADDRESS, else a local runtime)"),
    )
}


def env(name: str) -> str:
    """The override's value as set (stripped), else its default. KeyError for an unlisted name."""
    return os.environ.get(name, "").strip() or ENVIRONMENT[name].default


def passed_on(root: str) -> dict[str, str]:
    """The environment a worker on another runtime needs (a Ray actor's: live/engine.py): the
    overrides set here, Hugging Face's and Triton's variables, and `root` first on the import path."""
    keep = {k: v for k, v in os.environ.items() if k.startswith(("DYNATREE_", "HF_", "TRANSFORMERS_", "TRITON_"))}
    path = os.environ.get("PYTHONPATH", "")
    return keep | {"PYTHONPATH": f"{root}{os.pathsep}{path}" if path else root}


def ray_starts_only_when_asked() -> bool:
    """Turn off Ray's start on first use (RAY_ENABLE_AUTO_CONNECT=0) unless the user set that
    variable; whether it is off (measure/cluster.connect: Ray starts only there)."""
    return os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0") == "0"


def env_on(name: str) -> bool:
    """A switch that is on unless its override says "0"."""
    return env(name) != "0"


@dataclasses.dataclass(frozen=True)
class ForwardSettings:
    """How one run's forwards run; None: auto (the override, else the library's rule).

    Attributes:
        static_cache: per-run preallocated KV buffers compacted in place (else DynamicCache).
        fast_forward: the lean forward over them (Llama-family models).
        graphs: fixed-shape forwards, one CUDA graph per width (auto: on CUDA).
        step_graphs: the tensor work between forwards captured as steps where forwards are.
        width_invariant: the target's rows get the bits they would get alone (auto: below float32).
        device_draft: greedy draft levels run at fixed widths, the tree read once (auto: on CUDA);
            off, each level's count is read at once (drafting/device.py).
        device_verify: the verify forward of a greedy tree drafted as levels is queued from the
            tree's rows built from the levels, where they are, before the host reads the tree (auto: on).
    """

    static_cache: bool | None = None
    fast_forward: bool | None = None
    graphs: bool | None = None
    step_graphs: bool | None = None
    width_invariant: bool | None = None
    device_draft: bool | None = None
    device_verify: bool | None = None

    def choice_switches(self) -> dict:
        """The switches the forward is chosen from (forward/choice.choose_forward's, forward_path's)."""
        return {"static": self.static_cache, "fast": self.fast_forward, "graphs": self.graphs}

    def cache_switches(self) -> dict:
        """Those and whether steps are captured: forward/kv.KVState's keyword arguments."""
        return self.choice_switches() | {"steps": self.step_graphs}
