"""fw validate, fw test and fw predict read a checkpoint of any layout under any strategy and
process count, and give what Lightning's own Trainer gives on the model `fw export` writes.

One digits run per layout (ddp x2, fsdp x2, tp=2, pp=2, zero3 x2; 4 steps, a checkpoint at 4) is
evaluated twice: once on 1 process and once on 2 under another strategy, `fw test` on one and
`fw validate` on the other, so that both commands run on 1 and on 2 processes and every layout
is read by both counts. The reference is Lightning's Trainer.test/validate, in this process, of
a DigitsTask holding the exported state dict. The validation split has 360 images: two
processes split it evenly, so no image counts twice.
"""

from __future__ import annotations

from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch

from framework import predictions
from framework.checkpoint.export import export
from framework.runtime.evaluation import read_results
from recipes.digits.data import DigitsDataModule
from recipes.digits.task import DigitsTask
from tests.conftest import QUIET, fw

pytestmark = pytest.mark.slow
VAL_FRACTION = 0.2004  # 360 of 1797 images: an even split over 2 processes
COMMON = [
    *QUIET,
    "task=digits",
    f"task.data.val_fraction={VAL_FRACTION}",
    "trainer.max_steps=4",
    "trainer.deterministic=true",
    "logger=[csv]",
    "callbacks.checkpoint.every_n_steps=4",
]
# name -> how it trains (2 processes, a global batch of 32)
LAYOUTS = {
    "ddp": ["strategy=ddp", "task.data.batch_size=16"],
    "fsdp": ["strategy=fsdp", "task.data.batch_size=16"],
    "tp": ["strategy=tensor", "task.data.batch_size=32"],
    "pp": ["strategy=pipeline", "task.data.batch_size=32"],
    "zero3": ["strategy=zero3", "task.data.batch_size=16"],
}
# name -> (command on 1 process, (command, strategy) on 2 processes)
EVALUATIONS = {
    "ddp": ("test", ("validate", "fsdp")),
    "fsdp": ("validate", ("test", "tensor")),
    "tp": ("test", ("validate", "ddp")),
    "pp": ("validate", ("test", "fsdp")),
    "zero3": ("test", ("validate", "pipeline")),
}


def run_fw(*args: str, cwd) -> str:
    result = fw(*args, cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each layout's run directory, trained once."""
    root = tmp_path_factory.mktemp("evaluate")
    for name, args in LAYOUTS.items():
        run_fw("train", *COMMON, *args, "trainer.devices=2", f"run.dir={root / name}", cwd=root)
    return SimpleNamespace(root=root)


def lightning_reference(ckpt, command: str, workdir) -> dict[str, float]:
    """Lightning's own Trainer.test/validate of the exported model, in this process."""
    out = workdir / "model.pt"
    export(ckpt, out, force=True)
    task = DigitsTask()
    task.load_state_dict(torch.load(out, weights_only=True))
    data = DigitsDataModule(batch_size=32, val_fraction=VAL_FRACTION)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    run = trainer.test if command == "test" else trainer.validate
    (metrics,) = run(task, datamodule=data, verbose=False)
    return {k: float(v) for k, v in metrics.items()}


def metrics_of(row: dict[str, str]) -> dict[str, float]:
    fixed = ("time", "checkpoint", "step", "processes", "strategy")
    return {k: float(v) for k, v in row.items() if k not in fixed and v not in ("", None)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_any_layout_evaluates_on_one_and_two_processes_as_lightning_does(layout, runs, workdir):
    run = runs.root / layout
    ckpt = run / "checkpoints" / "step00000004"
    trained = (run / "metrics.csv").read_text()
    alone, (command2, strategy2) = EVALUATIONS[layout]
    out = run_fw(alone, str(run), "trainer.devices=1", "strategy=ddp", *QUIET, cwd=workdir)
    assert "step00000004 (step 4), ddp x 1" in out and f"{alone}.csv" in out, out
    row = read_results(run, alone)[-1]
    assert row["checkpoint"] == "step00000004" and row["processes"] == "1"
    got, want = metrics_of(row), lightning_reference(ckpt, alone, workdir)
    assert set(got) == set(want), (got, want)
    assert all(abs(got[k] - want[k]) <= 1e-5 for k in want), (got, want)

    args = [f"strategy={strategy2}", "trainer.devices=2", *QUIET]
    run_fw(command2, str(ckpt), *args, cwd=workdir)  # the checkpoint itself named this time
    row = read_results(run, command2)[-1]
    assert row["processes"] == "2"
    got, want = metrics_of(row), lightning_reference(ckpt, command2, workdir)
    # under a pipeline the task's own step cannot run: the loss is logged, by the strategy
    losses_only = {f"{k.split('/')[0]}/loss" for k in want}
    assert set(got) == (losses_only if strategy2 == "pipeline" else set(want)), (got, want)
    assert all(abs(got[k] - want[k]) <= 1e-5 for k in got), (got, want)
    assert (run / "metrics.csv").read_text() == trained, "training's rows untouched"


def test_predict_gives_the_same_outputs_in_the_same_order_at_one_and_two_processes(runs, workdir):
    run = runs.root / "ddp"
    run_fw("predict", str(run), "trainer.devices=1", *QUIET, cwd=workdir)
    alone = predictions.read(run)
    assert len(predictions.files(run)) == 1
    run_fw("predict", str(run), "strategy=fsdp", "trainer.devices=2", *QUIET, cwd=workdir)
    assert len(predictions.files(run)) == 2, "one file per rank, the earlier ones replaced"
    both = predictions.read(run)
    assert len(alone) == len(both) == 360
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(alone, both, strict=True))
    # the dataset's order: the first image's logits are the model's on the first image
    data = DigitsDataModule(batch_size=32, val_fraction=VAL_FRACTION)
    data.setup("predict")
    export(run / "checkpoints" / "step00000004", workdir / "model.pt", force=True)
    task = DigitsTask()
    task.load_state_dict(torch.load(workdir / "model.pt", weights_only=True))
    x, _ = data.val_set[:5]
    assert torch.allclose(torch.stack(both[:5]), task(x).detach(), atol=1e-5)


def test_an_evaluation_with_another_model_is_refused_before_launch(runs, workdir):
    result = fw("test", str(runs.root / "ddp"), "task.model.hidden=64", cwd=workdir)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "the checkpoint holds another model (task.model.hidden: 128 -> 64)" in result.stderr
    assert "Traceback" not in result.stderr
