"""torchvision ResNets, with the stem adapted to the input size and any channel count."""

from __future__ import annotations

import torch
from torch import nn
from torchvision import models

from ddp_template.errors import ConfigError

NORM_LAYERS = {
    "batch": nn.BatchNorm2d,
    "group": lambda channels: nn.GroupNorm(min(32, channels // 4), channels),
    "none": nn.Identity,
}

# Largest input (px) that gets the small-image stem under `small_input: auto`. ImageNet's stem
# (7x7 conv stride 2, then a stride-2 max-pool) divides the side by 4 before the first stage:
# 64 px would reach it at 16x16 and leave 2x2 for the last stage. The small stem keeps the
# full size instead, so its first stage costs (side / 56)^2 that of ImageNet ResNet at 224 px:
# 0.33x at 32 px, 1.3x at 64 px, but 16x at 224 px.
SMALL_INPUT_MAX_PX = 64


def uses_small_stem(small_input: bool | str, image_size: int | None) -> bool:
    """`small_input`: true | false, or "auto": inputs up to 64 px get the small stem."""
    if isinstance(small_input, bool):
        return small_input
    if small_input != "auto":
        raise ConfigError(
            "task.module.model.small_input",
            small_input,
            f"auto (the small-image stem for inputs up to {SMALL_INPUT_MAX_PX} px), true or false",
            "task.module.model.small_input=auto",
        )
    return image_size is not None and image_size <= SMALL_INPUT_MAX_PX


def describe_stem(small_input: bool | str, image_size: int | None) -> str:
    """Which stem the model gets, and why (for the start-up report)."""
    small = uses_small_stem(small_input, image_size)
    stem = (
        "small-image stem (3x3 conv, stride 1, no max-pool)"
        if small
        else "ImageNet stem (7x7 conv, stride 2, max-pool)"
    )
    if isinstance(small_input, bool):
        return f"{stem}: task.module.model.small_input={str(small_input).lower()}"
    relation = "<=" if small else ">"
    return f"{stem}: {image_size} px inputs {relation} {SMALL_INPUT_MAX_PX} px (small_input=auto)"


def build_resnet(
    arch: str,
    num_classes: int,
    in_channels: int = 3,
    small_input: bool | str = "auto",
    image_size: int | None = None,
    norm: str = "batch",
    channels_last: bool = False,
    dropout: float = 0.0,
) -> nn.Module:
    """A ResNet-family model from torchvision (random weights), optionally channels-last.
    The stem follows `small_input`; under "auto" it follows `image_size`. Its `description`
    is the start-up report's model row."""
    resnets = [name for name in models.list_models(module=models) if "resnet" in name]
    if arch not in resnets:
        raise ConfigError("task.module.model.arch", arch, f"one of {resnets}", "e.g. resnet18")
    if norm not in NORM_LAYERS:
        raise ConfigError(
            "task.module.model.norm", norm, f"one of {sorted(NORM_LAYERS)}", "e.g. norm=batch"
        )
    if not isinstance(channels_last, bool):
        raise ConfigError(
            "task.module.model.channels_last", channels_last, "true or false", "channels_last=true"
        )
    model = models.get_model(
        arch, weights=None, num_classes=num_classes, norm_layer=NORM_LAYERS[norm]
    )
    if uses_small_stem(small_input, image_size):
        # 8x8 or 32x32 inputs: a 7x7/2 conv and a max-pool would shrink them to nothing.
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    if not 0.0 <= dropout < 1.0:
        raise ConfigError(
            "task.module.model.dropout", dropout, "a probability in [0, 1)", "e.g. dropout=0.2"
        )
    if dropout:
        model.fc = nn.Sequential(nn.Dropout(dropout), model.fc)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    model.description = f"{arch}, {describe_stem(small_input, image_size)}"
    return model
