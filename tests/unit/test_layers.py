"""The framework's modules stand in layers (DESIGN.md, "Layers"): a module imports from its own
layer or from lower ones, never from a higher one (lazy imports inside functions count too),
and workers are entered through the launchers only.

A new top-level module must be given its layer here: the first test names any that has none.
"""

from __future__ import annotations

import pytest

from tests.unit.test_imports import import_graph

# Lowest first. An entry names a module or a package (with everything under it); a module takes
# the layer of its longest entry. The package itself (`framework`) is only its __init__.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "base",
        (
            "framework.allocator",
            "framework.checkpoint",
            "framework.checkpoint.disk",
            "framework.checkpoint.portable",
            "framework.checkpoint.safe",
            "framework.config.fields",
            "framework.errors",
            "framework.files",
            "framework.logs",
            "framework.memory",
            "framework.lr_scaling",
            "framework.perf",
            "framework.predictions",  # the reader of a run's predictions folder
            "framework.processes",
            "framework.rng",
            "framework.secrets",
            "framework.stores",
            "framework.watchdog",
            "framework.world",
        ),
    ),
    (
        "parallel primitives",  # what framework.nn blocks are made of: the context split
        ("framework.parallel.context", "framework.parallel.keys"),
    ),
    (
        "task",
        (
            "framework",
            "framework.data",
            "framework.instantiate",
            "framework.nn",
            "framework.optim",
            "framework.task",
        ),
    ),
    ("parallel", ("framework.parallel", "framework.integrations")),
    (
        "config and contract",  # RunContext is what a plugin is built with; resume compares configs
        (
            "framework.config",
            "framework.context",
            "framework.loggers.targets",  # a logger's _target_ and arguments, checked
            "framework.plugins",
            "framework.checkpoint.resume",
            "framework.strategy_base",
        ),
    ),
    (
        "sweep library",
        (
            "framework.sweep.config",
            "framework.sweep.report",
            "framework.sweep.space",
            "framework.sweep.study",
        ),
    ),
    (
        "plugins",
        (
            "framework.callbacks",
            "framework.debug",
            "framework.loggers",
            "framework.replica_groups",
            "framework.runtime",
            "framework.strategies",
        ),
    ),
    ("worker", ("framework.worker",)),
    ("launchers", ("framework.external", "framework.launch", "framework.launchers")),
    (
        "commands",
        (
            "framework.checkpoint.export",
            "framework.evaluate",
            "framework.integrations.hf.export",
            "framework.help",
            "framework.plot",
            "framework.preflight",
            "framework.prepare",
            "framework.runner",
            "framework.sweep",
        ),
    ),
    ("cli", ("framework.cli",)),
]


def layer_of(module: str) -> int | None:
    """The index in LAYERS of the layer `module` belongs to (None: not placed)."""
    best: tuple[int, int] | None = None  # (length of the entry, layer)
    for number, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            inside = entry != "framework" and module.startswith(f"{entry}.")
            if (module == entry or inside) and (best is None or len(entry) > best[0]):
                best = (len(entry), number)
    return None if best is None else best[1]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """'importer -> imported (layer -> higher layer)' for every import of a higher layer."""
    found = []
    for importer, imported in sorted(graph.items()):
        for target in sorted(imported):
            low, high = layer_of(importer), layer_of(target)
            if low is not None and high is not None and high > low:
                found.append(f"{importer} -> {target} ({LAYERS[low][0]} -> {LAYERS[high][0]})")
    return found


def test_every_module_has_a_layer():
    assert [m for m in sorted(import_graph()) if layer_of(m) is None] == []


def test_no_module_imports_from_a_higher_layer():
    assert upward_imports(import_graph()) == []


def test_only_the_launchers_enter_a_worker():
    """One way into a worker: the launchers call worker.entry; the runner hands every job to a
    launcher (framework.external inside torchrun/srun) and never imports the worker itself."""
    graph = import_graph()
    importers = sorted(m for m, imported in graph.items() if "framework.worker" in imported)
    assert importers and all(LAYERS[layer_of(m)][0] == "launchers" for m in importers), importers


def test_an_upward_import_is_found():
    graph = {
        "framework.config.dry_build": {"framework.worker", "framework.task"},
        "framework.worker": {"framework.task"},
        "framework.strategies.ddp": {"framework.strategies.ddp.strategy"},
    }
    assert upward_imports(graph) == [
        "framework.config.dry_build -> framework.worker (config and contract -> worker)"
    ]
    assert layer_of("framework") == layer_of("framework.task") != layer_of("framework.errors")
    assert layer_of("framework.sweep.study") < layer_of("framework.callbacks.pruning.callback")
    assert layer_of("framework.unplaced_module") is None


def test_inside_torchrun_the_runner_hands_the_job_to_the_external_launcher(monkeypatch):
    from omegaconf import OmegaConf

    from framework import external, runner
    from framework.launchers import local
    from framework.plugins import required_names

    cfg = OmegaConf.create({"launcher": {"kind": "local"}})
    for name in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "SLURM_NTASKS", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    assert runner.job_launcher(cfg)[0] is local
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    monkeypatch.setenv("LOCAL_RANK", "0")
    launcher, launcher_cfg = runner.job_launcher(cfg)
    assert launcher is external and isinstance(launcher_cfg, external.Config)
    assert [n for n in required_names("launcher") if not hasattr(external, n)] == []


def test_a_slurm_task_preempted_by_its_signal_requeues_and_by_sigterm_stops(
    monkeypatch, tmp_path, caplog
):
    """worker.entry hands the preemption to launcher=slurm's Task, which requeues the job on
    its own signal (rank 0) and only stops on SIGTERM (scancel)."""
    import signal

    from framework import external, worker
    from framework.callbacks.checkpoint.callback import Preempted
    from framework.launchers import slurm
    from framework.world import World

    (tmp_path / "config.yaml").write_text("seed: 0\n")
    calls = []
    monkeypatch.setattr(slurm.subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    monkeypatch.setattr(external, "check_world", lambda world: None)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.delenv("RANK", raising=False)
    world = World(world_size=1, devices=1, num_nodes=1, accelerator="cpu")
    task = slurm.Task(str(tmp_path / "config.yaml"), "", "USR2", 3, world)
    for signum in (signal.SIGUSR2, signal.SIGTERM):

        def preempted(cfg, run_dir, resume_from, signum=signum):
            assert run_dir == tmp_path and cfg.seed == 0
            raise Preempted(12, signum)

        monkeypatch.setattr(worker, "_train", preempted)
        assert task() == "preempted"
    assert calls == [["scontrol", "requeue", "77"]]
    with pytest.raises(Preempted):  # nobody takes it: fw exits 75
        worker.entry(tmp_path / "config.yaml")
