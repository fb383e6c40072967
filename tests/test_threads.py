"""torch's thread count is decided in one place, and the CLI's engine switches reach the engine."""

from __future__ import annotations

import json

import pytest
import torch

from dynatree_core.cli import main
from dynatree_core.core import threads as T
from dynatree_core.errors import DynaTreeError


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_an_explicit_request_beats_the_environment_which_beats_the_default(monkeypatch):
    monkeypatch.setenv(T.ENV, "3")
    assert T.resolve_threads(2) == (2, "asked")
    assert T.resolve_threads(None) == (3, "env")
    assert T.resolve_threads("auto") == (3, "env")
    monkeypatch.delenv(T.ENV)
    assert T.resolve_threads(None, "cli") == (T.available_cores(), "default")


def test_the_app_leaves_a_core_to_the_browser_and_server():
    assert T.default_threads("app", cores=2) == 1
    assert T.default_threads("app", cores=16) == 15
    assert T.default_threads("app", cores=1) == 1, "never zero threads"
    assert T.default_threads("cli", cores=2) == 2
    with pytest.raises(ValueError):
        T.default_threads("server", cores=2)


@pytest.mark.parametrize("bad", ["x", "-1", "1.5", -2])
def test_invalid_thread_counts_are_refused_with_a_message(monkeypatch, bad):
    with pytest.raises(DynaTreeError, match="thread"):
        T.resolve_threads(bad)
    monkeypatch.setenv(T.ENV, str(bad))
    with pytest.raises(DynaTreeError, match=T.ENV):
        T.resolve_threads(None)


def test_configure_applies_the_count_and_remembers_why(restore_threads, monkeypatch):
    monkeypatch.delenv(T.ENV, raising=False)
    assert T.configure_threads(1, role="app") == 1 and torch.get_num_threads() == 1
    assert T.threads_source() == "asked (app)"
    torch.set_num_threads(2)
    assert T.threads_source() == "external", "a change made elsewhere is not claimed as ours"


def test_cli_threads_and_forward_switches_reach_the_run(capsys, tiny_pair_dirs, restore_threads):
    target, draft = tiny_pair_dirs
    args = ["generate", "--target", target, "--draft", draft, "--prompt", "hello", "--max-new-tokens", "8", "--json"]
    results = {}
    for name, extra in {
        "lean": [],
        "static": ["--no-fast-forward"],
        "dynamic": ["--no-static-cache"],
    }.items():
        assert main([*args, "--threads", "1", *extra]) == 0
        results[name] = json.loads(capsys.readouterr().out)
    assert {name: r["forward_path"] for name, r in results.items()} == {n: n for n in results}
    assert all(r["threads"] == 1 for r in results.values())
    assert results["lean"]["token_ids"] == results["static"]["token_ids"] == results["dynamic"]["token_ids"]
    assert main([*args, "--threads", "zero"]) == 2
    assert "--threads" in capsys.readouterr().err


def test_latency_reports_threads_and_the_forward_path(capsys, tiny_pair_dirs, restore_threads):
    target, draft = tiny_pair_dirs
    base = ["latency", "--target", target, "--draft", draft, "--tokens", "1,2", "--contexts", "8", "--repeats", "1"]
    assert main([*base, "--json", "--threads", "1", "--no-fast-forward"]) == 0
    env = json.loads(capsys.readouterr().out)["environment"]
    assert env["torch_threads"] == 1 and env["threads_source"] == "asked (cli)" and env["forward_path"] == "static"
