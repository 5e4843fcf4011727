"""`fw check` and `fw plan` count float8 training and the Muon optimizer: the check simulates the
float8 layers the job trains with (emulated on a CPU world, torchao's float8 matmuls on a GPU
target) and steps the task's own optimizer (Muon's state: one momentum per hidden matrix,
AdamW's two moments for the rest); the plan runs the float8 matmuls at the device's float8
peak, refuses float8 on a device without one, and charges Muon's Newton-Schulz FLOPs and its
exchange of whole matrices under sharded layouts, each by the formula it documents."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from framework.errors import ConfigError
from framework.preflight.hardware import DEVICES
from framework.preflight.optimizer_work import newton_schulz_flops
from framework.preflight.perf import predict
from framework.preflight.replica import Work
from tests.unit.test_plan_perf import layout as plan_layout

TINY = ["experiment=gpt_tiny", "trainer.accelerator=cpu"]
MUON = "task.optimizer._target_=framework.optim.Muon"
H100 = DEVICES["H100 SXM"]
NS_STEPS = 5  # framework.optim.Muon's default


def shapes(report):
    """(The hidden matrices' shapes, the other parameters' sizes) of the checked task, by
    framework.optim.muon's rule."""
    from framework.instantiate import build_task
    from framework.optim.muon import hidden_matrices

    task = build_task(report.config.task)
    hidden = hidden_matrices(task)
    params = list(task.parameters())
    return [tuple(p.shape) for p in params if id(p) in hidden], [
        p.numel() for p in params if id(p) not in hidden
    ]


@pytest.fixture(scope="module")
def checked():
    """fw check of gpt_tiny with AdamW and with Muon, in one process and under fsdp x2."""
    from framework.preflight.check import check

    return {
        (name, n): check([*TINY, f"trainer.devices={n}", *extra, *layout])
        for name, extra in {"adamw": [], "muon": [MUON]}.items()
        for n, layout in {1: [], 2: ["strategy=fsdp"]}.items()
    }


@pytest.mark.slow
def test_check_counts_muons_one_momentum_per_hidden_matrix_and_adamws_two_for_the_rest(checked):
    """AdamW keeps two fp32 moments and a step count for every parameter; Muon one momentum for
    each hidden matrix and AdamW's state for the rest: the check's optimizer column is exactly
    that, whole in one process and halved by fsdp x2's shards (the step counts stay whole),
    and what fw plan's optimizer term reads (layout_facts)."""
    from framework.preflight.traffic import layout_facts

    hidden, rest = shapes(checked["muon", 1])
    assert len(hidden) == 8  # each of the 2 blocks' qkv, attention proj, mlp fc and proj
    matrices = sum(r * c for r, c in hidden)
    steps = 4 * (len(hidden) + len(rest))  # AdamW's step count: a 4-byte tensor each
    adamw = checked["adamw", 1].worst.optimizer
    muon = checked["muon", 1].worst.optimizer
    assert adamw == 8 * (matrices + sum(rest)) + steps
    assert muon == 4 * matrices + 8 * sum(rest) + 4 * len(rest)
    # AdamW's, less one moment and the step count of each hidden matrix
    assert adamw - muon == 4 * matrices + 4 * len(hidden)
    for rank in checked["muon", 2].ranks:
        assert rank.optimizer == (4 * matrices + 8 * sum(rest)) // 2 + 4 * len(rest)
    facts = {name: layout_facts(checked[name, 1], 8)["state_bytes"] for name in ("adamw", "muon")}
    assert facts["adamw"]["optimizer"] - facts["muon"]["optimizer"] == adamw - muon
    assert facts["adamw"]["params"] == facts["muon"]["params"]


@pytest.mark.slow
def test_muons_newton_schulz_flops_are_counted_on_the_rank_that_runs_them(checked):
    """One process orthogonalises every hidden matrix: 5 x (4 m^2 n + 2 m^3) FLOPs each in
    bf16 (newton_schulz_flops), counted on the simulated step; under fsdp x2 the matrices go to
    the two ranks in turn, each running half; AdamW runs no matmul."""
    hidden, _ = shapes(checked["muon", 1])
    total = sum(newton_schulz_flops(r, c, NS_STEPS) for r, c in hidden)
    (one,) = checked["muon", 1].ranks
    assert one.optimizer_flops == {"bf16": total}
    assert one.optimizer_matmuls == 3 * NS_STEPS * len(hidden)
    ranks = checked["muon", 2].ranks
    assert [r.rank for r in ranks] == [0, 1]
    assert [r.optimizer_flops["bf16"] for r in ranks] == [total / 2, total / 2]
    assert checked["adamw", 1].worst.optimizer_flops == {}
    # by hand for one shape: A = X X^T, A + A A, X + B X on a 64 x 192 matrix (or its transpose)
    assert newton_schulz_flops(192, 64, 1) == 2 * 64 * 64 * 192 + 2 * 64**3 + 2 * 64 * 64 * 192


@pytest.mark.slow
def test_muons_exchange_is_twice_a_ranks_shards_of_the_hidden_matrices(checked):
    """Under fsdp x2 each hidden matrix is gathered whole on one rank and its result scattered
    back: a rank sends twice its shards of them (4-byte updates), fw plan's `optimizer`
    traffic; one process and AdamW send nothing for it."""
    from framework.preflight.traffic import comm_bytes, traffic

    hidden, _ = shapes(checked["muon", 1])
    shard = 4 * sum(r * c for r, c in hidden) // 2
    report = checked["muon", 2]
    assert [r.optimizer_sent for r in report.ranks] == [2 * shard, 2 * shard]
    sent = traffic(report.config, report)
    assert sent["optimizer"] == 2 * shard
    adamw = checked["adamw", 2]
    assert traffic(adamw.config, adamw)["optimizer"] == 0
    assert comm_bytes(report.config, report) == comm_bytes(adamw.config, adamw) + 2 * shard
    assert checked["muon", 1].worst.optimizer_sent == 0


def layout(**changes):
    """A data-parallel layout of 8 ranks holding 16 GB of state (4 + 4 + 8: bf16-mixed AdamW)."""
    facts = plan_layout(state_bytes={"params": 4e9, "grads": 4e9, "optimizer": 8e9})
    facts.update(changes)
    return facts


def test_the_plan_charges_newton_schulz_at_the_matmul_rate_and_the_exchange_over_the_link():
    work = Work(flops=1e15, other_bytes=0.0, ops=0, tokens=16384, rows=2)
    adamw = predict(work, layout(), H100)
    muon = predict(
        work,
        layout(
            optimizer_flops={"bf16": 3e12, "fp32": 1e11},
            optimizer_matmuls=30,
            traffic={"data": 0.0, "tensor": 0.0, "pipeline": 0.0, "experts": 0.0, "optimizer": 9e8},
        ),  # fmt: skip
        H100,
    )
    assert adamw.optimizer_s == pytest.approx((8e9 + 4e9 + 16e9) / 3350e9)
    assert muon.optimizer_s - adamw.optimizer_s == pytest.approx(
        3e12 / (989e12 * 0.7) + 1e11 / (67e12 * 0.7)
    )
    # blocking, over the data-parallel group's link (NVLink 4: 450 GB/s each way)
    assert muon.comm_s - adamw.comm_s == pytest.approx(9e8 / 450e9)


@pytest.fixture(scope="module")
def tiny_batch():
    from framework.config.compose import compose_config
    from framework.instantiate import instantiate_args
    from framework.runner import resolve

    cfg = compose_config([*TINY, "trainer.devices=1"])
    resolve(cfg)
    torch.manual_seed(0)
    data = instantiate_args(cfg.task.data)
    data.setup("fit")
    return next(iter(data.train_dataloader()))


def counted(batch, *extra):
    from framework.config.compose import compose_config
    from framework.preflight.replica import count_replica
    from framework.runner import resolve

    cfg = compose_config(["experiment=gpt_tiny", "trainer.devices=1", *extra])
    resolve(cfg)
    return count_replica(cfg, batch)


@pytest.mark.slow
def test_the_plan_counts_the_float8_layers_matmuls_apart_on_a_gpu(tiny_batch):
    """On a GPU the converted linears' matmuls (forward, and both of backward: 6 x tokens x
    in x out each) run in float8, the rest of the step's FLOPs as before; the CPU emulates float8
    with ordinary matmuls, which count as such."""
    from framework.instantiate import build_task
    from framework.parallel import float8

    gpu = ["trainer.accelerator=gpu", "trainer.precision=bf16-mixed"]
    plain = counted(tiny_batch, *gpu)
    fp8 = counted(tiny_batch, *gpu, "trainer.float8=tensorwise")
    emulated = counted(
        tiny_batch, "trainer.accelerator=cpu", "trainer.precision=bf16-mixed",
        "trainer.float8=tensorwise",
    )  # fmt: skip
    from framework.config.compose import compose_config

    task = build_task(compose_config(["experiment=gpt_tiny"]).task)
    names = float8.chosen(task, float8.DEFAULT_SKIP)
    assert len(names) == 8
    weights = sum(task.get_submodule(n).weight.numel() for n in names)
    assert plain.float8_flops == 0 and emulated.float8_flops == 0
    assert fp8.flops == plain.flops == emulated.flops
    assert fp8.float8_flops == 6 * tiny_batch[0].numel() * weights
    assert fp8.other_bytes > plain.other_bytes  # the casts to float8, as eager runs them


def test_float8_matmuls_run_at_the_devices_float8_peak(tiny_batch):
    """The float8 share of a step's matmul FLOPs at the H100's float8 peak (1979 TFLOP/s, twice
    bf16's): compute falls by exactly that share's time at bf16's rate less at float8's."""
    work = Work(flops=1e15, other_bytes=0.0, ops=0, tokens=16384, rows=2, float8_flops=6e14)
    p = predict(work, layout(), H100)
    assert p.compute_s == pytest.approx(4e14 / (989e12 * 0.7) + 6e14 / (1979e12 * 0.7))
    fp8 = counted(tiny_batch, "trainer.accelerator=gpu", "trainer.precision=bf16-mixed",
                  "trainer.float8=tensorwise")  # fmt: skip
    assert fp8.float8_flops > 0
    free = replace(H100, op_overhead_s=0.0)  # gpt_tiny's launches would hide the matmuls
    bf16 = predict(replace(fp8, float8_flops=0.0), layout(), free)
    faster = predict(fp8, layout(), free)
    saved = fp8.float8_flops * (1 / 989e12 - 1 / 1979e12) / 0.7
    assert bf16.compute_s - faster.compute_s == pytest.approx(saved)


def test_a_float8_plan_on_a_gpu_without_float8_is_refused(capsys):
    from framework.cli import main

    work = Work(flops=1e15, other_bytes=0.0, ops=0, tokens=16384, rows=2, float8_flops=6e14)
    with pytest.raises(ConfigError, match="trainer.float8"):
        predict(work, layout(), DEVICES["A100 SXM 80GB"])
    args = ["plan", "--gpus", "2", "--gpu", "A100", "experiment=gpt_tiny"]
    code = main([*args, "trainer.float8=tensorwise"])
    err = capsys.readouterr().err
    assert code == 2 and "trainer.float8" in err and "no float8 matmul rate" in err


@pytest.mark.slow
def test_check_simulates_the_float8_layers_the_job_trains_with(monkeypatch):
    """The check's model has torchao's Float8Linear where the job's has (emulated on a CPU
    world, as the worker runs it; torchao's float8 matmuls on a GPU target), in one process
    and under fsdp; float8 keeps the weights, their gradients and the optimizer state in high
    precision (those columns do not move) and adds its casts to the activations' peak."""
    from framework.instantiate import build_task
    from framework.parallel import float8
    from framework.preflight import simulate
    from framework.preflight.check import check

    seen = []
    step = simulate.step

    def spied(task, *args, **kwargs):
        layers = [task.get_submodule(n) for n in float8.converted(task)]
        seen.append(([n for n in float8.converted(task)], {m.config.emulate for m in layers}))
        return step(task, *args, **kwargs)

    monkeypatch.setattr(simulate, "step", spied)
    base = ["experiment=gpt_tiny", "trainer.devices=1"]
    plain = check([*base, "trainer.accelerator=cpu"]).worst
    fp8 = check([*base, "trainer.accelerator=cpu", "trainer.float8=tensorwise"]).worst
    check([*base, "trainer.accelerator=gpu", "trainer.float8=tensorwise"])
    check(["experiment=gpt_tiny", "trainer.devices=2", "strategy=fsdp",
           "trainer.accelerator=cpu", "trainer.float8=rowwise"], quick=True)  # fmt: skip
    task = build_task(check([*base, "trainer.accelerator=cpu"]).config.task)
    names = float8.chosen(task, float8.DEFAULT_SKIP)
    assert len(names) == 8
    assert seen[0] == ([], set())
    assert seen[1] == (names, {True})  # emulated on the CPU
    assert seen[2] == (names, {False})  # a GPU target: torchao's float8 matmuls
    assert seen[3] == (names, {True})  # under fsdp too (rank 0)
    assert (fp8.params, fp8.grads, fp8.optimizer) == (plain.params, plain.grads, plain.optimizer)
    assert fp8.activations > plain.activations


@pytest.mark.slow
def test_zero_ranks_count_muons_state_its_share_of_newton_schulz_and_their_partitions_exchange():
    """DeepSpeed's ZeRO ranks are simulated as one replica and the estimator DeepSpeed gives
    for mixed precision assumes Adam: with Muon a rank holds one fp32 moment less for its 1/N of
    the hidden matrices, runs every N-th matrix's Newton-Schulz, and sends its partition of
    them to their owners and back."""
    from framework.preflight.check import check

    args = [*TINY, "trainer.devices=2", "strategy=zero2", "trainer.precision=bf16-mixed"]
    adamw = check(args).worst
    muon = check([*args, MUON]).worst
    hidden, _ = shapes(check([*TINY, "trainer.devices=1"]))
    matrices = 4 * sum(r * c for r, c in hidden)  # fp32 bytes
    assert adamw.optimizer - muon.optimizer == matrices // 2
    total = sum(newton_schulz_flops(r, c, NS_STEPS) for r, c in hidden)
    assert muon.optimizer_flops == {"bf16": total / 2}
    assert muon.optimizer_sent == 2 * matrices / 2
    assert (adamw.optimizer_flops, adamw.optimizer_sent) == ({}, 0)
