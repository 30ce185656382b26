"""The training loader's saved position handed back on resume, at any world size.

Lightning restores a loader's position (`data.ResumableDataLoader.load_state_dict`) when it
sets the loader up, and counts the batches of the resumed epoch itself. Both need care:

- A scheduler sized by `trainer.estimated_stepping_batches` makes Lightning set the loader
  up before the checkpoint is read, and the position would be dropped: it is handed over
  here, when training starts, before the loader's first batch.
- At another world size or batch size, the batches left in the epoch are not the saved
  count's complement: 4 batches taken of 8 by 2 ranks leave 8 of 16 batches to 1 rank.
  Lightning ends an epoch when its count reaches the loader's length (and calls that batch
  the last one, which starts the epoch's validation), so its count is moved to the length
  minus the batches left: the epoch ends with its last sample, validation runs as usual.
- A schedule counted in steps (OneCycleLR, CosineAnnealingLR) continues as an uninterrupted
  run of this shape would from the resumed place, inside an epoch or at its end
  (`optim.fit_schedule_to_resumed_run`).
"""

from __future__ import annotations

from typing import cast

import lightning as L

from ddp_template.optim import fit_schedule_to_resumed_run
from ddp_template.resume.loader import ResumableDataLoader, ResumableDistributedSampler

_COUNTERS = ("ready", "started", "processed", "completed")


class LoaderPosition(L.Callback):
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        fit_loop = trainer.fit_loop
        fit_loop._load_combined_loader_states()
        loader = trainer.train_dataloader
        if not isinstance(loader, ResumableDataLoader) or not loader.continues_epoch:
            if trainer.ckpt_path is not None:
                # Resumed at an epoch's end: the next epoch starts with none of its batches done.
                fit_schedule_to_resumed_run(trainer, pl_module, trainer.current_epoch, 0)
            return
        progress = fit_loop.epoch_loop.batch_progress
        shift = len(loader) - loader.batches_left() - progress.current.ready
        # Lightning moves its counters on from these when the epoch continues.
        for tracker in (progress.current, progress.total):
            for counter in _COUNTERS:
                setattr(tracker, counter, getattr(tracker, counter) + shift)
        epoch = cast(ResumableDistributedSampler, loader.sampler).epoch
        fit_schedule_to_resumed_run(trainer, pl_module, epoch, progress.current.ready)
