"""What the template costs per training step, next to the same loop in plain PyTorch.

Runs `python train.py experiment=benchmark recipe=<recipe> devices=N` and
`torchrun benchmarks/raw_ddp.py` (same model, data, batch, precision and steps) one after
the other, alternating which goes first, several times; prints each pair, then the medians,
and as its last line `overhead ratio: X.XX` (template step time / plain PyTorch step time,
medians of the per-run medians). Lightning's own DDP parity test allows 2%.

Both sides run under the same OpenMP thread policy, exported to both: `train.py` sets
`GOMP_SPINCOUNT=10000` before torch loads (`ddp_template.launch.process_defaults`) unless
one is exported, and the plain loop would otherwise run under GNU OpenMP's default spin
(300,000 rounds), which on shared cores alone moved the ratio to 0.76. `--thread-policy`
picks it: `train.py` (10000 on both sides, the default), `libgomp` (300000 on both), or
`both` (every pair under each, and a ratio per policy).

    .venv/bin/python benchmarks/overhead.py                  # 2 processes, 3 repetitions
    .venv/bin/python benchmarks/overhead.py --repeats 5 --recipe amp --image-size 16
    taskset -c 0,1 .venv/bin/python benchmarks/overhead.py --thread-policy both

Others' work on the same cores shows up in the figures: run it on a quiet machine, or pin
it to cores of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRECISION = {"baseline": "32-true", "amp": "16-mixed"}
# The spin of torch's OpenMP threads, exported to both sides alike: train.py's own default,
# and GNU OpenMP's when nothing is set (its manual: 300,000).
THREAD_POLICIES = {"train.py": "10000", "libgomp": "300000"}


def policy_env(policy: str) -> dict[str, str]:
    """The environment of both sides under `policy`: one GOMP_SPINCOUNT, no wait policy
    (which would override it)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    return {**env, "GOMP_SPINCOUNT": THREAD_POLICIES[policy]}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--recipe", choices=sorted(PRECISION), default="baseline")
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--thread-policy", choices=[*THREAD_POLICIES, "both"], default="train.py")
    return parser.parse_args()


def run_template(args: argparse.Namespace, folder: Path, policy: str) -> dict:
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "experiment=benchmark",
            f"recipe={args.recipe}",
            f"devices={args.devices}",
            f"benchmark.warmup_steps={args.warmup_steps}",
            f"benchmark.steps={args.steps}",
            f"data.batch_size={args.batch_size}",
            f"data.image_size={args.image_size}",
            f"task.module.model.arch={args.arch}",
            f"hydra.run.dir={folder}",
        ],
        check=True,
        capture_output=True,
        text=True,
        env=policy_env(policy),
    )
    return json.loads((folder / "results.json").read_text())


def run_raw(args: argparse.Namespace, out: Path, policy: str) -> dict:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={args.devices}",
            str(ROOT / "benchmarks" / "raw_ddp.py"),
            f"--out={out}",
            f"--warmup-steps={args.warmup_steps}",
            f"--steps={args.steps}",
            f"--batch-size={args.batch_size}",
            f"--image-size={args.image_size}",
            f"--arch={args.arch}",
            f"--precision={PRECISION[args.recipe]}",
        ],
        check=True,
        capture_output=True,
        text=True,
        env=policy_env(policy),
    )
    return json.loads(out.read_text())


def main() -> None:
    args = parse_args()
    policies = list(THREAD_POLICIES) if args.thread_policy == "both" else [args.thread_policy]
    print(
        f"{args.arch}, {args.image_size}x{args.image_size} synthetic images, batch "
        f"{args.batch_size} per device, {args.devices} processes, recipe={args.recipe}, "
        f"{args.warmup_steps} warm-up + {args.steps} timed steps, cores "
        f"{','.join(map(str, sorted(os.sched_getaffinity(0))))}"
    )
    ratios = {policy: measure(args, policy) for policy in policies}
    for policy in policies[1:]:
        print(
            f"overhead ratio under {policy} (GOMP_SPINCOUNT={THREAD_POLICIES[policy]}): "
            f"{ratios[policy]:.2f}"
        )
    print(f"overhead ratio: {ratios[policies[0]]:.2f}")


def measure(args: argparse.Namespace, policy: str) -> float:
    """Interleaved pairs under one thread policy; prints them and returns the ratio of the
    medians."""
    template_ms, raw_ms, sigterm_us = [], [], []
    print(f"thread policy {policy}: GOMP_SPINCOUNT={THREAD_POLICIES[policy]} on both sides")
    print(f"{'run':>4} {'first':>9} {'template ms':>12} {'PyTorch ms':>11} {'ratio':>6}")
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            # Interleaved: a machine that slows down or speeds up affects both sides alike.
            order = ("template", "raw") if repeat % 2 == 0 else ("raw", "template")
            figures = {}
            for side in order:
                if side == "template":
                    figures[side] = run_template(args, Path(tmp) / f"template_{repeat}", policy)
                else:
                    figures[side] = run_raw(args, Path(tmp) / f"raw_{repeat}.json", policy)
            template_ms.append(1000 * figures["template"]["step_time_median_s"])
            raw_ms.append(1000 * figures["raw"]["step_time_median_s"])
            sigterm_us.append(1e6 * figures["raw"]["sigterm_broadcast_s"])
            ratio = template_ms[-1] / raw_ms[-1]
            print(
                f"{repeat:>4} {order[0]:>9} {template_ms[-1]:>12.1f} {raw_ms[-1]:>11.1f} "
                f"{ratio:>6.3f}",
                flush=True,
            )
    template, raw = statistics.median(template_ms), statistics.median(raw_ms)
    sigterm = statistics.median(sigterm_us)
    ratios = sorted(t / r for t, r in zip(template_ms, raw_ms, strict=True))
    print(f"median step: template {template:.1f} ms, plain PyTorch {raw:.1f} ms")
    print(
        f"ratio of each pair: {ratios[0]:.3f} to {ratios[-1]:.3f}, median "
        f"{statistics.median(ratios):.3f} (the spread is the machine's noise)"
    )
    print(
        f"SIGTERM flag broadcast Lightning runs before each step: {sigterm:.0f} us "
        f"({100 * sigterm / 1000 / raw:.3f}% of a step)"
    )
    return template / raw


if __name__ == "__main__":
    main()
