"""`fw` finds the user's modules in the working directory, but after the installed packages: a
stray `torch.py` there is not imported."""

from __future__ import annotations

import pytest

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


def stand_in_slurm(workdir):
    """A folder of stand-ins for `sbatch` (accepts job 4242, keeping the environment it was
    called with, which SLURM hands the job, in `sbatch.env` beside the script) and `srun` (runs
    its command as the job's one task, here): launcher=slurm without a SLURM cluster."""
    bin_dir = workdir.parent / "slurm-bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(
        '#!/bin/sh\nenv -0 > "$(dirname "$1")/sbatch.env"\necho "Submitted batch job 4242"\n'
    )
    (bin_dir / "srun").write_text(
        "#!/bin/sh\n"
        'while [ "${1#-}" != "$1" ]; do\n'  # srun's options, then the task's command
        '  case "$1" in --unbuffered) shift ;; *) shift 2 ;; esac\n'
        "done\n"
        'exec "$@"\n'
    )
    for tool in ("sbatch", "srun"):
        (bin_dir / tool).chmod(0o755)
    return bin_dir


def run_slurm_job(workdir, run_dir):
    """The submission script `fw train launcher=slurm` left, run as SLURM runs it on one node
    (in the directory the job was submitted from, with sbatch's environment and the variables
    SLURM gives a task)."""
    import subprocess

    kept = (run_dir / "slurm" / "sbatch.env").read_text().split("\0")
    env = {
        **dict(line.split("=", 1) for line in kept if "=" in line),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "train",
        "SLURM_NTASKS": "1",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_NNODES": "1",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_NODELIST": "localhost",
        "SLURM_TASKS_PER_NODE": "1",
        "MASTER_PORT": "29555",
    }
    script = run_dir / "slurm" / "4242_submission.sh"
    return subprocess.run(
        ["bash", str(script)], cwd=workdir, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_a_slurm_jobs_task_imports_no_stray_torch_py_and_finds_the_users_task(workdir):
    """launcher=slurm: sbatch runs the job in the directory `fw` was submitted from, and
    submitit's `python -m submitit.core._submit` would put that directory first on sys.path:
    the task's Python runs with -P and appends it, so the user's task trains and torch is
    torch."""
    import os
    import subprocess

    from tests.conftest import FW, fw_env

    bin_dir = stand_in_slurm(workdir)
    marker = stray(workdir, "torch")
    (workdir / "my_task.py").write_text(USER_TASK)
    args = ["task._target_=my_task.WideDigits", "~task.model.dropout", "+task.model.width=7"]
    job = ["launcher=slurm", "trainer.max_steps=2", "run.dir=run", *QUIET]
    env = {**fw_env(), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    submitted = subprocess.run(
        [str(FW), "train", *args, *job], cwd=workdir, env=env, capture_output=True, text=True
    )
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    assert not marker.exists(), "fw imported the stray torch.py"
    done = run_slurm_job(workdir, workdir / "run")
    assert not marker.exists(), "the SLURM task imported the stray torch.py"
    assert done.returncode == 0, done.stderr[-3000:]
    assert (workdir / "run" / "checkpoints" / "step00000002").is_dir(), "the user's task trained"


@pytest.mark.slow
def test_ray_ranks_import_no_stray_torch_py_and_find_the_users_task(workdir):
    """launcher=ray (a Ray cluster started on this machine): Ray puts the directory its driver
    connects from first on every worker's sys.path; `fw` connects from a neutral one and each
    worker appends the user's: the rank trains the user's task, and torch is torch."""
    marker = stray(workdir, "torch")
    (workdir / "my_task.py").write_text(USER_TASK)
    args = ["task._target_=my_task.WideDigits", "~task.model.dropout", "+task.model.width=7"]
    job = ["launcher=ray", "launcher.address=local", "trainer.max_steps=2", "run.dir=run"]
    result = fw("train", *args, *job, *QUIET, cwd=workdir)
    assert not marker.exists(), "a Ray worker imported the stray torch.py"
    assert result.returncode == 0, result.stderr[-3000:]
    assert (workdir / "run" / "checkpoints" / "step00000002").is_dir(), "the user's task trained"


USER_ENCODER = """
def where():
    import torch

    return torch.__file__
"""


@pytest.mark.slow
def test_ray_preparation_workers_import_no_stray_torch_py_and_find_the_users_encoder(workdir):
    """`fw prepare --engine ray` (its Ray, on this machine): a Ray task runs a function of the
    user's module, as the workers run a data module's encoder: found, and torch is torch."""
    import subprocess

    from framework.processes import python
    from tests.conftest import fw_env

    marker = stray(workdir, "torch")
    (workdir / "my_encoder.py").write_text(USER_ENCODER)
    driver = (
        "import os, sys\n"
        "sys.path.append(os.getcwd())  # as fw does\n"
        "import ray, my_encoder\n"
        "from framework.data.ray_engine import ray_cluster\n"
        "with ray_cluster(1):\n"
        "    print(ray.get(ray.remote(my_encoder.where).remote()))\n"
    )
    env = {key: value for key, value in fw_env().items() if key != "RAY_ADDRESS"}
    done = subprocess.run(
        python("-c", driver), cwd=workdir, env=env, capture_output=True, text=True, timeout=300
    )
    assert not marker.exists(), "a Ray worker imported the stray torch.py"
    assert done.returncode == 0, done.stderr[-3000:]
    assert "site-packages" in done.stdout.strip().splitlines()[-1], done.stdout
