"""The model cards of the shipped drafts: one writer for `export` (`make draft`: smollm2-draft) and
`export-feature` (a `train-feature` run: smollm2-feature-draft-corpus; a `train-packed` run:
smollm2-feature-draft, smollm2-fused-draft), and both exports (weights, card, curve).

A card is a list of sections, each a small function over the run's `curve.json` (its config, curve and data), rendered
as Markdown: what the draft is, how it was trained (loss, schedule, data, the stages before it, the command), its
learning curve, the compute from the ledger (ledger.py) and, given the quality JSON, its measured quality. Paths in a
feature card and its curve are written relative to the repository, home or the cache root (runs/environment.portable).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from dynatree_core.core.presets import REPO_ROOT
from dynatree_core.drafts.fused import CONFIG_FILE, FC_NORMS
from dynatree_core.runs.environment import portable
from dynatree_core.training.ledger import totals

FEATURE_STAGES = ("answers", "answers-relabel", "feature-label", "train-feature", "train-packed")


def _table(head: list[str], rows) -> list[str]:
    """A Markdown table: the header, its rule, one line per row of cells ("" renders as "| |")."""
    line = lambda cells: "|" + "|".join(f" {c} " if str(c) else " " for c in cells) + "|"  # noqa: E731
    return [line(head), "|" + "---|" * len(head), *map(line, rows)]


def _compute(runs, heading: str, wall: str, keep=None, total: bool = False) -> list[str]:
    """The ledger's stages for `runs` (and every run-less data stage), `keep` only when given."""
    spent = {k: v for k, v in totals(run=runs).items() if keep is None or k in keep}
    if not spent:
        return []
    rows = [(k, f"{v['seconds']:.0f}", v["items"], v["tokens"]) for k, v in spent.items()]
    if total:
        s = sum(v["seconds"] for v in spent.values())
        rows.append(("total", f"{s:.0f} ({s / 3600:.2f} h)", "", ""))
    return ["", heading, "", *_table(["stage", wall, "items", "tokens"], rows)]


def _render(lines: list[str], compute: list[str], note: str, quality: list[str]) -> str:
    return "\n".join(lines + compute + (["", note] if note else []) + quality) + "\n"


# ----- the token draft (`make draft`) ----------------------------------------------------------


def token_card(name: str, run_dir: Path, quality: dict | None, command: str, note: str = "") -> str:
    """smollm2-draft's README: architecture, loss, schedule, data, curve, compute, quality."""
    info = json.loads((run_dir / "curve.json").read_text())
    cfg, curve = info["config"], info["curve"]
    lines = [
        f"# {name}: the embedded target's draft model",
        "",
        "A small Llama-architecture causal LM distilled from SmolLM2-135M-Instruct (the embedded",
        "target) on this project's CPU, used as the default draft of the `embedded` preset.",
        f"Reduced vocabulary: {cfg['vocab']} slots (slot 0 = OTHER, the rest map to target ids via",
        "`token_map.json`; see `dynatree_core/core/vocab.py`). Weights in bfloat16.",
        "",
        "## How it was trained",
        "",
        f"- architecture: hidden {cfg['hidden']}, {cfg['layers']} layers, {cfg['heads']} heads "
        f"({cfg['kv_heads']} KV), MLP {cfg['intermediate']}, tied embeddings initialised by PCA of the target's",
        f"- loss: soft cross-entropy to the target's top-20 + {cfg['hard_weight']} x hard CE to its argmax",
        f"- {cfg['steps']} steps of {cfg['batch']} windows (<= 320 tokens), AdamW lr {cfg['lr']}, cosine, "
        f"seed {cfg['seed']}"
        + (f"; {cfg['onpolicy_share']:.0%} of each batch from on-policy windows" if cfg.get("onpolicy_share") else ""),
        "- data: windows of the target's own sampled chat/plain generations (temperature 0.8, top-p 0.95),",
        "  Python documentation sources and fortunes (Debian packages); chunk 0 of the generations is held out",
        f"- command: `{command}`",
        "",
        "## Learning curve (held-out top-1 agreement with the target's greedy token)",
        "",
        *_table(
            ["step", "windows seen", "agreement", "wall s"],
            [(c["step"], c["windows_seen"], f"{c['heldout_agreement']:.3f}", f"{c['wall_s']:.0f}") for c in curve],
        ),
    ]
    heading = "## Compute (measured, this machine's 2 CPU cores; from the recipe's ledger)"
    compute = _compute(run_dir, heading, "CPU wall s", total=True)
    shown = ["", "## Measured quality", "", "```json", json.dumps(quality, indent=1), "```"] if quality else []
    return _render(lines, compute, note, shown)


def export_token_draft(run_dir: Path, dest: Path, *, quality_json: Path | None, command: str, note: str = "") -> None:
    """`make draft`'s export: the run's model (bfloat16) into `dest` with its card and curve."""
    src = run_dir / "model"
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest)
    quality = json.loads(quality_json.read_text()) if quality_json and quality_json.exists() else None
    if quality is not None:  # `quality --out` keys results by draft directory
        quality = quality.get(str(src), next(iter(quality.values())) if len(quality) == 1 else quality)
    (dest / "README.md").write_text(token_card(dest.name, run_dir, quality, command, note))
    shutil.copy(run_dir / "curve.json", dest / "curve.json")


# ----- the feature drafts (`export-feature`) ---------------------------------------------------


def _device(cfg: dict) -> str:
    """Where a run trained, from its config (runs before the key existed trained on the CPU)."""
    device = str(cfg.get("device") or "cpu")
    return "CPU" if device == "cpu" else f"GPU ({device})" if device.startswith("cuda") else device


def _share(cfg: dict, text: str) -> str:
    return text.format(cfg["ce_share"]) if cfg.get("ce_share", 1) < 1 else ""


def _loss_line(cfg: dict, kind: str) -> str:
    """The loss of a `train-feature` run (kind None) or of a `train-packed` run (packed/step.py)."""
    if kind is None:
        return (
            f"- loss ({cfg.get('loss', 'kd')}): smooth L1 to the target's next feature + {cfg['ce_weight']} x soft "
            "cross-entropy to head(next feature) over the reduced vocabulary"
            + _share(cfg, ", taken over a random {:.0%} of positions")
        )
    ce = "soft cross-entropy to the compact teacher (the target's top-32, renormalised over the map)"
    ce += _share(cfg, " over a random {:.0%} of the answer positions")
    level = (
        ce
        if kind == "fused"
        else f"{cfg['regression_weight']} x smooth L1 to the target's next feature + {cfg['ce_weight']} x {ce}"
    )
    if cfg.get("levels", 1) > 1:
        return (
            f"- loss: unrolled over the draft's own outputs for {cfg['levels']} levels (training-time test; level k "
            f"weighted {cfg['level_decay']}^(k-1)); each level: {level}"
        )
    return f"- loss: {level}"


def _data_lines(info: dict, curve: list[dict], staged: bool = False) -> list[str]:
    """Where the training positions came from: the answers' sources, or the sampled corpus."""
    data = info.get("data")
    if not data or "sources" not in data:
        return [
            f"- data: the committed corpus's windows whose target features were labelled; "
            f"{info['config']['onpolicy_share']:.0%} of each batch from the target's own sampled generations; "
            "chunk 0 held out"
        ]
    seen = curve[-1].get("seen", 0) if curve else 0
    positions = data.get("training_answer_positions", 0)
    rows = sorted(data["sources"].items(), key=lambda kv: -kv[1]["answer_tokens"])
    total = {k: sum(v[k] for _, v in rows) for k in ("prompts", "prompt_tokens", "answer_tokens")}
    cells = [(k, f"{v['prompts']:,}", f"{v['prompt_tokens']:,}", f"{v['answer_tokens']:,}") for k, v in rows]
    cells.append(("**all**", f"{total['prompts']:,}", f"{total['prompt_tokens']:,}", f"{total['answer_tokens']:,}"))
    lines = [
        "- data: the target's own answers (ids and final hidden states, `python -m dynatree_core.training "
        "answers`) to prompts from these offline sources; about one sequence in 50 held out (in-distribution "
        "check); the out-of-distribution prompt set (`assets/prompts/ood/`) is never trained on",
        f"- trained on {data['training_windows']} windows, {positions:,} answer positions "
        f"(the loss positions; {data['training_positions']:,} with the prompts as context); "
        f"{seen:,} loss positions seen = **{seen / max(positions, 1):.2f} passes**"
        + (f"; started from `{data['init_from']}`" if data.get("init_from") and not staged else ""),
        "",
        *_table(["source", "prompts", "prompt tokens", "answer tokens"], cells),
        "",
    ]
    if any(k.startswith("written-") for k in data["sources"]):
        lines += [
            "Rows `written-*` are human-written text, not the target's answers (training/answers/written.py): "
            "documentation, manual pages, code and fortunes as the assistant's turn after a short request, passed once "
            "through the target teacher-forced; the loss still follows the target's own next-token distribution there.",
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


def _start(data: dict, first_start: str | None) -> str:
    if first_start:
        return first_start
    return f"`{data['init_from']}`" if data.get("init_from") else "random initialisation"


def _stages(chain: list[tuple[Path, dict]], run_dir: Path, first_start: str | None = None) -> list[str]:
    """A draft trained in stages (`chain`, from `_chain`): one row per run, oldest first; the first
    row says what the first stage started from (`first_start`, else its init_from, or nothing)."""
    if len(chain) < 2:
        return []
    rows = []
    for k, (folder, part) in enumerate(chain, 1):
        data, last, cfg = part.get("data") or {}, (part["curve"] or [{}])[-1], part["config"]
        passes = last.get("seen", 0) / max(data.get("training_answer_positions", 0), 1)
        loss = (
            cfg.get("loss", "kd")
            if "levels" not in cfg
            else "kd"
            if cfg["levels"] == 1
            else f"unrolled ({cfg['levels']} levels)"
        )
        start = "the previous stage" if k > 1 else _start(data, first_start)
        name = "this run" if folder == run_dir else folder.name
        rows.append(
            (
                f"{k} ({name})",
                loss,
                last.get("step", 0),
                f"{last.get('train_s', 0):.0f}",
                f"{passes:.2f}",
                _device(cfg),
                start,
            )
        )
    head = ["stage", "loss", "steps", "training s", "passes", "trained on", "started from"]
    return ["", "Trained in stages, each from the previous stage's weights:", "", *_table(head, rows), ""]


def _label(name: str, run_dir: Path) -> str:
    """A draft's name in the quality table: "this draft", or its run's folder name, not a path."""
    path = Path(name).expanduser()
    if path == run_dir / "draft" or path.resolve() == (run_dir / "draft").resolve():
        return "**this draft**"
    return path.parent.name if path.name == "draft" else path.name or name


def _quality_lines(quality: dict | None, run_dir: Path) -> list[str]:
    """agreement_report's JSON ({split: {model: {...}}}) as one table; other JSON verbatim."""
    if not quality:
        return []
    lines = ["", "## Measured quality (top-1 agreement with the target's greedy token, by tree depth)", ""]
    splits = {k: v for k, v in quality.items() if isinstance(v, dict) and "windows" in v}
    if not splits:
        return lines + ["```json", portable(json.dumps(quality, indent=1)), "```"]
    rows = []
    for split, part in splits.items():
        for name, res in part.items():
            if isinstance(res, dict):
                depths = res.get("agreement_by_depth") or [res["agreement"]] * 4  # a token draft: same at any depth
                rows.append((split, part["windows"], _label(name, run_dir), *(f"{a:.3f}" for a in depths[:4])))
    return lines + _table(["split", "windows", "draft", "depth 1", "depth 2", "depth 3", "depth 4"], rows)


def feature_card(
    run_dir: Path, quality: dict | None, command: str, note: str = "", *, map_size: int | None = None,
    dest: Path | None = None,
) -> str:  # fmt: skip
    """A feature draft's README: what it is, data, recipe, curve, compute, quality. `dest`: where it
    ships (a packed run shipped over the draft it started from says so)."""
    info = json.loads((run_dir / "curve.json").read_text())
    chain = _chain(run_dir, info)  # a run started from an earlier run's draft: every stage is shown
    packed = "levels" in info["config"]
    lines = (_packed_lines if packed else _feature_lines)(run_dir, info, chain, command, map_size, dest)
    heading = "## Compute (measured; the recipe's ledger: the data stages and this draft's training runs)"
    compute = _compute([folder for folder, _ in chain], heading, "wall s", keep=FEATURE_STAGES)
    return portable(_render(lines, compute, note, _quality_lines(quality, run_dir)), cache=True)


def _feature_lines(run_dir: Path, info: dict, chain, command: str, map_size, dest) -> list[str]:
    """A `train-feature` run (feature/train.py): KD on stored features, the curve by depth."""
    cfg, curve = info["config"], info["curve"]
    slots = f"{map_size:,}-token map" if map_size else "draft's token map"
    stages = _stages(chain, run_dir)  # a draft trained in stages: their table names the first start
    spent = curve[-1].get("train_s") if curve else None
    return [
        "# Feature-level (EAGLE-style) draft",
        "",
        "A one-layer head over the target's own final hidden states (dynatree_core/drafts/feature.py):",
        "fc([embedding(next token); target feature]) -> one Llama decoder layer -> predicted feature",
        f"-> the target's LM head rows for the {slots} (frozen; rebuilt from the target at load).",
        "Saved: fc and the layer (bfloat16); load attaches them to the loaded target.",
        "",
        "## How it was trained",
        "",
        _loss_line(cfg, None),
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
        *_table(
            ["step", "depth 1", "depth 2", "depth 3", "depth 4"],
            [(c["step"], *(f"{a:.3f}" for a in c["heldout_agreement_by_depth"])) for c in curve],
        ),
    ]


def _packed_lines(run_dir: Path, info: dict, chain, command: str, map_size, dest) -> list[str]:
    """A `train-packed` run (packed/): its kind, loss, schedule, passes, stages before it, the curve over all."""
    cfg, curve, kind = info["config"], info["curve"], info.get("kind", "feature")
    last, data = (curve[-1] if curve else {}), info.get("data") or {}
    start = (chain[0][1].get("data") or {}).get("init_from")
    replaces_start = bool(start and dest) and (REPO_ROOT / Path(start).expanduser()).resolve() == dest.resolve()
    shipped = f"the draft shipped in `{start}` before this one (its weights and card: that directory's git history)"
    shipped_start = shipped if replaces_start else None
    seen = sum((part["curve"] or [{}])[-1].get("seen", 0) for _, part in chain)
    passes = seen / max(data.get("training_answer_positions", 0), 1)
    fused = kind == "fused"
    meta = run_dir / "draft" / CONFIG_FILE  # its fc_norm: how the taps meet fc
    taps = FC_NORMS[json.loads(meta.read_text()).get("fc_norm", "per_tap") if meta.exists() else "per_tap"]
    head = (
        f"a fused-feature (EAGLE-3) head: fc over the target's {taps}, EAGLE-3's layer, its own norm and head"
        if fused
        else "a one-layer feature-level (EAGLE-style) head over the target's final hidden states"
    )
    schedule = f"a {cfg['budget_s']:.0f} s budget" if cfg.get("budget_s") else f"{cfg['passes']} passes"
    if len(chain) > 1:
        began = "the previous stage (below)"
    else:
        began = shipped_start or (f"`{data['init_from']}`" if data.get("init_from") else None)
    return [
        f"# {'Fused-feature' if fused else 'Feature-level'} draft",
        "",
        f"{head} (dynatree_core/drafts/{'fused' if fused else 'feature'}.py)"
        + (f", over a {map_size:,}-token map." if map_size else "."),
        "",
        "## How it was trained",
        "",
        *(["The last stage:", ""] if len(chain) > 1 else []),
        _loss_line(cfg, kind),
        f"- packed windows ({cfg['pairs_per_step']} pair slots a step), the compact teacher, autocast "
        f"{cfg.get('autocast') or 'off'}, on the {_device(cfg)}; AdamW lr {cfg['lr']}, warm-up {cfg['warmup']} steps, "
        f"then cosine to zero over {schedule}; {last.get('step', 0)} steps, {last.get('train_s', 0):.0f} s of training"
        + (f"; started from {began}" if began else "; from random initialisation"),
        *_stages(chain, run_dir, first_start=shipped_start),
        *(_data_lines(info, [{"seen": seen}], staged=True) if "sources" in data else [f"- **{passes:.2f} passes**"]),
        *_pack_lines(data),
        f"- command: `{command}`",
        "",
        "## Learning curve (top-1 agreement with the target's greedy token, depth 1 / 2 / 3 / 4)",
        "",
        *_table(
            ["stage", "step", "passes (all stages)", "training s (all stages)", "held out", "out-of-distribution"],
            _packed_curve(chain, max(data.get("training_answer_positions", 0), 1)),
        ),
    ]


def _pack_lines(data: dict) -> list[str]:
    """A `draft-gpu` run's pack: per source, what it held and what the target answered (follow-ups in theirs)."""
    if not data.get("pack"):
        return []
    stored = data.get("pack_answers") or data.get("sources") or {}  # the pack's own answers, not prior ones
    rows, tokens = [], 0
    for source, held in sorted(data["pack"].items()):
        got = stored.get(source, {})
        tokens += got.get("answer_tokens", 0)
        rows.append((source, f"{held.get('passages', 0):,}", f"{held.get('prompts', 0):,}", f"{held.get('chars', 0):,}",
                     f"{got.get('prompts', 0):,}", f"{got.get('answer_tokens', 0):,}"))  # fmt: skip
    head = ["source", "passages", "prompts in the pack", "characters", "sequences answered", "answer tokens"]
    prior = data.get("prior")  # answers made before the run (`--prior-answers`), relabelled in it
    also = [f"Also trained on {prior['answer_tokens']:,} answer tokens made before this run (stages "
            f"{', '.join(prior['stages'])}: `--prior-answers`), relabelled in it.", ""] if prior else []  # fmt: skip
    return ["", f"The prompt pack ({tokens:,} answer tokens generated from it):", "", *_table(head, rows), "", *also]


def _packed_curve(chain, total: int) -> list[tuple]:
    """The curve of every stage, passes and training seconds counted over all stages before it."""
    rows, seen_before, s_before = [], 0, 0.0
    for k, (_, part) in enumerate(chain, 1):
        for c in part["curve"]:
            cells = [" / ".join(f"{a:.3f}" for a in c.get(split, [])) or "-" for split in ("heldout", "ood")]
            seen, spent = f"{(seen_before + c['seen']) / total:.2f}", f"{s_before + c['train_s']:.0f}"
            rows.append((k, c["step"], seen, spent, *cells))
        end = (part["curve"] or [{}])[-1]
        seen_before, s_before = seen_before + end.get("seen", 0), s_before + end.get("train_s", 0.0)
    return rows


def export_feature_draft(
    run_dir: Path, dest: Path, target: torch.nn.Module, *, quality: dict | None, command: str, note: str = ""
) -> None:
    """Copy the run's draft into `dest` (bfloat16 weights, no head rows) with its model card."""
    from dynatree_core.drafts.fused import target_rows
    from dynatree_core.drafts.heads import load_head

    draft = load_head(str(run_dir / "draft"), target)
    if draft.kind == "fused":  # a frozen head is the target's rows: left out, rebuilt at load
        rows = target_rows(target, draft.token_map)
        frozen = rows is not None and torch.equal(draft.lm_head.weight.detach().float().cpu(), rows)
        draft.save(dest, with_head=not frozen, dtype=torch.bfloat16)
    else:
        draft.save(dest, dtype=torch.bfloat16)
    size = len(draft.token_map) if draft.token_map is not None else None
    (dest / "README.md").write_text(feature_card(run_dir, quality, command, note, map_size=size, dest=dest))
    (dest / "curve.json").write_text(portable((run_dir / "curve.json").read_text(), cache=True))
