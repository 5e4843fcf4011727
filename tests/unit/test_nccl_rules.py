"""The rules of NCCL, checked on the CPU (framework/parallel/nccl_rules.py): each rule is
held to the project's own code (context parallel's ring at cp=2, expert parallel's all-to-all,
the pipeline's blocking sends, the CPU-side gloo groups) and fails on a violation planted on
purpose: an unbatched isend/irecv pair (the ring's exchange as it was), a CPU tensor handed to
an all-to-all of an NCCL-bound group in the forward, a gloo group made outside
framework.world.host_group, two members of one NCCL group on one GPU. Two processes on gloo,
started by torch's multiprocessing spawn; the recorder over whole `fw train` steps of the cp,
pipeline and expert layouts: tests/distributed/test_context.py. Two scans of the framework's
source hold all of it, not only what a test runs, to rules 1 and 4: no bare point-to-point
call, no gloo group made outside host_group."""

from __future__ import annotations

import ast
import functools
import json
import os

import pytest
import torch

from framework.parallel import nccl_rules
from tests.conftest import REPO


def bare_exchange(x, group, to, source):
    """The ring's exchange as it was: a bare isend and irecv (NCCL: both ranks wait)."""
    import torch.distributed as dist

    x = x.contiguous()
    out = torch.empty_like(x)
    works = [
        dist.isend(x, group=group, group_dst=to),
        dist.irecv(out, group=group, group_src=source),
    ]
    for work in works:
        work.wait()
    return out


# each case builds its inputs (as a worker builds its model before the step), then returns
# the step the recorder watches


def ring(rank, group, exchange=None):
    """Context parallel's ring attention at cp=2, forward and backward."""
    from framework.parallel.context import attention

    q, k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in "qkv")

    def step():
        kept = attention.exchange
        attention.exchange = exchange or kept
        try:
            attention.split_attention(q, k, v, True, "ring", group, 2, rank).sum().backward()
        finally:
            attention.exchange = kept

    return step


def experts(rank, group, plant=False):
    """The MoE layer under expert parallel (ep=2: 2 of its 4 experts here), forward and
    backward; `plant`: its token counts rebuilt on the side (without a device), as a careless
    edit would."""
    from framework.nn import moe

    torch.manual_seed(0)
    layer = moe.MoE(8, 16, num_experts=4, top_k=2)
    layer.set_expert_parallel(group, 2, rank)
    layer.experts = moe.GroupedExperts(8, 16, 2, "auto")
    x = torch.randn(2, 5, 8)

    def step():
        bincount = moe.torch.bincount
        if plant:
            moe.torch.bincount = lambda t, minlength=0: torch.tensor(
                bincount(t, minlength=minlength).tolist()
            )
        try:
            layer(x).sum().backward()
        finally:
            moe.torch.bincount = bincount

    return step


def pipeline_sends(rank, group):
    """The pipeline's blocking send of a tensor with its header, answered by a receive."""
    from framework.parallel.pipeline.schedule import _recv, _send

    x = torch.ones(3, 2)

    def step():
        if rank == 0:
            _send(x, 1, group)
            _recv(1, group, torch.device("cpu"))
        else:
            _send(_recv(0, group, torch.device("cpu")) * 2, 0, group)

    return step


def host_flags(rank, group):
    """A CPU flag on a CPU-side gloo group (allowed), then on a gloo group made by hand."""
    import torch.distributed as dist

    from framework.world import host_group

    def step():
        dist.all_reduce(torch.tensor([1.0]), group=host_group("test"))
        dist.all_reduce(torch.tensor([1.0]), group=dist.new_group(backend="gloo"))

    return step


CASES = {
    "ring": ring,
    "ring, unbatched exchange": lambda rank, group: ring(rank, group, bare_exchange),
    "experts": experts,
    "experts, counts made without a device": lambda rank, group: experts(rank, group, True),
    "pipeline sends": pipeline_sends,
    "host flags": host_flags,
}


def record(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    found = {}
    for name, case in CASES.items():
        step = case(rank, dist.group.WORLD)
        recorder = nccl_rules.NcclRecorder()
        with recorder:
            step()
        records = [None, None]
        dist.all_gather_object(records, recorder.record)
        ops = sorted({e.op for e in recorder.record.events})
        found[name] = {"ops": ops, "violations": nccl_rules.violations(dict(enumerate(records)))}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(found, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    import torch.multiprocessing as mp

    root = tmp_path_factory.mktemp("nccl")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(record, args=(str(root / "store"), str(root / "found.json")), nprocs=2)
    return json.loads((root / "found.json").read_text())


def test_the_projects_p2p_and_all_to_all_keep_nccls_rules(recorded):
    for name in ("ring", "experts", "pipeline sends"):
        assert recorded[name]["violations"] == [], name
    assert {"send", "recv_"} <= set(recorded["ring"]["ops"]), "the ring's exchanges were seen"
    assert "all_to_all_single" in recorded["experts"]["ops"]


def test_an_unbatched_isend_irecv_pair_is_found(recorded):
    (found,) = recorded["ring, unbatched exchange"]["violations"]
    assert "ranks 0 and 1 both issue a bare send to the other first" in found
    assert "(step 0, framework/parallel/context/attention.py:" in found, found


def test_a_cpu_tensor_in_an_nccl_bound_all_to_all_in_the_forward_is_found(recorded):
    found = recorded["experts, counts made without a device"]["violations"]
    assert found, "the planted counts were not seen"
    assert any(
        "all_to_all_single" in line and "(forward, framework/nn/moe.py" in line for line in found
    ), found


def test_cpu_flags_belong_on_host_groups_and_gloo_groups_come_from_host_group(recorded):
    found = recorded["host flags"]["violations"]
    assert len(found) == 4, found  # rank 0 and 1, each: the hand-made group and its CPU flag
    assert sum("outside framework.world.host_group" in line for line in found) == 2
    assert sum("allreduce on group" in line for line in found) == 2
    assert not any("host:test" in line for line in found)


def test_two_members_of_one_nccl_group_on_one_gpu_are_found():
    placed = {"torchft rank 0": [("node0", 0), ("node1", 0)], "dp": [("node0", 0), ("node0", 1)]}
    assert nccl_rules.shared_devices(placed) == []
    placed["torchft rank 0"] = [("node0", 0), ("node0", 0)]  # two groups on one machine
    (found,) = nccl_rules.shared_devices(placed)
    assert "members 0 and 1 would both run on GPU 0 of node0" in found


@functools.cache  # parsed once for both scans
def framework_calls() -> list:
    """Every call in the framework's modules: (path from the repository, the function it is
    in, the call node, the names that module binds to torch.distributed)."""
    found = []
    for path in sorted((REPO / "framework").rglob("*.py")):
        tree = ast.parse(path.read_text())
        aliases = distributed_names(tree)
        found += [(str(path.relative_to(REPO)), f, call, aliases) for f, call in calls(tree, "")]
    return found


def calls(node, inside: str):
    """(the innermost function around it, call) for every call under `node`."""
    for child in ast.iter_child_nodes(node):
        named = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
        if isinstance(child, ast.Call):
            yield inside, child
        yield from calls(child, child.name if named else inside)


def distributed_names(tree) -> dict[str, str]:
    """{name: what it is} for the names a module binds to torch.distributed ("module") or to
    one of its functions (that function's name)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("torch.distributed") and a.asname:
                    names[a.asname] = "module"
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                if a.name in ("distributed", "distributed_c10d"):
                    names[a.asname or a.name] = "module"
                elif node.module.startswith("torch.distributed"):
                    names[a.asname or a.name] = a.name
    return names


def test_gloo_groups_are_made_only_by_host_group():
    """A gloo group made anywhere else in the framework would bind, in a multi-node CUDA job,
    to whatever the host name resolves to (the recorder finds it only in the code a test
    runs; this finds it in all of it)."""
    found = []
    for path, _, node, _ in framework_calls():
        if getattr(node.func, "attr", "") == "new_group":
            backend = [k.value for k in node.keywords if k.arg == "backend"]
            gloo = any(isinstance(b, ast.Constant) and b.value == "gloo" for b in backend)
            if gloo and path != "framework/world.py":
                found.append(f"{path}:{node.lineno}")
    assert found == [], found


DISTRIBUTED = ("torch.distributed", "torch.distributed.distributed_c10d")
P2P_CALLS = {"send", "recv", "isend", "irecv", "send_object_list", "recv_object_list"}
# bare point-to-point that never meets a peer's bare send: a pipeline's validation runs the
# stages one after another, so a rank receives from the stage before it and only then sends to
# the next (one direction at a time); recorded above ("pipeline sends")
ONE_WAY = {
    ("framework/parallel/pipeline/schedule.py", "_send", "send"),
    ("framework/parallel/pipeline/schedule.py", "_recv", "recv"),
}


def test_point_to_point_is_issued_only_in_batches():
    """NCCL runs a send only once the peer's receive is posted: two ranks that each first send
    to the other without batching hang on any message above NCCL's buffers, and gloo never
    does. The recorder holds to this rule only the steps a test records; this holds every
    module of the framework to it: a send or receive is a `dist.P2POp` handed to
    `dist.batch_isend_irecv`, never a bare call (the one-way chain of ONE_WAY aside)."""
    found = []
    for path, inside, node, aliases in framework_calls():
        func, name = node.func, ""
        if isinstance(func, ast.Attribute) and func.attr in P2P_CALLS:
            owner = ast.unparse(func.value)
            if aliases.get(owner) == "module" or owner in DISTRIBUTED:
                name = func.attr
        elif isinstance(func, ast.Name) and aliases.get(func.id) in P2P_CALLS:
            name = aliases[func.id]
        if name and (path, inside, name) not in ONE_WAY:
            found.append(f"{path}:{node.lineno} ({inside or 'module'}): bare {name}")
    assert found == [], found
