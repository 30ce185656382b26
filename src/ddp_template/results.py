"""What a run leaves behind: results.json, the plain weights, and the summary it prints."""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from ddp_template.comm_hooks import COMM_HOOKS
from ddp_template.memory import memory_kind

RESULTS_FILE = "results.json"
WEIGHTS_FILE = "model.pt"


def collect_results(
    cfg: DictConfig,
    trainer: L.Trainer,
    fit_metrics: dict[str, float],
    test_metrics: dict[str, float],
    weights: Path,
) -> dict[str, Any]:
    """Rank 0's record of the run. Metric keys keep Lightning's names (`test/acc`)."""
    metrics = fit_metrics
    per_device_batch = int(cfg.data.batch_size)
    accumulation = int(cfg.trainer.accumulate_grad_batches)
    peaks = _per_rank(metrics, "perf/peak_mem_mb/rank_")
    reserved = _per_rank(metrics, "perf/peak_reserved_mb/rank_")
    return {
        **test_metrics,
        "val/acc": metrics.get("val/acc"),
        "best_val": _best_score(trainer),
        "samples_per_sec": metrics.get("perf/samples_per_sec"),
        "samples_per_sec_per_device": metrics.get("perf/samples_per_sec_per_device"),
        "peak_memory_mb": max(peaks.values()) if peaks else None,
        "peak_memory_mb_per_rank": peaks,
        # CUDA only: what the caching allocator held, cached blocks included.
        "peak_reserved_memory_mb_per_rank": reserved or None,
        "step_time_median_s": metrics.get("perf/step_time_median_s"),
        "step_time_p90_s": metrics.get("perf/step_time_p90_s"),
        "data_wait_fraction": metrics.get("perf/data_wait_fraction"),
        "data_wait_fraction_per_rank": _per_rank(metrics, "perf/data_wait_fraction/rank_"),
        "measured_steps": int(metrics.get("perf/measured_steps", 0)),
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
        "global_batch_size": per_device_batch * trainer.world_size * accumulation,
        "epochs": trainer.current_epoch,
        "global_step": trainer.global_step,
        "checkpoints": _checkpoints(trainer),
        "weights": str(weights),
        "output_dir": str(cfg.paths.output_dir),
        "config": OmegaConf.to_container(cfg, resolve=True),
        "machine": machine(trainer.strategy.root_device),
        "finished_at": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def machine(device: torch.device) -> dict[str, Any]:
    """What the figures were measured on, so that a results file speaks for itself."""
    return {
        "cpu": _cpu_name(),
        "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
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


def _per_rank(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    return {key[len(prefix) :]: value for key, value in metrics.items() if key.startswith(prefix)}


def _ddp_settings(metrics: dict[str, float]) -> dict[str, Any] | None:
    settings = {k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith("ddp/")}
    if not settings:
        return None
    flags = ("gradient_as_bucket_view", "static_graph", "find_unused_parameters")
    settings = {key: bool(value) if key in flags else value for key, value in settings.items()}
    if "comm_hook" in settings:
        settings["comm_hook"] = COMM_HOOKS[int(settings["comm_hook"])]
        settings["comm_hook_calls"] = int(settings["comm_hook_calls"])
    return settings


def _best_score(trainer: L.Trainer) -> float | None:
    callback = trainer.checkpoint_callback
    score = getattr(callback, "best_model_score", None)
    return float(score) if score is not None else None


def _checkpoints(trainer: L.Trainer) -> dict[str, str | None]:
    # callbacks.model_checkpoint keeps best.ckpt, callbacks.last_checkpoint last.ckpt.
    paths = {Path(c.best_model_path).stem: c.best_model_path for c in trainer.checkpoint_callbacks}
    return {"best": paths.get("best") or None, "last": paths.get("last") or None}


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Readers see the old file or the whole new one, never half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as tmp:
        json.dump(data, tmp, indent=2, default=str)
    os.replace(tmp.name, path)


def export_weights(model: torch.nn.Module, path: Path) -> None:
    """The bare model's state_dict, on the CPU: no `module.`/`model.` prefixes, loadable
    anywhere with `torch.load(path, weights_only=True)`."""
    state = {key: value.detach().cpu() for key, value in model.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def print_summary(results: dict[str, Any]) -> None:
    table = Table(title="Run summary", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    rate = results.get("samples_per_sec")
    rows = [
        (
            "devices",
            f"{results['devices_per_node']} x {results['num_nodes']} node(s), {results['accelerator']}",
        ),
        ("world size", results["world_size"]),
        ("batch per device", results["batch_size_per_device"]),
        (
            "global batch",
            f"{results['global_batch_size']} (= {results['batch_size_per_device']} x "
            f"{results['world_size']} ranks x {results['accumulate_grad_batches']} accumulation)",
        ),
        ("precision", _precision_text(results)),
        ("throughput", f"{rate:,.0f} samples/s" if rate else "n/a (too few batches)"),
        ("peak memory", _memory_text(results)),
        ("test accuracy", _percent(results.get("test/acc"))),
        ("output folder", results["output_dir"]),
    ]
    for name, value in rows:
        table.add_row(name, str(value))
    Console().print(table)


def _precision_text(results: dict[str, Any]) -> str:
    used, asked = results["precision_used"], results["precision_requested"]
    return used if used == asked else f"{used} (asked for {asked})"


def _memory_text(results: dict[str, Any]) -> str:
    peak = results.get("peak_memory_mb")
    if peak is None:
        return "n/a"
    kind = "CUDA allocated" if results["memory_kind"] == "cuda_max_allocated" else "host RSS"
    return f"{peak:,.0f} MiB ({kind}, max over ranks)"


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.2f}%"
