"""An elastic job over several machines: `launcher.min_nodes` below `trainer.num_nodes`.

Every node's `fw` process runs the same loop (local.run_elastic). The job's starts are numbered
generations in the rendezvous store (rendezvous.Generations); each generation is one torch
rendezvous that forms with at least `min_nodes` nodes (the first one: all of them), at most
`num_nodes`, and every generation resumes from the newest complete checkpoint:

- A node is lost (its fw process or machine gone): the collectives of the others fail, their
  fw processes move the job to the next generation and, after `launcher.rejoin_wait_s` without
  more nodes arriving, form the smaller world. The workers keep the global batch
  (framework.config.elastic), so the samples of each step and the losses are those of the full
  world.
- A node comes back (its `fw train` command started again): it joins the job late (its config
  checked against the first node's), moves the job to the next generation expecting one node
  more, and waits. The running nodes' watches see the new generation and send their workers the
  preemption signal: they save a checkpoint at the next step boundary and stop; then every node
  forms the larger world from that checkpoint.

Each change is a restart, counted against `launcher.max_restarts` and recorded in run.json. The
node whose address `launcher.rdzv_endpoint` names keeps the store: losing that one ends the job.
Under launcher=slurm each node's SLURM task runs the same loop (framework.launchers.slurm), with
the store on the allocation's first node; there a job only shrinks (a lost node does not come
back into the allocation).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable

log = logging.getLogger("framework.launcher")

POLL_S = 0.2  # how often the watches and a returning node read the store


class Watch:
    """While this node's workers run: a thread that reads the job's generation and, once
    another node moved the job on (a node comes back), sends the workers the preemption signal
    once: they save a checkpoint at the next step and stop (`fired` says why)."""

    def __init__(self, generations, generation: int, signal_workers: Callable[[int], None]):
        self.generations, self.generation = generations, generation
        self.signal_workers = signal_workers
        self.fired: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fw-elastic-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                moved = self.generations.current() > self.generation
            except (RuntimeError, OSError):  # the store's node ended (the job finished there)
                return
            if moved:
                self.fired = "a node joins the job: stopped at a checkpoint to grow the world"
                log.info("A node joins the job: checkpoint at the next step, then grow")
                self.signal_workers(signal.SIGUSR1)
                return


def come_back(generations, generation: int, num_nodes: int, timeout_s: float) -> int:
    """A node that joins a running job: move it to the next generation, which waits for the
    nodes of the running one and this one, and start once their workers have stopped at a
    checkpoint (a node's workers stop only after the checkpoint every rank saved together, so
    all nodes then resume from it). Returns the generation to start in."""
    members = generations.count("members", generation)  # a lost node among them, maybe
    expect = min(num_nodes, members + 1)
    joined = generations.advance(generation, expect)
    log.info("Joining the running job: %d node(s) from its next step", expect)
    deadline = time.monotonic() + timeout_s
    while generations.count("stopped", generation) < 1 and time.monotonic() < deadline:
        time.sleep(POLL_S)
    return joined
