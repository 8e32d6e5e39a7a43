"""The supported Megatron-Core pins and ``mcore-compat pin list | status | <pin>``.

The pins live in ``pins.toml`` next to this module (shipped as package data, so an installed
mcore-compat finds it too). Every command runs pip with an argument list, never through a shell.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
import shlex
import subprocess
import sys
import tomllib
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mcore_compat.capabilities import Capabilities

PINS_FILE = "pins.toml"
SESSION_PREFIX = "test-mcore-"
SHARED_SOURCE_VARIABLE = "MCORE_SRC"
MODES = ("static", "dynamic")

_RELEASE = re.compile(r"^megatron-core==(?P<version>\d+(\.\d+)*)$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_PIN_FIELDS = {
    "python": str,
    "requires_python": str,
    "package": str,
    "git": str,
    "commit": str,
    "requires": list,
    "pip_args": list,
    "generation": str,
    "adapter": str,
    "runs": list,
}
_REQUIRED_PIN_FIELDS = ("python", "generation", "adapter", "runs")
_PYTHON_FIELDS = {"base": list, "shared": bool}

Runner = Callable[..., subprocess.CompletedProcess[Any]]


class PinError(ValueError):
    """A pin name, the pins file or a pin's source is unusable; the message says how to fix it."""


class SourceUnavailable(PinError):
    """A source pin has neither a local checkout at its commit nor a reachable repository."""


@dataclass(frozen=True)
class Pin:
    """One supported Megatron-Core: how it installs and what mcore-compat must make of it."""

    name: str
    python: str
    generation: str
    adapter: str
    runs: tuple[str, ...]
    package: str | None = None
    git: str | None = None
    commit: str | None = None
    requires_python: str | None = None
    requires: tuple[str, ...] = ()
    pip_args: tuple[str, ...] = ()

    @property
    def version(self) -> str | None:
        """The release version (``megatron-core==X``), None for source pins."""
        found = _RELEASE.match(self.package or "")
        return found["version"] if found else None

    @property
    def session(self) -> str:
        """The nox session that tests this pin (``test-mcore-core_r0_16``)."""
        return SESSION_PREFIX + self.name.replace(".", "_")

    @property
    def source_variable(self) -> str:
        """Environment variable naming a local checkout for this pin (``MCORE_SRC_MAIN``)."""
        return f"{SHARED_SOURCE_VARIABLE}_{re.sub(r'[^0-9A-Za-z]', '_', self.name).upper()}"

    def how(self) -> str:
        """One line: how this pin installs."""
        if self.package:
            return f"pip install {self.package}"
        return (
            f"git {self.git}@{self.commit} (not on the package index), "
            f"or a checkout at that commit in ${self.source_variable} or ${SHARED_SOURCE_VARIABLE}"
        )


@dataclass(frozen=True)
class PythonSeries:
    """How test environments of one Python series are prepared."""

    name: str
    base: tuple[str, ...]
    shared: bool


@dataclass(frozen=True)
class PinTable:
    """The parsed pins file."""

    pins: dict[str, Pin]
    pythons: dict[str, PythonSeries] = field(default_factory=dict)

    def names(self) -> str:
        return ", ".join(self.pins)

    def get(self, name: str) -> Pin:
        """The pin called ``name``; unknown names are refused with the list of valid ones."""
        if name in self.pins:
            return self.pins[name]
        hint = ""
        for pin in self.pins.values():
            if name in (pin.session, pin.session.removeprefix(SESSION_PREFIX)):
                hint = f" (did you mean {pin.name!r}?)"
        raise PinError(f"unknown pin {name!r}{hint}; valid pins: {self.names()}")

    def match(self, version: str | None, commit: str | None) -> Pin | None:
        """The pin an installed Megatron-Core is: by commit for source installs, by version for releases."""
        if commit:
            return next((p for p in self.pins.values() if p.commit and p.commit == commit.lower()), None)
        if version:
            return next((p for p in self.pins.values() if p.version and p.version == version), None)
        return None


def _problem(where: str, key: str, value: object, problem: str) -> PinError:
    return PinError(f"{PINS_FILE} {where} {key}={value!r}: {problem}")


def _check_fields(where: str, table: Mapping[str, Any], allowed: Mapping[str, type]) -> None:
    for key, value in table.items():
        if key not in allowed:
            raise _problem(where, key, value, f"unknown field; use one of {', '.join(allowed)}")
        if not isinstance(value, allowed[key]):
            raise _problem(where, key, value, f"must be a {allowed[key].__name__}")
        if isinstance(value, list) and not all(isinstance(item, str) for item in value):
            raise _problem(where, key, value, "must be a list of strings")


def _parse_pin(name: str, raw: Mapping[str, Any], pythons: Mapping[str, PythonSeries]) -> Pin:
    where = f"[pins.{name!r}]"
    _check_fields(where, raw, _PIN_FIELDS)
    for key in _REQUIRED_PIN_FIELDS:
        if key not in raw:
            raise PinError(f"{PINS_FILE} {where} has no {key}; add it (see the comment at the top of the file)")
    if raw["python"] not in pythons:
        raise _problem(
            where, "python", raw["python"], f"add a [python.{raw['python']!r}] table or use one of {list(pythons)}"
        )
    package, git, commit = raw.get("package"), raw.get("git"), raw.get("commit")
    if (package is None) == (git is None) or (git is None) != (commit is None):
        raise PinError(f"{PINS_FILE} {where}: give either package, or git and commit")
    if package is not None and not _RELEASE.match(package):
        raise _problem(where, "package", package, "write an exact release, e.g. 'megatron-core==0.16.1'")
    if commit is not None and not _COMMIT.match(commit):
        raise _problem(where, "commit", commit, "write the full 40-character lower-case commit hash")
    for run in raw["runs"]:
        scheduler, _, mode = run.partition(":")
        if not scheduler or mode not in MODES:
            raise _problem(where, "runs", run, f"write 'scheduler:mode' with mode one of {MODES}")
    return Pin(
        name=name,
        python=raw["python"],
        generation=raw["generation"],
        adapter=raw["adapter"],
        runs=tuple(raw["runs"]),
        package=package,
        git=git,
        commit=commit,
        requires_python=raw.get("requires_python"),
        requires=tuple(raw.get("requires", ())),
        pip_args=tuple(raw.get("pip_args", ())),
    )


def parse(text: str) -> PinTable:
    """Parse and validate the text of a pins file."""
    data = tomllib.loads(text)
    for key in data:
        if key not in ("python", "pins"):
            raise PinError(f"{PINS_FILE}: unknown table [{key}]; use [python.<series>] and [pins.<name>]")
    pythons: dict[str, PythonSeries] = {}
    for series, raw in data.get("python", {}).items():
        _check_fields(f"[python.{series!r}]", raw, _PYTHON_FIELDS)
        pythons[series] = PythonSeries(series, tuple(raw.get("base", ())), bool(raw.get("shared", False)))
    pins = {name: _parse_pin(name, raw, pythons) for name, raw in data.get("pins", {}).items()}
    if not pins:
        raise PinError(f"{PINS_FILE} names no pins; add a [pins.<name>] table")
    return PinTable(pins, pythons)


@functools.cache
def load() -> PinTable:
    """The pins file shipped next to this module (noxfile.py loads this module without its package)."""
    return parse(Path(__file__).with_name(PINS_FILE).read_text(encoding="utf-8"))


# -- where a source pin comes from --------------------------------------------------------------


def git_head(path: Path) -> str | None:
    """The commit checked out at ``path`` when ``path`` is the root of a git checkout, else None."""
    try:
        out = subprocess.run(
            ["git", "-C", str(path), "rev-parse", "--show-toplevel", "HEAD"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.split()
    if out.returncode != 0 or len(lines) != 2 or Path(lines[0]).resolve() != path.resolve():
        return None
    return lines[1]


def git_reachable(url: str, timeout: float = 30.0) -> bool:
    """Whether ``git ls-remote`` reaches ``url`` within ``timeout`` seconds."""
    try:
        out = subprocess.run(
            ["git", "ls-remote", "--exit-code", url, "HEAD"],
            capture_output=True,
            timeout=timeout,
            check=False,
            env={**os.environ, "GIT_TERMINAL_PROMPT": "0"},
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0


def find_checkout(pin: Pin, environ: Mapping[str, str], head: Callable[[Path], str | None] = git_head) -> Path | None:
    """A local checkout at the pin's commit: ``$MCORE_SRC_<PIN>`` (must match), else ``$MCORE_SRC`` if it does."""
    explicit = environ.get(pin.source_variable)
    if explicit:
        path = Path(explicit).resolve()
        commit = head(path)
        if commit != pin.commit:
            found = "not the root of a git checkout" if commit is None else f"at commit {commit}"
            raise PinError(
                f"{pin.source_variable}={explicit!r} is {found}, but pin {pin.name!r} is commit {pin.commit}; "
                f"run `git -C {shlex.quote(explicit)} checkout {pin.commit}` or unset {pin.source_variable}"
            )
        return path
    shared = environ.get(SHARED_SOURCE_VARIABLE)
    if shared and head(Path(shared)) == pin.commit:
        return Path(shared).resolve()
    return None


def resolve_source(
    pin: Pin,
    environ: Mapping[str, str],
    head: Callable[[Path], str | None] = git_head,
    reachable: Callable[[str], bool] = git_reachable,
) -> Path | None:
    """For a source pin, the local checkout to install, or None to install from its repository.

    Raises :class:`SourceUnavailable` when there is neither. Release pins return None.
    """
    if pin.package is not None:
        return None
    checkout = find_checkout(pin, environ, head)
    if checkout is not None or reachable(str(pin.git)):
        return checkout
    shared = environ.get(SHARED_SOURCE_VARIABLE)
    elsewhere = f" (${SHARED_SOURCE_VARIABLE}={shared!r} is at {head(Path(shared)) or 'no commit'})" if shared else ""
    raise SourceUnavailable(
        f"pin {pin.name!r} is Megatron-LM commit {pin.commit}, which is not on the package index, and "
        f"{pin.git} is not reachable{elsewhere}. Provide a checkout: `git clone {pin.git} mlm && "
        f"git -C mlm checkout {pin.commit}`, then set {pin.source_variable}=$PWD/mlm (or {SHARED_SOURCE_VARIABLE})."
    )


def install_plan(pin: Pin, source: Path | None = None) -> list[list[str]]:
    """The ``pip install`` argument lists that install ``pin``, in order.

    A release resolves together with its requirements; a source pin installs its requirements first, then
    itself with ``pip_args`` (which keep pip from resolving its dependencies on the wrong Python), from the
    pinned commit of the local checkout or of its repository: a snapshot whose install records the commit.
    """
    if pin.package is not None:
        return [[*pin.pip_args, pin.package, *pin.requires]]
    # file://localhost/...: pip 23's requirement parser rejects the empty host of file:///...
    url = f"file://localhost{urllib.parse.quote(str(source))}" if source is not None else pin.git
    steps = [list(pin.requires)] if pin.requires else []
    return [*steps, [*pin.pip_args, f"megatron-core @ git+{url}@{pin.commit}"]]


def check_python(pin: Pin, version: Sequence[int] = sys.version_info[:3]) -> None:
    """Refuse a pin whose wheels cannot install on this interpreter."""
    if pin.requires_python is None:
        return
    from packaging.specifiers import SpecifierSet

    running = ".".join(map(str, version[:3]))
    if running not in SpecifierSet(pin.requires_python):
        raise PinError(
            f"pin {pin.name!r} needs Python {pin.requires_python} (its wheels are built for it only); "
            f"this environment runs Python {running} ({sys.executable}). Make a Python {pin.python} environment "
            f"(e.g. `$(pyenv prefix {pin.python})/bin/python -m venv .venv312 && . .venv312/bin/activate`) and retry."
        )


# -- the commands -------------------------------------------------------------------------------


def format_list(table: PinTable) -> str:
    """``pin list``: every pin, its Python, its generation and how it installs."""
    width = max(map(len, table.pins))
    lines = [f"{'pin':<{width}}  python  gen  installs"]
    lines += [f"{p.name:<{width}}  {p.python:<6}  {p.generation:<3}  {p.how()}" for p in table.pins.values()]
    return "\n".join(lines)


def installed_version(caps: Capabilities) -> str | None:
    """The version of the imported Megatron-Core: its distribution's metadata when that distribution is what
    was imported (or when ``megatron.core`` failed to import), else what the module reports (a source tree).
    """
    try:
        dist = importlib.metadata.distribution("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return caps.mcore_version
    if caps.mcore_path is None:
        return dist.version
    located = Path(str(dist.locate_file("megatron/core"))).resolve()
    return dist.version if located == Path(caps.mcore_path).resolve() else caps.mcore_version


def match_installed(caps: Capabilities, table: PinTable) -> Pin | None:
    """The pin the imported Megatron-Core is, or None."""
    return table.match(installed_version(caps), caps.mcore_commit)


def status_report(caps: Capabilities, table: PinTable, version: str | None) -> dict[str, str | None]:
    """What is installed (``version``: see :func:`installed_version`) and which pin: a name, ``custom`` or ``none``."""
    installed = version is not None or caps.mcore_path is not None
    pin = table.match(version, caps.mcore_commit)
    shown = version or ("installed, version unknown" if installed else "not installed")
    if caps.mcore_version and caps.mcore_version != version:
        shown += f" (reports {caps.mcore_version})"
    return {
        "python": f"{sys.executable} ({'.'.join(map(str, sys.version_info[:3]))})",
        "megatron-core": shown,
        "commit": caps.mcore_commit,
        "path": caps.mcore_path,
        "pin": pin.name if pin else ("custom" if installed else "none"),
        "generation": caps.generation,
        "problem": caps.import_error,
    }


def format_status(report: Mapping[str, str | None]) -> str:
    width = max(map(len, report))
    return "\n".join(f"{key:<{width}}  {'-' if value is None else value}" for key, value in report.items())


def switch(
    name: str,
    table: PinTable,
    environ: Mapping[str, str] = os.environ,
    run: Runner = subprocess.run,
    python: str = sys.executable,
    resolve: Callable[[Pin, Mapping[str, str]], Path | None] = resolve_source,
) -> int:
    """``pin <name>``: install the pin into this environment with pip, then print the doctor table."""
    pin = table.get(name)
    check_python(pin)
    source = resolve(pin, environ)
    for args in install_plan(pin, source):
        command = [python, "-m", "pip", "install", *args]
        print("+", shlex.join(command), flush=True)
        if (code := run(command, check=False).returncode) != 0:
            print(f"pip failed (exit status {code}) installing pin {pin.name!r}", file=sys.stderr)
            return code
    package_root = str(Path(__file__).resolve().parent.parent)
    env = {**environ, "PYTHONPATH": os.pathsep.join(filter(None, (package_root, environ.get("PYTHONPATH"))))}
    doctor = run([python, "-m", "mcore_compat", "doctor"], check=False, env=env).returncode
    return 0 if doctor in (0, 1) else doctor


def main(action: str) -> int:
    """Entry point of ``mcore-compat pin``; errors print one line and exit with status 2."""
    try:
        table = load()
        if action == "list":
            print(format_list(table))
            return 0
        if action == "status":
            from mcore_compat.capabilities import detect

            caps = detect()
            print(format_status(status_report(caps, table, installed_version(caps))))
            return 0
        return switch(action, table)
    except PinError as exc:
        print(f"mcore-compat pin: {exc}", file=sys.stderr)
        return 2


__all__ = [
    "MODES",
    "PINS_FILE",
    "Pin",
    "PinError",
    "PinTable",
    "PythonSeries",
    "Runner",
    "SESSION_PREFIX",
    "SHARED_SOURCE_VARIABLE",
    "SourceUnavailable",
    "check_python",
    "find_checkout",
    "format_list",
    "format_status",
    "git_head",
    "git_reachable",
    "install_plan",
    "installed_version",
    "load",
    "main",
    "match_installed",
    "parse",
    "resolve_source",
    "status_report",
    "switch",
]
