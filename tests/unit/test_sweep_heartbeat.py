"""`fw sweep` on several machines: a trial whose sweep process died elsewhere (no process to look
up here) stops sending heartbeats, and the next sweep process marks it failed so another trial
takes its place; a trial that is still running keeps beating and stays."""

from __future__ import annotations

import time

import optuna
import pytest
from optuna.trial import TrialState

from framework.sweep.study import HOST, PID, fail_orphans, heartbeat, open_storage


def test_a_silent_trial_from_another_machine_is_failed_and_a_beating_one_stays(tmp_path, caplog):
    storage = open_storage(f"sqlite:///{tmp_path / 'optuna.db'}", heartbeat_s=1)
    study = optuna.create_study(study_name="s", storage=storage)
    trials = [study.ask(), study.ask()]
    for trial in trials:
        trial.set_user_attr(HOST, "another-machine")
        trial.set_user_attr(PID, 1)
    for trial in trials:  # both started; then the first one's sweep process dies
        storage.record_heartbeat(trial._trial_id)
    with heartbeat(study, trials[1], 1):
        time.sleep(4.5)  # past the grace period of three intervals
        fail_orphans(study)
        states = [t.state for t in study.get_trials(deepcopy=False)]
    assert states == [TrialState.FAIL, TrialState.RUNNING]
    assert "Trial 0 sent no heartbeat for three intervals" in caplog.text
    assert "another-machine" in caplog.text


class Killed(BaseException):
    """Stands for SIGKILL arriving while the sampler draws a trial's values."""


class KilledWhileDrawing(optuna.samplers.RandomSampler):
    def sample_independent(self, *args, **kwargs):
        raise Killed


def test_a_sweep_killed_while_drawing_leaves_a_trial_the_next_sweep_fails(
    tmp_path, caplog, monkeypatch
):
    """The trial is RUNNING from its first write; a kill before its values are drawn must still
    leave it marked with its sweep process, or no later sweep fails it and the search runs one
    trial short for ever."""
    from types import SimpleNamespace

    from framework.sweep import study as sweep_study

    storage = open_storage(f"sqlite:///{tmp_path / 'optuna.db'}", heartbeat_s=60)
    study = optuna.create_study(study_name="s", storage=storage, sampler=KilledWhileDrawing())
    search = SimpleNamespace(
        sweep_dir=tmp_path,
        trials=2,
        cfg=SimpleNamespace(seed=None),
        space={"lr": optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True)},
        study_name="s",
    )
    with pytest.raises(Killed):
        sweep_study.next_trial(study, search)
    (left,) = study.get_trials(deepcopy=False)
    assert left.state == TrialState.RUNNING

    monkeypatch.setattr(sweep_study, "alive", lambda pid: False)  # that process is gone
    fail_orphans(study)
    assert [t.state for t in study.get_trials(deepcopy=False)] == [TrialState.FAIL]
    assert "Trial 0 was running when its sweep process" in caplog.text
