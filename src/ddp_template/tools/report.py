"""A sweep folder -> one comparison table: `report.md`, `report.csv` and `report.png`.

    python train.py -m experiment=benchmark recipe=baseline,amp,data,comm,shard
    python -m ddp_template.tools.report multirun/<date>/<time>_<pid>

Each job of the sweep is one row, named by the overrides that differ between the jobs
(`recipe=amp`, `strategy.bucket_cap_mb=50`, ...), read from the job's `.hydra/overrides.yaml`.
Speed-up and memory change are relative to the baseline row: the job with `recipe=baseline`
when there is one, else the first job (`--baseline TEXT` picks another).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import yaml

from ddp_template.errors import UserFacingError
from ddp_template.metrics import best_key
from ddp_template.worker.results import RESULTS_FILE

OVERRIDES_FILE = Path(".hydra") / "overrides.yaml"
OUTPUTS = ("report.md", "report.csv", "report.png")

CSV_COLUMNS = (
    "setting",
    "samples_per_sec",
    "samples_per_sec_per_device",
    "tflops_per_sec_per_device",
    "mfu",
    "step_time_median_s",
    "step_time_p90_s",
    "exposed_comm_s",
    "data_wait_fraction",
    "peak_memory_mb",
    "memory_kind",
    "model_state_mb",
    "speedup",
    "memory_change",
    "monitor",
    "monitor_best",
    "precision_used",
    "world_size",
    "strategy",
    "bucket_cap_mb",
    "comm_hook",
    "repeats",
    "job_dir",
)

MEMORY_KINDS = {"cuda_max_allocated": "CUDA max allocated", "host_peak_rss": "host peak RSS"}


class NoResults(UserFacingError):
    """The folder holds no results of this project's runs."""


def load_rows(
    folder: str | Path, baseline: str | None = None, median_over: str | None = None
) -> list[dict[str, Any]]:
    """One dict per job of a sweep folder (in job order), with speed-up and memory change
    relative to the baseline row. Jobs that left no results.json are left out.

    `median_over="seed"` merges the jobs that differ only in that key into one row holding
    the medians of their figures: repetitions of each setting, interleaved by the sweep
    (`seed=1,2,3 recipe=...` runs every recipe once per seed), even out a machine whose
    load changes while the sweep runs."""
    folder = Path(folder)
    jobs = _job_dirs(folder)
    read = {job: _read_results(job) for job in jobs}
    measured = [(job, result) for job, result in read.items() if result is not None]
    if not measured:
        raise NoResults(_no_results_message(folder, jobs))
    overrides = {job: _overrides(job) for job, _ in measured}
    names = _setting_names(overrides)
    rows = [_row(job, result, names[job], overrides[job]) for job, result in measured]
    if median_over:
        rows = _medians(rows, median_over)
    _add_relative_columns(rows, _baseline_index(rows, baseline))
    return rows


# Figures of a row that repetitions are reduced to the median of.
_MEASURED = (
    "samples_per_sec",
    "samples_per_sec_per_device",
    "tflops_per_sec_per_device",
    "mfu",
    "step_time_median_s",
    "step_time_p90_s",
    "exposed_comm_s",
    "data_wait_fraction",
    "peak_memory_mb",
    "model_state_mb",
    "monitor_best",
)


def _medians(rows: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        name = " ".join(p for p in row["setting"].split() if _split(p)[0] != key)
        groups.setdefault(name or "(all)", []).append(row)
    if all(len(group) == 1 for group in groups.values()):
        raise UserFacingError(
            f"--median-over {key}: no two jobs differ only in {key}, so there is nothing to "
            f"take a median of. Fix: sweep {key} too, e.g. `{key}=1,2,3 recipe=...`, or leave "
            "--median-over out."
        )
    merged = []
    for name, group in groups.items():
        row = {**group[0], "setting": name, "repeats": len(group), "median_over": key}
        row["finished_at"] = max(str(r["finished_at"]) for r in group)
        for column in _MEASURED:
            values = [r[column] for r in group if r[column] is not None]
            row[column] = statistics.median(values) if values else None
        merged.append(row)
    return merged


def missing_jobs(folder: str | Path) -> list[str]:
    """Settings of the jobs that ran (they have overrides) but wrote no results.json."""
    jobs = _job_dirs(Path(folder))
    names = _setting_names({job: _overrides(job) for job in jobs})
    return [names[job] for job in jobs if _read_results(job) is None]


def _job_dirs(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    found = {p.parent for p in folder.rglob(RESULTS_FILE)}
    found |= {p.parent.parent for p in folder.rglob(str(OVERRIDES_FILE))}
    return sorted(found, key=_job_order)


def _job_order(job: Path) -> tuple:
    # Hydra numbers the jobs of a sweep 0, 1, ... 10: numeric order, not text order.
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in job.parts)


def _read_results(job: Path) -> dict[str, Any] | None:
    file = job / RESULTS_FILE
    try:
        result = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(result, dict) or "samples_per_sec" not in result:
        return None
    return result


def _no_results_message(folder: Path, jobs: list[Path]) -> str:
    if not folder.is_dir():
        return (
            f"{folder} is not a folder. Point the report at a sweep folder, e.g. "
            "`python -m ddp_template.tools.report multirun/<date>/<time>_<pid>` after "
            "`python train.py -m experiment=benchmark recipe=baseline,amp,data,comm`."
        )
    if jobs:
        return (
            f"{folder} holds {len(jobs)} job folder(s) but none has a readable {RESULTS_FILE} "
            "with a samples/s figure: the jobs failed or are still running (see each job's "
            "train.log). Run the report again once they have finished."
        )
    return (
        f"{folder} holds no {RESULTS_FILE} of a training run, so there is nothing to compare. "
        "Point the report at the folder a sweep wrote (multirun/<date>/<time>_<pid>, the one "
        "holding multirun.yaml and the numbered job folders), or at a folder of runs."
    )


def _overrides(job: Path) -> list[str]:
    file = job / OVERRIDES_FILE
    if not file.is_file():
        return []
    loaded = yaml.safe_load(file.read_text()) or []
    return [str(item) for item in loaded]


def _split(override: str) -> tuple[str, str]:
    key, _, value = override.partition("=")
    return key.lstrip("+~"), value


def _setting_names(overrides: dict[Path, list[str]]) -> dict[Path, str]:
    """Names made of the overrides whose value differs between jobs."""
    parsed = {job: dict(_split(o) for o in items) for job, items in overrides.items()}
    keys = {key for items in parsed.values() for key in items if not key.startswith("hydra.")}
    varying = sorted(
        (key for key in keys if len({items.get(key) for items in parsed.values()}) > 1),
        key=lambda key: _first_position(key, overrides),
    )
    names = {}
    for job, items in parsed.items():
        shown = varying if len(parsed) > 1 else sorted(items)
        parts = [f"{key}={items[key]}" for key in shown if key in items]
        names[job] = " ".join(parts) or job.name
    return names


def _first_position(key: str, overrides: dict[Path, list[str]]) -> int:
    """Keys keep the order they were typed in."""
    for items in overrides.values():
        for position, override in enumerate(items):
            if _split(override)[0] == key:
                return position
    return 0


def _row(job: Path, result: dict[str, Any], name: str, overrides: list[str]) -> dict[str, Any]:
    ddp = result.get("ddp") or {}
    return {
        "setting": name,
        "overrides": overrides,
        "machine": result.get("machine"),
        "finished_at": result.get("finished_at"),
        "samples_per_sec": result.get("samples_per_sec"),
        "samples_per_sec_per_device": result.get("samples_per_sec_per_device"),
        "tflops_per_sec_per_device": result.get("tflops_per_sec_per_device"),
        "mfu": result.get("mfu"),
        "step_time_median_s": result.get("step_time_median_s"),
        "step_time_p90_s": result.get("step_time_p90_s"),
        "exposed_comm_s": result.get("exposed_comm_s"),
        "data_wait_fraction": result.get("data_wait_fraction"),
        "peak_memory_mb": result.get("peak_memory_mb"),
        "memory_kind": result.get("memory_kind"),
        "model_state_mb": model_state_mb(result),
        "speedup": None,
        "memory_change": None,
        # The task's own measure of the job: the best validation value of its monitored metric.
        "monitor": result.get("monitor"),
        "monitor_best": result.get(best_key(result["monitor"])) if "monitor" in result else None,
        "monitor_mode": result.get("monitor_mode"),
        "precision_used": result.get("precision_used"),
        "world_size": result.get("world_size"),
        "strategy": result.get("strategy"),
        "bucket_cap_mb": ddp.get("bucket_cap_mb"),
        "comm_hook": ddp.get("comm_hook"),
        "repeats": 1,
        "job_dir": str(job),
    }


def model_state_mb(result: dict[str, Any]) -> float | None:
    """The parameters, gradients and optimizer state of the rank holding most, in MiB: all
    of it under ddp, about 1/W under fsdp (results.json's model_state_mb_over_ranks)."""
    parts = result.get("model_state_mb_over_ranks")
    if not parts:
        return None
    return sum(figures["max"] for figures in parts.values())


def _baseline_index(rows: list[dict[str, Any]], baseline: str | None) -> int:
    if baseline is None:
        named = [i for i, row in enumerate(rows) if "recipe=baseline" in row["setting"].split()]
        return named[0] if named else 0
    for index, row in enumerate(rows):
        if baseline in row["setting"]:
            return index
    settings = ", ".join(row["setting"] for row in rows)
    raise UserFacingError(
        f"--baseline {baseline!r} matches no row of the sweep (rows: {settings}). "
        "Fix: pass part of one of those settings, or leave --baseline out."
    )


def _add_relative_columns(rows: list[dict[str, Any]], base: int) -> None:
    reference = rows[base]
    for row in rows:
        row["baseline"] = row is reference
        row["speedup"] = _ratio(row["samples_per_sec"], reference["samples_per_sec"])
        memory = _ratio(row["peak_memory_mb"], reference["peak_memory_mb"])
        row["memory_change"] = None if memory is None else memory - 1.0


def _ratio(value: float | None, reference: float | None) -> float | None:
    if value is None or not reference:
        return None
    return value / reference


def memory_label(rows: list[dict[str, Any]]) -> str:
    kinds = {row["memory_kind"] for row in rows}
    return MEMORY_KINDS.get(kinds.pop(), "peak") if len(kinds) == 1 else "peak"


def monitor_label(rows: list[dict[str, Any]]) -> str | None:
    """`best val/acc (max)` when the jobs measured one monitored metric, else None (a
    benchmark has no validation, and jobs of different tasks do not compare)."""
    monitors = {(row["monitor"], row["monitor_mode"]) for row in rows}
    if len(monitors) != 1 or all(row["monitor_best"] is None for row in rows):
        return None
    ((monitor, mode),) = monitors
    return f"best {monitor} ({mode})"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    memory = memory_label(rows)
    monitor = monitor_label(rows)
    header = (
        "| setting | samples/s | per device | TFLOP/s per device | MFU | step median (ms) "
        f"| step p90 (ms) | exposed comm (ms) | loader wait | memory (MiB, {memory}) "
        "| model state (MiB per rank) "
        "| speed-up | memory change |"
        + (f" {monitor} |" if monitor else "")
        + " precision | strategy |"
    )
    lines = [header, "|" + "---|" * (16 if monitor else 15)]
    for row in rows:
        task_value = [_number(row["monitor_best"], ".4g")] if monitor else []
        name = f"**{row['setting']}**" if row["baseline"] else row["setting"]
        lines.append(
            "| "
            + " | ".join(
                [
                    name,
                    _number(row["samples_per_sec"], ",.1f"),
                    _number(row["samples_per_sec_per_device"], ",.1f"),
                    _number(row["tflops_per_sec_per_device"], ".3g"),
                    _number(row["mfu"], ".1%"),
                    _number(_ms(row["step_time_median_s"]), ",.0f"),
                    _number(_ms(row["step_time_p90_s"]), ",.0f"),
                    _number(_ms(row["exposed_comm_s"]), ",.0f"),
                    _number(row["data_wait_fraction"], ".1%"),
                    _number(row["peak_memory_mb"], ",.0f"),
                    _number(row["model_state_mb"], ",.1f"),
                    _number(row["speedup"], ".2f", prefix="x"),
                    _number(row["memory_change"], "+.0%"),
                    *task_value,
                    row["precision_used"] or "n/a",
                    row["strategy"] or "n/a",
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def _number(value: float | None, spec: str, prefix: str = "") -> str:
    return "n/a" if value is None else prefix + format(value, spec)


def describe(rows: list[dict[str, Any]]) -> str:
    """What every row shares: the overrides, the machine and when it was measured."""
    shared = [o for o in rows[0]["overrides"] if all(o in row["overrides"] for row in rows)]
    merged_key = rows[0].get("median_over")
    shared = [
        o for o in shared if not _split(o)[0].startswith("hydra.") and _split(o)[0] != merged_key
    ]
    lines = [f"Common to all rows: {' '.join(shared) or '(no overrides)'}."]
    if rows[0]["repeats"] > 1:
        lines.append(
            f"Each row: medians of {rows[0]['repeats']} jobs that differ only in "
            f"{rows[0]['median_over']}."
        )
    machine = rows[0].get("machine")
    if machine:
        gpu = machine.get("gpu") or "no GPU"
        finished = max(str(row.get("finished_at")) for row in rows)
        lines.append(
            f"Measured on {machine.get('cpu')}, {machine.get('cpu_cores')} CPU cores, {gpu}; "
            f"world size {rows[0]['world_size']}; torch {machine.get('torch')}, Lightning "
            f"{machine.get('lightning')}; finished {finished}."
        )
    return " ".join(lines)


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Bar charts of throughput and peak memory, one bar per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [row["setting"] for row in rows]
    rates = [row["samples_per_sec"] or 0.0 for row in rows]
    memory = [row["peak_memory_mb"] or 0.0 for row in rows]
    height = 1.2 + 0.45 * len(rows)
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, height), sharey=True)
    left.barh(names, rates, color="tab:blue")
    left.set_xlabel("samples/s (all devices)")
    right.barh(names, memory, color="tab:orange")
    right.set_xlabel(f"peak memory per rank, MiB ({memory_label(rows)})")
    left.invert_yaxis()
    for axis, values, spec in ((left, rates, ",.1f"), (right, memory, ",.0f")):
        for position, value in enumerate(values):
            axis.text(value, position, " " + format(value, spec), va="center", fontsize=8)
        axis.margins(x=0.2)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_report(
    folder: str | Path, baseline: str | None = None, median_over: str | None = None
) -> str:
    """Writes report.md, report.csv and report.png into the sweep folder; returns the table."""
    folder = Path(folder)
    rows = load_rows(folder, baseline, median_over)
    table = markdown_table(rows)
    missing = missing_jobs(folder)
    note = "".join(f"\nNot measured (no {RESULTS_FILE}): {name}" for name in missing)
    caption = (
        f"{describe(rows)} Speed-up and memory change are relative to the row in bold. "
        f"{_memory_note(rows)}"
    )
    (folder / "report.md").write_text(f"# {folder}\n\n{table}\n\n{caption}\n{note}\n")
    write_csv(rows, folder / "report.csv")
    plot(rows, folder / "report.png")
    return f"{table}\n\n{caption}{note}"


def _memory_note(rows: list[dict[str, Any]]) -> str:
    if memory_label(rows) == MEMORY_KINDS["host_peak_rss"]:
        return (
            "Memory is the peak resident set of the training process (largest rank), "
            "DataLoader workers not included."
        )
    return "Memory is the peak of CUDA memory allocated by tensors (largest rank)."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ddp_template.tools.report",
        description="Compare the jobs of a sweep: report.md, report.csv, report.png.",
    )
    parser.add_argument("folder", help="a sweep folder, e.g. multirun/<date>/<time>_<pid>")
    parser.add_argument(
        "--baseline",
        default=None,
        help="part of the setting of the reference row (default: recipe=baseline, else job 0)",
    )
    parser.add_argument(
        "--median-over",
        default=None,
        metavar="KEY",
        help="merge jobs that differ only in KEY (e.g. seed) into one row of medians",
    )
    args = parser.parse_args(argv)
    try:
        table = write_report(args.folder, args.baseline, args.median_over)
    except UserFacingError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(table)
    written = ", ".join(str(Path(args.folder) / name) for name in OUTPUTS)
    print(f"\nwritten: {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
