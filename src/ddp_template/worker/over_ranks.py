"""A figure every rank has (peak memory, data wait, step time), reported as its spread over
the ranks: a fixed number of keys whatever the world size, where one key per rank would give
a tracker thousands of series from a job of a thousand ranks, and results.json as many
entries."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

SPREAD = ("min", "median", "max", "min_rank", "max_rank")


def spread(name: str, values: list[float]) -> dict[str, float]:
    """A figure of every rank as five keys: its min, median and max over ranks, and the
    ranks that hold the min and the max (the lowest such rank)."""
    low = min(range(len(values)), key=values.__getitem__)
    high = max(range(len(values)), key=values.__getitem__)
    return {
        f"{name}/min": values[low],
        f"{name}/median": float(np.median(values)),
        f"{name}/max": values[high],
        f"{name}/min_rank": float(low),
        f"{name}/max_rank": float(high),
    }


def over_ranks(metrics: Mapping[str, Any], name: str) -> dict[str, float] | None:
    """What `spread` logged for `name`, read back from logged metrics (None: not logged)."""
    found: dict[str, float] = {}
    for key in SPREAD:
        value = metrics.get(f"{name}/{key}")
        if value is None:
            return None
        found[key] = int(value) if key.endswith("_rank") else float(value)
    return found
