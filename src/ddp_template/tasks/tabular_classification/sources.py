"""Tabular data sets bundled with scikit-learn, each described by a small class: what it
holds and how to split it.

A source is cheap to construct (no data is read), so the config check can build it before
any worker starts and reject a bad option with a clear message. Features are standardised
with the mean and spread of the training split only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch.utils.data import TensorDataset

from ddp_template.data import Splits, check_held_out, split_indices, standardise


@dataclass
class BundledTable:
    """A table of numeric features and class labels that ships with scikit-learn."""

    val_fraction: float = 0.1
    test_fraction: float = 0.2
    split_seed: int = 0

    # The loader's name in sklearn.datasets, and what it returns.
    loader: ClassVar[str]
    num_features: ClassVar[int]
    num_classes: ClassVar[int]

    def __post_init__(self) -> None:
        check_held_out(self.val_fraction, self.test_fraction)

    def splits(self) -> Splits:
        from sklearn import datasets

        table, labels = getattr(datasets, self.loader)(return_X_y=True)
        features = torch.tensor(table, dtype=torch.float32)
        targets = torch.tensor(labels, dtype=torch.long)
        train, val, test = split_indices(
            len(targets), self.val_fraction, self.test_fraction, self.split_seed
        )
        features = standardise(features, train)
        train_set, val_set, test_set = (
            TensorDataset(features[rows], targets[rows]) for rows in (train, val, test)
        )
        return train_set, val_set, test_set


@dataclass
class BreastCancer(BundledTable):
    """Wisconsin diagnostic breast cancer: 569 tumours, 30 measurements, malignant or benign."""

    loader: ClassVar[str] = "load_breast_cancer"
    num_features: ClassVar[int] = 30
    num_classes: ClassVar[int] = 2


@dataclass
class Wine(BundledTable):
    """Wines from three cultivars: 178 wines, 13 chemical measurements, 3 classes."""

    loader: ClassVar[str] = "load_wine"
    num_features: ClassVar[int] = 13
    num_classes: ClassVar[int] = 3
