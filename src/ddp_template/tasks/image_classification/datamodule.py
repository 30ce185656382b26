"""DataModule of the image classification task: `data=<name>` picks the source (conf/data/<name>.yaml names its class in sources.py)."""

from __future__ import annotations

from typing import Any

from ddp_template.data import ShardedDataModule
from ddp_template.tasks.image_classification import sources


class ImageClassificationDataModule(ShardedDataModule):
    source_module = sources

    @property
    def decoded_per_sample(self) -> bool:
        return self.source.decoded_per_sample

    def sizes(self) -> dict[str, Any]:
        # The model's stem follows the input size.
        return {
            "num_classes": self.source.num_classes,
            "in_channels": self.source.in_channels,
            "image_size": self.source.input_size,
        }

    def describe_input(self) -> str:
        return self.source.describe_input()
