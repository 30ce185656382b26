"""Training steps of one process on a machine whose cores are also busy with other work:
torch's threads spinning while they wait (OpenMP's default), spinning briefly and then
sleeping (`GOMP_SPINCOUNT=10000`, what `train.py` sets), sleeping at once
(`OMP_WAIT_POLICY=PASSIVE`), and one thread.

Each configuration is a fresh process that trains the default task's model (ResNet-18 on
8x8 images, batch 64) for `--seconds` on the quiet machine, then as long beside one busy
loop per core (the "load"), and prints samples/s for each. The configurations alternate,
`--repeats` times; the table gives the medians side by side, and the last line the ratio of
train.py's threads to OpenMP's default under load.

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
for _ in ("quiet", "loaded"):
    sys.stdin.readline()  # the benchmark says go once the cores are as they should be
    start, steps = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        model(batch).sum().backward()
        steps += 1
    print(steps * 64 / (time.perf_counter() - start), flush=True)
"""

# name -> (torch threads, the OpenMP variables; none: OpenMP's default)
CONFIGS = {
    "all cores, threads spin (OpenMP default)": (0, {}),
    "all cores, spin briefly, sleep (train.py)": (0, {"GOMP_SPINCOUNT": "10000"}),
    "all cores, threads sleep (PASSIVE)": (0, {"OMP_WAIT_POLICY": "PASSIVE"}),
    "one thread": (1, {}),
}
OPENMP_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--tiny", action="store_true", help="one repeat of 0.5 s")
    return parser.parse_args()


def quiet_and_loaded(threads: int, openmp: dict[str, str], seconds: float) -> tuple[float, float]:
    """Samples/s of one process, on the quiet cores and then beside the busy loops (one
    process for both: its OpenMP runtime reads the wait policy once, when it loads)."""
    env = {k: v for k, v in os.environ.items() if k not in OPENMP_VARIABLES}
    env.update(openmp)
    cores = len(os.sched_getaffinity(0))
    child = subprocess.Popen(
        [sys.executable, "-c", STEPS, str(threads or cores), str(seconds)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin and child.stdout
    child.stdin.write("go\n")
    child.stdin.flush()
    quiet = float(child.stdout.readline())
    with busy_cores():
        child.stdin.write("go\n")
        child.stdin.flush()
        loaded = float(child.stdout.readline())
    if child.wait() != 0:
        raise RuntimeError(f"the measuring process failed with exit code {child.returncode}")
    return quiet, loaded


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


def measure(repeats: int, seconds: float) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    quiet: dict[str, list[float]] = {name: [] for name in CONFIGS}
    loaded: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for _ in range(repeats):
        for name, (threads, openmp) in CONFIGS.items():
            alone, beside = quiet_and_loaded(threads, openmp, seconds)
            quiet[name].append(alone)
            loaded[name].append(beside)
    return quiet, loaded


def main() -> None:
    args = parse_args()
    repeats, seconds = (1, 0.5) if args.tiny else (args.repeats, args.seconds)
    quiet, loaded = measure(repeats, seconds)
    cores = len(os.sched_getaffinity(0))
    print(f"{cores} cores; median samples/s of {repeats} run(s) of {seconds:g} s each")
    print(f"{'configuration':<48} {'quiet':>8} {'loaded':>8}")
    for name in CONFIGS:
        print(
            f"{name:<48} {statistics.median(quiet[name]):>8.0f} {statistics.median(loaded[name]):>8.0f}"
        )
    default = statistics.median(loaded["all cores, threads spin (OpenMP default)"])
    brief = statistics.median(loaded["all cores, spin briefly, sleep (train.py)"])
    print(f"under load, train.py's threads / OpenMP's default: {brief / default:.1f}x")


if __name__ == "__main__":
    main()
