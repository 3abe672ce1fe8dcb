"""The set-up a newcomer runs: which Python environment the make targets use (scripts/python_env.sh), that they
never install into a Python outside one, and the one-line stops for a Python that cannot be used.

The interpreters are real ones: this machine's, a fresh venv, and copies of the base interpreter whose standard
library lacks ensurepip (as Debian's does without python3-venv) or carries conda's marker. Nothing is installed.
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from conftest import ROOT

SCRIPT = ROOT / "scripts" / "python_env.sh"
FLOOR = (3, 10)


def base_python() -> Path:
    """The interpreter this one's environment was made from (itself when it runs outside any environment)."""
    exe = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    if not exe.exists() or (Path(sys.base_prefix) / "conda-meta").is_dir():
        pytest.skip("no plain base interpreter to test with (a conda base, or an unusual layout)")
    return exe


def python_env(mode: str, python: str | Path, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", str(SCRIPT), mode, str(python)], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})


def copied_python(tmp_path: Path, leave_out: str = "", add: str = "") -> Path:
    """A real interpreter in its own prefix: the base binary copied, its standard library linked entry by entry
    (without `leave_out`), and a directory `add` created in the prefix. Python finds its prefix from where its
    binary lies, so this one's sys.prefix is tmp_path/prefix."""
    base = base_python()
    prefix = tmp_path / "prefix"
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    stdlib = Path(sysconfig.get_paths(vars={"installed_base": sys.base_prefix, "base": sys.base_prefix})["stdlib"])
    (prefix / "bin").mkdir(parents=True)
    (prefix / "lib" / version).mkdir(parents=True)
    shutil.copy2(base.resolve(), prefix / "bin" / "python3")
    for entry in stdlib.iterdir():
        if entry.name != leave_out:
            (prefix / "lib" / version / entry.name).symlink_to(entry)
    for entry in Path(sys.base_prefix, "lib").glob("libpython*"):  # a shared libpython found beside the binary
        (prefix / "lib" / entry.name).symlink_to(entry)
    if add:
        (prefix / add).mkdir()
    python = prefix / "bin" / "python3"
    probe = subprocess.run([str(python), "-c", "import sys, os; print(sys.prefix)"], capture_output=True, text=True)
    if probe.returncode != 0 or Path(probe.stdout.strip()).resolve() != prefix.resolve():
        pytest.skip(f"a copied interpreter does not run from its own prefix here: {probe.stderr[-300:]}")
    return python


def old_python() -> str | None:
    """An interpreter older than the floor on this machine, if there is one (pyenv's, or python3.x on PATH)."""
    candidates = [shutil.which(f"python3.{minor}") for minor in range(6, FLOOR[1])]
    candidates += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.*/bin/python3")))
    for candidate in filter(None, candidates):
        run = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2] < (3, 10))"],
                             capture_output=True, text=True)
        if run.stdout.strip() == "True":
            return candidate
    return None


def test_script_states_the_floor_the_docs_state():
    """The floor is declared once, in the script; the front pages and the platform notes repeat it."""
    text = SCRIPT.read_text()
    major, minor = re.search(r"FLOOR_MAJOR=(\d+) FLOOR_MINOR=(\d+)", text).groups()
    assert (int(major), int(minor)) == FLOOR
    for page in ("README.md", "README_zh.md", "docs/real-model.md"):
        assert f"Python {major}.{minor}" in (ROOT / page).read_text(encoding="utf-8"), page


def test_a_python_outside_any_environment_gets_the_projects_venv(tmp_path):
    assert python_env("which", base_python(), tmp_path).stdout.strip() == ".venv/bin/python"


def test_an_active_venv_is_used_as_it_is(tmp_path):
    subprocess.run([str(base_python()), "-m", "venv", "--without-pip", str(tmp_path / "env")], check=True)
    python = tmp_path / "env" / "bin" / "python"
    assert python_env("which", python, tmp_path).stdout.strip() == str(python)
    ensured = python_env("ensure", python, tmp_path)
    assert ensured.returncode == 0 and not (tmp_path / ".venv").exists()
    assert ensured.stdout.startswith(f"make: using the active environment {(tmp_path / 'env').resolve()}")


def test_a_conda_environment_is_used_as_it_is(tmp_path):
    python = copied_python(tmp_path, add="conda-meta")
    assert python_env("which", python, tmp_path).stdout.strip() == str(python)


@pytest.mark.slow  # makes a real venv with pip (a few seconds)
def test_the_venv_is_made_once_then_used(tmp_path):
    made = python_env("ensure", base_python(), tmp_path)
    assert made.returncode == 0, made.stderr
    assert made.stdout.startswith("make: made .venv from ") and made.stdout.count("\n") == 1
    venv_python = tmp_path / ".venv" / "bin" / "python"
    assert subprocess.run([str(venv_python), "-m", "pip", "--version"], capture_output=True).returncode == 0
    again = python_env("ensure", base_python(), tmp_path)
    assert again.returncode == 0 and again.stdout.startswith("make: using .venv (Python ")
    # activated, .venv is still named as the project's own
    assert python_env("ensure", venv_python, tmp_path).stdout.startswith("make: using .venv (Python ")
    # PYTHON of another version than .venv's: .venv is used, and the line says how to remake it from PYTHON
    other = old_python()
    if other:
        note = python_env("ensure", other, tmp_path)
        assert note.returncode == 0 and f"rm -rf .venv and make again to remake it from {other}" in note.stdout


def test_a_python_without_ensurepip_stops_with_the_fix_and_leaves_nothing(tmp_path):
    """Debian's and Ubuntu's Python without python3-venv: venv cannot install pip. One line, the package to
    install, and no half-made .venv that a later run would take for a good one."""
    python = copied_python(tmp_path, leave_out="ensurepip")
    work = tmp_path / "work"
    work.mkdir()
    run = python_env("ensure", python, work)
    assert run.returncode == 1 and run.stdout == ""
    assert run.stderr.count("\n") == 1 and run.stderr.startswith("error: ")
    assert "cannot make the virtual environment .venv" in run.stderr
    if Path("/etc/debian_version").exists():
        assert f"apt install python{sys.version_info[0]}.{sys.version_info[1]}-venv" in run.stderr
    assert not (work / ".venv").exists()


def test_a_python_older_than_the_floor_stops_with_the_fix(tmp_path):
    old = old_python()
    if old is None:
        pytest.skip("no Python older than 3.10 on this machine")
    run = python_env("ensure", old, tmp_path)
    assert run.returncode == 1 and run.stderr.count("\n") == 1
    assert "PocketLM needs 3.10 or newer" in run.stderr and "make demo PYTHON=" in run.stderr
    assert not (tmp_path / ".venv").exists()


def test_a_missing_python_stops_with_one_line(tmp_path):
    run = python_env("ensure", "python3.no-such-version", tmp_path)
    assert run.returncode == 1 and run.stderr.count("\n") == 1 and "no python3.no-such-version found" in run.stderr


def make_dry_run(python: str | Path, *targets: str) -> list[str]:
    """The commands `make -n` would run for these targets with PYTHON=python (nothing runs)."""
    run = subprocess.run(["make", "-n", *targets, f"PYTHON={python}"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    return run.stdout.splitlines()


def pip_installers(commands: list[str]) -> set[str]:
    """The interpreters whose pip the commands install with."""
    return {m.group(1) for line in commands for m in re.finditer(r"(\S+) -m pip install", line)}


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_never_installs_into_a_python_outside_an_environment(tmp_path):
    every_install = ["install", "install-dev", "demo", "test", "gpu-check"]
    installs = pip_installers(make_dry_run(base_python(), *every_install))
    assert installs and installs == {".venv/bin/python"}, installs
    # an environment the user made is installed into as it is
    subprocess.run([str(base_python()), "-m", "venv", "--without-pip", str(tmp_path / "env")], check=True)
    python = str(tmp_path / "env" / "bin" / "python")
    assert pip_installers(make_dry_run(python, *every_install)) == {python}


def test_the_pages_quote_the_makefiles_torch_pin_and_its_measured_downloads():
    """The PyTorch pin is declared once (the Makefile); the front pages name it and the download sizes that
    bench/bench_install.py measured for it (bench/results/install-linux-x86_64.json), not figures of their own."""
    pin = re.search(r"^TORCH_VERSION \?= (\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    pypi = json.loads((ROOT / "bench/results/install-linux-x86_64.json").read_text())["pypi_torch"]
    assert pypi["requirement"] == f"torch=={pin}"
    total = f"{pypi['total_bytes'] / 1e9:.2f} GB"
    for page in ("README.md", "README_zh.md", "docs/real-model.md", "docs/real-model_zh.md"):
        text = (ROOT / page).read_text(encoding="utf-8")
        assert set(re.findall(r"torch==([\d.]+\d)", text)) <= {pin}, page
        assert total in text, (page, total)
    for page in ("README.md", "README_zh.md"):
        assert str(len(pypi["files"])) in (ROOT / page).read_text(encoding="utf-8")


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_gpu_check_installs_pytest_and_runs_the_check_in_the_environment():
    """A GPU owner's path (docs/real-model.md): `make gpu-check` after `make install` gives the check the pytest
    that runs its CUDA tests, and runs it with the environment's Python."""
    commands = make_dry_run(base_python(), "gpu-check")
    assert ".venv/bin/python -m pip install --disable-pip-version-check -q -r requirements-test.txt" in commands
    assert "PYTHON=.venv/bin/python bash bench/gpu_check.sh" in commands
    assert re.search(r"^pytest\b", (ROOT / "requirements-test.txt").read_text(), re.M)
    assert "requirements-test.txt" in (ROOT / "requirements-dev.txt").read_text()  # one declaration of pytest
