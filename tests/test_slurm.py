"""launch.slurm: dry run, local executor, and a real single-node Slurm (2 tasks, preemption -> requeue -> done).

The real-Slurm tests need a running cluster: `bash launch/slurm_local/start.sh` (as root) starts one; CI does.
With POCKETLM_REQUIRE_SLURM=1 (set by .ci/run) a missing cluster fails instead of skipping.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, cli_flags, read_metrics, wait_for_metrics

pytest.importorskip("submitit")
from launch import slurm  # noqa: E402

pytestmark = pytest.mark.slow  # real processes: `make test-fast` leaves this module out



def train_args(corpus, out: Path, run: str, **over) -> list[str]:
    base = {"data_path": corpus["pretrain"], "cache_dir": corpus["cache"], "out_dir": out, "run_name": run,
            "preset": "tiny", "max_steps": 4, "dtype": "float32", "log_interval": 1, "eval_interval": 1000,
            "save_interval": 2, "num_workers": 0, "batch_size": 4}
    return cli_flags(base, **over)


def slurm_ready() -> bool:
    if shutil.which("sinfo") is None:
        return False
    res = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    return res.returncode == 0 and any(state in res.stdout for state in ("idle", "mix", "alloc"))


@pytest.fixture(scope="module")
def cluster() -> None:
    if not slurm_ready():
        reason = "no running Slurm cluster (start one with `bash launch/slurm_local/start.sh` as root)"
        if os.environ.get("POCKETLM_REQUIRE_SLURM") == "1":
            pytest.fail(reason)
        pytest.skip(reason)


def metrics_steps(run_dir: Path) -> list[int]:
    return [m["step"] for m in read_metrics(run_dir)]


def test_dry_run_prints_the_job_and_resumes_by_default(capsys):
    assert slurm.main(["--nodes", "2", "--gpus_per_node", "4", "--partition", "gpu", "--time", "90", "--dry_run",
                       "--", "train_pretrain.py", "--batch_size", "8", "--run_name", "big"]) == 0
    out = capsys.readouterr().out
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --partition=gpu", "#SBATCH --signal=USR2@120", "#SBATCH --job-name=big"):
        assert line in out
    record = json.loads(out[: out.index("#!/bin/bash")])
    assert record["command"][-3:] == ["--run_name", "big", "--resume"] and record["tasks"] == 8


def test_bad_launch_arguments(capsys):
    with pytest.raises(SystemExit):
        slurm.main(["--dry_run", "--", "train_pretrain.py", "--overwrite"])
    assert "--overwrite cannot be requeued" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        slurm.main(["--dry_run", "--", "nope.py"])
    assert "nope.py: no such script" in capsys.readouterr().err


def test_local_executor_runs_two_tasks(corpus, tmp_path):
    res = subprocess.run([sys.executable, "-m", "launch.slurm", "--cluster", "local", "--gpus_per_node", "0",
                          "--tasks_per_node", "2", "--log_dir", str(tmp_path / "jobs"), "--wait", "--",
                          "train_pretrain.py", *train_args(corpus, tmp_path, "loc")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout + res.stderr
    assert metrics_steps(tmp_path / "loc") == [1, 2, 3, 4]
    logs = list((tmp_path / "jobs" / "loc").glob("*/*_1_log.err"))
    assert logs and '"world_size": 2' in (tmp_path / "jobs/loc").joinpath(
        logs[0].parent.name, logs[0].name.replace("_1_", "_0_")).read_text()


def test_real_slurm_two_tasks(cluster, corpus, tmp_path):
    args = slurm.parse(["--cluster", "slurm", "--gpus_per_node", "0", "--tasks_per_node", "2", "--time", "10",
                        "--log_dir", str(tmp_path / "jobs"), "--", "train_pretrain.py",
                        *train_args(corpus, tmp_path, "two")])
    job, record = slurm.make_job(args)
    handle = slurm.submit(args, job, record)
    handle.results()  # raises if a task failed
    assert metrics_steps(tmp_path / "two") == [1, 2, 3, 4]
    assert (tmp_path / "jobs/two" / f"{handle.job_id}_submission.json").is_file()


def test_real_slurm_preemption_checkpoints_requeues_and_completes(cluster, corpus, tmp_path):
    args = slurm.parse(["--cluster", "slurm", "--gpus_per_node", "0", "--tasks_per_node", "2", "--time", "10",
                        "--signal_delay_s", "40", "--log_dir", str(tmp_path / "jobs"), "--", "train_pretrain.py",
                        *train_args(corpus, tmp_path, "pre", max_steps=80, save_interval=1000)])
    job, record = slurm.make_job(args)
    handle = slurm.submit(args, job, record)
    assert wait_for_metrics(tmp_path / "pre", lines=10, timeout_s=180), "the job never started training"
    assert (tmp_path / "pre" / "metrics.jsonl").exists(), "the job never started training"
    handle._interrupt()  # what Slurm does on preemption: SIGTERM, then the requeue signal
    # Slurm holds a requeued job for ~2 minutes (BeginTime); release it at once to keep the test short.
    for _ in range(240):
        state = subprocess.run(["squeue", "-h", "-j", str(handle.job_id), "-o", "%T %r"], capture_output=True,
                               text=True).stdout
        if "PENDING" in state:
            subprocess.run(["scontrol", "update", f"JobId={handle.job_id}", "StartTime=now"], check=True)
            break
        time.sleep(0.5)
    else:
        pytest.fail("the job was not requeued")
    handle.results()  # returns only once the requeued job has finished
    steps = metrics_steps(tmp_path / "pre")
    assert steps == list(range(1, 81)), "every step exactly once across the preemption"
    logs = "".join(p.read_text() for p in (tmp_path / "jobs/pre").glob("*/*_0_log.*"))
    assert "received: checkpointed step" in logs and "Requeued job" in logs
