"""Regression tables bundled with scikit-learn, each described by a small class: what it
holds and how to split it.

A source is cheap to construct (no data is read), so the config check can build it before
any worker starts and reject a bad option with a clear message. Features and targets are
standardised with the mean and spread of the training split only, so a mean squared error
reads in units of the target's variance: predicting the training mean scores about 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch.utils.data import TensorDataset

from ddp_template.data import Splits, check_held_out, split_indices, standardise


@dataclass
class BundledRegressionTable:
    """A table of numeric features and one numeric target that ships with scikit-learn."""

    val_fraction: float = 0.1
    test_fraction: float = 0.2
    split_seed: int = 0

    # The loader's name in sklearn.datasets, and the width of its feature rows.
    loader: ClassVar[str]
    num_features: ClassVar[int]

    def __post_init__(self) -> None:
        check_held_out(self.val_fraction, self.test_fraction)

    def splits(self) -> Splits:
        from sklearn import datasets

        table, values = getattr(datasets, self.loader)(return_X_y=True)
        features = torch.tensor(table, dtype=torch.float32)
        targets = torch.tensor(values, dtype=torch.float32).unsqueeze(1)
        train, val, test = split_indices(
            len(targets), self.val_fraction, self.test_fraction, self.split_seed
        )
        features = standardise(features, train)
        targets = standardise(targets, train)
        train_set, val_set, test_set = (
            TensorDataset(features[rows], targets[rows]) for rows in (train, val, test)
        )
        return train_set, val_set, test_set


@dataclass
class Diabetes(BundledRegressionTable):
    """Diabetes progression one year after baseline: 442 patients, 10 measurements."""

    loader: ClassVar[str] = "load_diabetes"
    num_features: ClassVar[int] = 10
