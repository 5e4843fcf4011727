"""Where the nodes and workers of a local-launcher job meet, and who may join.

torch's TCPStore listens on every interface and asks nobody who they are. A job on one machine
needs no other machine: its stores (the rendezvous store and the one its workers share, which
torch's elastic agent creates) listen on 127.0.0.1 only. A job over several machines listens on
the address of `launcher.rdzv_endpoint` (the rendezvous store) and of the first node (the
workers' store), and its nodes share a token (`launcher.rdzv_token` or FW_RDZV_TOKEN): the keys
they meet under are derived from it, and every node's config is signed with it, so a stranger
who reaches the port can neither read nor forge them. The collectives themselves (gloo, NCCL)
trust the network, as in every PyTorch framework: see docs/security.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import socket
from datetime import timedelta

from framework.errors import ConfigError

BACKEND = "fw-bound"  # torch's c10d rendezvous, with stores bound to one address
DIRECT = "fw-direct"  # one machine, one agent: the store this process holds, no meeting
TOKEN_ENV = "FW_RDZV_TOKEN"
LOOPBACK = "127.0.0.1"


def job_token(configured: str) -> str:
    """The job's token: launcher.rdzv_token, else FW_RDZV_TOKEN ('' when neither is set)."""
    return configured or os.environ.get(TOKEN_ENV, "")


def keyed(token: str, name: str) -> str:
    """A name only the holders of the token can compute."""
    return hmac.new(token.encode(), name.encode(), hashlib.sha256).hexdigest()[:32]


def address_of(host: str) -> str:
    """The IP address a host name stands for (IPv4 first)."""
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return infos[0][4][0]


def bound_store(address: str, port: int, timeout: timedelta):
    """A TCPStore server listening on `address` only (port 0: a free one). Multi-tenant, so
    torch's rendezvous opening a server on the same port in this process shares it."""
    from torch.distributed import TCPStore

    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address, port))
    sock.listen(512)
    port = sock.getsockname()[1]
    return TCPStore(
        address,
        port,
        is_master=True,
        multi_tenant=True,
        master_listen_fd=sock.detach(),  # the store owns the socket from here on
        wait_for_workers=False,
        timeout=timeout,
    )


def register_backend() -> None:
    """Make `BACKEND` known to torch's rendezvous registry (the way torch takes new backends;
    registering the same creator again is a no-op)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, _create_handler)
    rendezvous_handler_registry.register(DIRECT, _create_direct_handler)


def _create_direct_handler(params):
    """The rendezvous of a job on one machine: its only agent is this process, so there is
    nobody to wait for. torch's dynamic rendezvous would still run its join protocol and, in
    its first round (every start is one), sleep 0-0.3 s at random to spread the nodes out;
    this one hands the agent the store at once (as torch's static rendezvous does, but on the
    store bound to loopback here)."""
    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.elastic.rendezvous import (
        RendezvousHandler,
        RendezvousInfo,
        RendezvousStoreInfo,
    )

    host, _, port = params.endpoint.rpartition(":")
    timeout = timedelta(seconds=params.get_as_int("join_timeout", 600))

    class DirectRendezvousHandler(RendezvousHandler):
        """One node, rank 0, at once."""

        def __init__(self) -> None:
            self.store = None

        def get_backend(self) -> str:
            return DIRECT

        @property
        def use_agent_store(self) -> bool:
            return True  # the workers meet on the same store, under their own prefix

        def next_rendezvous(self):
            if self.store is None:
                self.store = TCPStore(host, int(port), is_master=False, timeout=timeout)
            store = PrefixStore(params.run_id, self.store)
            return RendezvousInfo(store, 0, 1, RendezvousStoreInfo(host, int(port)))

        def is_closed(self) -> bool:
            return False

        def set_closed(self) -> None:
            pass

        def num_nodes_waiting(self) -> int:
            return 0

        def get_run_id(self) -> str:
            return params.run_id

        def shutdown(self) -> bool:
            return True

    return DirectRendezvousHandler()


def _create_handler(params):
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        RendezvousTimeout,
    )

    class BoundRendezvousHandler(DynamicRendezvousHandler):
        """torch's handler, whose workers' store listens on the first node's address only."""

        def get_backend(self) -> str:
            return BACKEND

        def _create_tcp_store_server(self, master_addr, master_port):
            timeout = timedelta(seconds=params.get_as_int("read_timeout", 60))
            return bound_store(address_of(master_addr), master_port, timeout)

    backend, store = create_backend(params)
    join = timedelta(seconds=params.get_as_int("join_timeout", 600))
    # an elastic job's nodes wait this long for more of them once min_nodes have arrived
    last_call = timedelta(seconds=params.get_as_int("last_call_timeout", 30))
    return BoundRendezvousHandler.from_backend(
        params.run_id,
        store,
        backend,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        RendezvousTimeout(join=join, last_call=last_call),
    )


class JoinTimeout(RuntimeError):
    """Not every node of the job arrived at the rendezvous in time."""


_stores: list = []  # the stores of this fw process's jobs, alive until it ends


def host_store(host: str, port: int, timeout: timedelta):
    """The rendezvous store of a job whose endpoint is this machine (None: another process
    here hosts it already, connect as a client)."""
    with contextlib.suppress(RuntimeError, ValueError, OSError):
        store = bound_store(address_of(host), port, timeout)
        _stores.append(store)
        return store
    return None


def join(
    endpoint: str,
    rdzv_id: str,
    token: str,
    nodes: int,
    config: dict,
    timeout_s: float,
    late: bool = False,
):
    """Meet the other nodes at the rendezvous store and check that every node composed the same
    config, signed with the job's token. Returns this node's arrival (0: the first; `nodes` or
    more: a node of an elastic job (`late`) that comes back while the others train, checked
    against the first node's config). Raises ConfigError for a different config or a node
    without the token."""
    from torch.distributed import TCPStore

    host, _, port = endpoint.rpartition(":")
    timeout = timedelta(seconds=timeout_s)
    hosting = host_store(host, int(port), timeout) if names_this_machine(host) else None
    store = hosting
    if store is None:
        store = TCPStore(host, int(port), is_master=False, timeout=timeout)
        _stores.append(store)
    prefix = f"fw-join/{rdzv_id}/{len(_stores)}"  # a sweep's jobs meet one after another
    arrival = store.add(f"{prefix}/arrived", 1) - 1
    hidden = f"{prefix}/{keyed(token, prefix)}"
    if arrival >= nodes and late:
        store.wait([f"{hidden}/config/0"], timeout)
        check_same(config, _verified(store.get(f"{hidden}/config/0"), token, endpoint))
        return arrival
    if arrival >= nodes:
        raise ConfigError(
            "trainer.num_nodes",
            nodes,
            f"node {arrival + 1} joined {endpoint} (launcher.rdzv_id={rdzv_id})",
            hint="Give each job its own launcher.rdzv_id or endpoint.",
        )
    # in the open: each node's proof that it holds the token (a MAC, useless without it); the
    # configs under a key only the token's holders can compute, signed with it
    store.set(f"{prefix}/proof/{arrival}", keyed(token, f"{prefix}/{arrival}"))
    text = json.dumps(config, sort_keys=True, default=str)
    store.set(f"{hidden}/config/{arrival}", json.dumps({"config": text, "mac": keyed(token, text)}))
    proofs = [f"{prefix}/proof/{n}" for n in range(nodes)]
    try:
        store.wait(proofs, timeout)
    except (RuntimeError, TimeoutError) as err:
        raise JoinTimeout(
            f"trainer.num_nodes={nodes}, but not every node joined {endpoint} within "
            f"launcher.join_timeout_s={timeout_s:g}"
        ) from err
    shown = [store.get(key).decode() for key in proofs]
    store.set(f"{prefix}/seen/{arrival}", "1")
    if hosting is not None:  # the store lives in this process: stay until every node read them
        store.wait([f"{prefix}/seen/{n}" for n in range(nodes)], timeout)
    for n, proof in enumerate(shown):
        if not hmac.compare_digest(proof, keyed(token, f"{prefix}/{n}")):
            raise ConfigError(
                "launcher.rdzv_token",
                "***",
                f"a node joined {endpoint} without this job's token: nothing was started",
                hint=f"Give every node the same launcher.rdzv_token (or {TOKEN_ENV}).",
            )
    keys = [f"{hidden}/config/{n}" for n in range(nodes)]
    store.wait(keys, timeout)
    configs = [_verified(store.get(key), token, endpoint) for key in keys]
    store.set(f"{prefix}/checked/{arrival}", "1")
    if hosting is not None:  # the store lives in this process: stay until every node read it
        store.wait([f"{prefix}/checked/{n}" for n in range(nodes)], timeout)
    for other in configs:
        check_same(configs[arrival], other)
    return arrival


def check_same(mine: dict, other: dict) -> None:
    """ConfigError naming the first key whose value differs between two nodes' configs."""
    differ = config_difference(mine, other)
    if differ is not None:
        key, value, theirs = differ
        raise ConfigError(
            key,
            value,
            f"the nodes of one job composed different configs (another node has {theirs})",
            hint="Start every node with the same command; run.dir must name the same "
            "shared directory on each.",
        )


def meeting(token: str, rdzv_id: str) -> str:
    """The name the nodes of this fw process's current job meet under (a sweep's jobs meet
    one after another, each under its own)."""
    return keyed(token, f"{rdzv_id}/{len(_stores)}")


def _verified(raw: bytes, token: str, endpoint: str) -> dict:
    try:
        entry = json.loads(raw)
        text, mac = entry["config"], entry["mac"]
    except (ValueError, KeyError, TypeError):
        text, mac = "", ""
    if not hmac.compare_digest(str(mac), keyed(token, str(text))):
        raise ConfigError(
            "launcher.rdzv_token",
            "***",
            f"a node joined {endpoint} without this job's token: nothing was started",
            hint=f"Give every node the same launcher.rdzv_token (or {TOKEN_ENV}).",
        )
    return json.loads(text)


def names_this_machine(host: str) -> bool:
    """Whether a rendezvous host is this machine (its name or one of its addresses)."""
    names = {"localhost", socket.gethostname(), socket.getfqdn()}
    if host in names:
        return True

    def addresses(name: str) -> set[str]:
        try:
            return {info[4][0] for info in socket.getaddrinfo(name, None)}
        except OSError:
            return set()

    mine = {"127.0.0.1", "::1"}.union(*(addresses(n) for n in names))
    return bool(addresses(host) & mine)


def config_difference(a, b, key: str = "") -> tuple[str, object, object] | None:
    """The first key whose value differs between two plain configs, with both values."""
    if isinstance(a, dict) and isinstance(b, dict):
        for name in sorted(set(a) | set(b)):
            found = config_difference(a.get(name), b.get(name), f"{key}.{name}" if key else name)
            if found is not None:
                return found
        return None
    return None if a == b else (key or "config", a, b)


class Generations:
    """The starts of an elastic job's workers on a set of nodes, counted in the rendezvous
    store: a lost node or a node that comes back moves every node to the next generation, whose
    torch rendezvous forms the new world. Keys under a name only the token's holders know."""

    def __init__(self, endpoint: str, token: str, rdzv_id: str, timeout_s: float) -> None:
        from torch.distributed import TCPStore

        host, _, port = endpoint.rpartition(":")
        timeout = timedelta(seconds=timeout_s)
        self.store = TCPStore(host, int(port), is_master=False, timeout=timeout)
        self.name = meeting(token, rdzv_id)  # this job's rendezvous name, as start_workers's
        self.prefix = f"fw-elastic/{self.name}"

    def current(self) -> int:
        return self.store.add(f"{self.prefix}/gen", 0)

    def count(self, what: str, generation: int, add: int = 0) -> int:
        """How many nodes started (`members`) or ended (`stopped`) their workers in a
        generation (`add`: count this node)."""
        return self.store.add(f"{self.prefix}/{what}/{generation}", add)

    def advance(self, generation: int, expect: int | None = None) -> int:
        """Move the job past `generation` (a no-op when another node already did); `expect`:
        the nodes the next generation waits for (else launcher.min_nodes). The new number."""
        if expect is not None:
            self.store.set(f"{self.prefix}/expect/{generation + 1}", str(expect))
        self.store.compare_set(f"{self.prefix}/gen", str(generation), str(generation + 1))
        return self.current()

    def expected(self, generation: int) -> int | None:
        key = f"{self.prefix}/expect/{generation}"
        return int(self.store.get(key)) if self.store.check([key]) else None
