"""What each collective FSDP and DDP use costs on gloo between lab nodes: an all-reduce of a
tensor, an all-gather into a tensor of the same size and a reduce-scatter from one, side
by side at each link rate (the median of 3 after one warm-up, rank 0's clock), and the CPU
time rank 0's process spends on one all-reduce (its user and system time, gloo's threads
included; not the kernel's receive work done on other processes' time).

The ring all-reduce sends 2 (W - 1) / W of the bytes per rank, a ring all-gather or
reduce-scatter (W - 1) / W: the printout shows whether gloo's run as the ring would.

    .venv/bin/python benchmarks/collectives_lab.py --nodes 2,4    # as root, about 1.5 min
    .venv/bin/python benchmarks/collectives_lab.py --nodes 2,8 --rates 200mbit,1gbit --mtus 1500,9000

`--mtus`: the links' MTU, each in turn on the same lab (9000, jumbo frames, is the lab's
default; at 1500 a shaped link wakes the receiver once per small packet).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def on_a_node(rank: int, world: int, master: str, megabytes: float) -> None:
    import torch
    import torch.distributed as dist

    host, port = master.split(":")
    store = dist.TCPStore(host, int(port), world, rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    elements = int(megabytes * 2**20) // 4 // world * world  # a whole shard per rank
    full, shard = torch.ones(elements), torch.ones(elements // world)

    def median_s(collective) -> float:
        collective()
        times = []
        for _ in range(3):
            dist.barrier()
            start = time.perf_counter()
            collective()
            times.append(time.perf_counter() - start)
        return sorted(times)[1]

    # The CPU time the node's process (gloo's threads included) spends on one all-reduce:
    # on a node with a fraction of a core, this work competes with the training's.
    before = resource.getrusage(resource.RUSAGE_SELF)
    dist.all_reduce(full)
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    measured = {
        "all_reduce_cpu_s": cpu_s,
        "all_reduce_s": median_s(lambda: dist.all_reduce(full)),
        "all_gather_s": median_s(lambda: dist.all_gather_into_tensor(full, shard)),
        "reduce_scatter_s": median_s(lambda: dist.reduce_scatter_tensor(shard, full)),
    }
    if rank == 0:
        print(json.dumps(measured), flush=True)


def _mtus(text: str) -> list[int]:
    """`--mtus 1500,9000`; each value's range is the lab's own check (`Lab.up`)."""
    try:
        return [int(m) for m in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not valid: integers separated by commas. Fix: e.g. --mtus 1500,9000"
        ) from None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="2,4")
    parser.add_argument("--rates", default="200mbit,1gbit")
    parser.add_argument("--megabytes", type=float, default=42.6, help="ResNet-18's gradients")
    parser.add_argument(
        "--mtus", type=_mtus, default=None, help="e.g. 1500,9000 (default: the lab's)"
    )
    parser.add_argument("--prefix", default="cl")
    parser.add_argument(
        "--node", nargs=3, metavar=("RANK", "WORLD", "MASTER"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.node:
        on_a_node(int(args.node[0]), int(args.node[1]), args.node[2], args.megabytes)
        return 0
    from ddp_template.tools.netlab import DEFAULT_MTU, Lab, parse_rate

    mtus = args.mtus or [DEFAULT_MTU]
    print(
        "| nodes | MTU | link | all-reduce s | all-gather s | reduce-scatter s "
        "| ring's all-gather s | CPU s of rank 0 per all-reduce |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for nodes, mtu in ((int(n), m) for n in args.nodes.split(",") for m in mtus):
        lab = Lab.up(nodes=nodes, rate=args.rates.split(",")[0], prefix=args.prefix, mtu=mtu)
        try:
            for rate in args.rates.split(","):
                lab.set_rate(parse_rate(rate))
                master = f"{lab.nodes[0].address}:29777"
                command = [sys.executable, __file__, "--megabytes", str(args.megabytes), "--node"]
                procs = [
                    lab.popen(
                        n.index,
                        [*command, str(n.index), str(nodes), master],
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                    for n in lab.nodes
                ]
                outputs = [p.communicate(timeout=600)[0] for p in procs]
                if any(p.returncode for p in procs):
                    raise RuntimeError(f"a node failed at {nodes} nodes, {rate}")
                m = json.loads(outputs[0].strip().splitlines()[-1])
                ring = (nodes - 1) / nodes * args.megabytes * 2**20 * 8 / parse_rate(rate)
                print(
                    f"| {nodes} | {mtu} | {rate} | {m['all_reduce_s']:.3f} | {m['all_gather_s']:.3f} | "
                    f"{m['reduce_scatter_s']:.3f} | {ring:.3f} | {m['all_reduce_cpu_s']:.3f} |",
                    flush=True,
                )
        finally:
            lab.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
