"""Defaults that follow the data: an image folder trains at its images' own size, the stem
follows the input size, and loader workers follow how the samples are loaded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers.runs import FAST, compose_train, train
from PIL import Image
from torch import nn

from ddp_template.build import build_task
from ddp_template.config.checks import resolve_and_check
from ddp_template.errors import ConfigError
from ddp_template.launch.topology import workers_per_rank


def image_folder(root: Path, side: int, per_class: int = 3, classes: int = 2) -> Path:
    """An ImageNet layout (train/<class>/, val/<class>/) of random PNGs, `side` px square."""
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for k in range(classes):
            folder = root / split / f"class_{k}"
            folder.mkdir(parents=True)
            for i in range(per_class):
                pixels = rng.integers(0, 256, size=(side, side, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")
    return root


def built(*overrides: str):
    # A batch as small as these folders (the check refuses one larger than a rank's shard).
    cfg = compose_train("data.batch_size=1", *overrides)
    resolve_and_check(cfg)
    datamodule, module = build_task(cfg)
    return cfg, datamodule, module


def has_small_stem(model: nn.Module) -> bool:
    return model.conv1.kernel_size == (3, 3) and isinstance(model.maxpool, nn.Identity)


def test_folder_of_small_images_trains_at_their_size_with_the_small_stem(tmp_path: Path) -> None:
    root = image_folder(tmp_path / "px32", side=32)
    cfg, datamodule, module = built("data=imagefolder", f"data.root={root}", "devices=2")
    assert datamodule.sizes()["image_size"] == 32
    assert has_small_stem(module.model)
    # Decoded from files: the cores a rank may use, less the one it trains on.
    assert cfg.data.num_workers == workers_per_rank(2, minimum=0)
    datamodule.setup("fit")
    image, _ = datamodule.train_set[0]
    assert tuple(image.shape) == (3, 32, 32)


def test_folder_of_large_images_trains_at_224_px_with_the_imagenet_stem(tmp_path: Path) -> None:
    root = image_folder(tmp_path / "px300", side=300, per_class=1)
    _, datamodule, module = built("data=imagefolder", f"data.root={root}")
    assert datamodule.sizes()["image_size"] == 224
    assert module.model.conv1.kernel_size == (7, 7) and not has_small_stem(module.model)


def test_a_size_set_by_hand_wins_and_the_stem_follows_it(tmp_path: Path) -> None:
    root = image_folder(tmp_path / "px32", side=32, per_class=1)
    _, datamodule, module = built("data=imagefolder", f"data.root={root}", "data.image_size=128")
    assert datamodule.sizes()["image_size"] == 128
    assert not has_small_stem(module.model)


@pytest.mark.parametrize("size,small", [(32, True), (64, True), (224, False)])
def test_synthetic_stem_follows_the_image_size(size: int, small: bool) -> None:
    _, _, module = built("data=synthetic", f"data.image_size={size}")
    assert has_small_stem(module.model) is small


def test_the_stem_can_be_forced() -> None:
    _, _, module = built("data=synthetic", "task.module.model.small_input=true")
    assert has_small_stem(module.model)
    _, _, module = built("data=digits", "task.module.model.small_input=false")
    assert not has_small_stem(module.model)


def test_in_memory_data_loads_in_the_training_process() -> None:
    for data in ("digits", "synthetic"):
        cfg, _, _ = built(f"data={data}", "devices=2")
        assert cfg.data.num_workers == 0


@pytest.mark.slow
def test_the_startup_report_states_size_stem_and_workers(tmp_path: Path) -> None:
    root = image_folder(tmp_path / "px32", side=32)
    proc = train(
        *FAST,
        "data=imagefolder",
        f"data.root={root}",
        "data.batch_size=2",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    report = " ".join(proc.stdout.split())
    assert "32x32 px, 3 channels (the images' own size)" in report
    assert "small-image stem" in report and "32 px inputs <= 64 px (small_input=auto)" in report
    assert "samples decoded one by one" in report


def test_image_size_of_another_type_is_refused(tmp_path: Path) -> None:
    root = image_folder(tmp_path / "px32", side=32, per_class=1)
    with pytest.raises(ConfigError, match="data.image_size='abc'"):
        built("data=imagefolder", f"data.root={root}", "data.image_size=abc")


def test_unreadable_image_is_named_before_workers(tmp_path: Path) -> None:
    root = image_folder(tmp_path / "px32", side=32, per_class=1)
    broken = root / "train" / "class_0" / "0.png"
    broken.write_bytes(b"not an image")
    with pytest.raises(ConfigError, match="0.png"):
        built("data=imagefolder", f"data.root={root}")


@pytest.mark.slow
def test_bad_image_size_exits_before_workers(tmp_path: Path) -> None:
    root = image_folder(tmp_path / "px32", side=32, per_class=1)
    run_dir = tmp_path / "run"
    proc = train(
        "data=imagefolder",
        f"data.root={root}",
        "data.image_size=0",
        "devices=2",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "data.image_size=0" in proc.stderr and "Fix:" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (run_dir / "logs").exists()
