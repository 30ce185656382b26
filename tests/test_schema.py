"""Every value is checked before a worker starts: types from the schema, ranges from its
table, and whatever a library refuses when the real objects are built once."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from helpers.runs import compose_train
from omegaconf import open_dict

from ddp_template.config.checks import resolve_and_check
from ddp_template.errors import ConfigError

# (overrides, the key named, a word of what is allowed)
REFUSED = {
    "seed=foo": (["seed=foo"], "seed", "whole number"),
    "max_epochs=-5": (["trainer.max_epochs=-5"], "trainer.max_epochs", "non-negative"),
    "max_epochs=abc": (["trainer.max_epochs=abc"], "trainer.max_epochs", "whole number"),
    "accumulate=0": (
        ["trainer.accumulate_grad_batches=0"],
        "trainer.accumulate_grad_batches",
        ">= 1",
    ),
    "log_every_n_steps=0": (["trainer.log_every_n_steps=0"], "trainer.log_every_n_steps", ">= 1"),
    "clip algorithm": (
        ["trainer.gradient_clip_algorithm=foo"],
        "trainer.gradient_clip_algorithm",
        "value",
    ),
    "deterministic=maybe": (["trainer.deterministic=maybe"], "trainer.deterministic", "warn"),
    "checkpointing=yes": (
        ["trainer.enable_checkpointing=yes"],
        "trainer.enable_checkpointing",
        "true or false",
    ),
    "unknown trainer key": (["+trainer.max_epoch=3"], "trainer.max_epoch", "lightning.Trainer"),
    "precision=fp8": (["precision=fp8"], "precision", "bf16-mixed"),
    "negative lr": (["task.module.optimizer.lr=-0.1"], "task.module.optimizer.lr", "learning rate"),
    "negative lr, AdamW": (
        ["task=tabular_classification", "task.module.optimizer.lr=-0.01"],
        "task.module.optimizer.lr",
        "learning rate",
    ),
    "momentum=abc": (
        ["task.module.optimizer.momentum=abc"],
        "task.module.optimizer.momentum",
        "number",
    ),
    "unknown optimizer key": (
        ["+task.module.optimizer.betas=1"],
        "task.module.optimizer.betas",
        "SGD",
    ),
    "scheduler pct_start": (
        ["+task.module.scheduler.pct_start=2"],
        "task.module.scheduler.pct_start",
        "between 0 and 1",
    ),
    "checkpoint mode": (
        ["callbacks.model_checkpoint.mode=best"],
        "callbacks.model_checkpoint.mode",
        "min, max",
    ),
    "model norm": (["task.module.model.norm=foo"], "task.module.model.norm", "batch"),
    "lr monitor interval": (
        ["callbacks.lr_monitor.logging_interval=often"],
        "callbacks.lr_monitor.logging_interval",
        "step",
    ),
    "unreachable mlflow": (
        ["logger=mlflow", "logger.mlflow.tracking_uri=http://127.0.0.1:9"],
        "logger.mlflow.tracking_uri",
        "MLflow tracking server",
    ),
}


@pytest.mark.parametrize("overrides,key,allowed", REFUSED.values(), ids=REFUSED.keys())
def test_refused_with_key_value_allowed_and_fix(
    overrides: list[str], key: str, allowed: str
) -> None:
    cfg = compose_train(*overrides)
    start = time.monotonic()
    with pytest.raises(ConfigError) as refused:
        resolve_and_check(cfg)
    # Measured at a few tenths of a second; a generous bound that still catches a hang.
    assert time.monotonic() - start < 20
    message = str(refused.value)
    assert refused.value.key == key, message
    assert message.startswith(f"{key}=") and allowed in message and "Fix: " in message
    assert "\n" not in message


def test_checking_leaves_no_traces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Building the Trainer, loggers' settings and all: no files, no environment variables,
    no torch flags, no tracker run, no process group."""
    monkeypatch.chdir(tmp_path)
    cfg = compose_train(
        "strategy=ddp",
        "devices=2",
        "logger=[csv,tensorboard,mlflow]",
        "trainer.deterministic=true",
        "trainer.benchmark=true",
    )
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path / "run")
    environment = dict(os.environ)
    resolve_and_check(cfg)
    assert list(tmp_path.iterdir()) == []
    assert dict(os.environ) == environment
    assert not torch.are_deterministic_algorithms_enabled()
    assert not torch.backends.cudnn.benchmark
    assert not torch.distributed.is_initialized()
    # Workers may be forked from this process: a CUDA context made here would be unusable there.
    assert not torch.cuda.is_initialized()
