"""`answers`' decoder (`make draft-feature`): batched decoding that keeps the target's features.

A feature draft (drafts/feature.py) learns from the target's own answers and the target's
final hidden states along them. Generating the answers with HF `generate` and then labelling
them in a second teacher-forced pass computes every hidden state twice; here the target decodes
a batch of prompts, each with its own preallocated cache, through the lean forward every run takes
(forward/batched.SequenceCaches.run(rows)), and the post-norm hidden state of every row it reads is
the feature, kept as it goes (the sampling and the compact teacher: decode_ops.py):

    prefill: rows (B, P), right-padded  -> features of the prompt positions, first next-token logits
    step t:  one token per row (B, 1)   -> the feature of that token, its next-token logits

so a sequence of N tokens (prompt + answer) comes with the features of its first N - 1 positions
(the last token is sampled, never read). `teacher_forced` runs the same forward over stored ids
(prefill only): on a machine where the features are missing it recomputes them from the ids,
and the tests check both against the stock HF forward.

Continuous batching: a finished row (EOS or its token limit) takes the next prompt once an eighth
of the batch is free; when no prompt waits and a quarter has finished, the buffers are compacted on
the batch axis, so compute follows the live rows. The host keeps its own copy of every row's state
(job, length, tokens made, limit), so a step reads one thing back from the device, its sampled
tokens; features and teachers stay in per-row device buffers until a refill harvests them in one
copy. On CUDA the step (forward, feature, logits, teacher) is one captured graph per attention span
while the batch is whole (forward/capture.py's StepGraphs); the tail runs it eagerly.

Contract: knows models, never trees, policies or prompt sources.
"""

from __future__ import annotations

import numpy as np
import torch

from dynatree_core.core.taps import FINAL
from dynatree_core.decoding.engine import vocab_size
from dynatree_core.forward import capture
from dynatree_core.forward.batched import SequenceCaches, lean_or_fail
from dynatree_core.forward.graphs import capture_safe, graphs_enabled
from dynatree_core.forward.rows import Rows
from dynatree_core.training.answers.decode_ops import TEACHER_K, Decoded, compact_teacher, host_f16, sample_rows

SPAN = 128  # a captured step attends over the cache's first multiple of SPAN slots that holds the longest row
PREFILL_ROWS_CUDA = 64  # prompts prefilled per forward on CUDA (8 elsewhere)
SPANS_KEPT = 2  # captured steps kept (the spans used last); an older span's graph is released


class BatchDecoder:
    """Batched decoding (module docstring) of one Llama-family target; of its runs it keeps only how the
    last one ran its step (`captured`)."""

    def __init__(self, model: torch.nn.Module, *, prefill_rows: int | None = None, graphs: bool | None = None):
        self.model = model
        self.graphs = graphs  # capture the decoding step (None: on CUDA unless DYNATREE_GRAPHS=0)
        self.captured = ""  # how the last `generate` ran its step: "eager", "N graphs", or why capture failed
        self.lean = lean_or_fail(model)
        self.hidden = model.config.get_text_config(decoder=True).hidden_size
        # prefill this many rows per forward (bounds activation memory); on CUDA a forward is launch-bound
        # at 8 rows, and a refill of a 1,024-row batch admits 128 prompts
        self.prefill_rows = prefill_rows or (PREFILL_ROWS_CUDA if self.device.type == "cuda" else 8)

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    def _caches(self, rows: int, capacity: int) -> SequenceCaches:
        return SequenceCaches.empty(self.model, self.lean, rows, capacity)

    def _prefill(
        self, prompts: list[list[int]], taps: tuple[int, ...] = ()
    ) -> tuple[torch.Tensor, SequenceCaches, torch.Tensor | None]:
        """Right-padded prompts through the target: states (r, W, H), their caches (r, ., W, .)
        and, with `taps`, the tapped layer inputs (r, W, len(taps), H) (else None). A row reads
        its own prompt causally; the padding after it is never read by real rows."""
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long, device=self.device)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, device=self.device)
        caches = self._caches(len(prompts), width)
        states = []
        for r0 in range(0, len(prompts), self.prefill_rows):
            r1 = min(r0 + self.prefill_rows, len(prompts))
            rows = Rows.chain(ids[r0:r1], 0, keep=0, hidden=(*taps, FINAL) if taps else True)  # causal, from slot 0
            states.append(caches.part(r0, r1).run(rows).states)
        states = torch.cat(states)
        if not taps:
            return states, caches, None
        return states[..., -1, :], caches, states[..., :-1, :]  # the final states; the tapped layers' inputs

    @torch.inference_mode()
    def teacher_forced(
        self, sequences: list[list[int]], *, taps: tuple[int, ...] = ()
    ) -> list[dict[str, torch.Tensor]]:
        """Per sequence, from one prefill over all but its last position (what a decoded row yields):
        "features" (len(s) - 1, H) post-norm states and, with `taps`, "taps" (len(s) - 1,
        len(taps), H), the inputs of those layers. Tensors in the target's dtype, on its device."""
        states, _, tapped = self._prefill([s[:-1] if len(s) > 1 else s for s in sequences], taps)
        out = []
        for i, s in enumerate(sequences):
            n = max(len(s) - 1, 0)
            row = {"features": states[i, :n]}
            if taps:
                row["taps"] = tapped[i, :n]
            out.append(row)
        return out

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        *,
        max_new: list[int],
        temperature: list[float],
        eos: frozenset[int],
        seed: int,
        batch: int = 64,
        top_p: float = 0.95,
        progress=None,
        teacher: bool = False,
    ) -> list[Decoded]:
        """Decode every prompt to EOS or its `max_new` tokens, `batch` rows at a time with continuous
        batching: a finished row takes the next prompt (prefilled with the others that start then), so
        the batch stays full until the prompts run out. Results keep the prompts' order. `progress(tokens)`
        is called with each step's new tokens; `teacher`: keep the compact teacher of every logits row."""
        run = _Decoding(self, prompts, max_new, temperature, eos, seed, min(batch, len(prompts)), teacher)
        run.admit(list(range(run.size)))
        while True:
            live = run.sample(top_p)
            if progress is not None:
                progress(len(live))
            free = np.flatnonzero(run.job < 0)
            if not run.queue and len(free) * 4 >= run.size and len(free) < run.size:  # the tail: drop free rows
                run.compact(np.flatnonzero(run.job >= 0))
                free = free[:0]
            if (run.job >= 0).any():
                run.extend()
            elif not run.queue:
                break
            if run.queue and len(free) and len(free) * 8 >= run.size:  # refill once an eighth of the rows is free
                run.admit(free.tolist())
        run.harvest()
        g = run.graphs
        self.captured = f"eager ({g.fallback})" if g.fallback else f"{g.captures} graphs" if g.captures else "eager"
        return run.results

    def _extend(self, token, lens, caches, length: int) -> torch.Tensor:
        """One decoding step of every row: each row reads its token at slot `lens` (b,) over the
        first `length` slots (the host knows the longest live row); returns the post-norm states (b, H)."""
        at = lens[:, None]  # each row's slot and position: it sees its sequence's slots up to its own
        rows = Rows.batch(at, token[:, None], at, width=1, span=length, keep=0, hidden=True)
        return caches.run(rows).states[:, 0]


class _Decoding:
    """One `generate` call's batch. Per row: its job, cache length, tokens made, token limit and
    temperature, on the device and mirrored on the host, so the host decides admission, compaction,
    finishing and the attention length without reading the device; a step reads one thing back,
    its sampled tokens (b,). The rows' features and teachers stay on the device in per-row buffers
    (answer position m at column m) and come to the host in one copy per refill, not per step."""

    def __init__(self, dec: BatchDecoder, prompts, max_new, temperature, eos, seed: int, size: int, teacher: bool):
        self.dec, self.prompts, self.max_new, self.temperature = dec, prompts, max_new, temperature
        self.size, dev, cap = size, dec.device, max(max(max_new), 1)  # a row makes one token at least
        self.queue = list(range(len(prompts)))[::-1]  # pop() takes them in order
        self.capacity = max(len(p) for p in prompts) + cap
        self.caches = dec._caches(size, self.capacity)
        # the step captured while the batch is whole (its buffers never move before the tail's first
        # compaction); on CUDA with a capture-safe target, or on a stand-in device (the CPU tests)
        wanted = graphs_enabled(dev, dec.graphs) and (dev.type == "cuda" or dev.type in capture.STAND_IN_DEVICES)
        self.graphs = capture.StepGraphs(dev, capture=wanted and capture_safe(dec.model))
        self.spans: list[int] = []  # the captured spans, the last used last
        self.whole = True  # no compaction yet: the buffers the captured steps read have not moved
        self.generator = torch.Generator(device=dev).manual_seed(seed)
        self.eos = np.asarray(sorted(eos) or [-1])
        self.eos_dev = torch.tensor(self.eos, device=dev)
        self.job = np.full(size, -1)  # batch row -> prompt index (-1: free)
        self.lens = np.zeros(size, dtype=np.int64)  # valid cache slots per row
        self.made = np.zeros(size, dtype=np.int64)
        self.limit = np.zeros(size, dtype=np.int64)
        self.toks = np.zeros((size, cap), dtype=np.int64)
        self.d = {  # the device's copy of the per-row state
            "lens": torch.zeros(size, dtype=torch.long, device=dev),
            "made": torch.zeros(size, dtype=torch.long, device=dev),
            "limit": torch.zeros(size, dtype=torch.long, device=dev),
            "temps": torch.zeros(size, device=dev),
            "alive": torch.zeros(size, dtype=torch.bool, device=dev),
            "logits": torch.zeros(size, vocab_size(dec.model), device=dev),
            "feats": torch.zeros(size, cap, dec.hidden, dtype=torch.float16, device=dev),
        }
        if teacher:  # column m: the logits answer token m was drawn from (cap + 1: a finished row's spare)
            k = min(TEACHER_K, self.d["logits"].shape[-1])
            self.d["t_ids"] = torch.zeros(size, cap + 1, k, dtype=torch.long, device=dev)
            self.d["t_logits"] = torch.zeros(size, cap + 1, k, device=dev)
            self.d["t_lse"] = torch.zeros(size, cap + 1, device=dev)
        self.rows = torch.arange(size, device=dev)
        self.hot = torch.zeros(0, dtype=torch.long, device=dev)  # the live rows that sample (temperature > 0)
        self.temps = np.zeros(size, dtype=np.float32)  # the host's copy of the rows' temperatures
        self.token: torch.Tensor | None = None
        self.pending: list[tuple[int, int, int]] = []  # finished rows not yet harvested: (row, job, made)
        self.prompt_feats: dict[int, np.ndarray] = {}
        self.results: list[Decoded | None] = [None] * len(prompts)

    def admit(self, free: list[int]) -> None:
        """Harvest the finished rows, then prefill the next prompts into the free rows `free`."""
        self.harvest()
        take = [self.queue.pop() for _ in free[: len(self.queue)]]
        if not take:
            return
        dec, d, dev = self.dec, self.d, self.dec.device
        at = free[: len(take)]
        rows = torch.tensor(at, device=dev)
        states, small, _ = dec._prefill([self.prompts[j] for j in take])
        self.caches.put(rows, small)
        ends = np.array([len(self.prompts[j]) for j in take])
        d["logits"][rows] = dec.lean.head(states[torch.arange(len(take)), torch.tensor(ends - 1, device=dev)]).float()
        self._keep(rows, torch.zeros(len(take), dtype=torch.long, device=dev), d["logits"][rows])
        host = host_f16(states)
        for i, j in enumerate(take):
            self.prompt_feats[j] = host[i, : ends[i]]
        self.job[at], self.lens[at], self.made[at] = take, ends, 0
        self.limit[at] = [int(self.max_new[j]) for j in take]
        temps = np.zeros(self.size, dtype=np.float32)
        temps[self.job >= 0] = [float(self.temperature[j]) for j in self.job[self.job >= 0]]
        for key, value in (("lens", self.lens), ("made", self.made), ("limit", self.limit), ("temps", temps),
                           ("alive", self.job >= 0)):  # fmt: skip
            d[key].copy_(torch.from_numpy(value))
        self._set_hot(temps)

    def _set_hot(self, temps: np.ndarray) -> None:
        """The rows that draw (temperature > 0), from the host's copy of the temperatures (none: an
        empty index, which sample_rows reads as none, where None would make it read the device)."""
        self.temps = temps
        self.hot = torch.from_numpy(np.flatnonzero(temps > 0)).to(self.dec.device)

    def sample(self, top_p: float) -> np.ndarray:
        """Each row's next token (the step's one read of the device); the rows that finish (EOS or
        their limit) are set aside for the next harvest. Returns the rows that made a token."""
        d = self.d
        self.token = sample_rows(d["logits"], d["temps"], self.generator, top_p=top_p, hot=self.hot)
        token = self.token.cpu().numpy()
        live = np.flatnonzero(self.job >= 0)
        self.toks[live, self.made[live]] = token[live]
        self.made[live] += 1
        d["made"] += d["alive"]
        done = live[np.isin(token[live], self.eos) | (self.made[live] >= self.limit[live])]
        d["alive"] &= ~(torch.isin(self.token, self.eos_dev) | (d["made"] >= d["limit"]))
        self.pending += [(int(r), int(self.job[r]), int(self.made[r])) for r in done]
        self.job[done] = -1
        return live

    def extend(self) -> None:
        """One forward of every row: the token just drawn read at its slot, its feature kept at its
        answer column, the next logits (and their teacher) in place. While the batch is whole the
        step is one captured graph per span (the attention's slots rounded up to SPAN); the tail,
        whose batch shrinks, runs it eagerly over the exact length."""
        d, live = self.d, self.job >= 0
        length = int(self.lens[live].max()) + 1
        if self.graphs.capture and self.whole:
            span = min(-(-length // SPAN) * SPAN, self.capacity)
            self._keep_span(span)
            (d["logits"],) = self.graphs(("answer-step", span), self._step(span), self.token, d["lens"], d["made"])
        else:
            (d["logits"],) = self._step(length)(self.token, d["lens"], d["made"])
        self.lens += live
        d["lens"] += d["alive"]

    def _step(self, length: int):
        """The step over the first `length` cache slots, a pure function of its tensor inputs but for
        its writes (the rows' keys/values, feature and teacher at their slot and column: the same
        values however often it runs, so a capture's warm-up runs change nothing)."""
        d, rows = self.d, self.rows

        def step(token: torch.Tensor, lens: torch.Tensor, made: torch.Tensor) -> tuple[torch.Tensor]:
            out = self.dec._extend(token, lens, self.caches, length)
            d["feats"][rows, (made - 1).clamp(min=0)] = out.to(torch.float16)
            logits = self.dec.lean.head(out).float()
            self._keep(rows, made, logits)
            return (logits,)

        return step

    def _keep_span(self, span: int) -> None:
        """`span` becomes the last used; the graphs of spans older than the last SPANS_KEPT go."""
        self.spans = [s for s in self.spans if s != span] + [span]
        if len(self.spans) > SPANS_KEPT:
            old, self.spans = set(self.spans[:-SPANS_KEPT]), self.spans[-SPANS_KEPT:]
            self.graphs.forget(lambda key: key[0] == "answer-step" and key[1] in old)

    def _keep(self, rows: torch.Tensor, cols: torch.Tensor, logits: torch.Tensor) -> None:
        if "t_ids" in self.d:
            for key, value in compact_teacher(logits).items():
                self.d[f"t_{key}"][rows, cols] = value

    def compact(self, keep: np.ndarray) -> None:
        """The batch cut to the rows `keep` (the tail: no prompt waits and a quarter of the rows is free)."""
        self.harvest()
        self.whole = False
        idx = torch.from_numpy(keep).to(self.dec.device)
        self.caches = self.caches.select(idx)
        self.d = {key: value.index_select(0, idx) for key, value in self.d.items()}
        for key in ("job", "lens", "made", "limit", "toks"):
            setattr(self, key, getattr(self, key)[keep])
        self.token = self.token.index_select(0, idx)
        self.size, self.rows = len(keep), torch.arange(len(keep), device=self.dec.device)
        self._set_hot(self.temps[keep])

    def harvest(self) -> None:
        """The finished rows' results, their device buffers read in one copy."""
        if not self.pending:
            return
        rows = torch.tensor([r for r, _, _ in self.pending], device=self.dec.device)
        most = max(m for _, _, m in self.pending)
        feats = self.d["feats"][rows, : max(most - 1, 0)].cpu().numpy()
        kept = {key: self.d[f"t_{key}"][rows, :most].cpu().numpy() for key in ("ids", "logits", "lse")
                if f"t_{key}" in self.d}  # fmt: skip
        for i, (r, j, m) in enumerate(self.pending):
            prompt = self.prompts[j]
            self.results[j] = Decoded(
                ids=np.asarray(prompt + self.toks[r, :m].tolist(), dtype=np.int64),
                prompt_len=len(prompt),
                features=np.concatenate([self.prompt_feats.pop(j), feats[i, : m - 1]]),
                teacher={key: value[i, :m] for key, value in kept.items()} or None,
            )
        self.pending = []
