"""DataModule of the tabular classification task: `data=<name>` picks the table."""

from __future__ import annotations

from ddp_template.data import ShardedDataModule
from ddp_template.tasks.regression.sources import SOURCES


class RegressionDataModule(ShardedDataModule):
    sources = SOURCES

    @property
    def num_classes(self) -> int:
        return self.source.num_classes

    @property
    def in_channels(self) -> int:
        """Input width of the model: the number of feature columns."""
        return self.source.num_features
