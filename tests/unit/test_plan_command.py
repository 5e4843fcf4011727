"""`fw plan` as a user runs it (`framework.cli.main`, in this process): the table and exit 0
when a layout fits, exit 2 with one line after the table when none does, and its usage errors
(the layouts themselves: tests/unit/test_preflight.py)."""

from __future__ import annotations

import pytest

from framework.cli import main

TINY = ["experiment=gpt_tiny", "task.data.batch_size=8"]


def run(args: list[str], capsys) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_job_that_fits_prints_the_recommended_command_and_exits_0(capsys):
    code, out, err = run(["--gpus", "2", "--gpu-mem", "80GB", *TINY], capsys)
    assert code == 0, err
    recommended = next(line for line in out.splitlines() if line.startswith("*"))
    assert "fw train experiment=gpt_tiny task.data.batch_size=8" in recommended


def test_a_job_that_fits_nowhere_exits_2_after_the_table(capsys):
    code, out, err = run(["--gpus", "2", "--gpu-mem", "1MB", *TINY], capsys)
    assert code == 2, err
    assert "Left out:" in out, "the table says why each layout was left out"
    assert err.startswith("error: --gpu-mem=1MB: no layout of the job over 2 GPUs passes")
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpu-mem", "80GB"], "--gpus=None: needs the number of GPUs"),
        (["--gpus", "two", "--gpu-mem", "80GB"], "--gpus=two: needs the number of GPUs"),
        (["--gpus", "2"], "--gpu-mem=None: needs the memory of one GPU"),
        (["--gpus", "2", "--gpu-mem", "lots"], "--gpu-mem=lots: is not a memory size"),
        (["--gpus", "2", "--gpu-mem", "80GB", "-m", "seed=1,2"], "fw plan plans one job"),
        (["--gpus", "2", "--gpu-mem", "80GB", "trainer.no_such_key=1"], "no such key"),
    ],
)
def test_bad_plan_arguments_exit_2_with_one_line(args, message, capsys):
    code, _, err = run([*args, *TINY], capsys)
    assert code == 2 and message in err, err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
