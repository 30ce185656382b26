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
from ddp_template.tools.scaling import (
    Link,
    MeasuredRun,
    Transfer,
    buckets,
    overlapped_backward,
    parse_buckets,
    parse_nodes,
    predict,
    probe_hook_costs,
    report,
    sent_bytes,
)

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


def test_the_overlapped_schedule_without_contention_is_the_plain_one() -> None:
    """A rated link (busy = alone, the compute keeps its speed): bucket k ends at
    max(ready_k, end of k - 1) + t_k, and the backward's compute is not slowed."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        count = int(torch.randint(1, 8, (1,), generator=generator))
        ready = sorted(torch.rand(count, generator=generator).tolist())
        seconds = (torch.rand(count, generator=generator) * 0.5).tolist()
        end = 0.0
        for r, t in zip(ready, seconds, strict=True):
            end = max(end, r) + t
        transfers = [Transfer(r, t, t) for r, t in zip(ready, seconds, strict=True)]
        assert overlapped_backward(1.0, transfers, 1.0) == pytest.approx(max(end, 1.0))


def test_a_transfer_that_takes_the_cores_slows_the_compute_it_overlaps() -> None:
    """One bucket ready at once, 1 s on the wire, 1 s of backward: with half the compute's
    speed left while it is sent, the compute has done 0.5 s when it ends and 0.5 s more
    after (1.5 s); a transfer at half its speed while the node computes is half sent when
    the backward ends and sends the rest alone (1.5 s); with no speed left (the node's
    fraction of a core taken by gloo) the two run one after the other."""
    assert overlapped_backward(1.0, [Transfer(0.0, 1.0, 1.0)], 0.5) == pytest.approx(1.5)
    assert overlapped_backward(1.0, [Transfer(0.0, 1.0, 2.0)], 1.0) == pytest.approx(1.5)
    assert overlapped_backward(1.0, [Transfer(0.0, 1.0, 1.0)], 0.0) == pytest.approx(2.0)
    # Sent after the backward, nothing contends: the busy speed does not apply.
    assert overlapped_backward(1.0, [Transfer(1.0, 1.0, 5.0)], 0.0) == pytest.approx(2.0)


def test_a_probed_link_under_compute_predicts_the_step_that_contention_costs() -> None:
    """The lab's probe measured the link while the nodes computed: a slower all-reduce and
    less compute speed then give a longer step than the same link alone, and the report's
    link line says what was measured."""
    alone = {"latency_s": 1e-3, "bandwidth_bps": {"float32": 2e8, "float16": 2e8, "bfloat16": 2e8}}
    busy = {
        **alone,
        "under_compute": {"latency_s": 4e-3, "bandwidth_bps": 1e8, "compute_share": 0.5},
    }
    quiet, contended = Link.probed(alone), Link.probed(busy)
    assert contended.busy_bandwidth_bps == {"float32": 1e8, "float16": 1e8, "bfloat16": 1e8}
    run = _run(shapes=[[1024, 1024]] * 8)
    for hook in ("none", "fp16"):
        assert (
            predict(run, 8, hook, contended, 0.0, 1).step_s
            > predict(run, 8, hook, quiet, 0.0, 1).step_s
        )
    assert "while computing float32 100mbit, 4000 us per hop, 50% of the compute" in (
        contended.describe()
    )


@pytest.mark.slow
def test_the_all_reduce_probe_measures_the_link_while_the_ranks_compute(tmp_path: Path) -> None:
    """Two real gloo processes on loopback: the probe's line carries the contended figures,
    each in range."""
    from helpers.runs import free_port, subprocess_env

    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "ddp_template.tools.allreduce_probe", "--rank", str(rank)]
            + ["--world", "2", "--master", f"127.0.0.1:{port}", "--megabytes", "2"],
            stdout=subprocess.PIPE,
            text=True,
            env=subprocess_env(),
        )
        for rank in (0, 1)
    ]
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    busy = json.loads(outputs[0].strip().splitlines()[-1])["under_compute"]
    assert 0 < busy["compute_share"] <= 1
    assert busy["bandwidth_bps"] > 0 and busy["latency_s"] > 0
    link = Link.probed(json.loads(outputs[0].strip().splitlines()[-1]))
    assert link.compute_share == busy["compute_share"]


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
    ok = subprocess.run([*command, "--nodes", "2,4"], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    lines = [line for line in ok.stdout.splitlines() if "predicted step time:" in line]
    assert len(lines) == 2 * 4 and lines[0].startswith("nodes=2 hook=none")
    assert sum(line.startswith("recommended at nodes=") for line in ok.stdout.splitlines()) == 2
    refused = subprocess.run(
        [*command, "--nodes", "0"], capture_output=True, text=True, timeout=300
    )
    assert refused.returncode == 2 and refused.stderr.startswith("error: --nodes='0' is not valid")
    one_process = _results(tmp_path / "plain", step_time_median_s=1.0)
    refused = subprocess.run(
        [sys.executable, "-m", "ddp_template.tools.scaling", str(one_process)],
        capture_output=True,
        text=True,
        timeout=300,
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


def test_the_hook_probe_runs_each_hook_inside_ddp_and_leaves_no_group_behind() -> None:
    """The probe times the backward through a one-rank DDP wrapper with and without the
    hook as the worker registers it (the casts alone read a quarter of the real cost)."""
    import torch.distributed as dist

    run = _run(shapes=[[512, 1024], [1024], [1024, 1024]])
    threads = torch.get_num_threads()
    costs = probe_hook_costs(run, ["none", "fp16", "powersgd"], None)
    assert costs["none"] == 0.0
    assert costs["fp16"] > 0 and costs["powersgd"] > 0
    assert not dist.is_initialized() and torch.get_num_threads() == threads


def test_bucket_sizes_given_are_predicted_and_the_only_choices() -> None:
    run = _run()
    costs = {"none": 0.0, "fp16": 0.01}
    lines = report(run, [4], Link.rated(1e8), ["none", "fp16"], costs, None, [1, 100])
    predicted = [line for line in lines if "predicted step time:" in line]
    assert [line.split()[1:3] for line in predicted] == [
        ["hook=none", "bucket_cap_mb=1"],
        ["hook=none", "bucket_cap_mb=100"],
        ["hook=fp16", "bucket_cap_mb=1"],
        ["hook=fp16", "bucket_cap_mb=100"],
    ]
    recommended = [line for line in lines if line.startswith("recommended")]
    assert len(recommended) == 1
    assert "bucket_cap_mb=1 " in recommended[0] or "bucket_cap_mb=100 " in recommended[0]


@pytest.mark.parametrize("bad", ["0", "1,x", "", "-5", "25,,"])
def test_bucket_sizes_out_of_range_are_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="bucket sizes in MiB > 0"):
        parse_buckets(bad)
    assert parse_buckets("1,25,null") == [1.0, 25.0, None]


def test_the_fsdp_model_adds_no_communication_on_one_rank_and_more_on_a_slower_link() -> None:
    from ddp_template.tools.scaling import Link, predict_sharded

    run = _run(step_s=0.3, data_wait_s=0.0, forward_s=0.1, backward_s=0.2, shapes=[])
    units = [{"name": "root", "bytes": 0}] + [{"name": "Block", "bytes": 4 << 20}] * 4
    alone = predict_sharded(run, 1, Link.rated(1e9), units, True)
    assert alone.exposed_comm_s == 0 and alone.efficiency == pytest.approx(1.0)
    fast, slow = (predict_sharded(run, 8, Link.rated(rate), units, True) for rate in (1e11, 1e9))
    assert 0 <= fast.exposed_comm_s < slow.exposed_comm_s
    # At 1 Gbit/s, 16 MiB gathered twice and reduce-scattered once (7/8 of it each) cannot
    # hide behind 0.3 s of compute: at least that time minus the compute is exposed.
    wire = 3 * 7 / 8 * (16 << 20) * 8 / 1e9
    assert slow.exposed_comm_s >= wire - 0.3
    kept = predict_sharded(run, 8, Link.rated(1e9), units, False)
    assert kept.exposed_comm_s < slow.exposed_comm_s  # no all-gather in the backward


def test_the_fsdp_reduce_scatter_on_gloo_costs_an_all_reduce_of_the_unit() -> None:
    """ProcessGroupGloo reduce-scatters by an all-reduce of the whole unit (measured on
    the lab: as long as the all-reduce of the same tensor); NCCL by a ring of half that."""
    from ddp_template.tools.scaling import Link, predict_sharded

    units = [{"name": "root", "bytes": 0}, {"name": "Block", "bytes": 64 << 20}]
    link = Link.rated(1e9, latency_s=0.0)
    # Almost no compute and no all-gather in the backward: the collectives are the step.
    gloo, nccl = (
        predict_sharded(
            _run(forward_s=1e-6, backward_s=1e-6, shapes=[], backend=backend), 8, link, units, False
        )
        for backend in ("gloo", "nccl")
    )
    unit_time = (64 << 20) * 8 / 1e9
    assert nccl.exposed_comm_s == pytest.approx(2 * 7 / 8 * unit_time, rel=1e-3)
    assert gloo.exposed_comm_s == pytest.approx(3 * 7 / 8 * unit_time, rel=1e-3)
