"""The scaling model (`python -m ddp_template.tools.scaling`): its buckets are DDP's, its
predictions move the way the physics says, and bad input is one paragraph. (Its figures
against measured 2-node steps: benchmarks/comm_lab.py, docs/nodes.md.)"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddp_template.errors import ConfigError
from ddp_template.tools.scaling import Link, MeasuredRun, buckets, parse_nodes, predict, sent_bytes

SHAPES = [[10], [10, 512], [512], [512, 256, 3, 3], [256], [256, 64, 3, 3], [64, 3, 3, 3]]


def _run(**changes) -> MeasuredRun:
    values = dict(
        step_s=1.0,
        data_wait_s=0.05,
        forward_s=0.3,
        backward_s=0.6,
        shapes=SHAPES,
        element_bytes=4,
        samples_per_step_per_device=64,
        devices_per_node=1,
        nodes=1,
        bucket_cap_mb=None,
        threads=1,
        powersgd_rank=1,
    )
    values.update(changes)
    return MeasuredRun(**values)


def test_buckets_are_the_ones_ddp_forms() -> None:
    """torch's own assignment (reverse parameter order, first bucket 1 MiB by default)."""
    params = [torch.empty(s) for s in reversed(SHAPES)]
    for cap_mb in (None, 1, 5):
        limits = [1 << 20 if cap_mb is None else int(cap_mb * 2**20), int((cap_mb or 25) * 2**20)]
        expected, _ = torch.distributed._compute_bucket_assignment_by_size(
            list(reversed(params)), limits, [False] * len(params)
        )
        assert buckets(SHAPES, 4, cap_mb) == [list(b) for b in expected]


def test_one_node_of_one_device_costs_no_communication() -> None:
    p = predict(_run(), 1, "none", Link.rated(1e9), 0.0, None)
    assert p.exposed_comm_s == 0 and p.step_s == pytest.approx(1.0) and p.efficiency == 1


def test_a_slower_link_more_nodes_and_less_compression_never_predict_faster() -> None:
    run = _run()
    fast, slow = Link.rated(10e9), Link.rated(100e6)
    for hook in ("none", "fp16", "powersgd"):
        steps = [predict(run, n, hook, slow, 0.0, None).step_s for n in (2, 4, 8, 16)]
        assert steps == sorted(steps)
        assert (
            predict(run, 4, hook, fast, 0, None).step_s
            <= predict(run, 4, hook, slow, 0, None).step_s
        )
    at = {
        h: predict(run, 8, h, slow, 0.0, None).exposed_comm_s for h in ("none", "fp16", "powersgd")
    }
    assert at["powersgd"] < at["fp16"] < at["none"]


def test_compression_sends_what_the_hooks_send() -> None:
    assert sent_bytes([256, 64, 3, 3], 4, "none", 1) == 256 * 576 * 4
    assert sent_bytes([256, 64, 3, 3], 4, "fp16", 1) == 256 * 576 * 2
    assert sent_bytes([256, 64, 3, 3], 4, "powersgd", 2) == (256 + 576) * 2 * 4
    assert sent_bytes([512], 4, "powersgd", 1) == 512 * 4  # vectors go uncompressed


def test_the_ring_costs_what_the_formula_says() -> None:
    """One bucket, no overlap possible (all gradients ready at the end of the backward)."""
    run = _run(backward_s=0.0, forward_s=0.95, shapes=[[1024, 1024]], bucket_cap_mb=100)
    link = Link.rated(1e9, latency_s=0.0)
    p = predict(run, 4, "none", link, 0.0, 100)
    wire = 2 * 3 / 4 * 1024 * 1024 * 4 * 8 / 1e9
    assert p.exposed_comm_s == pytest.approx(wire)


@pytest.mark.parametrize("bad", ["0", "2,0", "x", "", "-4"])
def test_node_counts_below_one_are_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="node counts >= 1"):
        parse_nodes(bad)


def _results(folder: Path, **record) -> Path:
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps(record))
    return folder


@pytest.mark.slow
def test_the_command_line_predicts_and_refuses(tmp_path: Path) -> None:
    gradients = {
        "shapes": SHAPES,
        "element_bytes": 4,
        "forward_compute_s": 0.3,
        "backward_compute_s": 0.6,
        "torch_threads": 1,
    }
    job = _results(
        tmp_path / "run",
        step_time_median_s=1.0,
        data_wait_fraction=0.05,
        batch_size_per_device=64,
        devices_per_node=1,
        gradients=gradients,
        ddp={"bucket_cap_mb": 25.0},
        config={"strategy": {"bucket_cap_mb": None, "powersgd_rank": 1}},
    )
    command = [sys.executable, "-m", "ddp_template.tools.scaling", str(job), "--link", "1gbit"]
    ok = subprocess.run([*command, "--nodes", "2,4"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    lines = [line for line in ok.stdout.splitlines() if "predicted step time:" in line]
    assert len(lines) == 2 * 4 and lines[0].startswith("nodes=2 hook=none")
    assert sum(line.startswith("recommended at nodes=") for line in ok.stdout.splitlines()) == 2
    refused = subprocess.run(
        [*command, "--nodes", "0"], capture_output=True, text=True, timeout=120
    )
    assert refused.returncode == 2 and refused.stderr.startswith("error: --nodes='0' is not valid")
    one_process = _results(tmp_path / "plain", step_time_median_s=1.0)
    refused = subprocess.run(
        [sys.executable, "-m", "ddp_template.tools.scaling", str(one_process)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2 and "strategy=ddp" in refused.stderr
    assert math.isclose(float(lines[0].split("compute ")[1].split(" s")[0]), 0.95, abs_tol=0.01)


def test_overlap_hides_communication_behind_the_backward_except_powersgd_on_gloo() -> None:
    link = Link.rated(10e9)
    hidden = predict(_run(), 2, "none", link, 0.0, None, overlap=1.0)
    serial = predict(_run(), 2, "none", link, 0.0, None, overlap=0.0)
    assert hidden.exposed_comm_s < serial.exposed_comm_s
    assert serial.exposed_comm_s == pytest.approx(
        sum(sent_bytes(s, 4, "none", 1) for s in SHAPES) * 8 / 10e9
        + len(buckets(SHAPES, 4, None)) * 2 * 50e-6,
        rel=0.01,
    )
    # PowerSGD on gloo waits for each bucket inside the backward: nothing hidden there.
    on_gloo = predict(_run(backend="gloo"), 2, "powersgd", link, 0.0, None, overlap=1.0)
    on_nccl = predict(_run(backend="nccl"), 2, "powersgd", link, 0.0, None, overlap=1.0)
    assert on_gloo.exposed_comm_s > on_nccl.exposed_comm_s
