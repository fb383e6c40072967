"""`make draft`'s `gen-data` stage: the target samples continuations of varied prompts (on-policy data).

Data is written in resumable chunks: `chunk_00042.npz` holds the token ids (uint16) of one
batch of sequences, flattened, with `offsets` and `prompt_lens`. A chunk that exists is
skipped, so an interrupted job picks up where it stopped. Every chunk is seeded by its index,
so the data set is reproducible. Soft labels are not stored: a teacher-forced target forward
recomputes them on the fly, far cheaper than generating the tokens.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from dynatree_core.decoding.pairs import encode_prompt
from dynatree_core.training.ledger import record
from dynatree_core.training.prompts import sample_prompts


@torch.inference_mode()
def generate_chunk(
    model, tokenizer, index: int, *, batch: int, new_tokens: int, temperature: float, top_p: float
) -> dict[str, np.ndarray]:
    """Sample `batch` continuations of seeded prompts; return flat uint16 ids + offsets."""
    torch.manual_seed(1_000_003 * index + 7)
    prompts = [encode_prompt(tokenizer, text, chat=chat) for text, chat in sample_prompts(batch, seed=index)]
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((batch, width), pad, dtype=torch.long)
    attn = torch.zeros((batch, width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding for batched generation
        ids[i, width - len(p) :] = torch.tensor(p)
        attn[i, width - len(p) :] = 1
    device = model.get_input_embeddings().weight.device
    out = model.generate(
        input_ids=ids.to(device),
        attention_mask=attn.to(device),
        do_sample=True,
        temperature=temperature,
        top_p=top_p,
        max_new_tokens=new_tokens,
        pad_token_id=pad,
    )
    eos = set(
        model.generation_config.eos_token_id
        if isinstance(model.generation_config.eos_token_id, list)
        else [model.generation_config.eos_token_id]
    )
    out = out.cpu()
    seqs, prompt_lens = [], []
    for i, p in enumerate(prompts):
        gen = out[i, width:].tolist()
        for j, tok in enumerate(gen):  # keep the first eos, drop what follows
            if tok in eos:
                gen = gen[: j + 1]
                break
        seqs.append(np.asarray(p + gen, dtype=np.uint16))
        prompt_lens.append(len(p))
    offsets = np.cumsum([0] + [len(s) for s in seqs]).astype(np.int64)
    return {"ids": np.concatenate(seqs), "offsets": offsets, "prompt_lens": np.asarray(prompt_lens, dtype=np.int32)}


def run(
    out_dir: Path,
    *,
    chunks: int,
    batch: int,
    new_tokens: int,
    temperature: float,
    top_p: float,
    dtype: str,
    threads: int | None,
    device: str = "auto",
) -> None:
    """Generate the missing chunks; `batch` sequences per HF generate call, on CUDA when one is
    present (`device` "auto"; the chunk's seed fixes its prompts and samples on either device)."""
    from dynatree_core.core.models import load_model

    if threads:
        torch.set_num_threads(threads)
    out_dir.mkdir(parents=True, exist_ok=True)
    todo = [i for i in range(chunks) if not (out_dir / f"chunk_{i:05d}.npz").exists()]
    print(f"data: {chunks - len(todo)}/{chunks} chunks present in {out_dir}", flush=True)
    if not todo:
        return
    target = load_model("embedded", device=device, dtype=dtype)
    for i in todo:
        t0 = time.perf_counter()
        chunk = generate_chunk(
            target.model, target.tokenizer, i, batch=batch, new_tokens=new_tokens, temperature=temperature, top_p=top_p
        )
        tmp = out_dir / f"chunk_{i:05d}.tmp.npz"
        np.savez(tmp, **chunk)
        tmp.rename(out_dir / f"chunk_{i:05d}.npz")
        n = int(chunk["offsets"][-1] - chunk["prompt_lens"].sum())
        dt = time.perf_counter() - t0
        record("gen-data", dt, tokens=n, item=f"chunk {i}")
        print(f"data: chunk {i} {n} generated tokens in {dt:.0f}s ({n / dt:.0f} tok/s)", flush=True)
