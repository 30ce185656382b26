"""The DataModule base every task builds on: it owns the samplers and DataLoader settings,
picks the task's data source by its `data=` name, and holds the splitting helpers tasks share.

Training shards come from a seeded `DistributedSampler` (Lightning calls `set_epoch` on it
each epoch, so the order changes between epochs and ranks never overlap). Its last shard is
padded with repeated samples so that every rank runs the same number of steps, which DDP's
per-step all-reduce needs. Evaluation shards are *not* padded: every sample is seen exactly
once, so metrics synchronised over ranks equal those of a single process.
"""

from __future__ import annotations

import warnings
from collections.abc import Sized
from typing import Any, ClassVar

import lightning as L
import torch
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ddp_template.errors import ConfigError

Splits = tuple[Dataset, Dataset, Dataset]


class ShardedDataModule(L.LightningDataModule):
    """Subclasses name their data sets in `sources` (`data=` name -> a source class whose
    `splits()` returns train, validation and test sets) and say in `sizes()` what their
    module needs to know of the data; `setup()` fills the three splits.

    A source is cheap to construct (no data is read), so the config check builds the
    DataModule before any worker starts and rejects a bad name or option with a clear message.
    """

    sources: ClassVar[dict[str, Any]] = {}

    def __init__(
        self,
        name: str,
        batch_size: int,
        num_workers: int = 0,
        pin_memory: bool = False,
        drop_last: bool = False,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        seed: int = 0,
        **source_options: Any,
    ) -> None:
        super().__init__()
        self.source = self._build_source(name, source_options)
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

    def _build_source(self, name: str, options: dict[str, Any]) -> Any:
        if name not in self.sources:
            raise ConfigError("data", name, f"one of {sorted(self.sources)}", "pick one of those")
        try:
            return self.sources[name](**options)
        except TypeError as err:
            raise ConfigError(
                "data", name, f"options of {name} only ({err})", "remove the unknown data.<key>"
            ) from None

    def sizes(self) -> dict[str, Any]:
        """What the task's module must know of the data to be built (input width, number
        of classes, ...): passed to its constructor."""
        raise NotImplementedError(f"{type(self).__name__} must say how its module is sized")

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
