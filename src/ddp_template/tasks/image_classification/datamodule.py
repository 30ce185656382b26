"""DataModule of the image classification task: `data=<name>` picks the source."""

from __future__ import annotations

from typing import Any

from ddp_template.data import ShardedDataModule
from ddp_template.errors import ConfigError
from ddp_template.tasks.image_classification.sources import SOURCES


class ImageDataModule(ShardedDataModule):
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
        return self.source.in_channels

    @property
    def decoded_per_sample(self) -> bool:
        return self.source.decoded_per_sample

    def model_inputs(self) -> dict[str, Any]:
        # The model's stem follows the input size.
        return {**super().model_inputs(), "image_size": self.source.input_size}

    def describe_input(self) -> str:
        return self.source.describe_input()

    def prepare_data(self) -> None:
        prepare = getattr(self.source, "prepare", None)
        if prepare is not None:
            prepare()

    def setup(self, stage: str) -> None:
        if self.train_set is None:
            self.train_set, self.val_set, self.test_set = self.source.splits()
