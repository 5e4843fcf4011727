"""`fw` finds the user's modules in the working directory, but after the installed packages: a
stray `torch.py` there is not imported."""

from __future__ import annotations

from tests.conftest import QUIET, fw

USER_TASK = """
import torch  # the installed torch, not the torch.py beside this file

from tests.tasks import PlainDigits


class WideDigits(PlainDigits):
    def __init__(self, hidden: int = 32, lr: float = 0.01, width: int = 5) -> None:
        super().__init__(hidden=hidden, lr=lr)
        self.width = torch.tensor(width)
"""


def test_a_torch_py_in_the_working_directory_is_not_imported(workdir):
    marker = workdir / "stray-torch-ran"
    (workdir / "torch.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nraise SystemExit('the stray torch.py ran')\n"
    )
    (workdir / "my_task.py").write_text(USER_TASK)
    args = ["task._target_=my_task.WideDigits", "~task.model.dropout", "+task.model.width=7"]
    result = fw("config", *args, cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not marker.exists(), "the stray torch.py was imported"
    # the user's module next to the command was found: `fw config` shows its signature
    assert "width: 7  # int" in result.stdout, result.stdout


def test_spawned_workers_import_neither_a_stray_torch_py_and_find_the_users_task(workdir):
    """Workers started as fresh interpreters (`launcher.start_method=spawn`, CUDA's default)
    run with -P, then append the working directory: the user's task trains, torch is torch."""
    marker = workdir / "stray-torch-ran"
    (workdir / "torch.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nraise SystemExit('the stray torch.py ran')\n"
    )
    (workdir / "my_task.py").write_text(USER_TASK)
    args = ["task._target_=my_task.WideDigits", "~task.model.dropout", "+task.model.width=7"]
    job = ["trainer.devices=2", "launcher.start_method=spawn", "trainer.max_steps=2", "run.dir=run"]
    result = fw("train", *args, *job, *QUIET, cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not marker.exists(), "a worker imported the stray torch.py"
    assert (workdir / "run" / "checkpoints" / "step00000002").is_dir(), "the user's task trained"
