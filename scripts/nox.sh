#!/usr/bin/env bash
# Run nox from a private tool environment (.nox/.tools), creating it on first use; arguments go to nox.
#
#   scripts/nox.sh -s demo        install a Megatron-Core release and this project, run the demo
#   scripts/nox.sh -t matrix      lint, then every pin session (what CI runs)
#   scripts/nox.sh -l             list the sessions
#
# Needs Python >= 3.11 as $PYTHON or python3; nox finds 3.11/3.12 for the sessions itself (PATH, pyenv).
set -euo pipefail

repo_root="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)"
tools="${repo_root}/.nox/.tools"
python="${PYTHON:-python3}"
nox_requirement="nox>=2025.2.9"

if [[ ! -x "${tools}/bin/nox" ]]; then
    if ! "${python}" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
        echo "scripts/nox.sh: ${python} is not Python >= 3.11; set PYTHON to one (e.g. \$(pyenv prefix 3.11)/bin/python)" >&2
        exit 2
    fi
    rm -rf "${tools}"
    "${python}" -m venv "${tools}"
    "${tools}/bin/python" -m pip install --quiet "${nox_requirement}"
fi
cd "${repo_root}"
exec "${tools}/bin/nox" "$@"
