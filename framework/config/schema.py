"""Schemas of the config groups that belong to the framework itself.

Strategy, logger and callback schemas live next to the code that uses them (one module per plugin)
and are registered by `framework.config.store`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from framework.config.fields import doc
from framework.lr_scaling import RULES as LR_SCALING_RULES

ACCELERATORS = ("auto", "cpu", "gpu", "cuda")
PRECISIONS = ("32-true", "32", "16-mixed", "bf16-mixed", "bf16-true", "16-true", "64-true")
SCHEDULERS = ("constant", "cosine", "linear")
BACKENDS = (None, "gloo", "nccl")
COMMANDS = ("fit", "validate", "test", "predict")  # Lightning's TrainerFn names
# lightning.Trainer arguments the framework sets itself, and where a config sets them instead
TRAINER_OWNED = {
    "strategy": "the strategy group (strategy=ddp|fsdp|zero3|tensor|pipeline|...)",
    "logger": "the logger group (logger=[csv,tensorboard], +logger.NAME._target_=CLASS)",
    "callbacks": "the callbacks group (+callbacks.NAME._target_=CLASS)",
    "plugins": "strategy.* and trainer.precision",
    "enable_checkpointing": "callbacks.checkpoint (~callbacks.checkpoint turns it off)",
    "default_root_dir": "run.dir",
}


@dataclass
class CollectiveSettings:
    """What every strategy that talks over a process group shares: the backend and how long a
    collective may wait. A strategy's `Config` subclasses it and sets `kind`'s default (kind is
    declared here so that it stays the first field, as `fw config` shows it)."""

    kind: str = doc(MISSING, "Strategy plugin.")
    backend: str | None = doc(
        None, "Collective backend (None: nccl on CUDA, gloo on CPU).", BACKENDS
    )
    timeout_s: int = doc(1800, "Seconds a collective may wait before the job fails.", min=1)


@dataclass
class SchedulerConfig:
    """Learning-rate schedule applied by TaskModule.configure_optimizers, stepped every optimizer step."""

    name: str = doc("constant", "Shape of the schedule after warm-up.", SCHEDULERS)
    warmup_steps: int = doc(0, "Steps of linear warm-up from 0 to the optimizer's lr.", min=0)
    min_lr_ratio: float = doc(
        0.1, "Final lr as a fraction of the peak (cosine and linear).", min=0, max=1
    )


@dataclass
class TaskConfig:
    """The user's task: a LightningModule class, its arguments, its data and its optimizer."""

    _target_: str = doc(MISSING, "Dotted path of the task class (a LightningModule).")
    model: dict[str, Any] = doc(
        {}, "Keyword arguments of the task class, checked against its signature."
    )
    data: dict[str, Any] = doc(
        {}, "`_target_` (a LightningDataModule class) and its keyword arguments."
    )
    optimizer: dict[str, Any] = doc(
        {"_target_": "torch.optim.AdamW", "lr": 1e-3},
        "`_target_` (an optimizer class) and its keyword arguments, no others (a class "
        "named without arguments gets its own defaults); used by TaskModule tasks.",
    )
    scheduler: SchedulerConfig = doc(
        SchedulerConfig(), "Learning-rate schedule (TaskModule tasks)."
    )
    data_order: str = doc(
        "global",
        "global: plain DataLoaders (shuffle=True/False) get one seeded order for any process "
        "count, resumed exactly mid-epoch; keep: leave the loaders to Lightning.",
        ("global", "keep"),
    )


@dataclass
class TrainerConfig:
    """Settings passed to lightning.Trainer."""

    accelerator: str = doc(
        "auto", "Device type; auto picks cuda when present, else cpu.", ACCELERATORS
    )
    devices: int = doc(1, "Processes (one per device) on each node.", min=1)
    num_nodes: int = doc(1, "Number of machines.", min=1)
    precision: str = doc("32-true", "Numeric precision of parameters and compute.", PRECISIONS)
    max_steps: int = doc(-1, "Stop after this many optimizer steps (-1: no step limit).", min=-1)
    max_epochs: int | None = doc(
        None,
        "Stop after this many epochs (None: unlimited if max_steps is set, else 1; -1: unlimited).",
        min=-1,
    )
    min_steps: int | None = doc(None, "Train at least this many optimizer steps.", min=0)
    min_epochs: int | None = doc(None, "Train at least this many epochs.", min=0)
    max_time: Any = doc(
        None,
        "Stop after this much training time: 'DD:HH:MM:SS' or {days:, hours:, minutes:, "
        "seconds:}; the checkpoint callback saves on stopping, so the run resumes.",
    )
    val_check_interval: Any = doc(
        None, "Validate every N training batches (int) or fraction of an epoch (float).", above=0
    )
    check_val_every_n_epoch: int | None = doc(
        1, "Validate every N epochs (None: by step only).", min=1
    )
    limit_train_batches: Any = doc(
        None, "Use only this many (int) or this fraction (float) of batches.", min=0
    )
    limit_val_batches: Any = doc(
        None, "Validate on this many (int) or this fraction (float) of batches.", min=0
    )
    limit_test_batches: Any = doc(
        None, "Test on this many (int) or this fraction (float) of batches.", min=0
    )
    limit_predict_batches: Any = doc(
        None, "Predict on this many (int) or this fraction (float) of batches.", min=0
    )
    reload_dataloaders_every_n_epochs: int = doc(
        0, "Ask the data module for new loaders every N epochs (0: never).", min=0
    )
    num_sanity_val_steps: int = doc(
        0, "Validation batches run before training to catch bugs early (-1: all).", min=-1
    )
    log_every_n_steps: int = doc(10, "Write training metrics every N optimizer steps.", min=1)
    accumulate_grad_batches: int = doc(
        1, "Batches whose gradients are summed before each step.", min=1
    )
    scale_lr: str = doc(
        "none",
        "Scale every optimizer's lr with the global batch (data-parallel ranks x per-rank batch x "
        "accumulate_grad_batches) against reference_batch_size: linear (x global/reference), "
        "sqrt (x its square root, for Adam) or none.",
        LR_SCALING_RULES,
    )
    reference_batch_size: int | None = doc(
        None, "The global batch size the configured lr was tuned at (needed by scale_lr).", min=1
    )
    gradient_clip_val: float | None = doc(
        None, "Clip gradients to this value (None: no clipping).", above=0
    )
    gradient_clip_algorithm: str = doc("norm", "How gradients are clipped.", ("norm", "value"))
    deterministic: bool = doc(False, "Use deterministic algorithms (bitwise repeatable runs).")
    benchmark: bool | None = doc(None, "cudnn.benchmark (None: Lightning's default).")
    enable_progress_bar: bool = doc(True, "Show a progress bar on the console (rank 0).")
    enable_model_summary: bool = doc(True, "Print a table of the model's layers at start.")
    overfit_batches: Any = doc(
        0,
        "Train and validate on this many batches (int) or fraction (float) only (debugging).",
        min=0,
    )
    fast_dev_run: Any = doc(
        False,
        "Run N (true: 1) train and val batches once, with no loggers or checkpoints "
        "(a smoke test).",
    )
    profiler: str | None = doc(None, "Lightning profiler.", (None, "simple", "advanced", "pytorch"))
    detect_anomaly: bool = doc(False, "Enable autograd anomaly detection (slow).")
    inference_mode: bool = doc(True, "Evaluate under torch.inference_mode (false: torch.no_grad).")
    use_distributed_sampler: bool | None = doc(
        None,
        "Lightning's DistributedSampler for the loaders (None: as task.data_order says; "
        "true/false need task.data_order=keep).",
    )
    sync_batchnorm: bool = doc(False, "BatchNorm statistics synchronised over the processes.")
    barebones: bool = doc(
        False, "Lightning's minimal-overhead mode (no progress bar, no logging, no summary)."
    )
    enable_autolog_hparams: bool = doc(True, "Log the task's hyperparameters to the loggers.")
    model_registry: str | None = doc(None, "Lightning model registry name to upload to.")
    test_after_fit: bool = doc(
        False,
        "When training ends, test the best checkpoint (callbacks.checkpoint.monitor), else the "
        "last, as `fw test RUN_DIR` does; metrics in test.csv and the loggers.",
    )
    activation_checkpointing: str = doc(
        "none",
        "Recompute activations in backward, per block: full (keep only block inputs), selective "
        "(keep matmul and collective outputs, recompute the rest) or none.",
        ("none", "full", "selective"),
    )
    compile: bool = doc(False, "torch.compile every block of the model (not the task module).")
    float8: str = doc(
        "none",
        "Train the linear layers in float8 (torchao; docs/scale.md#4-use-fewer-bytes-per-number): "
        "tensorwise (one scale per tensor), rowwise (per row), rowwise_with_gw_hp (rowwise, weight gradients in high "
        "precision) or none. Emulated on the CPU; a GPU needs compute capability 8.9+.",
        ("none", "tensorwise", "rowwise", "rowwise_with_gw_hp"),
    )
    float8_skip: list[str] = doc(
        ["*head", "*output", "*router*", "*gate"],
        "Module names (fnmatch patterns) kept in high precision under float8; replaces the "
        "default (the output head and mixture-of-experts routers).",
    )
    malloc: str = doc(
        "auto",
        "glibc malloc in each training process: reuse (large freed CPU blocks stay mapped for "
        "the next step: no page faults a step, resident memory stays at its peak), system "
        "(glibc's adaptive thresholds) or auto (reuse on the CPU, system on CUDA). MALLOC_* "
        "variables, when set, win (framework/allocator.py).",
        ("auto", "reuse", "system"),
    )
    peak_tflops: float | None = doc(
        None,
        "Peak TFLOP/s of one device for perf/mfu (None: the known GPU's dense bf16 peak; "
        "none on the CPU).",
        above=0,
    )


@dataclass
class RunConfig:
    """Where a run keeps its outputs."""

    dir: str | None = doc(None, "Run directory (None: runs/<date>_<time>).")
    name: str | None = doc(None, "Display name of the run (None: the run directory's name).")
    secret_keys: list[str] = doc(
        [],
        "More config key names (regexes) whose values are secret, besides token, api_key, "
        "secret, password, passphrase, pwd, auth, authorization, credential, cookie, any "
        "*_key: never written to disk or the console.",
    )
    dir_mode: str = doc(
        "0750",
        "Permissions (octal) of the directories a run creates: 0750 lets your group read the "
        "run, nobody else; its files are 0640 (never more open than your umask allows).",
        ("0700", "0750", "0755", "0770", "0775"),
    )
    allow_foreign_dir: bool = doc(
        False,
        "Use a run directory that another user owns (refused otherwise: its checkpoints and "
        "files are theirs to plant, and resume=auto would load them).",
    )
    trust_checkpoint: bool = doc(
        False,
        "Load the checkpoint this run resumes from even if its pickles name more than data "
        "(their code runs): only for checkpoints you made yourself (`fw train --trust`).",
    )


@dataclass
class TrainConfig:
    """The whole job: one composed, validated, resolved config per run directory."""

    task: TaskConfig = doc(MISSING, "The task to train (group `task`).")
    strategy: Any = doc(MISSING, "How the work is spread over processes (group `strategy`).")
    trainer: TrainerConfig = doc(TrainerConfig(), "Trainer settings (group `trainer`).")
    logger: dict[str, Any] = doc({}, "Experiment loggers by name (group `logger`).")
    callbacks: dict[str, Any] = doc({}, "Callbacks by name (group `callbacks`).")
    launcher: Any = doc(MISSING, "How processes are started (group `launcher`).")
    run: RunConfig = doc(RunConfig(), "Run directory and name.")
    seed: int = doc(
        0,
        "Seed of every random generator (python, numpy, torch, data order).",
        min=0,
        max=2**32 - 1,
    )
    extra: dict[str, Any] = doc(
        {}, "Free-form values of your own (e.g. +extra.note=baseline), kept in config.yaml."
    )
    command: str = doc(
        "fit",
        "What the job does with the task: fit (fw train), or validate, test or predict "
        "(set by fw validate|test|predict).",
        COMMANDS,
    )
    resume: str = doc(
        "auto",
        "auto: continue from the newest complete checkpoint in run.dir; never: refuse an existing "
        "run; or the path of a checkpoint (or run directory) to start from.",
    )
