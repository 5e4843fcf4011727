"""The settings of `launcher=ray` (its schema, registered as schema/launcher/ray)."""

from __future__ import annotations

from dataclasses import dataclass

from framework.config.fields import doc

STRATEGIES = ("PACK", "SPREAD", "STRICT_SPREAD")
FORWARDED = [
    "FW_*",
    "WANDB_*",
    "HF_*",
    "TRANSFORMERS_*",
    "TORCH_*",
    "NCCL_*",
    "GLOO_*",
    "DS_*",
    "OMP_NUM_THREADS",
    "PYTHONPATH",
]


@dataclass
class Config:
    """Run every rank as an actor on a Ray cluster, in one placement group."""

    kind: str = doc("ray", "Launcher plugin.")
    address: str = doc(
        "",
        "The Ray cluster: its head's HOST:PORT (the GCS port, 6379 by default), `auto` (the "
        "cluster this machine belongs to) or `local` (a new cluster on this machine, stopped "
        "when the job ends); empty: RAY_ADDRESS, else `local`.",
    )
    strategy: str = doc(
        "PACK",
        "How the ranks' bundles are placed on nodes (Ray's placement strategies): PACK as few "
        "nodes as possible, SPREAD over as many as possible, STRICT_SPREAD one node per rank. "
        "On CUDA each node takes one bundle of trainer.devices GPUs, one node each "
        "(STRICT_SPREAD), whatever this says.",
        STRATEGIES,
    )
    cpus_per_rank: int = doc(1, "CPUs reserved for each rank (and its CPU threads).", min=1)
    max_restarts: int = doc(
        0,
        "When a rank fails, its node is lost or the job hangs, stop every actor and start them "
        "again from the newest complete checkpoint, up to this many times.",
        min=0,
    )
    hang_timeout_s: float = doc(
        300.0,
        "End (or restart) the job when a rank makes no training progress for this many seconds, "
        "after saving every rank's Python stack in RUN_DIR/stacks (0: no watchdog).",
        min=0,
    )
    probe_timeout_s: float = doc(
        10.0,
        "How long the cluster's address may take to answer before the job is refused.",
        above=0,
    )
    placement_timeout_s: float = doc(
        600.0, "How long to wait for the cluster to free the job's bundles.", above=0
    )
    forward_env: list = doc(
        FORWARDED,
        "Environment variables of the fw process every rank gets (names; * matches any text); "
        "the rest of a rank's environment is its node's.",
    )
