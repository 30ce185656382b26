"""The project's own places and forms, read by every stage (a leaf: it imports nothing of
the project): where conf/ is, the names of a job's checkpoints, the interpreter as a user
types it, and a config as `dotted.key: value` pairs (the checks, the nodes' agreement,
resume=true's folder check)."""

import sys
from pathlib import Path
from typing import Any

# A job's newest checkpoint, in <job>/checkpoints/ (one file, or a folder of shards).
LAST = "last.ckpt"


def previous_of(path: Path) -> Path:
    """`last.ckpt` -> `last.prev.ckpt`: the previous complete version, kept beside it."""
    return path.with_name(f"{path.stem}.prev{path.suffix}")


# The config tree, conf/ at the project's root.
CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "conf")


def dotted(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A plain config tree (`OmegaConf.to_container`) as `dotted.key: value`, the form in
    which two configs are compared key by key. An empty mapping stays a value, so that `{}`
    and a missing key differ."""
    if isinstance(tree, dict):
        flat: dict[str, Any] = {}
        for key, value in tree.items():
            flat.update(dotted(value, f"{prefix}{key}."))
        return flat or {prefix.rstrip("."): {}}
    return {prefix.rstrip("."): tree}


def interpreter_in(folder: Path) -> str:
    """The running interpreter as typed in `folder`: `.venv/bin/python` for the project's
    own environment (a bare `python` may be another one, without the project), else its
    full path."""
    try:
        return Path(sys.executable).relative_to(folder).as_posix()
    except ValueError:
        return sys.executable
