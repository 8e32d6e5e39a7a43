"""The supported Megatron-Core pins: the parsed ``pins.toml``, where a source pin comes from, how each installs.

The pins live in ``pins.toml`` next to this module (shipped as package data, so an installed
mcore-compat finds it too). This module imports nothing of its package and not torch: ``noxfile.py``
loads it on its own. The ``mcore-compat pin`` commands are in :mod:`mcore_compat.cli`, the installed
pin's status next to the doctor (:mod:`mcore_compat.doctor`).
"""

from __future__ import annotations

import functools
import re
import shlex
import sys
import tomllib
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "MODES",
    "PINS_FILE",
    "SESSION_PREFIX",
    "SHARED_SOURCE_VARIABLE",
    "SUITES",
    "Pin",
    "PinError",
    "PinTable",
    "PythonSeries",
    "SourceUnavailable",
    "check_python",
    "find_checkout",
    "format_list",
    "install_plan",
    "load",
    "parse",
    "resolve_source",
]

PINS_FILE = "pins.toml"
SESSION_PREFIX = "test-mcore-"
SHARED_SOURCE_VARIABLE = "MCORE_SRC"
MODES = ("static", "dynamic")
SUITES = ("full", "smoke")
"""What a pin's nox session runs: the whole suite, or the smoke run (another pin of its generation runs the whole)."""

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
    "suite": str,
}
_REQUIRED_PIN_FIELDS = ("python", "generation", "adapter", "runs")
_PYTHON_FIELDS = {"base": list, "shared": bool}


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
    suite: str = "full"

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
    if raw.get("suite", "full") not in SUITES:
        raise _problem(where, "suite", raw["suite"], f"use one of {SUITES}")
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
        suite=raw.get("suite", "full"),
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


def find_checkout(pin: Pin, environ: Mapping[str, str], head: Callable[[Path], str | None]) -> Path | None:
    """A local checkout at the pin's commit: ``$MCORE_SRC_<PIN>`` (must match), else ``$MCORE_SRC`` if it does.

    ``head`` reads a checkout's commit (:func:`mcore_compat.gitinfo.git_head`).
    """
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
    head: Callable[[Path], str | None],
    reachable: Callable[[str], bool],
) -> Path | None:
    """For a source pin, the local checkout to install, or None to install from its repository.

    ``head`` and ``reachable`` are :mod:`mcore_compat.gitinfo`'s ``git_head`` and ``git_reachable``
    (parameters, so that this module imports nothing of its package). Raises :class:`SourceUnavailable`
    when there is neither. Release pins return None.
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
    pinned commit of the local checkout or of its repository: a snapshot whose install records the commit. A
    ``source`` that is a file is a ``git archive`` tarball of the pinned commit, installed as it is (the install
    records the tarball, which names its commit: :func:`mcore_compat.gitinfo.archive_commit`).
    """
    if pin.package is not None:
        return [[*pin.pip_args, pin.package, *pin.requires]]
    steps = [list(pin.requires)] if pin.requires else []
    if source is not None and source.is_file():
        return [*steps, [*pin.pip_args, str(source)]]
    # file://localhost/...: pip 23's requirement parser rejects the empty host of file:///...
    url = f"file://localhost{urllib.parse.quote(str(source))}" if source is not None else pin.git
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


def format_list(table: PinTable) -> str:
    """``pin list``: every pin, its Python, its generation and how it installs."""
    width = max(map(len, table.pins))
    lines = [f"{'pin':<{width}}  python  gen  installs"]
    lines += [f"{p.name:<{width}}  {p.python:<6}  {p.generation:<3}  {p.how()}" for p in table.pins.values()]
    return "\n".join(lines)
