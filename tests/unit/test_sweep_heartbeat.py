"""`fw sweep` on several machines: a trial whose sweep process died elsewhere (no process to look
up here) stops sending heartbeats, and the next sweep process marks it failed so another trial
takes its place; a trial that is still running keeps beating and stays."""

from __future__ import annotations

import time

import pytest

optuna = pytest.importorskip("optuna")

from optuna.trial import TrialState  # noqa: E402

from framework.sweep.study import HOST, PID, fail_orphans, heartbeat, open_storage  # noqa: E402


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
