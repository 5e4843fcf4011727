"""The default callbacks cost nothing on a step where they have nothing to do (issue 33,
docs/benchmarks.md): no clock read by the straggler check in one process, no module walk by the
MoE metrics on a model without experts, no `self.log` by the throughput callback on a step that
Lightning does not write to the loggers; and what they log is still what they measured."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from framework.callbacks.lr_monitor.callback import LRMonitor
from framework.callbacks.moe import callback as moe_callback
from framework.callbacks.stragglers import callback as stragglers_callback
from framework.callbacks.throughput import callback as throughput_callback


class Clock:
    """A stand-in for the `time` module: counts reads, advances 1 ms per read."""

    def __init__(self) -> None:
        self.reads = 0

    def perf_counter(self) -> float:
        self.reads += 1
        return self.reads / 1000

    thread_time = perf_counter


class Module:
    """What a callback sees of the LightningModule: it records what is logged."""

    def __init__(self) -> None:
        self.logged: dict[str, float] = {}

    def log(self, name, value, **kwargs) -> None:
        self.logged[name] = value


def hook(callback, name: str, *args) -> None:
    """Call a hook as Lightning's trainer does: only when it is callable."""
    fn = getattr(callback, name)
    if callable(fn):
        fn(*args)


class Logger:
    """A logger that records each `log_metrics` call: (step, metrics)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, dict]] = []

    def log_metrics(self, metrics, step=None) -> None:
        self.calls.append((step, dict(metrics)))


def trainer(
    world_size: int = 1, step: int = 0, logs: bool = False, logger: Logger | None = None
) -> SimpleNamespace:
    return SimpleNamespace(
        world_size=world_size,
        global_step=step,
        is_global_zero=True,
        strategy=SimpleNamespace(root_device=torch.device("cpu")),
        _logger_connector=SimpleNamespace(should_update_logs=logs),
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(_batches_that_stepped=step)),
        loggers=[logger] if logger is not None else [],
        train_dataloader=None,
    )


def test_the_straggler_check_reads_no_clock_in_one_process(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(stragglers_callback, "time", clock)
    callback = stragglers_callback.Stragglers(SimpleNamespace(every_n_steps=2, threshold=1.5))
    one = trainer(world_size=1)
    callback.on_train_start(one, None)
    for i in range(5):
        hook(callback, "on_train_batch_start", one, None, None, i)
        hook(callback, "on_before_backward", one, None, None)
        hook(callback, "on_train_batch_end", one, None, None, None, i)
    assert clock.reads == 0


def test_throughput_logs_a_window_at_the_step_lightning_writes_with_its_own_figures(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(throughput_callback, "time", clock)
    cfg = SimpleNamespace(window=2, count_flops=False, warn_data_wait=0.0)
    callback, module = (
        throughput_callback.Throughput(cfg, data_ranks=2, configured_peak=None),
        Module(),
    )
    logger = Logger()
    batch = (torch.zeros(8, 3), torch.zeros(8))
    callback.on_train_start(trainer(), module)
    for step in range(1, 4):  # the window closes at step 2; Lightning writes logs at step 3
        t = trainer(step=step, logs=step == 3, logger=logger)
        reads = clock.reads
        callback.on_train_batch_start(t, module, batch, step)
        callback.on_train_batch_end(t, module, None, batch, step)
        assert clock.reads - reads == 2, "one read at the batch's start, one at its end"
        assert (logger.calls != []) == (step == 3), f"written at step {step}"
    assert module.logged == {}, "no per-figure pl_module.log: written to the loggers directly"
    ((at, written),) = logger.calls
    assert at == 3, "at the step Lightning writes the other metrics of this batch"
    # the window: batches 1-2, started at read 1, closed at read 4 (3 ms); waited read 2 -> 3
    assert written["perf/steps_per_sec"] == pytest.approx(2 / 0.003)
    assert written["perf/samples_per_sec"] == pytest.approx(2 * 8 * 2 / 0.003)
    assert written["perf/data_wait_ms"] == pytest.approx(1.0)
    assert "perf/memory_peak_gib" in written and "perf/tokens_per_sec" not in written


@pytest.mark.parametrize(
    ("batch", "sizes"),
    [
        ((torch.zeros(4, 16, dtype=torch.long), torch.zeros(4)), (4, 64)),
        ({"input_ids": torch.zeros(2, 5, dtype=torch.long), "mask": torch.ones(2, 5)}, (2, 10)),
        ({"x": torch.zeros(3, 2)}, (3, 0)),
        (torch.zeros(6, 2), (6, 0)),
    ],
)
def test_rows_and_tokens_of_a_batch(batch, sizes):
    assert throughput_callback.sizes_in(batch) == sizes


def test_moe_metrics_do_nothing_per_step_on_a_model_without_experts(monkeypatch):
    walks = []
    monkeypatch.setattr(moe_callback, "moe_layers", lambda model: walks.append(model) or [])
    callback, model = moe_callback.MoEMetrics(SimpleNamespace(per_expert=True)), nn.Linear(2, 2)
    callback.setup(trainer(), model, "fit")
    callback.on_train_start(trainer(), model)
    walks.clear()
    for step in range(5):
        hook(callback, "on_before_optimizer_step", trainer(step=step, logs=True), model, None)
    assert walks == []


def test_the_lr_monitor_is_idle_without_a_logger():
    # Lightning's own stops the run: "Cannot use LearningRateMonitor ... that has no logger"
    no_logger = SimpleNamespace(loggers=[], lr_scheduler_configs=[], optimizers=[])
    monitor = LRMonitor(logging_interval="step")
    monitor.on_train_start(no_logger)
    hook(monitor, "on_train_epoch_start", no_logger, None)
    hook(monitor, "on_train_batch_start", no_logger, None, None, 0)
    assert monitor.idle


def test_lightning_passes_by_the_hooks_a_callback_has_nothing_to_do_in():
    """Lightning formats a profiler name and enters a profiler context for every callback at
    each of the six per-step hooks unless the hook is not callable (trainer/call.py)."""
    from framework.callbacks.checkpoint.callback import Checkpointer
    from framework.runtime.hooks import PER_STEP

    def used(callback) -> set[str]:
        return {name for name in PER_STEP if callable(getattr(callback, name))}

    stragglers = stragglers_callback.Stragglers(SimpleNamespace(every_n_steps=2, threshold=1.5))
    stragglers.on_train_start(trainer(world_size=1), None)
    assert used(stragglers) == set(), "one process: nothing to compare"
    moe = moe_callback.MoEMetrics(SimpleNamespace(per_expert=True))
    assert used(moe) == {"on_before_optimizer_step"}
    moe.on_train_start(trainer(), nn.Linear(2, 2))
    assert used(moe) == set(), "no MoE layers"
    cfg = SimpleNamespace(window=2, count_flops=False, warn_data_wait=0.0)
    throughput = throughput_callback.Throughput(cfg, data_ranks=1, configured_peak=None)
    assert used(throughput) == {"on_train_batch_start", "on_train_batch_end"}
    monitor = LRMonitor(logging_interval="step")
    monitor.on_train_start(SimpleNamespace(loggers=[]))
    assert used(monitor) == set()
    checkpointer = Checkpointer(SimpleNamespace(), SimpleNamespace(run_dir=Path("unused")))
    assert used(checkpointer) == {"on_train_batch_start", "on_train_batch_end"}


@pytest.mark.parametrize("asked", [None, "simple"])
def test_fw_trainer_builds_no_profiler_context_per_hook(asked, tmp_path):
    """Lightning wraps each hook it calls (about 29 a step) in `trainer.profiler.profile(name)`.
    With `trainer.profiler` unset, fw's Trainer hands out one shared no-op context, where
    Lightning's default would build a context manager per call; a profiler asked for is
    Lightning's own, and a few steps train under either."""
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.profilers import PassThroughProfiler, SimpleProfiler
    from omegaconf import OmegaConf

    from framework.config.schema import TrainerConfig
    from framework.worker import make_trainer

    cfg = OmegaConf.structured(TrainerConfig)
    cfg.profiler, cfg.max_steps, cfg.enable_progress_bar = asked, 3, False
    cfg.enable_model_summary = False
    world = SimpleNamespace(is_cuda=False, devices=1, num_nodes=1)
    trainer = make_trainer(cfg, world, "auto", [], [], tmp_path, own_order=False)
    if asked is None:
        assert isinstance(trainer.profiler, PassThroughProfiler)  # records nothing, as before
        assert trainer.profiler.profile("a") is trainer.profiler.profile("b")
    else:
        assert isinstance(trainer.profiler, SimpleProfiler)
    trainer.fit(BoringModel())
    assert trainer.global_step == 3
    assert isinstance(trainer, pl.Trainer)
