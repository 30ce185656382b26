"""`debug=dry_run`: a config planned at the size it names (1,024 ranks here) in one process
on torch's fake process group. Its figures are checked against what follows from the data
set and the model independently (DistributedSampler's padding, the parameters' bytes, the
ring all-reduce, DDP's bucket rule as tools/scaling.py states it); it refuses at that size
what a real start refuses there; it starts no worker and writes no checkpoint."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import math
import multiprocessing
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.runs import ROOT, compose_train, subprocess_env
from omegaconf import open_dict

from ddp_template.config.checks import resolve_and_check
from ddp_template.config.dry_run import DRY_RUN_FILE, apply_global_batch, plan
from ddp_template.errors import ConfigError
from ddp_template.tools.scaling import buckets as scaling_buckets

# What users type: 128 nodes of 8 GPUs, on a machine that has none.
PLANNED = ["debug=dry_run", "num_nodes=128", "devices=8", "accelerator=gpu"]
WORLD = 128 * 8
# 50,000 samples do not divide over 1,024 ranks: 49 each, 176 of them repeats.
SYNTHETIC = [
    "data=synthetic",
    "data.num_samples=50000",
    "data.eval_samples=2000",
    "data.image_size=16",
    "data.batch_size=10",
]


def _children(pid: int) -> dict[int, str]:
    """The processes `pid` started (all its threads' children) and their command lines."""
    found: dict[int, str] = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            for child in (task / "children").read_text().split():
                command = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
                found[int(child)] = command.decode(errors="replace")
    return found


# A worker imports torch and Lightning before anything else: it lives for seconds.
WORKER_LIFETIME_S = 1.0


def _workers(seen: dict[int, tuple[str, float, float]]) -> list[str]:
    """Python processes among them that lived as a worker would: helpers such as
    `ldconfig -p`, which a library runs to find a shared library, are not, and between its
    fork and its exec such a helper shows the parent's own command line (on a loaded
    machine a poll catches it there)."""
    return [
        command
        for command, first, last in seen.values()
        if "python" in command and last - first >= WORKER_LIFETIME_S
    ]


def _dry_run(*overrides: str, cwd: Path) -> tuple[subprocess.CompletedProcess, list[str], float]:
    """train.py as users type it; every process it starts meanwhile is noted. Returns the
    CPU seconds it used (user + system): the wall time on a machine shared with other work
    says more about the others."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *overrides],
        cwd=cwd,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen: dict[int, tuple[str, float, float]] = {}  # pid: command, first and last sighting
    while proc.poll() is None:
        now = time.perf_counter()
        for pid, command in _children(proc.pid).items():
            seen[pid] = (command, seen.get(pid, (command, now, now))[1], now)
        time.sleep(0.05)
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    print(f"train.py {' '.join(overrides[:6])} ...: {cpu:.1f} CPU seconds, {wall:.1f} s wall")
    return (
        subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr),
        _workers(seen),
        cpu,
    )


@pytest.mark.slow
def test_1024_ranks_planned_from_the_command_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc, workers, cpu_seconds = _dry_run(
        *PLANNED,
        *SYNTHETIC,
        "strategy=ddp",
        "strategy.bucket_cap_mb=5",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"dry run: {WORLD} ranks planned" in proc.stdout
    # One process: no worker was started (a worker would live for seconds).
    assert workers == []
    assert not list(run_dir.rglob("*.ckpt")) and not (run_dir / "results.json").exists()
    assert not (run_dir / "checkpoints").exists()

    planned = json.loads((run_dir / DRY_RUN_FILE).read_text())
    assert planned["world_size"] == WORLD and planned["accelerator"] == "cuda"
    # Under a minute of this machine's CPU, start to exit (the "under a minute").
    assert cpu_seconds < 60

    data = planned["data"]
    shards = data["train_shard_per_rank"]
    padded = math.ceil(50000 / WORLD) * WORLD
    assert len(shards) == WORLD and sum(shards) == padded
    assert data["padding"] == padded - 50000 == 176
    # The padded order's last 176 positions fall on 176 different ranks.
    assert data["ranks_with_padding"] == 176
    assert set(data["train_batches_per_rank"]) == {math.ceil(49 / 10)}
    # Evaluation is not padded: every sample once, on some rank, each rank one at least.
    for split in ("val", "test"):
        per_rank = data[f"{split}_per_rank"]
        assert sum(per_rank) == data[f"{split}_samples"] == 2000 and min(per_rank) >= 1
    assert planned["batch"] == {"per_rank": 10, "accumulate_grad_batches": 1, "global": 10 * WORLD}

    parameters = _parameter_shapes(*SYNTHETIC)
    parameter_bytes = 4 * sum(math.prod(s) for s in parameters)
    sizes = [bucket["bytes"] for bucket in planned["buckets"]]
    assert sum(sizes) == parameter_bytes == planned["memory_per_rank"]["parameters"]
    # DDP's rule (reducer.cpp, as tools/scaling.py states it) over the gradients in the
    # order DDP filled the buckets: the same buckets.
    order = [shape for bucket in planned["buckets"] for shape in bucket["shapes"]]
    assert sorted(map(tuple, order)) == sorted(map(tuple, parameters))
    expected = [sum(4 * math.prod(order[i]) for i in g) for g in scaling_buckets(order, 4, 5)]
    assert sizes == expected and len(sizes) > 1

    ring = 2 * (WORLD - 1) / WORLD
    traffic = planned["bytes_per_step"]["per_hook"]
    assert traffic["none"]["sent_per_rank"] == int(ring * parameter_bytes)
    assert traffic["fp16"]["sent_per_rank"] == int(ring * parameter_bytes / 2)
    assert traffic["powersgd"]["sent_per_rank"] < traffic["fp16"]["sent_per_rank"]
    # One all-reduce per bucket, PyTorch's PowerSGD three (the vectors, P, Q).
    assert traffic["none"]["all_reduces"] == traffic["fp16"]["all_reduces"] == len(sizes)
    assert traffic["powersgd"]["all_reduces"] == 3 * len(sizes)

    memory = planned["memory_per_rank"]
    # The task's SGD with momentum keeps one momentum buffer per parameter.
    assert memory["optimizer_state"] == parameter_bytes
    assert memory["gradients"] == memory["buckets"] == parameter_bytes
    # Weights and momentum, serialised (plus buffers and names).
    assert 2 * parameter_bytes < planned["checkpoint_bytes"] < 2.1 * parameter_bytes

    # The model's BatchNorm statistics and counters, broadcast at every forward's start.
    buffers: dict[str, int] = {}
    for buffer in _module(*SYNTHETIC).buffers():
        name = str(buffer.dtype).removeprefix("torch.")
        buffers[name] = buffers.get(name, 0) + buffer.numel() * buffer.element_size()
    assert planned["broadcast_buffer_bytes"] == buffers and set(buffers) == {"float32", "int64"}
    assert "broadcast from rank 0 at each forward (strategy.forward_sync_buffers)" in proc.stdout
    assert "of which the buffer broadcast 0.051" in proc.stdout  # 1,023 x 50 us

    prediction = planned["prediction"]
    assert "assumption" in prediction["link"] and "10gbit" in prediction["link"]
    for figures in prediction["per_hook"].values():
        assert figures["step_s"] >= figures["compute_s"] > 0
        # NCCL (the planned GPUs) passes the buffers along a chain: 1,023 waits of 50 us,
        # longer than their bytes at 10 Gbit/s.
        assert figures["buffer_broadcast_s"] == pytest.approx((WORLD - 1) * 50e-6)
    assert "activation memory" in proc.stdout and "not known to a dry run" in proc.stdout


def _module(*overrides: str) -> torch.nn.Module:
    """The task's model, built here apart from the dry run."""
    from ddp_template.build import build_task

    _, module = build_task(compose_train(*overrides))
    return module


def _parameter_shapes(*overrides: str) -> list[list[int]]:
    return [list(p.shape) for p in _module(*overrides).parameters()]


@pytest.fixture(scope="module")
def plan_in_child() -> Iterator[Callable[[Any], dict]]:
    """`plan(cfg)` in a process of the module's own: the fake process group, FSDP's hooks
    and the threads they leave stay out of the test process, which goes on to start real
    process groups in later tests. A refusal is raised here as the child raised it; a
    crash of the child fails the test that caused it (BrokenProcessPool), not the run."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as child:
        yield lambda cfg: child.submit(plan, cfg).result()


def _planned(*overrides: str, tmp_path: Path):
    cfg = compose_train(*PLANNED, *overrides)
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path)
    return cfg


@pytest.mark.slow
def test_a_batch_larger_than_a_rank_shard_is_refused_as_a_real_start_refuses_it(
    tmp_path: Path,
) -> None:
    """diabetes has 310 training rows: at 1,024 ranks each holds 1, and a batch of 32 is
    refused with the message a real start gives at that size."""
    run_dir = tmp_path / "run"
    proc, workers, _ = _dry_run(
        *PLANNED, "task=regression", f"hydra.run.dir={run_dir}", cwd=tmp_path
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.startswith("error: data.batch_size=32 is not valid: at most the 1 ")
    assert "310 training samples over 1024 rank(s)" in proc.stderr and "Fix:" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert workers == [] and not (run_dir / DRY_RUN_FILE).exists()


def test_a_validation_split_smaller_than_the_ranks_is_refused(
    tmp_path: Path, plan_in_child: Callable[[Any], dict]
) -> None:
    cfg = _planned(*SYNTHETIC, "data.eval_samples=1000", tmp_path=tmp_path)
    with pytest.raises(ConfigError, match="validation split has 1000 samples, fewer than the 1024"):
        plan_in_child(cfg)
    assert not (tmp_path / DRY_RUN_FILE).exists()


def test_a_small_world_shows_its_padding_and_the_optimizer_state(
    tmp_path: Path, plan_in_child: Callable[[Any], dict]
) -> None:
    """32 ranks over diabetes' 310 rows: 10 each, 10 of them repeats, on 10 ranks."""
    cfg = _planned("num_nodes=4", "task=regression", "data.batch_size=4", tmp_path=tmp_path)
    planned = plan_in_child(cfg)
    data = planned["data"]
    assert data["train_shard_per_rank"] == [10] * 32
    assert data["padding"] == 10 and data["ranks_with_padding"] == 10
    assert set(data["train_batches_per_rank"]) == {3}
    shapes = _parameter_shapes("task=regression")
    parameter_bytes = 4 * sum(math.prod(s) for s in shapes)
    assert sum(b["bytes"] for b in planned["buckets"]) == parameter_bytes
    # The task's AdamW: two moments per element, a step counter (a float32) per tensor.
    assert planned["memory_per_rank"]["optimizer_state"] == 2 * parameter_bytes + 4 * len(shapes)
    assert json.loads((tmp_path / DRY_RUN_FILE).read_text())["world_size"] == 32


def test_gradients_as_bucket_views_cost_no_memory_of_their_own(
    tmp_path: Path, plan_in_child: Callable[[Any], dict]
) -> None:
    cfg = _planned(
        "num_nodes=4",
        "task=regression",
        "data.batch_size=4",
        "strategy=ddp",
        "strategy.gradient_as_bucket_view=true",
        "strategy.comm_hook=powersgd",
        tmp_path=tmp_path,
    )
    memory = plan_in_child(cfg)["memory_per_rank"]
    assert memory["gradients"] == 0 and memory["buckets"] == memory["parameters"]
    # PowerSGD's error feedback: a copy of the buckets, plus the low-rank factors.
    assert memory["comm_hook_state"] > memory["buckets"]


def test_fsdp_is_planned_as_shards_gathered_units_and_ring_collectives(
    tmp_path: Path, plan_in_child: Callable[[Any], dict]
) -> None:
    """`strategy=fsdp` at 16 ranks: rank 0's shard is ceil(rows / W) rows of every
    parameter (FSDP2's chunks), the units are the MLP's Linear layers, the traffic three
    ring collectives of the gathered bytes, against DDP's two of the gradients."""
    cfg = _planned(
        "task=regression",
        "data.batch_size=4",
        "strategy=fsdp",
        "strategy.wrap=[Linear]",
        tmp_path=tmp_path,
    )
    # The link as a probe on the nodes saved it (`netlab probe --allreduce --save`).
    probe = tmp_path / "probe.json"
    probe.write_text(
        json.dumps(
            {
                "latency_s": 1e-4,
                "bandwidth_bps": {"float32": 1e10, "float16": 1e10, "bfloat16": 1e10},
                "all_gather_bandwidth_bps": 5e9,
            }
        )
    )
    with open_dict(cfg):
        cfg.num_nodes = 2
        cfg.devices = 8
        cfg.dry_run.link = str(probe)
    world = 16
    planned = plan_in_child(cfg)
    shapes = _parameter_shapes("task=regression")
    elements = [math.prod(s) for s in shapes]
    # Rank 0 holds the first ceil(rows / W) rows of each parameter.
    shard = sum(4 * math.ceil(s[0] / world) * math.prod(s[1:]) for s in shapes)
    memory = planned["memory_per_rank"]
    assert memory["parameters"] == memory["gradients"] == shard
    # AdamW: two moments of the shard, a step counter per tensor (not sharded).
    assert memory["optimizer_state"] == 2 * shard + 4 * len(shapes)
    sharding = planned["sharding"]
    names = [u["name"] for u in sharding["units"]]
    assert names[0] == "root" and set(names[1:]) == {"Linear"}
    assert sharding["unsharded_parameter_bytes"] == 4 * sum(elements)
    traffic = planned["bytes_per_step"]
    ring = (world - 1) / world
    sent = {k: c["sent_per_rank"] for k, c in traffic["collectives"].items()}
    # Planned for GPUs: NCCL's ring reduce-scatter (gloo's is an all-reduce: test_scaling).
    assert traffic["backend"] == "nccl"
    assert sent["forward_all_gather"] == sent["reduce_scatter"] == int(ring * 4 * sum(elements))
    # Resharded after the forward, the Linear units are gathered again for the backward;
    # the root (the batch norms' weights here) stays gathered.
    linear = 4 * sum(
        p.numel()
        for m in _module("task=regression").modules()
        if isinstance(m, torch.nn.Linear)
        for p in m.parameters()
    )
    assert sent["backward_all_gather"] == int(ring * linear)
    assert traffic["ddp_sent_per_rank"] == int(2 * ring * 4 * sum(elements))
    # The whole model and optimizer state, once over all ranks.
    assert planned["checkpoint_bytes"] >= 3 * 4 * sum(elements)
    assert planned["prediction"]["link"].startswith(f"measured by the probe in {probe}")
    assert "all-gather float32 5gbit" in planned["prediction"]["link"]
    predicted = planned["prediction"]["per_hook"]["fsdp"]
    assert predicted["step_s"] >= predicted["compute_s"] > 0
    assert predicted["exposed_comm_s"] > 0


def test_global_batch_sets_the_per_rank_batch_or_is_refused() -> None:
    cfg = compose_train(*PLANNED, "dry_run.global_batch_size=4096")
    apply_global_batch(cfg)
    assert cfg.data.batch_size == 4
    cfg = compose_train(
        *PLANNED, "trainer.accumulate_grad_batches=2", "dry_run.global_batch_size=4096"
    )
    apply_global_batch(cfg)
    assert cfg.data.batch_size == 2
    cfg = compose_train(*PLANNED, "dry_run.global_batch_size=5000")
    with pytest.raises(ConfigError) as refused:
        apply_global_batch(cfg)
    message = str(refused.value)
    assert message.startswith("dry_run.global_batch_size=5000 is not valid: a multiple of the 1024")
    assert "Fix: dry_run.global_batch_size=5120 or 4096" in message


def test_num_nodes_0_is_refused_in_a_dry_run_and_devices_must_be_named() -> None:
    with pytest.raises(ConfigError, match=r"^num_nodes=0 is not valid: >= 1"):
        resolve_and_check(
            compose_train("debug=dry_run", "num_nodes=0", "devices=8", "accelerator=gpu")
        )
    with pytest.raises(ConfigError, match=r"^devices='auto' is not valid: the number of GPUs"):
        resolve_and_check(compose_train("debug=dry_run", "num_nodes=2", "accelerator=gpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_only_a_dry_run_passes_accelerator_gpu_without_gpus() -> None:
    cfg = compose_train("num_nodes=1", "devices=8", "accelerator=gpu")
    with pytest.raises(ConfigError, match=r"^accelerator='gpu' is not valid: a GPU"):
        resolve_and_check(cfg)
    planned = compose_train("debug=dry_run", "num_nodes=1", "devices=8", "accelerator=gpu")
    resolve_and_check(planned)
    assert planned.accelerator == "cuda" and planned.devices == 8


@pytest.mark.slow
@pytest.mark.parametrize(
    "command,expected",
    [
        # Past the GPU check a dry run skips (a plain run's num_nodes=0: test_config.py).
        (
            ["train.py", "debug=dry_run", "num_nodes=0", "devices=8", "accelerator=gpu"],
            "error: num_nodes=0 is not valid: >= 1",
        ),
        (
            ["train.py", *PLANNED, "dry_run.global_batch_size=1000"],
            "error: dry_run.global_batch_size=1000 is not valid",
        ),
        (
            ["-m", "ddp_template.tools.scaling", "no_such_run", "--nodes", "1,0"],
            "error: --nodes='1,0' is not valid: node counts >= 1",
        ),
        (
            ["train.py", *PLANNED, "dry_run.link=no_probe.json"],
            "error: dry_run.link='no_probe.json' is not valid: a link rate (e.g. 10gbit), a "
            "probe's .json file; this file does not exist",
        ),
    ],
    ids=["dry run num_nodes=0", "global batch", "scaling --nodes 1,0", "a probe file missing"],
)
def test_bad_input_is_one_paragraph_and_exit_2(
    command: list[str], expected: str, tmp_path: Path
) -> None:
    args = [str(ROOT / command[0]), *command[1:]] if command[0] == "train.py" else command
    if command[0] == "train.py":
        args.append(f"hydra.run.dir={tmp_path / 'run'}")
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.startswith(expected) and "Fix:" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run" / DRY_RUN_FILE).exists()
