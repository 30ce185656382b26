"""Seeds and generator states: one home for how the run's random streams are derived and
how generator states are stored in checkpoints."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def derived_seed(seed: int, *keys: int) -> int:
    """A seed for one stream of random numbers, (seed, keys) -> 63 bits, well mixed (NumPy's
    SeedSequence): nearby keys give unrelated streams, unlike `seed + key`."""
    state = np.random.SeedSequence([seed, *keys]).generate_state(2, np.uint32)
    return int(state[0]) << 31 | int(state[1]) >> 1


def plain_numpy_state(numpy_state: tuple[Any, ...]) -> tuple[Any, ...]:
    """NumPy's generator state with its key array as a tensor, so that checkpoints holding it
    load with torch.load(weights_only=True)."""
    name, keys, position, has_gauss, gauss = numpy_state
    return name, torch.from_numpy(np.asarray(keys).astype(np.int64)), position, has_gauss, gauss


def numpy_state(plain: tuple[Any, ...]) -> tuple[Any, ...]:
    """The inverse of `plain_numpy_state`."""
    name, keys, position, has_gauss, gauss = plain
    return name, keys.numpy().astype(np.uint32), position, has_gauss, gauss
