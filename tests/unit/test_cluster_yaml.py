"""The Kubernetes examples of docs/cluster.md ("Ray and Kubernetes"), which are not run here: the
KubeRay `RayJob` and the SkyPilot task load as YAML, carry the fields their tools require, run
`fw train ... launcher=ray` with overrides that compose, ask for as many GPUs as the command's
ranks, and put `run.dir` on storage that every node mounts at the same path."""

from __future__ import annotations

import re
import shlex

import pytest
import yaml

from tests.conftest import REPO

DOC = REPO / "docs" / "cluster.md"


def examples() -> dict[str, dict]:
    """The YAML blocks of the doc's "Ray and Kubernetes" section, by what they are."""
    section = DOC.read_text().split("## Ray and Kubernetes", 1)[1]
    found = {}
    for block in re.findall(r"```yaml\n(.*?)```", section, re.DOTALL):
        data = yaml.safe_load(block)
        found["rayjob" if data.get("kind") == "RayJob" else "skypilot"] = data
    return found


def fw_overrides(command: str) -> dict[str, str]:
    """The `key=value` arguments of the `fw train` in a shell command (continuations joined)."""
    words = shlex.split(command.replace("\\\n", " "))
    start = words.index("fw")
    assert words[start + 1] == "train", words
    args = []
    for word in words[start + 2 :]:
        if "=" not in word:
            break
        args.append(word)
    return dict(arg.split("=", 1) for arg in args)


def assert_composes(overrides: dict[str, str]) -> None:
    """The command's overrides name real keys and values of the right types."""
    from framework.config.compose import compose_config

    cfg = compose_config([f"{k}={v}" for k, v in overrides.items()])
    assert cfg.launcher.kind == "ray"


def gpus(container: dict) -> int:
    return int(container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))


def test_the_rayjob_runs_fw_on_a_cluster_whose_nodes_share_the_run_dir():
    job = examples()["rayjob"]
    assert job["apiVersion"].startswith("ray.io/") and job["metadata"]["name"]
    spec = job["spec"]
    overrides = fw_overrides(spec["entrypoint"])
    assert_composes(overrides)
    cluster = spec["rayClusterSpec"]
    groups = [(1, cluster["headGroupSpec"])]
    groups += [(g["replicas"], g) for g in cluster["workerGroupSpecs"]]
    total_gpus, nodes = 0, 0
    for replicas, group in groups:
        assert "rayStartParams" in group
        pod = group["template"]["spec"]
        claims = {v["name"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
        (container,) = pod["containers"]
        assert container["image"]
        env = {e["name"]: e for e in container["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token" and "RAY_AUTH_TOKEN" in env
        mounts = [m for m in container["volumeMounts"] if m["name"] in claims]
        assert any(overrides["run.dir"].startswith(m["mountPath"] + "/") for m in mounts), (
            "every pod mounts the run directory's volume"
        )
        total_gpus += replicas * gpus(container)
        nodes += replicas
    ranks = int(overrides["trainer.num_nodes"]) * int(overrides["trainer.devices"])
    assert overrides["trainer.accelerator"] == "cuda" and total_gpus == ranks
    assert nodes == int(overrides["trainer.num_nodes"])
    assert gpus(cluster["headGroupSpec"]["template"]["spec"]["containers"][0]) == int(
        overrides["trainer.devices"]
    ), "fw checks trainer.devices against the GPUs of the pod it runs in"


def test_the_skypilot_task_starts_a_ray_cluster_and_runs_fw_on_it():
    task = examples()["skypilot"]
    assert task["name"] and task["setup"]
    overrides = fw_overrides(task["run"])
    assert_composes(overrides)
    accelerator, count = task["resources"]["accelerators"].split(":")
    assert accelerator and int(count) == int(overrides["trainer.devices"])
    assert task["num_nodes"] == int(overrides["trainer.num_nodes"])
    assert any(overrides["run.dir"].startswith(path + "/") for path in task["file_mounts"])
    run = task["run"]
    assert "ray start --head --port=6379" in run and 'ray start --address="$HEAD_IP:6379"' in run
    assert task["envs"]["RAY_AUTH_MODE"] == "token" and "RAY_AUTH_TOKEN" in task["secrets"]


@pytest.mark.parametrize("name", ["rayjob", "skypilot"])
def test_both_examples_are_marked_as_not_run_here(name):
    section = DOC.read_text().split("## Ray and Kubernetes", 1)[1]
    heading = {"rayjob": "### Kubernetes through KubeRay", "skypilot": "### SkyPilot"}[name]
    text = section.split(heading, 1)[1].split("```", 1)[0]
    assert "**Not run here**" in text
