"""`answers`' decoder (`make draft-feature`): batched decoding that keeps the target's features.

A feature draft (drafts/feature.py) learns from the target's own answers and the target's
final hidden states along them. Generating the answers with HF `generate` and then labelling
them in a second teacher-forced pass computes every hidden state twice; here the target decodes
a batch of prompts through its lean blocks (core/fastpath.py) over preallocated KV buffers, and the
post-norm hidden state of every row it reads is the feature, kept as it goes:

    prefill: rows (B, P), left-padded   -> features of the prompt positions, first next-token logits
    step t:  one token per row (B, 1)   -> the feature of that token, its next-token logits

so a sequence of N tokens (prompt + answer) comes with the features of its first N - 1 positions
(the last token is sampled, never read). `teacher_forced` runs the same forward over stored ids
(prefill only): on a machine where the features are missing it recomputes them from the ids,
and the tests check both against the stock HF forward.

Attention: every row attends over its own slots; left padding is masked per row. Query heads are
folded into the query length per key/value head (q viewed as (B, kv_heads, groups * q, d)), so
SDPA sees equal head counts and needs no grouped-query expansion of the cache. Rows that finish
(EOS or their token limit) leave the batch once a quarter of it has finished: the buffers are
compacted on the batch axis, so compute follows the live rows.

Contract: knows models, never trees, policies or prompt sources.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.nn.functional as F

from dynatree_core.core.fastpath import LeanForward, fold_groups, fold_mask, lean_forward_for, rope_pair
from dynatree_core.decoding.engine import vocab_size
from dynatree_core.errors import DynaTreeError

TOP_K = 64  # sampled rows draw from the top-k (then top-p) of the tempered distribution
TEACHER_K = 32  # the teacher's top-k kept per loss position (the rest of its mass is renormalised away)


def compact_teacher(logits: torch.Tensor, k: int = TEACHER_K) -> dict[str, torch.Tensor]:
    """The target's next-token distribution at n positions, kept small: its top-k token ids
    ("ids", (n, k) int64) and logits ("logits", (n, k) float32) and the log-sum-exp over its whole
    vocabulary ("lse", (n,) float32), so p(top-k) = exp(logits - lse) and the mass they cover is known.
    A training step then needs no target LM head at all (SpecForge's compact teacher keeps the
    draft vocabulary's slice; the top-k is smaller still, and any token map can be applied later)."""
    top = logits.topk(min(k, logits.shape[-1]), dim=-1)
    return {"ids": top.indices, "logits": top.values.float(), "lse": torch.logsumexp(logits.float(), dim=-1)}


@dataclasses.dataclass
class Decoded:
    """One finished row: ids = prompt + answer (EOS included when it came), features (len(ids) - 1, H)
    and, when asked for, the compact teacher at every answer position (`compact_teacher`'s keys,
    host arrays of len(ids) - prompt_len rows: the logits each answer token was drawn from)."""

    ids: np.ndarray
    prompt_len: int
    features: np.ndarray
    teacher: dict[str, np.ndarray] | None = None


def lean_or_fail(model: torch.nn.Module) -> LeanForward:
    lean = lean_forward_for(model, fast=True)
    if lean is None:
        raise DynaTreeError(
            f"batched draft data needs a Llama-family target (llama, qwen2, mistral); this one is "
            f"{model.config.model_type!r}"
        )
    return lean


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, block) -> torch.Tensor:
    """Attention for q (B, heads, T, d) over keys/values (B, kv_heads, L, d) with the additive mask
    (B, 1, T, L), query heads folded per key/value head (fastpath.fold_groups)."""
    b, heads, t, d = q.shape
    q, mask = fold_groups(q, block.groups), fold_mask(mask, block.groups)
    if t == 1:  # a decoding step: two batched matmuls beat SDPA's kernel on CPU (memory-bound on the cache)
        scores = torch.matmul(q, keys.transpose(-1, -2)).float() * block.scaling + mask.float()
        out = torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)
    else:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=block.scaling)
    return out.reshape(b, heads, t, d)


def _forward(
    lean: LeanForward,
    ids: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor,
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    slots: torch.Tensor | None = None,
    *,
    taps: tuple[int, ...] = (),
    tapped: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Rows ids (B, T) at `positions` (B, T), reading the first L cache slots through `mask`
    (B, 1, T, L). Keys/values go to slots 0 .. T (slots None: a prefill) or, for one token per
    row (T = 1), to each row's slot in `slots` (B,). Returns the post-norm states (B, T, H);
    the inputs of the layers in `taps` (core/taps.py) are appended to `tapped`, in layer order."""
    x = F.embedding(ids, lean.embed.weight)
    cos, sin = rope_pair(*lean.rotary(x, positions))
    b, width, length = ids.shape[0], ids.shape[1], mask.shape[-1]
    rows = torch.arange(b, device=ids.device)
    for i, (block, (kbuf, vbuf)) in enumerate(zip(lean.blocks, caches, strict=True)):
        if i in taps:
            tapped.append(x)
        q, k, v = block.project(block.norm1(x), cos, sin)
        if slots is None:
            kbuf[:, :, :width] = k
            vbuf[:, :, :width] = v
        else:
            kbuf[rows, :, slots] = k[:, :, 0]
            vbuf[rows, :, slots] = v[:, :, 0]
        attn = _attend(q, kbuf[:, :, :length], vbuf[:, :, :length], mask, block)
        x = block.mlp(x + block.o(attn.transpose(1, 2).reshape(b, width, -1)))
    return lean.norm(x)


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, torch.finfo(dtype).min)


def sample_rows(
    logits: torch.Tensor, temperature: torch.Tensor, generator: torch.Generator, *, top_p: float = 0.95
) -> torch.Tensor:
    """Next tokens for logits (B, V): argmax where temperature is 0, else a draw from the tempered
    top-k (TOP_K) distribution cut to top-p."""
    pick = logits.argmax(-1)
    hot = temperature > 0
    if not bool(hot.any()):
        return pick
    top = logits[hot].topk(min(TOP_K, logits.shape[-1]), dim=-1)
    probs = torch.softmax(top.values / temperature[hot, None], dim=-1)
    before = probs.cumsum(-1) - probs  # mass of the better tokens
    probs = probs.masked_fill(before >= top_p, 0.0)
    draw = torch.multinomial(probs / probs.sum(-1, keepdim=True), 1, generator=generator)
    pick[hot] = top.indices.gather(1, draw)[:, 0]
    return pick


class BatchDecoder:
    """Batched decoding (module docstring) of one Llama-family target; holds no per-run state."""

    def __init__(self, model: torch.nn.Module, *, prefill_rows: int = 8):
        self.model = model
        self.lean = lean_or_fail(model)
        config = model.config.get_text_config(decoder=True)
        self.hidden = config.hidden_size
        block = self.lean.blocks[0]
        self.kv_heads = block.qk_heads - block.heads
        self.head_dim = block.head_dim
        self.prefill_rows = prefill_rows  # prefill this many rows per forward (bounds activation memory)

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    def _buffers(self, rows: int, capacity: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (rows, self.kv_heads, capacity, self.head_dim)
        dtype = self.model.dtype
        return [
            (torch.zeros(shape, dtype=dtype, device=self.device), torch.zeros(shape, dtype=dtype, device=self.device))
            for _ in self.lean.blocks
        ]

    def _prefill(
        self, prompts: list[list[int]], taps: tuple[int, ...] = ()
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None]:
        """Right-padded prompts through the target: states (r, W, H), their caches (r, ., W, .)
        and, with `taps`, the tapped layer inputs (r, W, len(taps), H) (else None). A row reads
        its own prompt causally; the padding after it is never read by real rows."""
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long, device=self.device)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, device=self.device)
        slots = torch.arange(width, device=self.device)
        positions = slots[None].expand(len(prompts), -1)
        mask = _additive((slots[None, :] <= slots[:, None])[None, None], self.model.dtype)  # (1, 1, W, W)
        caches = self._buffers(len(prompts), width)
        states, tapped = [], []
        for r0 in range(0, len(prompts), self.prefill_rows):
            r1 = min(r0 + self.prefill_rows, len(prompts))
            part = [(k[r0:r1], v[r0:r1]) for k, v in caches]
            rows: list[torch.Tensor] = []
            block = mask.expand(r1 - r0, -1, -1, -1)
            states.append(_forward(self.lean, ids[r0:r1], positions[r0:r1], block, part, taps=taps, tapped=rows))
            if taps:
                tapped.append(torch.stack(rows, dim=2))
        return torch.cat(states), caches, (torch.cat(tapped) if taps else None)

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
        n = len(prompts)
        size = min(batch, n)
        queue = list(range(n))[::-1]  # pop() takes them in order
        caches = self._buffers(size, max(len(p) for p in prompts) + max(max_new))
        generator = torch.Generator(device=self.device).manual_seed(seed)
        eos_ids = torch.tensor(sorted(eos) or [-1], device=self.device)
        job = torch.full((size,), -1, device=self.device)  # batch row -> prompt index (-1: free)
        lens = torch.zeros(size, dtype=torch.long, device=self.device)  # valid cache slots per row
        temps = torch.zeros(size, device=self.device)
        limit = torch.zeros(size, dtype=torch.long, device=self.device)
        made = torch.zeros(size, dtype=torch.long, device=self.device)
        logits = torch.zeros(size, vocab_size(self.model), device=self.device)
        answers: list[list[int]] = [[] for _ in range(n)]
        feats: list[list[np.ndarray]] = [[] for _ in range(n)]
        kept: list[list] | None = [[] for _ in range(n)] if teacher else None

        def admit(free: list[int]) -> None:
            take = [queue.pop() for _ in free[: len(queue)]]
            if not take:
                return
            rows = torch.tensor(free[: len(take)], device=self.device)
            states, small, _ = self._prefill([prompts[j] for j in take])
            width = states.shape[1]
            for (k, v), (sk, sv) in zip(caches, small, strict=True):
                k[rows, :, :width] = sk
                v[rows, :, :width] = sv
            ends = torch.tensor([len(prompts[j]) for j in take], device=self.device)
            logits[rows] = self.lean.head(states[torch.arange(len(take)), ends - 1]).float()
            _keep(kept, take, logits[rows])
            for i, j in enumerate(take):
                feats[j].append(host_f16(states[i, : len(prompts[j])]))
            job[rows] = torch.tensor(take, device=self.device)
            lens[rows] = ends
            temps[rows] = torch.tensor([float(temperature[j]) for j in take], device=self.device)
            limit[rows] = torch.tensor([int(max_new[j]) for j in take], device=self.device)
            made[rows] = 0

        admit(list(range(size)))
        while True:
            alive = job >= 0
            token = sample_rows(logits, temps, generator, top_p=top_p)
            for i, tok in zip(job.tolist(), token.tolist(), strict=True):
                if i >= 0:
                    answers[i].append(tok)
            made += alive.long()
            if progress is not None:
                progress(int(alive.sum()))
            finished = alive & (torch.isin(token, eos_ids) | (made >= limit))
            job = job.masked_fill(finished, -1)
            alive = job >= 0
            free = torch.nonzero(~alive)[:, 0].tolist()
            if not queue and len(free) * 4 >= len(job) and bool(alive.any()):  # the tail: drop free rows
                keep = torch.nonzero(alive)[:, 0]
                caches = [(k.index_select(0, keep), v.index_select(0, keep)) for k, v in caches]
                job, lens, temps, limit, made, token, logits = _rows(keep, job, lens, temps, limit, made, token, logits)
                alive, free = job >= 0, []
            if bool(alive.any()):
                logits = self._extend(token, lens, caches, job, feats)
                _keep(kept, job.tolist(), logits)
                lens = lens + alive.long()
            elif not queue:
                break
            if queue and free and len(free) * 8 >= len(job):  # refill once an eighth of the rows is free
                admit(free)
        return [_decoded(p, answers[j], feats[j], kept and kept[j]) for j, p in enumerate(prompts)]

    def _extend(self, token, lens, caches, job, feats) -> torch.Tensor:
        """One decoding step of every row: each row reads its token at slot `lens` (b,), its
        feature is kept for its job; returns the next logits (b, vocab)."""
        slots = torch.arange(int(lens.max()) + 1, device=self.device)
        visible = (slots[None, :] <= lens[:, None])[:, None, None]  # (b, 1, 1, length)
        mask = _additive(visible, self.model.dtype)
        out = _forward(self.lean, token[:, None], lens[:, None], mask, caches, lens)[:, 0]
        host = host_f16(out)
        for r, i in enumerate(job.tolist()):
            if i >= 0:  # the feature of the token just read
                feats[i].append(host[r : r + 1])
        return self.lean.head(out).float()


def _rows(keep: torch.Tensor, *rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(a[keep] for a in rows)


def _keep(kept: list[list] | None, jobs: list[int], logits: torch.Tensor) -> None:
    """With a teacher kept: each row's compact teacher of `logits` (rows, vocab), appended to its
    job's list as (the step's host arrays, the row) (job -1: a free row, nothing kept)."""
    if kept is None:
        return
    host = {k: v.cpu().numpy() for k, v in compact_teacher(logits).items()}
    for r, i in enumerate(jobs):
        if i >= 0:
            kept[i].append((host, r))


def _decoded(prompt: list[int], answer: list[int], feats: list[np.ndarray], kept: list | None) -> Decoded:
    ids = np.asarray(prompt + answer, dtype=np.int64)
    teacher = {k: np.stack([h[k][r] for h, r in kept]) for k in ("ids", "logits", "lse")} if kept else None
    return Decoded(ids=ids, prompt_len=len(prompt), features=np.concatenate(feats)[: len(ids) - 1], teacher=teacher)


def host_f16(states: torch.Tensor) -> np.ndarray:
    return states.float().cpu().numpy().astype(np.float16)
