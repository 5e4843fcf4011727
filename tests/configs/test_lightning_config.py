"""The config side of a LightningCLI user's habits: every Trainer argument the framework does not
own is a typed field (a typo is still exit 2), the ones it owns point to their group, Hydra's
own keys and options do what Hydra does or say what does, and inputs that used to fail late are
refused before anything is written."""

from __future__ import annotations

import dataclasses
import inspect

import lightning.pytorch as pl
import pytest

from framework.cli import main
from framework.config.compose import compose_config
from framework.config.schema import TRAINER_OWNED, TrainerConfig
from framework.worker import TRAINER_KEYS_SKIPPED
from tests.conftest import refused

DIGITS = ["task=digits", "trainer.max_steps=2"]
TB = "+logger.tb._target_=lightning.pytorch.loggers.TensorBoardLogger"
WANDB = "+logger.w._target_=lightning.pytorch.loggers.WandbLogger"


def test_every_trainer_argument_is_a_field_or_the_frameworks():
    fields = {f.name for f in dataclasses.fields(TrainerConfig)}
    arguments = set(inspect.signature(pl.Trainer).parameters)
    own = set(TRAINER_KEYS_SKIPPED) - {"use_distributed_sampler", "devices", "num_nodes"}
    assert arguments - set(TRAINER_OWNED) <= fields, arguments - set(TRAINER_OWNED) - fields
    assert fields - own <= arguments, fields - own - arguments
    assert not set(TRAINER_OWNED) & fields


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["trainer.strategy=ddp"], "trainer.strategy=ddp: this lightning.Trainer argument is"),
        (["+trainer.logger=x"], "set it with the logger group"),
        (["trainer.max_tme=10"], "trainer.max_tme=10: no such key"),
        (["trainer.max_time=11h"], "expected 'DD:HH:MM:SS'"),
        (["trainer.fast_dev_run=-1"], "trainer.fast_dev_run=-1: expected true, false"),
        (["trainer.use_distributed_sampler=false"], "Add task.data_order=keep"),
        (["trainer.test_after_fit=true", "task._target_=tests.tasks.PlainDigits"], "no test_step"),
        (["hydra.job.chdir=true"], "The working directory never changes"),
        (["hydra/launcher=submitit_slurm"], "launcher=local|slurm|ray"),
        (["task=gpt", "task.data.max_bytes=100"], "task.data.max_bytes=100: 100 bytes of text"),
        (["task=moe_gpt", "task.model.capacity_factor=0.0"], "must be greater than 0"),
        # what a logger class takes as **kwargs, checked where Lightning hands it on
        (
            [TB, "+logger.tb.bogus=1"],
            "logger.tb.bogus=1: not an argument of TensorBoardLogger, nor",
        ),
        ([TB, "+logger.tb.flush_secs=abc"], "SummaryWriter, which expects Optional[int]"),
        ([WANDB, "+logger.w.grop=x"], "nor of wandb.init that it passes the rest to. Did you mean"),
        ([WANDB, "+logger.w.mode=bogus"], "wandb.init, which expects Optional[Literal['online'"),
    ],
)
def test_refused_before_anything_is_written(args, message, workdir, monkeypatch, capsys):
    plain = ["~task.model.hidden", "~task.model.dropout"] if "PlainDigits" in str(args) else []
    base = [] if any(a.startswith("task=") for a in args) else DIGITS
    err = refused([*base, *args, *plain], workdir, monkeypatch, capsys)
    assert message in err, err


def test_forwarded_logger_arguments_of_the_right_names_and_types_pass():
    from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

    from framework.loggers.targets import check_forwarded

    check_forwarded("logger.tb", TB, TensorBoardLogger, {"flush_secs": 5, "comment": "c"})
    check_forwarded(
        "logger.w", WANDB, WandbLogger, {"group": "g", "tags": ["a"], "mode": "offline"}
    )


def test_a_logger_class_whose_package_is_missing_is_refused(workdir, monkeypatch, capsys):
    """CometLogger raised ModuleNotFoundError in every worker, after the run directory was made."""
    from framework.loggers import targets

    def missing():
        raise ModuleNotFoundError("No module named 'comet_ml'", name="comet_ml")

    entry = targets.FORWARDS["lightning.pytorch.loggers.comet.CometLogger"]
    monkeypatch.setitem(
        targets.FORWARDS, "lightning.pytorch.loggers.comet.CometLogger", (missing, *entry[1:])
    )
    comet = "+logger.c._target_=lightning.pytorch.loggers.CometLogger"
    err = refused([*DIGITS, comet], workdir, monkeypatch, capsys)
    assert "CometLogger needs the package 'comet_ml', which is not installed" in err, err


def test_validation_data_without_a_validation_step_is_said_once_before_launch(caplog):
    """Lightning's own warning is silenced in the workers (one per rank); fw train says it."""
    import logging

    from framework.config import commands
    from framework.config.validate import plan_job

    plain = ["task._target_=tests.tasks.PlainDigits", "~task.model.hidden", "~task.model.dropout"]
    commands._NOTED.clear()
    with caplog.at_level(logging.INFO, logger="framework.config"):
        for _ in range(2):  # a sweep plans its trials in one process
            plan_job(compose_config([*DIGITS, *plain]), here=False)
        plan_job(compose_config(DIGITS), here=False)  # DigitsTask validates
    said = [r.getMessage() for r in caplog.records if "val_dataloader" in r.getMessage()]
    assert said == [
        "DigitsDataModule has a val_dataloader but PlainDigits defines no validation_step: the "
        "run is not validated (trainer.limit_val_batches=0 says so without this line)"
    ]


def test_a_gpt_corpus_file_smaller_than_a_block_is_refused(workdir, monkeypatch, capsys):
    tiny = workdir.parent / "tiny.txt"
    tiny.write_text("abc")
    err = refused(["task=gpt", f"task.data.path={tiny}"], workdir, monkeypatch, capsys)
    assert f"task.data.path={tiny}: 3 bytes of text do not fill one block" in err


def test_hydra_run_dir_is_run_dir():
    assert compose_config(["hydra.run.dir=out/x"]).run.dir == "out/x"
    assert compose_config(["hydra.job.name=first"]).run.name == "first"


def test_cfg_job_prints_what_fw_config_prints(capsys):
    assert main(["config", "task=gpt"]) == 0
    shown = capsys.readouterr().out
    for flag in (["--cfg", "job"], ["--cfg=all"], ["-c", "job"]):
        assert main(["train", *flag, "task=gpt"]) == 0
        assert capsys.readouterr().out == shown
    assert main(["train", "--cfg", "hydra"]) == 2
    assert "fw runs no Hydra application" in capsys.readouterr().err


def test_a_config_dir_option_replaces_the_built_in_one_of_the_same_name(tmp_path, capsys):
    (tmp_path / "task").mkdir()
    (tmp_path / "task" / "digits.yaml").write_text(
        "defaults:\n  - /schema/task@_here_\n  - _self_\n"
        "_target_: recipes.digits.task.DigitsTask\nmodel:\n  hidden: 7\n"
        "data:\n  _target_: recipes.digits.data.DigitsDataModule\n"
    )
    assert compose_config([], [tmp_path]).task.model.hidden == 7, "the default option too"
    assert compose_config(["task=digits"], [tmp_path]).task.model.hidden == 7
    assert compose_config(["task=gpt"], [tmp_path]).task.model.n_layer == 4  # others stay
    assert main(["train", "--help", "--config-dir", str(tmp_path)]) == 0
    assert "replaces the built-in option" in capsys.readouterr().out


def test_an_sgd_task_gets_no_weight_decay_it_did_not_ask_for(tmp_path):
    """The README's own task option: SGD with lr alone gets no weight_decay from the framework's
    defaults (the schema's default optimizer used to carry AdamW's 0.01 into it)."""
    (tmp_path / "task").mkdir()
    (tmp_path / "task" / "linear.yaml").write_text(
        "defaults:\n  - /schema/task@_here_\n  - _self_\n"
        "_target_: recipes.digits.task.DigitsTask\n"
        "data:\n  _target_: recipes.digits.data.DigitsDataModule\n"
        "optimizer:\n  _target_: torch.optim.SGD\n  lr: 0.1\n"
    )
    cfg = compose_config(["task=linear"], [tmp_path])
    assert dict(cfg.task.optimizer) == {"_target_": "torch.optim.SGD", "lr": 0.1}
