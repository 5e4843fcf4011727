"""How a replica group that rejoins receives a live peer's state (imports torchft: workers only).

torchft's Manager hands the state over through a checkpoint transport; its default, the HTTP
transport, serves the sender's state on every interface and unpickles what it receives with
`weights_only=False`, so whoever answered in the peer's place could run code in the healing
group. `HealTransport` is that transport with its two ends narrowed:

- the receiving end reads the state with torch's `weights_only` unpickler, as a checkpoint is
  read (framework/checkpoint/safe.py): tensors, numbers, strings, lists and dicts, which is all
  the heal state holds (model and optimizer tensors, the schedulers' and loss scaler's
  numbers, torchft's step); anything else is refused before it is built;
- the sending end listens on the address this machine's host name resolves to (the name the
  group gives torchft, where the other groups reach it), not on every interface.
"""

from __future__ import annotations

import socket
import threading
import urllib.request
from datetime import timedelta
from http.server import ThreadingHTTPServer
from typing import Any

from torch.distributed._serialization import _streaming_load
from torchft.checkpointing import HTTPTransport

from framework.checkpoint.safe import refusals


class HealTransport(HTTPTransport):
    """torchft's HTTP checkpoint transport reading only data and serving on `address` only."""

    def __init__(self, timeout: timedelta, address: str) -> None:
        super().__init__(timeout=timeout, num_chunks=0)
        self._listen_on(address)

    def _listen_on(self, address: str) -> None:
        """Move the server torchft opened on every interface to `address` (torchft's
        constructor takes no address): it has served nothing yet, the transport refusing
        requests until its first `send_checkpoint`."""
        handler = self._server.RequestHandlerClass
        self._server.shutdown()
        self._thread.join()
        self._server.server_close()
        self._server = _server_on(address, handler)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def address(self) -> str:
        """The URL peers fetch the state from (the step is appended)."""
        host, port = self._server.socket.getsockname()[:2]
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}/checkpoint/"

    @classmethod
    def _load_from_address(cls, address: str, timeout: timedelta) -> Any:
        """The state at `address`, read as data (torchft's reads it with weights_only=False);
        UnsafeCheckpoint when it names anything else."""
        with (
            urllib.request.urlopen(address, timeout=timeout.total_seconds()) as stream,
            refusals(f"the heal state from {address}", unreadable=False),
        ):
            return _streaming_load(stream, weights_only=True)


def _server_on(address: str, handler: Any) -> ThreadingHTTPServer:
    """An HTTP server of `handler` on `address` (IPv4 or IPv6), a free port."""

    class Server(ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in address else socket.AF_INET
        request_queue_size = 1024  # torchft's: every process of every healing group at once

    return Server((address, 0), handler)
