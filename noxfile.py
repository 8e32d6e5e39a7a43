"""nox sessions: ``lint``, a fast ``tests`` run, ``demo`` and one real-install session per Megatron-Core pin.

    nox -l                           list the sessions
    nox                              lint (ruff, mypy) + tests (fast: no Megatron-Core; $MCORE_SRC checkouts if set)
    nox -s test-mcore-core_r0_16     install megatron-core 0.16.1 for real, then this project, then the whole suite
                                     (pins.toml suite = "smoke": the release assertions and one step per scheduler)
    nox -s wheel                     build the wheel, install it with megatron-core 0.16.1, check it from outside
    nox -s test-mcore-history        real steps on every generation's first commit and both tips
    nox -t matrix -j auto            lint, tests, wheel, demo, every pin session and history, concurrently (README, CI)

Where shared/megatron-lm/ lies beside the project (CI's machines), the main and dev sessions install its snapshots
and the history session reads its trees: there a pin or the history that cannot run fails instead of skipping.

The pins, their Python and how each installs live in mcore_compat/pins.toml. Python 3.11/3.12 are found on
PATH, through pyenv (whose interpreters are not on PATH unless selected), or from $PYTHON_3_11 / $PYTHON_3_12.
The 3.12 pins share one environment (.nox/shared-py3.12; only CUDA torch builds exist for 3.12, about 5.5 GB),
one session at a time: delete it to rebuild it from scratch.
"""

from __future__ import annotations

import fcntl
import functools
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from types import ModuleType

import nox

ROOT = Path(__file__).resolve().parent
SNAPSHOTS = ROOT.parent / "shared" / "megatron-lm" / "megatron-core-first-commits.tar.xz"
"""Megatron-LM snapshots beside the project (CI's machines have them): see tests/real_trees.py."""
MATRIX_TAG = "matrix"
DEMO_PIN = "core_r0.16"
RUFF = "ruff==0.17.6"
MYPY = "mypy==2.4.1"

nox.needs_version = ">=2026.10.20"  # parallel sessions (-j, allow_parallel)
nox.options.default_venv_backend = "venv"
nox.options.error_on_missing_interpreters = True
if hasattr(nox.options, "download_python"):
    nox.options.download_python = "never"


def _load(name: str) -> ModuleType:
    """A leaf module of mcore_compat on its own: the package itself may need torch, which nox's environment lacks."""
    spec = importlib.util.spec_from_file_location(f"_mcore_compat_{name}", ROOT / "mcore_compat" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


pins = _load("pins")
gitinfo = _load("gitinfo")
TABLE = pins.load()


def _series_of(python: str) -> str | None:
    try:
        out = subprocess.run(
            [python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _pyenv_python(series: str) -> str | None:
    pyenv = shutil.which("pyenv")
    if pyenv is None:
        return None
    latest = subprocess.run([pyenv, "latest", series], capture_output=True, text=True, check=False)
    if latest.returncode != 0:
        return None
    prefix = subprocess.run([pyenv, "prefix", latest.stdout.strip()], capture_output=True, text=True, check=False)
    return str(Path(prefix.stdout.strip()) / "bin" / f"python{series}") if prefix.returncode == 0 else None


def find_python(series: str) -> str:
    """An absolute path to a working ``python<series>``, or ``series`` itself so that nox reports it missing."""
    override = os.environ.get(f"PYTHON_{series.replace('.', '_')}")
    candidates = [
        override,
        sys.executable if _series_of(sys.executable) == series else None,
        shutil.which(f"python{series}"),
        _pyenv_python(series),
    ]
    for candidate in filter(None, candidates):
        if _series_of(candidate) == series:
            return candidate
    return series


PYTHONS = {series: find_python(series) for series in TABLE.pythons}
PY311 = PYTHONS["3.11"]


def _pip(session: nox.Session, python: Path, *args: str) -> None:
    rest = _torch_first(session, python, args)
    if rest:
        session.run(str(python), "-m", "pip", "install", *rest, external=True)


CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
"""PyTorch's index of CPU builds: a 192 MB download for Linux x86_64, where the package index's default build
downloads about 3 GB of CUDA libraries."""


@functools.cache
def _cpu_index_reachable() -> bool:
    try:
        with urllib.request.urlopen(f"{CPU_TORCH_INDEX}/torch/", timeout=10):
            return True
    except OSError:
        return False


def _torch_first(session: nox.Session, python: Path | None, args: tuple[str, ...]) -> tuple[str, ...]:
    """Install a pinned torch among ``args`` from PyTorch's CPU index where it is reachable (Linux), and return the
    arguments left; elsewhere return them all, for the configured index (which may hold a CPU build itself)."""
    pinned = [arg for arg in args if re.fullmatch(r"torch==[0-9.]+", arg)]
    if not pinned or not sys.platform.startswith("linux"):
        return args
    if not _cpu_index_reachable():
        session.log(f"{CPU_TORCH_INDEX} is not reachable: {pinned[0]} comes from the configured package index")
        return args
    command = ("-m", "pip", "install", "--index-url", CPU_TORCH_INDEX, *pinned)
    if python is None:
        session.install("--index-url", CPU_TORCH_INDEX, *pinned)
    else:
        session.run(str(python), *command, external=True)
    return tuple(arg for arg in args if arg not in pinned)


SMOKE = ("tests/test_release_pin.py", "tests/test_smoke.py")
"""A ``suite = "smoke"`` pin's run: the release-specific assertions and one real step per scheduler and mode."""


def _pytest(
    session: nox.Session, python: Path, env: dict[str, str | None], paths: tuple[str, ...] = ("tests",)
) -> None:
    """The suite (``paths``); pytest's "no tests collected" (exit 5) fails the session like any other failure.

    ``-P`` keeps the current directory off ``sys.path`` and ``--import-mode=append`` puts the checkout's root last
    (for the ``tests`` package), so ``mcore_compat`` and ``packing`` are the installed ones, as a pip user gets them
    (``tests/conftest.py`` checks it in pin sessions).
    """
    bin_dir = str(python.parent)
    env = {
        "PATH": os.pathsep.join((bin_dir, os.environ.get("PATH", ""))),
        "VIRTUAL_ENV": str(python.parent.parent),
    } | env
    command = [str(python), "-P", "-m", "pytest", "--import-mode=append", *paths, *session.posargs]
    session.run(*command, env=env, external=True, success_codes=[0])


@contextmanager
def _exclusive(session: nox.Session, name: str) -> Iterator[None]:
    """An exclusive lock across nox processes: sessions run concurrently under ``nox -j``."""
    with (session.cache_dir.parent.resolve() / f".{name}.lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _shared_environment(session: nox.Session, series: str) -> Path:
    """One environment for all pins of ``series``, created on first use and kept (pip switches the pin in it)."""
    interpreter = PYTHONS[series]
    if not Path(interpreter).is_absolute():
        variable = f"PYTHON_{series.replace('.', '_')}"
        session.error(f"Python {series} not found: install it with pyenv, put python{series} on PATH or set {variable}")
    env_dir = session.cache_dir.parent.resolve() / f"shared-py{series}"
    python = env_dir / "bin" / "python"
    ready = env_dir / ".base-installed"
    if not ready.is_file():
        shutil.rmtree(env_dir, ignore_errors=True)
        session.run(interpreter, "-m", "venv", str(env_dir), external=True)
        _pip(session, python, *TABLE.pythons[series].base)
        ready.write_text("\n".join(TABLE.pythons[series].base) + "\n")
    return python


def _install_pin(session: nox.Session, pin: pins.Pin, project: str = f"{ROOT}[test]") -> tuple[Path, Path | None]:
    """Install ``pin`` and then this project (not editable: the installed package is what users get)."""
    try:
        source = pins.resolve_source(pin, os.environ, head=gitinfo.git_head, reachable=gitinfo.git_reachable)
    except pins.SourceUnavailable as exc:
        source = _snapshot(pin)
        if source is None and SNAPSHOTS.parent.is_dir():  # CI's machines: a pin that cannot install fails the run
            session.error(f"{exc} shared/megatron-lm/ beside the project has no snapshot of it either.")
        if source is None:
            session.skip(str(exc))
    except pins.PinError as exc:
        session.error(str(exc))
    series = TABLE.pythons[pin.python]
    if series.shared:
        python = _shared_environment(session, pin.python)
    else:
        python = Path(session.bin) / "python"
        _pip(session, python, *series.base)
    for args in pins.install_plan(pin, source):
        _pip(session, python, *args)
    with _exclusive(session, "project-build"):  # pip builds this checkout in place (build/, *.egg-info)
        _pip(session, python, project)
    return python, source


def _snapshot(pin: pins.Pin) -> Path | None:
    """The ``git archive`` tarball of a source pin's commit in shared/megatron-lm/ beside the project, if there."""
    tarball = SNAPSHOTS.parent / f"megatron-lm-{pin.commit}.tar.gz"
    return tarball if pin.commit and gitinfo.archive_commit(tarball) == pin.commit else None


def _extracted(session: nox.Session, tarball: Path) -> Path:
    """``tarball`` (a ``git archive`` of Megatron-LM) extracted once under nox's cache: the tree tests read as
    ``$MCORE_SRC``, as they read a checkout."""
    root = session.cache_dir.resolve() / "snapshots" / tarball.name.removesuffix(".tar.gz")
    tree = root / root.name
    if not (tree / "megatron" / "core" / "__init__.py").is_file():
        shutil.rmtree(root, ignore_errors=True)
        with tarfile.open(tarball) as archive:
            archive.extractall(root, filter="data")
    return tree


def _pin_session(pin: pins.Pin) -> None:
    shared = TABLE.pythons[pin.python].shared

    def run(session: nox.Session) -> None:
        with _exclusive(session, f"shared-py{pin.python}") if shared else nullcontext():
            extras = "test,plot" if pin.name == DEMO_PIN else "test"  # one session draws the plan's --plot
            python, source = _install_pin(session, pin, f"{ROOT}[{extras}]")
            checkout = source if source is None or source.is_dir() else _extracted(session, source)
            env = {"MCORE_COMPAT_EXPECT_PIN": pin.name, "MCORE_SRC": str(checkout) if checkout else None}
            _pytest(session, python, env, ("tests",) if pin.suite == "full" else SMOKE)

    suite = "the whole suite" if pin.suite == "full" else "the smoke run (noxfile.SMOKE)"
    run.__doc__ = f"{pin.name} (Python {pin.python}): {pin.how()}; then {suite}"
    nox.session(
        run,
        name=pin.session,
        python=None if shared else PYTHONS[pin.python],
        venv_backend="none" if shared else None,
        tags=[MATRIX_TAG],
        default=False,
        allow_parallel=True,
    )


@nox.session(python=PY311, tags=[MATRIX_TAG], allow_parallel=True, reuse_venv=True)
def lint(session: nox.Session) -> None:
    """ruff check, ruff format --check, and mypy over mcore_compat and packing (pyproject.toml [tool.mypy])."""
    project = nox.project.load_toml(ROOT / "pyproject.toml")["project"]
    typed = [req for req in project["dependencies"] if not req.startswith(("megatron-core", "torch"))]
    session.install(RUFF, MYPY, *TABLE.pythons["3.11"].base, *typed)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy")


def _lowest(requirement: str) -> str:
    """``name>=X`` as ``name==X``: the lower bound itself, so that the suite proves it."""
    return re.sub(r">=", "==", requirement) if re.fullmatch(r"[A-Za-z0-9._-]+>=[0-9.]+", requirement) else requirement


@nox.session(python=PY311, reuse_venv=True, tags=[MATRIX_TAG], allow_parallel=True)
def tests(session: nox.Session) -> None:
    """Fast: the suite without Megatron-Core installed, on the lower bounds of this project's dependencies.

    Tests that need Megatron-LM source use the checkout named by $MCORE_SRC.
    """
    _install_lower_bounds(session)
    _pytest(session, Path(session.bin) / "python", {})


@nox.session(name="test-mcore-history", python=PY311, tags=[MATRIX_TAG], allow_parallel=True, default=False)
def history(session: nox.Session) -> None:
    """Real 4-rank steps on the first commit of every generation and both tips: the probe against a real step, and
    padding ids against zero padding (the tests marked ``history``).

    Trees come from shared/megatron-lm/ beside the project, else $MCORE_REPO (which adds every commit that touched
    the scheduler, and detection on each first commit's parent: tests/test_real_commits.py); they are extracted once
    into $MCORE_TREES. Without either the session skips with the command that gets a clone; with shared/megatron-lm/
    but without its archive of first commits it fails.
    """
    if SNAPSHOTS.parent.is_dir() and not SNAPSHOTS.is_file():
        session.error(f"shared/megatron-lm/ is beside the project but has no {SNAPSHOTS.name}")
    if not SNAPSHOTS.is_file() and not os.environ.get("MCORE_REPO"):
        session.skip(
            "no shared/megatron-lm/ beside the project and MCORE_REPO is unset: `git clone --filter=blob:none "
            "https://github.com/NVIDIA/Megatron-LM.git <dir>` and set MCORE_REPO=<dir>"
        )
    _install_lower_bounds(session)
    tests = [str(ROOT / "tests" / name) for name in ("test_history.py", "test_padding_steps.py")]
    if os.environ.get("MCORE_REPO"):
        tests.append(str(ROOT / "tests" / "test_real_commits.py"))
    session.run("python", "-m", "pytest", "-m", "history", *tests, *session.posargs, env={"OMP_NUM_THREADS": "1"})


def _install_lower_bounds(session: nox.Session) -> None:
    """This project (editable) on the lower bounds of its dependencies, with what source pins need, no megatron-core."""
    project = nox.project.load_toml(ROOT / "pyproject.toml")["project"]
    source_needs = [req for pin in TABLE.pins.values() if pin.git for req in pin.requires]
    needs = [
        *TABLE.pythons["3.11"].base,
        *map(_lowest, project["dependencies"]),
        *source_needs,
        *project["optional-dependencies"]["test"],
    ]
    first_by_name: dict[str, str] = {}
    for req in needs:
        first_by_name.setdefault(re.match(r"[A-Za-z0-9._-]+", req)[0].lower(), req)
    first_by_name.pop("megatron-core", None)
    rest = _torch_first(session, None, tuple(first_by_name.values()))
    if rest:
        session.install(*rest)
    session.install("--no-deps", "-e", str(ROOT))


@nox.session(python=PY311, tags=[MATRIX_TAG], allow_parallel=True, default=False)
def demo(session: nox.Session) -> None:
    """Install a Megatron-Core pin ($MCORE_PIN, default core_r0.16) and this project; doctor + a CPU packing step."""
    pin = TABLE.get(os.environ.get("MCORE_PIN", DEMO_PIN))
    if pin.python != "3.11":
        session.error(f"MCORE_PIN={pin.name!r} needs Python {pin.python}; the demo runs on 3.11: pick a 3.11 pin")
    _install_pin(session, pin, project=str(ROOT))
    session.run("mcore-compat", "demo")


@nox.session(python=PY311, tags=[MATRIX_TAG], allow_parallel=True, default=False)
def wheel(session: nox.Session) -> None:
    """Build the wheel, install it with a release ($MCORE_PIN, default core_r0.16), check it as a pip user meets it.

    tests/test_installed_wheel.py runs every command from outside the checkout, without PYTHONPATH.
    """
    pin = TABLE.get(os.environ.get("MCORE_PIN", DEMO_PIN))
    if pin.package is None or pin.python != "3.11":
        session.error(f"MCORE_PIN={pin.name!r}: the wheel check needs a Python 3.11 release pin")
    dist = Path(session.create_tmp()).resolve() / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    with _exclusive(session, "project-build"):
        session.run("python", "-m", "pip", "wheel", "--no-deps", "-w", str(dist), str(ROOT))
    (built,) = dist.glob("mcore_compat-*.whl")
    python = Path(session.bin) / "python"
    _pip(session, python, *TABLE.pythons[pin.python].base, *pins.install_plan(pin)[0], str(built), "pytest")
    env = {"MCORE_COMPAT_WHEEL_PYTHON": str(python), "PYTHONPATH": str(ROOT)}
    session.run(
        str(python),
        "-m",
        "pytest",
        str(ROOT / "tests" / "test_installed_wheel.py"),
        *session.posargs,
        env=env,
        external=True,
        success_codes=[0],
    )


for _pin in TABLE.pins.values():
    _pin_session(_pin)
