"""Inside each worker: read the frozen config, build the Trainer and its parts, fit.

`entry` is the one way in, and the launchers are what call it: `launcher=local` in the `fw`
process for one process, or in each worker it forks, or as `python -m framework.worker
RUN_DIR/config.yaml [--resume CKPT]` in each worker it spawns (one process per device, with
torch's elastic environment variables); `launcher=slurm` in each SLURM task; framework.external
in each rank of a torchrun or srun job. Where `entry` runs in the `fw` process, it trains from
the job plan validation made there; a worker process makes its plan from config.yaml in one call
(framework/config/job_plan.py).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from framework import allocator, secrets, watchdog
from framework.config import job_plan
from framework.config.job_plan import JobPlan
from framework.context import RunContext, load_run_state
from framework.errors import EXIT_TERMINATED
from framework.instantiate import build_task, instantiate_args
from framework.logs import quiet_lightning, setup_logging
from framework.plugins import load_plugin, typed_config
from framework.processes import die_with_parent
from framework.strategy_base import StrategyInputs
from framework.world import RESTART_ENV, World

log = logging.getLogger("framework.worker")

# Not Lightning Trainer arguments: the process layout, and model transforms applied here.
TRAINER_KEYS_SKIPPED = (
    "devices",
    "num_nodes",
    "accelerator",
    "activation_checkpointing",
    "compile",
    "float8",
    "float8_skip",
    "malloc",
    "peak_tflops",
    "scale_lr",
    "reference_batch_size",
    "test_after_fit",
    "use_distributed_sampler",  # from task.data_order unless set (make_trainer)
)


STARTS = ("here", "fork", "spawn")  # how the process that runs `entry` came to be
MODULES_FILE = "modules.txt"  # in launcher=local's heartbeat directory: what a worker imported


class Terminated(RuntimeError):
    """The job's ranks stopped on SIGTERM without saving a checkpoint on it (no checkpoint
    callback, or `callbacks.checkpoint.on_preemption=false`): Lightning's own SIGTERM handling
    (`fw` exits 143, and a launcher does not restart the workers)."""

    exit_code = EXIT_TERMINATED


def terminated_message(run_dir: Path) -> str:
    from framework.checkpoint import disk

    newest = disk.listing(run_dir / "checkpoints")
    then = (
        f"the same command continues from the newest checkpoint (step {newest[0][0]})"
        if newest
        else "no checkpoint was saved: the same command starts over"
    )
    return (
        "stopped on SIGTERM without a checkpoint taken on it (callbacks.checkpoint is off or "
        f"its on_preemption is false); {then}"
    )


def entry(
    config_path: str | Path,
    resume_from: str | Path | None = None,
    started: str = "here",
    on_preempted: Callable[[Exception], None] | None = None,
    plan: JobPlan | DictConfig | None = None,
) -> None:
    """Train the job whose run directory holds `config_path` (its frozen config.yaml) as this
    process's rank, from the checkpoint `resume_from` (None or '': from the start).

    `plan`: the job's plan when it was made in this process (by validation in the `fw`
    process, which trains here: one process, or a rank of torchrun/srun), or config.yaml as
    the launcher read it (a forked worker's copy); without it the worker reads config.yaml. The
    worker makes its plan from the config (framework/config/job_plan.py, `for_worker`).

    `started`: "here" for the `fw` process itself (one process) and for a rank that torchrun,
    srun or SLURM started; "fork" or "spawn" for a worker process that launcher=local started,
    which then dies with its parent and ends with exit code 75 when preempted (what the
    launcher reads). A preemption (a checkpoint saved on SIGTERM/SIGUSR1/SIGUSR2) otherwise
    raises callbacks.checkpoint.callback.Preempted (`fw` exits 75), or, when `on_preempted` is given,
    is handed to it (launcher=slurm requeues the job).
    """
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from framework.callbacks.checkpoint.callback import Preempted

    if started not in STARTS:
        raise ValueError(f"started={started!r}: one of {', '.join(STARTS)}")
    if started != "here":
        become_child(started)
    path = Path(config_path)
    train = _train
    if started == "spawn":  # a forked worker's function is recorded by the elastic agent
        from torch.distributed.elastic.multiprocessing.errors import record

        train = record(_train)  # its exception, in the error file the launcher reports
    try:
        # nothing is returned: a forked worker's result would be pickled back to the launcher
        job = plan if plan is not None else OmegaConf.load(path)
        train(job, path.parent, Path(resume_from) if resume_from else None)
    except Preempted as stop:
        if on_preempted is not None:
            on_preempted(stop)
        elif started == "here":
            raise
        else:
            sys.exit(stop.exit_code)
    except SIGTERMException:
        # Lightning stopped every rank at the same step on SIGTERM, with no checkpoint taken on
        # it: its exception is a SystemExit of code 0, which a forked worker would end with as
        # if it had finished (the launcher then waits for a result that never comes).
        if started == "here":
            raise Terminated(terminated_message(path.parent)) from None
        sys.exit(EXIT_TERMINATED)


def become_child(started: str) -> None:
    """A worker process of launcher=local: dies with the launcher; a forked one drops the
    launcher's signal handlers (copied by fork), a spawned one finds the user's modules."""
    import signal

    if started == "fork":
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    die_with_parent()
    from framework.stores import sign_worker_store

    sign_worker_store()  # the process group's store: signed with the job's key
    if started == "spawn" and os.getcwd() not in sys.path:
        # started with -P: the user's modules, after the packages
        sys.path.append(os.getcwd())


def _train(job: JobPlan | DictConfig, run_dir: Path, resume_from: Path | None = None) -> Any:
    """Train one job in this process (`entry` calls it) from its plan, or from the frozen
    config it is made from; returns the fitted lightning.Trainer."""
    setup_logging()
    import lightning.pytorch as pl

    from framework.callbacks.checkpoint.callback import STATE_FILE, Checkpointer, Preempted
    from framework.config.elastic import fit_plan
    from framework.runtime.elastic import callbacks as elastic_callbacks
    from framework.runtime.lr_scaling import callbacks as scaling_callbacks
    from framework.runtime.vote import vote_on_sigterm

    quiet_lightning()
    # an elastic job that lost a node: the smaller world, with the global batch kept
    plan = fit_plan(job_plan.for_worker(job))
    cfg, world, data_parallel = plan.cfg, plan.world, plan.data_parallel
    allocator.configure(allocator.mode_for(cfg.trainer.malloc, world.is_cuda))  # first
    ctx = make_context(plan, run_dir, resume_from)
    # Read at import time by Lightning; a forked worker inherited the launcher's value (0).
    from lightning_utilities.core.rank_zero import rank_zero_only

    rank_zero_only.rank = world.rank
    limit_threads(world)
    use_tf32(world, str(cfg.trainer.precision))
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    task = build_task(cfg.task)
    data = instantiate_args(cfg.task.data)
    strategy = plan.strategy_plugin.build(plan.strategy, world, strategy_inputs(plan))
    loggers = build_loggers(cfg, ctx)
    if cfg.command != "fit":
        return evaluate(plan, run_dir, resume_from, ctx, task, data, strategy, loggers)
    callbacks = [
        build_callback(n, e, ctx) for n, e in (cfg.callbacks or {}).items() if e is not None
    ]
    beat = watchdog.start_beating(world.local_rank, world.rank)  # under launcher=local
    if world.is_cuda:
        (run_dir / "stacks").mkdir(exist_ok=True)
        for name, value in watchdog.nccl_settings(run_dir).items():
            os.environ.setdefault(name, value)
    callbacks += [beat] if beat is not None else []
    callbacks += scaling_callbacks(cfg.trainer, data_parallel[1], task, run_dir / "config.yaml")
    callbacks += elastic_callbacks(cfg)
    # with one global order the strategy distributes the loaders (framework.data.order)
    own_order = cfg.task.data_order == "global"
    trainer = make_trainer(cfg.trainer, world, strategy, loggers, callbacks, run_dir, own_order)
    voted = any(isinstance(c, Checkpointer) and c.cfg.on_preemption for c in callbacks)
    sigterm_vote = vote_on_sigterm(trainer, voted)  # no blocking broadcast per step
    name_modules(world)
    ckpt_path = str(resume_from / STATE_FILE) if resume_from else None
    restart = int(os.environ.get(RESTART_ENV, "0"))
    if restart:  # what torchrun's own restarts would say (0 under one agent run otherwise)
        os.environ["TORCHELASTIC_RESTART_COUNT"] = str(restart)
    if resume_from and trainer.is_global_zero:
        again = f" (restart {restart})" if restart else ""
        log.info("Resuming from %s (step %d)%s", resume_from, ctx.resume_step, again)
    trainer.fit(task, datamodule=data, ckpt_path=ckpt_path, weights_only=True)
    if sigterm_vote is not None:
        sigterm_vote.finish()
    checkpointer = next((c for c in callbacks if isinstance(c, Checkpointer)), None)
    preempted = checkpointer is not None and checkpointer.preempted_at is not None
    if cfg.trainer.test_after_fit and not preempted and not trainer.interrupted:
        test_after_fit(plan, run_dir, trainer.global_step)
    close_process_group()
    if preempted:
        raise Preempted(checkpointer.preempted_at, checkpointer.preempted_by)
    if trainer.is_global_zero:
        from framework.config.commands import after_fit

        then = after_fit(task, data, cfg.trainer.test_after_fit).replace("RUN_DIR", str(run_dir))
        log.info("Run finished at step %d. Outputs in %s%s", trainer.global_step, run_dir, then)
    return trainer


def strategy_inputs(plan: JobPlan, trust: bool = False) -> StrategyInputs:
    """What the strategy plugin's `build` gets besides its config (framework/strategy_base.py)."""
    from framework.parallel import float8
    from framework.parallel.transforms import ModelTransforms

    cfg = plan.cfg
    return StrategyInputs(
        transforms=ModelTransforms(
            cfg.trainer.activation_checkpointing,
            cfg.trainer.compile,
            float8.settings_for(cfg.trainer, plan.world.is_cuda),
        ),
        data_parallel=plan.data_parallel,
        data_order=cfg.task.data_order,
        trust_checkpoint=trust or cfg.run.trust_checkpoint,
    )


def build_loggers(cfg: DictConfig, ctx: RunContext) -> list[Any]:
    """The job's loggers: built-in plugins by `kind`, any Lightning logger by `_target_`."""
    loggers = [build_logger(n, e, ctx) for n, e in (cfg.logger or {}).items() if e is not None]
    return [lg for lg in loggers if lg is not None]  # a plugin may decline (e.g. disabled)


def evaluate(
    plan: JobPlan,
    run_dir: Path,
    checkpoint: Path | None,
    ctx: RunContext,
    task: Any,
    data: Any,
    strategy: Any,
    loggers: list[Any],
) -> Any:
    """`fw validate|test|predict` (`cfg.command`): Lightning's Trainer.validate/test/predict
    of the task from `checkpoint`, read by the strategy as a resume reads it (any layout,
    this rank's slices); the metrics to RUN_DIR/<command>.csv and the loggers, predictions to
    RUN_DIR/predictions (framework/runtime/evaluation.py). Returns the Trainer."""
    from framework.callbacks.checkpoint.callback import STATE_FILE
    from framework.runtime import evaluation

    cfg = plan.cfg
    callbacks = [
        build_callback(n, e, ctx)
        for n, e in (cfg.callbacks or {}).items()
        if e is not None and "_target_" in e  # the built-in callbacks serve training
    ]
    callbacks.append(evaluation.EvaluationRecord(run_dir, checkpoint, ctx.resume_step, plan.layout))
    if cfg.command == "predict":
        callbacks.append(evaluation.PredictionWriter(run_dir))
    own_order = cfg.task.data_order == "global"
    trainer = make_trainer(
        cfg.trainer, plan.world, strategy, loggers, callbacks, run_dir, own_order
    )
    ckpt_path = str(checkpoint / STATE_FILE) if checkpoint else None
    if trainer.is_global_zero:
        log.info("%s: %s (step %d)", cfg.command.capitalize(), checkpoint, ctx.resume_step)
    evaluation.run(trainer, task, data, cfg.command, ckpt_path)
    close_process_group()
    return trainer


def test_after_fit(plan: JobPlan, run_dir: Path, step: int) -> None:
    """`trainer.test_after_fit`: test the run's best checkpoint (checkpoints/best, kept by
    `callbacks.checkpoint.monitor`), else its newest, as `fw test RUN_DIR` does: a new task,
    strategy and Trainer in these processes, the checkpoint read as any evaluation reads it."""
    import dataclasses

    import lightning.pytorch as pl

    from framework.callbacks.checkpoint import chosen_checkpoint

    chosen = chosen_checkpoint(run_dir / "checkpoints")
    if chosen is None:
        log.warning("trainer.test_after_fit: no checkpoint to test (callbacks.checkpoint off?)")
        return
    cfg = OmegaConf.create(OmegaConf.to_container(plan.cfg))
    cfg.command = "test"
    tested = dataclasses.replace(plan, cfg=cfg)
    ctx = make_context(tested, run_dir, chosen)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    task = build_task(cfg.task)
    data = instantiate_args(cfg.task.data)
    inputs = strategy_inputs(tested, trust=True)  # written by this run
    strategy = plan.strategy_plugin.build(plan.strategy, plan.world, inputs)
    evaluate(tested, run_dir, chosen, ctx, task, data, strategy, build_loggers(cfg, ctx))


def name_modules(world: World) -> None:
    """Under launcher=local (its heartbeat directory set), local rank 0 names the modules it has
    imported once its Trainer is built: the fw process imports them while training runs
    (framework.launchers.local.Preload), so that the workers of a restart, forked from it,
    start with them imported."""
    directory = os.environ.get(watchdog.HEARTBEAT_ENV)
    if directory and world.local_rank == 0:
        from framework import files

        files.write_atomic(Path(directory) / MODULES_FILE, "\n".join(sorted(sys.modules)))


def make_trainer(
    trainer_cfg, world: World, strategy, loggers, callbacks, run_dir: Path, own_order: bool
) -> Any:
    """The lightning.Trainer: the `trainer` settings it takes, and the parts built here."""
    import lightning.pytorch as pl
    import torch

    trainer_args = {
        k: v
        for k, v in OmegaConf.to_container(trainer_cfg).items()
        if k not in TRAINER_KEYS_SKIPPED and v is not None
    }
    if trainer_cfg.max_epochs is None:
        # Unset epochs: unlimited when a step budget is given, else one pass over the data.
        trainer_args["max_epochs"] = -1 if trainer_cfg.max_steps > 0 else 1
    if trainer_cfg.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    if "profiler" not in trainer_args:  # no profiler asked for: the no-op one, minus its cost
        from framework.runtime.hooks import QuietProfiler

        trainer_args["profiler"] = QuietProfiler()
    if trainer_cfg.enable_progress_bar and not trainer_cfg.barebones:
        from framework.runtime.progress import StepProgressBar

        callbacks = [*callbacks, StepProgressBar()]  # one bar over the run's steps
    sampler = trainer_cfg.get("use_distributed_sampler")
    return pl.Trainer(
        accelerator="cuda" if world.is_cuda else "cpu",
        devices=world.devices,
        num_nodes=world.num_nodes,
        strategy=strategy,
        logger=loggers or False,
        callbacks=callbacks,
        enable_checkpointing=False,  # checkpoints come from callbacks.checkpoint
        default_root_dir=str(run_dir),
        use_distributed_sampler=(not own_order) if sampler is None else sampler,
        **trainer_args,
    )


def make_context(plan: JobPlan, run_dir: Path, resume_from: Path | None) -> RunContext:
    """What the logger and callback plugins are built with: the run's identity, where it
    resumes, and the plan's layout."""
    from framework.checkpoint import disk

    cfg = plan.cfg
    state = load_run_state(run_dir)
    step = disk.read_meta(resume_from)["step"] if resume_from else 0
    plain = OmegaConf.to_container(cfg, resolve=True)
    pattern = secrets.key_pattern(cfg.run.secret_keys)
    hidden = secrets.values_under_secret_keys(plain, pattern) | secrets.environment_credentials()
    return RunContext(
        run_dir=Path(run_dir),
        run_name=cfg.run.name or Path(run_dir).name,
        run_id=state.get("run_id", "local"),
        group=state.get("group"),
        config=secrets.redact(plain, pattern),
        world=plan.world,
        resume_from=resume_from,
        resume_step=step,
        data_parallel=plan.data_parallel,
        checkpoint_format=plan.checkpoint_format,
        secret_keys=tuple(cfg.run.secret_keys),
        secret_values=frozenset(hidden),
        command=cfg.command,
    )


def close_process_group() -> None:
    """Leave the process group together: a rank exiting while a peer still talks to it aborts."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def limit_threads(world: World) -> None:
    """Share the CPU cores between the local processes instead of oversubscribing them: each
    would otherwise start one thread per core. On CUDA too, where torchrun would set 1 (with
    several processes): a share keeps the CPU's own work (DeepSpeed's and FSDP's offloaded
    optimizer steps) fast. OMP_NUM_THREADS, when set (by the user, or torchrun), wins."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, world.devices)))


def use_tf32(world: World, precision: str) -> None:
    """On CUDA under full fp32 precision, float32 matmuls run on TF32 tensor cores (10-bit
    mantissa, fp32 range; about 8x the fp32 rate on A100 and H100), as nanoGPT and litgpt set
    it: training quality is the same in practice. `NVIDIA_TF32_OVERRIDE=0` keeps strict fp32.
    Under mixed precision autocast covers the matmuls, and those left in fp32 on purpose (MoE
    router scores) stay strict."""
    if world.is_cuda and precision in ("32-true", "32"):
        import torch

        torch.backends.cuda.matmul.allow_tf32 = True  # cuDNN's convolutions already use TF32


def build_callback(name: str, node: DictConfig, ctx: RunContext) -> Any:
    if "_target_" in node:
        return instantiate_args(node)
    return build_plugin("callbacks", name, node, ctx)


def build_logger(name: str, node: DictConfig, ctx: RunContext) -> Any:
    """A logger plugin's logger (`kind`), or any Lightning logger class (`_target_`) with the
    run's directory and id filled in where the class takes them and the entry does not say
    (framework/loggers/targets.py)."""
    if "_target_" in node:
        from framework.loggers.targets import build_target

        return build_target(name, node, ctx)
    return build_plugin("logger", name, node, ctx)


def build_plugin(family: str, name: str, node: DictConfig, ctx: RunContext) -> Any:
    """A logger or callback plugin's object, built from its typed config."""
    plugin = load_plugin(family, node.kind, f"{family}.{name}.kind")
    return plugin.build(typed_config(plugin, node), ctx)


def main(argv: list[str] | None = None) -> None:
    """`python -m framework.worker CONFIG [--resume CKPT]`: a worker spawned by launcher=local."""
    args = sys.argv[1:] if argv is None else argv
    resume = args[args.index("--resume") + 1] if "--resume" in args else None
    try:
        entry(args[0], resume, "spawn")
    except BaseException:
        from framework.logs import redact_uncaught

        redact_uncaught()  # the traceback Python prints next, without secrets
        raise


if __name__ == "__main__":
    main()
