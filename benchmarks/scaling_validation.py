"""The scaling model against measured step times at several lab nodes and link rates.

For each node count N (2, 4, 8) the machine's cores are shared out as N nodes of a fraction
of a core each (a cgroup v1 cpu quota, by default 1.6 cores / N, at most 0.8), all under one
parent cgroup whose weight keeps other work on the machine from taking the quota. At that
fraction, with the N-node lab up, it goes `--repeats R` times (default 1) through a pass:

1. the one-node run users feed the model (`train.py experiment=benchmark strategy=ddp
   devices=1`, plain Python, not in the lab's namespaces), in node 0's quota, and beside
   it the same run in each of the other N - 1 nodes' quotas: N one-node runs a pass, each
   computing as a lab node does, its neighbours busy;
2. the N-node job on the lab (`ddp_template.tools.netlab`, one namespace per node, links
   shaped to the rate), one torchrun agent per node, each node in its own quota, for every
   setting at every rate: comm_hook=none at bucket_cap_mb=1,25,100 and fp16, powersgd at
   25 (`--full`: every hook at every bucket size).

Then, for each link rate, the command users run, fed the one-node run whose step is
nearest the median of all the passes' (each setting is taken at the median of its runs
too), on node 0's quota: `python -m ddp_template.tools.scaling <one-node run> --nodes N --link <rate>
--hooks none,fp16,powersgd --buckets 1,25,100` (its own hook-cost probe; with
`--link-from lab`, `--link lab`: the idle lab probed). The processes are placed as the lab
places its nodes: pinned to a core (`--link-from rate`), or free on every core within
their quota (`--link-from lab`).

With `--feed each`, every pass and rate is a block of its own, as a user's day is: the
one-node runs, that rate's jobs right after them, then the command fed the block's median
one-node run; each prediction is set against its own block's job (a table row per pass),
so a machine whose speed drifts over the grid moves a prediction and its job together; the
report then gives each setting's median error over its passes, and each pass's
recommendation against the settings' median steps.

With `--feed job` each job has one-node runs of its own right before it, and the
command fed their median right after it (with `--link-from lab` the idle lab probed once a
pass and rate, `netlab probe --allreduce --save`, and each command given that file), so a
fed run and its job lie minutes apart, not the length of a rate's nine jobs. The report is
that of --feed each; a pass's recommendation is that of its first job's command.

No figure from the N-node jobs goes into a prediction. Prints predicted against measured
step time with the error per setting, and per case (node count x rate) the setting the
command recommends among those measured against the measured best. Beside each setting:
a rank's CPU per step (results.json's `cpu_s_per_step_over_ranks`) against the one-node
run's, the share of its node's quota it used, and whether the prediction lies below the
job's CPU floor (that CPU over the quota: no step can be shorter). With --repeats, the
same predictions against each pass's runs alone, and the machine's speed beside that pass's
jobs (a fixed work's rounds per CPU second, read before each job and each one-node run)
against its speed beside the fed run: a host that slows the machine shows there. Writes
scaling_validation.csv/.json/.md into --out.

    .venv/bin/python benchmarks/scaling_validation.py --nodes 2,4 --full   # as root, ~30 min
    .venv/bin/python benchmarks/scaling_validation.py                  # 2,4,8: 8 nodes need ~13 GB
    .venv/bin/python benchmarks/scaling_validation.py --report-only    # the report again
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from ddp_template.tools.netlab import (  # noqa: E402
    CPU_PERIOD_RANGE_US,
    MIN_CPU_QUOTA_US,
    Lab,
    parse_rate,
)

CGROUP = Path("/sys/fs/cgroup/cpu")
DEFAULT_PERIOD_US = 100_000
# The quota period the runs in --out were measured with: their report and a later run into
# the same folder (which keeps the runs already there) read it back.
PERIOD_FILE = "cfs_period_us.txt"
HOOKS = ["none", "fp16", "powersgd"]
BUCKETS = [1, 25, 100]
PYTHON = sys.executable
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def grid(full: bool) -> list[tuple[str, int]]:
    if full:
        return [(h, b) for h in HOOKS for b in BUCKETS]
    return [("none", b) for b in BUCKETS] + [(h, 25) for h in HOOKS if h != "none"]


def fraction_for(nodes: int, total: float) -> float:
    return round(min(0.8, total / nodes), 3)


def train_args(args: argparse.Namespace, warmup: int, steps: int) -> list[str]:
    return [
        "experiment=benchmark",
        "accelerator=cpu",
        "strategy=ddp",
        f"data.image_size={args.image_size}",
        f"data.batch_size={args.batch_size}",
        f"benchmark.warmup_steps={warmup}",
        f"benchmark.steps={steps}",
    ]


# --- cgroups: one per node under a parent that outweighs everything else -------------------


def make_group(parent: str, name: str, fraction: float, period_us: int) -> Path:
    top = CGROUP / parent
    top.mkdir(exist_ok=True)
    # Other processes sit in session autogroups of weight 1024 each: this parent wins.
    (top / "cpu.shares").write_text("262144")
    group = top / name
    group.mkdir(exist_ok=True)
    (group / "cpu.cfs_period_us").write_text(str(period_us))
    (group / "cpu.cfs_quota_us").write_text(str(int(fraction * period_us)))
    return group


def remove_groups(parent: str) -> None:
    """The cgroups this script made (each empty once its processes are gone)."""
    top = CGROUP / parent
    if not top.is_dir():
        return
    for group in (g for g in top.iterdir() if g.is_dir()):
        with contextlib.suppress(OSError):
            group.rmdir()
    with contextlib.suppress(OSError):
        top.rmdir()


def in_group(group: Path, command: list[str]) -> list[str]:
    """The command, started inside `group` (the shell enters it, then becomes the command)."""
    return ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh", *command]


# Beside every lab job and every pass's one-node run: the machine's speed then (a virtual
# machine's host may run it slower for tens of minutes; the same work took 31% more CPU an
# hour into one grid: docs/nodes.md).
SPEED_FILE = "machine_speed.json"


def machine_speed() -> float:
    """Rounds of a fixed work per CPU second on this process's one thread, read while the
    lab is idle: matrix products and a copy larger than the caches, as a training step mixes
    compute and memory traffic. CPU seconds, not wall time: no quota or neighbour moves it,
    only how fast the machine runs the instructions."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(256, 256), torch.randn(256, 256)
        source, target = torch.randn(8 << 20), torch.empty(8 << 20)
        # Untimed first: the target's first touch faults its pages in, and torch's first
        # products set up their buffers (the first reading of a process was 25% low).
        for _ in range(3):
            torch.mm(a, b)
            target.copy_(source)
        rounds, start = 0, time.process_time()
        while time.process_time() - start < SPEED_READING_S:
            for _ in range(8):
                torch.mm(a, b)
            target.copy_(source)
            rounds += 1
        return rounds / (time.process_time() - start)
    finally:
        torch.set_num_threads(threads)


SPEED_READING_S = 1.0


def record_speed(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / SPEED_FILE).write_text(json.dumps({"rounds_per_cpu_s": machine_speed()}))


def read_speed(folder: Path) -> float | None:
    """The reading `record_speed` left in `folder` (None: measured before it was kept)."""
    path = folder / SPEED_FILE
    return float(json.loads(path.read_text())["rounds_per_cpu_s"]) if path.is_file() else None


def wait_for_memory(needed_mb: int) -> None:
    while True:
        available = (
            int(
                next(
                    x for x in Path("/proc/meminfo").read_text().splitlines() if "MemAvailable" in x
                ).split()[1]
            )
            // 1024
        )
        if available >= needed_mb:
            return
        print(f"waiting: {available} MiB available, {needed_mb} needed", flush=True)
        time.sleep(20)


# --- the one-node run, the command, the lab's jobs ---------------------------------------


def one_node_run(
    args: argparse.Namespace,
    fraction: float,
    nodes: int,
    repeat: int = 0,
    command: bool = True,
    folder: Path | None = None,
) -> Path:
    """Node 0's one-node run, with the other N - 1 nodes' cores and quotas busy with the same
    training (as in the lab, where the nodes share the machine's caches and memory; on a
    cluster each node has a machine of its own, and a one-node run there computes as fast as
    each node of the job). The neighbours' runs are one-node runs too, of the same steps,
    each under its own quota: N readings of the pass (`reference_steps`). `repeat`: the run
    of that pass (`--repeats`); `command`: with --link-from rate, the command users run
    right after it, beside neighbours that train on. `folder`: where (default: the pass's
    `reference_folder`)."""
    folder = folder or reference_folder(args.out, fraction, repeat)
    # With --link-from lab the command runs later, against the lab it probes.
    rates = args.rate_list if args.link_from == "rate" and command else []
    predicted = [predicted_file(args.out, nodes, rate) for rate in rates]
    if (folder / "results.json").is_file() and all(p.is_file() for p in predicted):
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "results.json").is_file():
        record_speed(folder)
        group = make_group(args.prefix, f"{args.prefix}-node0", fraction, args.cfs_period_us)
        with busy_neighbours(args, folder, fraction, nodes, args.one_node_steps):
            command_line = [
                *placement(args, 0),
                PYTHON,
                str(ROOT / "train.py"),
                *train_args(args, args.warmup + 1, args.one_node_steps),
                "devices=1",
                f"hydra.run.dir={folder}",
            ]
            with open(folder / "node0.log", "w") as log:
                run = subprocess.run(
                    in_group(group, command_line), stdout=log, stderr=log, cwd=ROOT
                )
            if run.returncode:
                raise RuntimeError(f"the one-node run failed: see {folder}/node0.log")
    if rates:
        # The command users run next, on the same core and quota, beside neighbours that
        # train on.
        group = make_group(args.prefix, f"{args.prefix}-node0", fraction, args.cfs_period_us)
        with busy_neighbours(args, args.out / f"command_{fraction}", fraction, nodes):
            for rate in rates:
                predict_with_the_command(args, folder, nodes, rate, group)
    return folder


@contextlib.contextmanager
def busy_neighbours(
    args: argparse.Namespace, folder: Path, fraction: float, nodes: int, steps: int | None = None
) -> Iterator[None]:
    """Nodes 1 to N - 1 train as node 0 does, each on its core and in its quota: with `steps`,
    one-node runs of that many timed steps (each writes its results.json under
    `folder`/neighbours; the block ends when they have); without, until the block ends."""
    neighbours = []
    try:
        for index in range(1, nodes):
            group = make_group(
                args.prefix, f"{args.prefix}-node{index}", fraction, args.cfs_period_us
            )
            command = [
                *placement(args, index),
                PYTHON,
                str(ROOT / "train.py"),
                *train_args(args, args.warmup + 1, steps or 100 * args.one_node_steps),
                "devices=1",
                f"hydra.run.dir={folder / 'neighbours' / str(index)}",
            ]
            neighbours.append(
                subprocess.Popen(
                    in_group(group, command),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    cwd=ROOT,
                    start_new_session=True,
                )
            )
        yield
        if steps:
            deadline = time.monotonic() + args.timeout
            for proc in neighbours:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(1, deadline - time.monotonic()))
    finally:
        for proc in neighbours:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def reference_folder(out: Path, fraction: float, repeat: int) -> Path:
    """The one-node run of pass `repeat`; the first keeps the name it always had."""
    return out / (f"one_node_{fraction}" + (f"_r{repeat + 1}" if repeat else ""))


# The --feed choices that judge each prediction against the jobs of its own block.
BLOCK_FEEDS = ("each", "job")


def block_folder(
    out: Path, fraction: float, rate: str, repeat: int, setting: tuple[str, int] | None = None
) -> Path:
    """With --feed each: the one-node run of pass `repeat` at `rate`, run just before that
    rate's jobs of the pass; with --feed job (`setting` given): just before that setting's
    job."""
    return out / (f"one_node_{fraction}_{rate}_r{repeat + 1}" + _of_setting(setting))


def predicted_file(
    out: Path,
    nodes: int,
    rate: str,
    repeat: int | None = None,
    setting: tuple[str, int] | None = None,
) -> Path:
    """The command's output: one per node count and rate, with --feed each one per pass,
    with --feed job one per job (`setting`)."""
    return out / (
        f"predicted_{nodes}_{rate}"
        + ("" if repeat is None else f"_r{repeat + 1}")
        + _of_setting(setting)
        + ".txt"
    )


def probe_file(out: Path, nodes: int, rate: str, repeat: int) -> Path:
    """With --feed job and --link-from lab: the idle lab's all-reduce probe at `rate`, read
    once before the pass's jobs at that rate, which each job's command takes (`--link FILE`)."""
    return out / f"probe_{nodes}_{rate}_r{repeat + 1}.json"


def _of_setting(setting: tuple[str, int] | None) -> str:
    return "" if setting is None else f"_{setting[0]}_{setting[1]}"


def runs_in(folder: Path) -> list[tuple[float, Path]]:
    """(median step s, folder) of the one-node runs of one pass in `folder`: node 0's, then
    its neighbours' (runs of the same steps beside it, each in its own quota; folders
    measured before they wrote their results hold node 0's alone)."""
    found = []
    neighbours = folder / "neighbours"
    others = sorted(neighbours.iterdir(), key=lambda p: p.name) if neighbours.is_dir() else []
    for results in (folder / "results.json", *(n / "results.json" for n in others)):
        if results.is_file():
            step = float(json.loads(results.read_text())["step_time_median_s"])
            found.append((step, results.parent))
    return found


def reference_steps(out: Path, fraction: float, repeats: int) -> list[tuple[float, Path]]:
    """The one-node runs (`runs_in`) there are in at most `repeats` passes."""
    return [run for r in range(repeats) for run in runs_in(reference_folder(out, fraction, r))]


def median_reference(out: Path, fraction: float, repeats: int) -> Path:
    """The one-node run whose step is nearest the median of the runs' (`median_of`): the run
    the command is fed, as the lab's jobs are taken at their median."""
    runs = reference_steps(out, fraction, repeats)
    if not runs:
        raise RuntimeError(f"no one-node run in {out} at {fraction} of a core")
    return median_of(runs)


def median_of(runs: list[tuple[float, Path]]) -> Path:
    """The folder of the (step s, folder) pair nearest the median step, the faster one of
    two as near (with two runs, the faster: one of them has to be fed)."""
    middle = statistics.median(step for step, _ in runs)
    return min(sorted(runs), key=lambda run: abs(run[0] - middle))[1]


def placement(args: argparse.Namespace, index: int) -> list[str]:
    """How node `index`'s processes are placed, as the lab places its nodes: netlab pins a
    node without a quota to its core (--link-from rate); a node in the lab's own quota
    (--link-from lab) may run on every core, and so do its one-node run, the neighbours and
    the command."""
    if args.link_from == "lab":
        return []
    return ["taskset", "-c", str(core_of(index))]


def core_of(index: int) -> int:
    """The core netlab gives node `index` (one each, round the machine's cores)."""
    cores = sorted(os.sched_getaffinity(0))
    return cores[index % len(cores)]


def predict_with_the_command(
    args: argparse.Namespace,
    one_node: Path,
    nodes: int,
    rate: str,
    group: Path,
    link: list[str] | None = None,
    repeat: int | None = None,
    setting: tuple[str, int] | None = None,
) -> Path:
    """`--link <rate>`, or with --link-from lab `--link lab` (the running lab at that rate,
    probed by an all-reduce over all its nodes, each under its quota), or `link` as given
    (e.g. `--link probe.json`). `repeat`: with --feed each, the pass it predicts;
    `setting`: with --feed job, the job."""
    out = predicted_file(args.out, nodes, rate, repeat, setting)
    if out.is_file():
        return out
    if link is None:
        link = (
            ["--link", rate]
            if args.link_from == "rate"
            else ["--link", "lab", "--lab", args.prefix]
        )
    command = [
        *placement(args, 0),
        PYTHON,
        "-m",
        "ddp_template.tools.scaling",
        str(one_node),
        "--nodes",
        str(nodes),
        *link,
        "--hooks",
        ",".join(HOOKS),
        "--buckets",
        ",".join(map(str, BUCKETS)),
    ]
    done = subprocess.run(in_group(group, command), capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise RuntimeError(f"the scaling command failed: {done.stderr}")
    out.write_text(done.stdout)
    print(done.stdout, flush=True)
    return out


def lab_run(
    args: argparse.Namespace, lab: Lab, folder: Path, overrides: list[str], port: int
) -> None:
    if (folder / "results.json").is_file():
        return
    record_speed(folder)
    nodes = len(lab.nodes)
    procs = []
    with contextlib.ExitStack() as logs:
        for node in lab.nodes:
            command = [
                TORCHRUN,
                f"--nnodes={nodes}",
                "--nproc_per_node=1",
                "--rdzv_backend=c10d",
                f"--rdzv_endpoint={lab.nodes[0].address}:{port}",
                f"--rdzv_id=sv{port}",
                str(ROOT / "train.py"),
                *overrides,
                f"hydra.run.dir={folder}",
            ]
            log = logs.enter_context((folder / f"node{node.index}.log").open("w"))
            # Into the cgroup before the namespace: `ip netns exec` mounts a /sys of its own,
            # without the cgroup file systems; the children inherit the group. With
            # --link-from lab each node is in the lab's own quota (lab.command joins it).
            on_node = lab.command(node.index, command)
            if args.link_from == "rate":
                name = f"{args.prefix}-node{node.index}"
                on_node = in_group(
                    make_group(args.prefix, name, args.current, args.cfs_period_us), on_node
                )
            procs.append(
                subprocess.Popen(
                    on_node,
                    stdout=log,
                    stderr=log,
                    cwd=ROOT,
                )
            )
        deadline = time.monotonic() + args.timeout
        try:
            for proc in procs:
                proc.wait(timeout=max(1, deadline - time.monotonic()))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
    if any(p.returncode for p in procs) or not (folder / "results.json").is_file():
        raise RuntimeError(f"the {nodes}-node run failed: see {folder}/node*.log")


def lab_for(args: argparse.Namespace, nodes: int) -> Lab:
    """The lab of `nodes` nodes at the first rate. With --link-from lab each node runs in
    the lab's own quota of this node count's fraction (`args.current`), over the same period
    as the one-node run: a node throttled at another period waits another time."""
    return Lab.up(
        nodes=nodes,
        rate=args.rate_list[0],
        prefix=args.prefix,
        cpu_fraction=args.current if args.link_from == "lab" else None,
        cpu_period_us=args.cfs_period_us,
    )


def job_folder(out: Path, nodes: int, rate: str, hook: str, bucket: int, repeat: int) -> Path:
    """Where a lab job writes; the first run of a setting keeps the name it always had."""
    name = f"{hook}_{bucket}" + (f"_r{repeat + 1}" if repeat else "")
    return out / f"{nodes}nodes_{rate}" / name


def measure(args: argparse.Namespace) -> None:
    port = 29500 + os.getpid() % 400
    for nodes in args.node_counts:
        fraction = args.current = fraction_for(nodes, args.total_cores)
        wait_for_memory(2000 * nodes + 2000)
        lab = lab_for(args, nodes)
        try:
            if args.feed in BLOCK_FEEDS:
                measure_each_pass(args, lab, nodes, port)
                port += args.repeats * len(args.rate_list) * len(grid(args.full))
                continue
            # Each repeat is one pass: a one-node run (beside the idle lab), then every
            # setting at every rate. A slow spell of the machine falls on one run of several
            # settings and of the reference, not on every run of one; the command is fed the
            # median one-node run, as each setting is taken at its median.
            for repeat in range(args.repeats):
                one_node_run(args, fraction, nodes, repeat, command=False)
                for rate in args.rate_list:
                    lab.set_rate(parse_rate(rate))
                    for hook, bucket in grid(args.full):
                        port += 1
                        run_job(args, lab, nodes, rate, hook, bucket, repeat, port)
            reference = median_reference(args.out, fraction, args.repeats)
            for rate in args.rate_list:
                lab.set_rate(parse_rate(rate))
                command_after_jobs(args, reference, nodes, rate)
        finally:
            lab.down()


def measure_each_pass(args: argparse.Namespace, lab: Lab, nodes: int, port: int) -> None:
    """--feed each: every pass and rate is one block, as a user's day is: the one-node runs,
    that rate's jobs right after them, then the command fed the block's median one-node run.
    Each prediction is set against the jobs of its own block: a machine that drifts over the
    grid moves the fed run and the jobs together, not the one without the other."""
    fraction = args.current
    for repeat in range(args.repeats):
        for rate in args.rate_list:
            lab.set_rate(parse_rate(rate))
            if args.feed == "job":
                measure_each_job(args, lab, nodes, port, repeat, rate)
                port += len(grid(args.full))
                continue
            block = block_folder(args.out, fraction, rate, repeat)
            one_node_run(args, fraction, nodes, repeat, command=False, folder=block)
            for hook, bucket in grid(args.full):
                port += 1
                run_job(args, lab, nodes, rate, hook, bucket, repeat, port)
            command_after_jobs(args, median_of(runs_in(block)), nodes, rate, repeat)


def measure_each_job(
    args: argparse.Namespace, lab: Lab, nodes: int, port: int, repeat: int, rate: str
) -> None:
    """--feed job: every job has one-node runs of its own right before it and the command
    fed their median right after it: the fed run and the job minutes apart, not the length
    of a block (on this machine the same work's CPU drifted by up to 48% within a block:
    docs/nodes.md). With --link-from lab the idle lab is probed once at the rate, before
    its jobs (`netlab probe --allreduce --save`), and each command takes that file."""
    fraction = args.current
    link = None
    if args.link_from == "lab":
        probe = probe_file(args.out, nodes, rate, repeat)
        save_lab_probe(args, probe)
        link = ["--link", str(probe)]
    for hook, bucket in grid(args.full):
        port += 1
        folder = block_folder(args.out, fraction, rate, repeat, (hook, bucket))
        one_node_run(args, fraction, nodes, repeat, command=False, folder=folder)
        run_job(args, lab, nodes, rate, hook, bucket, repeat, port)
        command_after_jobs(
            args, median_of(runs_in(folder)), nodes, rate, repeat, (hook, bucket), link
        )


def save_lab_probe(args: argparse.Namespace, probe: Path) -> None:
    """The idle lab's all-reduce probe, as the command's `--link lab` reads it, saved."""
    if probe.is_file():
        return
    command = [
        PYTHON,
        "-m",
        "ddp_template.tools.netlab",
        "probe",
        "--allreduce",
        "--save",
        str(probe),
        "--prefix",
        args.prefix,
    ]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode or not probe.is_file():
        raise RuntimeError(f"the lab's probe failed: {done.stderr}")


def run_job(
    args: argparse.Namespace,
    lab: Lab,
    nodes: int,
    rate: str,
    hook: str,
    bucket: int,
    repeat: int,
    port: int,
) -> None:
    folder = job_folder(args.out, nodes, rate, hook, bucket, repeat)
    overrides = [
        *train_args(args, args.warmup, args.steps),
        f"strategy.comm_hook={hook}",
        f"strategy.bucket_cap_mb={bucket}",
    ]
    started = time.monotonic()
    lab_run(args, lab, folder, overrides, port)
    print(
        f"{nodes} nodes x {args.current} core, {rate}, {hook} {bucket}, run "
        f"{repeat + 1}: {time.monotonic() - started:.0f} s",
        flush=True,
    )


def command_after_jobs(
    args: argparse.Namespace,
    reference: Path,
    nodes: int,
    rate: str,
    repeat: int | None = None,
    setting: tuple[str, int] | None = None,
    link: list[str] | None = None,
) -> None:
    """The command users run, fed `reference`, the lab at `rate` and its jobs done
    (`setting`: with --feed job, the one job it is set against; `link`: as given)."""
    fraction = args.current
    group = make_group(args.prefix, f"{args.prefix}-node0", fraction, args.cfs_period_us)
    if args.link_from == "lab":
        # The lab's nodes idle: the probe measures the link, not the jobs.
        predict_with_the_command(args, reference, nodes, rate, group, link, repeat, setting)
    else:
        # Fresh folders for the neighbours: the one-node runs' are in use.
        with busy_neighbours(args, args.out / f"command_{fraction}", fraction, nodes):
            predict_with_the_command(args, reference, nodes, rate, group, link, repeat, setting)


# --- the report --------------------------------------------------------------------------

LINE = re.compile(r"nodes=(\d+) hook=(\w+) bucket_cap_mb=(\S+) .* predicted step time: ([\d.]+) s")


PARTS = re.compile(
    r"nodes=\d+ hook=(\w+) bucket_cap_mb=(\S+) compute ([\d.]+) s exposed comm ([\d.]+) s"
)


ASSUMED_CPU = re.compile(
    r"nodes=\d+ hook=(\w+) bucket_cap_mb=(\S+) .*a rank's CPU ([\d.]+) s a step"
)


def predicted_cpu(path: Path) -> dict[tuple[str, int], float]:
    """The rank CPU per step each prediction assumed (printed since the command gave its
    floor's parts; an older output: none)."""
    return {(m[1], int(float(m[2]))): float(m[3]) for m in ASSUMED_CPU.finditer(path.read_text())}


def predicted_parts(path: Path) -> dict[tuple[str, int], tuple[float, float]]:
    """The compute and exposed communication of each prediction line."""
    return {
        (m[1], int(float(m[2]))): (float(m[3]), float(m[4]))
        for m in PARTS.finditer(path.read_text())
    }


def measured_parts(record: dict) -> tuple[float | None, float | None]:
    """A lab job's forward + backward compute (DDP's timers) and exposed communication
    (results.json exposed_comm_s: DDP's timers, how long the all-reduce ran past the
    backward), where recorded."""
    gradients = record.get("gradients") or {}
    compute = None
    if gradients.get("forward_compute_s") is not None:
        compute = float(gradients["forward_compute_s"]) + float(gradients["backward_compute_s"])
    return compute, record.get("exposed_comm_s")


def predictions(path: Path) -> dict[tuple[str, int], float]:
    found = {}
    for match in LINE.finditer(path.read_text()):
        found[(match[2], int(float(match[3])))] = float(match[4])
    return found


def command_choice(path: Path) -> tuple[str, int]:
    """The pair the command recommends (its `recommended at nodes=` line)."""
    match = re.search(r"strategy.comm_hook=(\w+) strategy.bucket_cap_mb=(\S+)", path.read_text())
    assert match, path
    return match[1], int(float(match[2]))


ONE_NODE_FORWARD = re.compile(r"^measured: step [\d.]+ s \(forward ([\d.]+),", re.MULTILINE)


def one_node_forward(path: Path) -> float | None:
    """The one-node run's forward, as the command read it (its `measured:` line)."""
    match = ONE_NODE_FORWARD.search(path.read_text())
    return float(match[1]) if match else None


def lab_forward(records: list[dict]) -> float | None:
    """The median forward of a setting's lab runs (DDP's timer). The forward holds no
    collective: beside the one-node run's it says how fast the lab's nodes computed during
    the job, a check on the lab, never an input to a prediction."""
    forwards = [
        float(r["gradients"]["forward_compute_s"])
        for r in records
        if (r.get("gradients") or {}).get("forward_compute_s") is not None
    ]
    return statistics.median(forwards) if forwards else None


def rank_cpu(records: list[dict]) -> float | None:
    """The median over a setting's runs of each run's median rank CPU per step."""
    cpus = [
        float(r["cpu_s_per_step_over_ranks"]["median"])
        for r in records
        if r.get("cpu_s_per_step_over_ranks")
    ]
    return statistics.median(cpus) if cpus else None


def one_node_cpu(reference: Path | None) -> float | None:
    """The CPU per step of the one-node run the command was fed (None: not recorded)."""
    if reference is None:
        return None
    return rank_cpu([json.loads((reference / "results.json").read_text())])


def probe_line(path: Path) -> str:
    return next(x for x in path.read_text().splitlines() if x.startswith("hook compute"))


def measured_period(out: Path) -> int:
    """The period the runs in `out` used (folders measured before it was recorded: 100 ms)."""
    recorded = out / PERIOD_FILE
    return int(recorded.read_text()) if recorded.is_file() else DEFAULT_PERIOD_US


def blocks(args: argparse.Namespace, nodes: int, rate: str) -> list[dict]:
    """What each prediction is set against: by default one block, the command's output
    against every pass's jobs (each setting at its median); with --feed each one block a
    pass, its own output against its own jobs; with --feed job one block a pass too, each
    job against the output of the command fed its own one-node runs (`by_setting`), the
    block's recommendation that of its first job's command."""
    fraction = fraction_for(nodes, args.total_cores)
    if args.feed == "job":
        found = []
        for repeat in range(args.repeats):
            by_setting = {}
            for setting in grid(args.full):
                runs = runs_in(block_folder(args.out, fraction, rate, repeat, setting))
                path = predicted_file(args.out, nodes, rate, repeat, setting)
                if path.is_file():
                    by_setting[setting] = (path, median_of(runs) if runs else None)
            if by_setting:
                first_path, first_reference = next(iter(by_setting.values()))
                found.append(
                    {
                        "pass": repeat + 1,
                        "predicted": first_path,
                        "repeats": [repeat],
                        "reference": first_reference,
                        "by_setting": by_setting,
                    }
                )
        return found
    if args.feed == "each":
        found = []
        for repeat in range(args.repeats):
            runs = runs_in(block_folder(args.out, fraction, rate, repeat))
            found.append(
                {
                    "pass": repeat + 1,
                    "predicted": predicted_file(args.out, nodes, rate, repeat),
                    "repeats": [repeat],
                    "reference": median_of(runs) if runs else None,
                }
            )
        return found
    runs = reference_steps(args.out, fraction, args.repeats)
    return [
        {
            "pass": None,
            "predicted": predicted_file(args.out, nodes, rate),
            "repeats": list(range(args.repeats)),
            "reference": median_of(runs) if runs else None,
        }
    ]


def rows_of(args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    rows, cases = [], []
    for nodes in args.node_counts:
        for rate in args.rate_list:
            for block in blocks(args, nodes, rate):
                if block["predicted"].is_file():
                    block_rows, case = block_of(args, nodes, rate, block)
                    rows += block_rows
                    cases += [case] if case else []
    return rows, cases


def block_of(
    args: argparse.Namespace, nodes: int, rate: str, block: dict
) -> tuple[list[dict], dict | None]:
    """The rows of one block's settings and its case (the command's choice against the
    measured best)."""
    rows = []
    path = block["predicted"]
    predicted = predictions(path)
    measured = {}
    fraction = fraction_for(nodes, args.total_cores)
    for hook, bucket in grid(args.full):
        # The command's output and the one-node run it was fed: with --feed job this job's
        # own (a job without one is not judged), else the block's.
        if "by_setting" in block:
            if (hook, bucket) not in block["by_setting"]:
                continue
            own_path, reference = block["by_setting"][(hook, bucket)]
        else:
            own_path, reference = path, block["reference"]
        own = predictions(own_path)
        parts, assumed_cpu = predicted_parts(own_path), predicted_cpu(own_path)
        reference_forward = one_node_forward(own_path)
        reference_cpu = one_node_cpu(reference)
        fed_speed = read_speed(pass_folder(reference)) if reference else None
        records, speeds = [], []
        for repeat in block["repeats"]:
            folder = job_folder(args.out, nodes, rate, hook, bucket, repeat)
            if (folder / "results.json").is_file():
                records.append(json.loads((folder / "results.json").read_text()))
                assert records[-1]["world_size"] == nodes, folder
                if (speed := read_speed(folder)) is not None:
                    speeds.append(speed)
        if not records:
            continue
        # The median of the runs, of the step and of each of its parts.
        steps = [float(r["step_time_median_s"]) for r in records]
        step = measured[(hook, bucket)] = statistics.median(steps)
        lab_compute, lab_exposed = _median_parts(records)
        forward = lab_forward(records)
        cpu = rank_cpu(records)
        rows.append(
            {
                "nodes": nodes,
                "core_fraction": fraction,
                "cfs_period_us": measured_period(args.out),
                "rate": rate,
                "comm_hook": hook,
                "bucket_cap_mb": bucket,
                # --feed each: the pass whose one-node run, command and job these are.
                "pass": block["pass"],
                "runs": len(records),
                # The slowest run over the fastest, minus one: the lab's own spread.
                "runs_spread": round(max(steps) / min(steps) - 1, 4),
                "measured_step_s": round(step, 4),
                "predicted_step_s": round(own[(hook, bucket)], 4),
                "error": round(own[(hook, bucket)] / step - 1, 4),
                # Where the error lies: the step's parts, measured and predicted.
                "measured_forward_backward_s": _rounded(lab_compute),
                "measured_exposed_comm_s": _rounded(lab_exposed),
                "predicted_compute_s": parts[(hook, bucket)][0],
                "predicted_exposed_comm_s": parts[(hook, bucket)][1],
                # How fast the lab computed during the job against the one-node run.
                "forward_vs_one_node": (
                    round(forward / reference_forward - 1, 4)
                    if forward and reference_forward
                    else None
                ),
                # The CPU a rank spent per step (all its threads, the kernel's work for its
                # sockets included), against the one-node run's, and the share of its node's
                # quota that used: near 1 the step is bound by the node's cores, compute and
                # communication taking turns.
                "rank_cpu_per_step_s": _rounded(cpu),
                # The rank CPU the prediction assumed (the one-node run's, the hook's and
                # the probed collectives'), against which the measured one is read.
                "predicted_rank_cpu_s": assumed_cpu.get((hook, bucket)),
                "rank_cpu_vs_one_node": (
                    round(cpu / reference_cpu - 1, 4) if cpu and reference_cpu else None
                ),
                "quota_used": round(cpu / (step * fraction), 4) if cpu else None,
                # The machine's speed before the job(s) against its speed before the fed
                # one-node run's pass (None: not read).
                "machine_vs_fed": (
                    round(statistics.median(speeds) / fed_speed - 1, 4)
                    if speeds and fed_speed
                    else None
                ),
            }
        )
    if not measured:
        return rows, None
    # The command's choice; where that setting was not measured (the reduced grid), its
    # choice among the settings that were.
    chosen = command_choice(path)
    among_measured = chosen in measured
    if not among_measured:
        chosen = min(measured, key=lambda s: predicted[s])
    best = min(measured, key=lambda s: measured[s])
    case = {
        "nodes": nodes,
        "rate": rate,
        "pass": block["pass"],
        "recommended": f"{chosen[0]} {chosen[1]}"
        + ("" if among_measured else " (among those measured)"),
        "recommended_measured_s": round(measured[chosen], 4),
        "measured_best": f"{best[0]} {best[1]}",
        "measured_best_s": round(measured[best], 4),
        "slower_than_best": round(measured[chosen] / measured[best] - 1, 4),
        "probe": probe_line(path),
    }
    return rows, case


def _median_parts(records: list[dict]) -> tuple[float | None, float | None]:
    """The median of each part over the runs that recorded it."""
    parts = [measured_parts(r) for r in records]
    computes = [c for c, _ in parts if c is not None]
    exposed = [float(e) for _, e in parts if e is not None]
    return (
        statistics.median(computes) if computes else None,
        statistics.median(exposed) if exposed else None,
    )


# A lab job whose forward (no collective in it) ran this close to the one-node run's computed
# as the model was told; a larger gap is the shared machine, not the link or the hook.
STEADY_FORWARD = 0.10


def _share(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.0%}"


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def _figure(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _runs(row: dict) -> str:
    """A row's runs and their spread, or with --feed each the pass it belongs to."""
    if row.get("pass") is not None:
        return f"pass {row['pass']}"
    return f"{row['runs']} ({row['runs_spread']:.0%})"


def _of_pass(case: dict) -> str:
    return "" if case.get("pass") is None else f" (pass {case['pass']})"


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def write(args: argparse.Namespace, rows: list[dict], cases: list[dict]) -> None:
    out = args.out
    with open(out / "scaling_validation.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (out / "scaling_validation.json").write_text(
        json.dumps({"rows": rows, "cases": cases}, indent=2)
    )
    lines = [
        "| nodes x core | link | comm_hook | bucket_cap_mb | runs (spread) | measured step s "
        "| predicted s | error | measured F + B s | predicted compute s | measured exposed s "
        "| predicted exposed s | lab's forward vs one node's | rank CPU s per step "
        "(vs one node's) | quota used |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['nodes']} x {r['core_fraction']} | {r['rate']} | {r['comm_hook']} | "
        f"{r['bucket_cap_mb']} | {_runs(r)} | "
        f"{r['measured_step_s']:.3f} | {r['predicted_step_s']:.3f} | "
        f"{r['error']:+.1%} | {_figure(r.get('measured_forward_backward_s'))} | "
        f"{_figure(r.get('predicted_compute_s'))} | {_figure(r.get('measured_exposed_comm_s'))} | "
        f"{_figure(r.get('predicted_exposed_comm_s'))} | {_share(r['forward_vs_one_node'])} | "
        f"{_figure(r.get('rank_cpu_per_step_s'))} ({_share(r.get('rank_cpu_vs_one_node'))}) | "
        f"{_percent(r.get('quota_used'))} |"
        for r in rows
    ]
    lines += [
        "",
        "| nodes | link | recommended (measured s) | measured best (s) | recommended slower by |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {c['nodes']}{_of_pass(c)} | {c['rate']} | {c['recommended']} ({c['recommended_measured_s']:.3f}) | "
        f"{c['measured_best']} ({c['measured_best_s']:.3f}) | {c['slower_than_best']:+.1%} |"
        for c in cases
    ]
    errors = [abs(r["error"]) for r in rows]
    within = sum(e <= 0.15 for e in errors)
    good = sum(c["slower_than_best"] <= 0.05 for c in cases)
    lines += [
        "",
        f"{within} of {len(rows)} predictions within 15% (largest {max(errors):.1%}; "
        f"{sum(r['error'] < 0 for r in rows)} negative); the recommendation is the measured "
        f"best or within 5% of it in {good} of {len(cases)} cases.",
    ]
    steady = [r for r in rows if r["forward_vs_one_node"] is not None]
    steady = [r for r in steady if abs(r["forward_vs_one_node"]) <= STEADY_FORWARD]
    lines.append(
        f"Of the {len(steady)} jobs whose forward ran within {STEADY_FORWARD:.0%} of the "
        f"one-node run's, {sum(abs(r['error']) <= 0.15 for r in steady)} within 15%."
    )
    lines += cpu_floor_lines(rows)
    lines += cpu_lane_lines(rows)
    lines += pass_lines(args, rows, cases)
    lines += sorted({f"- {c['nodes']} nodes{_of_pass(c)}: {c['probe']}" for c in cases})
    lines += reference_lines(args)
    (out / "scaling_validation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def pass_folder(run: Path) -> Path:
    """Node 0's folder of the pass a one-node run belongs to (a neighbour's is inside it)."""
    return run.parent.parent if run.parent.name == "neighbours" else run


def pass_lines(args: argparse.Namespace, rows: list[dict], cases: list[dict]) -> list[str]:
    """The same predictions against each pass's runs alone, and the machine's speed during
    the pass's jobs against its speed when the fed one-node run ran: a model fed one run
    cannot be nearer the jobs than the machine stayed the same machine."""
    if args.repeats == 1:
        return []  # one pass: the table is that pass
    if args.feed in BLOCK_FEEDS:
        return each_pass_lines(args, rows) + over_passes_lines(rows, cases)
    lines = []
    for nodes in args.node_counts:
        fraction = fraction_for(nodes, args.total_cores)
        runs = reference_steps(args.out, fraction, args.repeats)
        # A neighbour's run shares its pass's reading, which node 0's folder keeps.
        fed_speed = read_speed(pass_folder(median_of(runs))) if runs else None
        for repeat in range(args.repeats):
            errors, speeds = [], []
            for r in (r for r in rows if r["nodes"] == nodes):
                folder = job_folder(
                    args.out, nodes, r["rate"], r["comm_hook"], r["bucket_cap_mb"], repeat
                )
                if not (folder / "results.json").is_file():
                    continue
                record = json.loads((folder / "results.json").read_text())
                step = float(record["step_time_median_s"])
                errors.append(r["predicted_step_s"] / step - 1)
                if (speed := read_speed(folder)) is not None:
                    speeds.append(speed)
            if not errors:
                continue
            line = (
                f"- {nodes} nodes, pass {repeat + 1} alone: {sum(abs(e) <= 0.15 for e in errors)} "
                f"of {len(errors)} within 15% (mean {statistics.mean(errors):+.1%})"
            )
            if speeds and fed_speed:
                line += (
                    f"; the machine at {statistics.median(speeds) / fed_speed - 1:+.0%} of its "
                    "speed when the fed one-node run ran (median of the jobs' readings)"
                )
            lines.append(line + ".")
    return lines


def each_pass_lines(args: argparse.Namespace, rows: list[dict]) -> list[str]:
    """--feed each: each pass's predictions (every one against its own block's one-node run)
    and the machine's speed beside the jobs against its speed beside that run."""
    lines = []
    for nodes in args.node_counts:
        for number in range(1, args.repeats + 1):
            of_pass = [r for r in rows if r["nodes"] == nodes and r["pass"] == number]
            if not of_pass:
                continue
            errors = [r["error"] for r in of_pass]
            line = (
                f"- {nodes} nodes, pass {number}: {sum(abs(e) <= 0.15 for e in errors)} of "
                f"{len(errors)} within 15% (mean {statistics.mean(errors):+.1%})"
            )
            drift = [r["machine_vs_fed"] for r in of_pass if r["machine_vs_fed"] is not None]
            if drift:
                line += (
                    f"; the machine at {min(drift):+.0%} to {max(drift):+.0%} of its speed "
                    "beside the fed one-node run"
                )
            lines.append(line + ".")
    return lines


def over_passes_lines(rows: list[dict], cases: list[dict]) -> list[str]:
    """--feed each: each setting over its passes. Its error is the median of the passes'
    errors (each its prediction against its own job): a job that ran while the machine was
    slower than beside its one-node run moves one pass, not the setting. Each pass's
    recommendation is set against the settings' median measured steps."""
    settings: dict[tuple, list[dict]] = {}
    for r in rows:
        settings.setdefault((r["nodes"], r["rate"], r["comm_hook"], r["bucket_cap_mb"]), [])
        settings[(r["nodes"], r["rate"], r["comm_hook"], r["bucket_cap_mb"])].append(r)
    errors = [statistics.median(r["error"] for r in runs) for runs in settings.values()]
    if not errors:
        return []
    lines = [
        "",
        "| nodes | link | comm_hook | bucket_cap_mb | measured s, pass by pass | predicted s "
        "| errors | median error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {nodes} | {rate} | {hook} | {bucket} | "
        + ", ".join(f"{r['measured_step_s']:.3f}" for r in runs)
        + " | "
        + ", ".join(f"{r['predicted_step_s']:.3f}" for r in runs)
        + " | "
        + ", ".join(f"{r['error']:+.1%}" for r in runs)
        + f" | {error:+.1%} |"
        for ((nodes, rate, hook, bucket), runs), error in zip(settings.items(), errors, strict=True)
    ]
    lines += [
        "",
        f"Each setting's median error over its passes: {sum(abs(e) <= 0.15 for e in errors)} "
        f"of {len(errors)} within 15% (largest {max(map(abs, errors)):.1%}; "
        f"{sum(e < 0 for e in errors)} negative, mean {statistics.mean(errors):+.1%}).",
    ]
    judged = []
    for case in cases:
        steps = {
            f"{hook} {bucket}": statistics.median(r["measured_step_s"] for r in runs)
            for (nodes, rate, hook, bucket), runs in settings.items()
            if (nodes, rate) == (case["nodes"], case["rate"])
        }
        chosen = case["recommended"].removesuffix(" (among those measured)")
        judged.append(steps[chosen] / min(steps.values()) - 1)
    if judged:
        lines.append(
            f"Against the settings' median steps over the passes, each pass's recommendation "
            f"is the best or within 5% of it in {sum(j <= 0.05 for j in judged)} of "
            f"{len(judged)} cases (at most {max(judged):+.1%})."
        )
    return lines


def job_cpu_floor(row: dict) -> float:
    """A job's shortest step its CPU allows: a rank's CPU per step over its node's quota."""
    return row["rank_cpu_per_step_s"] / row["core_fraction"]


def cpu_floor_lines(rows: list[dict]) -> list[str]:
    """The predictions below their job's CPU floor: a rank's CPU per step over its node's
    quota, the shortest step those seconds of CPU allow. A prediction under it cannot be met
    whatever the link does; it says the model was not told what the job's CPU costs beyond
    the one-node run's (the collectives' copies and sockets on the node's own cores)."""
    known = [r for r in rows if r.get("rank_cpu_per_step_s")]
    if not known:
        return []
    below = [r for r in known if r["predicted_step_s"] < job_cpu_floor(r)]
    others = [r for r in known if r not in below]
    line = (
        f"{len(below)} of {len(known)} predictions lie below their job's CPU floor (a rank's "
        "CPU per step over its quota)"
    )
    if below:
        errors = sorted(r["error"] for r in below)
        line += f": their errors {errors[0]:+.1%} to {errors[-1]:+.1%}"
    if others:
        line += f"; the other {len(others)}: mean error {statistics.mean(r['error'] for r in others):+.1%}"
    return [line + "."]


def cpu_lane_lines(rows: list[dict]) -> list[str]:
    """Where an error lies, for the model's CPU lane: a job's lane, measured (a rank's CPU
    per step over its quota plus its exposed communication, both the job's own), against
    its measured step, and the prediction against that lane. A lane above the step says the
    job overlapped that much of its CPU with its wait on the wire, which the lane (the
    model's floor: CPU / cores + exposed) counts one after the other; the prediction
    against the lane is the model's own error on the lane's parts. Medians over a rate and
    hook's jobs."""
    groups: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    assumed: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        cpu, exposed = r.get("rank_cpu_per_step_s"), r.get("measured_exposed_comm_s")
        if not cpu or exposed is None:
            continue
        lane = job_cpu_floor(r) + exposed
        step, predicted = r["measured_step_s"], r["predicted_step_s"]
        groups.setdefault((r["rate"], r["comm_hook"]), []).append(
            (lane / step - 1, predicted / lane - 1, predicted / step - 1)
        )
        if r.get("predicted_rank_cpu_s"):
            assumed.setdefault((r["rate"], r["comm_hook"]), []).append(
                r["predicted_rank_cpu_s"] / cpu - 1
            )
    if not groups:
        return []
    lines = [
        "The CPU lane, measured (a rank's CPU per step over its quota plus the exposed "
        "communication, both the job's), against the measured step, and the prediction "
        "against that lane (medians over the jobs):"
    ]
    for (rate, hook), values in sorted(groups.items()):
        over_step = [v[0] for v in values]
        lines.append(
            f"- {rate} {hook}: lane vs step {statistics.median(over_step):+.1%} "
            f"({min(over_step):+.0%} to {max(over_step):+.0%}), predicted vs lane "
            f"{statistics.median(v[1] for v in values):+.1%}, predicted vs step "
            f"{statistics.median(v[2] for v in values):+.1%} ({len(values)} jobs)"
            + (
                f"; the rank CPU it assumed vs the job's {statistics.median(cpu_errors):+.1%}"
                if (cpu_errors := assumed.get((rate, hook)))
                else ""
            )
        )
    return lines


def reference_lines(args: argparse.Namespace) -> list[str]:
    """Each block's one-node runs (median step s) and the one the command was fed."""
    lines = []
    for nodes in args.node_counts:
        fraction = fraction_for(nodes, args.total_cores)
        if args.feed == "job":
            # One line a job: its own one-node runs and the one its command was fed.
            labelled = [
                (
                    f"{nodes} nodes, {rate}, pass {r + 1}, {hook} {bucket}",
                    runs_in(block_folder(args.out, fraction, rate, r, (hook, bucket))),
                )
                for r in range(args.repeats)
                for rate in args.rate_list
                for hook, bucket in grid(args.full)
            ]
        elif args.feed == "each":
            found = [
                (f"{nodes} nodes, {rate}, pass {r + 1}", block_folder(args.out, fraction, rate, r))
                for r in range(args.repeats)
                for rate in args.rate_list
            ]
            labelled = [(label, runs_in(folder)) for label, folder in found]
        else:
            labelled = [(f"{nodes} nodes", reference_steps(args.out, fraction, args.repeats))]
        lines += [reference_line(args, label, runs, fraction) for label, runs in labelled if runs]
    return lines


def reference_line(
    args: argparse.Namespace, label: str, runs: list[tuple[float, Path]], fraction: float
) -> str:
    steps = [step for step, _ in runs]
    fed = median_of(runs)
    fed_step = next(step for step, folder in runs if folder == fed)
    cpu = one_node_cpu(fed)
    used = ""
    if cpu:
        used = f", {cpu:.3f} s of CPU a step ({cpu / (fed_step * fraction):.0%} of its quota)"
    listed = (
        ", ".join(f"{s:.3f}" for s in steps) + " s"
        if len(steps) <= 4
        else f"{min(steps):.3f} to {max(steps):.3f} s, median {statistics.median(steps):.3f} s"
    )
    return (
        f"- {label}: {len(steps)} one-node run{'s' if len(steps) > 1 else ''} {listed} "
        f"(spread {max(steps) / min(steps) - 1:.0%}); the command was fed "
        f"{fed.relative_to(args.out)}{used}"
    )


def add_run_arguments(parser: argparse.ArgumentParser, nodes: str, name: str, prefix: str) -> None:
    """What this script and the others that share its lab and quotas take alike."""
    parser.add_argument("--nodes", default=nodes)
    parser.add_argument("--rates", default="200mbit,1gbit")
    parser.add_argument("--total-cores", type=float, default=1.6, help="shared out among nodes")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / name)
    parser.add_argument("--image-size", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--one-node-steps", type=int, default=8)
    parser.add_argument("--prefix", default=prefix, help="of the lab's nodes and cgroups")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--report-only", action="store_true")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser, "2,4,8", "scaling_validation", "sv")
    parser.add_argument("--full", action="store_true", help="every hook at every bucket size")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of each lab job (each repeat goes once through the grid); the table takes "
        "the median of the runs and their spread",
    )
    parser.add_argument(
        "--cfs-period-us",
        type=int,
        default=DEFAULT_PERIOD_US,
        help="the quota's period (1000-1000000): a throttled node waits up to "
        "(1 - fraction) x period before it runs again, the one-node run alike",
    )
    parser.add_argument(
        "--feed",
        choices=["median", *BLOCK_FEEDS],
        default="median",
        help="what the command is fed: the median of every pass's one-node runs, its "
        "predictions set against each setting's median run (median); or each pass and rate "
        "a block of its own (one-node runs, that rate's jobs, the command fed the block's "
        "median one-node run), every prediction against its own block's job (each); or "
        "each job its own one-node runs right before it and the command fed them right "
        "after it, the lab probed once a pass and rate (job)",
    )
    parser.add_argument(
        "--link-from",
        choices=["rate", "lab"],
        default="rate",
        help="what the command is told of the link: the rate (--link 200mbit), or the lab "
        "itself (--link lab: an all-reduce probe over all its nodes, each in the lab's own "
        "quota of the same fraction, under which the lab's jobs then run too)",
    )
    args = parser.parse_args()
    args.node_counts = [int(n) for n in args.nodes.split(",")]
    if args.repeats < 1:
        parser.error(
            f"--repeats={args.repeats} is not valid: at least one run of each job. "
            "Fix: e.g. --repeats 3"
        )
    # cgroup v1's limits, as the lab checks them (netlab.check_cpu_period) for its own option.
    low, high = CPU_PERIOD_RANGE_US
    if not low <= args.cfs_period_us <= high:
        parser.error(
            f"--cfs-period-us={args.cfs_period_us} is not valid: cgroup v1 takes {low} to "
            f"{high} us. Fix: e.g. --cfs-period-us 10000"
        )
    for nodes in args.node_counts:
        fraction = fraction_for(nodes, args.total_cores)
        if fraction * args.cfs_period_us < MIN_CPU_QUOTA_US:
            parser.error(
                f"--cfs-period-us={args.cfs_period_us} is not valid for {nodes} nodes: each "
                f"gets {fraction:g} of a core, a quota of {fraction * args.cfs_period_us:.0f} "
                f"us, and cgroup v1 takes none under {MIN_CPU_QUOTA_US}. Fix: --cfs-period-us "
                f"{math.ceil(MIN_CPU_QUOTA_US / fraction)} or more"
            )
    args.rate_list = [r for r in args.rates.split(",") if r]
    recorded = args.out / PERIOD_FILE
    if not args.report_only and recorded.is_file():
        before = int(recorded.read_text())
        if before != args.cfs_period_us:
            parser.error(
                f"--cfs-period-us={args.cfs_period_us} is not valid for --out {args.out}: "
                f"its runs were measured with {before} us, and they would be kept beside "
                f"the new ones. Fix: give another --out, or --cfs-period-us {before}"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        (args.out / PERIOD_FILE).write_text(str(args.cfs_period_us))
        try:
            measure(args)
        finally:
            remove_groups(args.prefix)
    rows, cases = rows_of(args)
    if not rows:
        other = "median" if args.feed in BLOCK_FEEDS else "each"
        print(
            f"error: --out {args.out} holds no lab job beside a prediction of the command for "
            f"--nodes {args.nodes} --rates {args.rates} --feed {args.feed}: nothing to report. "
            f"Fix: measure there first (without --report-only), or give the --nodes, --rates "
            f"and --feed it was measured with (e.g. --feed {other})",
            file=sys.stderr,
        )
        return 2
    write(args, rows, cases)
    return 0


if __name__ == "__main__":
    sys.exit(main())
