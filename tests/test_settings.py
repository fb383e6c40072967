"""The run-settings registry (decoding/settings.py): one range and default per setting, from which the
CLI's flags and the pages' widgets are generated, and the RunSpec they produce."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from dynatree_core.cli import build_parser
from dynatree_core.decoding.settings import SETTINGS, RunSpec
from dynatree_core.errors import DynaTreeError

ROOT = Path(__file__).resolve().parent.parent


def test_the_run_spec_is_the_registry_and_checks_its_values():
    spec = RunSpec()
    assert {f.name for f in dataclasses.fields(spec)} == set(SETTINGS)
    assert all(getattr(spec, name) == s.default for name, s in SETTINGS.items())
    with pytest.raises(DynaTreeError, match=r"top_p \(--top-p\) must be between 0.05 and 1.0, got 0"):
        RunSpec(top_p=0)
    with pytest.raises(DynaTreeError, match="verifier .* must be one of auto, "):
        RunSpec(verifier="nope")
    with pytest.raises(DynaTreeError, match=r"max_new_tokens \(--max-new-tokens\) must be at least 1, got 0"):
        RunSpec(max_new_tokens=0)
    assert RunSpec(max_new_tokens=100_000).max_new_tokens == 100_000, "the slider's top does not bind the CLI"
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.seed = 3
    config = RunSpec(max_new_tokens=9, temperature=0.7, top_k=5, order="dfs", seed=4).decode_config(
        seed=6, analyze=True
    )
    assert (config.max_new_tokens, config.order, config.seed, config.analyze) == (9, "dfs", 6, True)
    assert (config.sampling.temperature, config.sampling.top_p, config.sampling.top_k) == (0.7, 1.0, 5)
    assert RunSpec.of({"seed": 2, "top_k": None, "prompt": "x"}) == RunSpec(seed=2), "unknown keys and None ignored"


@pytest.mark.parametrize("command", ["generate", "compare", "bench", "dtype"])
def test_cli_flags_come_from_the_registry(command):
    args = ["--prompt", "x"] if command in ("generate", "compare") else []
    parser = build_parser()
    parsed = parser.parse_args([command, *args])
    shared = [name for name in SETTINGS if hasattr(parsed, name)]
    assert "max_new_tokens" in shared
    assert all(getattr(parsed, name) == SETTINGS[name].default for name in shared)
    sub = next(a for a in parser._subparsers._group_actions[0].choices.values() if a.prog.endswith(command))
    helps = {a.dest: a.help for a in sub._actions}
    assert all(helps[name] == SETTINGS[name].help for name in shared)


def test_every_page_widget_of_a_shared_setting_comes_from_the_registry():
    """No page defines its own range for a registry setting: they call ui.widgets.setting_widget."""
    labels = [s.label for s in SETTINGS.values()]
    # the Verification Lab samples only: temperature above 0 and the sampled verifiers, a subset
    own = {"2_Verification_Lab.py": {"Temperature", "Verifier"}}
    for path in [ROOT / "app.py", *sorted((ROOT / "pages").glob("*.py"))]:
        built = _widget_labels(path.read_text(encoding="utf-8"))
        for label in set(labels) - own.get(path.name, set()):
            assert label not in built, f"{path.name} builds its own {label!r} widget"


WIDGETS = {"slider", "select_slider", "number_input", "selectbox", "radio", "text_input", "text_area",
           "checkbox", "toggle", "multiselect", "segmented_control", "pills"}  # fmt: skip


def _widget_labels(source: str) -> set[str]:
    """Labels of the Streamlit widgets a file builds itself: `st.<widget>("Label", ...)` or
    `<column>.<widget>(label="Label")`, read from the syntax tree (not from the text)."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in WIDGETS:
            args = node.args[:1] + [k.value for k in node.keywords if k.arg == "label"]
            out |= {a.value for a in args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
    return out


def test_the_widget_check_reads_calls_not_text():
    """It finds a widget built with the label as a keyword or on a column, and ignores the label
    in a string or a help text."""
    src = 'left.slider(label="Top-p", min_value=0.0)\nst.number_input("Top-k")\nx = \'st.slider("Seed"\'\n'
    assert _widget_labels(src) == {"Top-p", "Top-k"}


@pytest.mark.slow
def test_the_pages_show_the_registry_ranges_and_the_compare_page_has_top_p_and_top_k():
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120)
    at.run()
    slider = next(s for s in at.slider if s.label == "Max new tokens")
    s = SETTINGS["max_new_tokens"]
    assert (slider.min, slider.max, slider.value) == (s.lo, s.hi, s.default)
    page = AppTest.from_file(str(ROOT / "pages" / "1_Compare_Policies.py"), default_timeout=120)
    page.run()
    assert not page.exception, page.exception
    assert next(s for s in page.slider if s.label == "Max new tokens").value == s.default
    assert any(x.label == "Top-p" for x in page.slider) and any(x.label == "Top-k" for x in page.number_input)


def test_a_widget_started_from_a_value_the_registry_refuses_starts_at_the_default():
    """An imported run's settings are not trusted: the Verification Lab starts top-p from them."""
    from streamlit.testing.v1 import AppTest

    def page(value):
        from dynatree_core.ui.widgets import setting_widget

        setting_widget("top_p", value=value)

    for value, want in ((0.5, 0.5), (0.01, 1.0), ("abc", 1.0), (None, 1.0)):
        at = AppTest.from_function(page, args=(value,))
        at.run()
        assert not at.exception and at.slider[0].value == want, (value, at.exception)


def test_a_log_scale_parameter_steps_by_a_tenth_of_its_defaults_decade():
    """Param.log_scale is read: DynaTree's tau (default 0.01, spans decades) steps by 0.001, its
    linear-scale parameters by 0.01."""
    from streamlit.testing.v1 import AppTest

    def page():
        from dynatree_core.ui.widgets import param_widgets

        param_widgets("dynatree")

    at = AppTest.from_function(page)
    at.run()
    steps = {w.label: w.step for w in at.number_input}
    assert steps["tau"] == pytest.approx(0.001) and steps["rho_stop"] == pytest.approx(0.001)
    assert steps["tau_h"] == pytest.approx(0.01)


# ----- how forwards run (core/settings.py) ---------------------------------------------------------
def _environment_reads(path: Path) -> list[str]:
    """Lines of `path` that read the process environment (os.environ / os.getenv)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [
        ast.unparse(node)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv")
        and isinstance(node.value, ast.Name) and node.value.id == "os"
    ]  # fmt: skip


def test_only_the_settings_module_reads_a_dynatree_variable():
    """Every DYNATREE_* variable is read through core/settings.env: one registry, one reader."""
    readers = []
    for path in sorted((ROOT / "dynatree_core").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if path.name != "settings.py" and _environment_reads(path) and "DYNATREE_" in text:
            readers.append(str(path.relative_to(ROOT)))
    assert readers == [], f"read these through core/settings.env: {readers}"


def test_every_dynatree_variable_the_library_names_is_registered_and_documented():
    import re

    from dynatree_core.core.settings import ENVIRONMENT

    named = set()
    for path in (ROOT / "dynatree_core").rglob("*.py"):
        named |= set(re.findall(r"DYNATREE_[A-Z_]+", path.read_text(encoding="utf-8")))
    named.discard("DYNATREE_USER_TEXT")  # a placeholder inside prompts (decoding/pairs.py), not a variable
    assert named == set(ENVIRONMENT), f"unregistered: {named - set(ENVIRONMENT)}, unused: {set(ENVIRONMENT) - named}"
    table = (ROOT / "docs/cli.md").read_text(encoding="utf-8").split("## Environment overrides")[1].split("\n\n")[2]
    documented = re.findall(r"^\| `(DYNATREE_[A-Z_]+)` \| (.*?) \| (.*) \|$", table, flags=re.M)
    assert [(n, d, h) for n, d, h in documented] == [
        (o.name, f"`{o.default}`" if o.default else "unset", o.help) for o in ENVIRONMENT.values()
    ], "docs/cli.md's table is the registry's"


def test_an_override_sets_only_what_a_run_leaves_auto(monkeypatch):
    from conftest import tiny_model

    from dynatree_core.core.settings import ForwardSettings, env
    from dynatree_core.forward.kv import KVState

    model = tiny_model("llama")
    monkeypatch.setenv("DYNATREE_STATIC_CACHE", " 0 ")
    assert env("DYNATREE_STATIC_CACHE") == "0"
    assert KVState(model, [1, 2], **ForwardSettings().cache_switches()).choice.path == "dynamic"
    asked = KVState(model, [1, 2], **ForwardSettings(static_cache=True).cache_switches())
    assert asked.choice.path == "lean", "an explicit setting wins over the override"
    for name in ("DYNATREE_STATIC_CACHE", "DYNATREE_LIVE_ENGINE", "DYNATREE_MAX_PAIRS"):
        monkeypatch.delenv(name, raising=False)
    assert env("DYNATREE_LIVE_ENGINE") == "ray" and env("DYNATREE_MAX_PAIRS") == "", "defaults when unset"


def test_the_engine_flags_build_one_forward_settings():
    from dynatree_core.cli.commands import forward_settings
    from dynatree_core.core.settings import ForwardSettings

    args = build_parser().parse_args(["generate", "--prompt", "x", "--no-graphs", "--device-draft", "on"])
    assert forward_settings(args) == ForwardSettings(graphs=False, device_draft=True)
    args = build_parser().parse_args(["bench", "--no-static-cache", "--width-invariant", "off"])
    assert forward_settings(args) == ForwardSettings(static_cache=False, width_invariant=False)
