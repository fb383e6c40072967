"""Model loading from local directories, tokenizer compatibility, and errors a user can cause."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, tiny_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from dynatree_core.cli import main
from dynatree_core.core.devices import resolve_device, resolve_dtype
from dynatree_core.core.models import check_tokenizers_compatible, load_model
from dynatree_core.decoding.pairs import encode_prompt, load_pair
from dynatree_core.errors import DynaTreeError


def word_tokenizer(shuffle: bool = False) -> PreTrainedTokenizerFast:
    words = ["<unk>", "<eos>"] + [f"w{i}" for i in range(VOCAB - 2)]
    if shuffle:
        words = words[:2] + words[2:][::-1]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


def save_tiny(path, arch: str, *, shuffle: bool = False, context: int | None = None):
    model = tiny_model(arch)
    if context is not None:
        config = type(model.config).from_dict({**model.config.to_dict(), "max_position_embeddings": context})
        model = type(model)(config)
    model.save_pretrained(path)
    word_tokenizer(shuffle).save_pretrained(path)
    return str(path)


@pytest.fixture
def tiny_dirs(tmp_path):
    return {
        "target": save_tiny(tmp_path / "target", "llama"),
        "draft": save_tiny(tmp_path / "draft", "qwen2"),
        "other_tok": save_tiny(tmp_path / "other", "llama", shuffle=True),
        "short": save_tiny(tmp_path / "short", "llama", context=16),
    }


def test_local_pair_loads_and_generates_exactly(capsys, tiny_dirs):
    pair = load_pair(tiny_dirs["target"], tiny_dirs["draft"], device="cpu", dtype="float32")
    assert pair.draft is not None and not pair.draft_is_stand_in
    code = main(
        [
            "generate",
            "--prompt",
            "w1 w2 w3",
            "--target",
            tiny_dirs["target"],
            "--draft",
            tiny_dirs["draft"],
            "--policy",
            "fixed_tree",
            "--param",
            "tau=0",
            "--max-new-tokens",
            "9",
            "--json",
        ]
    )
    assert code == 0
    tree_out = capsys.readouterr().out
    main(
        [
            "generate",
            "--prompt",
            "w1 w2 w3",
            "--target",
            tiny_dirs["target"],
            "--policy",
            "ar",
            "--max-new-tokens",
            "9",
            "--json",
        ]
    )
    import json

    assert json.loads(tree_out)["token_ids"] == json.loads(capsys.readouterr().out)["token_ids"]


def test_incompatible_tokenizers_are_refused(capsys, tiny_dirs):
    with pytest.raises(DynaTreeError, match="different tokenizers"):
        load_pair(tiny_dirs["target"], tiny_dirs["other_tok"], device="cpu", dtype="float32")
    code = main(["generate", "--prompt", "w1", "--target", tiny_dirs["target"], "--draft", tiny_dirs["other_tok"]])
    err = capsys.readouterr().err
    assert code == 2 and "different tokenizers" in err.splitlines()[-1]


def test_same_tokenizer_passes_the_check(tiny_dirs):
    a = load_model(tiny_dirs["target"], device="cpu", dtype="float32")
    b = load_model(tiny_dirs["draft"], device="cpu", dtype="float32")
    check_tokenizers_compatible(a, b)


def test_prompt_longer_than_context_exits_2(capsys, tiny_dirs):
    prompt = " ".join(f"w{i}" for i in range(40))
    code = main(["generate", "--prompt", prompt, "--target", tiny_dirs["short"], "--policy", "ar"])
    assert code == 2 and "context" in capsys.readouterr().err


def test_missing_draft_uses_the_target_with_a_warning(tiny_dirs):
    with pytest.warns(UserWarning, match="stand-in"):
        pair = load_pair(tiny_dirs["target"], None, device="cpu", dtype="float32")
    assert pair.draft is pair.target and pair.draft_is_stand_in


def test_chat_mode_without_template_is_a_clear_error(tiny_dirs):
    loaded = load_model(tiny_dirs["target"], device="cpu", dtype="float32")
    with pytest.raises(DynaTreeError, match="chat template"):
        encode_prompt(loaded.tokenizer, "w1", chat=True)


def test_device_and_dtype_resolution():
    assert resolve_device("cpu").type == "cpu"
    assert resolve_dtype("auto", resolve_device("cpu")) is torch.float32, "the rule: float32 on CPU (exact greedy)"
    assert resolve_dtype("bfloat16", resolve_device("cpu")) is torch.bfloat16
    assert resolve_dtype("float16", resolve_device("cpu")) is torch.float16
    with pytest.raises(DynaTreeError):
        resolve_dtype("float8", resolve_device("cpu"))
    with pytest.raises(DynaTreeError):
        resolve_device("tpu:0")


def test_presets_only_refuses_other_models_everywhere(capsys, tiny_dirs, monkeypatch):
    from dynatree_core.core.presets import EMBEDDED, PRESETS
    from dynatree_core.core.specs import check_spec_allowed

    monkeypatch.setenv("DYNATREE_PRESETS_ONLY", "1")
    for spec in (tiny_dirs["target"], "someorg/some-model", "/etc/passwd", "../model.gguf"):
        with pytest.raises(DynaTreeError, match="serves only its preset models"):
            load_model(spec)
    check_spec_allowed(EMBEDDED)  # presets (targets and drafts) stay allowed
    for preset in PRESETS.values():
        check_spec_allowed(preset.target)
    assert main(["generate", "--prompt", "hi", "--target", tiny_dirs["target"]]) == 2
    assert "serves only its preset models" in capsys.readouterr().err
    monkeypatch.setenv("DYNATREE_PRESETS_ONLY", "0")
    check_spec_allowed(tiny_dirs["target"])


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--temperature", "nan"], "temperature"),
        (["--temperature", "inf"], "temperature"),
        (["--temperature", "-0.5"], "temperature"),
        (["--temperature", "0.8", "--top-p", "1.5"], "top_p"),
        (["--temperature", "0.8", "--top-k", "-3"], "top_k"),
        (["--temperature", "0.8", "--verifier", "nope"], "verifier"),
        (["--policy", "fixed_tree", "--temperature", "0.8", "--verifier", "block"], "block"),
    ],
)
def test_sampling_flags_at_the_edges_exit_2(capsys, tiny_dirs, extra, needle):
    pair = ["--target", tiny_dirs["target"], "--draft", tiny_dirs["target"]]
    code = main(["generate", "--prompt", "w1 w2", *pair, *extra])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("warning:")]
    assert code == 2 and lines[-1].startswith("error:") and needle in lines[-1], err


def test_more_new_tokens_than_the_context_holds_ends_at_the_limit(capsys, tiny_dirs):
    import json

    code = main(["generate", "--prompt", "w1 w2 w3", "--target", tiny_dirs["short"], "--policy", "ar",
                 "--max-new-tokens", "100000", "--json"])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["stop_reason"] == "context_limit"
    assert len(out["prompt_ids"]) + len(out["token_ids"]) == 16  # the tiny model's 16 positions


def test_the_app_binds_to_localhost_by_default():
    import tomllib
    from pathlib import Path

    config = tomllib.loads((Path(__file__).resolve().parent.parent / ".streamlit" / "config.toml").read_text())
    assert config["server"]["address"] == "localhost"
