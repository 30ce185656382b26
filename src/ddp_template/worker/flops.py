"""How much arithmetic a training step does, and how much the hardware could do.

`training_flops_per_sample` counts the forward and backward of one batch once, with
torch's FlopCounterMode (through Lightning's `measure_flops`) on a meta-device copy of the
model: no memory, no arithmetic, no effect on the real weights, their gradients or batch
norm statistics. It counts matrix products and convolutions (what dominates a step and what
the peak figures measure); element-wise work is not counted, as in torchtitan's and
Composer's MFU.

`peak_flops` is one device's dense peak for the precision the run computes in, from the
vendors' data sheets; None for a device not in the table (and on CPUs), so MFU is null
there. Lightning's table (`lightning.fabric.utilities.throughput`) is not used: its H200
and H100 NVL figures are the data sheets' "with sparsity" ones, twice the dense peak, and it
does not recognise the name an H200 reports ("NVIDIA H200").
"""

from __future__ import annotations

import contextlib
import copy
import re
import weakref
from typing import Any

import torch
from lightning.fabric.utilities.throughput import measure_flops

TERA = 1e12

# Dense (no sparsity) peaks per device, in TFLOP/s, by precision. The first pattern that
# matches the lower-cased device name (torch.cuda.get_device_name) wins.
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    # NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): 1,979 BF16/FP16 and 989 TF32
    # TFLOPS "with sparsity" for SXM, 1,671 / 835 for NVL; dense is half. FP32 67 / 60.
    (r"h200 nvl", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (r"h200", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0}),
    # NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100): SXM 1,979 / 989 with
    # sparsity, FP32 67; PCIe 1,513 / 756, FP32 51.
    (r"h100.*pcie", {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.0}),
    (r"h100 .*hbm3|h100 sxm", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0}),
    # NVIDIA A100 datasheet (nvidia.com/en-us/data-center/a100): 312 BF16/FP16, 156 TF32
    # dense (624 / 312 with sparsity), FP32 19.5; SXM and PCIe alike.
    (r"a100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    # NVIDIA L40S datasheet: 733 / 366 with sparsity, FP32 91.6.
    (r"l40s", {"bf16": 366.5, "fp16": 366.5, "tf32": 183.0, "fp32": 91.6}),
    # NVIDIA L4 datasheet (nvidia.com/en-us/data-center/l4): 242 BF16/FP16 and 120 TF32
    # with sparsity, FP32 30.3.
    (r"\bl4\b", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    # NVIDIA A10 datasheet: 125 BF16/FP16, 62.5 TF32 dense, FP32 31.2. (AWS's A10G is a
    # different part whose peaks NVIDIA does not publish: not in the table.)
    (r"\ba10\b", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    # NVIDIA V100 datasheet: FP16 tensor 125 (SXM2) / 112 (PCIe), FP32 15.7 / 14; no BF16,
    # no TF32.
    (r"v100.*sxm", {"fp16": 125.0, "fp32": 15.7}),
    (r"v100.*pcie", {"fp16": 112.0, "fp32": 14.0}),
]


def peak_tflops(device_name: str, precision: str, tf32: bool) -> float | None:
    """One device's dense peak for the run's compute precision, None where unknown."""
    kind = _compute_kind(precision, tf32)
    name = device_name.lower()
    for pattern, peaks in PEAK_TFLOPS:
        if re.search(pattern, name):
            return peaks.get(kind) if kind else None
    return None


def device_peak_tflops(
    device: torch.device, precision: str, model: torch.nn.Module
) -> float | None:
    """The peak of this rank's device (CUDA only; CPUs have no entry)."""
    if device.type != "cuda":
        return None
    # float32 work runs on TF32 tensor cores where torch allows it (Ampere and newer):
    # matrix products by torch's matmul precision, convolutions by cuDNN's switch (on by
    # default), so a model's largest kind of work decides.
    convolutional = any(isinstance(m, torch.nn.modules.conv._ConvNd) for m in model.modules())
    allowed = (
        torch.backends.cudnn.allow_tf32
        if convolutional
        else torch.get_float32_matmul_precision() != "highest"
    )
    tf32 = allowed and torch.cuda.get_device_capability(device)[0] >= 8
    return peak_tflops(torch.cuda.get_device_name(device), precision, tf32)


def _compute_kind(precision: str, tf32: bool) -> str | None:
    if precision.startswith("bf16"):
        return "bf16"
    if precision.startswith("16"):
        return "fp16"
    if precision.startswith("32"):
        return "tf32" if tf32 else "fp32"
    return None


def training_flops_per_sample(model: torch.nn.Module, batch: Any) -> float | None:
    """FLOPs of one training step (forward and backward) per sample, counted on a meta copy
    of `model` fed the batch's inputs (its first element); None where the batch has no
    tensor inputs or the model cannot run on the meta device."""
    inputs = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
    if not isinstance(inputs, torch.Tensor) or inputs.ndim == 0 or len(inputs) == 0:
        return None
    meta_inputs = torch.empty_like(inputs, device="meta")
    try:
        # A sharded (FSDP) network refuses to be copied: its meta copy was taken before.
        meta_model = _UNSHARDED.get(model) or _meta_copy(model)
        flops = measure_flops(meta_model, lambda: meta_model(meta_inputs), _loss)
    except Exception:
        # An operation without a meta kernel, a model that wants more than the batch's
        # first element: the run trains all the same, its FLOPs are unknown (null).
        return None
    return flops / len(inputs) if flops else None


# A network's meta copy as it was before `fully_shard` (FLOPs do not depend on the sharding).
_UNSHARDED: weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module] = (
    weakref.WeakKeyDictionary()
)


def remember_unsharded(network: torch.nn.Module) -> None:
    """Called just before `network` is sharded: its FLOPs are counted on this copy."""
    # A network that cannot be copied: its FLOPs stay unknown (null), as unsharded.
    with contextlib.suppress(Exception):
        _UNSHARDED[network] = _meta_copy(network)


def _loss(output: Any) -> torch.Tensor:
    first = output[0] if isinstance(output, (list, tuple)) else output
    return first.float().sum()


def _meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy whose parameters and buffers live on the meta device (nothing allocated)."""
    memo: dict[int, Any] = {}
    for parameter in model.parameters():
        memo[id(parameter)] = torch.nn.Parameter(
            torch.empty_like(parameter, device="meta"), requires_grad=parameter.requires_grad
        )
    for buffer in model.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return copy.deepcopy(model, memo)
