"""The docs' path to an own model and an own data set, followed as written on a copy of the
project: `new_task` copies the image task, a source class in its sources.py and
conf/data/shapes.yaml add a folder of PNG pictures (docs/data.md), a class in its model.py and
conf/model/small_cnn.yaml naming it replace the network with `model=small_cnn`
(docs/new_tasks.md), and nothing else is edited. The copy trains on 2 ranks and passes its copied test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.runs import FAST, results
from PIL import Image, ImageDraw
from test_new_task import copy_project

SOURCE = '''

@dataclass
class Shapes:
    """Grey 8x8 PNG pictures of shapes in class folders (root/<class>/<picture>.png)."""

    root: str = ""
    val_fraction: float = 0.2
    test_fraction: float = 0.2
    split_seed: int = 0
    in_channels = 1
    input_size = 8
    decoded_per_sample = False

    def __post_init__(self) -> None:
        check_held_out(self.val_fraction, self.test_fraction)
        if not Path(self.root).is_dir():
            raise ConfigError(
                "data.root", self.root, "a folder of class folders", "pass data.root=/path"
            )

    @property
    def classes(self) -> list[str]:
        return sorted(folder.name for folder in Path(self.root).iterdir() if folder.is_dir())

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def describe_input(self) -> str:
        return "8x8 px, 1 channel (shapes)"

    def splits(self) -> Splits:
        from PIL import Image

        pictures, labels = [], []
        for label, name in enumerate(self.classes):
            for file in sorted((Path(self.root) / name).glob("*.png")):
                with Image.open(file) as picture:
                    pictures.append(transforms.functional.to_tensor(picture.convert("L")))
                labels.append(label)
        full = TensorDataset(torch.stack(pictures), torch.tensor(labels))
        train, val, test = split_indices(
            len(full), self.val_fraction, self.test_fraction, self.split_seed
        )
        return Subset(full, train), Subset(full, val), Subset(full, test)
'''

DATA_CONFIG = """name: shapes
source: Shapes
root: ???
batch_size: 8
num_workers: 0
val_fraction: 0.2
test_fraction: 0.2
split_seed: 0
"""

MODEL = '''

class SmallCNN(nn.Module):
    """Two 3x3 convolutions and a linear classifier, for small pictures."""

    def __init__(
        self, num_classes: int, in_channels: int, image_size: int | None, width: int = 16
    ) -> None:
        super().__init__()
        side = image_size or 8
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1),
            nn.ReLU(),
            nn.Flatten(),
        )
        self.classifier = nn.Linear(width * side * side, num_classes)
        self.description = f"SmallCNN, width {width}"

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images))
'''

# conf/model/small_cnn.yaml: the whole network node, picked with model=small_cnn.
MODEL_PRESET = """# @package task.module.model
_target_: ddp_template.tasks.shapes.model.SmallCNN
width: 16
"""


def shape_pictures(root: Path, per_class: int = 12) -> Path:
    """Three classes of 8x8 grey pictures: a square, a disc and a cross, at shifted places."""
    draw_shape = {
        "square": lambda d, x, y: d.rectangle([x, y, x + 3, y + 3], fill=255),
        "disc": lambda d, x, y: d.ellipse([x, y, x + 3, y + 3], fill=255),
        "cross": lambda d, x, y: (
            d.line([x, y + 2, x + 4, y + 2], fill=255),
            d.line([x + 2, y, x + 2, y + 4], fill=255),
        ),
    }
    for name, draw in draw_shape.items():
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            picture = Image.new("L", (8, 8))
            draw(ImageDraw.Draw(picture), i % 4, (i // 4) % 4)
            picture.save(root / name / f"{i}.png")
    return root


def run(args: list[str], project: Path) -> subprocess.CompletedProcess:
    """A command in the copy, importing the copy's package (as its own checkout would)."""
    env = {**os.environ, "PYTHONPATH": str(project / "src"), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        args, cwd=project, env=env, capture_output=True, text=True, timeout=400, check=False
    )
    assert proc.returncode == 0, f"{args}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.mark.slow
def test_the_docs_path_to_an_own_model_and_data_set_trains_and_tests(tmp_path: Path) -> None:
    project = copy_project(tmp_path / "project")
    python = sys.executable
    run([python, "-m", "ddp_template.new_task", "shapes"], project)
    package = project / "src" / "ddp_template" / "tasks" / "shapes"

    # docs/data.md: a class in the task's sources.py, and conf/data/<name>.yaml naming it.
    with (package / "sources.py").open("a") as sources:
        sources.write(SOURCE)
    (project / "conf" / "data" / "shapes.yaml").write_text(DATA_CONFIG)
    # docs/new_tasks.md: a class in the task's model.py, and conf/model/<name>.yaml naming it.
    with (package / "model.py").open("a") as model:
        model.write(MODEL)
    (project / "conf" / "model" / "small_cnn.yaml").write_text(MODEL_PRESET)

    pictures = shape_pictures(tmp_path / "pictures")
    run_dir = tmp_path / "run"
    proc = run(
        [
            python,
            "train.py",
            "task=shapes",
            "model=small_cnn",
            "data=shapes",
            f"data.root={pictures}",
            "strategy=ddp",
            "devices=2",
            *FAST,
            f"hydra.run.dir={run_dir}",
        ],
        project,
    )
    out = results(run_dir)
    assert out["world_size"] == 2 and out["config"]["data"]["source"] == "Shapes"
    # The whole node replaced: no key of the ResNet's is left behind.
    assert out["config"]["task"]["module"]["model"] == {
        "_target_": "ddp_template.tasks.shapes.model.SmallCNN",
        "width": 16,
    }
    # 36 pictures, a fifth each for validation and test: 7 test pictures over 2 ranks.
    assert 0.0 <= out["test/acc"] <= 1.0
    assert "SmallCNN, width 16" in proc.stdout + proc.stderr + _logs(run_dir)

    # The copied test, run as new_task prints it.
    run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_task_shapes.py"],
        project,
    )


def _logs(run_dir: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in run_dir.rglob("*.log"))


OWN_NETWORK = """
from torch import nn


class TinyCNN(nn.Module):
    def __init__(self, num_classes, in_channels, image_size, width=8):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(width, num_classes),
        )

    def forward(self, images):
        return self.net(images)
"""


def test_one_override_swaps_the_whole_network_for_an_own_class(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`model=<preset>` replaces task.module.model as a whole (the ResNet's arch,
    small_input, norm, ... are not left behind to be refused one per run); the preset may
    live outside the project, in a folder added with hydra.searchpath."""
    from helpers.runs import compose_train

    from ddp_template.build import build_task
    from ddp_template.config.checks import resolve_and_check

    (tmp_path / "own_nets.py").write_text(OWN_NETWORK)
    monkeypatch.syspath_prepend(str(tmp_path))
    presets = tmp_path / "conf" / "model"
    presets.mkdir(parents=True)
    (presets / "tiny_cnn.yaml").write_text(
        "# @package task.module.model\n_target_: own_nets.TinyCNN\nwidth: 4\n"
    )
    cfg = compose_train(f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "model=tiny_cnn")
    assert dict(cfg.task.module.model) == {"_target_": "own_nets.TinyCNN", "width": 4}
    resolve_and_check(cfg)
    _, module = build_task(cfg)
    assert type(module.model).__name__ == "TinyCNN" and module.model.net[0].out_channels == 4
