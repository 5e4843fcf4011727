"""CPU-side checks of code that only runs on CUDA (issue 34): the environment a CUDA job and the
test suite give their processes, the RNG state across a change of GPUs, the settings chosen for
CUDA (DeepSpeed, threads, TF32), fp32 router scores under autocast, and the GPU peak table. No
GPU is needed: torch.cuda is stood in for where a test needs it."""

from __future__ import annotations

import logging
import os
import sys
import types

import pytest
import torch

from framework.errors import ConfigError
from framework.world import World
from tests.conftest import device_env, fw_env, refused

CUDA = World(world_size=4, devices=4, num_nodes=1, accelerator="cuda", rank=3, local_rank=3)
CPU = World(world_size=2, devices=2, num_nodes=1, accelerator="cpu")


# -- the environment: DeepSpeed's accelerator, the suite pinned to the CPU ----------------------


def test_a_cuda_job_does_not_inherit_deepspeeds_cpu_accelerator(caplog):
    from framework.strategies.deepspeed import select_accelerator

    env = {"DS_ACCELERATOR": "cpu"}  # exported by the Makefile or the test suite
    with caplog.at_level(logging.INFO, logger="framework.deepspeed"):
        assert select_accelerator(CUDA, env) == "cuda"
    assert env == {"DS_ACCELERATOR": "cuda"}
    assert "DS_ACCELERATOR=cpu inherited by a CUDA job" in caplog.text
    unset: dict[str, str] = {}
    select_accelerator(CUDA, unset)
    assert unset == {}, "left to DeepSpeed's detection"
    assert select_accelerator(CPU, unset) == "cpu" and unset == {"DS_ACCELERATOR": "cpu"}


def fake_make_strategy(monkeypatch) -> None:
    """`build` without DeepSpeed: the heavy half returns the DeepSpeed config it was given."""
    heavy = types.ModuleType("framework.strategies.deepspeed.strategy")
    heavy.make_strategy = lambda config, cfg, world, inputs: config
    monkeypatch.setitem(sys.modules, heavy.__name__, heavy)


def test_deepspeed_built_for_cuda_overlaps_communication_pins_memory_and_finds_the_gpu(
    monkeypatch,
):
    from framework.strategies import deepspeed

    fake_make_strategy(monkeypatch)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    cfg = deepspeed.Config(stage=3, offload_optimizer="cpu", offload_params="cpu")
    config = deepspeed.build(cfg, CUDA, None)
    assert os.environ["DS_ACCELERATOR"] == "cuda"
    zero = config["zero_optimization"]
    assert zero["overlap_comm"] is True
    assert zero["offload_optimizer"]["pin_memory"] is True
    assert zero["offload_param"]["pin_memory"] is True
    # the CPU keeps what its loss comparisons with ddp were measured with
    zero = deepspeed.build(cfg, CPU, None)["zero_optimization"]
    assert zero["overlap_comm"] is False and zero["offload_optimizer"]["pin_memory"] is False


def test_a_test_not_marked_gpu_runs_on_the_cpu_also_on_a_gpu_machine(monkeypatch):
    env = fw_env()  # what `fw` subprocesses of this test get
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["DS_ACCELERATOR"] == "cpu"
    with monkeypatch.context() as outside:  # a session fixture's reference runs, before pinning
        outside.delenv("CUDA_VISIBLE_DEVICES")
        outside.delenv("DS_ACCELERATOR")
        assert fw_env()["CUDA_VISIBLE_DEVICES"] == "" and fw_env()["DS_ACCELERATOR"] == "cpu"
    # in this process (in-process `fw train`, forked workers): GPUs hidden, CUDA reported absent
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert torch.cuda.is_available() is False
    assert World.planned(types.SimpleNamespace(accelerator="auto", devices=2, num_nodes=1)) == CPU


def test_a_gpu_test_sees_the_gpus_without_an_inherited_cpu_accelerator():
    env = device_env({"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "0,1", "X": "1"}, gpu=True)
    assert env == {"CUDA_VISIBLE_DEVICES": "0,1", "X": "1"}


# -- RNG: only this process's device, read also from the older list of every device ------------


class FakeCuda:
    """torch.cuda's generator functions for `count` GPUs; this process on `device`."""

    def __init__(self, monkeypatch, count: int, device: int) -> None:
        self.states = {d: torch.full((8,), d, dtype=torch.uint8) for d in range(count)}
        self.restored: list[tuple[int, int]] = []  # (the state's mark, device)
        for name, value in {
            "is_available": lambda: True,
            "is_initialized": lambda: True,
            "device_count": lambda: count,
            "current_device": lambda: device,
            "get_rng_state": lambda d="cuda": self.states[d],
            "set_rng_state": self.set,
        }.items():
            monkeypatch.setattr(torch.cuda, name, value)

    def set(self, state: torch.Tensor, d: int | str = "cuda") -> None:
        if not isinstance(d, int) or d not in self.states:
            raise IndexError(d)
        self.restored.append((int(state[0]), d))


def test_rng_state_resumes_on_fewer_gpus_into_the_device_in_use(monkeypatch):
    from framework import rng

    FakeCuda(monkeypatch, count=4, device=3)
    saved = rng.capture()
    assert torch.equal(saved["cuda"], torch.full((8,), 3, dtype=torch.uint8)), "cuda:3's only"
    on_one_gpu = FakeCuda(monkeypatch, count=1, device=0)
    rng.restore(saved)
    assert on_one_gpu.restored == [(3, 0)], "what cuda:3 drew goes on, on cuda:0"


def test_rng_state_of_an_older_checkpoint_is_taken_for_this_device_or_skipped(monkeypatch, caplog):
    from framework import rng

    FakeCuda(monkeypatch, count=4, device=0)
    saved = {**rng.capture(), "cuda": [torch.full((8,), d, dtype=torch.uint8) for d in range(2)]}
    second = FakeCuda(monkeypatch, count=4, device=1)
    rng.restore(saved)
    assert second.restored == [(1, 1)]
    fourth = FakeCuda(monkeypatch, count=4, device=3)
    with caplog.at_level(logging.WARNING, logger="framework.rng"):
        rng.restore(saved)
    assert fourth.restored == []
    assert "none for cuda:3" in caplog.text


# -- settings chosen for CUDA ---------------------------------------------------------------------


def test_cuda_workers_share_the_cores_unless_omp_num_threads_is_set(monkeypatch):
    from framework import worker

    threads: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    worker.limit_threads(CUDA)
    assert threads == [16], "64 cores over 4 local processes"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    worker.limit_threads(CUDA)
    assert threads == [16], "the user's (or torchrun's) setting wins"


@pytest.mark.parametrize(
    ("world", "precision", "tf32"),
    [
        (CUDA, "32-true", True),
        (CUDA, "32", True),
        (CUDA, "bf16-mixed", False),
        (CPU, "32-true", False),
    ],
)
def test_tf32_matmuls_on_cuda_under_fp32_precision_only(world, precision, tf32):
    from framework import worker

    matmul = torch.backends.cuda.matmul  # a settings object monkeypatch cannot restore
    before = matmul.allow_tf32
    try:
        matmul.allow_tf32 = False
        worker.use_tf32(world, precision)
        assert matmul.allow_tf32 is tf32
    finally:
        matmul.allow_tf32 = before


def test_forked_workers_are_refused_on_cuda_before_launch(tmp_path, monkeypatch, capsys):
    from framework.config import validate

    monkeypatch.setattr(validate, "cuda_device_count", lambda: 2)  # a machine with 2 GPUs
    args = ["trainer.accelerator=gpu", "trainer.devices=2", "launcher.start_method=fork"]
    err = refused(args, tmp_path, monkeypatch, capsys)
    assert (
        "launcher.start_method=fork: forked workers cannot use CUDA once the fw process has "
        "initialized it. Valid choices: auto, spawn." in err
    )


def test_forked_workers_stay_on_the_cpu():
    from framework.launchers import local

    local.validate(local.Config(start_method="fork"), CPU)
    local.validate(local.Config(start_method="spawn"), CUDA)
    with pytest.raises(ConfigError, match="launcher.start_method=fork"):
        local.validate(local.Config(start_method="fork"), CUDA)


# -- numerics and figures -------------------------------------------------------------------------


def test_router_scores_are_fp32_under_bf16_autocast():
    from framework.nn.moe import TopKRouter

    router = TopKRouter(16, num_experts=4, top_k=2, z_loss_coeff=1e-3)
    x = torch.randn(8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        weights, _ = router(x)
        assert torch.mm(x, x.T).dtype == torch.bfloat16, "autocast is on"
    assert weights.dtype == torch.float32
    assert router.aux_loss.dtype == torch.float32, "the z-loss of fp32 logits"
    want = torch.topk((x @ router.gate.weight.T).softmax(-1), 2).values
    assert torch.equal(weights, want), "the same scores as without autocast"


@pytest.mark.parametrize(
    ("device_name", "peak"),
    [
        ("NVIDIA H100 NVL", 835.0),  # not the SXM part's 989
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA L40", 181.0),  # not the L4's 121
        ("NVIDIA L4", 121.0),
        ("NVIDIA L40S", 362.0),
        ("Tesla V100-SXM2-32GB", None),  # no bf16 tensor cores: its 125 is fp16
        ("NVIDIA A100-SXM4-40GB", 312.0),
    ],
)
def test_gpu_peaks_are_found_by_whole_names_most_specific_first(device_name, peak):
    from framework.perf import parse_memory, peak_tflops

    assert peak_tflops(device_name) == peak
    assert parse_memory("--gpu-mem", "V100") == 32 * 2**30, "the memory of a V100 is known"


def test_the_preemption_vote_reads_no_gpu_tensor(monkeypatch):
    """On NCCL the per-step vote runs on a gloo group of CPU flags: reading a CUDA flag
    (`.item()`) would wait for everything the step queued on the GPU, every step."""
    from framework.runtime import vote as ck

    groups, reduced = [], []

    class Work:
        def wait(self) -> None:
            pass

    def all_reduce(flag, op, group, async_op):
        reduced.append((flag.device.type, group))
        return Work()

    monkeypatch.setattr(ck.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(ck.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(ck.dist, "get_backend", lambda: "nccl")
    monkeypatch.setattr(
        ck.dist, "new_group", lambda backend, group_desc: groups.append(backend) or "gloo"
    )
    monkeypatch.setattr(ck.dist, "all_reduce", all_reduce)
    vote = ck.PreemptionVote()
    assert vote.agreed(0) == 0 and vote.agreed(15) == 0
    assert groups == ["gloo"], "one gloo group, made once"
    assert reduced == [("cpu", "gloo"), ("cpu", "gloo")]


@pytest.mark.parametrize(
    ("env", "interface"),
    [
        ({"MASTER_ADDR": "10.0.0.1"}, "ens5"),  # the route to the master
        ({"MASTER_ADDR": "node0"}, "ens5"),  # the master's name resolving to 127.0.1.1 there
        ({"MASTER_ADDR": "10.0.0.1", "NCCL_SOCKET_IFNAME": "ib0"}, "ib0"),  # NCCL's, exact
        ({"MASTER_ADDR": "10.0.0.1", "NCCL_SOCKET_IFNAME": "ib"}, "ens5"),  # a prefix: not gloo's
        ({"MASTER_ADDR": "10.0.0.1", "GLOO_SOCKET_IFNAME": "eth9"}, "eth9"),  # the user's
    ],
)
def test_gloo_groups_of_a_multi_node_cuda_job_bind_to_an_explicit_interface(
    env, interface, monkeypatch
):
    """Every CPU-side gloo group (the vote, the loss guard, background checkpoint writes) is
    made by framework.world.host_group, which names gloo's interface in a CUDA job over several
    machines: the one NCCL is told to use, else the one the master is reached by."""
    import torch.distributed as dist

    from framework import world

    addresses = {"lo": "127.0.0.1", "docker0": "172.17.0.1", "ens5": "10.0.0.7", "ib0": "10.1.0.7"}
    monkeypatch.setattr(world, "interface_addresses", lambda: addresses)
    monkeypatch.setattr(
        world, "route_source", lambda host: "10.0.0.7" if host[0].isdigit() else "127.0.1.1"
    )
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.setenv(name, "")  # recorded: host_group's own setting is undone at the end
        monkeypatch.delenv(name)
    for name, value in {"LOCAL_WORLD_SIZE": "8", "WORLD_SIZE": "16", **env}.items():
        monkeypatch.setenv(name, value)
    made = []
    monkeypatch.setattr(dist, "get_backend", lambda: "nccl")
    monkeypatch.setattr(
        dist,
        "new_group",
        lambda backend, group_desc: made.append(
            (backend, group_desc, os.environ.get("GLOO_SOCKET_IFNAME"))
        ),
    )
    world.host_group("loss-guard")
    assert made == [("gloo", "host:loss-guard", interface)]
    monkeypatch.setenv("WORLD_SIZE", "8")  # one machine: gloo left to its default
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    world.host_group("vote")
    assert made[-1] == ("gloo", "host:vote", None)


def test_a_gloo_group_without_an_interface_is_warned_about_once(monkeypatch, caplog):
    """No GLOO_SOCKET_IFNAME, no usable NCCL_SOCKET_IFNAME, no route to the master: the
    gloo group is made anyway (gloo's default binding), and each machine's first process
    warns once, naming GLOO_SOCKET_IFNAME, instead of hanging without a word."""
    import torch.distributed as dist

    from framework import world

    monkeypatch.setattr(world, "interface_addresses", lambda: {"lo": "127.0.0.1"})
    monkeypatch.setattr(world, "route_source", lambda host: None)
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    env = {"LOCAL_WORLD_SIZE": "8", "WORLD_SIZE": "16", "MASTER_ADDR": "node0", "LOCAL_RANK": "0"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    made = []
    monkeypatch.setattr(dist, "get_backend", lambda: "nccl")
    monkeypatch.setattr(dist, "new_group", lambda backend, group_desc: made.append(group_desc))
    world.warn_without_interface.cache_clear()
    with caplog.at_level(logging.WARNING, logger="framework"):
        world.host_group("vote")
        world.host_group("loss-guard")
    assert made == ["host:vote", "host:loss-guard"]
    (warned,) = [r for r in caplog.records if "GLOO_SOCKET_IFNAME" in r.getMessage()]
    assert warned.levelno == logging.WARNING and "set GLOO_SOCKET_IFNAME" in warned.getMessage()
    caplog.clear()
    monkeypatch.setenv("LOCAL_RANK", "3")  # the machine's other processes stay quiet
    world.warn_without_interface.cache_clear()
    with caplog.at_level(logging.WARNING, logger="framework"):
        world.host_group("vote")
    assert caplog.records == []
    world.warn_without_interface.cache_clear()


def test_grouped_experts_compute_in_bf16_under_bf16_mixed():
    """grouped_mm is not on autocast's list: under bf16-mixed the experts would run in fp32 (no
    bf16 grouped GEMM on the GPU). They take autocast's dtype, as the per-expert loop's
    matmuls do, with the loop's result."""
    from framework.nn.moe import GroupedExperts

    torch.manual_seed(0)
    grouped, loop = GroupedExperts(32, 64, 2), GroupedExperts(32, 64, 2, gemm="loop")
    loop.load_state_dict(grouped.state_dict())
    x, counts = torch.randn(24, 32), torch.tensor([10, 14])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert grouped.use_grouped(x.bfloat16())
        got, want = grouped(x, counts), loop(x, counts)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert grouped(x, counts).dtype == torch.float32, "fp32 without autocast"
