"""`python -m dynatree_core gpu-check`: does the captured-forward path hold on this GPU?

Run it first on a new GPU machine. For the embedded pair and a tiny random model of each
architecture the lean forward supports (llama, qwen2, mistral), in float32, it checks:

    policies      every tree policy with graphs == without graphs == plain greedy (`ar`)
    wide tree     a tree wider than the largest bucket (fixed_tree depth 16, branch 8, budget 256)
    buffer grows  a run whose cache outgrows its first buffers (graphs dropped, recaptured)
    interleaved   two runs stepped alternately in one process (their graphs share a pool)
    fallback      an injected capture failure: the run goes on eagerly, exact, and says why

and, in float32 and in bfloat16, the width-invariant forwards (forward/invariant.py):

    invariant D   this device's kernels pass `width_verdict`, and a path node verified inside a
                  17-row tree gets, bit for bit, the logits `ar` computes for it alone
    policies D    every tree policy, width-invariant, reproduces `ar` token for token in dtype D

then measures on the embedded target: replay vs eager milliseconds per width bucket, the width each
narrow bucket runs at (measured at capture: forward/graphs.py), capture seconds, GPU memory per run
and host round trips and launches per iteration (core/transfer.py's counts, measure/launches.py),
with the draft levels and verify batch built on the device or the host and with the steps between
forwards captured or not; and last, the embedded pair in bfloat16 on the multi-turn OOD prompt
(divergence.DIVERGENCE_PROMPT), 128 tokens, with the policies of wide levels (fixed_tree, eagle2, dyspec_threshold):

    bits P        every committed position's logits equal `ar`'s bit for bit; else the first
                  position that differs, its difference against ar's top-two gap, and the first
                  differing cache entry, which names the op (measure/divergence.py)

A stage that raises is one failed row naming the error, and the JSON is rewritten after each stage
(a run stopped at its time limit keeps what it did). It prints a verdict table. Without CUDA it
says so in one line and exits 0; `--device cpu` runs the same checks on the padded forward run
eagerly (what the test suite does, tiny models).
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch

from dynatree_core.core.log import log_exception
from dynatree_core.core.settings import ForwardSettings
from dynatree_core.core.transfer import sync
from dynatree_core.core.tree import DraftTree
from dynatree_core.decoding.engine import DecodeConfig, decode, generate
from dynatree_core.decoding.methods import make_method
from dynatree_core.drafting.policy import POLICIES
from dynatree_core.errors import DynaTreeError
from dynatree_core.forward import capture, graphs
from dynatree_core.forward.kv import KVState
from dynatree_core.forward.rows import Rows, lineage
from dynatree_core.measure import divergence, launches

ARCHS = ("llama", "qwen2", "mistral")
PROMPTS = ([1, 5, 7, 9, 11, 13, 2, 8], [42, 17, 8, 8, 60, 2, 90, 33, 12, 4, 77, 5])
WIDE = {"depth": 16, "branch": 8, "tau": 0.0, "budget": 256}


def tiny_pair(arch: str, device: torch.device) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A random tiny target of `arch` (sharpened logits) and a noisy copy as its draft."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        arch,
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=0,
        **({"sliding_window": None} if arch == "mistral" else {}),
    )
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        target.model.norm.weight.mul_(6.0)
    draft = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.01)
    return target.to(device), draft.to(device)


GRAPHS = ForwardSettings(graphs=True)  # captured forwards (on a CPU: the same shapes, eagerly)


def _run(target, draft, prompt, policy: str, params: dict, *, max_new: int = 32, **forward):
    """A greedy run of `policy`; `forward`: its ForwardSettings' fields."""
    config = DecodeConfig(max_new_tokens=max_new, forward=ForwardSettings(**forward))
    return generate(target, prompt, make_method(policy, params), draft=draft, config=config)


def _ar(target, prompt, max_new: int = 32) -> list[int]:
    return _run(target, None, prompt, "ar", {}, graphs=False, max_new=max_new).token_ids


def pair_checks(name: str, target, draft, token_map=None) -> list[dict]:
    """The five checks on one pair; each a row {pair, check, ok, detail}."""
    rows = []

    def row(check: str, ok: bool, detail: str = "") -> None:
        rows.append({"pair": name, "check": check, "ok": bool(ok), "detail": detail})

    wants = {tuple(p): _ar(target, p) for p in PROMPTS}
    bad = []
    for policy in [n for n in POLICIES if POLICIES[n].needs_draft_model]:
        for p in PROMPTS:
            on = _run(target, draft, p, policy, {}, graphs=True)
            off = _run(target, draft, p, policy, {}, graphs=False)
            if not (on.token_ids == off.token_ids == wants[tuple(p)]):
                bad.append(policy)
    row("policies", not bad, f"diverged: {', '.join(sorted(set(bad)))}" if bad else f"{len(POLICIES) - 2} policies")
    wide = _run(target, draft, PROMPTS[0], "fixed_tree", WIDE, graphs=True)
    row("wide tree", wide.token_ids == wants[tuple(PROMPTS[0])], f"up to {WIDE['budget']} nodes a forward")
    long = _run(target, draft, PROMPTS[1], "fixed_tree", WIDE, graphs=True, max_new=200)
    row("buffer grows", long.token_ids == _ar(target, PROMPTS[1], 200), f"{long.iterations} iterations")
    runs = [
        decode(target, p, make_method("fixed_tree", {}), draft=draft, config=DecodeConfig(32, forward=GRAPHS))
        for p in PROMPTS
    ]
    outs: list[list[int]] = [[], []]
    for _ in range(64):  # step them alternately until both end
        for i, run in enumerate(runs):
            rec = next(run, None)
            if rec is not None:
                outs[i] += rec.committed
    row("interleaved", all(o == wants[tuple(p)] for o, p in zip(outs, PROMPTS, strict=True)), "two runs")
    injected = RuntimeError("injected capture failure")  # every capture: the forwards' and the steps'
    fail = mock.patch.object(capture.StepGraphs, "_capture", side_effect=injected)
    with fail, mock.patch.object(graphs, "capture_wanted", return_value=True), _quiet():
        fell = _run(target, draft, PROMPTS[0], "fixed_tree", {}, graphs=True)
    ok = fell.token_ids == wants[tuple(PROMPTS[0])] and "capture failed" in fell.forward_path
    row("fallback", ok, fell.forward_path)
    return rows


INVARIANCE_DTYPES = (torch.float32, torch.bfloat16)


def _tree(root: int) -> tuple[DraftTree, list[int]]:
    """17 nodes; the checked path root -> a -> c -> e sits at scattered rows among siblings."""
    tree = DraftTree.with_root(root)
    a, b = tree.add(0, 26, -0.1), tree.add(0, 53, -0.3)
    c = tree.add(a, 58, -0.2)
    e = tree.add(c, 40, -0.1)
    for i in range(12):
        tree.add((a, b, c, e)[i % 4], 60 + i, -1.0)
    return tree, [0, a, c, e]


@torch.inference_mode()
def path_bits_match(target, prompt: list[int], graphs: bool | None = None) -> bool:
    """A path node's logits in one tree verification == `ar`'s for it decoded one token at a time,
    bit for bit, with width-invariant forwards (the promise of forward/invariant.py); `graphs`: at
    fixed shapes (static_rows.StaticRows) where the device's default or True says so."""
    tree, path = _tree(prompt[-1])
    head = prompt[:-1]
    alone, kv = [], KVState(target, head, invariant=True, graphs=graphs)
    kv.run(Rows.chain(head, 0))
    kv.pending = []
    for depth, node in enumerate(path):
        alone.append(kv.run(Rows.chain([tree.tokens[node]], len(head) + depth)).logits[0])
    kv = KVState(target, head, invariant=True, graphs=graphs)
    kv.run(Rows.chain(head, 0))
    kv.pending = []
    order = tree.order("bfs")
    lines = lineage(tree.parent_rows(order))
    nodes, positions = [tree.tokens[n] for n in order[1:]], tree.position_ids(order[1:], len(head))
    batch = Rows.tree(kv.length, [tree.tokens[0]], len(head), nodes, positions, lines, keep=len(order))
    logits = kv.run(batch).logits
    return all(torch.equal(logits[order.index(n)], alone[d]) for d, n in enumerate(path))


def invariance_checks(name: str, target, draft) -> list[dict]:
    """Per dtype in INVARIANCE_DTYPES: the kernels' verdict with the path's bits, and every tree
    policy's tokens against `ar`'s, width-invariant. Copies the models into each dtype."""
    from dynatree_core.forward.fastpath import lean_forward_for
    from dynatree_core.forward.invariant import linears_note, width_verdict
    from dynatree_core.forward.static_rows import static_attention_agrees

    rows = []
    for dtype in INVARIANCE_DTYPES:
        label = str(dtype).removeprefix("torch.")
        t, d = (copy.deepcopy(m).to(dtype) for m in (target, draft))
        lean = lean_forward_for(t)
        device = t.get_input_embeddings().weight.device
        found = width_verdict(lean, dtype, device) if lean is not None else None
        verdict = found.reason if found is not None else "no lean forward for this model"
        bits = lean is not None and path_bits_match(t, PROMPTS[0])
        pads = [note] if found and (note := linears_note(found.linear_rows)) else []
        pads += [f"attention in calls of {found.attention_rows} rows"] if found and found.attention_rows > 1 else []
        padded = f" ({'; '.join(pads)})" if pads else ""
        detail = verdict or ("bitwise" + padded if bits else "a path node's logits differ from ar's")
        replayed = None
        if lean is not None:  # the fixed-shape (capturable) form: StaticRows
            fixed = static_attention_agrees(lean, dtype, device)
            detail += "; fixed shapes: " + ("captured where graphs are" if fixed else "not invariant, grouped eagerly")
        if lean is not None and device.type == "cuda":  # probed again as a captured run calls them
            replayed = width_verdict(lean, dtype, device, attention=False, captured=True)
            rows_note = f", {note}" if (note := linears_note(replayed.linear_rows)) else ""
            attention = static_attention_agrees(lean, dtype, device, captured=True)
            detail += f"; replayed from graphs: {replayed.reason or 'bitwise'}{rows_note}"
            detail += "" if attention else ", fixed-shape attention not invariant"
        ok = verdict is None and bits and (replayed is None or replayed.reason is None)
        rows.append({"pair": name, "check": f"invariant {label}", "ok": ok, "detail": detail})
        config = DecodeConfig(max_new_tokens=32, forward=ForwardSettings(width_invariant=True))
        bad = []
        for p in PROMPTS:
            want = generate(t, p, make_method("ar"), config=config).token_ids
            bad += [
                n
                for n in POLICIES
                if POLICIES[n].needs_draft_model
                and generate(t, p, make_method(n), draft=d, config=config).token_ids != want
            ]
        detail = f"left ar's tokens: {', '.join(sorted(set(bad)))}" if bad else "token-identical to ar"
        rows.append({"pair": name, "check": f"policies {label}", "ok": not bad, "detail": detail})
    return rows


@contextlib.contextmanager
def _quiet():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _timed(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / repeats * 1e3


@torch.inference_mode()
def bucket_ms(model, device: torch.device, *, context: int = 256, repeats: int = 20) -> list[dict]:
    """Per width bucket: one forward of that many rows after `context` tokens, captured vs eager."""
    out = []
    prompt = [1 + i % 100 for i in range(context)]
    for width in graphs.buckets(graphs.MAX_BUCKET):
        times = {}
        for mode in (True, False):
            kv = KVState(model, prompt, capacity=context + graphs.MAX_BUCKET, graphs=mode)
            kv.run(Rows.chain(prompt, 0))
            kv.pending = []

            def step(kv=kv, rows=Rows.chain([5] * width, context)):
                kv.run(rows)
                kv.keep(list(range(context)))

            step()  # the capture (graphs) or the warm-up (eager)
            times[mode] = _timed(step, device, repeats)
        out.append({"width": width, "replay_ms": round(times[True], 3), "eager_ms": round(times[False], 3)})
    return out


@torch.inference_mode()
def measured_widths(model, *, context: int = 256) -> dict:
    """The width each bucket below graphs.MEASURE_UP_TO runs at, as a captured run measures it at
    its first forward of that bucket, with the replay ms of each candidate ({} without capture).
    Earlier runs of the model already chose (the choice is kept per model and dtype): it is
    measured again here, so the report holds the timings behind it."""
    prompt = [1 + i % 100 for i in range(context)]
    kv = KVState(model, prompt, capacity=context + graphs.MAX_BUCKET, graphs=True)
    kv.run(Rows.chain(prompt, 0))
    kv.pending = []
    if kv.padded is None or not kv.padded.capture:
        return {}
    kv.padded.chosen.clear()
    for q in (b for b in graphs.buckets(graphs.MAX_BUCKET) if b < graphs.MEASURE_UP_TO):
        kv.run(Rows.chain([5] * q, context))
        kv.keep(list(range(context)))
    timings = kv.padded.timings
    return {
        b: {"runs_at": kv.padded.chosen[b], "replay_ms": {w: round(ms, 3) for w, ms in timings[b].items()}}
        for b in timings
    }


def run_measures(target, draft, device: torch.device) -> dict:
    """fixed_tree's round trips, launches and speed per iteration, by where its levels and verify
    batch are built (measure/launches.run_measures)."""

    def run(levels: bool, verify: bool, steps: bool):
        on = dict(graphs=True, step_graphs=steps, device_draft=levels, device_verify=verify)
        return _run(target, draft, PROMPTS[0], "fixed_tree", {}, max_new=64, **on)

    return launches.run_measures(run, device)


def gpu_check(device: str = "auto", *, embedded: bool = True, out: Path | None = None, log=print) -> dict | None:
    """Run every check (module docstring); returns the report, or None without CUDA."""
    if device == "auto":
        if not torch.cuda.is_available():
            log("gpu-check: no CUDA device here; nothing to check (run it on the GPU machine).")
            return None
        device = "cuda"
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise DynaTreeError(f"gpu-check: {device!r} is not a device (auto, cuda, cuda:N or cpu)") from exc
    report = {"device": str(dev), "name": _device_name(dev), "checks": [], "measures": {}}
    rows, measures = report["checks"], report["measures"]

    def stage(pair: str, what: str, fn: Callable[[], list[dict]]) -> None:
        """fn's rows; where it raises, one failed row naming the error (the traceback in the log),
        so a broken check costs its own rows, not the report; the report is written after each
        stage, so a run stopped at its time limit keeps what it measured."""
        try:
            rows.extend(fn())
        except Exception as exc:  # a check that raises is a failed check, reported as one
            log_exception(f"gpu-check: {pair} {what}", exc)
            reason = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
            rows.append({"pair": pair, "check": what, "ok": False, "detail": f"raised {type(exc).__name__}: {reason}"})
        _write(report, out)

    for arch in ARCHS:
        target, draft = tiny_pair(arch, dev)
        stage(f"tiny {arch}", "checks", lambda t=target, d=draft, a=arch: pair_checks(f"tiny {a}", t, d))
        stage(f"tiny {arch}", "invariance", lambda t=target, d=draft, a=arch: invariance_checks(f"tiny {a}", t, d))
        log(f"gpu-check: tiny {arch} done")
    if embedded:
        from dynatree_core.decoding.pairs import load_pair

        pair = load_pair("embedded", device=device, dtype="float32")
        target, draft = pair.target.model, pair.draft.model
        stage("embedded", "checks", lambda: pair_checks("embedded", target, draft))
        stage("embedded", "invariance", lambda: invariance_checks("embedded", target, draft))
        # the measures before the bits trace: they are the round's goals; the trace, a diagnosis
        for name, fn in (
            ("buckets", lambda: bucket_ms(target, dev)),
            ("widths", lambda: measured_widths(target)),
            ("run", lambda: run_measures(target, draft, dev)),
        ):
            stage("embedded", f"measure {name}", lambda name=name, fn=fn: measures.update({name: fn()}) or [])
        stage("embedded", "bits", lambda: divergence.divergence_checks("embedded", pair))
        log("gpu-check: embedded pair done")
    log(verdict_table(report))
    if out is not None:
        log(f"gpu-check: report written to {out}")
    return report


def _write(report: dict, out: Path | None) -> None:
    """The report as it stands, with its verdict, to `out` (JSON) where one is given."""
    report["verdict"] = "pass" if all(r["ok"] for r in report["checks"]) else "FAIL"
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (padded forward, not captured)"


def verdict_table(report: dict) -> str:
    lines = [
        f"gpu-check on {report['name']}: {report['verdict']}",
        "",
        "| pair | check | ok | detail |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {r['pair']} | {r['check']} | {'yes' if r['ok'] else 'NO'} | {r['detail']} |" for r in report["checks"]
    ]
    measures = report.get("measures") or {}
    if measures.get("buckets"):
        lines += ["", "| width | replay ms | eager ms |", "|---|---|---|"]
        lines += [f"| {b['width']} | {b['replay_ms']} | {b['eager_ms']} |" for b in measures["buckets"]]
    if measures.get("widths"):
        lines += ["", "| bucket | runs at | replay ms by width |", "|---|---|---|"]
        lines += [
            f"| {b} | {w['runs_at']} | {', '.join(f'{k}: {v}' for k, v in w['replay_ms'].items())} |"
            for b, w in measures["widths"].items()
        ]
    if measures.get("run"):
        lines += ["", *launches.run_lines(measures["run"])]
    return "\n".join(lines)
