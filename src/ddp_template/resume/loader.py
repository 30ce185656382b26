"""Training loaders that resume mid-epoch, at any world size and batch size, and augment the
same with or without loader workers.

Lightning saves a loader's `state_dict` (the place in the epoch's global sample order) in
every checkpoint and hands it back to `load_state_dict` on resume (see
`ResumableDistributedSampler`). Random augmentation draws from generators seeded per batch
by the batch's place in the epoch (see `SeededSamples`), never from the training process's
own generators, so it is the same with or without loader workers, and before and after a
resume. `ShardedDataModule` (data.py) builds its training loaders from these.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from typing import Any, cast

import numpy as np
import torch
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ddp_template.worker.rng import derived_seed

Splits = tuple[Dataset, Dataset, Dataset]


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
    """`DistributedSampler` that seeds each batch's augmentation and can start mid-epoch,
    at any world size and batch size.

    An epoch has one global order of samples whatever the number of ranks (the permutation
    `DistributedSampler` draws from seed and epoch). An iteration starts at a position of
    that order (0, or where a checkpoint stood), takes the rest of it, pads or trims the rest
    to a multiple of the ranks as `DistributedSampler` does, and deals it out round robin:
    rank r takes the rest's positions r, r + ranks, r + 2 ranks, ... Each rank's batches
    being consecutive pieces of its share, the batches all ranks have taken cover a prefix
    of the global order, whose length (`position_after`) is where a resume continues, with
    any number of ranks or any batch size. At the same world size and batch size this is
    exactly `DistributedSampler`'s order, padding included.

    Every index carries a seed drawn from (seed, epoch, global position of the batch's first
    sample): batches differ across ranks and epochs, and a batch is augmented the same way
    whichever worker loads it, and after a resume at the same world size.

    `drop_lone_sample`: a share that would end in a batch of one sample (which BatchNorm
    cannot train on, `data.drops_lone_sample`) leaves its last sample out, the share of this
    iteration: a resumed epoch's share differs from a whole epoch's.
    """

    def __init__(
        self, *args: Any, batch_size: int = 1, drop_lone_sample: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.batch_size = batch_size
        self.drop_lone_sample = drop_lone_sample
        # Where the current iteration started in the epoch's global order.
        self.start = 0
        self._resume: tuple[int, int] | None = None

    def resume_at(self, epoch: int, position: int) -> None:
        """The next iteration over `epoch` starts at `position` of the epoch's global order
        (the samples all ranks together had taken)."""
        self._resume = (epoch, min(position, self._size()))

    @property
    def resuming(self) -> bool:
        """The next iteration continues a saved epoch instead of starting one."""
        return self._resume is not None and self._resume[0] == self.epoch

    def next_start(self) -> int:
        return self._resume[1] if self._resume is not None and self.resuming else 0

    def share(self, start: int) -> int:
        """Samples of each rank in an iteration that starts at `start` (equal on all ranks)."""
        rest = self._size() - start
        share = rest // self.num_replicas if self.drop_last else math.ceil(rest / self.num_replicas)
        if self.drop_lone_sample and is_lone_sample_left(share, self.batch_size):
            # Each rank's last sample: the rest's last `num_replicas` positions.
            return share - 1
        return share

    def __len__(self) -> int:
        """Samples of each rank in a whole epoch."""
        return self.share(0)

    def position_after(self, batches: int) -> int:
        """The global position once every rank has taken `batches` batches of the current
        iteration (the repeats that pad the end are not positions of the order)."""
        return min(self.start + self.samples_in(batches), self._size())

    def samples_in(self, batches: int) -> int:
        """Samples, all ranks together, in the current iteration's first `batches` batches."""
        return min(batches * self.batch_size, self.share(self.start)) * self.num_replicas

    def __iter__(self) -> Iterator[SeededIndex]:
        self.start = self.next_start()
        self._resume = None
        order = self._epoch_order()
        total = self.share(self.start) * self.num_replicas
        rest = order[self.start :][:total]
        if total > len(rest):
            # Padded with the order's first samples, as DistributedSampler pads: the same
            # repeats as an uninterrupted run at this world size.
            rest += (order * math.ceil(total / len(order)))[: total - len(rest)]
        seed = 0
        for position, index in enumerate(rest[self.rank :: self.num_replicas]):
            if position % self.batch_size == 0:
                first = self.start + position * self.num_replicas + self.rank
                seed = derived_seed(self.seed, self.epoch, first)
            yield SeededIndex(index, seed)

    def _epoch_order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self._size()))
        # DistributedSampler's own permutation: it depends on seed and epoch only.
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self._size(), generator=generator).tolist()

    def _size(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]  # sized, as DistributedSampler needs


def is_lone_sample_left(share: int, batch_size: int) -> bool:
    """A share of `share` samples in batches of `batch_size` ends in a batch of one (a
    share of one sample is its only batch, and kept)."""
    return share % batch_size == 1 and share > 1


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
    """A DataLoader that Lightning can stop and resume mid-epoch, at any world size.

    `state_dict` holds the epoch, the global position in the epoch's sample order that the
    batches taken by the training loop cover (counted where they are handed over, not where
    workers prefetch them), and the world size and batch size it was taken at. After
    `load_state_dict`, the next iteration over that epoch continues at that position, shared
    among this run's ranks: every sample of the epoch is trained once, whatever the number
    of ranks now. `samples_trained` counts the samples this process's training loop took.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._batches_taken = 0
        # The epoch of the current iteration (None: none started).
        self._iteration_epoch: int | None = None
        # Samples of this process's iterations before the current one.
        self._samples_before = 0

    # torch types it as returning DataLoader's own iterator class; this one returns a
    # generator over that iterator on purpose, to count the batches handed over.
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        # Started on the first batch, when Lightning has set the epoch: workers would
        # otherwise read the sampler before it.
        return self._batches()

    def _batches(self) -> Iterator[Any]:
        self._samples_before = self.samples_trained
        self._batches_taken = 0
        self._iteration_epoch = getattr(self.sampler, "epoch", None)
        for batch in super().__iter__():
            self._batches_taken += 1
            yield batch

    @property
    def _resumable(self) -> ResumableDistributedSampler | None:
        sampler = self.sampler
        if isinstance(sampler, ResumableDistributedSampler) and self.batch_size is not None:
            return sampler
        return None

    @property
    def samples_trained(self) -> int:
        """Samples handed to training steps by this process's loader so far, all ranks
        together (padding repeats included)."""
        sampler = self._resumable
        current = sampler.samples_in(self._batches_taken) if sampler else 0
        return self._samples_before + current

    @property
    def continues_epoch(self) -> bool:
        """The next iteration continues an epoch from a checkpoint's position."""
        sampler = self._resumable
        return sampler is not None and sampler.resuming

    def batches_left(self) -> int:
        """Batches of the next iteration (fewer than `len` when it continues an epoch)."""
        sampler = self._resumable
        if sampler is None:
            return len(self)
        share = sampler.share(sampler.next_start())
        batch_size = cast(int, self.batch_size)
        return share // batch_size if self.drop_last else math.ceil(share / batch_size)

    def state_dict(self) -> dict[str, int]:
        sampler = self._resumable
        if sampler is None:
            return {}
        if sampler.resuming:
            position = sampler.next_start()
        elif self._iteration_epoch == sampler.epoch:
            position = sampler.position_after(self._batches_taken)
        else:
            # The epoch is set and its iteration not started yet.
            position = 0
        return {
            "epoch": sampler.epoch,
            "position": position,
            "world_size": sampler.num_replicas,
            "batch_size": cast(int, self.batch_size),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        sampler = self._resumable
        if sampler is None or not state:
            return
        sampler.set_epoch(state["epoch"])
        sampler.resume_at(state["epoch"], state["position"])
        self._batches_taken = 0
        self._iteration_epoch = None
