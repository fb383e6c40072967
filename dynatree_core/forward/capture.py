"""Captured device steps: what a run replays as one CUDA graph each, forwards and the work between.

This is the one capturing mechanism: a model's forwards at fixed shapes are steps too
(graphs.PaddedForward: `kind` "forward"). Between forwards an iteration launches its own
kernels: a draft level's top-k, sorts and admission, the verify rows' sorts and ancestor closure.
On a GPU each op is a kernel launch of a few microseconds, host and device; a fixed_tree iteration
issued about 430 of them outside its forwards (`measure/launches.py`), where `ar` issues a few.
SGLang captures its EAGLE draft loop, top-k included, as one graph (docs/gpu.md).

`StepGraphs(key, fn, *inputs)` runs `fn`, a pure function of device tensors returning a tuple of
tensors, as one graph per `key`:
- the key names everything `fn` reads besides its tensor inputs (level, widths, thresholds, the
  policy's parameters): a graph replays the Python values it was captured with, so a value left out
  of the key would be replayed stale. The first call captures with the `fn` given then; later calls
  with the same key replay that capture and never call their own `fn`;
- inputs are copied into the step's own buffers before a replay, except another step's outputs
  (or views of them) and `constant`s: their buffers never move, so the graph reads them where they
  are (chained steps: a level's decision reads the last level's outputs; one graph per key and
  per set of such buffers read). The outputs are the step's buffers, valid until the same step
  replays again (the next iteration's level): consume them before that;
- capture happens where captured forwards do (CUDA, the run's graphs switch); everywhere else `fn`
  runs as it is, except on STAND_IN_DEVICES (the tests and measure/launches.py add "cpu"), where a
  stand-in graph replays the captured `fn` eagerly over the same buffers: what the engine sees of a
  graph (its buffers, its captured Python values) on a machine without one;
- each step's graph has a memory pool of its own: its outputs live on while other graphs replay,
  and a graph captured into a shared pool may place them where an earlier graph keeps its
  temporaries; the forwards' steps share one pool per device (`POOLS`: their outputs are copied
  out before the next replay);
- a capture that fails warns once and the run goes on eagerly; capture seconds are counted apart
  (`capture_s`) and kept out of the phase timings. Replays are counted by kind (`REPLAYS`).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
import weakref
from collections import Counter
from collections.abc import Callable

import torch

from dynatree_core.core.log import log_exception
from dynatree_core.core.settings import env_on

STAND_IN_DEVICES: tuple[str, ...] = ()  # where steps replay stand-in graphs (module docstring)
# "step": replays of captured steps, process-wide; "level", "verify": those that are a draft level's
# or the verify forward with its inputs (KVState.level)
REPLAYS: Counter = Counter()
_WARNED: set[str] = set()  # one warning per kind of capture failure per process (forwards' and steps')


class _Pools:
    """One graph memory pool per device, shared by every run's graphs, with a count of the live
    graphs that use it: when the last one is released, the handle is dropped, so a later capture
    gets a fresh pool instead of one torch has torn down (`use_count > 0` assertion)."""

    def __init__(self):
        self.handles: dict[str, object] = {}
        self.live: dict[str, int] = {}

    def acquire(self, device: torch.device, graph) -> object:
        key = str(device)
        if key not in self.handles:
            self.handles[key] = torch.cuda.graph_pool_handle()
            self.live[key] = 0
        self.live[key] += 1
        weakref.finalize(graph, self._release, key)
        return self.handles[key]

    def _release(self, key: str) -> None:
        self.live[key] -= 1
        if self.live[key] <= 0:
            self.handles.pop(key, None)
            self.live.pop(key, None)


POOLS = _Pools()


def capture_failed(exc: Exception, what: str) -> str:
    """Why a capture failed, in one line; warned once per process for each reason."""
    reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:160]
    if reason not in _WARNED:
        _WARNED.add(reason)
        log_exception(what, exc)  # the traceback, in the server log, where a maintainer looks
        warnings.warn(f"{what} ({reason}); continuing without graphs", stacklevel=5)
    return reason


def capture_graph(device: torch.device, run: Callable[[], object], pool: Callable | None = None) -> tuple:
    """`run` captured as a CUDA graph on `device`: warmed up twice on a side stream (library
    handles and workspaces are made outside the capture), then captured (torch.cuda.graphs docs)
    into `pool(graph)`'s memory pool, or one of its own. Returns (graph, what the captured call returned)."""
    with torch.cuda.device(device):
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                run()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool(graph) if pool is not None else None):
            out = run()
    return graph, out


def replayed(
    fn: Callable[[torch.Tensor], torch.Tensor], device: torch.device
) -> Callable[[torch.Tensor], torch.Tensor]:
    """fn(x) the way a captured forward runs it: on CUDA captured as a graph and replayed (a library
    may pick other kernels under stream capture than eagerly), its output copied out; elsewhere fn
    itself. invariant.py's probes take it where the run's forwards are captured."""
    if device.type != "cuda":
        return fn

    def call(x: torch.Tensor) -> torch.Tensor:
        static = x.clone()
        graph, out = capture_graph(device, lambda: fn(static))
        graph.replay()
        return out.clone()

    return call


@dataclasses.dataclass
class _Step:
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]
    graph: object


class _StandInGraph:
    """A graph's replay, eagerly: the captured `fn` over the step's input buffers, into its outputs."""

    def __init__(self, fn, inputs: tuple[torch.Tensor, ...], outputs: tuple[torch.Tensor, ...]):
        self.fn, self.inputs, self.outputs = fn, inputs, outputs

    def replay(self) -> None:
        for out, new in zip(self.outputs, self.fn(*self.inputs), strict=True):
            out.copy_(new)


def _where(t: torch.Tensor) -> tuple:
    """A tensor's memory as a graph reads it: address, shape, strides, dtype."""
    return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype


def _memory(t: torch.Tensor) -> int:
    """The allocation a tensor lies in: a view of a step's output (a level's first rows) is read
    in place as the output is, its own place (`_where`) in the key."""
    return t.untyped_storage().data_ptr()


def capture_wanted(device: torch.device, fixed_shapes: bool, captured: bool, steps: bool | None = None) -> bool:
    """Capture a run's steps: where its forwards run at fixed shapes and are captured (CUDA), or
    on a stand-in device; `steps=False` (auto: DYNATREE_STEP_GRAPHS=0) turns it off (to measure
    what it buys)."""
    if not (steps if steps is not None else env_on("DYNATREE_STEP_GRAPHS")):
        return False
    return fixed_shapes and (captured or device.type in STAND_IN_DEVICES)


class StepGraphs:
    """One run's captured steps on one device (module docstring)."""

    def __init__(self, device: torch.device, *, capture: bool, kind: str = "step", what: str = ""):
        self.device, self.capture = device, capture
        # "step"; "forward": a model's forwards at fixed shapes (graphs.PaddedForward), whose graphs draw
        # on the device's shared pool (POOLS: their outputs are copied out before the next replay)
        self.kind, self.what = kind, what or "capturing a device step failed"
        self.last: _Step | None = None  # the step called last (graphs.PaddedForward times its replays)
        self.steps: dict[tuple, _Step] = {}
        self.constants: dict[tuple, torch.Tensor] = {}
        self.fixed: set[int] = set()  # the memory of the steps' outputs and the constants (`_memory`)
        self.captures = 0
        self.capture_s = 0.0
        self.fallback: str | None = None  # why capture was given up

    def __call__(self, key: tuple, fn: Callable[..., tuple[torch.Tensor, ...]], *inputs: torch.Tensor):
        if not self.capture:
            return fn(*inputs)
        # inputs that are another step's outputs (or constants) are read where they are, not copied:
        # their buffers are fixed, so the graph is keyed by which buffers it reads
        chained = tuple(_where(t) if _memory(t) in self.fixed else None for t in inputs)
        key = (key, chained)
        step = self.steps.get(key)
        if step is None:
            t0 = time.perf_counter()
            try:
                step = self.steps[key] = self._capture(fn, inputs, chained)
                self.captures += 1
                self.fixed.update(_memory(t) for t in step.outputs)
            except Exception as exc:  # any capture failure: warn once, continue eagerly
                self._give_up(exc)
                return fn(*inputs)
            finally:
                self.capture_s += time.perf_counter() - t0
        for buf, t, chain in zip(step.inputs, inputs, chained, strict=True):
            if chain is None:
                buf.copy_(t)
        step.graph.replay()
        self.last = step
        REPLAYS[self.kind] += 1
        if key[0][:1] in (("level",), ("verify",)):  # a forward with its inputs (KVState.level)
            REPLAYS[key[0][0]] += 1
        return step.outputs

    def constant(self, key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A device tensor made once per run (never written): passed as a step's input each
        iteration, it is copied nowhere (the step captured over it)."""
        if key not in self.constants:
            self.constants[key] = make()
            self.fixed.add(_memory(self.constants[key]))
        return self.constants[key]

    def share_fixed(self, other: StepGraphs) -> None:
        """Read `other`'s outputs in place too, and it ours (one run's target and draft on one
        device: the verify forward's step reads the rows the draft's step built)."""
        if other.device == self.device:
            self.fixed |= other.fixed
            other.fixed = self.fixed

    def buffer(self, key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A device tensor made once per run at a fixed address, which the host writes between
        steps (the committed length a draft level's step reads): read in place, never copied."""
        return self.constant(key, make)

    def forget(self, stale: Callable[[tuple], bool]) -> None:
        """Release the steps whose key `stale` names (graphs over buffers that moved or a span
        no longer used): their memory, and their outputs' place among the fixed buffers."""
        for key in [key for key in self.steps if stale(key[0])]:
            step = self.steps.pop(key)
            self.fixed.difference_update(_memory(t) for t in step.outputs)

    def _capture(self, fn, inputs: tuple[torch.Tensor, ...], chained: tuple) -> _Step:
        """Warm up on a side stream, then capture (torch.cuda.graphs docs); the step's input
        buffers are the inputs themselves where they are fixed (`chained`), else copies."""
        static = tuple(t if chain is not None else t.clone() for t, chain in zip(inputs, chained, strict=True))
        if self.device.type != "cuda":  # a stand-in device
            outputs = tuple(t.clone() for t in fn(*static))
            return _Step(static, outputs, _StandInGraph(fn, static, outputs))
        # a step's pool is its own (not the forwards' shared one): its outputs outlive other replays
        # (a level's are read after the next level's forward), and a capture into a shared pool
        # may place them in memory an earlier graph uses for its temporaries
        pool = (lambda graph: POOLS.acquire(self.device, graph)) if self.kind == "forward" else None
        graph, outputs = capture_graph(self.device, lambda: tuple(fn(*static)), pool)
        return _Step(static, outputs, graph)

    def _give_up(self, exc: Exception) -> None:
        self.capture, self.fallback = False, capture_failed(exc, self.what)
        self.steps.clear()
        self.fixed.clear()
