"use strict";
// The panels that poll (tiers, recent requests + waterfall, eval) and startup. Needs base.js, ask.js.

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
    panelMsg(panel, d.available ? "" : d.error || "No evaluation yet: run `ragcache eval`.");
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
