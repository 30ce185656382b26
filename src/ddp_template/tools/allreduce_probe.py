"""What an all-reduce really costs between nodes: a short gloo probe, one process per node.

    python -m ddp_template.tools.allreduce_probe --rank R --world W --master HOST:PORT

Rank 0 prints one JSON line: the latency of a tiny all-reduce (per ring hop) and, for each
dtype DDP's hooks send (float32: none and PowerSGD, float16, bfloat16), the effective
bandwidth of a large one in bit/s, counted as the model counts it (each rank sends
2 (W - 1) / W of the bytes). That folds in what the link rate alone does not say: the
TCP stack's and gloo's cost on the node's cores, and gloo's summation of half-width
numbers on the CPU. Each figure is the median of several readings, which are kept beside it
(`latency_readings_s`, `bandwidth_readings_bps`): `ddp_template.tools.netlab`'s
`Lab.allreduce_probe` runs it on every node and warns when they disagree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import timedelta

DTYPES = ("float32", "float16", "bfloat16")


def measure(megabytes: float, repeats: int) -> dict[str, object]:
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    hops = 2 * (world - 1)
    tiny = torch.zeros(8)
    for _ in range(3):
        dist.all_reduce(tiny)
    latencies = [_timed(lambda: dist.all_reduce(tiny)) / hops for _ in range(10)]
    latency = statistics.median(latencies)
    bandwidth, readings = {}, {}
    for name in DTYPES:
        dtype = getattr(torch, name)
        tensor = torch.ones(int(megabytes * 2**20) // torch.finfo(dtype).bits * 8, dtype=dtype)
        dist.all_reduce(tensor)
        sent = 2 * (world - 1) / world * tensor.numel() * tensor.element_size()
        readings[name] = [
            sent * 8 / max(_timed(lambda t=tensor: dist.all_reduce(t)) - hops * latency, 1e-9)
            for _ in range(repeats)
        ]
        bandwidth[name] = statistics.median(readings[name])
    # The medians are the result; the readings show how far one probe can be trusted.
    return {
        "world": world,
        "latency_s": latency,
        "bandwidth_bps": bandwidth,
        "latency_readings_s": latencies,
        "bandwidth_readings_bps": readings,
    }


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
