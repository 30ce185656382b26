"""`+callbacks.slow_val._target_=stop_probe.SlowValidation`: validation batches during fit
take at least `batch_s` seconds, and `<job>/validating_<epoch>` is written when an epoch's
validation starts, so that a test can send a signal in the middle of it."""

from __future__ import annotations

import time
from pathlib import Path

import lightning as L


class SlowValidation(L.Callback):
    def __init__(self, batch_s: float = 1.0) -> None:
        self.batch_s = batch_s

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking and trainer.is_global_zero:
            marker = Path(trainer.default_root_dir) / f"validating_{trainer.current_epoch}"
            marker.write_text(str(time.time()))

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dl=0):
        if not trainer.sanity_checking:
            time.sleep(self.batch_s)


class SlowTest(L.Callback):
    """Test batches take at least `batch_s` seconds; `<job>/testing` is written when the
    test starts (rank 0), so that a test can send a signal in the middle of it."""

    def __init__(self, batch_s: float = 1.0) -> None:
        self.batch_s = batch_s

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            (Path(trainer.default_root_dir) / "testing").write_text(str(time.time()))

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dl=0):
        time.sleep(self.batch_s)
