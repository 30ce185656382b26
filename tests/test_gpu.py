"""GPU paths, where CUDA devices are visible (skipped with the reason elsewhere): fp16 with
its loss scaler, nccl with the fp16 communication hook and SyncBatchNorm, the host-sync finder
on a planted `.item()`, CUDA peak memory, the watchdog's dump on nccl, and the GPU defaults.
The callbacks and the planted module come from benchmarks/gpu_check_plugins.py."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest
from helpers.runs import CPU, FAST, ROOT, compose_train, cuda_devices, results, train

from ddp_template.config.checks import resolve_and_check
from ddp_template.errors import ConfigError

GPU_FAST = [option for option in FAST if option != CPU] + ["accelerator=cuda"]


@pytest.fixture
def plugins(monkeypatch) -> None:
    """benchmarks/ on the runs' PYTHONPATH, for `gpu_check_plugins.<name>`."""
    paths = [str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, paths)))


def read(run_dir: Path, name: str) -> dict:
    return json.loads((run_dir / name).read_text())


@pytest.mark.gpu(1)
@pytest.mark.slow
def test_default_run_in_16_mixed_keeps_a_loss_scale(run_dir: Path, tmp_path: Path, plugins) -> None:
    train(
        "accelerator=cuda",
        "precision=16-mixed",
        "logger=none",
        "+callbacks.loss_scale._target_=gpu_check_plugins.LossScaleRecorder",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    out = results(run_dir)
    assert out["precision_used"] == "16-mixed" and out["machine"]["gpu"]
    assert out["test/acc"] >= 0.95, out["test/acc"]
    scaler = read(run_dir, "loss_scale.json")
    assert scaler["scaler"] == "GradScaler"
    # A finite power of two: the scaler backs off on overflow and grows after clean steps.
    scale = scaler["final_scale"]
    assert 0 < scale < float("inf") and math.log2(scale).is_integer(), scale


@pytest.mark.gpu(1)
def test_cuda_peak_memory_reaches_the_results(run_dir: Path, tmp_path: Path) -> None:
    proc = train(
        "accelerator=cuda",
        "experiment=benchmark",
        "data.image_size=32",
        "benchmark.warmup_steps=1",
        "benchmark.steps=3",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    out = results(run_dir)
    assert out["memory_kind"] == "cuda_max_allocated" and out["peak_memory_mb"] > 0
    allocated = out["peak_memory_mb_over_ranks"]["max"]
    assert out["peak_reserved_memory_mb_over_ranks"]["max"] >= allocated
    assert "CUDA allocated/reserved" in proc.stdout and "CUDA allocated, max over ranks" in (
        proc.stdout
    )


@pytest.mark.gpu(1)
@pytest.mark.slow
def test_nccl_runs_the_fp16_hook_and_sync_batchnorm(run_dir: Path, tmp_path: Path, plugins) -> None:
    devices = cuda_devices()
    train(
        *GPU_FAST,
        "strategy=ddp",
        f"devices={devices}",
        "strategy.process_group_backend=nccl",
        "strategy.comm_hook=fp16",
        "sync_batchnorm=true",
        "+callbacks.probe._target_=gpu_check_plugins.DistributedProbe",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    out, probe = results(run_dir), read(run_dir, "distributed.json")
    assert out["world_size"] == devices and probe["backend"] == "nccl"
    assert probe["sync_batchnorm_layers"] == probe["batchnorm_layers"] > 0
    assert out["ddp"]["comm_hook"] == "fp16"
    assert out["ddp"]["comm_hook_calls"] >= out["global_step"] == 3


@pytest.mark.gpu(1)
def test_host_sync_names_a_planted_item(run_dir: Path, tmp_path: Path, plugins) -> None:
    proc = train(
        *GPU_FAST,
        "data=synthetic",
        "data.image_size=16",
        "debug=host_sync",
        "task.module._target_=gpu_check_plugins.ItemInStepClassifier",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    found = re.findall(r"^host sync: (.*)$", proc.stdout, re.MULTILINE)
    assert any(
        "gpu_check_plugins.py:" in line and "self.last_loss = loss.item()" in line for line in found
    ), proc.stdout[-3000:]
    assert re.search(r"host syncs in training steps: \d+ line\(s\), by count", proc.stdout)


@pytest.mark.gpu(2)
@pytest.mark.slow
def test_a_hang_on_nccl_dumps_every_rank(run_dir: Path, tmp_path: Path) -> None:
    proc = train(
        *GPU_FAST,
        "strategy=ddp",
        "devices=2",
        "strategy.process_group_backend=nccl",
        "data=synthetic",
        "data.image_size=16",
        "debug=watchdog",
        "callbacks.hang_watchdog.timeout_s=15",
        "+callbacks.sleep._target_=faults.SleepInStep",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        check=False,
        timeout=300,
    )
    assert proc.returncode != 0
    stacks = {rank: (run_dir / "hang" / f"rank_{rank}.txt").read_text() for rank in (0, 1)}
    assert "in on_before_backward" in stacks[1]
    # NCCL's own flight recorder: rank 0 has a collective in flight that rank 1 never joined.
    assert re.search(r"collectives: #\d+(-#\d+)? nccl:\S+ in flight", stacks[0]), stacks[0][:800]
    assert "rank 1: main thread at" in (run_dir / "hang" / "summary.txt").read_text()


@pytest.mark.gpu(1)
def test_auto_picks_the_gpu_and_tuned_loaders_pin_memory() -> None:
    cfg = compose_train("accelerator=auto", "loader=tuned")
    resolve_and_check(cfg)
    assert cfg.accelerator == "cuda" and cfg.data.pin_memory is True


@pytest.mark.gpu(1)
def test_more_devices_than_gpus_is_refused(tmp_path: Path) -> None:
    visible = cuda_devices()
    with pytest.raises(ConfigError, match=f"at most the {visible} GPUs visible here"):
        resolve_and_check(compose_train("accelerator=gpu", f"devices={visible + 1}"))
    proc = train("accelerator=gpu", f"devices={visible + 1}", cwd=tmp_path, check=False)
    assert proc.returncode == 2 and f"devices={visible + 1} is not valid" in proc.stderr
    assert "Traceback" not in proc.stderr
