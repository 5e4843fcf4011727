"""Files the framework writes: 0640, run directories 0750, and no symlink planted at a temporary
or lock path is ever followed (the file it points to stays as it was)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from framework import files
from framework.checkpoint import disk
from framework.sweep import study


def umask() -> int:
    current = os.umask(0o022)
    os.umask(current)
    return current


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file someone else owns and wants to stay as it is."""
    path = tmp_path / "victim"
    path.write_text("precious")
    return path


def test_a_symlink_at_the_temporary_path_is_not_followed(tmp_path, victim, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    # the old fixed temporary name, planted in advance
    (run / "config.yaml.tmp").symlink_to(victim)
    disk.write_text_atomic(run / "config.yaml", "a: 1\n")
    assert (run / "config.yaml").read_text() == "a: 1\n"
    assert victim.read_text() == "precious" and not (run / "config.yaml").is_symlink()
    # and the random name, were it guessed: refused, not followed
    monkeypatch.setattr(files.secrets, "token_hex", lambda n: "guessed")
    (run / ".run.json.guessed.tmp").symlink_to(victim)
    with pytest.raises(FileExistsError):
        disk.write_json_atomic(run / "run.json", {"run_id": "x"})
    assert victim.read_text() == "precious" and not (run / "run.json").exists()


def test_a_symlink_at_the_target_is_replaced_not_written_through(tmp_path, victim):
    (tmp_path / "summary.txt").symlink_to(victim)
    files.write_atomic(tmp_path / "summary.txt", "table")
    assert victim.read_text() == "precious"
    assert not (tmp_path / "summary.txt").is_symlink()


def test_the_sweep_lock_log_and_database_refuse_a_symlink(tmp_path, victim):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    for name in (".lock", "train.log"):
        (sweep / name).symlink_to(victim)
    with pytest.raises(OSError), study.locked(sweep):
        pass
    with pytest.raises(OSError):
        files.open_append(sweep / "train.log")
    (sweep / "optuna.db").symlink_to(victim)
    study.create_sqlite_file(f"sqlite:///{sweep / 'optuna.db'}")
    assert victim.read_text() == "precious"


def test_modes_of_what_the_framework_creates(tmp_path):
    mask = umask()
    run = files.make_dir(tmp_path / "a" / "run", files.dir_mode("0750"))
    assert run.stat().st_mode & 0o777 == 0o750 & ~mask
    files.write_atomic(run / "config.yaml", "a: 1\n")
    assert (run / "config.yaml").stat().st_mode & 0o777 == 0o640 & ~mask
    study.create_sqlite_file(f"sqlite:///{run / 'optuna.db'}")
    assert (run / "optuna.db").stat().st_mode & 0o777 == 0o640 & ~mask
    with study.locked(run):
        assert (run / ".lock").stat().st_mode & 0o777 == 0o640 & ~mask
    os.chmod(run, 0o700)
    files.make_dir(run, 0o755)
    assert run.stat().st_mode & 0o777 == 0o700, "an existing directory keeps its owner's mode"


def test_a_committed_checkpoint_is_narrowed_to_0640(tmp_path):
    ckpts = files.make_dir(tmp_path / "checkpoints", 0o750)
    tmp = ckpts / "step00000003.tmp"
    (tmp / "shard").mkdir(parents=True)
    for name in ("state.ckpt", "shard/0.distcp"):
        (tmp / name).write_bytes(b"x")
        os.chmod(tmp / name, 0o644)  # as torch.save leaves them under umask 022
    os.chmod(tmp / "shard", 0o755)
    os.chmod(tmp, 0o755)
    final = disk.commit(tmp, {"step": 3})
    modes = {p.name: p.stat().st_mode & 0o777 for p in [final, *final.rglob("*")]}
    assert modes["state.ckpt"] == modes["0.distcp"] == modes["meta.json"] == 0o640 & ~umask()
    assert modes["step00000003"] == modes["shard"] == 0o750
    assert disk.verify(final) is None


def test_under_umask_000_the_default_runs_folder_and_the_run_are_private(tmp_path, monkeypatch):
    """The missing parents of a run directory (the default `runs/`) are created with the run's
    mode, not the umask's 0777: nobody else can rename or plant a run in them."""
    from framework.runner import make_jobs, write_config

    monkeypatch.chdir(tmp_path)
    job = make_jobs([])[0]  # run.dir: runs/<date>_<time>
    old = os.umask(0)
    try:
        write_config(job)
    finally:
        os.umask(old)
    runs = tmp_path / "runs"
    for directory in (runs, job.run_dir, job.run_dir / "checkpoints"):
        assert directory.stat().st_mode & 0o777 == 0o750, directory
    for name in ("config.yaml", "run.json"):
        assert (job.run_dir / name).stat().st_mode & 0o777 == 0o640, name


def foreign(path: Path, monkeypatch) -> None:
    """Make `path` another user's: chown to nobody as root, else this process pretends to be
    another user."""
    if os.geteuid() == 0:
        os.chown(path, 65534, 65534)
    else:
        uid = os.geteuid()
        monkeypatch.setattr("framework.runner.os.geteuid", lambda: uid + 1)


def test_a_run_directory_owned_by_another_user_is_refused(workdir, monkeypatch, capsys):
    """Another local user can create the run directory first and plant a checkpoint that
    resume=auto would load: refused (exit 2) unless run.allow_foreign_dir=true says so."""
    from framework.runner import make_jobs
    from tests.conftest import refused

    run = workdir / "run"
    (run / "checkpoints").mkdir(parents=True)
    foreign(run, monkeypatch)
    err = refused([], workdir, monkeypatch, capsys)
    assert "run.dir=" in err and "is owned by another user" in err, err
    assert "run.allow_foreign_dir=true" in err
    assert not (run / "config.yaml").exists()
    job = make_jobs(["run.dir=run", "run.allow_foreign_dir=true"])[0]
    assert job.run_dir == run.resolve()
