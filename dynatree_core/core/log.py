"""The server log: where the app, its pages and its engine processes write every exception with
its traceback, so that the one line a page shows can point to the whole story.

One file for every process of a server (`DYNATREE_LOG`, default `~/.cache/dynatree/server.log`),
appended to, plus standard error (the terminal that ran `streamlit run`). Each record is written
in one call, so the lines of two processes do not interleave within a record.
"""

from __future__ import annotations

import logging
import sys
import threading
from pathlib import Path

from dynatree_core.core.settings import env

LOG_ENV = "DYNATREE_LOG"
_LOGGER = "dynatree"
_setup = threading.Lock()


def log_path() -> Path:
    """The server log's file (DYNATREE_LOG, else ~/.cache/dynatree/server.log)."""
    where = env(LOG_ENV)
    return Path(where).expanduser() if where else Path.home() / ".cache" / "dynatree" / "server.log"


def logger() -> logging.Logger:
    """The project's logger, writing to the server log and standard error (set up on first use, and
    again when DYNATREE_LOG names another file; a log file that cannot be opened leaves standard
    error alone, with a line saying so)."""
    log = logging.getLogger(_LOGGER)
    path = log_path()
    with _setup:
        if getattr(log, "_dynatree_path", None) != path:
            for old in list(log.handlers):
                log.removeHandler(old)
                old.close()
            log.setLevel(logging.INFO)
            log.propagate = False
            form = logging.Formatter("%(asctime)s %(process)d %(levelname)s %(message)s")
            handlers: list[logging.Handler] = [_Stderr()]
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                handlers.append(logging.FileHandler(path, encoding="utf-8"))
            except OSError as exc:
                print(f"dynatree: cannot write the server log {path}: {exc}", file=sys.stderr)
            for handler in handlers:
                handler.setFormatter(form)
                log.addHandler(handler)
            log._dynatree_path = path  # type: ignore[attr-defined]
    return log


class _Stderr(logging.StreamHandler):
    """Standard error as it is when a record is written, not when the logger was set up: a
    replaced stream (pytest's capture, closed after its test) may be gone when an engine's
    watcher thread logs its end."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def log_exception(where: str, exc: BaseException | None = None) -> str:
    """Log `exc` (default: the exception being handled) with its traceback under `where`; returns
    the sentence a page adds to its one-line message ("details in the server log: <path>")."""
    exc = exc if exc is not None else sys.exc_info()[1]
    info = (type(exc), exc, exc.__traceback__) if exc is not None else True
    logger().error("%s: %s: %s", where, type(exc).__name__ if exc else "error", exc, exc_info=info)
    return f"details in the server log: {log_path()}"


def log_info(message: str, *args) -> None:
    """One line in the server log (engine starts and ends, evictions, queue waits)."""
    logger().info(message, *args)
