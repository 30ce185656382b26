"""GPU machines, checked on any machine: how CUDA is counted decides whether workers (and
packed jobs) may be forked, the launching process never creates a CUDA context, a CPU rank
never initialises CUDA, and the GPU requests a machine cannot hold are refused with one
paragraph. The machine's way of counting is set up as a GPU machine would have it
(tests/helpers/cuda_scenario.py); nothing here needs a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.runs import FAST, TESTS, compose_train, subprocess_env

from ddp_template.config.checks import resolve_accelerator, resolve_and_check, resolve_devices
from ddp_template.errors import ConfigError

needs_cuda_build = pytest.mark.skipif(
    not torch.cuda._is_compiled(), reason="torch built without CUDA: it counts no GPU at all"
)
MIG = "MIG-7f2c1d9a-0b3e-5a61-9c4d-2e8f6a1b3c5d"


def scenario(name: str, launcher: str) -> dict:
    proc = subprocess.run(
        [sys.executable, str(TESTS / "helpers" / "cuda_scenario.py"), name, launcher],
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_cuda_build
@pytest.mark.slow
@pytest.mark.parametrize(
    "name,launcher,method",
    [
        ("nvml", "launch", "fork"),
        ("mig", "launch", "spawn"),
        ("no_nvml", "launch", "spawn"),
        ("nvml", "packed", "fork"),
        ("mig", "packed", "spawn"),
    ],
)
def test_workers_forked_only_where_a_forked_child_can_use_cuda(
    name: str, launcher: str, method: str
) -> None:
    found = scenario(name, launcher)
    assert found["devices"] >= 1
    assert found["method"] == method
    # The worker started that way can initialise CUDA ...
    assert found["worker_in_bad_fork"] is False
    # ... and the hazard is real: counted through the CUDA runtime, a fork could not.
    assert found["forked_in_bad_fork"] is (name != "nvml")


@pytest.fixture
def gpu_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two GPUs counted (as NVML would), and any CUDA initialisation an error."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)

    def initialise(*args: object, **kwargs: object) -> None:
        raise AssertionError("CUDA was initialised in the launching process")

    monkeypatch.setattr(torch.cuda, "_lazy_init", initialise)


@pytest.mark.parametrize(
    "switch",
    [
        "strategy.comm_hook=bf16",
        "sync_batchnorm=true",
        "precision=bf16-mixed",
        "precision=16-mixed",
        "debug=host_sync",
        "strategy.process_group_backend=nccl",
        "compile=true",
    ],
)
def test_the_checks_create_no_cuda_context(gpu_machine: None, switch: str) -> None:
    resolve_and_check(compose_train("accelerator=gpu", "devices=2", "strategy=ddp", switch))
    assert not torch.cuda.is_initialized()


def test_a_cpu_rank_saves_no_cuda_generator(
    gpu_machine: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU machine a CPU run's checkpoint must not ask for CUDA's generators (that
    initialises CUDA, impossible in a forked rank)."""
    import lightning as L

    from ddp_template.resume.state import ResumeState

    callback = ResumeState(seed=0)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, default_root_dir=tmp_path)
    callback._trainer = trainer
    assert "torch.cuda" not in callback.state_dict()["ranks"][0]["rng"]


def test_a_launcher_that_gave_no_gpu_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError) as refused:
        resolve_accelerator("gpu")
    message = str(refused.value)
    assert "torchrun started it without one" in message and "CUDA_VISIBLE_DEVICES ''" in message


def test_more_devices_than_cuda_visible_devices_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(ConfigError, match=r"at most the 2 GPUs CUDA_VISIBLE_DEVICES='0,1' lists"):
        resolve_devices(4, "cuda")


def test_a_launcher_that_shows_each_rank_one_gpu_is_told_to_show_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """srun --gpus-per-task=1: each task sees one GPU, and a rank takes the GPU of its
    local rank among those it sees."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(ConfigError, match="let torchrun show every process all 2 GPUs"):
        resolve_devices(2, "cuda")


def test_several_devices_on_a_mig_instance(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", MIG)
    with pytest.raises(ConfigError, match="1 on a MIG instance"):
        resolve_devices(2, "cuda")


@pytest.mark.slow
def test_gpu_asked_of_a_rank_without_one_exits_with_the_paragraph(tmp_path: Path) -> None:
    """The real command, as srun starts one of two tasks on a node without GPUs."""
    env = {
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_NNODES": "1",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "train",
        "CUDA_VISIBLE_DEVICES": "",
    }
    proc = subprocess.run(
        [sys.executable, str(TESTS.parent / "train.py"), *FAST[1:], "accelerator=gpu"],
        cwd=tmp_path,
        env=subprocess_env(**env),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "srun started it without one" in proc.stderr and "Traceback" not in proc.stderr
