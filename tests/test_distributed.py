"""Real multi-process runs on CPU (gloo): DDP parity, cross-world-size resume, dead ranks, DeepSpeed ZeRO-2."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from model import load_model
from trainer_utils.checkpoint import latest_checkpoint

from conftest import ROOT, cli_flags, read_metrics, strict_records, wait_for_metrics

pytestmark = pytest.mark.slow  # real processes: `make test-fast` leaves this module out

DS_BF16 = ["--deepspeed", "launch/ds_zero2.json", "--dtype", "bfloat16"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}


def args(corpus, out: Path, run: str, **over) -> list[str]:
    base = {"data_path": corpus["pretrain"], "cache_dir": corpus["cache"], "out_dir": out, "run_name": run,
            "preset": "tiny", "max_steps": 6, "dtype": "float32", "log_interval": 1, "eval_interval": 3,
            "save_interval": 3, "num_workers": 0, "learning_rate": 1e-3, "warmup_steps": 2, "keep_last": 10,
            "optimizer": "adamw"}  # (test_train.flags says why)
    return cli_flags(base, **over)


def run(cmd: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def torchrun(n: int, script_args: list[str], script: str = "train_pretrain.py") -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}", "--standalone", script,
                *script_args])


def single(script_args: list[str], script: str = "train_pretrain.py") -> subprocess.CompletedProcess:
    return run([sys.executable, script, *script_args])


def losses(run_dir: Path) -> list[float]:
    return [m["loss"] for m in read_metrics(run_dir)]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_model(run_dir)[0].state_dict()


@pytest.mark.parametrize("accum", [1, 2])
def test_ddp_two_ranks_reproduce_the_single_process_curve(corpus, tmp_path, accum):
    single(args(corpus, tmp_path, "single", batch_size=8, accumulation_steps=accum))
    res = torchrun(2, args(corpus, tmp_path, "ddp", batch_size=4, accumulation_steps=accum))
    assert '"world_size": 2' in res.stderr and '"backend": "ddp"' in res.stderr
    a, b = losses(tmp_path / "single"), losses(tmp_path / "ddp")
    assert len(a) == len(b) == 6
    assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-5, (a, b)
    wa, wb = weights(tmp_path / "single"), weights(tmp_path / "ddp")
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=1e-5, rtol=0)


def test_ddp_ranks_split_a_mixture_like_one_process_reads_it(two_sources, tmp_path):
    """Each rank reads its positions of the weighted draw: two ranks train on the single process's batches."""
    mix = ["--data_path", f"{two_sources['pretrain_a']}:0.7", f"{two_sources['pretrain_b']}:0.3",
           "--val_fraction", "0.1"]
    corpus = {"pretrain": None, "cache": two_sources["cache"]}
    single(args(corpus, tmp_path, "single", batch_size=8, data_path=None) + mix)
    torchrun(2, args(corpus, tmp_path, "ddp", batch_size=4, data_path=None) + mix)
    a, b = losses(tmp_path / "single"), losses(tmp_path / "ddp")
    assert len(a) == len(b) == 6
    assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-5, (a, b)


def test_two_rank_run_resumes_on_one_rank_at_the_same_sample(corpus, tmp_path):
    single(args(corpus, tmp_path, "single", batch_size=8))
    torchrun(2, args(corpus, tmp_path, "ddp", batch_size=4))
    run_dir = tmp_path / "ddp"
    shutil.rmtree(run_dir / "checkpoints/step_00000006")  # as if the 2-rank job died after step 3's checkpoint
    (run_dir / "latest").write_text("checkpoints/step_00000003\n")
    res = single(args(corpus, tmp_path, "ddp", batch_size=8, resume=True))
    assert "resuming a 2-rank run on 1 ranks: the sample cursor (24) carries over" in res.stderr
    state = torch.load(run_dir / "checkpoints/step_00000006/training_state.pt", weights_only=True)
    assert state["cursor"] == 48 and state["world_size"] == 1
    wa, wb = weights(tmp_path / "single"), weights(run_dir)
    for name in wa:  # same samples in the same order, same schedule: the same model
        torch.testing.assert_close(wa[name], wb[name], atol=1e-5, rtol=0)


def test_a_dead_rank_makes_the_other_fail_within_the_timeout(corpus, tmp_path):
    from trainer_utils.distributed import _free_port
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {**ENV, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        cmd = [sys.executable, "train_pretrain.py", *args(corpus, tmp_path, "dead", max_steps=100000,
                                                           save_interval=100000, eval_interval=100000,
                                                           dist_timeout=30)]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    assert wait_for_metrics(tmp_path / "dead", lines=4), "the 2-rank run never started training"
    procs[1].send_signal(signal.SIGKILL)
    t0 = time.time()
    _, err = procs[0].communicate(timeout=90)
    procs[1].communicate()
    assert procs[0].returncode not in (0, None), err[-2000:]
    assert time.time() - t0 < 60
    assert "lost contact with the other ranks" in err, err[-2000:]


def test_deepspeed_zero2_trains_checkpoints_resumes_and_tracks_ddp(corpus, tmp_path):
    pytest.importorskip("deepspeed")
    torchrun(2, args(corpus, tmp_path, "ddp", batch_size=4))
    ds = DS_BF16
    torchrun(2, args(corpus, tmp_path, "ds", batch_size=4) + ds)
    ckpt = tmp_path / "ds/checkpoints/step_00000006"
    assert sorted(p.name for p in (ckpt / "deepspeed").glob("*optim_states.pt")) == [
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    a, b = losses(tmp_path / "ddp"), losses(tmp_path / "ds")
    # bf16 autocast (DeepSpeed) against fp32 (DDP): same samples, same schedule, agreement to bf16 precision
    assert max(abs(x - y) for x, y in zip(a, b)) < 5e-3, (a, b)
    res = torchrun(2, args(corpus, tmp_path, "ds", batch_size=4, max_steps=9, resume=True) + ds)
    assert "step 9: val_loss" in res.stderr
    steps = [m["step"] for m in read_metrics(tmp_path / "ds")]
    assert steps == list(range(1, 10))


def test_lora_and_distillation_under_ddp_and_deepspeed(corpus, tmp_path):
    """Post-training on every backend: LoRA (frozen base, adapters only in the optimizer) on two DDP ranks
    follows one process; under DeepSpeed ZeRO-2 it trains and its checkpoint loads; distillation runs on DDP."""
    single(args(corpus, tmp_path, "base"))
    post = dict(data_path=corpus["sft"], init_from=tmp_path / "base", preset=None)
    # SFT batches are length-grouped by micro-batch size: one process with 2 micro-batches of 4 = 2 ranks of 4
    single(args(corpus, tmp_path, "single", batch_size=4, accumulation_steps=2, **post), "train_lora.py")
    torchrun(2, args(corpus, tmp_path, "ddp", batch_size=4, **post), "train_lora.py")
    a, b = losses(tmp_path / "single"), losses(tmp_path / "ddp")
    assert len(a) == len(b) == 6 and max(abs(x - y) for x, y in zip(a, b)) <= 1e-5, (a, b)
    if importlib.util.find_spec("deepspeed") is not None:
        torchrun(2, args(corpus, tmp_path, "ds", batch_size=4, **post) + DS_BF16, "train_lora.py")
        assert (tmp_path / "ds/checkpoints/step_00000006/lora.json").is_file()
        load_model(tmp_path / "ds")
    res = torchrun(2, args(corpus, tmp_path, "distill", batch_size=4, teacher=tmp_path / "base"),
                   "train_distillation.py")
    assert '"world_size": 2' in res.stderr and len(losses(tmp_path / "distill")) == 6
    if importlib.util.find_spec("deepspeed") is not None:  # the teacher stays outside the engine
        torchrun(2, args(corpus, tmp_path, "distill-ds", batch_size=4, teacher=tmp_path / "base") + DS_BF16,
                 "train_distillation.py")
        assert len(losses(tmp_path / "distill-ds")) == 6


def test_dpo_under_ddp_and_deepspeed(corpus, tmp_path):
    """DPO's reference pass runs once (rank 0) and every rank reads it; two DDP ranks follow one process with
    two accumulation steps; ZeRO-2 trains and resumes."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join((ROOT / "dataset/demo/dpo_demo.jsonl").read_text().splitlines(True)[:64]))
    single(args(corpus, tmp_path, "sft", data_path=corpus["sft"]), "train_full_sft.py")
    post = dict(data_path=pairs, init_from=tmp_path / "sft", preset=None, max_seq_len=128, learning_rate=1e-4)
    single(args(corpus, tmp_path, "single", batch_size=4, accumulation_steps=2, **post), "train_dpo.py")
    res = torchrun(2, args(corpus, tmp_path, "ddp", batch_size=4, **post), "train_dpo.py")
    assert "computed once" not in res.stderr  # the single-process run cached the reference for both
    a, b = losses(tmp_path / "single"), losses(tmp_path / "ddp")
    assert abs(a[0] - math.log(2)) < 1e-4 and max(abs(x - y) for x, y in zip(a, b)) <= 1e-5, (a, b)
    if importlib.util.find_spec("deepspeed") is not None:
        torchrun(2, args(corpus, tmp_path, "ds", batch_size=4, **post) + DS_BF16, "train_dpo.py")
        torchrun(2, args(corpus, tmp_path, "ds", batch_size=4, max_steps=8, resume=True, **post) + DS_BF16,
                 "train_dpo.py")
        assert [m["step"] for m in read_metrics(tmp_path / "ds")] == list(range(1, 9))


def test_grpo_under_ddp(corpus, tmp_path):
    """GRPO's groups stay on the rank that holds their prompt, and each row's sampling is keyed by (seed, step,
    prompt, member): two DDP ranks sample, score and learn what one process does with two accumulation steps."""
    prompts = tmp_path / "math.jsonl"
    prompts.write_text("".join((ROOT / "dataset/demo/math_train.jsonl").read_text().splitlines(True)[:32]))
    single(args(corpus, tmp_path, "sft", data_path=corpus["sft"]), "train_full_sft.py")
    post = dict(data_path=prompts, init_from=tmp_path / "sft", preset=None, max_seq_len=96, learning_rate=1e-3,
                num_generations=4, max_completion_tokens=12, sample_prompts="none", max_steps=4, beta=0.05)
    single(args(corpus, tmp_path, "single", batch_size=2, accumulation_steps=2, **post), "train_grpo.py")
    torchrun(2, args(corpus, tmp_path, "ddp", batch_size=2, **post), "train_grpo.py")
    a, b = read_metrics(tmp_path / "single"), read_metrics(tmp_path / "ddp")
    assert len(a) == len(b) == 4
    for key in ("reward", "completion_tokens", "reward_std"):  # the same completions, scored the same
        assert [m[key] for m in a] == pytest.approx([m[key] for m in b], abs=1e-6), key
    for key in ("loss", "kl"):
        assert max(abs(x[key] - y[key]) for x, y in zip(a, b)) <= 1e-5, key
    wa, wb = weights(tmp_path / "single"), weights(tmp_path / "ddp")
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=1e-5, rtol=0)
    if importlib.util.find_spec("deepspeed") is not None:  # rollouts from the engine's module, then resumed
        torchrun(2, args(corpus, tmp_path, "ds", batch_size=2, **{**post, "max_steps": 2}) + DS_BF16, "train_grpo.py")
        torchrun(2, args(corpus, tmp_path, "ds", batch_size=2, resume=True, **post) + DS_BF16, "train_grpo.py")
        assert [m["step"] for m in read_metrics(tmp_path / "ds")] == [1, 2, 3, 4]


def test_deepspeed_launcher_and_plain_python(corpus, tmp_path):
    pytest.importorskip("deepspeed")
    launcher = shutil.which("deepspeed")
    if launcher is None:
        pytest.skip("deepspeed launcher not on PATH")
    ds = ["--deepspeed", "launch/ds_zero2.json", "--max_steps", "2"]
    res = run([launcher, "--num_accelerators", "2", "train_pretrain.py", *args(corpus, tmp_path, "l", batch_size=4),
               *ds])
    assert '"world_size": 2' in res.stderr
    env_free = {k: v for k, v in ENV.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")}
    res = subprocess.run([sys.executable, "train_pretrain.py", *args(corpus, tmp_path, "p", batch_size=4), *ds],
                         cwd=ROOT, env=env_free, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]  # no launcher, no mpi4py: still a one-process run
    assert '"backend": "deepspeed"' in res.stderr


def test_existing_run_stops_every_rank_at_once(corpus, tmp_path):
    torchrun(2, args(corpus, tmp_path, "ddp", batch_size=4, max_steps=2))
    t0 = time.time()
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                          "train_pretrain.py", *args(corpus, tmp_path, "ddp", batch_size=4, max_steps=2)],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    # Every rank checks before any collective exists, so none waits for another: the first to get there stops, and
    # torchrun stops the others at once (a rank that started later may not have printed the error yet).
    assert res.returncode != 0 and res.stderr.count("already holds a run") >= 1
    assert "trainer_utils/" not in res.stderr and 'train_pretrain.py", line' not in res.stderr  # no crash of ours
    assert time.time() - t0 < 60  # nobody hangs


def test_srun_tasks_get_the_launchers_rendezvous(monkeypatch):
    """A plain `srun python train_pretrain.py` task derives RANK/WORLD_SIZE and the same MASTER_PORT that
    launch/slurm.py gives its tasks, so both launch paths meet on one port per job."""
    from launch.slurm import rendezvous_port
    from trainer_utils.distributed import detect_env
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "unset")  # recorded, so the test restores the environment afterwards
        monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("SLURM_JOB_ID", "12345")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "localhost")
    env = detect_env()
    assert (env.rank, env.local_rank, env.world_size, env.launcher) == (1, 1, 2, "slurm")
    assert (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"]) == ("1", "1", "2")
    assert os.environ["MASTER_PORT"] == str(rendezvous_port("12345")) == "32345"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_deepspeed_skips_a_step_without_targets(corpus, tmp_path, dtype):
    """DeepSpeed applies the same rule as the other backends: no target anywhere, no update. One rank, in its own
    process (DeepSpeed keeps process-wide state a second engine trips over). ZeRO skips the non-finite step
    itself, in fp32 (via the grad norm) and in bf16."""
    pytest.importorskip("deepspeed")
    from trainer_utils.distributed import _free_port
    env = {**ENV, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port())}
    argv = args(corpus, tmp_path, "ds", max_steps=1, batch_size=4, dtype=dtype) + ["--deepspeed",
                                                                                   "launch/ds_zero2.json"]
    code = (f"import json, sys; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]\n"
            "import pytest\nfrom conftest import train_through_an_empty_step\n"
            "with pytest.MonkeyPatch.context() as monkeypatch:\n"
            f"    out = train_through_an_empty_step({argv!r}, monkeypatch)\n"
            "print('RESULT', json.dumps(out))\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.split("RESULT ", 1)[1])
    assert out["weights_moved"] == [] and out["skipped"] == 1
    [record] = [r for r in out["records"] if "loss" in r]
    assert record["loss"] is None and record["skipped_steps"] == 1


@pytest.mark.parametrize("where,schedule", [
    ("throwaway", dict(warmup_steps=2, eval_interval=3, save_interval=3)),  # a warm-up too short to plan on
    ("first steps", dict(warmup_steps=10, eval_interval=6, save_interval=6)),  # planned on steps 1-5 at most
])
def test_a_time_budget_is_one_plan_for_every_rank(corpus, tmp_path, where, schedule):
    """The probe (a throwaway Trainer, or the run's own first steps) and the guard decide from all-reduced numbers:
    two ranks plan the same steps (here --max_steps bounds them, so the run is deterministic) and train what one
    process trains with --max_steps."""
    single(args(corpus, tmp_path, "single", batch_size=8, max_steps=12, **schedule))
    res = torchrun(2, args(corpus, tmp_path, "ddp", batch_size=4, max_steps=12, time_budget="25s", **schedule))
    assert res.stderr.count("time budget 25.0s: 12 steps at") == 1, res.stderr[-2000:]  # said once, by rank 0
    plan = json.loads((tmp_path / "ddp" / "train_config.json").read_text())["resolved"]["time_budget"]
    assert (plan["steps"], plan["limit"]) == (12, 12) and plan["check_every"] < 12  # the guard ran, on both ranks
    assert (plan["planned_at"] > 0) == (where == "first steps")
    a, b = losses(tmp_path / "single"), losses(tmp_path / "ddp")
    assert len(a) == len(b) == 12 and max(abs(x - y) for x, y in zip(a, b)) <= 1e-5, (a, b)


@pytest.mark.parametrize("warmup", [2, 10])  # measured on a throwaway Trainer, or on the run's first steps
def test_a_time_budget_below_max_steps_ends_every_rank_at_the_same_step(corpus, tmp_path, warmup):
    """Here the budget decides, not --max_steps: the probe's costs and the guard's numbers come from real clocks
    that differ between ranks, and rank 0 alone continues the sample prompts at each evaluation. A rank that
    planned or re-planned from its own numbers would end at another step and leave the other waiting in a
    collective (the 30 s --dist_timeout makes that a failure). The run ends, every rank at the planned step."""
    res = torchrun(2, args(corpus, tmp_path, "ddp", batch_size=4, max_steps=100_000, time_budget="30s",
                           eval_interval=20, save_interval=40, log_interval=10, dist_timeout=30, warmup_steps=warmup))
    plan = json.loads((tmp_path / "ddp" / "train_config.json").read_text())["resolved"]["time_budget"]
    assert plan["steps"] < plan["limit"] == 100_000 and (plan["planned_at"] > 0) == (warmup == 10)
    last = read_metrics(tmp_path / "ddp")[-1]["step"]
    replans = [r for r in strict_records(tmp_path / "ddp") if r.get("event") == "time_budget"]
    assert last == (replans[-1]["steps"] if replans else plan["steps"]), res.stderr[-2000:]
    assert latest_checkpoint(tmp_path / "ddp").name.endswith(f"step_{last:08d}")
