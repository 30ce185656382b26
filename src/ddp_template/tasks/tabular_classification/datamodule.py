"""DataModule of the tabular classification task: `data=<name>` picks the table."""

from __future__ import annotations

from typing import Any

from ddp_template.data import ShardedDataModule
from ddp_template.errors import ConfigError
from ddp_template.tasks.tabular_classification.sources import SOURCES


class TabularClassificationDataModule(ShardedDataModule):
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
        super().__init__(
            batch_size=batch_size,
            num_workers=num_workers,
            pin_memory=pin_memory,
            drop_last=drop_last,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            seed=seed,
        )
        if name not in SOURCES:
            raise ConfigError("data", name, f"one of {sorted(SOURCES)}", "pick one of those")
        try:
            self.source = SOURCES[name](**source_options)
        except TypeError as err:
            raise ConfigError(
                "data", name, f"options of {name} only ({err})", "remove the unknown data.<key>"
            ) from None

    @property
    def num_classes(self) -> int:
        return self.source.num_classes

    @property
    def in_channels(self) -> int:
        """Input width of the model: the number of feature columns."""
        return self.source.num_features

    def setup(self, stage: str) -> None:
        if self.train_set is None:
            self.train_set, self.val_set, self.test_set = self.source.splits()
