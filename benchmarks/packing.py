"""What packing a sweep gains: the same sweep of one-device jobs run one after another and
side by side (`launcher=packed`).

A sweep of `--jobs` jobs (`seed=1,2,...`), each a one-process benchmark job limited to one CPU
core, the way a one-GPU job is limited to its GPU:

- sequential: Hydra's own launcher, the sweep confined to one core (every job then trains on
  that core, one after another);
- packed: `launcher=packed` on `--cores` cores: as many jobs at once as cores, each on its own.

The two run alternately, several times; the script prints each pair's wall times, the
medians and, as its last line, `packing speed-up: X` (median sequential / median packed).
The ideal is the number of cores (fewer when the jobs do not divide evenly).

    .venv/bin/python benchmarks/packing.py                 # 4 jobs on 2 cores, 3 repetitions
    .venv/bin/python benchmarks/packing.py --tiny          # tiny jobs, once (for a test)

Others' work on the same cores shows up in the figures: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument(
        "--tiny", action="store_true", help="one repetition of 10-step jobs on 16x16 images"
    )
    args = parser.parse_args()
    if args.tiny:
        args.repeats, args.steps, args.batch_size, args.image_size = 1, 10, 16, 16
    available = sorted(os.sched_getaffinity(0))
    if len(available) < args.cores:
        sys.exit(f"--cores {args.cores}: this process may use {len(available)} core(s) only")
    args.core_ids = available[: args.cores]
    return args


def sweep_command(args: argparse.Namespace, folder: Path, packed: bool) -> list[str]:
    seeds = ",".join(str(seed) for seed in range(1, args.jobs + 1))
    return [
        sys.executable,
        str(ROOT / "train.py"),
        "-m",
        *(["launcher=packed"] if packed else []),
        "experiment=benchmark",
        "accelerator=cpu",
        "devices=1",
        "benchmark.warmup_steps=1",
        f"benchmark.steps={args.steps}",
        f"data.batch_size={args.batch_size}",
        f"data.image_size={args.image_size}",
        f"seed={seeds}",
        f"hydra.sweep.dir={folder}",
    ]


def run_sweep(args: argparse.Namespace, folder: Path, packed: bool) -> float:
    """Wall time of the whole sweep, confined to one core (sequential) or to all of them."""
    cores = set(args.core_ids) if packed else {args.core_ids[0]}
    command = sweep_command(args, folder, packed)
    started = time.perf_counter()
    proc = subprocess.run(
        command,
        preexec_fn=lambda: os.sched_setaffinity(0, cores),
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - started
    finished = len(list(folder.glob("*/results.json")))
    if proc.returncode != 0 or finished != args.jobs:
        sys.exit(
            f"{' '.join(command)} exited {proc.returncode} with {finished} of {args.jobs} "
            f"jobs finished\n--- stderr ---\n{proc.stderr[-3000:]}"
        )
    return wall


def main() -> None:
    args = parse_args()
    print(
        f"{args.jobs} one-core jobs of {args.steps} ResNet-18 steps ({args.image_size}x"
        f"{args.image_size} synthetic images, batch {args.batch_size}); sequential on 1 core vs "
        f"packed on {args.cores} cores; {args.repeats} repetition(s), interleaved"
    )
    print(f"{'run':>4} {'first':>10} {'sequential s':>13} {'packed s':>9} {'speed-up':>9}")
    sequential, packed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            # Interleaved: a machine that slows down or speeds up affects both sides alike.
            order = (False, True) if repeat % 2 == 0 else (True, False)
            for is_packed in order:
                side = "packed" if is_packed else "sequential"
                wall = run_sweep(args, Path(tmp) / f"{side}_{repeat}", is_packed)
                (packed if is_packed else sequential).append(wall)
            print(
                f"{repeat:>4} {'sequential' if not order[0] else 'packed':>10} "
                f"{sequential[-1]:>13.1f} {packed[-1]:>9.1f} "
                f"{sequential[-1] / packed[-1]:>9.2f}",
                flush=True,
            )
    median_sequential, median_packed = statistics.median(sequential), statistics.median(packed)
    print(f"median sweep: sequential {median_sequential:.1f} s, packed {median_packed:.1f} s")
    print(f"packing speed-up: {median_sequential / median_packed:.2f}")


if __name__ == "__main__":
    main()
