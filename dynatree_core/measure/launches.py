"""The device work an iteration launches outside its captured forwards, counted on any device.

On a GPU a small model is launch-bound: a captured forward is one graph replay, but every tensor op
between forwards (a level's top-k and sorts, the mask, the cache's compaction) is a kernel launch
of a few microseconds on the host and on the device (docs/gpu.md: width is nearly free,
kernel count is not). Counting them needs no GPU: every op torch dispatches is seen here
(a TorchDispatchMode), and a run at fixed shapes on a CPU makes the same calls a GPU run makes.

Counted per iteration:
- `ops`: ops that launch work (views and bare allocations excluded), outside forward graphs and
  captured steps; on a GPU only those on the model's device (`host_ops`: those on host tensors,
  the host's own bookkeeping, apart); on a CPU host and device are one, so `ops` holds both;
- `replays`: forward graphs and captured steps (forward/capture.py), each one launch;
- `sites`: the library function each op came from, the busiest first.
Captures run as stand-in graphs on a CPU (capture.STAND_IN_DEVICES), so a CPU count says what a
GPU would launch; on CUDA the real graphs run and replay() dispatches nothing.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from collections.abc import Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dynatree_core.core import transfer
from dynatree_core.forward import capture

# ops that allocate, alias or read a scalar: no kernel of their own (a read is counted by transfer.py)
NO_LAUNCH = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias"})
NO_LAUNCH |= {"lift_fresh", "_local_scalar_dense", "is_nonzero", "_has_compatible_shallow_copy_type", "detach_"}
NO_LAUNCH |= {"_unsafe_view"}  # a view that a copying reshape returns: the copy (clone) is the launch


def launches_work(func, args, out) -> bool:
    """Whether a dispatched op launched a kernel: not an allocation, alias or scalar read
    (NO_LAUNCH), and not a view, unless an op that only may alias (`to`, `reshape`: schemas that
    return their input where they can) made new memory (a conversion, a copy of strided rows)."""
    if func.overloadpacket.__name__ in NO_LAUNCH:
        return False
    if not func.is_view:
        return True
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    outs = out if isinstance(out, list | tuple) else (out,)
    home = first.untyped_storage().data_ptr() if first is not None else None
    return any(isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() != home for o in outs)


class OpNames(TorchDispatchMode):
    """Ops that launch work (launches_work's rule), counted by name: a forward's kernels by kind
    (benchmarks/forward_kernels.py, tests/test_kernels.py)."""

    def __init__(self):
        super().__init__()
        self.names: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if launches_work(func, args, out):
            self.names[func.overloadpacket.__name__] += 1
        return out


class _Counter(TorchDispatchMode):
    def __init__(self, device_type: str):
        super().__init__()
        self.device_type = device_type
        self.counts: Counter = Counter()
        self.sites: Counter = Counter()
        self.inside = 0  # > 0 inside a replay (a graph's ops are one launch, counted by the replay)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.inside or not launches_work(func, args, out):
            return out
        on_device = self.device_type == "cpu" or any(_on(t, self.device_type) for t in (*args, out))
        self.counts["ops" if on_device else "host_ops"] += 1
        if on_device:
            self.sites[_site()] += 1
        return out

    @contextlib.contextmanager
    def replay(self, counted: bool = True) -> Iterator[None]:
        """A replay (one launch), or with `counted` False a capture (set-up: nothing counted)."""
        self.counts["replays"] += counted
        self.inside += 1
        try:
            yield
        finally:
            self.inside -= 1


def _on(t, device_type: str) -> bool:
    if isinstance(t, torch.Tensor):
        return t.device.type == device_type
    return isinstance(t, list | tuple) and any(_on(x, device_type) for x in t)


def _site() -> str:
    """The innermost dynatree_core function on the stack (this module excluded)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        if "/dynatree_core/" in name and not name.endswith("measure/launches.py"):
            return f"{name.split('/dynatree_core/')[-1]}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "torch"


@contextlib.contextmanager
def counting_launches(device: torch.device) -> Iterator[_Counter]:
    """Count the launches of the block (module docstring); on a CPU, captures run as stand-ins."""
    counter = _Counter(device.type)
    # a stand-in graph's replay (a captured step, a forward at fixed shapes: graphs.PaddedForward
    # captures its forwards as steps, stand-ins here); a capture (set-up: not counted)
    patched = {(capture._StandInGraph, "replay"): True, (capture.StepGraphs, "_capture"): False}
    saved = {(owner, name): getattr(owner, name) for owner, name in patched}

    def wrapped(fn, counted: bool):
        def wrapper(*args, **kwargs):
            with counter.replay(counted):
                return fn(*args, **kwargs)

        return wrapper

    devices = capture.STAND_IN_DEVICES
    for (owner, name), counted in patched.items():
        setattr(owner, name, wrapped(saved[owner, name], counted))
    if device.type != "cuda":
        capture.STAND_IN_DEVICES = (*devices, device.type)
    try:
        with counter:
            yield counter
    finally:
        for (owner, name), fn in saved.items():
            setattr(owner, name, fn)
        capture.STAND_IN_DEVICES = devices


# ops after which the host waits for the device: a scalar read (`int(t)`, `bool(t)`, `.item()`), or
# an output whose shape depends on the values (a boolean mask's rows, `nonzero`, `unique`)
WAITS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2",
                   "unique_consecutive", "unique_dim"})  # fmt: skip


def waits_for_values(func, args, kwargs) -> str | None:
    """The kind of wait a dispatched op makes the host do (None: none). Boolean indexing and
    `repeat_interleave` without `output_size` size their output by the values; a copy to the host
    from a device waits for it (seen on a GPU only: on a CPU every tensor is on the host)."""
    name = func.overloadpacket.__name__
    if name in WAITS:
        return name
    if name in ("index", "index_put", "index_put_"):
        masks = args[1] if len(args) > 1 else ()
        if any(isinstance(m, torch.Tensor) and m.dtype in (torch.bool, torch.uint8) for m in masks):
            return f"{name.rstrip('_')} by a mask"
    if name == "repeat_interleave" and isinstance(args[0], torch.Tensor) and "output_size" not in (kwargs or {}):
        return name
    if name == "_to_copy" and args[0].device.type != "cpu" and str((kwargs or {}).get("device", "")) == "cpu":
        return "copy to the host"
    return None


class _Waits(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.kinds: Counter = Counter()
        self.sites: Counter = Counter()

    @property
    def total(self) -> int:
        return sum(self.kinds.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = waits_for_values(func, args, kwargs)
        if kind is not None:
            self.kinds[kind] += 1
            self.sites[_site()] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting_waits() -> Iterator[_Waits]:
    """Count the block's ops that make the host wait for the device's values (`waits_for_values`):
    on a GPU each drains the queue of launched kernels. Counted on any device, so a CPU test holds
    a GPU's loop to them: `with counting_waits() as w: ...; w.total, w.kinds, w.sites`."""
    counter = _Waits()
    with counter:
        yield counter


def per_iteration(run: Callable[[], object], device: torch.device, top: int = 8) -> dict:
    """Run `run` (returns a RunResult) with launches counted: per-iteration means and busiest sites."""
    before = capture.REPLAYS["step"] + capture.REPLAYS["forward"]
    with counting_launches(device) as counter:
        result = run()
    iterations = max(result.iterations, 1)
    if device.type == "cuda":  # real graphs: a replay dispatches nothing, the counter says so
        counter.counts["replays"] += capture.REPLAYS["step"] + capture.REPLAYS["forward"] - before
    out = {k: round(counter.counts[k] / iterations, 1) for k in ("ops", "host_ops", "replays")}
    out["sites"] = {site: round(n / iterations, 1) for site, n in counter.sites.most_common(top)}
    return out


# fixed_tree's variants in gpu-check's run measure: where its levels and verify batch are built
VARIANTS = {
    "host_batch": ("the verify batch built on the host", True, False),
    "host_levels": ("draft levels decided on the host", False, False),
    "eager_steps": ("the steps between forwards not captured", True, True),
}


def run_measures(run: Callable[[bool, bool, bool], object], device: torch.device) -> dict:
    """Capture seconds, memory per run, host round trips and speed per iteration of `run(levels,
    verify, steps)` with the draft levels and the verify batch on the device (the CUDA default), and the
    same for each of VARIANTS; launches per iteration counted in a run of their own (the counter
    slows a run down: its speed is not reported)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    with transfer.counting() as moved:
        result = run(True, True, True)
    memory = (torch.cuda.max_memory_allocated(device) - base) / 2**20 if device.type == "cuda" else None
    out = {
        "forward_path": result.forward_path,
        "capture_s": round(result.capture_s, 3),
        "run_memory_mb": None if memory is None else round(memory, 1),
        **_measured(result, moved, lambda: run(True, True, True), device),
    }
    for key, (_, levels, verify) in VARIANTS.items():
        steps = key != "eager_steps"
        with transfer.counting() as moved:
            result = run(levels, verify, steps)
        out[key] = _measured(result, moved, lambda lv=levels, v=verify, s=steps: run(lv, v, s), device)
    return out


def _measured(result, moved, again: Callable[[], object], device: torch.device) -> dict:
    iterations = max(result.iterations, 1)
    return {
        "per_iteration": {k: round(v / iterations, 2) for k, v in moved.items()},
        "tokens_per_s": round(result.throughput_tps, 1),
        "launches": per_iteration(again, device, top=5),
    }


def run_lines(run: dict) -> list[str]:
    """run_measures' report as lines of gpu-check's verdict."""

    def launched(m: dict) -> str:
        return f"{m['launches']['ops']} ops + {m['launches']['replays']} replays launched"

    lines = [
        f"forward path: {run['forward_path']}; capture {run['capture_s']} s; memory per run {run['run_memory_mb']} MB; "
        f"per iteration {run['per_iteration']}, {launched(run)}; {run['tokens_per_s']} tokens/s"
    ]
    for key, (what, _, _) in VARIANTS.items():
        if key in run:
            m = run[key]
            lines.append(
                f"{what} instead: per iteration {m['per_iteration']}, {launched(m)}; {m['tokens_per_s']} tokens/s"
            )
    return lines
