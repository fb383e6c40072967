"""The layering of dynatree_core, enforced over every import (function-local ones included).

The package holds one subpackage per layer; a module may import only from its own package and
from packages of strictly lower layers. A function-local import that points upward is a cycle all
the same: it only hides it from Python's import machinery. The app and its pages sit above
everything and nothing in the library imports them. Each package's docstring says what it may
import, and says the same as LAYERS.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "dynatree_core"

# Bottom-up: the folder list read as the layer diagram.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors",),
    ("core",),
    ("forward",),
    ("runs", "verify", "drafts"),
    ("drafting",),
    ("decoding",),
    ("measure",),
    ("live", "viz", "training"),
    ("ui", "cli"),
    ("__main__",),
)
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
ROOT_MODULES = {"__init__", "errors", "__main__"}  # everything else lives in a layer's package


def _unit(module: str) -> str:
    """dynatree_core.drafts.feature -> drafting; dynatree_core.forward.kv -> core; dynatree_core.errors -> errors."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported dynatree_core module) for every import statement in the file, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "dynatree_core":
            if node.module == "dynatree_core":  # `from dynatree_core import drafting`: the names are packages
                out += [(node.lineno, f"dynatree_core.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "dynatree_core"]
    return out


def _library_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent != PACKAGE)


def test_every_module_lives_in_a_layer():
    units = {_unit(".".join(p.relative_to(ROOT).with_suffix("").parts)) for p in _library_files()}
    assert units - set(RANK) == set(), "place each new package in LAYERS"
    assert set(RANK) - units == set(), "LAYERS names a package that no longer exists"


def test_the_package_root_holds_only_the_entry_points_and_errors():
    loose = {p.stem for p in PACKAGE.glob("*.py")}
    assert loose == ROOT_MODULES, f"put {sorted(loose - ROOT_MODULES)} in the package of its layer"


@pytest.mark.parametrize("path", _library_files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down_only(path):
    source = _unit(".".join(path.relative_to(ROOT).with_suffix("").parts))
    upward = [
        f"line {line}: {module} (layer {RANK[_unit(module)]}) from layer {RANK[source]}"
        for line, module in _imports(path)
        if _unit(module) != source and RANK[_unit(module)] >= RANK[source]
    ]
    assert not upward, f"{path.relative_to(ROOT)} imports sideways or upward: " + "; ".join(upward)


def _may_import(package: str) -> list[str]:
    doc = ast.get_docstring(ast.parse((PACKAGE / package / "__init__.py").read_text(encoding="utf-8"))) or ""
    found = re.search(r"May import: ([^.]*)\.", doc.replace("\n", " "))
    return [] if found is None or found.group(1) == "nothing" else [x.strip() for x in found.group(1).split(",")]


@pytest.mark.parametrize("package", [u for u in RANK if (PACKAGE / u).is_dir()])
def test_each_package_says_what_it_holds_and_what_it_may_import(package):
    doc = ast.get_docstring(ast.parse((PACKAGE / package / "__init__.py").read_text(encoding="utf-8"))) or ""
    assert len(doc.split()) >= 20, f"{package}/__init__.py: say what the package holds"
    below = [u for u in RANK if RANK[u] < RANK[package]]
    assert _may_import(package) == below, f"{package}/__init__.py: 'May import: {', '.join(below)}.'"


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


def test_the_library_never_imports_the_benchmark_scripts():
    """benchmarks/ (the scripts beside the library) may import dynatree_core, never the reverse."""
    for path in _library_files():
        assert "benchmarks" not in _top_level_imports(path), path


def test_the_app_import_check_reads_imports_not_text(tmp_path):
    """It fails on a planted import in a function body, and not on a string or comment naming one."""
    bad, fine = tmp_path / "bad.py", tmp_path / "fine.py"
    bad.write_text("def f():\n    import pages.lab as lab\n    return lab\n")
    fine.write_text('"""Not `import app`: the app imports us."""\n# from pages import x\nx = "import app"\n')
    assert _top_level_imports(bad) & {"app", "pages"} and not _top_level_imports(fine) & {"app", "pages"}


def test_the_checker_catches_an_upward_function_local_import(tmp_path):
    """The test can fail: an upward import inside a function body is found."""
    bad = tmp_path / "kv.py"
    bad.write_text("def f():\n    from dynatree_core.decoding.engine import decode\n    return decode\n")
    found = [m for _, m in _imports(bad)]
    assert found == ["dynatree_core.decoding.engine"] and RANK[_unit(found[0])] > RANK["core"]


def test_the_app_and_pages_never_reseed_the_process_wide_generator():
    """Every browser session shares the process: a page that calls torch.manual_seed changes the
    draws of every other session's run (the engine seeds its own generator from the run's seed)."""
    for path in [ROOT / "app.py", *sorted((ROOT / "pages").glob("*.py")), *sorted((PACKAGE / "ui").glob("*.py"))]:
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
