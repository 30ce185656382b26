"""The scaling model (`python -m ddp_template.tools.scaling`): its buckets are DDP's, its
predictions move the way the physics says, and bad input is one paragraph. (Its figures
against measured 2-node steps: benchmarks/comm_lab.py, docs/nodes.md.)"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ddp_template.errors import ConfigError
from ddp_template.tools.scaling import (
    Link,
    MeasuredRun,
    Prediction,
    Transfer,
    buckets,
    overlapped_backward,
    parse_buckets,
    parse_nodes,
    predict,
    probe_hook_costs,
    recommend,
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
    # The longer of the bits' time and the 2 (W - 1) waits, not their sum (the ring's
    # segments in flight hide one behind the other): a slow hop bounds a small bucket,
    # a fast one leaves the bits' time.
    slow_hops = Link.rated(1e9, latency_s=wire)
    assert predict(run, 4, "none", slow_hops, 0.0, 100).exposed_comm_s == pytest.approx(6 * wire)
    fast_hops = Link.rated(1e9, latency_s=wire / 12)
    assert predict(run, 4, "none", fast_hops, 0.0, 100).exposed_comm_s == pytest.approx(wire)


def _gloo_ring_segments(elements: int, world: int, element_bytes: int = 4) -> list[int]:
    """Bytes of each segment gloo's ring all-reduce cuts a tensor into (gloo/allreduce.cc,
    `ring`: at least 2 W segments, a multiple of W, each rounded up to whole elements;
    a segment past the end is empty and not sent). Large tensors make more segments, of
    at most gloo's largest segment; the probe's small one is far below it."""
    total = elements * element_bytes
    count = math.ceil(2 * world / world) * world
    size = math.ceil(math.ceil(total / count) / element_bytes) * element_bytes
    return [max(0, min(size, total - k * size)) for k in range(count)]


def test_the_latency_probe_puts_data_on_every_hop_of_gloos_ring() -> None:
    """The probe's small all-reduce makes every hop a bucket makes: no segment of gloo's
    ring is empty at any world size, while the 8 floats it used to send leave half the
    segments empty at 8 nodes (those hops are skipped: it read 1.7-2.1 ms a hop on the
    lab where all-reduces of 4 to 64 KiB waited 4.7-4.9)."""
    from ddp_template.tools.allreduce_probe import latency_elements

    for world in (2, 3, 4, 5, 8, 13, 32, 128, 1024):
        segments = _gloo_ring_segments(latency_elements(world), world)
        assert len(segments) == 2 * world and min(segments) > 0, world
        assert latency_elements(world) * 4 <= 32 * 2 * world  # small: the waits, not bytes
    assert _gloo_ring_segments(8, 8).count(0) == 8


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


def _cpu_probed(cores: float, per_call: float, per_byte: float) -> Link:
    rates = {"float32": 1e9, "float16": 1e9, "bfloat16": 1e9}
    return Link.probed(
        {
            "latency_s": 1e-4,
            "bandwidth_bps": rates,
            "under_compute": {
                "latency_s": 1e-4,
                "bandwidth_bps": 1e9,
                "compute_share": 1.0,
                "cores": cores,
                "cores_while_communicating": cores,
            },
            "cpu_s_per_all_reduce": per_call,
            "cpu_s_per_byte": dict.fromkeys(rates, per_byte),
        }
    )


def test_a_rank_bound_by_its_cpu_takes_that_cpu_then_the_exposed_communication() -> None:
    """A rank on 0.2 of a core that spent 0.19 s of CPU in a one-node step of 0.95 s (its
    quota's worth) spends the collectives' CPU on top, each call and each byte it sends
    counted: the step is at least that CPU over 0.2 core, then the communication the
    schedule leaves exposed (the lab's nodes did not overlap the two). The collectives' CPU
    is counted once: the schedule then runs uncontended. A rate, or a run that did not
    record its CPU, keeps the schedule alone."""
    shapes = [[1024, 1024]] * 8  # 32 MiB of float32 gradients
    run = _run(shapes=shapes, cpu_s_per_step=0.19)
    per_call, per_byte = 1e-3, 2e-9
    link = _cpu_probed(0.2, per_call, per_byte)
    rated = Link.rated(1e9, 1e-4)  # the same link, uncontended, no CPU figures
    sent = 2 * 7 / 8 * 32 * 2**20
    for hook, cap, cost, calls, wire_bytes in (
        ("none", 100, 0.0, 1, sent),  # one bucket; the run broadcasts no buffers
        ("fp16", 100, 0.0, 1, sent / 2),  # half the bytes
        ("none", 1, 0.0, len(shapes), sent),  # a bucket per gradient: a call each
        ("none", 100, 0.5, 1, sent),  # the hook's compute at the run's 0.2 of a core
    ):
        cpu = 0.19 + cost * 0.19 / 0.95 + calls * per_call + wire_bytes * per_byte
        p = predict(run, 8, hook, link, cost, cap)
        schedule = predict(run, 8, hook, rated, cost, cap)
        assert schedule.cpu_floor_s is None
        floor = cpu / 0.2 + schedule.exposed_comm_s + run.data_wait_s
        assert p.cpu_floor_s == pytest.approx(floor), (hook, cap, cost)
        assert p.rank_cpu_s == pytest.approx(cpu), (hook, cap, cost)
        assert p.step_s == pytest.approx(max(floor, schedule.step_s))
        assert p.compute_s + p.exposed_comm_s + p.data_wait_s == pytest.approx(p.step_s)
    assert (
        predict(run, 8, "none", link, 0.0, 100).step_s
        > predict(run, 8, "none", rated, 0.0, 100).step_s
    )
    assert predict(_run(shapes=shapes), 8, "none", link, 0.0, 100).cpu_floor_s is None
    # The command prints the floor and the rank's CPU it assumed.
    lines = report(run, [8], link, ["none"], {"none": 0.0}, None, [100])
    cpu = 0.19 + per_call + sent * per_byte
    assert (
        f"CPU floor {cpu / 0.2 + predict(run, 8, 'none', rated, 0.0, 100).exposed_comm_s + run.data_wait_s:.3f} s (a rank's CPU {cpu:.3f} s a step)"
        in lines[2]
    )
    assert "0.200 of a core while computing and all-reducing, 1000 us per all-reduce, 2.00 ns" in (
        link.describe()
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
    measured = json.loads(outputs[0].strip().splitlines()[-1])
    busy = measured["under_compute"]
    assert 0 < busy["compute_share"] <= 1
    assert busy["bandwidth_bps"] > 0 and busy["latency_s"] > 0
    assert measured["all_gather_bandwidth_bps"] > 0
    assert len(measured["all_gather_readings_bps"]) == 5
    # DDP's buffer broadcast, idle and right after a burst of compute on every rank.
    assert measured["broadcast_s"] > 0 and measured["forward_broadcast_s"] > 0
    ladder = measured["float32_seconds_by_bytes"]
    assert [size for size, _ in ladder] == [2 * 2 * 8 * 4, 4 << 10, 64 << 10, 1 << 20, 4 << 20]
    assert all(seconds > 0 for _, seconds in ladder)
    link = Link.probed(measured)
    assert link.compute_share == busy["compute_share"]
    assert link.gather_bandwidth_bps == measured["all_gather_bandwidth_bps"]
    assert link.broadcast_round_s == measured["forward_broadcast_s"]  # one round at W = 2
    # What the collectives cost a rank's CPU, and the CPU a rank gets per second.
    assert measured["cpu_s_per_all_reduce"] > 0
    assert all(measured["cpu_s_per_byte"][dtype] > 0 for dtype in ("float32", "float16"))
    assert 0 < busy["cores"] <= os.cpu_count() and busy["cores_while_communicating"] > 0
    assert link.cores == busy["cores_while_communicating"]


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
    # Each bucket the longer of its bits' time and its 2 (W - 1) waits of 50 us.
    assert serial.exposed_comm_s == pytest.approx(
        sum(
            max(sum(sent_bytes(SHAPES[i], 4, "none", 1) for i in group) * 8 / 10e9, 2 * 50e-6)
            for group in buckets(SHAPES, 4, None)
        ),
        rel=0.01,
    )
    # PowerSGD on gloo waits for each bucket inside the backward: nothing hidden there.
    on_gloo = predict(_run(backend="gloo"), 2, "powersgd", link, 0.0, None, overlap=1.0)
    on_nccl = predict(_run(backend="nccl"), 2, "powersgd", link, 0.0, None, overlap=1.0)
    assert on_gloo.exposed_comm_s > on_nccl.exposed_comm_s


def test_a_bucket_goes_on_the_wire_when_the_run_measured_its_gradients_ready() -> None:
    """Where the one-node run recorded when each gradient was ready (a ResNet's last stage,
    most of its bytes, early in the backward), each bucket leaves then, not when the
    backward has produced that share of the bytes; the schedule is the plain recurrence
    from those points. Without the record: the bytes' share."""
    shapes = [[1024, 1024], [256, 256], [64, 64]]  # 4 MiB, 256 KiB, 16 KiB
    run = _run(shapes=shapes, step_s=2.0, forward_s=0.3, backward_s=1.5, data_wait_s=0.0)
    link = Link.rated(200e6, latency_s=1e-6)
    groups = buckets(shapes, 4, 0.1)  # one bucket each
    assert groups == [[0], [1], [2]]
    sizes = [4 * 2**20, 256 * 2**10, 16 * 2**10]
    wire = [2 * 7 / 8 * size * 8 / 200e6 for size in sizes]

    def plain(ready: list[float]) -> float:
        end = 0.0
        for at, seconds in zip(ready, wire, strict=True):
            end = max(end, at) + seconds
        return max(0.0, run.forward_s + end - (run.forward_s + run.backward_s))

    measured = replace(run, ready_fractions=[0.1, 0.5, 0.9])
    early = predict(measured, 8, "none", link, 0.0, 0.1)
    by_bytes = predict(run, 8, "none", link, 0.0, 0.1)
    total = sum(sizes)
    assert early.exposed_comm_s == pytest.approx(plain([0.15, 0.75, 1.35]))
    shares = [sum(sizes[: k + 1]) / total for k in range(3)]
    assert by_bytes.exposed_comm_s == pytest.approx(plain([1.5 * s for s in shares]))
    assert early.step_s < by_bytes.step_s
    # DDP sends the buckets in order: one ready before the bucket ahead of it waits for it.
    out_of_order = replace(run, ready_fractions=[0.6, 0.2, 0.9])
    assert predict(out_of_order, 8, "none", link, 0.0, 0.1).exposed_comm_s == pytest.approx(
        plain([0.9, 0.9, 1.35])
    )


BN_BUFFERS = {"float32": 38_400, "int64": 160}  # resnet18's BatchNorm statistics, counters


@pytest.mark.parametrize(("world", "rounds"), [(2, 1), (4, 2), (5, 3), (8, 3), (1024, 10)])
def test_the_forward_waits_for_the_buffer_broadcast_tree(world: int, rounds: int) -> None:
    """gloo's binomial tree: ceil(log2 W) rounds; the two dtypes in flight together."""
    wait = 4e-3
    link = Link.rated(1e9, latency_s=wait)
    without = predict(_run(), world, "none", link, 0.0, None)
    synced = predict(_run(broadcast_buffer_bytes=BN_BUFFERS), world, "none", link, 0.0, None)
    assert synced.buffer_broadcast_s == pytest.approx(rounds * wait)
    assert synced.step_s - without.step_s == pytest.approx(rounds * wait)
    assert synced.exposed_comm_s - without.exposed_comm_s == pytest.approx(rounds * wait)
    assert predict(_run(broadcast_buffer_bytes=BN_BUFFERS), 1, "none", link, 0.0, None).step_s == (
        pytest.approx(_run().step_s)
    )


def test_a_large_buffer_broadcast_costs_its_bytes_each_round_and_nccl_once() -> None:
    big = {"float32": 100 * 2**20}
    link = Link.rated(1e9, latency_s=1e-3)
    bytes_s = 100 * 2**20 * 8 / 1e9
    on_gloo = predict(_run(broadcast_buffer_bytes=big), 8, "none", link, 0.0, None)
    on_nccl = predict(_run(broadcast_buffer_bytes=big, backend="nccl"), 8, "none", link, 0.0, None)
    assert on_gloo.buffer_broadcast_s == pytest.approx(3 * bytes_s)
    assert on_nccl.buffer_broadcast_s == pytest.approx(max(bytes_s, 7 * 1e-3))
    # Three dtypes: the first two in flight together, the third after them.
    three = {"float32": 8 * 2**20, "int64": 8, "float16": 4 * 2**20}
    p = predict(_run(broadcast_buffer_bytes=three), 2, "none", link, 0.0, None)
    assert p.buffer_broadcast_s == pytest.approx((8 * 2**20 + 4 * 2**20) * 8 / 1e9)


def test_a_probed_broadcast_gives_the_wait_of_each_round() -> None:
    measured = {
        "world": 8,
        "latency_s": 1e-3,
        "bandwidth_bps": {"float32": 1e9, "float16": 1e9, "bfloat16": 1e9},
        "forward_broadcast_s": 0.09,
    }
    link = Link.probed(measured)
    assert link.broadcast_round_s == pytest.approx(0.03)
    at_four = predict(_run(broadcast_buffer_bytes=BN_BUFFERS), 4, "none", link, 0.0, None)
    assert at_four.buffer_broadcast_s == pytest.approx(2 * 0.03)
    assert "buffer broadcast 30000 us per round" in link.describe()


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


def test_each_hook_makes_the_all_reduces_per_bucket_the_model_counts(monkeypatch) -> None:
    """The model's latency rounds per bucket are the all-reduces the hook really makes: one
    for fp16, three one after another for PyTorch's PowerSGD (the vectors sent whole, P,
    Q), counted on a real DDP wrapper of one bucket with the worker's hook and state."""
    import torch.distributed as dist

    from ddp_template.tools.scaling import _probe_model
    from ddp_template.worker.comm_hooks import comm_hook

    real = dist.all_reduce
    calls: list[int] = []

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    run = _run(shapes=[[64, 32], [32], [32, 16]])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for hook in ("fp16", "powersgd"):
            model = _probe_model(run, hook, None)
            per_step = []
            for _ in range(4):  # PowerSGD compresses from its start step (2) on
                calls.clear()
                with monkeypatch.context() as patch:
                    patch.setattr(dist, "all_reduce", counting)
                    model(torch.ones(())).backward()
                per_step.append(len(calls))
            assert per_step[-1] == comm_hook(hook).all_reduces, (hook, per_step)
    finally:
        dist.destroy_process_group()
    # Without a hook DDP all-reduces each bucket once, in C++ (not through dist.all_reduce).
    assert comm_hook("none").all_reduces == 1


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


def _plain_sharded_end(forward, backward, gathers, scatters, regather) -> float:
    """FSDP's schedule with no contention, written out as a recurrence: one collective at
    a time; unit k + 1's all-gather issued as unit k's forward starts; in the backward each
    resharded unit gathered again as the unit after it starts, each unit's gradients
    reduce-scattered once computed."""
    count = len(forward)
    comm = gathers[0]
    gathered = {0: comm}
    compute = 0.0
    for k in range(count):
        start = max(compute, gathered.get(k, 0.0))
        if k + 1 < count:
            comm = max(comm, start) + gathers[k + 1]
            gathered[k + 1] = comm
        compute = start + forward[k]
    gathered = {}
    if regather[-1]:
        comm = max(comm, compute) + gathers[-1]
        gathered[count - 1] = comm
    for k in reversed(range(count)):
        start = max(compute, gathered.get(k, 0.0))
        if k > 0 and regather[k - 1]:
            comm = max(comm, start) + gathers[k - 1]
            gathered[k - 1] = comm
        compute = start + backward[k]
        comm = max(comm, compute) + scatters[k]
    return max(compute, comm)


def test_the_fsdp_schedule_on_a_rated_link_is_the_plain_recurrence() -> None:
    """On a rated link (no contention) the two-lane schedule gives the recurrence's end
    on GPUs (NCCL), and on CPUs (gloo, where FSDP2's collectives block the thread that
    computes) every collective after the compute, on random units, compute, node counts
    and rates."""
    from ddp_template.tools.scaling import predict_sharded, reduce_scatter_factor

    generator = torch.Generator().manual_seed(1)

    def draw(low: float, high: float) -> float:
        return low + (high - low) * float(torch.rand(1, generator=generator))

    for case in range(30):
        count = int(torch.randint(1, 9, (1,), generator=generator))
        sizes = [int(draw(1, 5e7)) for _ in range(count)]
        nodes, rate = (2, 4, 8)[case % 3], (1e8, 1e9, 1e10)[case % 3]
        backend = ("gloo", "nccl")[case % 2]
        reshard = case % 4 < 2
        run = _run(forward_s=draw(0.05, 1), backward_s=draw(0.1, 2), shapes=[], backend=backend)
        link = Link.rated(rate, latency_s=1e-4)
        world = nodes

        def seconds(nbytes: int, factor: float, rate: float = rate, world: int = world) -> float:
            return max(factor * nbytes * 8 / rate, round(factor * world) * 1e-4)

        total = sum(sizes)
        ring, scatter = (world - 1) / world, reduce_scatter_factor(backend, world)
        gathers = [seconds(n, ring) for n in sizes]
        scatters = [seconds(n, scatter) for n in sizes]
        regather = [reshard and k > 0 for k in range(count)]
        if backend == "nccl":
            end = _plain_sharded_end(
                [run.forward_s * n / total for n in sizes],
                [run.backward_s * n / total for n in sizes],
                gathers,
                scatters,
                regather,
            )
        else:
            again = sum(t for t, twice in zip(gathers, regather, strict=True) if twice)
            end = run.forward_s + run.backward_s + sum(gathers) + again + sum(scatters)
        units = [{"name": f"u{k}", "bytes": n} for k, n in enumerate(sizes)]
        predicted = predict_sharded(run, nodes, link, units, reshard)
        assert run.forward_s + run.backward_s + predicted.exposed_comm_s == pytest.approx(
            max(end, run.forward_s + run.backward_s)
        ), case


def test_fsdp_takes_the_probed_all_gather_and_the_contention_ddp_not_the_gather() -> None:
    """A probe that found gloo's all-gather at half the all-reduce's rate makes FSDP's
    predicted step longer and leaves DDP's (which sends no all-gather) as it was; the
    collectives' contention with the compute makes FSDP's longer still."""
    from ddp_template.tools.scaling import predict_sharded

    rates = {"float32": 2e8, "float16": 2e8, "bfloat16": 2e8}
    ring = Link.probed({"latency_s": 1e-3, "bandwidth_bps": rates})
    slow_gather = Link.probed(
        {"latency_s": 1e-3, "bandwidth_bps": rates, "all_gather_bandwidth_bps": 1e8}
    )
    contended = Link.probed(
        {
            "latency_s": 1e-3,
            "bandwidth_bps": rates,
            "all_gather_bandwidth_bps": 1e8,
            "under_compute": {"latency_s": 1e-3, "bandwidth_bps": 1e8, "compute_share": 0.5},
        }
    )
    assert "all-gather float32 100mbit" in slow_gather.describe()
    # Overlapped (on GPUs) the collectives contend with the compute; on CPUs nothing
    # overlaps and there is no contention to count.
    run = _run(forward_s=0.5, backward_s=1.0, shapes=[[1024, 1024]] * 8, backend="nccl")
    units = [{"name": "root", "bytes": 0}] + [{"name": "Block", "bytes": 8 << 20}] * 4
    steps = [predict_sharded(run, 2, link, units, True).step_s for link in (ring, slow_gather)]
    assert steps[1] > steps[0]
    assert predict_sharded(run, 2, contended, units, True).step_s > steps[1]
    on_cpus = replace(run, backend="gloo")
    assert predict_sharded(on_cpus, 2, contended, units, True).step_s == pytest.approx(
        predict_sharded(on_cpus, 2, slow_gather, units, True).step_s
    )
    # With almost no compute to hide behind, the step grows by the gathers' extra time:
    # at 2 nodes they receive (W - 1) / W of the 32 MiB, twice (forward and backward).
    bare = _run(forward_s=1e-6, backward_s=1e-6, shapes=[])
    grew = (
        predict_sharded(bare, 2, slow_gather, units, True).step_s
        - predict_sharded(bare, 2, ring, units, True).step_s
    )
    gathered_bits = 2 * 0.5 * (32 << 20) * 8
    assert grew == pytest.approx(gathered_bits / 1e8 - gathered_bits / 2e8, rel=1e-3)
    assert (
        predict(run, 2, "none", slow_gather, 0.0, 25).step_s
        == predict(run, 2, "none", ring, 0.0, 25).step_s
    )


def test_a_probe_saved_to_a_file_is_a_link_and_a_bad_file_one_paragraph(tmp_path: Path) -> None:
    from ddp_template.tools.scaling import link_of

    measured = {
        "latency_s": 1e-3,
        "bandwidth_bps": {"float32": 2e8, "float16": 1e8, "bfloat16": 1e8},
        "all_gather_bandwidth_bps": 1.5e8,
    }
    saved = tmp_path / "probe.json"
    saved.write_text(json.dumps(measured))
    link = link_of(str(saved), 5e-5, "--link")
    assert link.bandwidth_bps["float16"] == 1e8 and link.latency_s == 1e-3
    assert link.gather_bandwidth_bps == 1.5e8
    assert link_of("1gbit", 5e-5, "--link") == Link.rated(1e9, 5e-5)
    with pytest.raises(ConfigError, match="this file does not exist") as missing:
        link_of(str(tmp_path / "none.json"), 5e-5, "dry_run.link")
    assert "dry_run.link=" in str(missing.value) and "netlab probe --allreduce --save" in str(
        missing.value
    )
    (tmp_path / "other.json").write_text(json.dumps({"latency_s": 1}))
    with pytest.raises(ConfigError, match="not an all-reduce probe's result"):
        link_of(str(tmp_path / "other.json"), 5e-5, "--link")
    with pytest.raises(ConfigError, match="a link rate"):
        link_of("fast", 5e-5, "--link")


def _predicted(hook: str, cap: float | None, step_s: float) -> Prediction:
    return Prediction(8, hook, cap, step_s, 0.0, 0.0, step_s, 1.0, 1.0)


def test_the_recommendation_changes_less_where_the_model_cannot_tell_pairs_apart() -> None:
    """Within 5% of the fastest the model cannot order the pairs: it recommends the one
    that sends the most exact gradients, then the bucket size nearest PyTorch's default;
    a pair faster by more than that is recommended whatever it changes."""

    def pick(*pairs: tuple[str, float | None, float]) -> tuple[str, float | None]:
        best = recommend([_predicted(*pair) for pair in pairs])
        return best.hook, best.bucket_cap_mb

    assert pick(("powersgd", 100, 0.96), ("fp16", 25, 0.97), ("none", 25, 1.0)) == ("none", 25)
    assert pick(("powersgd", 100, 0.531), ("fp16", 1, 0.537), ("fp16", 25, 0.565)) == ("fp16", 1)
    assert pick(("powersgd", 100, 0.50), ("fp16", 1, 0.60)) == ("powersgd", 100)
    powersgd = (("powersgd", 100, 0.535), ("powersgd", 25, 0.542), ("powersgd", 1, 0.596))
    assert pick(*powersgd) == ("powersgd", 25)
    assert pick(("none", 1, 1.0), ("none", 100, 1.04), ("none", None, 1.06)) == ("none", 100)
    assert pick(("none", None, 1.02), ("none", 25, 1.0)) == ("none", 25)


def test_the_report_names_the_faster_pair_it_did_not_recommend() -> None:
    """A tie is said: the recommended line names the fastest pair and its prediction. At
    5 Gbit/s fp16 is predicted 1.003 s a step and none 1.007 s (a tie: none); at 1 Gbit/s
    1.059 and 1.193 s (fp16, no tie)."""
    run = _run(shapes=[[1024, 1024]] * 8)
    costs = {"none": 0.0, "fp16": 0.0}

    def recommended(rate: float) -> str:
        lines = report(run, [2], Link.rated(rate), ["none", "fp16"], costs, None, [25, 100])
        (line,) = [line for line in lines if line.startswith("recommended at nodes=2")]
        return line

    tie = recommended(5e9)
    assert "strategy.comm_hook=none strategy.bucket_cap_mb=25 (predicted step 1.007 s" in tie
    assert "hook=fp16 bucket_cap_mb=25 is predicted 1.003 s, within 5%: a tie" in tie
    clear = recommended(1e9)
    assert "strategy.comm_hook=fp16 strategy.bucket_cap_mb=25 (predicted step 1.059 s" in clear
    assert "a tie" not in clear
