"""PocketLM's pretraining against MiniMind's own trainer at equal wall time, scored on held-out text.

    python bench/bench_vs_minimind.py --minimind ~/src/minimind --out out/vs-minimind \\
        --config default="" --config adamw="--optimizer adamw"

1. The corpus (--data, the bundled demo by default) is split: every --heldout_every-th document is held out and
   sorted into English and Chinese by its share of CJK characters; the first --train_docs of the others are the
   training file both trainers get.
2. MiniMind's `trainer/train_pretrain.py` (a copy of the --minimind checkout, so its ../out and ../checkpoints
   land under --out) trains one epoch over it on the CPU, at d512/L8, context 512, batch 8, no accumulation: one
   document per row, truncated and padded, as it always does. Its wall time, process start to exit, is the
   budget.
3. Each --config is `train_pretrain.py --preset minimind-26m --batch_size 8 --max_seq_len 512` on the same file
   with `--time_budget` = that wall time (so its process, set-up and checkpoints included, ends within it), plus
   the config's flags.
4. Every model is scored the same way on the held-out files: each document alone, led by the model's own
   document-start token, cut into windows of 512 predicted tokens; bits per byte = the summed negative
   log-likelihood of all the document's tokens, in bits, over the UTF-8 bytes of its text. Two tokenizers count
   different tokens, so bits per byte is what compares.

Throughput is the steady training rate: text tokens a second (MiniMind: the non-padding tokens of its rows;
PocketLM: the targets its run counted, every position since it packs, at whatever batch and accumulation a config
sets) and, comparable across tokenizers, text bytes a second.

Writes --out/results.json and --out/results.md. A leg already measured (--out/legs/NAME.json) is reused unless
--again; delete it to measure it afresh. Runs one process at a time: in parallel they would share the cores.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.portable import portable  # noqa: E402
from common.device import cpu_description  # noqa: E402
from common.errors import DataError  # noqa: E402
from common.files import METRICS_NAME  # noqa: E402
from dataset.jsonl import read_records  # noqa: E402
from dataset.tokenizer import Tokenizer  # noqa: E402
from model import load_model  # noqa: E402
from model.inference import split_windows  # noqa: E402
from model.loading import resolve_model_dir  # noqa: E402

DEMO = ROOT / "dataset" / "demo" / "pretrain_demo.jsonl"
SHAPE = ["--hidden_size", "512", "--num_hidden_layers", "8", "--max_seq_len", "512", "--batch_size", "8"]
SEQ = 512
CJK = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]")
ZH_SHARE = 0.3  # a document with more than this share of CJK characters counts as Chinese
STEP_LINE = re.compile(r"\((\d+)/(\d+)\), loss: ([0-9.]+)")  # MiniMind's log: Epoch:[1/1](k/N), loss: x, ...


@dataclass
class Leg:
    """One trained model: how long it ran, what it trained on per second, and its held-out bits per byte."""

    name: str
    command: str
    wall_s: float
    steps: int
    step_s: float  # steady seconds a step
    tokens_per_s: float  # text tokens a second (its own tokenizer's)
    bytes_per_s: float  # text bytes a second
    bpb: dict[str, float] = field(default_factory=dict)  # held-out file's language -> bits per byte
    final_loss: float | None = None


def split(data: Path, out: Path, train_docs: int, every: int) -> tuple[Path, dict[str, Path]]:
    """Write the training file and the held-out files (one per language); return their paths."""
    texts = [record["text"] for _, record in read_records(data, "text")]  # a bad line: DataError naming it
    held = {"en": [], "zh": []}
    train = []
    for i, text in enumerate(texts):
        if i % every == every - 1:
            held["zh" if len(CJK.findall(text)) > ZH_SHARE * max(len(text), 1) else "en"].append(text)
        elif len(train) < train_docs:
            train.append(text)
    out.mkdir(parents=True, exist_ok=True)

    def write(path: Path, docs: list[str]) -> Path:
        path.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in docs), encoding="utf-8")
        return path

    return write(out / "train.jsonl", train), {k: write(out / f"heldout-{k}.jsonl", v) for k, v in held.items()}


def read_texts(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@torch.inference_mode()
def bits_per_byte(logits_of: Callable[[torch.Tensor], torch.Tensor], encode: Callable[[str], list[int]],
                  start_id: int, texts: Sequence[str]) -> float:
    """Bits per UTF-8 byte of `texts`, each document alone after `start_id`, in windows of SEQ predictions."""
    nats, n_bytes = 0.0, 0
    for text in texts:
        ids = [start_id] + encode(text)
        for window, _ in split_windows(ids, [True] * len(ids), SEQ):
            x = torch.tensor([window[:-1]])
            logp = torch.log_softmax(logits_of(x)[0].float(), -1)
            nats -= logp.gather(1, torch.tensor(window[1:])[:, None]).sum().item()
        n_bytes += len(text.encode("utf-8"))
    return nats / math.log(2) / n_bytes


def steady(times: list[tuple[int, float]]) -> float:
    """Median seconds a step between consecutive (step, time) records, the first two steps left out where
    enough remain (a short run keeps them)."""
    late = [(s, t) for s, t in times if s > 2]
    times = late if len(late) >= 3 else times
    gaps = [(t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in zip(times, times[1:]) if s1 > s0]
    if not gaps:
        raise SystemExit("error: too few logged steps to time a steady step")
    return statistics.median(gaps)


def run_minimind(checkout: Path, train: Path, out: Path, threads: int) -> Leg:
    """MiniMind's trainer, one epoch over `train`, in a copy of `checkout` under `out`."""
    work = out / "minimind"
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(checkout, work, ignore=shutil.ignore_patterns(".git", "images", "out", "checkpoints"))
    save = work / "out"
    save.mkdir()
    (work / "checkpoints").mkdir()
    cmd = [sys.executable, "train_pretrain.py", "--data_path", str(train.resolve()), "--device", "cpu", *SHAPE,
           "--accumulation_steps", "1", "--epochs", "1", "--num_workers", "0", "--log_interval", "1",
           "--save_interval", "1000000", "--save_dir", str(save.resolve())]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads)}
    print(f"[minimind] {shlex.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    times: list[tuple[int, float]] = []
    losses: list[float] = []
    with subprocess.Popen(cmd, cwd=work / "trainer", env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as proc, open(out / "minimind.log", "w") as log:
        for line in proc.stdout:
            log.write(line)
            if m := STEP_LINE.search(line):
                times.append((int(m[1]), time.perf_counter() - t0))
                losses.append(float(m[3]))
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"error: MiniMind's trainer exited {proc.returncode}; see {out / 'minimind.log'}")
    tok = minimind_tokenizer(work)
    # what a row of its dataset holds: <bos> text[:SEQ - 2 tokens] <eos>, then padding
    rows = [tok(t, add_special_tokens=False, max_length=SEQ - 2, truncation=True).input_ids for t in read_texts(train)]
    tokens = sum(len(r) + 2 for r in rows)
    text_bytes = sum(len(tok.decode(r).encode("utf-8")) for r in rows)
    step_s = steady(times)
    per_step = len(rows) / len(times)  # documents a step
    return Leg("MiniMind", shlex.join(map(portable, cmd)), wall, len(times), step_s,
               tokens / len(rows) * per_step / step_s, text_bytes / len(rows) * per_step / step_s,
               final_loss=losses[-1])


def minimind_tokenizer(work: Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(work / "model"))


def score_minimind(work: Path, held: dict[str, Path]) -> dict[str, float]:
    """Held-out bits per byte of the model MiniMind's trainer saved (fp16 weights, scored in fp32)."""
    # MiniMind's model file, loaded by path: its package is also called `model`
    spec = importlib.util.spec_from_file_location("model_minimind", work / "model" / "model_minimind.py")
    mm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mm)
    model = mm.MiniMindForCausalLM(mm.MiniMindConfig(hidden_size=512, num_hidden_layers=8))
    weights = torch.load(work / "out" / "pretrain_512.pth", map_location="cpu")
    model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    model.eval()
    tok = minimind_tokenizer(work)
    return {lang: bits_per_byte(lambda x: model(x).logits, lambda t: tok(t, add_special_tokens=False).input_ids,
                                tok.bos_token_id, read_texts(path)) for lang, path in held.items()}


def run_pocketlm(name: str, flags: str, train: Path, out: Path, budget_s: float, threads: int) -> Leg:
    """train_pretrain.py on `train` with --time_budget budget_s plus `flags`."""
    runs = out / "runs"
    cmd = [sys.executable, "train_pretrain.py", "--preset", "minimind-26m", *SHAPE[-4:], "--data_path",
           str(train.resolve()), "--time_budget", f"{budget_s:.0f}s", "--out_dir", str(runs.resolve()),
           "--run_name", name, "--overwrite", "--log_interval", "1", *shlex.split(flags)]
    print(f"[{name}] {shlex.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    with open(out / f"{name}.log", "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": str(threads)}).returncode
    wall = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"error: {name} exited {rc}; see {out / f'{name}.log'}")
    records = [json.loads(line) for line in (runs / name / METRICS_NAME).read_text().splitlines()]
    steps = [r for r in records if "tokens_seen" in r]
    losses = [r["loss"] for r in steps if "loss" in r]
    step_s, tokens_per_s = training_rate(steps)
    tok = Tokenizer(resolve_model_dir(runs / name))
    texts = read_texts(train)
    bytes_per_token = sum(len(t.encode("utf-8")) for t in texts) / sum(len(tok.encode(t)) + 1 for t in texts)
    return Leg(name, shlex.join(map(portable, cmd)), wall, steps[-1]["step"], step_s, tokens_per_s,
               tokens_per_s * bytes_per_token,
               final_loss=losses[-1] if losses else None)


def training_rate(steps: list[dict]) -> tuple[float, float]:
    """Steady seconds a step and tokens a second from a run's step records (step, elapsed_s, tokens_seen).

    Tokens a step come from the run's own count, so a config's batch size or accumulation is counted as trained."""
    step_s = steady([(r["step"], r["elapsed_s"]) for r in steps])
    tokens_per_step = (steps[-1]["tokens_seen"] - steps[0]["tokens_seen"]) / (steps[-1]["step"] - steps[0]["step"])
    return step_s, tokens_per_step / step_s


def score_pocketlm(run_dir: Path, held: dict[str, Path]) -> dict[str, float]:
    model, model_dir = load_model(run_dir)
    tok = Tokenizer(model_dir)
    return {lang: bits_per_byte(model, tok.encode, tok.eot_id, read_texts(path)) for lang, path in held.items()}


def table(legs: list[Leg]) -> str:
    base = legs[0]
    lines = ["| trainer | wall s | steps | s/step | text tokens/s | text bytes/s | bytes/s vs MiniMind | "
             + " | ".join(f"held-out bpb {k} (vs MiniMind)" for k in base.bpb) + " |",
             "|---|--:|--:|--:|--:|--:|--:|" + "--:|" * len(base.bpb)]
    for leg in legs:
        cells = [f"{leg.bpb[k]:.4f} ({leg.bpb[k] / base.bpb[k] - 1:+.1%})" for k in base.bpb]
        lines.append(f"| {leg.name} | {leg.wall_s:.0f} | {leg.steps} | {leg.step_s:.2f} | {leg.tokens_per_s:,.0f} | "
                     f"{leg.bytes_per_s:,.0f} | {leg.bytes_per_s / base.bytes_per_s:.2f}x | " + " | ".join(cells)
                     + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minimind", type=Path, required=True, help="a MiniMind checkout (trainer/train_pretrain.py)")
    p.add_argument("--data", type=Path, default=DEMO)
    p.add_argument("--train_docs", type=int, default=776, help="documents in the training file")
    p.add_argument("--heldout_every", type=int, default=20, help="hold out every N-th document")
    p.add_argument("--config", action="append", default=[], metavar='NAME="FLAGS"',
                   help="a PocketLM configuration: train_pretrain.py flags over the default (repeatable; "
                        "default: one, named default, with no flags)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--again", action="store_true", help="measure every leg afresh")
    p.add_argument("--out", type=Path, default=Path("out/vs-minimind"))
    args = p.parse_args()
    if not (args.minimind / "trainer" / "train_pretrain.py").is_file():
        raise SystemExit(f"error: {args.minimind}: no trainer/train_pretrain.py (expected a MiniMind checkout)")
    configs = dict(c.split("=", 1) if "=" in c else (c, "") for c in args.config) or {"default": ""}
    try:
        train, held = split(args.data, args.out, args.train_docs, args.heldout_every)
    except DataError as e:
        raise SystemExit(f"error: {e}") from None
    (args.out / "legs").mkdir(parents=True, exist_ok=True)

    def leg(name: str, measure: Callable[[], Leg]) -> Leg:
        path = args.out / "legs" / f"{name}.json"
        if path.is_file() and not args.again:
            return Leg(**json.loads(path.read_text()))
        result = measure()
        path.write_text(json.dumps(asdict(result), indent=1))
        print(f"[{name}] {json.dumps(asdict(result))}", flush=True)
        return result

    def minimind() -> Leg:
        result = run_minimind(args.minimind, train, args.out, args.threads)
        result.bpb = score_minimind(args.out / "minimind", held)
        return result

    def ours(name: str, flags: str, budget_s: float) -> Leg:
        result = run_pocketlm(name, flags, train, args.out, budget_s, args.threads)
        result.bpb = score_pocketlm(args.out / "runs" / name, held)
        return result

    legs = [leg("MiniMind", minimind)]
    legs += [leg(name, lambda n=name, f=flags: ours(n, f, legs[0].wall_s)) for name, flags in configs.items()]
    report = {"machine": cpu_description(), "cores": os.cpu_count(), "threads": args.threads,
              "data": portable(args.data), "train_docs": args.train_docs,
              "heldout_docs": {k: len(read_texts(v)) for k, v in held.items()}, "legs": [asdict(x) for x in legs]}
    (args.out / "results.json").write_text(json.dumps(report, indent=1, ensure_ascii=False))
    (args.out / "results.md").write_text(table(legs) + "\n")
    print(table(legs))


if __name__ == "__main__":
    main()
