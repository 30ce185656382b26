"""A callback the tests add with `+callbacks.sync._target_=sync_probe.HostSyncProbe`: it
counts, on every rank, the calls of Lightning's per-step SIGTERM-flag broadcast during fit,
and the host-blocking collectives Python code starts inside training steps (from the start
of a batch to the end of its `on_train_batch_end` hooks), and writes them to
`<job>/sync_probe/rank_<N>.json` when fit ends."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import lightning as L
import torch.distributed as dist
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

# The collectives a per-step flag would use; DDP's gradient all-reduce runs in C++, unseen.
WATCHED = ("broadcast", "all_reduce", "barrier", "all_gather", "all_gather_object")


class HostSyncProbe(L.Callback):
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.steps = 0
        self._originals: dict[tuple[object, str], object] = {}
        self._training = False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        # On the class: an instance attribute set by the preemption callback shadows it,
        # and then Lightning's broadcast is never called.
        self._wrap(_TrainingEpochLoop, "_broadcast_sigterm_tensor", "sigterm_broadcast")
        for name in WATCHED:
            self._wrap(dist, name, name, blocking_only=True)

    def _wrap(self, owner: object, name: str, key: str, blocking_only: bool = False) -> None:
        original = getattr(owner, name)
        self._originals[(owner, name)] = original
        self.counts[key] = 0

        @functools.wraps(original)
        def counted(*args, **kwargs):
            if not blocking_only or (self._training and not kwargs.get("async_op")):
                self.counts[key] += 1
            return original(*args, **kwargs)

        setattr(owner, name, counted)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._training = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # Listed after the other callbacks: their on_train_batch_end hooks ran inside the step.
        self._training = False
        self.steps += 1

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._training = False
        for (owner, name), original in self._originals.items():
            setattr(owner, name, original)
        folder = Path(trainer.default_root_dir) / "sync_probe"
        folder.mkdir(parents=True, exist_ok=True)
        record = {"steps": self.steps, "world_size": trainer.world_size, **self.counts}
        (folder / f"rank_{trainer.global_rank}.json").write_text(json.dumps(record))
