"""Console logging for the `fw` process and the workers: rank-zero aware, noise filtered."""

from __future__ import annotations

import logging
import sys
import warnings

from framework.world import global_rank

NOISE = ("💡 Tip:",)


class _ScrubSecrets(logging.Filter):
    """Replace URL passwords and credential values (environment, the secret config values the
    workers are handed, values given under secret keys on the command line) in every message,
    and in the traceback of an exception it logs (torch elastic logs a worker's with its
    message)."""

    def filter(self, record: logging.LogRecord) -> bool:
        from framework.secrets import redact_text

        values = _secrets()
        record.msg = redact_text(record.getMessage(), values)
        record.args = ()
        if record.exc_info:
            text = record.exc_text or logging.Formatter().formatException(record.exc_info)
            record.exc_text = redact_text(text, values)
        if record.stack_info:
            record.stack_info = redact_text(record.stack_info, values)
        return True


SCRUB = _ScrubSecrets()


def _secrets() -> set[str]:
    from framework.secrets import process_secrets

    return process_secrets()


def scrub_every_handler() -> None:
    """Put the secret scrubber on every log handler that exists now (torch's, which prints the
    failure of a worker with its exception, Lightning's, the root logger's): a task's exception
    may hold a secret value, and those handlers print it on the console."""
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for logger in loggers:
        for handler in getattr(logger, "handlers", ()):
            if SCRUB not in handler.filters:
                handler.addFilter(SCRUB)


def format_exception(err: BaseException) -> str:
    """`err`'s traceback as Python prints it (its causes too), secrets replaced."""
    import traceback

    from framework.secrets import redact_text

    return redact_text("".join(traceback.format_exception(err)), _secrets())


def _print_exception(kind, value, traceback) -> None:
    """sys.excepthook: an uncaught exception's traceback as Python prints it, secrets replaced
    (a task's exception in the one process that trains, or in a spawned worker)."""
    sys.stderr.write(format_exception(value.with_traceback(traceback)))


def _print_thread_exception(args) -> None:
    if args.exc_type is SystemExit:
        return
    _print_exception(args.exc_type, args.exc_value, args.exc_traceback)


def redact_uncaught() -> None:
    """Make what sys.excepthook prints secret-free: ours, or the hook another library put in
    its place since (W&B's prints the traceback itself, then calls the one it replaced), run
    with its output scrubbed. Called where an exception is about to leave the process."""
    import contextlib
    import io

    current = sys.excepthook
    if current is _print_exception or getattr(current, "scrubbed", False):
        return
    if current is sys.__excepthook__:
        sys.excepthook = _print_exception
        return

    def scrubbed(kind, value, traceback) -> None:
        from framework.secrets import redact_text

        printed = io.StringIO()
        with contextlib.redirect_stderr(printed):
            current(kind, value, traceback)
        sys.stderr.write(redact_text(printed.getvalue(), _secrets()))

    scrubbed.scrubbed = True  # type: ignore[attr-defined]
    sys.excepthook = scrubbed


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(NOISE)


class _Stderr(logging.StreamHandler):
    """Writes to sys.stderr as it is when a record is emitted: a redirect made after setup (by
    a caller of framework.cli.main, a notebook's capture) is followed, not a closed stream."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def setup_logging(rank: int | None = None) -> None:
    """`framework` logs at INFO on rank 0 (WARNING elsewhere); known third-party noise is dropped."""
    rank = global_rank() if rank is None else rank
    logger = logging.getLogger("framework")
    if not logger.handlers:
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("[fw] %(message)s"))
        handler.addFilter(SCRUB)
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    scrub_every_handler()
    import threading

    redact_uncaught()
    threading.excepthook = _print_thread_exception
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    # torchao (trainer.float8; transformers imports it too once it is installed) says at import
    # that its CUDA kernels' libraries cannot load on a CPU machine, and torch that the enums it
    # registers need no registering: neither concerns a run
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.* is deprecated")
    warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.* is deprecated")
    # The data position is restored by callbacks.checkpoint through GlobalOrderSampler.
    warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before")
    warnings.filterwarnings("ignore", message=".*`isinstance\\(treespec, LeafSpec\\)`.*")
    # an evaluation reads the model only; the checkpoint callback's state serves training
    warnings.filterwarnings("ignore", message="Be aware that when using `ckpt_path`, callbacks")
    # said once by fw train, before launch (commands.note_unvalidated)
    warnings.filterwarnings("ignore", message=".*`val_dataloader` but have no `validation_step`")


def quiet_lightning() -> None:
    """Drop Lightning's advertising lines; call after Lightning has set up its handlers."""
    for name in ("lightning.pytorch", "lightning.fabric"):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, _DropNoise) for f in handler.filters):
                handler.addFilter(_DropNoise())
    scrub_every_handler()
