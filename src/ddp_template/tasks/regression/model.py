"""A multilayer perceptron predicting numbers from rows of numeric features.

Each hidden block is Linear -> norm -> ReLU -> Dropout. With batch norm, a batch's statistics
are those of the rank's own batch; `sync_batchnorm=true` (CUDA only) turns the layers into
SyncBatchNorm, which computes them over the global batch: with small per-device batches,
as tabular data often has, that is what keeps DDP training close to single-device training.
"""

from __future__ import annotations

import numbers

from torch import nn

from ddp_template.errors import ConfigError

NORM_LAYERS = {"batch": nn.BatchNorm1d, "layer": nn.LayerNorm, "none": nn.Identity}


def build_mlp(
    num_features: int,
    num_outputs: int,
    hidden: list[int] | tuple[int, ...] = (64, 64),
    norm: str = "batch",
    dropout: float = 0.0,
) -> nn.Sequential:
    """Hidden blocks of the given widths, then a linear layer to the predicted values."""
    if not all(_is_width(w) for w in hidden):
        raise ConfigError(
            "task.module.model.hidden", hidden, "a list of widths >= 1", "e.g. [64,64]"
        )
    if norm not in NORM_LAYERS:
        raise ConfigError(
            "task.module.model.norm", norm, f"one of {sorted(NORM_LAYERS)}", "e.g. norm=batch"
        )
    if not isinstance(dropout, numbers.Real) or not 0.0 <= dropout < 1.0:
        raise ConfigError(
            "task.module.model.dropout", dropout, "a probability in [0, 1)", "e.g. dropout=0.1"
        )
    layers: list[nn.Module] = []
    width = num_features
    for size in hidden:
        # A norm layer's own shift makes the linear layer's bias redundant.
        layers += [
            nn.Linear(width, size, bias=norm == "none"),
            NORM_LAYERS[norm](size),
            nn.ReLU(),
            nn.Dropout(dropout),
        ]
        width = size
    layers.append(nn.Linear(width, num_outputs))
    return nn.Sequential(*layers)


def _is_width(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 1
