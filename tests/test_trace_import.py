"""Importing run files: malformed, truncated or hostile JSON is refused with a message, and any
file that is accepted can be drawn by the app without an error (fuzzed with hypothesis)."""

from __future__ import annotations

import copy
import functools
import json

import pytest
import torch
from conftest import examples, noisy_copy, tiny_model
from hypothesis import given
from hypothesis import strategies as st

from dynatree_core.core.sampling_config import SamplingConfig
from dynatree_core.decoding.engine import DecodeConfig
from dynatree_core.decoding.methods import make_method
from dynatree_core.live.run import LiveRun
from dynatree_core.viz import (
    acceptance_by_depth,
    mask_figure,
    node_details,
    run_charts,
    speed_breakdown,
    text_html,
    tree_figure,
    verification_rows,
    why_text,
)

FUZZ = examples(150)  # conftest: derandomized here, 5,000 random examples under `make fuzz`


@functools.cache
def exported(sampled: bool) -> str:
    """A real run's export: greedy fixed_tree, or sampled traversal with analysis (every field used)."""
    target, draft = tiny_model("llama"), noisy_copy("llama", 0.05)
    config = DecodeConfig(max_new_tokens=8)
    policy = make_method("fixed_tree", {"depth": 2, "branch": 2})
    if sampled:
        config = DecodeConfig(
            max_new_tokens=8, sampling=SamplingConfig(temperature=1.0), verifier="traversal", analyze=True
        )
        policy = make_method("fixed_tree", {"depth": 2, "branch": 2, "budget": 6})
    live = LiveRun.start(target, [5, 9, 11], policy, draft=draft, config=config, settings={"policy": "fixed_tree"})
    while live.step() is not None:
        pass
    return live.to_json()


def draw_everything(run: LiveRun) -> None:
    """What the app draws from an imported run, every iteration and every node."""
    for rec in run.records:
        tree_figure(rec, run.text)
        mask_figure(rec, run.text)
        verification_rows(rec, run.text)
        for node in range(len(rec.tree.tokens)):
            node_details(rec, node, run.text)
    text_html(run.records, run.text)
    run_charts(run.records, 10.0)
    acceptance_by_depth(run.records)
    why_text(speed_breakdown(run.records, 40.0))
    run.result()


def replay_or_refuse(data: str | bytes) -> LiveRun | None:
    try:
        run = LiveRun.from_json(data)
    except ValueError as exc:
        assert str(exc).startswith("not a DynaTree run file"), exc
        return None
    draw_everything(run)
    return run


@pytest.mark.parametrize("sampled", [False, True])
def test_real_exports_replay_and_draw(sampled):
    run = replay_or_refuse(exported(sampled))
    assert run is not None and run.records and run.done


@pytest.mark.parametrize(
    "data,needle",
    [
        (b"", "Expecting value"),
        (b'{"records": [', "Expecting value"),  # truncated
        (b"[" * 100_000 + b"]" * 100_000, "nests deeper"),  # would be a RecursionError in the parser
        (b'{"policy": 7}', "policy must be a string"),
        (b'{"prompt_ids": [1e400]}', "integer"),
        (b'{"prompt_ids": [' + b"9" * 5000 + b"]}", "integer"),  # a 5000-digit number
        (b'{"token_ids": [NaN]}', "integer"),
        (b'{"records": [{"tree": "x"}]}', "tree must be an object"),
        (b'{"params": {"k": {"__class__": "os.system"}}}', "plain values"),
        (b'{"token_texts": {"x": 1}}', "token_texts"),
    ],
)
def test_hostile_files_are_refused_with_a_message(data, needle):
    with pytest.raises(ValueError, match="not a DynaTree run file") as info:
        LiveRun.from_json(data)
    assert needle in str(info.value)


def test_files_over_the_size_limit_are_refused_before_parsing(monkeypatch):
    import dynatree_core.runs.validate as tc

    monkeypatch.setattr(tc, "MAX_BYTES", 1000)
    with pytest.raises(ValueError, match="limit is"):
        LiveRun.from_json(exported(False))


def test_a_file_from_another_format_version_is_refused_with_the_versions_this_one_reads():
    raw = json.loads(exported(False))
    assert raw["version"] == 1 and LiveRun.from_json(json.dumps(raw)).records
    for version in (2, 0, "1", True):
        raw["version"] = version
        with pytest.raises(ValueError, match="reads versions 1 to 1"):
            LiveRun.from_json(json.dumps(raw))


def test_the_found_log_probability_of_710_is_refused_naming_the_iteration_and_the_node():
    """A random draw of the fuzz test found this file: logp 710 was accepted, then overflowed
    math.exp while the tree was drawn (OverflowError). Refused now, with where it is."""
    raw = json.loads(exported(False))
    raw["records"][0]["tree"]["logp"][1] = 710.0
    with pytest.raises(ValueError, match=r"record 0 \(iteration 1\): node 1: tree.logp is 710.0"):
        LiveRun.from_json(json.dumps(raw))
    raw = json.loads(exported(False))
    raw["records"][0]["tree"]["cum_logp"][1] = 800.0
    with pytest.raises(ValueError, match="node 1: tree.cum_logp is 800.0"):
        LiveRun.from_json(json.dumps(raw))


def test_every_value_outside_its_domain_is_refused_with_its_field():
    plain, sampled = json.loads(exported(False)), json.loads(exported(True))

    def tree_of(r):
        return r["tree"]

    def first_step(r, kind):
        return next(s for s in r["verification"] if s["kind"] == kind)

    cases = [
        (plain, "a log-probability is at most 0", lambda r: tree_of(r)["logp"].__setitem__(1, 0.5)),
        (
            plain,
            "tree.cum_logp is",
            lambda r: tree_of(r)["cum_logp"].__setitem__(1, -0.001 + (tree_of(r)["cum_logp"][1] or 0)),
        ),
        (plain, "tree.depths is", lambda r: tree_of(r)["depths"].__setitem__(1, 3)),
        (plain, "the root has depth 0", lambda r: tree_of(r)["logp"].__setitem__(0, -1.0)),
        (plain, "mask row is not its ancestors", lambda r: r["mask"].__setitem__(1, "0" * len(r["mask"][1]))),
        (plain, "is not the root's", lambda r: r["position_ids"].__setitem__(1, r["position_ids"][1] + 1)),
        (plain, "tree.tokens", lambda r: tree_of(r)["tokens"].__setitem__(1, 96)),
        (plain, "target_tokens", lambda r: r["target_tokens"].__setitem__(0, 10**6)),
        (plain, "draft_forward_ms must not be negative", lambda r: r.__setitem__("draft_forward_ms", -0.1)),
        (plain, "verify_rows must be an integer", lambda r: r.__setitem__("verify_rows", -1)),
        (sampled, "a probability lies in", lambda r: first_step(r, "test").__setitem__("prob", 1.5)),
        (sampled, "a probability lies in", lambda r: first_step(r, "test").__setitem__("u", -0.2)),
        (sampled, "a probability lies in", lambda r: r["analysis"]["0"].__setitem__("reach", 2.0)),
    ]
    for raw, needle, mutate in cases:
        bad = copy.deepcopy(raw)
        assert bad["vocab_size"] == 96, "a run file names its target's vocabulary"
        record = next(
            r for r in bad["records"] if len(r["tree"]["tokens"]) > 2 and len(r["order"]) > 2 and r["verification"]
        )
        mutate(record)
        with pytest.raises(ValueError, match=needle):
            LiveRun.from_json(json.dumps(bad))


def test_record_inconsistencies_are_refused():
    raw = json.loads(exported(False))
    cases = {
        "order must list distinct nodes": lambda r: r["order"].append(r["order"][-1]),
        "mask rows may only hold": lambda r: r["mask"].__setitem__(0, "2" * len(r["mask"][0])),
        "accepted nodes must be verified": lambda r: r["accepted"].append(0),
        "tree.parents must point": lambda r: r["tree"]["parents"].__setitem__(1, 5),
        "draft_ms must not be negative": lambda r: r.__setitem__("draft_ms", -1.0),
        "a test step lacks": lambda r: r["verification"].append({"kind": "test"}),
        "unknown field": lambda r: r["verification"].append({"kind": "argmax", "token": 1, "code": "x"}),
    }
    for needle, mutate in cases.items():
        bad = copy.deepcopy(raw)
        mutate(bad["records"][0])
        with pytest.raises(ValueError, match=needle):
            LiveRun.from_json(json.dumps(bad))


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@pytest.mark.property
@FUZZ
@given(JSON)
def test_arbitrary_json_is_refused_or_drawn(value):
    replay_or_refuse(json.dumps(value))


@pytest.mark.property
@FUZZ
@given(st.booleans(), st.data())
def test_mutated_exports_are_refused_or_drawn(sampled, data):
    raw = json.loads(exported(sampled))
    record = data.draw(st.sampled_from(raw["records"]))
    mutate_json(data, [raw, record, record, record["tree"]])
    replay_or_refuse(json.dumps(raw))


def mutate_json(data, starts: list) -> None:
    """One to three random replacements or deletions, each at a random place below one of `starts`
    (objects or lists inside one JSON document, changed in place)."""
    for _ in range(data.draw(st.integers(1, 3))):
        node, key = data.draw(st.sampled_from(starts)), None
        for _depth in range(data.draw(st.integers(1, 6))):  # walk down to a random place
            children = list(node.keys()) if isinstance(node, dict) else list(range(len(node)))
            if not children:
                break
            key = data.draw(st.sampled_from(children))
            if not isinstance(node[key], (dict, list)):
                break
            node, key = node[key], None
        if key is None:
            continue
        if isinstance(node, dict) and data.draw(st.booleans()):
            del node[key]
        else:
            node[key] = data.draw(JSON)


def test_a_sampled_runs_draws_import_sparse_and_a_hostile_vocabulary_size_is_refused():
    """The exported draws come back (q kept compressed until a verifier reads it); a draw claiming a
    vocabulary of 10^12 entries is refused before anything is allocated."""
    run = LiveRun.from_json(exported(True))
    draws = [d for rec in run.records for d in rec.tree.sampled.values()]
    assert draws and all(d.weights is None and d.packed and d.tokens for d in draws)
    assert all(abs(float(d.dense().sum()) - 1.0) < 1e-12 for d in draws)
    raw = json.loads(exported(True))
    rec = next(r for r in raw["records"] if r["tree"].get("sampled"))
    next(iter(rec["tree"]["sampled"].values()))["size"] = 10**12
    with pytest.raises(ValueError, match="tree.sampled size"):
        LiveRun.from_json(json.dumps(raw))


def test_a_cli_run_exported_for_the_app_imports_back_with_its_settings_and_texts(tiny_pair_dirs, tmp_path):
    """`generate --export FILE` writes what the live page imports (its opening replay is one)."""
    from dynatree_core.cli import main

    out = tmp_path / "run.json"
    code = main(["generate", "--target", tiny_pair_dirs[0], "--draft", tiny_pair_dirs[1], "--prompt", "Hello there",
                 "--max-new-tokens", "12", "--export", str(out)])  # fmt: skip
    assert code == 0
    run = LiveRun.from_json(out.read_bytes())
    assert run.spec is not None and run.settings["policy"] == "fixed_tree" and run.settings["prompt"] == "Hello there"
    assert run.records and all(run.token_texts.get(t) is not None for r in run.records for t in r.committed)
    assert all(t in run.token_texts for t in run.prompt_ids), "the prompt's text travels too"


def test_the_bundled_replay_imports_and_accepts_several_tokens_per_iteration():
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "assets" / "replay" / "welcome.json"
    run = LiveRun.from_json(path.read_bytes())
    assert len(run.records) >= 10 and run.result().tokens_per_iteration >= 2.0
    assert run.spec is not None and run.settings["target"] == "embedded"


def _draw_dict(weights: bytes, size: int) -> dict:
    import base64
    import zlib

    return {"tokens": [1], "size": size, "w16": base64.b64encode(zlib.compress(weights)).decode("ascii")}


def test_a_draws_compressed_q_is_checked_before_it_is_kept():
    """q travels as zlib'd float16 weights: a file whose q inflates past its vocabulary (a zlib
    bomb), falls short of it, is not zlib, or is not a distribution is refused on import, and no
    more than 2 * size bytes are ever inflated."""
    import numpy as np

    from dynatree_core.core.tree import SampledDraw

    ok = SampledDraw.from_dict(_draw_dict(np.full(8, 0.125, "<f2").tobytes(), 8))
    assert ok.weights is None and torch.equal(ok.dense(), torch.full((8,), 0.125, dtype=torch.float64))
    bomb = _draw_dict(bytes(200 * 2**20), 8)  # 200 MB of zeros in ~200 KB
    for bad, match in (
        (bomb, "does not fit"),
        (_draw_dict(np.full(7, 0.125, "<f2").tobytes(), 8), "does not fit"),
        (_draw_dict(np.array([0.5, np.nan], "<f2").tobytes(), 2), "not a distribution"),
        (_draw_dict(np.array([0.5, -0.5], "<f2").tobytes(), 2), "not a distribution"),
        (_draw_dict(np.zeros(2, "<f2").tobytes(), 2), "not a distribution"),
        ({"tokens": [1], "size": 2, "w16": "AAAA"}, "not zlib"),
    ):
        with pytest.raises(ValueError, match=match):
            SampledDraw.from_dict(bad)


def test_a_draw_from_a_file_written_before_float16_weights_imports_and_exports_as_it_came():
    """Older exports hold q's nonzero entries as float32 ids and values: they still import (q
    read normalised) and are written back in the same form, bit for bit."""
    import base64

    import numpy as np

    from dynatree_core.core.tree import SampledDraw

    legacy = {
        "tokens": [3, 3],
        "size": 10,
        "ids": base64.b64encode(np.array([3, 7], "<i4").tobytes()).decode("ascii"),
        "q": base64.b64encode(np.array([0.75, 0.25], "<f4").tobytes()).decode("ascii"),
    }
    draw = SampledDraw.from_dict(legacy)
    assert draw.to_dict() == legacy
    assert draw.dense().tolist() == [0, 0, 0, 0.75, 0, 0, 0, 0.25, 0, 0]


@pytest.mark.slow
def test_a_512_token_sampled_run_of_the_embedded_pair_exports_under_the_limit_and_imports_back(tmp_path):
    """Every export imports back: a 512-token run at temperature 1, top-p 1 (every draw's q spans
    the vocabulary) with the app's default policy, exported by the CLI, fits the import limit,
    reads back with every draw's q a distribution, and writes its records out again unchanged."""
    from dynatree_core.cli import main
    from dynatree_core.runs.validate import MAX_BYTES

    out = tmp_path / "run.json"
    code = main(["generate", "--prompt", "Tell me a story about a dragon.", "--max-new-tokens", "512",
                 "--temperature", "1", "--top-p", "1", "--seed", "1", "--export", str(out)])  # fmt: skip
    assert code == 0
    data = out.read_bytes()
    assert len(data) < MAX_BYTES, f"{len(data) / 2**20:.1f} MB"
    run = LiveRun.from_json(data)
    n = sum(len(r.committed) for r in run.records)  # a new shipped draft moves where a seed's story ends:
    assert run.settings["policy"] == "fixed_tree" and n == 512, (
        f"the story ended at {n} tokens: pick a seed that runs on"
    )
    draws = [d for rec in run.records for d in rec.tree.sampled.values()]
    assert len(draws) > 100 and all(abs(float(d.dense().sum()) - 1) < 1e-12 for d in draws)
    assert all(d.dense()[t] > 0 for d in draws for t in d.tokens), "every draw is possible under its q"
    again, first = json.loads(run.to_json()), json.loads(data)
    assert all(again[k] == first[k] for k in ("records", "settings", "token_texts", "prompt_ids"))
