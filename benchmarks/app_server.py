"""`streamlit run app.py` on a free port for as long as a block runs: the one way the browser test
(tests/test_e2e.py) and the browser benchmarks (live_page, first_iterations) start the app.

    with app_server({"DYNATREE_REPLAY": "1"}, log_dir=Path("tests/output")) as server:
        page.goto(server.url)

Headless on 127.0.0.1, no usage stats, no file watcher; `env` is added to this process's
environment (read when the block starts, so a test's conftest settings reach the server). The
server's output goes to `log_dir/<log_prefix>-<port>.log` (the system's temp folder by default).
It waits until `/_stcore/health` answers "ok" (`AppServerError` with the log's tail when the
server exits first or `start_timeout_s` passes), and afterwards ends the server by its own pid:
terminate, then kill if it has not exited within `stop_timeout_s`.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks import ROOT

HOST = "127.0.0.1"


class AppServerError(RuntimeError):
    """The server exited or did not answer in time; `log_tail` is the end of its output."""

    def __init__(self, log_tail: str):
        super().__init__(f"streamlit did not start:\n{log_tail}")
        self.log_tail = log_tail


@dataclass(frozen=True)
class AppServer:
    url: str
    port: int
    log: Path
    proc: subprocess.Popen


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def server_command(port: int) -> list[str]:
    return [
        sys.executable, "-m", "streamlit", "run", "app.py",
        "--server.headless", "true", "--server.port", str(port), "--server.address", HOST,
        "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none",
    ]  # fmt: skip


def stop(proc: subprocess.Popen, timeout_s: float = 30) -> None:
    """End a process this module started, by its own pid: terminate, kill if it lingers."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def background(cmd: Sequence[str], *, env: Mapping[str, str] | None = None, log: Path | None = None):
    """A process (run from the repo root) for the duration of the block, ended afterwards."""
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 (closed below)
    try:
        proc = subprocess.Popen(list(cmd), cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            yield proc
        finally:
            stop(proc)
    finally:
        if log:
            out.close()


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 120) -> None:
    """Until the server answers its health check; AppServerError if it exits or times out first."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError):
            if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).read() == b"ok":
                return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AppServerError(log.read_text(errors="replace")[-2000:])
        time.sleep(0.5)


@contextlib.contextmanager
def app_server(
    env: Mapping[str, str] | None = None,
    *,
    log_dir: Path | None = None,
    log_prefix: str = "streamlit",
    start_timeout_s: float = 120,
    stop_timeout_s: float = 30,
) -> Iterator[AppServer]:
    """The app served on a free port while the block runs (see the module's docstring)."""
    port = free_port()
    log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.gettempdir())
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{log_prefix}-{port}.log"
    url = f"http://{HOST}:{port}"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            server_command(port), cwd=ROOT, env=os.environ | dict(env or {}), stdout=out, stderr=subprocess.STDOUT
        )
        try:
            wait_healthy(url, proc, log, start_timeout_s)
            yield AppServer(url=url, port=port, log=log, proc=proc)
        finally:
            stop(proc, stop_timeout_s)
