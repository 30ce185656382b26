"""Helpers: run `python train.py` as a real subprocess, the way users do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent

# Small, quick runs: a few batches, no per-epoch noise.
FAST = [
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=3",
    "trainer.limit_val_batches=2",
    "trainer.limit_test_batches=2",
    "trainer.num_sanity_val_steps=0",
    "trainer.enable_model_summary=false",
    "logger=none",
]


def train(
    *overrides: str, cwd: Path, timeout: float = 600, check: bool = True
) -> subprocess.CompletedProcess:
    # Kept after the tests folder: a PYTHONPATH set by the caller (a copy of the project).
    path = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
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


def results(run_dir: Path) -> dict:
    return json.loads((run_dir / "results.json").read_text())


def probes(run_dir: Path) -> list[dict]:
    files = sorted((run_dir / "probe").glob("rank_*.json"), key=lambda p: int(p.stem.split("_")[1]))
    return [json.loads(f.read_text()) for f in files]


def compose_train(*overrides: str):
    """The training config as Hydra composes it, in this process (no job folder)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from ddp_template import resolvers
    from ddp_template.train import CONFIG_DIR

    resolvers.register()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=list(overrides))
    with open_dict(cfg):
        cfg.paths.output_dir = "unused"
    return cfg


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"
