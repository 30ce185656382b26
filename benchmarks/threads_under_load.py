"""Training steps of one process on a machine whose cores are also busy with other work:
torch's threads spinning (OpenMP's default wait) or sleeping (`OMP_WAIT_POLICY=PASSIVE`,
what `train.py` sets), and one thread.

Each measurement is a fresh process that trains the default task's model (ResNet-18 on
8x8 images, batch 64) for `--seconds` and prints samples/s. The configurations alternate,
`--repeats` times, on a quiet machine and beside one busy loop per core (the "load"); the
table gives the medians side by side, and the last line the ratio of sleeping to spinning
threads under load.

    .venv/bin/python benchmarks/threads_under_load.py              # 3 repeats of 5 s each
    .venv/bin/python benchmarks/threads_under_load.py --tiny       # one short repeat (a test)

Others' work on the same cores shows up in the "quiet" column: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

STEPS = """
import os, sys, time, torch, torchvision
torch.set_num_threads(int(sys.argv[1]))
seconds = float(sys.argv[2])
model = torchvision.models.resnet18(num_classes=10)
batch = torch.randn(64, 3, 8, 8)
for _ in range(2):
    model(batch).sum().backward()
start, steps = time.perf_counter(), 0
while time.perf_counter() - start < seconds:
    model(batch).sum().backward()
    steps += 1
print(steps * 64 / (time.perf_counter() - start))
"""

# name -> (torch threads, OMP_WAIT_POLICY or None for OpenMP's default)
CONFIGS = {
    "all cores, threads spin (OpenMP default)": (0, None),
    "all cores, threads sleep (PASSIVE, train.py)": (0, "PASSIVE"),
    "one thread": (1, None),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--tiny", action="store_true", help="one repeat of 0.5 s")
    return parser.parse_args()


def samples_per_second(threads: int, wait_policy: str | None, seconds: float) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    if wait_policy:
        env["OMP_WAIT_POLICY"] = wait_policy
    cores = len(os.sched_getaffinity(0))
    out = subprocess.run(
        [sys.executable, "-c", STEPS, str(threads or cores), str(seconds)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


@contextmanager
def busy_cores() -> Iterator[None]:
    """One busy loop per core, as other people's jobs on a shared machine."""
    loops = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(len(os.sched_getaffinity(0)))
    ]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def measure(repeats: int, seconds: float) -> dict[str, list[float]]:
    figures: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for _ in range(repeats):
        for name, (threads, policy) in CONFIGS.items():
            figures[name].append(samples_per_second(threads, policy, seconds))
    return figures


def main() -> None:
    args = parse_args()
    repeats, seconds = (1, 0.5) if args.tiny else (args.repeats, args.seconds)
    quiet = measure(repeats, seconds)
    with busy_cores():
        loaded = measure(repeats, seconds)
    cores = len(os.sched_getaffinity(0))
    print(f"{cores} cores; median samples/s of {repeats} run(s) of {seconds:g} s each")
    print(f"{'configuration':<48} {'quiet':>8} {'loaded':>8}")
    for name in CONFIGS:
        print(
            f"{name:<48} {statistics.median(quiet[name]):>8.0f} {statistics.median(loaded[name]):>8.0f}"
        )
    spin = statistics.median(loaded["all cores, threads spin (OpenMP default)"])
    sleep = statistics.median(loaded["all cores, threads sleep (PASSIVE, train.py)"])
    print(f"under load, sleeping / spinning threads: {sleep / spin:.1f}x")


if __name__ == "__main__":
    main()
