"use strict";
// The ask panel: retrieve-and-generate streamed over fetch (SSE), chunks, and the prompt's tokens.

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
    + ` · recomputed ${u.recomputed_tokens} · TTFT ${fmtMs(t.ttft)} ms${t.repair ? ` · repair ${fmtMs(t.repair)} ms` : ""} · total ${fmtMs(t.total)} ms · ${u.completion_tokens} tok out`);
  selectedId = d.request_id;
  refreshRecent();
}

const RATIO_MODES = ["cacheblend", "probe", "a3", "blendq", "deferred"];  // whose knob is the share recomputed

async function ask(ev) {
  ev.preventDefault();
  if (askCtl) askCtl.abort();
  const ctl = (askCtl = new AbortController());
  const mode = $("#ask-mode").value;
  const body = {
    query: $("#ask-query").value.trim(), namespace: $("#ask-namespace").value.trim(),
    top_k: parseInt($("#ask-topk").value, 10), mode: mode || null,  // "": the server's RAGCACHE_MODE
    recompute_ratio: RATIO_MODES.includes(mode) ? parseFloat($("#ask-ratio").value) : null,
    epic_k: mode === "epic" ? parseInt($("#ask-epic-k").value, 10) : null,
    target_kl: ["auto", "adaptive"].includes(mode) && $("#ask-target-kl").value !== "" ? parseFloat($("#ask-target-kl").value) : null,
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
  for (const l of document.querySelectorAll("[data-for-mode]")) l.hidden = !l.dataset.forMode.split(" ").includes(mode);
}
