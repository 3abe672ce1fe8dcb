"""Byte-level BPE tokenizer: training, loading, and the ChatML chat format with assistant-only labels.

One rule keeps training and inference consistent: special tokens are never produced from text. Every string
(pretraining documents, user and assistant content) is encoded with special-token matching off, and the
structural ids (<|im_start|>, <|im_end|>, <|endoftext|>) are inserted by code. So a document containing the
literal string "<|im_end|>" cannot forge chat structure.

The chat template stored in tokenizer_config.json renders the same text; for ordinary content
`transformers`' apply_chat_template yields exactly the ids `encode_chat` trains on (tested).

Tool calls and thinking (the format of MiniMind's and Qwen's templates, for their data): `tools` (JSON function
signatures) join the system turn inside <tools></tools>; an assistant turn is its optional `reasoning_content`
as <think>...</think>, then its content, then each of its `tool_calls` as <tool_call>{"name", "arguments"}
</tool_call>, all of it trained on; consecutive `tool` messages return as one user turn of <tool_response>
blocks, never trained on. A conversation without these renders exactly as plain ChatML. These markers are
ordinary text to the tokenizer.
"""
from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any, Iterable, Sequence

from common.errors import TokenizerError
from common.files import DEFAULT_TOKENIZER_DIR

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # ids 0, 1, 2 in tokenizers trained here

THINK = ("<think>\n", "\n</think>\n\n")  # around an assistant turn's reasoning_content
TOOLS_PREAMBLE = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                  "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_INSTRUCTION = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                     "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
                     "\"arguments\": <args-json-object>}\n</tool_call>")
# The generation prompt's opening of the answer, by enable_thinking: None (a model never taught to think) adds
# nothing; True opens a <think> block; False closes an empty one (a thinking model told to answer directly).
THINKING_PROMPT = {None: "", True: "<think>\n", False: "<think>\n\n</think>\n\n"}


def _jinja(text: str) -> str:
    """A Python string as the inside of a single-quoted Jinja literal."""
    return json.dumps(text, ensure_ascii=False)[1:-1].replace("'", "\\'")


# ChatML. Content is trimmed so that the "\n" after the role always ends a pre-token: the label boundary
# between header and content is then also a token boundary, in both this code and transformers. The tool and
# thinking branches mirror chat_turns() below line for line (parity with transformers is tested).
CHAT_TEMPLATE = (
    "{%- set ns = namespace(prev='', body='') %}"
    "{%- set tools = tools or (messages[0]['tools'] if messages and messages[0]['role'] == 'system' "
    "and messages[0]['tools'] is defined else none) %}"
    "{%- if tools %}"
    "{%- set system = messages[0]['content'] | trim if messages[0]['role'] == 'system' else '' %}"
    "{{- '<|im_start|>system\\n' + ((system + '\\n\\n') if system else '') + '" + _jinja(TOOLS_PREAMBLE) + "' }}"
    "{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}"
    "{{- '" + _jinja(TOOLS_INSTRUCTION) + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- set content = (message['content'] or '') | trim %}"
    "{%- if loop.first and tools and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- ('\\n' if ns.prev == 'tool' else '<|im_start|>user\\n') + '<tool_response>\\n' + content "
    "+ '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{%- set ns.body = content %}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{%- set call = call['function'] if call['function'] is defined else call %}"
    "{%- set args = call['arguments'] if call['arguments'] is string else call['arguments'] | tojson %}"
    "{%- set ns.body = ns.body + ('\\n' if ns.body else '') + '<tool_call>\\n{\"name\": \"' + call['name'] "
    "+ '\", \"arguments\": ' + args + '}\\n</tool_call>' %}"
    "{%- endfor %}"
    "{%- set think = ('" + _jinja(THINK[0]) + "' + message['reasoning_content'] | trim + '" + _jinja(THINK[1]) + "') "
    "if message['reasoning_content'] is string else '' %}"
    "{{- '<|im_start|>assistant\\n' + (think + ns.body) | trim + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns.prev = message['role'] %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is true %}{{- '" + _jinja(THINKING_PROMPT[True]) + "' }}"
    "{%- elif enable_thinking is false %}{{- '" + _jinja(THINKING_PROMPT[False]) + "' }}{%- endif %}"
    "{%- endif %}"
)


Message = dict[str, Any]  # {"role", "content"}, and for tool use "tool_calls", "reasoning_content", "tools"


def tool_call_text(call: dict[str, Any]) -> str:
    """One tool call as the assistant writes it: an OpenAI {"function": {"name", "arguments"}} or a bare
    {"name", "arguments"}, arguments an object or a JSON string (kept as written)."""
    call = call.get("function", call)
    args = call["arguments"]
    args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return '<tool_call>\n{"name": "' + call["name"] + '", "arguments": ' + args + "}\n</tool_call>"


def chat_turns(messages: Sequence[Message], tools: Sequence[dict] | None = None) -> list[tuple[str, str, int]]:
    """The ChatML turns a conversation renders to: (role, content, how many messages the turn holds).

    `tools` default to a first system message's "tools" (MiniMind's records carry them there). Contents are
    trimmed; an assistant turn is <think>reasoning</think>, content and tool calls; a run of tool messages is one
    user turn of <tool_response> blocks. The synthesised tools system turn counts with the first message's.
    """
    messages = list(messages)
    first_system = bool(messages) and messages[0]["role"] == "system"
    tools = tools or (messages[0].get("tools") if first_system else None)
    turns: list[list[Any]] = []
    if tools:
        system = messages[0]["content"].strip() if first_system else ""
        turns.append(["system", (system + "\n\n" if system else "") + TOOLS_PREAMBLE
                      + "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools) + TOOLS_INSTRUCTION,
                      int(first_system)])
        messages = messages[int(first_system):]
    previous = None
    for m in messages:
        content = (m.get("content") or "").strip()
        if m["role"] == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if previous == "tool":
                turns[-1][1] += "\n" + block
                turns[-1][2] += 1
            else:
                turns.append(["user", block, 1])
        elif m["role"] == "assistant":
            body = "\n".join(([content] if content else []) + [tool_call_text(c) for c in m.get("tool_calls") or []])
            reasoning = m.get("reasoning_content")
            think = THINK[0] + reasoning.strip() + THINK[1] if isinstance(reasoning, str) else ""
            turns.append(["assistant", (think + body).strip(), 1])
        else:
            turns.append([m["role"], content, 1])
        previous = m["role"]
    return [(role, content, count) for role, content, count in turns]


class Tokenizer:
    """Thin wrapper over a `tokenizers.Tokenizer` with PocketLM's special-token and chat conventions."""

    def __init__(self, path: str | Path = DEFAULT_TOKENIZER_DIR) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise TokenizerError(f"{file}: no tokenizer.json (train one with train_tokenizer.py)")
        try:
            self._tok = HFTokenizer.from_file(str(file))
        except Exception as e:  # noqa: BLE001 - the Rust error is one line
            raise TokenizerError(f"{file}: not a tokenizers JSON file ({str(e)[:200]})") from None
        self._tok.encode_special_tokens = True  # special strings in text stay text (see module doc)
        self.path = file.parent
        self.sha256 = hashlib.sha256(file.read_bytes()).hexdigest()
        self.vocab_size = self._tok.get_vocab_size()
        ids = {t: self._tok.token_to_id(t) for t in SPECIAL_TOKENS}
        missing = [t for t, i in ids.items() if i is None]
        if missing:
            raise TokenizerError(f"{file}: special tokens {missing} are missing; expected {list(SPECIAL_TOKENS)}")
        self.eot_id, self.im_start_id, self.im_end_id = ids[ENDOFTEXT], ids[IM_START], ids[IM_END]
        self.pad_id = self.eot_id
        newline = self.encode("\n")
        if len(newline) != 1:
            raise TokenizerError(f"{file}: a newline encodes to {len(newline)} tokens; byte-level BPE needs one")
        self.newline_id = newline[0]  # ends every chat turn

    @functools.cached_property
    def own_bytes_per_token(self) -> float | None:
        """UTF-8 bytes per token on the tokenizer's own held-out text (compression.json beside it, as
        scripts/build_default_tokenizer.py writes it; None without one); read once."""
        try:
            kinds = json.loads((self.path / "compression.json").read_text(encoding="utf-8"))["heldout_compression"]
            return sum(k["bytes"] for k in kinds.values()) / sum(k["tokens"] for k in kinds.values())
        except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
            return None

    # ------------------------------------------------------------------ plain text
    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def check_fits(self, vocab_size: int, where: str = "model") -> None:
        """Refuse a model whose embedding table is smaller than this tokenizer's id range."""
        if self.vocab_size > vocab_size:
            raise TokenizerError(f"{self.path}/tokenizer.json has {self.vocab_size} tokens but the {where} has "
                                 f"vocab_size {vocab_size}; use the tokenizer the model was trained with "
                                 "(--tokenizer DIR)")

    # ------------------------------------------------------------------------ chat
    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = False,
                    tools: Sequence[dict] | None = None, enable_thinking: bool | None = None) -> str:
        """The text CHAT_TEMPLATE produces (for display and for comparison with transformers)."""
        text = "".join(f"{IM_START}{role}\n{content}{IM_END}\n" for role, content, _ in chat_turns(messages, tools))
        return text + (f"{IM_START}assistant\n{THINKING_PROMPT[enable_thinking]}" if add_generation_prompt else "")

    def encode_chat(self, messages: Sequence[Message], add_generation_prompt: bool = False,
                    tools: Sequence[dict] | None = None, enable_thinking: bool | None = None, prefill: str = ""
                    ) -> tuple[list[int], list[bool], list[int]]:
        """(ids, labelled, turn_ends): labelled marks assistant content tokens and their <|im_end|>.

        turn_ends[i] is the length of ids after message i's turn (consecutive tool messages share one), so
        callers can truncate at turn boundaries. `prefill`: the start of the answer, written after the generation
        prompt and encoded with it, as training encodes an answer (e.g. "<tool_call>\n" to make the model call).
        """
        ids: list[int] = []
        labelled: list[bool] = []
        turn_ends: list[int] = []
        turns = chat_turns(messages, tools)
        # Header and content are encoded as one piece (as transformers does between special tokens), with
        # offsets to tell which tokens belong to the content.
        pieces = [f"{role}\n{content}" for role, content, _ in turns]
        encodings = self._tok.encode_batch(pieces, add_special_tokens=False)
        for (role, content, count), piece, enc in zip(turns, pieces, encodings):
            content_start = len(piece) - len(content)
            is_assistant = role == "assistant"
            ids.append(self.im_start_id)
            labelled.append(False)
            ids.extend(enc.ids)
            labelled.extend(is_assistant and start >= content_start for start, _ in enc.offsets)
            ids.extend((self.im_end_id, self.newline_id))
            labelled.extend((is_assistant, False))
            turn_ends.extend([len(ids)] * count)
        if add_generation_prompt:
            ids.extend([self.im_start_id] + self.encode("assistant\n" + THINKING_PROMPT[enable_thinking] + prefill))
            labelled.extend([False] * (len(ids) - len(labelled)))
        return ids, labelled, turn_ends

    def chat_prompt(self, messages: Sequence[Message], tools: Sequence[dict] | None = None,
                    enable_thinking: bool | None = None, prefill: str = "") -> list[int]:
        """Ids of a conversation followed by the assistant header (and `prefill`), ready for generation."""
        return self.encode_chat(messages, add_generation_prompt=True, tools=tools, enable_thinking=enable_thinking,
                                prefill=prefill)[0]

    def tool_results(self, messages: Sequence[Message]) -> list[int]:
        """The ids the chat template writes after an assistant turn's <|im_end|> when tool messages follow it,
        through the next assistant header: what a tool loop that keeps a conversation as token ids appends (the
        reply's own tokens stay as generated, never re-encoded)."""
        return [self.newline_id] + self.encode_chat(messages, add_generation_prompt=True)[0]

    def stop_ids(self, chat: bool) -> list[int]:
        """Where generation ends: a chat answer at <|im_end|> (or a document end), raw text at <|endoftext|>."""
        return [self.im_end_id, self.eot_id] if chat else [self.eot_id]

    def prompt_ids(self, text: str, chat: bool, system: str | None = None) -> list[int]:
        """Ids to continue: raw text (pretrained models), or a one-turn chat awaiting the answer (SFT models)."""
        if chat:
            return self.chat_prompt(([{"role": "system", "content": system}] if system else [])
                                    + [{"role": "user", "content": text}])
        return self.encode(text) or [self.eot_id]  # an empty prompt starts a new document


# The roles of the special tokens for transformers (special_tokens_map.json and tokenizer_config.json).
SPECIAL_TOKENS_MAP = {"bos_token": IM_START, "eos_token": IM_END, "pad_token": ENDOFTEXT, "unk_token": ENDOFTEXT,
                      "additional_special_tokens": list(SPECIAL_TOKENS)}


def tokenizer_config(model_max_length: int = 32768) -> dict[str, Any]:
    """tokenizer_config.json for `transformers.AutoTokenizer` (fast tokenizer, ChatML template)."""
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i, t in enumerate(SPECIAL_TOKENS)}
    return {"tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": added, **SPECIAL_TOKENS_MAP,
            "clean_up_tokenization_spaces": False,
            "model_max_length": model_max_length, "add_bos_token": False, "add_eos_token": False,
            "chat_template": CHAT_TEMPLATE}


def train_bpe(texts: Iterable[str], vocab_size: int = 6400, min_frequency: int = 2,
              special_tokens: Sequence[str] = SPECIAL_TOKENS, length: int | None = None):
    """Train a byte-level BPE `tokenizers.Tokenizer` on an iterator of strings."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if list(special_tokens[:3]) != list(SPECIAL_TOKENS):
        raise TokenizerError(f"special tokens must start with {list(SPECIAL_TOKENS)} (ids 0-2)")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(special_tokens), show_progress=True,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    return tok


def save_tokenizer(tok, out_dir: str | Path, model_max_length: int = 32768) -> Path:
    """Write tokenizer.json + tokenizer_config.json (+ special_tokens_map.json) into out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(model_max_length), indent=2, ensure_ascii=False) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(SPECIAL_TOKENS_MAP, indent=2) + "\n")
    return out
