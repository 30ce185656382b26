"""LightningModule of the tabular classification task."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from ddp_template.module import TaskModule, build_model
from ddp_template.optim import OptimizerFactory, SchedulerFactory


class TabularClassificationModule(TaskModule):
    """Cross-entropy classifier. Metrics are torchmetrics objects: their states are summed
    over ranks at the end of an epoch, so they are exact under DDP."""

    metrics = ("loss", "acc")

    def __init__(
        self,
        model: dict[str, Any],
        num_classes: int,
        num_features: int,
        optimizer: OptimizerFactory | None = None,
        scheduler: SchedulerFactory | None = None,
        scheduler_interval: str = "step",
    ) -> None:
        super().__init__(optimizer, scheduler, scheduler_interval)
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        # `model._target_` (conf/task/tabular_classification.yaml) builds the network.
        self.model = build_model(model, num_features=num_features, num_classes=num_classes)
        self.criterion = nn.CrossEntropyLoss()
        self.train_loss = MeanMetric()
        self.val_loss, self.test_loss = MeanMetric(), MeanMetric()
        self.train_acc = MulticlassAccuracy(num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes, average="micro")

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.model(features)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        features, labels = batch
        logits = self(features)
        loss = self.criterion(logits, labels)
        # Called (not just updated): the batch's own value is what on_step logs.
        self.train_loss(loss.detach(), weight=labels.numel())
        self.train_acc(logits.detach(), labels)
        self.log("train/loss", self.train_loss, on_step=True, on_epoch=True, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=True, on_epoch=True)
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
