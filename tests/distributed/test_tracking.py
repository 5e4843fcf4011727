"""W&B offline tracking follows the run; config checks on resume; secrets; export."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading

import pytest
import torch

from tests.conftest import QUIET, fw, fw_env

pytestmark = pytest.mark.slow


class ConnectionCounter:
    """A local TCP port standing in for the W&B server: counts connection attempts."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.sock.settimeout(0.2)
        self.count = 0
        self.running = True
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self) -> None:
        while self.running:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.count += 1
            conn.close()

    def close(self) -> None:
        self.running = False
        self.thread.join()
        self.sock.close()


def wandb_env(server: ConnectionCounter) -> dict[str, str]:
    env = fw_env()
    env.pop("WANDB_MODE", None)  # auto: no API key, so offline
    env.update(WANDB_BASE_URL=server.url, HOME=env.get("HOME", "/root"), WANDB_API_KEY="")
    return env


# A parent process that used W&B before starting the job (a script, a notebook): its service's
# token reaches the job through WANDB_SERVICE.
UNDER_A_WANDB_PARENT = [
    sys.executable,
    "-c",
    "import subprocess, sys, wandb; wandb.setup(); sys.exit(subprocess.call(sys.argv[1:]))",
]


def run_fw(args, cwd, env, timeout: float = 300, parent: list[str] = ()):
    from tests.conftest import FW

    return subprocess.run(
        [*parent, str(FW), "train", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        start_new_session=True,
    )


def test_wandb_offline_one_run_per_job_same_id_after_restart(workdir):
    """Also `log_model=all`: each committed checkpoint is recorded as a version of
    `model-<run id>` for `wandb sync`, carrying the run id, its step, and the metrics of the
    validation at its step (checkpoints every 3 steps are saved before that validation runs)."""
    server = ConnectionCounter()
    upload = ["logger.wandb.log_model=all", "callbacks.checkpoint.every_n_steps=3"]
    upload += ["trainer.val_check_interval=3", "run.dir=run", *QUIET]
    try:
        env = wandb_env(server)
        env["WANDB_DATA_DIR"] = str(workdir / "wandb-data")
        first = run_fw(["trainer.devices=2", "trainer.max_steps=6", *upload], workdir, env)
        assert first.returncode == 0, first.stderr[-3000:]
        assert "wandb sync" in first.stderr
        val_losses = [
            float(r.split(",")[3])
            for r in (workdir / "run" / "metrics.csv").read_text().splitlines()[1:]
            if r.split(",")[3]
        ]
        again = run_fw(["trainer.devices=2", "trainer.max_steps=12", *upload], workdir, env)
        assert again.returncode == 0, again.stderr[-3000:]
    finally:
        server.close()
    assert server.count == 0, "no network access may be attempted"
    runs = sorted((workdir / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2, "one W&B run directory per start, none per extra rank"
    run_id = (workdir / "run" / "run.json").read_text().split('"run_id": "')[1].split('"')[0]
    assert all(r.name.endswith(run_id) for r in runs), "a restart logs to the same run"
    log = next(runs[0].glob("run-*.wandb")).read_bytes()
    assert b"recipes.digits.task.DigitsTask" in log and b"max_steps" in log, (
        "the config is recorded"
    )
    jobs = [records(next(r.glob("run-*.wandb")), "artifact") for r in runs]
    metas = [[json.loads(a.metadata) for a in job] for job in jobs]
    assert [[m["step"] for m in job] for job in metas] == [[3, 6], [9, 12]]
    for job in jobs:
        assert {a.name for a in job} == {f"model-{run_id}"} and {a.type for a in job} == {"model"}
        assert all(a.manifest.contents for a in job), "the checkpoint's files are recorded"
    assert {m["run_id"] for job in metas for m in job} == {run_id}
    assert [m["metrics"]["val/loss"] for m in metas[0]] == pytest.approx(val_losses)
    assert [sorted(a.aliases) for a in jobs[1]] == [["latest", "step-9"], ["latest", "step-12"]]


def records(path, kind: str) -> list:
    """The records of one kind (run, artifact, ...) in an offline W&B run file (a
    leveldb-style log of protobuf records)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, pos, chunk, found = path.read_bytes(), 7, b"", []  # after the ':W&B' file header
    block = 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, size, piece = struct.unpack("<IHB", data[pos : pos + 7])
        chunk += data[pos + 7 : pos + 7 + size]
        pos += 7 + size
        if piece in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == kind:
                found.append(getattr(record, kind))
    return found


def run_record(path):
    found = records(path, "run")
    assert found, f"no run record in {path}"
    return found[0]


def test_online_with_an_unreachable_server_falls_back_to_offline(workdir, tmp_path):
    """An API key but no server (a local port that refuses): the job is not blocked beyond
    `init_timeout`, logs offline to the same run id, and finishes; also when started by a
    process that holds a W&B service of its own, which the job inherits and which keeps the
    failed online run's id."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: connections to it are refused
    env = fw_env()
    env.pop("WANDB_MODE", None)
    env.update(
        WANDB_API_KEY="0123456789abcdef0123456789abcdef01234567",
        WANDB_BASE_URL=f"http://127.0.0.1:{port}",
        HOME=str(tmp_path),
    )
    args = ["logger.wandb.mode=online", "logger.wandb.init_timeout=5", "trainer.max_steps=3"]
    result = run_fw([*args, *QUIET, "run.dir=run"], workdir, env, 90, UNDER_A_WANDB_PARENT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "W&B online init failed" in result.stderr and "logging offline instead" in result.stderr
    offline = list((workdir / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    run_id = (workdir / "run" / "run.json").read_text().split('"run_id": "')[1].split('"')[0]
    assert len(offline) == 1 and run_record(offline[0]).run_id == run_id


def test_multirun_jobs_share_one_wandb_group(workdir):
    env = fw_env()
    env["WANDB_MODE"] = "offline"
    result = run_fw(["-m", "seed=1,2", "trainer.max_steps=3", *QUIET], workdir, env)
    assert result.returncode == 0, result.stderr[-3000:]
    sweep = next((workdir / "runs").iterdir())
    runs = [run_record(next((sweep / n / "wandb").glob("offline-run-*/run-*.wandb"))) for n in "01"]
    assert [r.run_group for r in runs] == [sweep.name, sweep.name]
    assert runs[0].run_id != runs[1].run_id, "one W&B run per job"


def test_secrets_never_reach_disk_or_the_console(workdir, tmp_path):
    """A task with an `api_token` that calls save_hyperparameters, W&B offline, a W&B API key
    in the environment: neither value is in any file of the run, the working directory or
    HOME (checkpoint and W&B files included), nor on the console."""
    home = tmp_path / "home"
    home.mkdir()
    env = fw_env()
    env.update(WANDB_MODE="offline", WANDB_API_KEY="sk-live-0123456789abcdef", HOME=str(home))
    task = ["~task.model.dropout", "task.model.hidden=8", "+task.model.api_token=tok-secret-42"]
    common = [*task, "trainer.max_steps=3", "callbacks.checkpoint.every_n_steps=3", *QUIET]
    refused = run_fw(
        ["task._target_=tests.tasks.PlainDigits", *common, "run.dir=run"], workdir, env
    )
    # PlainDigits takes no api_token: refused before anything is written, the value not shown
    assert refused.returncode == 2 and not (workdir / "run").exists()
    assert "task.model.api_token=***: not an argument of PlainDigits" in refused.stderr
    result = run_fw(["task._target_=tests.tasks.TokenDigits", *common, "run.dir=run"], workdir, env)
    assert result.returncode == 0, result.stderr[-3000:]
    ckpt = workdir / "run" / "checkpoints" / "step00000003" / "state.ckpt"
    saved = torch.load(ckpt, weights_only=False)["hyper_parameters"]
    assert saved["api_token"] == "***" and saved["hidden"] == 8, "hyperparameters kept, redacted"
    assert list((workdir / "run" / "wandb").glob("offline-run-*/run-*.wandb")), "W&B wrote"
    for outputs in (refused, result):
        console = outputs.stdout + outputs.stderr
        assert "tok-secret-42" not in console and "sk-live-0123456789abcdef" not in console
    checked = 0
    for root in (workdir, home):
        for path in root.rglob("*"):
            if path.is_file():
                data = path.read_bytes()
                assert b"tok-secret-42" not in data and b"sk-live-0123456789abcdef" not in data, (
                    path
                )
                checked += 1
    assert checked > 10
    assert "api_token: '***'" in (workdir / "run" / "config.yaml").read_text()


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory):
    """A 4-step run of the default task that the tests below read and leave as it is."""
    run = tmp_path_factory.mktemp("four_steps") / "run"
    result = fw("train", "trainer.max_steps=4", *QUIET, f"run.dir={run}", cwd=run.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    return run


def test_resume_refuses_a_different_model_and_lists_harmless_changes(
    four_steps, workdir, monkeypatch, capsys
):
    from framework.cli import main  # the refusal in this process: it comes before any launch

    shutil.copytree(four_steps, workdir / "run", symlinks=True)
    args = ["trainer.max_steps=4", *QUIET, "run.dir=run"]
    monkeypatch.chdir(workdir)
    assert main(["train", *args, "task.model.hidden=64"]) == 2
    err = capsys.readouterr().err
    assert "task.model.hidden: 128 -> 64" in err and "Traceback" not in err, err
    ok = fw(
        "train",
        "trainer.max_steps=8",
        "trainer.log_every_n_steps=2",
        *QUIET,
        "run.dir=run",
        cwd=workdir,
    )
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert (
        "trainer.max_steps: 4 -> 8" in ok.stderr
        and "trainer.log_every_n_steps: 10 -> 2" in ok.stderr
    )


def test_resume_from_an_explicit_checkpoint_into_a_new_run(four_steps, workdir):
    b = fw(
        "train",
        "trainer.max_steps=6",
        f"resume={four_steps}/checkpoints/last",
        *QUIET,
        "run.dir=b",
        cwd=workdir,
    )
    assert b.returncode == 0, b.stderr[-3000:]
    assert "(step 4)" in b.stderr
    meta = (workdir / "b" / "checkpoints" / "last" / "meta.json").read_text()
    assert '"step": 6' in meta


def test_export_gives_a_plain_state_dict(four_steps, workdir, capsys):
    out = workdir / "model.pt"
    result = fw("export", str(four_steps), str(out), cwd=workdir)
    assert result.returncode == 0, result.stderr
    # loaded by plain torch, in a process that never imports the framework
    code = (
        "import sys, torch; s = torch.load(sys.argv[1], weights_only=True);"
        "assert 'framework' not in sys.modules; print(sorted(s))"
    )
    shown = subprocess.run(
        [sys.executable, "-c", code, str(out)], capture_output=True, text=True, check=True
    )
    assert "net.0.weight" in shown.stdout
    ckpt = torch.load(four_steps / "checkpoints" / "last" / "state.ckpt", weights_only=True)
    exported = torch.load(out, weights_only=True)
    assert all(torch.equal(exported[k], ckpt["state_dict"][k]) for k in exported)
    from framework.cli import main  # the next two in this process: the start-up is paid above

    assert main(["export", str(four_steps), str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["export", str(four_steps), str(out), "--force"]) == 0
