"""The draft model's session for one run: its own KV cache, expanded one tree level per forward.

A policy never touches caches or masks: it asks the session for the draft distributions of a
whole tree level at once, with device tensors (`expand_level`: one draft forward, no host read;
the masks are built there from each row's parent row; `expand_rows` for a best-first search's
batch, whose rows' parents may sit in any earlier forward), names the nodes' slots once it has
read its tree (`bind`), and the engine tells it which nodes were accepted (`commit`, KV
compaction). Token drafts use this class as it is; feature and fused heads (feature.py,
fused.py) subclass it.
"""

from __future__ import annotations

import torch

from dynatree_core.core.transfer import upload_into
from dynatree_core.core.tree import DraftTree
from dynatree_core.core.vocab import TokenMap
from dynatree_core.forward.kv import KVState
from dynatree_core.forward.rows import Rows, counting


class Drafter:
    """The draft model for one run: its own KV cache, expanded one tree level per forward.

    Cache layout during an iteration: [committed tokens (root last)] [tree nodes, level by level].
    Siblings never share mutable state: every node has its own cache slot and sees only its
    ancestors through the mask.
    """

    wants_features = False  # a feature draft (drafts/feature.py) also reads the target's hidden states
    ready = True  # it can draft now (a feature draft waits for the target's first forward)

    def __init__(
        self,
        model: torch.nn.Module,
        prompt_ids: list[int],
        vocab_size: int,
        token_map: TokenMap | None = None,
        *,
        kv: KVState | None = None,
    ):
        self.kv = kv if kv is not None else KVState(model, prompt_ids)
        self.vocab_size = vocab_size
        self.token_map = token_map  # reduced-vocabulary draft: map ids in and log-probs out
        self.slots: dict[int, int] = {}  # node id -> cache index, for the current tree
        self.committed = 0  # cache entries that are committed tokens
        # levels drafted on the device (expand_level): each row's ancestors' slots and itself, and
        # the first slot of every level after the root's
        self.ancestors = torch.zeros(1, 0, dtype=torch.long)
        self.level_starts: list[int] = []
        self.row_lines = self.ancestors  # expand_rows: every row's ancestors' slots and itself, the root's first
        self._committed_on_device: torch.Tensor | None = None  # _upload_committed

    @property
    def forwards(self) -> int:
        return self.kv.forwards

    @property
    def steps(self):
        """The tensor work between its forwards, captured where they are (forward/capture.StepGraphs)."""
        return self.kv.steps

    def _root(self, then: tuple | None) -> tuple[torch.Tensor, tuple | None]:
        """The root's forward (the pending committed tokens, root last): its logits, and what
        `then` returned where it ran in the forward's captured step (else None)."""
        kv = self.kv
        self.slots = {}
        done = self._captured_root(kv.pending, kv.length, then) if kv.filled else None
        if done is None:
            done = kv.run(Rows.chain(self._draft_ids(kv.pending), kv.length)), None
        out, after = done
        kv.pending = []
        self.committed = kv.length
        self.slots[0] = kv.length - 1
        return out.logits, after

    def expand_level(
        self,
        tokens: torch.Tensor | None,
        parents: torch.Tensor | None,
        depth: int,
        *,
        then: tuple | None = None,
    ):
        """One tree level held on the device, in one forward and with no host read: `tokens` (P,)
        at `depth`, `parents` (P,) their parents' rows in the level before (the root level is one
        row); `None, None, 0` runs the root (the pending chain). Every row is computed, padded
        ones too (their children are never admitted). Returns (P, vocab) log-probabilities. With
        `then` = (key, fn, inputs), the level's decision: returns fn(logits, *inputs), run inside
        the forward's captured step where the run captures its levels (one launch a level:
        drafting/device.py), else a step of its own."""
        logits, after = self._level(tokens, parents, depth, then)
        if then is None:
            return self.to_logp(logits)
        if after is None:  # the forward ran apart: the decision is a step of its own
            key, fn, inputs = then
            after = self.steps(key, fn, logits, *inputs)
        return after

    def expand_rows(self, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        """One forward over tree rows of any depths, after the root's (`expand_level(None, None, 0)`):
        a best-first search's batch (drafting/salf.py, dyspec.py). `tokens` (P,) at `depths` (P,),
        `parents` (P,) their parents' rows counted over the iteration's forwards: the root's row 0,
        then each `expand_rows` forward's rows in order. Each row sees the committed entries, its
        ancestors' slots and its own; the f-th such forward's rows bind as level f (`bind`).
        Returns (P, vocab) log-probabilities."""
        start = self.kv.length
        if not self.level_starts:  # the first batch after the root: the rows' table holds the root's row
            self.row_lines = torch.full((1, 1), self.committed - 1, dtype=torch.long, device=tokens.device)
        self.level_starts.append(start)
        table = self.row_lines
        own = counting(start + tokens.shape[0], tokens.device)[start:]
        lines = torch.cat([table[parents], own[:, None]], dim=1)  # a row's ancestors' slots and its own
        self.row_lines = torch.cat([torch.cat([table, table[:, -1:]], dim=1), lines])  # a slot repeated: one seen
        positions = self.committed + self.position_shift + depths
        return self.to_logp(self._rows_logits(tokens, parents, positions, lines))

    def _level(self, tokens, parents, depth: int, then) -> tuple[torch.Tensor, tuple | None]:
        """expand_level's forward: its logits, and `then`'s outputs where they ran in its step."""
        if tokens is None:
            logits, after = self._root(then)
            self.level_starts = []
            self._committed_on_device = self._upload_committed(logits.device) if self.steps.capture else None
            if self._committed_on_device is None:  # no elements: nothing to fill
                self.ancestors = torch.empty(1, 0, dtype=torch.long, device=logits.device)
            return logits, after
        p, start = tokens.shape[0], self.kv.length
        self.level_starts.append(start)
        if self._committed_on_device is not None:  # where the run captures its steps: one step, inputs and all
            done = self._captured_level(tokens, parents, depth, start, then)
            if done is not None:
                return done
        own = counting(start + p, tokens.device)[start:]
        self.ancestors = torch.cat([self.ancestors[parents], own[:, None]], dim=1)  # the root is committed
        return self._level_logits(tokens, parents, depth), None

    def _captured_root(self, tokens: list[int], first: int, then, *extra: torch.Tensor):
        """The root's forward (the pending chain at positions from `first`) as ONE captured step
        with its inputs (KVState.uploaded), after the prefill, where the run captures its steps:
        (its Forward, what `then` returned). `extra`: what `_root_embeds` reads. None elsewhere."""
        embeds = self._root_embeds if self.wants_features else None
        key = ("level", type(self).__name__, "root")  # names the ids map and the embeds hook it captures
        return self.kv.uploaded(key, tokens, first, 1, ids=self._draft_ids, embeds=embeds, extra=extra, then=then)

    def _root_embeds(self, chain: torch.Tensor, width: int, *extra) -> torch.Tensor | None:
        """A captured root's input vectors (width, hidden), or None: the tokens' embeddings."""
        return None

    def _upload_committed(self, device: torch.device) -> torch.Tensor:
        """Where the run captures its steps: the committed length, uploaded once an iteration into
        a buffer the level steps read in place (and the root's empty ancestor list, made once)."""
        steps = self.steps
        self.ancestors = steps.constant(("no ancestors",), lambda: torch.zeros(1, 0, dtype=torch.long, device=device))
        committed = steps.buffer(("committed",), lambda: torch.zeros(1, dtype=torch.long, device=device))
        upload_into(committed, torch.tensor([self.committed]))
        return committed

    def _captured_level(self, tokens, parents, depth: int, start: int, then):
        """expand_level's forward and everything it reads made on the device in ONE captured step
        (KVState.level), from the committed length the root's forward uploaded: the rows' slots,
        ancestors, mask, positions and inputs. Slots sit at a fixed offset from the committed
        length (a level's width is fixed), so the graph of a level replays every iteration.
        Returns (its logits, what `then` returned); None where the forward does not fill (FilledForwards.fills)."""
        p, offset = tokens.shape[0], start - self.committed
        position = depth + self.position_shift

        def make_fill(width: int, span: int):
            def fill(tokens, parents, ancestors, committed, *extra):
                start = committed + offset
                own = start + counting(p, tokens.device)
                ancestors = torch.cat([ancestors[parents], own[:, None]], dim=1)  # the root is committed
                positions = (committed + position).expand(p)
                embeds = self._level_embeds(tokens, parents, width, *extra)
                rows = Rows.batch(start, (), 0, self._draft_ids(tokens), positions, ancestors, below=committed,
                                  width=width, span=span, embeds=embeds)  # fmt: skip
                return rows, ancestors

            return fill

        inputs = (tokens, parents, self.ancestors, self._committed_on_device, *self._level_inputs(depth))
        key = ("level", type(self).__name__, depth, offset)
        # a row sees the committed entries, its ancestors and itself
        embeds = self.wants_features
        done = self.kv.level(key, make_fill, inputs, p, embeds=embeds, most_keys=self.committed + depth, then=then)
        if done is None:
            return None
        out, (self.ancestors, *after) = done
        self._level_done(out)
        return out.logits, tuple(after)

    position_shift = -1  # a level at depth d sits at position committed + shift + d (feature drafts: 0)

    def _level_inputs(self, depth: int) -> tuple[torch.Tensor, ...]:
        """What a captured level reads besides its tokens, parents, ancestors and the committed length."""
        return ()

    def _level_embeds(self, tokens, parents, width: int, *extra) -> torch.Tensor | None:
        """A captured level's input vectors (width, hidden), or None: the tokens' embeddings."""
        return None

    def _level_done(self, out) -> None:
        """What a captured level keeps of its forward besides the logits."""

    def _level_logits(self, tokens, parents, depth: int) -> torch.Tensor:
        """A level's forward run apart (not captured): its rows see the committed entries and their `ancestors`."""
        positions = torch.full_like(tokens, self.committed + self.position_shift + depth)
        return self.kv.run(self._level_rows(self._draft_ids(tokens), positions, self.ancestors)).logits

    def _level_rows(self, ids, positions, lines: torch.Tensor, **fields) -> Rows:
        """Draft rows right after the cache's entries, each seeing the committed entries and the slots
        its `lines` names (its ancestors' and its own), every row's logits kept."""
        return Rows.batch(self.kv.length, (), 0, ids, positions, lines, below=self.committed, keep=len(ids), **fields)

    def bind(self, node: int, level: int, row: int) -> None:
        """`node` of the tree read back is row `row` of level `level` (1: the root's children)
        drafted by `expand_level`: its cache slot, for `commit`."""
        self.slots[node] = self.level_starts[level - 1] + row

    def _rows_logits(self, tokens, parents, positions, lines: torch.Tensor) -> torch.Tensor:
        """expand_rows' forward: its rows see the committed entries and the slots their `lines` name."""
        return self.kv.run(self._level_rows(self._draft_ids(tokens), positions, lines)).logits

    def level_top(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The `k` most probable children of each row (at most as many as it can propose): their
        float32 log-probabilities (as `to_logp` gives them) and target ids, most probable first. One
        log_softmax and one top-k over the draft's own vocabulary (a token map's ids are looked up
        for the k alone): what a greedy level reads of its distributions (drafting/device.py)."""
        if self.token_map is not None:
            return self.token_map.top_target(logits, k)
        logp = torch.log_softmax(logits[:, : self.vocab_size], dim=-1)
        lp, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
        return lp.float(), ids

    def to_logp(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits -> (q, target vocab) log-probabilities (through the token map if any)."""
        if self.token_map is not None:
            return self.token_map.to_target_logp(logits)
        return torch.log_softmax(logits[:, : self.vocab_size], dim=-1)

    def _draft_ids(self, target_ids: list[int] | torch.Tensor) -> list[int] | torch.Tensor:
        """Target ids -> the draft's (a device tensor stays on the device)."""
        if self.token_map is None:
            return target_ids
        if isinstance(target_ids, torch.Tensor):
            return self.token_map.to_draft(target_ids)
        return self.token_map.to_draft(torch.tensor(target_ids)).tolist()

    def replace_root(self, token: int) -> None:
        """The next root becomes `token` (engine.replace_root): the last token waiting for the draft's KV."""
        self.kv.pending[-1] = int(token)

    def commit(self, tree: DraftTree, accepted: list[int], new_tokens: list[int]) -> None:
        """Keep the accepted nodes' KV (compaction); tokens without draft KV become pending."""
        if 0 not in self.slots:  # the draft did not run this iteration
            self.kv.pending.extend(new_tokens)
            return
        cached = []
        for node in accepted:
            if node not in self.slots:
                break
            cached.append(self.slots[node])
        self.kv.keep(list(range(self.committed)) + cached)
        self.kv.pending = list(new_tokens[len(cached) :])
        self.slots = {}
