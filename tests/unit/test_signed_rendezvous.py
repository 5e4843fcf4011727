"""What the nodes, agents and workers of a job read from a store is signed with the job's token
(framework/stores.py): torch elastic's rendezvous state (a pickle in torch's own
backend, unpickled on every node) is signed JSON here, refused before it is parsed when it is
not signed, and never unpickled from the store; MASTER_ADDR and the workers' process-group keys
are refused without their MAC; the nodes compare their configs as MACs a stranger cannot read.
The multi-process attack is in tests/distributed/test_forged_rendezvous.py."""

from __future__ import annotations

import base64
import importlib
import json
import os
import pickle
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from framework import stores as signed
from framework.errors import ConfigError
from framework.launch import rendezvous

TOKEN = "job-token-5b1e"


def server():
    return rendezvous.bound_store("127.0.0.1", 0, timedelta(seconds=5))


def payload(ran: Path) -> bytes:
    """A pickle that creates `ran` when it is unpickled."""

    class Payload:
        def __reduce__(self):
            return (exec, (f"open({str(ran)!r}, 'w').write('ran')",))

    return pickle.dumps(Payload())


def a_state() -> _RendezvousState:
    state = _RendezvousState()
    node = _NodeDesc("node0", 101, 0)
    state.participants[node] = 0
    state.last_heartbeats[node] = datetime.now(timezone.utc)
    state.wait_list.add(_NodeDesc("node1", 202, 1))
    state.deadline = datetime.now(timezone.utc)
    return state


def test_the_rendezvous_state_is_refused_unless_signed_and_never_unpickled(tmp_path):
    store = server()
    writer = signed.signed_backend(store, "job", TOKEN)
    reader = signed.signed_backend(store, "job", TOKEN)
    state = a_state()
    first = writer.set_state(pickle.dumps(state))
    assert first[2], "set"
    second = writer.set_state(pickle.dumps(state), first[1])
    assert second[2], "set over the first, by its token"
    got = pickle.loads(reader.get_state()[0])  # pickled by the reader from checked JSON
    assert signed.encode_state(got) == signed.encode_state(state)
    assert json.loads(bytes(store.get("fw.rendezvous.job")).split(b".", 2)[2])["seq"] == 1

    ran = tmp_path / "ran"
    evil = payload(ran)
    forged = {
        "torch's base64 pickle": base64.b64encode(evil),
        "a raw pickle": evil,
        "a bad MAC": b"fw1." + b"0" * 64 + b"." + evil,
        "signed for another run": signed.signed_backend(store, "job2", TOKEN).seal(a_state(), 9),
        "signed with another token": signed.signed_backend(store, "job3", "guess").seal(
            a_state(), 9
        ),
        "an older state played back": first[1],
    }
    for what, blob in forged.items():
        store.set("fw.rendezvous.job", blob)
        with pytest.raises(RendezvousStateError, match="not signed with this job's token"):
            reader.get_state()
        assert not ran.exists(), f"{what}: unpickled"


def test_a_forged_master_addr_is_refused():
    store = server()
    prefix = "torch.rendezvous.job.0"
    key = signed.derive(TOKEN, "agent-store")
    agents = signed.signed_store(dist.PrefixStore(prefix, store), prefix, key)
    agents.set("MASTER_ADDR", "10.0.0.1")
    assert agents.get("MASTER_ADDR") == b"10.0.0.1"
    store.set(f"{prefix}/MASTER_ADDR", "6.6.6.6")  # a stranger, without the token
    with pytest.raises(RendezvousStateError, match="'MASTER_ADDR'.*not signed with this job"):
        agents.get("MASTER_ADDR")
    copied = signed.signed_store(dist.PrefixStore("other", store), "other", key)
    copied.set("MASTER_ADDR", "10.0.0.2")
    store.set(f"{prefix}/MASTER_ADDR", bytes(store.get("other/MASTER_ADDR")))
    with pytest.raises(RendezvousStateError):  # a signed value moved to another key
        agents.get("MASTER_ADDR")


def test_the_workers_process_group_store_is_signed(monkeypatch):
    """A worker's env:// rendezvous (init_process_group's) hands the process group a store
    whose values carry the job's MAC: a stranger's gloo address is refused."""
    store = server()
    handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
    monkeypatch.setitem(handlers, "env", handlers["env"])  # put back after the test
    for name, value in {
        signed.STORE_KEY_ENV: signed.store_key(TOKEN),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RUN_ID": "job",
    }.items():
        monkeypatch.setenv(name, value)
    signed.sign_worker_store()
    workers, rank, world_size = next(dist.rendezvous("env://"))
    assert (rank, world_size) == (0, 1)
    workers.set("default_pg/0//cpu//0/0", b"address-of-rank-0")
    assert bytes(store.get("default_pg/0//cpu//0/0")) != b"address-of-rank-0", "signed"
    assert workers.get("default_pg/0//cpu//0/0") == b"address-of-rank-0"
    store.set("default_pg/0//cpu//0/1", b"the-strangers-address")
    with pytest.raises(RendezvousStateError, match="not signed with this job's token"):
        workers.get("default_pg/0//cpu//0/1")


def test_the_nodes_compare_configs_as_macs():
    mine = {"task": {"lr": 0.1, "layers": [1, 2]}, "run": {"dir": "/shared/run"}}
    macs = rendezvous.config_macs(TOKEN, "fw-join/fw/1", mine)
    text = json.dumps(macs)
    assert "lr" not in text and "0.1" not in text and "/shared/run" not in text
    rendezvous.check_same(TOKEN, "fw-join/fw/1", mine, macs)
    theirs = rendezvous.config_macs(TOKEN, "fw-join/fw/1", {**mine, "task": {"lr": 0.2}})
    with pytest.raises(ConfigError, match=r"task.lr=0.1: the nodes of one job composed"):
        rendezvous.check_same(TOKEN, "fw-join/fw/1", mine, theirs)
    guessed = rendezvous.config_macs("a-guess", "fw-join/fw/1", mine)
    with pytest.raises(ConfigError):
        rendezvous.check_same(TOKEN, "fw-join/fw/1", mine, guessed)


def test_a_slurm_jobs_tasks_sign_their_process_group_store(monkeypatch, tmp_path):
    """launcher=slurm hands the job a new key in its environment (no file holds it) and each
    task signs its process group's store with it (torch's store on the first node listens on
    every interface) before it trains."""
    from framework import external, worker
    from framework.launchers import slurm
    from framework.world import World

    handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
    monkeypatch.setitem(handlers, "env", handlers["env"])  # put back after the test
    monkeypatch.delenv(signed.STORE_KEY_ENV, raising=False)
    monkeypatch.delenv(rendezvous.TOKEN_ENV, raising=False)
    with slurm.job_token(needed=False):
        key = os.environ[signed.STORE_KEY_ENV]
        assert len(key) == 64 and rendezvous.TOKEN_ENV not in os.environ
    assert signed.STORE_KEY_ENV not in os.environ, "only while submitting"
    with slurm.job_token(needed=True):
        assert os.environ[rendezvous.TOKEN_ENV] and os.environ[signed.STORE_KEY_ENV]

    monkeypatch.setenv(signed.STORE_KEY_ENV, key)  # as the job's environment has it
    seen = []
    monkeypatch.setattr(external, "check_world", lambda world: None)
    monkeypatch.setattr(
        worker, "entry", lambda *a, **k: seen.append(getattr(handlers["env"], "fw_signed", False))
    )
    world = World(world_size=2, devices=2, num_nodes=1, accelerator="cpu")
    task = slurm.Task(str(tmp_path / "config.yaml"), "", "USR2", 0, world)
    assert task() == "finished" and seen == [True]
