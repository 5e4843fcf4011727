"""The job plan (framework/config/job_plan.py): validation derives a job's facts once and hands
them on. Counted through `fw train`'s own path (runner.train, launcher, worker.entry, with the
training loop itself left out): each process types the strategy node once and fits its
degrees once (before the plan: the `fw` process typed it twice and fitted three times, and
each worker typed it once more and fitted three times; inside torchrun, where the `fw` process
is the worker, three typings and six fits)."""

from __future__ import annotations

import sys

import pytest
from omegaconf import OmegaConf

from framework import runner, worker
from framework.config import job_plan
from framework.launchers import local
from framework.parallel.dims import ParallelDims
from framework.secrets import ENV as SECRETS_ENV
from framework.strategies import parallel

FSDP = ["task=digits", "strategy=fsdp", "callbacks=none", "logger=[csv]", "trainer.max_steps=1"]


@pytest.fixture
def counted(monkeypatch):
    """{'typed': n, 'fit': n}: typings of a strategy node and ParallelDims.fit calls, from an
    empty cache of fitted degrees (as in a fresh process); the training loop left out."""
    import lightning.pytorch as pl

    calls = {"typed": 0, "fit": 0}
    typed_config, fit = job_plan.typed_config, ParallelDims.fit.__func__

    def counting_typed(module, node, key=""):
        calls["typed"] += module.__name__.startswith("framework.strategies.")
        return typed_config(module, node, key)

    def counting_fit(cls, degrees, world_size):
        calls["fit"] += 1
        return fit(cls, degrees, world_size)

    for name, module in list(sys.modules.items()):  # every module that imported it
        if name.startswith("framework") and getattr(module, "typed_config", None) is typed_config:
            monkeypatch.setattr(module, "typed_config", counting_typed)
    monkeypatch.setattr(ParallelDims, "fit", classmethod(counting_fit))
    monkeypatch.setattr(pl.Trainer, "fit", lambda *args, **kwargs: None)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the worker leaves torch's threads alone
    monkeypatch.setenv(SECRETS_ENV, "{}")  # set by the runner for its workers: restored after
    parallel._fitted.cache_clear()
    yield calls
    parallel._fitted.cache_clear()


def test_fw_train_in_one_process_types_the_strategy_once_and_fits_once(
    counted, tmp_path, monkeypatch
):
    """launcher=local with one process trains in the fw process from the plan it made."""
    for name in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "RANK", "WORLD_SIZE", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    entered, entry = [], worker.entry
    monkeypatch.setattr(worker, "entry", lambda *a, **kw: entered.append(kw) or entry(*a, **kw))
    runner.train([*FSDP, "trainer.devices=1", f"run.dir={tmp_path / 'run'}"])
    assert counted == {"typed": 1, "fit": 1}
    assert isinstance(entered[0]["plan"], job_plan.JobPlan)


def test_inside_torchrun_the_plan_is_made_once_in_each_process(counted, tmp_path, monkeypatch):
    """A rank of torchrun runs fw train itself: validation's plan goes to the worker as it is."""
    for key, value in {
        "TORCHELASTIC_RUN_ID": "job-7",
        "LOCAL_RANK": "0",
        "RANK": "0",
        "WORLD_SIZE": "1",
    }.items():
        monkeypatch.setenv(key, value)
    runner.train([*FSDP, "trainer.devices=1", f"run.dir={tmp_path / 'run'}"])
    assert counted == {"typed": 1, "fit": 1}


def test_a_worker_process_makes_its_plan_from_config_yaml_in_one_call(counted, tmp_path):
    """What a worker process started by launcher=local or SLURM does: config.yaml in, one
    typing and one fit (the cache of the fw process cleared, as in a spawned process)."""
    [job] = runner.make_jobs([*FSDP, "trainer.devices=2", f"run.dir={tmp_path / 'run'}"])
    config_path = runner.write_config(job)
    runner.pass_secrets(job)  # as run_job does: what config.yaml leaves out
    assert counted == {"typed": 1, "fit": 1}
    parallel._fitted.cache_clear()
    worker.entry(config_path)
    assert counted == {"typed": 2, "fit": 2}


def test_the_plan_holds_what_validation_worked_out(tmp_path, monkeypatch):
    for name in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "RANK", "WORLD_SIZE", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    [job] = runner.make_jobs([*FSDP, "trainer.devices=2", f"run.dir={tmp_path / 'run'}"])
    plan = job.plan
    assert plan.world.world_size == 2 and plan.world.rank == 0
    assert plan.strategy_plugin is parallel and isinstance(plan.strategy, parallel.Config)
    assert plan.dims == ParallelDims(fsdp=2)
    assert (plan.layout, plan.checkpoint_format, plan.data_parallel) == ("fsdp=2", "dcp", (0, 2))
    assert plan.saves_async is True
    assert plan.launcher_plugin is local and isinstance(plan.launcher, local.Config)
    assert runner.job_launcher(job.cfg, (plan.launcher_plugin, plan.launcher))[1] is plan.launcher
    # the plan as rank 1 of the job sees it: its place among the data ranks; nothing retyped
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    mine = job_plan.for_worker(plan)
    assert (mine.world.rank, mine.world.local_rank, mine.data_parallel) == (1, 1, (1, 2))
    assert mine.strategy is plan.strategy and mine.dims is plan.dims
    assert mine.cfg is not plan.cfg and OmegaConf.to_container(mine.cfg) == OmegaConf.to_container(
        plan.cfg
    )
