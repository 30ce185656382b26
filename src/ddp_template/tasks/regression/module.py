"""LightningModule of the tabular classification task."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from ddp_template.errors import ConfigError
from ddp_template.module import TaskModule
from ddp_template.optim import OptimizerFactory, SchedulerFactory
from ddp_template.tasks.regression.model import build_mlp


class RegressionModule(TaskModule):
    """Cross-entropy classifier. Metrics are torchmetrics objects: their states are summed
    over ranks at the end of an epoch, so they are exact under DDP."""

    metrics = ("loss", "acc")

    def __init__(
        self,
        model: dict[str, Any],
        num_classes: int,
        in_channels: int,
        optimizer: OptimizerFactory | None = None,
        scheduler: SchedulerFactory | None = None,
        scheduler_interval: str = "step",
    ) -> None:
        super().__init__(optimizer, scheduler, scheduler_interval)
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        # in_channels: the number of feature columns (the DataModule's name for input width).
        self.model = build_mlp(num_features=in_channels, num_classes=num_classes, **model)
        self.criterion = nn.CrossEntropyLoss()
        self.train_loss = MeanMetric()
        self.val_loss, self.test_loss = MeanMetric(), MeanMetric()
        self.train_acc = MulticlassAccuracy(num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes, average="micro")

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.model(features)

    def on_train_start(self) -> None:
        if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in self.model.modules()):
            _require_no_batch_of_one(self.trainer.train_dataloader)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        features, labels = batch
        logits = self(features)
        loss = self.criterion(logits, labels)
        self.train_loss.update(loss.detach(), weight=labels.numel())
        self.train_acc.update(logits.detach(), labels)
        self.log("train/loss", self.train_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_loss, self.val_acc)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_loss, self.test_acc)

    def _evaluate(self, batch, stage: str, loss_metric: MeanMetric, acc: MulticlassAccuracy):
        features, labels = batch
        logits = self(features)
        loss_metric.update(self.criterion(logits, labels), weight=labels.numel())
        acc.update(logits, labels)
        self.log(f"{stage}/loss", loss_metric, on_step=False, on_epoch=True, prog_bar=True)
        self.log(f"{stage}/acc", acc, on_step=False, on_epoch=True, prog_bar=True)


def _require_no_batch_of_one(loader: DataLoader) -> None:
    """Batch norm cannot normalise a training batch of one sample (torch raises "Expected
    more than 1 value per channel"); every rank has the same shard size, so all would fail."""
    if loader.drop_last or not loader.batch_size:
        return
    per_rank = len(loader.sampler)
    if per_rank % loader.batch_size == 1:
        raise ConfigError(
            "data.batch_size",
            loader.batch_size,
            f"a size that leaves no training batch of one sample: each rank trains on "
            f"{per_rank} samples, and batch norm needs two or more per batch",
            f"e.g. data.batch_size={loader.batch_size + 1}, or data.drop_last=true",
        )
