"""Diagnostics (`debug=`): real 2-process DDP runs on the CPU with a fault injected from
tests/helpers/faults.py, and the up-front refusals of bad debug settings."""

from __future__ import annotations

import json
import re
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers.runs import FAST, compose_train, results, train

from ddp_template.callbacks.host_sync import HostSyncFinder
from ddp_template.callbacks.startup_report import oversubscription_warning
from ddp_template.config import resolvers
from ddp_template.config.checks import resolve_and_check
from ddp_template.errors import ConfigError
from ddp_template.train import CONFIG_DIR

resolvers.register()
# Two ranks on tiny synthetic images; debug=fast sets the batch limits.
TWO_RANKS = ["devices=2", "data=synthetic", "data.image_size=8", "logger=none"]
TINY_DDP = ["strategy=ddp", *TWO_RANKS, *FAST]


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory) -> dict[str, Path]:
    """debug=fast on 2 ranks, plainly and with every CPU diagnostic on at once."""
    tmp = tmp_path_factory.mktemp("smoke")
    plain, checked = tmp / "plain", tmp / "checked"
    outputs = {}
    outputs["plain"] = train("debug=fast", *TWO_RANKS, f"hydra.run.dir={plain}", cwd=tmp)
    outputs["checked"] = train(
        "debug=[fast,sync_check,profile,distributed]",
        *TWO_RANKS,
        "callbacks.profiler.wait=0",
        "callbacks.profiler.warmup=1",
        "callbacks.profiler.active=1",
        "+callbacks.debug_probe._target_=faults.DebugProbe",
        f"hydra.run.dir={checked}",
        cwd=tmp,
    )
    return {
        "plain": plain,
        "checked": checked,
        **{f"{k}_out": v.stdout for k, v in outputs.items()},
    }


@pytest.mark.slow
def test_fast_runs_fit_validation_and_test_under_ddp(smoke_runs) -> None:
    out = results(smoke_runs["plain"])
    assert out["world_size"] == 2 and out["strategy"] == "ddp"
    assert out["global_step"] == 2 and out["test/acc"] is not None
    assert (smoke_runs["plain"] / "checkpoints" / "best.ckpt").is_file()


@pytest.mark.slow
def test_startup_report_and_memory_per_epoch(smoke_runs) -> None:
    stdout = smoke_runs["plain_out"]
    assert "DDP set-up" in stdout
    for row in ("world size", "global batch", "precision used", "backend", "sampler"):
        assert row in stdout
    assert "128 (= 64 x 2 ranks x 1 accumulation)" in stdout
    assert "gloo, timeout 1800 s" in stdout
    assert "find_unused_parameters=False" in stdout
    assert "DistributedSampler(shuffle=True, drop_last=False)" in stdout
    peaks = results(smoke_runs["plain"])["peak_memory_mb_over_ranks"]
    line = re.search(
        r"peak memory, epoch 1 \(host RSS, MiB\): min ([\d,]+) \(rank (\d)\)  median [\d,]+"
        r"  max ([\d,]+) \(rank (\d)\)",
        stdout,
    )
    assert line, stdout[-3000:]
    low, low_rank, high, high_rank = (float(v.replace(",", "")) for v in line.groups())
    assert [low, high] == [round(peaks["min"]), round(peaks["max"])]
    assert {low_rank, high_rank} == {0, 1} == {peaks["min_rank"], peaks["max_rank"]}


@pytest.mark.slow
def test_checks_leave_training_bit_identical(smoke_runs) -> None:
    plain = torch.load(smoke_runs["plain"] / "model.pt", weights_only=True)
    checked = torch.load(smoke_runs["checked"] / "model.pt", weights_only=True)
    assert plain.keys() == checked.keys()
    assert all(torch.equal(plain[key], checked[key]) for key in plain)
    assert "sync check: gradients and weights identical on all 2 ranks" in smoke_runs["checked_out"]
    assert "at the 2 optimizer step(s) checked" in smoke_runs["checked_out"]


@pytest.mark.slow
def test_profiler_traces_of_every_rank_parse(smoke_runs) -> None:
    traces = sorted((smoke_runs["checked"] / "profiler").glob("rank_*.pt.trace.json"))
    assert [t.name.split(".")[0] for t in traces] == ["rank_0", "rank_1"]
    for trace in traces:
        events = json.loads(trace.read_text())["traceEvents"]
        assert any(e.get("name") == "aten::convolution_backward" for e in events)
    assert "rank 0's operators by self_cpu_time_total" in smoke_runs["checked_out"]


@pytest.mark.slow
def test_distributed_debug_switches_reach_every_rank(smoke_runs) -> None:
    probes = [
        json.loads((smoke_runs["checked"] / "debug_probe" / f"rank_{r}.json").read_text())
        for r in (0, 1)
    ]
    for probe in probes:
        assert probe["TORCH_DISTRIBUTED_DEBUG"] == "INFO"
        assert probe["debug_level"] == "DebugLevel.INFO"
        assert probe["TORCH_FR_BUFFER_SIZE"] == "2000"
        assert probe["anomaly"] is True
    # debug_print: every rank's line, on rank 0, in rank order.
    lines = [line for line in smoke_runs["checked_out"].splitlines() if "hello from pid" in line]
    assert [re.search(r"rank (\d) \|", line).group(1) for line in lines] == ["0", "1"]
    assert all("world size 2" in line for line in lines)


@pytest.mark.slow
def test_a_desynchronised_rank_is_caught(tmp_path: Path) -> None:
    proc = train(
        *TINY_DDP,
        "trainer.limit_train_batches=4",
        "debug=sync_check",
        "+callbacks.desync._target_=faults.DesyncRank",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode != 0
    assert "Ranks out of sync at global step 1" in proc.stderr
    assert "the first parameter that differs is model.fc.weight (its value" in proc.stderr
    assert "rank(s) 1 disagree with rank 0" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_hang_dumps_every_rank_and_ends(tmp_path: Path) -> None:
    timeout = 8
    run_dir = tmp_path / "run"
    proc = train(
        *TINY_DDP,
        "debug=watchdog",
        f"callbacks.hang_watchdog.timeout_s={timeout}",
        "+callbacks.sleep._target_=faults.SleepInStep",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        check=False,
        timeout=300,
    )
    ended = time.time()
    assert proc.returncode != 0
    # Rank 1 fell asleep for 600 s; the watchdog ended the job long before: within its timeout
    # plus the ranks' wait for each other's dumps (10 s each) and the shutdown, on a busy machine.
    assert ended - float((run_dir / "asleep").read_text()) < timeout + 60
    hang = run_dir / "hang"
    stacks = {r: (hang / f"rank_{r}.txt").read_text() for r in (0, 1)}
    assert "in on_before_backward" in stacks[1] and "faults.py" in stacks[1]
    assert "backward" in stacks[0].split("Python stacks")[1]
    # The flight recorder shows rank 0 inside the gradient all-reduce, rank 1 in none.
    assert re.search(r"collectives: #\d+(-#\d+)? gloo:all_reduce in flight", stacks[0])
    assert "collectives: none in flight" in stacks[1]
    assert f"Stacks of every thread of every rank: {hang}/rank_<N>.txt" in proc.stdout
    assert "rank 1: main thread at" in (hang / "summary.txt").read_text()
    assert f"the stacks of every rank are in {hang}" in proc.stderr


@pytest.mark.slow
def test_unused_parameters_are_named_with_the_fix(tmp_path: Path) -> None:
    proc = train(
        *TINY_DDP,
        "task.module._target_=faults.UnusedBranchClassifier",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode != 0
    assert "2 parameter(s) got no gradient: unused_head.weight, unused_head.bias" in proc.stderr
    assert "strategy.find_unused_parameters=true" in proc.stderr
    assert "strategy.static_graph=true" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_overfit_learns_a_few_batches(tmp_path: Path) -> None:
    proc = train(
        "debug=overfit",
        "logger=none",
        "data.batch_size=16",
        "trainer.enable_model_summary=false",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    epochs = re.findall(r"epoch (\d+)/30  train/loss (\S+)  train/acc (\S+)", proc.stdout)
    assert len(epochs) == 30
    first_loss, last_loss, last_acc = (
        float(epochs[0][1]),
        float(epochs[-1][1]),
        float(epochs[-1][2]),
    )
    # What "it can learn" needs: every sample of the few batches right, and the loss down by
    # an order of magnitude. How far below that it ends differs between CPUs (their kernels).
    assert last_acc == 1.0 and last_loss < first_loss / 10


BAD = {
    "watchdog timeout 0": (
        ["debug=watchdog", "callbacks.hang_watchdog.timeout_s=0"],
        "callbacks.hang_watchdog.timeout_s=0",
    ),
    "watchdog on_hang": (
        ["debug=watchdog", "callbacks.hang_watchdog.on_hang=retry"],
        "callbacks.hang_watchdog.on_hang='retry'",
    ),
    "sync check every 0 steps": (
        ["debug=sync_check", "callbacks.sync_check.every_n_steps=0"],
        "callbacks.sync_check.every_n_steps=0",
    ),
    "profiler without active steps": (
        ["debug=profile", "callbacks.profiler.active=0"],
        "callbacks.profiler.active=0",
    ),
    "DETAIL on gloo": (
        ["debug=distributed", "debug.distributed_debug=DETAIL"],
        "debug.distributed_debug='DETAIL'",
    ),
    "unknown debug level": (
        ["debug=distributed", "debug.distributed_debug=LOUD"],
        "debug.distributed_debug='LOUD'",
    ),
    "host_sync on the CPU": (["debug=host_sync"], "debug='host_sync'"),
}


@pytest.mark.parametrize("overrides,expected", BAD.values(), ids=BAD.keys())
def test_bad_debug_setting_is_refused(overrides, expected) -> None:
    with pytest.raises(ConfigError) as refused:
        resolve_and_check(compose_train("accelerator=cpu", *overrides))
    assert str(refused.value).startswith(f"{expected} is not valid: ")
    assert "Fix: " in str(refused.value)


@pytest.mark.slow
def test_bad_debug_input_on_the_command_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = train("debug=nope", f"hydra.run.dir={run_dir}", cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert "debug='nope' is not valid: an option of the config group debug" in proc.stderr
    assert "sync_check" in proc.stderr
    proc = train(
        "debug=profile",
        "callbacks.profiler.active=0",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 2
    assert "error: callbacks.profiler.active=0 is not valid" in proc.stderr
    assert "Traceback" not in proc.stderr and not (run_dir / "logs").exists()


@pytest.mark.parametrize(
    "option", sorted(p.stem for p in (Path(CONFIG_DIR) / "debug").glob("*.yaml"))
)
def test_every_debug_option_composes_and_passes_the_checks(option: str) -> None:
    cfg = compose_train(f"debug={option}", "accelerator=cpu")
    if option == "host_sync":
        with pytest.raises(ConfigError):
            resolve_and_check(cfg)
    else:
        resolve_and_check(cfg)


def test_host_sync_finder_reports_each_line_once(capsys) -> None:
    """The reporting half of debug=host_sync (the warnings come from CUDA on a GPU)."""
    finder = HostSyncFinder()
    finder.on_train_start(SimpleNamespace(is_global_zero=True), None)
    try:
        for _ in range(3):
            warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
    finally:
        finder.on_train_end(SimpleNamespace(is_global_zero=True), None)
    out = capsys.readouterr().out
    assert out.count("host sync: ") == 1 and "test_debug.py:" in out
    assert re.search(r"3 x  .*test_debug.py:\d+ +warnings.warn", out)


def test_loader_workers_beyond_the_cores_are_warned_about() -> None:
    assert oversubscription_warning(local_ranks=2, workers=0, cores=2) is None
    assert oversubscription_warning(local_ranks=4, workers=1, cores=8) is None
    warning = oversubscription_warning(local_ranks=2, workers=4, cores=8)
    assert warning == (
        "2 rank(s) x (1 + 4 loader workers) = 10 processes share 8 core(s): they compete "
        "with training. Try data.num_workers=3."
    )
