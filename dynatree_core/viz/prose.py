"""The words the pages show beside the figures: why a run is (not) faster, why it stopped."""

from __future__ import annotations


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
