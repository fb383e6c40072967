"""BENCHMARKS' headline: each draft of the embedded target on the OOD prompts, in one process.

    PYTHONPATH=. .venv/bin/python -m benchmarks.ood_headline [--out FILE.json] [--limit 8]

The OOD set (assets/prompts/ood/, sources no draft trains on), its first --limit prompts taken
round-robin over the categories (the ones `bench --prompts ood --limit 8` reports; the defaults
were fitted on the next eight, ood_defaults.py). For each draft (the token draft, the first
feature draft, the shipped feature draft, or those given by --draft NAME=DIR), one `bench` pass
over the same prompts with ar and the tree policies at their registry defaults, greedy; HF
`generate` once, in the first pass. Speedup = a policy's tokens / s over the faster of that
pass's ar and HF generate. Nothing else may run meanwhile.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks import RESULTS, ROOT
from dynatree_core.core.presets import EMBEDDED
from dynatree_core.decoding.engine import DecodeConfig
from dynatree_core.decoding.pairs import load_pair
from dynatree_core.measure.bench import run_bench
from dynatree_core.measure.entries import Entry
from dynatree_core.measure.prompt_sets import choose_prompts

MODELS = ROOT / "assets" / "models"
DRAFTS = {
    "token draft": MODELS / "smollm2-draft",
    "first feature draft": MODELS / "smollm2-feature-draft-corpus",
    "shipped feature draft": MODELS / "smollm2-feature-draft",
}
POLICIES = ("linear", "fixed_tree", "dynatree", "salf", "eagle2", "dyspec_threshold", "dyspec", "delayed_auto")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--draft", action="append", default=[], help="NAME=DIR (repeatable): instead of the three")
    parser.add_argument("--out", type=Path, default=RESULTS / "cpu-ood-headline.json")
    args = parser.parse_args(argv)
    drafts = dict(d.split("=", 1) for d in args.draft) if args.draft else {k: str(v) for k, v in DRAFTS.items()}
    result = headline(drafts, limit=args.limit, tokens=args.tokens, dtype=args.dtype)
    args.out.write_text(json.dumps(result, indent=1))
    print(markdown(result))


def headline(drafts: dict[str, str], *, limit: int = 8, tokens: int = 128, dtype: str = "float32") -> dict:
    """One `bench` pass per draft ({name: directory}) over the same OOD prompts, in this process;
    HF generate runs in the first pass only, and every speedup is over the faster of it and that
    pass's `ar`."""
    prompts = choose_prompts("ood", limit)
    entries = [Entry(p) for p in POLICIES]
    passes, hf_tps = {}, None
    for i, (name, path) in enumerate(drafts.items()):
        pair = load_pair(EMBEDDED, path, dtype=dtype)
        config = DecodeConfig(
            max_new_tokens=tokens,
            eos_token_ids=pair.target.eos_token_ids,
            context_length=pair.target.context_length,
        )
        print(f"{name}: {len(prompts)} prompts, {tokens} tokens", flush=True)
        report = run_bench(pair, entries, prompts, config=config, include_hf=i == 0)
        rows = {r["policy"]: r for r in report.summary_rows()}
        hf_tps = rows["hf_generate"]["throughput_tps"] if i == 0 else hf_tps
        base = max(rows["ar"]["throughput_tps"], hf_tps or 0.0)
        where = Path(path).resolve()
        passes[name] = {
            "draft": str(where.relative_to(ROOT)) if where.is_relative_to(ROOT) else name,
            "ar_tps": rows["ar"]["throughput_tps"],
            "policies": {
                p: {
                    "tokens_per_s": rows[p]["throughput_tps"],
                    "speedup_vs_faster_of_ar_hf": round(rows[p]["throughput_tps"] / base, 3),
                    "tokens_per_iteration": rows[p]["tokens_per_iteration"],
                    "exact": rows[p]["exact"],
                }
                for p in POLICIES
            },
            "report": report.to_dict(),
        }
        print(json.dumps({k: v for k, v in passes[name].items() if k != "report"}), flush=True)
    return {"hf_generate_tps": hf_tps, "prompts": limit, "max_new_tokens": tokens, "passes": passes}


def markdown(result: dict) -> str:
    names = list(result["passes"])
    out = ["| policy | " + " | ".join(f"{n}: speedup, tokens / iteration" for n in names) + " |"]
    out.append("|---|" + "---|" * len(names))
    for p in POLICIES:
        cells = []
        for n in names:
            row = result["passes"][n]["policies"][p]
            cells.append(f"{row['speedup_vs_faster_of_ar_hf']:.2f}x, {row['tokens_per_iteration']:.2f}")
        out.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
