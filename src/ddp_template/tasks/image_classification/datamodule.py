"""DataModule of the image classification task: `data=<name>` picks the source."""

from __future__ import annotations

from typing import Any

from ddp_template.data import ShardedDataModule
from ddp_template.tasks.image_classification.sources import SOURCES


class ImageClassificationDataModule(ShardedDataModule):
    sources = SOURCES

    def sizes(self) -> dict[str, Any]:
        return {"num_classes": self.source.num_classes, "in_channels": self.source.in_channels}
