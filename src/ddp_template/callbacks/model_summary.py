"""Lightning's model summary, with the FLOPs of a real training batch.

Lightning counts the summary's FLOPs by running the module's `example_input_array`
forward, and prints `Total FLOPs: 0` for a module that sets none (the tasks here do not:
their input shape comes from the data). This summary waits for the first training batch
and shows the FLOPs of its forward and backward, counted on a meta copy of the model
(`flops.training_flops_per_sample`, the count behind `perf/flops_per_sample`), without
Lightning's per-layer FLOPs column (zeros for the same reason).
"""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.data import extract_batch_size

from ddp_template.worker.flops import training_flops_per_sample


def _not_the_skipped_default(record: logging.LogRecord) -> bool:
    # Lightning notes at every start that it adds no summary of its own beside this one.
    return "Skipping setting a default `ModelSummary`" not in record.getMessage()


logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_not_the_skipped_default)


class TrainingFlopsSummary(ModelSummary):
    """`trainer.enable_model_summary`: Lightning's table at the first training batch, its
    `Total FLOPs` being one batch's forward and backward (omitted where they cannot be
    counted)."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._printed = False

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._printed or not self._max_depth:
            return
        self._printed = True
        model = getattr(pl_module, "model", None)
        per_sample = (
            training_flops_per_sample(model, batch) if isinstance(model, torch.nn.Module) else None
        )
        summary = self._summary(trainer, pl_module)
        # Lightning's per-layer FLOPs come from the example forward too: all 0 here.
        columns = [column for column in summary._get_summary_data() if column[0] != "FLOPs"]
        if trainer.is_global_zero:
            self.summarize(
                columns,
                summary.total_parameters,
                summary.trainable_parameters,
                summary.model_size,
                summary.total_training_modes,
                total_flops=int(per_sample * extract_batch_size(batch)) if per_sample else 0,
                **self._summarize_kwargs,
            )
