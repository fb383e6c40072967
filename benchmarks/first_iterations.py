"""Are the first live iterations as fast as the rest? Measured in the browser, from the repo root,
nothing else running (needs Debian's chromium and the playwright package):

    PYTHONPATH=. .venv/bin/python -m benchmarks.first_iterations [--tokens 512]

For each way the page can open (on the replay, whose frames give the engine process time to load
and warm up the pair, and on the form, DYNATREE_REPLAY=0, which loads the pair when Run is
pressed), a fresh `streamlit run app.py` (benchmarks.app_server) is driven in Chromium: the opening replay (if any) is
left to finish, then Run decodes one prompt with the embedded pair and the page's defaults, and
the run is exported from the page. From the export's engine timings (each iteration's draft +
verify + commit + overhead, what the running tokens/s chart plots) it prints the tokens/s of
iterations 1-10 against iterations 11 to the end, their ratio, and the first 15 iterations' ms
per token (iteration 1 includes the prompt's prefill). The browser and the server share the
machine's cores with the engine process: the page's drawing slows the engine while it runs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.app_server import app_server

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
CHROMIUM = "/usr/bin/chromium"


def idle(page) -> None:
    page.get_by_role("button", name="Run", exact=True).wait_for(timeout=600_000)
    page.wait_for_selector("[data-testid=stApp][data-test-script-state=notRunning]", timeout=600_000)


def one_run(browser, url: str, replay: bool, tokens: int, settle_s: float = 0.0) -> dict:
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(url)
    idle(page)
    if replay:  # the replay plays to its end (the engine loads meanwhile)
        page.get_by_text("Draft tree — iteration 21", exact=True).wait_for(timeout=300_000)
        idle(page)
    prompt = page.get_by_label("Prompt", exact=True)
    prompt.fill(PROMPT)
    prompt.press("Control+Enter")
    idle(page)
    slider = page.get_by_role("slider", name="Max new tokens")
    slider.focus()
    page.keyboard.press("End")
    for _ in range(512 - tokens):
        page.keyboard.press("ArrowLeft")
    idle(page)
    time.sleep(settle_s)  # more time for the engine and the browser to finish their work before Run
    page.get_by_role("button", name="Run", exact=True).click()
    page.get_by_text("Finished:", exact=False).wait_for(state="detached", timeout=120_000)  # the replay's
    page.get_by_text("Finished:", exact=False).wait_for(timeout=900_000)
    idle(page)
    with page.expect_download() as download:
        page.get_by_role("button", name="Export run (JSON)").click()
    run = json.loads(Path(download.value.path()).read_text())
    page.close()
    records = run["records"]
    tok = [len(r["committed"]) for r in records]
    ms = [r["draft_ms"] + r["verify_ms"] + r["commit_ms"] + r["overhead_ms"] for r in records]
    first = 1000 * sum(tok[:10]) / sum(ms[:10])
    rest = 1000 * sum(tok[10:]) / sum(ms[10:])
    return {"iterations": len(records), "tokens": sum(tok), "first10_tok_s": round(first, 1),
            "rest_tok_s": round(rest, 1), "ratio": round(first / rest, 3),
            "first15_ms_per_token": [round(m / t) for m, t in zip(ms[:15], tok[:15], strict=True)]}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--cases", type=int, default=2, help="1: the replay case only")
    parser.add_argument("--settle", type=float, default=0.0, help="seconds to wait before pressing Run")
    args = parser.parse_args(argv)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        cases = (("opens on the replay", {"DYNATREE_REPLAY": "1"}), ("opens on the form", {"DYNATREE_REPLAY": "0"}))
        for name, env in cases[: args.cases]:
            with app_server(env, log_prefix="dynatree-first-iterations", stop_timeout_s=60) as app:
                result = one_run(browser, app.url, env["DYNATREE_REPLAY"] == "1", args.tokens, args.settle)
                print(name, json.dumps(result), flush=True)
        browser.close()


if __name__ == "__main__":
    main()
