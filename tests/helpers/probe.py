"""A callback the tests add with `+callbacks.probe._target_=probe.Probe`: it records, on every
rank, what the real samplers yield and a checksum of the final weights, so that tests can
compare ranks from the outside."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import torch


def _indices(loader) -> list[int]:
    return [int(i) for i in loader.sampler]


class Probe(L.Callback):
    def __init__(self) -> None:
        self.record: dict = {"train": {}, "val": [], "test": []}

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning has called sampler.set_epoch(epoch) by now.
        self.record["train"][str(trainer.current_epoch)] = _indices(trainer.train_dataloader)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.record["val"] = _indices(trainer.val_dataloaders)

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.record["test"] = _indices(trainer.test_dataloaders)

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.record["test_samples_seen"] = self.record.get("test_samples_seen", 0) + len(batch[1])

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        flat = torch.cat([p.detach().double().reshape(-1) for p in pl_module.parameters()])
        self.record["weights_sum"] = float(flat.sum())
        self.record["weights_abs_sum"] = float(flat.abs().sum())
        self.record["world_size"] = trainer.world_size

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        out = Path(trainer.default_root_dir) / "probe" / f"rank_{trainer.global_rank}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(self.record))


class BatchIndependent(L.Callback):
    """Keeps batch norm and dropout layers in eval mode while training: each sample's loss
    then depends on that sample alone, so 2 ranks of B samples and 1 process of 2B compute
    the same averaged gradient, whatever network a task has (Lightning sets train mode at
    every epoch and after validation; this runs before every step)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        for layer in pl_module.modules():
            if isinstance(layer, (torch.nn.modules.batchnorm._BatchNorm, torch.nn.Dropout)):
                layer.eval()


class FailOnRank(L.Callback):
    """Raises on one rank in the middle of training: a worker's own error."""

    def __init__(self, rank: int = 1, batch: int = 1) -> None:
        self.rank, self.batch = rank, batch

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and batch_idx == self.batch:
            raise ValueError(f"deliberate failure on rank {self.rank}")


class RandomDrawProbe(L.Callback):
    """Records on every rank what random numbers shaped the first training batch: a
    checksum of each augmented image, and the first numbers the generator that dropout
    draws from would give (read without advancing it)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step != 0:
            return
        images, _ = batch
        with torch.random.fork_rng(devices=[]):
            dropout_draw = torch.rand(4).tolist()
        record = {
            "image_sums": [float(image.double().sum()) for image in images],
            "dropout_draw": dropout_draw,
        }
        out = Path(trainer.default_root_dir) / "draws" / f"rank_{trainer.global_rank}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record))


class TrainedSamples(L.Callback):
    """Records on every rank which training samples each step trains, by their index in the
    training set: `<job>/trained/rank_<r>.jsonl`, a line per step, written as the step starts
    (a run that ends abruptly keeps the lines of the steps it trained).

    A sample is known by its content: the callback maps each row of the training set's
    features to its index, and needs rows that differ (a table without duplicates)."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        features = trainer.datamodule.train_set.tensors[0]
        self.ids = {row.numpy().tobytes(): i for i, row in enumerate(features)}
        assert len(self.ids) == len(features), "training rows repeat: ids would be ambiguous"
        self.out = Path(trainer.default_root_dir) / "trained" / f"rank_{trainer.global_rank}.jsonl"
        self.out.parent.mkdir(parents=True, exist_ok=True)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        features, _ = batch
        ids = [self.ids[row.cpu().numpy().tobytes()] for row in features]
        line = {"step": trainer.global_step, "world_size": trainer.world_size, "ids": ids}
        with self.out.open("a") as file:
            file.write(json.dumps(line) + "\n")


class LearningRates(L.Callback):
    """Rank 0 records, as each optimizer step starts, the learning rate it trains with and
    the scheduler's step count and length: `<job>/lr.jsonl`, a line per step."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not trainer.is_global_zero:
            return
        scheduler = trainer.lr_scheduler_configs[0].scheduler
        length = getattr(scheduler, "total_steps", getattr(scheduler, "T_max", None))
        line = {
            "step": trainer.global_step,
            "lr": trainer.optimizers[0].param_groups[0]["lr"],
            "scheduler_step": scheduler.last_epoch,
            "length": length,
        }
        with (Path(trainer.default_root_dir) / "lr.jsonl").open("a") as file:
            file.write(json.dumps(line) + "\n")


class SaveAtStep(L.Callback):
    """After optimizer step `step`, every rank saves `<job>/checkpoints/step.ckpt` together
    (as a preemption handler does) and training goes on: a mid-epoch checkpoint."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(Path(trainer.default_root_dir) / "checkpoints" / "step.ckpt")
