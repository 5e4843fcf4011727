"""Under torchrun, a job without run.dir gets `runs/<torchrun run id>` (docs/cluster.md): every
process of the job computes the same directory, where a time stamp would differ between them.
The job is planned in this process with torchrun's environment (nothing is started)."""

from __future__ import annotations

from framework.runner import make_jobs


def test_without_run_dir_the_run_directory_is_named_by_the_torchrun_run_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for key, value in {
        "TORCHELASTIC_RUN_ID": "job-1234",
        "LOCAL_RANK": "0",
        "RANK": "0",
        "WORLD_SIZE": "1",
    }.items():
        monkeypatch.setenv(key, value)
    [job] = make_jobs(["trainer.max_steps=2"])
    assert job.run_dir == tmp_path / "runs" / "job-1234"
    assert list(tmp_path.iterdir()) == [], "planning writes nothing"
