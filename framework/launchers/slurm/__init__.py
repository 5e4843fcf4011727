"""`launcher=slurm`: submit the job to SLURM (through submitit) and return.

The config is composed and checked once, here, and the run directory written; then one SLURM job
is submitted with `trainer.num_nodes` nodes and `trainer.devices` tasks per node (GPUs per node
on CUDA). Inside the allocation every task trains as the rank SLURM gives it, the way `srun fw
train ...` does (framework.external), reading the run directory's config.yaml.

Elastic (`launcher.min_nodes` below `trainer.num_nodes`): the job runs one task per node, and
each task is that node's agent, as `fw train launcher=local` is on each machine of a job over
several machines (framework.launch.elastic): it starts `trainer.devices` workers, and the
agent of the allocation's first node keeps the rendezvous store. The job is submitted so that
SLURM lets the other tasks run on when one ends (`--no-kill`, `srun --kill-on-bad-exit=0
--wait=0`): when a node's agent is gone, the agents left continue from the newest checkpoint
on fewer nodes, with the same global batch. A SLURM allocation does not take a lost node back:
the job only shrinks.

Preemption: SLURM sends `signal` (USR2 by default, `signal_delay_s` before the end of the time
limit or before a preemption); every rank saves a checkpoint at the next step, rank 0 asks SLURM
to requeue the job (`scontrol requeue`, at most `max_requeues` times) and the requeued job
continues from that checkpoint in the same run directory, with the same W&B run. SIGTERM (what
`scancel` and SLURM's preemption send) also saves before the job ends.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from framework.config.fields import doc
from framework.errors import ConfigError
from framework.processes import find_user_modules, python
from framework.world import RESTART_ENV, World, global_rank

if TYPE_CHECKING:
    from framework.config.job_plan import JobPlan

log = logging.getLogger("framework.launcher")

__all__ = ["Config", "Task", "TaskFailed", "build", "join", "redact_scripts", "validate"]


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
        "With trainer.num_nodes > 1: the fewest nodes the job goes on with when one is lost "
        "(its task or machine gone): the others continue from the newest checkpoint with the "
        "same global batch. A lost node does not come back into the allocation: the job only "
        "shrinks (null: trainer.num_nodes, a lost node ends the job).",
        min=1,
    )


def validate(cfg: Config, world: World) -> None:
    if cfg.min_nodes is not None and cfg.min_nodes > world.num_nodes:
        raise ConfigError(
            "launcher.min_nodes",
            cfg.min_nodes,
            f"more than trainer.num_nodes={world.num_nodes}",
            hint=f"Use 1 to {world.num_nodes} (null: {world.num_nodes}).",
        )
    if shutil.which("sbatch") is None:
        raise ConfigError(
            "launcher",
            "slurm",
            "sbatch is not on PATH: this machine cannot submit SLURM jobs",
            hint="Run fw on a SLURM login node, or use launcher=local.",
        )


def join(cfg: Config, world: World, config: dict) -> bool:
    """Submitting is done from one machine: it writes the run directory. An elastic job's
    global batch is checked first for every smaller world it may shrink to."""
    if elastic(cfg, world):
        from framework.config import elastic as elastic_batch

        elastic_batch.check(config, world, cfg.min_nodes)
    return True


def elastic(cfg: Config, world: World) -> bool:
    """Whether the job goes on with fewer nodes when one is lost."""
    return world.num_nodes > 1 and cfg.min_nodes is not None and cfg.min_nodes < world.num_nodes


def build(cfg: Config, plan: JobPlan):
    """A function that submits the job and returns once SLURM accepted it (each task makes
    its plan from config.yaml)."""
    world = plan.world

    def launch(config_path: Path, resume_from: Path | None = None) -> None:
        run_dir = config_path.parent
        executor = slurm_executor(run_dir / "slurm")
        options = {"signal": f"{cfg.signal}@{cfg.signal_delay_s}", **cfg.sbatch}
        tasks, cpus, srun_args = world.devices, cfg.cpus_per_task, None
        if elastic(cfg, world):  # one agent per node, which SLURM lets die alone
            # the node's workers share its one task: as many CPUs as its devices' tasks get
            tasks, cpus = 1, (cfg.cpus_per_task or 1) * world.devices
            options = {"no_kill": True, **options}
            srun_args = ["--no-kill", "--kill-on-bad-exit=0", "--wait=0"]
        executor.update_parameters(
            job_name=cfg.job_name or run_dir.name,
            nodes=world.num_nodes,
            ntasks_per_node=tasks,
            gpus_per_node=world.devices if world.is_cuda else None,
            cpus_per_task=cpus,
            mem=f"{cfg.mem_gb:g}GB" if cfg.mem_gb else None,
            time=cfg.time_min,
            partition=cfg.partition,
            account=cfg.account,
            qos=cfg.qos,
            constraint=cfg.constraint,
            setup=list(cfg.setup),
            additional_parameters=options,
            srun_args=srun_args,
        )
        min_nodes = cfg.min_nodes if elastic(cfg, world) else None
        task = Task(
            str(config_path), str(resume_from or ""), cfg.signal, cfg.max_requeues, world, min_nodes
        )
        with job_token(elastic(cfg, world)):  # in the job's environment, in no file
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


def slurm_executor(folder: Path):
    """submitit's executor, its tasks' Python started with -P (sbatch runs the job in the
    directory `fw` was started from: a stray `torch.py` there is not imported in place of
    torch; the Task appends the directory for the user's modules)."""
    import shlex

    import submitit

    return submitit.SlurmExecutor(folder=folder, max_num_timeout=0, python=shlex.join(python()))


@contextlib.contextmanager
def job_token(needed: bool):
    """While submitting: in the environment sbatch hands to the job (so that it is written into
    no file of the run directory), the key every task signs its process group's store with (a
    new random one: torch's store on the first task's node listens on every interface) and,
    for an elastic job, the token its node agents share at the rendezvous (FW_RDZV_TOKEN if
    set, else a new random one)."""
    from framework.launch import rendezvous
    from framework.stores import STORE_KEY_ENV

    added = {STORE_KEY_ENV: secrets.token_hex(32)}
    if needed and not os.environ.get(rendezvous.TOKEN_ENV):
        added[rendezvous.TOKEN_ENV] = secrets.token_hex(16)
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


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


class TaskFailed(RuntimeError):
    """A task's exception, as its traceback with secrets replaced: what submitit keeps and
    prints of it."""


class Task:
    """What every SLURM task runs: train as the rank SLURM gives it; when a preemption signal
    stopped training (a checkpoint was saved), rank 0 requeues the job."""

    def __init__(
        self,
        config_path: str,
        resume_from: str,
        signame: str,
        max_requeues: int,
        world: World,
        min_nodes: int | None = None,
    ) -> None:
        self.config_path, self.resume_from = config_path, resume_from
        self.signal, self.max_requeues = signame, max_requeues
        self.world = world  # as planned in the fw process
        self.min_nodes = min_nodes  # an elastic job: this task is its node's agent

    def __call__(self) -> str:
        try:
            return self.train()
        except Exception as err:  # what submitit catches
            # submitit keeps the traceback it catches in RUN_DIR/slurm/*_result.pkl and prints
            # it in the task's log: the task's exception may hold a secret value
            from framework.logs import format_exception

            raise TaskFailed(format_exception(err)) from None

    def train(self) -> str:
        """Train as this task's rank (or as its node's agent); 'finished' or 'preempted'."""
        from framework import worker
        from framework.checkpoint import disk
        from framework.external import check_world

        find_user_modules(os.getcwd())  # started with -P: the user's modules, after the packages
        run_dir = Path(self.config_path).parent
        requeued = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
        os.environ[RESTART_ENV] = str(requeued)
        resume = Path(self.resume_from) if self.resume_from else None
        if requeued:  # continue from the newest checkpoint the job completed
            resume = disk.newest_complete(run_dir / "checkpoints") or resume
        if self.min_nodes is not None:
            return self.run_node(resume, requeued)
        check_world(self.world)
        from framework.stores import sign_worker_store

        sign_worker_store()  # the tasks' process-group store: signed with the job's key
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

    def run_node(self, resume: Path | None, requeued: int) -> str:
        """This node's agent in an elastic job: the elastic loop of launcher=local, with the
        rendezvous on the allocation's first node (its agent keeps the store), at most one
        restart per node the job may lose."""
        from omegaconf import OmegaConf

        from framework.checkpoint import disk
        from framework.launch import rendezvous
        from framework.launchers import local

        world, job = self.world, os.environ.get("SLURM_JOB_ID", "0")
        nodes = int(os.environ.get("SLURM_JOB_NUM_NODES", os.environ.get("SLURM_NNODES", "1")))
        if nodes != world.num_nodes:
            raise ConfigError(
                "trainer.num_nodes",
                world.num_nodes,
                f"the SLURM job has {nodes} node(s)",
                hint=f"Ask SLURM for --nodes={world.num_nodes}.",
            )
        first, port = first_node(), rdzv_port(job)
        agent = local.Config(
            rdzv_endpoint=f"{first}:{port}",
            rdzv_id=f"slurm-{job}-{requeued}",
            min_nodes=self.min_nodes,
            max_restarts=world.num_nodes - self.min_nodes,  # each restart loses a node
        )
        token = rendezvous.job_token("")
        if not token:
            raise ConfigError(
                "launcher.rdzv_token",
                "",
                f"{rendezvous.TOKEN_ENV} did not reach the job's tasks",
                hint="Keep sbatch's default --export=ALL (launcher.sbatch.export).",
            )
        hosting = os.environ.get("SLURM_NODEID", "0") == "0"
        if not hosting:  # the first node's agent keeps the store: let it open it first
            wait_listening(first, port, agent.join_timeout_s)
        config = OmegaConf.to_container(OmegaConf.load(self.config_path))
        rendezvous.join(
            agent.rdzv_endpoint, agent.rdzv_id, token, world.num_nodes, config, agent.join_timeout_s
        )
        for name in TASK_VARIABLES:  # the workers are the agent's, not srun's tasks
            os.environ.pop(name, None)
        method = "spawn" if world.is_cuda else "fork"
        signals: list[int] = []
        try:
            local.run_elastic(agent, world, method, Path(self.config_path), resume, signals)
        except local.WorkersPreempted:
            ours = signal.Signals[f"SIG{self.signal}"]
            if hosting and ours in signals:  # one node requeues the job
                saved = disk.listing(Path(self.config_path).parent / "checkpoints")
                requeue(saved[0][0] if saved else 0, requeued, self.max_requeues)
            return "preempted"
        return "finished"


# srun's variables for its tasks: a node agent's workers must not read themselves as those
TASK_VARIABLES = (
    "SLURM_NTASKS",
    "SLURM_NPROCS",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_STEP_TASKS_PER_NODE",
)


def first_node() -> str:
    """The host name of the allocation's first node (where the rendezvous store lives)."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST", os.environ.get("SLURM_NODELIST", ""))
    done = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True
    )
    return done.stdout.split()[0]


def wait_listening(host: str, port: int, timeout_s: float) -> None:
    """Wait until something listens on host:port (the rendezvous store of the first node)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def rdzv_port(job: str) -> int:
    """The rendezvous port of an elastic job, the same on every node: from the job id."""
    return 15000 + int(job) % 10000


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
