"""Baselines: what a user would pick instead, run as black boxes (one call, no per-iteration trees).

A `Baseline` is a protocol of its own, beside the drafting `Policy`: it shares the parameter
specs (`Tunable`: name, summary, `Param`s, needs_draft_model) but has no `draft`; it has one
`run(...) -> RunResult`. `BASELINES` is its registry; `methods.py` lists policies and baselines
together for the CLI and the pages. The built-in ones are Hugging Face's own decoding:

  hf_assisted       target.generate(assistant_model=draft): HF's assisted generation (a chain)
  hf_prompt_lookup  target.generate(prompt_lookup_num_tokens=n): HF's prompt lookup decoding
  hf_generate       target.generate(): plain decoding with HF's dynamic cache, eager
  hf_static         target.generate(past_key_values=StaticCache(...)): what a user who wants speed
                    calls; generate compiles the decoding step (torch.compile) on CUDA and XPU, and
                    runs it eagerly elsewhere (its forward path says which). The cache is sized in
                    buckets and kept per model, and each bucket is warmed once, untimed (HFStatic)

They are not stepped by our engine: `run` calls HF generate once, timed on the same prompts and models, and rebuilds the
summary from a hook on the target's forward (each target forward is one iteration; the tokens
it reads beyond the first are the candidates it verifies). HF exposes no per-iteration trees,
so a baseline's RunResult has no records. A reduced-vocabulary draft (the embedded one) is
given to HF as a full-vocabulary view (`TokenMap.full_vocab_model`).
"""

from __future__ import annotations

import time
import weakref
from typing import Any, ClassVar

import torch

from dynatree_core.core.vocab import TokenMap
from dynatree_core.drafting.policy import Param, Tunable
from dynatree_core.drafts.heads import is_head
from dynatree_core.errors import DynaTreeError
from dynatree_core.runs.metrics import kv_bytes_per_token, memory_mb, ratio, weight_bytes
from dynatree_core.runs.records import RunResult


class Baseline(Tunable):
    """A black box: one call decodes the whole answer and returns its RunResult (no records)."""

    kind: ClassVar[str] = "baseline"

    def run(
        self,
        target: torch.nn.Module,
        prompt_ids: list[int],
        *,
        draft: torch.nn.Module | None,
        config: Any,
        draft_token_map: TokenMap | None = None,
        tokenizer=None,
    ) -> RunResult:
        raise NotImplementedError


BASELINES: dict[str, type[Baseline]] = {}


def register_baseline(cls: type[Baseline]) -> type[Baseline]:
    BASELINES[cls.name] = cls
    return cls


class HFBaseline(Baseline):
    """Hugging Face generate with this baseline's arguments, timed from outside."""

    def generate_kwargs(self, draft: torch.nn.Module | None) -> dict:
        raise NotImplementedError

    def generate_kwargs_for(
        self, target: torch.nn.Module, prompt_ids: list[int], draft: torch.nn.Module | None, config
    ) -> dict:
        """This run's generate arguments, prepared before the timer starts (anything built or warmed
        here is not timed). By default `generate_kwargs(draft)`; HFStatic adds its cache."""
        return self.generate_kwargs(draft)

    def forward_path(self, device: torch.device) -> str:
        """How HF ran the target's forwards (RunResult.forward_path)."""
        return "hf"

    def run(
        self,
        target: torch.nn.Module,
        prompt_ids: list[int],
        *,
        draft: torch.nn.Module | None,
        config,
        draft_token_map: TokenMap | None = None,
        tokenizer=None,
    ) -> RunResult:
        self._check(prompt_ids, draft)
        if draft is not None and draft_token_map is not None:
            draft = draft_token_map.full_vocab_model(draft)
        device = target.get_input_embeddings().weight.device
        uses_draft = self.needs_draft_model and draft is not None
        resident = weight_bytes(target) + (weight_bytes(draft) if uses_draft else 0)
        eos = list(config.eos_token_ids) or None
        kwargs = self.generate_kwargs_for(target, prompt_ids, draft, config)  # untimed
        out, wall, reads = self._timed_generate(target, prompt_ids, config, eos, kwargs)
        tokens = out[0, len(prompt_ids) :].tolist()
        resident += kv_bytes_per_token(target) * (len(prompt_ids) + sum(reads[1:]))
        if uses_draft:
            resident += kv_bytes_per_token(draft) * (len(prompt_ids) + len(tokens))
        if eos and eos[0] in tokens and tokens[-1] != eos[0]:  # HF pads after EOS
            tokens = tokens[: tokens.index(eos[0]) + 1]
        text = tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer is not None else ""
        peak_mb = memory_mb(device, resident)
        return self._result(
            target, prompt_ids=prompt_ids, tokens=tokens, reads=reads, wall=wall, text=text, peak_mb=peak_mb, eos=eos
        )

    def _check(self, prompt_ids: list[int], draft: torch.nn.Module | None) -> None:
        if not prompt_ids:
            raise DynaTreeError("the prompt is empty")
        if self.needs_draft_model and draft is None:
            raise DynaTreeError(f"policy {self.name!r} needs a draft model")
        if self.needs_draft_model and is_head(draft):
            raise DynaTreeError(
                f"{self.name} runs Hugging Face's assisted generation, which needs a standalone draft LM; "
                "this draft is a feature draft (it reads the target's hidden states): use the token draft"
            )

    def _generate(
        self, target: torch.nn.Module, prompt_ids: list[int], config, eos: list[int] | None, kwargs: dict
    ) -> torch.Tensor:
        """One HF generate call with this run's decoding settings: output ids (1, prompt + new)."""
        device = target.get_input_embeddings().weight.device
        sampling = config.sampling
        extra = {} if sampling.greedy else {"temperature": sampling.temperature, "top_p": sampling.top_p}
        if not sampling.greedy:
            extra["top_k"] = sampling.top_k or None
            torch.manual_seed(config.seed)  # HF samples from torch's global generator
        with torch.inference_mode():
            return target.generate(
                torch.tensor([prompt_ids], device=device),
                max_new_tokens=config.max_new_tokens,
                do_sample=not sampling.greedy,
                **extra,
                eos_token_id=eos,
                pad_token_id=eos[0] if eos else 0,
                **kwargs,
            )

    def _timed_generate(
        self, target: torch.nn.Module, prompt_ids: list[int], config, eos: list[int] | None, kwargs: dict
    ) -> tuple[torch.Tensor, float, list[int]]:
        """One HF generate call, timed: (output ids (1, prompt + new), wall seconds, the tokens each
        target forward read, from a hook on its forward). `kwargs` come from `generate_kwargs_for`,
        prepared before the timer starts."""
        device = target.get_input_embeddings().weight.device
        reads: list[int] = []
        handle = target.register_forward_pre_hook(
            lambda _m, args, kwargs: reads.append(
                (kwargs.get("input_ids") if "input_ids" in kwargs else args[0]).shape[1]
            ),
            with_kwargs=True,
        )
        try:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            out = self._generate(target, prompt_ids, config, eos, kwargs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            wall = time.perf_counter() - start
        finally:
            handle.remove()
        return out, wall, reads

    def _result(
        self,
        target: torch.nn.Module,
        *,
        prompt_ids: list[int],
        tokens: list[int],
        reads: list[int],
        wall: float,
        text: str,
        peak_mb: float,
        eos: list[int] | None,
    ) -> RunResult:
        """The run's summary: each target forward is one iteration; the tokens it read beyond the
        first are the candidates it verified."""
        device = target.get_input_embeddings().weight.device
        iterations = len(reads)
        accepted = max(len(tokens) - iterations, 0)  # each forward commits accepted + 1 token
        drafted = sum(n - 1 for n in reads[1:])  # after the prefill, candidates ride with 1 token
        return RunResult(
            policy=self.name,
            params=dict(self.config),
            text=text,
            prompt_ids=list(prompt_ids),
            token_ids=tokens,
            iterations=iterations,
            new_tokens=len(tokens),
            target_forwards=iterations,
            draft_forwards=0,  # not observable from outside HF
            tokens_per_iteration=ratio(len(tokens), iterations),
            acceptance_rate=ratio(accepted, drafted),
            mean_accepted_length=ratio(accepted, iterations),
            throughput_tps=ratio(len(tokens), wall),
            wall_s=wall,
            ttft_ms=0.0,  # not observable from outside HF
            tpot_ms=ratio(wall * 1000, len(tokens)),
            # CUDA: the allocator's peak. CPU: the weights used and caches sized from the config for
            # every token read (HF's own cache is out of sight)
            peak_memory_mb=peak_mb,
            draft_ms=0.0,
            verify_ms=0.0,
            commit_ms=0.0,
            overhead_ms=0.0,
            stop_reason="eos" if eos and tokens and tokens[-1] in eos else "max_new_tokens",
            device=str(device),
            dtype=str(target.dtype).removeprefix("torch."),
            threads=torch.get_num_threads(),
            forward_path=self.forward_path(device),
        )


@register_baseline
class HFAssisted(HFBaseline):
    """HF assisted generation: the draft proposes a chain, the target verifies it (black box)."""

    name = "hf_assisted"
    summary = "Baseline: HF generate(assistant_model=draft), timed as a black box"
    params = (
        Param("num_assistant_tokens", int, 5, 1, 64, "Draft tokens per step (HF's starting value)"),
        Param("heuristic", bool, True, help="HF's heuristic schedule: +2 tokens after full acceptance, -1 otherwise"),
    )

    def generate_kwargs(self, draft: torch.nn.Module | None) -> dict:
        gen = draft.generation_config
        gen.num_assistant_tokens = self.config["num_assistant_tokens"]
        gen.num_assistant_tokens_schedule = "heuristic" if self.config["heuristic"] else "constant"
        gen.assistant_confidence_threshold = 0.0  # propose the full chain (HF's default stops early)
        return {"assistant_model": draft}


@register_baseline
class HFPromptLookup(HFBaseline):
    """HF prompt lookup decoding: candidates copied from earlier n-gram matches (black box)."""

    name = "hf_prompt_lookup"
    family = "retrieved"
    summary = "Baseline: HF generate(prompt_lookup_num_tokens=n), timed as a black box"
    needs_draft_model = False
    params = (
        Param("prompt_lookup_num_tokens", int, 10, 1, 64, "Tokens copied after a match"),
        Param("max_matching_ngram_size", int, 2, 1, 8, "Longest n-gram matched"),
    )

    def generate_kwargs(self, draft: torch.nn.Module | None) -> dict:
        return dict(self.config)


@register_baseline
class HFGenerate(HFBaseline):
    """Plain HF generate: one target forward per token, no drafting (the reference to beat)."""

    name = "hf_generate"
    family = "none"
    summary = "Reference: HF generate() without speculation, timed as a black box"
    needs_draft_model = False

    def generate_kwargs(self, draft: torch.nn.Module | None) -> dict:
        return {}


# devices on which transformers' generate compiles a static-cache decoding step by itself
# (GenerationMixin._valid_auto_compile_criteria, transformers 5.x: a cache whose `is_compileable`)
AUTO_COMPILE_DEVICES = ("cuda", "xpu")

# HFStatic's cache sizes are multiples of this: prompt + max_new_tokens rounded up
STATIC_CACHE_BUCKET = 256

# HFStatic's caches per target model: {(max_cache_len, dtype, device): StaticCache}. Weak keys: a
# cache lives as long as its model, and a copy of the model (deepcopy) starts without one, so its
# first use of a size is warmed up again (torch.compile's work belongs to the model it compiled)
STATIC_CACHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def static_cache_len(prompt_len: int, max_new_tokens: int) -> int:
    """HFStatic's cache size for a prompt: prompt + max_new_tokens rounded up to STATIC_CACHE_BUCKET."""
    need = prompt_len + max_new_tokens
    return -(-need // STATIC_CACHE_BUCKET) * STATIC_CACHE_BUCKET


@register_baseline
class HFStatic(HFBaseline):
    """HF generate with a static cache: compiled by generate on CUDA (the fastest AR a user runs
    without writing code), eager with preallocated buffers elsewhere.

    Why it brings its own cache: given `cache_implementation="static"`, generate sizes the cache at
    prompt + max_new_tokens, so every prompt of a new length builds a cache of a new shape and
    torch.compile recompiles the decoding step inside the timed call (measured on an H200: one
    prompt took 30 s, and the reference ran at 28 tokens/s against 56 for plain generate). Here the
    cache is a `transformers.StaticCache` sized up to a multiple of STATIC_CACHE_BUCKET, one per
    size, kept per target model (STATIC_CACHES, keyed by size, dtype and device, so it never serves
    another model, dtype or device) and reset before each call (generate reads the cache's length as
    the prefix already in it). On a device where generate compiles (AUTO_COMPILE_DEVICES), the first use of a
    size runs one untimed generate first, the compile and CUDA-graph capture for that size, so the
    timed call is the steady state a warmed-up server runs. On CPU nothing compiles: no warm-up."""

    name = "hf_static"
    family = "none"
    summary = "Reference: HF generate with a static cache, compiled on CUDA (warmed per size), timed as a black box"
    needs_draft_model = False

    cache_len: int | None = None  # the last run's cache size, for its forward path

    def generate_kwargs(self, draft: torch.nn.Module | None) -> dict:
        return {"cache_implementation": "static"}  # without a prompt to size a cache: generate sizes one

    def generate_kwargs_for(
        self, target: torch.nn.Module, prompt_ids: list[int], draft: torch.nn.Module | None, config
    ) -> dict:
        """The target's cache for this prompt's size (made, and warmed up where generate compiles, on
        first use), emptied: built before the timer starts."""
        from transformers import StaticCache

        weight = target.get_input_embeddings().weight
        size = static_cache_len(len(prompt_ids), config.max_new_tokens)
        caches = STATIC_CACHES.setdefault(target, {})
        key = (size, weight.dtype, str(weight.device))
        cache = caches.get(key)
        first_use = cache is None
        if first_use:
            cache = caches[key] = StaticCache(config=target.config, max_cache_len=size)
        kwargs = {"past_key_values": cache}
        if first_use and weight.device.type in AUTO_COMPILE_DEVICES:  # compile and capture, untimed
            eos = list(config.eos_token_ids) or None
            self._generate(target, prompt_ids, config, eos, kwargs)
            if weight.device.type == "cuda":
                torch.cuda.synchronize(weight.device)
        with torch.inference_mode():  # its buffers were made inside generate's inference mode
            cache.reset()
        self.cache_len = size
        return kwargs

    def forward_path(self, device: torch.device) -> str:
        if device.type in AUTO_COMPILE_DEVICES:
            return f"hf+static+compiled (cache {self.cache_len} tokens, warmed per size)"
        return f"hf+static (not compiled: generate compiles on {' / '.join(AUTO_COMPILE_DEVICES)} only)"
