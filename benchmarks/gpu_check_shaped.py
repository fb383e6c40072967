"""gpu-check's pair checks and measures on SmolLM2-135M's shapes with random weights (CUDA only).

For a GPU machine that cannot hold the embedded GGUF: the target is a random Llama with the
embedded target's shapes (30 layers, 576 wide, 9 query / 3 key-value heads, 49,152 tokens), its
draft the target's first two layers; timings do not depend on the weights.

    PYTHONPATH=. python -m benchmarks.gpu_check_shaped gpu-check-smollm2-shaped.json
"""

from __future__ import annotations

import argparse
import copy
import json

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from dynatree_core.measure import gpu_check as check


def shaped_pair(device: torch.device) -> tuple[torch.nn.Module, torch.nn.Module]:
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(cfg).float().eval()
    small = copy.deepcopy(cfg)
    small.num_hidden_layers = 2
    draft = AutoModelForCausalLM.from_config(small).float().eval()
    with torch.no_grad():
        target.model.norm.weight.mul_(6.0)  # sharpened logits, as gpu-check's tiny pairs
        draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        for i in range(2):
            draft.model.layers[i].load_state_dict(target.model.layers[i].state_dict())
        draft.model.norm.weight.copy_(target.model.norm.weight)
    return target.to(device), draft.to(device)


def measure(out: str) -> None:
    dev = torch.device("cuda")
    target, draft = shaped_pair(dev)
    rows = check.pair_checks("smollm2-shaped random", target, draft)
    rows += check.invariance_checks("smollm2-shaped random", target, draft)
    measures = {
        "buckets": check.bucket_ms(target, dev),
        "widths": check.measured_widths(target),
        "run": check.run_measures(target, draft, dev),
    }
    report = {"device": "cuda", "name": torch.cuda.get_device_name(dev), "checks": rows, "measures": measures}
    report["verdict"] = "pass" if all(r["ok"] for r in rows) else "FAIL"
    print(check.verdict_table(report))
    with open(out, "w") as f:
        json.dump(report, f, indent=1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="gpu-check-smollm2-shaped.json", help="the report to write")
    measure(parser.parse_args(argv).out)


if __name__ == "__main__":
    main()
