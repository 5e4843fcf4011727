"""`fw` finds the user's modules in the working directory, but after the installed packages: a
stray `torch.py` there is not imported."""

from __future__ import annotations

from tests.conftest import fw

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
