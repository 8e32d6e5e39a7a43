#!/usr/bin/env bash
# Switch the Megatron-Core of the current Python environment between the supported pins.
#
#   scripts/switch_mcore.sh list          the pins (mcore_compat/pins.toml) and how each installs
#   scripts/switch_mcore.sh status        installed version/commit, the pin it matches (or "custom"), generation
#   scripts/switch_mcore.sh <pin>         pip-install that pin here, then print `mcore-compat doctor`
#
# The interpreter is $PYTHON, else `python` (an activated virtual environment), else `python3`.
# Source pins (main, dev) install from a checkout named by MCORE_SRC_MAIN / MCORE_SRC_DEV (or MCORE_SRC) at the
# pinned commit, else from GitHub. This script only forwards its arguments, quoted, to `mcore-compat pin`.
set -euo pipefail

repo_root="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-$(command -v python || command -v python3)}"

if [[ $# -ne 1 ]]; then
    echo "usage: $0 list | status | <pin>" >&2
    exit 2
fi
export PYTHONPATH="${repo_root}${PYTHONPATH:+:${PYTHONPATH}}"
exec "${python}" -m mcore_compat pin "$1"
