"""Ship a trained draft: copy its weights into assets/models/<name>/ with a model card.

The card states how the draft was trained (config, data, command), its learning curve and its
measured quality (from `quality --out`), so the numbers travel with the weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from dynatree_core.training.ledger import totals


def model_card(name: str, run_dir: Path, quality: dict | None, command: str, note: str = "") -> str:
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
        f"- loss: soft cross-entropy to the target's top-20 + {cfg['hard_weight']} x hard CE to its argmax"
        + (f" + {cfg['talf_weight']} x TALF tree loss" if cfg.get("talf_weight") else ""),
        f"- {cfg['steps']} steps of {cfg['batch']} windows (<= 320 tokens), AdamW lr {cfg['lr']}, cosine, "
        f"seed {cfg['seed']}"
        + (f"; {cfg['onpolicy_share']:.0%} of each batch from on-policy windows" if cfg.get("onpolicy_share") else ""),
        "- data: windows of the target's own sampled chat/plain generations (temperature 0.8, top-p 0.95),",
        "  Python documentation sources and fortunes (Debian packages); chunk 0 of the generations is held out",
        f"- command: `{command}`",
        "",
        "## Learning curve (held-out top-1 agreement with the target's greedy token)",
        "",
        "| step | windows seen | agreement | wall s |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {c['step']} | {c['windows_seen']} | {c['heldout_agreement']:.3f} | {c['wall_s']:.0f} |" for c in curve
    ]
    spent = totals(run=run_dir)
    if spent:
        lines += [
            "",
            "## Compute (measured, this machine's 2 CPU cores; from the recipe's ledger)",
            "",
            "| stage | CPU wall s | items | tokens |",
            "|---|---|---|---|",
        ]
        lines += [f"| {k} | {v['seconds']:.0f} | {v['items']} | {v['tokens']} |" for k, v in spent.items()]
        total = sum(v["seconds"] for v in spent.values())
        lines += [f"| total | {total:.0f} ({total / 3600:.2f} h) | | |"]
    if note:
        lines += ["", note]
    if quality:
        lines += ["", "## Measured quality", "", "```json", json.dumps(quality, indent=1), "```"]
    return "\n".join(lines) + "\n"


def export(run_dir: Path, dest: Path, *, quality_json: Path | None, command: str, note: str = "") -> None:
    src = run_dir / "model"
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest)
    quality = json.loads(quality_json.read_text()) if quality_json and quality_json.exists() else None
    if quality is not None:  # `quality --out` keys results by draft directory
        quality = quality.get(str(src), next(iter(quality.values())) if len(quality) == 1 else quality)
    (dest / "README.md").write_text(model_card(dest.name, run_dir, quality, command, note))
    shutil.copy(run_dir / "curve.json", dest / "curve.json")
