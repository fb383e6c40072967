"""Live page vs CLI decoding speed on this machine, run from the repo root:

    PYTHONPATH=. .venv/bin/python -m benchmarks.live_page [--runs 3] [--max-new-tokens 64] [--policy fixed_tree]
        [--busy] [--app-threads N] [--live-engine ray|thread] [--cli-threads N]
        [--out assets/benchmarks/cpu-live-page.json]

1. Starts `streamlit run app.py` headless on a free port (benchmarks.app_server, as the e2e test
   does; `--app-threads` sets the server's DYNATREE_THREADS) and opens it in Debian's Chromium through Playwright.
2. Picks the embedded pair, the policy and max new tokens in the sidebar (prompt and chat
   template stay at the page's defaults), presses Run once as a warm-up (it loads the models),
   and one CLI process as a warm-up.
3. Then `--runs` rounds, each one page run (Reset + Run, wait for the finished run, read the
   page's "Tokens / s (engine time)" metric and the engine's thread count from its caption)
   followed by one CLI process run as a user would (`python -m dynatree_core generate --prompt
   <the page's prompt> --chat --policy P --max-new-tokens N --json --num-samples 2`) with the
   browser still open on the finished page: the first sample is what a user's one-shot command
   measures (a cold process), the second the same run warm, as the page's server is after its
   warm-up. Alternating puts both sides of each ratio in the same minute: this shared host's
   speed drifts by up to 25% between minutes.
4. Prints a summary and writes the report: per-run tokens/s of both sides, medians, the
   round-by-round ratios page/CLI and their median, the thread counts each side used, and the
   machine.

`--busy` keeps one extra process burning a core for the whole measurement (a second program on
a teacher's laptop). Needs Debian's chromium (`apt-get install -y chromium`) and the playwright
package; never `playwright install`. Both sides measure engine time from the same records
(`metrics.summarize`: new tokens / summed iteration wall time, prefill included).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import RESULTS, ROOT
from benchmarks.app_server import AppServerError, app_server, background

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
TPS_LABEL = "Tokens / s (engine time)"
DEFAULT_MAX_NEW = 64  # the page's default "Max new tokens"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3, help="measured runs per side (after one warm-up each)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--policy", default="fixed_tree", help="a tree policy the page can run live")
    p.add_argument("--busy", action="store_true", help="one extra CPU-burning process during the measurement")
    p.add_argument("--app-threads", type=int, default=None, help="DYNATREE_THREADS for the server")
    p.add_argument("--live-engine", choices=("ray", "thread"), default=None, help="DYNATREE_LIVE_ENGINE for the server")
    p.add_argument("--cli-threads", type=int, default=None, help="--threads for the CLI (default: its own)")
    p.add_argument("--timeout-s", type=float, default=600, help="the longest one page run may take")
    p.add_argument("--out", type=Path, default=RESULTS / "cpu-live-page.json")
    args = p.parse_args(argv)
    if args.runs < 1 or not 1 <= args.max_new_tokens <= 512:
        p.error("--runs must be at least 1 and --max-new-tokens within the page's 1-512")
    return args


def environment() -> dict:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": cpu,
        "cores": cores,
        "logical_cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "DYNATREE_THREADS": os.environ.get("DYNATREE_THREADS"),
    }


# ----- the page ---------------------------------------------------------------------------------
def idle(page, timeout_ms: float = 120_000) -> None:
    """The page is drawn (the Run button) and its script has finished."""
    page.get_by_role("button", name="Run", exact=True).wait_for(timeout=timeout_ms)
    page.wait_for_selector("[data-testid=stApp][data-test-script-state=notRunning]", timeout=timeout_ms)


def choose(page, label: str, option: str) -> None:
    """Pick `option` in the sidebar selectbox labelled `label` (a no-op when already chosen)."""
    box = page.get_by_role("combobox", name=label, exact=True)
    if box.input_value() != option:
        box.click()
        page.get_by_role("option", name=option, exact=True).click()
        idle(page)
    if box.input_value() != option:
        raise SystemExit(f"could not choose {option!r} in {label!r}: the box shows {box.input_value()!r}")


def set_max_new_tokens(page, n: int) -> None:
    slider = page.get_by_role("slider", name="Max new tokens")
    slider.focus()
    key = "ArrowLeft" if n < DEFAULT_MAX_NEW else "ArrowRight"
    for _ in range(abs(n - int(slider.input_value()))):  # an <input type=range>
        page.keyboard.press(key)
    idle(page)
    if int(slider.input_value()) != n:
        raise SystemExit(f"Max new tokens shows {slider.input_value()}, not {n}")


def metric(page, label: str) -> str:
    box = page.locator("[data-testid=stMetric]").filter(has_text=label)
    return box.locator("[data-testid=stMetricValue]").inner_text(timeout=30_000)


def page_run(page, timeout_s: float) -> dict:
    """Reset, Run, wait for the finished run; what the page shows about it."""
    page.get_by_role("button", name="Reset", exact=True).click()
    page.get_by_text("Press Run", exact=False).wait_for(timeout=60_000)
    idle(page)
    start = time.monotonic()
    page.get_by_role("button", name="Run", exact=True).click()
    page.get_by_text("Finished:", exact=False).first.wait_for(timeout=timeout_s * 1000)
    seen_s = time.monotonic() - start
    idle(page)
    if page.locator("[data-testid=stException]").count() or page.get_by_text("The run stopped").count():
        raise SystemExit("the page raised during the run")
    caption = page.get_by_text(re.compile(r"Measured on .* torch thread")).first.inner_text()
    threads = re.search(r"(\d+) torch threads? of (\d+) cores", caption)
    where = "process" if "in its own process" in caption else "thread" if "in a thread" in caption else None
    measured = re.search(r"Measured on (\S+), (\w+)", caption)
    return {
        "tokens_per_s": float(metric(page, TPS_LABEL)),
        "new_tokens": int(metric(page, "New tokens")),
        "iterations": int(metric(page, "Iterations")),
        "tokens_per_iteration": float(metric(page, "Tokens / iteration")),
        "threads": int(threads.group(1)) if threads else None,
        "engine": where,  # the engine decoded in its own process or in a thread of the server
        "device": measured.group(1) if measured else None,
        "dtype": measured.group(2) if measured else None,
        "seen_finished_after_s": round(seen_s, 2),  # click to "Finished:" seen: drawing and polling included
    }


def prepare_page(page, args: argparse.Namespace) -> tuple[str, dict]:
    """(the page's prompt, a warm-up run) on an open page set to the run's settings."""
    idle(page)
    choose(page, "Model pair", "embedded")
    choose(page, "Policy", args.policy)
    set_max_new_tokens(page, args.max_new_tokens)
    prompt = page.get_by_label("Prompt", exact=True).input_value()
    if not page.get_by_role("switch", name="Chat template", exact=True).is_checked():
        raise SystemExit("the chat template toggle is off: the CLI run would not match")
    warmup = page_run(page, args.timeout_s)  # loads (and on a fresh machine converts) the models
    print(f"page warm-up: {warmup['tokens_per_s']} tokens/s", flush=True)
    return prompt, warmup


# ----- the CLI ----------------------------------------------------------------------------------
def cli_command(prompt: str, args: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, "-m", "dynatree_core", "generate", "--prompt", prompt, "--chat"]
    cmd += ["--policy", args.policy, "--max-new-tokens", str(args.max_new_tokens), "--json", "--num-samples", "2"]
    return cmd + (["--threads", str(args.cli_threads)] if args.cli_threads else [])


def cli_run(cmd: list[str]) -> dict:
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"the CLI failed ({done.returncode}):\n{done.stderr[-2000:]}")
    first, warm = json.loads(done.stdout)
    return {
        "first_tokens_per_s": first["throughput_tps"],  # what one `generate` command measures
        "warm_tokens_per_s": warm["throughput_tps"],  # the same run again in the same process
        "new_tokens": warm["new_tokens"],
        "iterations": warm["iterations"],
        "tokens_per_iteration": warm["tokens_per_iteration"],
        "threads": warm.get("threads"),
        "device": warm.get("device"),
        "dtype": warm.get("dtype"),
        "same_tokens_both_samples": first["token_ids"] == warm["token_ids"],
    }


def interleaved(page, prompt: str, args: argparse.Namespace) -> tuple[list[dict], list[dict], dict]:
    """(page runs, CLI runs, the CLI's warm-up): page and CLI alternate, run by run, so that both
    sides of each ratio see the machine in the same minute (its speed drifts on a shared host)."""
    cmd = cli_command(prompt, args)
    cli_warmup = cli_run(cmd)
    print(f"CLI warm-up: {cli_warmup['first_tokens_per_s']:.1f} / {cli_warmup['warm_tokens_per_s']:.1f} tokens/s")
    page_runs, cli_runs = [], []
    for i in range(args.runs):
        page_runs.append(page_run(page, args.timeout_s))
        cli_runs.append(cli_run(cmd))  # the browser stays open on the finished page
        r = cli_runs[-1]
        print(f"run {i + 1}/{args.runs}: page {page_runs[-1]['tokens_per_s']} tokens/s, CLI "
              f"{r['first_tokens_per_s']:.1f} (first) / {r['warm_tokens_per_s']:.1f} (warm)", flush=True)  # fmt: skip
    return page_runs, cli_runs, cli_warmup


# ----- the report -------------------------------------------------------------------------------
def summary(page_runs: list[dict], cli_runs: list[dict]) -> dict:
    page = statistics.median(r["tokens_per_s"] for r in page_runs)
    first = statistics.median(r["first_tokens_per_s"] for r in cli_runs)
    warm = statistics.median(r["warm_tokens_per_s"] for r in cli_runs)
    return {
        "page_tokens_per_s_median": page,
        "cli_first_tokens_per_s_median": round(first, 2),
        "cli_warm_tokens_per_s_median": round(warm, 2),
        "ratio_page_to_cli_warm": round(page / warm, 3) if warm else None,
        "ratio_page_to_cli_first": round(page / first, 3) if first else None,
        "ratio_page_to_cli_warm_per_round": [
            round(p["tokens_per_s"] / c["warm_tokens_per_s"], 3) for p, c in zip(page_runs, cli_runs, strict=True)
        ],
        "ratio_page_to_cli_warm_median_of_rounds": round(
            statistics.median(
                p["tokens_per_s"] / c["warm_tokens_per_s"] for p, c in zip(page_runs, cli_runs, strict=True)
            ),
            3,
        ),
        "page_engine": sorted({r.get("engine") or "?" for r in page_runs}),
        "page_threads": sorted({r["threads"] for r in page_runs if r["threads"] is not None}),
        "cli_threads": sorted({r["threads"] for r in cli_runs if r["threads"] is not None}),
        "same_new_tokens": len({r["new_tokens"] for r in page_runs} | {r["new_tokens"] for r in cli_runs}) == 1,
    }


def measure(args: argparse.Namespace, machine: dict) -> dict:
    from playwright.sync_api import sync_playwright

    env: dict[str, str] = {}
    if args.app_threads is not None:
        env["DYNATREE_THREADS"] = str(args.app_threads)
    if args.live_engine is not None:
        env["DYNATREE_LIVE_ENGINE"] = args.live_engine
    busy = background([sys.executable, "-c", "while True: pass"]) if args.busy else contextlib.nullcontext()
    server = app_server(env, log_dir=Path(tempfile.gettempdir()), log_prefix="dynatree-live-page")
    with busy, server as app, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1500, "height": 1100})
        page.goto(app.url)
        prompt, page_warmup = prepare_page(page, args)
        page_runs, cli_runs, cli_warmup = interleaved(page, prompt, args)
        browser.close()
    return {
        "what": "live page (Chromium open on this machine) vs CLI: engine-time tokens/s, same prompt and settings",
        "settings": {
            "pair": "embedded",
            "policy": args.policy,
            "max_new_tokens": args.max_new_tokens,
            "prompt": prompt,
            "chat": True,
            "runs": args.runs,
            "busy": args.busy,
            "app_threads": args.app_threads,
            "live_engine": args.live_engine or "the app's default",
            "cli_threads": args.cli_threads,
            "render_interval_note": "the page draws its latest iteration every RENDER_INTERVAL_S (app.py)",
            "cli_command": " ".join(cli_command("<prompt>", args)[1:]),
        },
        "environment": machine,
        "summary": summary(page_runs, cli_runs),
        "page": {"warmup": page_warmup, "runs": page_runs},
        "cli": {"warmup": cli_warmup, "runs": cli_runs},
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not Path(CHROMIUM).exists():
        raise SystemExit("Debian's chromium is missing: apt-get install -y chromium")
    try:
        report = measure(args, environment())
    except AppServerError as e:
        raise SystemExit(str(e)) from None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(report["summary"], indent=2))
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
