"""`ckpt_path` is checked before any worker starts: a checkpoint of another task, the
exported model.pt, or one saved without the training state is refused in one paragraph."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.runs import compose_train, train
from omegaconf import open_dict

from ddp_template.build import build_task
from ddp_template.errors import ConfigError
from ddp_template.resume.checkpoint_check import check_checkpoint


def _checkpoint_of(path: Path, *overrides: str, weights_only: bool = False) -> Path:
    """A file shaped as Lightning saves one, with the weights of the module `overrides` build."""
    _, module = build_task(compose_train(*overrides))
    state = {"state_dict": module.state_dict(), "pytorch-lightning_version": "2.6.6"}
    if not weights_only:
        state["loops"] = {}
    torch.save(state, path)
    return path


def _check(ckpt: Path, *overrides: str) -> None:
    cfg = compose_train(*overrides)
    with open_dict(cfg):
        cfg.ckpt_path = str(ckpt)
    check_checkpoint(cfg, lambda checked: build_task(checked)[1])


def test_a_checkpoint_of_the_same_model_passes(tmp_path: Path) -> None:
    _check(_checkpoint_of(tmp_path / "same.ckpt", "data=digits"), "data=digits")


def test_a_checkpoint_of_another_task_is_refused_with_what_differs(tmp_path: Path) -> None:
    other = _checkpoint_of(tmp_path / "regression.ckpt", "task=regression")
    with pytest.raises(ConfigError) as refused:
        _check(other, "data=digits")
    message = str(refused.value)
    assert "task=image_classification" in message and "data=digits" in message
    assert "weights this model does not have" in message and "\n" not in message
    # A few keys as examples, not all of them.
    assert len(message) < 1000


def test_the_same_task_with_another_model_size_names_the_shapes(tmp_path: Path) -> None:
    wider = _checkpoint_of(
        tmp_path / "wide.ckpt", "task=regression", "task.module.model.hidden=[128,64]"
    )
    with pytest.raises(ConfigError, match="of another shape"):
        _check(wider, "task=regression")


def test_weights_without_training_state_are_refused(tmp_path: Path) -> None:
    _, module = build_task(compose_train("task=regression"))
    exported = tmp_path / "model.pt"
    torch.save(module.model.state_dict(), exported)
    with pytest.raises(ConfigError, match="such as the exported model.pt"):
        _check(exported, "task=regression")
    weights_only = _checkpoint_of(tmp_path / "w.ckpt", "task=regression", weights_only=True)
    with pytest.raises(ConfigError, match="save_weights_only"):
        _check(weights_only, "task=regression")


@pytest.mark.slow
def test_model_pt_as_ckpt_path_stops_before_any_worker(tmp_path: Path) -> None:
    _, module = build_task(compose_train("task=regression"))
    exported = tmp_path / "model.pt"
    torch.save(module.model.state_dict(), exported)
    run_dir = tmp_path / "run"
    proc = train(
        "task=regression",
        "devices=2",
        f"ckpt_path={exported}",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "model.pt" in errors[0] and "Fix:" in errors[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (run_dir / "logs").exists()
