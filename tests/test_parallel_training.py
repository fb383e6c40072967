"""Data-parallel training (training/parallel.py): two gloo workers on one machine step exactly as
one worker on the union of their batches, and only worker 0 writes; the training CLI joins
torchrun's workers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
STEPS, ROWS = 6, 8


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The batch stream: 2 x STEPS batches of ROWS rows, the same in every process."""
    g = torch.Generator().manual_seed(0)
    draw = lambda n: torch.randn(ROWS, n, generator=g, dtype=torch.float64)  # noqa: E731
    return [(draw(4), draw(2)) for _ in range(2 * STEPS)]


def _recipe(joined: bool):
    """A float64 two-layer model; `joined`: each batch is two of the stream's, concatenated (what
    one worker sees where two workers each take one)."""
    from dynatree_core.training.trainer import Recipe

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()
    data = _data()
    if joined:
        data = [(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])) for a, b in zip(data[::2], data[1::2], strict=True)]

    def batches(state):
        for i in range(state.get("cursor", 0), len(data)):
            yield data[i], {"cursor": i + 1}

    def loss(batch, parts):
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1]), {}, len(batch[0]), len(batch[0])

    def save(out):
        torch.save(model.state_dict(), out / "model.pt")

    point = lambda state, loss: {"step": state["step"], "loss": loss}  # noqa: E731
    return Recipe(model, list(model.parameters()), batches, loss, point, save, run={})


def _loop():
    from dynatree_core.training.trainer import Loop

    return Loop("toy", lr=0.05, warmup=2, clip=0.5, steps=STEPS, log_every=2, eval_every=3, autocast="")


def _worker(rank: int, size: int, init: str, outs: list[str]) -> None:
    from dynatree_core.training import trainer

    trainer.record = lambda *a, **k: None  # the ledger is the user's: not a test's
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    try:
        state = trainer.train(_recipe(joined=False), Path(outs[rank]), _loop(), log=lambda m: None)
        assert state["step"] == STEPS and state["seen"] == 2 * STEPS * ROWS and state["cursor"] == 2 * STEPS
        dist.barrier()  # both done (rank 0 writes its files last) before either tears the group down
    finally:
        dist.destroy_process_group()


def test_two_gloo_workers_step_as_one_worker_on_the_union_of_their_batches(tmp_path, monkeypatch):
    from dynatree_core.training import trainer

    monkeypatch.setattr(trainer, "record", lambda *a, **k: None)
    alone = tmp_path / "alone"
    state = trainer.train(_recipe(joined=True), alone, _loop(), log=lambda m: None)
    assert state["step"] == STEPS and state["seen"] == 2 * STEPS * ROWS
    outs = [str(tmp_path / "worker0"), str(tmp_path / "worker1")]
    mp.spawn(_worker, args=(2, f"file://{tmp_path / 'rendezvous'}", outs), nprocs=2, join=True)
    one, two = torch.load(alone / "model.pt"), torch.load(Path(outs[0]) / "model.pt")
    assert one.keys() == two.keys()
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-12, atol=1e-12)
    assert not torch.equal(one["0.weight"], _recipe(False).model.state_dict()["0.weight"])  # it trained
    curve = (Path(outs[0]) / "curve.json").read_text()
    assert '"step": 3' in curve and '"step": 6' in curve
    assert sorted(p.name for p in Path(outs[1]).iterdir()) == []  # worker 1 writes nothing


def test_the_training_cli_joins_torchruns_workers(tmp_path):
    """`torchrun -m dynatree_core.training ...`: each worker joins the group (gloo here) before its command."""
    script = (
        "import sys, torch.distributed as d\n"
        "from dynatree_core.training import __main__ as m\n"
        "def ranks(args):\n"
        "    said = f'{d.get_rank()} of {d.get_world_size()} {d.get_backend()}'\n"
        f"    open(f'{tmp_path}/rank{{d.get_rank()}}', 'w').write(said)\n"
        "m.COMMANDS = {'ranks': m.Command('ranks', lambda p: None, ranks)}\n"
        "m.main(['ranks'])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
    (tmp_path / "ranks.py").write_text(script)
    proc = subprocess.run([*torchrun, str(tmp_path / "ranks.py")], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["0 of 2 gloo", "1 of 2 gloo"]
