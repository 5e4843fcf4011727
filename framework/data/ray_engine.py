"""The `ray` engine of `framework.data.prepared.prepare`: the same chunks, written on Ray Data.

The items are cut into `workers` consecutive parts as litdata's ordered workers cut them; part k
is encoded and written by one Ray task as litdata's worker k writes it (`chunk-k-*.bin` and its
own `k.index.json`), and the parts' indexes are then joined in order into `index.json`, so the
output is byte for byte the local engine's with the same workers and chunk size. Ray runs on
this machine (a new local cluster with `workers` CPUs) or on the cluster `RAY_ADDRESS` names. A
killed run, rerun, keeps the parts whose index was written and writes the others again.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from framework.checkpoint.disk import write_text_atomic
from framework.errors import ConfigError

log = logging.getLogger(__name__)


def in_parts(items: list[Any], parts: int) -> list[list[Any]]:
    """`items` cut into `parts` consecutive runs whose lengths differ by at most one, the longer
    ones last: how litdata's ordered workers share items, so that part k holds worker k's."""
    base, longer = divmod(len(items), parts)
    runs, start = [], 0
    for k in range(parts):
        stop = start + base + (k >= parts - longer)
        runs.append(items[start:stop])
        start = stop
    return runs


def write_with_ray(
    items: list[Any], encode: Callable, output: Path, workers: int, chunk_bytes: int
) -> None:
    """The ray engine: one Ray Data row per part (its number and its items), each written by a
    Ray task; parts whose index a killed run already wrote are kept. Their indexes are then
    joined, in part order, into `index.json`."""
    runs = {k: run for k, run in enumerate(in_parts(items, workers)) if run}
    if not (output / "index.json").is_file():  # else a kill came after the join: it is done
        todo = [{"part": k, "items": run} for k, run in runs.items() if not part_index(output, k)]
        if len(todo) < len(runs):
            log.warning(
                "%s: %d of %d parts were written before; kept",
                output,
                len(runs) - len(todo),
                len(runs),
            )
        if todo:
            with ray_cluster(workers):
                import ray.data

                dataset = ray.data.from_items(todo, override_num_blocks=len(todo))
                kwargs = {"encode": encode, "output": str(output), "chunk_bytes": chunk_bytes}
                dataset.map(write_part, fn_kwargs=kwargs, num_cpus=1).materialize()
        join_parts(output, list(runs))
    for k in runs:
        (output / f"{k}.index.json").unlink(missing_ok=True)


@contextmanager
def ray_cluster(workers: int) -> Iterator[None]:
    """Ray, connected to the cluster `RAY_ADDRESS` names, or else a new one on this machine
    with `workers` CPUs; shut down (this machine's one stopped) on the way out."""
    import ray

    from framework.processes import init_ray

    address = os.environ.get("RAY_ADDRESS")
    if not address:
        init_ray("local", num_cpus=workers, include_dashboard=False)
    else:
        try:
            listening(address)  # Ray itself retries a silent address for many minutes
            init_ray(None)
        except (OSError, ray.exceptions.AuthenticationError) as error:
            raise ConfigError(
                "RAY_ADDRESS",
                address,
                f"no Ray cluster could be joined there ({str(error).splitlines()[0]})",
                hint="Give the head node's HOST:6379; with token authentication, also "
                "RAY_AUTH_MODE=token and its token (docs/data.md).",
            ) from None
    try:
        yield
    finally:
        ray.shutdown()


def listening(address: str) -> None:
    """OSError unless something listens at `address` (HOST:PORT, or ray://HOST:PORT); other
    forms ("auto") are left to Ray."""
    host, colon, port = address.removeprefix("ray://").rpartition(":")
    if colon and port.isdigit():
        socket.create_connection((host, int(port)), timeout=10).close()


def write_part(row: dict[str, Any], encode: Callable, output: str, chunk_bytes: int) -> dict:
    """A Ray task: part `row["part"]`'s items encoded, in order, into litdata chunks named as
    litdata's worker of that number names them, and the part's index (written last)."""
    from litdata import TokensLoader
    from litdata.streaming import Cache

    part, items = int(row["part"]), row["items"]
    items = items.tolist() if hasattr(items, "tolist") else list(items)  # numpy's back to Python's
    for stale in Path(output).glob(f"chunk-{part}-*.bin"):  # a killed run's half of this part
        stale.unlink()
    # litdata names a writer's chunks and index by this rank (its optimize workers set it too)
    os.environ["DATA_OPTIMIZER_GLOBAL_RANK"] = str(part)
    try:
        cache = Cache(output, chunk_bytes=chunk_bytes, item_loader=TokensLoader())
        for index, item in enumerate(items):
            cache[index] = encode(item)
        cache.done()
    finally:
        del os.environ["DATA_OPTIMIZER_GLOBAL_RANK"]
    return {"part": part}


def part_index(output: Path, part: int) -> dict | None:
    """The index part `part` wrote when it finished; None before (or half-written by a kill)."""
    try:
        return json.loads((output / f"{part}.index.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def join_parts(output: Path, parts: list[int]) -> None:
    """The indexes of `parts` joined in that order into `index.json` (the format litdata's
    `optimize` writes)."""
    indexes = [part_index(output, k) for k in parts]
    if any(index is None for index in indexes) or any(
        index["config"] != indexes[0]["config"] for index in indexes
    ):
        raise RuntimeError(f"the parts' indexes in {output} are missing or disagree")
    chunks = [chunk for index in indexes for chunk in index["chunks"]]
    joined = {"chunks": chunks, "config": indexes[0]["config"], "updated_at": str(time.time())}
    write_text_atomic(output / "index.json", json.dumps(joined, sort_keys=True))
