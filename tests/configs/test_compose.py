"""Every YAML composes and validates; every schema has a YAML; a typo fails at compose time."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from framework.config.compose import CONF_DIR, GROUPS, compose_config, group_options
from framework.config.store import CORE_SCHEMAS, plugin_schemas
from framework.config.validate import plan_job
from framework.errors import ConfigError

# launcher=slurm validates only where sbatch is installed: both sides are tested on their own
SKIPPED = {("logger", "none"), ("launcher", "slurm")}
OPTIONS = [(g, o) for g in GROUPS for o in group_options(g) if (g, o) not in SKIPPED]
# Options that need more than the defaults: fsdp_tp (fsdp x tp=2) two processes, hogwild the CPU
# (accelerator auto is CUDA where a GPU is present), hf_lm a model: a pretrained directory or a
# random init's config (the tiny experiment's).
NEEDS = {
    ("strategy", "fsdp_tp"): ["trainer.devices=2"],
    ("strategy", "hogwild"): ["trainer.accelerator=cpu"],
    ("task", "hf_lm"): ["experiment=hf_lm_tiny"],
}


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes_and_validates(group, option, monkeypatch):
    override = f"{group}=[{option}]" if group == "logger" else f"{group}={option}"
    if group == "trainer" and option == "gpu":  # validated as on a machine with one GPU
        monkeypatch.setattr("framework.config.validate.cuda_device_count", lambda: 1)
    cfg = compose_config([override, *NEEDS.get((group, option), [])])
    OmegaConf.resolve(cfg)
    assert plan_job(cfg).world.world_size >= 1


def test_launcher_slurm_composes_and_is_refused_where_sbatch_is_missing(monkeypatch, tmp_path):
    """Without SLURM's client the job could not be submitted: refused before anything starts
    (the validating side, with sbatch installed: tests/distributed/test_slurm.py)."""
    cfg = compose_config(["launcher=slurm"])
    OmegaConf.resolve(cfg)
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no sbatch
    with pytest.raises(ConfigError, match="sbatch is not on PATH") as info:
        plan_job(cfg)
    assert info.value.key.startswith("launcher")


def test_fsdp_tp_on_one_process_is_refused():
    cfg = compose_config(["strategy=fsdp_tp"])
    OmegaConf.resolve(cfg)
    with pytest.raises(ConfigError, match="does not divide the 1 processes"):
        plan_job(cfg)


def test_gpu_trainer_refused_without_cuda():
    """CUDA is absent here on any machine (the `pin_cpu` fixture)."""
    cfg = compose_config(["trainer=gpu"])
    with pytest.raises(ConfigError, match="no CUDA device"):
        plan_job(cfg)


def test_every_schema_has_a_yaml():
    texts = "\n".join(p.read_text() for p in CONF_DIR.rglob("*.yaml"))
    for name in CORE_SCHEMAS:
        assert f"/schema/{name}@" in texts, f"schema/{name} is used by no YAML"
    for group, kind in plugin_schemas():
        assert f"/schema/{group}/{kind}@" in texts, f"schema/{group}/{kind} is used by no YAML"


def _first_node_key(group: str) -> str:
    return {"logger": "logger.csv", "callbacks": "callbacks.checkpoint"}.get(group, group)


@pytest.mark.parametrize(
    "group", ["task", "strategy", "trainer", "logger", "callbacks", "launcher", "run"]
)
def test_misspelled_key_fails_at_compose_time(group):
    with pytest.raises(ConfigError, match="no such key") as info:
        compose_config([f"{_first_node_key(group)}.no_such_field=1"])
    assert info.value.key.endswith("no_such_field")
    assert info.value.choices, "the message lists the valid keys"


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("trainer.max_steps=many", "trainer.max_steps"),
        ("strategy.bucket_cap_mb=big", "strategy.bucket_cap_mb"),
        ("seed=abc", "seed"),
        ("trainer.deterministic=maybe", "trainer.deterministic"),
    ],
)
def test_wrong_type_fails_at_compose_time(override, key):
    with pytest.raises(ConfigError) as info:
        compose_config([override])
    assert info.value.key == key


@pytest.mark.parametrize("group", GROUPS)
def test_unknown_option_lists_valid_ones(group):
    with pytest.raises(ConfigError) as info:
        compose_config([f"{group}=nonexistent_option"])
    assert info.value.key == group
    assert info.value.choices == group_options(group)


def test_typo_in_a_yaml_fails(tmp_path):
    (tmp_path / "strategy").mkdir()
    (tmp_path / "strategy" / "typo.yaml").write_text(
        "defaults:\n  - /schema/strategy/ddp@_here_\n  - _self_\nbucket_capmb: 3\n"
    )
    with pytest.raises(ConfigError, match="bucket_capmb"):
        compose_config(["strategy=typo"], [tmp_path])


def test_invalid_choice_is_refused_before_launch():
    cfg = compose_config(["trainer.precision=fp8"])
    with pytest.raises(ConfigError, match="not a valid choice") as info:
        plan_job(cfg)
    assert "bf16-mixed" in info.value.choices


def test_task_arguments_are_checked_against_the_signature():
    cfg = compose_config(["+task.model.hiddn=3"])
    with pytest.raises(ConfigError, match="not an argument of DigitsTask") as info:
        plan_job(cfg)
    assert "hidden" in info.value.choices and "Did you mean 'hidden'" in str(info.value)
    cfg = compose_config(["task.model.hidden=wide"])
    with pytest.raises(ConfigError, match="expected int"):
        plan_job(cfg)
    cfg = compose_config(["task.optimizer.lr=fast"])
    with pytest.raises(ConfigError, match="task.optimizer.lr"):
        plan_job(cfg)


def test_multirun_jobs_get_numbered_run_dirs_under_a_given_run_dir(tmp_path):
    from framework.runner import make_jobs

    jobs = make_jobs(["seed=1,2", f"run.dir={tmp_path}/sweep"], multirun=True)
    assert [j.run_dir for j in jobs] == [tmp_path / "sweep" / "0", tmp_path / "sweep" / "1"]
    assert [j.cfg.seed for j in jobs] == [1, 2]
    swept = make_jobs([f"run.dir={tmp_path}/a,{tmp_path}/b"], multirun=True)
    assert [j.run_dir for j in swept] == [tmp_path / "a", tmp_path / "b"]
    assert not any(tmp_path.iterdir()), "planning writes nothing"


def test_overfit_batches_keeps_an_integer_count():
    cfg = compose_config(["debug=overfit"])
    assert cfg.trainer.overfit_batches == 1 and isinstance(cfg.trainer.overfit_batches, int)
