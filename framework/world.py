"""The shape of a job: how many processes, on what kind of device, and which one this is."""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

log = logging.getLogger("framework")


@dataclass(frozen=True)
class World:
    """Process layout of a job, known before launch (rank 0) and inside each worker."""

    world_size: int
    devices: int
    num_nodes: int
    accelerator: str  # "cpu" or "cuda": what `auto` resolved to
    rank: int = 0
    local_rank: int = 0

    @property
    def is_cuda(self) -> bool:
        return self.accelerator == "cuda"

    @classmethod
    def planned(cls, trainer_cfg) -> World:
        """The world a trainer config asks for, as seen from the launching process."""
        accel = resolve_accelerator(trainer_cfg.accelerator)
        devices = int(trainer_cfg.devices)
        nodes = int(trainer_cfg.num_nodes)
        return cls(world_size=devices * nodes, devices=devices, num_nodes=nodes, accelerator=accel)

    @classmethod
    def current(cls, trainer_cfg) -> World:
        """The world of a running worker, read from the launcher's environment variables."""
        planned = cls.planned(trainer_cfg)
        return cls(
            world_size=int(env("WORLD_SIZE", "SLURM_NTASKS", planned.world_size)),
            devices=planned.devices,
            num_nodes=planned.num_nodes,
            accelerator=planned.accelerator,
            rank=int(env("RANK", "SLURM_PROCID", 0)),
            local_rank=int(env("LOCAL_RANK", "SLURM_LOCALID", 0)),
        )


def env(name: str, slurm_name: str, default):
    """A torchrun variable, else its SLURM equivalent (srun sets only those), else `default`."""
    return os.environ.get(name, os.environ.get(slurm_name, default))


RESTART_ENV = "FW_RESTART_COUNT"  # set by launcher=local: which start of the job this is


def global_rank() -> int:
    return int(env("RANK", "SLURM_PROCID", 0))


def resolve_accelerator(name: str) -> str:
    """Map the accelerator setting to the device type actually used: `cpu` or `cuda`."""
    if name == "cpu":
        return "cpu"
    if name in ("gpu", "cuda"):
        return "cuda"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def collective_backend(choice: str | None, world: World) -> str:
    """The collective backend of a job: the one asked for, else NCCL on CUDA and gloo on CPU;
    a ConfigError for NCCL without CUDA. Every strategy plugin asks here."""
    if choice == "nccl" and not world.is_cuda:
        from framework.errors import ConfigError

        raise ConfigError(
            "strategy.backend",
            choice,
            "NCCL needs CUDA devices but the job runs on CPU",
            ["gloo", "null"],
        )
    return choice or ("nccl" if world.is_cuda else "gloo")


def local_device(world: World, first_gpu: int = 0):
    """This process's torch device: its GPU (`first_gpu` + its local rank) on CUDA, else the
    CPU."""
    import torch

    if not world.is_cuda:
        return torch.device("cpu")
    return torch.device("cuda", first_gpu + world.local_rank)


def parallel_devices(world: World, first_gpu: int = 0):
    """The devices of this machine's processes, by local rank, for Lightning's parallel
    strategies (which otherwise take cuda:0 .. devices-1); None on the CPU (Lightning's own)."""
    import torch

    if not world.is_cuda:
        return None
    return [torch.device("cuda", first_gpu + r) for r in range(world.devices)]


# ---- CPU-side process groups

HOST_GROUP = (
    "host:"  # group_desc prefix of every group host_group makes (framework.parallel.nccl_rules)
)
GLOO_INTERFACE_ENV = "GLOO_SOCKET_IFNAME"


def host_group(purpose: str):
    """A new gloo process group of every process, for collectives of CPU tensors beside the
    training's (the preemption vote, the loss guard's verdict, a background checkpoint write's):
    on a GPU job the training's groups are NCCL, which takes no CPU tensor, and reading a flag
    back from the GPU would wait for the whole step. Every process makes it at the same point
    (a collective). In a job over several machines on CUDA gloo is given an explicit network
    interface first (`gloo_interface`): alone it binds to whatever the host name resolves to
    (127.0.1.1 on stock images, or an interface the other machines cannot reach), and the
    first collective hangs."""
    import torch.distributed as dist

    if is_multi_node_cuda(os.environ, dist.get_backend()):
        interface = gloo_interface(os.environ)
        if interface is None:
            warn_without_interface()
        elif not os.environ.get(GLOO_INTERFACE_ENV):
            os.environ[GLOO_INTERFACE_ENV] = interface  # read by gloo at each group's creation
            log.info("gloo groups bind to %s (%s)", interface, GLOO_INTERFACE_ENV)
    return dist.new_group(backend="gloo", group_desc=f"{HOST_GROUP}{purpose}")


@functools.cache  # once per process, whatever number of groups it makes
def warn_without_interface() -> None:
    """Warn (each machine's first process) that this machine's gloo groups get no explicit
    interface: the job may hang at their first collective."""
    if os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")) != "0":
        return
    log.warning(
        "No network interface found for the CPU-side gloo groups of this job over several "
        "machines (the preemption vote, the loss guard, background checkpoint writes): "
        "GLOO_SOCKET_IFNAME is unset, NCCL_SOCKET_IFNAME names no interface of this machine "
        "exactly and the route to MASTER_ADDR gave none. Gloo binds to whatever the host name "
        "resolves to (often 127.0.1.1), and the first collective can hang: set "
        "GLOO_SOCKET_IFNAME to the interface the machines reach each other by (e.g. eth0)."
    )


def is_multi_node_cuda(environ, backend: str) -> bool:
    """Whether this worker is one of a CUDA job (NCCL as the default backend) over several
    machines (fewer processes on this machine than in the job)."""
    if backend != "nccl":
        return False
    local, total = environ.get("LOCAL_WORLD_SIZE"), environ.get("WORLD_SIZE")
    if local and total:
        return int(local) < int(total)
    nodes = environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES") or "1"
    return int(nodes) > 1


def gloo_interface(environ) -> str | None:
    """The network interface this machine's gloo groups take: GLOO_SOCKET_IFNAME when set;
    else NCCL_SOCKET_IFNAME when it names existing interfaces exactly (gloo takes exact names
    only, NCCL also prefixes and exclusions); else the interface this machine reaches
    MASTER_ADDR by, or when that is a loopback address (the master's own name resolving to
    127.0.1.1) the first interface that is not a loopback, docker or veth one; None when none
    is found."""
    if environ.get(GLOO_INTERFACE_ENV):
        return environ[GLOO_INTERFACE_ENV]
    addresses = interface_addresses()
    nccl = environ.get("NCCL_SOCKET_IFNAME", "")
    names = [name.removeprefix("=") for name in nccl.split(",") if name]
    if names and not nccl.startswith("^") and all(name in addresses for name in names):
        return ",".join(names)
    source = route_source(environ.get("MASTER_ADDR", ""))
    by_address = {address: name for name, address in addresses.items()}
    if source and not source.startswith("127."):
        return by_address.get(source)
    others = [n for n in addresses if not n.startswith(("lo", "docker", "veth"))]
    return others[0] if others else None


def route_source(host: str) -> str | None:
    """The local address this machine sends from to reach `host` (no packet is sent)."""
    import socket

    if not host:
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def interface_addresses() -> dict[str, str]:
    """{interface name: its IPv4 address} of this machine's interfaces that have one (Linux)."""
    import fcntl
    import socket
    import struct

    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name[:15].encode())
            try:
                reply = fcntl.ioctl(s.fileno(), 0x8915, request)  # SIOCGIFADDR
            except OSError:  # no IPv4 address
                continue
            found[name] = socket.inet_ntoa(reply[20:24])
    return found


def address_of(host: str) -> str:
    """The IP address a host name stands for (IPv4 first)."""
    import socket

    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return infos[0][4][0]
