"""torchvision ResNets, with the stem adapted to small images and any channel count."""

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


def build_resnet(
    arch: str,
    num_classes: int,
    in_channels: int = 3,
    small_input: bool = False,
    norm: str = "batch",
    channels_last: bool = False,
    dropout: float = 0.0,
) -> nn.Module:
    """A ResNet-family model from torchvision (random weights), optionally channels-last."""
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
    if small_input:
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
    return model
