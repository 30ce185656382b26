"""What a template job costs before and after its training steps, next to the same steps
started with torchrun.

Runs `python train.py experiment=benchmark recipe=baseline devices=N` (a fixed number of
steps) and `torchrun benchmarks/raw_ddp.py` (same model, data, batch and steps, written by
hand in plain PyTorch), alternating which goes first, several times. Rank 0 of each side
records when its process came to be, when the process group and the data were ready, and
when each step ended; the benchmark adds when the command started and when it exited.

Prints each pair, the median of every phase on both sides, the wall time of the smoke run
`python train.py debug=fast strategy=ddp devices=N` (not with --tiny), and as its last two
lines `start-up ratio: X` (the template's start-up / plain PyTorch's, medians) and
`extra start-up: Y s` (the median of the pairs' differences). Start-up is everything but the
training steps: the wall time of the command less the time from the first step's start to
the last step's end.

    .venv/bin/python benchmarks/startup.py                  # 2 processes, 3 repetitions
    .venv/bin/python benchmarks/startup.py --repeats 5 --devices 4
    .venv/bin/python benchmarks/startup.py --tiny           # a tiny model, once (for a test)

Others' work on the same cores shows up in the figures: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"

# Milestones in the order a job reaches them; `started` and `exited` are taken here.
PHASES = [
    ("start the workers", "started", "worker_created"),
    ("worker set-up: imports, process group, data", "worker_created", "ready"),
    ("until the first step: model, DDP", "ready", "first_step_start"),
    ("first step", "first_step_start", "first_step_end"),
    ("other steps", "first_step_end", "last_step_end"),
    ("shut-down, until the command exits", "last_step_end", "exited"),
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument(
        "--tiny", action="store_true", help="one repetition of 2 steps of 8x8 images, no smoke run"
    )
    args = parser.parse_args()
    if args.tiny:
        args.repeats, args.steps, args.batch_size, args.image_size = 1, 2, 8, 8
    return args


def environment() -> dict[str, str]:
    """The benchmark's modules (the clock callback, the milestones) importable by both sides."""
    path = os.pathsep.join(filter(None, [str(BENCHMARKS), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def timed_run(command: list[str], milestones: Path, cwd: Path) -> dict[str, float]:
    started = time.time()
    proc = subprocess.run(command, cwd=cwd, env=environment(), capture_output=True, text=True)
    exited = time.time()
    if proc.returncode != 0:
        sys.exit(
            f"{' '.join(command)} exited {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}"
        )
    return {"started": started, **json.loads(milestones.read_text()), "exited": exited}


def run_template(args: argparse.Namespace, folder: Path) -> dict[str, float]:
    milestones = folder.with_suffix(".milestones.json")
    command = [
        sys.executable,
        str(ROOT / "train.py"),
        "experiment=benchmark",
        "recipe=baseline",
        f"devices={args.devices}",
        "benchmark.warmup_steps=0",
        f"benchmark.steps={args.steps}",
        f"data.batch_size={args.batch_size}",
        f"data.image_size={args.image_size}",
        f"task.module.model.arch={args.arch}",
        f"hydra.run.dir={folder}",
        "+callbacks.startup_clock._target_=startup_clock.StartupClock",
        f"+callbacks.startup_clock.path={milestones}",
    ]
    return timed_run(command, milestones, cwd=folder.parent)


def run_raw(args: argparse.Namespace, folder: Path) -> dict[str, float]:
    milestones = folder.with_suffix(".milestones.json")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.devices}",
        str(BENCHMARKS / "raw_ddp.py"),
        f"--out={folder.with_suffix('.json')}",
        f"--milestones={milestones}",
        "--warmup-steps=0",
        f"--steps={args.steps}",
        f"--batch-size={args.batch_size}",
        f"--image-size={args.image_size}",
        f"--arch={args.arch}",
    ]
    return timed_run(command, milestones, cwd=folder.parent)


def run_smoke(args: argparse.Namespace, folder: Path) -> float:
    """Wall time of the smoke run a user repeats all day."""
    command = [
        sys.executable,
        str(ROOT / "train.py"),
        "debug=fast",
        "strategy=ddp",
        f"devices={args.devices}",
        f"hydra.run.dir={folder}",
    ]
    started = time.perf_counter()
    subprocess.run(command, cwd=folder.parent, env=environment(), check=True, capture_output=True)
    return time.perf_counter() - started


def start_up(times: dict[str, float]) -> float:
    """Wall time of the command less its training steps."""
    steps = times["last_step_end"] - times["first_step_start"]
    return times["exited"] - times["started"] - steps


def main() -> None:
    args = parse_args()
    print(
        f"{args.arch}, {args.image_size}x{args.image_size} synthetic images, batch "
        f"{args.batch_size} per device, {args.devices} processes, {args.steps} steps; "
        f"{args.repeats} repetition(s), interleaved"
    )
    print(f"{'run':>4} {'first':>9} {'start-up s: template':>21} {'torchrun':>9} {'extra':>7}")
    sides: dict[str, list[dict[str, float]]] = {"template": [], "torchrun": []}
    smoke_s: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            # Interleaved: a machine that slows down or speeds up affects both sides alike.
            order = ("template", "torchrun") if repeat % 2 == 0 else ("torchrun", "template")
            for side in order:
                run = run_template if side == "template" else run_raw
                sides[side].append(run(args, Path(tmp) / f"{side}_{repeat}"))
            template, raw = start_up(sides["template"][-1]), start_up(sides["torchrun"][-1])
            print(
                f"{repeat:>4} {order[0]:>9} {template:>21.2f} {raw:>9.2f} {template - raw:>+7.2f}",
                flush=True,
            )
            if not args.tiny:
                smoke_s.append(run_smoke(args, Path(tmp) / f"smoke_{repeat}"))

    print(f"\n{'median seconds':<46} {'template':>9} {'torchrun':>9} {'extra':>7}")

    def row(name: str, measure) -> None:
        template = statistics.median(measure(t) for t in sides["template"])
        raw = statistics.median(measure(t) for t in sides["torchrun"])
        print(f"{name:<46} {template:>9.2f} {raw:>9.2f} {template - raw:>+7.2f}")

    for name, begin, end in PHASES:
        row(name, lambda t, begin=begin, end=end: t[end] - t[begin])
    row("time to the first step", lambda t: t["first_step_start"] - t["started"])
    row("total", lambda t: t["exited"] - t["started"])
    row("start-up: total less the training steps", start_up)
    if smoke_s:
        print(
            f"\n`train.py debug=fast strategy=ddp devices={args.devices}`: "
            f"{statistics.median(smoke_s):.1f} s (median of {len(smoke_s)})"
        )
    template = [start_up(t) for t in sides["template"]]
    raw = [start_up(t) for t in sides["torchrun"]]
    extra = statistics.median(t - r for t, r in zip(template, raw, strict=True))
    print(f"start-up ratio: {statistics.median(template) / statistics.median(raw):.2f}")
    print(f"extra start-up: {extra:.2f} s")


if __name__ == "__main__":
    main()
