"""Where the nodes and workers of a local-launcher job meet, and who may join.

torch's TCPStore asks nobody who they are: whoever reaches its port can list its keys, read every
value and write any. So, for every job of launcher=local (and launcher=slurm's elastic agents):

- Where the stores listen: a job on one machine keeps them on 127.0.0.1; a job over several
  machines on the address of `launcher.rdzv_endpoint` (the rendezvous store) and of the first
  node (the workers' store), not on every interface (`bound_store`).
- What is trusted from them: every value the nodes, their agents and their workers exchange is
  signed with the job's token and checked before it is used (framework/stores.py); one
  that is not is refused before anything reads it (exit code 2). torch elastic's rendezvous
  state, a pickle in torch's own backend, is signed JSON here: nothing read from a store is
  ever unpickled. Every node has `trainer.devices` workers, so the agents compute the ranks
  themselves (TORCH_ELASTIC_WORKER_IDENTICAL=1) instead of reading torch's unsigned rank tables.
- What is readable: key names are public (a store lists them). The configs the nodes compare
  are exchanged as MACs, never as text.
- The token: `launcher.rdzv_token` or FW_RDZV_TOKEN over several machines; a new random one for
  each start of a job on one machine (other users of the machine reach loopback too).

A stranger who reaches a port can still stop a job (change a counter, delete a key): it then
fails or times out, and says so. The collectives' own connections (gloo, NCCL) trust the
network, as in every PyTorch framework: see docs/security.md.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import json
import os
import socket
import time
from datetime import timedelta
from typing import Any

from framework.errors import ConfigError
from framework.stores import derive, keep, signed_backend, signed_store
from framework.world import address_of

BACKEND = "fw-bound"  # torch's dynamic rendezvous: signed state, stores bound to one address
DIRECT = "fw-direct"  # one machine, one agent: the store this process holds, no meeting
TOKEN_ENV = "FW_RDZV_TOKEN"
IDENTICAL_ENV = "TORCH_ELASTIC_WORKER_IDENTICAL"  # torch's agent: ranks computed, not exchanged
LOOPBACK = "127.0.0.1"
_tokens: dict[str, str] = {}  # run id -> token, for the handlers torch creates in this process


def job_token(configured: str) -> str:
    """The job's token: launcher.rdzv_token, else FW_RDZV_TOKEN ('' when neither is set)."""
    return configured or os.environ.get(TOKEN_ENV, "")


def keyed(token: str, name: str) -> str:
    """A name only the holders of the token can compute."""
    return hmac.new(token.encode(), name.encode(), hashlib.sha256).hexdigest()[:32]


def tell_refused(store, run_id: str, token: str, reason: str) -> None:
    """Leave the reason of a refusal in the rendezvous store, signed, for the other nodes: the
    refusing node's agent closes the rendezvous (or its fw process, which may keep the store,
    ends), and they would otherwise only see it closed or gone."""
    with contextlib.suppress(Exception):  # best effort: the store may be gone
        signed = signed_store(store, "fw-refused", derive(token, "refused"))
        signed.set(f"fw-refused/{run_id}", reason)


def _client(endpoint: str, timeout_s: float):
    from torch.distributed import TCPStore

    host, _, port = endpoint.rpartition(":")
    return TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))


def refused_elsewhere(endpoint: str, run_id: str, token: str) -> str | None:
    """Why another node of the job refused the rendezvous store (None: none did, or the store
    is gone). Counts this node as told, so that the node keeping the store may end."""
    key = f"fw-refused/{run_id}"
    with contextlib.suppress(Exception):
        store = _client(endpoint, 2)
        if store.check([key]):
            reason = signed_store(store, "fw-refused", derive(token, "refused")).get(key)
            store.add(f"{key}/told", 1)
            return reason.decode()
    return None


def after_refusal(endpoint: str, run_id: str, token: str, reason: str, nodes: int) -> None:
    """On a node that refused (or learned of a refusal from its agent): leave the reason for the
    others and, when this fw process keeps the rendezvous store, keep it until every node knows
    (at most 10 s)."""
    key = f"fw-refused/{run_id}"
    with contextlib.suppress(Exception):
        store = _client(endpoint, 2)
        if not store.check([key]):
            tell_refused(store, run_id, token, reason)
        store.add(f"{key}/told", 1)
        deadline = time.monotonic() + 10
        while endpoint in _hosted and store.add(f"{key}/told", 0) < nodes:
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)


def use_token(run_id: str, token: str) -> None:
    """The token the rendezvous `run_id` of this process signs and checks with (the handlers
    are created by torch's elastic agent, from the run id)."""
    _tokens[run_id] = token


def _token_of(run_id: str) -> str:
    token = _tokens.get(run_id)
    if not token:  # never a rendezvous without signatures
        raise RuntimeError(f"no token for the rendezvous {run_id!r} (rendezvous.use_token)")
    return token


# --- the configs the nodes compare, as MACs


def config_macs(token: str, prefix: str, config: dict) -> dict[str, str]:
    """{MAC of a key's path: MAC of the path and its value} for every leaf of a config: two
    nodes holding the token can tell which key differs; whoever reads the store learns nothing
    (not even the key names)."""
    from framework.context import flatten

    key = derive(token, f"config/{prefix}")

    def mac(*parts: str) -> str:
        return hmac.new(key, "\0".join(parts).encode(), hashlib.sha256).hexdigest()

    return {
        mac("path", path): mac("value", path, json.dumps(value, sort_keys=True, default=str))
        for path, value in flatten(config).items()
    }


def macs_difference(token: str, prefix: str, mine: dict, theirs: dict) -> tuple[str, Any] | None:
    """The first key (of this node's config `mine`) whose value another node's MACs do not
    match, with this node's value; ('config', None) for a key only the other node has."""
    from framework.context import flatten

    own = config_macs(token, prefix, mine)
    for (path, value), (path_mac, value_mac) in zip(
        flatten(mine).items(), own.items(), strict=True
    ):
        if theirs.get(path_mac) != value_mac:
            return path, value
    if set(theirs) - set(own):
        return "config", None
    return None


# --- torch elastic's rendezvous handlers


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
    """Make `BACKEND` and `DIRECT` known to torch's rendezvous registry (the way torch takes new
    backends; registering the same creator again is a no-op)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, _create_handler)
    rendezvous_handler_registry.register(DIRECT, _create_direct_handler)


def _create_direct_handler(params):
    """The rendezvous of a job on one machine: its only agent is this process, so there is
    nobody to wait for. torch's dynamic rendezvous would still run its join protocol and, in
    its first round (every start is one), sleep 0-0.3 s at random to spread the nodes out;
    this one hands the agent the store at once (as torch's static rendezvous does, but on the
    store bound to loopback here, its values signed with the start's token)."""
    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.elastic.rendezvous import (
        RendezvousHandler,
        RendezvousInfo,
        RendezvousStoreInfo,
    )

    host, _, port = params.endpoint.rpartition(":")
    timeout = timedelta(seconds=params.get_as_int("join_timeout", 600))
    token = _token_of(params.run_id)

    class DirectRendezvousHandler(RendezvousHandler):
        """One node, rank 0, at once."""

        def __init__(self) -> None:
            self.store = None
            self.signed = None

        def get_backend(self) -> str:
            return DIRECT

        @property
        def use_agent_store(self) -> bool:
            return True  # the workers meet on the same store, under their own prefix

        def next_rendezvous(self):
            if self.store is None:
                self.store = TCPStore(host, int(port), is_master=False, timeout=timeout)
                prefixed = PrefixStore(params.run_id, self.store)
                key = derive(token, "agent-store")
                self.signed = signed_store(prefixed, params.run_id, key, params.endpoint)
            return RendezvousInfo(self.signed, 0, 1, RendezvousStoreInfo(host, int(port)))

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
    """torch's dynamic rendezvous (the nodes join, elastic jobs re-form) with its state signed
    (`signed_backend`), the agents' store signed (`signed_store`: MASTER_ADDR/PORT) and the
    workers' store listening on the first node's address only. The rendezvous store itself is
    held by this process or another fw process (`host_store`, `bound_store`): this one is its
    client."""
    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousStateError
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        RendezvousTimeout,
    )

    token = _token_of(params.run_id)
    host, _, port = params.endpoint.rpartition(":")
    read_timeout = timedelta(seconds=params.get_as_int("read_timeout", 60))
    store = TCPStore(host, int(port), is_master=False, timeout=read_timeout)
    tell = functools.partial(tell_refused, store, params.run_id, token)
    backend = signed_backend(store, params.run_id, token, params.endpoint, tell)
    agent_key = derive(token, "agent-store")

    class BoundRendezvousHandler(DynamicRendezvousHandler):
        """torch's handler: signed state and agent store, the workers' store on one address."""

        def get_backend(self) -> str:
            return BACKEND

        def _create_tcp_store_server(self, master_addr, master_port):
            return bound_store(address_of(master_addr), master_port, read_timeout)

        def num_nodes_waiting(self) -> int:
            """torch's count, asked by the agent while its workers run: first, whether another
            node refused a value of the store (its agent then left; this one would wait)."""
            marker = f"fw-refused/{params.run_id}"
            if store.check([marker]):
                refused = signed_store(
                    store, "fw-refused", derive(token, "refused"), params.endpoint
                )
                raise RendezvousStateError(
                    f"another node of the job stopped: {refused.get(marker).decode()}"
                )
            return super().num_nodes_waiting()

        def _wrap_store(self, inner):
            prefix = f"torch.rendezvous.{self._settings.run_id}.{self._state_holder.state.round}"
            prefixed = PrefixStore(prefix, inner)
            return keep(signed_store(prefixed, prefix, agent_key, params.endpoint, tell))

    join = timedelta(seconds=params.get_as_int("join_timeout", 600))
    # an elastic job's nodes wait this long for more of them once min_nodes have arrived
    last_call = timedelta(seconds=params.get_as_int("last_call_timeout", 30))
    handler = BoundRendezvousHandler.from_backend(
        params.run_id,
        store,
        backend,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        RendezvousTimeout(join=join, last_call=last_call),
    )
    handler.fw_parts = (store, backend)  # kept alive with the handler
    return handler


class JoinTimeout(RuntimeError):
    """Not every node of the job arrived at the rendezvous in time."""


_stores: list = []  # the stores of this fw process's jobs, alive until it ends
_hosted: set[str] = set()  # the endpoints whose store this process keeps


def host_store(host: str, port: int, timeout: timedelta):
    """The rendezvous store of a job whose endpoint is this machine (None: another process
    here hosts it already, connect as a client)."""
    with contextlib.suppress(RuntimeError, ValueError, OSError):
        store = bound_store(address_of(host), port, timeout)
        _stores.append(store)
        _hosted.add(f"{host}:{port}")
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
    """Meet the other nodes at the rendezvous store and check that every node holds the job's
    token and composed the same config (exchanged as MACs, `config_macs`: the store never holds
    its text). Returns this node's arrival (0: the first; `nodes` or more: a node of an elastic
    job (`late`) that comes back while the others train, checked against the first node's
    config). Raises ConfigError for a different config or a node without the token."""
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
    if arrival >= nodes and late:
        store.wait([f"{prefix}/config/0"], timeout)
        check_same(
            token,
            prefix,
            config,
            _verified(store.get(f"{prefix}/config/0"), token, prefix, endpoint),
        )
        return arrival
    if arrival >= nodes:
        raise ConfigError(
            "trainer.num_nodes",
            nodes,
            f"node {arrival + 1} joined {endpoint} (launcher.rdzv_id={rdzv_id})",
            hint="Give each job its own launcher.rdzv_id or endpoint.",
        )
    # each node's proof that it holds the token (a MAC, useless without it), and its config as
    # MACs, signed with it
    store.set(f"{prefix}/proof/{arrival}", keyed(token, f"{prefix}/{arrival}"))
    macs = config_macs(token, prefix, config)
    body = json.dumps(macs, sort_keys=True)
    store.set(f"{prefix}/config/{arrival}", json.dumps({"macs": body, "mac": keyed(token, body)}))
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
            raise _no_token(endpoint)
    keys = [f"{prefix}/config/{n}" for n in range(nodes)]
    store.wait(keys, timeout)
    others = [_verified(store.get(key), token, prefix, endpoint) for key in keys]
    store.set(f"{prefix}/checked/{arrival}", "1")
    if hosting is not None:  # the store lives in this process: stay until every node read it
        store.wait([f"{prefix}/checked/{n}" for n in range(nodes)], timeout)
    for other in others:
        check_same(token, prefix, config, other)
    return arrival


def _no_token(endpoint: str) -> ConfigError:
    return ConfigError(
        "launcher.rdzv_token",
        "***",
        f"a node joined {endpoint} without this job's token: nothing was started",
        hint=f"Give every node the same launcher.rdzv_token (or {TOKEN_ENV}).",
    )


def check_same(token: str, prefix: str, mine: dict, theirs: dict[str, str]) -> None:
    """ConfigError naming the first key of this node's config whose value another node's MACs
    (`config_macs`) do not match."""
    differ = macs_difference(token, prefix, mine, theirs)
    if differ is not None:
        key, value = differ
        what = "a different value" if key != "config" else "a key this node does not have"
        raise ConfigError(
            key,
            value,
            f"the nodes of one job composed different configs (another node has {what})",
            hint="Start every node with the same command; run.dir must name the same "
            "shared directory on each.",
        )


def meeting(token: str, rdzv_id: str) -> str:
    """The name the nodes of this fw process's current job meet under (a sweep's jobs meet
    one after another, each under its own); public, as every key name in a store."""
    return keyed(token, f"{rdzv_id}/{len(_stores)}")


def _verified(raw: bytes, token: str, prefix: str, endpoint: str) -> dict[str, str]:
    """Another node's config MACs, once their signature holds."""
    try:
        entry = json.loads(raw)
        body, mac = entry["macs"], entry["mac"]
    except (ValueError, KeyError, TypeError):
        body, mac = "", ""
    if not hmac.compare_digest(str(mac), keyed(token, str(body))):
        raise _no_token(endpoint)
    return json.loads(body)


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


class Generations:
    """The starts of an elastic job's workers on a set of nodes, counted in the rendezvous
    store: a lost node or a node that comes back moves every node to the next generation, whose
    torch rendezvous forms the new world. The counters are plain (a stranger can only stall
    them); the node count a generation waits for is signed."""

    def __init__(self, endpoint: str, token: str, rdzv_id: str, timeout_s: float) -> None:
        from torch.distributed import PrefixStore, TCPStore

        host, _, port = endpoint.rpartition(":")
        timeout = timedelta(seconds=timeout_s)
        self.store = TCPStore(host, int(port), is_master=False, timeout=timeout)
        self.name = meeting(token, rdzv_id)  # this job's rendezvous name, as start_workers's
        self.prefix = f"fw-elastic/{self.name}"
        prefixed = PrefixStore(self.prefix, self.store)
        self.signed = signed_store(prefixed, self.prefix, derive(token, "elastic"), endpoint)
        self.token = token  # for the torch rendezvous of each generation

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
            self.signed.set(f"expect/{generation + 1}", str(expect))
        self.store.compare_set(f"{self.prefix}/gen", str(generation), str(generation + 1))
        return self.current()

    def expected(self, generation: int) -> int | None:
        """The node count a generation waits for, as the node that moved the job there signed
        it (None: launcher.min_nodes)."""
        key = f"expect/{generation}"
        if not self.store.check([f"{self.prefix}/{key}"]):
            return None
        return int(self.signed.get(key))
