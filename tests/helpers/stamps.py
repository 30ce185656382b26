"""Callbacks a test plants in a run to learn when something happened, by the wall clock
(the test and every lab node share this machine's clock)."""

from __future__ import annotations

import time
from pathlib import Path

import lightning as L


class StampFirstStep(L.Callback):
    """Rank 0 writes the time its first training batch starts to `path`."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == 0 and not self.path.exists():
            self.path.write_text(repr(time.time()))
