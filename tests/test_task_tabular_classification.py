"""The tabular_classification task: its data, its model, and full runs as users start them,
on one process and on two DDP processes (gloo on the CPU)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from helpers.runs import results, train

from ddp_template.errors import ConfigError
from ddp_template.tasks.tabular_classification.datamodule import TabularClassificationDataModule
from ddp_template.tasks.tabular_classification.model import build_mlp

TASK = "task=tabular_classification"
QUIET = ["trainer.enable_model_summary=false", "logger=none"]


@pytest.mark.parametrize(
    "name,source,rows,features,classes",
    [("breast_cancer", "BreastCancer", 569, 30, 2), ("wine", "Wine", 178, 13, 3)],
)
def test_splits_are_standardised_with_training_rows_only(
    name: str, source: str, rows: int, features: int, classes: int
) -> None:
    datamodule = TabularClassificationDataModule(name=name, source=source, batch_size=16)
    datamodule.setup("fit")
    train_x, train_y = datamodule.train_set.tensors
    test_x, _ = datamodule.test_set.tensors
    sizes = [len(s) for s in (datamodule.train_set, datamodule.val_set, datamodule.test_set)]
    assert sum(sizes) == rows and sizes[2] == round(rows * 0.2)
    assert datamodule.sizes() == {"num_features": features, "num_classes": classes}
    assert train_x.shape[1] == features and len(train_y.unique()) == classes
    torch.testing.assert_close(train_x.mean(0), torch.zeros(features), atol=1e-5, rtol=0)
    torch.testing.assert_close(train_x.std(0), torch.ones(features), atol=1e-5, rtol=0)
    # The held-out rows were scaled with the training statistics, not their own.
    assert test_x.mean(0).abs().max() > 1e-3


def test_batch_norm_layers_are_what_sync_batchnorm_converts() -> None:
    model = build_mlp(num_features=30, num_classes=2, hidden=[16, 8])
    synced = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    assert sum(isinstance(m, torch.nn.SyncBatchNorm) for m in synced.modules()) == 2
    assert not any(isinstance(m, torch.nn.BatchNorm1d) for m in synced.modules())


@pytest.mark.parametrize(
    "option,message",
    [
        ({"hidden": [64, 0]}, "hidden=[64, 0]"),
        ({"norm": "group"}, "norm='group'"),
        ({"dropout": 1.0}, "dropout=1.0"),
    ],
)
def test_bad_model_option_is_named(option: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"task.module.model.{message} is not valid")):
        build_mlp(num_features=30, num_classes=2, **option)


@pytest.mark.slow
def test_default_run_on_one_process(run_dir: Path, tmp_path: Path) -> None:
    train(TASK, *QUIET, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    out = results(run_dir)
    assert out["config"]["data"]["name"] == "breast_cancer"
    assert out["world_size"] == 1
    # Far above the majority class (63%): the model learns; the exact figure varies by CPU.
    assert out["test/acc"] >= 0.9, (
        f"test accuracy {out['test/acc']} on breast cancer, expected >= 0.9 (the majority "
        "class alone scores 0.63): the model does not learn"
    )
    state = torch.load(run_dir / "model.pt", weights_only=True, map_location="cpu")
    build_mlp(num_features=30, num_classes=2).load_state_dict(state)


@pytest.mark.slow
def test_default_run_on_two_ddp_processes(run_dir: Path, tmp_path: Path) -> None:
    train(TASK, "strategy=ddp", "devices=2", *QUIET, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    out = results(run_dir)
    assert (
        out["world_size"] == 2
        and out["global_batch_size"] == 2 * out["config"]["data"]["batch_size"]
    )
    # Far above the majority class (63%): the model learns; the exact figure varies by CPU.
    assert out["test/acc"] >= 0.9, (
        f"test accuracy {out['test/acc']} on breast cancer, expected >= 0.9 (the majority "
        "class alone scores 0.63): the model does not learn"
    )


@pytest.mark.slow
def test_wine(run_dir: Path, tmp_path: Path) -> None:
    train(TASK, "data=wine", *QUIET, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    out = results(run_dir)
    assert out["config"]["data"]["name"] == "wine"
    # 36 test samples, 3 classes (the largest 40%): at most 7 errors says the model learns,
    # with room for another CPU's rounding (a model that learns nothing stays near 40%).
    assert out["test/acc"] >= 0.8, (
        f"test accuracy {out['test/acc']} on wine, expected >= 0.8 (the largest class "
        "alone scores 0.4): the model does not learn"
    )
