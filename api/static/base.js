"use strict";
// ragcache dashboard: plain ES2020, no dependencies, every request same-origin.
// Three scripts, loaded in order: base.js (helpers, API access, banner) · ask.js (ask, streamed, and the
// token view) · app.js (tiers, recent requests + waterfall, eval, startup).

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
