"""Names and small helpers shared by the layers that must not import each other: run-directory file names,
atomic writes, the Slurm rendezvous port, and the check for optional packages."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable

from .errors import ConfigError, PocketLMError

LATEST_NAME = "latest"  # out/<run>/latest holds "checkpoints/step_..." of the newest complete checkpoint
BEST_NAME = "best"  # out/<run>/best: the checkpoint with the lowest validation loss (with early stopping)
TRAIN_INFO_NAME = "train_info.json"  # stage and step of a checkpoint
TRAIN_CONFIG_NAME = "train_config.json"  # a run's full configuration, itself a valid --config file
METRICS_NAME = "metrics.jsonl"  # out/<run>/metrics.jsonl: every record of the run, one JSON object a line


PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TOKENIZER_DIR = PROJECT_ROOT / "model" / "tokenizer"  # the shipped default tokenizer


def shipped_path(path: str) -> Path:
    """`path` as given, or, when it is relative and absent from the working directory, the file of that name the
    project ships (dataset/prompts/samples.txt is a default wherever the trainer is started from)."""
    p = Path(path)
    if p.is_absolute() or p.exists() or not (PROJECT_ROOT / p).exists():
        return p
    return PROJECT_ROOT / p


def write_atomic(path: str | Path, data: str | bytes | Iterable[bytes]) -> None:
    """Write `data` (text, bytes, or an iterable of byte chunks) to a temporary file beside `path`, fsync it
    and rename it over `path`: readers see the old file or the new one, never a half-written one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    chunks = [data.encode("utf-8")] if isinstance(data, str) else [data] if isinstance(data, bytes) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp creates the file 0600; give it the permissions a plain open() would have.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def rendezvous_port(job_id: str) -> int:
    """A port derived from the Slurm job id: every task computes the same one without talking to the others."""
    digits = "".join(c for c in str(job_id) if c.isdigit()) or "0"
    return 20000 + int(digits) % 20000


def require_package(module: str, needed_for: str) -> None:
    """Raise ConfigError naming the install command when an optional package is missing (checked without
    importing it, so the check is cheap enough to run before any slow work)."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken install, or a module blocked in sys.modules
        found = False
    if not found:
        raise ConfigError(f"{needed_for} needs the `{module}` package, which is not installed; install it with "
                          f"`pip install -r requirements.txt` (or `make install`)")


def file_sha256(path: str | Path, block: int = 1 << 22) -> str:
    """The hex sha256 of a file, read in blocks (weights files can be large)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def read_json(path: str | Path, error: type[PocketLMError], missing: str = "no such file") -> Any:
    """The JSON value in `path`, or `error` with a one-line message naming the file (missing, unreadable, broken)."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(f"{path}: {missing}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e})") from None
