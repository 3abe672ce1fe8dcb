"""Shared pytest fixtures and helpers: tiny configs, deterministic seeding, small corpora, run metrics."""
from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# the project's library packages, lowest first (docs/layout.md; tests/test_imports.py checks the arrows between them)
PACKAGES = ("common", "model", "dataset", "evaluation", "export", "trainer_utils", "serving", "launch")

from model import ModelConfig, get_preset  # noqa: E402

# tqdm's default lock holds a multiprocessing RLock: a semaphore every process forked after it shares. A test
# process killed while holding it (mutmut forks one per mutant and kills those past its time limit) would leave
# every later one blocked on it for good, using no CPU, so never timed out. Progress bars in tests need a thread
# lock only.
tqdm.tqdm.set_lock(threading.RLock())


def tiny_config(style: str = "llama", **overrides) -> ModelConfig:
    """A 2-layer, d64 model: fast enough for logic tests. vocab 256 keeps softmaxes cheap. Styles: "llama",
    "qwen3" (Llama with QK-norm), "gpt2"."""
    base = dict(vocab_size=256, max_seq_len=64, max_position_embeddings=256)
    if style == "qwen3":
        base.update(qk_norm=True)
    if style == "gpt2":
        base.update(norm="layernorm", position_embedding="learned", mlp="gelu", bias=True,
                    num_key_value_heads=4)
    return get_preset("tiny", **{**base, **overrides})


def fake_cpu(monkeypatch, bf16: bool) -> None:
    """Make the precision policy see a CPU with (or without) native bf16, whatever this machine is."""
    from common import device
    caps = device.Capabilities("cpu", bf16, False, f"faked: {'native' if bf16 else 'no native'} bf16")
    monkeypatch.setattr(device, "cpu_capabilities", lambda: caps)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _tf32_restored():
    """A test (or a training run inside one) that turns CUDA TF32 on must not leave it on: later fp32 equality
    tests at 1e-4 would fail under TF32 on a GPU. Restored through the same switch the trainer sets."""
    saved = torch.backends.cuda.matmul.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture(scope="session")
def tokenizer():
    from dataset.tokenizer import Tokenizer
    return Tokenizer()  # the shipped default in model/tokenizer/


def write_jsonl(path: Path, records: list) -> Path:
    """Write records (dicts, or raw strings written verbatim) one per line."""
    import json
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n")
    return path


def demo_records(name: str, n: int) -> list[dict]:
    """The first n records of a bundled demo file (pretrain_demo.jsonl or sft_demo.jsonl)."""
    import json
    with open(ROOT / "dataset" / "demo" / name, encoding="utf-8") as f:
        return [json.loads(line) for _, line in zip(range(n), f)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Path]:
    """Small real training files (40 documents, 60 conversations) and a token cache shared by a test module."""
    d = tmp_path_factory.mktemp("corpus")
    return {"pretrain": write_jsonl(d / "pretrain.jsonl", demo_records("pretrain_demo.jsonl", 40)),
            "sft": write_jsonl(d / "sft.jsonl", demo_records("sft_demo.jsonl", 60)), "cache": d / "cache"}


@pytest.fixture(scope="module")
def sft_run(corpus, tmp_path_factory) -> Path:
    """A tiny SFT run (4 steps on the corpus conversations) for post-training to start from."""
    from test_train import flags

    import train_full_sft

    out = tmp_path_factory.mktemp("sft")
    assert train_full_sft.main(flags(corpus, out, "sft", data_path=corpus["sft"], max_steps=4)) == 0
    return out / "sft"


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory) -> dict[str, Path]:
    """The corpus fixture's documents and conversations split into two files each, to be mixed."""
    d = tmp_path_factory.mktemp("sources")
    pretrain, sft = demo_records("pretrain_demo.jsonl", 40), demo_records("sft_demo.jsonl", 60)
    return {"pretrain_a": write_jsonl(d / "first.jsonl", pretrain[:24]),
            "pretrain_b": write_jsonl(d / "second.jsonl", pretrain[24:]),
            "sft_a": write_jsonl(d / "chat_a.jsonl", sft[:40]), "sft_b": write_jsonl(d / "chat_b.jsonl", sft[40:]),
            "cache": d / "cache"}


def cli_flags(base: dict, **overrides) -> list[str]:
    """argv for a training script: {"max_steps": 4, "resume": True} -> ["--max_steps", "4", "--resume"]."""
    out: list[str] = []
    for key, value in {**base, **overrides}.items():
        if value is True:
            out.append(f"--{key}")
        elif value is not None and value is not False:
            out += [f"--{key}", str(value)]
    return out


def read_metrics(run_dir: Path) -> list[dict]:
    """The training-step records (those with a "loss") of a run's metrics.jsonl, in order."""
    with open(Path(run_dir) / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if "loss" in r]


def wait_for_metrics(run_dir: Path, lines: int, timeout_s: float = 120) -> bool:
    """Poll until a run's metrics.jsonl has `lines` lines (its process is training); False on time-out."""
    path = Path(run_dir) / "metrics.jsonl"
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= lines:
            return True
        time.sleep(0.2)
    return False


def strict_records(run_dir: Path) -> list[dict]:
    """Every record of metrics.jsonl, parsed as strict JSON (a bare NaN or Infinity fails the test)."""
    def reject(constant: str) -> None:
        pytest.fail(f"metrics.jsonl holds a bare {constant}, which strict JSON readers reject")
    with open(Path(run_dir) / "metrics.jsonl") as f:
        return [json.loads(line, parse_constant=reject) for line in f]


def train_through_an_empty_step(argv: list[str], monkeypatch) -> dict:
    """Train one step whose every target is masked (no valid target anywhere) with the training flags `argv`;
    return what a test checks: whether the weights and the optimizer state moved, and the run's records."""
    from common.tokens import IGNORE_INDEX
    from trainer_utils import loop
    from trainer_utils.data import StepFeeder
    from trainer_utils.stages import parse_train_config

    config = parse_train_config("pretrain", argv, "")
    session = loop.Session(config, "pretrain")
    try:
        trainer = loop.Trainer(session)
        before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        real = StepFeeder.next_step

        def no_targets(self):
            micro, n_input = real(self)
            return [(x, torch.full_like(y, IGNORE_INDEX)) for x, y in micro], n_input

        monkeypatch.setattr(StepFeeder, "next_step", no_targets)
        assert trainer.fit() == 0
        after = trainer.model.state_dict()
        return {"weights_moved": [k for k in before if not torch.equal(before[k], after[k])],
                # a skipped step may create the optimizer's state lazily, but leaves it all zero (Adam's step count,
                # moments, SGD's momentum buffer)
                "optimizer_moved": any(bool(torch.as_tensor(v).any()) for state in trainer.optimizer.state.values()
                                       for v in state.values()),
                "skipped": trainer.state.skipped, "records": strict_records(session.run_dir)}
    finally:
        session.backend.close()


@pytest.fixture(scope="session")
def reward_model(tmp_path_factory):
    """A tiny random Llama sequence-classification model with this project's tokenizer: a reward model directory
    as transformers writes one."""
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("reward_model")
    tok = transformers.AutoTokenizer.from_pretrained(ROOT / "model/tokenizer")
    config = transformers.LlamaConfig(vocab_size=6400, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, num_labels=1,
                                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    transformers.LlamaForSequenceClassification(config).save_pretrained(d)
    tok.save_pretrained(d)
    return d
