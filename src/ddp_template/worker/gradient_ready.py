"""When each gradient is ready in the backward: what decides when DDP can send a bucket.

The scaling model (`ddp_template.tools.scaling`) schedules each bucket's all-reduce from the
moment the backward has produced its last gradient. The bytes are not a clock: a ResNet's
last stage holds three quarters of its weights and, at a small image size, a small share of
the backward's work, so its gradients are ready early and their bucket goes on the wire
while most of the backward is still to run. This records, for each trained parameter, the
share of the backward's time elapsed when its gradient was accumulated (a
post-accumulate-grad hook per parameter: one clock read), the median over the first
steps (`SAMPLED_BACKWARDS`).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

# The first backward builds autograd's buffers and DDP's buckets: not a step's timing.
SKIPPED_BACKWARDS = 1
# Backwards timed after those; then the hooks come off, so a long training keeps neither
# a clock read per gradient nor a list that grows with its steps.
SAMPLED_BACKWARDS = 50


class GradientReadyTimes:
    """Per parameter, the share of each backward elapsed when its gradient was ready."""

    def __init__(self) -> None:
        self._parameters: list[Any] = []
        self._handles: list[Any] = []
        self._started: float | None = None
        self._ready_at: dict[int, float] = {}
        self._backwards = 0
        # One list per parameter (in `parameters()` order): its share in each backward.
        self._shares: list[list[float]] = []

    def attach(self, module: Any) -> None:
        self._parameters = [p for p in module.parameters() if p.requires_grad]
        self._shares = [[] for _ in self._parameters]
        for index, parameter in enumerate(self._parameters):
            self._handles.append(
                parameter.register_post_accumulate_grad_hook(self._recorder(index))
            )

    def _recorder(self, index: int) -> Any:
        def ready(_: Any) -> None:
            if self._started is not None:
                self._ready_at.setdefault(index, time.perf_counter())

        return ready

    def backward_starts(self) -> None:
        if self._handles:
            self._started = time.perf_counter()
            self._ready_at = {}

    def backward_ends(self) -> None:
        started, self._started = self._started, None
        if started is None:
            return
        self._backwards += 1
        span = time.perf_counter() - started
        if self._backwards <= SKIPPED_BACKWARDS or span <= 0:
            return
        for index, at in self._ready_at.items():
            self._shares[index].append(min(1.0, (at - started) / span))
        if self._backwards >= SKIPPED_BACKWARDS + SAMPLED_BACKWARDS:
            self.detach()

    def fractions(self) -> list[float] | None:
        """Each trained parameter's median share, in the order DDP buckets them (the
        reverse of `parameters()`, as results.json's `gradients.shapes`); None when some
        parameter was never timed (no step measured, or a gradient that never came)."""
        if not self._shares or any(not shares for shares in self._shares):
            return None
        return [round(statistics.median(shares), 4) for shares in reversed(self._shares)]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
