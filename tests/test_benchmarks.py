"""The benchmark scripts (benchmarks/) stay runnable: each imports without doing any work, answers
--help from its argparse, patches no sys.path and keeps its functions short; and the app-server
helper they share with tests/test_e2e.py starts, answers and stops a server (a stand-in here: the
real app is started by the browser tests)."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import benchmarks
from benchmarks import app_server

PACKAGE = Path(benchmarks.__file__).resolve().parent
MODULES = sorted(m.name for m in pkgutil.iter_modules([str(PACKAGE)]))
SCRIPTS = [m for m in MODULES if m != "app_server"]
MAX_FUNCTION_LINES = 80


def test_the_package_holds_every_script_and_its_docstring_lists_them():
    assert len(SCRIPTS) >= 13 and not list((benchmarks.ROOT / "assets" / "benchmarks").glob("*.py"))
    assert not list((benchmarks.ROOT / "assets" / "benchmarks").glob("*.sh")), "scripts live in benchmarks/"
    assert (PACKAGE / "gpu_session.sh").exists()
    for name in MODULES:
        assert f"    {name} " in benchmarks.__doc__, f"benchmarks/__init__.py: say what {name} measures"
    assert benchmarks.RESULTS == benchmarks.ROOT / "assets" / "benchmarks" and benchmarks.RESULTS.is_dir()


@pytest.mark.parametrize("name", MODULES)
def test_each_module_imports_and_its_script_answers_help(name, capsys):
    module = importlib.import_module(f"benchmarks.{name}")
    if name == "app_server":
        return
    assert callable(module.main), f"benchmarks/{name}.py: its work goes in main(argv)"
    with pytest.raises(SystemExit) as done:
        module.main(["--help"])
    assert done.value.code == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("name", MODULES)
def test_no_sys_path_patch_no_long_function_and_a_main_guard(name):
    source = (PACKAGE / f"{name}.py").read_text(encoding="utf-8")
    tree = ast.parse(source)
    assert "sys.path" not in source, f"benchmarks/{name}.py: run it as `python -m benchmarks.{name}`"
    long = [
        f"{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"benchmarks/{name}.py: split {long}"
    if name != "app_server":
        guards = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
        assert guards, f"benchmarks/{name}.py: run main() under `if __name__ == '__main__':`"


# A stand-in for `streamlit run app.py`: answers the health check with "ok" and prints its env.
FAKE_SERVER = textwrap.dedent(
    """
    import http.server, os, sys
    port = int(sys.argv[sys.argv.index("--server.port") + 1])
    print("DYNATREE_PROBE", os.environ.get("DYNATREE_PROBE"), flush=True)
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        def log_message(self, *args):
            pass
    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
    """
)


def test_the_app_server_starts_answers_and_stops(monkeypatch, tmp_path):
    fake = [sys.executable, "-c", FAKE_SERVER, "--server.port"]
    monkeypatch.setattr(app_server, "server_command", lambda port: [*fake, str(port)])
    with app_server.app_server({"DYNATREE_PROBE": "on"}, log_dir=tmp_path, log_prefix="probe") as app:
        assert app.url == f"http://127.0.0.1:{app.port}" and app.proc.poll() is None
        assert app.log == tmp_path / f"probe-{app.port}.log"
    assert app.proc.poll() is not None, "the server is ended when the block ends"
    assert "DYNATREE_PROBE on" in app.log.read_text()


def test_the_app_server_reports_a_server_that_exits_with_its_log(monkeypatch, tmp_path):
    monkeypatch.setattr(app_server, "server_command", lambda port: [sys.executable, "-c", "print('no app here')"])
    with pytest.raises(app_server.AppServerError) as failed, app_server.app_server(log_dir=tmp_path):
        pass
    assert "no app here" in failed.value.log_tail and "streamlit did not start" in str(failed.value)


def test_the_real_command_is_the_app_headless_without_a_file_watcher():
    cmd = app_server.server_command(8765)
    assert cmd[:5] == [sys.executable, "-m", "streamlit", "run", "app.py"]
    flags = dict(zip(cmd[5::2], cmd[6::2], strict=True))
    assert flags == {
        "--server.headless": "true",
        "--server.port": "8765",
        "--server.address": "127.0.0.1",
        "--browser.gatherUsageStats": "false",
        "--server.fileWatcherType": "none",
    }


def test_gpu_session_script_parses_and_lists_its_calls_by_the_new_path():
    script = PACKAGE / "gpu_session.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    calls = subprocess.run(["bash", str(script), "calls"], capture_output=True, text=True, check=True).stdout
    assert "benchmarks/gpu_session.sh receive 00" in calls and "assets/benchmarks/gpu_session.sh" not in calls


def test_draft_merit_ships_only_a_draft_ahead_on_agreement_and_speed():
    from benchmarks.draft_merit import goals_table, summary, verdict

    def passes(speedups: dict[str, float], tpi: float) -> dict:
        return {
            "policies": {
                p: {"speedup_vs_faster_of_ar_hf": s, "tokens_per_iteration": tpi, "exact": 8}
                for p, s in speedups.items()
            }
        }

    readme = {"linear": 0.9, "fixed_tree": 1.5, "dynatree": 1.3, "salf": 1.6}
    shipped = summary([0.63, 0.55, 0.53, 0.5], passes({"linear": 3.0, "salf": 1.7, "fixed_tree": 1.5}, 2.07), readme, 8)
    assert shipped["best_speedup"] == 1.7, "linear is no tree policy: its speedup never counts as the best"
    assert shipped["readme_min_over_ar"] == 1.3 and shipped["every_row_exact"]
    fast, slow = passes({"salf": 1.95, "fixed_tree": 1.8}, 2.5), passes({"salf": 1.6, "fixed_tree": 1.5}, 2.5)
    better = summary([0.72, 0.6, 0.61, 0.5], fast, readme, 8)
    worse_speed = summary([0.72, 0.6, 0.61, 0.5], slow, readme, 8)
    worse_depth2 = summary([0.72, 0.5, 0.61, 0.5], fast, readme, 8)
    assert verdict(shipped, better) and not verdict(shipped, shipped)
    assert not verdict(shipped, worse_speed) and not verdict(shipped, worse_depth2)
    table = goals_table({"shipped": shipped, "candidate": better})
    assert "0.630 (not met)" in table and "0.720 (met)" in table and "1.950 (met)" in table
