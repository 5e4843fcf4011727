"""Who can reach a job: a local job's stores listen on loopback only (launch/rendezvous.py), and
so do `fw calibrate`'s; the multi-node token is in test_slurm.py, beside the other multi-node
jobs, and a stranger's forgeries in test_forged_rendezvous.py."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from framework.launch.signals import child_pids
from tests.conftest import FW, QUIET, fw_env
from tests.distributed.test_resume import start, wait_for_step


def listening(pids: list[int]) -> set[str]:
    """host:port of every TCP socket in LISTEN state that one of `pids` holds."""
    inodes = set()
    for pid in pids:
        fds = Path(f"/proc/{pid}/fd")
        for fd in fds.iterdir() if fds.is_dir() else []:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            # /proc prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.add(f"{socket.inet_ntop(family, raw)}:{int(port, 16)}")
    return found


def test_a_local_jobs_stores_listen_on_loopback_only(workdir):
    """The stores, and gloo's own sockets: gloo listens where the host name resolves (loopback
    on this machine, a network address on many), so the workers of a job on one machine get
    GLOO_SOCKET_IFNAME=lo (spawned here: their environment is readable in /proc)."""
    args = [
        "task._target_=tests.tasks.SlowDigitsTask",
        "+task.model.step_sleep=0.1",
        "trainer.devices=2",
        "trainer.max_steps=200",
        "trainer.log_every_n_steps=1",
        "launcher.start_method=spawn",
        *QUIET,
        "run.dir=run",
    ]
    proc = start(args, workdir)
    try:
        wait_for_step(workdir / "run", 1, proc)
        workers = child_pids(proc.pid)
        sockets = listening([proc.pid, *workers])
        environs = [Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") for pid in workers]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert len(sockets) >= 2, f"the rendezvous and the workers' stores at least: {sockets}"
    hosts = {ipaddress.ip_address(s.rpartition(":")[0]) for s in sockets}
    assert all(h.is_loopback for h in hosts), sockets
    assert len(environs) == 2 and all(b"GLOO_SOCKET_IFNAME=lo" in e for e in environs)


def test_fw_calibrate_listens_on_loopback_only(workdir):
    """Its measuring processes meet as a local job's workers do (it started `torchrun
    --standalone`, whose stores listen on every interface), and start as `python -P`: a
    torch.py where the command runs is not imported."""
    marker = workdir / "stray-torch-ran"
    (workdir / "torch.py").write_text(f"open({str(marker)!r}, 'w').close()\nraise SystemExit(1)\n")
    proc = subprocess.Popen(
        [str(FW), "calibrate", "--out", "calibration.json"],
        cwd=workdir,
        env=fw_env(),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    sockets: set[str] = set()
    tree: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            tree = [proc.pid, *child_pids(proc.pid)]
            tree += [pid for child in tree[1:] for pid in child_pids(child)]
            sockets |= listening(tree)
            if len(sockets) >= 2:  # the store, and a measuring process's own
                break
            time.sleep(0.2)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 10  # killed with fw calibrate (each has a session of its own)
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in tree[1:]):
        time.sleep(0.1)
    survivors = [pid for pid in tree[1:] if Path(f"/proc/{pid}/cmdline").exists()]
    for pid in survivors:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not survivors, "measuring processes outlived a killed fw calibrate"
    assert not marker.exists(), "a measuring process imported the stray torch.py"
    assert sockets, proc.stderr.read()[-3000:]
    hosts = {ipaddress.ip_address(s.rpartition(":")[0]) for s in sockets}
    assert all(h.is_loopback for h in hosts), sockets
