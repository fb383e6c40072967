"""The words the pages show beside the figures: what one iteration did, why a run is (not)
faster, why it stopped, and the glossary of tree terms (docs/glossary.md)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

from dynatree_core.runs.records import IterationRecord
from dynatree_core.verify.registry import VERIFIERS
from dynatree_core.viz.tree import visible

GLOSSARY = Path(__file__).resolve().parents[2] / "docs" / "glossary.md"


def why_text(b: dict[str, float]) -> str:
    """The breakdown in words, with what would change the outcome."""
    if not b:
        return "No iterations yet."
    lines = [
        f"Each iteration commits **{b['tokens_per_iteration']:.2f}** tokens and takes **{b['iteration_ms']:.0f} ms**: "
        f"{b['draft_ms']:.0f} ms drafting ({b['draft_forwards']:.1f} draft forwards), {b['verify_ms']:.0f} ms for one "
        f"target forward over {b['tokens_verified']:.1f} tokens, {b['other_ms']:.1f} ms outside the forwards."
    ]
    if "step_ms" not in b:
        lines.append("Measure the latency profile (or the AR reference) to compare with plain decoding.")
        return "\n\n".join(lines)
    verdict = "faster" if b["expected_speedup"] > 1 else "slower"
    lines.append(
        f"Plain decoding pays **{b['step_ms']:.0f} ms** per token, so this run breaks even at "
        f"**{b['break_even_tokens']:.2f}** tokens per iteration; it commits {b['tokens_per_iteration']:.2f}, "
        f"so it is expected to be **{b['expected_speedup']:.2f}x** ({verdict} than plain decoding)."
    )
    tips = []
    if b["verify_vs_step"] > 1.5:
        tips.append(
            f"verifying {b['tokens_verified']:.0f} tokens costs {b['verify_vs_step']:.1f}x a one-token step on this "
            "device (see the curve): a smaller node budget or tree keeps the verification near the flat part"
        )
    if b["draft_ms"] > 0.35 * b["iteration_ms"]:
        tips.append(
            f"drafting is {b['draft_ms'] / b['iteration_ms']:.0%} of the iteration: fewer levels (depth) or an earlier "
            "stop (thresholds) save draft forwards"
        )
    if b["tokens_per_iteration"] < b["break_even_tokens"] + 0.3:
        tips.append("the draft's proposals are accepted too rarely: a better-matched draft model is the real lever")
    if tips:
        lines.append("What would help: " + "; ".join(tips) + ".")
    return "\n\n".join(lines)


STOP_TEXT = {
    "eos": "the model ended its answer (an end-of-sequence token)",
    "max_new_tokens": "it reached the max new tokens setting",
    "context_limit": "the prompt and the output filled the model's context window; it can take no more tokens",
}


def stop_text(stop: str | None) -> str:
    """Why a finished run stopped, in words."""
    return "Finished: " + STOP_TEXT.get(stop or "", f"stopped ({stop or 'no reason recorded'})") + "."


def explain_iteration(rec: IterationRecord, decode: Callable[[int], str], verifier: str = "greedy") -> str:
    """The iteration in words, with its own tokens as the example."""
    levels = max(rec.tree.depths) if len(rec.tree) > 1 else 0
    accepted = "".join(decode(rec.tree.tokens[n]) for n in rec.accepted)
    pruned = sum(1 for n in range(len(rec.tree)) if not rec.tree.is_verified(n))
    bonus = "none (the run stopped first)" if rec.bonus_token is None else f"`{visible(decode(rec.bonus_token))}`"
    return (
        f"1. **Draft.** From the root `{visible(decode(rec.tree.tokens[0]))}` the draft model grew a tree "
        f"of {len(rec.tree) - 1} proposed tokens over {levels} levels, one draft forward per level "
        f"({rec.draft_forwards} forwards); {pruned} were pruned before verification.\n"
        f"2. **Verify.** The target read the {rec.drafted} remaining nodes (plus the root"
        + (f" and {rec.chain_len - 1} committed tokens it had not seen" if rec.chain_len > 1 else "")
        + ") in **one forward**, each node attending only to its ancestors (the mask on the right), "
        "at position root + depth.\n"
        + (
            f"3. **Commit.** The longest path that matches the target's own choices was accepted: "
            f"{len(rec.accepted)} tokens (`{visible(accepted)}`), then the target's next token was added "
            f"for free as the bonus: {bonus}. "
            if verifier == "greedy"
            else f"3. **Commit.** The `{verifier}` verifier walked down from the root: at each node it drew "
            "a token from the target's distribution, steering towards the drafted children without changing "
            f"that distribution, and moved on while the token was a verified child: {len(rec.accepted)} "
            f"accepted (`{visible(accepted)}`), then the token it drew where the walk stopped: {bonus}. "
            if VERIFIERS.get(verifier) is None or VERIFIERS[verifier].direction == "top-down"
            else f"3. **Commit.** The `{verifier}` verifier walked up from the leaves (post-order): it tested "
            "each leaf against its sequence weight (the target/draft ratio of its whole path, clipped), and "
            "after each rejection handed the leftover probability to the parent's residual, until a node was "
            f"accepted: {len(rec.accepted)} tokens (`{visible(accepted)}`), then a token drawn from that "
            f"node's (residual) target distribution: {bonus}. "
        )
        + f"{len(rec.committed)} tokens committed; the draft's and the target's caches keep the accepted "
        "path's entries and drop the rest."
    )


@functools.cache
def glossary() -> str:
    """The glossary table of docs/glossary.md (its first markdown table, header row first): one
    source for the docs and the live page."""
    lines = GLOSSARY.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join(lines[start:end])
