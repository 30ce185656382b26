"""Gradient compression for DDP's all-reduce: PyTorch's communication hooks, on every device.

Lightning registers DDP communication hooks only on CUDA and skips them silently elsewhere.
`CommHookDDPStrategy` registers the hook chosen by `strategy.comm_hook` whatever the device
(gloo on the CPU runs the fp16, bf16 and PowerSGD hooks too), through a wrapper that counts
its calls, so that a run can show the hook really ran (results.json: ddp.comm_hook_calls).

PowerSGD keeps state between steps (each rank's compression error, the low-rank factors it
starts the next step from, a step counter), held per gradient bucket; a checkpoint keeps the
errors' mean over ranks (`mean_error_feedback`, resume/state.py says why). DDP forms its buckets
anew in every process (one bucket on the first step, then buckets in the order gradients
arrived), so `hook_state_dict` saves that state per parameter and the hook rebuilds it for
whatever buckets the resumed process forms: a resume continues the same computation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from ddp_template.errors import ConfigError
from ddp_template.worker.rng import numpy_state, plain_numpy_state


@dataclass(frozen=True)
class CommHook:
    """One value of `strategy.comm_hook`: everything the project knows of a hook.

    Read by the strategy (what to register, with what state), the config's allowed names,
    the logged settings, and the scaling model and dry run (what goes on the wire; the
    scaling model times the hook itself, registered as the worker registers it). Adding a
    hook is one entry here (docs/launching.md, "Adding a comm hook").
    """

    name: str
    # PyTorch's hook (state, bucket) -> Future; None: DDP's own all-reduce, no hook.
    function: Callable[..., Any] | None
    # The element type of what it sends, and the all-reduces per bucket.
    wire_dtype: str
    all_reduces: int
    # Bytes it puts on the wire for one gradient: (shape, element bytes, PowerSGD's rank).
    sent_bytes: Callable[[list[int], int, int], float]
    # The state it keeps between steps: (PowerSGD's rank, start step) -> state, or None.
    make_state: Callable[[int, int], object | None] | None = None
    # How far the gradients it sends depart from the exact ones: 0 exact, 1 rounded to half
    # width, 2 a low-rank approximation. The scaling model recommends a less exact hook only
    # when it is predicted clearly faster (tools/scaling.py, `recommend`).
    approximation: int = 0


def _full_width(shape: list[int], element_bytes: int, rank: int) -> float:
    return math.prod(shape) * element_bytes


def _half_width(shape: list[int], element_bytes: int, rank: int) -> float:
    return math.prod(shape) * 2


def _low_rank(shape: list[int], element_bytes: int, rank: int) -> float:
    """PowerSGD sends P (n x r) and Q (m x r) of a matrix; vectors go uncompressed."""
    count = math.prod(shape)
    if len(shape) < 2:
        return count * element_bytes
    n, m = shape[0], count // shape[0]
    r = min(rank, n, m)
    return min(count, (n + m) * r) * element_bytes


def _powersgd_state(rank: int, start_iter: int) -> powerSGD_hook.PowerSGDState:
    return powerSGD_hook.PowerSGDState(
        process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=start_iter
    )


COMM_HOOKS: dict[str, CommHook] = {
    hook.name: hook
    for hook in (
        CommHook("none", None, "float32", 1, _full_width),
        CommHook(
            "fp16",
            default_hooks.fp16_compress_hook,
            "float16",
            1,
            _half_width,
            approximation=1,
        ),
        CommHook(
            "bf16",
            default_hooks.bf16_compress_hook,
            "bfloat16",
            1,
            _half_width,
            approximation=1,
        ),
        CommHook(
            "powersgd",
            powerSGD_hook.powerSGD_hook,
            "float32",
            # One after another: the vectors sent whole, then P, then Q (powerSGD_hook
            # chains each on the one before).
            3,
            _low_rank,
            _powersgd_state,
            approximation=2,
        ),
    )
}


def comm_hook(name: str) -> CommHook:
    """The entry of a hook named in `strategy.comm_hook` (the config check lists the names)."""
    return COMM_HOOKS[name]


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
        function = comm_hook(name).function
        assert function is not None, f"{name} registers no hook"
        self.hook = function
        self.one_bucket_at_a_time = one_bucket_at_a_time
        # DDP's logging data names the hook after __qualname__: the real hook's.
        self.__qualname__ = self.hook.__qualname__
        # DDP refuses a hook *named* bf16_compress_hook unless NCCL is available, although
        # gloo runs it; bf16 on CUDA is checked up front instead (checks.py).
        self.__name__ = f"counting_{self.hook.__name__}"
        self.calls = 0
        self.by_parameter: PowerSGDByParameter | None = None

    def __call__(self, state, bucket):
        self.calls += 1
        if self.by_parameter is not None:
            self.by_parameter.prepare(state, bucket)
        future = self.hook(state, bucket)
        if not self.one_bucket_at_a_time:
            return future
        done = torch.futures.Future()
        done.set_result(future.wait())
        return done


def broadcast_buffer_bytes(model: DistributedDataParallel) -> dict[str, int]:
    """Bytes of the buffers DDP sends at each forward, per dtype; empty when it sends none
    (forward_sync_buffers=false, or a model without buffers)."""
    if not model.will_sync_module_buffers():
        return {}
    sizes: dict[str, int] = {}
    for buffer in model.modules_buffers:
        name = str(buffer.dtype).removeprefix("torch.")
        sizes[name] = sizes.get(name, 0) + buffer.numel() * buffer.element_size()
    return sizes


def hook_state(name: str, powersgd_rank: int, powersgd_start_iter: int) -> object | None:
    """The state a hook keeps between steps (after the process group exists)."""
    make_state = comm_hook(name).make_state
    return make_state(powersgd_rank, powersgd_start_iter) if make_state else None


def needs_one_bucket_at_a_time(name: str, backend: str) -> bool:
    """PowerSGD on gloo (see CountingHook)."""
    return name == "powersgd" and backend == "gloo"


def registered_hook(model: DistributedDataParallel) -> CountingHook | None:
    """The counting hook registered on a live DDP wrapper, if any."""
    return _registered(model)[0]


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
        if comm_hook(self.comm_hook).function is None:
            return
        if self.comm_hook == "bf16" and self.root_device.type == "cuda":
            check_bf16_support(self.root_device)
        assert isinstance(self.model, DistributedDataParallel)
        state = hook_state(self.comm_hook, self.powersgd_rank, self.powersgd_start_iter)
        hook = CountingHook(
            self.comm_hook,
            one_bucket_at_a_time=needs_one_bucket_at_a_time(self.comm_hook, dist.get_backend()),
        )
        if isinstance(state, powerSGD_hook.PowerSGDState):
            hook.by_parameter = PowerSGDByParameter(self.model.module)
        self.model.register_comm_hook(state, hook)


def check_bf16_support(device: torch.device) -> None:
    """In the worker, on its own GPU (the launching process asks NVML where it can)."""
    from ddp_template.errors import TrainingStopped

    capability = torch.cuda.get_device_capability(device)
    if capability[0] < 8:
        raise TrainingStopped(str(bf16_refused(capability)))


def hook_state_dict(model: torch.nn.Module | None) -> dict[str, Any] | None:
    """This rank's communication hook state, independent of DDP's buckets (None: stateless)."""
    hook, state = _registered(model)
    if hook is None or hook.by_parameter is None:
        return None
    return hook.by_parameter.state_dict(state)


def mean_error_feedback(
    saved: dict[str, Any] | None, device: torch.device
) -> dict[str, Any] | None:
    """`saved` (this rank's `hook_state_dict`) with each parameter's compression error
    replaced by its mean over the ranks: one all-reduce on every rank, the size of the
    error, whatever the world size. All ranks hold the same parameters' errors (DDP's
    buckets are the same on every rank), in the same order (sorted by parameter)."""
    if saved is None or not (dist.is_available() and dist.is_initialized()):
        return saved
    keys = [key for key, piece in sorted(saved["parameters"].items()) if "error" in piece]
    if not keys:
        return saved
    errors = [saved["parameters"][key]["error"] for key in keys]
    flat = torch.cat([error.reshape(-1) for error in errors]).to(device)
    dist.all_reduce(flat)
    flat = flat.div_(dist.get_world_size()).cpu()
    parameters = dict(saved["parameters"])
    for key, piece in zip(keys, flat.split([error.numel() for error in errors]), strict=True):
        parameters[key] = {**parameters[key], "error": piece.clone()}
    return {**saved, "parameters": parameters}


def load_hook_state_dict(model: torch.nn.Module | None, saved: dict[str, Any] | None) -> None:
    hook, state = _registered(model)
    if hook is None or hook.by_parameter is None or saved is None:
        return
    hook.by_parameter.load_state_dict(state, saved)


def _registered(model: torch.nn.Module | None) -> tuple[CountingHook | None, Any]:
    for hook, state in getattr(model, "_comm_hooks", []):
        if isinstance(hook, CountingHook):
            return hook, state
    return None, None


class PowerSGDByParameter:
    """Translates PowerSGD's per-bucket state to per-parameter pieces and back.

    For each bucket, PowerSGD holds the compression error as one flat tensor (the bucket's
    gradients one after the other) and the factors Q of the matrices it compresses as another
    (grouped by matrix shape, in bucket order). `prepare`, called before the hook with every
    bucket, notices when DDP has formed different buckets and moves the state over, piece by
    piece; a loaded state waits in per-parameter form until its buckets are seen.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.index = {p.data_ptr(): i for i, p in enumerate(module.parameters())}
        # bucket index -> (parameter index, shape) of each gradient in it
        self.layouts: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
        self.pending: dict[int, dict[str, torch.Tensor]] = {}

    def prepare(self, state: powerSGD_hook.PowerSGDState, bucket) -> None:
        bucket_index = bucket.index()
        layout = [(self.index[p.data_ptr()], tuple(p.shape)) for p in bucket.parameters()]
        known = self.layouts.get(bucket_index)
        if known == layout:
            return
        keys = {key for key, _ in layout}
        if known is not None or any(keys & {k for k, _ in old} for old in self.layouts.values()):
            # DDP formed new buckets: all of the old state is laid out the old way.
            self.pending.update(self._split(state))
            _clear(state)
            self.layouts = {}
        self.layouts[bucket_index] = layout
        self._join(state, bucket_index, layout, bucket.buffer())

    def state_dict(self, state: powerSGD_hook.PowerSGDState) -> dict[str, Any]:
        pieces = {**self.pending, **self._split(state)}
        return {
            "iter": state.iter,
            # numpy's stub picks the dict overload for the default legacy=True, which
            # returns the tuple for the MT19937 generator PowerSGD seeds.
            "rng": plain_numpy_state(cast("tuple[Any, ...]", state.rng.get_state())),
            "parameters": dict(sorted(pieces.items())),
        }

    def load_state_dict(self, state: powerSGD_hook.PowerSGDState, saved: dict[str, Any]) -> None:
        state.iter = saved["iter"]
        state.rng.set_state(numpy_state(saved["rng"]))
        _clear(state)
        self.layouts = {}
        self.pending = dict(saved["parameters"])

    def _split(self, state) -> dict[int, dict[str, torch.Tensor]]:
        pieces: dict[int, dict[str, torch.Tensor]] = {}
        for bucket_index, layout in self.layouts.items():
            slices = _slices(state, [shape for _, shape in layout])
            error = state.error_dict.get(bucket_index)
            q = state.q_memory_dict.get(bucket_index)
            for (key, _), (err_at, q_at) in zip(layout, slices, strict=True):
                piece = pieces.setdefault(key, {})
                if error is not None:
                    piece["error"] = error[err_at[0] : err_at[1]].detach().cpu().clone()
                if q is not None and q_at is not None:
                    piece["q"] = q[q_at[0] : q_at[1]].detach().cpu().clone()
        return {key: piece for key, piece in pieces.items() if piece}

    def _join(self, state, bucket_index: int, layout, buffer: torch.Tensor) -> None:
        pieces = [self.pending.get(key) for key, _ in layout]
        if not any(pieces):
            return
        like: dict[str, Any] = {"device": buffer.device, "dtype": buffer.dtype}
        slices = _slices(state, [shape for _, shape in layout])
        if all(piece and "error" in piece for piece in pieces):
            state.error_dict[bucket_index] = torch.cat([p["error"] for p in pieces if p]).to(**like)
        compressed = [
            (piece, q_at) for piece, (_, q_at) in zip(pieces, slices, strict=True) if q_at
        ]
        if compressed and all(piece and "q" in piece for piece, _ in compressed):
            # Q in the hook's order: grouped by matrix shape (see _slices).
            ordered = sorted(compressed, key=lambda item: item[1][0])
            q = torch.cat([p["q"] for p, _ in ordered if p])
            state.q_memory_dict[bucket_index] = q.to(**like)
            # P is recomputed from Q before it is read; only its size matters.
            state.p_memory_dict[bucket_index] = torch.zeros(_p_size(state, layout), **like)
        for key, _ in layout:
            self.pending.pop(key, None)


def _matrix(state, shape: tuple[int, ...]) -> tuple[int, int, int, bool]:
    """How the PowerSGD hook sees a gradient: rows, columns, rank, compressed or not."""
    rows = shape[0] if shape else 1
    cols = math.prod(shape) // max(rows, 1)
    rank = min(rows, cols, state.matrix_approximation_rank)
    compress = powerSGD_hook._should_compress(rows, cols, rank, state.min_compression_rate)[0]
    return rows, cols, rank, compress


def _slices(state, shapes: list[tuple[int, ...]]):
    """(error slice, Q slice or None) of each gradient of a bucket, as the hook lays them out:
    errors in bucket order; Qs of compressed matrices grouped by shape (first seen first)."""
    errors, at = [], 0
    for shape in shapes:
        errors.append((at, at + math.prod(shape)))
        at += math.prod(shape)
    groups: dict[tuple[int, int], list[int]] = {}
    for position, shape in enumerate(shapes):
        rows, cols, _, compress = _matrix(state, shape)
        if compress:
            groups.setdefault((rows, cols), []).append(position)
    q_slices: dict[int, tuple[int, int]] = {}
    at = 0
    for positions in groups.values():
        for position in positions:
            _, cols, rank, _ = _matrix(state, shapes[position])
            q_slices[position] = (at, at + cols * rank)
            at += cols * rank
    return [(errors[i], q_slices.get(i)) for i in range(len(shapes))]


def _p_size(state, layout) -> int:
    total = 0
    for _, shape in layout:
        rows, _, rank, compress = _matrix(state, shape)
        total += rows * rank if compress else 0
    return total


def _clear(state) -> None:
    state.error_dict.clear()
    state.p_memory_dict.clear()
    state.q_memory_dict.clear()


def bf16_refused(capability: tuple[int, int]) -> ConfigError:
    return ConfigError(
        "strategy.comm_hook",
        "bf16",
        "bf16 compression needs a GPU with bfloat16 support (compute capability 8.0, Ampere, "
        f"or newer); this one has {capability[0]}.{capability[1]}",
        "use strategy.comm_hook=fp16",
    )
