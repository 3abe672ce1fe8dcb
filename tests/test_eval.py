"""eval_model.py and scripts/plot_metrics.py: generation, chat, perplexity, probes, errors, plotting.

Run directories are built by hand in the trainer's layout (`latest` -> checkpoints/step_XXXXXXXX with weights,
config, tokenizer files and train_info.json), with a tiny randomly initialised model.
"""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import eval_model
from dataset.tokenizer import DEFAULT_TOKENIZER_DIR
from model import CheckpointError, PocketLM, generate, load_model, save_model
from model.config import parse_rope_scaling
from model.inference import (
    PerplexityStats,
    StreamDecoder,
    fit_chat,
    keep_recent,
    pack_documents,
    read_train_info,
    score_windows,
    split_windows,
    stream_generate,
    token_byte_lengths,
)

from conftest import ROOT, tiny_config, write_jsonl

GREEDY = ["--temperature", "0", "--max_new_tokens", "12", "--device", "cpu", "--dtype", "float32"]


def make_run(root: Path, stage: str, seed: int) -> Path:
    """A run dir as the trainer writes it, holding one checkpoint of a tiny vocab-6400 model."""
    torch.manual_seed(seed)
    # A larger init than training's 0.02 makes greedy output depend visibly on the prompt (not one repeated token).
    model = PocketLM(tiny_config(vocab_size=6400, initializer_range=0.3))
    ckpt = save_model(model, root / "checkpoints" / "step_00000200", tokenizer_dir=DEFAULT_TOKENIZER_DIR)
    info = {"stage": stage, "step": 200, "tokens_seen": 12800, "val_loss": None}
    (ckpt / "train_info.json").write_text(json.dumps(info))
    (root / "latest").write_text("checkpoints/step_00000200\n")
    return root


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("runs")
    # The SFT run's name says "pretrain": the stage must come from train_info.json, never from the path.
    return {"pretrain": make_run(base / "pt", "pretrain", 1), "sft": make_run(base / "pretrain-named-sft", "sft", 2)}


# Batched, padded windows run other matmul shapes than one window at a time, so fp32 rounding differs by a few
# parts per million, by how much depending on the CPU's kernels (5e-6 relative has been seen).
BATCHED_REL = 2e-5


def _eval(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "eval_model.py", *args], cwd=ROOT, capture_output=True, text=True,
                          input=stdin, timeout=120)


def _greedy_reply(run: Path, ids: list[int], eos: list[int], tok) -> str:
    """What eval_model should print for one prompt: greedy ids decoded, an unfinished character dropped."""
    model, _ = load_model(run)
    new = generate(model, [ids], max_new_tokens=12, temperature=0, repetition_penalty=1.1, eos_token_ids=eos,
                   pad_token_id=tok.pad_id)[0]
    return tok.decode(new).rstrip("\ufffd")


# ------------------------------------------------------------------------- generation
def test_prompt_ids_use_chat_template_only_for_sft(tokenizer):
    sft = tokenizer.prompt_ids("hello", chat=True, system="be brief")
    assert sft[0] == tokenizer.im_start_id == 1
    assert sft == tokenizer.chat_prompt([{"role": "system", "content": "be brief"},
                                         {"role": "user", "content": "hello"}])
    pretrain = tokenizer.prompt_ids("hello", chat=False)
    assert pretrain == tokenizer.encode("hello") and tokenizer.im_start_id not in pretrain
    assert tokenizer.prompt_ids("", chat=False) == [tokenizer.eot_id]  # empty prompt = start of a document


@pytest.mark.slow  # starts a process
@pytest.mark.parametrize("stage", ["pretrain", "sft"])
def test_prompt_generates_what_the_stage_calls_for(runs, tokenizer, stage):
    res = _eval("--checkpoint", str(runs[stage]), "--prompt", "Once upon a time", *GREEDY)
    assert res.returncode == 0, res.stderr
    assert f"prompt format {'chat' if stage == 'sft' else 'text'}" in res.stderr
    ids = tokenizer.prompt_ids("Once upon a time", chat=stage == "sft")
    eos = [tokenizer.im_end_id, tokenizer.eot_id] if stage == "sft" else [tokenizer.eot_id]
    shown = ">>> Once upon a time\n" if stage == "sft" else "Once upon a time"  # question / text continued
    assert res.stdout == shown + _greedy_reply(runs[stage], ids, eos, tokenizer) + "\n"


def test_long_prompt_keeps_the_most_recent_tokens(runs, capsys):
    # tiny: max_position_embeddings 256, so 250 new tokens leave 6 prompt tokens.
    assert eval_model.main(["--checkpoint", str(runs["pretrain"]), "--prompt", "word " * 50, "--temperature", "0",
                            "--max_new_tokens", "250"]) == 0
    err = capsys.readouterr().err
    assert "note: prompt too long" in err and "kept the last 6" in err


@pytest.mark.slow  # starts a process
def test_chat_streams_replies_and_reset_clears_history(runs, tokenizer):
    res = _eval("--checkpoint", str(runs["sft"]), "--chat", *GREEDY, stdin="hello\n/reset\nhi\n")
    assert res.returncode == 0, res.stderr
    assert "history cleared" in res.stderr
    eos = [tokenizer.im_end_id, tokenizer.eot_id]
    first = _greedy_reply(runs["sft"], tokenizer.chat_prompt([{"role": "user", "content": "hello"}]), eos, tokenizer)
    # After /reset the second turn is prompted alone, not after the first exchange.
    second = _greedy_reply(runs["sft"], tokenizer.chat_prompt([{"role": "user", "content": "hi"}]), eos, tokenizer)
    assert res.stdout == f"{first}\n{second}\n"
    with_history = _greedy_reply(runs["sft"], tokenizer.chat_prompt(
        [{"role": "user", "content": "hello"}, {"role": "assistant", "content": first},
         {"role": "user", "content": "hi"}]), eos, tokenizer)
    assert with_history != second  # so the check above really tells a reset from a kept history


@pytest.mark.slow  # starts a process
def test_probes_print_each_prompt_with_its_completion(runs, tmp_path):
    probes = tmp_path / "probes.txt"
    probes.write_text("# capitals\nThe capital of France is\tParis\n\n中国的首都是\n", encoding="utf-8")
    res = _eval("--checkpoint", str(runs["pretrain"]), "--probes", str(probes), *GREEDY)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(">>> The capital of France is\n")
    assert ">>> 中国的首都是\n" in res.stdout and "capitals" not in res.stdout
    # a probe line (prompt<TAB>expected) is also scored; a plain prompt is only continued
    scored = [line for line in res.stdout.splitlines() if line.startswith(("[correct]", "[wrong]"))]
    assert len(scored) == 1 and "expected 'Paris'" in scored[0] and "logprob -" in scored[0] and "rank " in scored[0]


def test_stream_decoder_never_splits_a_character(tokenizer):
    text = "你好，世界！龘靐齉 PocketLM 🙂 test"
    ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # some character really spans several tokens
    decoder = StreamDecoder(tokenizer.decode)
    pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text
    cut = StreamDecoder(tokenizer.decode)  # generation stopped inside a character: the fragment is dropped
    partial = tokenizer.encode("龘")
    assert len(partial) > 1 and [cut.push(i) for i in partial[:-1]] == [""] * (len(partial) - 1)
    assert cut.flush() == ""
    assert cut.flush() == "" and cut.push(tokenizer.encode("a")[0]) == "a"  # the dropped fragment is gone


def test_stream_generate_streams_the_first_row_only_while_it_is_active():
    model = PocketLM(tiny_config(initializer_range=0.3)).eval()  # varied greedy output
    prompts = [[5, 6, 7], [9, 8]]
    decode = lambda ids: "".join(f"<{i}>" for i in ids)  # noqa: E731 - every id is one complete piece
    free = generate(model, prompts, max_new_tokens=8, temperature=0)
    # an EOS that stops row 0 after a few tokens and never occurs in row 1
    stop = [k for k in range(1, 6) if free[0][k] not in free[0][:k] + free[1]]
    if not stop:
        pytest.skip("random model gives no usable stop token")
    k = stop[0]
    shown: list[str] = []
    new = stream_generate(model, prompts, decode, on_text=shown.append, max_new_tokens=8, temperature=0,
                          eos_token_ids=[free[0][k]], pad_token_id=0)
    assert new == [free[0][:k], free[1]]  # row 0 stopped, row 1 went on
    assert "".join(shown) == decode(new[0]) and len(shown) == k  # nothing after row 0 finished


def test_fit_chat_drops_oldest_exchanges_but_keeps_the_system_prompt():
    def encode(messages):  # one "token" per character of content
        return [0] * sum(len(m["content"]) for m in messages)

    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "aaaa"},
            {"role": "assistant", "content": "bbbb"}, {"role": "user", "content": "cc"}]
    kept, ids, dropped = fit_chat(msgs, encode, budget=5)
    assert kept == [msgs[0], msgs[3]] and dropped == 2 and len(ids) == 3
    # Dropping the old question alone would fit (7 tokens) but leave a history opening with an answer.
    kept, ids, dropped = fit_chat(msgs, encode, budget=7)
    assert kept == [msgs[0], msgs[3]] and dropped == 2 and len(ids) == 3
    kept, ids, dropped = fit_chat(msgs[:1] + [{"role": "user", "content": "x" * 20}], encode, budget=5)
    assert len(ids) == 21 and dropped == 0  # the newest turn stays; the caller left-truncates its ids
    assert keep_recent([1, 2, 3, 4], 2) == ([3, 4], 2)


# ------------------------------------------------------------------------- perplexity
def _parse_ppl(stdout: str) -> dict[str, float]:
    m = re.search(r"ppl (\S+) \| bits/byte (\S+) \| loss (\S+) nats/token \| (\d+) \S+( tokens)?, (\d+) bytes", stdout)
    assert m, stdout
    return {"ppl": float(m[1]), "bpb": float(m[2]), "loss": float(m[3]), "tokens": int(m[4]), "bytes": int(m[6])}


@pytest.mark.slow  # starts a process
def test_ppl_on_text_matches_an_independent_computation(runs, tokenizer, tmp_path):
    texts = ["The quick brown fox jumps over the lazy dog. " * 4, "你好，世界。今天天气很好，我们去公园散步吧。",
             "Short one.", "Perplexity is the exponential of the mean negative log-likelihood per token. " * 2]
    data = write_jsonl(tmp_path / "val.jsonl", [{"text": t} for t in texts])
    res = _eval("--checkpoint", str(runs["pretrain"]), "--ppl", str(data), "--device", "cpu")
    assert res.returncode == 0, res.stderr
    got = _parse_ppl(res.stdout)

    # Reference: the <|endoftext|>-joined stream in windows of max_seq_len + 1 sharing boundary tokens (the
    # training layout), one forward per window, plain cross entropy.
    model, _ = load_model(runs["pretrain"])
    L = model.config.max_seq_len
    stream = [i for t in texts for i in tokenizer.encode(t) + [tokenizer.eot_id]]
    assert len(stream) > 2 * L  # several windows are exercised
    nats, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(stream) - 1, L):
            w = torch.tensor(stream[start:start + L + 1])
            nats += F.cross_entropy(model(w[None, :-1])[0], w[1:], reduction="sum").item()
            count += len(w) - 1
    assert count == len(stream) - 1 == got["tokens"]  # every token but the first is predicted once
    # Scored bytes: all text bytes except the unscored first token's (<|endoftext|> stands for none).
    n_bytes = sum(len(t.encode()) for t in texts) - len(tokenizer.decode(stream[:1]).encode())
    assert got["bytes"] == n_bytes
    assert got["loss"] == pytest.approx(nats / count, rel=BATCHED_REL)
    assert got["ppl"] == pytest.approx(math.exp(got["loss"]), rel=1e-5)  # the same loss, exponentiated
    assert got["bpb"] == pytest.approx(nats / 0.6931471805599453 / n_bytes, abs=1e-4)


def test_ppl_with_rope_scaling_scores_windows_of_the_scaled_context(runs, tokenizer, tmp_path, capsys):
    """--rope_scaling yarn:2 scores in windows of twice the training context (64) with the scaled model, and
    --ppl_window picks other lengths up to it."""
    texts = ["The quick brown fox jumps over the lazy dog. " * 30, "你好，世界。今天天气很好，我们去公园散步吧。" * 10]
    data = write_jsonl(tmp_path / "long.jsonl", [{"text": t} for t in texts])
    flags = ["--checkpoint", str(runs["pretrain"]), "--ppl", str(data), "--device", "cpu", "--dtype", "float32"]
    assert eval_model.main([*flags, "--rope_scaling", "yarn:2"]) == 0
    out = capsys.readouterr()
    assert "128-token windows" in out.out and "RoPE yarn x2 (trained at 64 tokens)" in out.err
    got = _parse_ppl(out.out)

    stream = [i for t in texts for i in tokenizer.encode(t) + [tokenizer.eot_id]]
    assert len(stream) > 3 * 128  # several windows, each past the training context

    def loss(model, L: int) -> float:  # one forward per window of L inputs, as the training layout
        nats = 0.0
        with torch.no_grad():
            for start in range(0, len(stream) - 1, L):
                w = torch.tensor(stream[start:start + L + 1])
                nats += F.cross_entropy(model(w[None, :-1])[0], w[1:], reduction="sum").item()
        return nats / (len(stream) - 1)

    scaled, _ = load_model(runs["pretrain"], rope_scaling=parse_rope_scaling("yarn:2"))
    assert got["tokens"] == len(stream) - 1
    assert got["loss"] == pytest.approx(loss(scaled, 128), rel=BATCHED_REL)
    unscaled, _ = load_model(runs["pretrain"])
    assert abs(loss(unscaled, 128) - got["loss"]) > 100 * BATCHED_REL * got["loss"]  # the scaling was applied

    assert eval_model.main([*flags, "--rope_scaling", "yarn:2", "--ppl_window", "96"]) == 0
    assert "96-token windows" in capsys.readouterr().out
    assert eval_model.main([*flags, "--rope_scaling", "yarn:2", "--ppl_window", "129"]) == 2
    assert "--ppl_window 129 is beyond the model's max_position_embeddings (128)" in capsys.readouterr().err
    # without scaling, windows past the training context are scored, with a note that RoPE extrapolates there
    assert eval_model.main([*flags, "--ppl_window", "128"]) == 0
    out = capsys.readouterr()
    assert _parse_ppl(out.out)["loss"] == pytest.approx(loss(unscaled, 128), rel=BATCHED_REL)
    assert "longer than the training context (64) and RoPE is not scaled" in out.err


def test_rope_scaling_flag_errors_come_before_loading(runs, capsys):
    for args, message in ((["--rope_scaling", "yarn"], "--rope_scaling 'yarn': expected TYPE:FACTOR"),
                          (["--ppl_window", "64", "--prompt", "x"], "--ppl_window: only with --ppl")):
        assert eval_model.main(["--checkpoint", str(runs["pretrain"].parent / "missing"), *args]) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and message in errors[0], errors


@pytest.mark.slow  # starts a process
def test_ppl_on_conversations_scores_only_assistant_tokens(runs, tokenizer, tmp_path):
    convs = [[{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": " Hello! 你好 "}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
              {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
              {"role": "assistant", "content": "六 (six)"}]]
    data = write_jsonl(tmp_path / "sft.jsonl", [{"conversations": c} for c in convs])
    res = _eval("--checkpoint", str(runs["sft"]), "--ppl", str(data), "--device", "cpu")
    assert res.returncode == 0, res.stderr
    got = _parse_ppl(res.stdout)

    model, _ = load_model(runs["sft"])
    nats, count = 0.0, 0
    with torch.no_grad():
        for conv in convs:
            ids, labelled, _ = tokenizer.encode_chat(conv)
            assert len(ids) <= model.config.max_seq_len + 1  # one window each
            x, y = torch.tensor(ids[:-1]), torch.tensor(ids[1:])
            mask = torch.tensor(labelled[1:])
            nats += F.cross_entropy(model(x[None])[0][mask], y[mask], reduction="sum").item()
            count += int(mask.sum())
    n_bytes = sum(len(t["content"].strip().encode()) for c in convs for t in c if t["role"] == "assistant")
    assert (got["tokens"], got["bytes"]) == (count, n_bytes)
    assert got["loss"] == pytest.approx(nats / count, rel=BATCHED_REL)
    assert got["bpb"] == pytest.approx(nats / 0.6931471805599453 / n_bytes, abs=1e-4)
    first = _eval("--checkpoint", str(runs["sft"]), "--ppl", str(data), "--limit", "1", "--device", "cpu")
    assert first.returncode == 0, first.stderr
    assert _parse_ppl(first.stdout)["bytes"] == len("Hello! 你好".encode())  # the first record alone
    assert "1 records from" in first.stdout


def test_token_byte_lengths_and_windows(tokenizer):
    lengths = token_byte_lengths(DEFAULT_TOKENIZER_DIR, 6400)
    text = "Bytes: 你好 🙂 café <|im_end|>"  # special-token text in content is ordinary text
    assert int(lengths[tokenizer.encode(text)].sum()) == len(text.encode())
    assert int(lengths[[tokenizer.eot_id, tokenizer.im_start_id, tokenizer.im_end_id]].sum()) == 0
    windows = [w for w, _ in pack_documents([[1, 2, 3], [4, 5], [6]], 2)]
    assert windows == [[1, 2, 3], [3, 4, 5], [5, 6]]
    # a lone leftover id was the previous window's last target: no window of one id
    assert [w for w, _ in pack_documents([[1, 2, 3], [4, 5]], 2)] == [[1, 2, 3], [3, 4, 5]]
    # split_windows: windows of length + 1 sharing their boundary id, flags cut alongside
    ids, scored = list(range(10)), [i % 3 == 0 for i in range(10)]
    got = list(split_windows(ids, scored, 4))
    assert [w for w, _ in got] == [[0, 1, 2, 3, 4], [4, 5, 6, 7, 8], [8, 9]]
    assert [f for _, f in got] == [scored[0:5], scored[4:9], scored[8:10]]
    assert list(split_windows([7], [True], 4)) == []  # nothing to predict


def test_score_windows_computes_the_loss_in_fp32_for_a_bf16_model():
    model = PocketLM(tiny_config()).to(torch.bfloat16).eval()
    windows = [(torch.randint(0, 256, (65,)).tolist(), [True] * 65) for _ in range(6)]
    stats = score_windows(model, windows, torch.ones(256, dtype=torch.long), batch_size=4)
    with torch.no_grad():
        x = torch.tensor([w[:-1] for w, _ in windows])
        y = torch.tensor([w[1:] for w, _ in windows])
        nats = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten(), reduction="sum").item()
    assert isinstance(stats, PerplexityStats) and stats.tokens == stats.bytes == 6 * 64
    assert stats.nats == pytest.approx(nats, rel=1e-5)  # a bf16 loss would be off by ~1e-3


def test_read_train_info(tmp_path):
    assert read_train_info(tmp_path) == {"prompt_format": "text"}
    (tmp_path / "train_info.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="train_info.json"):
        read_train_info(tmp_path)
    (tmp_path / "train_info.json").write_text('{"stage": "rlhf"}')
    with pytest.raises(CheckpointError, match="prompt_format.*'rlhf'"):
        read_train_info(tmp_path)
    (tmp_path / "train_info.json").write_text('{"prompt_format": "chat", "method": "dpo"}')
    assert read_train_info(tmp_path)["prompt_format"] == "chat"


@pytest.mark.parametrize("stage, prompt_format", [("pretrain", "text"), ("sft", "chat")])
def test_checkpoints_written_before_prompt_format_keep_loading(tmp_path, stage, prompt_format):
    """Older checkpoints named the prompt format by the stage that wrote it."""
    (tmp_path / "train_info.json").write_text(json.dumps({"stage": stage, "step": 4}))
    assert read_train_info(tmp_path)["prompt_format"] == prompt_format


# ----------------------------------------------------------------------------- errors
@pytest.mark.slow  # starts a process
def test_bad_input_is_one_error_line_and_exit_2(runs, tmp_path, capsys):
    (tmp_path / "not_a_model").mkdir()
    (tmp_path / "not_a_model" / "notes.txt").write_text("hi")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\n{"text": \n')
    bad_info = make_run(tmp_path / "bad_info", "sft", 3)
    (bad_info / "checkpoints" / "step_00000200" / "train_info.json").write_text("[]")
    cases = {
        "no such file": ["--checkpoint", str(tmp_path / "missing"), "--prompt", "x"],
        "expected a PocketLM run or model directory": ["--checkpoint", str(tmp_path / "not_a_model"),
                                                       "--prompt", "x"],
        "nope.jsonl: no such file": ["--checkpoint", str(runs["pretrain"]), "--ppl", str(tmp_path / "nope.jsonl")],
        "broken.jsonl:2: invalid JSON": ["--checkpoint", str(runs["pretrain"]), "--ppl", str(broken)],
        "train_info.json": ["--checkpoint", str(bad_info), "--prompt", "x"],
    }
    for expected, args in cases.items():  # in-process: an escaping exception would fail the test
        assert eval_model.main(args) == 2, args
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and expected in errors[0], errors
    res = _eval("--checkpoint", str(tmp_path / "missing"), "--chat")  # and once as a real process
    assert res.returncode == 2 and res.stderr.startswith("error:") and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("device,message", [("cuda:0", "CUDA is not available"), ("tpu9", "--device tpu9")])
def test_unusable_device_is_a_usage_error_in_every_script(runs, tmp_path, capsys, device, message):
    """One check (model.inference.resolve_device) serves evaluation and training alike."""
    if device.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert eval_model.main(["--checkpoint", str(runs["pretrain"]), "--prompt", "x", "--device", device]) == 2
    assert f"error: --device {device}" in capsys.readouterr().err
    import train_pretrain
    # rejected with the flags, before any data is prepared
    assert train_pretrain.main(["--preset", "tiny", "--device", device, "--cache_dir", str(tmp_path / "cache")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith(f"error: --device {device}") and len(err.splitlines()) == 1
    assert not (tmp_path / "cache").exists()


# --------------------------------------------------------------------------- plotting
@pytest.mark.slow  # starts a process
def test_plot_metrics_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    lines = []
    for step in range(1, 41):
        lines.append({"step": step, "loss": 8.0 / step ** 0.3, "lr": 1e-3 * min(1.0, step / 10), "grad_norm": 1.0,
                      "tokens_per_s": 1000.0})
        if step % 10 == 0:
            lines.append({"step": step, "val_loss": 7.5 / step ** 0.3, "val_ppl": 2.0, "event": "eval"})
    write_jsonl(run / "metrics.jsonl", lines + ["{truncated", '"just a string"'])
    res = subprocess.run([sys.executable, "scripts/plot_metrics.py", str(run)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "skipped 2 malformed lines" in res.stdout
    png = run / "loss.png"
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    missing = subprocess.run([sys.executable, "scripts/plot_metrics.py", str(tmp_path / "nope")], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and missing.stderr.startswith("error:") and "Traceback" not in missing.stderr
