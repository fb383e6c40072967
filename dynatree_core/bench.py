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
import json
import os
import platform
import statistics
import sys
from typing import Any

from dynatree_core.compare import Entry, EntryStats, measure
from dynatree_core.engine import DecodeConfig
from dynatree_core.errors import DynaTreeError
from dynatree_core.prompts import Prompt
from dynatree_core.session import encode_prompt

SUMMARY_FIELDS = (
    "label", "policy", "verifier", "params", "throughput_tps", "throughput_std", "speedup", "tokens_per_iteration",
    "acceptance_rate", "mean_accepted_length", "iterations", "ttft_ms", "tpot_ms", "draft_ms_per_iteration",
    "verify_ms_per_iteration", "overhead_ms_per_iteration", "peak_memory_mb", "memory_overhead", "tree_size_mean",
    "tree_size_max", "exact", "runs", "outside_forwards_share",
)  # fmt: skip


def parse_spec(spec: str) -> tuple[str, dict[str, str], str]:
    """'name', 'name:key=value,key=value', either with '@verifier' appended."""
    spec, _, verifier = spec.partition("@")
    name, _, rest = spec.partition(":")
    params = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise DynaTreeError(f"policy spec {spec!r}: expected key=value, got {item!r}")
        params[key.strip()] = value.strip()
    return name.strip(), params, verifier.strip() or "auto"


def environment(device: str, dtype: str) -> dict[str, Any]:
    """What a result was measured on: hardware, library versions, threads, device and dtype."""
    import torch
    import transformers

    cpu, flags = platform.processor() or "unknown", ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            info = f.read()
        cpu = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), cpu)
        flags = next((ln for ln in info.splitlines() if ln.startswith("flags")), "")
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "amx_bf16": "amx_bf16" in flags.split(),
        "avx512_bf16": "avx512_bf16" in flags.split(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
        "device": device,
        "dtype": dtype,
        "platform": platform.platform(),
    }


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
        out.append(encode_prompt(tokenizer, text, chat=p.chat))
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

    def markdown(self) -> str:
        out = [
            "| policy | verifier | tokens / s | speedup | tokens / iteration | acceptance | accepted length "
            "| TTFT ms | TPOT ms | draft / verify / other ms per iteration | outside forwards | peak MB | exact |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
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
                f"| {e.label} | {e.verifier} | {e.throughput_tps:.1f} ± {e.throughput_std:.1f} | {e.speedup:.2f} | "
                f"{e.tokens_per_iteration:.2f} | {e.acceptance_rate:.2f} | {e.mean_accepted_length:.2f} | {ttft} | "
                f"{tpot} | {split} | {outside} | {e.peak_memory_mb:.0f} | {exact} |"
            )
        return "\n".join(out)


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
) -> BenchReport:
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
    return BenchReport(environment(device, dtype), settings, stats, rows)


def stderr_progress(done: int, total: int, label: str) -> None:
    width = 30
    filled = int(width * done / total)
    print(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<48}", end="", file=sys.stderr, flush=True)


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


def sweep_entries(policy: str, sweeps: list[tuple[str, list[str]]], base: dict[str, str] | None = None) -> list[Entry]:
    """One parameter at a time around the registry defaults (plus `base`), as the DynaTree papers'
    figures vary it; each entry is labelled 'name=value'."""
    from dynatree_core.drafting import make_policy

    base = dict(base or {})
    entries = []
    for name, values in sweeps:
        for value in values:
            params = {**base, name: value}
            make_policy(policy, params)  # unknown names and out-of-range values fail here, before any run
            entries.append(Entry(policy, params, label=f"{policy} {name}={value}"))
    return entries


def sweep_figures(report: BenchReport, sweeps: list[tuple[str, list[str]]]):
    """Throughput (± std over rounds) and tokens per iteration against each swept parameter, with
    the best reference's throughput as a dashed line (one figure per parameter)."""
    from plotly.subplots import make_subplots

    refs = [e for e in report.results if e.reference]
    best_ref = max(refs, key=lambda e: e.throughput_tps) if refs else None
    figures = {}
    for name, values in sweeps:
        rows = [
            e for e in report.results if not e.reference and e.label.endswith(tuple(f" {name}={v}" for v in values))
        ]
        xs = [e.label.rsplit("=", 1)[1] for e in rows]
        fig = make_subplots(specs=[[{"secondary_y": True}]])
        fig.add_scatter(
            x=xs,
            y=[e.throughput_tps for e in rows],
            error_y=dict(type="data", array=[e.throughput_std for e in rows]),
            mode="lines+markers",
            name="tokens / s",
        )
        fig.add_scatter(
            x=xs, y=[e.tokens_per_iteration for e in rows], mode="lines+markers", name="tokens / iteration",
            secondary_y=True,
        )  # fmt: skip
        if best_ref is not None:
            fig.add_hline(y=best_ref.throughput_tps, line_dash="dash", annotation_text=best_ref.label)
        policy = rows[0].policy if rows else ""
        fig.update_layout(title=f"{policy}: throughput vs {name}", xaxis_title=name, height=380, xaxis_type="category")
        fig.update_yaxes(title_text="tokens / s", secondary_y=False)
        fig.update_yaxes(title_text="tokens / iteration", secondary_y=True)
        figures[name] = fig
    return figures
