"""What the set-up costs a newcomer: the downloads of PyTorch's build from PyPI, and a fresh install's time.

    python bench/bench_install.py --python python3.12 --out bench/results/install-linux-x86_64.json
    python bench/bench_install.py --downloads .venv/bin/python --out bench/results/install-downloads.json
    python bench/bench_install.py --fresh_clone --targets demo test --out bench/results/fresh-clone-<machine>.json
    python bench/bench_install.py --fresh_clone --targets demo --make_args DEMO_PRETRAIN_STEPS=450 DEMO_SFT_STEPS=150 \
        --out bench/results/demo-fixed-steps-<machine>.json

--python resolves `torch==<the Makefile's TORCH_VERSION>` as `make install` asks for it, with that interpreter, on
PyPI alone (this machine's pip configuration ignored: what a user's machine sees), without downloading any wheel
(pip's dry run reads the index's metadata files), and adds up the files' sizes from the index. On Linux x86-64
that is the CUDA build and its NVIDIA libraries.

--downloads measures what an installed environment downloaded: its distributions fetched again by its own pip
(without dependencies), less those of another environment (--minus): `make install` against `make install-dev`.

--fresh_clone clones this repository's HEAD into a temporary folder and times each make target there, as a
newcomer types it, with an empty pip cache; the cache's size after each target is what was downloaded (and built)
for it. The machine's CPU, Python and pip settings are recorded beside the times.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# common.device imports torch: this runs in the project's environment, as the other benchmarks do
from common.device import cpu_description  # noqa: E402
from common.files import METRICS_NAME  # noqa: E402

INDEX = "https://pypi.org/simple"


def torch_version() -> str:
    return re.search(r"^TORCH_VERSION \?= (\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)


def public_pip_env() -> dict[str, str]:
    """The environment with this machine's pip configuration (local wheels, extra indexes, caps) switched off."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k == "PIP_CERT"}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


@lru_cache(maxsize=None)  # torch's page lists every file of every release: fetched once, not once per file
def index_files(name: str) -> list[dict]:
    """A project's files on the index, with their sizes (PEP 691 JSON)."""
    request = urllib.request.Request(f"{INDEX}/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)["files"]


def file_size(name: str, filename: str) -> int:
    return next(f["size"] for f in index_files(name) if f["filename"] == filename)


def resolve_torch(python: str) -> dict:
    """The files pip would download for the Makefile's torch pin, with their sizes (nothing is installed)."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([python, "-m", "venv", f"{tmp}/env"], check=True)
        report = Path(tmp, "report.json")
        subprocess.run([f"{tmp}/env/bin/python", "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q",
                        "--index-url", INDEX, "--report", str(report), f"torch=={torch_version()}"],
                       check=True, env=public_pip_env())
        info = json.loads(report.read_text())
        interpreter = subprocess.run([f"{tmp}/env/bin/python", "-c",
                                      "import platform; print(platform.python_version(), platform.machine())"],
                                     capture_output=True, text=True, check=True).stdout.split()
    files = []
    for item in info["install"]:
        filename = item["download_info"]["url"].rsplit("/", 1)[1]
        files.append({"name": item["metadata"]["name"], "version": item["metadata"]["version"],
                      "file": filename, "bytes": file_size(item["metadata"]["name"].lower(), filename)})
    files.sort(key=lambda f: -f["bytes"])
    torch_wheel = next(f["bytes"] for f in files if f["name"] == "torch")
    # the pin's wheel for every platform PyPI has it for (one per Python version: their sizes differ little)
    wheels = {f["filename"].split("-")[-1].removesuffix(".whl"): f["size"] for f in index_files("torch")
              if f["filename"].startswith(f"torch-{torch_version()}-cp311-")}
    return {"python": interpreter[0], "machine": interpreter[1], "system": platform.system(),
            "torch_wheel_bytes_by_platform_cp311": wheels,
            "requirement": f"torch=={torch_version()}", "index": INDEX, "files": files,
            "total_bytes": sum(f["bytes"] for f in files), "torch_wheel_bytes": torch_wheel,
            "other_bytes": sum(f["bytes"] for f in files) - torch_wheel}


def distributions(python: str) -> dict[str, str]:
    """{name: version} of what an environment has installed (pip itself and its build tools aside)."""
    listed = subprocess.run([python, "-m", "pip", "list", "--format", "json"], capture_output=True, text=True,
                            check=True).stdout
    return {d["name"].lower(): d["version"] for d in json.loads(listed)
            if d["name"].lower() not in ("pip", "setuptools", "wheel")}


def download_sizes(python: str, minus: str | None) -> dict:
    """The files pip downloads for the distributions an environment has (less those of another environment),
    fetched again by that environment's pip, each without its dependencies, and their sizes: what its install
    downloaded, whatever index or mirror its pip is set to use."""
    wanted = distributions(python)
    if minus:
        wanted = {n: v for n, v in wanted.items() if n not in distributions(minus)}
    requirements = [f"{n}=={v}" for n, v in sorted(wanted.items())]
    with tempfile.TemporaryDirectory() as tmp:
        # pip reads a source distribution's metadata before it keeps the file: some build in isolation (their build
        # tools come with them), some only beside what the environment has (DeepSpeed's needs torch)
        for isolation in ([], ["--no-build-isolation"]):
            fetch = subprocess.run([python, "-m", "pip", "download", "-q", "--no-deps", *isolation, "-d", tmp,
                                    *requirements], capture_output=True, text=True)
            if fetch.returncode == 0:
                break
        else:
            sys.exit(f"error: pip download failed:\n{fetch.stderr[-2000:]}")
        files = sorted(({"file": p.name, "bytes": p.stat().st_size} for p in Path(tmp).iterdir()),
                       key=lambda f: -f["bytes"])
    return {"environment": python, "minus": minus, "distributions": len(wanted), "files": files,
            "total_bytes": sum(f["bytes"] for f in files)}


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def run_summary(run_dir: Path) -> dict | None:
    """A demo run's steps, its last validation losses and its median training throughput (metrics.jsonl)."""
    path = run_dir / METRICS_NAME
    if not path.exists():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    evals = [r for r in records if "val_loss" in r]
    trained = [r for r in records if "loss" in r and "tokens_per_s" in r]
    rates = sorted(r["tokens_per_s"] for r in trained)
    times = sorted(r["step_time_s"] for r in trained if "step_time_s" in r)
    last = evals[-1] if evals else {}
    return {"steps": max(r.get("step", 0) for r in records), "val_loss": last.get("val_loss"),
            "val_bpb": last.get("val_bpb"), "val_ppl": last.get("val_ppl"),
            "first_logged_loss": trained[0]["loss"] if trained else None,
            "last_logged_loss": trained[-1]["loss"] if trained else None,
            "median_tokens_per_s": rates[len(rates) // 2] if rates else None,
            "median_step_time_s": times[len(times) // 2] if times else None}


def fresh_install(targets: list[str], python: str, make_args: list[str]) -> dict:
    """Each make target timed in a fresh clone of HEAD, one after another, with an empty pip cache."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        clone, cache = Path(tmp, "clone"), Path(tmp, "pip-cache")
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        env = {**os.environ, "PIP_CACHE_DIR": str(cache)}
        env.pop("VIRTUAL_ENV", None)
        for target in targets:
            before = tree_bytes(cache) if cache.exists() else 0
            start = time.perf_counter()
            run = subprocess.run(["make", target, f"PYTHON={python}", *make_args], cwd=clone, env=env,
                                 capture_output=True, text=True)
            seconds = time.perf_counter() - start
            results.append({"target": target, "seconds": round(seconds, 1), "returncode": run.returncode,
                            "pip_cache_bytes_added": tree_bytes(cache) - before,
                            "venv_bytes": tree_bytes(clone / ".venv") if (clone / ".venv").exists() else None,
                            "first_line": run.stdout.splitlines()[0] if run.stdout else "",
                            "last_lines": run.stdout.splitlines()[-6:]})
            if target == "demo":
                results[-1]["runs"] = {name: run_summary(clone / "out" / name)
                                       for name in ("demo-pretrain", "demo-sft")}
            print(f"make {target}: {seconds:.0f} s, exit {run.returncode}, "
                  f"pip cache +{results[-1]['pip_cache_bytes_added'] / 1e6:.0f} MB")
            if run.returncode != 0:  # recorded with its output's end; the targets after it would build on it
                results[-1]["stderr_tail"] = run.stderr.splitlines()[-20:]
                break
    pip_config = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    version = subprocess.run([python, "-c", "import platform; print(platform.python_version())"],
                             capture_output=True, text=True).stdout.strip()
    return {"machine": f"{os.cpu_count()}-core {cpu_description()}", "python": python, "python_version": version,
            "make_args": make_args,
            "pip_find_links_configured": bool(os.environ.get("PIP_FIND_LINKS")) or "find-links" in pip_config,
            "targets": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--python", help="resolve PyTorch's PyPI build for this interpreter")
    parser.add_argument("--fresh_clone", action="store_true", help="time make targets in a fresh clone")
    parser.add_argument("--targets", nargs="+", default=["install"], help="make targets for --fresh_clone")
    parser.add_argument("--base_python", default="python3", help="PYTHON for make in --fresh_clone")
    parser.add_argument("--make_args", nargs="*", default=[],
                        help="make variables for every target, e.g. DEMO_PRETRAIN_STEPS=450 DEMO_SFT_STEPS=150")
    parser.add_argument("--cpu_wheel", metavar="FILE", help="with --python: record this CPU-build wheel's size")
    parser.add_argument("--downloads", metavar="PYTHON", help="the download size of what this environment has")
    parser.add_argument("--minus", metavar="PYTHON", help="with --downloads: less what this environment has")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if not (args.python or args.fresh_clone or args.downloads):
        parser.error("give --python, --fresh_clone or --downloads")
    result: dict = {"date": time.strftime("%Y-%m-%d")}
    if args.python:
        result["pypi_torch"] = resolve_torch(args.python)
        t = result["pypi_torch"]
        if args.cpu_wheel:  # PyTorch's CPU index (download.pytorch.org) serves it; only its name and size are kept
            t["cpu_build_wheel"] = {"file": Path(args.cpu_wheel).name, "bytes": Path(args.cpu_wheel).stat().st_size}
        print(f"torch=={torch_version()} from PyPI for Python {t['python']} on {t['machine']}: "
              f"{t['total_bytes'] / 1e9:.2f} GB in {len(t['files'])} files "
              f"(torch's wheel {t['torch_wheel_bytes'] / 1e6:.0f} MB)")
    if args.downloads:
        result["downloads"] = d = download_sizes(args.downloads, args.minus)
        print(f"{d['distributions']} distributions: {d['total_bytes'] / 1e6:.0f} MB in {len(d['files'])} files")
    if args.fresh_clone:
        result["fresh_clone"] = fresh_install(args.targets, args.base_python, args.make_args)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    failed = [t["target"] for t in result.get("fresh_clone", {}).get("targets", []) if t["returncode"] != 0]
    if failed:
        print(f"error: make {failed[0]} failed in the fresh clone (its output's end is in {args.out})",
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
