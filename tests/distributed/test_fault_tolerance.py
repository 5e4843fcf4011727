"""Replica-level fault tolerance (`strategy=ddp strategy.fault_tolerance=torchft`).

Three `fw train` commands are three replica groups of one process each, on one torchft lighthouse
started by this test. Group 2 is killed with -9 while the three step together: groups 0 and 1
keep stepping with 2 groups (their processes never restart and read no checkpoint: none exists
yet); the same command started again heals group 2 from a live peer (no checkpoint on disk
to read, no "Resuming from"), and the three end the run together with bitwise equal weights,
both in their final checkpoints and at every step all three trained; the healed group logs
each step it trained once, with the others' learning rate, and no other step. Bad settings are refused
before launch with exit 2."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
import torchft  # noqa: F401 (the torchft extra: missing, these fail, not skip)

from recipes.digits.task import DigitsTask
from tests.conftest import FW, QUIET, fw_env, losses, read_metrics, refused

STEPS = 24
HOLD = 14  # the groups wait at this step until the test has started group 2 again
GROUPS = 3


class PacedDigits(DigitsTask):
    """Digits that sleeps `step_sleep` a step and appends `step digest time` after each step to
    `<out>/<run dir name>.txt` (the digest: SHA-256 of the parameters' bytes).
    Before a batch reaches the strategy, so before it asks for a quorum, it waits while
    `<out>/go` is missing, and at step `hold_step` while `<out>/hold` exists."""

    def __init__(self, out: str, hidden: int = 32, step_sleep: float = 0.15, hold_step: int = 0):
        super().__init__(hidden=hidden)
        self.out, self.step_sleep, self.hold_step = Path(out), step_sleep, hold_step

    def on_before_batch_transfer(self, batch, dataloader_idx):
        deadline = time.monotonic() + 120
        while not (self.out / "go").exists() or (
            self.trainer.global_step == self.hold_step and (self.out / "hold").exists()
        ):
            assert time.monotonic() < deadline, "never released"
            time.sleep(0.05)
        time.sleep(self.step_sleep)
        return batch

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        data = b"".join(p.detach().numpy().tobytes() for p in self.parameters())
        name = Path(self.trainer.default_root_dir).name
        with open(self.out / f"{name}.txt", "a") as fh:
            digest = hashlib.sha256(data).hexdigest()
            fh.write(f"{self.trainer.global_step} {digest} {time.time():.3f}\n")


def group_args(out: Path, lighthouse: str, group: int) -> list[str]:
    return [
        "task=digits",
        "task._target_=tests.distributed.test_fault_tolerance.PacedDigits",
        "~task.model.dropout",
        f"+task.model.out={out}",
        f"+task.model.hold_step={HOLD}",
        "task.data.batch_size=32",
        "task.scheduler.name=linear",  # an lr that changes every step: logged as the peers'
        f"trainer.max_steps={STEPS}",
        "trainer.log_every_n_steps=1",
        "trainer.limit_val_batches=0",
        "logger=[csv]",
        "callbacks.checkpoint.every_n_steps=1000",  # only the final one: nothing to resume from
        "strategy=ddp",
        "trainer.devices=1",
        "strategy.fault_tolerance=torchft",
        f"strategy.lighthouse={lighthouse}",
        f"strategy.replica_groups={GROUPS}",
        f"strategy.replica_group={group}",
        "strategy.fault_timeout_s=20",
        f"run.dir=g{group}",
        *QUIET,
    ]


def start(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [str(FW), "train", *args],
        cwd=cwd,
        env={**fw_env(), "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def follow(proc: subprocess.Popen) -> list[str]:
    """The lines of a process's stderr, read as they come (in a thread)."""
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    return lines


def wait_for(check, what: str, procs, lines, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        for p, said in zip(procs, lines, strict=True):
            assert p.poll() is None, f"{what}: a group ended: " + "".join(said)[-3000:]
        assert time.monotonic() < deadline, f"{what}: timed out"
        time.sleep(0.05)


def records(out: Path, group: int) -> list[tuple[int, str, float]]:
    """(step, digest, time) of each step the group finished, in order."""
    path = out / f"g{group}.txt"
    if not path.exists():
        return []
    lines = [line.split() for line in path.read_text().splitlines()]
    return [(int(step), digest, float(when)) for step, digest, when in lines]


def last_step(out: Path, group: int) -> int:
    found = records(out, group)
    return found[-1][0] if found else -1


def start_lighthouse(min_replicas: int):
    """A torchft lighthouse in this process: a quorum of whoever is there after 1 s, of at
    least `min_replicas` groups."""
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=1000)
    return server, "localhost:" + server.address().rsplit(":", 1)[1]


@pytest.fixture
def lighthouse():
    server, address = start_lighthouse(1)
    yield address
    server.shutdown()


@pytest.mark.slow
def test_a_killed_replica_group_rejoins_from_a_live_peer(workdir, lighthouse):
    out = workdir / "records"
    out.mkdir()
    (out / "hold").touch()
    procs = [start(group_args(out, lighthouse, g), workdir) for g in range(GROUPS)]
    lines = [follow(p) for p in procs]
    joined = lambda said: any("joins the lighthouse" in x for x in said)  # noqa: E731
    try:
        ready = lambda: all(joined(said) for said in lines)  # noqa: E731
        wait_for(ready, "the three groups start", procs, lines, timeout=120)
        (out / "go").touch()  # the first quorum: the three groups
        # a few steps of the three together (a group that missed the first quorum healed in)
        wait_for(lambda: last_step(out, 2) >= 5, "the groups step", procs, lines, timeout=60)
        killed = time.time()
        os.killpg(procs[2].pid, signal.SIGKILL)  # the whole group: fw and its worker
        procs[2].wait(timeout=30)
        killed_at = last_step(out, 2)
        survivors, lines = procs[:2], lines[:2]
        on = lambda: min(last_step(out, g) for g in (0, 1)) >= HOLD  # noqa: E731
        wait_for(on, "groups 0 and 1 go on without group 2", survivors, lines, timeout=60)
        assert not list((workdir / "g2" / "checkpoints").glob("step*")), "nothing on disk"
        restarted = time.time()
        again = start(group_args(out, lighthouse, 2), workdir)  # the same command
        procs, lines = [*survivors, again], [*lines, follow(again)]
        wait_for(lambda: joined(lines[2]), "group 2 starts again", procs, lines, timeout=120)
        released = time.time()
        (out / "hold").unlink()
        ends = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    errs = ["".join(x) for x in lines]
    assert ends == [0, 0, 0], "\n---\n".join(e[-3000:] for e in errs)
    assert not any("Resuming from" in e for e in errs), "no group read a checkpoint"
    for said in errs[:2]:  # never started again by the launcher either
        assert said.count("joins the lighthouse") == 1, said[-3000:]
    healed = re.findall(r"healed from a live peer at step (\d+)", errs[2])
    assert healed and int(healed[0]) >= HOLD, errs[2][-3000:]

    # groups 0 and 1 stepped on past the kill with 2 groups, then with 3 again
    groups = {
        int(r["step"]): int(float(r["torchft/replica_groups"]))
        for r in read_metrics(workdir / "g0")
        if r.get("torchft/replica_groups")
    }
    assert sorted(groups) == list(range(STEPS)), "every step logged once"
    # group 2 had done `killed_at` steps, the last of them with 3 groups; it died in the next
    # one (dropped, or done by 2); groups 0 and 1 go on alone up to the hold
    shape = [groups[killed_at - 1], *{groups[s] for s in range(killed_at + 1, HOLD)}]
    assert shape == [3, 2], f"3 groups, then 2 after the kill at {killed_at}: {groups}"
    assert groups[STEPS - 1] == 3, f"group 2 back by the end: {groups}"

    # group 2's metrics.csv (rewritten by the restarted command): a row at each step it trained
    # after the heal and at no other, each with the learning rate the others had at that step
    rows = {int(r["step"]): r for r in read_metrics(workdir / "g0")}
    again = [int(r["step"]) for r in read_metrics(workdir / "g2")]
    assert again == list(range(int(healed[0]), STEPS)), f"group 2 logged steps {again}"
    for r in read_metrics(workdir / "g2"):
        assert r["lr-AdamW"] == rows[int(r["step"])]["lr-AdamW"], r

    # the same weights everywhere: at every step all three trained, and in the final checkpoints
    digests = [{step: d for step, d, _ in records(out, g)} for g in range(GROUPS)]
    rejoined = [s for s in digests[2] if s > killed_at]
    assert rejoined and min(rejoined) > HOLD, f"group 2 healed to the others' step: {rejoined}"
    common = set(digests[0]) & set(digests[1]) & set(digests[2])
    assert set(rejoined) <= common and STEPS in common
    for step in sorted(common):
        assert digests[0][step] == digests[1][step] == digests[2][step], f"step {step}"
    report(out, killed, restarted, released)
    finals = [final_weights(workdir / f"g{g}") for g in range(GROUPS)]
    for name, tensor in finals[0].items():
        for other in finals[1:]:
            assert torch.equal(tensor, other[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_groups_of_two_processes_train_as_one_ddp_job_of_four(strategy, workdir, one_process):
    """2 groups x 2 processes (ddp or fsdp inside each, torchft across: under fsdp each process
    averages its gradient shards with the same rank of the other group) with batch 8 a process:
    the mean of the groups' losses is the one-process run's with the global batch of 32 (which
    a 4-process ddp job reproduces: test_ddp.py), and the groups end with equal weights."""
    server, address = start_lighthouse(2)  # the first quorum waits for both groups
    args = [
        "task=digits",
        "task.data.batch_size=8",
        "trainer.max_steps=20",
        "trainer.deterministic=true",
        "trainer.log_every_n_steps=1",
        "logger=[csv]",
        "callbacks.checkpoint.every_n_steps=1000",  # the final one only
        f"strategy={strategy}",
        "trainer.devices=2",
        "strategy.fault_tolerance=torchft",
        f"strategy.lighthouse={address}",
        "strategy.replica_groups=2",
        "strategy.min_replicas=2",
        "strategy.fault_timeout_s=30",
        *QUIET,
    ]
    procs = [
        start([*args, f"strategy.replica_group={g}", f"run.dir=g{g}"], workdir) for g in (0, 1)
    ]
    lines = [follow(p) for p in procs]  # read as they come: neither group blocks on its pipe
    try:
        ends = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        server.shutdown()
    assert ends == [0, 0], "\n---\n".join("".join(x)[-3000:] for x in lines)
    ref = one_process["digits"]
    mean = [losses(workdir / "g0"), losses(workdir / "g1")]
    assert sorted(mean[0]) == sorted(mean[1]) == sorted(ref) == list(range(20))
    for step in range(20):
        both = (mean[0][step] + mean[1][step]) / 2
        assert abs(both - ref[step]) <= 1e-5, (step, both, ref[step])
    finals = [final_weights(workdir / f"g{g}") for g in (0, 1)]
    for name, tensor in finals[0].items():
        assert torch.equal(tensor, finals[1][name]), name


def report(out: Path, killed: float, restarted: float, released: float) -> None:
    """What recovery took (printed; pytest -s shows it): the survivors' steps around the kill,
    and group 2's start and heal."""
    times = [when for _, _, when in records(out, 0)]
    gaps = sorted(b - a for a, b in zip(times, times[1:], strict=False))
    after = next(when for _, _, when in records(out, 0) if when > killed)
    healed = next(when for _, _, when in records(out, 2) if when > restarted)
    print(
        f"\ntorchft: median step {gaps[len(gaps) // 2]:.2f} s; kill -> group 0's next step "
        f"{after - killed:.2f} s; restart -> group 2 joins {released - restarted:.2f} s, "
        f"-> its first (healed) step {healed - restarted:.2f} s"
    )


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    """The full weights of the run's newest checkpoint (any layout: ddp's file, fsdp's DCP)."""
    from framework.checkpoint.load import read_whole

    (last,) = sorted((run / "checkpoints").glob("step*"))[-1:]
    return read_whole(last).model


GOOD = [
    "task=digits",
    "strategy=ddp",
    "trainer.devices=1",
    "strategy.fault_tolerance=torchft",
    "strategy.replica_groups=2",
    *QUIET,
]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ([*GOOD, "trainer.num_nodes=2"], "trainer.num_nodes=2: strategy.fault_tolerance=torchft"),
        ([*GOOD], "strategy.fault_tolerance=torchft needs the address of a running torchft"),
        ([*GOOD, "strategy.replica_group=2"], "strategy.replica_group=2: groups are numbered"),
        ([*GOOD, "strategy.min_replicas=3"], "strategy.min_replicas=3: more than"),
    ],
    ids=["nodes", "no-lighthouse", "group", "min-replicas"],
)
def test_bad_settings_are_refused_before_launch(args, says, workdir, monkeypatch, capsys):
    err = refused(args, workdir, monkeypatch, capsys)
    assert says in err, err


def test_no_lighthouse_there_and_torchft_missing_are_refused(workdir, monkeypatch, capsys):
    import importlib.util
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [*GOOD, f"strategy.lighthouse=127.0.0.1:{port}"]
    err = refused(args, workdir, monkeypatch, capsys)
    assert f"strategy.lighthouse=127.0.0.1:{port}: no lighthouse answers there" in err, err
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a)
    )
    err = refused(args, workdir, monkeypatch, capsys)
    assert "torchft is not installed" in err and "framework[torchft]" in err, err
