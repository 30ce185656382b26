"""The article's switches as config groups: recipes, loaders, communication hooks,
channels-last, benchmark mode, and their up-front checks. In-process and quick."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from helpers.runs import compose_train, train
from omegaconf import OmegaConf

from ddp_template.callbacks.speed import SpeedMonitor
from ddp_template.config import resolvers
from ddp_template.config.checks import resolve_and_check
from ddp_template.errors import ConfigError
from ddp_template.worker.comm_hooks import (
    COMM_HOOKS,
    CountingHook,
    hook_state,
    needs_one_bucket_at_a_time,
)

resolvers.register()


def checked(*overrides: str):
    cfg = compose_train(*overrides)
    resolve_and_check(cfg)
    return OmegaConf.to_container(cfg, resolve=True)


def test_recipes_are_cumulative() -> None:
    recipes = {name: checked(f"recipe={name}") for name in ("baseline", "amp", "data", "comm")}
    baseline, amp, data, comm = recipes.values()
    for cfg in recipes.values():
        assert cfg["strategy"]["name"] == "ddp"
    # baseline: fp32, the loader in the training process, PyTorch's DDP defaults (null bucket).
    assert baseline["precision"] == "32-true"
    assert baseline["data"]["num_workers"] == 0
    assert baseline["strategy"]["bucket_cap_mb"] is None
    assert baseline["strategy"]["comm_hook"] == "none"
    # Each recipe keeps the previous one's choices and adds its own.
    assert amp["precision"] == "16-mixed" and amp["data"] == baseline["data"]
    assert data["precision"] == "16-mixed" and data["data"]["num_workers"] >= 1
    assert data["strategy"] == amp["strategy"]
    assert comm["data"] == data["data"] and comm["precision"] == "16-mixed"
    assert comm["strategy"]["comm_hook"] == "fp16"
    assert comm["strategy"]["bucket_cap_mb"] == 50
    assert comm["strategy"]["gradient_as_bucket_view"] and comm["strategy"]["static_graph"]


def test_the_shard_recipe_is_data_loading_under_fsdp() -> None:
    """recipe=shard: data's loading, strategy=fsdp in place of ddp (none of comm's DDP
    switches: they are DDP's), and bf16-mixed, the mixed precision FSDP takes."""
    data, shard = checked("recipe=data"), checked("recipe=shard")
    assert shard["strategy"]["name"] == "fsdp" and shard["strategy"]["comm_hook"] == "none"
    assert shard["data"] == data["data"] and shard["precision"] == "bf16-mixed"


def test_any_group_can_be_overridden_on_top_of_a_recipe() -> None:
    cfg = checked(
        "recipe=comm", "loader=baseline", "precision=bf16-mixed", "strategy.comm_hook=bf16"
    )
    assert cfg["data"]["num_workers"] == 0
    assert cfg["precision"] == "bf16-mixed"
    assert cfg["strategy"]["comm_hook"] == "bf16" and cfg["strategy"]["bucket_cap_mb"] == 50


@pytest.mark.parametrize("devices", [1, 2])
def test_tuned_loader_derives_workers_from_the_cores_per_rank(devices: int) -> None:
    cfg = checked("loader=tuned", f"devices={devices}")
    cores = len(os.sched_getaffinity(0))
    assert cfg["data"]["num_workers"] == max(1, cores // devices - 1)
    # Pinned memory only on CUDA runs; compose_train pins the CPU (tests/test_gpu.py: CUDA).
    assert cfg["data"]["pin_memory"] is False
    assert cfg["data"]["persistent_workers"] is True
    assert cfg["data"]["prefetch_factor"] == 4


def test_benchmark_mode_times_fixed_steps_without_evaluation() -> None:
    cfg = checked("experiment=benchmark", "benchmark.warmup_steps=3", "benchmark.steps=7")
    assert cfg["data"]["name"] == "synthetic"
    assert cfg["trainer"]["max_steps"] == 10
    assert cfg["trainer"]["limit_val_batches"] == 0 and cfg["test"] is False
    assert cfg["callbacks"]["speed_monitor"]["warmup_batches"] == 3
    assert cfg["callbacks"]["model_checkpoint"] is None
    assert not cfg["logger"]


BAD_VALUES = [
    (["precision=fp8"], "precision"),
    (["strategy=ddp", "strategy.comm_hook=nope"], "strategy.comm_hook"),
    (
        ["strategy=ddp", "strategy.comm_hook=powersgd", "strategy.powersgd_rank=0"],
        "strategy.powersgd_rank",
    ),
    (
        ["strategy=ddp", "strategy.comm_hook=powersgd", "strategy.powersgd_start_iter=1"],
        "strategy.powersgd_start_iter",
    ),
    (["data.num_workers=2", "data.prefetch_factor=0"], "data.prefetch_factor"),
    (["experiment=benchmark", "benchmark.steps=0"], "benchmark.steps"),
    (["experiment=benchmark", "benchmark.warmup_steps=-1"], "benchmark.warmup_steps"),
    (["task.module.model.channels_last=maybe"], "task.module.model.channels_last"),
]


@pytest.mark.parametrize("overrides,key", BAD_VALUES, ids=lambda v: str(v))
def test_bad_values_are_named(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        resolve_and_check(compose_train(*overrides))
    assert err.value.key == key
    assert "Fix:" in str(err.value)


CLI_CASES = {
    "precision=fp8": (["precision=fp8"], "precision='fp8' is not valid"),
    "comm_hook=nope": (
        ["recipe=comm", "strategy.comm_hook=nope"],
        "strategy.comm_hook='nope' is not valid: one of none, fp16, bf16, powersgd",
    ),
    "powersgd rank 0": (
        ["recipe=comm", "strategy.comm_hook=powersgd", "strategy.powersgd_rank=0"],
        "strategy.powersgd_rank=0 is not valid",
    ),
    "prefetch_factor=0": (
        ["loader=tuned", "data.prefetch_factor=0"],
        "data.prefetch_factor=0 is not valid",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("overrides,expected", CLI_CASES.values(), ids=CLI_CASES.keys())
def test_bad_value_on_the_command_line(overrides, expected, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = train(*overrides, f"hydra.run.dir={run_dir}", cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr and "Fix:" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (run_dir / "results.json").exists()


def test_unknown_recipe_lists_the_options(tmp_path: Path) -> None:
    proc = train("recipe=fast", cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert "recipe='fast' is not valid: an option of the config group recipe" in proc.stderr
    for option in ("baseline", "amp", "data", "comm"):
        assert option in proc.stderr


@pytest.fixture
def one_rank_group():
    """A real gloo process group of one rank in this process, removed afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", [name for name in COMM_HOOKS if name != "none"])
def test_each_comm_hook_runs_on_gloo_and_is_counted(name: str, one_rank_group) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001)
    hook = CountingHook(name, needs_one_bucket_at_a_time(name, dist.get_backend()))
    ddp.register_comm_hook(hook_state(name, powersgd_rank=1, powersgd_start_iter=2), hook)
    inputs = torch.randn(16, 32)
    for _ in range(3):
        ddp.zero_grad()
        ddp(inputs).square().mean().backward()
    assert hook.calls >= 3  # once per bucket per step
    assert ddp._get_ddp_logging_data()["comm_hook"] == hook.hook.__qualname__
    grads = torch.autograd.grad(model(inputs).square().mean(), list(model.parameters()))
    matrices = [(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True) if p.ndim > 1]
    if name == "powersgd":
        # From step 2 on, weight matrices travel as a rank-1 approximation: not exact.
        assert any(not torch.allclose(got, exact, atol=1e-3) for got, exact in matrices)
    else:
        # Half-width all-reduce: the model's gradients, rounded.
        for got, exact in matrices:
            torch.testing.assert_close(got, exact, rtol=0.02, atol=1e-3)


def test_channels_last_model_and_inputs() -> None:
    from ddp_template.tasks.image_classification.module import ImageClassificationModule

    torch.manual_seed(0)
    resnet = {"_target_": "ddp_template.tasks.image_classification.model.build_resnet"}
    plain = ImageClassificationModule({**resnet, "arch": "resnet18", "small_input": True}, 10, 3)
    fast = ImageClassificationModule(
        {**resnet, "arch": "resnet18", "small_input": True, "channels_last": True}, 10, 3
    )
    fast.load_state_dict(plain.state_dict())
    conv = fast.model.conv1.weight
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    images = torch.randn(4, 3, 16, 16)
    plain.eval(), fast.eval()
    torch.testing.assert_close(fast(images), plain(images), rtol=1e-4, atol=1e-4)


class _Recorder(SimpleNamespace):
    def log_dict(self, metrics, **kwargs) -> None:
        self.logged = metrics


def test_speed_monitor_splits_loader_wait_from_the_step() -> None:
    """Steps of 20 ms preceded by 20 ms waits: half of the time is waiting for data."""
    monitor = SpeedMonitor(warmup_batches=2)
    module = _Recorder(device=torch.device("cpu"))
    trainer = SimpleNamespace(precision="32-true", strategy=SimpleNamespace(model=module))
    batch = (torch.zeros(8, 1), torch.zeros(8))
    monitor.on_fit_start(trainer, module)
    for epoch_steps in (6, 6):
        monitor.on_train_epoch_start(trainer, module)
        for index in range(epoch_steps):
            time.sleep(0.02)
            monitor.on_train_batch_start(trainer, module, batch, index)
            time.sleep(0.02)
            monitor.on_train_batch_end(trainer, module, None, batch, index)
    monitor.on_train_epoch_end(trainer, module)
    logged = module.logged
    # 12 steps: 2 of warm-up, and the first step of the second epoch is not timed.
    assert logged["perf/measured_steps"] == 9
    assert 0.3 < logged["perf/data_wait_fraction"] < 0.7
    # At least the two 20 ms sleeps; far below a second (a busy machine oversleeps, a unit
    # mistake would read 40).
    assert 0.035 < logged["perf/step_time_median_s"] < 1.0
    assert logged["perf/step_time_p90_s"] >= logged["perf/step_time_median_s"]
    median_rate = 8 / logged["perf/step_time_median_s"]
    assert logged["perf/samples_per_sec"] == pytest.approx(median_rate, rel=0.5)
    assert logged["perf/peak_mem_mb/max"] >= logged["perf/peak_mem_mb/min"] > 0
    # One process: no communication to measure, and no key that says 0.
    assert "perf/exposed_comm_s" not in logged


def _spin(seconds: float) -> None:
    """Busy this thread for `seconds` of CPU time."""
    until = time.process_time() + seconds
    while time.process_time() < until:
        pass


@pytest.mark.parametrize("busy", [False, True], ids=["sleeping steps", "computing steps"])
def test_speed_monitor_reports_the_cpu_time_of_a_step(busy: bool) -> None:
    """A step that sleeps 40 ms costs the rank almost no CPU; one that computes 40 ms of
    CPU costs at least that: the CPU per step tells a rank bound by its cores from one that
    waits."""
    monitor = SpeedMonitor(warmup_batches=1)
    module = _Recorder(device=torch.device("cpu"))
    trainer = SimpleNamespace(precision="32-true", strategy=SimpleNamespace(model=module))
    batch = (torch.zeros(8, 1), torch.zeros(8))
    monitor.on_fit_start(trainer, module)
    monitor.on_train_epoch_start(trainer, module)
    for index in range(6):
        monitor.on_train_batch_start(trainer, module, batch, index)
        if busy:
            _spin(0.04)
        else:
            time.sleep(0.04)
        monitor.on_train_batch_end(trainer, module, None, batch, index)
    monitor.on_train_epoch_end(trainer, module)
    cpu = module.logged["perf/cpu_s_per_step/median"]
    assert module.logged["perf/cpu_s_per_step/max_rank"] == 0
    if busy:
        assert 0.04 <= cpu <= module.logged["perf/step_time_median_s"] * 2
    else:
        assert 0 <= cpu < 0.02


def test_a_comm_hook_added_to_the_table_is_read_everywhere(
    one_rank_group, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One `CommHook` entry is all a new hook needs: the config's allowed names, what is
    registered and counted, the logged settings and the scaling model's wire bytes."""
    import math

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from ddp_template.callbacks.ddp_settings import read_ddp_settings
    from ddp_template.tools.scaling import Link, sent_bytes
    from ddp_template.worker.comm_hooks import CommHook
    from ddp_template.worker.results import _ddp_settings

    def halved(state, bucket):
        return default_hooks.fp16_compress_hook(state, bucket)

    entry = CommHook("halved", halved, "float16", 1, lambda shape, size, rank: math.prod(shape))
    monkeypatch.setitem(COMM_HOOKS, "halved", entry)

    checked("strategy=ddp", "strategy.comm_hook=halved")
    with pytest.raises(ConfigError, match="one of none, fp16, bf16, powersgd, halved"):
        checked("strategy=ddp", "strategy.comm_hook=halfed")

    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
    hook = CountingHook("halved")
    ddp.register_comm_hook(hook_state("halved", 1, 2), hook)
    ddp(torch.randn(2, 8)).sum().backward()
    assert hook.calls == 1
    logged = {f"ddp/{key}": value for key, value in read_ddp_settings(ddp).items()}
    assert _ddp_settings(logged)["comm_hook"] == "halved"

    assert sent_bytes([4, 8], 4, "halved", 1) == 32
    assert "float16" in Link.rated(1e9).bandwidth_bps
