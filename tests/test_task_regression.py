"""The regression task: its data, and a DDP run whose best checkpoint is the one with the
lowest validation error, and whose test error beats predicting the mean."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from helpers.runs import results, train

from ddp_template.tasks.regression.datamodule import RegressionDataModule
from ddp_template.tasks.regression.module import RegressionModule

TASK = "task=regression"


def test_splits_are_standardised_with_training_rows_only() -> None:
    datamodule = RegressionDataModule(name="diabetes", source="Diabetes", batch_size=16)
    datamodule.setup("fit")
    train_x, train_y = datamodule.train_set.tensors
    test_x, _ = datamodule.test_set.tensors
    sizes = [len(s) for s in (datamodule.train_set, datamodule.val_set, datamodule.test_set)]
    assert sum(sizes) == 442 and sizes[2] == round(442 * 0.2)
    assert datamodule.sizes() == {"num_features": 10} and train_x.shape[1] == 10
    for column in (train_x, train_y):
        torch.testing.assert_close(column.mean(0), torch.zeros(column.shape[1]), atol=1e-5, rtol=0)
        torch.testing.assert_close(column.std(0), torch.ones(column.shape[1]), atol=1e-5, rtol=0)
    # The held-out rows were scaled with the training statistics, not their own.
    assert test_x.mean(0).abs().max() > 1e-3


def validation_errors(run_dir: Path) -> dict[int, float]:
    """Epoch -> val/mse, as the CSV logger recorded them."""
    with (run_dir / "csv" / "metrics.csv").open() as file:
        rows = [row for row in csv.DictReader(file) if row.get("val/mse")]
    return {int(row["epoch"]): float(row["val/mse"]) for row in rows}


def mean_squared_error(module: RegressionModule, dataset) -> float:
    features, targets = dataset.tensors
    module.eval()
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(module(features), targets))


@pytest.mark.slow
def test_ddp_run_keeps_the_checkpoint_of_lowest_validation_error(
    run_dir: Path, tmp_path: Path
) -> None:
    proc = train(
        TASK,
        "strategy=ddp",
        "devices=2",
        "trainer.max_epochs=6",
        "trainer.enable_model_summary=false",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    out = results(run_dir)
    assert out["world_size"] == 2
    assert out["monitor"] == "val/mse" and out["monitor_mode"] == "min"
    errors = validation_errors(run_dir)
    assert len(errors) == 6 and len(set(errors.values())) > 1, errors
    best_epoch = min(errors, key=errors.__getitem__)
    assert out["val/mse_best"] == pytest.approx(errors[best_epoch], rel=1e-6), (
        f"val/mse_best {out['val/mse_best']}, expected the lowest epoch's {errors}"
    )
    # The epoch lines and the summary report the same best, and say which way is better.
    (last_line,) = [line for line in proc.stdout.splitlines() if "epoch 6/6" in line]
    assert f"best val/mse {out['val/mse_best']:.4g}" in last_line
    assert "(lower is better)" in proc.stdout

    best = out["checkpoints"]["best"]
    assert torch.load(best, weights_only=True, map_location="cpu")["epoch"] == best_epoch
    # The kept weights themselves have that error on the validation rows (evaluation shards
    # are unpadded, so the two ranks' mean equals one process's).
    module = RegressionModule.load_from_checkpoint(best, weights_only=True, map_location="cpu")
    datamodule = RegressionDataModule(name="diabetes", source="Diabetes", batch_size=32)
    datamodule.setup("fit")
    assert mean_squared_error(module, datamodule.val_set) == pytest.approx(
        errors[best_epoch], rel=1e-4
    )

    # It learned: the test error is well below that of predicting the training mean (0
    # after standardisation), which scores the test targets' mean square.
    _, test_targets = datamodule.test_set.tensors
    predicting_the_mean = float((test_targets**2).mean())
    assert out["test/mse"] < 0.8 * predicting_the_mean, (
        f"test/mse {out['test/mse']}, expected below 0.8 x {predicting_the_mean:.4g}, the "
        "error of predicting the training mean: the model does not learn"
    )
