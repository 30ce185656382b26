"""DataModule of the regression task: `data=<name>` picks the table (conf/data/<name>.yaml names its class in sources.py)."""

from __future__ import annotations

from typing import Any

from ddp_template.data import ShardedDataModule
from ddp_template.tasks.regression import sources


class RegressionDataModule(ShardedDataModule):
    source_module = sources

    def sizes(self) -> dict[str, Any]:
        return {"num_features": self.source.num_features}
