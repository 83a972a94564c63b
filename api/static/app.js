"use strict";
// ragcache dashboard: plain ES2020, no dependencies, every request same-origin.
// Sections: helpers · API access + banner · tiers · recent requests + waterfall · ask (SSE) · eval · startup.

const POLL_MS = 3000;
const EVAL_EVERY = 10;                     // eval refresh every 10 polls (~30 s)
const KEY_STORE = "ragcache.apiKey";
const NS_STORE = "ragcache.namespace";

// ---------- helpers ----------
const $ = (sel, root = document) => root.querySelector(sel);

function el(tag, props = {}, ...kids) {
  const n = document.createElement(tag);
  for (const [k, v] of Object.entries(props)) {
    if (v == null) continue;
    if (k === "class") n.className = v;
    else if (k === "text") n.textContent = v;
    else if (k.startsWith("data-")) n.setAttribute(k, v);
    else if (k === "style") for (const [prop, x] of Object.entries(v)) n.style.setProperty(prop, x);
    else n[k] = v;
  }
  n.append(...kids);
  return n;
}

const num = (x) => (typeof x === "number" && Number.isFinite(x) ? x : null);
const pct = (x) => (num(x) == null ? "–" : `${(x * 100).toFixed(1)}%`);
const fmtMs = (x) => (num(x) == null ? "–" : x < 100 ? x.toFixed(1) : String(Math.round(x)));
const fmtTime = (unix) => new Date(unix * 1000).toLocaleTimeString([], { hour12: false });
const hue = (i) => Math.round((i * 137.508 + 200) % 360);   // golden-angle palette, one hue per chunk

function fmtBytes(n) {
  if (num(n) == null) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${i ? n.toFixed(1) : n} ${units[i]}`;
}

const fmtNum = (x) => (x == null ? "–" : typeof x !== "number" || Number.isInteger(x) ? String(x) : x.toPrecision(3));

// ---------- API access + banner ----------
class ApiError extends Error {
  constructor(status, message, type = "") { super(message); this.status = status; this.type = type; }
}

const banner = {
  msgs: new Map(),
  set(kind, text) { this.msgs.set(kind, text); this.render(); },
  clear(kind) { if (this.msgs.delete(kind)) this.render(); },
  render() {
    const b = $("#banner");
    b.replaceChildren(...[...this.msgs].map(([k, t]) => el("p", { "data-kind": k, text: t })));
    b.dataset.kind = [...this.msgs.keys()].join(" ");
    b.hidden = this.msgs.size === 0;
  },
};

function setReachable(ok) {
  const c = $("#conn");
  c.textContent = ok ? `live · ${fmtTime(Date.now() / 1000)}` : "offline";
  c.classList.toggle("down", !ok);
  if (ok) banner.clear("unreachable");
  else banner.set("unreachable", `Server unreachable: cannot connect to ${location.origin}. Retrying every ${POLL_MS / 1000} s…`);
}

async function api(path, { method = "GET", body, signal } = {}) {
  const key = sessionStorage.getItem(KEY_STORE);
  const headers = {};
  if (key) headers.Authorization = `Bearer ${key}`;
  if (body) headers["Content-Type"] = "application/json";
  let res;
  try {
    res = await fetch(path, { method, headers, signal, cache: "no-store", body: body && JSON.stringify(body) });
  } catch (err) {
    if (err.name === "AbortError") throw err;
    setReachable(false);
    throw new ApiError(0, "server unreachable");
  }
  setReachable(true);
  if (res.status !== 401) banner.clear("auth");    // the key (or no key) was accepted
  if (res.ok) return res;
  let message = res.statusText, type = "";
  try { const e = (await res.json()).error || {}; message = e.message || message; type = e.type || ""; } catch { /* not JSON */ }
  if (res.status === 401) {
    banner.set("auth", key ? `API key rejected (401): ${message}. Enter a valid key above.`
                           : `This server needs an API key (401): enter one above.`);
  }
  throw new ApiError(res.status, message, type);
}

const errText = (e) => (e.status === 0 ? "Server unreachable." : e.status === 401 ? "Needs a valid API key (401)."
  : e.status === 403 ? `Forbidden (403): ${e.message}` : `Error${e.status > 0 ? ` ${e.status}` : ""}${e.type ? ` (${e.type})` : ""}: ${e.message}`);

function panelMsg(panel, text = "", isError = false) {
  const p = $(".panel-msg", panel);
  Object.assign(p, { textContent: text, hidden: !text });
  p.classList.toggle("error", isError);
}

// An API failure shown inside its panel; auth failures also clear the panel (stale numbers would mislead).
function panelError(panel, e, forbidden, clear) {
  if (e.status === 401 || e.status === 403) clear();
  panelMsg(panel, e.status === 0 ? "Server unreachable: showing the last values received."
    : e.status === 403 ? `${forbidden} (403: ${e.message})` : errText(e), true);
}

// ---------- tiers ----------
function stat(field, label, text, value, title) {
  return el("div", { class: "stat", "data-field": field, "data-value": value, title },
    el("dt", { text: label }), el("dd", { text }));
}

function tierCard(t) {
  const cap = num(t.capacity_bytes) || 0, used = num(t.used_bytes) || 0;
  const frac = cap > 0 ? Math.min(1, used / cap) : 0;
  const lookups = (t.hits || 0) + (t.misses || 0);
  const rate = lookups ? t.hits / lookups : null;
  const bar = el("div", { class: `bar${frac > 0.9 ? " full" : ""}`, "data-field": "used_bytes", "data-value": used,
    title: cap > 0 ? `${pct(frac)} full` : "no capacity limit" }, el("div", { class: "fill", style: { width: `${(frac * 100).toFixed(1)}%` } }));
  return el("div", { class: "tier", "data-tier": t.name },
    el("div", { class: "tier-head" }, el("strong", { text: t.name }),
      el("span", { class: "muted", text: cap > 0 ? `${fmtBytes(used)} / ${fmtBytes(cap)} (${pct(frac)})` : `${fmtBytes(used)} (no limit)` })),
    bar,
    el("dl", {},
      stat("entries", "entries", String(t.entries), t.entries),
      stat("hit_rate", "hit rate", pct(rate), rate ?? "", `${t.hits} hits / ${t.misses} misses`),
      stat("evictions", "evictions", String(t.evictions), t.evictions),
      stat("corrupt", "corrupt", String(t.corrupt), t.corrupt),
      t.errors ? stat("errors", "errors", String(t.errors), t.errors) : ""));
}

async function refreshTiers() {
  const panel = $("#tiers"), list = $(".tier-list", panel);
  try {
    const d = await (await api("/v1/cache/stats")).json();
    panelMsg(panel, d.tiers.length ? "" : "No tiers configured.");
    list.replaceChildren(...d.tiers.map(tierCard));
    $("#tiers-extra").textContent = `pinned ${d.pinned} · corrupt dropped ${d.corrupt_dropped}`;
  } catch (e) {
    panelError(panel, e, "Stats need the admin key", () => { list.replaceChildren(); $("#tiers-extra").textContent = ""; });
  }
}

// ---------- recent requests + waterfall ----------
let recent = [], selectedId = null;
let selected = null;                       // the selected request's record (kept if it scrolls out of the list)

function renderRecent() {
  const cell = (text, cls) => el("td", { class: cls, text });
  const rows = recent.map((r) => {
    const t = r.timings_ms || {};
    const tr = el("tr", { "data-id": r.id, tabIndex: 0, title: `${r.route} · status ${r.status} · id ${r.id}` },
      cell(fmtTime(r.time)), cell(r.namespace), cell(r.mode), cell(String(r.prompt_tokens), "num"),
      cell(r.prompt_tokens ? pct(r.reused_tokens / r.prompt_tokens) : "–", "num"),
      cell(fmtMs(t.ttft), "num"), cell(fmtMs(t.total), "num"));
    tr.classList.toggle("selected", r.id === selectedId);
    tr.classList.toggle("failed", r.status >= 400);
    return tr;
  });
  if (!rows.length) rows.push(el("tr", { class: "empty" }, el("td", { colSpan: 7, text: "No requests yet." })));
  $("#recent tbody").replaceChildren(...rows);
}

async function refreshRecent() {
  const panel = $("#recent");
  try {
    recent = (await (await api("/v1/requests/recent?limit=50")).json()).requests;
    panelMsg(panel);
    renderRecent();
    if (recent.some((r) => r.id === selectedId)) selectRequest(selectedId);
  } catch (e) {
    panelError(panel, e, "Recent requests need the admin key", () => { recent = []; renderRecent(); });
  }
}

function selectRequest(id) {
  selectedId = id;
  selected = recent.find((r) => r.id === id) || selected;
  for (const tr of document.querySelectorAll("#recent tbody tr")) tr.classList.toggle("selected", tr.dataset.id === id);
  if (selected && selected.id === id) renderWaterfall(selected);
}

function renderWaterfall(r) {
  const t = r.timings_ms || {};
  const v = (k) => num(t[k]) || 0;
  const a = v("retrieve"), b = a + v("load"), c = b + v("blend");
  const ttft = Math.max(v("ttft"), c), end = Math.max(ttft + v("decode"), v("total"), 1e-9);
  const stages = [["retrieve", 0, a, `${fmtMs(a)} ms`], ["load", a, b, `${fmtMs(v("load"))} ms`],
    ["blend", b, c, `${fmtMs(v("blend"))} ms`], ["first token", c, ttft, `at ${fmtMs(ttft)} ms`],
    ["decode", ttft, ttft + v("decode"), `${fmtMs(v("decode"))} ms`]];
  const rows = stages.map(([name, s, e, label]) => {
    const bar = el("div", { class: "span", title: `${name}: ${fmtMs(s)} → ${fmtMs(e)} ms`,
      style: { left: `${(s / end) * 100}%`, width: `${((e - s) / end) * 100}%` } });
    return el("div", { class: "stage", "data-stage": name },
      el("span", { class: "stage-name", text: name }), el("div", { class: "track" }, bar), el("span", { class: "stage-ms", text: label }));
  });
  const mag = 10 ** Math.floor(Math.log10(end / 4)), f = end / 4 / mag;
  const step = (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * mag;    // round ticks: 1, 2 or 5 × 10^k ms
  const ticks = Array.from({ length: Math.floor(end / step + 1e-9) + 1 }, (_, i) => i * step);
  const axis = el("div", { class: "axis" }, ...ticks.map((x, i) =>
    el("span", { text: `${+x.toPrecision(6)}${i === ticks.length - 1 ? " ms" : ""}`, style: { left: `${(x / end) * 100}%` } })));
  const head = `${fmtTime(r.time)} · ${r.namespace} · ${r.mode} · status ${r.status} · total ${fmtMs(v("total"))} ms`;
  $("#waterfall").replaceChildren(el("h3", { text: head }), ...rows,
    el("div", { class: "axis-row" }, el("span"), axis, el("span")));
}

// ---------- ask (streaming SSE over fetch) ----------
let askCtl = null;

async function readSse(res, onEvent) {
  const reader = res.body.getReader(), dec = new TextDecoder();
  let buf = "";
  const dispatch = (block) => {
    let event = "message";
    const data = [];
    for (const line of block.split("\n")) {
      if (!line || line.startsWith(":")) continue;
      const i = line.indexOf(":");
      const field = i < 0 ? line : line.slice(0, i);
      const val = i < 0 ? "" : line.slice(i + 1).replace(/^ /, "");
      if (field === "event") event = val;
      else if (field === "data") data.push(val);
    }
    if (data.length) onEvent(event, JSON.parse(data.join("\n")));
  };
  try {
    for (;;) {
      const { value, done } = await reader.read();
      buf = (buf + dec.decode(value || new Uint8Array(), { stream: !done })).replace(/\r\n/g, "\n");
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) { dispatch(buf.slice(0, i)); buf = buf.slice(i + 2); }
      if (done) { if (buf.trim()) dispatch(buf); return; }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

function askStatus(text, isError = false) {
  $("#ask-status").textContent = text;
  $("#ask-status").classList.toggle("error", isError);
}

function renderChunks(chunks, ex) {
  const rec = new Set(ex ? ex.recomputed : []);
  const recIn = (i) => {                     // "recomputed n / length" of chunk i, from its segment
    const s = ex && ex.segments.find((g) => g.kind === "chunk" && g.chunk === i);
    let n = 0;
    if (s) for (let p = s.start; p < s.end; p++) n += rec.has(p);
    return s ? `recomputed ${n} / ${s.end - s.start}` : "";
  };
  $("#chunks").replaceChildren(...chunks.map((c, i) => el("li", { "data-chunk": i, title: `chunk id ${c.id}`, style: { "--h": hue(i) } },
    el("span", { class: "swatch" }), el("span", { class: "doc", text: c.doc_id }),
    el("span", { class: "score", text: `score ${fmtNum(c.score)}` }),
    el("span", { class: "tier-badge", "data-tier": c.tier, text: c.tier }), el("span", { class: "rec", text: recIn(i) }))));
}

// One span per segment (prefix, each chunk, suffix), one span per token inside it.
function tokenSegment(s, ex, rec, maxDev) {
  const seg = el("span", { class: "seg", "data-kind": s.kind });
  if (s.kind === "chunk" && s.chunk != null) {
    Object.assign(seg.dataset, { chunk: s.chunk, label: s.chunk + 1 });   // label matches the 1-based chunk list
    seg.style.setProperty("--h", hue(s.chunk));
  }
  for (let p = s.start; p < s.end; p++) {
    const tok = el("span", { class: "tok", text: ex.tokens[p] });
    const d = ex.deviation ? ex.deviation[p] : null;
    let tip = `${s.kind}${s.chunk != null ? ` ${s.chunk + 1}` : ""} · position ${p}`;
    if (d != null) tip += ` · deviation ${fmtNum(d)}`;
    if (rec.has(p)) {
      tok.classList.add("recomputed");
      tip += " · recomputed";
      if (d != null && maxDev > 0) tok.style.setProperty("--dev", (0.3 + (0.7 * d) / maxDev).toFixed(3));
    }
    tok.title = tip;
    seg.append(tok);
  }
  return seg;
}

function renderTokens(ex) {
  const box = $("#tokens");
  if (!ex) return box.replaceChildren(el("p", { class: "hint", text: "The server sent no token explanation." }));
  const rec = new Set(ex.recomputed || []);
  const maxDev = (ex.deviation || []).reduce((m, x) => (x != null && x > m ? x : m), 0);
  const parts = [];
  let at = 0;                                // positions no segment covers still show, neutral
  for (const s of [...ex.segments].sort((a, b) => a.start - b.start)) {
    if (s.start > at) parts.push(tokenSegment({ kind: "other", start: at, end: s.start, chunk: null }, ex, rec, maxDev));
    parts.push(tokenSegment(s, ex, rec, maxDev));
    at = Math.max(at, s.end);
  }
  if (at < ex.tokens.length) parts.push(tokenSegment({ kind: "other", start: at, end: ex.tokens.length, chunk: null }, ex, rec, maxDev));
  box.replaceChildren(...parts);
}

function showResult(d) {
  window.__lastResult = d;
  if (typeof d.answer === "string") $("#answer").textContent = d.answer;
  renderChunks(d.chunks || [], d.explain);
  renderTokens(d.explain);
  const u = d.usage || {}, t = d.timings_ms || {};
  askStatus(`prompt ${u.prompt_tokens} tok · reused ${u.reused_tokens} (${pct(u.reused_tokens / u.prompt_tokens)})`
    + ` · recomputed ${u.recomputed_tokens} · TTFT ${fmtMs(t.ttft)} ms · total ${fmtMs(t.total)} ms · ${u.completion_tokens} tok out`);
  selectedId = d.request_id;
  refreshRecent();
}

async function ask(ev) {
  ev.preventDefault();
  if (askCtl) askCtl.abort();
  const ctl = (askCtl = new AbortController());
  const mode = $("#ask-mode").value;
  const body = {
    query: $("#ask-query").value.trim(), namespace: $("#ask-namespace").value.trim(),
    top_k: parseInt($("#ask-topk").value, 10), mode,
    recompute_ratio: mode === "cacheblend" ? parseFloat($("#ask-ratio").value) : null,
    epic_k: mode === "epic" ? parseInt($("#ask-epic-k").value, 10) : null,
    max_tokens: parseInt($("#ask-max").value, 10), stream: true, explain: true,
  };
  sessionStorage.setItem(NS_STORE, body.namespace);
  window.__lastResult = null;
  $("#answer").textContent = "";
  for (const id of ["#chunks", "#tokens"]) $(id).replaceChildren();
  $("#ask-stop").disabled = false;
  askStatus("retrieving and prefilling…");
  const t0 = performance.now();
  let gotFirst = false, finished = false;
  try {
    const res = await api("/v1/rag/generate", { method: "POST", body, signal: ctl.signal });
    await readSse(res, (event, data) => {
      if (event === "token") {
        if (!gotFirst) { gotFirst = true; askStatus(`streaming… first token after ${fmtMs(performance.now() - t0)} ms`); }
        $("#answer").append(data.text);
      } else if (event === "done") { finished = true; showResult(data); }
      else if (event === "error") { const e = data.error || {}; throw new ApiError(-1, e.message || "stream error", e.type); }
    });
    if (!finished) askStatus("The stream ended before the answer was complete.", true);
  } catch (e) {
    if (askCtl === ctl) askStatus(e.name === "AbortError" ? "Stopped." : errText(e), e.name !== "AbortError");
  } finally {
    if (askCtl === ctl) { askCtl = null; $("#ask-stop").disabled = true; }
  }
}

function showModeInputs() {
  const mode = $("#ask-mode").value;
  for (const l of document.querySelectorAll("[data-for-mode]")) l.hidden = l.dataset.forMode !== mode;
}

// ---------- eval ----------
const EVAL_COLS = { ttft_s_median: "TTFT s", speedup_vs_full: "speedup", recompute_fraction: "recompute",
  f1_vs_full: "F1 vs full", top1_agree: "top-1 agree", kl_first: "KL first", kl_tf: "KL forced", f1_gold: "F1 gold" };
let evalKey = "", evalPlotUrl = null;

function renderEval(d) {
  const r = d.results || {}, modes = r.modes || {}, rows = Object.values(modes);
  const extra = [...new Set(rows.flatMap(Object.keys))].filter((k) => !(k in EVAL_COLS) && rows.some((m) => typeof m[k] === "number"));
  const cols = [...Object.keys(EVAL_COLS).filter((k) => rows.some((m) => k in m)), ...extra];
  $("#eval-table thead").replaceChildren(el("tr", {}, el("th", { text: "mode" }), ...cols.map((k) => el("th", { class: "num", text: EVAL_COLS[k] || k, title: k }))));
  $("#eval-table tbody").replaceChildren(...Object.entries(modes).map(([label, m]) =>
    el("tr", { "data-mode": label }, el("td", { text: label }), ...cols.map((k) => el("td", { class: "num", text: fmtNum(m[k]) })))));
  $("#eval-meta").textContent = `${r.model ?? "?"} · ${r.dataset ?? "?"} · n=${r.n ?? "?"} · top-k ${r.top_k ?? "?"}`;
}

async function refreshEval() {
  const panel = $("#eval"), body = $(".eval-body", panel), img = $("#eval-plot");
  try {
    const d = await (await api("/v1/eval/latest")).json();
    const key = JSON.stringify(d);
    if (key === evalKey) return;
    evalKey = key;
    body.hidden = !d.available;
    panelMsg(panel, d.available ? "" : "No evaluation yet: run `ragcache eval`.");
    if (!d.available) { $("#eval-meta").textContent = ""; return; }
    renderEval(d);
    img.hidden = !(typeof d.plot_url === "string" && d.plot_url.startsWith("/"));   // same-origin only
    if (img.hidden) return;
    const blob = await (await api(d.plot_url)).blob();     // the plot needs the auth header too: no plain <img src>
    if (evalPlotUrl) URL.revokeObjectURL(evalPlotUrl);
    img.src = evalPlotUrl = URL.createObjectURL(blob);
  } catch (e) {
    evalKey = "";
    panelError(panel, e, "The evaluation needs the admin key", () => { body.hidden = true; });
  }
}

// ---------- startup ----------
let polls = 0;

async function poll() {
  try {
    await Promise.all([refreshTiers(), refreshRecent(), polls++ % EVAL_EVERY === 0 ? refreshEval() : null]);
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

function init() {
  $("#api-key").value = sessionStorage.getItem(KEY_STORE) || "";
  $("#ask-namespace").value = sessionStorage.getItem(NS_STORE) || $("#ask-namespace").value;
  $("#key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const k = $("#api-key").value.trim();
    if (k) sessionStorage.setItem(KEY_STORE, k); else sessionStorage.removeItem(KEY_STORE);
    banner.clear("auth");
    evalKey = "";
    refreshTiers(); refreshRecent(); refreshEval();
  });
  $("#key-clear").addEventListener("click", () => { $("#api-key").value = ""; $("#key-form").requestSubmit(); });
  $("#ask-form").addEventListener("submit", ask);
  $("#ask-stop").addEventListener("click", () => askCtl && askCtl.abort());
  $("#ask-mode").addEventListener("change", showModeInputs);
  const onRow = (ev) => {
    const tr = ev.target.closest("tr[data-id]");
    if (!tr || (ev.type === "keydown" && ev.key !== "Enter" && ev.key !== " ")) return;
    ev.preventDefault();
    selectRequest(tr.dataset.id);
  };
  for (const type of ["click", "keydown"]) $("#recent tbody").addEventListener(type, onRow);
  showModeInputs();
  poll();
}

init();
