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


def stray(workdir, module: str):
    """A `module`.py in the working directory that leaves a marker when imported."""
    marker = workdir / f"stray-{module}-ran"
    (workdir / f"{module}.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nraise SystemExit('the stray {module}.py ran')\n"
    )
    return marker


def test_the_pythons_fw_starts_itself_import_no_stray_module(workdir, monkeypatch):
    """`fw plan --measure` runs each layout as `python -P -m framework.cli train ...`, and the
    Ray launcher probes the cluster with `python -P -c ...`: a torch.py or ray.py where the
    command runs is not imported (`fw calibrate`'s processes: test_listening.py)."""
    import subprocess

    from framework.launchers.ray.cluster import ask_gcs
    from framework.preflight.measure import measure_command
    from tests.conftest import fw_env

    torch_ran, ray_ran = stray(workdir, "torch"), stray(workdir, "ray")
    # trainer.devices=64: refused after torch is imported (the CPU count is checked)
    command = measure_command(["trainer.devices=64"], [], workdir / "run")
    done = subprocess.run(command, cwd=workdir, env=fw_env(), capture_output=True, text=True)
    assert done.returncode == 2 and "trainer.devices=64" in done.stderr, done.stderr[-2000:]
    assert not torch_ran.exists(), "fw plan --measure's fw train imported the stray torch.py"
    monkeypatch.chdir(workdir)
    ask_gcs("127.0.0.1:1", 4)  # nothing answers there; the probe is killed at the deadline
    assert not ray_ran.exists(), "the Ray probe imported the stray ray.py"
