"""`strategy=fsdp` beside `strategy=ddp` on lab nodes at two link rates: measured step time,
and the step each one's model predicts from the same one-node run.

The machine's cores are shared out as N lab nodes of a fraction of a core each (the cgroup
quotas of benchmarks/scaling_validation.py, which this reuses), and in order:

1. the one-node run users feed the models (`train.py experiment=benchmark strategy=ddp
   devices=1`), on node 0's core and quota with the other nodes' cores busy;
2. the predictions, each through the command users run, on the same core and quota: DDP's
   from `python -m ddp_template.tools.scaling <one-node run> --nodes N --link <rate>`
   (comm_hook=none at bucket_cap_mb=25), FSDP's from the dry run
   (`train.py debug=dry_run strategy=fsdp num_nodes=N dry_run.measured_run=<one-node run>
   dry_run.link=<rate>`: all-gathers and reduce-scatters per unit, `tools/scaling.py`'s
   `predict_sharded`);
3. the N-node jobs on the lab, one torchrun agent per node, each node in its quota: `ddp`
   and `fsdp` (wrapped by ResNet's `BasicBlock`) at each rate.

No figure from the N-node jobs goes into a prediction. Prints measured and predicted step
per strategy and rate, and fsdp's step over ddp's; writes fsdp_lab.csv/.md into --out.

    .venv/bin/python benchmarks/fsdp_lab.py --nodes 2 --out /tmp/fl   # as root, about 4 min here
    .venv/bin/python benchmarks/fsdp_lab.py --nodes 2 --link-from lab --out /tmp/fll
    .venv/bin/python benchmarks/fsdp_lab.py --nodes 2 --out /tmp/fl --report-only
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import scaling_validation as sv  # noqa: E402

from ddp_template.tools.netlab import Lab, parse_rate  # noqa: E402

ROOT = sv.ROOT
FSDP = ["strategy=fsdp", "strategy.wrap=[BasicBlock]"]
DDP = ["strategy=ddp", "strategy.comm_hook=none", "strategy.bucket_cap_mb=25"]


def strategy_args(strategy: str) -> list[str]:
    return FSDP if strategy == "fsdp" else DDP


def train_args(args: argparse.Namespace, strategy: str, warmup: int, steps: int) -> list[str]:
    # scaling_validation's benchmark run, its strategy replaced.
    common = [a for a in sv.train_args(args, warmup, steps) if not a.startswith("strategy=")]
    return [*common, *strategy_args(strategy)]


def probe_file(args: argparse.Namespace, nodes: int, rate: str) -> Path:
    """With --link-from lab: the lab probed as users probe it (`netlab probe --allreduce
    --save`: the all-reduce alone and while the nodes compute, FSDP's all-gather), every
    node in its quota; both models take the file as their link."""
    saved = args.out / f"probe_{nodes}_{rate}.json"
    if not saved.is_file():
        command = [sv.PYTHON, "-m", "ddp_template.tools.netlab", "probe", "--prefix"]
        command += [args.prefix, "--repeats", "3", "--allreduce", "--save", str(saved)]
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
        if done.returncode:
            raise RuntimeError(f"the probe failed: {done.stderr[-3000:]}")
        (args.out / f"probe_{nodes}_{rate}.txt").write_text(done.stdout + done.stderr)
        print(done.stdout, flush=True)
    return saved


def fsdp_prediction(out: Path, nodes: int, rate: str) -> float:
    """FSDP's predicted step, from the dry run's record."""
    plan = json.loads((out / f"dry_run_{nodes}_{rate}" / "dry_run.json").read_text())
    return float(plan["prediction"]["per_hook"]["fsdp"]["step_s"])


def predict_fsdp(
    args: argparse.Namespace, one_node: Path, nodes: int, rate: str, link: str | None = None
) -> None:
    """FSDP's predicted step through the dry run, fed the one-node run's compute, on the
    rate (or `link`: a probe's file)."""
    folder = args.out / f"dry_run_{nodes}_{rate}"
    if not (folder / "dry_run.json").is_file():
        group = sv.make_group(args.prefix, f"{args.prefix}-node0", args.current, args.cfs_period_us)
        command = [
            *sv.placement(args, 0),
            sv.PYTHON,
            str(ROOT / "train.py"),
            *train_args(args, "fsdp", args.warmup, args.steps),
            "debug=dry_run",
            f"num_nodes={nodes}",
            "devices=1",
            f"dry_run.measured_run={one_node}",
            f"dry_run.link={link or rate}",
            "dry_run.latency_us=50",
            f"hydra.run.dir={folder}",
        ]
        done = subprocess.run(sv.in_group(group, command), capture_output=True, text=True, cwd=ROOT)
        if done.returncode:
            raise RuntimeError(f"the dry run failed: {done.stderr[-3000:]}")
        (args.out / f"dry_run_{nodes}_{rate}.txt").write_text(done.stdout)


def measure(args: argparse.Namespace) -> None:
    port = 29500 + os.getpid() % 400
    for nodes in args.node_counts:
        args.current = sv.fraction_for(nodes, args.total_cores)
        sv.wait_for_memory(2000 * nodes + 2000)
        # The one-node run and DDP's predictions (every hook and bucket size; one is used).
        one_node = sv.one_node_run(args, args.current, nodes)
        probed = args.link_from == "lab"
        if not probed:
            for rate in args.rate_list:
                predict_fsdp(args, one_node, nodes, rate)
        quota = args.current if probed else None
        lab = Lab.up(nodes=nodes, rate=args.rate_list[0], prefix=args.prefix, cpu_fraction=quota)
        try:
            for rate in args.rate_list:
                lab.set_rate(parse_rate(rate))
                if probed:
                    # Both models through the commands users run, told the probed link.
                    link = str(probe_file(args, nodes, rate))
                    group = sv.make_group(
                        args.prefix, f"{args.prefix}-node0", args.current, args.cfs_period_us
                    )
                    sv.predict_with_the_command(
                        args, one_node, nodes, rate, group, ["--link", link]
                    )
                    predict_fsdp(args, one_node, nodes, rate, link)
                for strategy in ("ddp", "fsdp"):
                    port += 1
                    folder = args.out / f"{nodes}nodes_{rate}" / strategy
                    started = time.monotonic()
                    overrides = train_args(args, strategy, args.warmup, args.steps)
                    sv.lab_run(args, lab, folder, overrides, port)
                    print(
                        f"{nodes} nodes x {args.current} core, {rate}, {strategy}: "
                        f"{time.monotonic() - started:.0f} s",
                        flush=True,
                    )
        finally:
            lab.down()


def rows_of(args: argparse.Namespace) -> list[dict]:
    rows = []
    for nodes in args.node_counts:
        for rate in args.rate_list:
            ddp_predicted = sv.predictions(args.out / f"predicted_{nodes}_{rate}.txt")
            predicted = {
                "ddp": ddp_predicted[("none", 25)],
                "fsdp": fsdp_prediction(args.out, nodes, rate),
            }
            measured = {}
            for strategy in ("ddp", "fsdp"):
                results = args.out / f"{nodes}nodes_{rate}" / strategy / "results.json"
                if not results.is_file():
                    continue
                record = json.loads(results.read_text())
                assert record["world_size"] == nodes, results
                measured[strategy] = float(record["step_time_median_s"])
            for strategy, step in measured.items():
                rows.append(
                    {
                        "nodes": nodes,
                        "core_fraction": sv.fraction_for(nodes, args.total_cores),
                        "rate": rate,
                        "strategy": strategy,
                        "measured_step_s": round(step, 4),
                        "predicted_step_s": round(predicted[strategy], 4),
                        "error": round(predicted[strategy] / step - 1, 4),
                        "over_ddp_measured": round(step / measured["ddp"], 3)
                        if "ddp" in measured
                        else None,
                        "over_ddp_predicted": round(predicted[strategy] / predicted["ddp"], 3),
                    }
                )
    return rows


def write(args: argparse.Namespace, rows: list[dict]) -> None:
    with open(args.out / "fsdp_lab.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        "| nodes x core | link | strategy | measured step s | predicted s | error "
        "| step / ddp's, measured | predicted |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['nodes']} x {r['core_fraction']} | {r['rate']} | {r['strategy']} | "
        f"{r['measured_step_s']:.3f} | {r['predicted_step_s']:.3f} | {r['error']:+.1%} | "
        f"{r['over_ddp_measured']:.2f} | {r['over_ddp_predicted']:.2f} |"
        for r in rows
    ]
    (args.out / "fsdp_lab.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sv.add_run_arguments(parser, "2", "fsdp_lab", "fl")
    parser.add_argument(
        "--link-from",
        choices=["rate", "lab"],
        default="rate",
        help="what the models are told of the link: the rate, or the lab probed under the "
        "nodes' quotas (netlab probe --allreduce --save: the all-reduce alone and while the "
        "nodes compute, and FSDP's all-gather), the jobs then run in those quotas too",
    )
    args = parser.parse_args()
    args.node_counts = [int(n) for n in args.nodes.split(",")]
    args.rate_list = [r for r in args.rates.split(",") if r]
    args.cfs_period_us = sv.DEFAULT_PERIOD_US
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        try:
            measure(args)
        finally:
            sv.remove_groups(args.prefix)
    write(args, rows_of(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
