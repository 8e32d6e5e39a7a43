#!/usr/bin/env bash
# Run nox from a private tool environment (.nox/.tools), made on first use or when the pin below changes;
# arguments go to nox.
#
#   scripts/nox.sh -s demo             install a Megatron-Core release and this project, run the demo
#   scripts/nox.sh -t matrix -j auto   lint and every pin session, concurrently (what CI runs)
#   scripts/nox.sh -l                  list the sessions
#
# Needs Python >= 3.11 as $PYTHON or python3; nox finds 3.11/3.12 for the sessions itself (PATH, pyenv).
set -euo pipefail

repo_root="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)"
tools="${repo_root}/.nox/.tools"
python="${PYTHON:-python3}"
nox_requirement="nox==2026.10.20"

if [[ "$(cat "${tools}/.requirement" 2>/dev/null)" != "${nox_requirement}" ]]; then
    if ! "${python}" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
        echo "scripts/nox.sh: ${python} is not Python >= 3.11; set PYTHON to one (e.g. \$(pyenv prefix 3.11)/bin/python)" >&2
        exit 2
    fi
    rm -rf "${tools}"
    "${python}" -m venv "${tools}"
    "${tools}/bin/python" -m pip install --quiet "${nox_requirement}"
    echo "${nox_requirement}" > "${tools}/.requirement"
fi
cd "${repo_root}"
exec "${tools}/bin/nox" "$@"
