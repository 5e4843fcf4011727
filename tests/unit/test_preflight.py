"""`fw check` and `fw plan`: a job of any size simulated in this process on torch's fake backend.

The per-rank model states are compared with what the memory benchmark measured in real runs
(benchmarks/results/memory.json, same model); failures that `fw train`'s checks before launch let
through, and that its workers would only meet at their first step, are reported with exit 2.
"""

from __future__ import annotations

import json

import pytest

from framework.errors import ConfigError
from tests.conftest import REPO

GPT_1B = [
    "task=gpt",
    "task.model.n_layer=24",
    "task.model.n_embd=2048",
    "task.model.n_head=16",
    "task.model.block_size=1024",
    "task.data.batch_size=4",
    "trainer.precision=bf16-mixed",
]


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    from framework.cli import main

    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.slow
def test_a_64_gpu_job_is_checked_in_this_process(capsys, monkeypatch, tmp_path):
    # how long it takes is a measurement (docs/preflight.md), not something a test can hold on
    # a machine whose cores other work shares
    monkeypatch.chdir(tmp_path)
    degrees = ["strategy=pipeline", "strategy.pp=4", "strategy.fsdp=8", "strategy.tp=2"]
    world = ["trainer.accelerator=gpu", "trainer.devices=8", "trainer.num_nodes=8"]
    code, out, err = run_cli(["check", *GPT_1B, *degrees, *world, "--gpu-mem", "H100"], capsys)
    assert code == 0, err
    assert "pp=4 x fsdp=8 x tp=2, 64 processes" in out
    assert "fits in the device's 80.0 GiB" in out
    rows = [line.split() for line in out.splitlines() if line[:1].isdigit()]
    # the first and last rank of each pipeline position, each with its stage
    assert [int(r[0]) for r in rows] == [0, 15, 16, 31, 32, 47, 48, 63]
    assert [r[2] for r in rows] == ["0", "0", "1", "1", "2", "2", "3", "3"]
    assert not list(tmp_path.iterdir()), "fw check writes nothing"


@pytest.fixture(scope="module")
def measured():
    return json.loads((REPO / "benchmarks/results/memory.json").read_text())


def test_model_states_per_rank_match_the_memory_benchmarks_measurement(measured):
    from benchmarks.memory import MODEL
    from framework.preflight.check import check

    cases = [r for r in measured["rows"] if r["processes"] == 4] + measured["rows"][:1]
    assert {r["strategy"] for r in cases} == {"ddp", "zero1", "zero2", "zero3", "fsdp"}
    for row in cases:
        strategy, n = row["strategy"], row["processes"]
        extra = ["strategy.param_persistence_threshold=0"] if strategy == "zero3" else []
        args = [*MODEL, f"strategy={strategy}", f"trainer.devices={n}", "trainer.accelerator=cpu"]
        report = check([*args, *extra])
        for rank in row["per_rank"]:
            real = sum(rank[k] for k in ("params", "grads", "optimizer", "master"))
            ours = next((r for r in report.ranks if r.rank == rank["rank"]), report.ranks[0])
            assert ours.model_states == pytest.approx(real, rel=0.10), (strategy, n, rank)


def test_what_would_fail_in_the_workers_is_refused_before_launch(tmp_path):
    """Each case passes every check `fw train` makes before launch, and fails in `fw check`
    (the third case, memory, is the next test)."""
    from framework.config.compose import compose_config
    from framework.config.validate import plan_job
    from framework.preflight.check import check
    from framework.runner import resolve

    cases = {
        # a plan entry that splits the MLP's first layer by rows: a shape error in forward
        "tp plan": (
            [
                "task=gpt",
                "strategy=tensor",
                "trainer.devices=2",
                "strategy.tp_plan=[model.blocks.0.mlp.fc:rowwise]",
            ],
            "rank 0 would fail in its first step: RuntimeError",
        ),
        # 64 data ranks of 32 samples need 2048 samples; 100 kB of text give 742
        "data": (
            [
                "task=gpt",
                "strategy=fsdp",
                "trainer.devices=8",
                "trainer.num_nodes=8",
                "task.data.max_bytes=100000",
            ],
            "task.data.batch_size=32: the training set's 742 samples give no full batch",
        ),
    }
    for name, (args, message) in cases.items():
        cfg = compose_config([*args, f"run.dir={tmp_path}"])
        resolve(cfg)
        plan_job(cfg, here=False)  # fw train's checks before launch: they pass
        with pytest.raises(ConfigError) as err:
            check(args)
        assert message in str(err.value), (name, str(err.value))


def test_a_job_that_does_not_fit_the_gpu_exits_2_after_the_table(capsys):
    big = [
        "task=gpt",
        "task.model.n_layer=2",
        "task.model.n_embd=1024",
        "task.model.block_size=1024",
    ]
    args = ["check", *big, "task.data.batch_size=16", "strategy=fsdp", "trainer.devices=2"]
    code, out, err = run_cli([*args, "trainer.accelerator=gpu", "--gpu-mem", "2GB"], capsys)
    assert code == 2
    assert "does NOT fit in the device's 2.0 GiB" in out
    assert err.startswith("error: --gpu-mem=2GB: rank ") and "fw plan" in err
    assert len(err.strip().splitlines()) == 1


def test_a_task_whose_metrics_copy_their_state_is_checked(capsys):
    """The digits recipe (the default task) builds torchmetrics metrics, which deepcopy their
    default state tensors: under the fake tensors of `fw check` that must work as in training."""
    code, out, err = run_cli(["check", "task=digits", "trainer.devices=2"], capsys)
    assert code == 0, err
    assert "ddp x 2, 2 processes" in out and "every rank" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpu-mem", "lots"], "--gpu-mem=lots: is not a memory size or a known GPU"),
        (["--ranks", "0,x"], "--ranks=0,x: is not a comma-separated list of ranks"),
        (["--ranks", "9"], "--ranks=9: is not a rank of the 1 processes"),
        (["-m", "seed=1,2"], "fw check checks one job"),
    ],
)
def test_bad_check_arguments_exit_2(args, message, capsys):
    code, _, err = run_cli(["check", "task=digits", *args], capsys)
    assert code == 2 and message in err, err


def test_plan_lists_only_layouts_check_accepts_and_recommends_one_that_fits():
    from framework.preflight.check import check
    from framework.preflight.planner import plan, table, world_overrides

    base = ["experiment=gpt_tiny", "task.data.batch_size=8"]
    options, refused = plan(base, 8, "80GB")
    names = [o.name for o in options]
    assert names[0] == "ddp", names  # a small model: plain replicas fit
    assert "fsdp x tp4" in dict(refused)  # 2 heads do not split 4 ways
    assert "fsdp x tp4" not in names and "fsdp x tp2" in names
    top = options[0]
    report = check([*base, *top.overrides, *world_overrides(8)], gpu_mem="80GB")
    assert report.fits
    # a device too small for whole replicas: the recommendation shards the model
    whole = max(o.worst.total for o in options if o.name == "ddp")
    sharded = min(o.worst.total for o in options if o.name == "fsdp")
    limit = f"{(whole + sharded) / 2 / 0.9 / 2**20:.0f}MB"
    options, refused = plan(base, 8, limit)
    assert "ddp" in dict(refused) and options and options[0].name != "ddp"
    for option in options[:2]:
        check([*base, *option.overrides, *world_overrides(8)], gpu_mem=limit)
    shown = table(options, refused, base, 8)
    command = next(line for line in shown.splitlines() if line.startswith("*"))
    assert f"fw train {' '.join(base)} {' '.join(options[0].overrides)}" in command
    assert "Left out:\n  ddp: needs" in shown


def test_a_mixture_of_experts_job_is_not_refused_for_its_data_dependent_routing():
    """Tokens per expert depend on the data, which fake tensors do not have: the check reports
    the model states (Adam: two states per parameter element) and says activations are not
    simulated, instead of calling a valid job a failure."""
    from framework.preflight.check import check

    report = check(
        ["task=moe_gpt", "strategy=expert", "trainer.devices=8", "trainer.accelerator=gpu"]
    )
    for rank in report.ranks:
        assert rank.optimizer == pytest.approx(2 * rank.params, rel=1e-3)  # + the step counts
        assert rank.grads == rank.params
        assert "activations not simulated" in rank.note


@pytest.mark.parametrize(
    ("accelerator", "foreach", "rows"),
    [("cpu", False, 64), ("gpu", True, 8)],  # at 8 rows the optimizer step's peak is the higher
)
def test_activations_and_the_optimizer_steps_temporaries_both_count_toward_the_total(
    accelerator, foreach, rows
):
    """Forward and backward peak apart from the optimizer's step (the activations are freed
    before Adam allocates its temporaries), so each phase is measured on its own: the digits
    MLP's activations are about the size of its layers' outputs for one batch, and the total
    covers the peak of a real optimizer step (on CUDA, where the job runs, Adam takes its foreach
    form; on the CPU a loop over the parameters)."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    from framework.instantiate import build_task
    from framework.preflight.check import check

    args = ["task=digits", f"task.data.batch_size={rows}", f"trainer.accelerator={accelerator}"]
    report = check(args)
    (row,) = report.ranks
    task = build_task(report.config.task)
    linears = [m for m in task.modules() if isinstance(m, torch.nn.Linear)]
    widths = [linears[0].in_features, *(m.out_features for m in linears)]
    hidden, weight = linears[0].out_features, max(m.weight.numel() * 4 for m in linears)
    # at least the hidden layer's output, which backward needs; at most a few copies of every
    # layer's input and output for the batch (saved, and their gradients in backward) and one
    # weight's gradient, a temporary of backward until it is stored in `.grad`
    assert rows * hidden * 4 <= row.activations <= 4 * rows * sum(widths) * 4 + weight, row

    x = torch.randn(rows, widths[0])
    y = torch.randint(0, widths[-1], (rows,))
    task.loss(task(x), y).backward()
    optimizer = task.make_optimizer()
    for group in optimizer.param_groups:
        group["foreach"] = foreach
    tracker = MemTracker()
    tracker.track_external(task, optimizer)
    with tracker:
        optimizer.step()
    (real,) = tracker.get_tracker_snapshot("peak").values()
    assert row.model_states + row.optimizer_step == real["Total"], (row, real)
    assert row.optimizer_step > 0 and row.total >= real["Total"]
    assert row.total == row.model_states + max(row.activations, row.optimizer_step)


def test_tensor_parallel_alone_steps_its_optimizer_as_a_gpu_would(capsys, monkeypatch, tmp_path):
    """With tp and no FSDP the norms stay plain tensors beside DTensor weights in one Adam group;
    Adam's foreach form, which it takes on CUDA, refuses the mix, so such a group steps per
    parameter (framework.parallel.placement), in fw check's simulated CUDA step as in training."""
    monkeypatch.chdir(tmp_path)
    args = ["experiment=gpt_tiny", "strategy=tensor", "trainer.devices=2"]
    code, out, err = run_cli(["check", *args, "trainer.accelerator=gpu"], capsys)
    assert code == 0, err
    assert "tp0" in out and "tp1" in out
