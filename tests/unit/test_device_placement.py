"""Device placement on a GPU, checked on a machine without one.

`fw check` for a CUDA target runs the parallel strategy's own setup (`parallelize`, the same
function the worker runs) with a device that is not the CPU standing for the rank's GPU, then
requires every parameter, buffer and torchmetrics state of the task on it, and every tensor the
strategy hands to a collective around a step on it (framework/preflight/devices.py). A tensor
left on the CPU, which only a GPU would reject, fails here: for every strategy preset of the
parallel plugin and the layouts that place differently (all degrees 1, tensor parallel only,
pipeline stages, FSDP with metric states outside its units, experts).
"""

from __future__ import annotations

import pytest

from framework.errors import ConfigError
from tests.conftest import REPO


def parallel_presets() -> list[str]:
    """Every conf/strategy preset of the parallel plugin (a new one is checked with no edit)."""
    return sorted(
        p.stem
        for p in (REPO / "conf/strategy").glob("*.yaml")
        if "/schema/strategy/parallel@" in p.read_text()
    )


def task_for(preset: str) -> list[str]:
    return ["experiment=moe_gpt_tiny"] if preset == "expert" else ["experiment=gpt_tiny"]


LAYOUTS = [
    # every degree 1: nothing is sharded, so nothing but the placement step moves anything
    ["experiment=gpt_tiny", "strategy=fsdp", "trainer.devices=1"],
    # pipeline stages over FSDP and over tensor parallel
    ["experiment=gpt_tiny", "strategy=pipeline", "strategy.pp=2", "strategy.fsdp=2"],
    ["experiment=gpt_tiny", "strategy=pipeline", "strategy.pp=2", "strategy.tp=2"],
    # torchmetrics states, outside every FSDP unit; and a pipeline's stages of a plain MLP
    ["task=digits", "strategy=fsdp", "trainer.devices=2"],
    ["task=digits", "strategy=pipeline", "trainer.devices=2"],
    # context parallel's forward and backward: the ring's exchanges, ulysses' all-to-alls
    ["experiment=gpt_tiny", "strategy=fsdp", "strategy.cp=2", "trainer.devices=2"],
    ["experiment=gpt_tiny", "strategy=fsdp", "strategy.cp=2", "strategy.cp_mode=ulysses"],
]


def placement(args: list[str]) -> None:
    """fw check's placement step for a CUDA target (ConfigError when a rank misplaces)."""
    from framework.preflight.check import check_placement, composed, first_batch

    cfg, plan = composed([*args, "trainer.accelerator=gpu"], None)
    assert plan.world.is_cuda
    check_placement(cfg, plan, first_batch(cfg, plan), None)


def test_the_parallel_presets_are_all_checked():
    assert {"fsdp", "tensor", "pipeline", "fsdp_tp", "expert"} <= set(parallel_presets())


@pytest.mark.parametrize("preset", parallel_presets())
def test_every_parallel_preset_leaves_nothing_off_the_gpu(preset):
    devices = "trainer.devices=4" if preset == "fsdp_tp" else "trainer.devices=2"
    placement([*task_for(preset), f"strategy={preset}", devices])


@pytest.mark.parametrize("args", LAYOUTS, ids=lambda a: " ".join(a[1:]))
def test_every_layout_leaves_nothing_off_the_gpu(args):
    n = 4 if "strategy.pp=2" in args else 2 if "strategy.cp=2" in args else None
    placement([*args, f"trainer.devices={n}"] if n else args)


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    from framework.cli import main

    code = main(args)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "left"),
    [
        # tensor parallel alone: the norms and the position embedding are in no plan
        (
            ["experiment=gpt_tiny", "strategy=tensor"],
            ["model.pos.weight on cpu", "model.blocks.0.ln1.weight on cpu"],
        ),
        # FSDP: the metrics' states belong to no sharding unit
        (["task=digits", "strategy=fsdp"], ["val_acc.tp on cpu", "val_loss.mean_value on cpu"]),
    ],
)
def test_a_tensor_the_setup_leaves_on_the_cpu_is_refused_with_exit_2(
    args, left, monkeypatch, capsys
):
    """With the placement step taken out of `parallelize` (what the strategy did before), a GPU
    job is refused before launch, naming the tensors, their device and the expected one."""
    import framework.parallel.placement

    monkeypatch.setattr(framework.parallel.placement, "to_device", lambda module, device: None)
    code, err = run_cli(["check", *args, "trainer.devices=2", "--gpu-mem", "H100"], capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert "rank 0 would hold tensors off its device" in err
    assert all(f"{name};" in err or f"{name} (" in err for name in left), err
    assert "expected: the rank's GPU" in err


def test_a_cpu_tensor_handed_to_a_collective_is_refused(monkeypatch):
    """A helper of the strategy's step that builds its tensor without `device=` (as the
    pipeline's timing metrics once did) is found, with the collective and the calling line."""
    import torch
    import torch.distributed as dist

    import framework.parallel.experts

    def counts_on_the_cpu(model, data_group):
        dist.all_reduce(torch.zeros(3), group=data_group)

    monkeypatch.setattr(framework.parallel.experts, "balance_routers", counts_on_the_cpu)
    with pytest.raises(ConfigError) as err:
        placement(["experiment=gpt_tiny", "strategy=pipeline", "trainer.devices=2"])
    message = str(err.value)
    assert "allreduce of a cpu tensor [3]" in message, message
    assert "framework/preflight/devices.py:" in message


def test_clipping_scales_gradients_the_cpu_offload_keeps_on_the_cpu():
    """Under FSDP's CPU offload the gradient shards are on the CPU and the norm on the GPU
    (meta stands for it): each gradient is scaled on its own device, as a CUDA scale times a
    CPU gradient would fail."""
    import torch

    from framework.parallel.gradients import clip_by_total_norm
    from framework.preflight.fakes import fake_mode

    with fake_mode():
        p = torch.nn.Parameter(torch.ones(4))
        p.grad = torch.full((4,), 3.0)
        norm = clip_by_total_norm([p], 1.0, torch.device("meta"))
    assert norm.device.type == "meta" and p.grad.device.type == "cpu"


def test_a_cpu_tensor_in_an_all_to_all_of_the_forward_is_refused(monkeypatch):
    """The step's forward and backward run on the GPU's stand-in too: an all-to-all of context
    parallel (ulysses) given a buffer made without `device=` is found, with the calling line."""
    import torch
    import torch.distributed as dist

    from framework.parallel.context import attention

    def all_to_all(x, group):
        out = torch.empty(x.shape, dtype=x.dtype)  # on the CPU, whatever x's device
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    args = ["experiment=gpt_tiny", "strategy=fsdp", "strategy.cp=2", "strategy.cp_mode=ulysses"]
    placement([*args, "trainer.devices=2"])
    monkeypatch.setattr(attention, "all_to_all", all_to_all)
    with pytest.raises(ConfigError) as err:
        placement([*args, "trainer.devices=2"])
    message = str(err.value)
    assert "alltoall_base of a cpu tensor" in message, message
    assert "(framework/parallel/context/attention.py:" in message, message
