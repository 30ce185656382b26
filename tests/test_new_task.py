"""`python -m ddp_template.new_task`: what it writes, what it refuses, and that a task it
generates trains under DDP and passes its own tests with no edits."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FAST, ROOT, results
from omegaconf import OmegaConf

from ddp_template import new_task
from ddp_template.new_task import TASKS_DIR, TaskNames, available_sources, create_task, render

EXPECTED_FILES = [
    "conf/task/speech_tagging.yaml",
    "src/ddp_template/tasks/speech_tagging/__init__.py",
    "src/ddp_template/tasks/speech_tagging/datamodule.py",
    "src/ddp_template/tasks/speech_tagging/model.py",
    "src/ddp_template/tasks/speech_tagging/module.py",
    "src/ddp_template/tasks/speech_tagging/sources.py",
    "tests/test_task_speech_tagging.py",
]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A bare project layout: just the folders the command writes into."""
    project = tmp_path / "project"
    (project / "conf" / "task").mkdir(parents=True)
    (project / TASKS_DIR).mkdir(parents=True)
    (project / "tests").mkdir()
    return project


def listing(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))


def names_of(source: str) -> TaskNames:
    """A task's own names, read from its config's targets."""
    task = OmegaConf.load(ROOT / "conf" / "task" / f"{source}.yaml").task
    return TaskNames(
        source,
        task.datamodule._target_.rsplit(".", 1)[1],
        task.module._target_.rsplit(".", 1)[1],
    )


@pytest.mark.parametrize("source", available_sources())
def test_template_renders_its_task_exactly(source: str) -> None:
    """A template is its task with the names left open: rendered with the task's own names it
    gives back the task's files, byte for byte, and no file of the task is missing from it."""
    files = render(source, names_of(source))
    package = TASKS_DIR / source
    on_disk = {
        p.relative_to(ROOT) for p in (ROOT / package).rglob("*.py") if "__pycache__" not in p.parts
    }
    assert on_disk == {p for p in files if p.is_relative_to(package)}
    for relative, text in files.items():
        if relative.parts[0] == "tests" and not (ROOT / relative).exists():
            continue  # the reference task's own tests live in test_runs.py, test_ddp.py, ...
        assert (ROOT / relative).read_text() == text, f"template of {source}: {relative} differs"


def test_default_source_is_image_classification(root: Path) -> None:
    files = create_task("speech_tagging", root=root)
    assert sorted(p.as_posix() for p in files) == EXPECTED_FILES
    package = "src/ddp_template/tasks/speech_tagging"
    assert listing(root) == sorted({*EXPECTED_FILES, package, *listing_of_bare_root()})
    config = OmegaConf.load(root / "conf" / "task" / "speech_tagging.yaml")
    assert config.task.name == "speech_tagging"
    assert config.task.datamodule._target_ == (
        "ddp_template.tasks.speech_tagging.datamodule.SpeechTaggingDataModule"
    )
    assert config.task.module._target_ == (
        "ddp_template.tasks.speech_tagging.module.SpeechTaggingModule"
    )
    for relative in EXPECTED_FILES:
        text = (root / relative).read_text()
        for old in (
            "image_classification",
            "ImageClassificationDataModule",
            "ImageClassificationModule",
        ):
            assert old not in text, f"{relative} still says {old}"
    module = (root / TASKS_DIR / "speech_tagging" / "module.py").read_text()
    assert "class SpeechTaggingModule(L.LightningModule):" in module
    assert "from ddp_template.tasks.speech_tagging.model import" in module


@pytest.mark.parametrize("source", available_sources())
def test_config_targets_name_the_generated_classes(source: str, root: Path) -> None:
    create_task("speech_tagging", source=source, root=root)
    task = OmegaConf.load(root / "conf" / "task" / "speech_tagging.yaml").task
    assert task.name == "speech_tagging"
    for part in ("datamodule", "module"):
        package, file, cls = task[part]._target_.rsplit(".", 2)
        assert package == "ddp_template.tasks.speech_tagging"
        text = (root / TASKS_DIR / "speech_tagging" / f"{file}.py").read_text()
        assert f"\nclass {cls}(" in text
    for relative in root.rglob("*.*"):
        assert source not in relative.read_text(), f"{relative} still names {source}"


def listing_of_bare_root() -> list[str]:
    return ["conf", "conf/task", "src", "src/ddp_template", "src/ddp_template/tasks", "tests"]


def test_generated_files_are_formatted_and_lint_clean(tmp_path: Path) -> None:
    ruff = Path(sys.executable).parent / "ruff"
    if not ruff.exists():
        pytest.skip("ruff is not installed")
    # In a copy of the project, so that ruff tells first-party imports as it does here.
    project = copy_project(tmp_path / "project")
    files = []
    for source in available_sources():
        files += create_task(f"{source.split('_')[0]}_copy", source=source, root=project)
    paths = [str(p) for p in files if p.suffix == ".py"]
    for args in (["format", "--check"], ["check"]):
        proc = subprocess.run(
            [str(ruff), *args, "--no-cache", *paths], cwd=project, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr


REFUSED = {
    "existing task": ("image_classification", "does not exist yet"),
    "dash": ("my-task", "lowercase Python identifier"),
    "capitals": ("MyTask", "lowercase Python identifier"),
    "leading digit": ("2d_task", "lowercase Python identifier"),
    "keyword": ("class", "not a keyword"),
    "stdlib module": ("os", "import os"),
    "installed module": ("torch", "import torch"),
    "this package": ("ddp_template", "import ddp_template"),
    "empty": ("", "lowercase Python identifier"),
}


@pytest.mark.parametrize("name,message", REFUSED.values(), ids=REFUSED.keys())
def test_refused_names_write_nothing(name: str, message: str, root: Path) -> None:
    (root / TASKS_DIR / "image_classification").mkdir()
    before = listing(root)
    with pytest.raises(new_task.ConfigError, match=message):
        create_task(name, root=root)
    assert listing(root) == before


@pytest.mark.parametrize(
    "existing", ["conf/task/speech_tagging.yaml", "tests/test_task_speech_tagging.py"]
)
def test_any_existing_file_of_the_task_is_kept(existing: str, root: Path) -> None:
    (root / existing).write_text("mine\n")
    before = listing(root)
    with pytest.raises(new_task.ConfigError, match="never overwritten"):
        create_task("speech_tagging", root=root)
    assert listing(root) == before
    assert (root / existing).read_text() == "mine\n"


def test_unknown_source_lists_the_tasks_available(root: Path) -> None:
    with pytest.raises(new_task.ConfigError) as err:
        create_task("speech_tagging", source="audio", root=root)
    assert "--from='audio'" in str(err.value)
    for source in available_sources():
        assert source in str(err.value)
    assert listing(root) == listing_of_bare_root()


def test_root_that_is_not_a_project(tmp_path: Path) -> None:
    with pytest.raises(new_task.ConfigError, match="conf/task/"):
        create_task("speech_tagging", root=tmp_path)
    assert listing(tmp_path) == []


def test_failure_half_way_leaves_nothing(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    moves = []

    def move_then_fail(source: Path, target: Path) -> None:
        if len(moves) == 3:
            raise OSError("disk full")
        os.rename(source, target)
        moves.append(target)

    monkeypatch.setattr(new_task, "_move", move_then_fail)
    with pytest.raises(OSError, match="disk full"):
        create_task("speech_tagging", root=root)
    assert len(moves) == 3
    assert listing(root) == listing_of_bare_root()


def test_template_error_leaves_nothing(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    templates = root.parent / "templates"
    shutil.copytree(new_task.TEMPLATES, templates)
    (templates / "image_classification" / "package" / "zz.py.jinja").write_text("{{ nope }}\n")
    monkeypatch.setattr(new_task, "TEMPLATES", templates)
    with pytest.raises(Exception, match="nope"):
        create_task("speech_tagging", root=root)
    assert listing(root) == listing_of_bare_root()


def run_command(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddp_template.new_task", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "args,expected",
    [
        (["torch"], "NAME='torch'"),
        (["my-task"], "NAME='my-task'"),
        (["speech_tagging", "--from", "audio"], "--from='audio'"),
    ],
    ids=["module", "identifier", "source"],
)
def test_command_line_errors(args: list[str], expected: str, root: Path) -> None:
    proc = run_command(*args, "--root", str(root), cwd=root)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"error: {expected} is not valid")
    assert "Fix:" in proc.stderr and proc.stderr.count("\n") == 1
    assert "Traceback" not in proc.stderr + proc.stdout
    assert listing(root) == listing_of_bare_root()


def copy_project(target: Path) -> Path:
    """What a checkout needs to train and test: configs, package, entry point, test helpers."""
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(ROOT / "conf", target / "conf", ignore=ignore)
    shutil.copytree(ROOT / "src" / "ddp_template", target / "src" / "ddp_template", ignore=ignore)
    (target / "tests").mkdir()
    for name in ("train.py", "pyproject.toml", "tests/conftest.py", "tests/probe.py"):
        shutil.copy2(ROOT / name, target / name)
    return target


@pytest.mark.slow
def test_generated_task_trains_with_ddp_and_passes_its_tests(tmp_path: Path) -> None:
    project = copy_project(tmp_path / "project")
    proc = run_command("speech_tagging", "--root", str(project), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "tests/test_task_speech_tagging.py" in proc.stdout

    # The copy's own package, configs and tests, as in a checkout holding the new task.
    env = {**os.environ, "PYTHONPATH": str(project / "src"), "PYTHONUNBUFFERED": "1"}
    run_dir = tmp_path / "run"
    overrides = ["task=speech_tagging", "strategy=ddp", "devices=2", *FAST]
    train = subprocess.run(
        [sys.executable, str(project / "train.py"), *overrides, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert train.returncode == 0, train.stderr[-5000:]
    out = results(run_dir)
    assert out["world_size"] == 2 and out["config"]["task"]["name"] == "speech_tagging"
    assert out["config"]["task"]["module"]["_target_"].endswith("SpeechTaggingModule")

    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert tests.returncode == 0, tests.stdout[-5000:]
    assert "2 passed" in tests.stdout
