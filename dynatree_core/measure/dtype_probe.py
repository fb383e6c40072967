"""The dtype probe: decode with AR and a tree policy in every candidate dtype and keep the rows.

It runs the whole stack (loading a pair, the engine, the bundled prompts), so it sits above
decoding/; `decoding/dtype_choice.py` below keeps the choice store that `load_pair(dtype="auto")`
reads.
"""

from __future__ import annotations

from dynatree_core.core.devices import resolve_device
from dynatree_core.decoding.dtype_choice import DtypeRow, candidates
from dynatree_core.decoding.engine import DecodeConfig, generate
from dynatree_core.decoding.pairs import encode_prompt, load_pair
from dynatree_core.drafting import make_policy
from dynatree_core.measure.prompt_sets import choose_prompts


def probe(
    target: str,
    draft: str | None,
    *,
    device: str = "auto",
    limit: int = 4,
    max_new_tokens: int = 48,
    policy: str = "dynatree",
    dtypes: list[str] | None = None,
    progress=None,
) -> list[DtypeRow]:
    """AR and `policy` on every prompt in every candidate dtype (one process, one after another)."""
    torch_device = resolve_device(device)
    prompts = choose_prompts("all", limit)
    rows = []
    names = dtypes or candidates(torch_device)
    for i, name in enumerate(names):
        pair = load_pair(target, draft, device=str(torch_device), dtype=name)
        ids = [encode_prompt(pair.target.tokenizer, p.text, chat=p.chat, history=p.history) for p in prompts]
        config = DecodeConfig(max_new_tokens=max_new_tokens, eos_token_ids=pair.target.eos_token_ids)
        kw = dict(config=config, **pair.drafting(make_policy(policy)))
        generate(pair.target.model, ids[0], make_policy(policy), **kw)  # warm-up
        tps: dict[str, list[float]] = {"ar": [], policy: []}
        exact = 0
        for prompt in ids:
            ar = generate(pair.target.model, prompt, make_policy("ar"), config=config)
            tree = generate(pair.target.model, prompt, make_policy(policy), **kw)
            tps["ar"].append(ar.throughput_tps)
            tps[policy].append(tree.throughput_tps)
            exact += tree.token_ids == ar.token_ids
        rows.append(DtypeRow(name, sum(tps["ar"]) / len(ids), sum(tps[policy]) / len(ids), exact, len(ids)))
        if progress:
            progress(i + 1, len(names), name)
        del pair
    return rows
