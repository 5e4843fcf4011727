"""Validation leaves the global RNG as it found it (docs/checkpoints.md): training draws the same
random numbers whether or not a validation ran in between, so a run resumed at a validated step
equals the uninterrupted one (end to end: tests/distributed/test_resume.py, whose task's
validation draws)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from framework.callbacks.checkpoint.callback import Checkpointer


def draw() -> tuple:
    return torch.rand(3).tolist(), random.random(), float(np.random.rand())


@pytest.mark.parametrize("sanity_checking", [True, False])
def test_training_draws_the_same_numbers_after_a_validation_that_draws(sanity_checking, tmp_path):
    checkpointer = Checkpointer(
        SimpleNamespace(every_n_steps=5, monitor=None), SimpleNamespace(run_dir=tmp_path)
    )
    # step 3, no checkpoint due: the hooks do nothing but the RNG's
    trainer = SimpleNamespace(
        sanity_checking=sanity_checking,
        global_step=3,
        is_global_zero=False,
        loggers=[],
        callback_metrics={},
    )
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    expected = draw()
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    checkpointer.on_validation_start(trainer, None)
    draw()  # the validation samples, augments, ...
    checkpointer.on_validation_end(trainer, None)
    assert draw() == expected
