"""The README's code runs as written, and the glossary the live page shows is the docs' table.

The README holds two Python blocks: the library example (loads the embedded pair, so slow) and
the smallest correct policy. Both are executed from the README's own text, so neither can rot.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import ARCHS, noisy_copy, tiny_model

from dynatree_core.decoding.engine import DecodeConfig, decode, generate
from dynatree_core.decoding.methods import make_method
from dynatree_core.drafting.policy import POLICIES
from dynatree_core.viz.prose import GLOSSARY, glossary

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text(encoding="utf-8")
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.DOTALL)


def _block(needle: str) -> str:
    """The README's one Python block that contains `needle`."""
    found = [b for b in BLOCKS if needle in b]
    assert len(found) == 1, f"expected one README python block with {needle!r}, found {len(found)}"
    return found[0]


@pytest.fixture
def skeleton_policy():
    """The README's policy skeleton, registered for one test and unregistered after it."""
    namespace: dict = {}
    exec(compile(_block("@register_policy"), "README.md:policy", "exec"), namespace)  # noqa: S102
    cls = namespace["TopChain"]
    assert POLICIES.get(cls.name) is cls, "the skeleton must register itself"
    yield cls
    POLICIES.pop(cls.name, None)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_readme_policy_skeleton_reproduces_target_greedy(arch, skeleton_policy):
    target, draft = tiny_model(arch), noisy_copy(arch, 0.01)
    prompt = [1, 5, 9, 14]
    config = DecodeConfig(max_new_tokens=24)
    reference = generate(target, prompt, make_method("ar"), config=config).token_ids
    result = generate(target, prompt, make_method(skeleton_policy.name, {"k": 3}), draft=draft, config=config)
    assert result.token_ids == reference, "the README's policy must be lossless under greedy verification"


def test_the_readme_policy_skeleton_drafts_one_level_per_draft_forward(skeleton_policy):
    target, draft = tiny_model("llama"), noisy_copy("llama", 0.01)
    policy = skeleton_policy(k=3)
    for rec in decode(target, [1, 5, 9, 14], policy, draft=draft, config=DecodeConfig(max_new_tokens=12)):
        levels = max(rec.tree.depths)
        assert levels <= 3, "the chain never grows past k"
        assert rec.draft_forwards == levels, "one draft forward per drafted level"
        leaf = len(rec.tree) - 1
        assert rec.tree.reason[leaf] in ("depth_limit", "length_limit"), "the leaf says why it stopped"


@pytest.mark.slow
def test_the_readme_library_example_runs_on_the_embedded_pair(capsys):
    namespace: dict = {}
    exec(compile(_block("load_pair("), "README.md:library", "exec"), namespace)  # noqa: S102
    out = capsys.readouterr().out
    assert "tokens/iteration" in out and "acceptance" in out, out
    assert out.split("\n")[0].strip(), "the example prints the generated text first"
    pair, result = namespace["pair"], namespace["result"]
    plain = pair.generate("Name three primary colors.", make_method("ar"), max_new_tokens=48)
    assert result.token_ids == plain.token_ids, "the example's tree decoding equals the target's greedy output"


def test_the_glossary_is_the_docs_table_and_the_readme_links_it():
    table = glossary()
    rows = table.splitlines()
    assert rows[:2] == ["| term | meaning |", "|---|---|"], "the page shows a markdown table, header first"
    assert all(row.startswith("| ") and row.endswith(" |") and row.count(" | ") >= 1 for row in rows[2:])
    terms = {row.split(" | ")[0].removeprefix("| ") for row in rows[2:]}
    wanted = {"root", "node", "depth", "path", "accepted path", "bonus token", "node budget (N_max)", "pruned"}
    assert wanted <= terms, f"the tree words the code uses must be defined: missing {sorted(wanted - terms)}"
    assert table in GLOSSARY.read_text(encoding="utf-8")
    assert "](docs/glossary.md)" in README and "## Glossary" not in README, "one glossary, in docs/"
