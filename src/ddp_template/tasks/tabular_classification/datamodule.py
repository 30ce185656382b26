"""DataModule of the tabular classification task: `data=<name>` picks the table (conf/data/<name>.yaml names its class in sources.py)."""

from __future__ import annotations

from typing import Any

from ddp_template.data import ShardedDataModule
from ddp_template.tasks.tabular_classification import sources


class TabularClassificationDataModule(ShardedDataModule):
    source_module = sources

    def sizes(self) -> dict[str, Any]:
        return {"num_classes": self.source.num_classes, "num_features": self.source.num_features}
