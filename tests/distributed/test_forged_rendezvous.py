"""A stranger on the rendezvous port of a job over two machines: two `fw train` processes on
this machine stand for the two nodes (as in test_slurm.py), and a third process, a plain torch
TCPStore client without the job's token, forges what torch elastic trusts from the store.

It reads every key and value it can list (the job's config must not be among them), then
either replaces the rendezvous state with a pickle that would create a file when unpickled
(torch's own backend unpickles the state on every node), or keeps overwriting MASTER_ADDR and
MASTER_PORT with the address of a store of its own (where a misled worker would connect, and
could then be fed pickles through gloo). Nothing it wrote may be used: no file, no worker at
its store, and both nodes stop with exit code 2 saying why. (One scenario cannot carry both
forgeries: whichever a node refuses first ends the job before the other is read.)"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import FW, QUIET, fw_env
from tests.distributed.test_elastic import free_port

pytestmark = pytest.mark.slow

CONFIG_MARK = "seen-only-by-the-nodes-3e7a1c"  # a config value the stranger must not read

FORGER = r"""
import base64, contextlib, json, os, pickle, re, socket, sys, time
from datetime import timedelta
import torch.distributed as dist

port, out, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
ran = os.path.join(out, "PAYLOAD_RAN")


class Payload:
    def __reduce__(self):
        return (exec, (f"open({ran!r}, 'w').write('code from the store ran')",))


report = {"state_key": None, "values": {}, "planted": 0, "at_my_store": []}


def save():
    with open(os.path.join(out, "forger.json"), "w") as fh:
        json.dump(report, fh)


print("ready", flush=True)  # torch imported: the nodes may start
while True:  # at once when the store opens (TCPStore's own retries back off for seconds)
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            break
    time.sleep(0.01)
client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
state = re.compile(r"^(torch|fw)\.rendezvous\.([^/]+)$")
key = None
while key is None:
    key = next((k for k in client.list_keys() if state.match(k)), None)
    time.sleep(0.01)
run_id = state.match(key).group(2)
report["state_key"] = key
for name in client.list_keys():  # whatever a stranger can read
    with contextlib.suppress(Exception):
        report["values"][name] = client.get(name).decode("latin-1")
save()

mine = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
forged = {"MASTER_ADDR": b"localhost", "MASTER_PORT": str(mine.port).encode()}
evil = pickle.dumps(Payload())
# torch's own form most often (its backend reads only that one), and the others
states = [base64.b64encode(evil), evil, base64.b64encode(evil), b"fw1." + b"0" * 64 + b"." + evil]
n = 0
while not os.path.exists(os.path.join(out, "stop")):
    n += 1
    if mode == "state":
        client.set(key, states[n % len(states)])
        report["planted"] += 1
    else:
        for rnd in (0, 1):
            for name, value in forged.items():
                client.set(f"torch.rendezvous.{run_id}.{rnd}/{name}", value)
                report["planted"] += 1
    if mine.num_keys() > 1:  # a worker came to my store
        report["at_my_store"] = sorted(mine.list_keys())
    if n % 100 == 0:
        save()
    time.sleep(0.002)
save()
"""


def stop(nodes: list[subprocess.Popen]) -> None:
    """End each node's fw process and its workers (each node is its own process group)."""
    for p in nodes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)


def misled(out: Path) -> bool:
    """Whether a worker came to the stranger's store (as far as its report says yet)."""
    try:
        return bool(json.loads((out / "forger.json").read_text())["at_my_store"])
    except (OSError, ValueError):
        return False


@pytest.mark.parametrize("forges", ["state", "master"])
def test_a_stranger_on_the_rendezvous_port_runs_nothing_and_reads_no_config(forges, tmp_path):
    """`state`: the rendezvous state replaced by a pickle as soon as it exists; `master`:
    MASTER_ADDR/PORT of every node pointed at the stranger's store from before the nodes read
    them."""
    work, out = tmp_path / "work", tmp_path / "forger"
    work.mkdir()
    out.mkdir()
    port = free_port()
    forger = subprocess.Popen(
        [sys.executable, "-c", FORGER, str(port), str(out), forges],
        env={k: v for k, v in fw_env().items() if k != "FW_RDZV_TOKEN"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert forger.stdout.readline().strip() == "ready"  # polling before the nodes meet
    args = [
        "train",
        "trainer.num_nodes=2",
        "trainer.devices=1",
        f"launcher.rdzv_endpoint=localhost:{port}",
        "launcher.join_timeout_s=60",
        "task._target_=tests.tasks.SlowDigitsTask",
        "+task.model.step_sleep=0.2",
        "trainer.max_steps=300",  # a minute at least: a forgery not refused would train
        f"+extra.note={CONFIG_MARK}",
        *QUIET,
        "run.dir=nodes",
    ]
    env = {**fw_env(), "FW_RDZV_TOKEN": "job-token", "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(
            [str(FW), *args],
            cwd=work,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for _ in range(2)
    ]
    try:
        deadline = time.monotonic() + 240
        while any(p.poll() is None for p in nodes) and time.monotonic() < deadline:
            if misled(out):  # a misled worker waits there for good: no need to wait for it
                break
            time.sleep(0.5)
        stop(nodes)
        results = [(p.wait(), p.communicate()[1]) for p in nodes]
    finally:
        stop(nodes)
        (out / "stop").touch()
        time.sleep(0.5)
        forger.kill()
    said = forger.communicate()[0]
    report = json.loads((out / "forger.json").read_text())
    assert report["state_key"], f"the stranger never reached the store: {said[-2000:]}"

    assert not (out / "PAYLOAD_RAN").exists(), "a pickle from the store was unpickled"
    assert report["at_my_store"] == [], report["at_my_store"]  # a worker came to its store
    for code, err in results:
        assert code == 2, err[-3000:]
        assert "not signed with this job's token" in err and "Traceback" not in err, err[-3000:]
    assert report["planted"] > 0

    read = "\n".join(f"{k}={v}" for k, v in report["values"].items())
    assert any(k.startswith("fw-join/") for k in report["values"]), read[:2000]
    for text in (CONFIG_MARK, "SlowDigitsTask", "max_steps"):
        assert text not in read, f"the stranger read the config ({text}): {read[:2000]}"
