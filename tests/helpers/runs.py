"""What the tests share: run `python train.py` as a real subprocess, the way users do,
compose the config in-process, read a run's results.

Every run and every composed config trains on the CPU unless the test says otherwise
(`accelerator=...` among its overrides): the same suite then passes on machines with and
without GPUs.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]
# What the tests plant in runs (probes, faults) and start as scripts.
HELPERS = TESTS / "helpers"
sys.path.insert(0, str(HELPERS))

# Pins the CPU: the tests check CPU behaviour (gloo, host memory, bf16 for 16-mixed).
CPU = "accelerator=cpu"

# Small, quick runs: a few batches, no per-epoch noise.
FAST = [
    CPU,
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=3",
    "trainer.limit_val_batches=2",
    "trainer.limit_test_batches=2",
    "trainer.num_sanity_val_steps=0",
    "trainer.enable_model_summary=false",
    "logger=none",
]

# Two epochs of FIRST_EPOCH_STEPS steps: last.prev.ckpt is the end of epoch 1, last.ckpt
# the end of epoch 2.
TWO_EPOCHS = [
    *[o for o in FAST if not o.startswith(("trainer.max_epochs", "trainer.limit_train"))],
    "trainer.max_epochs=2",
    "trainer.limit_train_batches=2",
]
FIRST_EPOCH_STEPS = 2


def interrupt_after_first_epoch(job: Path) -> None:
    """The state a job killed during its second epoch leaves: the first epoch's checkpoint
    as last.ckpt, no results."""
    (job / "results.json").unlink()
    checkpoints = job / "checkpoints"
    (checkpoints / "last.prev.ckpt").replace(checkpoints / "last.ckpt")


def on_cpu_unless_told(overrides: tuple[str, ...] | list[str]) -> list[str]:
    """The overrides, plus `accelerator=cpu` when they name no accelerator."""
    if any(o.lstrip("+~").startswith("accelerator=") for o in overrides):
        return list(overrides)
    return [*overrides, CPU]


def train(
    *overrides: str, cwd: Path, timeout: float = 600, check: bool = True
) -> subprocess.CompletedProcess:
    overrides = tuple(on_cpu_unless_told(overrides))
    env = subprocess_env()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *overrides],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"train.py {' '.join(overrides)} exited {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout[-5000:]}\n--- stderr ---\n{proc.stderr[-5000:]}"
        )
    return proc


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment of a process a test starts: the test helpers importable (faults,
    probes), kept before a PYTHONPATH set by the caller (a copy of the project)."""
    path = os.pathsep.join(filter(None, [str(HELPERS), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **extra}


def start(
    args: list[str], cwd: Path, env: dict[str, str] | None = None, **popen: object
) -> subprocess.Popen:
    """Starts a command (train.py, torchrun) in the background, its output captured."""
    return subprocess.Popen(
        args,
        cwd=cwd,
        env=subprocess_env(**(env or {})),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def results(run_dir: Path) -> dict:
    return json.loads((run_dir / "results.json").read_text())


def probes(run_dir: Path) -> list[dict]:
    files = sorted((run_dir / "probe").glob("rank_*.json"), key=lambda p: int(p.stem.split("_")[1]))
    return [json.loads(f.read_text()) for f in files]


def compose_train(*overrides: str):
    """The training config as Hydra composes it, in this process (no job folder); on the
    CPU unless the overrides name an accelerator."""
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from ddp_template.config import resolvers
    from ddp_template.train import CONFIG_DIR

    resolvers.register()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=on_cpu_unless_told(overrides))
    with open_dict(cfg):
        cfg.paths.output_dir = "unused"
    return cfg


def cuda_devices() -> int:
    import torch

    return torch.cuda.device_count()
