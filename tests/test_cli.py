"""The command line: JSON output schema, and one-line errors with exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dynatree_core.cli import main

RESULT_FIELDS = {
    "text",
    "token_ids",
    "iterations",
    "new_tokens",
    "target_forwards",
    "tokens_per_iteration",
    "acceptance_rate",
    "mean_accepted_length",
    "throughput_tps",
    "ttft_ms",
    "tpot_ms",
    "peak_memory_mb",
    "draft_ms",
    "verify_ms",
    "commit_ms",
    "overhead_ms",
    "stop_reason",
    "policy",
    "params",
}


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["generate", "--prompt", ""], "prompt is empty"),
        (["generate", "--prompt", "   \n\t"], "prompt is empty"),
        (["generate"], "prompt is empty"),
        (["generate", "--prompt", "hi", "--policy", "nope"], "unknown policy"),
        (["generate", "--prompt", "hi", "--param", "depth=99"], "out of range"),
        (["generate", "--prompt", "hi", "--param", "tau=nan"], "finite"),
        (["generate", "--prompt", "hi", "--param", "bogus=1"], "no parameter"),
        (["generate", "--prompt", "hi", "--param", "depth"], "key=value"),
        (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "at least 1"),
        (["generate", "--prompt", "hi", "--no-such-flag"], "unrecognized"),
        (["generate", "--prompt-file", "/nonexistent/prompt.txt"], "cannot read"),
        (["generate", "--prompt", "hi", "--target", "./no/such/dir"], "not found"),
        (["generate", "--prompt", "hi", "--target", "someorg/not-a-model"], "cannot load"),
        (["generate", "--prompt", "hi", "--device", "cuda:7"], "device"),
        (["frobnicate"], "invalid choice"),
        (["generate", "--prompt", "hi", "--preset", "nope"], "unknown preset"),
    ],
)
def test_bad_input_exits_2_with_one_error_line(capsys, argv, needle):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error:") and needle in lines[-1], err
    assert "Traceback" not in err


def test_policies_json_lists_the_registry(capsys):
    code, out, _ = run_cli(capsys, "policies", "--json")
    assert code == 0
    policies = {p["name"]: p for p in json.loads(out)}
    paper = {"dynatree", "dyspec", "dyspec_threshold", "eagle2", "salf", "delayed", "ngram"}
    assert {"ar", "linear", "fixed_tree", "hf_assisted", "hf_prompt_lookup"} | paper <= set(policies)
    assert policies["hf_assisted"]["black_box"] and not policies["salf"]["black_box"]
    assert {"nodes", "batch", "th", "retrieved", "recycled"} == {p["name"] for p in policies["salf"]["params"]}
    families = {name: p["family"] for name, p in policies.items()}
    assert families["fixed_tree"] == "model" and families["ar"] == families["hf_generate"] == "none"
    assert families["ngram"] == families["suffix"] == families["hf_prompt_lookup"] == "retrieved"
    assert families["recycle"] == "recycled" and families["joined_fixed_tree"] == "joined"
    names = {p["name"] for p in policies["fixed_tree"]["params"]}
    assert {"depth", "branch", "tau", "budget"} <= names


@pytest.mark.slow
def test_generate_json_fixed_tree_matches_ar_in_a_subprocess():
    def run(policy: str) -> dict:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "dynatree_core",
                "generate",
                "--prompt",
                "Name three primary colors.",
                "--chat",
                "--policy",
                policy,
                "--max-new-tokens",
                "24",
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr
        assert "Traceback" not in proc.stderr
        return json.loads(proc.stdout)

    tree, ar = run("fixed_tree"), run("ar")
    assert set(tree) >= RESULT_FIELDS, RESULT_FIELDS - set(tree)
    assert tree["token_ids"] == ar["token_ids"]
    assert tree["target_forwards"] == tree["iterations"]
    assert ar["iterations"] == ar["new_tokens"]


@pytest.mark.slow
def test_chat_template_is_on_by_default_for_an_instruct_target(capsys):
    def ids(*flags: str) -> list[int]:
        code, out, _ = run_cli(
            capsys,
            "generate",
            "--prompt",
            "Name a colour.",
            "--policy",
            "ar",
            "--max-new-tokens",
            "6",
            "--json",
            *flags,
        )
        assert code == 0
        return json.loads(out)["token_ids"]

    default = ids()
    assert default == ids("--chat")
    assert default != ids("--no-chat")


def test_bench_reports_policies_against_the_best_reference(capsys, tiny_pair_dirs, tmp_path, monkeypatch):
    target, draft = tiny_pair_dirs
    for name in ("plotly", "dynatree_core.viz.bench"):  # a bench without sweeps needs no plotting (headless GPU)
        monkeypatch.setitem(sys.modules, name, None)
    out = tmp_path / "reports" / "results.json"  # a folder that does not exist yet: bench makes it
    code, printed, err = run_cli(
        capsys,
        "bench",
        "--target", target, "--draft", draft, "--dtype", "float32",
        "--policies", "ar,linear", "--policy", "fixed_tree:depth=3,branch=2", "--policy", "hf_assisted",
        "--limit", "3", "--max-new-tokens", "6", "--repeats", "2", "--max-prompt-tokens", "8", "--out", str(out),
    )  # fmt: skip
    assert code == 0, err
    assert "| linear | model | greedy |" in printed and "42/42" in err  # markdown table; a progress bar on stderr
    report = json.loads(out.read_text())
    rows = {r["label"]: r for r in report["results"]}
    assert list(rows) == ["ar (our loop)", "hf_generate", "hf_static", "linear", "fixed_tree", "hf_assisted"]
    assert [r["family"] for r in rows.values()] == ["none", "none", "none", "model", "model", "model"]
    for r in rows.values():
        assert {"policy", "throughput_tps", "speedup", "tokens_per_iteration", "acceptance_rate"} <= set(r)
        assert r["exact"] == r["runs"] == 6  # 3 prompts x 2 rounds, all equal to ar's output
    assert max(rows[r]["speedup"] for r in ("ar (our loop)", "hf_generate", "hf_static")) == 1.0
    assert rows["fixed_tree"]["params"]["depth"] == 3 and rows["ar (our loop)"]["memory_overhead"] == 0.0
    assert len(report["prompts"]) == 6 * 3 and all(p["prompt_tokens"] > 0 for p in report["prompts"])
    env = report["environment"]
    assert {"cpu", "torch", "transformers", "torch_threads", "device", "dtype"} <= set(env)
    assert report["settings"]["repeats"] == 2 and report["settings"]["command"].startswith(
        "python -m dynatree_core bench"
    )
    assert out.with_suffix(".csv").read_text().startswith("label,policy,family,verifier")
    code, _, err = run_cli(capsys, "bench", "--policy", "fixed_tree:depth", "--limit", "1")
    assert code == 2 and "key=value" in err
    code, _, err = run_cli(capsys, "bench", "--policies", "nope", "--limit", "1")
    assert code == 2 and "unknown policy" in err


def test_bench_sweep_varies_one_parameter_at_a_time_and_plots(capsys, tiny_pair_dirs, tmp_path):
    target, draft = tiny_pair_dirs
    out = tmp_path / "sweep.json"
    code, printed, err = run_cli(
        capsys,
        "bench", "--target", target, "--draft", draft, "--limit", "1", "--max-new-tokens", "4", "--no-hf",
        "--sweep", "depth=2..3", "--sweep", "tau=0.01,0.1", "--policies", "linear", "--out", str(out),
    )  # fmt: skip
    assert code == 0, err
    labels = [r["label"] for r in json.loads(out.read_text())["results"]]
    swept = ["fixed_tree depth=2", "fixed_tree depth=3", "fixed_tree tau=0.01", "fixed_tree tau=0.1"]
    assert labels == ["ar (our loop)", *swept, "linear"]
    for name in ("depth", "tau"):
        assert (tmp_path / f"sweep.sweep-{name}.html").stat().st_size > 1000
    for bad, needle in (("depth=9..3", "empty range"), ("depth", "NAME=A..B"), ("nope=1,2", "no parameter")):
        code, _, err = run_cli(capsys, "bench", "--limit", "1", "--sweep", bad)
        assert code == 2 and needle in err, err


def test_bench_sweeps_run_settings_and_grids(capsys, tiny_pair_dirs, tmp_path):
    target, draft = tiny_pair_dirs
    out = tmp_path / "scale.json"
    code, _, err = run_cli(
        capsys,
        "bench", "--target", target, "--draft", draft, "--limit", "2", "--no-hf", "--warmup", "0",
        "--policies", "linear", "--sweep", "T=3,5", "--out", str(out),
    )  # fmt: skip
    assert code == 0, err
    report = json.loads(out.read_text())
    rows = {r["label"]: r for r in report["results"]}
    assert list(rows) == ["ar (our loop) T=3", "linear T=3", "ar (our loop) T=5", "linear T=5"]
    assert rows["ar (our loop) T=5"]["speedup"] == 1.0 == rows["ar (our loop) T=3"]["speedup"]  # per value
    by_label = {}
    for row in report["prompts"]:
        by_label.setdefault(row["label"], []).append(row["new_tokens"])
    assert by_label["linear T=3"] == [3, 3] and by_label["linear T=5"] == [5, 5]  # T really changed
    assert report["settings"]["max_new_tokens"] == [3, 5]
    assert (tmp_path / "scale.sweep-T.html").stat().st_size > 1000

    out = tmp_path / "lmax.json"
    code, _, err = run_cli(
        capsys,
        "bench", "--target", target, "--draft", draft, "--limit", "1", "--no-hf", "--warmup", "0",
        "--max-new-tokens", "2", "--sweep", "L_max=2,6", "--out", str(out),
    )  # fmt: skip
    assert code == 0, err
    tokens = {r["label"]: r["prompt_tokens"] for r in json.loads(out.read_text())["prompts"]}
    assert tokens["ar (our loop) L_max=2"] < tokens["ar (our loop) L_max=6"]  # the prompt was cut

    out = tmp_path / "grid.json"
    code, _, err = run_cli(
        capsys,
        "bench", "--target", target, "--draft", draft, "--limit", "1", "--no-hf", "--warmup", "0",
        "--max-new-tokens", "3", "--sweep-policy", "dynatree", "--grid",
        "--sweep", "tau_h=0.5,0.9", "--sweep", "tau_l=0.3,0.6", "--out", str(out),
    )  # fmt: skip
    assert code == 0, err
    labels = [r["label"] for r in json.loads(out.read_text())["results"]]
    # tau_l=0.6 with tau_h=0.5 is rejected by dynatree (tau_l < tau_h) and skipped
    assert labels == ["ar (our loop)", "dynatree tau_h=0.5,tau_l=0.3", "dynatree tau_h=0.9,tau_l=0.3",
                      "dynatree tau_h=0.9,tau_l=0.6"]  # fmt: skip
    assert (tmp_path / "grid.sweep-tau_h-tau_l.html").stat().st_size > 1000
    for args, needle in (
        (["--sweep", "T=4", "--sweep", "L_max=8"], "one run setting"),
        (["--sweep", "T=a,b"], "integers"),
        (["--grid", "--sweep", "depth=2..3"], "two or more"),
        (["--grid", "--sweep", "depth=2..3", "--sweep", "nope=1"], "no parameter nope"),
    ):
        code, _, err = run_cli(capsys, "bench", "--limit", "1", *args)
        assert code == 2 and needle in err, err


def test_verifiers_json_and_sampled_generation(capsys, tiny_pair_dirs):
    code, out, _ = run_cli(capsys, "verifiers", "--json")
    assert code == 0
    rows = {r["name"]: r for r in json.loads(out)}
    every = {"greedy", "nss", "naive", "block", "spectr", "specinfer", "khisti", "traversal", "without_replacement"}
    assert set(rows) == every
    assert "deterministic" in rows["nss"]["accepts"] and rows["specinfer"]["accepts"] == ["iid", "single_path"]
    assert rows["block"]["accepts"] == ["single_path"] and rows["traversal"]["direction"] == "bottom-up"
    assert set(rows["traversal"]["accepts"]) == {"iid", "without_replacement", "single_path"}
    target, draft = tiny_pair_dirs
    args = ["generate", "--target", target, "--draft", draft, "--prompt", "hello", "--max-new-tokens", "6"]
    hot = [*args, "--temperature", "0.8", "--verifier", "specinfer", "--num-samples", "3", "--seed", "4", "--json"]
    code, out, err = run_cli(capsys, *hot)
    assert code == 0, err
    samples = json.loads(out)
    assert len(samples) == 3 and all(len(s["token_ids"]) == 6 for s in samples)
    code, again, _ = run_cli(capsys, *hot)
    assert [s["token_ids"] for s in json.loads(again)] == [s["token_ids"] for s in samples]  # same seeds
    walk = [*args, "--policy", "delayed", "--temperature", "0.8", "--verifier", "traversal", "--json", "--trace"]
    code, out, err = run_cli(capsys, *walk)
    assert code == 0, err
    records = json.loads(out)["records"]
    assert records[0]["verifier"] == "traversal" and records[0]["verification"][-1]["kind"] == "sample"
    code, _, err = run_cli(capsys, *args, "--temperature", "0.8", "--verifier", "traversal")
    assert code == 2 and "budget" in err  # fixed_tree's default budget can bind
    code, _, err = run_cli(capsys, *args, "--policy", "eagle2", "--temperature", "0.8", "--verifier", "naive")
    assert code == 2 and "only 'nss' is lossless" in err
    code, _, err = run_cli(capsys, *args, "--temperature", "0.8", "--top-p", "0")
    assert code == 2 and "top_p" in err


def test_dtype_probe_picks_the_fastest_exact_dtype_and_auto_uses_it(capsys, tiny_pair_dirs, tmp_path, monkeypatch):
    from dynatree_core.decoding.dtype_choice import CHOICE_FILE, DtypeRow, choose
    from dynatree_core.decoding.pairs import load_pair
    from dynatree_core.errors import DynaTreeError

    rows = [DtypeRow("float32", 10, 12, 4, 4), DtypeRow("bfloat16", 20, 25, 3, 4), DtypeRow("float16", 9, 11, 4, 4)]
    assert choose(rows).dtype == "float32"  # bfloat16 is faster but changed one output
    with pytest.raises(DynaTreeError, match="no dtype"):
        choose([DtypeRow("bfloat16", 20, 25, 3, 4)])

    monkeypatch.setenv("DYNATREE_CACHE", str(tmp_path))
    target, draft = tiny_pair_dirs
    assert load_pair(target, draft, device="cpu").dtype_source == "rule"
    code, out, err = run_cli(
        capsys, "dtype", "--target", target, "--draft", draft, "--device", "cpu", "--max-new-tokens", "6",
        "--limit", "2", "--json",
    )  # fmt: skip
    assert code == 0, err
    result = json.loads(out)
    assert [r["dtype"] for r in result["rows"]] == ["float32", "bfloat16"]
    exact = [r for r in result["rows"] if r["exact"] == r["prompts"] == 2]
    assert result["chosen"] == max(exact, key=lambda r: r["tree_tps"])["dtype"]
    pair = load_pair(target, draft, device="cpu")  # auto now follows the saved probe
    assert pair.dtype_source == "probe"
    assert str(pair.target.model.dtype) == str(pair.draft.model.dtype) == f"torch.{result['chosen']}"
    assert load_pair(target, draft, device="cpu", dtype="float32").dtype_source == "asked"
    (tmp_path / CHOICE_FILE).write_text("{broken")  # a damaged file is ignored, never fatal
    assert load_pair(target, draft, device="cpu").dtype_source == "rule"


def test_png_export_without_kaleido_is_a_clear_error(tmp_path, monkeypatch):
    import plotly.graph_objects as go

    from dynatree_core.errors import DynaTreeError
    from dynatree_core.viz.bench import write_figure

    fig = go.Figure(go.Scatter(x=[1, 2], y=[3, 4]))
    assert write_figure(fig, tmp_path / "f") == [str(tmp_path / "f.html")]
    write_figure(fig, tmp_path / "f2")  # a second figure in the folder: plotly.js is not copied again
    script = tmp_path / "plotly.min.js"
    assert script.stat().st_size > 1_000_000 and sorted(p.name for p in tmp_path.iterdir()) == [
        "f.html",
        "f2.html",
        "plotly.min.js",
    ]
    for page in ("f.html", "f2.html"):
        html = (tmp_path / page).read_text()
        assert len(html) < 50_000 and 'src="plotly.min.js"' in html

    def no_kaleido(*args, **kwargs):
        raise ValueError("Image export using the 'kaleido' engine requires the kaleido package")

    monkeypatch.setattr(go.Figure, "write_image", no_kaleido)
    with pytest.raises(DynaTreeError, match="pip install kaleido"):
        write_figure(fig, tmp_path / "g", png=True)
    assert (tmp_path / "g.html").is_file()  # the HTML is written first either way


@pytest.mark.parametrize("command", ["generate", "compare", "lab"])
def test_a_prompt_longer_than_the_context_is_refused_before_loading_the_models(
    capsys, tiny_pair_dirs, monkeypatch, command
):
    """The tokenizer and config alone show the prompt cannot fit (context 512): exit 2, no model load."""
    import dynatree_core.decoding.pairs as session

    target, draft = tiny_pair_dirs
    loads = []
    monkeypatch.setattr(session, "load_pair", lambda *a, **k: loads.append(a) or pytest.fail("models loaded"))
    argv = [command, "--target", target, "--draft", draft, "--no-chat", "--prompt", "hello " * 600]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "the prompt has" in err and "the model's context is 512" in err and loads == []
