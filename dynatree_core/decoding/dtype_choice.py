"""Pick the fastest *correct* dtype for a model pair on this device, by measuring it.

"Correct" is the engine's greedy promise: in a given dtype, tree decoding must reproduce AR
decoding in that same dtype token for token. Lower precision is faster where the hardware has
the units (bfloat16 with AMX or on GPUs) but rounds logits coarsely, so a tree forward (many
tokens) and an AR forward (one token) can disagree on near-ties; whether that happens is a
property of the model, the kernels and the device, so we measure it rather than assume it.

`dtype_probe.probe` runs AR and a tree policy on a few bundled prompts in every candidate dtype and keeps
the fastest whose outputs all agree; the choice is saved under the cache dir, keyed by device,
model pair and torch version, and `--dtype auto` uses it from then on (devices.resolve_dtype).
Without a saved probe, auto is the static rule: float32 on CPU, bfloat16 on GPUs that have it.
"""

from __future__ import annotations

import dataclasses
import json
import time

import torch

from dynatree_core.core.cache_dir import cache_dir
from dynatree_core.errors import DynaTreeError
from dynatree_core.runs.environment import cpu_info

CHOICE_FILE = "dtype-choice.json"


@dataclasses.dataclass
class DtypeRow:
    dtype: str
    ar_tps: float
    tree_tps: float
    exact: int  # prompts whose tree output equals AR's in this dtype
    prompts: int

    @property
    def correct(self) -> bool:
        return self.exact == self.prompts


def candidates(device: torch.device) -> list[str]:
    if device.type == "cuda":
        return ["float32", "bfloat16", "float16"] if torch.cuda.is_bf16_supported() else ["float32", "float16"]
    return ["float32", "bfloat16"]


def device_key(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"cpu:{cpu_info()[0]}:{torch.get_num_threads()} threads"


def choice_key(device: torch.device, target: str, draft: str | None) -> str:
    return f"{device_key(device)}|{target}|{draft}|torch {torch.__version__}"


def choose(rows: list[DtypeRow]) -> DtypeRow:
    """The fastest correct dtype (by tree throughput, the number the tool is for); an error if none is exact."""
    correct = [r for r in rows if r.correct]
    if not correct:
        raise DynaTreeError("no dtype reproduced AR decoding exactly; use --dtype float32 (or float64)")
    return max(correct, key=lambda r: r.tree_tps)


def saved_choice(device: torch.device, target: str, draft: str | None = None) -> str | None:
    path = cache_dir() / CHOICE_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # a broken file is ignored, never fatal
    key = choice_key(device, target, draft)
    entry = data.get(key) or next((v for k, v in data.items() if k.startswith(f"{device_key(device)}|{target}|")), None)
    return entry.get("dtype") if isinstance(entry, dict) else None


def save_choice(device: torch.device, target: str, draft: str | None, row: DtypeRow, rows: list[DtypeRow]) -> None:
    path = cache_dir() / CHOICE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        data = json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError:
        data = {}
    data[choice_key(device, target, draft)] = {
        "dtype": row.dtype,
        "measured": [dataclasses.asdict(r) for r in rows],
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)
