"""Sharded data parallel (zero1/2/3 through DeepSpeed, fsdp): ddp's losses, state sharded, exact resume.

The references are the one-process runs of tests/distributed/conftest.py (ddp on 2 processes
equals them: test_ddp.py): digits with batch 32 (here 16 on each of 2 processes) and gpt16."""

from __future__ import annotations

import json
import random

import pytest
import torch

from tests.conftest import QUIET, fw, losses, metric_rows, refused
from tests.distributed.test_resume import SLOW, kill_then_restart

pytestmark = pytest.mark.slow
PARITY = [
    *QUIET,
    "trainer.devices=2",
    "trainer.deterministic=true",
    "trainer.log_every_n_steps=1",
    "callbacks=none",
    "logger=[csv]",
]
# the one-process reference digits: batch 16 on each of 2 processes
DIGITS = ["task=digits", "task.data.batch_size=16", "trainer.max_steps=20"]
# the one-process reference gpt16 (tests/distributed/conftest.py): batch 8 on each of 2 processes
GPT = ["experiment=gpt_tiny", "trainer.val_check_interval=20", "task.scheduler.name=constant"]


# digits runs kept with their checkpoints (for export too) and what each rank held (ShardCounter);
# zero3 partitions every parameter (by default it keeps those under 1e5 elements whole: all of
# digits' and gpt_tiny's); its step 1 is recorded and held to NCCL's rules (nccl-rules.json)
NCCL = ["+callbacks.nccl._target_=tests.tasks.RecordNcclRules"]
SAVED = {
    "zero1": [],
    "zero2": [],
    "zero3": ["strategy.param_persistence_threshold=0", *NCCL],
    "fsdp": [],
}


@pytest.fixture(scope="module")
def digits_runs(tmp_path_factory):
    """digits on 2 processes, 20 steps, checkpointed at the end, under each strategy of SAVED;
    `<strategy>-shards/shards-rank<r>.json`: the elements rank r held at step 2."""
    root = tmp_path_factory.mktemp("digits")
    with_checkpoints = [a for a in PARITY if a != "callbacks=none"]
    for strategy, extra in SAVED.items():
        (root / f"{strategy}-shards").mkdir()
        shards = [
            "+callbacks.shards._target_=tests.tasks.ShardCounter",
            f"+callbacks.shards.out={root / f'{strategy}-shards'}",
        ]
        run = root / strategy
        args = [f"strategy={strategy}", *extra, *DIGITS, *with_checkpoints, *shards]
        result = fw("train", *args, f"run.dir={run}")
        assert result.returncode == 0, result.stderr[-3000:]
    return root


@pytest.fixture(scope="module")
def ddp_losses(one_process):
    return {"digits": one_process["digits"], "gpt": one_process["gpt16"]}


@pytest.mark.parametrize(
    "strategy", ["zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "fsdp"]
)
def test_sharded_reproduces_ddp_on_digits(strategy, ddp_losses, digits_runs, workdir):
    run = digits_runs / strategy
    if strategy not in SAVED:
        result = fw("train", f"strategy={strategy}", *DIGITS, *PARITY, "run.dir=run", cwd=workdir)
        assert result.returncode == 0, result.stderr[-3000:]
        run = workdir / "run"
    got, want = losses(run), ddp_losses["digits"]
    assert sorted(got) == list(range(20))
    assert all(abs(got[s] - want[s]) <= 1e-5 for s in want), (got, want)


# gpt (two parameter groups, a head tied to the embedding) under zero2; zero1 is the same
# DeepSpeed optimizer (stage_1_and_2) with gradients whole; zero3 and fsdp on gpt:
# test_tensor.py's activation-checkpointing cases and test_moves.py's ddp -> zero3 -> fsdp run;
# fsdp also below (named units)
@pytest.mark.parametrize("strategy", ["zero2"])
def test_sharded_reproduces_ddp_on_gpt(strategy, ddp_losses, workdir):
    result = fw("train", f"strategy={strategy}", *GPT, *PARITY, "run.dir=run", cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    got, want = losses(workdir / "run"), ddp_losses["gpt"]
    assert sorted(got) == sorted(want) and len(got) == 20
    assert all(abs(got[s] - want[s]) <= 1e-5 for s in want), (got, want)


def test_a_zero3_step_keeps_nccls_rules(digits_runs):
    """DeepSpeed's gathers and reduce-scatters of a ZeRO-3 step, recorded on the CPU, are
    handed only tensors on the device and its point-to-point is batched: what NCCL requires
    and gloo forgives (framework/parallel/nccl_rules.py)."""
    found = json.loads((digits_runs / "zero3" / "nccl-rules.json").read_text())
    assert {"_allgather_base_", "_reduce_scatter_base_"} <= set(found["ops"]), found["ops"]
    assert found["violations"] == []


def shard_counts(digits_runs, strategy: str) -> list[dict]:
    out = digits_runs / f"{strategy}-shards"
    return [json.loads((out / f"shards-rank{r}.json").read_text()) for r in (0, 1)]


def near(value: int, target: float) -> bool:
    return abs(value - target) <= 0.02 * target


def test_state_is_really_sharded(digits_runs):
    # what one process of ddp holds: every parameter, its gradient, AdamW's two slots of each
    (first, _) = shard_counts(digits_runs, "zero1")
    full = {"params": first["full"], "grads": first["full"], "optimizer": 2 * first["full"]}
    for strategy in ("zero1", "zero2", "zero3", "fsdp"):
        for rank in shard_counts(digits_runs, strategy):
            assert near(rank["optimizer"], full["optimizer"] / 2), (strategy, rank)
            if strategy != "zero1":
                assert near(rank["grads"], full["grads"] / 2), (strategy, rank)
            if strategy in ("zero3", "fsdp"):
                total = rank["params"] + rank["grads"] + rank["optimizer"]
                assert near(total, (full["params"] + full["grads"] + full["optimizer"]) / 2), rank
            else:
                assert rank["params"] == full["params"]


# zero2's restart: test_preemption.py; fsdp's: a kill -9 under fsdp x tp (test_hf_resume.py)
# and cp x fsdp (test_context.py), a kill mid-write of an async save below
@pytest.mark.parametrize("strategy", ["zero3"])
def test_kill_9_and_restart_is_exact_under_sharding(strategy, workdir):
    args = [
        f"strategy={strategy}",
        *(a for a in SLOW if "max_steps" not in a),
        "trainer.max_steps=20",
    ]
    reference = fw("train", *args, f"run.dir={workdir}/reference", cwd=workdir)
    assert reference.returncode == 0, reference.stderr[-3000:]
    kill_step = random.Random(strategy).randint(6, 17)
    err = kill_then_restart(args, workdir / "run", kill_step, workdir)
    assert "Resuming from" in err
    assert metric_rows(workdir / "run") == metric_rows(workdir / "reference")


def test_async_saves_equal_sync_saves_and_a_kill_mid_write_resumes_from_the_one_before(
    digits_runs, workdir
):
    from framework.checkpoint.export import consolidated_state

    marker = workdir / "killed"
    args = [
        "strategy=fsdp",
        *DIGITS,
        *(a for a in PARITY if a != "callbacks=none"),
        "callbacks.checkpoint.every_n_steps=5",
        "callbacks.checkpoint.async_save=true",
        "+callbacks.kill._target_=tests.tasks.KillAfterSave",
        "+callbacks.kill.step=10",
        f"+callbacks.kill.marker={marker}",
        "run.dir=run",
    ]
    first = fw("train", *args, cwd=workdir)
    assert first.returncode != 0 and marker.exists(), first.stderr[-3000:]
    checkpoints = workdir / "run" / "checkpoints"
    assert (checkpoints / "step00000005" / "meta.json").is_file()
    assert not (checkpoints / "step00000010").exists(), "a write in flight is never committed"
    again = fw("train", *args, cwd=workdir)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "(step 5)" in again.stderr, "resumed from the last complete checkpoint"
    assert losses(workdir / "run") == losses(digits_runs / "fsdp")
    a = consolidated_state(checkpoints / "step00000020")
    b = consolidated_state(digits_runs / "fsdp" / "checkpoints" / "step00000020")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "sync = async"


def test_export_of_sharded_checkpoints_equals_the_ddp_model(digits_runs, one_process, workdir):
    from framework.cli import main  # `fw export` in this process: its start-up is paid elsewhere

    runs = {"ddp": one_process["root"] / "digits", "zero3": digits_runs / "zero3"}
    runs["fsdp"] = digits_runs / "fsdp"
    for strategy, run in runs.items():
        assert main(["export", str(run), str(workdir / f"{strategy}.pt")]) == 0
    a = torch.load(workdir / "ddp.pt", weights_only=True)
    for strategy in ("zero3", "fsdp"):
        b = torch.load(workdir / f"{strategy}.pt", weights_only=True)
        assert a.keys() == b.keys()
        assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a), strategy


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["strategy=zero2", "strategy.offload_params=cpu"], "parameter offload needs ZeRO stage 3"),
        (["strategy=zero3", "strategy.stage=4"], "Valid choices: 1, 2, 3"),
        (["strategy=fsdp", "strategy.cpu_offload=true"], "needs the job to run on CUDA"),
        (["strategy=fsdp", "strategy.param_dtype=fp8"], "Valid choices: null, float32, bfloat16"),
        (
            [
                "strategy=zero2_offload",
                "strategy.offload_optimizer=nvme",
                "strategy.nvme_path=/no/disk",
            ],
            "strategy.nvme_path=/no/disk",
        ),
    ],
)
def test_invalid_sharding_settings_are_refused_before_launch(
    args, message, workdir, monkeypatch, capsys
):
    assert message in refused(args, workdir, monkeypatch, capsys)


def test_fsdp_with_named_units_reproduces_ddp_on_gpt(ddp_losses, workdir):
    probe = [
        "+callbacks.probe._target_=tests.tasks.TransformProbe",
        f"+callbacks.probe.out={workdir}",
    ]
    result = fw(
        "train",
        "strategy=fsdp",
        "strategy.shard_modules=[Attention,MLP]",
        *GPT,
        *PARITY,
        *probe,
        "run.dir=run",
        cwd=workdir,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    got, want = losses(workdir / "run"), ddp_losses["gpt"]
    assert sorted(got) == sorted(want) and all(abs(got[s] - want[s]) <= 1e-5 for s in want)
    units = json.loads((workdir / "probe-rank0.json").read_text())["fsdp_units"]
    assert units == ["Attention", "Attention", "GPT", "MLP", "MLP"], (
        "the named classes are the units"
    )


def test_fsdp_settings_mean_the_same_as_the_preset_or_as_degrees(
    ddp_losses, workdir, monkeypatch, capsys
):
    """strategy=fsdp and degrees written out are one layout with one FSDP applier: mixed
    precision gives the same (bf16) losses both ways, and differs from fp32 ddp."""
    mixed = ["strategy.param_dtype=bfloat16", "strategy.reduce_dtype=float32"]
    spellings = {
        "preset": ["strategy=fsdp"],
        "degrees": ["strategy=tensor", "strategy.tp=1", "strategy.fsdp=-1"],
    }
    for name, spelled in spellings.items():
        result = fw("train", *spelled, *mixed, *DIGITS, *PARITY, f"run.dir={name}", cwd=workdir)
        assert result.returncode == 0, result.stderr[-3000:]
    got, want = losses(workdir / "preset"), losses(workdir / "degrees")
    assert got == want and len(got) == 20
    assert any(abs(got[s] - ddp_losses["digits"][s]) > 1e-4 for s in got), "bf16 was applied"
    (workdir / "refused").mkdir()
    for spelled in spellings.values():
        offload = [*spelled, "strategy.cpu_offload=true", "trainer.devices=2"]
        err = refused(offload, workdir / "refused", monkeypatch, capsys)
        assert "needs the job to run on CUDA" in err


def test_nvme_offload_matches_ddp_or_is_refused_before_launch_without_libaio(ddp_losses, workdir):
    """NVMe offload needs DeepSpeed's async_io op; without libaio it is a config error, not a crash."""
    from framework.strategies.deepspeed import async_io_available
    from framework.world import World

    nvme = workdir / "nvme"
    nvme.mkdir()
    args = [
        "strategy=zero3_offload",
        "strategy.offload_optimizer=nvme",
        "strategy.offload_params=nvme",
        f"strategy.nvme_path={nvme}",
        *DIGITS,
        *PARITY,
        "run.dir=run",
    ]
    result = fw("train", *args, cwd=workdir)
    if async_io_available(World(world_size=2, devices=2, num_nodes=1, accelerator="cpu")):
        assert result.returncode == 0, result.stderr[-3000:]
        got, want = losses(workdir / "run"), ddp_losses["digits"]
        assert sorted(got) == sorted(want), "the same steps logged"
        assert all(abs(got[s] - want[s]) <= 1e-5 for s in want), (got, want)
    else:
        assert result.returncode == 2, result.stderr[-3000:]
        assert "libaio" in result.stderr and "Traceback" not in result.stderr
        assert not (workdir / "run").exists()
