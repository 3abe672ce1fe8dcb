#!/bin/sh
# The Python environment every make target runs in, so that nothing is ever installed into a system Python
# (Debian's and Ubuntu's refuse it: PEP 668, "externally managed"):
#   - PYTHON running in a virtual environment or a conda environment (activated, or named by its path): that one;
#   - otherwise the project's own .venv, made from PYTHON on first use.
#
#   sh scripts/python_env.sh which PYTHON    prints the interpreter the targets run (never fails; quick)
#   sh scripts/python_env.sh ensure PYTHON   makes .venv when it is the one and is missing, then says in one line
#                                            which environment is used; or stops with one line naming the fix
#
# POSIX sh, not bash: macOS's /bin/sh and Debian's dash run it alike.
set -u

FLOOR_MAJOR=3 FLOOR_MINOR=10  # PyTorch 2.13's floor (its wheels: Python 3.10-3.14)
FLOOR="$FLOOR_MAJOR.$FLOOR_MINOR"
VENV=.venv

mode=${1:-}
py=${2:-python3}

# Exit 0 when the interpreter runs inside a virtual environment (venv, or virtualenv's older real_prefix) or a
# conda environment (base included: conda-meta marks every one).
IN_ENV='import os, sys
sys.exit(0 if sys.prefix != getattr(sys, "base_prefix", sys.prefix) or hasattr(sys, "real_prefix")
         or os.path.isdir(os.path.join(sys.prefix, "conda-meta")) else 1)'
OLD_ENOUGH="import sys; sys.exit(0 if sys.version_info >= ($FLOOR_MAJOR, $FLOOR_MINOR) else 1)"
VERSION='import platform; print(platform.python_version())'
MINOR='import sys; print("%d.%d" % sys.version_info[:2])'

chosen() {
  if "$py" -c "$IN_ENV" >/dev/null 2>&1; then echo "$py"; else echo "$VENV/bin/python"; fi
}

fail() {
  echo "error: $*" >&2
  exit 1
}

# A newer Python on PATH to suggest when PYTHON is too old or cannot make environments.
other_python() {
  for candidate in python3.14 python3.13 python3.12 python3.11 python3.10; do
    if command -v "$candidate" >/dev/null 2>&1 && [ "$(command -v "$candidate")" != "$(command -v "$py")" ] \
        && "$candidate" -c "$OLD_ENOUGH" >/dev/null 2>&1; then
      echo "$candidate"
      return
    fi
  done
}

too_old() {  # too_old INTERPRETER: stop with the fix when it is older than the floor
  "$1" -c "$OLD_ENOUGH" >/dev/null 2>&1 && return
  newer=$(other_python)
  fix="install Python $FLOOR or newer (your package manager, python.org or pyenv) and name it: make demo PYTHON=python3.12"
  [ -n "$newer" ] && fix="$newer is on your PATH: make demo PYTHON=$newer"
  fail "$1 is Python $("$1" -c "$VERSION" 2>/dev/null || echo '(unknown)'); PocketLM needs $FLOOR or newer (PyTorch's floor). $fix"
}

make_venv() {
  command -v "$py" >/dev/null 2>&1 \
    || fail "no $py found: install Python $FLOOR or newer (your package manager, python.org or pyenv), or name one: make demo PYTHON=/path/to/python3"
  too_old "$py"
  if ! "$py" -m venv "$VENV" >/dev/null 2>&1 || ! "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
    rm -rf "$VENV"  # a half-made environment (no pip) would be taken for a good one next time
    version=$("$py" -c "$MINOR")
    if [ -f /etc/debian_version ]; then
      fix="sudo apt install python$version-venv (Debian and Ubuntu ship venv and ensurepip apart), then make again"
    else
      fix="install a Python with its venv and ensurepip modules, or name one: make demo PYTHON=/path/to/python3"
    fi
    fail "$(command -v "$py") (Python $version) cannot make the virtual environment $VENV: $fix"
  fi
  # The pip a Python bundles can be years old (Debian 12's builds DeepSpeed by the legacy setup.py route); a newer
  # one when the index answers, else the bundled one does the job
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null 2>&1 || true
  echo "make: made $VENV from $(command -v "$py") (Python $("$VENV/bin/python" -c "$VERSION")); every make target installs into it and runs it. To run the scripts yourself: . $VENV/bin/activate"
}

case "$mode" in
  which)
    chosen
    ;;
  ensure)
    target=$(chosen)
    prefix=$("$py" -c 'import os, sys; print(os.path.realpath(sys.prefix))' 2>/dev/null)
    if [ -d "$VENV" ] && [ "$prefix" = "$(cd "$VENV" && pwd -P)" ]; then
      target=$VENV/bin/python py=$VENV/bin/python  # .venv itself, activated (make puts .venv/bin first on PATH)
    fi
    if [ "$target" = "$py" ] && [ "$target" != "$VENV/bin/python" ]; then
      too_old "$py"
      echo "make: using the active environment $prefix (Python $("$py" -c "$VERSION"))"
    elif [ -e "$target" ]; then
      "$target" -c 'import sys' >/dev/null 2>&1 \
        || fail "$VENV does not run (was the Python it was made from removed?): rm -rf $VENV and run make again"
      "$target" -c "$OLD_ENOUGH" >/dev/null 2>&1 \
        || fail "$VENV has Python $("$target" -c "$VERSION"); PocketLM needs $FLOOR or newer: rm -rf $VENV and make again with a newer one (make demo PYTHON=python3.12)"
      note=""
      mine=$("$target" -c "$MINOR")
      theirs=$("$py" -c "$MINOR" 2>/dev/null || echo "$mine")
      [ "$target" != "$py" ] && [ "$mine" != "$theirs" ] \
        && note=", not $py's $theirs: rm -rf $VENV and make again to remake it from $py"
      echo "make: using $VENV (Python $("$target" -c "$VERSION")$note); to run the scripts yourself: . $VENV/bin/activate"
    else
      make_venv
    fi
    ;;
  *)
    fail "usage: sh scripts/python_env.sh which|ensure PYTHON"
    ;;
esac
