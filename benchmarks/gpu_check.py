"""Every GPU path of the template in one unattended command, with a report.

    .venv/bin/python benchmarks/gpu_check.py                       # one GPU or more: <= 8 min
    .venv/bin/python benchmarks/gpu_check.py --tiny                # the same flow, small models
    .venv/bin/python benchmarks/gpu_check.py --device cpu --tiny   # the whole flow on the CPU

Parts, in this order, each in subprocesses of its own with its own time limit (a part that
fails or runs out of time is reported as such, and the next one runs):

  mixed      the default run with precision=16-mixed: test accuracy, the precision used, and
             the loss scale the fp16 scaler started and ended with
  ddp        strategy=ddp on every GPU with nccl, strategy.comm_hook=fp16 and
             sync_batchnorm=true: backend, SyncBatchNorm layers, calls of the hook
  host_sync  debug=host_sync on a training step with a planted `.item()`: the lines it names
  watchdog   debug=watchdog on nccl while rank 1 sleeps inside a step (two GPUs): the dump
  loader     a folder of JPEGs written here: images/s of the training loader alone for
             loader=baseline and loader=tuned (workers, pinned memory), and the share of
             each training step spent waiting for data
  resnet50   experiment=benchmark, ResNet-50 on synthetic 224 px images, for recipe=baseline,
             amp, amp + channels_last, data, comm (and compile=true when train.yaml has the
             switch): images/s and CUDA peak memory, beside NVIDIA's A100 reference and the
             article's ratios

Writes <out>/gpu_report.md and <out>/gpu_check.json after every part (each run's own folder
and log are under <out>/runs and <out>/logs). Exit code 0 when no part failed or ran out of
time, 1 otherwise, 2 when the machine has no CUDA and --device cpu was not given.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpu_check_report import (
    ARTICLE_AMP_MEMORY_CHANGE,
    ARTICLE_AMP_SPEEDUP,
    NVIDIA_A100_IMG_S,
    render_report,
)

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
# The faults the watchdog part plants (tests/helpers/faults.py).
HELPERS = ROOT / "tests" / "helpers"
JSON_FILE = "gpu_check.json"
REPORT_FILE = "gpu_report.md"

# A part is not started with less time than this left.
MIN_START_S = 5.0


class OutOfTime(Exception):
    """A command ran past its limit (and was stopped with all its processes)."""


@dataclass
class Outcome:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    run_dir: Path | None = None

    def results(self) -> dict[str, Any] | None:
        file = self.run_dir / "results.json" if self.run_dir else None
        return json.loads(file.read_text()) if file and file.is_file() else None

    def tail(self, lines: int = 6) -> str:
        text = (self.stderr.strip() or self.stdout.strip()).splitlines()
        return " / ".join(line.strip() for line in text[-lines:])


@dataclass
class Check:
    """The run's settings and the clock every part draws its time from."""

    device: str
    tiny: bool
    out: Path
    gpus: int
    deadline: float
    limits: dict[str, float] = field(default_factory=dict)
    part_deadline: float = 0.0

    @property
    def accelerator(self) -> str:
        return "cuda" if self.device == "cuda" else "cpu"

    def remaining(self) -> float:
        return min(self.deadline, self.part_deadline) - time.monotonic()

    def command(self, name: str, args: list[str], limit_s: float | None = None) -> Outcome:
        """Runs `args` in a session of its own (a timeout stops its workers too); logs its
        output to <out>/logs/<name>.log; raises OutOfTime past its limit or the part's."""
        timeout = self.remaining() if limit_s is None else min(limit_s, self.remaining())
        if timeout <= 0:
            raise OutOfTime(f"{name}: no time left to start it")
        paths = [str(BENCHMARKS), str(HELPERS), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}
        env["PYTHONUNBUFFERED"] = "1"
        start = time.monotonic()
        proc = subprocess.Popen(
            args,
            cwd=self.out,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop_session(proc)
            stdout, stderr = proc.communicate()
            self._log(name, args, stdout, stderr, f"stopped after {timeout:.0f} s")
            raise OutOfTime(f"{name} ran past its {timeout:.0f} s") from None
        self._log(name, args, stdout, stderr, f"exit code {proc.returncode}")
        return Outcome(proc.returncode, stdout, stderr, time.monotonic() - start)

    def train(self, name: str, overrides: list[str], limit_s: float | None = None) -> Outcome:
        run_dir = self.out / "runs" / name
        args = [sys.executable, str(ROOT / "train.py"), *overrides, f"hydra.run.dir={run_dir}"]
        outcome = self.command(name, args, limit_s)
        outcome.run_dir = run_dir
        return outcome

    def sweep(self, name: str, overrides: list[str], limit_s: float | None = None) -> Outcome:
        """A Hydra multirun in one process: its jobs are <out>/runs/<name>/<job number>."""
        sweep_dir = self.out / "runs" / name
        args = [sys.executable, str(ROOT / "train.py"), "-m", *overrides]
        outcome = self.command(name, [*args, f"hydra.sweep.dir={sweep_dir}"], limit_s)
        outcome.run_dir = sweep_dir
        return outcome

    def _log(self, name: str, args: list[str], stdout: str, stderr: str, end: str) -> None:
        log = self.out / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(
            f"$ {' '.join(args)}\n({end})\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}\n"
        )


def _stop_session(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


# --- sizes: a GPU run, and the tiny flow ----------------------------------------------------


def short_run(check: Check) -> list[str]:
    """A few training batches, a little validation, no test: a run that checks a path."""
    return [
        f"accelerator={check.accelerator}",
        "trainer.max_epochs=1",
        f"trainer.limit_train_batches={3 if check.tiny else 10}",
        "trainer.limit_val_batches=2",
        "trainer.num_sanity_val_steps=0",
        "trainer.enable_model_summary=false",
        "logger=none",
        "test=false",
    ]


def small_images(check: Check) -> list[str]:
    return ["data=synthetic", f"data.image_size={8 if check.tiny else 32}", "data.num_samples=512"]


def resnet50_benchmark(check: Check) -> list[str]:
    if check.tiny:
        return [
            "experiment=benchmark",
            "data.image_size=8",
            "data.num_samples=64",
            "data.batch_size=8",
            "benchmark.warmup_steps=1",
            "benchmark.steps=3",
        ]
    return [
        "experiment=benchmark",
        "data.image_size=224",
        "data.num_samples=51200",
        "data.batch_size=256",
        "task.module.model.arch=resnet50",
        "task.module.model.small_input=false",
        "trainer.benchmark=true",
    ]


# Seconds each part may take on a GPU. The tiny flow gives every part TINY_LIMIT_S: a guard
# against hangs, generous for CPUs shared with other work.
LIMITS_S = {
    "mixed": 75.0,
    "ddp": 60.0,
    "host_sync": 45.0,
    "watchdog": 60.0,
    "loader": 110.0,
    "resnet50": 300.0,
}
TINY_LIMIT_S = 300.0
# Wall time for all parts: 8 minutes on a GPU.
FULL_BUDGET_S = 480.0
TINY_BUDGET_S = 1800.0
# One benchmark job (start-up, cuDNN autotuning, 25 steps of 256 images); compile=true more.
ROW_LIMIT_S = {"default": 50.0, "compile": 150.0}


def part_limit(check: Check, part: str) -> float:
    if part in check.limits:
        return check.limits[part]
    return TINY_LIMIT_S if check.tiny else LIMITS_S[part]


# --- the parts --------------------------------------------------------------------------------


def mixed(check: Check, record: dict[str, Any]) -> None:
    overrides = [
        f"accelerator={check.accelerator}",
        "precision=16-mixed",
        "logger=none",
        "+callbacks.loss_scale._target_=gpu_check_plugins.LossScaleRecorder",
    ]
    if check.tiny:
        overrides += [
            "trainer.max_epochs=1",
            "trainer.limit_train_batches=3",
            "trainer.limit_val_batches=2",
            "trainer.limit_test_batches=2",
            "trainer.num_sanity_val_steps=0",
            "trainer.enable_model_summary=false",
        ]
    outcome = check.train("mixed", overrides)
    results = require_results(outcome, record)
    if results is None:
        return
    scale_file = outcome.run_dir / "loss_scale.json"
    scaler = json.loads(scale_file.read_text()) if scale_file.is_file() else {}
    record.update(
        test_accuracy=results.get("test/acc"),
        precision_requested=results["precision_requested"],
        precision_used=results["precision_used"],
        scaler=scaler.get("scaler"),
        initial_loss_scale=scaler.get("initial_scale"),
        final_loss_scale=scaler.get("final_scale"),
        optimizer_steps=scaler.get("optimizer_steps"),
        gpu=results["machine"]["gpu"],
        machine=results["machine"],
    )
    problems = []
    if check.accelerator == "cuda":
        if results["precision_used"] != "16-mixed":
            problems.append(f"precision used {results['precision_used']}, not 16-mixed")
        scale = scaler.get("final_scale")
        if not (isinstance(scale, float) and 0 < scale < float("inf")):
            problems.append(f"the fp16 loss scaler left no finite scale ({scale})")
    elif results["precision_used"] != "bf16-mixed":
        problems.append(f"16-mixed on the CPU ran as {results['precision_used']}, not bf16-mixed")
    if not check.tiny and (results.get("test/acc") or 0) < 0.95:
        problems.append(f"test accuracy {results.get('test/acc')} below the default run's 0.95")
    finish(record, problems)


def ddp(check: Check, record: dict[str, Any]) -> None:
    on_gpu = check.accelerator == "cuda"
    # Every GPU; on the CPU one rank, as on a machine with one GPU.
    devices = check.gpus if on_gpu else 1
    overrides = [
        *short_run(check),
        "strategy=ddp",
        f"devices={devices}",
        "strategy.comm_hook=fp16",
        "+callbacks.probe._target_=gpu_check_plugins.DistributedProbe",
    ]
    if on_gpu:
        overrides += ["strategy.process_group_backend=nccl", "sync_batchnorm=true"]
    else:
        record["note"] = "on the CPU: gloo, and no SyncBatchNorm (it needs CUDA)"
    outcome = check.train("ddp", overrides)
    results = require_results(outcome, record)
    if results is None:
        return
    probe_file = outcome.run_dir / "distributed.json"
    probe = json.loads(probe_file.read_text()) if probe_file.is_file() else {}
    hook = results.get("ddp") or {}
    record.update(
        world_size=results["world_size"],
        backend=probe.get("backend"),
        sync_batchnorm_layers=probe.get("sync_batchnorm_layers"),
        batchnorm_layers=probe.get("batchnorm_layers"),
        comm_hook=hook.get("comm_hook"),
        comm_hook_calls=hook.get("comm_hook_calls"),
        optimizer_steps=results["global_step"],
    )
    problems = []
    expected_backend = "nccl" if on_gpu else "gloo"
    if probe.get("backend") != expected_backend:
        problems.append(f"backend {probe.get('backend')}, not {expected_backend}")
    if hook.get("comm_hook") != "fp16" or (hook.get("comm_hook_calls") or 0) < max(
        1, results["global_step"]
    ):
        problems.append(
            f"the fp16 hook ran {hook.get('comm_hook_calls')} times in "
            f"{results['global_step']} steps (at least once per step expected)"
        )
    if on_gpu and not probe.get("sync_batchnorm_layers"):
        problems.append("no SyncBatchNorm layer in the live model")
    if results["world_size"] != devices:
        problems.append(f"world size {results['world_size']}, not {devices}")
    finish(record, problems)


HOST_SYNC_LINE = re.compile(r"^host sync: (.*)$", re.MULTILINE)


def host_sync(check: Check, record: dict[str, Any]) -> None:
    overrides = [
        *short_run(check),
        *small_images(check),
        "debug=host_sync",
        "task.module._target_=gpu_check_plugins.ItemInStepClassifier",
    ]
    outcome = check.train("host_sync", overrides)
    if check.accelerator != "cuda":
        # The same command, refused before any worker starts: it composed, and the planted
        # module was built by the config check, so only CUDA is missing.
        refused = outcome.returncode == 2 and "debug='host_sync' is not valid" in outcome.stderr
        record["status"] = "skipped" if refused else "failed"
        record["reason"] = (
            "needs CUDA (torch.cuda.set_sync_debug_mode); on the CPU the command composed and "
            "was refused by the config check, as designed"
            if refused
            else f"the command failed before the CUDA check: {outcome.tail()}"
        )
        return
    if outcome.returncode != 0:
        finish(record, [f"the run failed (exit {outcome.returncode}): {outcome.tail()}"])
        return
    lines = HOST_SYNC_LINE.findall(outcome.stdout)
    planted = [line for line in lines if "gpu_check_plugins.py" in line and ".item()" in line]
    counts = re.search(r"host syncs in training steps: (\d+) line", outcome.stdout)
    record.update(lines_found=lines, planted_line=planted[0] if planted else None)
    record["lines_counted"] = int(counts.group(1)) if counts else None
    finish(record, [] if planted else ["the planted .item() was not among the lines found"])


def watchdog(check: Check, record: dict[str, Any]) -> None:
    on_gpu = check.accelerator == "cuda"
    if on_gpu and check.gpus < 2:
        record["status"] = "skipped"
        record["reason"] = f"two ranks need two GPUs; {check.gpus} visible"
        return
    # Longer than the gap between two beats: on GPUs, NCCL's set-up before the first step.
    timeout_s = 15 if on_gpu else 8
    overrides = [
        *short_run(check),
        *small_images(check),
        "strategy=ddp",
        "devices=2",
        "debug=watchdog",
        f"callbacks.hang_watchdog.timeout_s={timeout_s}",
        "+callbacks.sleep._target_=faults.SleepInStep",
    ]
    if on_gpu:
        overrides.append("strategy.process_group_backend=nccl")
    outcome = check.train("watchdog", overrides)
    hang = outcome.run_dir / "hang"
    dumps = {rank: hang / f"rank_{rank}.txt" for rank in (0, 1)}
    texts = {rank: path.read_text() if path.is_file() else "" for rank, path in dumps.items()}
    collectives = {
        rank: next((ln for ln in text.splitlines() if ln.startswith("collectives: ")), None)
        for rank, text in texts.items()
    }
    summary = hang / "summary.txt"
    record.update(
        exit_code=outcome.returncode,
        seconds_to_end=round(outcome.seconds, 1),
        timeout_s=timeout_s,
        collectives={str(rank): line for rank, line in collectives.items()},
        summary=summary.read_text().strip() if summary.is_file() else None,
    )
    backend = "nccl" if on_gpu else "gloo"
    problems = []
    if outcome.returncode == 0:
        problems.append("the run ended normally: the planted hang did not happen")
    missing = [str(path) for path in [*dumps.values(), summary] if not path.is_file()]
    if missing:
        problems.append(f"missing dumps: {', '.join(missing)}")
    if texts[1] and "in on_before_backward" not in texts[1]:
        problems.append("rank 1's stacks do not show it asleep in on_before_backward")
    if texts[0] and f"{backend}:" not in (collectives[0] or ""):
        problems.append(f"rank 0's dump names no {backend} collective: {collectives[0]}")
    finish(record, problems)


def compile_switch_exists() -> bool:
    """`compile=true` is benchmarked when conf/train.yaml has the switch."""
    from omegaconf import OmegaConf

    return "compile" in OmegaConf.load(ROOT / "conf" / "train.yaml")


# The recipes run as one sweep (one process, as users run them); the other rows each alone.
SWEPT_RECIPES = ("baseline", "amp", "data", "comm")


def single_rows(check: Check) -> list[tuple[str, list[str]]]:
    rows = [("amp+channels_last", ["recipe=amp", "task.module.model.channels_last=true"])]
    # On the CPU, inductor's C++ build of ResNet takes minutes: the CPU flow leaves it to
    # tests/test_compile.py, which compiles a small model under DDP.
    if compile_switch_exists() and check.device != "cpu":
        rows.append(("amp+compile", ["recipe=amp", "compile=true"]))
    return rows


def benchmark_row(results: dict[str, Any]) -> dict[str, Any]:
    reference = "tf32" if results["precision_used"] in ("32-true", "32") else "mixed"
    reserved = results.get("peak_reserved_memory_mb_over_ranks") or {}
    return {
        "status": "passed",
        "images_per_sec": results["samples_per_sec"],
        # Training FLOPs counted on a meta copy; MFU against the data sheet's dense peak.
        "tflops_per_sec_per_device": results.get("tflops_per_sec_per_device"),
        "mfu": results.get("mfu"),
        "step_time_median_s": results["step_time_median_s"],
        "data_wait_fraction": results["data_wait_fraction"],
        "peak_memory_mb": results["peak_memory_mb"],
        "peak_reserved_memory_mb": reserved.get("max"),
        "memory_kind": results["memory_kind"],
        "precision_used": results["precision_used"],
        "loader_workers": results["config"]["data"]["num_workers"],
        "comm_hook": (results.get("ddp") or {}).get("comm_hook"),
        "nvidia_a100_reference": NVIDIA_A100_IMG_S[reference],
        "nvidia_reference_kind": reference,
        "gpu": results["machine"]["gpu"],
    }


def resnet50(check: Check, record: dict[str, Any]) -> None:
    benchmark = [*resnet50_benchmark(check), f"accelerator={check.accelerator}"]
    record["setup"] = (
        "ResNet-18 (small-input stem), 8 px, batch 8, 1 + 3 steps (--tiny)"
        if check.tiny
        else "ResNet-50, 224 px, batch 256, 5 + 20 steps, cudnn.benchmark"
    )
    measured: dict[str, dict[str, Any]] = {}
    limit = None if check.tiny else ROW_LIMIT_S["default"] * len(SWEPT_RECIPES)
    try:
        sweep = check.sweep("resnet50", [*benchmark, f"recipe={','.join(SWEPT_RECIPES)}"], limit)
        stopped = None
    except OutOfTime as error:
        stopped = str(error)
    for number, name in enumerate(SWEPT_RECIPES):
        job = check.out / "runs" / "resnet50" / str(number) / "results.json"
        if job.is_file():
            measured[name] = benchmark_row(json.loads(job.read_text()))
        elif stopped:
            measured[name] = {"status": "timed out", "reason": stopped}
        else:
            measured[name] = {"status": "failed", "reason": f"no results.json: {sweep.tail()}"}
    for name, overrides in single_rows(check):
        if check.remaining() < MIN_START_S:
            measured[name] = {"status": "not run", "reason": "the part's time was spent"}
            continue
        limit = ROW_LIMIT_S["compile" if "compile" in name else "default"]
        try:
            outcome = check.train(
                f"resnet50-{name.replace('+', '-')}",
                [*benchmark, *overrides],
                None if check.tiny else limit,
            )
        except OutOfTime as error:
            measured[name] = {"status": "timed out", "reason": str(error)}
            continue
        results = outcome.results() if outcome.returncode == 0 else None
        measured[name] = (
            benchmark_row(results)
            if results
            else {"status": "failed", "reason": f"exit {outcome.returncode}: {outcome.tail()}"}
        )
    order = ["baseline", "amp", "amp+channels_last", "data", "comm", "amp+compile"]
    rows = {name: measured[name] for name in order if name in measured}
    record["rows"] = rows
    base = rows["baseline"]
    for row in rows.values():
        if row["status"] == "passed" and base["status"] == "passed":
            row["speedup"] = row["images_per_sec"] / base["images_per_sec"]
            row["memory_change"] = row["peak_memory_mb"] / base["peak_memory_mb"] - 1
    record["article"] = {
        "amp_speedup": ARTICLE_AMP_SPEEDUP,
        "amp_memory_change": ARTICLE_AMP_MEMORY_CHANGE,
    }
    states = {row["status"] for row in rows.values()}
    record["status"] = (
        "failed" if "failed" in states else "timed out" if states - {"passed"} else "passed"
    )
    bad = [f"{name}: {row['status']}" for name, row in rows.items() if row["status"] != "passed"]
    if bad:
        record["reason"] = "; ".join(bad)


def loader(check: Check, record: dict[str, Any]) -> None:
    folder = check.out / "jpegs"
    count, sizes = (48, ("32", "64")) if check.tiny else (3000, ("256", "500"))
    script = str(BENCHMARKS / "loader_throughput.py")
    if not folder.is_dir():
        write = [sys.executable, script, "write", str(folder), "--count", str(count)]
        write += ["--classes", "3" if check.tiny else "10", "--min-size", sizes[0]]
        outcome = check.command("loader-write", [*write, "--max-size", sizes[1]])
        if outcome.returncode != 0:
            finish(record, [f"writing the JPEGs failed: {outcome.tail()}"])
            return
    record["images"] = {"count": count, "sizes_px": f"{sizes[0]}-{sizes[1]}", "root": str(folder)}
    batch, image_size = (8, 16) if check.tiny else (128, 224)
    measure = [sys.executable, script, "measure", str(folder), "--loader", "baseline", "tuned"]
    measure += ["--accelerator", check.accelerator, "--batches", "3" if check.tiny else "12"]
    measure += ["--batch-size", str(batch), "--image-size", str(image_size)]
    outcome = check.command("loader-measure", measure)
    if outcome.returncode != 0:
        finish(record, [f"measuring the loaders failed: {outcome.tail()}"])
        return
    alone = [json.loads(line) for line in outcome.stdout.splitlines() if line.startswith("{")]
    record["loading_alone"] = {entry["loader"]: entry for entry in alone}
    model = (
        ["data.batch_size=8", "benchmark.warmup_steps=1", "benchmark.steps=3"]
        if check.tiny
        else [
            "data.batch_size=128",
            "task.module.model.arch=resnet50",
            "task.module.model.small_input=false",
            "trainer.benchmark=true",
        ]
    )
    steps: dict[str, Any] = {}
    record["training"] = steps
    problems = []
    loaders = ("baseline", "tuned")
    sweep = check.sweep(
        "loader",
        [
            "experiment=benchmark",
            "recipe=amp",
            f"loader={','.join(loaders)}",
            f"accelerator={check.accelerator}",
            "data=imagefolder",
            f"data.root={folder}",
            f"data.image_size={image_size}",
            *model,
        ],
    )
    for number, name in enumerate(loaders):
        job = sweep.run_dir / str(number) / "results.json"
        if not job.is_file():
            problems.append(f"training with loader={name} left no results: {sweep.tail()}")
            continue
        results = json.loads(job.read_text())
        steps[name] = {
            "images_per_sec": results["samples_per_sec"],
            "data_wait_fraction": results["data_wait_fraction"],
            "step_time_median_s": results["step_time_median_s"],
            "num_workers": results["config"]["data"]["num_workers"],
            "pin_memory": results["config"]["data"]["pin_memory"],
        }
    if set(record["loading_alone"]) != {"baseline", "tuned"}:
        problems.append("the loader measurement printed no figures")
    finish(record, problems)


PARTS: dict[str, Callable[[Check, dict[str, Any]], None]] = {
    "mixed": mixed,
    "ddp": ddp,
    "host_sync": host_sync,
    "watchdog": watchdog,
    "loader": loader,
    # Last: its optional compile row is the first thing cut when the budget runs out.
    "resnet50": resnet50,
}


def require_results(outcome: Outcome, record: dict[str, Any]) -> dict[str, Any] | None:
    results = outcome.results() if outcome.returncode == 0 else None
    if results is None:
        finish(record, [f"the run failed (exit {outcome.returncode}): {outcome.tail()}"])
    return results


def finish(record: dict[str, Any], problems: list[str]) -> None:
    record["status"] = "failed" if problems else "passed"
    if problems:
        record["reason"] = "; ".join(problems)


# --- running the parts, writing the results -------------------------------------------------


def run_parts(check: Check, names: list[str], state: dict[str, Any]) -> None:
    for name in names:
        record: dict[str, Any] = {}
        state["parts"][name] = record
        limit = part_limit(check, name)
        left = check.deadline - time.monotonic()
        if left < MIN_START_S:
            record.update(status="not run", reason="the whole check's time budget was spent")
            write_outputs(check, state)
            continue
        print(f"[gpu_check] {name}: up to {min(limit, left):.0f} s", flush=True)
        start = time.monotonic()
        check.part_deadline = start + limit
        try:
            PARTS[name](check, record)
        except OutOfTime as stopped:
            record.update(status="timed out", reason=str(stopped))
        except Exception as error:  # a broken part is reported; the others still run
            record.update(status="failed", reason=f"{type(error).__name__}: {error}")
            record["traceback"] = traceback.format_exc()
        record["seconds"] = round(time.monotonic() - start, 1)
        print(f"[gpu_check] {name}: {record['status']} ({record['seconds']} s)", flush=True)
        write_outputs(check, state)


def write_outputs(check: Check, state: dict[str, Any]) -> None:
    state["wall_seconds"] = round(time.monotonic() - state["_start"], 1)
    public = {key: value for key, value in state.items() if not key.startswith("_")}
    tmp = check.out / f"{JSON_FILE}.tmp"
    tmp.write_text(json.dumps(public, indent=2, default=str))
    tmp.replace(check.out / JSON_FILE)
    (check.out / REPORT_FILE).write_text(render_report(public))


def machine_facts(device: str) -> dict[str, Any]:
    """Without touching CUDA here (the runs own the GPUs): names come from the runs."""
    import lightning
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "gpus_visible": torch.cuda.device_count() if device == "cuda" else 0,
        "gpu": None,
        "cpu": cpu,
        "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "cuda": torch.version.cuda,
    }


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="small models, few steps")
    parser.add_argument("--out", type=Path, help="default: outputs/gpu_check/<date>_<time>")
    parser.add_argument(
        "--budget-s",
        type=float,
        help=f"wall time for all parts (default {FULL_BUDGET_S:.0f}; with --tiny "
        f"{TINY_BUDGET_S:.0f}, a guard for busy CPUs)",
    )
    parser.add_argument("--only", nargs="+", choices=list(PARTS), help="run these parts only")
    parser.add_argument(
        "--limit",
        action="append",
        default=[],
        metavar="PART=SECONDS",
        help="a part's own time limit, e.g. --limit resnet50=300",
    )
    return parser.parse_args(argv)


def parse_limits(values: list[str]) -> dict[str, float]:
    limits = {}
    for value in values:
        part, _, seconds = value.partition("=")
        if part not in PARTS or not re.fullmatch(r"\d+(\.\d+)?", seconds):
            print(
                f"error: --limit {value} is not valid: PART=SECONDS with PART one of "
                f"{', '.join(PARTS)}. Fix: e.g. --limit resnet50=300",
                file=sys.stderr,
            )
            sys.exit(2)
        limits[part] = float(seconds)
    return limits


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    limits = parse_limits(args.limit)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "error: --device cuda is not valid here: torch sees no CUDA GPU on this machine. "
            "Fix: run it on a GPU machine, or add --device cpu (with --tiny) to run the whole "
            "flow on the CPU.",
            file=sys.stderr,
        )
        return 2
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    out = (args.out or ROOT / "outputs" / "gpu_check" / stamp).resolve()
    out.mkdir(parents=True, exist_ok=True)
    budget = args.budget_s or (TINY_BUDGET_S if args.tiny else FULL_BUDGET_S)
    start = time.monotonic()
    check = Check(
        device=args.device,
        tiny=args.tiny,
        out=out,
        gpus=torch.cuda.device_count() if args.device == "cuda" else 0,
        deadline=start + budget,
        limits=limits,
    )
    state: dict[str, Any] = {
        "_start": start,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "mode": f"{'tiny' if args.tiny else 'full'} on {args.device}",
        "started_at": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "budget_s": budget,
        "machine": machine_facts(args.device),
        "parts": {},
    }
    names = args.only or list(PARTS)
    run_parts(check, names, state)
    gpu = next((r.get("gpu") for r in state["parts"].values() if r.get("gpu")), None)
    state["machine"]["gpu"] = gpu
    write_outputs(check, state)
    statuses = {name: record["status"] for name, record in state["parts"].items()}
    print(f"[gpu_check] {json.dumps(statuses)}\n[gpu_check] report: {out / REPORT_FILE}")
    return 1 if {"failed", "timed out", "not run"} & set(statuses.values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
