// The tokenbus console: six views over the public API, called with the key the user pastes.
// The key stays in this tab's sessionStorage (no cookie, never in a URL). Everything shown is set
// as text (textContent), never parsed as HTML: a prompt holding markup is displayed, not run.

const KEY_STORAGE = "tokenbus.key";
const $ = (id) => document.getElementById(id);

// -- the key and the API -------------------------------------------------------------------

function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE) || "";
}

class ApiError extends Error {}

async function api(path, options = {}) {
  const headers = { Authorization: `Bearer ${apiKey()}`, ...(options.headers || {}) };
  if (options.json !== undefined) {
    headers["Content-Type"] = "application/json";
    options = { ...options, body: JSON.stringify(options.json) };
  }
  const response = await fetch(path, { ...options, headers });
  if (!response.ok) {
    throw new ApiError(await errorMessage(response));
  }
  return response;
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return `${response.status}: ${body.error.message}`;
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

function showError(error) {
  const box = $("error");
  box.textContent = error ? String(error.message || error) : "";
  box.hidden = !error;
}

function element(tag, text, attributes = {}) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  return node;
}

function row(cells, numeric = []) {
  const tr = document.createElement("tr");
  cells.forEach((cell, i) => {
    const td = cell instanceof Node ? document.createElement("td") : element("td", cell);
    if (cell instanceof Node) td.append(cell);
    if (numeric.includes(i)) td.className = "number";
    tr.append(td);
  });
  return tr;
}

// -- tabs ---------------------------------------------------------------------------------------

const VIEWS = { playground: loadModels, usage: loadUsage, conversations: () => loadConversations(true),
                stored: () => loadStored(true), batches: loadBatches, keys: loadKeys };

function show(tab) {
  for (const button of document.querySelectorAll("nav button")) {
    if (button.dataset.tab === tab) button.setAttribute("aria-current", "page");
    else button.removeAttribute("aria-current");
  }
  for (const name of Object.keys(VIEWS)) $(name).hidden = name !== tab;
  showError(null);
  if (apiKey()) VIEWS[tab]().catch(showError);
}

// -- playground ---------------------------------------------------------------------------------

let generation = null; // the AbortController of the stream being read
let completionId = null; // its id, once its first chunk has come

async function loadModels() {
  const select = $("pg-model");
  if (select.options.length) return;
  const models = (await (await api("/v1/models")).json()).data;
  select.replaceChildren(...models.map((m) => element("option", m.id, { value: m.id })));
}

function playgroundRequest() {
  const messages = [];
  if ($("pg-system").value.trim()) messages.push({ role: "system", content: $("pg-system").value });
  messages.push({ role: "user", content: $("pg-user").value });
  const request = {
    model: $("pg-model").value, messages, stream: true, stream_options: { include_usage: true },
    max_tokens: Number($("pg-max-tokens").value) || undefined,
    temperature: Number($("pg-temperature").value),
  };
  if ($("pg-store").checked) request.store = true; // kept: the Stored view shows it
  if ($("pg-tools").value.trim()) {
    try {
      request.tools = JSON.parse($("pg-tools").value);
    } catch {
      throw new ApiError("Tools must be a JSON array of tools.");
    }
  }
  return request;
}

async function send() {
  showError(null);
  const output = $("pg-output");
  output.textContent = "";
  $("pg-tool-calls").replaceChildren();
  $("pg-stats").textContent = "";
  setState("waiting");
  generation = new AbortController();
  completionId = null;
  $("pg-send").disabled = true;
  $("pg-stop").disabled = false;
  const started = performance.now();
  const clock = { first: null, last: null, chunks: 0, completionTokens: null, calls: [] };
  try {
    const response = await api("/v1/chat/completions", { method: "POST", json: playgroundRequest(),
                                                         signal: generation.signal });
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let pending = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      pending += value;
      const lines = pending.split("\n");
      pending = lines.pop();
      for (const line of lines) readLine(line, clock, started);
    }
    if ($("pg-state").textContent === "streaming" || $("pg-state").textContent === "waiting") setState("ended");
  } catch (error) {
    if (error.name === "AbortError") setState("stopped");
    else {
      setState("failed");
      showError(error);
    }
  } finally {
    generation = null;
    $("pg-send").disabled = false;
    $("pg-stop").disabled = true;
  }
}

function readLine(line, clock, started) {
  // The SSE stream as simple clients read it: data lines, JSON until [DONE].
  if (!line.startsWith("data: ")) return;
  const data = line.slice("data: ".length);
  if (data === "[DONE]") return;
  const chunk = JSON.parse(data);
  if (chunk.error) {
    if (chunk.error.code === "generation_cancelled") setState("stopped");
    else {
      setState("failed");
      showError(new ApiError(chunk.error.message));
    }
    return;
  }
  if (chunk.id) completionId = chunk.id;
  if (chunk.usage) clock.completionTokens = chunk.usage.completion_tokens;
  const choice = (chunk.choices || [])[0];
  if (choice) {
    const delta = choice.delta || {};
    if (delta.content || delta.tool_calls) {
      const now = performance.now();
      if (clock.first === null) clock.first = now;
      clock.last = now;
      clock.chunks += 1;
      setState("streaming");
    }
    if (delta.content) $("pg-output").textContent += delta.content;
    for (const call of delta.tool_calls || []) addToolCall(clock.calls, call);
    if (choice.finish_reason) setState(`done: ${choice.finish_reason}`);
  }
  showStats(clock, started);
}

function addToolCall(calls, piece) {
  const call = calls[piece.index] || (calls[piece.index] = { name: "", arguments: "", item: element("li") });
  if (piece.function && piece.function.name) call.name = piece.function.name;
  if (piece.function && piece.function.arguments) call.arguments += piece.function.arguments;
  call.item.textContent = `${call.name}(${call.arguments})`;
  if (!call.item.isConnected) $("pg-tool-calls").append(call.item);
}

function showStats(clock, started) {
  if (clock.first === null) return;
  const ttft = clock.first - started;
  const tokens = clock.completionTokens ?? clock.chunks;
  const seconds = (clock.last - clock.first) / 1000;
  const rate = seconds > 0 ? `${(tokens / seconds).toFixed(1)} tokens/s` : "";
  $("pg-stats").textContent = `time to first token ${ttft.toFixed(0)} ms · ${tokens} tokens ${rate}`;
}

function setState(state) {
  $("pg-state").textContent = state;
}

async function stop() {
  // Cancel the generation itself (the GPU stops within a step), then stop reading.
  const running = generation;
  if (completionId) {
    await api(`/v1/chat/completions/${encodeURIComponent(completionId)}/cancel`, { method: "POST" })
      .catch(() => null); // finished meanwhile, or the edge is away: stop reading all the same
  }
  if (running) running.abort();
}

// -- usage ---------------------------------------------------------------------------------------

let usageRows = [];

function isoDate(date) {
  return date.toISOString().slice(0, 10);
}

async function loadUsage() {
  if (!$("usage-since").value) {
    const today = new Date();
    $("usage-until").value = isoDate(today);
    $("usage-since").value = isoDate(new Date(today.getTime() - 6 * 86400000));
  }
  const until = new Date(`${$("usage-until").value}T00:00:00Z`);
  const params = new URLSearchParams({
    bucket: $("usage-bucket").value, since: $("usage-since").value,
    until: isoDate(new Date(until.getTime() + 86400000)), // the whole last day
  });
  usageRows = (await (await api(`/v1/usage?${params}`)).json()).data;
  $("usage-table").tBodies[0].replaceChildren(...usageRows.map((r) => row(
    [r.bucket, r.model, r.tier, r.requests, r.prompt_tokens, r.cached_prompt_tokens ?? 0, r.completion_tokens,
      r.cost_usd.toFixed(6)],
    [3, 4, 5, 6, 7])));
  $("usage-csv").disabled = usageRows.length === 0;
  drawChart(usageRows);
}

function drawChart(rows) {
  const svg = $("usage-chart");
  const ns = "http://www.w3.org/2000/svg";
  const perBucket = new Map();
  for (const r of rows) perBucket.set(r.bucket, (perBucket.get(r.bucket) || 0) + r.cost_usd);
  const entries = [...perBucket.entries()];
  const most = Math.max(...entries.map(([, cost]) => cost), 0) || 1;
  const width = Number(svg.getAttribute("width"));
  const barWidth = Math.max(4, Math.min(60, (width - 20) / Math.max(entries.length, 1) - 4));
  const nodes = [];
  entries.forEach(([bucket, cost], i) => {
    const height = (cost / most) * 140;
    const bar = document.createElementNS(ns, "rect");
    bar.setAttribute("x", String(10 + i * (barWidth + 4)));
    bar.setAttribute("y", String(150 - height));
    bar.setAttribute("width", String(barWidth));
    bar.setAttribute("height", String(height));
    const title = document.createElementNS(ns, "title");
    title.textContent = `${bucket}: ${cost.toFixed(6)} USD`;
    bar.append(title);
    const label = document.createElementNS(ns, "text");
    label.setAttribute("x", String(10 + i * (barWidth + 4)));
    label.setAttribute("y", "168");
    label.textContent = bucket.slice(5, $("usage-bucket").value === "day" ? 10 : 13);
    nodes.push(bar, label);
  });
  svg.replaceChildren(...nodes);
}

function csvField(value) {
  const text = String(value);
  return /[",\n]/.test(text) ? `"${text.replaceAll('"', '""')}"` : text;
}

function downloadCsv() {
  const columns = ["bucket", "model", "tier", "requests", "cancelled", "prompt_tokens", "cached_prompt_tokens",
                   "completion_tokens", "input_cost_nanousd", "output_cost_nanousd", "cost_usd"];
  const lines = [columns.join(",")].concat(usageRows.map((r) => columns.map((c) => csvField(r[c])).join(",")));
  save(new Blob([lines.join("\n") + "\n"], { type: "text/csv" }),
       `tokenbus-usage-${$("usage-since").value}-${$("usage-until").value}.csv`);
}

function save(blob, name) {
  const link = element("a", null, { download: name });
  link.href = URL.createObjectURL(blob);
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(link.href), 60_000); // once the download has surely read it
}

// -- batches -----------------------------------------------------------------------------------

async function loadBatches() {
  const batches = (await (await api("/v1/batches?limit=100")).json()).data;
  $("batch-table").tBodies[0].replaceChildren(...batches.map((b) => {
    const actions = element("span");
    for (const [label, fileId, suffix] of [["Output", b.output_file_id, "output"], ["Errors", b.error_file_id, "errors"]]) {
      if (!fileId) continue;
      const button = element("button", label, { type: "button", "data-file": suffix });
      button.addEventListener("click", () => downloadFile(fileId, `${b.id}_${suffix}.jsonl`).catch(showError));
      actions.append(button);
    }
    if (b.status === "in_progress") {
      const cancel = element("button", "Cancel", { type: "button", "data-cancel": b.id });
      cancel.addEventListener("click", () => cancelBatch(b.id).catch(showError));
      actions.append(cancel);
    }
    const problems = b.errors ? b.errors.data.map((e) => `line ${e.line}: ${e.message}`).join("; ") : "";
    const counts = b.request_counts;
    return row([b.id, problems ? `${b.status} (${problems})` : b.status, counts.total, counts.completed, counts.failed,
                new Date(b.created_at * 1000).toLocaleString(), actions], [2, 3, 4]);
  }));
}

async function startBatch(event) {
  event.preventDefault();
  const file = $("batch-file").files[0];
  if (!file) throw new ApiError("Choose a file of requests (JSON lines) first.");
  const form = new FormData();
  form.append("purpose", "batch");
  form.append("file", file);
  const uploaded = await (await api("/v1/files", { method: "POST", body: form })).json();
  await api("/v1/batches", { method: "POST", json: {
    input_file_id: uploaded.id, endpoint: $("batch-endpoint").value, completion_window: "24h" } });
  $("batch-file").value = "";
  await loadBatches();
}

async function downloadFile(fileId, name) {
  save(await (await api(`/v1/files/${encodeURIComponent(fileId)}/content`)).blob(), name);
}

async function cancelBatch(batchId) {
  await api(`/v1/batches/${encodeURIComponent(batchId)}/cancel`, { method: "POST" });
  await loadBatches();
}

// -- conversations ---------------------------------------------------------------------------

let conversationsAfter = null;
let conversationsLoad = 0; // the latest load: an earlier one still in flight must not add its page

async function loadConversations(fromStart) {
  const load = ++conversationsLoad;
  const params = new URLSearchParams({ limit: "20" });
  if (!fromStart && conversationsAfter) params.set("after", conversationsAfter);
  const page = await (await api(`/v1/conversations?${params}`)).json();
  if (load !== conversationsLoad) return;
  if (fromStart) $("conv-list").replaceChildren();
  for (const c of page.data) {
    const open = element("button", `${c.id} · ${c.model} · ${new Date(c.last_turn_at * 1000).toLocaleString()}`,
                         { type: "button" });
    open.addEventListener("click", () => loadTurns(c.id).catch(showError));
    const item = element("li");
    item.append(open);
    $("conv-list").append(item);
  }
  conversationsAfter = page.next_cursor;
  $("conv-more").hidden = !page.has_more;
}

async function loadTurns(conversationId) {
  const page = await (await api(`/v1/conversations/${encodeURIComponent(conversationId)}/messages?limit=100`)).json();
  const turns = page.data.map((m) => {
    const when = new Date(m.created_at * 1000).toLocaleString();
    return turnElement(`${m.role} · ${m.status} · ${when}`, m.content, m.tool_calls);
  });
  $("conv-turns").replaceChildren(element("h2", conversationId), ...turns);
}

function turnElement(meta, content, toolCalls) {
  const turn = element("div", null, { class: "turn" });
  turn.append(element("div", meta, { class: "meta" }));
  turn.append(element("div", content, { class: "content" }));
  for (const call of toolCalls || []) {
    turn.append(element("div", `${call.function.name}(${call.function.arguments})`, { class: "tool-call" }));
  }
  return turn;
}

// -- stored completions ------------------------------------------------------------------------

let storedAfter = null;
let storedLoad = 0; // the latest load: an earlier one still in flight must not add its page

async function loadStored(fromStart) {
  const load = ++storedLoad;
  const params = new URLSearchParams({ limit: "20", order: "desc" });
  const key = $("st-key").value.trim();
  if (key) params.set(`metadata[${key}]`, $("st-value").value);
  if (!fromStart && storedAfter) params.set("after", storedAfter);
  const page = await (await api(`/v1/chat/completions?${params}`)).json();
  if (load !== storedLoad) return;
  if (fromStart) {
    $("st-list").replaceChildren();
    $("st-detail").replaceChildren();
  }
  for (const c of page.data) {
    const open = element("button", `${c.id} · ${c.model} · ${new Date(c.created * 1000).toLocaleString()}`,
                         { type: "button" });
    open.addEventListener("click", () => loadStoredOne(c).catch(showError));
    const item = element("li");
    item.append(open);
    $("st-list").append(item);
  }
  storedAfter = page.last_id;
  $("st-more").hidden = !page.has_more;
}

async function loadStoredOne(completion) {
  const path = `/v1/chat/completions/${encodeURIComponent(completion.id)}`;
  const messages = (await (await api(`${path}/messages?limit=100`)).json()).data;
  const asked = messages.map((m) => turnElement(m.role, m.content ?? "", m.tool_calls));
  const answers = completion.choices.map((c) => turnElement(`assistant · ${c.finish_reason}`, c.message.content ?? "",
                                                            c.message.tool_calls));
  const metadata = Object.entries(completion.metadata || {}).map(([k, v]) => `${k}=${v}`).join(", ");
  const usage = completion.usage || {};
  const tokens = `${usage.prompt_tokens} + ${usage.completion_tokens} tokens`;
  const facts = element("div", `${completion.model} · ${completion.service_tier || "default"} · ${tokens} · ` +
                        `${metadata || "no metadata"}`, { class: "meta" });
  const remove = element("button", "Delete", { type: "button", id: "st-delete" });
  remove.addEventListener("click", async () => {
    try {
      await api(path, { method: "DELETE" });
      await loadStored(true);
    } catch (error) {
      showError(error);
    }
  });
  $("st-detail").replaceChildren(element("h2", completion.id), facts, ...asked, ...answers, remove);
}

// -- keys --------------------------------------------------------------------------------------

async function loadKeys() {
  const self = await (await api("/v1/keys/self")).json();
  const facts = [["id", self.id], ["tenant", self.tenant], ["tier", self.tier],
                 ["models", self.models.length ? self.models.join(", ") : "all"], ["admin", self.admin ? "yes" : "no"]];
  for (const [level, quota] of Object.entries(self.quota)) {
    facts.push([`${level} requests/min`, limitText(quota.requests_per_minute, quota.remaining_requests)]);
    facts.push([`${level} tokens/min`, limitText(quota.tokens_per_minute, quota.remaining_tokens)]);
  }
  $("keys-self").replaceChildren(...facts.flatMap(([name, value]) => [element("dt", name), element("dd", value)]));
  $("keys-admin").hidden = !self.admin;
  if (self.admin) await loadTenantKeys(self.id);
}

function limitText(limit, remaining) {
  return limit === null ? "no limit" : `${remaining} of ${limit} left`;
}

async function loadTenantKeys(ownId) {
  const keys = (await (await api("/v1/keys")).json()).data;
  $("keys-table").tBodies[0].replaceChildren(...keys.map((k) => {
    let action = element("span", k.id === ownId ? "this key" : "");
    if (!k.revoked && k.id !== ownId) {
      action = element("button", "Revoke", { type: "button", "data-key": k.id });
      action.addEventListener("click", () => revoke(k.id).catch(showError));
    }
    return row([k.id, k.tier, k.models.length ? k.models.join(", ") : "all", k.rpm || "none", k.tpm || "none",
                new Date(k.created_at * 1000).toLocaleString(), k.revoked ? "revoked" : "active", action], [3, 4]);
  }));
}

async function createKey(event) {
  event.preventDefault();
  const wanted = { rpm: Number($("keys-rpm").value) || 0, tpm: Number($("keys-tpm").value) || 0 };
  if ($("keys-tier").value.trim()) wanted.tier = $("keys-tier").value.trim();
  const models = $("keys-models").value.split(",").map((m) => m.trim()).filter(Boolean);
  if (models.length) wanted.models = models;
  const made = await (await api("/v1/keys", { method: "POST", json: wanted })).json();
  $("keys-secret-value").textContent = made.key;
  $("keys-secret").hidden = false;
  await loadKeys();
}

async function revoke(keyId) {
  await api(`/v1/keys/${encodeURIComponent(keyId)}`, { method: "DELETE" });
  await loadKeys();
}

// -- wiring -------------------------------------------------------------------------------------

function keyChanged() {
  $("key-status").textContent = apiKey() ? "key in use (this tab only)" : "no key";
  $("pg-model").replaceChildren();
  const current = document.querySelector("nav button[aria-current='page']");
  show(current ? current.dataset.tab : "playground");
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY_STORAGE, $("key-input").value.trim());
  $("key-input").value = "";
  keyChanged();
});
$("key-forget").addEventListener("click", () => {
  sessionStorage.removeItem(KEY_STORAGE);
  keyChanged();
});
for (const button of document.querySelectorAll("nav button")) {
  button.addEventListener("click", () => show(button.dataset.tab));
}
$("pg-send").addEventListener("click", () => send());
$("pg-stop").addEventListener("click", stop);
$("usage-show").addEventListener("click", () => loadUsage().catch(showError));
$("usage-csv").addEventListener("click", downloadCsv);
$("conv-refresh").addEventListener("click", () => loadConversations(true).catch(showError));
$("conv-more").addEventListener("click", () => loadConversations(false).catch(showError));
$("st-filter").addEventListener("submit", (event) => {
  event.preventDefault();
  loadStored(true).catch(showError);
});
$("st-more").addEventListener("click", () => loadStored(false).catch(showError));
$("batch-create").addEventListener("submit", (event) => startBatch(event).catch(showError));
$("batch-refresh").addEventListener("click", () => loadBatches().catch(showError));
$("keys-create").addEventListener("submit", (event) => createKey(event).catch(showError));
keyChanged();
