"""Fit each tree policy's defaults on out-of-distribution prompts, measured on this machine.

    PYTHONPATH=. .venv/bin/python -m benchmarks.ood_defaults [--policies fixed_tree,salf] [--out DIR]

Tuning prompts: the OOD set (assets/prompts/ood/, sources no draft trains on), round-robin prompts
9-16 (`bench --prompts ood --skip 8 --limit 8`: the second prompt of each category), so the first
eight, which BENCHMARKS reports, never choose a default. For each policy, two `bench` runs:

1. one parameter at a time around the registry defaults (`bench --sweep-policy P --sweep a=... `),
   every value on the same prompts in one process; the best value of each parameter (by total
   tokens / s) is kept when it beats the default's own row by more than --margin;
2. the defaults against that combination, again in one run (the parameters interact): the faster
   one is the measured best, written to DIR/ood-defaults.json with every number behind it.

Greedy, 128 new tokens, the `embedded` pair. Nothing else may run meanwhile (each bench takes the
machine's cores). The registry defaults are then edited by hand to the measured best.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchmarks import RESULTS, ROOT

# the main parameters of each tree policy and the values tried (each list holds the default)
GRIDS = {
    "fixed_tree": {"depth": "3,4,5,6,8", "branch": "1,2,3", "tau": "0.01,0.03,0.1,0.2", "budget": "8,12,16,32"},
    "dynatree": {"d0": "3,4,5,6", "tau_h": "0.7,0.9,0.95", "b_max": "2,3,4", "budget": "12,16,32"},
    "salf": {"nodes": "6,8,12,16,32", "batch": "4,8,16", "th": "0.3,0.6,0.8"},
    "eagle2": {"depth": "3,4,6", "topk": "2,4,6", "total": "8,12,16,24"},
    "dyspec_threshold": {"threshold": "0.02,0.05,0.1,0.2", "budget": "12,16,32", "max_children": "4,8"},
    "dyspec": {"budget": "2,3,4,8,12", "batch": "4,8"},
    "delayed_auto": {"k_max": "2,4", "l1_max": "4,6", "l2_max": "3,6"},
    "recycle": {"k": "4,8,16", "depth": "4,6,8", "budget": "6,8,10,12,16,24"},
    "suffix": {"min_match": "1,2,3,4", "depth": "4,8,16", "branches": "1,2,4", "budget": "8,16,32"},
    "joined_fixed_tree": {"retrieved": "0,4,8,16", "recycled": "0,4,8,16"},
    "joined_dynatree": {"retrieved": "0,4,8,16", "recycled": "0,4,8,16"},
}


def bench(args: argparse.Namespace, extra: list[str], out: Path) -> dict:
    cmd = [sys.executable, "-m", "dynatree_core", "bench", "--prompts", "ood", "--skip", str(args.skip),
           "--limit", str(args.limit), "--max-new-tokens", str(args.tokens), "--preset", args.preset,
           "--no-hf", "--out", str(out), *extra]  # fmt: skip
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def fit(policy: str, args: argparse.Namespace, defaults: dict) -> dict:
    sweeps = [x for name, values in GRIDS[policy].items() for x in ("--sweep", f"{name}={values}")]
    first = bench(args, ["--policies", "ar", "--sweep-policy", policy, *sweeps], args.out / f"{policy}-sweep.json")
    rows = {r["label"]: r for r in first["results"] if r["policy"] == policy}
    chosen = {}
    for name, values in GRIDS[policy].items():
        base = rows[f"{policy} {name}={_fmt(defaults[name])}"]["throughput_tps"]
        best = max(values.split(","), key=lambda v: rows[f"{policy} {name}={v}"]["throughput_tps"])
        if rows[f"{policy} {name}={best}"]["throughput_tps"] > base * (1 + args.margin):
            chosen[name] = best
    result = {"policy": policy, "defaults": defaults, "sweep": first["results"], "candidate": chosen}
    if chosen:
        spec = policy + ":" + ",".join(f"{k}={v}" for k, v in chosen.items())
        second = bench(args, ["--policies", f"ar,{policy}", "--policy", spec], args.out / f"{policy}-check.json")
        by = {r["label"]: r for r in second["results"]}
        tuned = next(r for r in second["results"] if r["label"] != policy and r["policy"] == policy)
        result["check"] = second["results"]
        result["best"] = chosen if tuned["throughput_tps"] > by[policy]["throughput_tps"] else {}
    else:
        result["best"] = {}
    return result


def _fmt(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default=",".join(GRIDS))
    parser.add_argument("--preset", default="embedded")
    parser.add_argument("--skip", type=int, default=8)
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--margin", type=float, default=0.03, help="a value must beat the default by this share")
    parser.add_argument("--out", type=Path, default=RESULTS / "ood-defaults")
    args = parser.parse_args(argv)
    from dynatree_core.decoding.methods import method_class

    args.out.mkdir(parents=True, exist_ok=True)
    summary_path = args.out / "ood-defaults.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    for policy in [p.strip() for p in args.policies.split(",") if p.strip()]:
        if policy in summary:  # resumable: a finished policy is not measured again
            continue
        defaults = {p.name: p.default for p in method_class(policy).params}
        summary[policy] = fit(policy, args, defaults)
        summary_path.write_text(json.dumps(summary, indent=1))
        print(f"{policy}: measured best {summary[policy]['best'] or 'the current defaults'}", flush=True)


if __name__ == "__main__":
    main()
