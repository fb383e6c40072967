"""`make draft`'s `quality` stage: measured quality of a draft against the embedded target.

  agreement            top-1 agreement with the target's greedy token on held-out generations
  tokens_per_iteration fixed_tree and linear (default parameters), greedy, bundled prompts;
                       every run is also checked token-for-token against the target's greedy
  step_cost            one-token forward with a warm cache at the same context length, median
                       over repeats, target vs draft, float32 and bfloat16

Numbers are printed and written as JSON; nothing here is asserted (speed lives in benchmarks).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from dynatree_core.core.models import load_model
from dynatree_core.decoding.engine import DecodeConfig, generate
from dynatree_core.decoding.pairs import encode_prompt
from dynatree_core.drafting import make_policy
from dynatree_core.forward.kv import KVState
from dynatree_core.forward.rows import Rows
from dynatree_core.measure.prompt_sets import load_prompts


def heldout_agreement(draft_dir: Path, corpus: Path, labels: Path) -> float:
    from dynatree_core.core.vocab import TokenMap
    from dynatree_core.training.token.train import LabelledCorpus, evaluate

    draft = load_model(str(draft_dir), device="cpu", dtype="float32")
    data = LabelledCorpus(corpus, labels, 49152)
    data.token_map = draft.token_map or TokenMap([-1, *range(49152)], 49152)
    return evaluate(draft.model, data)


@torch.inference_mode()
def step_ms(model: torch.nn.Module, context: int = 200, repeats: int = 30, token_map=None) -> float:
    ids = torch.randint(100, 10000, (context,)).tolist()
    if token_map is not None:
        ids = token_map.to_draft(torch.tensor(ids)).tolist()
    kv = KVState(model, ids)
    kv.run(Rows.chain(ids, 0))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        kv.run(Rows.chain([ids[-1]], context))
        times.append((time.perf_counter() - start) * 1e3)
        kv.keep(list(range(context)))
    return statistics.median(times)


def decode_quality(draft_dirs: list[Path], prompts: str = "all", max_new_tokens: int = 64) -> dict[str, dict]:
    """Tokens/iteration of fixed_tree and linear (defaults) per draft, and step costs.

    The target's own greedy output is computed once per prompt and every draft's output is
    compared with it token for token.
    """
    target = load_model("embedded", device="cpu", dtype="float32")
    drafts = {str(d): load_model(str(d), device="cpu", dtype="float32") for d in draft_dirs}
    rows: dict[tuple[str, str], list[dict]] = {}
    for p in load_prompts(prompts):
        ids = encode_prompt(target.tokenizer, p.text, chat=p.chat, history=p.history)
        config = DecodeConfig(max_new_tokens=max_new_tokens, eos_token_ids=target.eos_token_ids)
        ar = generate(target.model, ids, make_policy("ar"), config=config)
        for key, draft in drafts.items():
            for name in ("fixed_tree", "linear"):
                run = generate(
                    target.model,
                    ids,
                    make_policy(name),
                    draft=draft.model,
                    config=config,
                    draft_token_map=draft.token_map,
                )
                rows.setdefault((key, name), []).append(
                    {
                        "domain": p.domain,
                        "tokens_per_iteration": run.tokens_per_iteration,
                        "acceptance_rate": run.acceptance_rate,
                        "exact": run.token_ids == ar.token_ids,
                    }
                )
    out: dict[str, dict] = {key: {} for key in drafts}
    for (key, name), rs in rows.items():
        out[key][name] = {
            "tokens_per_iteration": statistics.mean(r["tokens_per_iteration"] for r in rs),
            "acceptance_rate": statistics.mean(r["acceptance_rate"] for r in rs),
            "all_exact": all(r["exact"] for r in rs),
            "by_domain": {
                d: statistics.mean(r["tokens_per_iteration"] for r in rs if r["domain"] == d)
                for d in sorted({r["domain"] for r in rs})
            },
        }
        print(
            f"quality: {key} {name} {out[key][name]['tokens_per_iteration']:.2f} tokens/iteration, "
            f"exact={out[key][name]['all_exact']}",
            flush=True,
        )
    for dtype in ("float32", "bfloat16"):
        t_ms = step_ms(load_model("embedded", device="cpu", dtype=dtype).model)
        for key in drafts:
            d = load_model(key, device="cpu", dtype=dtype)
            d_ms = step_ms(d.model, token_map=d.token_map)
            out[key][f"step_ms_{dtype}"] = {"target": t_ms, "draft": d_ms, "ratio": d_ms / t_ms}
            print(
                f"quality: {key} {dtype} step target {t_ms:.1f} ms, draft {d_ms:.1f} ms (ratio {d_ms / t_ms:.3f})",
                flush=True,
            )
    return out
