"""BENCHMARKS.md, generated: one section per topic, its current numbers read from the committed reports.

    PYTHONPATH=. .venv/bin/python -m benchmarks.benchmarks_doc [--check] [--assets DIR]

Each topic is one entry of TOPICS: its title (code and docs cite the sections by name), its reports
(paths under assets/, each with the command that wrote it where the report records none), how its
table's rows come from them, and its goals. The goals' thresholds are the only numbers written
here: every measured value, and whether a goal is met, is read or computed from the reports, so the
same reports always give the same file, byte for byte. A measure no report holds names the log
section that has it instead. `--check` writes nothing and exits 1, with a short diff, when
BENCHMARKS.md differs from what it would write (tests/test_benchmarks_doc.py makes the same
comparison). How the numbers moved, and the file as it was written by hand, are in
docs/benchmark-log.md. Standard library only: nothing here loads a model.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks import ROOT

ASSETS = ROOT / "assets"
DOC = ROOT / "BENCHMARKS.md"
LOG = "docs/benchmark-log.md"
COMMAND = "PYTHONPATH=. .venv/bin/python -m benchmarks.benchmarks_doc"
REFERENCES = ("ar", "hf_generate", "hf_static")  # decoding without a draft: what speedups divide by
NOT_TREES = (*REFERENCES, "linear", "hf_assisted", "hf_prompt_lookup")  # no draft, a chain, or HF's loops
NO_GPU = "unmeasured (no GPU lent)"
SCRIPT = "PYTHONPATH=. .venv/bin/python -m benchmarks."  # a benchmark script's command, before its name
TRAIN = "python -m dynatree_core.training "

Table = tuple[list[str], list[list[str]]]
Measured = tuple[float, str]  # a value and the row it came from


class Reports:
    """The committed reports under one assets/ directory, each parsed once."""

    def __init__(self, assets: Path):
        self.assets = assets
        self._parsed: dict[str, dict] = {}

    def __call__(self, name: str) -> dict:
        if name not in self._parsed:
            self._parsed[name] = json.loads((self.assets / name).read_text(encoding="utf-8"))
        return self._parsed[name]

    def glob(self, pattern: str) -> list[str]:
        """Paths under assets/ that match, sorted."""
        return sorted(p.relative_to(self.assets).as_posix() for p in self.assets.glob(pattern))


@dataclass(frozen=True)
class Goal:
    """A goal: what it asks, its threshold, and how its value is read from the reports; or, with
    `logged`, a measure no report holds and the start of the log heading whose section has it."""

    what: str
    threshold: float | None
    measure: Callable[[Reports], Measured | None] | None = None
    fmt: str = "{:.2f}x"
    at_most: bool = False
    missing: str | Callable[[Reports], str] = "not in the report"  # a callable: words computed from the reports
    logged: str = ""


@dataclass(frozen=True)
class Topic:
    """One section: its title, what it measured, its reports (path under assets/ -> the command that
    wrote it; None: the report's own settings.command), when, its table and its goals."""

    title: str
    about: str
    reports: dict[str, str | None]
    date: str
    table: Callable[[Reports], Table] | None
    goals: tuple[Goal, ...] = ()


# ---- bench reports: rows, references, trees -------------------------------------------------


def results(report: dict) -> list[dict]:
    """A bench report's rows (`results`), or a compare report's (`entries`)."""
    return report.get("results") or report.get("entries") or []


def over_reference(row: dict, rows: list[dict]) -> float:
    """The row's tokens/s over the fastest reference of its run (`ar`, HF `generate`, `hf_static`)."""
    return row["throughput_tps"] / max(r["throughput_tps"] for r in rows if r["policy"] in REFERENCES)


def trees(rows: list[dict]) -> list[dict]:
    """The tree policies' rows: no reference, no chain, none of HF's own loops."""
    return [r for r in rows if r["policy"] not in NOT_TREES and r.get("family") != "none"]


def ours(rows: list[dict]) -> list[dict]:
    """Our speculative rows: everything but the references and HF's own loops."""
    return [r for r in rows if r["policy"] not in REFERENCES and not r["policy"].startswith("hf_")]


def fastest(rows: list[dict]) -> dict:
    return max(rows, key=lambda r: r["throughput_tps"])


def policy_row(rows: list[dict], policy: str) -> dict | None:
    """The policy at its defaults: the row labelled by the policy's name, else its first row."""
    named = [r for r in rows if r["label"] == policy] or [r for r in rows if r["policy"] == policy]
    return named[0] if named else None


def label_of(row: dict) -> str:
    return row["label"].replace(" (our loop)", "")


def exact(row: dict) -> str:
    return "-" if row.get("exact") is None else f"{row['exact']}/{row['runs']}"


def portable(command: str, name: str) -> str:
    """The recorded command, its `--out` named as the committed report when it was a machine path."""
    words = command.split(" ")
    for i, word in enumerate(words[:-1]):
        if word == "--out" and words[i + 1][:1] in ("/", "~"):
            words[i + 1] = f"assets/{name}"
    return " ".join(words)


COLUMNS: dict[str, Callable[[dict, list[dict]], str]] = {
    "policy": lambda r, rows: f"`{label_of(r)}`",
    "family": lambda r, rows: r.get("family") or "-",
    "tokens/s": lambda r, rows: f"{r['throughput_tps']:.1f}",
    "x fastest reference": lambda r, rows: f"{over_reference(r, rows):.2f}x",
    "tokens / iteration": lambda r, rows: f"{r['tokens_per_iteration']:.2f}",
    "draft / verify ms": lambda r, rows: f"{r['draft_ms_per_iteration']:.1f} / {r['verify_ms_per_iteration']:.1f}",
    "exact": lambda r, rows: exact(r),
}


def bench_table(name: str, columns: tuple[str, ...]) -> Callable[[Reports], Table]:
    """A table of one bench report's rows, in the report's order."""

    def table(reports: Reports) -> Table:
        rows = results(reports(name))
        return list(columns), [[COLUMNS[c](r, rows) for c in columns] for r in rows]

    return table


def best_tree(name: str) -> Callable[[Reports], Measured]:
    """The fastest tree policy of a bench report, over the fastest reference of its run."""

    def measure(reports: Reports) -> Measured:
        rows = results(reports(name))
        return over_reference(fastest(trees(rows)), rows), label_of(fastest(trees(rows)))

    return measure


def tokens_of(name: str, policy: str) -> Callable[[Reports], Measured | None]:
    def measure(reports: Reports) -> Measured | None:
        row = policy_row(results(reports(name)), policy)
        return (row["tokens_per_iteration"], policy) if row else None

    return measure


def exact_share(names: tuple[str, ...], pick: Callable[[list[dict]], list[dict]] = ours) -> Callable:
    """The share of the picked rows' runs that were token for token the target's own output."""

    def measure(reports: Reports) -> Measured:
        picked = [r for n in names for r in pick(results(reports(n)))]
        done, runs = sum(r["exact"] for r in picked), sum(r["runs"] for r in picked)
        return done / runs, f"{done} of {runs} runs, {len(picked)} rows"

    return measure


# ---- Headline: prompts no draft trained on (OOD) --------------------------------------------

HEADLINE = "benchmarks/cpu-ood-headline.json"
README_COMPARE = "benchmarks/cpu-readme-compare.json"
SHIPPED_PASS = "shipped feature draft"  # the headline report's pass of the draft that ships
SPEEDUP = "speedup_vs_faster_of_ar_hf"


def shipped_policies(reports: Reports) -> dict:
    return reports(HEADLINE)["passes"][SHIPPED_PASS]["policies"]


def headline_table(reports: Reports) -> Table:
    report = reports(HEADLINE)
    passes, hf = report["passes"], report["hf_generate_tps"]
    cell = "{0[speedup_vs_faster_of_ar_hf]:.2f}x, {0[tokens_per_iteration]:.2f}".format
    rows = [[f"`{p}`", *(cell(passes[n]["policies"][p]) for n in passes)] for p in shipped_policies(reports)]
    rows.append(["`ar` / HF `generate` tokens/s", *(f"{passes[n]['ar_tps']:.1f} / {hf:.1f}" for n in passes)])
    return ["policy", *passes], rows


def headline_best(reports: Reports) -> Measured:
    policies = shipped_policies(reports)
    name = max((p for p in policies if p not in NOT_TREES), key=lambda p: policies[p][SPEEDUP])
    return policies[name][SPEEDUP], name


def headline_fixed_tree(reports: Reports) -> Measured:
    return shipped_policies(reports)["fixed_tree"]["tokens_per_iteration"], "fixed_tree"


def readme_slowest_tree(reports: Reports) -> Measured:
    """The README example's slowest tree policy over `ar` (its compare report)."""
    rows = results(reports(README_COMPARE))
    slowest = min(trees(rows), key=lambda r: r["throughput_tps"])
    return slowest["throughput_tps"] / policy_row(rows, "ar")["throughput_tps"], label_of(slowest)


def headline_exact(reports: Reports) -> Measured:
    report = reports(HEADLINE)
    done = [p["exact"] for run in report["passes"].values() for p in run["policies"].values()]
    runs = report["prompts"] * len(done)
    return sum(done) / runs, f"{sum(done)} of {runs} runs"


# ---- Defaults fitted on OOD prompts (CPU) ---------------------------------------------------

FITS = ("benchmarks/ood-defaults-long/ood-defaults.json", "benchmarks/ood-defaults-cost-free/ood-defaults.json")
RANKED_FIT = "benchmarks/ood-defaults-cost-free/recycle-ranked.json"


def fit_rows(fit: dict) -> tuple[dict, dict | None]:
    """A fit's row at the defaults and the fitted combination's (None when nothing beat the defaults)."""
    rows = [r for r in fit.get("check") or fit["sweep"] if r["policy"] == fit["policy"]]
    default = next(r for r in rows if r["params"] == fit["defaults"])
    fitted = next((r for r in rows if r["params"] != fit["defaults"]), None) if fit["best"] else None
    return default, fitted


def yield_cell(row: dict | None) -> str:
    return "-" if row is None else f"{row['speedup']:.2f}x ({row['tokens_per_iteration']:.2f})"


def defaults_table(reports: Reports) -> Table:
    rows = []
    for name in FITS:
        for policy, fit in reports(name).items():
            if policy == "recycle":  # fitted again, with its best-first walk (RANKED_FIT): that row stands for it
                continue
            default, fitted = fit_rows(fit)
            change = ", ".join(f"{k} {v}" for k, v in fit["best"].items()) or "unchanged"
            rows.append([f"`{policy}`", change, yield_cell(default), yield_cell(fitted)])
    ranked = results(reports(RANKED_FIT))
    top = fastest(trees(ranked))
    change = top["label"].partition("(")[2].rstrip(")").replace("=", " ")
    rows.append(["`recycle` (refit: best first)", change, yield_cell(policy_row(ranked, "recycle")), yield_cell(top)])
    return ["policy", "fitted", "defaults: x `ar` (tokens / iteration)", "fitted: x `ar`"], rows


# ---- Draft quality: agreement with the target by depth -------------------------------------

SHIPPED_CURVE = "models/smollm2-feature-draft/curve.json"
KD_VS_UNROLLED = "benchmarks/cpu-draft-quality-kd-vs-unrolled.json"
CURVES = {  # equal-compute runs from scratch: row label -> curve
    "feature kind": "benchmarks/kind-compare/cmp-feature-l1.json",
    "fused kind (EAGLE-3 taps)": "benchmarks/kind-compare/cmp-fused-l3.json",
}
PACKED = TRAIN + "train-packed --ce-share 0.25 --lr 5e-4 --budget-s 600 --eval-every-s 600"
SHIPPED_RUN = "make draft-feature-long && make draft-feature-final"


def last_point(reports: Reports, name: str) -> dict:
    return reports(name)["curve"][-1]


def by_depth(values: list[float]) -> str:
    return " / ".join(f"{v:.3f}" for v in values)


def quality_table(reports: Reports) -> Table:
    shipped = last_point(reports, SHIPPED_CURVE)
    rows = [["shipped feature draft", by_depth(shipped["ood"]), by_depth(shipped["heldout"])]]
    split = reports(KD_VS_UNROLLED)
    token = [split[s]["token draft"]["agreement"] for s in ("out-of-distribution", "in-distribution (held out)")]
    rows.append(["token draft", *(f"{v:.3f} at every depth" for v in token)])
    for label, name in CURVES.items():
        point = last_point(reports, name)
        rows.append([f"{label}, {point['train_s']:.0f} s", by_depth(point["ood"]), by_depth(point["heldout"])])
    return ["draft", "OOD, depth 1 / 2 / 3 / 4", "held out, depth 1 / 2 / 3 / 4"], rows


def shipped_agreement(depth: int) -> Callable[[Reports], Measured]:
    return lambda reports: (last_point(reports, SHIPPED_CURVE)["ood"][depth - 1], f"depth {depth}")


# ---- Draft training throughput (CPU) --------------------------------------------------------

TRAIN_STEPS = ("benchmarks/cpu-train-step-feature.json", "benchmarks/cpu-train-step-fused3.json")


def train_step_table(reports: Reports) -> Table:
    rows = []
    for name in TRAIN_STEPS:
        step = reports(name)
        before, after, config = step["before"], step["after"], step["config"]
        rows.append([
            f"{config['kind']} kind, {config['levels']} level(s)",
            f"{before['positions_per_s']:,.0f} -> {after['positions_per_s']:,.0f}",
            f"{before['answer_positions_per_s']:,.0f} -> {after['answer_positions_per_s']:,.0f}",
            f"{step['ratio']['answer_positions_per_s']:.2f}x",
        ])  # fmt: skip
    return ["step", "positions / s, before -> cheap step", "answer positions / s", "ratio"], rows


def train_step_ratio(reports: Reports) -> Measured:
    return reports(TRAIN_STEPS[0])["ratio"]["answer_positions_per_s"], "answer positions / s"


# ---- Decoding speed by drafting policy (CPU) ------------------------------------------------

BUNDLED = "benchmarks/cpu-draft-quality-shipped.json"
MAIN = "benchmarks/cpu-main.json"


def main_tree_over(policy: str) -> Callable[[Reports], Measured]:
    """cpu-main.json's fastest tree policy over another row of the same run (tokens/s)."""

    def measure(reports: Reports) -> Measured:
        rows = results(reports(MAIN))
        top, other = fastest(trees(rows)), policy_row(rows, policy)
        return top["throughput_tps"] / other["throughput_tps"], f"{label_of(top)} against {policy}"

    return measure


# ---- Verifiers under sampling (CPU) ---------------------------------------------------------

SAMPLED = {
    "T = 0.6": "benchmarks/sampled-verifiers/cpu-2026-11-27-T0.6.json",
    "T = 1.0": "benchmarks/sampled-verifiers/cpu-2026-11-27-T1.0.json",
}
SAMPLED_ROWS = 3  # the rows shown: the fastest at either temperature


def sampled_table(reports: Reports) -> Table:
    runs = {t: results(reports(n)) for t, n in SAMPLED.items()}
    speed = {
        t: {r["label"]: (over_reference(r, rows), r["tokens_per_iteration"]) for r in ours(rows)}
        for t, rows in runs.items()
    }
    labels = list(speed[next(iter(SAMPLED))])
    shown = sorted(labels, key=lambda label: (-max(speed[t][label][0] for t in runs), label))[:SAMPLED_ROWS]
    rows = [[f"`{label}`", *("{:.2f}x ({:.2f})".format(*speed[t][label]) for t in runs)] for label in shown]
    return ["policy @ verifier", *(f"{t}: x fastest reference (tokens / iteration)" for t in runs)], rows


def sampled_best(name: str) -> Callable[[Reports], Measured]:
    def measure(reports: Reports) -> Measured:
        rows = results(reports(name))
        return over_reference(fastest(ours(rows)), rows), label_of(fastest(ours(rows)))

    return measure


# ---- The engine: forwards, time outside them, draft levels, dtype, threads ------------------

LATENCY = {"float32": "benchmarks/cpu-latency-float32.json", "bfloat16": "benchmarks/cpu-latency-bfloat16.json"}
PATHS = "benchmarks/cpu-forward-paths.json"
DTYPE = "benchmarks/cpu-dtype.json"
TOKEN_DRAFT_RUN = "benchmarks/cpu-bench-lean-path.json"
FEATURE_DRAFT_RUN = "benchmarks/cpu-bench-feature-draft.json"
NEW_TOKENS, WIDTHS, CONTEXT = (1, 8, 16), (1, 16), 128  # the forwards the table shows
LATENCY_RUN = "python -m dynatree_core latency --tokens 1,2,4,8,16,32,64,128 --contexts 128,512"


def latency_cell(reports: Reports, name: str) -> str:
    points = reports(name)["points"]
    ms = {p["new_tokens"]: p["ms"] for p in points if p["model"] == "target" and p["context"] == CONTEXT}
    return " / ".join(f"{ms[n]:.1f}" for n in NEW_TOKENS)


def forward_paths(reports: Reports) -> list[str]:
    return list(dict.fromkeys(p["path"] for p in reports(PATHS)["points"]))


def paths_cell(reports: Reports) -> str:
    ms = {(p["width"], p["path"]): p["median_ms"] for p in reports(PATHS)["points"] if p["model"] == "target"}
    return "; ".join(f"width {w}: " + " / ".join(f"{ms[w, p]:.1f}" for p in forward_paths(reports)) for w in WIDTHS)


def dtype_cell(reports: Reports) -> str:
    report = reports(DTYPE)
    return (
        f"{report['chosen']} ("
        + ", ".join(f"{r['dtype']} {r['exact']}/{r['prompts']} exact" for r in report["rows"])
        + ")"
    )


def share_range(reports: Reports, name: str, key: str) -> str:
    values = sorted(r[key] for r in trees(results(reports(name))))
    return f"{100 * values[0]:.1f}-{100 * values[-1]:.1f}%"


def engine_table(reports: Reports) -> Table:
    tokens = " / ".join(map(str, NEW_TOKENS))
    rows = [
        [f"target forward ms, {d}, context {CONTEXT}, {tokens} new tokens", latency_cell(reports, n)]
        for d, n in LATENCY.items()
    ]
    outside = [share_range(reports, n, "outside_forwards_share") for n in (TOKEN_DRAFT_RUN, FEATURE_DRAFT_RUN)]
    rows += [
        [f"target forward ms by path: {' / '.join(forward_paths(reports))}", paths_cell(reports)],
        ["fastest correct dtype", dtype_cell(reports)],
        ["outside the forwards, tree policies: token / feature draft", " / ".join(outside)],
        ["memory over `ar`, tree policies", share_range(reports, MAIN, "memory_overhead")],
    ]
    return ["measure", "value"], rows


def outside_share(reports: Reports) -> Measured:
    top = max(trees(results(reports(TOKEN_DRAFT_RUN))), key=lambda r: r["outside_forwards_share"])
    return top["outside_forwards_share"], f"the most, {label_of(top)}"


# ---- The engine's heart: what a reader follows, and what a level launches -------------------

HEART = "benchmarks/cpu-engine-heart.json"
ITERATION_PATH = "benchmarks/cpu-iteration-path.json"
HEART_SINCE = "2026-11-28"  # the round's start: a GPU report dated before it measured older code


def latest_session(report: dict) -> dict:
    return report[max((k for k in report if k.startswith("session_")), key=lambda k: int(k.split("_")[1]))]


def heart_now(reports: Reports) -> dict:
    """The round's measures now: the traced path, the lines, fixed_tree's launches."""
    heart, path = reports(HEART), reports(ITERATION_PATH)
    launches = latest_session(heart)["launches_per_iteration"]
    fixed_tree = (launches.get("at_session_end") or launches["after"])["fixed_tree"]
    # a level's admission as its one kernel, as a GPU whose check passes runs it (counted in Triton's interpreter)
    kernel = launches.get("with_admission_kernel", {}).get("fixed_tree")
    return {
        "files": path["files"],
        "functions": path["functions"],
        "lines": latest_session(heart)["nonblank_lines"]["after"]["with_forward"],
        "ops": (kernel or fixed_tree)["device_eager"]["ops"],
        "torch_ops": fixed_tree["device_eager"]["ops"] if kernel else None,
        "replays": fixed_tree["device_steps"]["replays"],
    }


def heart_table(reports: Reports) -> Table:
    heart, now = reports(HEART), heart_now(reports)
    start, launches = heart["iteration_path"]["before"], heart["launches_fixed_tree_per_iteration"]["before"]
    lines = heart["nonblank_lines_core_drafts_drafting_decoding"]["before"]
    paths = [f"{start['files']} / {start['functions']}", f"{now['files']} / {now['functions']}"]
    replays = [f"{launches['device_steps']['replays']}", f"{now['replays']}"]
    ops = f"{now['ops']}"
    if now["torch_ops"]:  # a level's admission as its one kernel, then as tensor ops
        ops += f" (admission as one kernel; {now['torch_ops']} as tensor ops)"
    rows = [
        ["greedy iteration: files / functions", *paths],
        ["non-blank lines: core, drafts, drafting, decoding, forward", f"{lines:,}", f"{now['lines']:,}"],
        ["fixed_tree ops outside the forwards, op by op", f"{launches['device_eager']['ops']}", ops],
        ["replays an iteration, steps captured (CPU stand-ins)", *replays],
    ]
    return ["measure", "the round's start", "now"], rows


def heart_value(key: str) -> Callable[[Reports], Measured]:
    return lambda reports: (heart_now(reports)[key], "")


def report_date(name: str) -> str:
    found = re.search(r"\d{4}-\d{2}-\d{2}", name)
    return found.group(0) if found else ""


def gpu_run(reports: Reports, dtype: str, since: str) -> list[dict] | None:
    """The newest GPU bench run of this dtype on the OOD prompts dated on or after `since`."""
    names = [n for n in reports.glob(f"benchmarks/gpu-*-ood-{dtype}.json") if report_date(n) >= since]
    return results(reports(max(names, key=lambda n: (report_date(n), n)))) if names else None


def gpu_over_ar(dtype: str, policy: str, since: str) -> Callable[[Reports], Measured | None]:
    def measure(reports: Reports) -> Measured | None:
        rows = gpu_run(reports, dtype, since)
        if rows is None or policy_row(rows, policy) is None:
            return None
        return policy_row(rows, policy)["throughput_tps"] / policy_row(rows, "ar")["throughput_tps"], dtype

    return measure


def gpu_draft_ms(reports: Reports) -> Measured | None:
    rows = gpu_run(reports, "bfloat16", HEART_SINCE)
    return None if rows is None else (policy_row(rows, "fixed_tree")["draft_ms_per_iteration"], "bfloat16")


# ---- Candidates that cost no draft forward (CPU) --------------------------------------------

COST_FREE = "benchmarks/cpu-cost-free.json"


def recycle_over_reference(reports: Reports) -> Measured:
    rows = results(reports(COST_FREE))
    return over_reference(policy_row(rows, "recycle"), rows), "recycle"


def recycle_draft_share(reports: Reports) -> Measured:
    row = policy_row(results(reports(COST_FREE)), "recycle")
    draft = row["draft_ms_per_iteration"]
    iteration = draft + row["verify_ms_per_iteration"] + row["overhead_ms_per_iteration"]
    return draft / iteration, f"{draft:.2f} of {iteration:.1f} ms"


def joined_over_model(key: str) -> Callable[[Reports], Measured | None]:
    """The fastest joined policy's `key` over the best model-draft policy's of the same run."""

    def measure(reports: Reports) -> Measured | None:
        rows = results(reports(COST_FREE))
        joined = [r for r in rows if r.get("family") == "joined"]
        model = [r for r in rows if r.get("family") == "model"]
        if not joined or not model:
            return None
        top, rival = fastest(joined), max(model, key=lambda r: r[key])
        return top[key] / rival[key], f"{label_of(top)} {top[key]:.2f} against {label_of(rival)} {rival[key]:.2f}"

    return measure


WALK_MS = 0.2  # assumed for a projection: the recycled matrix's refresh and walk on a GPU (a top-k, a gather a level)
PROJECTED = "projected {:.2f}x from the newest GPU bfloat16 report ({}) and this run's tokens an iteration: {}"


def projected_recycle(reports: Reports) -> str:
    """No GPU run of `recycle`: its speed over `ar` projected, and said to be a projection: the GPU's
    fixed_tree verify and outside ms (bfloat16: a narrower tree costs about the same) plus WALK_MS,
    over `recycle`'s tokens an iteration measured here (greedy: a property of the models and prompts)."""
    name = max(reports.glob("benchmarks/gpu-*-ood-bfloat16.json"), key=lambda n: (report_date(n), n), default=None)
    cpu = policy_row(results(reports(COST_FREE)), "recycle")
    if name is None or cpu is None:
        return NO_GPU
    rows = results(reports(name))
    ar, tree = policy_row(rows, "ar"), policy_row(rows, "fixed_tree")
    if ar is None or tree is None or not tree.get("verify_ms_per_iteration"):
        return NO_GPU
    ms = (tree["verify_ms_per_iteration"] + tree["overhead_ms_per_iteration"] + WALK_MS) / cpu["tokens_per_iteration"]
    how = f"its fixed_tree verify + outside ms and {WALK_MS} ms for the walk; a projection, not a measurement"
    return f"{NO_GPU}; " + PROJECTED.format(1000 / ar["throughput_tps"] / ms, name.split("/")[-1], how)


def projected_joined(reports: Reports) -> str:
    """No GPU run of `joined_fixed_tree`: its gain over fixed_tree projected from the tokens an
    iteration measured here, at fixed_tree's iteration time (a few more rows cost about nothing in
    bfloat16 there), and said to be a projection."""
    name = max(reports.glob("benchmarks/gpu-*-ood-bfloat16.json"), key=lambda n: (report_date(n), n), default=None)
    rows = results(reports(COST_FREE))
    joined, tree = policy_row(rows, "joined_fixed_tree"), policy_row(rows, "fixed_tree")
    if name is None or joined is None or tree is None:
        return NO_GPU
    ratio = joined["tokens_per_iteration"] / tree["tokens_per_iteration"]
    how = "fixed_tree's iteration time for both; a projection, not a measurement"
    return f"{NO_GPU}; " + PROJECTED.format(ratio, name.split("/")[-1], how)


def gpu_pair(policy: str, over: str) -> Callable[[Reports], Measured | None]:
    """A policy's tokens/s over another's in the newest GPU bench report that runs both, if any."""

    def measure(reports: Reports) -> Measured | None:
        for name in reversed(reports.glob("benchmarks/gpu-*.json")):
            rows = results(reports(name))
            if policy_row(rows, policy) and policy_row(rows, over):
                return policy_row(rows, policy)["throughput_tps"] / policy_row(rows, over)["throughput_tps"], name
        return None

    return measure


# ---- Width invariance: bfloat16 trees token-identical to bfloat16 `ar` (CPU) ----------------

BF16_RUN = "benchmarks/cpu-bf16-invariant.json"
INVARIANCE_COST = "benchmarks/cpu-invariance-cost.json"


def invariance_table(reports: Reports) -> Table:
    rows = results(reports(BF16_RUN))
    mine, theirs = ours(rows), [r for r in rows if r["policy"].startswith("hf_")]
    speed = sorted(over_reference(r, rows) for r in mine)
    table = [
        ["our policies with every run token-identical", f"{sum(r['exact'] == r['runs'] for r in mine)} of {len(mine)}"],
        ["HF's own loops, runs token-identical", ", ".join(f"{label_of(r)} {exact(r)}" for r in theirs)],
        ["bfloat16 speed, our policies, x `ar`", f"{speed[0]:.2f}x-{speed[-1]:.2f}x"],
    ]
    for dtype, cost in reports(INVARIANCE_COST)["points"].items():
        ratio = f"{cost['tree invariant / shared']:.2f}x / {cost['ar invariant / shared']:.2f}x"
        bits = "equal" if cost["path bits equal ar's"] else "differ"
        table.append([f"{dtype}: invariant over shared kernels, tree verify / `ar` step", f"{ratio}; path bits {bits}"])
    return ["measure", "value"], table


# ---- GPU (lent H200 and H100) and captured forwards -----------------------------------------

GPU_RUNS = {
    "float32": "benchmarks/gpu-h200-2026-11-27-3151fd5-ood-float32.json",
    "bfloat16": "benchmarks/gpu-h200-2026-11-27-3151fd5-ood-bfloat16.json",
}
GPU_CHECK = "benchmarks/gpu-h200-2026-11-27-3151fd5-check.json"
GPU_TREE_ROWS = 3  # tree policies shown: the fastest in bfloat16


def gpu_table(reports: Reports) -> Table:
    runs = {d: results(reports(n)) for d, n in GPU_RUNS.items()}
    by_label = {d: {r["label"]: r for r in rows} for d, rows in runs.items()}
    ranked = sorted(trees(runs["bfloat16"]), key=lambda r: (-r["throughput_tps"], r["label"]))[:GPU_TREE_ROWS]
    shown = [r["label"] for r in runs["float32"] if r["policy"] in REFERENCES] + [r["label"] for r in ranked]

    def cell(dtype: str, label: str) -> str:
        row = by_label[dtype][label]
        return f"{row['throughput_tps']:.1f} ({over_reference(row, runs[dtype]):.2f}x), {exact(row)}"

    rows = [[f"`{label_of(by_label['float32'][label])}`", *(cell(d, label) for d in runs)] for label in shown]
    return ["policy", *(f"{d}: tokens/s (x fastest reference), exact" for d in runs)], rows


def gpu_ar_over_static(dtype: str) -> Callable[[Reports], Measured]:
    def measure(reports: Reports) -> Measured:
        rows = results(reports(GPU_RUNS[dtype]))
        return policy_row(rows, "ar")["throughput_tps"] / policy_row(rows, "hf_static")["throughput_tps"], dtype

    return measure


def gpu_verify_width(dtype: str) -> Callable[[Reports], Measured]:
    """fixed_tree's verify forward over `ar`'s one-row forward, in the same run."""

    def measure(reports: Reports) -> Measured:
        rows = results(reports(GPU_RUNS[dtype]))
        tree, ar = policy_row(rows, "fixed_tree"), policy_row(rows, "ar")
        ratio = tree["verify_ms_per_iteration"] / ar["verify_ms_per_iteration"]
        return ratio, f"{dtype}, fixed_tree's {tree['verify_rows_mean']:.1f} rows"

    return measure


def gpu_blocking_reads(reports: Reports) -> Measured:
    per = reports(GPU_CHECK)["measures"]["run"]["per_iteration"]
    return per["to_host"] + per["sync"], "gpu-check, fixed_tree, float32"


def gpu_checks_passed(reports: Reports) -> Measured:
    checks = reports(GPU_CHECK)["checks"]
    failed = [f"{c['pair']} {c['check']}" for c in checks if not c["ok"]]
    return 1 - len(failed) / len(checks), ("failed: " + ", ".join(failed)) if failed else ""


# ---- The live page against the CLI ----------------------------------------------------------

LIVE = {
    "quiet, CLI at its default threads": "benchmarks/cpu-live-page-process.json",
    "quiet, CLI at 1 thread": "benchmarks/cpu-live-page-process-cli1.json",
    "one busy process beside": "benchmarks/cpu-live-page-process-busy.json",
}
QUIET, BUSY = "quiet, CLI at its default threads", "one busy process beside"
LIVE_RUN = SCRIPT + "live_page --runs {} --out assets/{}"
RAY_LIVE = "benchmarks/cpu-live-page-ray-vs-process.json"  # sittings alternating: the engine a Ray actor, a process
REPLICAS = "benchmarks/cpu-replicas.json"
RAY_LOG = "Beyond one machine"  # the log's section on engines on Ray


def live_table(reports: Reports) -> Table:
    rows = []
    for label, name in LIVE.items():
        s = reports(name)["summary"]
        page, cli = s["page_tokens_per_s_median"], s["cli_warm_tokens_per_s_median"]
        rows.append([label, f"{page:.2f}", f"{cli:.2f}", f"{s['ratio_page_to_cli_warm_median_of_rounds']:.2f}x"])
    ray = [s["summary"] for s in reports(RAY_LIVE)["sittings"] if s["engine"] == "ray"]
    page, cli = (
        statistics.median(s[k] for s in ray) for k in ("page_tokens_per_s_median", "cli_warm_tokens_per_s_median")
    )
    ratio = reports(RAY_LIVE)["median_of_rounds"]["ray"]
    label = "quiet, the engine a Ray actor (sittings alternating with a process)"
    rows.append([label, f"{page:.2f}", f"{cli:.2f}", f"{ratio:.2f}x"])
    return ["condition", "page tokens/s", "CLI tokens/s", "page / CLI (median of rounds)"], rows


def live_ratio(label: str) -> Callable[[Reports], Measured]:
    return lambda reports: (reports(LIVE[label])["summary"]["ratio_page_to_cli_warm_median_of_rounds"], label)


def ray_over_process(reports: Reports) -> Measured:
    medians = reports(RAY_LIVE)["median_of_rounds"]
    return medians["ray"] / medians["process"], f"{medians['ray']:.2f}x on Ray, {medians['process']:.2f}x a process"


def replicas_ratio(reports: Reports) -> Measured:
    report = reports(REPLICAS)
    return report["two_over_one"], f"{report['tokens']} tokens, {report['cores']} cores"


# ---- The pages that open on results ---------------------------------------------------------

PAGES_OPEN = "benchmarks/cpu-pages-open.json"
FIRST = "The app's first screen"  # the log's section of the live page's first screen


def pages_table(reports: Reports) -> Table:
    cells = reports(PAGES_OPEN)["cells"]
    screens = list(dict.fromkeys(cell.rsplit(" ", 1)[1] for cell in cells))
    rows = {}
    for cell, value in cells.items():
        page, _ = cell.rsplit(" ", 1)  # "Compare_Policies 1366x768"
        rows.setdefault(page, [page.replace("_", " ")]).append(f"{value['median']:.2f} ({value['worst']:.2f})")
    return ["page: first figure after the title, s, median (worst)", *screens], list(rows.values())


def pages_worst(reports: Reports) -> Measured:
    cell, value = max(reports(PAGES_OPEN)["cells"].items(), key=lambda kv: kv[1]["worst"])
    return value["worst"], cell.replace("_", " ")


# ---- Draft training data --------------------------------------------------------------------

WRITTEN = "written-"  # the curve's sources of human-written text: no answers of the target


def answer_sources(reports: Reports) -> dict:
    sources = reports(SHIPPED_CURVE)["data"]["sources"]
    return {k: v for k, v in sources.items() if not k.startswith(WRITTEN)}


def data_table(reports: Reports) -> Table:
    sources = answer_sources(reports)
    rows = [
        [what, f"{sum(v[key] for v in sources.values()):,}", *(f"{v[key]:,}" for v in sources.values())]
        for what, key in (("prompts", "prompts"), ("answer tokens", "answer_tokens"))
    ]
    return ["", f"all {len(sources)} kinds", *sources], rows


def data_total(key: str) -> Callable[[Reports], Measured]:
    return lambda reports: (sum(v[key] for v in answer_sources(reports).values()), "")


# ---- The draft at scale: one GPU sitting ----------------------------------------------------

PACK = "draft-data/prompt-pack.json"


def pack_table(reports: Reports) -> Table:
    header = reports(PACK)["header"]
    sources = header["sources"].values()
    passages, chars = sum(s["passages"] for s in sources), sum(s["chars"] for s in sources)
    follow_ups = " / ".join(f"{n:,}" for n in header["follow_ups"].values())
    dropped = f"{header['ood_dropped']} ({header['ood_texts']}) / {header['duplicates_dropped']}"
    rows = [
        ["prompts (target)", f"{header['prompts']:,} ({header['target_prompts']:,})"],
        ["sources / passages / characters", f"{len(sources)} / {passages:,} / {chars:,}"],
        ["instructions", f"{len(header['instructions'])} kinds"],
        ["jobs with target-written follow-ups, by round", follow_ups],
        ["dropped: OOD overlaps (of texts checked) / repeats", dropped],
    ]
    return ["measure", "value"], rows


# ---- the topics, in the order the document shows them ---------------------------------------

TOPICS = (
    Topic(
        title="Headline: prompts no draft trained on (OOD)",
        about="The embedded pair (SmolLM2-135M-Instruct target) on the first OOD prompts (`assets/prompts/ood/`: "
        "sources no draft trained on), greedy, float32, registry defaults, each draft one pass in one process; "
        "cells: speedup over the faster of `ar` and HF `generate`, tokens an iteration. The README example is "
        "`compare` on one prompt.",
        reports={
            HEADLINE: SCRIPT + "ood_headline",
            README_COMPARE: 'python -m dynatree_core compare --prompt "Why is the sky blue?" --policy linear '
            "--policy fixed_tree --policy dynatree --policy salf --repetitions 3 --json",
        },
        date="2026-11-25",
        table=headline_table,
        goals=(
            Goal("best tree policy (shipped draft) over the faster of `ar` / HF `generate`", 1.7, headline_best),
            Goal("fixed_tree's tokens an iteration (shipped draft)", 2.2, headline_fixed_tree, fmt="{:.2f}"),
            Goal("README example: every tree policy over `ar`", 1.3, readme_slowest_tree),
            Goal("runs token for token the target's greedy output", 1.0, headline_exact, fmt="{:.0%}"),
        ),
    ),
    Topic(
        title="Defaults fitted on OOD prompts (CPU)",
        about="`benchmarks/ood_defaults.py` on the OOD tuning prompts (the second of each category, never the "
        "headline's), the shipped draft: one process sweeps each main parameter, a second checks the combination "
        "against the defaults; a value replaces a default only when it beats the default's own row by more than "
        "the script's margin. A fit, not a goal.",
        reports={
            FITS[0]: SCRIPT + "ood_defaults --out assets/benchmarks/ood-defaults-long",
            FITS[1]: SCRIPT + "ood_defaults --policies recycle,suffix,joined_fixed_tree,joined_dynatree "
            "--out assets/benchmarks/ood-defaults-cost-free",
            RANKED_FIT: None,
        },
        date="2026-11-25 (tree policies), 2026-11-29 (`recycle`, `suffix`, the joined forms)",
        table=defaults_table,
    ),
    Topic(
        title="Draft quality: agreement with the target by depth",
        about="Top-1 agreement of the draft's token with the target's greedy token; depth d = a node whose d-1 "
        "ancestors were accepted. OOD: the target's answers to `assets/prompts/ood/`; held out: each run's own "
        "held-out answer windows. The shipped draft: its curve's last point; the rest: equal-compute runs "
        '(answers alone against answers with written text: docs/benchmark-log.md, "Draft data that generalises").',
        reports={
            SHIPPED_CURVE: SHIPPED_RUN,
            KD_VS_UNROLLED: TRAIN + "feature-quality --answers --draft assets/models/smollm2-feature-draft-corpus "
            "KD_RUN/draft UNROLLED_RUN/draft",
            CURVES["feature kind"]: PACKED + " --kind feature --levels 1 --out RUN",
            CURVES["fused kind (EAGLE-3 taps)"]: PACKED + " --kind fused --levels 3 --out RUN",
        },
        date="2026-11-25 (shipped draft), 2026-11-24 (the rest)",
        table=quality_table,
        goals=(
            Goal("shipped draft's OOD agreement, depth 1", 0.66, shipped_agreement(1), fmt="{:.3f}"),
            Goal("shipped draft's OOD agreement, depth 3", 0.56, shipped_agreement(3), fmt="{:.3f}"),
        ),
    ),
    Topic(
        title="Draft training throughput (CPU)",
        about="The feature draft's training step before and after the cheap step (the teacher's top-k precomputed, "
        "packed windows, bfloat16 autocast), same windows, same loss, alternating rounds in one process.",
        reports={
            TRAIN_STEPS[0]: SCRIPT + "train_step --rounds 2 --steps 5 --out assets/" + TRAIN_STEPS[0],
            TRAIN_STEPS[1]: SCRIPT
            + "train_step --rounds 1 --steps 5 --kind fused --levels 3 --out assets/"
            + TRAIN_STEPS[1],
        },
        date="2026-11-24",
        table=train_step_table,
        goals=(
            Goal("the cheap step's answer positions / s over the step before", 3.0, train_step_ratio),
            Goal("relabelling throughput (positions / s)", None, logged="The cheap step and the fused kind"),
        ),
    ),
    Topic(
        title="Decoding speed by drafting policy (CPU)",
        about="The embedded pair on the bundled prompts (one per domain), 128 new tokens, float32, the defaults of "
        "the time, with the first feature draft (then `assets/models/smollm2-feature-draft`, now "
        "`smollm2-feature-draft-corpus`); the goals against the chain and HF assisted generation come from the "
        "token draft's run of every policy. The OOD headline above is the current speed.",
        reports={BUNDLED: None, MAIN: None},
        date="before 2026-11-23",
        table=bench_table(BUNDLED, ("policy", "tokens/s", "x fastest reference", "tokens / iteration", "exact")),
        goals=(
            Goal("fixed_tree's tokens an iteration", 3.0, tokens_of(BUNDLED, "fixed_tree"), fmt="{:.2f}"),
            Goal("best tree policy over the fastest reference", 1.8, best_tree(BUNDLED)),
            Goal("best tree policy over the linear chain (`cpu-main.json`)", 1.15, main_tree_over("linear")),
            Goal("best tree policy over HF assisted generation, same draft", 1.3, main_tree_over("hf_assisted")),
        ),
    ),
    Topic(
        title="Verifiers under sampling (CPU)",
        about="The embedded pair with the feature draft, OOD prompts one per domain, 48 new tokens, seed = prompt "
        "index; the rows shown are the fastest at either temperature. A row holds a few hundred sampled tokens, "
        "so its tokens an iteration carry a standard error of about 0.06.",
        reports=dict.fromkeys(SAMPLED.values()),
        date="2026-11-27",
        table=sampled_table,
        goals=tuple(
            Goal(f"{t}: the fastest speculative row over sampling from the target", 1.0, sampled_best(n))
            for t, n in SAMPLED.items()
        ),
    ),
    Topic(
        title="The engine: forwards, time outside them, draft levels, dtype, threads",
        about="One cached forward of the target (SmolLM2-135M), packed weights, by new tokens and by forward path "
        "(lean is the default); the dtype probe; the share of an iteration outside the model forwards and the "
        "memory over `ar` in `bench` runs.",
        reports={
            LATENCY["float32"]: LATENCY_RUN + " --dtype float32 --out assets/" + LATENCY["float32"],
            LATENCY["bfloat16"]: LATENCY_RUN + " --dtype bfloat16 --out assets/" + LATENCY["bfloat16"],
            PATHS: SCRIPT + "forward_paths",
            DTYPE: "python -m dynatree_core dtype --json --no-save",
            TOKEN_DRAFT_RUN: None,
            FEATURE_DRAFT_RUN: None,
            MAIN: None,
        },
        date="before 2026-11-23",
        table=engine_table,
        goals=(
            Goal(
                "time outside the forwards, token draft, tree policies", 0.10, outside_share, fmt="{:.1%}", at_most=True
            ),
            Goal(
                "a feature-draft level in the loop, x one target step",
                0.12,
                at_most=True,
                logged="Draft data that generalises",
            ),
            Goal(
                "a token-draft level in the loop",
                2.0,
                fmt="{:.1f} ms",
                at_most=True,
                logged="The feature-level draft (EAGLE-style)",
            ),
            Goal("torch threads beside a busy process", None, logged="Threads, and the live page against the CLI"),
        ),
    ),
    Topic(
        title="The engine's heart: what a reader follows, and what a level launches",
        about="Goals of the engine's rework (one tree as tensors, one row batch, one forward entry): the files and "
        "functions one greedy fixed_tree iteration passes through (traced, feature draft), the library's non-blank "
        "lines, and what a fixed_tree iteration launches outside its forwards (first OOD prompt, 48 tokens, "
        "float32), at the round's start and after its latest session, on this CPU.",
        reports={
            ITERATION_PATH: SCRIPT + "iteration_path",
            HEART: SCRIPT
            + "launches --prompts 1`; the admission as one kernel: `TRITON_INTERPRET=1 "
            + SCRIPT
            + "launches --prompts 1 --admit-kernel",
        },
        date="2026-11-28 (start) to 2026-12-07",
        table=heart_table,
        goals=(
            Goal("files one iteration passes through", 8, heart_value("files"), fmt="{:.0f}", at_most=True),
            Goal("functions one iteration passes through", 20, heart_value("functions"), fmt="{:.0f}", at_most=True),
            Goal("non-blank lines, forward/ included", 6000, heart_value("lines"), fmt="{:,.0f}", at_most=True),
            Goal("fixed_tree ops outside the forwards, op by op", 60, heart_value("ops"), fmt="{:.1f}", at_most=True),
            Goal("replays an iteration, steps captured", 5, heart_value("replays"), fmt="{:.1f}", at_most=True),
            Goal(
                "GPU, bfloat16: fixed_tree over `ar`",
                1.5,
                gpu_over_ar("bfloat16", "fixed_tree", HEART_SINCE),
                missing=NO_GPU,
            ),
            Goal(
                "GPU, float32: fixed_tree over `ar`",
                1.2,
                gpu_over_ar("float32", "fixed_tree", HEART_SINCE),
                missing=NO_GPU,
            ),
            Goal(
                "GPU: fixed_tree's draft ms an iteration",
                0.6,
                gpu_draft_ms,
                fmt="{:.2f} ms",
                at_most=True,
                missing=NO_GPU,
            ),
        ),
    ),
    Topic(
        title="Candidates that cost no draft forward (CPU)",
        about="Retrieved (`suffix`: SAM-Decoding's suffix automaton; `ngram`), recycled (`recycle`: Token "
        "Recycling) and joined trees (a model-draft tree with the suffix match grafted in), against the "
        "model-draft trees and the references on the headline's OOD prompts, 128 tokens, greedy, defaults fitted "
        "on the tuning prompts first.",
        reports={COST_FREE: None},
        date="2026-11-29",
        table=bench_table(
            COST_FREE,
            ("policy", "family", "tokens/s", "x fastest reference", "tokens / iteration", "draft / verify ms", "exact"),
        ),
        goals=(
            Goal("`recycle`'s tokens an iteration", 2.1, tokens_of(COST_FREE, "recycle"), fmt="{:.2f}"),
            Goal("`recycle` over the fastest reference, no draft model loaded", 1.4, recycle_over_reference),
            Goal("`recycle`'s drafting share of its iteration", 0.02, recycle_draft_share, fmt="{:.1%}", at_most=True),
            Goal(
                "fastest joined policy's tokens an iteration over the best model draft's",
                1.15,
                joined_over_model("tokens_per_iteration"),
            ),
            Goal(
                "fastest joined policy's tokens/s over the fastest model draft's",
                1.10,
                joined_over_model("throughput_tps"),
            ),
            Goal("GPU: `recycle` over `ar`", 1.6, gpu_pair("recycle", "ar"), missing=projected_recycle),
            Goal(
                "GPU: `joined_fixed_tree` over `fixed_tree`",
                1.2,
                gpu_pair("joined_fixed_tree", "fixed_tree"),
                missing=projected_joined,
            ),
        ),
    ),
    Topic(
        title="Width invariance: bfloat16 trees token-identical to bfloat16 `ar` (CPU)",
        about="The width-invariant forwards (`dynatree_core/forward/invariant.py`, on by default in "
        "bfloat16/float16): every policy on the OOD prompts in bfloat16 against bfloat16 `ar`, and what "
        "invariance costs one forward after a cached context against the shared kernels.",
        reports={BF16_RUN: None, INVARIANCE_COST: SCRIPT + "invariance_cost"},
        date="2026-11-25",
        table=invariance_table,
        goals=(
            Goal("our policies' runs token-identical to bfloat16 `ar`", 1.0, exact_share((BF16_RUN,)), fmt="{:.0%}"),
        ),
    ),
    Topic(
        title="GPU (lent H200 and H100) and captured forwards",
        about="A lent GPU session: the embedded target with the shipped feature draft, the OOD prompts, 128 new "
        "tokens, greedy, registry defaults, captured forwards, bfloat16 width-invariant; rows: the references and "
        "the fastest tree policies; `gpu-check` for the host reads. Earlier sessions' reports stay in "
        "`assets/benchmarks/gpu-*`.",
        reports={GPU_RUNS["float32"]: None, GPU_RUNS["bfloat16"]: None, GPU_CHECK: "python -m dynatree_core gpu-check"},
        date="2026-11-27",
        table=gpu_table,
        goals=(
            Goal("float32: `ar` over the static-cache HF `generate`", 1.0, gpu_ar_over_static("float32")),
            Goal("bfloat16: `ar` over the static-cache HF `generate`", 1.0, gpu_ar_over_static("bfloat16")),
            Goal("float32: best tree policy over the fastest reference", 1.5, best_tree(GPU_RUNS["float32"])),
            Goal("bfloat16: best tree policy over the fastest reference", 2.0, best_tree(GPU_RUNS["bfloat16"])),
            Goal(
                "tree runs token-identical to `ar` of their dtype",
                1.0,
                exact_share(tuple(GPU_RUNS.values()), trees),
                fmt="{:.0%}",
            ),
            Goal("blocking host reads per iteration", 2.0, gpu_blocking_reads, fmt="{:.1f}", at_most=True),
            Goal("bfloat16: a tree verify over a one-row forward", 1.25, gpu_verify_width("bfloat16"), at_most=True),
            Goal("float32: a tree verify over a one-row forward", 1.25, gpu_verify_width("float32"), at_most=True),
            Goal("`gpu-check`'s rows passed", 1.0, gpu_checks_passed, fmt="{:.0%}"),
        ),
    ),
    Topic(
        title="The live page against the CLI",
        about="`benchmarks/live_page.py`: the page in Chromium on this machine against the CLI, alternating round "
        "by round; embedded pair (token draft then; the feature draft in the Ray row), fixed_tree defaults, the "
        "page's default prompt, 64 tokens; page = its engine-time tokens/s, the engine in its own process at 1 torch "
        "thread (a spawned process, before engines became Ray actors). `benchmarks/replicas.py`: two sessions on "
        "one pair, their runs started together, iterations a second with one engine against two replicas.",
        reports={
            LIVE[QUIET]: LIVE_RUN.format(4, LIVE[QUIET]),
            LIVE["quiet, CLI at 1 thread"]: LIVE_RUN.format("3 --cli-threads 1", LIVE["quiet, CLI at 1 thread"]),
            LIVE[BUSY]: LIVE_RUN.format("3 --busy", LIVE[BUSY]),
            RAY_LIVE: SCRIPT + "live_page --runs 3 --live-engine ray, sittings alternating with the process engine "
            "of the time (removed since)",
            REPLICAS: SCRIPT + "replicas --tokens 256",
        },
        date="before 2026-11-23 (process rows), 2026-11-29 (Ray)",
        table=live_table,
        goals=(
            Goal("page over the CLI, quiet", 0.8, live_ratio(QUIET)),
            Goal("page over the CLI with a busy process beside (no collapse)", 0.8, live_ratio(BUSY)),
            Goal(
                "page over the CLI: the engine a Ray actor over a process, sittings alternating", 1.0, ray_over_process
            ),
            Goal("two sessions on one pair: 2 replicas over 1 (iterations a second)", 1.6, replicas_ratio),
            Goal(
                "two engine threads in the app, drawing less often, drawing in a thread",
                None,
                logged="Threads, and the live page against the CLI",
            ),
            Goal("Ray's own processes in the classroom test", 1024, fmt="{:.0f} MiB", at_most=True, logged=RAY_LOG),
            Goal("CI's time with Ray, over before", 1.1, at_most=True, logged=RAY_LOG),
        ),
    ),
    Topic(
        title="Draft training data",
        about="The target's own answers the shipped draft trained on (bfloat16, one-pass batched answers with "
        "their features), by kind of offline source, as its card's curve records them (human-written text apart).",
        reports={SHIPPED_CURVE: TRAIN + "answers --stages questions,main --main-shards 34"},
        date="2026-11-24",
        table=data_table,
        goals=(
            Goal("answer tokens", 3_000_000, data_total("answer_tokens"), fmt="{:,.0f}"),
            Goal("prompts", 20_000, data_total("prompts"), fmt="{:,.0f}"),
            Goal("kinds of source", 5, lambda reports: (len(answer_sources(reports)), ""), fmt="{:.0f}"),
            Goal("one-pass answers over HF `generate` (answer tokens/s)", 4.0, logged="Draft data that generalises"),
        ),
    ),
    Topic(
        title="The draft at scale: one GPU sitting",
        about="The prompt pack and the one-sitting recipe (`draft-gpu`; docs/training.md), built and tested on the "
        "CPU. No GPU-trained draft has come back, so the draft goals below read the shipped draft.",
        reports={PACK: TRAIN + "prompt-pack", SHIPPED_CURVE: SHIPPED_RUN, HEADLINE: SCRIPT + "ood_headline"},
        date="2026-11-26",
        table=pack_table,
        goals=(
            Goal(
                "prompts in the pack", 250_000, lambda reports: (reports(PACK)["header"]["prompts"], ""), fmt="{:,.0f}"
            ),
            Goal(
                "answer tokens generated and trained on in one GPU sitting",
                20e6,
                fmt="{:,.0f}",
                logged="The draft's recipe on an H100",
            ),
            Goal("OOD agreement, depth 1", 0.70, shipped_agreement(1), fmt="{:.3f}"),
            Goal("OOD agreement, depth 3", 0.60, shipped_agreement(3), fmt="{:.3f}"),
            Goal("OOD headline: best tree policy over the faster of `ar` / HF `generate`", 1.9, headline_best),
            Goal("OOD headline: fixed_tree's tokens an iteration", 2.4, headline_fixed_tree, fmt="{:.2f}"),
            Goal("README example: every tree policy over `ar`", 1.4, readme_slowest_tree),
        ),
    ),
    Topic(
        title="The app's first screen, and pages that open on results",
        about="Compare, the Verification Lab and Benchmark opened in Chromium on this machine with nothing clicked "
        "and no model loaded: from the page's title to the first drawn mark of a chart inside the viewport "
        "(the recorded comparison, the recorded lab experiment, the shipped reports), after one warm-up visit. "
        "The live page's first screen, stage view and exports were measured 2026-11-23 and 2026-11-24 with no "
        "report committed (Chromium and the server share the engine's two cores here).",
        reports={PAGES_OPEN: SCRIPT + "pages_open --rounds 3"},
        date="2026-11-29",
        table=pages_table,
        goals=(
            Goal("every page's first figure after its title, both screens", 3.0, pages_worst, "{:.2f} s", True),
            Goal("first tree on the live page, warm quiet server", 3.0, fmt="{:.1f} s", at_most=True, logged=FIRST),
            Goal("first ten live iterations' tokens/s over the rest's", 0.8, logged=FIRST),
            Goal("export of a 512-token sampled run", 64, fmt="{:.0f} MB", at_most=True, logged=FIRST),
        ),
    ),
)


# ---- rendering ------------------------------------------------------------------------------


def find_environment(report: object) -> dict | None:
    """The first `environment` a report records, however deep (the headline's sits in each pass)."""
    if not isinstance(report, dict):
        return None
    if isinstance(report.get("environment"), dict):
        return report["environment"]
    return next((env for v in report.values() if (env := find_environment(v))), None)


def machine(env: dict | None) -> str:
    """The machine a report was measured on, in words, from its environment."""
    if env is None:
        return "the project's CPU (the report records no machine)"
    torch = f", torch {env['torch']}" if env.get("torch") else ""
    if env.get("gpu"):
        return f"{env['gpu']} (lent){torch}"
    cores = env.get("cpu_count") or env.get("cores")
    return f"{env['cpu']}, {cores} cores{', AVX512-BF16' if env.get('avx512_bf16') else ''}{torch}"


def source_line(topic: Topic, reports: Reports) -> str:
    """What was measured, when, on which machine, and each report with the command that wrote it."""
    if not topic.reports:
        return f"{topic.about} Measured {topic.date}; no report is committed: the numbers are in {LOG}."
    env = find_environment(reports(next(iter(topic.reports))))  # the first report names the machine
    commands = {n: c or portable(reports(n)["settings"]["command"], n) for n, c in topic.reports.items()}
    sources = "; ".join(f"`assets/{n}`: `{c}`" for n, c in commands.items())
    return f"{topic.about} Measured {topic.date} on {machine(env)}. Reports and commands: {sources}."


def goal_line(goal: Goal, reports: Reports) -> str:
    """`- Goal: what >= threshold: value (where), **met**`, the verdict computed from the value."""
    head = f"- Goal: {goal.what} {'<=' if goal.at_most else '>='} {goal.fmt.format(goal.threshold)}"
    measured = goal.measure(reports) if goal.measure else None
    if measured is None:
        return f"{head}: {goal.missing(reports) if callable(goal.missing) else goal.missing}"
    value, where = measured
    met = value <= goal.threshold if goal.at_most else value >= goal.threshold
    shown = goal.fmt.format(value)
    if shown == goal.fmt.format(goal.threshold) and not met:
        shown += f" (unrounded {value:.4f})"
    return f"{head}: {shown}{f' ({where})' if where else ''}, **{'met' if met else 'not met'}**"


def logged_line(goals: list[Goal]) -> str:
    """One line for the measures no report holds: each with the log heading whose section has it."""
    items = []
    for goal in goals:
        bound = "" if goal.threshold is None else f" {'<=' if goal.at_most else '>='} {goal.fmt.format(goal.threshold)}"
        items.append(f'{goal.what}{bound} ("{goal.logged}")')
    return f"- Not in a report, see {LOG}: " + "; ".join(items) + "."


def table_lines(table: Table) -> list[str]:
    header, rows = table
    return [f"| {' | '.join(header)} |", "|" + "---|" * len(header), *(f"| {' | '.join(r)} |" for r in rows)]


def section(topic: Topic, reports: Reports) -> list[str]:
    """A topic's lines: its title, its table, what and where from, its goals, then what the log holds."""
    lines = [f"## {topic.title}", ""]
    if topic.table is not None:
        lines += [*table_lines(topic.table(reports)), ""]
    lines += [source_line(topic, reports), *(goal_line(g, reports) for g in topic.goals if not g.logged)]
    if logged := [g for g in topic.goals if g.logged]:
        lines.append(logged_line(logged))
    return [*lines, ""]


def intro(reports: Reports) -> list[str]:
    env = find_environment(reports(HEADLINE))
    return [
        "# Benchmarks",
        "",
        f"Generated from the committed reports under `assets/` by `{COMMAND}` (`--check` fails when this file is "
        "stale): do not edit it by hand. One section per topic, its current numbers only, each with its reports, "
        "their commands, the date and the machine; every goal's verdict is computed from the reports' numbers.",
        f"Machine: {machine(env)} ({'AMX' if env.get('amx_bf16') else 'no AMX'}, no GPU), unless a section names "
        "another; GPU numbers come from lent H100 / H200 machines, marked as such. Greedy decoding unless a section "
        "samples; every greedy speculative run is checked token for token against the target's own greedy output "
        "(`exact`). This host's speed drifts from minute to minute: compare ratios within one run.",
        "How each number moved, with every command and condition, is in [docs/benchmark-log.md]"
        "(docs/benchmark-log.md); its last section keeps this file as it was written by hand.",
        "",
    ]


def render(assets: Path = ASSETS) -> str:
    """BENCHMARKS.md's text from the reports under `assets` (the repository's assets/, or a copy)."""
    reports = Reports(assets)
    lines = intro(reports)
    for topic in TOPICS:
        lines += section(topic, reports)
    return "\n".join(lines).rstrip("\n") + "\n"


def stale_summary(written: str, wanted: str) -> str:
    """A short account of how the file on disk differs from what the reports give."""
    diff = difflib.unified_diff(written.splitlines(), wanted.splitlines(), "on disk", "from the reports", lineterm="")
    lines = list(diff)
    changed = sum(1 for line in lines[2:] if line[:1] in "+-")
    shown = "\n".join(line[:160] for line in lines[:24])
    return f"BENCHMARKS.md is stale: {changed} lines differ; regenerate it with `{COMMAND}`.\n{shown}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when BENCHMARKS.md is stale")
    parser.add_argument("--assets", type=Path, default=ASSETS, help="the directory the reports' paths start from")
    parser.add_argument("--out", type=Path, default=DOC, help="the file to write (or, with --check, to compare)")
    args = parser.parse_args(argv)
    wanted = render(args.assets)
    written = args.out.read_text(encoding="utf-8") if args.out.exists() else ""
    if args.check:
        if written != wanted:
            print(stale_summary(written, wanted))
            return 1
        print(f"{args.out.name} is current ({len(wanted.splitlines())} lines)")
        return 0
    args.out.write_text(wanted, encoding="utf-8")
    print(f"written: {args.out.name} ({len(wanted.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
