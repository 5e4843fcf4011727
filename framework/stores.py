"""Values read from a torch store, trusted only when signed with the job's token.

Whoever reaches a TCPStore's port can list its keys, read every value and write any (torch
checks nobody). Everything the nodes, agents and workers of a launcher=local job read from one
is therefore signed (HMAC-SHA256, a key derived from the token for each use) and checked before
use; a value that is not is refused with `refusal` (torch's RendezvousStateError, whose message
holds REFUSED) before anything parses it:

- torch elastic's rendezvous state, which torch's own backend keeps as a pickle and unpickles on
  every node, is kept as signed JSON (`signed_backend`); the bytes torch's state holder unpickles
  are pickled in this process from the checked state, never read from the store;
- the agents' keys (MASTER_ADDR/PORT) and the workers' process-group keys (the addresses gloo
  and NCCL connect to) go through `signed_store` (`sign_worker_store` in each worker);
- (framework/launch/rendezvous.py) the configs the nodes compare are exchanged as MACs, never as
  text.

framework/launch/rendezvous.py says where the stores listen and who holds the token.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import pickle
from datetime import datetime

REFUSED = "not signed with this job's token"  # in every refusal (the launcher looks for it)
STORE_KEY_ENV = "FW_STORE_KEY"  # the workers' key for their process group's store (derived)
STATE_BACKEND = "fw-signed"  # the name torch asks the state backend for
MAGIC, EMPTY = b"fw1.", b"fw-rdzv-empty"


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
            return STATE_BACKEND

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


_kept: list = []  # Python stores handed to torch's C++ side, which does not keep them alive


def keep(store):
    """`store`, kept alive for the rest of the process (a Python store that torch's C++ still
    uses after Python dropped it fails there: `Not implemented`)."""
    _kept.append(store)
    return store


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
            keep(wrapped)
            yield wrapped, rank, world_size

    signed.fw_signed = True  # type: ignore[attr-defined]
    handlers["env"] = signed
