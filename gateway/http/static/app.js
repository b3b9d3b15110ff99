// llmpool's built-in page: a chat playground on the public /v1/chat/completions streaming API and an
// operator view fed by /metrics. Plain browser JavaScript, no build step, no outside hosts.
"use strict";

const $ = (id) => document.getElementById(id);
// images: those waiting to go with the next message, as data: URIs (image_url parts; the gateway decodes them)
const state = { history: [], controller: null, tps: [], images: [] };

// ---- API key -----------------------------------------------------------------------------------
function apiHeaders(extra = {}) {
  const key = localStorage.getItem("llmpool.apiKey");
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

function askForKey() {
  return new Promise((resolve) => {
    const dialog = $("key-dialog");
    $("key-input").value = localStorage.getItem("llmpool.apiKey") || "";
    dialog.onclose = () => {
      if (dialog.returnValue === "save") localStorage.setItem("llmpool.apiKey", $("key-input").value.trim());
      resolve(dialog.returnValue === "save");
    };
    dialog.showModal();
  });
}

// fetch() that asks for the key once when the server answers 401, then retries.
async function api(path, options = {}) {
  let response = await fetch(path, { ...options, headers: apiHeaders(options.headers) });
  if (response.status === 401 && (await askForKey())) {
    response = await fetch(path, { ...options, headers: apiHeaders(options.headers) });
  }
  return response;
}

async function errorText(response) {
  try {
    return (await response.json()).error.message;
  } catch {
    return `HTTP ${response.status}`;
  }
}

// ---- views ---------------------------------------------------------------------------------------
function show(view) {
  for (const name of ["chat", "dashboard"]) {
    $(`view-${name}`).hidden = name !== view;
    $(`tab-${name}`).classList.toggle("active", name === view);
  }
  if (view === "dashboard") startDashboard();
}

for (const link of document.querySelectorAll("nav a")) {
  link.addEventListener("click", (event) => {
    event.preventDefault();
    history.pushState({}, "", link.getAttribute("href"));
    show(link.dataset.view);
  });
}
window.addEventListener("popstate", () => show(location.pathname.startsWith("/dashboard") ? "dashboard" : "chat"));

// ---- playground ----------------------------------------------------------------------------------
async function loadModels() {
  const response = await api("/v1/models");
  if (!response.ok) return showError("chat-error", await errorText(response));
  const models = (await response.json()).data;
  $("model").replaceChildren(...models.map((m) => new Option(m.id, m.id)));
}

function showError(id, message) {
  $(id).textContent = message || "";
  $(id).hidden = !message;
}

function addMessage(role, text, images = []) {
  const box = document.createElement("div");
  box.className = `msg ${role}`;
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  box.append(body);
  for (const url of images) box.append(thumbnail(url));
  $("messages").append(box);
  box.scrollIntoView({ block: "end" });
  return box;
}

function requestBody(messages) {
  const number = (id) => ($(id).value === "" ? undefined : Number($(id).value));
  const body = {
    model: $("model").value,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: number("temperature"),
    top_p: number("top_p"),
    max_tokens: number("max_tokens"),
    seed: number("seed"),
  };
  return JSON.stringify(body);
}

// Reads an OpenAI SSE stream: "id: ...\ndata: {json}" blocks, then "data: [DONE]".
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    const blocks = buffer.split("\n\n");
    buffer = blocks.pop();
    for (const block of blocks) {
      const line = block.split("\n").find((l) => l.startsWith("data: "));
      if (line === undefined) continue;
      const data = line.slice("data: ".length);
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

function thumbnail(url) {
  const img = document.createElement("img");
  img.src = url;
  img.alt = "image";
  return img;
}

function attach(files) {
  for (const file of files) {
    if (!file.type.startsWith("image/")) continue;
    const reader = new FileReader();
    reader.onload = () => {
      state.images.push(reader.result);
      $("attached").append(thumbnail(reader.result));
    };
    reader.readAsDataURL(file);
  }
}

async function send(text) {
  showError("chat-error", "");
  const images = state.images;
  state.images = [];
  $("attached").replaceChildren();
  const parts = images.map((url) => ({ type: "image_url", image_url: { url } }));
  const content = images.length ? [...parts, ...(text ? [{ type: "text", text }] : [])] : text;
  state.history.push({ role: "user", content });
  addMessage("user", text, images);
  const system = $("system").value.trim();
  const messages = system ? [{ role: "system", content: system }, ...state.history] : [...state.history];
  const box = addMessage("assistant", "");
  box.classList.add("streaming");
  const textNode = box.querySelector(".text");
  const stats = document.createElement("span");
  stats.className = "stats";
  box.append(stats);
  state.controller = new AbortController();
  setBusy(true);
  const started = performance.now();
  let firstToken = null;
  let usage = null;
  let finish = null;
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: requestBody(messages),
      signal: state.controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    for await (const chunk of sseEvents(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      if (choice.delta.content) {
        firstToken = firstToken ?? performance.now();
        textNode.textContent += choice.delta.content;
        box.scrollIntoView({ block: "end" });
      }
      finish = choice.finish_reason || finish;
    }
  } catch (error) {
    if (error.name === "AbortError") finish = "stopped";
    else showError("chat-error", error.message);
  } finally {
    box.classList.remove("streaming");
    box.dataset.finish = finish || "error";
    state.history.push({ role: "assistant", content: textNode.textContent });
    stats.textContent = describe(started, firstToken, usage, finish);
    state.controller = null;
    setBusy(false);
  }
}

function describe(started, firstToken, usage, finish) {
  const parts = [];
  if (firstToken) parts.push(`TTFT ${Math.round(firstToken - started)} ms`);
  if (usage && firstToken) {
    const seconds = (performance.now() - firstToken) / 1000;
    if (usage.completion_tokens > 1 && seconds > 0) parts.push(`${((usage.completion_tokens - 1) / seconds).toFixed(1)} tok/s`);
    parts.push(`prompt ${usage.prompt_tokens} tokens`, `completion ${usage.completion_tokens} tokens`);
    const cached = usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens;
    if (cached !== undefined) parts.push(`cached ${cached} tokens`);
  }
  if (finish) parts.push(finish === "stopped" ? "stopped" : `finish: ${finish}`);
  return parts.join(" · ");
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if ((!text && !state.images.length) || state.controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("image").addEventListener("change", (event) => {
  attach(event.target.files);
  event.target.value = "";
});
$("prompt").addEventListener("paste", (event) => attach(event.clipboardData ? event.clipboardData.files : []));
$("composer").addEventListener("dragover", (event) => event.preventDefault());
$("composer").addEventListener("drop", (event) => {
  event.preventDefault();
  attach(event.dataTransfer.files);
});
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("clear").addEventListener("click", () => {
  state.history = [];
  state.images = [];
  $("attached").replaceChildren();
  $("messages").replaceChildren();
});
$("key-button").addEventListener("click", () => askForKey().then(loadModels));

// ---- operator view -------------------------------------------------------------------------------
// Prometheus text -> [{name, labels, value}]
function parseMetrics(text) {
  const samples = [];
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const match = line.match(/^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)$/);
    if (!match) continue;
    const labels = {};
    for (const pair of (match[2] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[pair[1]] = pair[2];
    samples.push({ name: match[1], labels, value: Number(match[3]) });
  }
  return samples;
}

function byWorker(samples, name) {
  const out = {};
  for (const s of samples) if (s.name === name) out[s.labels.worker] = s;
  return out;
}

let dashboardTimer = null;
function startDashboard() {
  if (dashboardTimer) return;
  refreshDashboard();
  dashboardTimer = setInterval(refreshDashboard, 2000);
}

async function refreshDashboard() {
  let response;
  try {
    response = await api("/metrics");
  } catch {
    return showError("dash-error", "The gateway is not reachable; retrying.");
  }
  if (!response.ok) return showError("dash-error", await errorText(response));
  showError("dash-error", "");
  const samples = parseMetrics(await response.text());
  const total = (name) => samples.filter((s) => s.name === name).reduce((sum, s) => sum + s.value, 0);
  const up = byWorker(samples, "llmpool_worker_up");
  const info = byWorker(samples, "llmpool_worker_info");
  const running = byWorker(samples, "llmpool_worker_running");
  const waiting = byWorker(samples, "llmpool_worker_waiting");
  const kv = byWorker(samples, "llmpool_worker_kv_cache_usage_ratio");
  const tps = byWorker(samples, "llmpool_worker_tokens_per_second");
  const peak = byWorker(samples, "llmpool_worker_peak_batch_size");
  const hits = byWorker(samples, "llmpool_worker_prefix_cache_hit_tokens_total");
  const draining = byWorker(samples, "llmpool_worker_draining");
  const live = Object.values(up).filter((s) => s.value === 1).length;
  $("stat-workers").textContent = live;
  $("stat-running").textContent = total("llmpool_running_batch_size");
  $("stat-waiting").textContent = total("llmpool_queue_length");
  const tokensPerSecond = total("llmpool_worker_tokens_per_second");
  $("stat-tps").textContent = tokensPerSecond.toFixed(1);
  state.tps.push({ at: Date.now(), value: tokensPerSecond });
  state.tps = state.tps.filter((p) => p.at > Date.now() - 5 * 60 * 1000);
  drawChart();
  const rows = Object.keys(up).sort().map((name) => {
    const alive = up[name].value === 1;
    const busy = alive && ((running[name] || {}).value || (waiting[name] || {}).value);
    const isDraining = alive && draining[name] && draining[name].value === 1;
    const workerState = !alive ? "dead" : isDraining ? "draining" : busy ? "busy" : "ready";
    const usage = alive ? (kv[name] || { value: 0 }).value : 0;
    const row = document.createElement("tr");
    row.dataset.worker = name;
    const model = info[name] ? info[name].labels.model : (up[name].labels.model || "-");
    const cells = [
      name,
      model,
      `<span class="state ${workerState}">${workerState}</span>`,
      info[name] ? `${info[name].labels.device} · ${info[name].labels.dtype}` : "-",
      alive ? running[name].value : "-",
      alive ? waiting[name].value : "-",
      alive ? `<span class="bar"><span style="width:${(usage * 100).toFixed(0)}%"></span></span>${(usage * 100).toFixed(1)}%` : "-",
      alive ? tps[name].value.toFixed(1) : "-",
      alive ? peak[name].value : "-",
      alive ? hits[name].value : "-",
    ];
    row.innerHTML = cells.map((c, i) => `<td>${i <= 1 ? escapeHtml(c) : c}</td>`).join("");
    return row;
  });
  $("workers").querySelector("tbody").replaceChildren(...rows);
  refreshBatches();
}

// The key's batches, newest first: those running, then the last few that ended (GET /v1/batches).
async function refreshBatches() {
  let response;
  try {
    response = await api("/v1/batches?limit=20");
  } catch {
    return;
  }
  if (!response.ok) return;
  const running = ["validating", "in_progress", "finalizing", "cancelling"];
  const batches = (await response.json()).data;
  const shown = batches.filter((b) => running.includes(b.status)).concat(batches.filter((b) => !running.includes(b.status)).slice(0, 5));
  const rows = shown.map((b) => {
    const counts = b.request_counts || { total: 0, completed: 0, failed: 0 };
    const usage = b.usage || { input_tokens: 0, output_tokens: 0 };
    const done = counts.total ? counts.completed / counts.total : 0;
    const row = document.createElement("tr");
    row.dataset.batch = b.id;
    row.innerHTML = [
      escapeHtml(b.id),
      escapeHtml(b.endpoint),
      escapeHtml(b.model || "-"),
      `<span class="state ${running.includes(b.status) ? "busy" : "ready"}">${escapeHtml(b.status)}</span>`,
      `<span class="bar"><span style="width:${(done * 100).toFixed(0)}%"></span></span>${counts.completed} / ${counts.total}`,
      counts.failed,
      `${usage.input_tokens} / ${usage.output_tokens}`,
      new Date(b.created_at * 1000).toLocaleString(),
    ].map((c) => `<td>${c}</td>`).join("");
    return row;
  });
  $("batches").querySelector("tbody").replaceChildren(...rows);
}

// The keys view wants the admin key (--admin-key), asked once and kept for this tab only.
async function refreshKeys() {
  let admin = sessionStorage.getItem("llmpool-admin-key");
  if (!admin) {
    admin = window.prompt("Admin key (--admin-key)") || "";
    if (!admin) return;
    sessionStorage.setItem("llmpool-admin-key", admin);
  }
  const response = await fetch("/admin/keys", { headers: { Authorization: `Bearer ${admin}` } });
  if (!response.ok) {
    sessionStorage.removeItem("llmpool-admin-key");
    return showError("keys-error", await errorText(response));
  }
  showError("keys-error", "");
  const limit = (value) => (value === null || value === undefined ? "-" : value);
  const rows = (await response.json()).data.map((key) => {
    const used = key.usage_this_month || {};
    const tokens = (used.input_tokens || 0) + (used.output_tokens || 0);
    const row = document.createElement("tr");
    row.dataset.key = key.id;
    const cells = [key.name, key.id, key.status, limit(key.rpm), limit(key.tpm), limit(key.max_concurrent),
      limit(key.monthly_tokens), key.models ? key.models.join(", ") : "all", used.requests || 0, tokens];
    row.innerHTML = cells.map((c) => `<td>${escapeHtml(c)}</td>`).join("");
    return row;
  });
  $("keys").querySelector("tbody").replaceChildren(...rows);
}
let keysTimer = null;
$("keys-load").addEventListener("click", () => {
  refreshKeys();
  if (!keysTimer) keysTimer = setInterval(refreshKeys, 10000);
});

function escapeHtml(text) {
  return String(text).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
}

function drawChart() {
  const canvas = $("tps-chart");
  const ratio = window.devicePixelRatio || 1;
  const width = (canvas.width = canvas.clientWidth * ratio);
  const height = (canvas.height = canvas.clientHeight * ratio);
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, width, height);
  const points = state.tps;
  const now = Date.now();
  const max = Math.max(10, ...points.map((p) => p.value)) * 1.15;
  ctx.fillStyle = "#667085";
  ctx.font = `${11 * ratio}px system-ui`;
  ctx.fillText(`${max.toFixed(0)} tok/s`, 6 * ratio, 14 * ratio);
  ctx.fillText("5 min ago", 6 * ratio, height - 6 * ratio);
  ctx.fillText("now", width - 28 * ratio, height - 6 * ratio);
  if (points.length < 2) return;
  ctx.strokeStyle = "#2563eb";
  ctx.lineWidth = 2 * ratio;
  ctx.beginPath();
  points.forEach((p, i) => {
    const x = width - ((now - p.at) / (5 * 60 * 1000)) * width;
    const y = height - (p.value / max) * (height - 20 * ratio) - 4 * ratio;
    if (i === 0) ctx.moveTo(x, y);
    else ctx.lineTo(x, y);
  });
  ctx.stroke();
}

show(location.pathname.startsWith("/dashboard") ? "dashboard" : "chat");
loadModels();
