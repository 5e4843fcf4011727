"""The `fw` command: `fw train [OVERRIDES]`, `fw config [OVERRIDES]`, `fw --help`.

Configuration and usage errors print one paragraph and exit with code 2; a failing worker prints
which rank failed and why, and exits with code 1.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from framework.errors import EXIT_CONFIG, EXIT_FAILED, EXIT_PREEMPTED, EXIT_TERMINATED, ConfigError

USAGE = """\
usage: fw train [-m] [--config-dir DIR] [--trust] [KEY=VALUE ...]   train (-m: one job per
                                                  swept value; --trust: resume from a
                                                  checkpoint whose pickles name more than data)
       fw config [--config-dir DIR] [KEY=VALUE ...]       show the composed config, documented
       fw validate|test|predict RUN_DIR_OR_CHECKPOINT [--config-dir DIR] [--trust] [KEY=VALUE ...]
                                                  evaluate a trained model (any layout, any
                                                  strategy and process count): metrics in
                                                  RUN_DIR/test.csv, predictions in
                                                  RUN_DIR/predictions
       fw check [--gpu-mem SIZE|GPU] [--host-mem SIZE] [--ranks R,..] [KEY=VALUE ...]
                                                  memory per rank and first-step failures of
                                                  the job, for any process count, in this process
       fw plan --gpus N --gpu-mem SIZE|GPU [KEY=VALUE ...]   the layouts that fit, best first
       fw plan --gpus N --gpu NAME|--hardware FILE [--tokens T] [--price-per-gpu-hour P]
               [--sort time|cost|simplicity] [--json] [--measure K] [KEY=VALUE ...]
                                                  ... with predicted step time, tokens/s, MFU,
                                                  hours and cost
       fw calibrate [--out FILE] [--processes N] [--cpu]  measure this CPU for fw plan
       fw prepare [--workers N] [--engine local|ray] [KEY=VALUE ...]
                                                  encode the task's data once (e.g. into
                                                  task.data.prepared), resumable
       fw sweep --trials N [--study NAME] [--storage URL] KEY=SEARCH ... [KEY=VALUE ...]
                                                  a search on Optuna, each trial a `fw train`
                                                  job, e.g. 'task.optimizer.lr=tag(log,
                                                  interval(1e-4, 1e-2))'; resumable, parallel
       fw export RUN_DIR_OR_CHECKPOINT OUT [--format pt|hf] [--max-shard-size SIZE] [--force]
                 [--trust]                        the trained model: one plain state dict (pt),
                                                  or a transformers directory (hf)
       fw plot RUN_DIR [RUN_DIR ...] [--out FILE.png]     draw loss, speed, memory (runs overlaid)
       fw --help | fw COMMAND --help                       this text, or one command's usage and options

Examples:
  fw train task=gpt strategy=ddp trainer.devices=2 trainer.max_steps=200 run.dir=runs/first
  fw train -m seed=1,2 trainer.devices=2
  fw test runs/first strategy=fsdp trainer.devices=2
  fw config task=gpt
"""

EVALUATION_HELP = """\
usage: fw {command} RUN_DIR_OR_CHECKPOINT [--config-dir DIR] [--trust] [KEY=VALUE ...]

{what} The run's own config (config.yaml) is used, with the overrides on top: a
group chosen here (strategy=fsdp, launcher=slurm, logger=[csv,tensorboard]) replaces the run's,
KEY=VALUE changes one key (trainer.devices=2, trainer.limit_{limit}_batches=10). The checkpoint
is RUN_DIR/checkpoints/best when the checkpoint callback keeps one (callbacks.checkpoint.monitor),
else the newest complete one, or the checkpoint directory given; any layout is read under any
strategy and process count.
  --config-dir DIR   another directory of config groups (replacing built-in options of the
                     same name)
  --trust            use the run as it is: a checkpoint whose pickles name more than data, and
                     classes, plugins or shell lines its config names that your own config
                     groups and command line do not (docs/security.md)
  --cfg job|all      print the config it would run with, as fw config does, and stop
"""
EVALUATION_WHAT = {
    "validate": "Run the task's validation_step over its val_dataloader (Lightning's\n"
    "Trainer.validate) and print the metrics; each run adds a row to RUN_DIR/validate.csv and\n"
    "sends the metrics to the run's loggers.",
    "test": "Run the task's test_step over its test_dataloader (Lightning's Trainer.test) and\n"
    "print the metrics; each run adds a row to RUN_DIR/test.csv and sends the metrics to the\n"
    "run's loggers (the same W&B run).",
    "predict": "Run the task's predict_step over its predict_dataloader (Lightning's\n"
    "Trainer.predict) and write the outputs with each sample's dataset index to\n"
    "RUN_DIR/predictions/rankNNNNN.pt (framework.predictions.read(RUN_DIR) gives them in the\n"
    "dataset's order, whatever the process count).",
}


COMMAND_HELP = {
    "config": """\
usage: fw config [--config-dir DIR] [KEY=VALUE ...]

Print the config `fw train` would run with these overrides, every field with its documentation.
Nothing is started and nothing is written.
  --config-dir DIR   another directory of config groups, searched before the built-in ones
                     (an option of the same name replaces the built-in one)
""",
    "check": """\
usage: fw check [--gpu-mem SIZE|GPU] [--host-mem SIZE] [--ranks R,..] [--config-dir DIR]
                [KEY=VALUE ...]

Run one training step of every rank of the job in this process (torch's fake backend, no real
memory) and print each rank's memory: parameters, gradients, optimizer, activations; under the
table, the host memory of its pretrained load, its resume (resume=PATH) and `fw export`.
  --gpu-mem SIZE|GPU  simulate that CUDA device (80GB, H100, ...) and refuse a job that does
                      not fit it (exit 2)
  --host-mem SIZE     a node's host memory: refuse a job whose pretrained load, resume or
                      export would not fit it (exit 2); their figures are printed either way
  --ranks R,..        the ranks to simulate (default: the first and last of each pipeline
                      stage)
  --config-dir DIR    another directory of config groups
""",
    "plan": """\
usage: fw plan --gpus N (--gpu-mem SIZE|GPU | --gpu NAME | --hardware FILE) [--tokens T]
               [--price-per-gpu-hour P] [--sort time|cost|simplicity] [--json] [--measure K]
               [--config-dir DIR] [KEY=VALUE ...]

List the layouts (fsdp x tp x pp ...) of the job over N GPUs that fit in each GPU's memory,
each checked as `fw check` would; with a device, each with its predicted step time, tokens/s
(total and per GPU), MFU, and hours and cost (see docs/preflight.md).
  --gpus N                 the number of GPUs
  --gpu-mem SIZE|GPU       the memory of one GPU (80GB, H100, ...; default: the device's)
  --gpu NAME               predict for this GPU: H100 SXM, H100 PCIe, H200, A100 SXM 80GB,
                           B200, L40S (H100 and A100 name the SXM parts)
  --hardware FILE          predict for the machine `fw calibrate` measured into FILE
  --tokens T               hours to train T tokens (e.g. 1e12)
  --price-per-gpu-hour P   cost of those hours on N GPUs
  --sort time|cost|simplicity   the order (default time: the most tokens per second first)
  --json                   print a list of objects (overrides, step_s, tokens_per_s, mfu,
                           memory_gib, hours, cost, ...)
  --measure K              run the first K layouts here for a few steps (fw train) and show
                           measured next to predicted
  --config-dir DIR         another directory of config groups
""",
    "calibrate": """\
usage: fw calibrate [--out FILE] [--processes N] [--cpu]

Measure this machine's CPU for `fw plan --hardware FILE`: matmul TFLOP/s by dtype, memory
bandwidth, the cost of one operation, and all-reduce latency and bandwidth over gloo, in N
processes (default 2) started as fw train starts a job's workers (their store on 127.0.0.1). It
measures no GPU: on a machine with CUDA devices it refuses (plan a GPU job with fw plan --gpu
NAME) unless --cpu is given.
  --out FILE        where to write it (default: calibration.json)
  --processes N     processes to measure with (default 2)
  --cpu             calibrate the CPU even where CUDA devices are present
""",
    "prepare": """\
usage: fw prepare [--workers N] [--engine local|ray] [--config-dir DIR] [KEY=VALUE ...]

Encode the task's data once, with its data module's prepare(workers) method (for example into
task.data.prepared); a killed preparation resumes. See docs/data.md.
  --workers N            processes (Ray: CPUs) that encode in parallel (default: all cores)
  --engine local|ray     this machine, or Ray Data (a local cluster, or RAY_ADDRESS's)
  --config-dir DIR       another directory of config groups
""",
    "export": """\
usage: fw export RUN_DIR_OR_CHECKPOINT OUT [--format pt|hf] [--max-shard-size SIZE] [--force]
                 [--trust]

Export the model of a run's last checkpoint, or of the checkpoint directory given, whatever
strategy wrote it.
  --format pt            (default) OUT is one plain PyTorch state dict (parameter name ->
                         tensor), e.g. model.pt
  --format hf            OUT is a directory that transformers' from_pretrained loads: the
                         task's transformers model (config.json, safetensors weights, and the
                         tokenizer files of task.model.pretrained's directory)
  --max-shard-size SIZE  with --format hf: the largest safetensors file (default 5GB); a
                         bigger model is split, with model.safetensors.index.json
  --force                replace OUT if it exists
  --trust                read a checkpoint whose pickles name more than data (refused
                         otherwise: loading it could run code; see docs/security.md)
""",
    "plot": """\
usage: fw plot RUN_DIR [RUN_DIR ...] [--out FILE.png]

Draw loss, speed and memory from each run's metrics.csv (several runs: overlaid).
  --out FILE.png   where to write the picture (default: RUN_DIR/metrics.png; several runs:
                   compare.png beside the first)
""",
}


for _command, _limit in (("validate", "val"), ("test", "test"), ("predict", "predict")):
    COMMAND_HELP[_command] = EVALUATION_HELP.format(
        command=_command, what=EVALUATION_WHAT[_command], limit=_limit
    )
CFG_CHOICES = ("job", "all")  # Hydra's --cfg: both print the job's config here (fw config)


def wants_help(args: list[str]) -> bool:
    return any(word in ("-h", "--help") for word in args)


def wants_config(args: list[str]) -> tuple[bool, list[str]]:
    """Hydra's `--cfg job|all` (`-c`): whether it was given, and the other words. `--cfg
    hydra` is refused: fw runs no Hydra application, so there is no Hydra config to show."""
    rest, asked, words = [], False, iter(args)
    for word in words:
        if word in ("--cfg", "-c") or word.startswith("--cfg="):
            value = word.partition("=")[2] or next(words, None)
            if value not in CFG_CHOICES:
                raise ConfigError(
                    "--cfg",
                    value,
                    "fw prints the job's config (job and all are the same: fw runs no Hydra "
                    "application, so there is no Hydra config)",
                    CFG_CHOICES,
                    hint="fw config [KEY=VALUE ...] prints it too, every field documented.",
                )
            asked = True
        else:
            rest.append(word)
    return asked, rest


def parse_args(args: list[str]) -> tuple[bool, list[Path], list[str], bool]:
    """(multirun, extra config dirs, overrides, help wanted) from the words after the command."""
    multirun, dirs, overrides, want_help = False, [], [], False
    words = iter(args)
    for word in words:
        if word in ("-m", "--multirun"):
            multirun = True
        elif word in ("-h", "--help"):
            want_help = True
        elif word == "--config-dir" or word.startswith("--config-dir="):
            value = word.partition("=")[2] or next(words, None)
            if not value or not Path(value).is_dir():
                raise ConfigError("--config-dir", value, "not a directory")
            dirs.append(Path(value))
        elif word.startswith("--") and "=" in word and not word.startswith("--config-dir"):
            overrides.append(word[2:])  # --KEY=VALUE, as a W&B sweep agent passes `${args}`
        elif word.startswith("-") and not word.startswith("--config-dir"):
            raise ConfigError(
                "option",
                word,
                "unknown option",
                ["-m", "--multirun", "--config-dir", "--cfg", "--help"],
            )
        else:
            overrides.append(word)
    return multirun, dirs, overrides, want_help


EXPORT_OPTIONS = ("--format", "--max-shard-size", "--force", "--trust")


def export_command(args: list[str]) -> int:
    from framework.checkpoint.export import export

    options: dict[str, str | None] = {"--format": None, "--max-shard-size": None}
    flags, paths, words = set(), [], iter(args)
    for word in words:
        name, eq, value = word.partition("=")
        if name in options:
            options[name] = value if eq else next(words, None)
            if not options[name]:
                raise ConfigError(name, None, "needs a value")
        elif word in ("--force", "--trust"):
            flags.add(word)
        elif word.startswith("-"):
            raise ConfigError("option", word, "unknown option of fw export", EXPORT_OPTIONS)
        else:
            paths.append(word)
    if len(paths) != 2:
        raise ConfigError(
            "export",
            " ".join(args),
            "expects a source and an output path",
            hint="Usage: fw export RUN_DIR_OR_CHECKPOINT OUT [--format pt|hf] [--force] [--trust]",
        )
    export(
        Path(paths[0]),
        Path(paths[1]),
        force="--force" in flags,
        trust="--trust" in flags,
        fmt=options["--format"] or "pt",
        max_shard_size=options["--max-shard-size"],
    )
    return 0


EVALUATIONS = ("validate", "test", "predict")


def evaluation_command(
    command: str,
    words: list[str],
    dirs: list[Path],
    trust: bool,
    show_config: bool,
    multirun: bool,
) -> int:
    """`fw validate|test|predict SOURCE [KEY=VALUE ...]` (framework/evaluate.py): the metrics
    as a table on stdout."""
    from framework import evaluate

    if multirun:
        raise ConfigError("-m", "multirun", f"fw {command} evaluates one checkpoint")
    sources = [w for w in words if "=" not in w and not w.startswith(("~", "+"))]
    if len(sources) != 1:
        raise ConfigError(
            command,
            " ".join(sources) or None,
            "expects one run directory or checkpoint directory",
            hint=f"Usage: fw {command} RUN_DIR_OR_CHECKPOINT [KEY=VALUE ...]",
        )
    overrides = [w for w in words if w != sources[0]]
    if show_config:
        from framework.help import render_config

        ckpt, _, saved = evaluate.locate(sources[0])
        cfg = evaluate.evaluation_config(saved, overrides, dirs, trust)
        cfg.command = command
        sys.stdout.write(render_config(cfg))
        return 0
    sys.stdout.write(evaluate.evaluate(command, sources[0], overrides, dirs, trust))
    return 0


def main(argv: list[str] | None = None) -> int:
    from framework.logs import setup_logging

    argv = sys.argv[1:] if argv is None else argv
    if "" not in sys.path and os.getcwd() not in sys.path:
        # user modules next to the command are found, but last: a stray `torch.py` in the
        # working directory must not shadow an installed package
        sys.path.append(os.getcwd())
    setup_logging()
    if not argv or argv[0] in ("-h", "--help", "help"):
        sys.stdout.write(USAGE)
        return 0 if argv else EXIT_CONFIG
    command, rest = argv[0], argv[1:]
    if command in COMMAND_HELP and wants_help(rest):  # before anything is composed or read
        sys.stdout.write(COMMAND_HELP[command])
        return 0
    try:
        if command == "export":
            return export_command(rest)
        if command == "plot":
            from framework.plot import plot_command

            return plot_command(rest)
        if command == "check":
            from framework.preflight import check_command

            return check_command(rest, parse_args)
        if command == "prepare":
            from framework.prepare import prepare_command

            return prepare_command(rest, parse_args)
        if command == "sweep":
            from framework.sweep import sweep_command

            return sweep_command(rest, parse_args)
        if command == "plan":
            from framework.preflight import plan_command

            return plan_command(rest, parse_args)
        if command == "calibrate":
            from framework.preflight.calibrate import calibrate_command

            return calibrate_command(rest)
        trust = command in ("train", *EVALUATIONS) and "--trust" in rest
        show_config, rest = wants_config(rest)
        multirun, dirs, overrides, want_help = parse_args([w for w in rest if w != "--trust"])
        if command in EVALUATIONS:
            return evaluation_command(command, overrides, dirs, trust, show_config, multirun)
        if command == "train":
            if want_help:
                from framework.help import train_help

                sys.stdout.write(train_help(dirs))
                return 0
            if show_config:  # Hydra's --cfg job: what fw config prints
                from framework.help import show_config as shown

                sys.stdout.write(shown(overrides, dirs))
                return 0
            from framework.runner import train

            train(overrides, multirun=multirun, extra_dirs=dirs, trust=trust)
            return 0
        if command == "config":
            from framework.help import show_config

            sys.stdout.write(show_config(overrides, dirs))
            return 0
        raise ConfigError(
            "command",
            command,
            "unknown command",
            [
                "train",
                *EVALUATIONS,
                "sweep",
                "prepare",
                "check",
                "plan",
                "calibrate",
                "config",
                "export",
                "plot",
            ],
        )
    except ConfigError as err:
        sys.stderr.write(f"error: {_shown(str(err), argv)}\n")
        return EXIT_CONFIG
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130
    except Exception as err:
        from framework.launchers.local import WorkerFailure

        if isinstance(err, WorkerFailure):
            logging.getLogger("framework").error("Job failed:\n%s", err)
            return EXIT_FAILED
        if getattr(err, "exit_code", None) == EXIT_PREEMPTED:  # Preempted, WorkersPreempted
            logging.getLogger("framework").warning("%s", err)
            return EXIT_PREEMPTED
        if getattr(err, "exit_code", None) == EXIT_TERMINATED:  # worker.Terminated
            logging.getLogger("framework").warning("%s", err)
            return EXIT_TERMINATED
        from framework.logs import redact_uncaught

        redact_uncaught()  # the traceback Python prints next, without secrets
        raise


def _shown(text: str, argv: list[str]) -> str:
    """Text for the console: the environment's credentials, the secret config values handed to
    the workers, URL passwords and the values given on this command line under secret keys
    (whatever their length) replaced by '***'."""
    from framework.secrets import command_line_secrets, environment_credentials, redact_text

    return redact_text(text, command_line_secrets(argv) | environment_credentials())


if __name__ == "__main__":
    sys.exit(main())
