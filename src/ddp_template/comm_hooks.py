"""Gradient compression for DDP's all-reduce: PyTorch's communication hooks, on every device.

Lightning registers DDP communication hooks only on CUDA and skips them silently elsewhere.
`CommHookDDPStrategy` registers the hook chosen by `strategy.comm_hook` whatever the device
(gloo on the CPU runs the fp16, bf16 and PowerSGD hooks too), through a wrapper that counts
its calls, so that a run can show the hook really ran (results.json: ddp.comm_hook_calls).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

# Names accepted by `strategy.comm_hook`; the position is the code logged as ddp/comm_hook.
COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")

_HOOK_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "fp16": default_hooks.fp16_compress_hook,
    "bf16": default_hooks.bf16_compress_hook,
    "powersgd": powerSGD_hook.powerSGD_hook,
}


class CountingHook:
    """Calls a DDP communication hook and counts the gradient buckets it was given.

    DDP checks a hook's signature: the parameters must be named `state` and `bucket`, and
    their annotations, when present, must be the real classes (so there are none here).

    `one_bucket_at_a_time` waits for each bucket's communication before handing it back.
    PyTorch's PowerSGD hooks wait for a second all-reduce inside a callback of the first;
    gloo runs those callbacks on its own worker threads (2), so with two buckets in flight
    both threads can end up waiting for an all-reduce that no thread is left to run: seen
    here as a hang in backward. One bucket at a time needs only two threads.
    """

    def __init__(self, name: str, one_bucket_at_a_time: bool = False) -> None:
        self.name = name
        self.hook = _HOOK_FUNCTIONS[name]
        self.one_bucket_at_a_time = one_bucket_at_a_time
        # DDP's logging data names the hook after __qualname__: the real hook's.
        self.__qualname__ = self.hook.__qualname__
        # DDP refuses a hook *named* bf16_compress_hook unless NCCL is available, although
        # gloo runs it; bf16 on CUDA is checked up front instead (checks.py).
        self.__name__ = f"counting_{self.hook.__name__}"
        self.calls = 0

    def __call__(self, state, bucket):
        self.calls += 1
        future = self.hook(state, bucket)
        if not self.one_bucket_at_a_time:
            return future
        done = torch.futures.Future()
        done.set_result(future.wait())
        return done


def hook_state(name: str, powersgd_rank: int, powersgd_start_iter: int) -> object | None:
    """The state a hook keeps between steps (after the process group exists)."""
    if name != "powersgd":
        return None
    return powerSGD_hook.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=powersgd_rank,
        start_powerSGD_iter=powersgd_start_iter,
    )


def needs_one_bucket_at_a_time(name: str, backend: str) -> bool:
    """PowerSGD on gloo (see CountingHook)."""
    return name == "powersgd" and backend == "gloo"


def registered_hook(model: DistributedDataParallel) -> CountingHook | None:
    """The counting hook registered on a live DDP wrapper, if any."""
    for hook, _state in getattr(model, "_comm_hooks", []):
        if isinstance(hook, CountingHook):
            return hook
    return None


class CommHookDDPStrategy(DDPStrategy):
    """Lightning's DDP strategy, plus `strategy.comm_hook` registered on any device."""

    def __init__(
        self,
        comm_hook: str = "none",
        powersgd_rank: int = 1,
        powersgd_start_iter: int = 2,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.comm_hook = comm_hook
        self.powersgd_rank = powersgd_rank
        self.powersgd_start_iter = powersgd_start_iter

    def _register_ddp_hooks(self) -> None:
        super()._register_ddp_hooks()
        if self.comm_hook == "none":
            return
        assert isinstance(self.model, DistributedDataParallel)
        state = hook_state(self.comm_hook, self.powersgd_rank, self.powersgd_start_iter)
        hook = CountingHook(
            self.comm_hook,
            one_bucket_at_a_time=needs_one_bucket_at_a_time(self.comm_hook, dist.get_backend()),
        )
        self.model.register_comm_hook(state, hook)
