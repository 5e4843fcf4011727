"""`launcher=slurm`: submit the job to SLURM (through submitit) and return.

The config is composed and checked once, here, and the run directory written; then one SLURM job
is submitted with `trainer.num_nodes` nodes and `trainer.devices` tasks per node (GPUs per node
on CUDA). Inside the allocation every task trains as the rank SLURM gives it, the way `srun fw
train ...` does (framework.external), reading the run directory's config.yaml.

Preemption: SLURM sends `signal` (USR2 by default, `signal_delay_s` before the end of the time
limit or before a preemption); every rank saves a checkpoint at the next step, rank 0 asks SLURM
to requeue the job (`scontrol requeue`, at most `max_requeues` times) and the requeued job
continues from that checkpoint in the same run directory, with the same W&B run. SIGTERM (what
`scancel` and SLURM's preemption send) also saves before the job ends.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from framework.config.fields import doc
from framework.errors import ConfigError
from framework.world import RESTART_ENV, World, global_rank

if TYPE_CHECKING:
    from framework.config.job_plan import JobPlan

log = logging.getLogger("framework.launcher")

__all__ = ["Config", "Task", "build", "join", "redact_scripts", "validate"]


@dataclass
class Config:
    """Submit one SLURM job (submitit): `trainer.num_nodes` nodes x `trainer.devices` tasks."""

    kind: str = doc("slurm", "Launcher plugin.")
    partition: str | None = doc(None, "SLURM partition (--partition); None: the default one.")
    time_min: int = doc(60, "Time limit in minutes (--time).", min=1)
    account: str | None = doc(None, "SLURM account (--account).")
    qos: str | None = doc(None, "Quality of service (--qos).")
    constraint: str | None = doc(None, "Node features (--constraint).")
    cpus_per_task: int | None = doc(None, "CPUs per task (--cpus-per-task); None: SLURM's.", min=1)
    mem_gb: float | None = doc(None, "Memory per node in GB (--mem); None: SLURM's.", above=0)
    job_name: str | None = doc(None, "SLURM job name; None: the run directory's name.")
    sbatch: dict = doc({}, "More sbatch options, name: value (e.g. {exclusive: true}).")
    setup: list = doc([], "Shell lines the job runs before starting the tasks (module load ...).")
    signal: str = doc(
        "USR2",
        "The signal SLURM sends before the time limit or a preemption: every rank saves, then "
        "the job is requeued.",
        ("USR1", "USR2", "TERM"),
    )
    signal_delay_s: int = doc(120, "How long before the end SLURM sends `signal`.", min=1)
    max_requeues: int = doc(
        10, "How many times a signalled job requeues itself (then it just stops).", min=0
    )
    min_nodes: int | None = doc(
        None,
        "Shrinking is not supported under launcher=slurm: only null or trainer.num_nodes are "
        "accepted (a lost node ends the SLURM job; run.dir keeps its checkpoints).",
        min=1,
    )


def validate(cfg: Config, world: World) -> None:
    if cfg.min_nodes is not None and cfg.min_nodes != world.num_nodes:
        # a SLURM job's allocation is fixed: srun's steps cannot re-form on fewer nodes, and a
        # requeue at a smaller node count is not something sbatch offers
        raise ConfigError(
            "launcher.min_nodes",
            cfg.min_nodes,
            f"launcher=slurm does not shrink a job (trainer.num_nodes={world.num_nodes}): a "
            "lost node ends the SLURM job, and its checkpoints stay in run.dir",
            hint="Leave launcher.min_nodes null (or equal to trainer.num_nodes), or start "
            "`fw train launcher=local launcher.min_nodes=...` on each node for an elastic job.",
        )
    if shutil.which("sbatch") is None:
        raise ConfigError(
            "launcher",
            "slurm",
            "sbatch is not on PATH: this machine cannot submit SLURM jobs",
            hint="Run fw on a SLURM login node, or use launcher=local.",
        )


def join(cfg: Config, world: World, config: dict) -> bool:
    """Submitting is done from one machine: it writes the run directory."""
    return True


def build(cfg: Config, plan: JobPlan):
    """A function that submits the job and returns once SLURM accepted it (each task makes
    its plan from config.yaml)."""
    world = plan.world

    def launch(config_path: Path, resume_from: Path | None = None) -> None:
        import submitit

        run_dir = config_path.parent
        executor = submitit.SlurmExecutor(folder=run_dir / "slurm", max_num_timeout=0)
        options = {"signal": f"{cfg.signal}@{cfg.signal_delay_s}", **cfg.sbatch}
        executor.update_parameters(
            job_name=cfg.job_name or run_dir.name,
            nodes=world.num_nodes,
            ntasks_per_node=world.devices,
            gpus_per_node=world.devices if world.is_cuda else None,
            cpus_per_task=cfg.cpus_per_task,
            mem=f"{cfg.mem_gb:g}GB" if cfg.mem_gb else None,
            time=cfg.time_min,
            partition=cfg.partition,
            account=cfg.account,
            qos=cfg.qos,
            constraint=cfg.constraint,
            setup=list(cfg.setup),
            additional_parameters=options,
        )
        task = Task(str(config_path), str(resume_from or ""), cfg.signal, cfg.max_requeues, world)
        job = executor.submit(task)
        logs = run_dir / "slurm"
        redact_scripts(logs)
        log.info(
            "Submitted SLURM job %s (%d node(s) x %d task(s)). Follow it with: squeue -j %s; "
            "tail -f %s/%s_0_log.err (one log per rank in %s)",
            job.job_id,
            world.num_nodes,
            world.devices,
            job.job_id,
            logs,
            job.job_id,
            logs,
        )

    return launch


def redact_scripts(folder: Path) -> None:
    """The submission scripts submitit leaves in the run directory, with secrets replaced (a
    `launcher.setup` line may hold one): SLURM ran sbatch on them and keeps its own copy, so the
    files are only there to be read. The pickled Task holds paths and the signal, no config."""
    from framework import files
    from framework.secrets import redact_text

    for script in sorted(folder.glob("*.sh")):
        text = script.read_text()
        shown = redact_text(text)
        if shown != text:
            files.write_atomic(script, shown, mode=script.stat().st_mode & files.FILE_MODE)


class Task:
    """What every SLURM task runs: train as the rank SLURM gives it; when a preemption signal
    stopped training (a checkpoint was saved), rank 0 requeues the job."""

    def __init__(
        self, config_path: str, resume_from: str, signame: str, max_requeues: int, world: World
    ) -> None:
        self.config_path, self.resume_from = config_path, resume_from
        self.signal, self.max_requeues = signame, max_requeues
        self.world = world  # as planned in the fw process

    def __call__(self) -> str:
        from framework import checkpointing, worker
        from framework.external import check_world

        run_dir = Path(self.config_path).parent
        requeued = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
        os.environ[RESTART_ENV] = str(requeued)
        resume = Path(self.resume_from) if self.resume_from else None
        if requeued:  # continue from the newest checkpoint the job completed
            resume = checkpointing.newest_complete(run_dir / "checkpoints") or resume
        check_world(self.world)
        stopped = []
        worker.entry(self.config_path, resume, on_preempted=stopped.append)
        if not stopped:
            return "finished"
        stop = stopped[0]
        # the job's signal requeues; SIGTERM (scancel, or SLURM's own preemption) stops
        if global_rank() == 0 and stop.signum == signal.Signals[f"SIG{self.signal}"]:
            requeue(stop.step, requeued, self.max_requeues)
        elif global_rank() == 0:
            log.warning("%s (by %s)", stop, signal.Signals(stop.signum).name)
        return "preempted"


def requeue(step: int, requeued: int, max_requeues: int) -> None:
    """Put this SLURM job back in the queue (it continues from the checkpoint just saved)."""
    job = os.environ.get("SLURM_JOB_ID")
    if job is None:
        return
    if requeued >= max_requeues:
        log.warning(
            "Checkpoint saved at step %d; not requeued: launcher.max_requeues=%d reached. Run "
            "the same command to continue.",
            step,
            max_requeues,
        )
        return
    log.warning(
        "Checkpoint saved at step %d; requeueing SLURM job %s (%d)", step, job, requeued + 1
    )
    subprocess.run(["scontrol", "requeue", job], check=False)
