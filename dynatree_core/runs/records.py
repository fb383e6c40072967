"""Records: one `IterationRecord` per decoding iteration, one `RunResult` per run.

Both are plain dataclasses of JSON-friendly values with `to_dict` / `from_dict`, so the app can
replay a run without models and benchmarks can store them. The mask is stored as one '0'/'1'
string per verified node (row i, column j: node order[i] attends to node order[j]).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch

from dynatree_core.core.tree import DraftTree

TRACE_VERSION = 1


@dataclasses.dataclass
class IterationRecord:
    """Everything one iteration did: the tree, what the target saw, what it accepted, timings."""

    index: int  # 1 for the first iteration (the one that also runs the prefill)
    tree: DraftTree
    order: list[int]  # verified node ids in the order sent to the target (root first)
    mask: list[str]  # tree block of the attention mask, one '0'/'1' row per node in `order`
    position_ids: list[int]  # position of each node in `order`
    prefix_len: int  # committed tokens before the root (the root sits at this position)
    chain_len: int  # committed tokens fed before the tree in this forward (root included)
    accepted: list[int]  # accepted node ids, root excluded
    bonus_token: int | None  # None when generation stopped before the bonus was committed
    committed: list[int]  # tokens committed this iteration (accepted + bonus, after EOS/limit cut)
    target_tokens: list[int]  # target's argmax at each node in `order`
    draft_forwards: int
    draft_ms: float
    verify_ms: float
    commit_ms: float
    overhead_ms: float
    memory_mb: float
    stop: str | None = None  # "eos", "max_new_tokens" or "context_limit" on the last iteration
    verifier: str = "greedy"
    draft_forward_ms: float = 0.0  # part of draft_ms spent inside draft model forwards
    capture_ms: float = 0.0  # CUDA graph captures this iteration (forward/graphs.py), left out of the timings above
    # rows of the target's forward: the chain and the verified nodes, or more where the forward was
    # queued from the device's rows, padded to a bound (decoding/batch.py); 0 in older records
    verify_rows: int = 0
    forward_path: str = ""  # how the target's forward ran (kv.KVState.path; a capture fallback says why)
    # the verifier's steps: {"kind": "test" | "residual" | "sample" | "argmax", "node", ...}
    verification: list[dict] = dataclasses.field(default_factory=list)
    # per verified node (id as a string): reach probability, expected acceptance (DecodeConfig.analyze)
    analysis: dict[str, dict] = dataclasses.field(default_factory=dict)

    @property
    def wall_ms(self) -> float:
        return self.draft_ms + self.verify_ms + self.commit_ms + self.overhead_ms

    @property
    def outside_forwards_ms(self) -> float:
        """Wall time outside model forwards: tree building, masks, verification, compaction."""
        return self.wall_ms - self.verify_ms - self.draft_forward_ms

    @property
    def drafted(self) -> int:
        """Draft nodes the target verified (root excluded)."""
        return len(self.order) - 1

    def mask_matrix(self) -> torch.Tensor:
        return torch.tensor([[c == "1" for c in row] for row in self.mask], dtype=torch.bool)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["tree"] = self.tree.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict) -> IterationRecord:
        fields = {f.name for f in dataclasses.fields(cls)}
        required = {
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        }
        missing = required - set(data)
        if missing:
            raise ValueError(f"iteration record lacks {sorted(missing)}")
        values = {k: data[k] for k in fields if k in data}
        values["tree"] = DraftTree.from_dict(data["tree"])
        return cls(**values)


@dataclasses.dataclass
class RunResult:
    """One run, reduced to its outputs and metrics (see metrics.summarize)."""

    policy: str
    params: dict[str, Any]
    text: str
    prompt_ids: list[int]
    token_ids: list[int]  # generated tokens only
    iterations: int
    new_tokens: int
    target_forwards: int
    draft_forwards: int
    tokens_per_iteration: float
    acceptance_rate: float  # accepted draft tokens / verified draft tokens
    mean_accepted_length: float  # accepted draft tokens per iteration (bonus excluded)
    throughput_tps: float  # new tokens per second of wall time, prefill included
    wall_s: float
    ttft_ms: float  # time to the first committed token (prefill + first iteration)
    tpot_ms: float  # mean time per output token after the first
    peak_memory_mb: float  # CUDA max allocated on GPU, process RSS on CPU
    draft_ms: float
    verify_ms: float
    commit_ms: float
    overhead_ms: float
    stop_reason: str
    device: str = "cpu"
    dtype: str = "float32"
    threads: int = 0  # torch intra-op threads the run used (core/threads.py); 0: not recorded
    forward_path: str = ""  # how forwards ran (kv.KVState.path: lean+graphs, lean, ...); HF baselines: "hf"
    capture_s: float = 0.0  # seconds of CUDA graph capture, kept out of every timing above
    draft_kind: str = ""  # "token" (a standalone draft LM) or "feature" (drafts/feature.py); "" without a draft
    records: list[IterationRecord] = dataclasses.field(default_factory=list)

    def to_dict(self, *, with_records: bool = True) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "records"}
        out["version"] = TRACE_VERSION
        if with_records:
            out["records"] = [r.to_dict() for r in self.records]
        return out

    def to_json(self, *, with_records: bool = True, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(with_records=with_records), indent=indent)

    @classmethod
    def from_dict(cls, data: dict) -> RunResult:
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in fields}
        values["records"] = [IterationRecord.from_dict(r) for r in data.get("records", [])]
        return cls(**values)
