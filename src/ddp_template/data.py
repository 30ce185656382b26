"""The DataModule base every task builds on: it owns the samplers and DataLoader settings,
builds the data source that `conf/data/<name>.yaml` names, and holds the splitting helpers
tasks share.

Training shards come from a seeded `DistributedSampler` (Lightning calls `set_epoch` on it
each epoch, so the order changes between epochs and ranks never overlap). Its last shard is
padded with repeated samples so that every rank runs the same number of steps, which DDP's
per-step all-reduce needs. Evaluation shards are *not* padded: every sample is seen exactly
once, so metrics synchronised over ranks equal those of a single process.

Training loaders resume mid-epoch, at any world size and batch size: Lightning saves a
loader's `state_dict` (the place in the epoch's global sample order) in every checkpoint and
hands it back to `load_state_dict` on resume (see `ResumableDistributedSampler`).
Random augmentation draws from generators seeded per batch by the batch's place in the
epoch (see `SeededSamples`), never from the training process's own generators, so it is
the same with or without loader workers, and before and after a resume.
"""

from __future__ import annotations

import math
import random
import types
import warnings
from collections.abc import Iterator, Sized
from pathlib import Path
from typing import Any, cast

import lightning as L
import numpy as np
import torch
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ddp_template.errors import ConfigError
from ddp_template.worker.rng import derived_seed

Splits = tuple[Dataset, Dataset, Dataset]


class ShardedDataModule(L.LightningDataModule):
    """Subclasses name their task's sources module in `source_module` and say in `sizes()`
    what their module needs to know of the data; `setup()` fills the three splits.

    A data set is one file, `conf/data/<name>.yaml`: its `source` names a class of the task's
    sources module (whose `splits()` returns train, validation and test sets), and its other
    keys, loader settings aside, are that class's options. A task reads every data set whose
    source its module has; nothing else registers one.

    A source is cheap to construct (no data is read), so the config check builds the
    DataModule before any worker starts and rejects a bad name or option with a clear message.
    """

    # The task's sources.py: `data.source` names a class in it.
    source_module: types.ModuleType

    def __init__(
        self,
        name: str,
        batch_size: int,
        # None only where conf/data/<name>.yaml forgot it: refused with the fix.
        source: str | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        drop_last: bool = False,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        seed: int = 0,
        **source_options: Any,
    ) -> None:
        super().__init__()
        self.source = self._build_source(name, source, source_options)
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

    @property
    def decoded_per_sample(self) -> bool:
        """Samples decoded on the CPU one by one (image files, per-image transforms): loader
        workers pay off. Subclasses whose data sits in memory as tensors keep False; others
        override it (with a property, or a plain class attribute)."""
        return False

    def _build_source(self, name: str, source: str | None, options: dict[str, Any]) -> Any:
        if source is None:
            raise ConfigError(
                "data.source",
                None,
                f"the name of the class that reads data={name}, a class of the task's "
                f"{self.source_module.__name__} (conf/data/{name}.yaml names none)",
                f"add `source: <the class>` to conf/data/{name}.yaml (docs/data.md)",
            )
        source_class = getattr(self.source_module, source, None)
        if not (isinstance(source_class, type) and hasattr(source_class, "splits")):
            module = self.source_module.__name__
            readable = data_sets_of(self.source_module)
            raise ConfigError(
                "data",
                name,
                f"a data set this task reads: conf/data/{name}.yaml names `source: {source}`, "
                f"a class {module} does not have; the task reads the conf/data/ files whose "
                f"source is one of its classes: {', '.join(readable) or 'none'}",
                f"pick one of those, or add class {source} to "
                f"src/{module.replace('.', '/')}.py (docs/data.md)",
            )
        try:
            return source_class(**options)
        except TypeError as err:
            raise ConfigError(
                "data", name, f"options of {source} only ({err})", "remove the unknown data.<key>"
            ) from None

    def sizes(self) -> dict[str, Any]:
        """What the task's module must know of the data to be built (input width, number
        of classes, ...): passed to its constructor."""
        raise NotImplementedError(f"{type(self).__name__} must say how its module is sized")

    def split_sizes(self) -> tuple[int, int, int] | None:
        """Samples in the training, validation and test splits, counted before any worker
        starts (the checks need them): None where the data comes in `prepare` (a download)
        and may not be there yet, or a split has no length."""
        if hasattr(self.source, "prepare"):
            return None
        splits = self.source.splits()
        if not all(isinstance(split, Sized) for split in splits):
            return None
        train, val, test = (len(cast(Sized, split)) for split in splits)
        return train, val, test

    def prepare_data(self) -> None:
        prepare = getattr(self.source, "prepare", None)
        if prepare is not None:
            prepare()

    def setup(self, stage: str) -> None:
        if self.train_set is None:
            self.train_set, self.val_set, self.test_set = self.source.splits()

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
        drop_last = self.drop_last
        if train:
            # Seeded by (seed, epoch): the same order on resume, and the same global order
            # whatever the number of ranks.
            sampler: DistributedSampler = ResumableDistributedSampler(
                dataset,
                num_replicas=world_size,
                rank=rank,
                shuffle=True,
                seed=self.seed,
                drop_last=self.drop_last,
                batch_size=self.batch_size,
            )
            drop_last = drop_last or drops_lone_sample(len(sampler), self.batch_size, self._model)
        else:
            size = len(dataset) if isinstance(dataset, Sized) else world_size
            require_one_sample_per_rank(size, world_size)
            sampler = UnrepeatedDistributedSampler(
                dataset, num_replicas=world_size, rank=rank, shuffle=False
            )
        if not self.decoded_per_sample:
            # Tensors in memory load fastest in the training process: Lightning's advice to
            # add workers is wrong here (it stays on for decoded data, where it is right).
            warnings.filterwarnings("ignore", ".*does not have many workers.*")
        workers = self.num_workers > 0
        loader_class = ResumableDataLoader if train else DataLoader
        return loader_class(
            SeededSamples(dataset) if train else dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            drop_last=drop_last and train,
            prefetch_factor=self.prefetch_factor if workers else None,
            persistent_workers=self.persistent_workers and workers,
            # Its own generator: a loader draws a seed for its workers at every iteration,
            # which would otherwise shift the training process's random numbers (dropout).
            generator=torch.Generator().manual_seed(self.seed),
        )

    @property
    def _model(self) -> torch.nn.Module | None:
        return self.trainer.lightning_module if self.trainer is not None else None


def data_sets_of(module: types.ModuleType) -> list[str]:
    """The `data=` names whose conf/data/<name>.yaml names a class of `module` (a task's
    sources module) as its `source`."""
    from ddp_template.train import CONFIG_DIR

    classes = {name for name, value in vars(module).items() if isinstance(value, type)}
    return sorted(
        path.stem
        for path in sorted((Path(CONFIG_DIR) / "data").glob("*.yaml"))
        if _source_named(path) in classes
    )


def _source_named(data_config: Path) -> object:
    loaded = OmegaConf.load(data_config)
    return loaded.get("source") if isinstance(loaded, DictConfig) else None


def drops_lone_sample(shard: int, batch_size: int, model: torch.nn.Module | None) -> bool:
    """Whether a rank's last training batch is one sample that the model cannot train on:
    BatchNorm computes a batch's spread, which one sample does not have (it raises where
    the layer sees one value per channel). That sample is left out of the epoch, as
    `data.drop_last=true` would; the order changes every epoch, so it trains in others."""
    if model is None or shard % batch_size != 1 or shard == 1:
        return False
    return any(
        isinstance(layer, torch.nn.modules.batchnorm._BatchNorm) for layer in model.modules()
    )


def training_batches(shard: int, batch_size: int, drop_last: bool) -> int:
    """Batches of an epoch on one rank holding `shard` training samples."""
    return shard // batch_size if drop_last else -(-shard // batch_size)


def require_one_sample_per_rank(size: int, world_size: int, split: str = "an evaluation") -> None:
    """An evaluation split of `size` samples over `world_size` ranks."""
    # DDP syncs buffers on the first evaluation batch: a rank without any batch would hang.
    if size < world_size:
        raise ConfigError(
            "devices",
            world_size,
            f"{split} split has {size} samples, fewer than the {world_size} ranks: each rank "
            "needs one (a rank without an evaluation batch would hang the others)",
            f"use at most {size} ranks in all, or a larger {split.split()[-1]} split",
        )


def split_indices(
    size: int, val_fraction: float, test_fraction: float, seed: int
) -> tuple[list[int], list[int], list[int]]:
    """A fixed random split, the same on every rank (it depends on `seed` only)."""
    order = torch.randperm(size, generator=torch.Generator().manual_seed(seed)).tolist()
    n_test = round(size * test_fraction)
    n_val = round(size * val_fraction)
    return order[n_test + n_val :], order[n_test : n_test + n_val], order[:n_test]


def check_fraction(key: str, value: float) -> None:
    if not 0.0 < value < 1.0:
        raise ConfigError(
            f"data.{key}", value, "a fraction between 0 and 1", f"e.g. data.{key}=0.1"
        )


def check_held_out(val_fraction: float, test_fraction: float) -> None:
    """Both held-out fractions are fractions, and rows are left for training."""
    check_fraction("val_fraction", val_fraction)
    check_fraction("test_fraction", test_fraction)
    if val_fraction + test_fraction >= 1.0:
        raise ConfigError(
            "data.test_fraction",
            test_fraction,
            f"with data.val_fraction={val_fraction}, a sum below 1 (rows must be left for "
            "training)",
            "e.g. data.val_fraction=0.1 data.test_fraction=0.2",
        )


def standardise(features: torch.Tensor, train: list[int]) -> torch.Tensor:
    """Zero mean and unit spread per column, measured on the training rows only: nothing of
    the validation or test rows leaks into training."""
    mean = features[train].mean(dim=0)
    spread = features[train].std(dim=0).clamp_min(1e-8)
    return (features - mean) / spread


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
    """

    def __init__(self, *args: Any, batch_size: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batch_size = batch_size
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
        if self.drop_last:
            return rest // self.num_replicas
        return math.ceil(rest / self.num_replicas)

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
