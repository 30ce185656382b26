"""The DDP settings the live model really uses, read back from the wrapper (not the config)."""

from __future__ import annotations

import lightning as L
from torch.nn.parallel import DistributedDataParallel

from ddp_template.worker.comm_hooks import broadcast_buffer_bytes, registered_hook
from ddp_template.worker.gradient_ready import GradientReadyTimes


def read_ddp_settings(model: object) -> dict[str, float] | None:
    """Numbers read from a DistributedDataParallel wrapper; None for an unwrapped model."""
    if not isinstance(model, DistributedDataParallel):
        return None
    hook = registered_hook(model)
    return {
        "bucket_cap_mb": model.bucket_bytes_cap / 2**20,
        "gradient_as_bucket_view": float(model.gradient_as_bucket_view),
        # Named broadcast_buffers before torch 2.13.
        "forward_sync_buffers": float(
            getattr(model, "forward_sync_buffers", getattr(model, "broadcast_buffers", True))
        ),
        "static_graph": float(model.static_graph),
        "find_unused_parameters": float(model.find_unused_parameters),
        # Metrics are numbers: the hook's name is in the key (results.json: comm_hook).
        f"comm_hook/{hook.name if hook else 'none'}": 1.0,
        # Gradient buckets this rank passed through the hook since training started.
        "comm_hook_calls": float(hook.calls if hook else 0),
    }


class DDPSettingsMonitor(L.Callback):
    """Logs `ddp/<setting>` at the end of each training epoch.

    Logged as metrics so they reach results.json whichever way the workers were started
    (including ddp_spawn, where only metrics travel back to the main process).
    """

    def __init__(self) -> None:
        # The gradients' layout and DDP's compute timers, read while the wrapper exists
        # (Lightning unwraps the model when fit ends); results.json's `gradients`.
        self.gradients: dict[str, object] | None = None
        self._ready = GradientReadyTimes()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if isinstance(trainer.strategy.model, DistributedDataParallel):
            self._ready.attach(trainer.strategy.model.module)

    def on_before_backward(
        self, trainer: L.Trainer, pl_module: L.LightningModule, loss: object
    ) -> None:
        self._ready.backward_starts()

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._ready.backward_ends()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.gradients = gradient_layout(trainer.strategy.model)
        if self.gradients is not None:
            self.gradients["ready_fractions"] = self._ready.fractions()
        self._ready.detach()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        settings = read_ddp_settings(trainer.strategy.model)
        if settings:
            pl_module.log_dict(
                {f"ddp/{key}": value for key, value in settings.items()},
                on_step=False,
                on_epoch=True,
                sync_dist=False,
            )


def gradient_layout(model: object) -> dict[str, object] | None:
    """What the communication costs per step, from the live DDP wrapper: every gradient's
    shape in the order DDP buckets them (the reverse of `parameters()`), the buckets' sizes
    and the last sampled forward and backward compute times (DDP's own timers). This is
    what `python -m ddp_template.tools.scaling` predicts other node counts from."""
    if not isinstance(model, DistributedDataParallel):
        return None
    import torch

    trained = [p for p in model.module.parameters() if p.requires_grad]
    logged = model._get_ddp_logging_data()
    buckets = [int(b) for b in str(logged.get("bucket_sizes", "")).split(",") if b.strip()]
    return {
        "shapes": [list(p.shape) for p in reversed(trained)],
        "element_bytes": trained[0].element_size() if trained else 4,
        "total_bytes": sum(p.numel() * p.element_size() for p in trained),
        "bucket_bytes": buckets,
        # What DDP broadcasts from rank 0 at the start of each forward (forward_sync_buffers),
        # bytes per dtype: one broadcast of each (torch's broadcast_coalesced groups by type).
        "broadcast_buffer_bytes": broadcast_buffer_bytes(model),
        "forward_compute_s": logged.get("forward_compute_time", 0) / 1e9,
        "backward_compute_s": logged.get("backward_compute_time", 0) / 1e9,
        "torch_threads": torch.get_num_threads(),
        "backend": torch.distributed.get_backend(),
    }
