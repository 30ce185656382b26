"""Composing and checking a run's config, before any worker process starts: types and ranges
(schema), every value that depends on the machine (checks), the real objects built once and
dropped (build_check), the command line's plugins and keys (plugins), the resolvers of
conf/, checkpoints given as `ckpt_path` (checkpoint_check) and the folder `resume=true`
continues (resume_folder)."""

from pathlib import Path
from typing import Any

# The config tree, conf/ at the project's root.
CONFIG_DIR = str(Path(__file__).resolve().parents[3] / "conf")


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
