"""Benchmarks: drafting policies over a prompt set, the DynaTree protocol (§4.1): N prompts, the
first W runs discarded as warm-up, prompts truncated to L_max tokens, T new tokens, R repeats.

Runs follow `compare.measure` (same loaded models, rotated interleaved rounds, ar and HF
generate as references in the same run); speed is reported as mean ± std over the rounds and as
a ratio to the faster reference. Every report records the environment it was measured in.
Output: a markdown table, or JSON ({"environment", "settings", "results": per-policy rows,
"prompts": per-prompt rows}) with a CSV of the per-policy rows beside it.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import itertools
import json
import statistics
from typing import Any

from dynatree_core.core.packing import is_packed
from dynatree_core.decoding.engine import DecodeConfig
from dynatree_core.decoding.methods import make_method, method_class
from dynatree_core.decoding.pairs import encode_prompt
from dynatree_core.errors import DynaTreeError
from dynatree_core.measure.compare import EntryStats, measure
from dynatree_core.measure.entries import Entry
from dynatree_core.measure.prompt_sets import OOD_PREFIX, Prompt
from dynatree_core.runs.environment import environment
from dynatree_core.runs.metrics import exactness_note

SUMMARY_FIELDS = (
    "label", "policy", "family", "verifier", "params", "throughput_tps", "throughput_std", "speedup",
    "tokens_per_iteration", "acceptance_rate", "mean_accepted_length", "iterations", "ttft_ms", "tpot_ms",
    "draft_ms_per_iteration",
    "verify_ms_per_iteration", "overhead_ms_per_iteration", "peak_memory_mb", "memory_overhead", "tree_size_mean",
    "tree_size_max", "verify_rows_mean", "exact", "runs", "outside_forwards_share",
)  # fmt: skip


def encode_prompts(tokenizer, prompts: list[Prompt], max_prompt_tokens: int | None) -> list[list[int]]:
    """Token ids per prompt; the prompt's own text is cut to its first L_max tokens before the chat
    template (if any) is applied, so a chat prompt keeps its template."""
    out = []
    for p in prompts:
        text = p.text
        if max_prompt_tokens:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) > max_prompt_tokens:
                text = tokenizer.decode(ids[:max_prompt_tokens])
        out.append(encode_prompt(tokenizer, text, chat=p.chat, history=p.history))
    return out


@dataclasses.dataclass
class BenchReport:
    environment: dict[str, Any]
    settings: dict[str, Any]
    results: list[EntryStats]
    prompts: list[dict[str, Any]]  # one row per (policy, prompt)

    def summary_rows(self) -> list[dict[str, Any]]:
        return [{k: getattr(e, k) for k in SUMMARY_FIELDS} for e in self.results]

    def to_dict(self) -> dict:
        return {
            "environment": self.environment,
            "settings": self.settings,
            "results": self.summary_rows(),
            "prompts": self.prompts,
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def csv(self) -> str:
        rows = self.summary_rows()
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=list(SUMMARY_FIELDS))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: json.dumps(v) if isinstance(v, dict) else v for k, v in row.items()})
        return buf.getvalue()

    def by_prompt_set(self) -> list[str]:
        """When the prompts mix the bundled sets and the OOD set: speedup over ar and tokens per
        iteration on each side, from the per-prompt rows (means over that side's prompts)."""
        side = lambda row: "OOD" if str(row["domain"]).startswith(OOD_PREFIX) else "in-distribution"  # noqa: E731
        sides = sorted({side(r) for r in self.prompts}, reverse=True)
        if len(sides) < 2:
            return []
        mean = lambda vals: statistics.fmean(vals) if vals else 0.0  # noqa: E731
        per: dict[tuple[str, str], tuple[float, float]] = {}
        for label in dict.fromkeys(r["label"] for r in self.prompts):
            for name in sides:
                rows = [r for r in self.prompts if r["label"] == label and side(r) == name]
                per[label, name] = (
                    mean([r["throughput_tps"] for r in rows]),
                    mean([r["tokens_per_iteration"] for r in rows]),
                )
        out = ["", "| policy | " + " | ".join(f"{s} speedup | {s} tokens / iteration" for s in sides) + " |"]
        out.append("|---|" + "---|---|" * len(sides))
        for label in dict.fromkeys(r["label"] for r in self.prompts):
            cells = []
            for name in sides:
                base = per.get(("ar", name), (0.0, 0.0))[0]
                tps, tpi = per[label, name]
                cells.append(f"{tps / base:.2f} | {tpi:.2f}" if base else f"- | {tpi:.2f}")
            out.append(f"| {label} | " + " | ".join(cells) + " |")
        return out

    def markdown(self) -> str:
        out = [
            "| policy | family | verifier | tokens / s | speedup | tokens / iteration | acceptance | accepted length "
            "| TTFT ms | TPOT ms | draft / verify / other ms per iteration | outside forwards | peak MB | exact |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for e in self.results:
            split = (
                "-"
                if e.tree_size_mean is None
                else f"{e.draft_ms_per_iteration:.1f} / {e.verify_ms_per_iteration:.1f} / "
                f"{e.overhead_ms_per_iteration:.1f}"
            )
            exact = f"{e.exact}/{e.runs}" if e.exact is not None else "n/a (sampled)"
            ttft = "-" if e.ttft_ms is None else f"{e.ttft_ms:.0f}"
            outside = "-" if e.outside_forwards_share is None else f"{e.outside_forwards_share:.1%}"
            tpot = "-" if e.tpot_ms is None else f"{e.tpot_ms:.1f}"
            out.append(
                f"| {e.label} | {e.family} | {e.verifier} | {e.throughput_tps:.1f} ± {e.throughput_std:.1f} | "
                f"{e.speedup:.2f} | "
                f"{e.tokens_per_iteration:.2f} | {e.acceptance_rate:.2f} | {e.mean_accepted_length:.2f} | {ttft} | "
                f"{tpot} | {split} | {outside} | {e.peak_memory_mb:.0f} | {exact} |"
            )
        out += self.by_prompt_set()
        paths = self.environment.get("forward_paths") or []
        note = exactness_note(self.environment.get("dtype", "float32"), paths)
        if paths:
            captured = self.environment.get("capture_s") or 0.0
            out.append(
                f"\nForwards: {'; '.join(paths)}"
                + (f" (graph capture {captured:.1f} s, not timed)" if captured else "")
            )
        return "\n".join(out + ([f"\n{note}"] if note else []))


def run_bench(
    pair,
    entries: list[Entry],
    prompts: list[Prompt],
    *,
    config: DecodeConfig,
    repeats: int = 1,
    warmup: int = 1,
    include_hf: bool = True,
    max_prompt_tokens: int | None = None,
    progress=None,
    device: str = "",
    dtype: str = "",
    workers=None,
) -> BenchReport:
    """`workers` (cluster.Workers, started): the runs go to Ray actors, the report is the same."""
    tokenizer = pair.target.tokenizer
    ids = encode_prompts(tokenizer, prompts, max_prompt_tokens)
    stats, results = measure(
        pair,
        entries,
        ids,
        config=config,
        repetitions=repeats,
        warmup=warmup,
        include_hf=include_hf,
        on_progress=progress,
        workers=workers,
    )
    rows = []
    for s, rounds in zip(stats, results, strict=True):
        for i, prompt in enumerate(prompts):
            runs = [rnd[i] for rnd in rounds]
            iterations = sum(r.iterations for r in runs)
            rows.append(
                {
                    "label": s.label,
                    "policy": s.policy,
                    "prompt": i,
                    "domain": prompt.domain,
                    "prompt_tokens": len(ids[i]),
                    "new_tokens": statistics.fmean(r.new_tokens for r in runs),
                    "throughput_tps": statistics.fmean(r.throughput_tps for r in runs),
                    "tokens_per_iteration": sum(r.new_tokens for r in runs) / iterations if iterations else 0.0,
                    "acceptance_rate": statistics.fmean(r.acceptance_rate for r in runs),
                    "exact": None
                    if not config.sampling.greedy
                    else all(r.token_ids == results[0][0][i].token_ids for r in runs),
                }
            )
    device = device or str(pair.target.model.device)
    dtype = dtype or str(pair.target.model.dtype).removeprefix("torch.")
    settings = {
        "prompts": len(prompts),
        "domains": sorted({p.domain for p in prompts}),
        "max_new_tokens": config.max_new_tokens,
        "max_prompt_tokens": max_prompt_tokens,
        "repeats": repeats,
        "warmup": warmup,
        "temperature": config.sampling.temperature,
        "top_p": config.sampling.top_p,
        "top_k": config.sampling.top_k,
        "verifier": config.verifier,
        "seed": config.seed,
    }
    env = environment(device, dtype, is_packed(pair.target.model), getattr(pair, "dtype_source", ""))
    runs = [r for rounds in results for rnd in rounds for r in rnd]
    env["forward_paths"] = sorted({r.forward_path for r in runs if r.forward_path})  # a capture fallback says why
    env["capture_s"] = round(sum(r.capture_s for r in runs), 3)  # CUDA graph capture, outside every timing
    if workers is not None:  # where the runs ran: each worker's host, device and threads
        env["workers"] = workers.places
    return BenchReport(env, settings, stats, rows)


def parse_sweep(spec: str) -> tuple[str, list[str]]:
    """'depth=3..8' (integer range, inclusive) or 'tau=0.01,0.03,0.1' -> (name, values)."""
    name, eq, values = spec.partition("=")
    if not eq or not name.strip() or not values.strip():
        raise DynaTreeError(f"--sweep expects NAME=A..B or NAME=V1,V2,..., got {spec!r}")
    if ".." in values:
        lo, _, hi = values.partition("..")
        try:
            start, stop = int(lo), int(hi)
        except ValueError as exc:
            raise DynaTreeError(f"--sweep {spec!r}: a range takes integers (A..B)") from exc
        if stop < start:
            raise DynaTreeError(f"--sweep {spec!r}: empty range")
        return name.strip(), [str(v) for v in range(start, stop + 1)]
    return name.strip(), [v.strip() for v in values.split(",") if v.strip()]


# run settings a sweep may vary (the papers' sequence-length and prompt-length figures), by alias
SETTINGS = {"T": "max_new_tokens", "max_new_tokens": "max_new_tokens", "L_max": "max_prompt_tokens",
            "max_prompt_tokens": "max_prompt_tokens"}  # fmt: skip


def split_sweeps(
    sweeps: list[tuple[str, list[str]]],
) -> tuple[tuple[str, list[int]] | None, list[tuple[str, list[str]]]]:
    """Separate a sweep over a run setting (T or L_max: at most one, integer values) from the
    sweeps over policy parameters."""
    settings = [(name, values) for name, values in sweeps if name in SETTINGS]
    if len(settings) > 1:
        raise DynaTreeError("sweep one run setting (T or L_max) at a time")
    setting = None
    if settings:
        name, values = settings[0]
        try:
            ints = [int(v) for v in values]
        except ValueError as exc:
            raise DynaTreeError(f"--sweep {name}: values must be integers") from exc
        if min(ints) < 1:
            raise DynaTreeError(f"--sweep {name}: values must be at least 1")
        setting = (name, ints)
    return setting, [(n, v) for n, v in sweeps if n not in SETTINGS]


def sweep_entries(policy: str, sweeps: list[tuple[str, list[str]]], base: dict[str, str] | None = None) -> list[Entry]:
    """One parameter at a time around the registry defaults (plus `base`), as the DynaTree papers'
    figures vary it; each entry is labelled 'name=value'."""

    base = dict(base or {})
    entries = []
    for name, values in sweeps:
        for value in values:
            params = {**base, name: value}
            make_method(policy, params)  # unknown names and out-of-range values fail here, before any run
            entries.append(Entry(policy, params, label=f"{policy} {name}={value}"))
    return entries


def grid_entries(policy: str, sweeps: list[tuple[str, list[str]]], base: dict[str, str] | None = None) -> list[Entry]:
    """Every combination of the swept values (the papers' sparse tau_h / tau_l scatter uses two);
    each entry is labelled 'policy a=1,b=2'. Combinations the policy rejects are skipped."""
    names = [name for name, _ in sweeps]
    known = {p.name for p in method_class(policy).params}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise DynaTreeError(f"policy {policy!r} has no parameter {', '.join(unknown)} (valid: {', '.join(known)})")
    entries = []
    for combo in itertools.product(*(values for _, values in sweeps)):
        params = {**(base or {}), **dict(zip(names, combo, strict=True))}
        try:
            make_method(policy, params)
        except DynaTreeError:
            continue  # a combination the policy rejects, e.g. tau_l above tau_h
        label = f"{policy} " + ",".join(f"{n}={v}" for n, v in zip(names, combo, strict=True))
        entries.append(Entry(policy, params, label=label))
    if not entries:
        raise DynaTreeError("no combination of the swept values is valid for " + policy)
    return entries


def run_setting_sweep(pair, entries: list[Entry], prompts: list[Prompt], *, config: DecodeConfig, setting: str,
                      values: list[int], progress=None, **kwargs) -> BenchReport:  # fmt: skip
    """One benchmark per value of a run setting (T or L_max), merged into one report: every row
    is labelled 'label T=128' and keeps its speedup over the references of its own value."""
    field = SETTINGS[setting]
    merged: BenchReport | None = None
    for i, value in enumerate(values):
        cfg = dataclasses.replace(config, max_new_tokens=value) if field == "max_new_tokens" else config
        if field == "max_prompt_tokens":
            kwargs["max_prompt_tokens"] = value

        def step(done, total, label, i=i, value=value):
            if progress:
                progress(i * total + done, len(values) * total, f"{setting}={value}: {label}")

        report = run_bench(pair, entries, prompts, config=cfg, progress=step, **kwargs)
        for e in report.results:
            e.label = f"{e.label} {setting}={value}"
            e.params = {**e.params, setting: value}
        for row in report.prompts:
            row["label"] = f"{row['label']} {setting}={value}"
            row[setting] = value
        if merged is None:
            merged = report
            merged.settings[field] = values
        else:
            merged.results += report.results
            merged.prompts += report.prompts
    assert merged is not None
    return merged
