"""What a task measures, named one way everywhere: `<stage>/<name>` (`val/acc`, `test/mse`).

A task module declares the names it logs (`metrics = ("loss", "acc")`); its config declares
the one it is judged by (`task.monitor: val/acc`) and which way is better
(`task.monitor_mode: max`). Checkpointing, early stopping, the epoch lines, results.json,
the report and a sweep's objective read those two keys; nothing else in the core names a
metric. The best value of the monitored metric is recorded as `<monitor>_best`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ddp_template.errors import ConfigError

STAGES = ("train", "val", "test")
# Stages a checkpoint or an early stop can watch: test runs after training.
MONITORED_STAGES = ("train", "val")
MODES = ("min", "max")
# Optuna's words for the two directions.
DIRECTIONS = {"min": "minimize", "max": "maximize"}


def key(stage: str, name: str) -> str:
    return f"{stage}/{name}"


def best_key(monitor: str) -> str:
    """Where results.json keeps the best value the monitored metric reached during fit."""
    return f"{monitor}_best"


def name_of(metric: str) -> str:
    """`val/acc` -> `acc`."""
    return metric.split("/", 1)[-1]


def of_stages(metrics: Mapping[str, Any], stages: Iterable[str] = STAGES) -> dict[str, float]:
    """The task's metrics among everything Lightning logged (perf/, ddp/ ... left out)."""
    prefixes = tuple(f"{stage}/" for stage in stages)
    return {k: float(v) for k, v in metrics.items() if k.startswith(prefixes)}


def check_mode(mode: object) -> None:
    if mode not in MODES:
        raise ConfigError(
            "task.monitor_mode",
            mode,
            "min (lower is better, e.g. a loss or an error) or max (e.g. an accuracy)",
            "e.g. task.monitor_mode=max",
        )


def check_monitor(monitor: object, mode: object, logged: Iterable[str]) -> None:
    """The task config's monitor is a metric its module logs, and its mode is min or max."""
    check_mode(mode)
    watchable = [key(stage, name) for stage in MONITORED_STAGES for name in logged]
    if monitor not in watchable:
        raise ConfigError(
            "task.monitor",
            monitor,
            f"a metric the task's module logs: {', '.join(watchable)}",
            f"e.g. task.monitor={key('val', next(iter(logged), 'loss'))}, or log the metric "
            "in the module and add its name to the module's `metrics`",
        )


def direction(mode: str) -> str:
    """`${direction:${task.monitor_mode}}`: Optuna's `maximize`/`minimize` for max/min."""
    check_mode(mode)
    return DIRECTIONS[mode]
