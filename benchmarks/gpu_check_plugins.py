"""What benchmarks/gpu_check.py adds to its training runs from the command line, with
benchmarks/ on PYTHONPATH: `+callbacks.<name>._target_=gpu_check_plugins.<Callback>` and
`task.module._target_=gpu_check_plugins.ItemInStepClassifier`. Each callback writes what it
saw into the job folder, where the check reads it."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

from ddp_template.tasks.image_classification.module import ImageClassificationModule

LOSS_SCALE_FILE = "loss_scale.json"
DISTRIBUTED_FILE = "distributed.json"


def _write(trainer: L.Trainer, name: str, record: dict) -> None:
    path = Path(trainer.default_root_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))


class LossScaleRecorder(L.Callback):
    """The loss scaler of mixed precision as training ended (fp16 on CUDA has one; bf16 and
    fp32 none): its scale, and the scale it started from."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.initial_scale = float(scaler.get_scale()) if scaler is not None else None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        _write(
            trainer,
            LOSS_SCALE_FILE,
            {
                "precision": str(trainer.precision),
                "scaler": type(scaler).__name__ if scaler is not None else None,
                "initial_scale": self.initial_scale,
                "final_scale": float(scaler.get_scale()) if scaler is not None else None,
                "optimizer_steps": trainer.global_step,
            },
        )


class DistributedProbe(L.Callback):
    """What the live run uses: process-group backend, world size, device, and how many
    SyncBatchNorm layers the model holds (sync_batchnorm=true converts every BatchNorm)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        initialized = dist.is_available() and dist.is_initialized()
        modules = list(pl_module.modules())
        _write(
            trainer,
            DISTRIBUTED_FILE,
            {
                "backend": dist.get_backend() if initialized else None,
                "world_size": trainer.world_size,
                "device": str(pl_module.device),
                "sync_batchnorm_layers": sum(
                    isinstance(m, torch.nn.SyncBatchNorm) for m in modules
                ),
                "batchnorm_layers": sum(
                    isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in modules
                ),
            },
        )


class ItemInStepClassifier(ImageClassificationModule):
    """The image classifier with a host sync planted in its training step: `.item()` on the
    loss makes the CPU wait for the GPU every step. debug=host_sync must name this line."""

    def training_step(self, batch, batch_idx: int):
        loss = super().training_step(batch, batch_idx)
        self.last_loss = loss.item()  # planted host sync
        return loss
