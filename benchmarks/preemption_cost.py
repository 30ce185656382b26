"""What the preemption check costs per training step, side by side: no check (a run not
under SLURM: the callback is off); the check a SLURM job made before it was deferred (an
all-reduce of the flag read at once, plus the broadcast of rank 0's SIGTERM flag that
Lightning's loop reads before every step: two host syncs per step); the blocking check alone
(`callbacks.preemption.decide_after_steps=0`); and the deferred one (each all-reduce read
`decide_after_steps` steps later, the default 2; Lightning's broadcast off).

Every rank runs the same small DDP training loop (an MLP on random data) in the three
modes, alternating their order between repetitions, and times each step and the check
inside it (`ddp_template.resume.preemption.FlagAgreement.step`, what the callback calls at every
optimizer step). Prints one line per repetition and mode, then the medians, per step in
microseconds: the step, the check, the step's extra time over no check, and the check's
ratio to the deferred one. The figures are the slowest rank's (each step waits for it).

    .venv/bin/python benchmarks/preemption_cost.py                 # 2 gloo ranks on CPUs
    .venv/bin/python benchmarks/preemption_cost.py --ranks 1 --device cuda   # nccl, 1 GPU

On a GPU the blocking check also makes the host wait for the device's queue every step,
which no CPU run shows. Others' work on the same cores shows up in the figures.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SRC = Path(__file__).resolve().parents[1] / "src"

# The lag of each mode's all-reduce (None: no check); "before" adds Lightning's broadcast.
MODES = {"none": None, "before": 0, "blocking": 0, "deferred": 2}
LABELS = {
    "none": "no check (not launcher=slurm)",
    "before": "before: blocking + Lightning's bcast",
    "blocking": "blocking (decide_after_steps=0)",
    "deferred": "deferred (decide_after_steps=2)",
}


def _lightnings_sigterm_broadcast(device: torch.device) -> None:
    """What `_broadcast_sigterm_tensor` of Lightning's training loop does before a step."""
    flag = torch.tensor([0], device=device)
    dist.broadcast(flag, src=0)
    flag.item()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    return parser.parse_args()


def _steps(args, model, optimizer, data, agreement, broadcast: bool, count: int):
    """`count` training steps; per step, its time and the check's time (seconds)."""
    step_times, check_times = [], []
    for _ in range(count):
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        model(data).square().mean().backward()
        optimizer.step()
        checked = time.perf_counter()
        if broadcast:
            _lightnings_sigterm_broadcast(data.device)
        if agreement is not None:
            agreement.step(0)
        ended = time.perf_counter()
        step_times.append(ended - started)
        check_times.append(ended - checked)
    if agreement is not None:
        agreement.drain()
    if args.device == "cuda":
        torch.cuda.synchronize()
    return step_times, check_times


def worker(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    # Here, not at the top: the launching process has no use for Lightning's import time.
    sys.path.insert(0, str(SRC))
    from ddp_template.resume.preemption import FlagAgreement

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=args.ranks)
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(rank)
    layers = [torch.nn.Linear(args.width, args.width) for _ in range(3)]
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(*layers).to(device),
        device_ids=[rank] if device.type == "cuda" else None,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.randn(args.batch_size, args.width, device=device)
    for repeat in range(args.repeats):
        order = list(MODES) if repeat % 2 == 0 else list(reversed(MODES))
        for mode in order:
            lag, broadcast = MODES[mode], mode == "before"
            for count in (args.warmup_steps, args.steps):
                agreement = FlagAgreement(lag, device) if lag is not None else None
                step_times, check_times = _steps(
                    args, model, optimizer, data, agreement, broadcast, count
                )
            mine = torch.tensor(
                [statistics.median(step_times), statistics.median(check_times)],
                dtype=torch.float64,
                device=device,
            )
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)
            if rank == 0:
                queue.put((repeat, mode, float(mine[0]), float(mine[1])))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    args = parse_args()
    context = mp.get_context("spawn")
    queue = context.Queue()
    mp.start_processes(
        worker, args=(args, _free_port(), queue), nprocs=args.ranks, start_method="spawn"
    )
    rows = [queue.get() for _ in range(args.repeats * len(MODES))]
    backend = "nccl" if args.device == "cuda" else "gloo"
    print(
        f"{args.ranks} {backend} rank(s), MLP {args.width}x3, batch {args.batch_size}, "
        f"{args.steps} steps per mode and repetition; per step, slowest rank's median"
    )
    header = f"{'mode':38} {'step us':>9} {'check us':>9} {'extra us':>9} {'check ratio':>12}"
    medians: dict[str, tuple[float, float]] = {}
    for mode in MODES:
        mine = [r for r in rows if r[1] == mode]
        medians[mode] = (
            statistics.median(r[2] for r in mine),
            statistics.median(r[3] for r in mine),
        )
    for repeat in range(args.repeats):
        for mode in MODES:
            (row,) = [r for r in rows if r[0] == repeat and r[1] == mode]
            print(
                f"  repetition {repeat}  {mode:9} step {row[2] * 1e6:8.1f} us  "
                f"check {row[3] * 1e6:8.1f} us"
            )
    print(header)
    base_step = medians["none"][0]
    deferred_check = medians["deferred"][1]
    for mode in MODES:
        step, check = medians[mode]
        ratio = f"{check / deferred_check:.1f}x" if mode != "none" and deferred_check else "-"
        print(
            f"{LABELS[mode]:38} {step * 1e6:9.1f} {check * 1e6:9.1f} "
            f"{(step - base_step) * 1e6:9.1f} {ratio:>12}"
        )


if __name__ == "__main__":
    main()
