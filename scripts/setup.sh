#!/usr/bin/env bash
# Creates .venv and installs the project (editable) with torch/torchvision.
# Usage: bash scripts/setup.sh        # what training needs
#        bash scripts/setup.sh dev    # plus what the tests need
# A second run reuses what is installed: it reinstalls only when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."

extra="${1:-}"
python="${PYTHON:-$(command -v python3.11 || command -v python3)}"
[ -x .venv/bin/python ] || "$python" -m venv .venv

spec="."
[ -n "$extra" ] && spec=".[$extra]"
stamp=".venv/.setup-stamp-${extra:-base}"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

.venv/bin/python -m pip install --quiet --upgrade pip
# torch/torchvision pinned to the builds this project is tested with.
.venv/bin/python -m pip install --quiet "torch==2.14.1" "torchvision==0.29.1" -e "$spec"
echo "$want" > "$stamp"
