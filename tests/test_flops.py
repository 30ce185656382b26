"""FLOPs per sample counted once on a meta copy, achieved TFLOP/s and MFU against the peak
table (in-process; the real runs' figures are checked in tests/test_benchmark.py and
tests/test_progress.py)."""

from __future__ import annotations

import pytest
import torch

from ddp_template.callbacks.speed import SpeedMonitor
from ddp_template.worker.flops import peak_tflops, training_flops_per_sample


def test_two_linear_layers_cost_their_products_forward_and_backward() -> None:
    """Forward 2*10*5 + 2*5*3 FLOPs a sample; backward both weights' gradients (as many)
    and the second layer's input gradient (2*5*3); the data needs no gradient: 290 per
    sample. The real weights are left alone."""
    model = torch.nn.Sequential(torch.nn.Linear(10, 5), torch.nn.Linear(5, 3))
    weights = model[0].weight.detach().clone()
    batch = (torch.randn(4, 10), torch.zeros(4))
    assert training_flops_per_sample(model, batch) == 290
    model = model[0]
    assert model.weight.grad is None and torch.equal(model.weight, weights)
    assert model.weight.device.type == "cpu"


def test_batch_norm_statistics_stay_as_they_were() -> None:
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    before = model[1].running_mean.clone()
    assert training_flops_per_sample(model, [torch.randn(2, 3, 8, 8)]) > 0
    assert torch.equal(model[1].running_mean, before) and model[1].num_batches_tracked == 0


def test_a_batch_without_tensor_inputs_is_not_counted() -> None:
    assert training_flops_per_sample(torch.nn.Linear(2, 2), {"x": torch.randn(2, 2)}) is None


@pytest.mark.parametrize(
    "name,precision,tf32,peak",
    [
        ("NVIDIA H100 80GB HBM3", "bf16-mixed", True, 989.5),
        ("NVIDIA H100 PCIe", "16-mixed", True, 756.5),
        ("NVIDIA H200", "bf16-mixed", True, 989.5),
        ("NVIDIA H200 NVL", "bf16-true", True, 835.5),
        ("NVIDIA A100-SXM4-80GB", "32-true", True, 156.0),
        ("NVIDIA A100 80GB PCIe", "32-true", False, 19.5),
        ("NVIDIA L4", "16-mixed", True, 121.0),
        ("NVIDIA L40S", "bf16-mixed", True, 366.5),
        ("NVIDIA A10", "bf16-mixed", True, 125.0),
        ("Tesla V100-SXM2-16GB", "16-mixed", False, 125.0),
        # Not in the table: MFU is null rather than a guess.
        ("NVIDIA L40", "bf16-mixed", True, None),
        ("NVIDIA A10G", "bf16-mixed", True, None),
        ("Tesla V100-SXM2-16GB", "bf16-mixed", False, None),
        ("NVIDIA A100-SXM4-80GB", "64-true", False, None),
    ],
)
def test_dense_peaks_by_device_and_precision(
    name: str, precision: str, tf32: bool, peak: float | None
) -> None:
    assert peak_tflops(name, precision, tf32) == peak


def test_mfu_is_the_achieved_share_of_each_devices_peak() -> None:
    monitor = SpeedMonitor()
    monitor.flops_per_sample, monitor.peak_tflops = 1e9, 1.0
    metrics = monitor.flops_metrics(samples_per_sec=1000.0, devices=2)
    assert metrics["perf/tflops_per_sec"] == pytest.approx(1.0)
    assert metrics["perf/tflops_per_sec_per_device"] == pytest.approx(0.5)
    assert metrics["perf/mfu"] == pytest.approx(0.5)
    monitor.peak_tflops = None
    assert "perf/mfu" not in monitor.flops_metrics(1000.0, 2)


def test_float32_runs_are_measured_against_what_their_work_runs_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On an A100 (as torch would name it), float32 convolutions run on TF32 tensor cores
    (cuDNN's switch, on by default) and float32 matrix products only when torch's matmul
    precision allows it."""
    from ddp_template.worker.flops import device_peak_tflops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    gpu = torch.device("cuda", 0)
    convolutional = torch.nn.Conv2d(3, 4, 3)
    linear = torch.nn.Linear(4, 4)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    assert device_peak_tflops(gpu, "32-true", convolutional) == 156.0
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert device_peak_tflops(gpu, "32-true", linear) == 19.5
        torch.set_float32_matmul_precision("high")
        assert device_peak_tflops(gpu, "32-true", linear) == 156.0
    finally:
        torch.set_float32_matmul_precision(previous)
    assert device_peak_tflops(gpu, "bf16-mixed", linear) == 312.0
    assert device_peak_tflops(torch.device("cpu"), "bf16-mixed", linear) is None
