"""Training speed of `fw train` against a hand-written PyTorch loop on one GPU: GPT-2 small.

Both sides train the recipe's model class (`recipes.gpt.model.GPT`) at GPT-2 small's shape: 12
layers, 12 heads, width 768, sequences of 1024 tokens, a vocabulary of 50304 (about 124 M
parameters, the head tied to the token embedding), 16 sequences a step. The same seed gives both
the same initial weights; both read the same token stream (the recipe's default corpus, the
Python standard library's sources, read as bytes: token ids below 256 of the 50304, which changes
nothing for speed) in the same order (one permutation per epoch seeded with seed + epoch, as fw's
sampler draws it); both use torch.optim.AdamW with the recipe's settings (conf/task/gpt.yaml),
decay on matrices only, `fused=True` on CUDA, a constant learning rate (the recipe's warm-up and
cosine schedule are switched off on the fw side, so the loop needs none).

Precision is `bf16-mixed` on both sides: weights and AdamW state stay fp32 and the forward runs
under `torch.autocast(bfloat16)`, what `trainer=gpu` gives users and what the MFU figures people
quote for GPT-2 small (nanoGPT, llm.c) use. `bf16-true` would halve the weights' memory but
update bf16 weights with bf16 optimizer state, a different training, not a faster same one.
`torch.compile` is on on both sides, per transformer block (fw's `trainer.compile=true`; the
loop compiles the same blocks' forwards), unless `--no-compile`.

Each side runs in a fresh process: fw as users start it (`fw train task=gpt ...`, one subprocess,
`callbacks=none`, CSV logger), with a `StepRecorder` callback added from the command line; the
loop in a spawned child. Both time the same window (`benchmarks/step_record.py`): from the start
of step `warmup` to the end of the last step, the device drained at both ends. Figures: tokens/s,
MFU (`framework.perf.transformer_flops_per_token` over the peak `framework.perf.peak_tflops`
gives for the device's name; recomputation under activation checkpointing is not counted),
peak memory (`torch.cuda.max_memory_allocated`), and the largest difference between the
per-step losses of a row and the loop's. Rows: the loop; fw with `strategy=ddp` (one process:
no DDP wrapper); fw with `strategy=fsdp` and `strategy=zero2` at world size 1; fw with
`trainer.activation_checkpointing=full`; fw with `trainer.float8=tensorwise` (torchao's float8
matmuls in the 48 linear layers of the blocks, the head tied to the embedding staying in bf16;
compared with fw's bf16 row: `float8_over_bf16_tokens_per_s`; its MFU is still counted against
the bf16 peak, and its losses differ from the loop's by float8's rounding). The runs alternate
(loop, fw, fsdp, zero2, AC, float8, loop, ...); a row's figure is the median over the repeats.

`--smoke`: a tiny GPT (2 layers, width 64, sequence 32, vocabulary 256) on the CPU in fp32, one
intra-op thread on both sides, no compile, the loop, fw and fw's float8 row (torchao's emulation
on the CPU); it checks that the loop's and fw's per-step losses are bitwise equal, and that the
float8 row ran with the same overrides the GPU run uses and stays within FLOAT8_SMOKE_TOLERANCE
of fw's losses, and exits 1 if not. Saves nothing.

Run from the repository root: `python -m benchmarks.gpu` (or `make bench-gpu`); needs CUDA.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from multiprocessing import get_context
from pathlib import Path

from omegaconf import OmegaConf

from benchmarks.common import ROOT, load_average, run_checked, save_results, train_command

SEED = 0
TARGET_RATIO = 0.98  # fw tokens/s over the loop's
TARGET_MFU = 0.45
FLOAT8 = "fw float8"
FLOAT8_SMOKE_TOLERANCE = 0.02  # relative, per step: float8 rounding, not another training
VAL_FRACTION = 0.05  # the recipe's held-out share of the corpus
PLAIN = "plain"
# fw rows: name -> overrides on top of the common ones
FW_ROWS = {
    "fw": [],
    "fw fsdp": ["strategy=fsdp"],
    "fw zero2": ["strategy=zero2"],
    "fw AC full": ["trainer.activation_checkpointing=full"],
    FLOAT8: ["trainer.float8=tensorwise"],
}
LABELS = {
    PLAIN: "plain PyTorch loop",
    "fw": "fw train (ddp, 1 process)",
    "fw fsdp": "fw train strategy=fsdp",
    "fw zero2": "fw train strategy=zero2",
    "fw AC full": "fw train, AC full",
    FLOAT8: "fw train, float8 tensorwise",
}


@dataclass(frozen=True)
class Size:
    """The model, the batch, the device and how long to train."""

    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    vocab_size: int
    batch_size: int
    steps: int
    warmup: int
    device: str  # cuda or cpu
    precision: str  # trainer.precision: bf16-mixed or 32-true
    compile: bool
    threads: int | None  # intra-op threads on both sides (None: each side's default)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.block_size

    def data_bytes(self) -> int:
        """Corpus bytes for one epoch of `steps` batches (fewer where the corpus is smaller)."""
        return (
            int((self.steps + 1) * self.tokens_per_step / (1 - VAL_FRACTION)) + 2 * self.block_size
        )


GPT2_SMALL = Size(12, 12, 768, 1024, 50304, 16, 200, 30, "cuda", "bf16-mixed", True, None)
SMOKE = Size(2, 2, 64, 32, 256, 4, 8, 2, "cpu", "32-true", False, 1)


def optimizer_settings() -> dict:
    """The recipe's AdamW arguments (lr, weight_decay, betas)."""
    task = OmegaConf.load(ROOT / "conf" / "task" / "gpt.yaml")
    return {k: v for k, v in OmegaConf.to_container(task.optimizer).items() if k != "_target_"}


def model_figures(size: Size) -> dict:
    """Parameters (unique), the ones that multiply an activation, and training FLOPs per token."""
    import torch
    from torch import nn

    from framework.perf import transformer_flops_per_token
    from recipes.gpt.model import GPT

    with torch.device("meta"):
        model = GPT(size.vocab_size, size.block_size, size.n_layer, size.n_head, size.n_embd)
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    flops = transformer_flops_per_token(matmul, size.n_layer, size.block_size, size.n_embd)
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "matmul_parameters": matmul,
        "flops_per_token": flops,
    }


def train_plain(size: Size) -> dict:
    """The hand-written loop; the `StepLog.result()` of its run."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from benchmarks.step_record import StepLog
    from recipes.gpt.data import TextDataModule
    from recipes.gpt.model import GPT

    if size.threads:
        torch.set_num_threads(size.threads)
    device = torch.device(size.device)
    # fw seeds every generator, then builds the model on the CPU and moves it: the same draws.
    torch.manual_seed(SEED)
    model = GPT(size.vocab_size, size.block_size, size.n_layer, size.n_head, size.n_embd)
    model.to(device).train()
    if size.compile:
        for block in model.blocks:
            block.forward = torch.compile(block.forward)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    settings = optimizer_settings()
    optimizer = torch.optim.AdamW(
        [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=settings["lr"],
        weight_decay=settings["weight_decay"],
        betas=tuple(settings["betas"]),
        fused=device.type == "cuda",
    )
    data = TextDataModule(
        block_size=size.block_size,
        batch_size=size.batch_size,
        val_fraction=VAL_FRACTION,
        max_bytes=size.data_bytes(),
    )
    data.setup("fit")
    bf16 = size.precision == "bf16-mixed"
    log = StepLog(size.steps, size.warmup, device)
    epoch = 0
    while log.step < size.steps:
        order = torch.randperm(
            len(data.train_set), generator=torch.Generator().manual_seed(SEED + epoch)
        )
        loader = DataLoader(
            data.train_set, batch_size=size.batch_size, sampler=order.tolist(), drop_last=True
        )
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            log.start()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                logits = model(x)
                loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            log.end(loss)
            if log.step == size.steps:
                break
        epoch += 1
    return log.result()


def run_plain(size: Size) -> dict:
    """`train_plain` in a fresh process, as fw gets one."""
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        return pool.submit(train_plain, size).result()


def fw_overrides(size: Size) -> list[str]:
    """The common `fw train` overrides: the model, the data, the optimizer, the precision."""
    return [
        "task=gpt",
        f"task.model.n_layer={size.n_layer}",
        f"task.model.n_head={size.n_head}",
        f"task.model.n_embd={size.n_embd}",
        f"task.model.block_size={size.block_size}",
        f"+task.model.vocab_size={size.vocab_size}",
        "task.model.sample_length=0",  # no sampled text at the end
        f"task.data.batch_size={size.batch_size}",
        f"task.data.val_fraction={VAL_FRACTION}",
        f"task.data.max_bytes={size.data_bytes()}",
        "task.scheduler.name=constant",
        "task.scheduler.warmup_steps=0",
        f"+task.optimizer.fused={str(size.device == 'cuda').lower()}",
        f"trainer.precision={size.precision}",
        f"trainer.compile={str(size.compile).lower()}",
        f"seed={SEED}",
    ]


def run_fw(size: Size, extra: list[str]) -> dict:
    """One `fw train` run with the StepRecorder; its `StepLog.result()`."""
    import json

    env = {**os.environ, "WANDB_MODE": "disabled"}
    if size.threads:
        env["OMP_NUM_THREADS"] = str(size.threads)  # fw leaves the thread count to it
    if size.device == "cuda" and env.get("DS_ACCELERATOR") == "cpu":
        del env["DS_ACCELERATOR"]  # the Makefile's CPU default: DeepSpeed must find the GPU
    with tempfile.TemporaryDirectory(prefix="fw-bench-gpu-") as tmp:
        record = Path(tmp) / "record.json"
        command = train_command(
            f"{tmp}/run",
            size.steps,
            1,
            *fw_overrides(size),
            *extra,
            "+callbacks.record._target_=benchmarks.step_record.StepRecorder",
            f"+callbacks.record.path={record}",
            f"+callbacks.record.warmup={size.warmup}",
            accelerator="gpu" if size.device == "cuda" else "cpu",
        )
        run_checked(command, " ".join(["fw train", *extra]), env=env)
        return json.loads(record.read_text())


def figures(record: dict, size: Size, flops_per_token: float) -> dict:
    """tokens/s and MFU of one run (MFU None where the device's peak is unknown)."""
    from framework.perf import peak_tflops

    tokens_per_s = record["timed_steps"] * size.tokens_per_step / record["seconds"]
    peak = peak_tflops(record["device_name"])
    mfu = tokens_per_s * flops_per_token / (peak * 1e12) if peak else None
    return {
        "tokens_per_s": tokens_per_s,
        "mfu": mfu,
        "peak_memory_bytes": record["peak_memory_bytes"],
    }


def summarise(size: Size, runs: dict[str, list[dict]], flops_per_token: float) -> dict:
    """Per row: medians over the repeats, ratio to the loop, largest loss difference to it."""
    plain = runs[PLAIN]
    rows = {}
    for name, records in runs.items():
        done = [r for r in records if "error" not in r]
        if not done:
            rows[name] = {"error": records[-1]["error"]}
            continue
        each = [figures(r, size, flops_per_token) for r in done]
        mfus = [f["mfu"] for f in each if f["mfu"] is not None]
        peaks = [f["peak_memory_bytes"] for f in each if f["peak_memory_bytes"] is not None]
        # the loop is the reference: its own row has no difference to it, not a difference of 0
        diffs = [
            max(abs(a - b) for a, b in zip(r["losses"], p["losses"], strict=True))
            for r, p in zip(records, plain, strict=True)
            if "error" not in r and "error" not in p and name != PLAIN
        ]
        rows[name] = {
            "tokens_per_s": statistics.median(f["tokens_per_s"] for f in each),
            "mfu": statistics.median(mfus) if mfus else None,
            "peak_memory_bytes": max(peaks) if peaks else None,
            "max_abs_loss_difference_to_plain": max(diffs) if diffs else None,
            "tokens_per_s_per_run": [f["tokens_per_s"] for f in each],
            "failed_runs": len(records) - len(done),
        }
    base = rows[PLAIN].get("tokens_per_s")
    for row in rows.values():
        if base and "tokens_per_s" in row:
            row["ratio_to_plain"] = row["tokens_per_s"] / base
    return rows


def verdict(ok: bool | None) -> str:
    return {None: "n/a", True: "met", False: "NOT met"}[ok]


def print_table(size: Size, model: dict, device: str, rows: dict) -> None:
    print(
        f"\nGPT {model['parameters'] / 1e6:.1f} M parameters ({size.n_layer} layers, "
        f"{size.n_head} heads, width {size.n_embd}, sequence {size.block_size}, vocabulary "
        f"{size.vocab_size}), batch {size.batch_size}, {size.precision}, compile "
        f"{'on' if size.compile else 'off'}, steps {size.warmup}-{size.steps} timed, on {device}"
    )
    print(f"{'':30}{'tokens/s':>12}{'÷ plain':>9}{'MFU':>8}{'peak GiB':>10}  max |loss - plain|")
    for name, row in rows.items():
        if "error" in row:
            print(f"{LABELS[name]:30}failed: {row['error'].strip().splitlines()[-1][:80]}")
            continue
        mfu = f"{100 * row['mfu']:.1f}%" if row["mfu"] is not None else "n/a"
        peak = row["peak_memory_bytes"]
        peak = f"{peak / 2**30:.2f}" if peak is not None else "n/a"
        diff = row["max_abs_loss_difference_to_plain"]
        diff = "reference" if name == PLAIN else "n/a" if diff is None else f"{diff:.3g}"
        print(
            f"{LABELS[name]:30}{row['tokens_per_s']:>12.0f}{row.get('ratio_to_plain', 0):>9.3f}"
            f"{mfu:>8}{peak:>10}  {diff}"
        )


def float8_over_bf16(rows: dict) -> float | None:
    """fw's float8 row's tokens/s over fw's bf16 row's (None where either failed)."""
    float8, bf16 = rows.get(FLOAT8, {}).get("tokens_per_s"), rows.get("fw", {}).get("tokens_per_s")
    return float8 / bf16 if float8 and bf16 else None


def goals(rows: dict) -> dict:
    """The two goals, on the fw row (MFU also on the loop's), and float8's speed-up (no goal)."""
    fw, plain = rows.get("fw", {}), rows.get(PLAIN, {})
    ratio = fw.get("ratio_to_plain")
    mfu = fw.get("mfu")
    speedup = float8_over_bf16(rows)
    result = {
        "fw_over_plain_tokens_per_s": ratio,
        "fw_over_plain_goal": TARGET_RATIO,
        "fw_over_plain_met": ratio >= TARGET_RATIO if ratio is not None else None,
        "fw_mfu": mfu,
        "plain_mfu": plain.get("mfu"),
        "mfu_goal": TARGET_MFU,
        "mfu_met": mfu >= TARGET_MFU if mfu is not None else None,
        "float8_over_bf16_tokens_per_s": speedup,
    }
    print(
        f"goal fw tokens/s >= {TARGET_RATIO} x plain: "
        f"{ratio if ratio is None else round(ratio, 3)} -> {verdict(result['fw_over_plain_met'])}"
    )
    shown = "n/a" if mfu is None else f"{100 * mfu:.1f}%"
    print(f"goal MFU >= {100 * TARGET_MFU:.0f}% (fw): {shown} -> {verdict(result['mfu_met'])}")
    print(f"float8 tokens/s / bf16 tokens/s (fw): {'n/a' if speedup is None else f'{speedup:.3f}'}")
    return result


def smoke_check(runs: dict[str, list[dict]]) -> None:
    """Exit 1 unless fw's per-step losses equal the loop's bitwise."""
    fw, plain = runs["fw"][0], runs[PLAIN][0]
    if "error" in fw or "error" in plain:
        sys.exit("smoke: a side failed:\n" + (fw.get("error") or plain.get("error")))
    diff = max(abs(a - b) for a, b in zip(fw["losses"], plain["losses"], strict=True))
    steps = len(plain["losses"])
    if fw["losses"] != plain["losses"]:
        sys.exit(f"smoke: per-step losses differ over {steps} steps, max |difference| {diff:.3g}")
    print(f"smoke: per-step losses of fw and plain bitwise equal over {steps} steps")
    float8 = runs[FLOAT8][0]
    if "error" in float8:
        sys.exit("smoke: the float8 row failed:\n" + float8["error"])
    apart = max(abs(a - b) / b for a, b in zip(float8["losses"], fw["losses"], strict=True))
    if float8["losses"] == fw["losses"] or apart > FLOAT8_SMOKE_TOLERANCE:
        sys.exit(f"smoke: float8's losses are not float8-rounded fw's: {apart:.3g} apart at most")
    print(f"smoke: the float8 row's per-step losses within {apart:.2%} of fw's over {steps} steps")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU, fp32")
    parser.add_argument("--batch-size", type=int, default=GPT2_SMALL.batch_size)
    parser.add_argument("--steps", type=int, default=GPT2_SMALL.steps)
    parser.add_argument("--warmup", type=int, default=GPT2_SMALL.warmup)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--no-save", action="store_true", help="print only")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    import torch

    from framework.parallel.float8 import MIN_CAPABILITY

    args = parse_args(argv)
    if args.smoke:
        size, names, repeats = SMOKE, [PLAIN, "fw", FLOAT8], 1
    else:
        if not torch.cuda.is_available():
            sys.exit("benchmarks.gpu needs a CUDA device (use --smoke for the CPU check)")
        size = replace(
            GPT2_SMALL,
            batch_size=args.batch_size,
            steps=args.steps,
            warmup=args.warmup,
            compile=not args.no_compile,
        )
        names, repeats = [PLAIN, *FW_ROWS], args.repeats
        capability = torch.cuda.get_device_capability()
        if capability < MIN_CAPABILITY:  # no float8 matmuls: fw refuses trainer.float8
            names.remove(FLOAT8)
            print(f"float8 row left out: compute capability {capability[0]}.{capability[1]}")
    load_at_start = load_average()
    model = model_figures(size)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for repeat in range(repeats):
        for name in names:
            try:
                record = run_plain(size) if name == PLAIN else run_fw(size, FW_ROWS[name])
            except RuntimeError as err:  # a failed fw row; the other rows still run
                record = {"error": str(err)[-3000:]}
            runs[name].append(record)
            shown = "failed" if "error" in record else f"{record['seconds']:.2f} s timed"
            print(f"run {repeat + 1}/{repeats} {LABELS[name]}: {shown}", flush=True)
    rows = summarise(size, runs, model["flops_per_token"])
    device = next((r["device_name"] for rs in runs.values() for r in rs if "device_name" in r), "?")
    print_table(size, model, device, rows)
    if args.smoke:
        smoke_check(runs)
        return
    results = {
        "size": asdict(size),
        "model": model,
        "device": device,
        "repeats": repeats,
        "rows": rows,
        "goals": goals(rows),
        "losses_first_run": {name: rs[0].get("losses") for name, rs in runs.items()},
    }
    if not args.no_save:
        save_results("gpu", results, load_at_start)
    if any("error" in r for rs in runs.values() for r in rs):
        sys.exit("some runs failed (see the table)")


if __name__ == "__main__":
    main()
