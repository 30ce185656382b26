"""The DataModule base every task builds on: it owns the samplers and DataLoader settings.

Training shards come from a seeded `DistributedSampler` (Lightning calls `set_epoch` on it
each epoch, so the order changes between epochs and ranks never overlap). Its last shard is
padded with repeated samples so that every rank runs the same number of steps, which DDP's
per-step all-reduce needs. Evaluation shards are *not* padded: every sample is seen exactly
once, so metrics synchronised over ranks equal those of a single process.
"""

from __future__ import annotations

import warnings
from collections.abc import Sized
from typing import Any

import lightning as L
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ddp_template.errors import ConfigError


class ShardedDataModule(L.LightningDataModule):
    """Subclasses fill `train_set`, `val_set` and `test_set` in `setup()`."""

    def __init__(
        self,
        batch_size: int,
        num_workers: int = 0,
        pin_memory: bool = False,
        drop_last: bool = False,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.drop_last = drop_last
        self.prefetch_factor = prefetch_factor
        self.persistent_workers = persistent_workers
        self.seed = seed
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None

    # Samples decoded on the CPU one by one (image files, per-image transforms): loader
    # workers pay off. Subclasses whose data sits in memory as tensors keep False.
    decoded_per_sample = False

    def model_inputs(self) -> dict[str, Any]:
        """What the task's LightningModule is sized by, passed to its constructor."""
        return {"num_classes": self.num_classes, "in_channels": self.in_channels}

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, train=False)

    def _replicas(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is None:
            return 1, 0
        return trainer.world_size, trainer.global_rank

    def _loader(self, dataset: Dataset | None, train: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__}.setup() did not create this split")
        world_size, rank = self._replicas()
        if train:
            # Seeded by (seed, epoch): the same order on resume, and the same global order
            # whatever the number of ranks.
            sampler = DistributedSampler(
                dataset,
                num_replicas=world_size,
                rank=rank,
                shuffle=True,
                seed=self.seed,
                drop_last=self.drop_last,
            )
        else:
            _require_one_sample_per_rank(dataset, world_size)
            sampler = UnrepeatedDistributedSampler(
                dataset, num_replicas=world_size, rank=rank, shuffle=False
            )
        if not self.decoded_per_sample:
            # Tensors in memory load fastest in the training process: Lightning's advice to
            # add workers is wrong here (it stays on for decoded data, where it is right).
            warnings.filterwarnings("ignore", ".*does not have many workers.*")
        workers = self.num_workers > 0
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            drop_last=self.drop_last and train,
            prefetch_factor=self.prefetch_factor if workers else None,
            persistent_workers=self.persistent_workers and workers,
        )


def _require_one_sample_per_rank(dataset: Dataset, world_size: int) -> None:
    # DDP syncs buffers on the first evaluation batch: a rank without any batch would hang.
    size = len(dataset) if isinstance(dataset, Sized) else world_size
    if size < world_size:
        raise ConfigError(
            "devices",
            world_size,
            f"an evaluation split has {size} samples, fewer than the {world_size} ranks",
            "use fewer devices or a larger validation/test split",
        )
