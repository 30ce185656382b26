"""One line per epoch on rank 0 unless a live progress bar shows it (log files, pipes,
clusters)."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from ddp_template import metrics as task_metrics
from ddp_template.callbacks.progress import draws_live_bar


class EpochSummary(L.Callback):
    """The training and validation values of the metrics the task logs (its module's
    `metrics`), then the best value of the monitored one so far, then the throughput."""

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero or draws_live_bar(trainer):
            return
        names = getattr(pl_module, "metrics", ())
        shown = [task_metrics.key(stage, name) for stage in ("train", "val") for name in names]
        metrics = trainer.callback_metrics
        parts = [f"{key} {float(metrics[key]):.4g}" for key in shown if key in metrics]
        best = _best_so_far(trainer)
        if best is not None:
            parts.append(best)
        if "perf/samples_per_sec" in metrics:
            parts.append(f"samples/s {float(metrics['perf/samples_per_sec']):.4g}")
        # max_epochs=-1 (no limit, e.g. a benchmark stopped by max_steps) shows no total.
        total = f"/{trainer.max_epochs}" if trainer.max_epochs and trainer.max_epochs > 0 else ""
        print(f"epoch {trainer.current_epoch + 1}{total}  " + "  ".join(parts), flush=True)


def _best_so_far(trainer: L.Trainer) -> str | None:
    """The checkpoint callback's best, this epoch's value included (it updates its own best
    after this callback has run)."""
    checkpoint = trainer.checkpoint_callback
    if not isinstance(checkpoint, ModelCheckpoint) or checkpoint.monitor is None:
        return None
    monitor = checkpoint.monitor
    if monitor not in trainer.callback_metrics:
        return None
    scores = [float(trainer.callback_metrics[monitor])]
    if checkpoint.best_model_score is not None:
        scores.append(float(checkpoint.best_model_score))
    best = min(scores) if checkpoint.mode == "min" else max(scores)
    return f"best {monitor} {best:.4g}"
