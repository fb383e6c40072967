"""Whether a newly trained feature draft ships: it against the shipped one, in one process.

    PYTHONPATH=. .venv/bin/python -m benchmarks.draft_merit --candidate DIR [--shipped DIR] [--out FILE.json]

Both drafts (feature drafts of the embedded target, e.g. a `draft-gpu` run's `export/`) are
measured the same way, one after the other, in this process, nothing else running:

1. OOD agreement by depth: top-1 agreement with the target's greedy token on the target's own
   answers to the OOD prompt set (the committed `assets/draft-data/ood-answers`; their features
   are recomputed teacher-forced into the cache where this machine lacks them);
2. the CPU OOD headline (ood_headline.headline: OOD prompts 1-8, 128 tokens, greedy; speedup over
   the faster of `ar` and HF generate; tokens per iteration);
3. the README example (`compare --prompt "Why is the sky blue?"` with its four policies, 64
   tokens, 3 repetitions): each policy's tokens / s over `ar`'s.

The candidate is **ahead** when its OOD agreement is higher at depths 1, 2 and 3 and its best
headline speedup is higher; only then is it shipped (`export-feature` into
assets/models/smollm2-feature-draft) and the defaults refit (ood_defaults.py). The goals the draft
at scale set are printed met or not, for both drafts (docs/training.md, "The one-sitting GPU recipe").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks import RESULTS, ROOT
from benchmarks.ood_headline import headline
from dynatree_core.drafts.feature import CONFIG_FILE

SHIPPED = ROOT / "assets" / "models" / "smollm2-feature-draft"
README_PROMPT = "Why is the sky blue?"
README_POLICIES = ("linear", "fixed_tree", "dynatree", "salf")
# (name, key into a draft's summary, the goal, its moonshot)
GOALS = (
    ("OOD agreement, depth 1", "ood_depth1", 0.70, 0.75),
    ("OOD agreement, depth 3", "ood_depth3", 0.60, 0.65),
    ("CPU OOD headline: best tree policy over the faster of ar / HF generate", "best_speedup", 1.9, 2.2),
    ("fixed_tree tokens per iteration", "fixed_tree_tpi", 2.4, None),
    ("README example: the slowest tree policy over ar", "readme_min_over_ar", 1.4, None),
)


def ood_agreement(drafts: dict[str, str]) -> dict[str, list[float]]:
    """Agreement by depth of each draft on the target's OOD answers ({name: [depth 1, 2, 3, 4]})."""
    from dynatree_core.core.models import load_model
    from dynatree_core.runs.environment import portable
    from dynatree_core.training.answers.store import AnswerStore, relabel
    from dynatree_core.training.answers.windows import AnswerCorpus, agreement_report
    from dynatree_core.training.cli import answer_dirs

    target = load_model("embedded", device="cpu", dtype="float32")
    store = AnswerStore(*answer_dirs("embedded", ood=True))
    relabel(store, target, stages=("ood",))  # features this machine lacks; nothing when present
    ood = AnswerCorpus(store, stages=("ood",), heldout=True)
    report = agreement_report(target.model, list(drafts.values()), None, {"ood": (ood, ood.eval_rows)})["ood"]
    by_path = {k: v["agreement_by_depth"] for k, v in report.items() if isinstance(v, dict)}
    return {name: by_path[portable(str(path))] for name, path in drafts.items()}


def readme_example(drafts: dict[str, str], repetitions: int = 3) -> dict[str, dict[str, float]]:
    """The README's `compare` with each draft: {name: {policy: tokens/s over ar's}}."""
    from dynatree_core.decoding.engine import DecodeConfig
    from dynatree_core.decoding.pairs import encode_prompt, load_pair
    from dynatree_core.measure.compare import compare
    from dynatree_core.measure.entries import Entry

    out = {}
    for name, path in drafts.items():
        pair = load_pair("embedded", path, dtype="float32")
        target = pair.target
        ids = encode_prompt(target.tokenizer, README_PROMPT, chat=target.has_chat_template)
        config = DecodeConfig(eos_token_ids=target.eos_token_ids, context_length=target.context_length)
        result = compare(pair, [Entry(p) for p in README_POLICIES], ids, config=config, repetitions=repetitions)
        tps = {e.policy: e.throughput_tps for e in result.entries}
        out[name] = {p: round(tps[p] / tps["ar"], 3) for p in README_POLICIES} | {"ar_tps": tps["ar"]}
        print(f"README example, {name}: {out[name]}", flush=True)
    return out


def summary(agreement: list[float], passes: dict, readme: dict[str, float], prompts: int) -> dict[str, float]:
    """The numbers the verdict and the goals read, for one draft."""
    policies = passes["policies"]
    return {
        "ood_depth1": agreement[0],
        "ood_depth2": agreement[1],
        "ood_depth3": agreement[2],
        "best_speedup": max(p["speedup_vs_faster_of_ar_hf"] for name, p in policies.items() if name != "linear"),
        "fixed_tree_tpi": policies["fixed_tree"]["tokens_per_iteration"],
        "readme_min_over_ar": min(readme[p] for p in README_POLICIES if p != "linear"),
        "every_row_exact": all(p["exact"] == prompts for p in policies.values()),
    }


def verdict(shipped: dict[str, float], candidate: dict[str, float]) -> bool:
    """Ahead: higher OOD agreement at depths 1-3 and a higher best headline speedup."""
    keys = ("ood_depth1", "ood_depth2", "ood_depth3", "best_speedup")
    return all(candidate[k] > shipped[k] for k in keys)


def goals_table(rows: dict[str, dict[str, float]]) -> str:
    names = list(rows)
    lines = ["| goal | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label, key, goal, moon in GOALS:
        cells = []
        for name in names:
            value = rows[name][key]
            met = "met" if value >= goal else "not met"
            cells.append(f"{value:.3f} ({met}{'; moonshot met' if moon and value >= moon else ''})")
        lines.append(f"| {label} >= {goal} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidate", type=Path, required=True, help="the new feature draft's directory")
    parser.add_argument("--shipped", type=Path, default=SHIPPED)
    parser.add_argument("--limit", type=int, default=8, help="OOD prompts in the headline")
    parser.add_argument("--out", type=Path, default=RESULTS / "cpu-draft-merit.json")
    args = parser.parse_args(argv)
    for path in (args.candidate, args.shipped):
        if not (path / CONFIG_FILE).exists():
            raise SystemExit(f"{path}: not a saved feature draft (no {CONFIG_FILE})")
    drafts = {"shipped": str(args.shipped), "candidate": str(args.candidate)}
    agreement = ood_agreement(drafts)
    print(f"OOD agreement by depth: {agreement}", flush=True)
    passes = headline(drafts, limit=args.limit)
    readme = readme_example(drafts)
    rows = {name: summary(agreement[name], passes["passes"][name], readme[name], args.limit) for name in drafts}
    ahead = verdict(rows["shipped"], rows["candidate"])
    result = {"drafts": drafts, "agreement": agreement, "headline": passes, "readme": readme, "summary": rows}
    result["candidate_ahead"] = ahead
    args.out.write_text(json.dumps(result, indent=1))
    print(goals_table(rows))
    print("candidate ahead: ship it, refit the defaults" if ahead else "candidate not ahead: the shipped draft stays")


if __name__ == "__main__":
    main()
