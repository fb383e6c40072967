"""How soon each page opens on a drawn figure, in Chromium on this machine, run from the repo root:

    PYTHONPATH=. .venv/bin/python -m benchmarks.pages_open [--rounds 3]
        [--out assets/benchmarks/cpu-pages-open.json]

Starts `streamlit run app.py` headless on a free port (benchmarks.app_server), then for each round,
page (Compare, Verification Lab, Benchmark) and screen (1366 x 768, 1920 x 1080) opens the page in
a fresh browser tab with nothing clicked and no model loaded, and times, in the page, from its title
to the first drawn mark of a chart (a bar or a point) inside the viewport and not covered
(`FIGURE_SAMPLER`, every 50 ms). The report holds every round's seconds and each cell's median and
worst, with the machine and the command. tests/test_e2e_pages.py asserts the same measure (<= 3 s).
Needs Debian's chromium and the playwright package (never `playwright install`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import shutil
import statistics
import sys
from pathlib import Path

from benchmarks import RESULTS
from benchmarks.app_server import app_server
from benchmarks.live_page import environment

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
PAGES = {  # URL path: the page's title
    "Compare_Policies": "Compare drafting policies",
    "Verification_Lab": "Verification Lab",
    "Benchmark": "Benchmark",
}
SCREENS = ({"width": 1366, "height": 768}, {"width": 1920, "height": 1080})

# In the page from its first moment, every 50 ms: when the title shows, and when a chart first has a
# drawn mark (a bar or a point of a plotly chart) inside the viewport, found there (nothing covers it).
FIGURE_SAMPLER = """(() => {
  const log = {titledAt: null, drawnAt: null, error: null};
  window.openLog = () => log;
  const inside = b => b.width > 0 && b.height > 0 && b.x >= 0 && b.y >= 0 && b.right <= innerWidth
                      && b.bottom <= innerHeight;
  const seen = m => {
    const b = m.getBoundingClientRect();
    const e = inside(b) && document.elementFromPoint(b.x + b.width / 2, b.y + b.height / 2);
    return !!e && e.closest(".js-plotly-plot") !== null;
  };
  const timer = setInterval(() => {
    try {
      const now = performance.now() / 1000;
      if (log.titledAt === null && document.querySelector("h1")) log.titledAt = now;
      const marks = document.querySelectorAll(".js-plotly-plot .scatterlayer path.point, .js-plotly-plot .bars path");
      if (log.drawnAt === null && [...marks].some(seen)) log.drawnAt = now;
      if (log.drawnAt !== null) clearInterval(timer);
    } catch (err) {
      log.error = String(err);
    }
  }, 50);
})()"""


def open_page(browser, url: str, path: str, screen: dict, picture=None) -> dict:
    """Open one page in a fresh tab: {"figure_after_title_s", "scrolled", ...the sampler's log}.
    `picture(page)`: called once the figure shows (a screenshot)."""
    page = browser.new_page(viewport=screen)
    page.add_init_script(FIGURE_SAMPLER)
    page.goto(f"{url}/{path}")
    page.locator("h1").filter(has_text=PAGES[path]).wait_for(timeout=120_000)
    page.wait_for_function("() => window.openLog().drawnAt !== null", polling=100, timeout=60_000)
    log = page.evaluate("window.openLog()")
    scrolled = page.evaluate("document.querySelector('[data-testid=stMain]').scrollTop")
    if picture is not None:
        picture(page)
    page.close()
    return {"figure_after_title_s": round(log["drawnAt"] - log["titledAt"], 2), "scrolled": scrolled, **log}


def measure(url: str, rounds: int) -> dict:
    """Every round of every page and screen, then each cell's median and worst."""
    from playwright.sync_api import sync_playwright

    seconds: dict[str, list[float]] = {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        for _ in range(rounds):
            for path in PAGES:
                for screen in SCREENS:
                    cell = f"{path} {screen['width']}x{screen['height']}"
                    seconds.setdefault(cell, []).append(open_page(browser, url, path, screen)["figure_after_title_s"])
        browser.close()
    return {cell: {"rounds": s, "median": statistics.median(s), "worst": max(s)} for cell, s in seconds.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="opens of each page at each screen size")
    p.add_argument("--out", type=Path, default=RESULTS / "cpu-pages-open.json")
    args = p.parse_args(argv)
    with app_server({}, start_timeout_s=120, stop_timeout_s=30) as app:
        warm_up = measure(app.url, 1)  # a first visit per page and screen: the server and browser caches warm
        cells = measure(app.url, args.rounds)
    report = {
        "environment": environment(),
        "date": datetime.date.today().isoformat(),
        "command": "PYTHONPATH=. .venv/bin/python -m benchmarks.pages_open " + shlex.join(argv or sys.argv[1:]),
        "warm_up": warm_up,
        "cells": cells,
    }
    args.out.write_text(json.dumps(report, indent=1), encoding="utf-8")
    for cell, value in cells.items():
        print(f"{cell}: median {value['median']:.2f} s, worst {value['worst']:.2f} s")


if __name__ == "__main__":
    main()
