"""The template's benchmark step written by hand in plain PyTorch: the reference that
`benchmarks/overhead.py` compares the template against.

Same model (torchvision ResNet, small-input stem), same synthetic data, same per-device batch,
optimizer, learning-rate schedule, precision and step count as
`python train.py experiment=benchmark recipe=baseline` (or `recipe=amp`), and the same
timing rule as the template's SpeedMonitor: a step lasts from the end of the previous step
to the end of this one; warm-up steps and the first step of each epoch are not timed.

    torchrun --standalone --nproc-per-node 2 benchmarks/raw_ddp.py --out raw.json

It does not set torch's OpenMP thread policy itself (`train.py` sets `GOMP_SPINCOUNT=10000`
before torch loads): `benchmarks/overhead.py` exports the same policy to both sides.

`--milestones FILE`: rank 0 also writes when it reached each point of its start-up (for
`benchmarks/startup.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
from milestones import process_start_time
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from ddp_template.tasks.image_classification.model import build_resnet
from ddp_template.tasks.image_classification.sources import Synthetic


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file for rank 0's figures")
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--num-samples", type=int, default=2048)
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--precision", default="32-true", choices=["32-true", "16-mixed"])
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--milestones", help="JSON file for rank 0's start-up milestones")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    times = {"worker_created": process_start_time()}
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    # As the template does: each local rank gets its share of the cores.
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_world))
    torch.manual_seed(args.seed)

    train_set, _, _ = Synthetic(num_samples=args.num_samples, image_size=args.image_size).splits()
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    times["ready"] = time.time()

    model = build_resnet(args.arch, num_classes=10, in_channels=3, small_input=True).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank] if cuda else None)
    total_steps = args.warmup_steps + args.steps
    optimizer = torch.optim.SGD(
        model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4, nesterov=True
    )
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total_steps)
    criterion = torch.nn.CrossEntropyLoss()
    mixed = args.precision == "16-mixed"
    # fp16 with a loss scaler on CUDA; bf16 on the CPU (as Lightning does for 16-mixed).
    dtype = torch.float16 if cuda else torch.bfloat16
    scaler = torch.amp.GradScaler("cuda", enabled=mixed and cuda)

    periods, step = [], 0
    epoch = 0
    while step < total_steps:
        sampler.set_epoch(epoch)
        previous_end = None
        for images, labels in loader:
            times.setdefault("first_step_start", time.time())
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            autocast = torch.autocast(device.type, dtype=dtype) if mixed else nullcontext()
            with autocast:
                loss = criterion(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if cuda:
                torch.cuda.synchronize(device)
            end = time.perf_counter()
            times.setdefault("first_step_end", time.time())
            times["last_step_end"] = time.time()
            if step >= args.warmup_steps and previous_end is not None:
                periods.append(end - previous_end)
            previous_end = end
            step += 1
            if step == total_steps:
                break
        epoch += 1

    if dist.get_rank() == 0:
        figures = {
            "step_time_median_s": float(np.median(periods)),
            "step_time_p90_s": float(np.percentile(periods, 90)),
            "measured_steps": len(periods),
            "samples_per_sec": args.batch_size
            * dist.get_world_size()
            * len(periods)
            / sum(periods),
            "sigterm_broadcast_s": _time_sigterm_broadcast(device),
        }
        with open(args.out, "w") as file:
            json.dump(figures, file, indent=2)
        if args.milestones:
            with open(args.milestones, "w") as file:
                json.dump(times, file)
    else:
        _time_sigterm_broadcast(device)
    dist.destroy_process_group()


def _time_sigterm_broadcast(device: torch.device, calls: int = 200) -> float:
    """Seconds per call of what Lightning (>= 2.5.2) runs before every training step with
    more than one rank: a broadcast of a SIGTERM flag from rank 0 and a host sync on it."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        flag = torch.tensor([0], device=device)
        dist.broadcast(flag, src=0)
        flag.item()
    return (time.perf_counter() - start) / calls


if __name__ == "__main__":
    main()
