"""`python -m ddp_template.new_task`: what it copies and renames, what it refuses, and that a
task copied from a user-made copy trains under DDP and passes its own tests unedited."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.runs import ROOT
from omegaconf import OmegaConf

from ddp_template import new_task
from ddp_template.new_task import (
    CONFIG_DIR,
    TASKS_DIR,
    available_sources,
    class_prefix,
    create_task,
    renamer,
)
from ddp_template.project import interpreter_in

BUILT_IN = ["image_classification", "regression", "tabular_classification"]


def copy_project(target: Path) -> Path:
    """What a checkout needs to train and test: configs, package, entry point, test helpers
    and the tasks' own tests."""
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(ROOT / "conf", target / "conf", ignore=ignore)
    shutil.copytree(ROOT / "src" / "ddp_template", target / "src" / "ddp_template", ignore=ignore)
    (target / "tests" / "helpers").mkdir(parents=True)
    for name in (
        "train.py",
        "pyproject.toml",
        "tests/conftest.py",
        "tests/helpers/runs.py",
        "tests/helpers/prestarted.py",
        "tests/helpers/probe.py",
    ):
        shutil.copy2(ROOT / name, target / name)
    for test in (ROOT / "tests").glob("test_task_*.py"):
        shutil.copy2(test, target / "tests" / test.name)
    return target


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return copy_project(tmp_path / "project")


def composed_model_target(root: Path, task: str) -> str:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(root / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[f"task={task}"])
    return OmegaConf.select(cfg, "task.module.model._target_")


def listing(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))


def test_the_tasks_of_the_project_are_the_sources() -> None:
    assert available_sources(ROOT) == BUILT_IN


def test_default_source_is_image_classification(root: Path) -> None:
    files = create_task("speech_tagging", root=root)
    package = "src/ddp_template/tasks/speech_tagging"
    assert sorted(p.as_posix() for p in files) == [
        "conf/task/speech_tagging.yaml",
        *(f"{package}/{name}.py" for name in ("__init__", "datamodule", "model", "module")),
        f"{package}/sources.py",
        "tests/test_task_speech_tagging.py",
    ]
    task = OmegaConf.load(root / "conf" / "task" / "speech_tagging.yaml").task
    assert task.name == "speech_tagging"
    assert task.datamodule._target_ == (
        "ddp_template.tasks.speech_tagging.datamodule.SpeechTaggingDataModule"
    )
    assert task.module._target_ == "ddp_template.tasks.speech_tagging.module.SpeechTaggingModule"
    # The network comes from conf/model/, built from the task's own model.py.
    assert composed_model_target(root, "speech_tagging") == (
        "ddp_template.tasks.speech_tagging.model.build_resnet"
    )
    module = (root / package / "module.py").read_text()
    assert "class SpeechTaggingModule(TaskModule):" in module


@pytest.mark.parametrize("source", BUILT_IN)
def test_a_copy_differs_from_its_task_by_the_names_only(source: str, root: Path) -> None:
    """Renamed back, every copied file is its original byte for byte; and no file of the
    copy names the original task or its classes any more."""
    files = create_task("speech_tagging", source=source, root=root)
    back = renamer("speech_tagging", source)
    for copy in files:
        original = Path(str(copy).replace("speech_tagging", source))
        text = (root / copy).read_text()
        assert back(text) == (root / original).read_text(), f"{copy} differs beyond the names"
        assert not re.search(rf"\b{source}\b|\b{class_prefix(source)}[A-Z]", text), copy
    assert len(files) == len(new_task.task_files(source, source, root))


@pytest.mark.parametrize("source", BUILT_IN)
def test_config_targets_name_the_generated_classes(source: str, root: Path) -> None:
    create_task("speech_tagging", source=source, root=root)
    task = OmegaConf.load(root / CONFIG_DIR / "speech_tagging.yaml").task
    for part in ("datamodule", "module"):
        package, file, cls = task[part]._target_.rsplit(".", 2)
        assert package == "ddp_template.tasks.speech_tagging"
        assert cls == f"SpeechTagging{'DataModule' if part == 'datamodule' else 'Module'}"
        text = (root / TASKS_DIR / "speech_tagging" / f"{file}.py").read_text()
        assert f"\nclass {cls}(" in text


def test_a_user_made_task_is_a_source(root: Path) -> None:
    create_task("speech_tagging", source="tabular_classification", root=root)
    (root / TASKS_DIR / "speech_tagging" / "extra.py").write_text("SpeechTaggingTable = 1\n")
    assert "speech_tagging" in available_sources(root)
    files = create_task("speech_tagging_v2", source="speech_tagging", root=root)
    extra = root / TASKS_DIR / "speech_tagging_v2" / "extra.py"
    assert extra.read_text() == "SpeechTaggingV2Table = 1\n"
    assert Path("tests/test_task_speech_tagging_v2.py") in files


def test_generated_files_are_formatted_and_lint_clean(root: Path) -> None:
    ruff = Path(sys.executable).parent / "ruff"
    if not ruff.exists():
        pytest.skip("ruff is not installed")
    files = []
    for source in BUILT_IN:
        files += create_task(f"{source.split('_')[0]}_copy", source=source, root=root)
    paths = [str(p) for p in files if p.suffix == ".py"]
    for args in (["format", "--check"], ["check"]):
        proc = subprocess.run(
            [str(ruff), *args, "--no-cache", *paths], cwd=root, capture_output=True, text=True
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


def test_unknown_source_lists_the_tasks(root: Path) -> None:
    before = listing(root)
    with pytest.raises(new_task.ConfigError) as err:
        create_task("speech_tagging", source="audio", root=root)
    assert "--from='audio'" in str(err.value)
    assert "the tasks are image_classification, regression, tabular_classification" in str(
        err.value
    )
    assert listing(root) == before


def test_root_that_is_not_a_project(tmp_path: Path) -> None:
    with pytest.raises(new_task.ConfigError, match="conf/task/"):
        create_task("speech_tagging", root=tmp_path)
    assert listing(tmp_path) == []


def test_failure_half_way_leaves_nothing(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = listing(root)
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
    assert listing(root) == before


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
    before = listing(root)
    proc = run_command(*args, "--root", str(root), cwd=root)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"error: {expected} is not valid")
    assert "Fix:" in proc.stderr and proc.stderr.count("\n") == 1
    assert "Traceback" not in proc.stderr + proc.stdout
    assert listing(root) == before


@pytest.mark.slow
def test_copy_of_a_user_made_task_trains_with_ddp_and_passes_its_tests(root: Path) -> None:
    """A user copies the regression task, then copies their copy: the second copy's own test
    (a DDP run whose best checkpoint has the lowest validation error, and whose test error
    beats predicting the mean) passes unedited."""
    first = run_command("dosage", "--from", "regression", "--root", str(root), cwd=root)
    assert first.returncode == 0, first.stderr
    second = run_command("dosage_v2", "--from", "dosage", "--root", str(root), cwd=root)
    assert second.returncode == 0, second.stderr
    assert "tests/test_task_dosage_v2.py" in second.stdout

    # The copy's own package, configs and tests, as in a checkout holding the new task.
    env = {**os.environ, "PYTHONPATH": str(root / "src"), "PYTHONUNBUFFERED": "1"}
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA"]
        + ["tests/test_task_dosage_v2.py"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert tests.returncode == 0, tests.stdout[-5000:]
    assert "2 passed" in tests.stdout
    assert "PASSED tests/test_task_dosage_v2.py::test_ddp_run_keeps_the_checkpoint" in tests.stdout


@pytest.mark.parametrize("pytest_installed", [True, False])
def test_the_printed_commands_run_in_the_readme_set_up(
    root: Path, pytest_installed: bool, monkeypatch, capsys
) -> None:
    """The project's interpreter, and the dev set-up first where pytest is not installed."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: find_spec(name, *a) if pytest_installed or name != "pytest" else None,
    )
    monkeypatch.chdir(root)
    assert new_task.main(["churn", "--root", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    python = interpreter_in(root)
    assert f"Train it:  {python} train.py task=churn strategy=ddp devices=2" in lines
    test = f"{python} -m pytest tests/test_task_churn.py"
    expected = test if pytest_installed else f"bash scripts/setup.sh dev && {test}"
    assert f"Test it:   {expected}" in lines


@pytest.mark.parametrize("task", BUILT_IN)
def test_a_task_folder_depends_on_no_other_task(task: str) -> None:
    """`new_task --from TASK` gives a copy that works on its own: no file of the task's
    folder, config or test names another task's package."""
    others = [f"ddp_template.tasks.{other}" for other in BUILT_IN if other != task]
    files = [
        *(ROOT / TASKS_DIR / task).rglob("*.py"),
        ROOT / CONFIG_DIR / f"{task}.yaml",
        ROOT / "tests" / f"test_task_{task}.py",
    ]
    for path in files:
        text = path.read_text()
        assert not [other for other in others if other in text], path


def _committed(root: Path) -> None:
    """The copied project as a git checkout whose last commit holds every file."""
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "the project"], check=True)


def test_a_copy_leaves_out_uncommitted_edits_unless_asked(root: Path) -> None:
    """An edit tried on the built-in task (another learning rate) stays out of a copy, and
    is named; --with-edits carries it."""
    _committed(root)
    config = root / CONFIG_DIR / "image_classification.yaml"
    config.write_text(config.read_text().replace("lr: 0.1", "lr: 0.5"))
    left_out: list[Path] = []
    create_task("pristine", root=root, left_out=left_out)
    copied = OmegaConf.load(root / CONFIG_DIR / "pristine.yaml").task.module.optimizer.lr
    assert copied == 0.1 and left_out == [CONFIG_DIR / "image_classification.yaml"]

    proc = run_command("edited", "--with-edits", "--root", str(root), cwd=root)
    assert proc.returncode == 0, proc.stderr
    assert OmegaConf.load(root / CONFIG_DIR / "edited.yaml").task.module.optimizer.lr == 0.5
    assert "without their uncommitted edits" not in proc.stdout
    proc = run_command("again", "--root", str(root), cwd=root)
    assert "without their uncommitted edits: conf/task/image_classification.yaml" in proc.stdout


def test_a_task_git_holds_no_version_of_is_copied_as_it_is(root: Path) -> None:
    _committed(root)
    create_task("mine", source="regression", root=root)
    left_out: list[Path] = []
    files = create_task("mine_v2", source="mine", root=root, left_out=left_out)
    assert left_out == [] and TASKS_DIR / "mine_v2" / "module.py" in files
