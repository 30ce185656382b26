"""When a template job reaches each point of its start-up, read on rank 0 by
`benchmarks/startup.py` (added to a run with `+callbacks.startup_clock._target_=...`).

The `benchmarks` folder must be on PYTHONPATH (the benchmark puts it there)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import lightning as L
from milestones import process_start_time


class StartupClock(L.Callback):
    """Writes rank 0's milestones to `path` when training ends:

    - `worker_created`: the rank's process came to be;
    - `ready`: the process group is up and the data set loaded (Lightning's `setup` hook);
    - `first_step_start`, `first_step_end`, `last_step_end`: training steps.
    """

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.times = {"worker_created": process_start_time()}

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.times.setdefault("ready", time.time())

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self.times.setdefault("first_step_start", time.time())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.times.setdefault("first_step_end", time.time())
        self.times["last_step_end"] = time.time()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            self.path.write_text(json.dumps(self.times))
