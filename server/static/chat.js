// The MTPLX chat page: a conversation streamed over /v1/chat/completions (fetch +
// ReadableStream), with the speculative-decoding figures of every reply. No framework, no
// build step; model text reaches the page only through markdown.js (DOM nodes, no HTML).

import { renderMarkdown } from "./markdown.js";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "mtplx.apiKey";
const SETTINGS_STORE = "mtplx.settings";
const SETTINGS = ["system", "temperature", "max-tokens", "drafter", "depth"];

const state = { model: null, history: [], controller: null };

// -- API key ------------------------------------------------------------------------------

function apiKey() {
  return localStorage.getItem(KEY_STORE) || "";
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = apiKey();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

/** Show the key form; resolves once the user saved a key. */
function askForKey(message) {
  $("key-message").textContent = message;
  $("key-panel").hidden = false;
  $("key-input").focus();
  return new Promise((resolve) => {
    $("key-form").onsubmit = (event) => {
      event.preventDefault();
      localStorage.setItem(KEY_STORE, $("key-input").value.trim());
      $("key-input").value = "";
      $("key-panel").hidden = true;
      resolve();
    };
  });
}

// -- settings -----------------------------------------------------------------------------

function loadSettings() {
  let saved = {};
  try {
    saved = JSON.parse(localStorage.getItem(SETTINGS_STORE) || "{}");
  } catch {
    saved = {};
  }
  for (const id of SETTINGS) {
    if (saved[id] !== undefined) $(id).value = saved[id];
    $(id).addEventListener("change", saveSettings);
  }
}

function saveSettings() {
  const values = {};
  for (const id of SETTINGS) values[id] = $(id).value;
  localStorage.setItem(SETTINGS_STORE, JSON.stringify(values));
}

/** The model card: its id and the drafters it offers (the drafter menu). */
async function loadModel() {
  for (;;) {
    let response;
    try {
      response = await fetch("/v1/models", { headers: headers() });
    } catch (error) {
      $("model").textContent = `server unreachable (${error.message})`;
      return;
    }
    if (response.status === 401) {
      await askForKey(apiKey() ? "That API key was refused." : "This server needs an API key.");
      continue;
    }
    if (response.status === 503) {
      // The model is still loading (or the server is draining): try again shortly.
      $("model").textContent = "model loading…";
      await new Promise((resolve) => setTimeout(resolve, 2000));
      continue;
    }
    if (!response.ok) {
      $("model").textContent = `error ${response.status}: ${await errorText(response)}`;
      return;
    }
    const card = (await response.json()).data[0];
    state.model = card.id;
    $("model").textContent = card.id;
    const drafter = $("drafter");
    const chosen = JSON.parse(localStorage.getItem(SETTINGS_STORE) || "{}").drafter || "";
    for (const name of card.drafters || []) {
      const option = document.createElement("option");
      option.value = name;
      option.textContent = name;
      drafter.append(option);
    }
    drafter.value = [...drafter.options].some((o) => o.value === chosen) ? chosen : "";
    $("send").disabled = false;
    return;
  }
}

// -- the conversation ---------------------------------------------------------------------

function addMessage(role, text) {
  const box = document.createElement("article");
  box.className = `msg ${role}`;
  const body = document.createElement("div");
  body.className = "body";
  box.append(body);
  if (role === "user") body.textContent = text;
  else body.append(renderMarkdown(text));
  $("log").append(box);
  box.scrollIntoView({ block: "end" });
  return box;
}

function requestBody(messages) {
  const body = { model: state.model, messages, stream: true };
  body.stream_options = { include_usage: true }; // the usage chunk carries the mtplx figures
  const temperature = $("temperature").value.trim();
  if (temperature !== "") body.temperature = Number(temperature);
  const maxTokens = $("max-tokens").value.trim();
  if (maxTokens !== "") body.max_tokens = Number(maxTokens);
  const mtplx = {};
  if ($("drafter").value) mtplx.drafter = $("drafter").value;
  const depth = $("depth").value;
  if (depth !== "") mtplx.depth = depth === "adaptive" ? null : Number(depth);
  if (Object.keys(mtplx).length) body.mtplx = mtplx;
  return body;
}

/** Server-sent events of a fetch response, one `data:` payload at a time. */
async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (data) yield data;
    }
  }
}

async function errorText(response) {
  try {
    const body = await response.json();
    return body.error?.message || JSON.stringify(body);
  } catch {
    return `HTTP ${response.status}`;
  }
}

function percent(x) {
  return `${(100 * x).toFixed(0)}%`;
}

/** The figures under a reply: from the usage chunk's `mtplx` statistics and the timing seen
 * here (tokens/s over the decode, from the first token to the last). */
function showStats(box, timing, usage, mtplx, note) {
  const stats = document.createElement("div");
  stats.className = "stats";
  const parts = [];
  if (note) parts.push(note);
  if (timing.first !== null) parts.push(`TTFT ${((timing.first - timing.start) / 1000).toFixed(2)} s`);
  if (usage) {
    const tokens = usage.completion_tokens;
    const seconds = (timing.end - (timing.first ?? timing.start)) / 1000;
    const rate = tokens > 1 && seconds > 0 ? (tokens - 1) / seconds : 0;
    parts.push(`${tokens} tokens`, `${rate.toFixed(1)} tok/s`);
    const cached = usage.prompt_tokens_details?.cached_tokens;
    if (cached) parts.push(`prompt ${usage.prompt_tokens} (${cached} cached)`);
  }
  if (mtplx) {
    if (mtplx.drafted > 0) {
      parts.push(`acceptance ${percent(mtplx.acceptance_rate)}`);
      parts.push(`${mtplx.mean_acceptance_length.toFixed(2)} tokens/cycle`);
      const positions = mtplx.accepted_per_position.map((accepted, i) => {
        const drafted = mtplx.drafted_per_position[i] || 0;
        return drafted ? percent(accepted / drafted) : "–";
      });
      parts.push(`per position ${positions.join(" · ")}`);
    } else {
      parts.push("no drafts");
    }
  }
  stats.textContent = parts.join("  |  ");
  box.append(stats);
}

async function send(text) {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...state.history, { role: "user", content: text });
  addMessage("user", text);
  const box = addMessage("assistant", "");
  const body = box.querySelector(".body");
  box.classList.add("streaming");
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  const timing = { start: performance.now(), first: null, end: null };
  let reply = "";
  let thought = "";
  const thinking = document.createElement("details");
  thinking.className = "thinking";
  thinking.open = true;
  const thinkingText = document.createElement("div");
  thinking.append(Object.assign(document.createElement("summary"), { textContent: "Thinking" }));
  thinking.append(thinkingText);
  let usage = null;
  let mtplx = null;
  let note = "";
  let refused = false;
  let pending = false;
  const render = () => {
    pending = false;
    body.replaceChildren(renderMarkdown(reply));
    box.scrollIntoView({ block: "end" });
  };
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers(),
      body: JSON.stringify(requestBody(messages)),
      signal: controller.signal,
    });
    if (response.status === 401) {
      refused = true;
      return;
    }
    if (!response.ok) throw new Error(await errorText(response));
    for await (const data of sseData(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      const reasoning = chunk.choices?.[0]?.delta?.reasoning_content;
      if (reasoning) {
        timing.first ??= performance.now();
        if (!thought) body.before(thinking);
        thought += reasoning;
        thinkingText.textContent = thought;
      }
      const delta = chunk.choices?.[0]?.delta?.content;
      if (delta) {
        timing.first ??= performance.now();
        if (thought && !reply) thinking.open = false; // the answer begins: fold the thinking
        reply += delta;
        if (!pending) {
          pending = true;
          requestAnimationFrame(render);
        }
      }
      if (chunk.choices?.[0]?.finish_reason === "length") note = "cut at max tokens";
      if (chunk.usage) usage = chunk.usage;
      if (chunk.mtplx) mtplx = chunk.mtplx;
    }
    state.history.push({ role: "user", content: text }, { role: "assistant", content: reply });
  } catch (error) {
    if (error.name === "AbortError") {
      note = "stopped";
      state.history.push({ role: "user", content: text }, { role: "assistant", content: reply });
    } else {
      const failure = document.createElement("div");
      failure.className = "error";
      failure.textContent = error.message;
      box.append(failure);
      note = "failed";
    }
  } finally {
    timing.end = performance.now();
    render();
    box.classList.remove("streaming");
    if (!refused) showStats(box, timing, usage, mtplx, note);
    state.controller = null;
    setBusy(false);
  }
  if (refused) {
    // Ask for the key, then send again (send() shows both messages again).
    box.previousElementSibling?.remove();
    box.remove();
    await askForKey("The API key was refused; enter it again.");
    await send(text);
  }
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("prompt").disabled = busy;
  if (!busy) $("prompt").focus();
}

function main() {
  loadSettings();
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || state.controller || !state.model) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => state.controller?.abort());
  $("clear").addEventListener("click", () => {
    state.history = [];
    $("log").replaceChildren();
  });
  $("forget-key").addEventListener("click", () => {
    localStorage.removeItem(KEY_STORE);
    loadModel();
  });
  loadModel();
}

main();
