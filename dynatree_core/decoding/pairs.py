"""Glue shared by the CLI and the app: resolve a model pair and encode prompts.

Keeps the rules in one place: which draft the embedded target uses, the tokenizer check, and
how a prompt (plain or chat) becomes token ids.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import warnings
from collections.abc import Callable

from dynatree_core.core.devices import resolve_device
from dynatree_core.core.models import LoadedModel, check_tokenizers_compatible, load_model
from dynatree_core.core.packing import pack_linears, packing_enabled
from dynatree_core.core.presets import EMBEDDED, PRESETS
from dynatree_core.core.specs import check_spec_allowed
from dynatree_core.decoding.baselines import Baseline
from dynatree_core.decoding.dtype_choice import saved_choice
from dynatree_core.decoding.engine import DecodeConfig, generate
from dynatree_core.drafting.policy import Policy
from dynatree_core.drafts.heads import is_head, is_head_dir, load_head
from dynatree_core.drafts.published import hub_head_dir
from dynatree_core.errors import DynaTreeError
from dynatree_core.runs.records import RunResult


@dataclasses.dataclass
class ModelPair:
    target: LoadedModel
    draft: LoadedModel | None
    draft_is_stand_in: bool = False
    dtype_source: str = "asked"  # "asked" (an explicit dtype), "probe" (a saved dtype probe) or "rule"
    # Loads the standalone token draft that the black-box baselines (HF assisted generation) need
    # when `draft` is a feature draft, which only our engine can run: on first use, not with the pair
    load_assistant: Callable[[], LoadedModel] | None = dataclasses.field(default=None, repr=False)
    _assistant: LoadedModel | None = dataclasses.field(default=None, init=False, repr=False)
    _assistant_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, init=False, repr=False)

    @property
    def assistant(self) -> LoadedModel | None:
        """The token draft lent to HF's assisted generation (loaded once, on first use); None when
        the draft is not a feature draft or the target has no token draft."""
        with self._assistant_lock:  # the app's sessions share one pair
            if self._assistant is None and self.load_assistant is not None:
                self._assistant = self.load_assistant()
            return self._assistant

    @property
    def assistant_loaded(self) -> bool:
        return self._assistant is not None

    def __getstate__(self) -> dict:  # a pair pickles (a Ray worker's, measure/cluster.py) without its lock
        return {k: v for k, v in self.__dict__.items() if k != "_assistant_lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _assistant_lock=threading.Lock())

    def drafting(self, policy) -> dict:
        """The engine's draft arguments for `policy`: `draft` and `draft_token_map` (one rule for
        every caller: no draft for policies that need none; HF baselines get the token draft)."""
        model = self.draft
        wants_assistant = isinstance(policy, Baseline) and policy.needs_draft_model
        if wants_assistant and model is not None and is_head(model.model) and self.assistant:
            model = self.assistant  # else HF's baseline says why it cannot run a feature draft
        if model is None or not policy.needs_draft_model:
            return {"draft": None, "draft_token_map": None}
        return {"draft": model.model, "draft_token_map": model.token_map}

    def generate(self, prompt: str, policy: Policy | Baseline, *, chat: bool | None = None, **config) -> RunResult:
        """Decode `prompt` with `policy` (`methods.make_method`) to the end: the library's one call.
        `chat` defaults to the target's chat template; `config` are `DecodeConfig` fields
        (max_new_tokens, sampling, seed, ...). The CLI's `generate` runs the same engine."""
        target = self.target
        ids = encode_prompt(target.tokenizer, prompt, chat=target.has_chat_template if chat is None else chat)
        defaults = {"eos_token_ids": target.eos_token_ids, "context_length": target.context_length}
        run = DecodeConfig(**{**defaults, **config})
        return generate(target.model, ids, policy, config=run, tokenizer=target.tokenizer, **self.drafting(policy))


def default_draft_for(target_spec: str) -> str | None:
    for preset in PRESETS.values():
        if preset.target == target_spec:
            return preset.draft
    return None


def token_draft_for(target_spec: str) -> str | None:
    """The first preset's standalone (token) draft for this target: the HF baselines' assistant."""
    for preset in PRESETS.values():
        if preset.target == target_spec and preset.draft and not preset.head and not is_head_dir(preset.draft):
            return preset.draft
    return None


def load_pair(
    target_spec: str = EMBEDDED,
    draft_spec: str | None = None,
    *,
    device: str = "auto",
    dtype: str = "auto",
    need_draft: bool = True,
    pack: bool = True,
) -> ModelPair:
    """Load target and draft. Without a draft spec, use the preset's draft, else the target
    itself as a stand-in (correct but never faster; a warning says so). A directory holding a
    feature draft (drafts/feature.py) is attached to the loaded target. On CPU the linear
    layers are pre-packed for oneDNN unless `pack` is False or DYNATREE_PACK=0 (core/packing.py).
    dtype "auto" takes the dtype a saved probe chose for this device and pair (dtype_choice.py), else
    the static rule (devices.resolve_dtype); both models always share one dtype."""
    source = "asked"
    if dtype == "auto":
        probed = saved_choice(resolve_device(device), target_spec, draft_spec or default_draft_for(target_spec))
        source, dtype = ("probe", probed) if probed else ("rule", "auto")
    target = load_model(target_spec, device=device, dtype=dtype)
    if pack and packing_enabled(target.device, target.dtype):
        pack_linears(target.model)
    if not need_draft:
        return ModelPair(target, None, dtype_source=source)
    draft_spec = draft_spec or default_draft_for(target_spec)
    if draft_spec is None or draft_spec == target_spec:
        warnings.warn(
            f"no draft model for {target_spec!r}: using the target itself as a stand-in draft "
            "(outputs stay exact, but nothing gets faster)",
            stacklevel=2,
        )
        return ModelPair(target, target, draft_is_stand_in=True, dtype_source=source)
    check_spec_allowed(draft_spec)
    head_dir = draft_spec if is_head_dir(draft_spec) else hub_head_dir(draft_spec)
    if head_dir:  # reads the target's features: built on the target it serves
        head = load_head(str(head_dir), target.model)
        if pack and packing_enabled(target.device, target.dtype):
            pack_linears(head)
        draft = LoadedModel(
            spec=draft_spec, model=head, tokenizer=target.tokenizer, device=target.device, dtype=target.dtype
        )
        assistant_spec = token_draft_for(target_spec)
        load = functools.partial(_load_token_draft, assistant_spec, target, dtype, pack) if assistant_spec else None
        return ModelPair(target, draft, dtype_source=source, load_assistant=load)
    return ModelPair(target, _load_token_draft(draft_spec, target, dtype, pack), dtype_source=source)


def _load_token_draft(spec: str, target: LoadedModel, dtype: str, pack: bool) -> LoadedModel:
    draft = load_model(spec, device=str(target.device), dtype=dtype)
    check_tokenizers_compatible(target, draft)
    if pack and packing_enabled(draft.device, draft.dtype):
        pack_linears(draft.model)
    return draft


_SLOT = "\ue000DYNATREE_USER_TEXT\ue001"  # private-use characters: no real prompt contains this


def encode_prompt(tokenizer, text: str, *, chat: bool, history: tuple[tuple[str, str], ...] = ()) -> list[int]:
    """Token ids for a prompt. Chat mode applies the tokenizer's chat template; `history` holds
    earlier (user, assistant) turns that come before `text` (chat mode only).

    The user's text is always tokenized as text: a prompt that contains "<|endoftext|>" or a chat
    marker gets the characters, never the control token (HF tokenizers would otherwise turn
    them into special ids, e.g. an EOS inside the prompt). Only the chat template's own markers
    are special: the template is rendered around placeholders, and the pieces between them are
    tokenized normally while the messages' text has special tokens split.
    """
    if text is None or not text.strip():
        raise DynaTreeError("the prompt is empty")
    if history and not chat:
        raise DynaTreeError("earlier turns need chat mode")
    clean = lambda t: t.replace("\x00", "")  # noqa: E731  NUL breaks some tokenizers; it carries no meaning
    split = lambda t: list(tokenizer(clean(t), add_special_tokens=False, split_special_tokens=True)["input_ids"])  # noqa: E731
    if not chat:
        bos = tokenizer(_SLOT, add_special_tokens=True)["input_ids"]
        plain = tokenizer(_SLOT, add_special_tokens=False)["input_ids"]
        return _wrap(bos, plain, split(text))
    if not getattr(tokenizer, "chat_template", None):
        raise DynaTreeError("this model has no chat template: turn chat mode off")
    texts = [t for turn in history for t in turn] + [text]
    slots = [f"{_SLOT}{i}\ue002" for i in range(len(texts))]
    roles = ["user", "assistant"] * len(history) + ["user"]
    messages = [{"role": r, "content": s} for r, s in zip(roles, slots, strict=True)]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if any(rendered.count(s) != 1 for s in slots):  # a template that rewrites the content: no safe split
        raise DynaTreeError("this model's chat template alters the message text: turn chat mode off")
    ids: list[int] = []
    for slot, message in zip(slots, texts, strict=True):
        before, rendered = rendered.split(slot)
        ids += _template_ids(tokenizer, before) + split(message)
    return ids + _template_ids(tokenizer, rendered)


def _template_ids(tokenizer, piece: str) -> list[int]:
    return list(tokenizer(piece, add_special_tokens=False)["input_ids"]) if piece else []


def _wrap(with_specials: list[int], without: list[int], ids: list[int]) -> list[int]:
    """Put around `ids` whatever special tokens (BOS/EOS) the tokenizer adds to any text: the
    difference between encoding the placeholder with and without special tokens."""
    start = next((i for i in range(len(with_specials)) if with_specials[i : i + len(without)] == without), None)
    if start is None:
        return list(ids)
    return list(with_specials[:start]) + list(ids) + list(with_specials[start + len(without) :])
