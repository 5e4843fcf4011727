"""Trainer settings Lightning compares with the number of batches only once every worker has
loaded its data are refused before launch (framework/config/batches.py): exit 2, one line,
nothing written. The counts are per data-parallel rank, after limit_train_batches."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from framework.config.batches import check_batches
from framework.config.compose import compose_config
from framework.config.dry_build import dry_build
from framework.errors import ConfigError
from tests.conftest import refused

GPT = ["experiment=gpt_tiny"]  # 371 training batches of 8 blocks on one rank, 20 validation
CASES = {
    "interval past the epoch": (
        [*GPT, "trainer.val_check_interval=1000"],
        "trainer.val_check_interval=1000: more than the 371 training batches",
    ),
    "interval past the limited epoch": (
        [*GPT, "trainer.val_check_interval=50", "trainer.limit_train_batches=40"],
        "trainer.val_check_interval=50: more than the 40 training batches",
    ),
    "interval past the epoch of one of two ranks": (
        [*GPT, "trainer.val_check_interval=300", "trainer.devices=2"],
        "trainer.val_check_interval=300: more than the 185 training batches",
    ),
    "a whole float is a number of batches": (
        [*GPT, "trainer.val_check_interval=1000.0"],
        "trainer.val_check_interval=1000: more than the 371 training batches",
    ),
    "a float above 1 that is not whole": (
        [*GPT, "trainer.limit_train_batches=2.5"],
        "trainer.limit_train_batches=2.5: neither a fraction in [0, 1] nor a whole number",
    ),
    "train fraction below one batch": (
        [*GPT, "trainer.limit_train_batches=0.001"],
        "trainer.limit_train_batches=0.001: keeps no batch of the 371",
    ),
    "val fraction below one batch": (
        [*GPT, "trainer.limit_val_batches=0.04"],
        "trainer.limit_val_batches=0.04: keeps no batch of the 20",
    ),
    "overfit fraction below one batch": (
        [*GPT, "trainer.overfit_batches=0.001"],
        "trainer.overfit_batches=0.001: keeps no batch",
    ),
    "no training batches": (  # a way to evaluate that never was one: say which is
        [*GPT, "trainer.limit_train_batches=0"],
        "trainer.limit_train_batches=0: training on no batches does nothing. To evaluate a run "
        "or a checkpoint, use fw validate RUN or fw test RUN",
    ),
    "a batch larger than the data": (
        [*GPT, "task.data.batch_size=100000", "trainer.val_check_interval=1"],
        "its train_dataloader gives no batch to a data-parallel rank (of 1)",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_setting_lightning_refuses_after_loading_is_refused_before_launch(
    case, tmp_path, monkeypatch, capsys
):
    args, expected = CASES[case]
    assert expected in refused(args, tmp_path, monkeypatch, capsys)


@pytest.fixture(scope="module")
def gpt_data():
    _, data = dry_build(compose_config(GPT).task)
    return data


def trainer(**settings):
    base = dict(val_check_interval=None, check_val_every_n_epoch=1, limit_train_batches=None)
    return OmegaConf.create({**base, **settings})


def test_the_limits_lightning_accepts_pass(gpt_data):
    check_batches(trainer(val_check_interval=371), gpt_data, 1)  # exactly one epoch
    check_batches(trainer(val_check_interval=185), gpt_data, 2)
    # validation by step only, or none at all: an interval past the epoch is what was meant
    check_batches(trainer(val_check_interval=1000, check_val_every_n_epoch=None), gpt_data, 1)
    check_batches(trainer(val_check_interval=1000, limit_val_batches=0), gpt_data, 1)
    check_batches(trainer(val_check_interval=1000, fast_dev_run=2), gpt_data, 1)
    check_batches(trainer(limit_train_batches=0.003), gpt_data, 1)  # 1.1 batches: one
    # fw validate/test/predict train nothing: no training batches blame no batch size
    check_batches(trainer(limit_train_batches=0, val_check_interval=5), gpt_data, 1)


def test_an_iterable_dataset_takes_no_fraction_of_an_epoch():
    import torch
    from torch.utils.data import DataLoader, IterableDataset

    class Stream(IterableDataset):
        def __iter__(self):
            yield from (torch.zeros(2) for _ in range(4))

    class Data:
        def setup(self, stage):
            pass

        def train_dataloader(self):
            return DataLoader(Stream(), batch_size=2)

        def val_dataloader(self):
            return DataLoader(Stream(), batch_size=2)

    with pytest.raises(ConfigError, match="val_check_interval=0.5: a fraction of an epoch"):
        check_batches(trainer(val_check_interval=0.5), Data(), 1)
    with pytest.raises(ConfigError, match="limit_val_batches=0.5: a fraction"):
        check_batches(trainer(val_check_interval=2, limit_val_batches=0.5), Data(), 1)
    check_batches(trainer(val_check_interval=1000), Data(), 1)  # an endless epoch
