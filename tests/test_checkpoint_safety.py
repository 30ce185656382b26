"""Checkpoints cannot be torn: each is complete under a temporary name before it takes its
own, the previous `last.ckpt` is kept until the new one is, and a restart that finds a
broken `last.ckpt` resumes from the previous one, saying so."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.runs import FAST, ROOT, start
from omegaconf import OmegaConf

from ddp_template.resume.checkpoint_check import newest_complete, unreadable
from ddp_template.resume.checkpoint_io import SafeCheckpointIO, previous_of


def _save(folder: Path, step: int) -> Path:
    path = folder / "last.ckpt"
    SafeCheckpointIO().save_checkpoint({"global_step": step, "w": torch.ones(3) * step}, path)
    return path


def test_the_previous_checkpoint_is_kept_and_a_truncated_one_falls_back_to_it(tmp_path) -> None:
    last = _save(tmp_path, 1)
    _save(tmp_path, 2)
    assert torch.load(last, weights_only=True)["global_step"] == 2
    assert torch.load(previous_of(last), weights_only=True)["global_step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "last.prev.ckpt"]
    assert newest_complete(last) == (last, None)

    # Torn: the first half of the file only.
    data = last.read_bytes()
    last.write_bytes(data[: len(data) // 2])
    assert unreadable(last) is not None
    resume_from, note = newest_complete(last)
    assert resume_from == previous_of(last)
    assert note is not None and "last.prev.ckpt" in note and "\n" not in note

    # Killed between the two renames: no last.ckpt, the previous one complete.
    last.unlink()
    assert newest_complete(last)[0] == previous_of(last)

    # Nothing complete at all: no checkpoint to resume from, and a line saying why.
    previous_of(last).write_bytes(b"not a checkpoint")
    last.write_bytes(b"nor this")
    resume_from, note = newest_complete(last)
    assert resume_from is None and note is not None


def test_a_restart_resumes_from_the_previous_checkpoint_when_last_is_torn(
    tmp_path, monkeypatch, capsys
) -> None:
    from ddp_template.resume.decision import resume_point

    folder = tmp_path / "checkpoints"
    last = _save(folder, 1)
    _save(folder, 2)
    last.write_bytes(last.read_bytes()[:100])
    cfg = OmegaConf.create({"paths": {"output_dir": str(tmp_path)}, "ckpt_path": None})
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.delenv("RANK", raising=False)
    assert resume_point(cfg) == str(previous_of(last))
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 1 and "last.prev.ckpt" in printed[0]


@pytest.mark.slow
def test_a_process_killed_while_writing_a_checkpoint_leaves_the_previous_one(tmp_path) -> None:
    job = tmp_path / "run"
    proc = start(
        [
            sys.executable,
            str(ROOT / "train.py"),
            *FAST,
            "task=regression",
            "trainer.limit_train_batches=4",
            "test=false",
            "~callbacks.model_checkpoint",
            "callbacks.last_checkpoint.every_n_train_steps=1",
            "+callbacks.stall._target_=faults.HalfWrittenCheckpoint",
            f"hydra.run.dir={job}",
        ],
        cwd=tmp_path,
    )
    marker = job / "writing"
    deadline = time.monotonic() + 120
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.exists(), proc.communicate()[1][-3000:] if proc.poll() is not None else ""
    proc.send_signal(signal.SIGKILL)
    proc.communicate()

    folder = job / "checkpoints"
    torn = list(folder.glob(".last.ckpt.*.tmp"))
    assert len(torn) == 1 and unreadable(torn[0]) is not None, "no half-written file"
    last = folder / "last.ckpt"
    assert newest_complete(last) == (last, None)
    assert torch.load(last, weights_only=True)["global_step"] == int(marker.read_text()) - 1
