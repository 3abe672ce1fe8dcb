// PocketLM chat page: streams replies from this server's POST /v1/chat/completions (OpenAI's server-sent events).
//
// The whole conversation is sent each turn (the server keeps no state). Model output only ever reaches the page
// through textContent, never innerHTML, so whatever the model writes is shown as text, not run as markup. A
// reply's reasoning (reasoning_content) and tool calls are shown in collapsed blocks; with "Bundled tools" ticked
// the model is offered the server's tools and its calls are run there (/tools/run) and answered.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = "pocketlm.apiKey"; // sessionStorage: the key lives as long as this tab, never on disk

const state = {
  model: null, // the model's id, from /v1/models (or /health until a key is given)
  tools: null, // the server's bundled tools (/tools), offered to the model when "Bundled tools" is ticked
  history: [], // the finished turns' messages (tool calls and results too): sent again after the system prompt
  conversation: 0, // bumped by "Clear conversation": a reply still arriving then belongs to no conversation
  controller: null, // the AbortController of the reply being streamed, if any
  loads: 0, // model-card reads started: only the latest one's answer is shown (keys typed in quick succession)
};

// ------------------------------------------------------------------------------------------------ API calls
function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

// An API failure as an Error carrying the server's message (OpenAI's {"error": {"message": ...}}).
async function apiError(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch (e) { /* not JSON: keep the status line */ }
  return new Error(message);
}

// The model's name and prompt format: /v1/models when it answers (it needs the key when the server has one), else
// /health (always open), so the page can show what it serves before a key is entered.
async function loadModel() {
  const load = ++state.loads;
  let problem = null;
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    if (!r.ok) throw await apiError(r);
    const card = (await r.json()).data[0];
    const tools = await fetch("/tools", { headers: headers() });
    if (load !== state.loads) return;
    showModel(card.id, card.prompt_format);
    state.tools = tools.ok ? (await tools.json()).tools : null;
    $("tools-setting").hidden = !state.tools;
    clearError();
    return;
  } catch (e) {
    problem = e;
  }
  try {
    const health = await (await fetch("/health")).json();
    if (load !== state.loads) return;
    showModel(health.model, health.prompt_format);
  } catch (e) { /* the server is gone: the error below says why */ }
  if (load === state.loads) showError(problem.message);
}

function showModel(name, promptFormat) {
  state.model = name;
  $("model-name").textContent = name;
  $("model-format").textContent = promptFormat ? `(${promptFormat})` : "";
  const chat = promptFormat !== "text";
  // A text checkpoint only continues text (/v1/completions): there is nothing to chat with.
  $("notice").hidden = chat;
  $("notice").textContent = chat ? "" : `${name} is a text (pretrained) checkpoint: it continues raw text and has no chat ` +
    "endpoint. Chatting needs an SFT checkpoint: start serve_openai_api.py with --checkpoint out/<sft run> " +
    "(e.g. out/demo-sft from `make demo`).";
  for (const id of ["prompt", "send"]) $(id).disabled = !chat;
}

// The request body for the conversation so far (its last message is the new user turn).
function requestBody(messages) {
  const body = {
    model: state.model,
    messages,
    temperature: Number($("temperature").value),
    top_p: Number($("top-p").value),
    stream: true,
    stream_options: { include_usage: true }, // a last chunk with the token counts: tokens/s
    truncate: "oldest_turns", // this server's extension: a long chat drops its oldest turns instead of failing
  };
  if (state.tools && $("use-tools").checked) body.tools = state.tools;
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (maxTokens > 0) body.max_tokens = maxTokens; // empty: whatever the context leaves
  return body;
}

// Calls onData(text) with the data of each server-sent event of a streamed response. TextDecoder with
// {stream: true} keeps a character whose UTF-8 bytes are split across two network reads (Chinese) whole.
async function readEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder("utf-8");
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) { // events end with a blank line
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (data) onData(data);
    }
  }
}

// ------------------------------------------------------------------------------------------------ one turn
const MAX_TOOL_ROUNDS = 3; // rounds of tool calls run per message at most, as eval_model.py --tools

// One user message and the model's answer to it: with the bundled tools offered, every tool call the model makes
// is run by the server (/tools/run) and its result sent back, and the model answers again, up to MAX_TOOL_ROUNDS.
async function send(text) {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...state.history, { role: "user", content: text });

  addMessage("user", text);
  clearError();
  setBusy(true);
  const conversation = state.conversation;
  state.controller = new AbortController();
  const added = [{ role: "user", content: text }]; // what this exchange adds to the history
  let reply = null;
  let result = null;
  try {
    for (let round = 0; ; round++) {
      reply = addMessage("assistant", "");
      result = await streamReply([...messages, ...added.slice(1)], reply);
      if (result.outcome === "failed" && !result.content && !result.calls.length) break;
      added.push(assistantMessage(result));
      if (result.outcome !== "done" || !result.calls.length) break;
      if (round === MAX_TOOL_ROUNDS) {
        reply.querySelector(".stats").textContent += ` · stopped after ${MAX_TOOL_ROUNDS} rounds of tool calls`;
        break;
      }
      for (const [i, call] of result.calls.entries()) {
        const output = await runTool(call);
        reply.querySelectorAll(".tool-call .result")[i].textContent = output; // text, never markup
        added.push({ role: "tool", tool_call_id: call.id, content: output });
      }
    }
  } catch (e) {
    showError(e.message); // a tool could not be run
  } finally {
    state.controller.abort(); // closes the connection if anything above left it open (a no-op once it ended)
    state.controller = null;
    setBusy(false);
  }
  if (conversation !== state.conversation) return; // cleared meanwhile
  if (added.length === 1) {
    // nothing came back: take the turn out again and give the text back for another try
    reply.previousElementSibling.remove(); // the user's message
    reply.remove();
    $("prompt").value = text;
    return;
  }
  // A stopped reply stays in the conversation as far as it got, like a finished one.
  state.history.push(...added);
}

// The assistant message a reply adds to the history: its text, and its tool calls as the API returned them.
function assistantMessage(result) {
  const message = { role: "assistant", content: result.content };
  if (result.calls.length) {
    message.tool_calls = result.calls.map((c) => ({
      id: c.id, type: "function", function: { name: c.name, arguments: c.arguments },
    }));
  }
  return message;
}

// Streams one chat completion into the `reply` element: the reasoning into a collapsed "Thinking" block, the
// text as it comes, each tool call into a collapsed block. Returns {content, calls, outcome: done|stopped|failed}.
async function streamReply(messages, reply) {
  reply.classList.add("streaming");
  const started = performance.now();
  let content = "";
  let reasoning = "";
  const calls = []; // {id, name, arguments} by the stream's index
  let usage = null;
  let outcome = "done";
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(requestBody(messages)),
      signal: state.controller.signal,
    });
    if (!r.ok) throw await apiError(r);
    await readEvents(r, (data) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message); // a failure after the stream started
      if (chunk.usage) usage = chunk.usage;
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      if (!delta) return;
      if (delta.reasoning_content) {
        reasoning += delta.reasoning_content;
        part(reply, "thinking").querySelector(".reasoning").textContent = reasoning;
      }
      if (delta.content) {
        content += delta.content;
        reply.querySelector(".text").textContent = content; // text, never markup
      }
      for (const call of delta.tool_calls || []) {
        if (!calls[call.index]) calls[call.index] = { id: call.id, name: "", arguments: "" };
        const c = calls[call.index];
        c.name += (call.function && call.function.name) || "";
        c.arguments += (call.function && call.function.arguments) || "";
        showCall(reply, call.index, c);
      }
      scrollDown();
    });
  } catch (e) {
    outcome = e.name === "AbortError" ? "stopped" : "failed";
    if (outcome === "failed") showError(e.message);
  } finally {
    reply.classList.remove("streaming");
  }
  const seconds = (performance.now() - started) / 1000;
  reply.querySelector(".stats").textContent = outcome === "stopped"
    ? `stopped after ${seconds.toFixed(1)} s`
    : usage
      // tokens/s over the whole reply as the user waited for it: prompt processing included
      ? `${usage.completion_tokens} tokens · ${(usage.completion_tokens / seconds).toFixed(1)} tokens/s`
      : `${seconds.toFixed(1)} s`;
  return { content, calls: calls.filter(Boolean), outcome };
}

// A tool call's result from the server's bundled tools (the text the model reads back).
async function runTool(call) {
  const r = await fetch("/tools/run", {
    method: "POST", headers: headers(), body: JSON.stringify({ name: call.name, arguments: call.arguments }),
    signal: state.controller.signal,
  });
  if (!r.ok) throw await apiError(r);
  return (await r.json()).content;
}

// The reply's collapsed block of a kind ("thinking"), made on first use, before the reply's text.
function part(reply, kind) {
  let block = reply.querySelector(`details.${kind}`);
  if (!block) {
    block = document.createElement("details");
    block.className = kind;
    const summary = document.createElement("summary");
    summary.textContent = "Thinking";
    const body = document.createElement("div");
    body.className = "reasoning";
    block.append(summary, body);
    reply.querySelector(".text").before(block);
  }
  return block;
}

// A tool call, collapsed: "Tool call: name" over its arguments and, once it has run, its result.
function showCall(reply, index, call) {
  const calls = reply.querySelector(".tool-calls");
  let block = calls.children[index];
  if (!block) {
    block = document.createElement("details");
    block.className = "tool-call";
    const summary = document.createElement("summary");
    const args = document.createElement("pre");
    args.className = "arguments";
    const result = document.createElement("pre");
    result.className = "result";
    block.append(summary, args, result);
    calls.append(block);
  }
  block.querySelector("summary").textContent = `Tool call: ${call.name}`;
  block.querySelector(".arguments").textContent = call.arguments;
}

function stop() {
  // Aborting closes the connection; the server notices and frees the request's slot before its next step.
  if (state.controller) state.controller.abort();
}

function clearConversation() {
  stop();
  state.conversation += 1;
  state.history = [];
  $("messages").replaceChildren();
  clearError();
}

// --------------------------------------------------------------------------------------------------- the page
function addMessage(role, text) {
  const item = document.createElement("div");
  item.className = `message ${role}`;
  const who = document.createElement("div");
  who.className = "role";
  who.textContent = role === "user" ? "You" : state.model || "Assistant";
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  const calls = document.createElement("div");
  calls.className = "tool-calls";
  const stats = document.createElement("div");
  stats.className = "stats";
  item.append(who, body, calls, stats);
  $("messages").append(item);
  scrollDown();
  return item;
}

function scrollDown() {
  const m = $("messages");
  m.scrollTop = m.scrollHeight;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  document.body.classList.toggle("busy", busy);
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = false;
}

function clearError() {
  $("error").textContent = "";
  $("error").hidden = true;
}

function submit(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.controller || $("send").disabled) return;
  $("prompt").value = "";
  send(text);
}

function init() {
  $("api-key").value = sessionStorage.getItem(KEY_STORAGE) || "";
  $("api-key").addEventListener("change", () => {
    sessionStorage.setItem(KEY_STORAGE, $("api-key").value.trim());
    loadModel(); // a new key may unlock /v1/models
  });
  for (const id of ["temperature", "top-p"]) {
    const show = () => { $(`${id}-value`).textContent = $(id).value; };
    $(id).addEventListener("input", show);
    show();
  }
  $("composer").addEventListener("submit", submit);
  $("prompt").addEventListener("keydown", (e) => {
    // Enter sends, Shift+Enter adds a line; not while an input method is composing (Chinese, Japanese, ...)
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing && e.keyCode !== 229) submit(e);
  });
  $("stop").addEventListener("click", stop);
  $("clear").addEventListener("click", clearConversation);
  loadModel();
}

init(); // the script is deferred: the document is parsed
