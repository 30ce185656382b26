"""What a run leaves behind: results.json, the plain weights, and the summary it prints.

torch and Lightning are imported where they are used: `report.py` reads results files
with this module's names and should start without them.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ddp_template import metrics as task_metrics
from ddp_template.launch.topology import available_cores, global_batch_size, global_batch_text
from ddp_template.worker.over_ranks import over_ranks

if TYPE_CHECKING:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from omegaconf import DictConfig

RESULTS_FILE = "results.json"
WEIGHTS_FILE = "model.pt"


def collect_results(
    cfg: DictConfig,
    trainer: L.Trainer,
    fit_metrics: dict[str, float],
    test_metrics: dict[str, float],
    weights: Path,
    attempts: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Rank 0's record of the run (`attempts`: `resume.attempts.attempts_summary`). The task's metrics keep Lightning's names (`val/acc`,
    `test/acc`: the last epoch's training and validation values, the test values);
    `<monitor>_best` is the best validation value the checkpoint callback saw."""
    from omegaconf import OmegaConf

    from ddp_template.worker.memory import memory_kind

    metrics = fit_metrics
    monitor = cfg.task.monitor
    per_device_batch = int(cfg.data.batch_size)
    accumulation = int(cfg.trainer.accumulate_grad_batches)
    peaks = over_ranks(metrics, "perf/peak_mem_mb")
    return {
        "monitor": monitor,
        "monitor_mode": cfg.task.monitor_mode,
        task_metrics.best_key(monitor): _best_score(trainer),
        **task_metrics.of_stages(metrics, ("train", "val")),
        **task_metrics.of_stages(test_metrics, ("test",)),
        "samples_per_sec": metrics.get("perf/samples_per_sec"),
        "samples_per_sec_per_device": metrics.get("perf/samples_per_sec_per_device"),
        # Training FLOPs (forward and backward) per sample, counted once; achieved rate;
        # MFU where the device's peak is known (null on CPUs and unlisted GPUs).
        "flops_per_sample": metrics.get("perf/flops_per_sample"),
        "tflops_per_sec": metrics.get("perf/tflops_per_sec"),
        "tflops_per_sec_per_device": metrics.get("perf/tflops_per_sec_per_device"),
        "mfu": metrics.get("perf/mfu"),
        "peak_memory_mb": peaks["max"] if peaks else None,
        # Over ranks: min, median, max and the ranks holding the min and the max.
        "peak_memory_mb_over_ranks": peaks,
        # CUDA only: what the caching allocator held, cached blocks included.
        "peak_reserved_memory_mb_over_ranks": over_ranks(metrics, "perf/peak_reserved_mb"),
        # MiB of parameters, gradients and optimizer state each rank holds (after step 1).
        "model_state_mb_over_ranks": _model_state(trainer),
        # strategy=fsdp: seconds each checkpoint save held training up.
        "checkpoint_blocked_s": getattr(trainer.strategy, "checkpoint_blocked_s", None),
        "step_time_median_s": metrics.get("perf/step_time_median_s"),
        "step_time_p90_s": metrics.get("perf/step_time_p90_s"),
        "data_wait_fraction": metrics.get("perf/data_wait_fraction"),
        "data_wait_fraction_over_ranks": over_ranks(metrics, "perf/data_wait_fraction"),
        "step_time_median_s_over_ranks": over_ranks(metrics, "perf/step_time_s"),
        # What communication added to a step (callbacks/speed.py): null where not measured.
        "exposed_comm_s": metrics.get("perf/exposed_comm_s"),
        "exposed_comm_s_over_ranks": over_ranks(metrics, "perf/exposed_comm_s"),
        # Each rank's CPU time per step (all its threads; callbacks/speed.py), over ranks.
        "cpu_s_per_step_over_ranks": over_ranks(metrics, "perf/cpu_s_per_step"),
        "slowest_rank": _whole(metrics.get("perf/slowest_rank")),
        "measured_steps": int(metrics.get("perf/measured_steps", 0)),
        "compile": bool(cfg.get("compile", False)),
        "warmup_time_s": metrics.get("perf/warmup_time_s"),
        "compile_time_s": _compile_time(cfg, metrics),
        "memory_kind": memory_kind(trainer.strategy.root_device),
        "world_size": trainer.world_size,
        "num_nodes": trainer.num_nodes,
        "devices_per_node": trainer.num_devices,
        "accelerator": cfg.accelerator,
        "precision_requested": str(cfg.precision),
        "precision_used": str(trainer.precision),
        "strategy": cfg.strategy.name,
        "ddp": _ddp_settings(metrics),
        "batch_size_per_device": per_device_batch,
        "accumulate_grad_batches": accumulation,
        "global_batch_size": global_batch_size(per_device_batch, trainer.world_size, accumulation),
        "epochs": trainer.current_epoch,
        "global_step": trainer.global_step,
        # How each attempt began and the samples they trained (resume.attempts).
        **(attempts or {}),
        "checkpoints": _checkpoints(trainer),
        "weights": str(weights),
        "output_dir": str(cfg.paths.output_dir),
        "config": OmegaConf.to_container(cfg, resolve=True),
        "machine": machine(trainer.strategy.root_device),
        "finished_at": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def _model_state(trainer: L.Trainer) -> dict[str, dict[str, float]] | None:
    """What `memory_report.ModelStateMemory` measured (by its attribute: a worker module
    does not import callbacks)."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        measured = getattr(callback, "model_state_mb_over_ranks", None)
        if measured is not None:
            return measured
    return None


def machine(device: torch.device) -> dict[str, Any]:
    """What the figures were measured on, so that a results file speaks for itself."""
    import lightning as L
    import torch

    return {
        "cpu": _cpu_name(),
        "cpu_cores": available_cores(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "lightning": L.__version__,
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compile_time(cfg: DictConfig, metrics: dict[str, float]) -> float | None:
    """With compile=true: the warm-up steps' time beyond as many steady steps (compilation
    happens in the first steps; the speed monitor keeps them out of the step times)."""
    warmup, step = metrics.get("perf/warmup_time_s"), metrics.get("perf/step_time_median_s")
    if not cfg.get("compile") or warmup is None or step is None:
        return None
    return max(0.0, warmup - metrics.get("perf/warmup_steps", 0.0) * step)


def _whole(value: float | None) -> int | None:
    return None if value is None else int(value)


def _ddp_settings(metrics: dict[str, float]) -> dict[str, Any] | None:
    logged = {k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith("ddp/")}
    if not logged:
        return None
    flags = (
        "gradient_as_bucket_view",
        "forward_sync_buffers",
        "static_graph",
        "find_unused_parameters",
    )
    settings: dict[str, Any] = {
        key: bool(value) if key in flags else value for key, value in logged.items()
    }
    hooks = [key for key in settings if key.startswith("comm_hook/")]
    for key in hooks:
        del settings[key]
        settings["comm_hook"] = key.split("/", 1)[1]
    if "comm_hook_calls" in settings:
        settings["comm_hook_calls"] = int(settings["comm_hook_calls"])
    return settings


def _best_score(trainer: L.Trainer) -> float | None:
    callback = trainer.checkpoint_callback
    score = getattr(callback, "best_model_score", None)
    return float(score) if score is not None else None


def _checkpoints(trainer: L.Trainer) -> dict[str, str | None]:
    # callbacks.model_checkpoint keeps best.ckpt, callbacks.last_checkpoint last.ckpt.
    # Lightning types them as the Checkpoint base class; the run's are ModelCheckpoints.
    callbacks = cast("list[ModelCheckpoint]", trainer.checkpoint_callbacks)
    paths = {Path(c.best_model_path).stem: c.best_model_path for c in callbacks}
    return {"best": paths.get("best") or None, "last": paths.get("last") or None}


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Readers see the old file or the whole new one, never half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as tmp:
        json.dump(data, tmp, indent=2, default=str)
    os.replace(tmp.name, path)


def export_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    """The bare model's state_dict (`sharding.bare_state_dict`: gathered when sharded), on
    the CPU: no `module.`/`model.` prefixes, loadable anywhere with
    `torch.load(path, weights_only=True)`."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def print_summary(results: dict[str, Any]) -> None:
    """The run-summary table, printed once per job by the launching process."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Run summary", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for name, value in summary_rows(results):
        table.add_row(name, value)
    Console().print(table)


def summary_rows(results: dict[str, Any]) -> list[tuple[str, str]]:
    rate = results.get("samples_per_sec")
    monitor = results["monitor"]
    test_metric = task_metrics.key("test", task_metrics.name_of(monitor))
    return [
        (
            "devices",
            f"{results['devices_per_node']} x {results['num_nodes']} node(s), {results['accelerator']}",
        ),
        ("world size", str(results["world_size"])),
        ("batch per device", str(results["batch_size_per_device"])),
        (
            "global batch",
            global_batch_text(
                results["batch_size_per_device"],
                results["world_size"],
                results["accumulate_grad_batches"],
            ),
        ),
        ("precision", _precision_text(results)),
        ("throughput", _throughput_text(results) if rate else "n/a (too few batches)"),
        ("peak memory", _memory_text(results)),
        (
            f"best {monitor}",
            f"{_value(results.get(task_metrics.best_key(monitor)))} "
            f"({'higher' if results['monitor_mode'] == 'max' else 'lower'} is better)",
        ),
        (test_metric, _value(results.get(test_metric))),
        ("output folder", str(results["output_dir"])),
    ]


def _throughput_text(results: dict[str, Any]) -> str:
    """samples/s, then the achieved TFLOP/s per device and MFU where they are known."""
    parts = [f"{results['samples_per_sec']:,.0f} samples/s"]
    per_device = results.get("tflops_per_sec_per_device")
    if per_device is not None:
        parts.append(f"{tflops_text(per_device)} TFLOP/s per device")
    if results.get("mfu") is not None:
        parts.append(f"MFU {results['mfu']:.1%}")
    return ", ".join(parts)


def tflops_text(tflops: float) -> str:
    """Three significant digits: CPU runs reach thousandths of a TFLOP/s, GPUs hundreds."""
    return f"{tflops:.3g}"


def _precision_text(results: dict[str, Any]) -> str:
    used, asked = results["precision_used"], results["precision_requested"]
    return used if used == asked else f"{used} (asked for {asked})"


def _memory_text(results: dict[str, Any]) -> str:
    peak = results.get("peak_memory_mb")
    if peak is None:
        return "n/a"
    kind = "CUDA allocated" if results["memory_kind"] == "cuda_max_allocated" else "host RSS"
    return f"{peak:,.0f} MiB ({kind}, max over ranks)"


def _value(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"
