"""Composing and checking a run's config, before any worker process starts: types and ranges
(schema), every value that depends on the machine (checks), the real objects built once and
dropped (build_check), the command line's plugins and keys (plugins), the resolvers of
conf/, checkpoints given as `ckpt_path` (checkpoint_check) and the folder `resume=true`
continues (resume_folder)."""

from pathlib import Path

# The config tree, conf/ at the project's root.
CONFIG_DIR = str(Path(__file__).resolve().parents[3] / "conf")
