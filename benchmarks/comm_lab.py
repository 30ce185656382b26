"""Communication settings side by side, over a real (shaped) network: two lab nodes
(`ddp_template.tools.netlab`), one core each, one torchrun agent per node, at each link rate.

For every rate it runs `experiment=benchmark` as a 2-node job for the article's recipes
(`recipe=baseline,amp,data,comm`), the communication hooks (`strategy.comm_hook=fp16,bf16,
powersgd` on the baseline) and bucket sizes (`strategy.bucket_cap_mb=1,5,25,100`), and the
same recipes once on one node alone (the compute reference). Each step is split into
compute (the one-node step without its data wait, plus the hook's own work), communication
not hidden behind compute (the rest of the 2-node step) and data wait (measured); beside
it, the step time `ddp_template.tools.scaling` predicts from the one-node run and the link rate
the lab measured. Writes comm_lab.md, comm_lab.csv and comm_lab.png into --out.

    .venv/bin/python benchmarks/comm_lab.py --rates 200mbit,1gbit     # as root
    .venv/bin/python benchmarks/comm_lab.py --tiny                    # a few steps (tests)

Other work on the same cores shows up in the figures: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from ddp_template.tools.netlab import Lab, format_rate, parse_rate  # noqa: E402
from ddp_template.tools.scaling import Link, load_run, predict, probe_hook_costs  # noqa: E402

RECIPES = ["baseline", "amp", "data", "comm"]
HOOK_SETTINGS = ["fp16", "bf16", "powersgd"]
BUCKETS = [1, 5, 25, 100]


def settings(tiny: bool) -> list[tuple[str, str, list[str]]]:
    """(name, one-node reference, overrides) of every 2-node run. The reference is the same
    setting on one node (the bucket size changes no compute), so it includes the hook's own
    work: DDP calls the hook at world size 1 too."""
    if tiny:
        return [
            ("recipe=baseline", "baseline", ["recipe=baseline"]),
            ("comm_hook=fp16", "fp16", ["recipe=baseline", "strategy.comm_hook=fp16"]),
        ]
    rows = [(f"recipe={r}", r, [f"recipe={r}"]) for r in RECIPES]
    rows += [
        (f"comm_hook={h}", h, ["recipe=baseline", f"strategy.comm_hook={h}"]) for h in HOOK_SETTINGS
    ]
    rows += [
        (f"bucket_cap_mb={b}", "baseline", ["recipe=baseline", f"strategy.bucket_cap_mb={b}"])
        for b in BUCKETS
    ]
    return rows


def common(args: argparse.Namespace) -> list[str]:
    return [
        "experiment=benchmark",
        "accelerator=cpu",
        f"data.image_size={args.image_size}",
        f"data.batch_size={args.batch_size}",
        f"benchmark.warmup_steps={args.warmup}",
        f"benchmark.steps={args.steps}",
    ]


def two_node_run(lab: Lab, folder: Path, overrides: list[str], port: int, timeout: float) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    torchrun = str(Path(sys.executable).parent / "torchrun")
    procs = []
    logs = contextlib.ExitStack()
    for node in (0, 1):
        command = [
            torchrun,
            "--nnodes=2",
            "--nproc_per_node=1",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint=node0:{port}"
            if lab.prefix == "ddplab"
            else f"--rdzv_endpoint={lab.nodes[0].hostname}:{port}",
            f"--rdzv_id=bench{port}",
            str(ROOT / "train.py"),
            *overrides,
            f"hydra.run.dir={folder}",
        ]
        log = logs.enter_context((folder / f"node{node}.log").open("w"))
        procs.append(lab.popen(node, command, stdout=log, stderr=log, cwd=folder))
    deadline = time.monotonic() + timeout
    with logs:
        for proc in procs:
            proc.wait(timeout=max(1, deadline - time.monotonic()))
    if any(p.returncode for p in procs):
        raise RuntimeError(f"2-node run failed: see {folder}/node*.log")
    return json.loads((folder / "results.json").read_text())


def one_node_run(lab: Lab, folder: Path, overrides: list[str], timeout: float) -> None:
    command = [
        sys.executable,
        str(ROOT / "train.py"),
        *overrides,
        "strategy=ddp",
        "devices=1",
        f"hydra.run.dir={folder}",
    ]
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "node0.log", "w") as log:
        proc = lab.popen(0, command, stdout=log, stderr=log, cwd=folder)
        if proc.wait(timeout=timeout):
            raise RuntimeError(f"one-node run failed: see {folder}/node0.log")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="200mbit,1gbit")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "comm_lab")
    parser.add_argument("--image-size", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prefix", default="ddplab")
    parser.add_argument("--tiny", action="store_true", help="2 settings, 2 steps, one rate")
    parser.add_argument(
        "--report-only", action="store_true", help="rebuild the report from --out's runs"
    )
    args = parser.parse_args()
    if args.tiny:
        args.rates, args.warmup, args.steps, args.image_size = args.rates.split(",")[0], 1, 2, 8
    rates = [r for r in args.rates.split(",") if r]
    for rate in rates:
        parse_rate(rate)
    if not args.report_only:
        measure(args, rates)
    _write(args.out, rows_of(args.out, rates, args.tiny))
    return 0


def measure(args: argparse.Namespace, rates: list[str]) -> None:
    """Runs every one-node reference and 2-node setting; each leaves its results.json, and
    each rate the lab's probes (probe_<rate>.json)."""
    lab = Lab.up(nodes=2, rate=rates[0], prefix=args.prefix)
    base = common(args)
    try:
        done = set()
        for _name, reference, overrides in settings(args.tiny):
            if reference not in done:
                one_node_run(lab, args.out / "one_node" / reference, [*base, *overrides], 600)
                done.add(reference)
        port = 29400 + os.getpid() % 500
        for rate in rates:
            lab.set_rate(parse_rate(rate))
            fast = (parse_rate(rate) or 0) >= 5e8
            probes = {
                "tcp_bps": lab.probe(megabytes=20 if fast else 8),
                "allreduce": lab.allreduce_probe(megabytes=16 if fast else 8),
            }
            (args.out / rate).mkdir(parents=True, exist_ok=True)
            (args.out / f"probe_{rate}.json").write_text(json.dumps(probes, indent=2))
            print(f"{rate}: {probes}", flush=True)
            for name, _reference, overrides in settings(args.tiny):
                port += 1
                folder = args.out / rate / name.replace("=", "-")
                two_node_run(lab, folder, [*base, *overrides], port, timeout=900)
                print(f"{rate} {name}: done", flush=True)
    finally:
        lab.down()


def rows_of(out: Path, rates: list[str], tiny: bool) -> list[dict]:
    """The report's rows from the runs in `out`, with the model's predictions."""
    references = {p.name: load_run(p) for p in (out / "one_node").iterdir()}
    # What each hook costs in compute, measured: its one-node step less the baseline's.
    base_step = references["baseline"].step_s
    costs = {"none": 0.0}
    costs.update(
        {h: max(0.0, references[h].step_s - base_step) for h in references if h in HOOK_SETTINGS}
    )
    probed_costs = probe_hook_costs(references["baseline"], ["none", *HOOK_SETTINGS])
    print("hook compute, measured on one node:", _ms(costs), "; probe:", _ms(probed_costs))
    rows = []
    for rate in rates:
        probes = json.loads((out / f"probe_{rate}.json").read_text())
        link, probed = probes["tcp_bps"], Link.probed(probes["allreduce"])
        print(f"{rate}: TCP {format_rate(int(link))}; all-reduce {probed.describe()}")
        for name, recipe, overrides in settings(tiny):
            record = json.loads((out / rate / name.replace("=", "-") / "results.json").read_text())
            rows.append(
                _row(rate, link, probed, name, recipe, overrides, record, references, costs)
            )
            print(_line(rows[-1]), flush=True)
    return rows


def _hook_of(overrides: list[str], recipe: str) -> str:
    for o in overrides:
        if o.startswith("strategy.comm_hook="):
            return o.split("=", 1)[1]
    return "fp16" if recipe == "comm" else "none"


def _bucket_of(overrides: list[str], recipe: str) -> float | None:
    for o in overrides:
        if o.startswith("strategy.bucket_cap_mb="):
            return float(o.split("=", 1)[1])
    return 50.0 if recipe == "comm" else None


def _ms(costs: dict[str, float]) -> str:
    return ", ".join(f"{h} {c * 1000:.0f} ms" for h, c in costs.items())


def _row(rate, link, probed, name, recipe, overrides, record, references, costs) -> dict:
    hook = _hook_of(overrides, recipe)
    reference = references[recipe]
    step = float(record["step_time_median_s"])
    wait = step * float(record.get("data_wait_fraction") or 0)
    compute = reference.step_s - reference.data_wait_s
    # The model starts from the run without a hook and adds the hook's measured cost
    # (the comm recipe's reference already holds its fp16 hook).
    model_from = references["baseline"] if recipe in HOOK_SETTINGS else reference
    cost = costs.get(hook, 0.0) if recipe in HOOK_SETTINGS else 0.0
    predicted = predict(model_from, 2, hook, probed, cost, _bucket_of(overrides, recipe))
    return {
        "rate": rate,
        "measured_link": format_rate(int(link)),
        "setting": name,
        "step_s": round(step, 4),
        "compute_s": round(compute, 4),
        "exposed_comm_s": round(max(0.0, step - compute - wait), 4),
        "data_wait_s": round(wait, 4),
        "samples_per_s": round(float(record["samples_per_sec"]), 1),
        "one_node_samples_per_s": round(
            reference.samples_per_step_per_device / reference.step_s, 1
        ),
        "predicted_step_s": round(predicted.step_s, 4),
        "prediction_error": round(predicted.step_s / step - 1, 3),
    }


def _line(row: dict) -> str:
    return (
        f"{row['rate']:>8} {row['setting']:<20} step {row['step_s']:.3f} s = compute {row['compute_s']:.3f} "
        f"+ exposed comm {row['exposed_comm_s']:.3f} + data wait {row['data_wait_s']:.3f}; "
        f"{row['samples_per_s']:.1f} samples/s; predicted {row['predicted_step_s']:.3f} s ({row['prediction_error']:+.0%})"
    )


def _write(out: Path, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "comm_lab.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    header = "| rate (measured) | setting | step s | compute s | exposed comm s | data wait s | samples/s | predicted step s | error |"
    lines = [header, "|" + "---|" * 9]
    for r in rows:
        lines.append(
            f"| {r['rate']} ({r['measured_link']}) | {r['setting']} | {r['step_s']:.3f} | {r['compute_s']:.3f} | "
            f"{r['exposed_comm_s']:.3f} | {r['data_wait_s']:.3f} | {r['samples_per_s']:.1f} | "
            f"{r['predicted_step_s']:.3f} | {r['prediction_error']:+.0%} |"
        )
    (out / "comm_lab.md").write_text("\n".join(lines) + "\n")
    _plot(out, rows)
    print("\n".join(lines))


def _plot(out: Path, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({r["rate"] for r in rows}, key=lambda r: parse_rate(r) or 0)
    fig, axes = plt.subplots(1, len(rates), figsize=(7 * len(rates), 5), squeeze=False)
    for ax, rate in zip(axes[0], rates, strict=True):
        mine = [r for r in rows if r["rate"] == rate]
        names = [r["setting"] for r in mine]
        bottom = [0.0] * len(mine)
        for part, color in (
            ("compute_s", "#4c72b0"),
            ("exposed_comm_s", "#dd8452"),
            ("data_wait_s", "#55a868"),
        ):
            values = [r[part] for r in mine]
            ax.bar(
                names,
                values,
                bottom=bottom,
                label=part.removesuffix("_s").replace("_", " "),
                color=color,
            )
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.scatter(
            names,
            [r["predicted_step_s"] for r in mine],
            color="black",
            marker="_",
            s=400,
            label="predicted step",
            zorder=3,
        )
        ax.set_title(f"2 nodes x 1 core, link {rate}")
        ax.set_ylabel("seconds per step")
        ax.tick_params(axis="x", rotation=60)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "comm_lab.png", dpi=100)


if __name__ == "__main__":
    sys.exit(main())
