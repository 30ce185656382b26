"""benchmarks/gpu_check.py: its whole flow on the CPU (`--device cpu --tiny`), so that the
first run on a GPU does not fail on a typo; a part that runs out of time; bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from helpers.runs import ROOT

SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
BASE_ROWS = ["baseline", "amp", "amp+channels_last", "data", "comm"]


def gpu_check(*args: str, timeout: float = 1700, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
    )


def outputs(folder: Path) -> tuple[dict, str]:
    return json.loads((folder / "gpu_check.json").read_text()), (
        folder / "gpu_report.md"
    ).read_text()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_whole_flow_runs_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "check"
    proc = gpu_check("--device", "cpu", "--tiny", "--out", str(out), "--budget-s", "1500")
    state, report = outputs(out)
    statuses = {name: part["status"] for name, part in state["parts"].items()}
    assert statuses == {
        "mixed": "passed",
        "ddp": "passed",
        "host_sync": "skipped",
        "watchdog": "passed",
        "resnet50": "passed",
        "loader": "passed",
    }, (statuses, proc.stdout[-3000:])
    assert proc.returncode == 0
    parts = state["parts"]

    mixed = parts["mixed"]
    # No fp16 autocast on the CPU: bf16, which needs no loss scaler.
    assert mixed["precision_requested"] == "16-mixed" and mixed["precision_used"] == "bf16-mixed"
    assert mixed["scaler"] is None and mixed["final_loss_scale"] is None
    assert 0 <= mixed["test_accuracy"] <= 1

    ddp = parts["ddp"]
    assert ddp["backend"] == "gloo" and ddp["world_size"] == 1
    assert ddp["comm_hook"] == "fp16" and ddp["comm_hook_calls"] >= ddp["optimizer_steps"] == 3

    # The GPU command composed, built the planted module and met the CUDA check.
    assert "needs CUDA" in parts["host_sync"]["reason"]

    watchdog = parts["watchdog"]
    assert "gloo:all_reduce in flight" in watchdog["collectives"]["0"]
    assert "none in flight" in watchdog["collectives"]["1"]
    assert (
        "rank 1: main thread at" in watchdog["summary"]
        and "on_before_backward" in (watchdog["summary"])
    )

    rows = parts["resnet50"]["rows"]
    assert list(rows)[: len(BASE_ROWS)] == BASE_ROWS
    for name, row in rows.items():
        assert row["status"] == "passed", name
        assert row["images_per_sec"] > 0 and row["memory_kind"] == "host_peak_rss"
    assert rows["baseline"]["speedup"] == 1.0 and rows["baseline"]["memory_change"] == 0.0
    assert rows["baseline"]["nvidia_a100_reference"] == 938
    assert rows["amp"]["nvidia_a100_reference"] == 2470
    assert rows["data"]["loader_workers"] >= 1 and rows["comm"]["comm_hook"] == "fp16"
    assert parts["resnet50"]["article"] == {"amp_speedup": 1.75, "amp_memory_change": -0.44}

    loader = parts["loader"]
    assert len(list(Path(loader["images"]["root"]).rglob("*.jpg"))) == loader["images"]["count"]
    alone, training = loader["loading_alone"], loader["training"]
    assert alone["baseline"]["num_workers"] == 0 and alone["tuned"]["num_workers"] >= 1
    assert all(alone[name]["images_per_sec"] > 0 for name in ("baseline", "tuned"))
    assert all(0 <= training[name]["data_wait_fraction"] < 1 for name in ("baseline", "tuned"))

    for name in statuses:
        assert f"| {name} | {statuses[name]} |" in report
    assert "| baseline | " in report and "938 (tf32)" in report and "x1.75" in report
    assert "## Data loading (48 JPEGs of 32-64 px)" in report


@pytest.mark.slow
def test_a_part_out_of_time_is_reported_and_the_next_runs(tmp_path: Path) -> None:
    out = tmp_path / "check"
    proc = gpu_check(
        "--device", "cpu", "--tiny", "--out", str(out), "--only", "mixed", "host_sync",
        "--limit", "mixed=1",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]
    state, report = outputs(out)
    mixed, host_sync = state["parts"]["mixed"], state["parts"]["host_sync"]
    assert mixed["status"] == "timed out" and "ran past its 1 s" in mixed["reason"]
    assert host_sync["status"] == "skipped" and "needs CUDA" in host_sync["reason"]
    assert "| mixed | timed out |" in report
    assert "(stopped after 1 s)" in (out / "logs" / "mixed.log").read_text()
    # The run it stopped left no process behind.
    left = [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if str(out) in " ".join(p.info["cmdline"] or [])
    ]
    assert not left


def test_without_cuda_it_says_so_and_exits_2(tmp_path: Path) -> None:
    out = tmp_path / "check"
    proc = gpu_check("--out", str(out), timeout=120, CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: --device cuda is not valid here")
    assert "--device cpu" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()
    proc = gpu_check("--device", "cpu", "--limit", "resnet=5", "--out", str(out), timeout=120)
    assert proc.returncode == 2 and "--limit resnet=5 is not valid" in proc.stderr
    assert not out.exists()
