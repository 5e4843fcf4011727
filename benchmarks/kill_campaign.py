"""Kill campaign: `kill -9` at random moments, then check the run continues exactly.

Each trial starts a 2-process job with `launcher.max_restarts=3` and kills at a moment chosen by
its mode (seeded, so a campaign can be replayed):

- `worker`: one worker, at a random step; the launcher restarts the workers.
- `mid-save`: one worker, while a checkpoint other than the first is being written (its `.tmp`
  directory exists; under fsdp with `async_save` that is the background write).
- `restart`: one worker, then another one as soon as the restarted workers exist (a kill during
  the restart).
- `job`: every process of the job (fw included), at a random step; then the same command again.
- `commit`: every process of the job, as soon as a checkpoint (after a random step) is committed;
  then the same command again. Every metrics row before the checkpoint's step must be on disk.
- `node`: (ddp) the job runs as two `fw` processes standing for two nodes
  (`trainer.num_nodes=2`, `launcher.min_nodes=1`); the second one's whole process group is
  killed at a random step: the first goes on alone, with the same global batch (its losses are
  compared within 1e-5, the summation order differs).
- `nan`: nothing is killed: the loss of one rank turns NaN at a random step, under
  `callbacks.loss_guard` with `action` skip or rollback (by seed). The trial passes when the job
  ends with exit code 0, RUN_DIR/skipped.jsonl names that step (a rollback: to the newest
  checkpoint, the steps since skipped), the steps before it are bitwise those of the
  uninterrupted run and every later loss is finite (tests/distributed/test_loss_guard.py shows
  they equal a run without the skipped samples).
- `end`: one worker of a job without restarts (`launcher.max_restarts=0`), at a random step: the
  job must end naming the killed rank (the time to that end is reported); then the same command
  again.

A trial passes when the job ends with exit code 0, its per-step losses are bitwise those of an
uninterrupted run of the same strategy (each step logged once), every checkpoint left in the
run directory verifies (sizes and digests), and the workers started after the kill resumed from
the newest checkpoint there was (a fresh start from step 0 would reach the same losses). The
table gives, per strategy and mode, the trials, the failures (`fresh`: not resumed), and the
median time from the kill to the next logged step, then that time broken down (medians, each
part from the end of the one before, read from the job's stderr lines as they arrive): detect
(the launcher starts stopping the other workers), stop (all stopped, the restart logged), start
(the new workers have built their Trainer), rendezvous (their process group formed), load (the
checkpoint restored), first step (the next step logged).

`--compare`: each kill trial is run twice with the same seed, one after the other: as it is and
with `launcher.fast_start=false` (torch's dynamic rendezvous for every start, the way restarts
went before the direct one), shown as strategy `<name>-torchrdzv`, with the ratios of the
medians after the tables.

Run from the repository root: `python -m benchmarks.kill_campaign [--trials 50]`. Not part of
`make bench` (about 40 s a trial on 2 cores); a 3-trial smoke run is part of `make test`.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.common import FW, ROOT, load_average, save_results
from framework.checkpoint import disk
from framework.launch.signals import child_pids

STEPS = 24
COMMON = [
    "trainer.devices=2",
    f"trainer.max_steps={STEPS}",
    "trainer.log_every_n_steps=1",
    "trainer.deterministic=true",
    "trainer.val_check_interval=12",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "task.model.hidden=64",
    "task.model.dropout=0.1",
    "task.data.batch_size=32",
    "callbacks.checkpoint.every_n_steps=4",
    "logger=[csv]",
    "launcher.max_restarts=3",
]
SLOW = ["task._target_=tests.tasks.SlowDigitsTask", "+task.model.step_sleep=0.1"]
STRATEGIES = {
    "ddp": SLOW,
    "zero2": [*SLOW, "strategy=zero2"],
    "fsdp": [*SLOW, "strategy=fsdp", "callbacks.checkpoint.async_save=true"],
    "pipeline": [
        "task._target_=tests.tasks.SlowLossDigits",
        "+task.model.loss_sleep=0.05",
        "strategy=pipeline",
        "strategy.microbatches=2",
    ],
}
MODES = ("worker", "mid-save", "restart", "job", "commit", "end", "node", "nan")
NODE_LOSS = ("ddp",)  # the strategies `node` trials run under
# without dropout: its masks come from each rank's own random stream, which one process left
# alone cannot draw as two did (node trials have their own uninterrupted reference)
NODE_ARGS = ["task.model.dropout=0.0"]
# the parts of a restart, each ending at the first stderr line (after the one before) that matches
PHASES = (
    ("detect", r"Terminating process|closing signal"),
    ("stop", r"Restart \d+ of"),
    ("start", r"GPU available"),
    ("rendezvous", r"All distributed processes registered"),
    ("load", r"Restored all states"),
)


def env() -> dict[str, str]:
    return {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT)}


def start(args: list[str], run: Path, extra_env: dict | None = None) -> subprocess.Popen:
    """`fw train ARGS run.dir=RUN`; its stderr lines are read as they come, each with the
    time it arrived (`proc.lines`)."""
    proc = subprocess.Popen(
        [FW, "train", *args, f"run.dir={run}"],
        env={**env(), **(extra_env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    proc.lines = []

    def read() -> None:
        for line in proc.stderr:
            proc.lines.append((time.monotonic(), line))

    proc.reader = threading.Thread(target=read, daemon=True)
    proc.reader.start()
    return proc


def output(proc: subprocess.Popen, timeout: float = 600) -> str:
    """Wait for the job; its stderr."""
    proc.wait(timeout=timeout)
    proc.reader.join(timeout=10)
    return "".join(line for _, line in proc.lines)


def phases(proc: subprocess.Popen, killed_at: float, resumed_s: float | None) -> dict:
    """Seconds each part of the restart took (PHASES, then the first step); None where a
    part's line did not come."""
    found, last = {}, killed_at
    for name, pattern in PHASES:
        when = next((t for t, line in proc.lines if t >= last and re.search(pattern, line)), None)
        found[name] = None if when is None else when - last
        last = last if when is None else when
    found["first step"] = None if resumed_s is None else killed_at + resumed_s - last
    return found


def rows(run: Path) -> list[tuple[int, str]]:
    path = run / "metrics.csv"
    if not path.exists():
        return []
    with path.open() as fh:
        return [
            (int(r["step"]), r["train/loss"]) for r in csv.DictReader(fh) if r.get("train/loss")
        ]


def wait(condition, proc: subprocess.Popen, timeout: float = 120.0, period: float = 0.005) -> bool:
    """Poll until `condition()`; False when the job ended or the time ran out first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(period)
    return False


def restarts(run: Path) -> list:
    try:
        return json.loads((run / "run.json").read_text()).get("restarts", [])
    except (OSError, ValueError):
        return []


def kill_one(proc: subprocess.Popen, rng: random.Random) -> bool:
    pids = child_pids(proc.pid)
    if len(pids) < 2:
        return False
    try:
        os.kill(rng.choice(pids), signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


SLOWER = "torchrdzv"  # --compare's variant: launcher.fast_start=false
VARIANTS = {"": [], SLOWER: ["launcher.fast_start=false"]}


def trial(
    strategy: str, mode: str, seed: int, root: Path, reference: list, variant: str = ""
) -> dict:
    """One kill (or two) and the check; what happened. `variant`: a key of VARIANTS."""
    if mode == "nan":
        return nan_trial(strategy, seed, root, reference)
    rng = random.Random(seed)
    args = [*STRATEGIES[strategy], *COMMON, *(NODE_ARGS if mode == "node" else [])]
    args += VARIANTS[variant]
    if mode == "end":
        args = [a.replace("max_restarts=3", "max_restarts=0") for a in args]
    label = f"{strategy}-{variant}" if variant else strategy
    run = root / f"{label}-{mode}-{seed}"
    ended_s, first_err = None, ""
    step = rng.randint(2, STEPS - 4)
    ckpts = run / "checkpoints"
    killed_at, kills = None, 1
    if mode == "node":
        proc, killed_at = lose_a_node(args, run, rng.randint(5, STEPS - 4))
    else:
        proc = start(args, run)
    if mode == "mid-save":
        # a save after the first: the restart must resume from the one before the damaged one
        hit = wait(
            lambda: ckpts.is_dir() and any(ckpts.glob("*.tmp")) and disk.listing(ckpts),
            proc,
        )
        killed_at = time.monotonic() if hit and kill_one(proc, rng) else None
    elif mode == "commit":
        hit = wait(lambda: any(s > step for s, _ in disk.listing(ckpts)), proc, period=0.001)
        if hit:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            killed_at = time.monotonic()
            proc = start(args, run)
    elif mode != "node":
        hit = wait(lambda: any(s >= step for s, _ in rows(run)), proc)
        if hit and mode == "end":
            killed_at = time.monotonic() if kill_one(proc, rng) else None
            first_err = output(proc)
            ended_s = time.monotonic() - killed_at if killed_at is not None else None
            named = "no Python exception recorded (killed by signal SIGKILL)" in first_err
            if proc.returncode != 1 or not named:
                killed_at = None  # reported below as a failure of this trial
                first_err = f"exit code {proc.returncode}, SIGKILL not named:\n{first_err}"
            proc = start(args, run)
        elif hit and mode == "job":
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            killed_at = time.monotonic()
            proc = start(args, run)
        elif hit:
            before = set(child_pids(proc.pid))
            killed_at = time.monotonic() if kill_one(proc, rng) else None
            if killed_at is not None and mode == "restart":

                def fresh() -> bool:  # the restarted workers exist
                    now = set(child_pids(proc.pid))
                    return len(now) == 2 and not now & before

                if wait(fresh, proc, period=0.001):
                    time.sleep(rng.uniform(0.0, 1.0))  # somewhere in their start-up
                    kills += kill_one(proc, rng)
    # the newest complete checkpoint when the new workers start: they must resume from it (or a
    # later one), never start afresh; the same losses alone would not tell
    newest = disk.listing(ckpts) if killed_at is not None else []
    floor = newest[0][0] if newest else 0
    resumed_s = None
    if killed_at is not None:  # the next step logged by the new workers
        if mode not in ("job", "commit", "end"):  # each restart is recorded as it starts
            wait(lambda: len(restarts(run)) >= kills, proc, period=0.02)
        since = time.time()
        metrics = run / "metrics.csv"
        # the new rank 0 first cuts metrics.csv back to the steps before the checkpoint it
        # resumes from, then logs that step once trained
        newest = disk.listing(run / "checkpoints")
        resume_step = newest[0][0] if newest else 0
        cut = wait(lambda: metrics.exists() and metrics.stat().st_mtime > since, proc, period=0.02)
        trained = cut and wait(
            lambda: any(s >= resume_step for s, _ in rows(run)), proc, period=0.02
        )
        resumed_s = time.monotonic() - killed_at if trained else None
    err = output(proc)
    got = rows(run)
    corrupt = [
        f"{p.name}: {problem}"
        for _, p in disk.listing(run / "checkpoints")
        if (problem := disk.verify(p)) is not None
    ]
    result = {
        "strategy": label,
        "mode": mode,
        "seed": seed,
        "killed": killed_at is not None,
        "exit_code": proc.returncode,
        # the nodes left add the global batch in another order: equal within 1e-5, not bitwise
        "losses_equal": close(got, reference) if mode == "node" else got == reference,
        "resumed": floor == 0 or max(resumed_steps(first_err + err), default=-1) >= floor,
        "corrupt": corrupt,
        "resumed_s": resumed_s,
        "ended_s": ended_s,
        "phases": phases(proc, killed_at, resumed_s) if killed_at is not None else None,
    }
    if mode == "end" and killed_at is None and ended_s is not None:
        result["exit_code"] = -1  # the job did not end as it should have
    if failed(result):
        result["stderr_tail"] = (first_err + err)[-3000:]
    else:
        shutil.rmtree(run, ignore_errors=True)
    return result


def nan_trial(strategy: str, seed: int, root: Path, reference: list) -> dict:
    """A NaN loss on one rank at a random step, under the loss guard (see `nan` above)."""
    rng = random.Random(seed)
    step, rank = rng.randint(2, STEPS - 4), rng.randint(0, 1)
    action = rng.choice(["skip", "rollback"])
    slow = ("task._target_=", "+task.model.step_sleep=", "+task.model.loss_sleep=")
    args = [a for a in [*STRATEGIES[strategy], *COMMON] if not a.startswith(slow)]
    args += [
        "task._target_=tests.loss_guard_tasks.BadStepDigits",
        f"+task.model.nan_steps=[{step}]",
        f"+task.model.bad_rank={rank}",
        "+callbacks.loss_guard.kind=loss_guard",
        f"+callbacks.loss_guard.action={action}",
    ]
    run = root / f"{strategy}-nan-{seed}"
    started = time.monotonic()
    proc = start(args, run)
    err = output(proc)
    got = dict(rows(run))
    try:
        lines = (run / "skipped.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
    except OSError:
        records = []
    every = 4  # callbacks.checkpoint.every_n_steps in COMMON: the newest checkpoint before
    back_to = step // every * every if action == "rollback" and step >= every else None
    expected = list(range(back_to, step + 1)) if back_to is not None else [step]
    recorded = [(r["step"], r["rolled_back_to"], r["skipped_steps"]) for r in records]
    result = {
        "strategy": strategy,
        "mode": "nan",
        "seed": seed,
        "killed": bool(records),  # the fault was injected (and seen)
        "exit_code": proc.returncode,
        "losses_equal": recorded == [(step, back_to, expected)]
        and [(s, v) for s, v in reference if s < step]
        == [(s, got.get(s)) for s, _ in reference if s < step]
        and all(s in got and abs(float(got[s])) < float("inf") for s in range(step + 1, STEPS)),
        "resumed": True,  # nothing restarts
        "corrupt": [
            f"{p.name}: {problem}"
            for _, p in disk.listing(run / "checkpoints")
            if (problem := disk.verify(p)) is not None
        ],
        "resumed_s": None,
        "ended_s": None,
        "phases": None,
        "action": action,
        "nan_step": step,
        "run_s": time.monotonic() - started,
    }
    if failed(result):
        result["stderr_tail"] = err[-3000:]
    else:
        shutil.rmtree(run, ignore_errors=True)
    return result


def lose_a_node(args: list[str], run: Path, step: int) -> tuple[subprocess.Popen, float | None]:
    """Two fw processes as two nodes of one elastic job; the second one (not the one keeping
    the rendezvous store) killed with its workers once `step` is logged. The first node's
    process, and when the kill was."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [a for a in args if a != "trainer.devices=2"]
    args += [
        "trainer.devices=1",
        "trainer.num_nodes=2",
        "launcher.min_nodes=1",
        f"launcher.rdzv_endpoint=localhost:{port}",
        "launcher.join_timeout_s=120",
    ]
    # one thread per node, as each of the reference's two workers on this machine gets
    node_env = {"FW_RDZV_TOKEN": "kill-campaign", "OMP_NUM_THREADS": "1"}
    first = start(args, run, node_env)

    def listening() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    if not wait(listening, first, period=0.05):
        return first, None
    second = start(args, run, node_env)
    if not wait(lambda: any(s >= step for s, _ in rows(run)), first):
        os.killpg(second.pid, signal.SIGKILL)
        return first, None
    os.killpg(second.pid, signal.SIGKILL)  # the node: its fw process and its worker
    killed_at = time.monotonic()
    second.wait()
    return first, killed_at


def close(got: list, reference: list, tolerance: float = 1e-5) -> bool:
    """The same steps, each loss within `tolerance`."""
    return [s for s, _ in got] == [s for s, _ in reference] and all(
        abs(float(a) - float(b)) <= tolerance for (_, a), (_, b) in zip(got, reference, strict=True)
    )


def resumed_steps(stderr: str) -> list[int]:
    """The steps the workers said they resumed from ("Resuming from PATH (step N)")."""
    return [int(n) for n in re.findall(r"Resuming from \S+ \(step (\d+)\)", stderr)]


def failed(r: dict) -> bool:
    """A trial fails on an exit code, losses not bitwise equal, a corrupt checkpoint, or a
    restart that did not resume from the newest checkpoint (a fresh start passes the rest)."""
    return r["exit_code"] != 0 or not r["losses_equal"] or bool(r["corrupt"]) or not r["resumed"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=56)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--compare",
        action="store_true",
        help="run each kill trial again with launcher.fast_start=false (same seed), and compare",
    )
    parser.add_argument("--name", default="kill_campaign", help="benchmarks/results/NAME.json")
    parser.add_argument(
        "--no-save",
        action="store_true",
        help="only print (no benchmarks/results/kill_campaign.json)",
    )
    opts = parser.parse_args(argv)
    strategies = opts.strategies.split(",")
    modes = opts.modes.split(",")
    load = load_average()
    root = Path(tempfile.mkdtemp(prefix="fw-kill-"))
    references: dict[tuple[str, bool], list] = {}
    results = []
    for number in range(opts.trials):
        strategy = strategies[number % len(strategies)]
        mode = modes[(number // len(strategies)) % len(modes)]
        if mode == "node" and strategy not in NODE_LOSS:
            continue
        key = (strategy, mode == "node")
        if key not in references:
            run = root / f"{strategy}-reference{'-node' * key[1]}"
            proc = start([*STRATEGIES[strategy], *COMMON, *(NODE_ARGS if key[1] else [])], run)
            err = output(proc)
            if proc.returncode != 0:
                print(f"{strategy}: the uninterrupted run failed:\n{err[-3000:]}", file=sys.stderr)
                return 1
            references[key] = rows(run)
        variants = ["", SLOWER] if opts.compare and mode != "nan" else [""]
        for variant in variants:
            seed = opts.seed + number
            results.append(trial(strategy, mode, seed, root, references[key], variant))
            r = results[-1]
            ok = not failed(r)
            resumed = f"{r['resumed_s']:.1f} s" if r["resumed_s"] is not None else "-"
            if r["ended_s"] is not None:
                resumed += f"; ended {r['ended_s']:.1f} s after the kill"
            print(
                f"trial {number + 1}/{opts.trials}: {r['strategy']} {mode}: "
                f"{'ok' if ok else 'FAILED'} (resumed after {resumed})",
                flush=True,
            )
    bad = report(results)
    if opts.compare:
        print_ratios(results)
    if not opts.no_save:
        save_results(opts.name, {"steps": STEPS, "trials": results}, load)
    if not bad:
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"failed runs kept in {root}")
    return 1 if bad else 0


def report(results: list[dict]) -> int:
    """Print the table; the number of failed trials."""
    print(
        f"\n{'strategy':<14}{'mode':<10}{'trials':>7}{'killed':>7}{'exit!=0':>8}"
        f"{'loss !=':>8}{'corrupt':>8}{'fresh':>6}{'resumed (median s)':>20}"
    )
    bad = 0
    for key in sorted({(r["strategy"], r["mode"]) for r in results}):
        group = [r for r in results if (r["strategy"], r["mode"]) == key]
        bad_exit = sum(r["exit_code"] != 0 for r in group)
        mismatch = sum(not r["losses_equal"] for r in group)
        corrupt = sum(bool(r["corrupt"]) for r in group)
        fresh = sum(not r["resumed"] for r in group)
        bad += sum(failed(r) for r in group)
        times = [r["resumed_s"] for r in group if r["resumed_s"] is not None]
        ends = [r["ended_s"] for r in group if r.get("ended_s") is not None]
        median = f"{statistics.median(times):.1f}" if times else "-"
        if ends:
            median += f" (ended {statistics.median(ends):.1f})"
        killed = sum(r["killed"] for r in group)
        print(
            f"{key[0]:<14}{key[1]:<10}{len(group):>7}{killed:>7}{bad_exit:>8}{mismatch:>8}"
            f"{corrupt:>8}{fresh:>6}{median:>20}"
        )
    print(f"{len(results)} trials, {bad} failed")
    print_phases(results)
    return bad


def print_phases(results: list[dict]) -> None:
    """The restart broken down: the median of each part, per strategy and mode."""
    names = [name for name, _ in PHASES] + ["first step"]
    print(f"\n{'strategy':<14}{'mode':<10}" + "".join(f"{n:>12}" for n in names) + "   (median s)")
    for key in sorted({(r["strategy"], r["mode"]) for r in results}):
        group = [r["phases"] for r in results if (r["strategy"], r["mode"]) == key]
        cells = []
        for name in names:
            times = [p[name] for p in group if p and p.get(name) is not None]
            cells.append(f"{statistics.median(times):.2f}" if times else "-")
        print(f"{key[0]:<14}{key[1]:<10}" + "".join(f"{c:>12}" for c in cells))


def print_ratios(results: list[dict]) -> None:
    """--compare: each median as it is over the same median with launcher.fast_start=false."""
    names = ["kill -> step"] + [name for name, _ in PHASES] + ["first step"]

    def median(strategy: str, mode: str, name: str) -> float | None:
        group = [r for r in results if (r["strategy"], r["mode"]) == (strategy, mode)]
        if name == "kill -> step":
            times = [r["resumed_s"] for r in group if r["resumed_s"] is not None]
        else:
            times = [r["phases"][name] for r in group if r["phases"] and r["phases"].get(name)]
        return statistics.median(times) if times else None

    print(f"\n{'fast / torchrdzv':<24}" + "".join(f"{n:>14}" for n in names) + "   (ratio)")
    for strategy, mode in sorted({(r["strategy"], r["mode"]) for r in results}):
        if strategy.endswith(f"-{SLOWER}"):
            continue
        cells = []
        for name in names:
            fast, slow = median(strategy, mode, name), median(f"{strategy}-{SLOWER}", mode, name)
            cells.append(f"{fast / slow:.2f}" if fast is not None and slow else "-")
        print(f"{strategy + ' ' + mode:<24}" + "".join(f"{c:>14}" for c in cells))


if __name__ == "__main__":
    sys.exit(main())
