"""launcher.max_requeues: a job stopped by its SLURM signal requeues itself while it has
requeues left, then stops with a warning that says how to continue (the requeue itself, on a
real SLURM: tests/distributed/test_slurm.py)."""

from __future__ import annotations

import logging

from framework.launchers import slurm


def test_a_job_requeues_itself_until_max_requeues_then_stops(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(slurm.subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    with caplog.at_level(logging.WARNING, logger=slurm.log.name):
        for requeued in range(3):  # the first start, then two requeues, of max_requeues=2
            slurm.requeue(step=10 + requeued, requeued=requeued, max_requeues=2)
    assert calls == [["scontrol", "requeue", "4242"]] * 2
    assert "not requeued: launcher.max_requeues=2 reached" in caplog.records[-1].getMessage()
    assert "step 12" in caplog.records[-1].getMessage()
