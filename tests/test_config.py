"""Composition of every config option, and the up-front checks."""

from __future__ import annotations

import inspect
from pathlib import Path

import lightning as L
import pytest
from helpers.runs import compose_train
from omegaconf import OmegaConf

from ddp_template.config import resolvers
from ddp_template.config.checks import TRAINER_ARGS_ELSEWHERE, resolve_and_check
from ddp_template.errors import ConfigError
from ddp_template.train import CONFIG_DIR

resolvers.register()
GROUPS = ["task", "data", "strategy", "loader", "trainer", "callbacks", "logger"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (Path(CONFIG_DIR) / group).glob("*.yaml"))


@pytest.mark.parametrize(
    "group,option", [(g, o) for g in GROUPS for o in options(g)], ids=lambda v: str(v)
)
def test_every_option_composes(group: str, option: str) -> None:
    extra = ["data.root=."] if option == "imagefolder" else []
    cfg = compose_train(f"{group}={option}", *extra)
    OmegaConf.to_container(cfg, resolve=True)


def test_default_config_passes_the_checks() -> None:
    cfg = compose_train()
    resolve_and_check(cfg)
    assert cfg.accelerator == "cpu" and cfg.devices == 1


def test_every_trainer_argument_is_reachable() -> None:
    """trainer.<arg> works without `+` for every Trainer argument not set elsewhere."""
    trainer_yaml = OmegaConf.load(Path(CONFIG_DIR) / "trainer" / "default.yaml")
    arguments = set(inspect.signature(L.Trainer.__init__).parameters) - {"self"}
    assert arguments - TRAINER_ARGS_ELSEWHERE == set(trainer_yaml)


def test_ddp_switches_reach_distributed_data_parallel() -> None:
    from ddp_template.build import build_strategy

    cfg = compose_train(
        "strategy=ddp",
        "devices=2",
        "strategy.bucket_cap_mb=50",
        "strategy.static_graph=true",
        "strategy.gradient_as_bucket_view=true",
        "strategy.forward_sync_buffers=false",
        "strategy.timeout=120",
    )
    strategy = build_strategy(cfg)
    assert strategy._ddp_kwargs == {
        "bucket_cap_mb": 50,
        "gradient_as_bucket_view": True,
        "forward_sync_buffers": False,
        "static_graph": True,
        "find_unused_parameters": False,
    }
    assert strategy._timeout.total_seconds() == 120


BAD_VALUES = [
    (["devices=0"], "devices"),
    (["devices=abc"], "devices"),
    (["devices=2.5"], "devices"),
    (["precision=17"], "precision"),
    (["data.batch_size=0"], "data.batch_size"),
    (["data.num_workers=-1"], "data.num_workers"),
    (["data.prefetch_factor=2"], "data.prefetch_factor"),
    (["strategy=ddp", "strategy.bucket_cap_mb=-5"], "strategy.bucket_cap_mb"),
    (["strategy=ddp", "strategy.timeout=0"], "strategy.timeout"),
    (["ckpt_path=/no/such/file"], "ckpt_path"),
    (["sync_batchnorm=true", "accelerator=cpu"], "sync_batchnorm"),
    (["num_nodes=2"], "num_nodes"),
    (["devices=2", "num_nodes=0"], "num_nodes"),
    (["max_restarts=-1"], "max_restarts"),
    (["accelerator=tpu"], "accelerator"),
    (["data=imagefolder", "data.root=/no/such/folder"], "data.root"),
    (["data.val_fraction=1.5"], "data.val_fraction"),
    (["task.module.model.arch=vgg11"], "task.module.model.arch"),
]


@pytest.mark.parametrize("overrides,key", BAD_VALUES, ids=lambda v: str(v))
def test_bad_values_are_named(overrides: list[str], key: str) -> None:
    cfg = compose_train(*overrides)
    with pytest.raises(ConfigError) as err:
        resolve_and_check(cfg)
    assert err.value.key == key
    assert "Fix:" in str(err.value)


def test_truncated_checkpoint_is_refused(tmp_path: Path) -> None:
    import torch

    from ddp_template.build import build_task

    # Shaped as Lightning's: the weights of the model the config builds, loop counters.
    _, module = build_task(compose_train())
    whole = tmp_path / "whole.ckpt"
    torch.save({"state_dict": module.state_dict(), "loops": {}}, whole)
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(whole.read_bytes()[:-300])
    resolve_and_check(compose_train(f"ckpt_path={whole}"))
    with pytest.raises(ConfigError, match="not a complete torch.save archive"):
        resolve_and_check(compose_train(f"ckpt_path={truncated}"))


def test_empty_image_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "cats").mkdir()
    with pytest.raises(ConfigError, match="found none"):
        resolve_and_check(compose_train("data=imagefolder", f"data.root={tmp_path}"))


def test_data_set_of_another_task_is_refused() -> None:
    """A task reads the data sets whose source class its sources.py has, and names them."""
    with pytest.raises(ConfigError) as err:
        resolve_and_check(compose_train("task=regression", "data=digits"))
    assert err.value.key == "data" and err.value.value == "digits"
    assert "`source: Digits`" in str(err.value) and "its classes: diabetes." in str(err.value)
