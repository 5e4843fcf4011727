"""launcher.fast_start's parts that a restart relies on, without starting workers (the kill
campaign measures the time they save: benchmarks/kill_campaign.py --compare)."""

from __future__ import annotations

import sys
import time
from datetime import timedelta

from framework.launch import rendezvous
from framework.launch.preload import Preload
from framework.worker import MODULES_FILE


def test_preload_imports_the_modules_a_worker_named(tmp_path):
    wanted = "tests.unit.fast_start_probe"  # a module nothing else imports
    sys.modules.pop(wanted, None)
    (tmp_path / MODULES_FILE).write_text(f"no_such_module_xyz\n{wanted}\n")
    preload = Preload(tmp_path)
    preload.start()
    deadline = time.monotonic() + 30
    while wanted not in sys.modules and time.monotonic() < deadline:
        time.sleep(0.05)
    preload.stop()
    assert wanted in sys.modules, "named by the worker: imported in this process"
    assert "no_such_module_xyz" not in sys.modules


def test_the_direct_rendezvous_hands_the_agent_its_store_at_once():
    from torch.distributed.elastic.rendezvous import (
        RendezvousParameters,
        rendezvous_handler_registry,
    )

    store = rendezvous.bound_store("127.0.0.1", 0, timedelta(seconds=10))
    rendezvous.register_backend()
    rendezvous.use_token("job", "a-token-of-this-start")
    params = RendezvousParameters(
        backend=rendezvous.DIRECT,
        endpoint=f"127.0.0.1:{store.port}",
        run_id="job",
        min_nodes=1,
        max_nodes=1,
    )
    handler = rendezvous_handler_registry.create_handler(params)
    info = handler.next_rendezvous()  # no join protocol, no random wait
    assert (info.rank, info.world_size) == (0, 1)
    assert info.bootstrap_store_info.master_port == store.port
    info.store.set("key", "value")  # the workers' store, under the job's prefix, signed
    assert info.store.get("key") == b"value"
    raw = bytes(store.get("job/key"))
    assert raw.endswith(b"value") and len(raw) == len(b"value") + 32, "a MAC, then the value"
