"""The data-wait warning speaks only when the wait matters: a share of the step above
`warn_data_wait`, after the first window, and enough seconds to matter (a short toy run whose
loader costs under a millisecond a batch is quiet); a loader that starves the step is named once.
The clock is scripted, so the figures are exact."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from framework.callbacks.throughput import callback as throughput_callback


class Clock:
    """A stand-in for the `time` module whose time the test sets."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def run(monkeypatch, caplog, steps: int, step_s: float, wait_s: float, window: int = 10) -> list:
    """`steps` training batches of `step_s` seconds, each waited for `wait_s`, under the
    throughput callback with its default settings; the data-wait warnings logged."""
    clock = Clock()
    monkeypatch.setattr(throughput_callback, "time", clock)
    cfg = SimpleNamespace(window=window, count_flops=False, warn_data_wait=0.1)
    callback = throughput_callback.Throughput(cfg, data_ranks=1, configured_peak=None)
    loader = SimpleNamespace(dataset=torch.utils.data.TensorDataset(torch.zeros(1)), num_workers=0)
    trainer = SimpleNamespace(
        global_step=0,
        is_global_zero=True,
        strategy=SimpleNamespace(root_device=torch.device("cpu")),
        _logger_connector=SimpleNamespace(should_update_logs=False),
        loggers=[],
        train_dataloader=loader,
    )
    batch = (torch.zeros(32, 64), torch.zeros(32))
    callback.on_train_start(trainer, None)
    with caplog.at_level(logging.WARNING, logger="framework.throughput"):
        for i in range(steps):
            clock.now += wait_s
            callback.on_train_batch_start(trainer, None, batch, i)
            clock.now += step_s
            trainer.global_step += 1
            callback.on_train_batch_end(trainer, None, None, batch, i)
    return [r.getMessage() for r in caplog.records if "waits for data" in r.getMessage()]


def test_a_short_toy_run_is_quiet_though_the_wait_is_a_large_share(monkeypatch, caplog):
    """The default digits run: 22 steps of 1.8 ms, 0.72 ms of wait each (36% of the time)."""
    assert run(monkeypatch, caplog, steps=22, step_s=0.0018, wait_s=0.00072) == []


def test_a_long_run_with_a_loaders_fixed_cost_is_quiet(monkeypatch, caplog):
    """Thousands of such steps wait seconds in all, but under a millisecond a batch: more
    workers would not win it back."""
    assert run(monkeypatch, caplog, steps=3000, step_s=0.0018, wait_s=0.00072) == []


def test_a_loader_that_starves_the_step_is_named_once_when_the_wait_adds_up(monkeypatch, caplog):
    """64 ms a batch (32 samples of 2 ms) in a 2 ms step: windows of 10 wait 9 x 64 ms = 0.58 s
    each; the first is not judged, the second brings the total to 0.58 s, the third to 1.15 s."""
    warned = run(monkeypatch, caplog, steps=40, step_s=0.002, wait_s=0.064)
    assert len(warned) == 1, warned
    assert "Training waits for data 97% of the time" in warned[0]
    assert "the loader of TensorDataset with num_workers=0" in warned[0]
    # the same loader in a run that stops before a second of waiting is quiet
    caplog.clear()
    assert run(monkeypatch, caplog, steps=29, step_s=0.002, wait_s=0.064) == []
