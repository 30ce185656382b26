"""One line per epoch on rank 0 unless a live progress bar shows it (log files, pipes,
clusters)."""

from __future__ import annotations

import lightning as L

from ddp_template.callbacks.progress import draws_live_bar


class EpochSummary(L.Callback):
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero or draws_live_bar(trainer):
            return
        shown = ("train/loss", "train/acc", "val/loss", "val/acc", "perf/samples_per_sec")
        metrics = trainer.callback_metrics
        parts = [f"{key} {float(metrics[key]):.4g}" for key in shown if key in metrics]
        # max_epochs=-1 (no limit, e.g. a benchmark stopped by max_steps) shows no total.
        total = f"/{trainer.max_epochs}" if trainer.max_epochs and trainer.max_epochs > 0 else ""
        print(f"epoch {trainer.current_epoch + 1}{total}  " + "  ".join(parts), flush=True)
