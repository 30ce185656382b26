"""A network of the shapes of pytorch#162338: no parameter divides evenly over 2 ranks
(Linear(3, 5) among them), with a batch norm layer."""

from __future__ import annotations

from typing import Any

from torch import nn


def uneven_mlp(num_features: int, num_classes: int, **_: Any) -> nn.Sequential:
    """Keys of the task's own model node (hidden, norm, dropout) are not used."""
    return nn.Sequential(
        nn.Linear(num_features, 3),
        nn.Linear(3, 5),
        nn.BatchNorm1d(5),
        nn.ReLU(),
        nn.Linear(5, num_classes),
    )
