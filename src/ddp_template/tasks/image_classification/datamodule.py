"""DataModule of the image classification task: `data=<name>` picks the source."""

from __future__ import annotations

from ddp_template.data import ShardedDataModule
from ddp_template.tasks.image_classification.sources import SOURCES


class ImageClassificationDataModule(ShardedDataModule):
    sources = SOURCES

    @property
    def num_classes(self) -> int:
        return self.source.num_classes

    @property
    def in_channels(self) -> int:
        return self.source.in_channels
