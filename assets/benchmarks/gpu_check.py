"""GPU checks for issue 8, run on a lent H100 from the repo root: `python3 assets/benchmarks/gpu_check.py`.

1. Exactness on CUDA per dtype: every tree policy's greedy output vs our AR loop on tiny random
   Llama models (float64, float32, bfloat16, float16).
2. Latency profile of SmolLM2-135M's shape and the draft's shape (random weights: the time of a
   forward does not depend on them), bfloat16 and float32, 1-256 tokens, contexts 128 and 512.
3. The cost of the synchronisation KVState adds after every forward to time it: 50 one-token
   forwards with a sync after each vs one sync at the end.

Writes $OUT/gpu.json (saved as assets/benchmarks/gpu-h100-latency.json).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.getcwd())
from dynatree_core.drafting import make_policy  # noqa: E402
from dynatree_core.engine import DecodeConfig, generate  # noqa: E402
from dynatree_core.kv import KVState, chain_then_tree_visibility  # noqa: E402
from dynatree_core.latency import profile  # noqa: E402

DEV = torch.device("cuda")
POLICIES = [("linear", {"k": 4}), ("fixed_tree", {}), ("dynatree", {}), ("dyspec", {}), ("salf", {}),
            ("eagle2", {}), ("delayed", {}), ("dyspec_threshold", {})]  # fmt: skip
PROMPTS = ([1, 5, 7, 9, 11], [3], [42, 17, 8, 8, 8, 8, 60, 2, 90, 33, 12, 4])
SKIP = ("architectures", "transformers_version", "dtype", "torch_dtype")


def tiny(seed: int, noise: float = 0.0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0,
                      eos_token_id=None, pad_token_id=0, attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(6.0)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * noise)
    return model.to(DEV, dtype)


def exactness() -> dict[str, str]:
    out = {}
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        target, draft = tiny(0, dtype=dtype), tiny(0, noise=0.01, dtype=dtype)
        config = DecodeConfig(max_new_tokens=40)
        ok = total = 0
        for name, params in POLICIES:
            for prompt in PROMPTS:
                ar = generate(target, prompt, make_policy("ar"), config=config).token_ids
                got = generate(target, prompt, make_policy(name, params), draft=draft, config=config).token_ids
                ok, total = ok + (got == ar), total + 1
        out[str(dtype)] = f"{ok}/{total}"
        print("exact", dtype, out[str(dtype)], flush=True)
    return out


def config_from(path: str) -> LlamaConfig:
    with open(path) as f:
        cfg = LlamaConfig(**{k: v for k, v in json.load(f).items() if k not in SKIP})
    cfg._attn_implementation = "sdpa"
    return cfg


def sync_cost(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, float]:
    kv = KVState(model, list(range(128)))
    prefill = chain_then_tree_visibility(0, 128, torch.zeros(0, 0, dtype=torch.bool))
    kv.forward(kv.pending, list(range(128)), prefill, 1)
    kv.pending = []
    mask = torch.zeros(1, 1, 1, 129, device=DEV, dtype=dtype)

    def loop(sync_each: bool) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            with torch.inference_mode():
                model(input_ids=torch.tensor([[5]], device=DEV), position_ids=torch.tensor([[128]], device=DEV),
                      attention_mask=mask, past_key_values=kv.cache, use_cache=True, logits_to_keep=1)  # fmt: skip
            if sync_each:
                torch.cuda.synchronize()
            kv.keep(list(range(128)))
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / 50 * 1e3

    loop(True), loop(False)  # warm-up
    each = statistics.median(loop(True) for _ in range(5))
    end = statistics.median(loop(False) for _ in range(5))
    print(f"sync after each forward {each:.3f} ms; once at the end {end:.3f} ms", flush=True)
    return {"sync_each": each, "sync_end": end}


def main() -> None:
    res = {"torch": torch.__version__, "transformers": transformers.__version__, "gpu": torch.cuda.get_device_name(0)}
    print(res, flush=True)
    res["tiny_exact"] = exactness()
    shapes = {"target": config_from("assets/benchmarks/smollm2-135m-config.json"),
              "draft": config_from("assets/models/smollm2-draft/config.json")}  # fmt: skip
    res["latency"], res["sync_ms"] = {}, {}
    for dtype in (torch.bfloat16, torch.float32):
        models = {}
        for name, cfg in shapes.items():
            torch.manual_seed(0)
            models[name] = LlamaForCausalLM(cfg).eval().to(DEV, dtype)
        points = profile(models, tokens=(1, 2, 4, 8, 16, 32, 64, 128, 256), contexts=(128, 512), repeats=10)
        res["latency"][str(dtype)] = [p.__dict__ for p in points]
        for p in points:
            print(dtype, p.model, p.context, p.new_tokens, round(p.ms, 2), flush=True)
        res["sync_ms"][str(dtype)] = sync_cost(models["target"], dtype)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "gpu.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
