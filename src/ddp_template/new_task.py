"""`python -m ddp_template.new_task NAME [--from TASK] [--root DIR]`: a new task, copied.

Copies an existing task of the project, built-in or made by this command before:

    src/ddp_template/tasks/TASK/   -> src/ddp_template/tasks/NAME/
    conf/task/TASK.yaml            -> conf/task/NAME.yaml      (so that `task=NAME` selects it)
    tests/test_task_TASK.py        -> tests/test_task_NAME.py  (when the task has one)

and renames, in every copied file, the package (`TASK` -> `NAME`) and the class names
(`<Task>Module`, `<Task>DataModule` and any other class starting with the task's CamelCase
name). Nothing else changes: the copy starts from the task as git's last commit holds
it (uncommitted edits of its files are left out and named; `--with-edits` copies them too),
or as it is where git holds no version of it.

Every check runs before anything is written. The files are written into a staging folder
inside the project first, then moved into place (renames on one file system); if a move
fails, what was already moved is removed again.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import keyword
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from importlib.machinery import PathFinder
from pathlib import Path

from ddp_template.errors import ConfigError, UserFacingError
from ddp_template.project import interpreter_in

# The checkout this package lives in (as for train.py's conf/).
PROJECT_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_SOURCE = "image_classification"
TASKS_DIR = Path("src", "ddp_template", "tasks")
CONFIG_DIR = Path("conf", "task")
TESTS_DIR = Path("tests")
NAME_PATTERN = re.compile(r"[a-z][a-z0-9_]*")
COMMAND = "python -m ddp_template.new_task"


def class_prefix(task: str) -> str:
    """`image_classification` -> `ImageClassification`, the start of the task's class names."""
    return "".join(part.capitalize() for part in task.split("_"))


def available_sources(root: Path = PROJECT_ROOT) -> list[str]:
    """Tasks of the project: a package under src/ddp_template/tasks/ and a config."""
    if not (root / TASKS_DIR).is_dir():
        return []
    return sorted(
        p.name
        for p in (root / TASKS_DIR).iterdir()
        if (p / "__init__.py").is_file() and (root / CONFIG_DIR / f"{p.name}.yaml").is_file()
    )


def task_files(source: str, name: str, root: Path) -> dict[Path, Path]:
    """The files of task `source` -> where their copies for task `name` go (relative to
    the project); nothing read yet."""
    package = TASKS_DIR / source
    copies = {
        p.relative_to(root): TASKS_DIR / name / p.relative_to(root / package)
        for p in sorted((root / package).rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }
    copies[CONFIG_DIR / f"{source}.yaml"] = CONFIG_DIR / f"{name}.yaml"
    test = TESTS_DIR / f"test_task_{source}.py"
    if (root / test).is_file():
        copies[test] = TESTS_DIR / f"test_task_{name}.py"
    return copies


def renamer(source: str, name: str) -> Callable[[str], str]:
    """Text -> text with the package and the class names of `source` renamed to `name`'s."""
    package = re.compile(rf"\b{re.escape(source)}\b")
    classes = re.compile(rf"\b{re.escape(class_prefix(source))}(?=[A-Z]|\b)")

    def rename(text: str) -> str:
        return classes.sub(class_prefix(name), package.sub(name, text))

    return rename


def copy_of(
    source: str, name: str, root: Path, with_edits: bool = False
) -> tuple[dict[Path, str], list[Path]]:
    """Every file of the new task (path relative to the project -> text), and the files of
    `source` whose uncommitted edits were left out; writes nothing."""
    rename = renamer(source, name)
    files: dict[Path, str] = {}
    left_out: list[Path] = []
    for relative, target in task_files(source, name, root).items():
        current = (root / relative).read_text(encoding="utf-8")
        committed = None if with_edits else committed_text(root, relative)
        if committed is not None and committed != current:
            left_out.append(relative)
        files[target] = rename(current if committed is None else committed)
    return files, left_out


def committed_text(root: Path, relative: Path) -> str | None:
    """The file as git's last commit holds it, None where it has none (no git, no checkout,
    a file never committed). A copy starts from the task as committed: an edit tried on a
    built-in task (say, another network in its config) is not carried into every task made
    from it unless asked (`--with-edits`)."""
    try:
        shown = subprocess.run(
            ["git", "-C", str(root), "show", f"HEAD:./{relative.as_posix()}"],
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return shown.stdout.decode("utf-8") if shown.returncode == 0 else None


def check_name(name: str) -> None:
    if not NAME_PATTERN.fullmatch(name) or keyword.iskeyword(name):
        raise ConfigError(
            "NAME",
            name,
            "a lowercase Python identifier that is not a keyword: a letter, then letters, "
            "digits or underscores (it names a Python package and the `task=` option)",
            f"e.g. `{COMMAND} {_suggest(name)}`",
        )
    if _is_module(name):
        raise ConfigError(
            "NAME",
            name,
            f"a name no importable module uses; `import {name}` already finds one, and a "
            "task named like it would be confused with it in imports, configs and tests",
            f"pick another name, e.g. `{COMMAND} {name}_task`",
        )


def _suggest(name: str) -> str:
    words = re.findall(r"[a-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower())
    suggestion = "_".join(words)
    if not suggestion or not suggestion[0].isalpha() or keyword.iskeyword(suggestion):
        suggestion = f"my_{suggestion}".rstrip("_")
    return suggestion


def _is_module(name: str) -> bool:
    """A standard-library, built-in or installed module; the current folder does not count."""
    if name in sys.stdlib_module_names or name in sys.builtin_module_names:
        return True
    here = {"", os.getcwd()}
    return PathFinder.find_spec(name, [p for p in sys.path if p not in here]) is not None


def check_source(source: str, root: Path) -> None:
    sources = available_sources(root)
    if source not in sources:
        raise ConfigError(
            "--from",
            source,
            f"a task of the project to copy; the tasks are {', '.join(sources) or 'none'}",
            f"e.g. `--from {sources[0] if sources else DEFAULT_SOURCE}`",
        )


def check_root(root: Path) -> None:
    if not ((root / "conf" / "task").is_dir() and (root / TASKS_DIR).is_dir()):
        raise ConfigError(
            "--root",
            str(root),
            f"the project folder, the one holding conf/task/ and {TASKS_DIR.as_posix()}/",
            "leave --root out, or point it at a checkout of this project",
        )


def check_new(files: dict[Path, str], root: Path, name: str) -> None:
    package = TASKS_DIR / name
    others = [p for p in files if not p.is_relative_to(package)]
    existing = [p.as_posix() for p in [package, *others] if (root / p).exists()]
    if existing:
        raise ConfigError(
            "NAME",
            name,
            f"the name of a task that does not exist yet; {', '.join(existing)} exists already "
            "and is never overwritten",
            "pick another name, or remove those files first if they are a task to replace",
        )


def write_all(files: dict[Path, str], root: Path) -> None:
    """Writes into a staging folder, then moves every file into place; all or nothing."""
    staging = Path(tempfile.mkdtemp(prefix=".new_task-", dir=root))
    moved: list[Path] = []
    made: list[Path] = []
    try:
        for relative, text in files.items():
            staged = staging / relative
            staged.parent.mkdir(parents=True, exist_ok=True)
            staged.write_text(text, encoding="utf-8")
        for relative in files:
            target = root / relative
            made += _make_folders(target.parent)
            if target.exists():
                raise FileExistsError(f"{target} appeared while the task was written")
            _move(staging / relative, target)
            moved.append(target)
    except BaseException:
        for path in reversed(moved):
            path.unlink(missing_ok=True)
        for folder in reversed(made):
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _make_folders(folder: Path) -> list[Path]:
    """Creates `folder` and its missing parents; returns those it created, outermost first."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for path in reversed(missing):
        path.mkdir()
    return list(reversed(missing))


def _move(source: Path, target: Path) -> None:
    os.rename(source, target)


def create_task(
    name: str,
    source: str = DEFAULT_SOURCE,
    root: Path = PROJECT_ROOT,
    with_edits: bool = False,
    left_out: list[Path] | None = None,
) -> list[Path]:
    """Checks everything, then writes the new task; returns its files (relative to root).
    The files of `source` are copied as committed unless `with_edits`; those whose
    uncommitted edits were left out are added to `left_out`."""
    check_name(name)
    check_root(root)
    check_source(source, root)
    files, edited = copy_of(source, name, root, with_edits)
    check_new(files, root, name)
    write_all(files, root)
    if left_out is not None:
        left_out += edited
    return list(files)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=COMMAND,
        description="Create a task (module, datamodule, config, tests) by copying an existing one.",
    )
    parser.add_argument("name", metavar="NAME", help="the new task: a lowercase identifier")
    parser.add_argument(
        "--from",
        dest="source",
        default=DEFAULT_SOURCE,
        metavar="TASK",
        help=f"the task to copy: any task of the project (default: {DEFAULT_SOURCE})",
    )
    parser.add_argument(
        "--root",
        type=Path,
        default=PROJECT_ROOT,
        help="the project folder to write into (default: the checkout of this package)",
    )
    parser.add_argument(
        "--with-edits",
        action="store_true",
        help="copy the task's files as they are now, uncommitted edits included (default: "
        "as git's last commit holds them, where it holds them)",
    )
    args = parser.parse_args(argv)
    left_out: list[Path] = []
    try:
        files = create_task(args.name, args.source, args.root.resolve(), args.with_edits, left_out)
    except UserFacingError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(
            f"error: writing the task failed ({err}); nothing of it was left behind. "
            "Fix: make the project folder writable and run the command again",
            file=sys.stderr,
        )
        return 1
    root = args.root.resolve()
    print(f"Created task={args.name} (a copy of {args.source}):")
    for path in files:
        print(f"  {path.as_posix()}")
    if left_out:
        edited = ", ".join(p.as_posix() for p in left_out)
        print(
            f"Copied as committed, without their uncommitted edits: {edited} (--with-edits copies them)"
        )
    if Path.cwd().resolve() != root:
        print(f"From {root}:")
    python = interpreter_in(root)
    print(f"Train it:  {python} train.py task={args.name} strategy=ddp devices=2")
    test = TESTS_DIR / f"test_task_{args.name}.py"
    if test in files:
        run_test = f"{python} -m pytest {test.as_posix()}"
        if importlib.util.find_spec("pytest") is None:
            # The training set-up has no pytest; the dev set-up adds it.
            run_test = f"bash scripts/setup.sh dev && {run_test}"
        print(f"Test it:   {run_test}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
