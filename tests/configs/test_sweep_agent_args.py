"""What a W&B sweep agent hands `fw train`: `--KEY=VALUE` arguments (its `${args}`) mean the same
as `KEY=VALUE` (`${args_no_hyphens}`), and the run takes the id the agent chose."""

from __future__ import annotations

import json

from framework.cli import main, parse_args


def test_hyphenated_and_plain_overrides_compose_the_same_config(capsys, workdir):
    assert parse_args(["--task.optimizer.lr=0.01", "-m"])[:3] == (
        True,
        [],
        ["task.optimizer.lr=0.01"],
    )
    assert main(["config", "--task.optimizer.lr=0.01", "--trainer.max_steps=7"]) == 0
    hyphens = capsys.readouterr().out
    assert main(["config", "task.optimizer.lr=0.01", "trainer.max_steps=7"]) == 0
    plain = capsys.readouterr().out
    assert hyphens == plain and "lr: 0.01" in plain and "max_steps: 7" in plain
    assert main(["config", "--trainer.max_step=7"]) == 2, "still checked like any override"
    assert "trainer.max_step" in capsys.readouterr().err


def test_a_single_run_adopts_the_agents_run_id_and_a_multirun_does_not(workdir, monkeypatch):
    from framework.runner import make_jobs, write_config

    monkeypatch.chdir(workdir)
    monkeypatch.setenv("WANDB_RUN_ID", "swp12345")
    (job,) = make_jobs(["trainer.max_steps=1", "run.dir=single"])
    write_config(job)
    assert json.loads((job.run_dir / "run.json").read_text())["run_id"] == "swp12345"
    jobs = make_jobs(["trainer.max_steps=1", "seed=1,2", "run.dir=sweep"], multirun=True)
    ids = set()
    for each in jobs:
        write_config(each)
        ids.add(json.loads((each.run_dir / "run.json").read_text())["run_id"])
    assert len(ids) == 2 and "swp12345" not in ids
