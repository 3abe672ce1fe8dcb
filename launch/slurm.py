"""Submit a PocketLM training script to Slurm with submitit: one task per GPU, checkpoint-and-requeue.

    python -m launch.slurm --nodes 2 --gpus_per_node 8 --partition gpu --time 1440 -- \\
        train_pretrain.py --data_path pretrain_hq.jsonl --batch_size 32 --run_name pretrain-26m

Layout: `nodes × gpus_per_node` tasks (one process per GPU, started by srun). Each task exports the torch
rendezvous (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR = first node of the allocation, MASTER_PORT derived from
the job id) and runs the script as a child process with `--resume`, so a requeued job continues from the run's
latest checkpoint (a first start finds none and starts fresh).

Preemption or time-out: Slurm signals the job (`--signal_delay_s` before the kill); the training processes
checkpoint after their current step and exit, and rank 0 asks submitit to requeue the job. Everything about
the job (exact command, parameters, per-task logs) is kept in `--log_dir/<job name>/`.
Without Slurm, `--cluster local` runs the same tasks as local processes (for testing).
This module only builds and submits commands; it imports no training code.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from common.files import rendezvous_port

REPO = Path(__file__).resolve().parents[1]


class TrainingJob:
    """The callable submitit runs in every task: start the training script, forward stop signals, requeue."""

    def __init__(self, script: str, script_args: list[str], workdir: str, stop_grace_s: int) -> None:
        self.script, self.script_args, self.workdir, self.stop_grace_s = script, script_args, workdir, stop_grace_s
        self._proc: subprocess.Popen | None = None
        self._done: threading.Event | None = None  # set when the trainer has exited
        self._preempted = False

    def command(self) -> list[str]:
        args = list(self.script_args)
        if "--resume" not in args:
            args.append("--resume")  # the first start has no checkpoint and starts fresh
        return [sys.executable, "-u", self.script, *args]

    def __call__(self) -> int:
        import submitit

        env = submitit.JobEnvironment()
        child_env = dict(os.environ, RANK=str(env.global_rank), LOCAL_RANK=str(env.local_rank),
                         WORLD_SIZE=str(env.num_tasks), MASTER_ADDR=env.hostnames[0],
                         MASTER_PORT=str(rendezvous_port(env.job_id)))
        # A preemption sends SIGTERM (to every process, the trainer included) before submitit's requeue
        # signal. Note it, so a trainer that checkpointed and exited is not mistaken for a finished one.
        previous = signal.getsignal(signal.SIGTERM)

        def on_term(signum: int, frame: Any) -> None:
            self._preempted = True
            if callable(previous):
                previous(signum, frame)

        signal.signal(signal.SIGTERM, on_term)
        print(f"task {env.global_rank}/{env.num_tasks} on {env.hostnames}: {shlex.join(self.command())}", flush=True)
        self._proc = subprocess.Popen(self.command(), cwd=self.workdir, env=child_env)
        # Reap the trainer on a thread: submitit runs checkpoint() as a signal handler in this (main) thread,
        # and a handler that interrupts Popen.wait() could never re-acquire Popen's wait lock.
        self._done = threading.Event()
        threading.Thread(target=lambda: (self._proc.wait(), self._done.set()), daemon=True).start()
        while not self._done.wait(1.0):
            pass
        rc = self._proc.returncode
        if self._preempted:
            # Stopped for preemption: wait for the requeue signal, whose handler requeues and exits.
            deadline = time.time() + self.stop_grace_s
            while time.time() < deadline:
                time.sleep(1)
        if rc != 0:
            raise RuntimeError(f"training exited with code {rc} (see this task's log)")
        return rc

    def checkpoint(self) -> Any:
        """Called by submitit on rank 0 when the job is preempted or times out: stop the trainer, requeue."""
        import submitit

        if self._proc is not None and self._done is not None and not self._done.is_set():
            print("preempted/timed out: asking the trainer to checkpoint and stop", flush=True)
            self._proc.send_signal(signal.SIGUSR1)  # the trainer checkpoints after its current step
            if not self._done.wait(self.stop_grace_s):
                print(f"trainer still running after {self.stop_grace_s}s; requeueing anyway", flush=True)
        if self._proc is not None:
            print(f"trainer exit code {self._proc.returncode}; requeueing", flush=True)
        return submitit.helpers.DelayedSubmission(
            TrainingJob(self.script, self.script_args, self.workdir, self.stop_grace_s))

    def __getstate__(self) -> dict[str, Any]:  # a running process is not part of the pickled job
        return {**self.__dict__, "_proc": None, "_done": None, "_preempted": False}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus_per_node", type=int, default=1, help="one task per GPU; 0 for CPU-only tasks")
    p.add_argument("--tasks_per_node", type=int, default=None, help="default: gpus_per_node (or 1)")
    p.add_argument("--cpus_per_task", type=int, default=None)
    p.add_argument("--mem_gb", type=int, default=None, help="memory per node")
    p.add_argument("--partition", default=None)
    p.add_argument("--account", default=None)
    p.add_argument("--qos", default=None)
    p.add_argument("--time", type=int, default=60, help="minutes per job (requeues get as long again)")
    p.add_argument("--signal_delay_s", type=int, default=120, help="warning before a time-out kill, to checkpoint")
    p.add_argument("--max_requeue", type=int, default=3, help="time-outs after which the job is not requeued")
    p.add_argument("--job_name", default=None, help="default: the script's --run_name, else the script name")
    p.add_argument("--log_dir", default="out/slurm", help="submitit folder: command, parameters, per-task logs")
    p.add_argument("--cluster", choices=("auto", "slurm", "local", "debug"), default="auto",
                   help="auto: slurm when sbatch exists, else local processes")
    p.add_argument("--dry_run", action="store_true", help="print the job and the sbatch script, submit nothing")
    p.add_argument("--wait", action="store_true", help="wait for the job to end and exit with its status")
    p.add_argument("script", help="train_pretrain.py or train_full_sft.py")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own flags")
    return p


def parse(argv: list[str] | None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:  # everything after `--` belongs to the training script
        i = argv.index("--")
        ours, theirs = argv[:i], argv[i + 1:]
    else:
        ours, theirs = argv, []
    p = build_parser()
    args = p.parse_args(ours + theirs[:1])
    args.script_args = list(args.script_args) + theirs[1:]
    if not (REPO / args.script).is_file() and not Path(args.script).is_file():
        p.error(f"{args.script}: no such script (expected train_pretrain.py or train_full_sft.py)")
    if "--overwrite" in args.script_args:
        p.error("--overwrite cannot be requeued safely (a restart would delete the run); use a new --run_name")
    if args.nodes < 1 or args.gpus_per_node < 0:
        p.error("--nodes must be >= 1 and --gpus_per_node >= 0")
    args.tasks_per_node = args.tasks_per_node or max(args.gpus_per_node, 1)
    if args.job_name is None:
        run_name = args.script_args[args.script_args.index("--run_name") + 1] \
            if "--run_name" in args.script_args[:-1] else Path(args.script).stem
        args.job_name = run_name
    return args


def executor_parameters(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """(generic submitit parameters, Slurm-only ones)."""
    params: dict[str, Any] = {"nodes": args.nodes, "tasks_per_node": args.tasks_per_node,
                              "timeout_min": args.time, "name": args.job_name}
    if args.gpus_per_node:
        params["gpus_per_node"] = args.gpus_per_node
    if args.cpus_per_task:
        params["cpus_per_task"] = args.cpus_per_task
    if args.mem_gb:
        params["mem_gb"] = args.mem_gb
    slurm = {"slurm_signal_delay_s": args.signal_delay_s, "slurm_max_num_timeout": args.max_requeue}
    for key in ("partition", "account", "qos"):
        if getattr(args, key):
            slurm[f"slurm_{key}"] = getattr(args, key)
    return params, slurm


def submit(args: argparse.Namespace, job: TrainingJob, record: dict[str, Any]) -> Any:
    """Submit `job` with submitit; write the submission record next to the logs; return the job handle."""
    import submitit

    params, slurm_params = executor_parameters(args)
    folder = Path(args.log_dir) / args.job_name
    cluster = None if args.cluster == "auto" else args.cluster
    executor = submitit.AutoExecutor(folder=folder / "%j", cluster=cluster, slurm_max_num_timeout=args.max_requeue)
    executor.update_parameters(**params, **{k: v for k, v in slurm_params.items() if executor.cluster == "slurm"
                                            and k != "slurm_max_num_timeout"})
    handle = executor.submit(job)
    record.update(job_id=handle.job_id, cluster=executor.cluster, folder=str(folder / str(handle.job_id)))
    (folder / f"{handle.job_id}_submission.json").write_text(json.dumps(record, indent=2) + "\n")
    literal = folder / "%j"  # created by submitit before the job id is known
    if literal.is_dir() and not any(literal.iterdir()):
        literal.rmdir()
    print(f"submitted job {handle.job_id} ({executor.cluster}, {record['tasks']} tasks); logs in "
          f"{folder / str(handle.job_id)}", flush=True)
    return handle


def make_job(args: argparse.Namespace) -> tuple[TrainingJob, dict[str, Any]]:
    """The task callable and the record of what will run."""
    job = TrainingJob(args.script, args.script_args, str(REPO), stop_grace_s=max(30, args.signal_delay_s - 10))
    params, slurm_params = executor_parameters(args)
    record = {"command": job.command(), "workdir": str(REPO), "executor": {**params, **slurm_params},
              "rendezvous": "MASTER_ADDR = first node of the allocation, MASTER_PORT = 20000 + job_id % 20000",
              "tasks": args.nodes * args.tasks_per_node}
    return job, record


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    job, record = make_job(args)
    folder = Path(args.log_dir) / args.job_name
    if args.dry_run:
        from submitit.slurm.slurm import _make_sbatch_string
        sbatch = _make_sbatch_string(
            command=f"{sys.executable} -u -m submitit.core._submit {folder}/%j", folder=folder / "%j",
            job_name=args.job_name, partition=args.partition, time=args.time, nodes=args.nodes,
            ntasks_per_node=args.tasks_per_node, gpus_per_node=args.gpus_per_node or None,
            cpus_per_task=args.cpus_per_task, mem=f"{args.mem_gb}GB" if args.mem_gb else None,
            signal_delay_s=args.signal_delay_s, account=args.account, qos=args.qos)
        print(json.dumps(record, indent=2))
        print(sbatch)
        return 0

    handle = submit(args, job, record)
    if args.wait:
        try:
            handle.results()
        except Exception as e:  # noqa: BLE001 - submitit re-raises the task's failure
            print(f"error: job {handle.job_id} failed: {str(e).strip().splitlines()[-1][:300]}", file=sys.stderr)
            return 1
        print(f"job {handle.job_id} finished")
    return 0


if __name__ == "__main__":
    sys.exit(main())
