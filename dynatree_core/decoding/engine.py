"""The decoding loop: draft -> verify -> commit -> observe, one record per iteration.

Each iteration sends the root (the last committed token, plus any committed tokens the target
has not seen yet, i.e. the prompt on the first iteration) and every verified draft node to the
target in ONE forward, with an ancestor mask and position ids = root position + depth. The
accepted path keeps the KV that forward computed (compaction); the bonus token becomes the next
root. The draft keeps its own cache in sync the same way. Per-run state lives here, never on
the (possibly shared) model objects.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator

import torch

from dynatree_core.core.invariant import invariant_wanted
from dynatree_core.core.kv import KVState, chain_then_tree_visibility, forward_path
from dynatree_core.core.models import context_length_of
from dynatree_core.core.sampling_config import SamplingConfig
from dynatree_core.core.taps import FINAL
from dynatree_core.core.transfer import PhaseClock, to_device
from dynatree_core.core.tree import DraftTree, Reason
from dynatree_core.core.vocab import TokenMap
from dynatree_core.decoding.baselines import Baseline
from dynatree_core.drafting.policy import Policy
from dynatree_core.drafting.request import DraftRequest
from dynatree_core.drafts.heads import head_drafter, head_kind, is_head
from dynatree_core.drafts.session import Drafter
from dynatree_core.errors import DynaTreeError
from dynatree_core.runs.metrics import memory_mb, summarize, weight_bytes
from dynatree_core.runs.records import IterationRecord, RunResult
from dynatree_core.verify.greedy import verify_greedy
from dynatree_core.verify.registry import resolve_verifier
from dynatree_core.verify.sampling import analyze, verify_sampling


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    max_new_tokens: int = 64
    eos_token_ids: frozenset[int] = frozenset()
    context_length: int | None = None  # defaults to the target's max positions
    order: str = "bfs"  # node order sent to the target: bfs or dfs
    sampling: SamplingConfig = SamplingConfig()  # temperature 0: greedy
    verifier: str = "auto"  # greedy at T=0; else specinfer (i.i.d. draws), without_replacement, or nss
    seed: int = 0  # seeds the draft's and the verifier's random draws
    analyze: bool = False  # per-node expected acceptance / reach probabilities (the app's; costs time)
    # How forwards run (core/kv.py, core/fastpath.py); None: on unless DYNATREE_STATIC_CACHE / DYNATREE_FAST_FORWARD=0
    static_cache: bool | None = None  # preallocated per-run KV buffers, compacted in place
    fast_forward: bool | None = None  # the lean forward over them (Llama-family models)
    graphs: bool | None = None  # fixed-shape forwards, one CUDA graph per width (core/graphs.py; default: on CUDA)
    # the target's forwards width-invariant (core/invariant.py); None: invariant_wanted's rule
    width_invariant: bool | None = None


def _capture_s(target_kv: KVState, drafter: Drafter | None) -> float:
    return target_kv.capture_s + (drafter.kv.capture_s if drafter else 0.0)


def draft_kind(draft: torch.nn.Module | None) -> str:
    """A head's kind ("feature", "fused": drafts/heads.py), "token" for a standalone draft LM."""
    if draft is None:
        return ""
    return head_kind(draft) if is_head(draft) else "token"


def vocab_size(model: torch.nn.Module) -> int:
    head = model.get_output_embeddings()
    if head is None:
        return model.config.vocab_size
    return getattr(head, "out_features", None) or head.weight.shape[0]  # a packed head has no dense weight


def cut(tokens: list[int], remaining: int, eos: Iterable[int]) -> tuple[list[int], str | None]:
    """Truncate an iteration's tokens at the first EOS (kept) and at the token budget."""
    eos = set(eos)
    for i, tok in enumerate(tokens):
        if tok in eos:
            return tokens[: i + 1], "eos"
    return tokens[:remaining], None


def decode(
    target: torch.nn.Module,
    prompt_ids: list[int],
    policy: Policy,
    *,
    draft: torch.nn.Module | None = None,
    config: DecodeConfig = DecodeConfig(),
    draft_token_map: TokenMap | None = None,
) -> Iterator[IterationRecord]:
    """Run speculative decoding, yielding one IterationRecord per iteration (one target forward)."""
    if isinstance(policy, Baseline):
        raise DynaTreeError(f"{policy.name} is a baseline that runs as one call: it cannot be stepped")
    if not prompt_ids:
        raise DynaTreeError("the prompt is empty")
    ctx = config.context_length or context_length_of(target)
    if len(prompt_ids) >= ctx:
        raise DynaTreeError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {ctx}")
    if policy.needs_draft_model and draft is None:
        raise DynaTreeError(f"policy {policy.name!r} needs a draft model")
    device = target.get_input_embeddings().weight.device
    verifier, draw = resolve_verifier(policy.capabilities(), config.verifier, config.sampling)
    gen = torch.Generator().manual_seed(config.seed)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    paths = dict(
        capacity=min(ctx, len(prompt_ids) + config.max_new_tokens),
        static=config.static_cache,
        fast=config.fast_forward,
        graphs=config.graphs,
    )
    target_kv = KVState(target, prompt_ids, **paths, invariant=invariant_wanted(target, config.width_invariant))
    drafter = None
    weights = weight_bytes(target)  # CPU memory accounting (metrics.memory_mb)
    if policy.needs_draft_model:
        vocab = min(vocab_size(draft), vocab_size(target))
        if is_head(draft):  # reads the target's features; carries its own token map
            drafter = head_drafter(draft, vocab, **paths)
        else:
            drafter = Drafter(draft, prompt_ids, vocab, draft_token_map, kv=KVState(draft, prompt_ids, **paths))
        weights += weight_bytes(draft)
    committed = list(prompt_ids)
    policy.reset()
    for index in range(1, config.max_new_tokens + 1):  # iterations count from 1; each commits >= 1 token
        remaining = config.max_new_tokens - (len(committed) - len(prompt_ids))
        room = ctx - len(committed)  # positions left for new tokens
        if remaining <= 0 or room <= 0:
            return
        # inference_mode is per thread: enter it per step, never across a yield (the app may
        # resume this generator from another thread)
        with torch.inference_mode():
            record = _iteration(
                index,
                target_kv,
                drafter,
                policy,
                committed,
                min(remaining, room),
                config,
                device,
                (verifier, draw, gen),
                weights,
            )
        committed.extend(record.committed)
        if record.stop is None and len(committed) - len(prompt_ids) >= config.max_new_tokens:
            record.stop = "max_new_tokens"
        elif record.stop is None and len(committed) >= ctx:
            record.stop = "context_limit"
        yield record
        if record.stop is not None:
            return


def _iteration(
    index: int,
    target_kv: KVState,
    drafter: Drafter | None,
    policy: Policy,
    committed: list[int],
    budget: int,
    config: DecodeConfig,
    device: torch.device,
    sampling_state: tuple[str, str, torch.Generator],
    weights: int = 0,
) -> IterationRecord:
    """One draft -> verify -> commit step. `budget`: tokens this iteration may commit."""
    verifier, draw, gen = sampling_state
    captured = _capture_s(target_kv, drafter)  # graph captures (core/graphs.py) are set-up, not the iteration's work
    clock = PhaseClock(device)  # phase boundaries, read once after the commit (one sync, not one each)
    clock.mark()
    draft_forwards = drafter.forwards if drafter else 0
    draft_forward_ms = drafter.kv.forward_ms if drafter else 0.0
    request = DraftRequest(committed[-1], budget - 1, drafter, committed, draw, config.sampling, gen)
    drafted = drafter is None or drafter.ready
    if drafted:
        tree = policy.draft(request)  # max depth budget - 1: the bonus needs 1 slot
    else:  # a feature draft before the target's first forward: this iteration is the prefill alone
        tree = DraftTree.with_root(committed[-1])
        tree.reason[0] = Reason.NO_FEATURES.value
    draft_forwards = (drafter.forwards if drafter else 0) - draft_forwards
    clock.mark()
    draft_capture_ms = (_capture_s(target_kv, drafter) - captured) * 1e3
    order = tree.order(config.order)
    ancestors = tree.ancestor_mask(order)  # (n, n) bool, root first
    past, chain = target_kv.length, target_kv.pending
    visible = chain_then_tree_visibility(past, len(chain), ancestors[1:, 1:])
    root_pos = len(committed) - 1
    positions = list(range(past, past + len(chain))) + tree.position_ids(order[1:], root_pos)
    tokens = chain + [tree.tokens[n] for n in order[1:]]
    clock.mark()
    features = drafter is not None and drafter.wants_features  # the same forward also returns hidden states
    hidden = (drafter.taps if drafter.taps != (FINAL,) else True) if features else False
    out = target_kv.forward(tokens, positions, visible, logits_to_keep=len(order), hidden=hidden)  # ONE forward
    logits, states = out if features else (out, None)
    clock.mark()
    verify_capture_ms = (_capture_s(target_kv, drafter) - captured) * 1e3 - draft_capture_ms
    if verifier == "greedy":
        outcome = verify_greedy(tree, order, logits)
    else:
        outcome = verify_sampling(tree, order, logits, config.sampling, verifier, gen, draw)
    new_tokens, stop = cut(
        [tree.tokens[n] for n in outcome.accepted] + [outcome.bonus_token], budget, config.eos_token_ids
    )
    _commit(target_kv, drafter, tree, outcome.accepted, order, past + len(chain) - 1, new_tokens, (chain, states))
    if drafted:  # a prefill-only iteration says nothing about the policy's trees
        policy.observe(outcome)
    clock.mark()
    record = IterationRecord(
        index=index,
        tree=tree,
        order=order,
        mask=["".join("1" if v else "0" for v in row) for row in ancestors.tolist()],
        position_ids=tree.position_ids(order, root_pos),
        prefix_len=root_pos,
        chain_len=len(chain),
        accepted=outcome.accepted[: len(new_tokens)],
        bonus_token=outcome.bonus_token if len(new_tokens) > len(outcome.accepted) else None,
        committed=new_tokens,
        target_tokens=outcome.target_tokens,
        draft_forwards=draft_forwards,
        draft_ms=0.0,  # the phase timings: below, once the clock is read
        verify_ms=0.0,
        commit_ms=0.0,
        overhead_ms=0.0,
        memory_mb=memory_mb(device, weights + target_kv.peak_bytes + (drafter.kv.peak_bytes if drafter else 0)),
        stop=stop,
        verifier=verifier,
        verification=outcome.trace,
        capture_ms=draft_capture_ms + verify_capture_ms,
        forward_path=target_kv.path,
    )
    clock.mark()
    t1, t2, t3, t4, t5 = clock.read()[1:]  # ms since the iteration began
    record.draft_ms = t1 - draft_capture_ms
    record.verify_ms = t3 - t2 - verify_capture_ms
    record.commit_ms = t4 - t3
    record.overhead_ms = t2 - t1 + t5 - t4
    # the draft's forward time: its CUDA events are done by now, so reading them waits for nothing
    record.draft_forward_ms = (drafter.kv.forward_ms if drafter else 0.0) - draft_forward_ms
    policy.observe_cost(len(tokens), record.verify_ms)
    if config.analyze and verifier != "greedy":  # outside the timings: an explanation, not the work
        record.analysis = analyze(tree, order, logits, config.sampling, verifier, draw)
    return record


def _commit(
    target_kv: KVState,
    drafter: Drafter | None,
    tree,
    accepted: list[int],
    order: list[int],
    root_slot: int,
    new_tokens: list[int],
    chain_states: tuple[list[int], torch.Tensor | None] = ([], None),
) -> None:
    """Keep the KV of the committed prefix and accepted nodes; the last new token is the next root.
    A feature draft also gets the target's hidden states of the chain (the committed tokens this
    forward read, root last) and the accepted nodes, each paired with the token that followed it:
    (f_chain[0], chain[1]), ..., (f_root, new[0]), (f_accepted[0], new[1]), ... (EAGLE's inputs)."""
    row = {node: i for i, node in enumerate(order)}
    in_cache = accepted[: len(new_tokens) - 1]
    target_kv.keep(list(range(root_slot + 1)) + [root_slot + row[n] for n in in_cache])
    target_kv.pending = [new_tokens[-1]]
    if drafter is None:
        return
    chain, states = chain_states
    if states is not None:
        rows = list(range(len(chain))) + [len(chain) - 1 + row[n] for n in in_cache]
        picked = states[to_device(torch.tensor(rows), states.device)]  # one upload of the row indices
        drafter.add_features(picked, list(chain[1:]) + list(new_tokens))
    drafter.commit(tree, in_cache, new_tokens)


def _paths(config: DecodeConfig) -> dict:
    return {"static": config.static_cache, "fast": config.fast_forward, "graphs": config.graphs}


def generate(
    target: torch.nn.Module,
    prompt_ids: list[int],
    policy: Policy | Baseline,
    *,
    draft: torch.nn.Module | None = None,
    config: DecodeConfig = DecodeConfig(),
    tokenizer=None,
    draft_token_map: TokenMap | None = None,
    on_record: Callable[[IterationRecord], None] | None = None,
) -> RunResult:
    """Run `decode` to the end and reduce its records to a RunResult; a baseline (baselines.py)
    runs as its own one call instead. on_record sees each iteration as it ends (time spent in it
    is not counted: throughput comes from the records' own timings)."""
    if isinstance(policy, Baseline):
        return policy.run(
            target, prompt_ids, draft=draft, config=config, draft_token_map=draft_token_map, tokenizer=tokenizer
        )
    records = []
    for record in decode(target, prompt_ids, policy, draft=draft, config=config, draft_token_map=draft_token_map):
        records.append(record)
        if on_record is not None:
            on_record(record)
    token_ids = [t for r in records for t in r.committed]
    text = tokenizer.decode(token_ids, skip_special_tokens=True) if tokenizer is not None else ""
    device = target.get_input_embeddings().weight.device
    return summarize(
        records,
        policy=policy.name,
        params=policy.config,
        text=text,
        prompt_ids=prompt_ids,
        target_forwards=len(records),
        device=str(device),
        dtype=str(target.dtype).removeprefix("torch."),
        threads=torch.get_num_threads(),
        forward_path=records[-1].forward_path if records else forward_path(target, **_paths(config)),
        draft_kind=draft_kind(draft) if policy.needs_draft_model else "",
    )
