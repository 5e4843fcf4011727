"""A real two-node SLURM cluster on this machine, for the tests of launcher=slurm.

Debian's `slurm-wlm` and `munge` are installed with apt-get when missing (root only); munged,
slurmctld and one slurmd per node are started by hand (no systemd here) with a slurm.conf in a
temporary directory, the machine's CPUs as each node's resources. The two nodes are two slurmd
daemons on this machine (`slurmd -N NAME`, each on its own port, spool, pid and log file: SLURM
expands `%n` to the node's name), named by the machine's host name and `localhost`, two names
that resolve to this machine, so a job's node list names hosts its tasks can reach. A job that
asks for one node runs on the first. Clients find it through `SLURM_CONF`. SLURM's daemons
listen on fixed ports (6817, 6818 and 6820): one cluster at a time on a machine.
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
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
NodeName={host} NodeAddr=127.0.0.1 Port=6818 CPUs={cpus} RealMemory=8000 State=UNKNOWN
NodeName=localhost NodeAddr=127.0.0.1 Port=6820 CPUs={cpus} RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes={host},localhost Default=YES MaxTime=INFINITE State=UP
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
        self.nodes = [host, "localhost"]
        (self.root / "state").mkdir(parents=True, exist_ok=True)
        for node in self.nodes:
            (self.root / "spool" / node).mkdir(parents=True, exist_ok=True)
        cpus = os.cpu_count() or 1
        self.conf.write_text(CONF.format(host=host, root=self.root, cpus=cpus))
        run = Path("/run/munge")
        run.mkdir(parents=True, exist_ok=True)
        shutil.chown(run, "munge", "munge")
        if not _running("munged"):
            subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True)
        subprocess.run(["slurmctld", "-i", "-f", str(self.conf)], check=True)
        for node in self.nodes:
            subprocess.run(["slurmd", "-f", str(self.conf), "-N", node], check=True)
        names = ["slurmctld.pid", *(f"slurmd-{node}.pid" for node in self.nodes)]
        for name in names:
            self.pids.append(int(_wait_for(self.root / name).read_text()))
        env = {**os.environ, **self.env}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            out = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%T"], env=env, capture_output=True, text=True
            ).stdout
            if len(out.split()) == len(self.nodes) and set(out.split()) <= {"idle", "mixed"}:
                return
            time.sleep(0.2)
        raise RuntimeError(f"the SLURM nodes did not become idle: {out!r}")

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
