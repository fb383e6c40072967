"""The launch counter (measure/launches.py): what it counts as a launch, and that a captured
step or forward counts as one."""

from __future__ import annotations

import torch
from conftest import noisy_copy, tiny_model

from dynatree_core.core.settings import ForwardSettings
from dynatree_core.decoding.engine import DecodeConfig, generate
from dynatree_core.decoding.methods import make_method
from dynatree_core.measure import launches

CPU = torch.device("cpu")


def test_views_and_allocations_launch_nothing_and_every_kernel_counts():
    a = torch.arange(6.0)
    with launches.counting_launches(CPU) as counter:
        b = a[1:].view(5)  # views
        torch.empty(4)  # an allocation
        c = b + 1  # one kernel
        c.mul_(2)  # one kernel
        torch.cat([a, c])  # one kernel
    assert counter.counts["ops"] == 3 and counter.counts["replays"] == 0
    assert sum(counter.sites.values()) == 3


def test_ops_that_only_may_alias_count_where_they_copy():
    """`to` and `reshape` dispatch as views where they can return their input; a conversion or a
    reshape of strided rows is a kernel all the same (seen under inference mode, as forwards run)."""
    a = torch.randn(4, 6, dtype=torch.bfloat16)
    for mode in (torch.inference_mode(), torch.no_grad()):
        with mode, launches.counting_launches(CPU) as counter:
            a.to(torch.bfloat16)  # itself: nothing
            a.reshape(24)  # a view
            a.float()  # a conversion: one kernel
            a.t().reshape(24)  # strided rows copied: one kernel
        assert counter.counts["ops"] == 2, counter.counts


def test_on_a_gpu_ops_on_host_tensors_are_the_hosts_not_launches():
    with launches._Counter("cuda") as counter:
        torch.arange(4) + 1  # host tensors, counted apart
    assert counter.counts["ops"] == 0 and counter.counts["host_ops"] == 2


def test_a_forward_at_fixed_shapes_is_one_launch_and_its_inside_is_not_counted():
    """`ar` at fixed shapes (the padded forward, eager on a CPU as a graph replays on a GPU): one
    replay an iteration, and a few ops around it (its inputs, the argmax, the cache's bookkeeping)."""
    target, prompt = tiny_model("llama"), [1, 5, 7, 9, 11]
    config = DecodeConfig(16, forward=ForwardSettings(graphs=True))
    ar = launches.per_iteration(lambda: generate(target, prompt, make_method("ar", {}), config=config), CPU)
    assert ar["replays"] == 1.0 and 0 < ar["ops"] < 20, ar


def test_captured_steps_launch_fewer_ops_than_the_same_steps_eagerly(monkeypatch):
    target, draft, prompt = tiny_model("llama"), noisy_copy("llama", 0.3), [1, 5, 7, 9, 11]
    config = DecodeConfig(16, forward=ForwardSettings(graphs=True, device_draft=True, device_verify=True))

    def run():
        return generate(target, prompt, make_method("fixed_tree", {}), draft=draft, config=config)

    stepped = launches.per_iteration(run, CPU)
    monkeypatch.setenv("DYNATREE_STEP_GRAPHS", "0")
    eager = launches.per_iteration(run, CPU)
    assert stepped["replays"] > eager["replays"] and eager["ops"] > 2 * stepped["ops"], (stepped, eager)
    assert any("admission.py" in site for site in eager["sites"]), "the levels' admissions, eagerly"
    # captured: only the run's constants, made once (device._start's lambdas)
    assert all(site.endswith("<lambda>") for site in stepped["sites"] if "device.py" in site), stepped


def test_reads_of_values_and_shapes_made_by_values_are_waits_and_nothing_else_is():
    x, mask, index = torch.randn(4, 5), torch.randn(4, 5) > 0, torch.tensor([1, 2])
    with launches.counting_waits() as waits:
        x[index], x.index_select(0, index), x.masked_fill(mask, 0), torch.where(mask, x, 0)  # shapes known
        torch.repeat_interleave(x[0], torch.tensor([1, 2, 1, 1, 1]), dim=0, output_size=6)
    assert waits.total == 0, dict(waits.kinds)
    with launches.counting_waits() as waits:
        int(mask.sum()), bool(mask.any()), x.sum().item()  # three scalar reads
        x[mask], mask.nonzero()  # shapes made by the values
        y = x.clone()
        y[mask] = 0
        torch.repeat_interleave(torch.tensor([1, 2]))
    assert waits.kinds == {"_local_scalar_dense": 3, "index by a mask": 1, "nonzero": 1, "index_put by a mask": 1,
                           "repeat_interleave": 1}, dict(waits.kinds)  # fmt: skip
