"""Draft-data throughput: the old two-pass path against one-pass batched decoding, run from the
repo root (nothing else torch-heavy running):

    PYTHONPATH=. .venv/bin/python -m benchmarks.draft_data_speed [--prompts 96] [--new-tokens 128]

One process, the embedded target in bfloat16 (packed as the recipe runs it), the same prompts for
every path: the first N jobs of the committed answer pool (assets/draft-data/answers), each
answered greedily or sampled as the job says (HF: temperature 0.8, top-p 0.95; one-pass: the
job's temperature, top-p 0.95), `--new-tokens` at most.

    hf-generate     training/token/sample.py's path: HF `generate`, 48 sequences per call (ids only)
    teacher-forced  the second pass that path needed for features (BatchDecoder.teacher_forced
                    over the HF outputs, 16 sequences per forward; as fast as feature-label or faster)
    one-pass        training/answers/decode_batch.py: continuous batching, features kept while decoding

Prints answer tokens per second for each, and the two-pass rate (ids + features) it replaces.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from benchmarks import ROOT
from dynatree_core.core.models import load_model
from dynatree_core.core.packing import pack_linears
from dynatree_core.training.answers.decode_batch import BatchDecoder
from dynatree_core.training.answers.sources import load_jobs
from dynatree_core.training.answers.store import encode_job


@torch.inference_mode()
def hf_generate(model, tokenizer, prompts, jobs, new_tokens: int, batch: int = 48) -> list[list[int]]:
    """Left-padded HF generate calls as training/token/sample.py makes them (sampled rows and greedy rows
    in separate calls: generate takes one temperature)."""
    out = []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    groups = [[i for i, j in enumerate(jobs) if (j.temperature > 0) == hot] for hot in (False, True)]
    for group in groups:
        for start in range(0, len(group), batch):
            part = group[start : start + batch]
            width = max(len(prompts[i]) for i in part)
            ids = torch.full((len(part), width), pad, dtype=torch.long)
            attn = torch.zeros((len(part), width), dtype=torch.long)
            for r, i in enumerate(part):
                ids[r, width - len(prompts[i]) :] = torch.tensor(prompts[i])
                attn[r, width - len(prompts[i]) :] = 1
            hot = jobs[part[0]].temperature > 0
            kwargs = dict(do_sample=True, temperature=0.8, top_p=0.95) if hot else dict(do_sample=False)
            gen = model.generate(
                input_ids=ids, attention_mask=attn, max_new_tokens=new_tokens, pad_token_id=pad, **kwargs
            )
            for r, i in enumerate(part):
                out.append(prompts[i] + [t for t in gen[r, width:].tolist() if t != pad])
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=96)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    target = load_model("embedded", dtype="bfloat16")
    pack_linears(target.model)
    jobs = load_jobs(ROOT / "assets" / "draft-data" / "answers" / "main.jobs.gz")[: args.prompts]
    prompts = [encode_job(target.tokenizer, j) for j in jobs]
    decoder = BatchDecoder(target.model)
    result = {"prompts": len(jobs), "prompt_tokens": sum(map(len, prompts)), "new_tokens": args.new_tokens}

    t0 = time.perf_counter()
    seqs = hf_generate(target.model, target.tokenizer, prompts, jobs, args.new_tokens)
    dt = time.perf_counter() - t0
    made = sum(len(s) for s in seqs) - result["prompt_tokens"]
    result["hf-generate"] = {"answer_tokens": made, "seconds": round(dt, 1), "tokens_per_s": round(made / dt, 1)}

    t0 = time.perf_counter()
    order = np.argsort([len(s) for s in seqs])
    for start in range(0, len(seqs), 16):
        decoder.teacher_forced([seqs[i] for i in order[start : start + 16]])
    dt_tf = time.perf_counter() - t0
    result["teacher-forced"] = {"seconds": round(dt_tf, 1), "tokens_per_s": round(sum(map(len, seqs)) / dt_tf, 1)}
    result["two-pass (ids + features)"] = {"tokens_per_s": round(made / (dt + dt_tf), 1)}

    t0 = time.perf_counter()
    rows = decoder.generate(
        prompts,
        max_new=[args.new_tokens] * len(jobs),
        temperature=[j.temperature for j in jobs],
        eos=target.eos_token_ids,
        seed=0,
        batch=64,
    )
    dt = time.perf_counter() - t0
    made = sum(len(r.ids) - r.prompt_len for r in rows)
    result["one-pass"] = {"answer_tokens": made, "seconds": round(dt, 1), "tokens_per_s": round(made / dt, 1)}
    result["one-pass / hf-generate"] = round(
        result["one-pass"]["tokens_per_s"] / result["hf-generate"]["tokens_per_s"], 2
    )
    result["one-pass / two-pass"] = round(
        result["one-pass"]["tokens_per_s"] / result["two-pass (ids + features)"]["tokens_per_s"], 2
    )
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
