"""The DataModule base every task builds on: it owns the samplers and DataLoader settings,
builds the data source that `conf/data/<name>.yaml` names, and holds the splitting helpers
tasks share.

Training shards come from a seeded `DistributedSampler` (Lightning calls `set_epoch` on it
each epoch, so the order changes between epochs and ranks never overlap). Its last shard is
padded with repeated samples so that every rank runs the same number of steps, which DDP's
per-step all-reduce needs. Evaluation shards are *not* padded: every sample is seen exactly
once, so metrics synchronised over ranks equal those of a single process.

Training loaders resume mid-epoch, at any world size and batch size, and seed each batch's
augmentation (resume/loader.py).
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Sized
from pathlib import Path
from typing import Any, cast

import lightning as L
import torch
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ddp_template.errors import ConfigError
from ddp_template.resume.loader import (
    ResumableDataLoader,
    ResumableDistributedSampler,
    SeededSamples,
    is_lone_sample_left,
)

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
                # Decided for each iteration's own share: a resumed epoch's differs.
                drop_lone_sample=cannot_train_on_one_sample(self._model),
            )
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
    from ddp_template.project import CONFIG_DIR

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
    `data.drop_last=true` would; the order changes every epoch, so it trains in others.
    The training sampler applies this to each iteration's share, a resumed epoch's too
    (`ResumableDistributedSampler.share`)."""
    return cannot_train_on_one_sample(model) and is_lone_sample_left(shard, batch_size)


def cannot_train_on_one_sample(model: torch.nn.Module | None) -> bool:
    """A model with BatchNorm (see `drops_lone_sample`)."""
    return model is not None and any(
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
