"""Where the nodes and workers of a local-launcher job meet, and who may join.

torch's TCPStore asks nobody who they are: whoever reaches its port can list its keys, read every
value and write any. So, for every job of launcher=local (and launcher=slurm's elastic agents):

- Where the stores listen: a job on one machine keeps them on 127.0.0.1; a job over several
  machines on the address of `launcher.rdzv_endpoint` (the rendezvous store) and of the first
  node (the workers' store), not on every interface (`bound_store`).
- What is trusted from them: every value the nodes, their agents and their workers exchange is
  signed with the job's token (HMAC-SHA256, a key derived from the token for each use) and
  checked before it is used; one that is not is refused before anything reads it (exit code 2).
  torch elastic keeps its rendezvous state as a pickle, which torch unpickles on every node:
  here it is kept as signed JSON (`SignedBackend`) and made into torch's object only once its
  signature holds, so nothing read from a store is ever unpickled. The agents' keys
  (MASTER_ADDR/PORT) and the workers' process-group keys (the addresses gloo and NCCL connect
  to) go through `SignedStore`. Every node has `trainer.devices` workers, so the agents compute
  the ranks themselves (TORCH_ELASTIC_WORKER_IDENTICAL=1) instead of reading torch's unsigned
  rank tables.
- What is readable: key names are public (a store lists them). The configs the nodes compare
  are exchanged as MACs (`config_macs`), never as text.
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
import pickle
import socket
from datetime import datetime, timedelta
from typing import Any

from framework.errors import ConfigError

BACKEND = "fw-bound"  # torch's dynamic rendezvous: signed state, stores bound to one address
DIRECT = "fw-direct"  # one machine, one agent: the store this process holds, no meeting
TOKEN_ENV = "FW_RDZV_TOKEN"
STORE_KEY_ENV = "FW_STORE_KEY"  # the workers' key for their process group's store (derived)
IDENTICAL_ENV = "TORCH_ELASTIC_WORKER_IDENTICAL"  # torch's agent: ranks computed, not exchanged
LOOPBACK = "127.0.0.1"
REFUSED = "not signed with this job's token"  # in every refusal (the launcher looks for it)
MAGIC, EMPTY = b"fw1.", b"fw-rdzv-empty"
_tokens: dict[str, str] = {}  # run id -> token, for the handlers torch creates in this process


def job_token(configured: str) -> str:
    """The job's token: launcher.rdzv_token, else FW_RDZV_TOKEN ('' when neither is set)."""
    return configured or os.environ.get(TOKEN_ENV, "")


def keyed(token: str, name: str) -> str:
    """A name only the holders of the token can compute."""
    return hmac.new(token.encode(), name.encode(), hashlib.sha256).hexdigest()[:32]


def derive(token: str, purpose: str) -> bytes:
    """The key of one use of the token (one per purpose: a MAC made for one never passes as
    another's)."""
    return hmac.new(token.encode(), f"fw-rdzv/{purpose}".encode(), hashlib.sha256).digest()


def refusal(what: str, where: str = "") -> Exception:
    """The error for a value read from a store that is not signed with the job's token
    (torch's RendezvousStateError, which its agents report and its heartbeat tolerates)."""
    from torch.distributed.elastic.rendezvous import RendezvousStateError

    at = f" at {where}" if where else ""
    return RendezvousStateError(
        f"{what} in the rendezvous store{at} is {REFUSED}: someone who reached the store's "
        "port without the token wrote it; it was refused before anything used it"
    )


def _tell_refused(store, run_id: str, token: str, reason: str) -> None:
    """Leave the reason of a refusal in the rendezvous store, signed, for the other nodes: the
    refusing node's agent closes the rendezvous, and they would otherwise only see it closed."""
    with contextlib.suppress(Exception):  # best effort: the store may be gone
        signed = signed_store(store, "fw-refused", derive(token, "refused"))
        signed.set(f"fw-refused/{run_id}", reason)


def refused_elsewhere(endpoint: str, run_id: str, token: str) -> str | None:
    """Why another node of the job refused its rendezvous store (None: none did, or the store
    is gone)."""
    from torch.distributed import TCPStore

    host, _, port = endpoint.rpartition(":")
    with contextlib.suppress(Exception):
        store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=5))
        key = f"fw-refused/{run_id}"
        if store.check([key]):
            signed = signed_store(store, "fw-refused", derive(token, "refused"))
            return signed.get(key).decode()
    return None


def use_token(run_id: str, token: str) -> None:
    """The token the rendezvous `run_id` of this process signs and checks with (the handlers
    are created by torch's elastic agent, from the run id)."""
    _tokens[run_id] = token


def _token_of(run_id: str) -> str:
    token = _tokens.get(run_id)
    if not token:  # never a rendezvous without signatures
        raise RuntimeError(f"no token for the rendezvous {run_id!r} (rendezvous.use_token)")
    return token


# --- torch elastic's rendezvous state as signed JSON


def _node(node) -> list:
    return [node.addr, node.pid, node.local_id]


def _time(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def encode_state(state) -> dict:
    """torch's _RendezvousState as plain JSON values."""
    return {
        "round": state.round,
        "complete": state.complete,
        "closed": state.closed,
        "deadline": _time(state.deadline),
        "participants": [[_node(n), r] for n, r in sorted(state.participants.items())],
        "wait_list": [_node(n) for n in sorted(state.wait_list)],
        "redundancy_list": [_node(n) for n in sorted(state.redundancy_list)],
        "last_heartbeats": [[_node(n), _time(t)] for n, t in sorted(state.last_heartbeats.items())],
    }


def decode_state(doc: dict):
    """A _RendezvousState from `encode_state`'s JSON, every field's type checked (ValueError)."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        _NodeDesc,
        _RendezvousState,
    )

    def node(value) -> _NodeDesc:
        addr, pid, local_id = value
        if not isinstance(addr, str) or type(pid) is not int or type(local_id) is not int:
            raise ValueError(f"not a node: {value!r}")
        return _NodeDesc(addr, pid, local_id)

    def when(value) -> datetime:
        moment = datetime.fromisoformat(value)
        if moment.tzinfo is None:
            raise ValueError(f"not an aware time: {value!r}")
        return moment

    def whole(value) -> int:
        if type(value) is not int:
            raise ValueError(f"not an integer: {value!r}")
        return value

    def flag(value) -> bool:
        if type(value) is not bool:
            raise ValueError(f"not a boolean: {value!r}")
        return value

    state = _RendezvousState()
    state.round = whole(doc["round"])
    state.complete, state.closed = flag(doc["complete"]), flag(doc["closed"])
    state.deadline = None if doc["deadline"] is None else when(doc["deadline"])
    state.participants = {node(n): whole(r) for n, r in doc["participants"]}
    state.wait_list = {node(n) for n in doc["wait_list"]}
    state.redundancy_list = {node(n) for n in doc["redundancy_list"]}
    state.last_heartbeats = {node(n): when(t) for n, t in doc["last_heartbeats"]}
    return state


def signed_backend(store, run_id: str, token: str, where: str = "", tell=None):
    """A torch RendezvousBackend that keeps the rendezvous state in `store` as signed JSON
    (`fw1.` + HMAC + JSON with a sequence number): a value that is not signed with the token,
    or an older one played back, is refused before it is parsed; the bytes handed to torch's
    state holder are pickled here from the checked state, never read from the store. `tell`:
    called with the refusal's message before it is raised."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

    def refuse(what: str) -> Exception:
        err = refusal(what, where)
        if tell is not None:
            tell(str(err))
        return err

    class SignedBackend(RendezvousBackend):
        """See signed_backend."""

        def __init__(self) -> None:
            self._key = f"fw.rendezvous.{run_id}"
            self._mac_key, self._seen = derive(token, "rendezvous-state"), -1
            store.compare_set(self._key, "", EMPTY)  # created: compare_set needs a key

        @property
        def name(self) -> str:
            return BACKEND

        def _mac(self, body: bytes) -> bytes:
            message = self._key.encode() + b"\0" + body
            return hmac.new(self._mac_key, message, hashlib.sha256).hexdigest().encode()

        def seal(self, state, seq: int) -> bytes:
            body = json.dumps({"seq": seq, "state": encode_state(state)}, sort_keys=True).encode()
            return MAGIC + self._mac(body) + b"." + body

        def open(self, blob: bytes):
            """(state, seq), or None for no state; refused unless signed and not older."""
            blob = bytes(blob)
            if blob == EMPTY:
                return None
            mac, dot, body = blob[len(MAGIC) :].partition(b".")
            if (
                not blob.startswith(MAGIC)
                or not dot
                or not hmac.compare_digest(mac, self._mac(body))
            ):
                raise refuse("the rendezvous state")
            try:
                doc = json.loads(body)
                seq, state = doc["seq"], decode_state(doc["state"])
            except (ValueError, KeyError, TypeError) as err:  # signed, so ours: a bug
                raise refuse(f"the rendezvous state (unreadable: {err})") from None
            if type(seq) is not int or seq < self._seen:
                raise refuse("an older rendezvous state played back")
            self._seen = seq
            return state, seq

        def get_state(self):
            blob = store.get(self._key)
            opened = self.open(blob)
            return None if opened is None else (pickle.dumps(opened[0]), bytes(blob))

        def set_state(self, state: bytes, token=None):
            mine = pickle.loads(state)  # this process's own state holder pickled it
            expected = token if isinstance(token, bytes) else EMPTY
            seq = 0
            if expected != EMPTY:  # a token is a blob this backend returned (checked then)
                seq = json.loads(expected.partition(b".")[2].partition(b".")[2])["seq"] + 1
            new = self.seal(mine, seq)
            current = bytes(store.compare_set(self._key, expected, new))
            if current == new:
                self._seen = seq
                return state, new, True
            opened = self.open(current)
            return None if opened is None else (pickle.dumps(opened[0]), current, False)

    return SignedBackend()


# --- a store whose values carry a MAC


def signed_store(inner, context: str, key: bytes, where: str = "", tell=None):
    """`inner` (a torch Store) with every value signed: set writes HMAC(key, context/name,
    value) + value, get refuses a value without it (a forged MASTER_ADDR, a gloo address).
    Counters (add) and waits pass through: a stranger can only stall them. `tell`: called with
    a refusal's message before it is raised."""
    import torch.distributed as dist

    class SignedStore(dist.Store):
        """See signed_store."""

        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def _mac(self, name: str, value: bytes) -> bytes:
            message = f"{context}/{name}".encode() + b"\0" + value
            return hmac.new(key, message, hashlib.sha256).digest()

        def _seal(self, name: str, value) -> bytes:
            value = value.encode() if isinstance(value, str) else bytes(value)
            return self._mac(name, value) + value

        def _open(self, name: str, blob) -> bytes:
            blob = bytes(blob)
            mac, value = blob[:32], blob[32:]
            if len(blob) < 32 or not hmac.compare_digest(mac, self._mac(name, value)):
                err = refusal(f"store key {name!r}", where)
                if tell is not None:
                    tell(str(err))
                raise err
            return value

        def set(self, name, value):
            inner.set(name, self._seal(name, value))

        def get(self, name):
            return self._open(name, inner.get(name))

        def compare_set(self, name, expected, desired):
            expected = self._seal(name, expected) if expected not in ("", b"") else expected
            current = bytes(inner.compare_set(name, expected, self._seal(name, desired)))
            return self._open(name, current) if current else current

        def multi_set(self, names, values):
            inner.multi_set(names, [self._seal(n, v) for n, v in zip(names, values, strict=True)])

        def multi_get(self, names):
            return [self._open(n, b) for n, b in zip(names, inner.multi_get(names), strict=True)]

        def add(self, name, amount):
            return inner.add(name, amount)

        def wait(self, names, *timeout):
            return inner.wait(names, *timeout)

        def check(self, names):
            return inner.check(names)

        def delete_key(self, name):
            return inner.delete_key(name)

        def num_keys(self):
            return inner.num_keys()

        def set_timeout(self, timeout):
            return inner.set_timeout(timeout)

        @property
        def timeout(self):
            return inner.timeout

    return SignedStore()


def store_key(token: str) -> str:
    """What a job's workers sign their process group's store with (hex, in STORE_KEY_ENV): a
    key derived from the token, not the token."""
    return derive(token, "worker-store").hex()


_signed_stores: list = []  # a Python store must outlive every C++ user of it


def sign_worker_store() -> None:
    """In a worker of launcher=local: the process group's store (torch's env:// rendezvous, on
    the agents' store) signed with the job's key, so a stranger cannot point gloo or NCCL at
    an address of theirs. No-op outside launcher=local's workers (no STORE_KEY_ENV)."""
    key = os.environ.get(STORE_KEY_ENV)
    if not key:
        return
    import importlib

    # the module (torch.distributed's `rendezvous` is also a function of that name)
    torch_rendezvous = importlib.import_module("torch.distributed.rendezvous")
    handlers = torch_rendezvous._rendezvous_handlers  # torch's registry has no replace
    plain = handlers["env"]
    if getattr(plain, "fw_signed", False):
        return
    context = f"workers/{os.environ.get('TORCHELASTIC_RUN_ID', '')}"
    where = f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"

    def signed(url: str, **kwargs):
        for store, rank, world_size in plain(url, **kwargs):
            wrapped = signed_store(store, context, bytes.fromhex(key), where)
            _signed_stores.append(wrapped)
            yield wrapped, rank, world_size

    signed.fw_signed = True  # type: ignore[attr-defined]
    handlers["env"] = signed


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
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        RendezvousTimeout,
    )

    token = _token_of(params.run_id)
    host, _, port = params.endpoint.rpartition(":")
    read_timeout = timedelta(seconds=params.get_as_int("read_timeout", 60))
    store = TCPStore(host, int(port), is_master=False, timeout=read_timeout)
    tell = functools.partial(_tell_refused, store, params.run_id, token)
    backend = signed_backend(store, params.run_id, token, params.endpoint, tell)
    agent_key = derive(token, "agent-store")

    class BoundRendezvousHandler(DynamicRendezvousHandler):
        """torch's handler: signed state and agent store, the workers' store on one address."""

        def get_backend(self) -> str:
            return BACKEND

        def _create_tcp_store_server(self, master_addr, master_port):
            return bound_store(address_of(master_addr), master_port, read_timeout)

        def _wrap_store(self, inner):
            prefix = f"torch.rendezvous.{self._settings.run_id}.{self._state_holder.state.round}"
            prefixed = PrefixStore(prefix, inner)
            signed = signed_store(prefixed, prefix, agent_key, params.endpoint, tell)
            _signed_stores.append(signed)  # C++ holds it; Python must too
            return signed

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
