"""The DataModule base every task builds on: it owns the samplers and DataLoader settings.

Training shards come from a seeded `DistributedSampler` (Lightning calls `set_epoch` on it
each epoch, so the order changes between epochs and ranks never overlap). Its last shard is
padded with repeated samples so that every rank runs the same number of steps, which DDP's
per-step all-reduce needs. Evaluation shards are *not* padded: every sample is seen exactly
once, so metrics synchronised over ranks equal those of a single process.

Training loaders resume mid-epoch: Lightning saves a loader's `state_dict` in every
checkpoint and hands it back to `load_state_dict` on resume (see `ResumableDataLoader`).
Random augmentation draws from generators seeded per batch by the batch's place in the
epoch (see `SeededSamples`), never from the training process's own generators, so it is
the same with or without loader workers, and before and after a resume.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sized
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ddp_template.errors import ConfigError
from ddp_template.rng import derived_seed


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
            sampler = ResumableDistributedSampler(
                dataset,
                num_replicas=world_size,
                rank=rank,
                shuffle=True,
                seed=self.seed,
                drop_last=self.drop_last,
                batch_size=self.batch_size,
            )
        else:
            _require_one_sample_per_rank(dataset, world_size)
            sampler = UnrepeatedDistributedSampler(
                dataset, num_replicas=world_size, rank=rank, shuffle=False
            )
        workers = self.num_workers > 0
        loader_class = ResumableDataLoader if train else DataLoader
        return loader_class(
            SeededSamples(dataset) if train else dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            drop_last=self.drop_last and train,
            prefetch_factor=self.prefetch_factor if workers else None,
            persistent_workers=self.persistent_workers and workers,
            # Its own generator: a loader draws a seed for its workers at every iteration,
            # which would otherwise shift the training process's random numbers (dropout).
            generator=torch.Generator().manual_seed(self.seed),
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


class SeededIndex(int):
    """A sample index that carries the seed of the batch it belongs to (an int everywhere
    else, so any data set and any code that reads the sampler take it as it is)."""

    seed: int

    def __new__(cls, index: int, seed: int) -> SeededIndex:
        value = super().__new__(cls, index)
        value.seed = seed
        return value

    def __getnewargs__(self) -> tuple[int, int]:  # type: ignore[override]
        # Sent to loader workers: keep the seed.
        return int(self), self.seed


class ResumableDistributedSampler(DistributedSampler):
    """`DistributedSampler` that seeds each batch's augmentation and can start mid-epoch.

    Every index carries a seed drawn from (seed, epoch, position of the batch's first
    sample in the epoch's global order): batches differ across ranks and epochs, and a batch
    is augmented the same way whichever worker loads it, and after a resume.
    """

    def __init__(self, *args: Any, batch_size: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batch_size = batch_size
        self._resume: tuple[int, int] | None = None

    def resume_at(self, epoch: int, samples: int) -> None:
        """The next iteration over `epoch` skips this rank's first `samples` samples."""
        self._resume = (epoch, samples)

    def __iter__(self) -> Iterator[SeededIndex]:
        indices = list(super().__iter__())
        skip = 0
        if self._resume is not None and self._resume[0] == self.epoch:
            skip = self._resume[1]
        self._resume = None
        seed = 0
        for position, index in enumerate(indices[skip:], start=skip):
            if position % self.batch_size == 0:
                # This rank's samples are at global positions rank, rank + replicas, ...
                first = position - position % self.batch_size
                seed = derived_seed(self.seed, self.epoch, first * self.num_replicas + self.rank)
            yield SeededIndex(index, seed)


class SeededSamples(Dataset):
    """Loads samples under the seed their batch carries, on generators of their own.

    torch's, NumPy's and Python's generators are set to the batch seed for the batch and
    restored afterwards, so the training process's random numbers (dropout) are untouched.
    Indices without a seed (e.g. Lightning's overfit sampler) load as usual.
    """

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[Any]:
        seed = getattr(indices[0], "seed", None) if indices else None
        if seed is None:
            return [self.dataset[index] for index in indices]
        outer = _collect_rng_states(include_cuda=False)
        try:
            random.seed(seed)
            np.random.seed(seed % 2**32)
            # The CPU generator only: torch.manual_seed would reseed the GPUs' (dropout) too.
            torch.random.default_generator.manual_seed(seed)
            return [self.dataset[int(index)] for index in indices]
        finally:
            _set_rng_states(outer)


class ResumableDataLoader(DataLoader):
    """A DataLoader that Lightning can stop and resume mid-epoch.

    `state_dict` holds the epoch and the number of batches the training loop has taken from
    the current iteration (counted where they are handed over, not where workers prefetch
    them). After `load_state_dict`, the next iteration over that epoch starts after those
    batches: the sampler skips their samples, nothing is loaded twice.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._batches_taken = 0

    def __iter__(self) -> Iterator[Any]:
        # Started on the first batch, when Lightning has set the epoch: workers would
        # otherwise read the sampler before it.
        return self._batches()

    def _batches(self) -> Iterator[Any]:
        sampler = self.sampler
        resume = getattr(sampler, "_resume", None)
        resuming = resume is not None and resume[0] == getattr(sampler, "epoch", None)
        self._batches_taken = resume[1] // self.batch_size if resuming else 0
        for batch in super().__iter__():
            self._batches_taken += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": getattr(self.sampler, "epoch", 0), "batches": self._batches_taken}

    def load_state_dict(self, state: dict[str, int]) -> None:
        sampler = self.sampler
        if not isinstance(sampler, ResumableDistributedSampler) or self.batch_size is None:
            return
        sampler.set_epoch(state["epoch"])
        sampler.resume_at(state["epoch"], state["batches"] * self.batch_size)
