"""Bad input through `fw`: exit code 2, one short paragraph, no traceback, nothing on disk."""

from __future__ import annotations

import os
import re

import pytest

from tests.conftest import fw, tree

TOO_MANY = (os.cpu_count() or 1) * 2 + 1  # launcher.processes_per_core=2 allows twice the cores

CASES = {
    "unknown group option": (["strategy=dpp"], ["strategy=dpp", "ddp"]),
    "misspelled key": (["trainer.max_step=5"], ["trainer.max_step", "max_steps"]),
    "wrong type": (["trainer.max_steps=lots"], ["trainer.max_steps", "lots"]),
    "too many devices": (
        ["trainer.accelerator=cpu", f"trainer.devices={TOO_MANY}"],
        [f"trainer.devices={TOO_MANY}", "more CPU processes than this machine allows"],
    ),
    "missing data file": (
        ["task=gpt", "task.data.path=/no/such/corpus.txt"],
        ["task.data.path", "/no/such/corpus.txt"],
    ),
    "unknown task class": (
        ["task._target_=recipes.digits.task.DigitTask"],
        ["task._target_", "DigitsTask"],
    ),
    "bad override syntax": (["trainer.max_steps"], ["trainer.max_steps", "key=value"]),
    "heads not dividing width": (
        ["task=gpt", "task.model.n_head=3"],
        ["task.model.n_head=3", "n_embd=128"],
    ),
    "unknown option flag": (["--fast"], ["--fast", "--multirun"]),
    "sweep without -m": (["seed=1,2"], ["-m"]),
}


def in_process(args: list[str], cwd, monkeypatch, capsys) -> tuple[int, str]:
    """`fw ARGS` run in this process (the `fw` start-up is paid once, by the test below): its
    exit code and what it printed on stderr."""
    from framework.cli import main

    monkeypatch.chdir(cwd)
    code = main(args)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_bad_input_exits_2_with_one_paragraph(case, workdir, monkeypatch, capsys):
    args, expected = CASES[case]
    code, err = in_process(["train", *args, f"run.dir={workdir}/run"], workdir, monkeypatch, capsys)
    assert code == 2, err
    err = err.strip()
    assert "Traceback" not in err
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    for text in expected:
        assert text in err
    assert tree(workdir) == set(), "nothing may be created on a config error"


def test_the_fw_process_exits_2_with_the_paragraph_alone(workdir):
    """The same through the `fw` console script: the process's exit code and its stderr."""
    args, expected = CASES["heads not dividing width"]
    result = fw("train", *args, f"run.dir={workdir}/run", cwd=workdir)
    assert result.returncode == 2, result.stderr
    err = result.stderr.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert all(text in err for text in expected)
    assert tree(workdir) == set(), "nothing may be created on a config error"


def test_unwritable_run_dir(workdir, monkeypatch, capsys):
    # /proc refuses new directories even to root, unlike a chmod-ed folder.
    code, err = in_process(["train", "run.dir=/proc/fw-test-run"], workdir, monkeypatch, capsys)
    assert code == 2, err
    assert "run.dir=/proc/fw-test-run" in err and "not writable" in err
    assert tree(workdir) == set()


def test_run_dir_under_a_file_is_refused(workdir, monkeypatch, capsys):
    blocker = workdir / "file"
    blocker.write_text("keep me")
    code, err = in_process(["train", f"run.dir={blocker}/run"], workdir, monkeypatch, capsys)
    assert code == 2 and "run.dir" in err and "Traceback" not in err
    assert blocker.read_text() == "keep me"


def test_existing_run_is_not_overwritten_with_resume_never(workdir, monkeypatch, capsys):
    run = workdir / "run"
    run.mkdir()
    (run / "config.yaml").write_text("seed: 7\n")
    code, err = in_process(
        ["train", f"run.dir={run}", "resume=never"], workdir, monkeypatch, capsys
    )
    assert code == 2 and "already holds a run" in err
    assert (run / "config.yaml").read_text() == "seed: 7\n"


def test_help_lists_groups_and_config_shows_descriptions():
    result = fw("train", "--help")
    assert result.returncode == 0
    for group in (
        "task",
        "strategy",
        "trainer",
        "logger",
        "callbacks",
        "launcher",
        "experiment",
        "debug",
    ):
        assert f"  {group}" in result.stdout
    shown = fw("config", "task=gpt")
    assert shown.returncode == 0
    assert "max_steps: -1  # Stop after this many optimizer steps" in shown.stdout
    assert "n_layer: 4  # int" in shown.stdout


def subcommands() -> list[str]:
    """Every command the CLI names: in `fw --help` (its `fw NAME` and `fw A|B|C` lines) and in
    its table of per-command help; a command added to either is covered here."""
    from framework.cli import COMMAND_HELP, USAGE

    named = re.findall(r"^(?:usage: |\s+)fw ([a-z|]+) ", USAGE, re.MULTILINE)
    return sorted({c for line in named for c in line.split("|")} | set(COMMAND_HELP))


SUBCOMMANDS = subcommands()


def test_the_help_names_every_command_fw_runs(capsys):
    """The commands an unknown command is told to choose from (those `fw` dispatches) are the
    ones its help names, so the test below reaches every one of them."""
    from framework.cli import main

    assert main(["no-such-command"]) == 2
    err = capsys.readouterr().err
    choices = err.split("Valid choices: ", 1)[1].strip().rstrip(".").split(", ")
    assert sorted(choices) == SUBCOMMANDS, err


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_answers_help_without_composing_a_job(
    command, capsys, monkeypatch, tmp_path
):
    from framework.cli import main

    monkeypatch.chdir(tmp_path)
    for flag in ("--help", "-h"):
        assert main([command, flag]) == 0, capsys.readouterr().err
        out = capsys.readouterr()
        assert out.out.startswith(f"usage: fw {command} "), out.out[:300]
        assert out.err == "", "no error, no log of a job"
        assert "rank  role" not in out.out and "_target_:" not in out.out, "no job was composed"
    assert list(tmp_path.iterdir()) == [], "nothing written"
