"""Data-parallel training: the one loop (trainer.py) on N workers, each a process.

Launched by torchrun, nothing else to set up:

    torchrun --nproc-per-node N -m dynatree_core.training COMMAND ...

(on one machine; `--nnodes` and `--rdzv-endpoint` for several, as torchrun documents). Each worker
runs the whole recipe on its own device (a GPU each with CUDA: `LOCAL_RANK`; gloo on CPUs) and
takes its share of the one batch stream: worker r steps on batches r, r + N, r + 2N, ... Every
step's gradient is the mean over the N workers' batches (one all-reduce of every gradient,
flattened), so N workers step exactly as one worker on the union of their batches (a recipe's
loss is a mean over its batch; tests/test_parallel_training.py checks the weights). A step's
counters (data seen, tokens read, its seconds) are summed over the workers, the seconds averaged,
so every worker keeps the same schedule (learning rate, evaluations, the time budget, the end);
worker 0 alone writes (log lines, the ledger, checkpoints, the curve, the trained model). This is
what torch's DistributedDataParallel does for a model whose forward it wraps; a recipe's loss calls
its model itself, so the loop reduces the gradients after `backward` instead.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class World:
    """This worker's place among the workers: rank 0 of 1 when training alone."""

    rank: int = 0
    size: int = 1

    @property
    def main(self) -> bool:
        """The worker that writes (logs, checkpoints, the curve, the model)."""
        return self.rank == 0


def world() -> World:
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size())
    return World()


def join() -> World:
    """Join torchrun's workers where torchrun started this process (WORLD_SIZE > 1): gloo, or NCCL
    on this worker's GPU (LOCAL_RANK) where CUDA is; alone, nothing to do."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or (dist.is_available() and dist.is_initialized()):
        return world()
    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # "cuda" is this worker's GPU from now on
        backend = "nccl"
    dist.init_process_group(backend)
    return world()


def same_start(params: list[torch.nn.Parameter], here: World) -> None:
    """Every worker starts from worker 0's weights (a recipe seeds its model, but a worker that
    resumed or drew otherwise must not drift)."""
    if here.size > 1:
        for p in params:
            dist.broadcast(p.data, 0)


def mean_gradients(params: list[torch.nn.Parameter], here: World) -> None:
    """Each gradient becomes its mean over the workers: one all-reduce of them all, flattened
    (a parameter no batch reached gets zeros, so every worker reduces the same tensors)."""
    if here.size == 1:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= here.size
    for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(part.view_as(g))


def shared_counts(seen: int, tokens: int, seconds: float, here: World, device) -> tuple[int, int, float]:
    """A step's data seen and tokens read, summed over the workers, and its seconds, averaged: the
    same on every worker (one all-reduce)."""
    if here.size == 1:
        return seen, tokens, seconds
    counts = torch.tensor([seen, tokens, seconds], dtype=torch.float64, device=device)
    dist.all_reduce(counts)
    return int(counts[0]), int(counts[1]), float(counts[2]) / here.size
