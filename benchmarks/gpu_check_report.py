"""gpu_report.md of benchmarks/gpu_check.py, from the state it writes to gpu_check.json: a
table of the parts, then the benchmark beside the published references, the data-loading
figures and what the diagnostics found."""

from __future__ import annotations

from typing import Any

# NVIDIA DeepLearningExamples, ResNet-50 v1.5 for PyTorch (21.03 container), one A100 80GB.
NVIDIA_A100_IMG_S = {"tf32": 938.0, "mixed": 2470.0}
# The article's table: baseline DDP 1200 img/s, 32 GB -> mixed precision 2100 img/s, 18 GB.
ARTICLE_AMP_SPEEDUP = 1.75
ARTICLE_AMP_MEMORY_CHANGE = -0.44


def _num(value: float | None, digits: int = 0, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}{suffix}"


def _pct(value: float | None, sign: bool = False) -> str:
    return "n/a" if value is None else f"{100 * value:{'+' if sign else ''}.1f}%"


def summary_line(name: str, record: dict[str, Any]) -> str:
    status = record.get("status")
    if status not in ("passed",):
        return record.get("reason", "")
    if name == "mixed":
        return (
            f"test accuracy {_pct(record.get('test_accuracy'))}, precision "
            f"{record.get('precision_used')}, loss scale {_num(record.get('initial_loss_scale'))}"
            f" -> {_num(record.get('final_loss_scale'))}"
        )
    if name == "ddp":
        return (
            f"{record.get('backend')} world size {record.get('world_size')}, fp16 hook calls "
            f"{record.get('comm_hook_calls')} in {record.get('optimizer_steps')} steps, "
            f"SyncBatchNorm layers {record.get('sync_batchnorm_layers')}"
        )
    if name == "host_sync":
        return f"found: {record.get('planted_line')}"
    if name == "watchdog":
        return (
            f"stopped by the watchdog (timeout_s={record.get('timeout_s')}), the run lasted "
            f"{record.get('seconds_to_end')} s; rank 0: {record['collectives']['0']}"
        )
    if name == "resnet50":
        rows = record.get("rows", {})
        return ", ".join(f"{n} {_num(r.get('images_per_sec'))} img/s" for n, r in rows.items())
    if name == "loader":
        alone = record.get("loading_alone", {})
        return ", ".join(
            f"{n} {_num(r.get('images_per_sec'))} img/s alone" for n, r in alone.items()
        )
    return ""


def render_report(state: dict[str, Any]) -> str:
    parts = state["parts"]
    machine = state["machine"]
    lines = [
        "# GPU check",
        "",
        f"- command: `{state['command']}`",
        f"- mode: {state['mode']}",
        f"- machine: GPU {machine.get('gpu') or 'none'} ({machine['gpus_visible']} visible), "
        f"CPU {machine['cpu']} ({machine['cpu_cores']} cores), torch {machine['torch']}",
        f"- started {state['started_at']}, wall time {state['wall_seconds']} s "
        f"(budget {state['budget_s']:.0f} s)",
        "",
        "| part | status | seconds | result |",
        "|---|---|---|---|",
    ]
    for name, record in parts.items():
        lines.append(
            f"| {name} | {record.get('status')} | {record.get('seconds', '')} | "
            f"{summary_line(name, record).replace('|', '/')} |"
        )
    rows = parts.get("resnet50", {}).get("rows")
    if rows:
        lines += [
            "",
            "## Benchmark (experiment=benchmark, synthetic images): "
            + parts["resnet50"].get("setup", ""),
            "",
            "| setting | img/s | step median (ms) | loader wait | peak memory (MiB) | speed-up | "
            "memory change | precision | NVIDIA A100 80GB reference (img/s) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, row in rows.items():
            if row.get("status") != "passed":
                lines.append(f"| {name} | {row.get('status')}: {row.get('reason', '')} |")
                continue
            step = row["step_time_median_s"]
            lines.append(
                f"| {name} | {_num(row['images_per_sec'], 1)} | "
                f"{_num(step * 1000 if step else None, 1)} | {_pct(row['data_wait_fraction'])} | "
                f"{_num(row['peak_memory_mb'])} ({row['memory_kind']}) | "
                f"x{_num(row.get('speedup'), 2)} | {_pct(row.get('memory_change'), sign=True)} | "
                f"{row['precision_used']} | {_num(row['nvidia_a100_reference'])} "
                f"({row['nvidia_reference_kind']}) |"
            )
        amp = rows.get("amp", {})
        lines += [
            "",
            f"amp against baseline: x{_num(amp.get('speedup'), 2)} throughput, memory "
            f"{_pct(amp.get('memory_change'), sign=True)}; the article: "
            f"x{ARTICLE_AMP_SPEEDUP} and {_pct(ARTICLE_AMP_MEMORY_CHANGE, sign=True)}. "
            "NVIDIA's reference is ResNet-50 v1.5 in its 21.03 container on one A100 80GB "
            "(938 img/s TF32, 2,470 img/s mixed precision), a different GPU and input "
            "pipeline: compare ratios, not absolute figures.",
        ]
    record = parts.get("loader", {})
    if record.get("loading_alone"):
        lines += [
            "",
            f"## Data loading ({record['images']['count']} JPEGs of "
            f"{record['images']['sizes_px']} px)",
            "",
            "| loader | workers | pin_memory | img/s, loading alone | img/s, training | "
            "share of each step waiting for data |",
            "|---|---|---|---|---|---|",
        ]
        for name, alone in record["loading_alone"].items():
            train = record.get("training", {}).get(name, {})
            lines.append(
                f"| {name} | {alone['num_workers']} | {alone['pin_memory']} | "
                f"{_num(alone['images_per_sec'], 1)} | {_num(train.get('images_per_sec'), 1)} | "
                f"{_pct(train.get('data_wait_fraction'))} |"
            )
    for name in ("host_sync", "watchdog"):
        record = parts.get(name, {})
        detail = record.get("lines_found") or (
            record.get("summary", "").splitlines() if record.get("summary") else None
        )
        if detail:
            lines += ["", f"## {name}", "", "```", *detail, "```"]
    return "\n".join(lines) + "\n"
