"""A classroom on one server, in a real browser: three sessions each on one of the three offline
pairs (embedded, embedded-token, embedded-eagle3) press Run while a fourth runs a comparison.
Every run finishes, the greedy texts are equal across pairs (one target, exact drafts), the server
log holds no traceback, and the server holds one engine (a Ray actor) per pair and no model of its own.

`make soak` runs the same for DYNATREE_SOAK_ROUNDS rounds (every session presses Run again).
Figures (seconds to finish, memory of each process) go to tests/output/classroom-ray.json.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

import pytest

from tests.test_e2e import CHROMIUM, OUTPUT, _idle, _serve

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
PAIRS = ("embedded", "embedded-token", "embedded-eagle3")
NEW_TOKENS = 24
ROUNDS = int(os.environ.get("DYNATREE_SOAK_ROUNDS", "1") or 1)


def _pick(page, label: str, option: str) -> None:
    """Choose `option` in the selectbox labelled `label` (the sidebar's model pair)."""
    page.locator("[data-testid=stSelectbox]").filter(has_text=label).first.click()
    page.get_by_role("option", name=option, exact=True).click()
    page.wait_for_selector("[data-testid=stApp][data-test-script-state=notRunning]", timeout=60_000)


def _slide_down(page, name: str, start: int, value: int) -> None:
    """Move the slider `name` from its default `start` down to `value` (one step per key press)."""
    page.get_by_role("slider", name=name).focus()
    for _ in range(start - value):
        page.keyboard.press("ArrowLeft")
    page.wait_for_selector("[data-testid=stApp][data-test-script-state=notRunning]", timeout=60_000)


def _live_session(browser, url: str, pair: str):
    page = browser.new_context(viewport={"width": 1366, "height": 900}).new_page()
    page.goto(url)
    _idle(page)
    if pair != "embedded":
        _pick(page, "Model pair", pair)
    _slide_down(page, "Max new tokens", 64, NEW_TOKENS)
    return page


def _compare_session(browser, url: str):
    page = browser.new_context(viewport={"width": 1366, "height": 900}).new_page()
    page.goto(f"{url}/Compare_Policies")
    page.get_by_role("button", name="Compare").wait_for(timeout=120_000)
    count = page.get_by_label("Policies to compare")
    count.fill("2")
    count.press("Enter")
    page.wait_for_selector("[data-testid=stApp][data-test-script-state=notRunning]", timeout=60_000)
    _slide_down(page, "Repetitions", 3, 1)
    _slide_down(page, "Max new tokens", 64, NEW_TOKENS)
    page.get_by_text("HF generate references", exact=True).click()  # ar alone as the reference: shorter
    page.wait_for_selector("[data-testid=stApp][data-test-script-state=notRunning]", timeout=60_000)
    return page


def _engines(server_pid: int) -> list:
    """The engines under the server: Ray's actor workers (live/actor.py)."""
    import psutil

    kids = psutil.Process(server_pid).children(recursive=True)
    return [p for p in kids if "ray::EngineActor" in " ".join(p.cmdline())]


def _ray_processes(server_pid: int) -> list:
    """Ray's own processes under the server (its runtime: gcs, raylet, agents), the engines apart."""
    import psutil

    kids = psutil.Process(server_pid).children(recursive=True)
    return [p for p in kids if "ray" in " ".join(p.cmdline()).lower() and "EngineActor" not in " ".join(p.cmdline())]


def test_a_class_on_one_server_three_pairs_and_a_comparison_at_once():
    from playwright.sync_api import sync_playwright

    OUTPUT.mkdir(parents=True, exist_ok=True)
    engine = "ray"
    log = OUTPUT / f"classroom-{engine}-server.log"
    log.unlink(missing_ok=True)
    figures = {"engine": engine, "pairs": list(PAIRS), "new_tokens": NEW_TOKENS, "rounds": []}
    with _serve(DYNATREE_LOG=str(log)) as url, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        pages = [_live_session(browser, url, pair) for pair in PAIRS]
        compare = _compare_session(browser, url)
        for round_ in range(ROUNDS):
            t0 = time.monotonic()
            for page in pages:
                page.get_by_role("button", name="Run", exact=True).click()
            compare.get_by_role("button", name="Compare").click()
            finished: dict[str, float] = {}
            deadline = time.monotonic() + 900
            while time.monotonic() < deadline and len(finished) < len(PAIRS) + 1:
                for pair, page in zip(PAIRS, pages, strict=True):
                    with contextlib.suppress(Exception):
                        if pair not in finished and page.get_by_text("Finished:", exact=False).count():
                            finished[pair] = round(time.monotonic() - t0, 1)
                with contextlib.suppress(Exception):
                    if "compare" not in finished and compare.get_by_text("Results", exact=True).count():
                        finished["compare"] = round(time.monotonic() - t0, 1)
                time.sleep(0.5)
            assert len(finished) == len(PAIRS) + 1, f"round {round_}: finished only {finished}"
            texts = {}
            for pair, page in zip(PAIRS, pages, strict=True):
                _idle(page)
                assert page.locator("[data-testid=stException]").count() == 0, pair
                assert page.locator("[data-testid=stAlert]").filter(has_text="could not").count() == 0, pair
                texts[pair] = page.locator("[data-testid=stHtml]").last.inner_text()
            compare.wait_for_selector("[data-testid=stApp][data-test-script-state=notRunning]", timeout=60_000)
            assert compare.get_by_text("Exact:", exact=False).count(), "the comparison's outputs differ from ar's"
            assert len(set(texts.values())) == 1 and texts[PAIRS[0]].strip(), texts
            engines = _engines(_server_pid(url))
            figures["rounds"].append(
                {
                    "finished_s": finished,
                    "engine_processes": len(engines),
                    "engine_rss_mib": sorted(round(p.memory_info().rss / 2**20) for p in engines),
                    "server_rss_mib": round(_server_process(url).memory_info().rss / 2**20),
                    "ray_rss_mib": round(sum(p.memory_info().rss for p in _ray_processes(_server_pid(url))) / 2**20),
                }
            )
            assert len(engines) == len(PAIRS), f"one engine per pair, not {len(engines)}"
        browser.close()
        console = (OUTPUT / f"streamlit-{url.rsplit(':', 1)[1]}.log").read_text()
    logged = log.read_text() if log.exists() else ""
    figures["server_log_lines"] = len(logged.splitlines())
    (OUTPUT / f"classroom-{engine}.json").write_text(json.dumps(figures, indent=1))
    assert "Traceback" not in logged and " ERROR " not in logged, logged[-3000:]
    assert "Traceback" not in console, console[-3000:]
    assert logged.count("pool: started") == len(PAIRS), "each pair loaded once"


def _server_process(url: str):
    import psutil

    port = int(url.rsplit(":", 1)[1])
    for conn in psutil.net_connections(kind="tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
            return psutil.Process(conn.pid)
    raise AssertionError(f"no process listens on {port}")


def _server_pid(url: str) -> int:
    return _server_process(url).pid
