"""DataModule of the regression task: `data=<name>` picks the table."""

from __future__ import annotations

from typing import Any

from ddp_template.data import ShardedDataModule
from ddp_template.tasks.regression.sources import SOURCES


class RegressionDataModule(ShardedDataModule):
    sources = SOURCES

    def sizes(self) -> dict[str, Any]:
        return {"num_features": self.source.num_features}
