"""The layering of dynatree_core, enforced over every import (function-local ones included).

A module may import only from strictly lower layers (modules of one package, e.g. drafting/*,
may import each other). A function-local import that points upward is a cycle all the same: it
only hides it from Python's import machinery. The app and its pages sit above everything and
nothing in the library imports them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "dynatree_core"

# Bottom-up. Records (trace) and their summaries (metrics) sit below the engine that writes them.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "transfer"),
    ("tree", "sampling", "vocab", "threads", "prompts", "packing", "fastpath", "graphs", "trace_check"),
    ("trace", "environment", "models", "kv"),
    ("metrics", "dtypes"),
    ("verify",),
    ("drafting",),
    ("baselines",),
    ("engine", "methods"),
    ("lab", "latency", "session", "settings", "entries"),
    ("compare", "engine_process", "dtype_probe"),
    ("bench", "live", "gpu_check"),
    ("live_process",),
    ("viz", "training", "ui"),
    ("cli", "ui_live"),
    ("__main__",),
)
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def _unit(module: str) -> str:
    """dynatree_core.drafting.feature -> drafting; dynatree_core.kv -> kv."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported dynatree_core module) for every import statement in the file, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "dynatree_core":
            if node.module == "dynatree_core":  # `from dynatree_core import bench`: the names are modules
                out += [(node.lineno, f"dynatree_core.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "dynatree_core"]
    return out


def _library_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent != PACKAGE)


def test_every_module_has_a_layer():
    units = {_unit(".".join(p.relative_to(ROOT).with_suffix("").parts)) for p in _library_files()}
    assert units - set(RANK) == set(), "place each new module in LAYERS"
    assert set(RANK) - units == set(), "LAYERS names a module that no longer exists"


@pytest.mark.parametrize("path", _library_files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down_only(path):
    source = _unit(".".join(path.relative_to(ROOT).with_suffix("").parts))
    upward = [
        f"line {line}: {module} (layer {RANK[_unit(module)]}) from layer {RANK[source]}"
        for line, module in _imports(path)
        if _unit(module) != source and RANK[_unit(module)] >= RANK[source]
    ]
    assert not upward, f"{path.relative_to(ROOT)} imports sideways or upward: " + "; ".join(upward)


def _top_level_imports(path: Path) -> set[str]:
    """The first component of every module the file imports, at any depth (AST, not text)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
    return out


def test_the_library_never_imports_the_app_or_its_pages():
    for path in _library_files():
        assert not _top_level_imports(path) & {"app", "pages"}, path


def test_the_app_import_check_reads_imports_not_text(tmp_path):
    """It fails on a planted import in a function body, and not on a string or comment naming one."""
    bad, fine = tmp_path / "bad.py", tmp_path / "fine.py"
    bad.write_text("def f():\n    import pages.lab as lab\n    return lab\n")
    fine.write_text('"""Not `import app`: the app imports us."""\n# from pages import x\nx = "import app"\n')
    assert _top_level_imports(bad) & {"app", "pages"} and not _top_level_imports(fine) & {"app", "pages"}


def test_the_checker_catches_an_upward_function_local_import(tmp_path):
    """The test can fail: an upward import inside a function body is found."""
    bad = tmp_path / "kv.py"
    bad.write_text("def f():\n    from dynatree_core.engine import decode\n    return decode\n")
    found = [m for _, m in _imports(bad)]
    assert found == ["dynatree_core.engine"] and RANK[_unit(found[0])] > RANK["kv"]


def test_the_app_and_pages_never_reseed_the_process_wide_generator():
    """Every browser session shares the process: a page that calls torch.manual_seed changes the
    draws of every other session's run (the engine seeds its own generator from the run's seed)."""
    for path in [ROOT / "app.py", *sorted((ROOT / "pages").glob("*.py")), PACKAGE / "ui.py"]:
        assert "manual_seed" not in path.read_text(encoding="utf-8"), path


def test_no_module_over_400_lines_and_no_page_over_250():
    """Files a newcomer can read in one sitting: library modules and app.py at most 400
    lines, the pages at most 250."""
    long = [
        f"{p.relative_to(ROOT)}: {n} lines"
        for p in [*PACKAGE.rglob("*.py"), ROOT / "app.py"]
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > 400
    ]
    long += [
        f"{p.relative_to(ROOT)}: {n} lines"
        for p in (ROOT / "pages").glob("*.py")
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > 250
    ]
    assert long == []
