"""LightningModule of the regression task."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torchmetrics import MeanSquaredError, R2Score

from ddp_template.module import TaskModule, build_model
from ddp_template.optim import OptimizerFactory, SchedulerFactory


class RegressionModule(TaskModule):
    """Mean-squared-error regression of one target. Metrics are torchmetrics objects: their
    states (sums of squares, counts) are summed over ranks at the end of an epoch, so they
    are exact under DDP."""

    metrics = ("mse", "r2")

    def __init__(
        self,
        model: dict[str, Any],
        num_features: int,
        optimizer: OptimizerFactory | None = None,
        scheduler: SchedulerFactory | None = None,
        scheduler_interval: str = "step",
    ) -> None:
        super().__init__(optimizer, scheduler, scheduler_interval)
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        # `model._target_` (conf/task/regression.yaml) builds the network: one output, the
        # predicted value.
        self.model = build_model(model, num_features=num_features, num_outputs=1)
        self.criterion = nn.MSELoss()
        # One pair per stage (keys name the stage: a key "train" would hide Module.train).
        self.stage_metrics = nn.ModuleDict(
            {
                f"{stage}_{name}": metric()
                for stage in ("train", "val", "test")
                for name, metric in (("mse", MeanSquaredError), ("r2", R2Score))
            }
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.model(features)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        features, targets = batch
        predictions = self(features)
        self._log_metrics("train", predictions.detach(), targets)
        return self.criterion(predictions, targets)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        features, targets = batch
        self._log_metrics("val", self(features), targets)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        features, targets = batch
        self._log_metrics("test", self(features), targets)

    def _log_metrics(self, stage: str, predictions: torch.Tensor, targets: torch.Tensor) -> None:
        mse, r2 = self.stage_metrics[f"{stage}_mse"], self.stage_metrics[f"{stage}_r2"]
        assert isinstance(mse, MeanSquaredError) and isinstance(r2, R2Score)
        mse.update(predictions, targets)
        r2.update(predictions.squeeze(1), targets.squeeze(1))
        self.log(f"{stage}/mse", mse, on_step=False, on_epoch=True, prog_bar=True)
        self.log(f"{stage}/r2", r2, on_step=False, on_epoch=True)
