"""What an all-reduce really costs between nodes: a short gloo probe, one process per node.

    python -m ddp_template.tools.allreduce_probe --rank R --world W --master HOST:PORT

Rank 0 prints one JSON line: the latency of a small all-reduce (per ring hop) and, for each
dtype DDP's hooks send (float32: none and PowerSGD, float16, bfloat16), the effective
bandwidth of a large one in bit/s, counted as the model counts it (each rank sends
2 (W - 1) / W of the bytes); and of FSDP's all-gather (float32), counted as a ring's.
That folds in what the link rate alone does not say: the TCP stack's and gloo's cost on
the node's cores, and gloo's summation of half-width numbers on the CPU. Each figure is
the median of several readings, which are kept beside it (`latency_readings_s`,
`bandwidth_readings_bps`): `ddp_template.tools.netlab`'s `Lab.allreduce_probe` runs it on
every node and warns when they disagree.

The small all-reduce puts data on every hop of gloo's ring (`latency_elements`): gloo cuts
a tensor into at least 2 W segments and sends none of the empty ones, so a tensor of
fewer elements (8 floats at 8 nodes) makes fewer hops than any bucket DDP sends: it read
1.7-2.1 ms a hop on the 8-node lab where all-reduces of 4 KiB to 64 KiB waited 4.7-4.9
(docs/nodes.md, "Small all-reduces on the lab"). The model (`ddp_template.tools.scaling`)
takes the longer of the latency's time and the bandwidth's, not their sum (gloo keeps two
segments in flight, a hop's wait hides behind the next segment's transfer), so the large
all-reduce's time is counted as all bandwidth.

`forward_broadcast_s` is DDP's broadcast of the module's buffers (BatchNorm's running
statistics) at the start of each forward (`strategy.forward_sync_buffers`): torch's own
coalesced broadcast of a small float32 and a small int64 tensor from rank 0, timed on rank 0
right after every rank has computed a burst, as the forward follows the optimizer's step.
gloo's broadcast is a binomial tree (gloo/broadcast.cc: ceil(log2 W) rounds, each a whole
send that waits for the receiver), so rank 0 waits for its children to come out of their
compute. On the 8-node lab at 0.2 core the jobs' forward lost 18 to 203 ms to it, where
this probe read 1.4 ms idle and 19 ms after its burst: a burst of equal work on every node
is not a training step (docs/nodes.md, "The forward's buffer broadcast").

`under_compute` measures the same all-reduces again while every rank computes (a loop of
matrix products on its main thread, as the backward computes while DDP's buckets are on
the wire): the latency and float32 bandwidth then, and the share of the compute's speed
left to it; and the CPU a rank gets per second (`cores`: computing alone, every rank
computing; `cores_while_communicating`: computing while the large all-reduces run).
`cpu_s_per_all_reduce` and `cpu_s_per_byte` (per dtype, per byte a rank sends) are the
CPU time the collectives cost a rank (`time.process_time()`: every thread of the
process, the kernel's work for its sockets included): on a node of a fraction of a core
that CPU is part of the step (the scaling model's CPU lane). On a node with cores to
spare both stay as they were; on a node with a fraction of a core gloo's threads and the
compute take turns on it, and the scaling model (`ddp_template.tools.scaling`) runs its
overlapped schedule at those speeds.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import threading
import time
from datetime import timedelta

DTYPES = ("float32", "float16", "bfloat16")
# Each contended reading spans this long: many periods (100 ms) of a cgroup's cpu quota.
CONTENDED_S = 2.0
# The compute of the contended readings: a matrix product of this side, one thread.
COMPUTE_SIDE = 256


def measure(megabytes: float, repeats: int) -> dict[str, object]:
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    hops = 2 * (world - 1)
    small = torch.zeros(latency_elements(world))
    for _ in range(3):
        dist.all_reduce(small)
    cpu = time.process_time()
    latencies = [_timed(lambda: dist.all_reduce(small)) / hops for _ in range(10)]
    # A call's own CPU (every thread of the process, the kernel's work for its sockets
    # included): the hops' sends and receives, whatever the bytes.
    cpu_per_call = (time.process_time() - cpu) / len(latencies)
    latency = statistics.median(latencies)
    bandwidth, readings, cpu_per_byte = {}, {}, {}
    for name in DTYPES:
        dtype = getattr(torch, name)
        tensor = torch.ones(int(megabytes * 2**20) // torch.finfo(dtype).bits * 8, dtype=dtype)
        dist.all_reduce(tensor)
        sent = 2 * (world - 1) / world * tensor.numel() * tensor.element_size()
        cpu = time.process_time()
        readings[name] = [
            sent * 8 / _timed(lambda t=tensor: dist.all_reduce(t)) for _ in range(repeats)
        ]
        # gloo's copies and sums and the kernel's network path, per byte a rank sends. The
        # call's own CPU is not taken off: a few large calls, against a figure read on the
        # small ones, it is noise that could leave nothing (a zero read once, CI's machine
        # busy with other tests); it is a small part of what a large all-reduce costs.
        cpu_per_byte[name] = (time.process_time() - cpu) / (sent * repeats)
        bandwidth[name] = statistics.median(readings[name])
    by_size = size_ladder(world, repeats)
    gather = all_gather_readings(megabytes, repeats)
    # The medians are the result; the readings show how far one probe can be trusted.
    return {
        "world": world,
        "latency_s": latency,
        "bandwidth_bps": bandwidth,
        "all_gather_bandwidth_bps": statistics.median(gather),
        "latency_readings_s": latencies,
        "bandwidth_readings_bps": readings,
        "all_gather_readings_bps": gather,
        "float32_seconds_by_bytes": by_size,
        "broadcast_s": statistics.median(buffer_broadcast_readings(repeats, burst_s=0.0)),
        "forward_broadcast_s": statistics.median(buffer_broadcast_readings(repeats)),
        "under_compute": under_compute(megabytes, latency, bandwidth["float32"]),
        "cpu_s_per_all_reduce": cpu_per_call,
        "cpu_s_per_byte": cpu_per_byte,
    }


def latency_elements(world: int) -> int:
    """Elements of the probe's small all-reduce: 8 floats in each of the 2 W segments gloo's
    ring cuts it into (gloo/allreduce.cc: at least 2 W segments, each rounded up to whole
    elements, the empty ones not sent), so that every hop carries data as DDP's buckets'
    do. 32 bytes a segment: the time is the hops' waits, not the bytes."""
    return 2 * world * 8


# Float32 elements of the ladder's all-reduces after the small one: 4 KiB to 4 MiB.
LADDER_ELEMENTS = (1 << 10, 1 << 14, 1 << 18, 1 << 20)


def size_ladder(world: int, repeats: int) -> list[list[float]]:
    """[bytes, seconds] of float32 all-reduces from the small one to 4 MiB, each the median
    of `repeats` readings: where the latency's time gives way to the bandwidth's, and
    whether the two add up or the longer one counts (the model's assumption, printed
    beside them by `netlab probe --allreduce`)."""
    import torch
    import torch.distributed as dist

    ladder = []
    for elements in (latency_elements(world), *LADDER_ELEMENTS):
        tensor = torch.zeros(elements)
        dist.all_reduce(tensor)
        seconds = [_timed(lambda t=tensor: dist.all_reduce(t)) for _ in range(repeats)]
        ladder.append([float(elements * 4), statistics.median(seconds)])
    return ladder


# What the probe broadcasts as DDP broadcasts a model's buffers: float32 statistics and an
# int64 counter, small enough that the time is the tree's rounds, not the bytes.
BUFFER_BYTES = {"float32": 4096, "int64": 8}
# The compute before each broadcast: long enough to span many periods of a node's quota.
BURST_S = 0.05


def buffer_broadcast_readings(repeats: int, burst_s: float = BURST_S) -> list[float]:
    """Seconds of DDP's buffer broadcast (`_broadcast_coalesced` of BUFFER_BYTES from rank
    0, DDP's call), each after every rank has computed the same matrix products (rank 0's
    count for `burst_s` of its own compute; none for 0), as read on rank 0."""
    import torch
    import torch.distributed as dist

    buffers = [
        torch.zeros(nbytes // getattr(torch, name).itemsize, dtype=getattr(torch, name))
        for name, nbytes in BUFFER_BYTES.items()
    ]
    group = dist.group.WORLD

    def broadcast() -> None:
        coalesced = getattr(dist, "_broadcast_coalesced", None)
        if coalesced is None:  # torch without it: one broadcast per dtype, as it does
            for buffer in buffers:
                dist.broadcast(buffer, 0)
        else:
            coalesced(group, buffers, 250 * 2**20, 0)

    a, b = torch.randn(COMPUTE_SIDE, COMPUTE_SIDE), torch.randn(COMPUTE_SIDE, COMPUTE_SIDE)
    products = _agreed(round(_compute_rate(a, b, burst_s) * burst_s)) if burst_s else 0
    broadcast()
    readings = []
    for _ in range(max(repeats, 5)):
        for _ in range(products):
            torch.mm(a, b)
        readings.append(_timed(broadcast))
    return readings


def all_gather_readings(megabytes: float, repeats: int) -> list[float]:
    """FSDP's all-gather (`all_gather_single`, float32) of `megabytes` gathered, each
    rank giving 1/W: effective bit/s counted as a ring counts it (each rank receives
    (W - 1) / W of the bytes over W - 1 hops). gloo's is not a ring and at 2 nodes takes
    about 1.5x a ring's time (docs/fsdp.md): the FSDP model takes this figure, not the
    all-reduce's."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    shard = torch.ones(int(megabytes * 2**20) // 4 // world)
    full = torch.empty(shard.numel() * world)
    # FSDP2's call (torch 2.14's DefaultAllGather); the older name before it existed.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(full, shard)
    received = (world - 1) * shard.numel() * 4
    return [received * 8 / _timed(lambda: gather(full, shard)) for _ in range(repeats)]


def under_compute(megabytes: float, latency_s: float, bandwidth_bps: float) -> dict[str, float]:
    """The all-reduces of `measure` while every rank computes: per-hop latency, float32
    bandwidth (counted as `measure` counts it) and `compute_share`, the compute's speed
    then over its speed alone (1: communication costs the compute nothing)."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    hops = 2 * (world - 1)
    small = torch.zeros(latency_elements(world))
    tensor = torch.ones(int(megabytes * 2**20) // 4)
    sent = 2 * (world - 1) / world * tensor.numel() * 4
    # Every rank runs the same number of all-reduces: rank 0's count, from its readings alone.
    small_count = _agreed(math.ceil(CONTENDED_S / max(hops * latency_s, 1e-6)))
    large_count = _agreed(
        math.ceil(CONTENDED_S / max(sent * 8 / bandwidth_bps, hops * latency_s, 1e-6))
    )
    a, b = torch.randn(COMPUTE_SIDE, COMPUTE_SIDE), torch.randn(COMPUTE_SIDE, COMPUTE_SIDE)
    alone, cores_alone = _cores_used(lambda: _compute_rate(a, b, CONTENDED_S))
    small_s, _ = _while_computing(lambda: dist.all_reduce(small), min(small_count, 5000), a, b)
    (large_s, rate), cores = _cores_used(
        lambda: _while_computing(lambda: dist.all_reduce(tensor), min(large_count, 50), a, b)
    )
    return {
        "latency_s": small_s / hops,
        "bandwidth_bps": sent * 8 / large_s,
        "compute_share": min(1.0, rate / alone),
        "cores": cores_alone,
        "cores_while_communicating": cores,
    }


def _cores_used(action):
    """The action's result, and the CPU seconds the process spent per second meanwhile:
    on a node under a cpu quota, the share of a core it gets (every rank busy alike)."""
    cpu, start = time.process_time(), time.perf_counter()
    result = action()
    return result, (time.process_time() - cpu) / max(time.perf_counter() - start, 1e-9)


def _agreed(count: int) -> int:
    import torch
    import torch.distributed as dist

    agreed = torch.tensor([max(1, count)])
    dist.broadcast(agreed, 0)
    return int(agreed)


def _compute_rate(a, b, seconds: float) -> float:
    """Matrix products per second on this thread, alone."""
    import torch

    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, b)
        count += 1
    return count / (time.perf_counter() - start)


def _while_computing(collective, count: int, a, b) -> tuple[float, float]:
    """Seconds per collective, run `count` times on a second thread, and matrix products
    per second on this one meanwhile."""
    import torch

    elapsed: list[float] = []

    def communicate() -> None:
        start = time.perf_counter()
        for _ in range(count):
            collective()
        elapsed.append(time.perf_counter() - start)

    thread = threading.Thread(target=communicate, daemon=True)
    products, start = 0, time.perf_counter()
    thread.start()
    while thread.is_alive():
        torch.mm(a, b)
        products += 1
    wall = time.perf_counter() - start
    thread.join()
    return elapsed[0] / count, products / wall


def _timed(action) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--master", required=True, help="HOST:PORT of rank 0")
    parser.add_argument("--megabytes", type=float, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master}",
        rank=args.rank,
        world_size=args.world,
        timeout=timedelta(seconds=120),
    )
    result = measure(args.megabytes, args.repeats)
    if args.rank == 0:
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
