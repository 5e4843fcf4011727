"""Running inside a job that already started the processes: torchrun or SLURM (`srun`).

`fw` then starts nothing: this module is the launcher the runner picks there by itself (in
place of `launcher.kind`), and each process trains as the rank it already is. Its process
layout must be the one the config asks for (`trainer.devices` per node x `trainer.num_nodes`),
checked before anything is written. Under SLURM the tasks per node come from
`SLURM_TASKS_PER_NODE` (what `srun -n N` sets); Lightning reads `SLURM_NTASKS_PER_NODE` (what
`--ntasks-per-node` sets), so it is filled in from the former when only that is given.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from framework.config.fields import doc
from framework.errors import ConfigError
from framework.world import World, global_rank

if TYPE_CHECKING:
    from framework.config.job_plan import JobPlan

KIND = "framework.external"  # not a `launcher=` choice: fw picks it inside torchrun/srun


@dataclass
class Config:
    """No settings: the enclosing torchrun or SLURM job has started the processes already."""

    kind: str = doc(KIND, "Launcher plugin (picked by fw inside torchrun/srun).")


def validate(cfg: Config, world: World) -> None:
    check_world(world)


def join(cfg: Config, world: World, config: dict) -> bool:
    """Rank 0 writes the run directory's state (run.json); every rank has composed the same
    config, and writes config.yaml itself before reading it back."""
    return global_rank() == 0


def build(cfg: Config, plan: JobPlan):
    """A function that trains this process as its rank of the enclosing job, from the plan
    validation made in this process."""

    def launch(config_path: Path, resume_from: Path | None = None) -> None:
        from framework import worker

        worker.entry(config_path, resume_from, plan=plan)

    return launch


def job_id() -> str | None:
    """The id of an enclosing torchrun or SLURM job whose processes we are, or None."""
    if "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_RANK" in os.environ:
        return os.environ["TORCHELASTIC_RUN_ID"]
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ:
        return f"slurm-{os.environ.get('SLURM_JOB_ID', 'job')}"
    return None


def tasks_per_node(value: str) -> list[int]:
    """SLURM's compact task counts ('2', '2(x3)', '4,2(x2)') as one count per node."""
    counts: list[int] = []
    for part in value.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ValueError(f"cannot read SLURM_TASKS_PER_NODE={value!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def check_world(world: World) -> None:
    """The config's process layout is the enclosing job's; fills in SLURM_NTASKS_PER_NODE."""
    size = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
    if world.world_size != size:
        raise ConfigError(
            "trainer.devices",
            world.devices,
            f"devices x num_nodes = {world.world_size} but the enclosing job has {size} processes",
            hint="Set trainer.devices (per node) and trainer.num_nodes to match the launcher.",
        )
    if "WORLD_SIZE" in os.environ or "SLURM_NTASKS_PER_NODE" in os.environ:
        return
    counts = tasks_per_node(os.environ.get("SLURM_TASKS_PER_NODE", str(size)))
    if len(set(counts)) != 1 or counts[0] != world.devices or len(counts) != world.num_nodes:
        raise ConfigError(
            "trainer.devices",
            world.devices,
            f"SLURM placed {os.environ.get('SLURM_TASKS_PER_NODE')} tasks per node on "
            f"{len(counts)} node(s); every node must run trainer.devices tasks",
            hint=f"Ask SLURM for --ntasks-per-node={world.devices} --nodes={world.num_nodes}.",
        )
    os.environ["SLURM_NTASKS_PER_NODE"] = str(counts[0])  # what Lightning reads
