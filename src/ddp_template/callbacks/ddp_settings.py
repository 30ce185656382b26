"""The DDP settings the live model really uses, read back from the wrapper (not the config)."""

from __future__ import annotations

import lightning as L
from torch.nn.parallel import DistributedDataParallel

from ddp_template.comm_hooks import COMM_HOOKS, registered_hook


def read_ddp_settings(model: object) -> dict[str, float] | None:
    """Numbers read from a DistributedDataParallel wrapper; None for an unwrapped model."""
    if not isinstance(model, DistributedDataParallel):
        return None
    hook = registered_hook(model)
    return {
        "bucket_cap_mb": model.bucket_bytes_cap / 2**20,
        "gradient_as_bucket_view": float(model.gradient_as_bucket_view),
        "static_graph": float(model.static_graph),
        "find_unused_parameters": float(model.find_unused_parameters),
        # Metrics are numbers: the hook's position in COMM_HOOKS (results.json has its name).
        "comm_hook": float(COMM_HOOKS.index(hook.name) if hook else 0),
        # Gradient buckets this rank passed through the hook since training started.
        "comm_hook_calls": float(hook.calls if hook else 0),
    }


class DDPSettingsMonitor(L.Callback):
    """Logs `ddp/<setting>` at the end of each training epoch.

    Logged as metrics so they reach results.json whichever way the workers were started
    (including ddp_spawn, where only metrics travel back to the main process).
    """

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        settings = read_ddp_settings(trainer.strategy.model)
        if settings:
            pl_module.log_dict(
                {f"ddp/{key}": value for key, value in settings.items()},
                on_step=False,
                on_epoch=True,
                sync_dist=False,
            )
