"""A real one-node SLURM cluster on this machine, for the tests of launcher=slurm.

Debian's `slurm-wlm` and `munge` are installed with apt-get when missing (root only); munged,
slurmctld and slurmd are started by hand (no systemd here) with a slurm.conf in a temporary
directory, the machine's CPUs as the node's resources. Clients find it through `SLURM_CONF`.
SLURM's daemons listen on fixed ports (6817-6818): one cluster at a time on a machine.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = ("slurm-wlm", "munge")


def install() -> str | None:
    """Install SLURM and munge if missing; None when ready, else why not."""
    if shutil.which("slurmctld") and shutil.which("munged"):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "slurm-wlm and munge are not installed, and apt-get as root is not available"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    done = subprocess.run(
        ["apt-get", "install", "-y", "-q", *PACKAGES], env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        done = subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
        done = subprocess.run(
            ["apt-get", "install", "-y", "-q", *PACKAGES], env=env, capture_output=True, text=True
        )
    if done.returncode != 0 or not shutil.which("slurmctld"):
        return f"apt-get install {' '.join(PACKAGES)} failed: {done.stderr[-500:]}"
    return None


CONF = """\
ClusterName=fwtest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=5
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,sched_interval=1,bf_interval=1
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


class Cluster:
    """munged, slurmctld and slurmd running with the slurm.conf in `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.pids: list[int] = []

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def start(self) -> None:
        host = socket.gethostname().split(".")[0]
        for sub in ("state", "spool"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        cpus = os.cpu_count() or 1
        self.conf.write_text(CONF.format(host=host, root=self.root, cpus=cpus))
        run = Path("/run/munge")
        run.mkdir(parents=True, exist_ok=True)
        shutil.chown(run, "munge", "munge")
        if not _running("munged"):
            subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True)
        subprocess.run(["slurmctld", "-i", "-f", str(self.conf)], check=True)
        subprocess.run(["slurmd", "-f", str(self.conf)], check=True)
        for name in ("slurmctld.pid", "slurmd.pid"):
            self.pids.append(int(_wait_for(self.root / name).read_text()))
        env = {**os.environ, **self.env}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            out = subprocess.run(
                ["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True
            ).stdout
            if out.strip() in ("idle", "mixed"):
                return
            time.sleep(0.2)
        raise RuntimeError(f"the SLURM node did not become idle: {out!r}")

    def stop(self) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
        for pid in self.pids:
            deadline = time.monotonic() + 10
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)


def _wait_for(path: Path, timeout: float = 10) -> Path:
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text().strip():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not appear")
        time.sleep(0.05)
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _running(name: str) -> bool:
    return subprocess.run(["pgrep", "-x", name], capture_output=True).returncode == 0
