"""`fw plan`'s step-time model (framework/preflight/perf.py) and its time-and-cost output:
the FLOPs it counts equal the throughput callback's counter, each term equals its formula by
hand, `--json` has the documented keys, `--sort cost` orders by cost, hours and cost follow
from tokens/s, and bad input exits 2 before anything is planned."""

from __future__ import annotations

import json
import math

import pytest
import torch

from framework.cli import main
from framework.preflight.hardware import DEVICES, Device, Link, known_device, write_calibration
from framework.preflight.perf import collective_s, predict
from framework.preflight.replica import Work

TINY = ["experiment=gpt_tiny", "task.data.batch_size=8"]
KEYS = {"overrides", "step_s", "tokens_per_s", "mfu", "memory_gib", "hours", "cost"}


def composed_tiny():
    from framework.config.compose import compose_config
    from framework.instantiate import instantiate_args
    from framework.runner import resolve

    cfg = compose_config([*TINY, "trainer.accelerator=cpu", "trainer.devices=1"])
    resolve(cfg)
    torch.manual_seed(0)
    data = instantiate_args(cfg.task.data)
    data.setup("fit")
    return cfg, next(iter(data.train_dataloader()))


def test_flops_per_step_equal_the_throughput_callbacks_counter():
    from framework.instantiate import build_task
    from framework.perf import flop_counter
    from framework.preflight.replica import count_replica
    from framework.preflight.simulate import whole_step

    cfg, batch = composed_tiny()
    counted = count_replica(cfg, batch)
    task = build_task(cfg.task)
    counter = flop_counter()  # what callbacks.throughput logs as perf/flops_per_batch
    with counter:
        whole_step(task, batch, False)()
    assert counted.flops == counter.get_total_flops() > 0
    assert counted.tokens == batch[0].numel() and counted.ops > 0


def test_the_count_on_fake_tensors_is_the_count_on_real_tensors():
    """`fw plan` counts a replica's step on fake tensors; what it finds (FLOPs, the bytes the
    other operations touch, the operations launched) is what the same step counts on real ones:
    the metadata queries only fake tensors dispatch (prim::device) are not operations."""
    from framework.preflight.replica import count_replica, real_count

    cfg, batch = composed_tiny()
    fake = count_replica(cfg, batch)
    real, _ = real_count(cfg, batch)
    assert (fake.flops, fake.other_bytes, fake.ops) == (real.flops, real.bytes, real.ops)


def test_the_experts_grouped_gemm_counts_the_flops_of_the_per_expert_loop():
    """A mixture-of-experts model's FLOPs (MFU in callbacks.throughput, compute in `fw plan`)
    do not depend on how its experts' GEMMs run: torch's counter alone sees none in
    grouped_mm, forward or backward."""
    from framework.nn.moe import GroupedExperts
    from framework.perf import flop_counter

    grouped, loop = GroupedExperts(32, 64, 4), GroupedExperts(32, 64, 4, gemm="loop")
    loop.load_state_dict(grouped.state_dict())
    x = torch.randn(40, 32, requires_grad=True)
    counts = torch.tensor([9, 0, 17, 14])  # an expert with no rows: its group is empty
    found = {}
    for name, experts in {"grouped": grouped, "loop": loop}.items():
        assert experts.use_grouped(x) == (name == "grouped")
        counter = flop_counter()
        with counter:
            experts(x, counts).square().sum().backward()
        found[name] = counter.get_total_flops()
    # 3 GEMMs of 40 rows, 32 x 64, forward and twice in backward
    assert found["grouped"] == found["loop"] == 3 * 3 * 2 * 40 * 32 * 64


def layout(**changes):
    facts = {
        "tp": 1,
        "pp": 1,
        "precision": "bf16-mixed",
        "data_ranks": 8,
        "microbatches": 1,
        "virtual_stages": 1,
        "traffic": {"data": 0.0, "tensor": 0.0, "pipeline": 0.0, "experts": 0.0},
        "group_sizes": {"data": 8, "tensor": 1, "experts": 1, "pipeline": 1},
        "spans_nodes": {"data": False, "tensor": False, "experts": False, "pipeline": False},
        "tensor_collectives": 0,
        "expert_collectives": 0,
        "pipeline_receives": 0,
        "state_bytes": {"params": 0, "grads": 0, "optimizer": 0},
    }
    for key, value in changes.items():  # a nested dict updates its entries
        facts[key] = {**facts[key], **value} if isinstance(value, dict) else value
    return facts


WORK = Work(flops=1e15, other_bytes=0.0, ops=0, tokens=16384, rows=2)
H100 = DEVICES["H100 SXM"]


def test_compute_is_the_ranks_flops_over_peak_times_efficiency():
    p = predict(WORK, layout(), H100)
    assert p.compute_s == pytest.approx(1e15 / (989e12 * 0.7))
    assert p.tokens_per_step == 16384 * 8
    assert p.mfu == pytest.approx(0.7)  # compute alone: the efficiency
    halves = predict(WORK, layout(tp=2, group_sizes={"tensor": 2, "data": 4}), H100)
    assert halves.compute_s == pytest.approx(p.compute_s / 2)


@pytest.mark.parametrize(("p", "m", "v"), [(2, 4, 1), (4, 8, 1), (4, 8, 2)])
def test_bubble_is_the_schedules_formula(p, m, v):
    pred = predict(WORK, layout(pp=p, microbatches=m, virtual_stages=v), H100)
    assert pred.bubble_s == pytest.approx(pred.compute_s * (p - 1) / (v * m))
    if v == 1:  # the idle share of the step benchmarks/pipeline.py measures
        share = pred.bubble_s / (pred.bubble_s + pred.compute_s)
        assert share == pytest.approx((p - 1) / (m + p - 1))


def test_communication_is_bytes_over_the_link_it_crosses_with_latency():
    link = Link("test", 100.0, 1e-5)
    assert collective_s(8e9, 4, 8, link) == pytest.approx(8e9 * 7 / 8 / 100e9 + 4 * 3 * 1e-5)
    tensor = {"data": 0.0, "tensor": 4e9, "pipeline": 0.0, "experts": 0.0}
    within = predict(
        WORK, layout(tp=8, traffic=tensor, group_sizes={"tensor": 8, "data": 1},
                     tensor_collectives=10), H100,
    )  # fmt: skip
    assert within.comm_s == pytest.approx(collective_s(4e9, 10, 8, H100.intra))
    across = layout(
        tp=8, traffic=tensor, group_sizes={"tensor": 8, "data": 1}, tensor_collectives=10,
        spans_nodes={"data": False, "tensor": True, "experts": False, "pipeline": False},
    )  # fmt: skip
    assert predict(WORK, across, H100).comm_s == pytest.approx(collective_s(4e9, 10, 8, H100.inter))


def test_data_parallel_traffic_hides_behind_compute_except_its_last_bucket():
    data = {"data": 2 * 16e9, "tensor": 0.0, "pipeline": 0.0, "experts": 0.0}
    pred = predict(WORK, layout(traffic=data), H100)
    whole = collective_s(32e9, math.ceil(32e9 / (25 * 2**20)), 8, H100.intra)
    buckets = math.ceil(32e9 / (25 * 2**20))
    assert pred.comm_s == pytest.approx(max(whole / buckets, whole - pred.compute_s))
    nothing_hidden = Device(**{**H100.__dict__, "overlap": 0.0})
    assert predict(WORK, layout(traffic=data), nothing_hidden).comm_s == pytest.approx(whole)


def test_only_the_share_sent_during_backward_hides_behind_compute():
    data = {"data": 2 * 16e9, "tensor": 0.0, "pipeline": 0.0, "experts": 0.0}
    buckets = math.ceil(32e9 / (25 * 2**20))
    whole = collective_s(32e9, buckets, 8, H100.intra)
    # ZeRO-1/2: the reduce-scatter in backward, the all-gather after the optimizer step
    half = predict(WORK, layout(traffic=data, data_overlap=0.5), H100)
    assert half.comm_s == pytest.approx(whole - (whole / 2 - whole / buckets))
    blocking = predict(WORK, layout(traffic=data, data_overlap=0.0), H100)
    assert blocking.comm_s == pytest.approx(whole)
    assert predict(WORK, layout(traffic=data), H100).comm_s < half.comm_s


def test_a_strategy_that_states_its_data_collectives_waits_for_each():
    """ZeRO-1/2 (DeepSpeed) issue more blocking collectives a step than DDP's buckets: on a
    calibrated CPU each waits, so the step's communication grows with their number."""
    from framework.preflight.hardware import by_size
    from framework.preflight.perf import charged_collectives

    data = {"data": 2 * 2**20, "tensor": 0.0, "pipeline": 0.0, "experts": 0.0}
    link = Link("measured", 1.0, 1e-3, {"1024": 1e-3, "1048576": 2e-3})
    device = Device(**{**CPU.__dict__, "intra": link, "inter": link})
    ddp = layout(traffic=data, group_sizes={"data": 2}, data_overlap=0.0)
    zero = {**ddp, "data_collectives": 4}
    assert charged_collectives(ddp)["c10d"] == 1 and charged_collectives(zero)["c10d"] == 4
    one, four = predict(WORK, ddp, device).comm_s, predict(WORK, zero, device).comm_s
    assert one == pytest.approx(2e-3)  # one call of 2 MiB
    assert four == pytest.approx(4 * by_size(link.allreduce_s, 2 * 2**20 / 4, 0.0))


def test_optimizer_step_is_memory_bound():
    states = {"params": 4e9, "grads": 4e9, "optimizer": 8e9}
    pred = predict(WORK, layout(state_bytes=states), H100)
    assert pred.optimizer_s == pytest.approx((8e9 + 4e9 + 16e9) / 3350e9)


def test_diloco_sends_its_pseudo_gradient_once_per_round():
    """ddp all-reduces the gradients every step; diloco the pseudo-gradient once per
    `sync_every` steps (in its dtype): fw plan's bytes and communication time per step follow."""
    from framework.plugins import capability, load_plugin, typed_config
    from framework.preflight.planner import plan

    slow = Link("bandwidth only", 1.0, 0.0)
    cpu = Device(**{**H100.__dict__, "overlap": 0.0, "accelerator": "cpu", "intra": slow})
    found = {}
    for name, extra in {"ddp": [], "diloco": ["strategy.sync_every=4"]}.items():
        (option,), _ = plan([*TINY, f"strategy={name}", *extra], 2, "80GB", device=cpu)
        found[name] = option
    grads = found["ddp"].report.worst.grads
    assert found["ddp"].comm_bytes == 2 * grads > 0
    assert found["diloco"].comm_bytes == pytest.approx(2 * grads / 4)
    # (each also all-reduces its logged loss every step: 4 bytes, 2 ns over this link)
    assert found["diloco"].prediction.comm_s == pytest.approx(
        found["ddp"].prediction.comm_s / 4, abs=1e-8
    )
    plugin = load_plugin("strategy", "diloco", "strategy.kind")
    bf16 = typed_config(plugin, {"kind": "diloco", "sync_every": 8, "pseudo_grad_dtype": "bf16"},
                        "strategy")  # fmt: skip
    traffic = capability(plugin, "data_traffic")(bf16, None, grads, grads)
    assert traffic == pytest.approx(2 * grads / 2 / 8)


def run(args: list[str], capsys) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def priced(tmp_path_factory):
    """One `fw plan --json --sort cost` over 2 H100s, shared by the output tests."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "framework.cli", "plan", "--gpus", "2", "--gpu", "H100",
         "--tokens", "1e9", "--price-per-gpu-hour", "2.5", "--json", "--sort", "cost", *TINY],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_json_lists_every_fitting_layout_with_the_documented_keys(priced):
    assert len(priced) >= 5
    for row in priced:
        assert set(row) >= KEYS, row
        assert row["overrides"][: len(TINY)] == TINY
    assert sum(r["recommended"] for r in priced) == 1


def test_sort_cost_orders_by_cost(priced):
    costs = [r["cost"] for r in priced]
    assert costs == sorted(costs)


def test_hours_and_cost_by_hand(priced):
    row = next(r for r in priced if r["overrides"][-1] == "strategy=ddp")
    tokens_per_step = 2 * 8 * 64  # two data ranks x batch 8 x block 64
    assert row["tokens_per_s"] == pytest.approx(tokens_per_step / row["step_s"])
    hours = 1e9 / row["tokens_per_s"] / 3600
    assert row["hours"] == pytest.approx(hours)
    assert row["cost"] == pytest.approx(hours * 2 * 2.5)


def test_the_recommendation_is_the_simplest_within_5_percent(priced):
    best = max(r["tokens_per_s"] for r in priced)
    near = [r for r in priced if r["tokens_per_s"] * 1.05 >= best]
    chosen = next(r for r in priced if r["recommended"])
    assert chosen["order"] == min(r["order"] for r in near)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpu", "H1000"], "--gpu=H1000: is not a known GPU"),
        (["--gpu", "H100", "--price-per-gpu-hour", "-1"], "--price-per-gpu-hour=-1: must be"),
        (["--gpu", "H100", "--tokens", "-5e9"], "--tokens=-5e9: must be a number above zero"),
        (["--gpu", "H100", "--sort", "speed"], "--sort=speed: is not a sort order"),
        (["--gpu", "H100", "--measure", "2"], "--measure=2: runs the layouts here"),
        (["--gpu-mem", "80GB", "--json"], "predictions need a device"),
    ],
)
def test_bad_input_exits_2_with_one_line(args, message, capsys):
    """One line, exit code 2 (--measure: CUDA is absent here on any machine, `pin_cpu`)."""
    code, out, err = run(["--gpus", "2", *args, *TINY], capsys)
    assert code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1 and not out


def test_a_file_that_is_not_a_calibration_exits_2(tmp_path, capsys):
    other = tmp_path / "config.yaml"
    other.write_text("trainer:\n  max_steps: 3\n")
    code, _, err = run(["--gpus", "2", "--hardware", str(other), *TINY], capsys)
    assert code == 2 and f"--hardware={other}: is not a calibration file" in err, err
    good = tmp_path / "calibration.json"
    write_calibration(known_device("h100 sxm"), good)
    from framework.preflight.hardware import read_calibration

    assert read_calibration(str(good)) == DEVICES["H100 SXM"]


def test_measure_with_a_layout_that_does_not_fit_exits_2_and_runs_nothing(tmp_path, capsys):
    here = tmp_path / "calibration.json"
    write_calibration(Device(**{**H100.__dict__, "accelerator": "cpu"}), here)
    args = ["--gpus", "2", "--hardware", str(here), "--measure", "1", "--gpu-mem", "1MB"]
    code, out, err = run([*args, *TINY, "strategy=ddp"], capsys)
    assert code == 2 and "no layout of the job over 2 GPUs passes fw check and fits" in err, err
    assert "Predicted against measured" not in out and not list(tmp_path.glob("**/metrics.csv"))


# a tensor-parallel rank's record: its collectives are DTensor's (functional)
HOST = {"ops": 500, "dtensor_ops": 300, "collectives": 10, "functional": 10,
        "optimizer_ops": 0, "optimizer_dtensor_ops": 200, "optimizer_collectives": 0}  # fmt: skip
CPU = Device(**{**H100.__dict__, "accelerator": "cpu", "overlap": 0.0, "host": {}})


def with_host(device: Device, dtensor_op: float, collective: float) -> Device:
    return Device(
        **{**device.__dict__, "host": {"dtensor_op": dtensor_op, "collective": collective}}
    )


def test_host_costs_of_zero_give_the_prediction_without_the_host_term():
    facts = layout(pp=2, microbatches=4, tensor_collectives=6, host_counts=[HOST])
    without = layout(pp=2, microbatches=4, tensor_collectives=6)
    for device in (CPU, H100):
        zero = predict(WORK, facts, with_host(device, 0.0, 0.0))
        old = predict(WORK, without, device)
        assert zero.host_s == 0.0 and zero.step_s == old.step_s
        assert zero.step_s == old.compute_s + old.comm_s + old.bubble_s + old.optimizer_s


def test_the_host_term_is_each_count_times_its_cost_on_the_cpu():
    facts = layout(pp=2, microbatches=4, tensor_collectives=6,
                   group_sizes={"tensor": 2}, host_counts=[HOST])  # fmt: skip
    once = predict(WORK, facts, with_host(CPU, 1e-4, 1e-3))
    # forward and backward per microbatch, the optimizer once; collectives beyond the 6 charged
    assert once.host_s == pytest.approx((300 * 4 + 200) * 1e-4 + (10 * 4 - 6) * 1e-3)
    twice = predict(WORK, facts, with_host(CPU, 2e-4, 2e-3))
    assert twice.host_s == pytest.approx(2 * once.host_s)
    assert twice.step_s - once.step_s == pytest.approx(once.host_s)
    slower = {**HOST, "optimizer_dtensor_ops": 1200}  # the slowest simulated rank counts
    both = predict(WORK, {**facts, "host_counts": [HOST, slower]}, with_host(CPU, 1e-4, 1e-3))
    assert both.host_s == pytest.approx(once.host_s + 1000 * 1e-4)
    # a pipeline's FSDP2 stage reduce-scatters its gradients once, after the last microbatch
    fsdp = {**HOST, "reductions": 3, "functional": 7}  # FSDP2's reduce-scatters are c10d's
    reduced = predict(WORK, {**facts, "host_counts": [fsdp]}, with_host(CPU, 1e-4, 1e-3))
    assert reduced.host_s == pytest.approx(once.host_s - 3 * (4 - 1) * 1e-3)


def test_on_a_gpu_the_host_term_is_what_outlasts_the_kernels():
    facts = layout(host_counts=[HOST])
    busy = predict(WORK, facts, with_host(H100, 1e-4, 0.0))  # 1.4 s of matmuls hide 50 ms
    assert busy.host_s == 0.0
    small = Work(flops=1e9, other_bytes=0.0, ops=0, tokens=16384, rows=2)
    exposed = predict(small, facts, with_host(H100, 1e-4, 0.0))
    assert exposed.host_s == pytest.approx(500 * 1e-4 - exposed.compute_s)


@pytest.fixture(scope="module")
def host_counts():
    """The host's calls per step `fw check` counts on the first rank of gpt_tiny at 2
    processes, under a whole replica (ddp) and FSDP2."""
    from framework.preflight.check import check

    world = ["trainer.accelerator=cpu", "trainer.devices=2", "trainer.num_nodes=1"]
    return {
        name: check([*TINY, f"strategy={name}", *world], quick=True).ranks[0].host
        for name in ("ddp", "fsdp")
    }


def test_fsdp_steps_the_optimizer_on_dtensors_op_for_op_as_a_replica_on_tensors(host_counts):
    """Every parameter of an FSDP2 rank is a DTensor shard: its optimizer step dispatches the
    replica's operations, each on DTensors."""
    ddp, fsdp = host_counts["ddp"], host_counts["fsdp"]
    assert ddp["optimizer_dtensor_ops"] == 0 and ddp["dtensor_ops"] == 0
    assert ddp["collectives"] == 0  # the replica's gradients are reduced by DDP's own hooks
    # AdamW's step counters stay plain tensors; every other operation is on a DTensor
    steps = fsdp["optimizer_ops"]
    assert fsdp["optimizer_dtensor_ops"] + steps == ddp["optimizer_ops"]
    assert fsdp["optimizer_dtensor_ops"] > 3 * steps > 0
    # gpt_tiny: 2 blocks and the root are units; each all-gathers its parameters in forward
    # and again in backward, and reduce-scatters its gradients
    assert fsdp["fsdp_units"] == 3 and fsdp["collectives"] == 3 * 2 + 3
    assert fsdp["reductions"] == 3 and ddp["reductions"] == 0


def test_the_collectives_dtensor_issues_inside_its_own_dispatch_are_counted():
    """A tensor-parallel gpt_tiny rank (2 layers) all-reduces twice per layer in forward and
    twice in backward, and its embedding's and its head's input in one direction each. The
    loss over vocabulary-split logits (strategy.loss_parallel) adds three all-reduces over
    [tokens, 1], issued inside DTensor's dispatch of the loss's operations; without it the
    logits are all-gathered once. A real step's profile counts the same 13 (a width-128 gpt)."""
    from framework.preflight.check import check

    world = ["trainer.accelerator=cpu", "trainer.devices=2", "trainer.num_nodes=1"]
    layers, found = 2, {}
    for split in ("true", "false"):
        tp = ["strategy=tensor", "strategy.tp=2", f"strategy.loss_parallel={split}"]
        found[split] = check([*TINY, *tp, *world], quick=True).ranks[0].host
    assert found["true"]["functional"] == 4 * layers + 2 + 3, found
    assert found["false"]["functional"] == 4 * layers + 2 + 1, found
    # the loss's local operations stay inside its DTensor calls: not counted as operations
    assert found["true"]["ops"] < found["false"]["ops"], found


def test_the_expert_layers_calls_are_counted_on_real_tensors():
    """moe_gpt's routed experts have data-dependent shapes, which fake tensors cannot run: the
    simulated rank's forward and backward are counted again on real tensors (same fake process
    group). What the host term then sees is what a real step issues: per MoE layer 5 all-to-alls
    (tokens per expert, the rows and the rows back in forward; the rows' gradients both ways in
    backward), besides FSDP2's gathers and reduce-scatters (3 per unit, as under fsdp), and
    operations on the experts' DTensor weights; once per optimizer step, each router's token
    counts all-reduced (the strategy's balance before the step)."""
    from framework.preflight.check import check

    world = ["trainer.accelerator=cpu", "trainer.devices=2", "trainer.num_nodes=1"]
    tiny = ["experiment=moe_gpt_tiny", "strategy=expert", "strategy.ep=2", *world]
    rank = check(tiny, quick=True).ranks[0]
    host, layers = rank.host, 2
    assert rank.note.startswith("activations not simulated")  # memory: model states only
    assert host["collectives"] == 3 * host["fsdp_units"] + 5 * layers
    assert host["dtensor_ops"] > 0 and host["optimizer_dtensor_ops"] > 0
    assert host["optimizer_collectives"] == layers


def test_tensor_parallel_splits_the_other_bytes_only_under_sequence_parallel():
    """FLOPs split over tp always; the bytes of operations without a FLOP formula (norms,
    residual adds, embeddings, the loss) only under sequence parallel: without it they run
    whole on every tensor-parallel rank. A layout that does not say keeps the old split."""
    work = Work(flops=1e12, other_bytes=3e11, ops=0, tokens=16384, rows=2)
    seconds = {}
    for sp in (True, False, None):
        facts = layout(tp=2, group_sizes={"tensor": 2})
        if sp is not None:
            facts["sequence_parallel"] = sp
        seconds[sp] = predict(work, facts, CPU).compute_s
    flops_s = work.flops / 2 / (CPU.peak("bf16") * CPU.efficiency)
    bytes_s = work.other_bytes / (CPU.hbm_gb_per_s * 1e9)
    assert seconds[False] == pytest.approx(flops_s + bytes_s)
    assert seconds[True] == seconds[None] == pytest.approx(flops_s + bytes_s / 2)


def test_a_tensor_parallel_rank_touches_most_of_a_replicas_other_bytes():
    """What the split above rests on, counted on real tensors (fake process group): gpt_tiny's
    tp=2 rank computes half the replica's FLOPs but touches well over half of its other bytes
    (its local operations, seen below DTensor; collectives and the sharding propagation's
    first-call trial runs left out)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_leaves

    from framework.instantiate import build_task
    from framework.parallel.transforms import ModelTransforms
    from framework.preflight import simulate as sim
    from framework.preflight.check import composed, first_batch
    from framework.preflight.counting import COLLECTIVES
    from framework.preflight.fakes import fake_world
    from framework.preflight.replica import counting_mode

    class Local(type(counting_mode())):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented  # DTensor runs it: its local operations come here
            leaves = tree_leaves((args, kwargs))
            if func.namespace in COLLECTIVES or any(
                torch.is_tensor(t) and t.device.type == "meta" for t in leaves
            ):
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    world = ["trainer.accelerator=cpu", "trainer.devices=2", "trainer.num_nodes=1"]
    cfg, plan = composed([*TINY, "strategy=tensor", "strategy.tp=2", *world], None)
    batch = first_batch(cfg, plan)
    counted = {}
    with fake_world(0, 2), sim._quiet_logging():
        replica = sim.whole_step(build_task(cfg.task), batch, False)
        built = (cfg.task, cfg.trainer, batch, 0, plan.strategy, plan.dims)
        rank = sim.rank_step(*built, ModelTransforms("none", False), False, None)[2]
        for name, run in {"replica": replica, "rank": rank}.items():
            run()  # DTensor's sharding propagation tries each new shape once, whole
            counted[name] = Local()
            with counted[name]:
                run()
    assert counted["rank"].flops == pytest.approx(counted["replica"].flops / 2, rel=0.01)
    assert counted["rank"].bytes > 0.75 * counted["replica"].bytes


def test_a_mixture_of_experts_too_large_to_count_is_estimated_from_its_active_parameters():
    """A routed model whose shapes depend on the data and is too large to count on real tensors
    is estimated at 6 FLOPs per parameter and token; a token runs through top_k of num_experts
    experts, so only that share of the expert weights counts (framework.nn MoE layers and
    transformers sparse MoE blocks alike)."""
    import transformers

    from framework.config.compose import compose_config
    from framework.instantiate import build_task, instantiate_args
    from framework.preflight.replica import active_parameters, count_replica
    from framework.runner import resolve
    from tests.hf_moe_tasks import qwen3_moe_config
    from tests.unit.test_hf_moe import Holder

    def expected(module, k, experts) -> float:
        named = dict(module.named_parameters())
        routed = sum(p.numel() for n, p in named.items() if ".experts." in n)
        assert routed > 0
        return sum(p.numel() for p in named.values()) - routed * (1 - k / experts)

    cfg = compose_config(["experiment=moe_gpt_tiny", "trainer.accelerator=cpu"])
    resolve(cfg)
    torch.manual_seed(0)
    task = build_task(cfg.task)
    model = cfg.task.model
    assert model.top_k < model.num_experts
    assert active_parameters(task) == expected(task, model.top_k, model.num_experts)
    qwen = Holder(transformers.Qwen3MoeForCausalLM(qwen3_moe_config()))  # top 2 of 4
    assert active_parameters(qwen) == expected(qwen, 2, 4)

    data = instantiate_args(cfg.task.data)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    work = count_replica(cfg, batch, max_real_params=0)  # the estimate, as for a large model
    assert work.flops == 6 * active_parameters(task) * batch[0].numel()
    assert "active parameters" in work.counted


def test_the_fused_attention_is_counted_apart_and_charged_at_its_measured_rate():
    """A step's fused attention FLOPs (torch's own counter finds the same), charged at the
    attention rate `fw calibrate` measures: on this CPU the kernel runs well below the matmuls.
    A device without a measured rate charges them at the matmuls' (the known GPUs)."""
    from torch.utils.flop_counter import FlopCounterMode

    from framework.instantiate import build_task
    from framework.perf import register_flop_formulas
    from framework.preflight.replica import count_replica
    from framework.preflight.simulate import whole_step

    cfg, batch = composed_tiny()
    work = count_replica(cfg, batch)
    register_flop_formulas()
    counter = FlopCounterMode(display=False)
    with counter:
        whole_step(build_task(cfg.task), batch, False)()
    counts = counter.get_flop_counts()["Global"]
    attention = sum(v for op, v in counts.items() if "scaled_dot_product" in str(op))
    assert 0 < work.attention_flops == attention < work.flops

    plain = predict(work, layout(), CPU).compute_s
    rate = CPU.peak("bf16") * CPU.efficiency / 2 / 1e12  # attention at half the matmuls' rate
    slower = Device(**{**CPU.__dict__, "attention_tflops": {"fp32": rate}})
    extra = predict(work, layout(), slower).compute_s - plain
    assert extra == pytest.approx(work.attention_flops / (CPU.peak("bf16") * CPU.efficiency))


def test_the_logged_values_and_the_optimizers_launches_are_counted_and_charged():
    """gpt_tiny logs its loss with sync_dist: under a Trainer a blocking all-reduce over every
    process at every step, charged one collective (a scalar's bytes, the latency). torch's
    AdamW on the CPU loops over the parameters: the operations the plan counts on fake tensors
    are those the step launches on real ones, each charged a launch; the foreach form CUDA
    takes launches fewer."""
    import dataclasses

    from framework.instantiate import build_task
    from framework.preflight.replica import count_optimizer_step, count_replica, counting_mode
    from framework.preflight.simulate import optimizer_of, whole_step

    cfg, batch = composed_tiny()
    work = count_replica(cfg, batch)
    assert work.synced_logs == 1
    task = build_task(cfg.task)
    whole_step(task, batch, False)()
    optimizer, counter = optimizer_of(task, False), counting_mode()
    optimizer.step()  # the first step makes the state; the second is a step as every other
    with counter:
        optimizer.step()
    tensors = len(list(task.parameters()))
    assert work.optimizer_ops == counter.ops >= 8 * tensors
    assert count_optimizer_step(task, True) < work.optimizer_ops / 3  # foreach: one call for all

    link = Link("latency only", 1e6, 1e-3)
    device = Device(**{**CPU.__dict__, "intra": link, "inter": link, "op_overhead_s": 1e-5})
    facts = layout(world_size=4)
    neither = predict(dataclasses.replace(work, synced_logs=0, optimizer_ops=0), facts, device)
    both = predict(work, facts, device)
    assert both.comm_s - neither.comm_s == pytest.approx(collective_s(4.0, 1, 4, link))
    assert both.optimizer_s - neither.optimizer_s == pytest.approx(work.optimizer_ops * 1e-5)
    alone = predict(work, layout(world_size=1), device)  # one process reduces nothing
    assert alone.comm_s == neither.comm_s


def test_a_model_counted_on_real_tensors_has_its_optimizers_launches_counted():
    """moe_gpt's routed experts have data-dependent shapes: its step is counted on real
    tensors, and its optimizer's launches on that real task (about 9 per parameter for torch's
    AdamW on the CPU), not left at 0."""
    from framework.config.compose import compose_config
    from framework.instantiate import build_task, instantiate_args
    from framework.preflight.replica import count_replica
    from framework.runner import resolve

    cfg = compose_config(["experiment=moe_gpt_tiny", "trainer.accelerator=cpu"])
    resolve(cfg)
    data = instantiate_args(cfg.task.data)
    data.setup("fit")
    work = count_replica(cfg, next(iter(data.train_dataloader())))
    assert work.counted.startswith("real tensors")
    tensors = len(list(build_task(cfg.task).parameters()))
    assert work.optimizer_ops >= 8 * tensors


def test_a_measured_figure_is_read_at_a_size_between_the_sizes_measured():
    """A calibration measures some rates at a few sizes (of a matmul, of an elementwise
    operation, of a collective's compute gap): in between, on a log scale of the size; beyond,
    the nearest; nothing measured, the device's own figure."""
    from framework.preflight.hardware import by_size

    measured = {"100": 10.0, "10000": 30.0}
    assert by_size(measured, 1000, 0.0) == pytest.approx(20.0)  # halfway on the log scale
    assert by_size(measured, 10, 0.0) == 10.0 and by_size(measured, 1e6, 0.0) == 30.0
    assert by_size({}, 1000, 7.0) == 7.0 and by_size(measured, 0, 7.0) == 7.0


def test_matmuls_and_other_operations_run_at_the_rate_measured_for_their_size():
    """On a calibrated CPU a transformer's matmuls reach a share of the square probe's rate
    that grows with their size, and the operations without a FLOP formula a rate that falls as
    their tensors outgrow the caches: each is charged at the rate of its mean size (a matmul's
    FLOPs, an operation's bytes), the tensor-parallel split making a matmul smaller."""
    work = Work(flops=4e12, other_bytes=2e11, ops=0, tokens=16384, rows=2, other_ops=1000,
                matmuls=400)  # fmt: skip
    sizes = {"shares": {"1e9": 0.5, "1e10": 1.0}, "rates": {"1e7": 100.0, "1e9": 20.0}}
    device = Device(**{**CPU.__dict__, "efficiency": 1.0, "matmul_share": sizes["shares"],
                       "elementwise_gb_per_s": sizes["rates"]})  # fmt: skip
    peak = device.peak("bf16")
    # 1e10 FLOPs a matmul: the full rate; 2e8 bytes an operation: 20 + (100 - 20) x (1 - ...)
    each = 2e11 / 1000
    rate = 100.0 + math.log(each / 1e7) / math.log(1e9 / 1e7) * (20.0 - 100.0)
    whole = predict(work, layout(), device)
    assert whole.compute_s == pytest.approx(4e12 / peak + 2e11 / (rate * 1e9))
    # tp 2 without sequence parallel: half the FLOPs in matmuls of half the size (5e9: 0.85 of
    # the rate), the other bytes whole
    split = predict(work, layout(tp=2, sequence_parallel=False, group_sizes={"tensor": 2}), device)
    share = 0.5 + math.log(5e9 / 1e9) / math.log(10) * 0.5
    assert split.compute_s == pytest.approx(2e12 / (peak * share) + 2e11 / (rate * 1e9))
    # a known GPU measured nothing: its efficiency and memory bandwidth at every size
    gpu = predict(work, layout(), H100)
    assert gpu.compute_s == pytest.approx(4e12 / (H100.peak("bf16") * 0.7) + 2e11 / 3350e9)


def test_a_blocking_collective_waits_longer_after_longer_compute_and_by_how_it_is_issued():
    """A calibrated device times a small all-reduce through c10d (DDP, FSDP2, the logged
    values) after 2 and 20 ms of compute, and each collective by its message's size: the plan
    charges each blocking c10d collective the time of its size, moved by how much longer (or
    shorter) the wait after the step's compute between two of them is than after the 3 ms the
    sizes were timed after. DTensor's functional collectives (tensor parallel) are charged what
    one added to a tensor-parallel step of that compute per collective, plus what a larger
    message than that step's takes longer on its own (the fastest all-reduce by size)."""
    from framework.preflight.hardware import CALIBRATED_GAP_S, STEP_PROBE_BYTES, by_size

    sized = {"1024": 1e-3, "1048576": 3e-3}
    link = Link("measured", 1.0, 1e-3, sized)
    waits = {"c10d": {"0.002": 1e-3, "0.02": 2e-3}, "functional": {"0.0025": 2e-3, "0.005": 3e-3}}
    fastest = {str(STEP_PROBE_BYTES): 2e-4, str(4 * STEP_PROBE_BYTES): 8e-4}
    device = Device(**{**CPU.__dict__, "intra": link, "inter": link, "waits": waits,
                       "measured": {"allreduce_fastest_s_by_bytes": fastest}})  # fmt: skip
    # each call at its message's size: 2 all-reduces of 1 MiB
    assert collective_s(2 * 2**20, 2, 2, link) == pytest.approx(2 * 3e-3)
    base = by_size(waits["c10d"], CALIBRATED_GAP_S, 0.0)
    for each in (STEP_PROBE_BYTES, 4 * STEP_PROBE_BYTES):  # the probe's messages, and larger
        tensor = {"data": 0.0, "tensor": 8 * each, "pipeline": 0.0, "experts": 0.0}
        facts = layout(tp=2, traffic=tensor, group_sizes={"tensor": 2, "data": 1},
                       tensor_collectives=8)  # fmt: skip
        pred = predict(WORK, facts, device)
        gap = pred.compute_s / 8  # no other blocking collective
        longer = 0.0 if each == STEP_PROBE_BYTES else 8e-4 - 2e-4
        assert pred.comm_s == pytest.approx(8 * (by_size(waits["functional"], gap, 0.0) + longer))
    # a data-parallel all-reduce of 1 MiB is c10d's: its size's time, moved by the wait
    data = {"data": 2 * 2**20, "tensor": 0.0, "pipeline": 0.0, "experts": 0.0}
    ddp = predict(WORK, layout(traffic=data, group_sizes={"data": 2}), device)
    gap = ddp.compute_s / 1
    assert ddp.comm_s == pytest.approx(3e-3 + by_size(waits["c10d"], gap, 0.0) - base)
    assert by_size(waits["c10d"], gap, 0.0) - base > 0  # a whole step's compute: a longer wait
    # nothing measured (a known GPU): latency and bandwidth, whatever the gap
    plain = Device(**{**device.__dict__, "waits": {}, "intra": Link("l", 1.0, 1e-3)})
    assert predict(WORK, facts, plain).comm_s == pytest.approx(
        collective_s(tensor["tensor"], 8, 2, plain.intra)
    )


def test_fw_calibrate_on_a_machine_with_cuda_refuses_to_describe_its_cpu_as_the_gpu(
    tmp_path, monkeypatch, capsys
):
    """A calibration measures the CPU and gloo: on a GPU node it would describe the host, and
    a GPU job is planned from the GPU tables; refused (exit 2) unless --cpu asks for the CPU."""
    from framework.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    out = tmp_path / "calibration.json"
    assert main(["calibrate", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "8 CUDA device(s): measures this machine's CPU and gloo only" in err, err
    assert "fw plan --gpu NAME" in err and "--cpu" in err and not out.exists()
