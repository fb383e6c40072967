"""The decoding loop: draft -> rows -> forward -> verify -> commit -> record, one record per iteration.

Each iteration sends the root (the last committed token, plus any committed tokens the target
has not seen yet, i.e. the prompt on the first iteration) and every verified draft node to the
target in ONE forward, with an ancestor mask and position ids = root position + depth. The
accepted path keeps the KV that forward computed (compaction); the bonus token becomes the next
root. The draft keeps its own cache in sync the same way. Per-run state lives here, never on
the (possibly shared) model objects: a run's state is one `DecodeState`, each iteration's
target inputs one `VerifyBatch`, its timings one `IterationClock`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator

import torch

from dynatree_core.core.models import context_length_of
from dynatree_core.core.sampling_config import SamplingConfig
from dynatree_core.core.settings import ForwardSettings
from dynatree_core.core.transfer import to_device
from dynatree_core.core.tree import DraftTree, Reason
from dynatree_core.core.vocab import TokenMap
from dynatree_core.decoding.baselines import Baseline
from dynatree_core.decoding.batch import EarlyVerify, VerifyBatch, early_wanted, host_verify
from dynatree_core.decoding.clock import IterationClock
from dynatree_core.drafting.policy import Policy
from dynatree_core.drafting.request import DraftRequest
from dynatree_core.drafts.heads import draft_kind, make_drafter
from dynatree_core.drafts.session import Drafter
from dynatree_core.errors import DynaTreeError
from dynatree_core.forward.choice import forward_path
from dynatree_core.forward.invariant import invariant_wanted
from dynatree_core.forward.kv import KVState
from dynatree_core.forward.reference import Forward
from dynatree_core.runs.metrics import memory_mb, summarize, weight_bytes
from dynatree_core.runs.records import IterationRecord, RunResult
from dynatree_core.verify.greedy import Outcome, verify_greedy
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
    forward: ForwardSettings = ForwardSettings()  # how forwards run (core/settings.py; None fields: auto)


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


@dataclasses.dataclass
class DecodeState:
    """One run's state, shared by its iterations: built once by `start_run`, never stored on a
    (possibly shared) model object."""

    target_kv: KVState  # the target's cache for this run (forward/kv.py)
    drafter: Drafter | None  # the draft model's session and cache; None for model-free policies
    policy: Policy  # the drafting policy (its history adapts in `observe`)
    config: DecodeConfig
    device: torch.device  # the target's
    verifier: str  # the verifier's name and how drafts are drawn (verify/registry.py)
    draw: str
    gen: torch.Generator  # seeded: the draft's and the verifier's random draws
    committed: list[int]  # every committed token id, the prompt first
    prompt_len: int
    context_length: int  # the target's positions (or the config's)
    weights: int = 0  # resident weight bytes (metrics.memory_mb's CPU accounting)
    device_draft: bool = False  # ForwardSettings.device_draft, resolved for the device
    device_verify: bool = True  # ForwardSettings.device_verify, resolved
    vocab: int = 0  # the target's vocabulary: a retrieved token at or past it is not a token of it

    @property
    def new_tokens(self) -> int:
        return len(self.committed) - self.prompt_len


def start_run(
    target: torch.nn.Module,
    prompt_ids: list[int],
    policy: Policy,
    *,
    draft: torch.nn.Module | None = None,
    config: DecodeConfig = DecodeConfig(),
    draft_token_map: TokenMap | None = None,
) -> DecodeState:
    """Check the request and build a run's state: the target's (and draft's) fresh caches."""
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
    forward = config.forward
    paths = dict(capacity=min(ctx, len(prompt_ids) + config.max_new_tokens), **forward.cache_switches())
    target_kv = KVState(target, prompt_ids, **paths, invariant=invariant_wanted(target, forward.width_invariant))
    drafter = None
    weights = weight_bytes(target)  # CPU memory accounting (metrics.memory_mb)
    if policy.needs_draft_model:
        drafter = make_drafter(draft, prompt_ids, min(vocab_size(draft), vocab_size(target)), draft_token_map, **paths)
        weights += weight_bytes(draft)
        target_kv.steps.share_fixed(drafter.steps)  # the verify step reads the draft's rows in place
    policy.reset()
    return DecodeState(
        target_kv=target_kv,
        drafter=drafter,
        policy=policy,
        config=config,
        device=device,
        verifier=verifier,
        draw=draw,
        gen=gen,
        committed=list(prompt_ids),
        prompt_len=len(prompt_ids),
        context_length=ctx,
        weights=weights,
        device_draft=forward.device_draft if forward.device_draft is not None else device.type == "cuda",
        device_verify=forward.device_verify is not False,
        vocab=vocab_size(target),
    )


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
    state = start_run(target, prompt_ids, policy, draft=draft, config=config, draft_token_map=draft_token_map)
    yield from iterate(state)


def iterate(state: DecodeState) -> Iterator[IterationRecord]:
    """The iterations of a run whose state `start_run` built (`decode` is the two together; a
    caller that needs the run's caches, as measure/divergence.py does, holds the state)."""
    config, ctx = state.config, state.context_length
    for index in range(1, config.max_new_tokens + 1):  # iterations count from 1; each commits >= 1 token
        remaining = config.max_new_tokens - state.new_tokens
        room = ctx - len(state.committed)  # positions left for new tokens
        if remaining <= 0 or room <= 0:
            return
        # inference_mode is per thread: enter it per step, never across a yield (the app may
        # resume this generator from another thread)
        with torch.inference_mode():
            record = _iteration(state, index, min(remaining, room))
        state.committed.extend(record.committed)
        if record.stop is None and state.new_tokens >= config.max_new_tokens:
            record.stop = "max_new_tokens"
        elif record.stop is None and len(state.committed) >= ctx:
            record.stop = "context_limit"
        yield record
        if record.stop is not None:
            return


def replace_root(state: DecodeState, token: int) -> None:
    """Make `token` the next root: the last committed token, which no forward has read yet (the
    target's and the draft's pending token). The Verification Lab warms a feature draft on all but
    a context's last token, then puts that token in place of the one the prefill drew."""
    state.committed[-1] = token
    state.target_kv.pending[-1] = token
    if state.drafter is not None:
        state.drafter.replace_root(token)


def _iteration(state: DecodeState, index: int, budget: int) -> IterationRecord:
    """One draft -> rows -> forward -> verify -> commit -> record step. `budget`: tokens this
    iteration may commit. A policy that decides its levels on the device may queue the verify
    forward itself from the tree's rows (`early`, decoding/batch.py); else the rows are built here."""
    clock = IterationClock(state)
    early = EarlyVerify(state, clock) if early_wanted(state) else None
    tree, drafted = _draft(state, budget, early)
    seen = None  # the chain rows' logits a policy that reads the target's rows gets too (the prefill's)
    if early is not None and early.out is not None:
        batch, out = early.batch(tree), early.out
    else:
        clock.mark("draft")
        batch = VerifyBatch.of(tree, state)  # the rows: the pending chain, then the tree's nodes
        clock.mark("rows")
        seed = len(batch.chain) - 1 if state.policy.reads_target else 0
        out = host_verify(state, batch, seed)  # ONE target forward
        clock.mark("verify", len(batch.tokens))
        if seed:
            seen, out = out.logits[:seed], Forward(out.logits[seed:], out.states)
    outcome = _verify(state, tree, batch, out)  # the iteration's blocking read: the target's choices
    clock.verified()
    if state.policy.reads_target:  # every row's next-token logits (Token Recycling's matrix): the next draft's work
        with clock.refreshing():
            if seen is not None:
                state.policy.observe_target(batch.chain[:-1], seen)
            state.policy.observe_target([tree.tokens[n] for n in batch.order], out.logits[: len(batch.order)])
    accepted = [tree.tokens[n] for n in outcome.accepted]
    new_tokens, stop = cut(accepted + [outcome.bonus_token], budget, state.config.eos_token_ids)
    _commit(state, tree, batch, outcome.accepted, new_tokens, out.states)
    if drafted:  # a prefill-only iteration says nothing about the policy's trees
        state.policy.observe(outcome)
    clock.mark("commit")
    record = _record(state, index, tree, batch, outcome, new_tokens, stop)
    clock.fill(record)
    state.policy.observe_cost(record.verify_rows, record.verify_ms)
    if state.config.analyze and state.verifier != "greedy":  # outside the timings: an explanation, not the work
        record.analysis = analyze(tree, batch.order, out.logits, state.config.sampling, state.verifier, state.draw)
    return record


def _verify(state: DecodeState, tree: DraftTree, batch: VerifyBatch, out) -> Outcome:
    """The accepted path and bonus token from the target's logits over the tree's rows."""
    if state.verifier == "greedy":
        return verify_greedy(tree, batch.order, out.logits[: len(batch.order)])
    sampling = state.config.sampling
    return verify_sampling(tree, batch.order, out.logits, sampling, state.verifier, state.gen, state.draw)


def _draft(state: DecodeState, budget: int, early: EarlyVerify | None) -> tuple[DraftTree, bool]:
    """The policy's tree (max depth budget - 1: the bonus needs 1 slot), and whether it drafted:
    a feature draft before the target's first forward has no features, so that iteration is the
    prefill alone (a root-only tree). `early`: the verify forward, for a policy that queues it
    from its tensor tree (drafting/tensor_tree.TensorTree.read)."""
    drafter, committed = state.drafter, state.committed
    if drafter is not None and not drafter.ready:
        tree = DraftTree.with_root(committed[-1])
        tree.reason[0] = Reason.NO_FEATURES.value
        return tree, False
    request = DraftRequest(
        root_token=committed[-1],
        max_depth=budget - 1,
        drafter=drafter,
        context=committed,
        vocab=state.vocab,
        draw=state.draw,
        sampling=state.config.sampling,
        gen=state.gen,
        on_device=state.device_draft,
        early=early,
    )
    return state.policy.propose(request), True


def _mask(lines: list[list[int]]) -> list[str]:
    """The record's mask from the verified rows' lineages: row i's '1's at itself and its ancestors."""
    rows = [set(line) for line in lines]
    return ["".join("1" if j in row else "0" for j in range(len(rows))) for row in rows]


def _record(state: DecodeState, index: int, tree: DraftTree, batch: VerifyBatch, outcome, new_tokens, stop):
    """The iteration's record; its timings and counters are filled in by `_iteration`."""
    drafter = state.drafter
    peak = state.target_kv.peak_bytes + (drafter.kv.peak_bytes if drafter else 0)
    return IterationRecord(
        index=index,
        tree=tree,
        order=batch.order,
        mask=_mask(batch.lines.tolist()),
        position_ids=tree.position_ids(batch.order, batch.root_pos),
        prefix_len=batch.root_pos,
        chain_len=len(batch.chain),
        accepted=outcome.accepted[: len(new_tokens)],
        bonus_token=outcome.bonus_token if len(new_tokens) > len(outcome.accepted) else None,
        committed=new_tokens,
        target_tokens=outcome.target_tokens,
        draft_forwards=0,
        draft_ms=0.0,  # the phase timings: set once the clock is read
        verify_ms=0.0,
        commit_ms=0.0,
        overhead_ms=0.0,
        memory_mb=memory_mb(state.device, state.weights + peak),
        stop=stop,
        verifier=state.verifier,
        verification=outcome.trace,
        capture_ms=0.0,
        forward_path=state.target_kv.path,
    )


def _commit(
    state: DecodeState,
    tree: DraftTree,
    batch: VerifyBatch,
    accepted: list[int],
    new_tokens: list[int],
    states: torch.Tensor | None,
) -> None:
    """Keep the KV of the committed prefix and accepted nodes; the last new token is the next root.
    A feature draft also gets the target's hidden states of the chain (the committed tokens this
    forward read, root last) and the accepted nodes, each paired with the token that followed it:
    (f_chain[0], chain[1]), ..., (f_root, new[0]), (f_accepted[0], new[1]), ... (EAGLE's inputs)."""
    row = {node: i for i, node in enumerate(batch.order)}
    in_cache = accepted[: len(new_tokens) - 1]
    root_slot = batch.past + len(batch.chain) - 1
    state.target_kv.keep(list(range(root_slot + 1)) + [root_slot + row[n] for n in in_cache])
    state.target_kv.pending = [new_tokens[-1]]
    drafter, chain = state.drafter, batch.chain
    if drafter is None:
        return
    if states is not None:
        rows = list(range(len(chain))) + [len(chain) - 1 + row[n] for n in in_cache]
        picked = states[to_device(torch.tensor(rows), states.device)]  # one upload of the row indices
        drafter.add_features(picked, list(chain[1:]) + list(new_tokens))
    drafter.commit(tree, in_cache, new_tokens)


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
        forward_path=records[-1].forward_path if records else forward_path(target, **config.forward.choice_switches()),
        draft_kind=draft_kind(draft) if policy.needs_draft_model else "",
    )
