"""The named model pairs (`presets`): the offline embedded pairs and public pairs that download
from the hub, among them published EAGLE heads on the targets they were trained for."""

from __future__ import annotations

import dataclasses
from pathlib import Path

EMBEDDED = "embedded"
REPO_ROOT = Path(__file__).resolve().parents[2]
EMBEDDED_DRAFT_DIR = REPO_ROOT / "assets" / "models" / "smollm2-draft"
EMBEDDED_FEATURE_DRAFT_DIR = REPO_ROOT / "assets" / "models" / "smollm2-feature-draft"  # drafts/feature.py
EMBEDDED_FUSED_DRAFT_DIR = REPO_ROOT / "assets" / "models" / "smollm2-fused-draft"  # drafts/fused.py (EAGLE-3 form)


@dataclasses.dataclass(frozen=True)
class Preset:
    """A named target/draft pair. `draft=None` means no draft model exists for it yet; `head`:
    the draft is a head reading the target's hidden states (drafts/heads.py), not a standalone
    LM; `offline`: everything ships with the project (the others download from the hub)."""

    name: str
    target: str
    draft: str | None
    description: str
    offline: bool = False
    head: bool = False


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        # The embedded pair drafts with the measured winner, the feature draft (BENCHMARKS.md);
        # the token draft stays selectable and is the HF baselines' assistant.
        *(
            [
                Preset(
                    "embedded",
                    EMBEDDED,
                    str(EMBEDDED_FEATURE_DRAFT_DIR),
                    "SmolLM2-135M-Instruct (bundled, offline) with the project's feature-level (EAGLE-style) draft",
                    offline=True,
                )
            ]
            if EMBEDDED_FEATURE_DRAFT_DIR.exists()
            else []
        ),
        Preset(
            "embedded-token" if EMBEDDED_FEATURE_DRAFT_DIR.exists() else "embedded",
            EMBEDDED,
            str(EMBEDDED_DRAFT_DIR) if EMBEDDED_DRAFT_DIR.exists() else None,
            "SmolLM2-135M-Instruct (bundled, offline) with the project's token-level draft (a standalone 9M LM)",
            offline=True,
        ),
        *(
            [
                Preset(
                    "embedded-eagle3",
                    EMBEDDED,
                    str(EMBEDDED_FUSED_DRAFT_DIR),
                    "SmolLM2-135M-Instruct (bundled, offline) with the project's EAGLE-3-form (fused-feature) draft,"
                    " per-tap norms (weaker than the default)",
                    offline=True,
                    head=True,
                )
            ]
            if EMBEDDED_FUSED_DRAFT_DIR.exists()
            else []
        ),
        Preset(
            "pythia-2.8b/70m",
            "EleutherAI/pythia-2.8b",
            "EleutherAI/pythia-70m",
            "The DynaTree papers' pair (GPU recommended)",
        ),
        Preset(
            "smollm2-1.7b/135m",
            "HuggingFaceTB/SmolLM2-1.7B-Instruct",
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            "SmolLM2 instruct pair, 13x size ratio",
        ),
        Preset(
            "qwen2.5-7b/0.5b",
            "Qwen/Qwen2.5-7B-Instruct",
            "Qwen/Qwen2.5-0.5B-Instruct",
            "Qwen2.5 instruct pair (GPU)",
        ),
        Preset(
            "llama-3.1-8b/3.2-1b",
            "meta-llama/Llama-3.1-8B-Instruct",
            "meta-llama/Llama-3.2-1B-Instruct",
            "Llama 3 instruct pair (GPU, gated on the hub)",
        ),
        # Published EAGLE heads on the targets they were trained for (docs/published-heads.md):
        # the drafts the serving engines use, read into this project's head kinds.
        *(
            Preset(name, target, head, f"{what} (GPU; the target is gated on the hub)", head=True)
            for name, target, head, what in [
                (
                    "vicuna-7b/eagle",
                    "lmsys/vicuna-7b-v1.3",
                    "yuhuili/EAGLE-Vicuna-7B-v1.3",
                    "Vicuna 7B with SafeAILab's EAGLE-1 head",
                ),
                (
                    "llama-3-8b/eagle",
                    "meta-llama/Meta-Llama-3-8B-Instruct",
                    "yuhuili/EAGLE-LLaMA3-Instruct-8B",
                    "Llama 3 8B with SafeAILab's EAGLE-1 head",
                ),
                (
                    "llama-3.1-8b/eagle3",
                    "meta-llama/Llama-3.1-8B-Instruct",
                    "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
                    "Llama 3.1 8B with SafeAILab's EAGLE-3 head",
                ),
                (
                    "llama-3.1-8b/eagle3-specforge",
                    "meta-llama/Llama-3.1-8B-Instruct",
                    "lmsys/sglang-EAGLE3-LLaMA3.1-Instruct-8B",
                    "Llama 3.1 8B with SpecForge's EAGLE-3 head (SGLang)",
                ),
                (
                    "llama-3.1-8b/eagle3-speculators",
                    "meta-llama/Llama-3.1-8B-Instruct",
                    "RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3",
                    "Llama 3.1 8B with vLLM speculators' EAGLE-3 head",
                ),
            ]  # fmt: skip
        ),
    ]
}
