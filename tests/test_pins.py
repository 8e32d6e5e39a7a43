"""The pins file, ``mcore-compat pin`` and ``scripts/switch_mcore.sh``, tested without installing anything."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import subprocess
import sys
import urllib.parse
from pathlib import Path

import pytest

from mcore_compat import ADAPTERS, GENERATIONS, cli, doctor, gitinfo, pins
from mcore_compat.capabilities import Capabilities, _unavailable

ROOT = Path(__file__).resolve().parent.parent
SWITCH = ROOT / "scripts" / "switch_mcore.sh"
README = ROOT / "README.md"
TABLE = pins.load()
RELEASES = [p for p in TABLE.pins.values() if p.package]
SOURCES = [p for p in TABLE.pins.values() if p.git]
MAIN = TABLE.get("main")
HOSTILE_PATH = "/srv/mlm checkout; touch pwned $(touch pwned2)"

VALID_PIN = """
[python."3.11"]
base = []

[pins.good]
python = "3.11"
package = "megatron-core==0.16.1"
generation = "G1"
adapter = "UnsupportedAdapter"
runs = []
"""


def _with(replace: str, by: str) -> str:
    assert replace in VALID_PIN
    return VALID_PIN.replace(replace, by)


# -- the shipped pins file -----------------------------------------------------------------------


@pytest.mark.parametrize("pin", TABLE.pins.values(), ids=list(TABLE.pins))
def test_shipped_pin_agrees_with_the_generation_table_and_adapters(pin: pins.Pin) -> None:
    assert pin.generation in GENERATIONS
    adapters = {cls.__name__: cls for cls in ADAPTERS}
    assert pin.adapter in adapters, f"{pin.name}: adapter {pin.adapter!r} is not one of {list(adapters)}"
    assert GENERATIONS[pin.generation].adapter == pin.adapter
    if pin.git:
        assert GENERATIONS[pin.generation].lineage == pin.name


def test_every_generation_a_pin_has_runs_the_whole_suite_on_one() -> None:
    full = {pin.generation for pin in TABLE.pins.values() if pin.suite == "full"}
    assert full == {pin.generation for pin in TABLE.pins.values()}


@pytest.mark.parametrize("pin", TABLE.pins.values(), ids=list(TABLE.pins))
def test_every_pin_has_a_nox_session_name_users_can_type(pin: pins.Pin) -> None:
    assert pin.session.startswith("test-mcore-")
    assert "." not in pin.session


def test_pins_file_ships_inside_the_package() -> None:
    from importlib import resources

    assert resources.files("mcore_compat").joinpath(pins.PINS_FILE).is_file()
    assert pins.load().pins == TABLE.pins


# -- parsing -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (_with('python = "3.11"\npackage', 'pyhton = "3.11"\npackage'), "pyhton='3.11': unknown field"),
        (_with('generation = "G1"\n', ""), "has no generation"),
        (_with('python = "3.11"\npackage', 'python = "3.10"\npackage'), """python='3.10': add a [python.'3.10']"""),
        (_with('package = "megatron-core==0.16.1"', 'package = "megatron-core>=0.16"'), "exact release"),
        (_with('package = "megatron-core==0.16.1"', 'git = "https://x"\ncommit = "abc"'), "full 40-character"),
        (_with('package = "megatron-core==0.16.1"', 'git = "https://x"'), "either package, or git and commit"),
        (_with("runs = []", 'runs = ["dp_balanced"]'), "'scheduler:mode'"),
        (_with("runs = []", 'runs = ["dp_balanced:fast"]'), "'scheduler:mode'"),
        (_with("runs = []", "runs = []\nrequires = [1]"), "list of strings"),
        (_with("runs = []", 'runs = "dp_balanced:static"'), "must be a list"),
        (_with("runs = []", 'runs = []\nsuite = "quick"'), "suite='quick': use one of ('full', 'smoke')"),
        (_with("base = []", 'base = []\nshared = "yes"'), "shared='yes': must be a bool"),
        (VALID_PIN + "\n[extra]\nx = 1\n", "unknown table [extra]"),
        ('[python."3.11"]\nbase = []\n', "names no pins"),
    ],
)
def test_parse_rejects_a_bad_pins_file_naming_field_and_value(text: str, message: str) -> None:
    with pytest.raises(pins.PinError) as excinfo:
        pins.parse(text)
    assert message in str(excinfo.value)


def test_parse_reads_a_valid_pin() -> None:
    pin = pins.parse(VALID_PIN).get("good")
    assert (pin.version, pin.session, pin.requires, pin.pip_args) == ("0.16.1", "test-mcore-good", (), ())


# -- names ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "hint"),
    [
        ("core_r0.20", None),
        ("", None),
        ("MAIN", None),
        ("main; rm -rf ~", None),
        ("$(touch pwned)", None),
        ("core_r0_16", "core_r0.16"),
        ("test-mcore-core_r0_19", "core_r0.19"),
    ],
)
def test_unknown_pins_are_refused_with_the_valid_ones(name: str, hint: str | None) -> None:
    with pytest.raises(pins.PinError) as excinfo:
        TABLE.get(name)
    message = str(excinfo.value)
    assert f"unknown pin {name!r}" in message
    assert all(valid in message for valid in TABLE.pins)
    assert (f"did you mean {hint!r}" in message) == (hint is not None)


# -- matching an installed Megatron-Core to a pin ------------------------------------------------


@pytest.mark.parametrize("pin", RELEASES, ids=[p.name for p in RELEASES])
def test_a_release_matches_by_version(pin: pins.Pin) -> None:
    assert TABLE.match(pin.version, None) == pin


@pytest.mark.parametrize("pin", SOURCES, ids=[p.name for p in SOURCES])
def test_a_source_install_matches_by_commit_whatever_its_version(pin: pins.Pin) -> None:
    assert TABLE.match("0.20.0", pin.commit) == pin
    assert TABLE.match(None, str(pin.commit).upper()) == pin


@pytest.mark.parametrize(
    ("version", "commit"),
    [
        ("0.19.0", None),  # dev reports 0.19.0: a version alone never makes a source pin
        ("0.16.0", None),
        (RELEASES[0].version, "0" * 40),  # a release version built from some other commit is custom
        (None, "0" * 40),
        (None, None),
    ],
)
def test_anything_else_matches_no_pin(version: str | None, commit: str | None) -> None:
    assert TABLE.match(version, commit) is None


def _caps(**fields: object) -> Capabilities:
    return dataclasses.replace(_unavailable("megatron-core is not installed"), **fields)


IMPORTED = _caps(mcore_version="0.16.1", generation="G1", import_error=None, mcore_path="/site/megatron/core")


@pytest.mark.parametrize(
    ("caps", "version", "expected_pin"),
    [
        (IMPORTED, "0.16.1", "core_r0.16"),
        (_caps(mcore_version="0.20.0", mcore_commit=MAIN.commit, mcore_path="/m/megatron/core"), "0.20.0", "main"),
        (_caps(mcore_version="0.20.0", mcore_commit="1" * 40, mcore_path="/m/megatron/core"), "0.20.0", "custom"),
        (_caps(mcore_version="0.12.0", mcore_path="/site/megatron/core"), "0.12.0", "custom"),
        (_unavailable("ModuleNotFoundError: No module named 'triton'"), "0.18.2", "core_r0.18"),
        (_unavailable("megatron-core is not installed"), None, "none"),
    ],
)
def test_status_reports_the_matching_pin_or_custom(caps: Capabilities, version: str | None, expected_pin: str) -> None:
    report = doctor.status_report(caps, TABLE, version)
    assert report["pin"] == expected_pin
    assert report["generation"] == caps.generation
    assert report["problem"] == caps.import_error
    assert doctor.format_status(report).count("\n") == len(report) - 1


class FakeDistribution:
    def __init__(self, version: str, root: str) -> None:
        self.version, self.root = version, root

    def locate_file(self, path: str) -> Path:
        return Path(self.root) / path


@pytest.mark.parametrize(
    ("dist", "caps", "expected"),
    [
        # 0.19 wheels append the commit of a git repository they sit in; the metadata is the truth
        (
            FakeDistribution("0.19.2", "/site"),
            _caps(mcore_version="0.19.2+d3fad36", mcore_path="/site/megatron/core"),
            "0.19.2",
        ),
        # a source tree on PYTHONPATH shadows the installed wheel: trust what was imported
        (FakeDistribution("0.16.1", "/site"), _caps(mcore_version="0.19.0", mcore_path="/src/megatron/core"), "0.19.0"),
        # installed but megatron.core failed to import: the metadata is all there is
        (FakeDistribution("0.18.2", "/site"), _unavailable("ModuleNotFoundError: No module named 'triton'"), "0.18.2"),
        (None, _caps(mcore_version="0.20.0", mcore_path="/m/megatron/core"), "0.20.0"),
    ],
)
def test_installed_version_prefers_the_imported_distributions_metadata(
    dist: FakeDistribution | None, caps: Capabilities, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def distribution(name: str) -> FakeDistribution:
        assert name == "megatron-core"
        if dist is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return dist

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    assert doctor.installed_version(caps) == expected


# -- where a source pin comes from ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "heads", "reachable", "expected"),
    [
        ({"MCORE_SRC_MAIN": "/m"}, {"/m": MAIN.commit}, False, Path("/m")),
        ({"MCORE_SRC": "/m"}, {"/m": MAIN.commit}, False, Path("/m")),
        ({"MCORE_SRC_MAIN": "/a", "MCORE_SRC": "/b"}, {"/a": MAIN.commit, "/b": MAIN.commit}, False, Path("/a")),
        ({"MCORE_SRC": "/d"}, {"/d": "2" * 40}, True, None),  # elsewhere: install from the repository
        ({}, {}, True, None),
    ],
)
def test_resolve_source_prefers_a_checkout_at_the_pinned_commit(environ, heads, reachable, expected) -> None:
    found = pins.resolve_source(MAIN, environ, head=lambda p: heads.get(str(p)), reachable=lambda url: reachable)
    assert found == expected


def test_a_named_checkout_at_another_commit_is_refused() -> None:
    with pytest.raises(pins.PinError) as excinfo:
        pins.resolve_source(MAIN, {"MCORE_SRC_MAIN": HOSTILE_PATH}, head=lambda p: "3" * 40, reachable=lambda u: True)
    message = str(excinfo.value)
    assert "MCORE_SRC_MAIN=" in message and "3" * 40 in message and str(MAIN.commit) in message
    assert "'/srv/mlm checkout; touch pwned $(touch pwned2)'" in message  # shown shell-quoted


@pytest.mark.parametrize("environ", [{}, {"MCORE_SRC": "/elsewhere"}])
def test_a_source_pin_without_checkout_or_network_says_how_to_provide_one(environ) -> None:
    with pytest.raises(pins.SourceUnavailable) as excinfo:
        pins.resolve_source(MAIN, environ, head=lambda p: "4" * 40, reachable=lambda url: False)
    message = str(excinfo.value)
    assert "MCORE_SRC_MAIN=" in message and f"checkout {MAIN.commit}" in message and str(MAIN.git) in message


def test_release_pins_need_no_source() -> None:
    def fail(*_: object) -> None:
        raise AssertionError("a release pin must not look for a checkout")

    assert pins.resolve_source(RELEASES[0], {"MCORE_SRC": "/x"}, head=fail, reachable=fail) is None


def test_git_head_reads_only_the_root_of_a_real_checkout(tmp_path: Path) -> None:
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "x"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    (tmp_path / "sub").mkdir()
    assert gitinfo.git_head(tmp_path) == head
    assert gitinfo.git_head(tmp_path / "sub") is None
    assert gitinfo.git_head(tmp_path / "missing") is None


def test_archive_commit_reads_a_git_archive_tarball_and_nothing_else(tmp_path: Path) -> None:
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path / "repo")]
    (tmp_path / "repo").mkdir()
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "repo" / "f").write_text("x")
    subprocess.run([*git, "add", "f"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "x"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    tarball = tmp_path / "snapshot.tar.gz"
    subprocess.run([*git, "archive", "--format=tar.gz", f"--output={tarball}", "HEAD"], check=True)
    assert gitinfo.archive_commit(tarball) == head
    plain = tmp_path / "plain.tar.gz"
    subprocess.run(["tar", "-czf", str(plain), "-C", str(tmp_path / "repo"), "f"], check=True)
    assert gitinfo.archive_commit(plain) is None
    assert gitinfo.archive_commit(tmp_path / "repo" / "f") is None
    assert gitinfo.archive_commit(tmp_path / "missing.tar.gz") is None


# -- installing ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pin", "source", "expected"),
    [
        (RELEASES[0], None, [[RELEASES[0].package]]),
        (RELEASES[-1], None, [[str(RELEASES[-1].package), *RELEASES[-1].requires]]),
        (MAIN, None, [list(MAIN.requires), [*MAIN.pip_args, f"megatron-core @ git+{MAIN.git}@{MAIN.commit}"]]),
    ],
)
def test_install_plan_is_argument_lists(pin: pins.Pin, source: Path | None, expected: list[list[str]]) -> None:
    assert pins.install_plan(pin, source) == expected


def test_a_local_checkout_installs_the_pinned_commit_as_one_argument() -> None:
    *requires, (*args, target) = pins.install_plan(MAIN, Path(HOSTILE_PATH))
    assert requires == [list(MAIN.requires)] and args == list(MAIN.pip_args)
    name, url = target.split(" @ git+", 1)
    location, commit = url.rsplit("@", 1)
    assert (name, commit) == ("megatron-core", MAIN.commit)
    assert urllib.parse.urlsplit(location)[:2] == ("file", "localhost")
    assert urllib.parse.unquote(urllib.parse.urlsplit(location).path) == HOSTILE_PATH
    assert not any(c in location for c in " ;$()`")


def test_a_git_archive_tarball_installs_as_it_is(tmp_path: Path) -> None:
    tarball = tmp_path / f"megatron-lm-{MAIN.commit}.tar.gz"
    tarball.write_bytes(b"")
    assert pins.install_plan(MAIN, tarball) == [list(MAIN.requires), [*MAIN.pip_args, str(tarball)]]


def test_source_pins_install_without_dependencies() -> None:
    for pin in SOURCES:
        assert "--no-deps" in pin.pip_args, f"{pin.name}: pip would resolve its dependencies from the index"


class Recorder:
    def __init__(self, codes: list[int]) -> None:
        self.codes, self.calls = codes, []

    def __call__(self, command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        self.calls.append((command, kwargs))
        return subprocess.CompletedProcess(command, self.codes[len(self.calls) - 1])


@pytest.mark.parametrize(("doctor_code", "expected"), [(0, 0), (1, 1), (3, 3)])
def test_switch_runs_pip_then_the_doctor_without_a_shell(doctor_code: int, expected: int) -> None:
    run = Recorder([0, 0, doctor_code])
    code = cli.switch(
        "main",
        TABLE,
        environ={"MCORE_SRC_MAIN": HOSTILE_PATH},
        run=run,
        python="/py",
        resolve=lambda p, e: Path(HOSTILE_PATH),
        shadowed=lambda: None,
    )
    assert code == expected
    commands = [command for command, _ in run.calls]
    assert commands[:2] == [
        ["/py", "-m", "pip", "install", *args] for args in pins.install_plan(MAIN, Path(HOSTILE_PATH))
    ]
    assert commands[2] == ["/py", "-m", "mcore_compat", "doctor"]
    assert all("shell" not in kwargs for _, kwargs in run.calls)
    package_root = str(Path(cli.__file__).resolve().parent.parent)  # the checkout, or the installed site-packages
    assert package_root in run.calls[2][1]["env"]["PYTHONPATH"].split(os.pathsep)


def test_switch_fails_where_a_checkout_shadows_the_installed_pin(capsys: pytest.CaptureFixture[str]) -> None:
    run = Recorder([0, 0])
    shadowing = ("0.16.1", "/venv/site-packages/megatron/core", "/src/mlm/megatron/core")
    release = RELEASES[0].name
    assert cli.switch(release, TABLE, environ={}, run=run, python="/py", shadowed=lambda: shadowing) == 1
    error = capsys.readouterr().err
    assert f"installed {release!r} (/venv/site-packages/megatron/core)" in error
    assert "imported from /src/mlm/megatron/core" in error and "PYTHONPATH" in error


def test_switch_stops_when_pip_fails() -> None:
    run = Recorder([5])
    assert cli.switch(RELEASES[0].name, TABLE, environ={}, run=run, python="/py") == 5
    assert len(run.calls) == 1


@pytest.mark.parametrize(("version", "refused"), [((3, 11, 7), True), ((3, 12, 1), False), ((3, 13, 0), False)])
def test_wheels_for_a_newer_python_are_refused_before_pip(version: tuple[int, int, int], refused: bool) -> None:
    pin = next(p for p in RELEASES if p.requires_python)
    if refused:
        with pytest.raises(pins.PinError, match=r"needs Python >=3\.12.*runs Python 3\.11\.7"):
            pins.check_python(pin, version)
    else:
        pins.check_python(pin, version)


# -- the command line and the script -------------------------------------------------------------


def test_cli_pin_list_names_every_pin_and_how_it_installs(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["pin", "list"]) == 0
    out = capsys.readouterr().out
    for pin in TABLE.pins.values():
        assert pin.how() in out and pin.name in out


def _switch(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SWITCH), *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=120)


@pytest.mark.parametrize(
    "name", ["core_r0.16; touch pwned", "$(touch pwned)", "`touch pwned`", "core_r0_16", "main && touch pwned"]
)
def test_switch_script_refuses_unknown_pins_and_runs_nothing(name: str, tmp_path: Path) -> None:
    result = _switch(name, cwd=tmp_path)
    assert result.returncode == 2
    assert f"unknown pin {name!r}" in result.stderr and ", ".join(TABLE.pins) in result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args", [(), ("main", "dev")])
def test_switch_script_takes_exactly_one_argument(args: tuple[str, ...], tmp_path: Path) -> None:
    result = _switch(*args, cwd=tmp_path)
    assert result.returncode == 2 and "usage:" in result.stderr


def test_switch_script_lists_the_pins(tmp_path: Path) -> None:
    result = _switch("list", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert [line.split()[0] for line in result.stdout.splitlines()[1:]] == list(TABLE.pins)


# -- the README and CI read the same facts -------------------------------------------------------


def _readme_section(title: str) -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def test_readme_support_table_lists_exactly_the_pins() -> None:
    lines = [line for line in _readme_section("Support").splitlines() if line.startswith("| `")]
    rows = [[cell.strip().strip("`") for cell in line.strip("|").split("|")] for line in lines]
    assert [row[0] for row in rows] == list(TABLE.pins)
    for name, installs, python, generation, adapter, works in rows:
        pin = TABLE.get(name)
        assert (python, generation, adapter) == (pin.python, pin.generation, pin.adapter), name
        assert str(pin.version or str(pin.commit)[:10]) in installs, name
        for run in ("dp_balanced:static", "default_dynamic_cp:dynamic"):
            assert (run.split(":")[0] in works) == (run in pin.runs), f"{name}: {works!r} vs runs {pin.runs}"


def test_ci_runs_exactly_the_readme_test_command() -> None:
    block = _readme_section("Two commands").split("```bash\n", 1)[1].split("```", 1)[0]
    demo, test = block.strip().splitlines()
    assert "-s demo" in demo
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert [line for line in ci if line and not line.startswith(("#", "set ", "cd "))] == [test]
