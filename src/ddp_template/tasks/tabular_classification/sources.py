"""Tabular data sets bundled with scikit-learn, each described by a small class: what it
holds and how to split it.

A source is cheap to construct (no data is read), so the config check can build it before
any worker starts and reject a bad option with a clear message. Features are standardised
with the mean and spread of the training split only: nothing of the validation or test rows
leaks into training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch.utils.data import Dataset, TensorDataset

from ddp_template.errors import ConfigError

Splits = tuple[Dataset, Dataset, Dataset]


def split_indices(
    size: int, val_fraction: float, test_fraction: float, seed: int
) -> tuple[list[int], list[int], list[int]]:
    """A fixed random split, the same on every rank (it depends on `seed` only)."""
    order = torch.randperm(size, generator=torch.Generator().manual_seed(seed)).tolist()
    n_test = round(size * test_fraction)
    n_val = round(size * val_fraction)
    return order[n_test + n_val :], order[n_test : n_test + n_val], order[:n_test]


def standardise(features: torch.Tensor, train: list[int]) -> torch.Tensor:
    """Zero mean and unit spread per column, measured on the training rows."""
    mean = features[train].mean(dim=0)
    spread = features[train].std(dim=0).clamp_min(1e-8)
    return (features - mean) / spread


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
        for key in ("val_fraction", "test_fraction"):
            value = getattr(self, key)
            if not 0.0 < value < 1.0:
                raise ConfigError(
                    f"data.{key}", value, "a fraction between 0 and 1", f"e.g. data.{key}=0.1"
                )
        if self.val_fraction + self.test_fraction >= 1.0:
            raise ConfigError(
                "data.test_fraction",
                self.test_fraction,
                f"with data.val_fraction={self.val_fraction}, a sum below 1 (rows must be "
                "left for training)",
                "e.g. data.val_fraction=0.1 data.test_fraction=0.2",
            )

    def splits(self) -> Splits:
        from sklearn import datasets

        table, labels = getattr(datasets, self.loader)(return_X_y=True)
        features = torch.tensor(table, dtype=torch.float32)
        targets = torch.tensor(labels, dtype=torch.long)
        train, val, test = split_indices(
            len(targets), self.val_fraction, self.test_fraction, self.split_seed
        )
        features = standardise(features, train)
        return tuple(TensorDataset(features[rows], targets[rows]) for rows in (train, val, test))


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


SOURCES = {"breast_cancer": BreastCancer, "wine": Wine}
