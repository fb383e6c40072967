"""Ship a trained feature draft: bfloat16 weights (no head rows) and its model card.

The card says what the draft is, what it was trained on (each source's prompts and tokens, the
positions it trained on and how many passes over them), how (loss, schedule, steps, wall time, the
starting draft) and how well it agrees with the target by tree depth, in distribution and on the
out-of-distribution prompt set (`feature-quality --answers --out`), with the command that made it.
Paths in it are written relative to the repository or home (runs/environment.portable).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dynatree_core.core.models import REPO_ROOT
from dynatree_core.drafts.fused import target_rows
from dynatree_core.drafts.heads import load_head
from dynatree_core.runs.environment import portable
from dynatree_core.training.ledger import totals


def _packed_loss_line(cfg: dict, kind: str) -> str:
    """The loss of a `train-packed` run (training/step.py)."""
    ce = "soft cross-entropy to the compact teacher (the target's top-32, renormalised over the map)"
    share = f" over a random {cfg['ce_share']:.0%} of the answer positions" if cfg.get("ce_share", 1) < 1 else ""
    level = (
        f"{ce}{share}"
        if kind == "fused"
        else f"{cfg['regression_weight']} x smooth L1 to the target's next feature + {cfg['ce_weight']} x {ce}{share}"
    )
    if cfg.get("levels", 1) > 1:
        return (
            f"- loss: unrolled over the draft's own outputs for {cfg['levels']} levels (training-time test; level k "
            f"weighted {cfg['level_decay']}^(k-1)); each level: {level}"
        )
    return f"- loss: {level}"


def _loss_line(cfg: dict) -> str:
    kd = (
        "smooth L1 to the target's next feature + "
        f"{cfg['ce_weight']} x soft cross-entropy to head(next feature) over the reduced vocabulary"
        + (f", taken over a random {cfg['ce_share']:.0%} of positions" if cfg.get("ce_share", 1) < 1 else "")
    )
    if cfg.get("loss") == "unrolled":
        return (
            f"- loss: unrolled over the draft's own predicted features for {cfg['unroll_steps']} levels "
            f"(training-time test, EAGLE-3 / HASS; level k weighted {cfg['unroll_decay']}^(k-1)); each level: {kd}"
        )
    return f"- loss ({cfg.get('loss', 'kd')}): {kd}"


def _data_lines(info: dict, curve: list[dict], staged: bool = False) -> list[str]:
    data = info.get("data")
    if not data or "sources" not in data:
        cfg = info["config"]
        return [
            f"- data: the committed corpus's windows whose target features were labelled; {cfg['onpolicy_share']:.0%} "
            "of each batch from the target's own sampled generations; chunk 0 held out"
        ]
    seen = curve[-1].get("seen", 0) if curve else 0
    positions = data.get("training_answer_positions", 0)
    lines = [
        "- data: the target's own answers (ids and final hidden states, `python -m dynatree_core.training "
        "answers`) to prompts from these offline sources; about one sequence in 50 held out (in-distribution "
        "check); the out-of-distribution prompt set (`assets/prompts/ood/`) is never trained on",
        f"- trained on {data['training_windows']} windows, {positions:,} answer positions "
        f"(the loss positions; {data['training_positions']:,} with the prompts as context); "
        f"{seen:,} loss positions seen = **{seen / max(positions, 1):.2f} passes**"
        + (f"; started from `{data['init_from']}`" if data.get("init_from") and not staged else ""),
        "",
        "| source | prompts | prompt tokens | answer tokens |",
        "|---|---|---|---|",
    ]
    rows = sorted(data["sources"].items(), key=lambda kv: -kv[1]["answer_tokens"])
    lines += [f"| {k} | {v['prompts']:,} | {v['prompt_tokens']:,} | {v['answer_tokens']:,} |" for k, v in rows]
    total = {k: sum(v[k] for _, v in rows) for k in ("prompts", "prompt_tokens", "answer_tokens")}
    lines += [f"| **all** | {total['prompts']:,} | {total['prompt_tokens']:,} | {total['answer_tokens']:,} |", ""]
    if any(k.startswith("written-") for k in data["sources"]):
        lines += [
            "Rows `written-*` are human-written text, not the target's answers (training/written.py): documentation, "
            "manual pages, code and fortunes as the assistant's turn after a short request, passed once through the "
            "target teacher-forced; the loss still follows the target's own next-token distribution there.",
            "",
        ]
    return lines


def _chain(run_dir: Path, info: dict) -> list[tuple[Path, dict]]:
    """The run and the runs it started from, oldest first, while each start is a run folder's
    `draft` with its curve.json beside it (a draft trained in stages)."""
    chain = [(run_dir, info)]
    while len(chain) < 16:
        start = (chain[-1][1].get("data") or {}).get("init_from")
        path = Path(start).expanduser() if start else None
        if path is None or path.name != "draft" or not (path.parent / "curve.json").exists():
            break
        chain.append((path.parent, json.loads((path.parent / "curve.json").read_text())))
    return chain[::-1]


def _loss_name(cfg: dict) -> str:
    if "levels" in cfg:  # a train-packed run
        return "kd" if cfg["levels"] == 1 else f"unrolled ({cfg['levels']} levels)"
    return cfg.get("loss", "kd")


def _device(cfg: dict) -> str:
    """Where a run trained, from its config (runs before the key existed trained on the CPU)."""
    device = str(cfg.get("device") or "cpu")
    return "CPU" if device == "cpu" else f"GPU ({device})" if device.startswith("cuda") else device


def _stages(chain: list[tuple[Path, dict]], run_dir: Path, first_start: str | None = None) -> list[str]:
    """A draft trained in stages (`chain`, from `_chain`): one row per run, oldest first; the first
    row says what the first stage started from (`first_start`, else its init_from, or nothing)."""
    if len(chain) < 2:
        return []
    lines = ["", "Trained in stages, each from the previous stage's weights:", ""]
    lines += [
        "| stage | loss | steps | training s | passes | trained on | started from |",
        "|---|---|---|---|---|---|---|",
    ]
    for k, (folder, part) in enumerate(chain, 1):
        data, last = part.get("data") or {}, (part["curve"] or [{}])[-1]
        passes = last.get("seen", 0) / max(data.get("training_answer_positions", 0), 1)
        start = (
            "the previous stage"
            if k > 1
            else first_start or f"`{data['init_from']}`"
            if data.get("init_from")
            else "random initialisation"
        )
        name = "this run" if folder == run_dir else folder.name
        lines.append(
            f"| {k} ({name}) | {_loss_name(part['config'])} | {last.get('step', 0)} "
            f"| {last.get('train_s', 0):.0f} | {passes:.2f} | {_device(part['config'])} | {start} |"
        )
    return lines + [""]


def _label(name: str, run_dir: Path) -> str:
    """A draft's name in the quality table: "this draft", or its run's folder name, not a path."""
    path = Path(name).expanduser()
    if path == run_dir / "draft" or path.resolve() == (run_dir / "draft").resolve():
        return "**this draft**"
    return path.parent.name if path.name == "draft" else path.name or name


def _quality_lines(quality: dict, run_dir: Path) -> list[str]:
    """agreement_report's JSON ({split: {model: {...}}}) as one table; other JSON verbatim."""
    splits = {k: v for k, v in quality.items() if isinstance(v, dict) and "windows" in v}
    if not splits:
        return ["```json", portable(json.dumps(quality, indent=1)), "```"]
    lines = ["| split | windows | draft | depth 1 | depth 2 | depth 3 | depth 4 |", "|---|---|---|---|---|---|---|"]
    for split, part in splits.items():
        for name, res in part.items():
            if not isinstance(res, dict):
                continue
            depths = res.get("agreement_by_depth") or [res["agreement"]] * 4  # a token draft: the same at any depth
            cells = " | ".join(f"{a:.3f}" for a in depths[:4])
            lines.append(f"| {split} | {part['windows']} | {_label(name, run_dir)} | {cells} |")
    return lines


def model_card(
    run_dir: Path,
    quality: dict | None,
    command: str,
    note: str = "",
    *,
    map_size: int | None = None,
    dest: Path | None = None,
) -> str:
    """The shipped feature draft's README: what it is, data, recipe, curve, compute, quality.
    `dest`: where it ships (a packed run shipped over the draft it started from says so)."""
    info = json.loads((run_dir / "curve.json").read_text())
    if "levels" in info["config"]:  # a train-packed run (training/step.py)
        return _packed_card(run_dir, info, quality, command, note, map_size=map_size, dest=dest)
    cfg, curve = info["config"], info["curve"]
    slots = f"{map_size:,}-token map" if map_size else "draft's token map"
    chain = _chain(run_dir, info)
    stages = _stages(chain, run_dir)  # a draft trained in stages: their table names the first start
    spent = curve[-1].get("train_s") if curve else None
    lines = [
        "# Feature-level (EAGLE-style) draft",
        "",
        "A one-layer head over the target's own final hidden states (dynatree_core/drafts/feature.py):",
        "fc([embedding(next token); target feature]) -> one Llama decoder layer -> predicted feature",
        f"-> the target's LM head rows for the {slots} (frozen; rebuilt from the target at load).",
        "Saved: fc and the layer (bfloat16); load attaches them to the loaded target.",
        "",
        "## How it was trained",
        "",
        _loss_line(cfg),
        f"- input-feature noise U(-{cfg['noise']}, {cfg['noise']}); AdamW lr {cfg['lr']}, warm-up {cfg['warmup']}, "
        + (f"cosine over a {cfg['budget_s']:.0f} s wall-time budget" if cfg.get("budget_s") else "cosine")
        + f"; {curve[-1]['step'] if curve else cfg['steps']} steps of {cfg['batch']} windows"
        + (f" ({spent:.0f} s of training)" if spent else "")
        + f"; autocast {cfg.get('autocast') or 'off'}; seed {cfg['seed']}",
        *_data_lines(info, curve, staged=bool(stages)),
        *stages,
        f"- command: `{command}`",
        "",
        "## Learning curve (held-out top-1 agreement with the target's greedy token, by tree depth)",
        "",
        "| step | depth 1 | depth 2 | depth 3 | depth 4 |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {c['step']} | " + " | ".join(f"{a:.3f}" for a in c["heldout_agreement_by_depth"]) + " |" for c in curve
    ]
    return _closing(lines, run_dir, quality, note, [folder for folder, _ in chain])


def _closing(lines: list[str], run_dir: Path, quality: dict | None, note: str, runs: list[Path]) -> str:
    """The card's compute ledger (the data stages and `runs`, this draft's training runs), note and quality."""
    stages = ("answers", "answers-relabel", "feature-label", "train-feature", "train-packed")
    ledger = {k: v for k, v in totals(run=runs).items() if k in stages}
    if ledger:
        lines += ["", "## Compute (measured; the recipe's ledger: the data stages and this draft's training runs)", ""]
        lines += ["| stage | wall s | items | tokens |", "|---|---|---|---|"]
        lines += [f"| {k} | {v['seconds']:.0f} | {v['items']} | {v['tokens']} |" for k, v in ledger.items()]
    if note:
        lines += ["", note]
    if quality:
        lines += ["", "## Measured quality (top-1 agreement with the target's greedy token, by tree depth)", ""]
        lines += _quality_lines(quality, run_dir)
    return "\n".join(lines) + "\n"


def _packed_card(
    run_dir: Path, info: dict, quality, command: str, note: str, *, map_size: int | None, dest: Path | None
) -> str:
    """The card of a `train-packed` run: its kind, loss, schedule, passes and learning curve."""
    cfg, curve, kind = info["config"], info["curve"], info.get("kind", "feature")
    last = curve[-1] if curve else {}
    data = info.get("data") or {}
    chain = _chain(run_dir, info)  # a run started from an earlier run's draft: every stage is shown
    start = (chain[0][1].get("data") or {}).get("init_from")
    replaces_start = bool(start and dest) and (REPO_ROOT / Path(start).expanduser()).resolve() == dest.resolve()
    shipped_start = (
        f"the draft shipped in `{start}` before this one (its weights and card: that directory's git history)"
        if replaces_start
        else None
    )
    seen = sum((part["curve"] or [{}])[-1].get("seen", 0) for _, part in chain)
    passes = seen / max(data.get("training_answer_positions", 0), 1)
    head = (
        "a fused-feature (EAGLE-3) head: fc over the target's normed layer inputs, EAGLE-3's layer, "
        "its own norm and head"
        if kind == "fused"
        else "a one-layer feature-level (EAGLE-style) head over the target's final hidden states"
    )
    schedule = f"a {cfg['budget_s']:.0f} s budget" if cfg.get("budget_s") else f"{cfg['passes']} passes"
    lines = [
        f"# {'Fused-feature' if kind == 'fused' else 'Feature-level'} draft",
        "",
        f"{head} (dynatree_core/drafting/{'fused' if kind == 'fused' else 'feature'}.py)"
        + (f", over a {map_size:,}-token map." if map_size else "."),
        "",
        "## How it was trained",
        "",
        *(["The last stage:", ""] if len(chain) > 1 else []),
        _packed_loss_line(cfg, kind),
        f"- packed windows ({cfg['pairs_per_step']} pair slots a step), the compact teacher, autocast "
        f"{cfg.get('autocast') or 'off'}, on the {_device(cfg)}; AdamW lr {cfg['lr']}, warm-up {cfg['warmup']} steps, "
        "then cosine to zero over "
        f"{schedule}; {last.get('step', 0)} steps, {last.get('train_s', 0):.0f} s of training"
        + (
            "; started from the previous stage (below)"
            if len(chain) > 1
            else f"; started from {shipped_start}"
            if shipped_start
            else f"; started from `{data['init_from']}`"
            if data.get("init_from")
            else "; from random initialisation"
        ),
        *_stages(chain, run_dir, first_start=shipped_start),
        *(_data_lines(info, [{"seen": seen}], staged=True) if "sources" in data else [f"- **{passes:.2f} passes**"]),
        f"- command: `{command}`",
        "",
        "## Learning curve (top-1 agreement with the target's greedy token, depth 1 / 2 / 3 / 4)",
        "",
        "| stage | step | passes (all stages) | training s (all stages) | held out | out-of-distribution |",
        "|---|---|---|---|---|---|",
    ]
    total, seen_before, s_before = max(data.get("training_answer_positions", 0), 1), 0, 0.0
    for k, (_, part) in enumerate(chain, 1):
        for c in part["curve"]:
            cells = [" / ".join(f"{a:.3f}" for a in c.get(split, [])) or "-" for split in ("heldout", "ood")]
            lines.append(
                f"| {k} | {c['step']} | {(seen_before + c['seen']) / total:.2f} | {s_before + c['train_s']:.0f} "
                f"| {cells[0]} | {cells[1]} |"
            )
        end = (part["curve"] or [{}])[-1]
        seen_before, s_before = seen_before + end.get("seen", 0), s_before + end.get("train_s", 0.0)
    return _closing(lines, run_dir, quality, note, [folder for folder, _ in chain])


def export_feature_draft(
    run_dir: Path, dest: Path, target: torch.nn.Module, *, quality: dict | None, command: str, note: str = ""
) -> None:
    """Copy the run's draft into `dest` (bfloat16 weights, no head rows) with its model card."""
    draft = load_head(str(run_dir / "draft"), target)
    if draft.kind == "fused":  # a frozen head is the target's rows: left out, rebuilt at load
        rows = target_rows(target, draft.token_map)
        frozen = rows is not None and torch.equal(draft.lm_head.weight.detach().float().cpu(), rows)
        draft.save(dest, with_head=not frozen, dtype=torch.bfloat16)
    else:
        draft.save(dest, dtype=torch.bfloat16)
    size = len(draft.token_map) if draft.token_map is not None else None
    (dest / "README.md").write_text(model_card(run_dir, quality, command, note, map_size=size, dest=dest))
    (dest / "curve.json").write_text(portable((run_dir / "curve.json").read_text()))
