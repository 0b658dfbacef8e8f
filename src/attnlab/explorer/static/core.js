// attnlab explorer, the core every view shares: the page's state, the API client, and the helpers
// for numbers, colours and SVG. No view is imported here, so a view module loads with this file
// alone.
//
// Design choices:
// - Every number comes from the JSON API (/api/...), one request per view and per head, fetched
// only
//   when that view is shown (lazy loading) and remembered until the text or the model changes.
// - In an exported HTML file (attnlab export-html) or a notebook, window.ATTNLAB_EXPORT holds the
//   precomputed responses and `api` answers from it instead of the network.
// - Experiments: knocked-out heads (state.ablate) and a training step (state.step) ride along in
// every
//   request body (`body`), so every view shows that model and the cache keys them apart.
// - A view that changes what every view shows (a head knocked out, a token appended) asks the page
// through
//   `page.refresh()` / `page.runText()`, which app.js sets: the views never import the page that
//   imports them.

export const EXPORT = window.ATTNLAB_EXPORT || null;
// A server listening beyond this machine needs the token its URL carries (/?token=...), sent with
// every call.
export const TOKEN = EXPORT ? null : new URLSearchParams(window.location.search).get("token");
export const $ = (id) => document.getElementById(id);
export const SVG_NS = "http://www.w3.org/2000/svg";

// The page's two actions, set by app.js; a view loaded alone (a test) sets its own.
export const page = {
  refresh() {
    throw new Error("page.refresh is not set: app.js sets it when the whole page loads");
  },
  runText() {
    throw new Error("page.runText is not set: app.js sets it when the whole page loads");
  },
};

export const state = {
  models : [],
  model : null,
  info : null,
  text : "",
  tokens : [],
  layer : 0,
  head : 0,
  view : "dict",
  responses : new Map(),
  dict : {mode : "real", mult : 1, query : null, queryToken : null, toyAt : null, weights : []},
  matrix : {stage : "softmax", mask : null, shown : null},
  heads : {threshold : 0.05, selected : null},
  block : {token : null, stage : 0}, // token null: the last one
  next : {temperature : 1, topK : 0, topP : 1, appended : ""},
  ablate : [],
  ablation : "zero",
  step : null,
  clickMode : "open",
  training : null,
  knock : null,
  timings : {},
};

// Data
export function requestKey(path, body) {
  const keys = Object.keys(body || {}).sort();
  return path + " " + JSON.stringify(keys.map((k) => [k, body[k]]));
}

export async function api(path, body) {
  const key = body ? requestKey(path, body) : path;
  if (EXPORT) {
    if (key in EXPORT.responses) return EXPORT.responses[key];
    throw new Error(
        "this exported page holds precomputed data for its own text and settings only; " +
        "run `attnlab explore` for everything else");
  }
  if (body && state.responses.has(key)) return state.responses.get(key);
  const response = await send(path, body);
  const data = await response.json();
  if (body) state.responses.set(key, data);
  return data;
}

export async function send(path, body) {
  // the server's answer to GET path (or POST body as JSON), with the token; an error's one line
  // thrown, with its HTTP status as `status`
  const headers = TOKEN ? {Authorization : "token " + TOKEN} : {};
  const init = body ? {
    method : "POST",
    headers : Object.assign({"Content-Type" : "application/json"}, headers),
    body : JSON.stringify(body)
  }
                    : {headers};
  let response = await fetch(path, init);
  // a full queue answers 503 at once with Retry-After: wait that long and ask again (a few times)
  for (let tries = 0; response.status === 503 && response.headers.has("Retry-After") && tries < 5;
       tries++) {
    await new Promise((resolve) => setTimeout(
                          resolve, 1000 * (Number(response.headers.get("Retry-After")) || 1)));
    response = await fetch(path, init);
  }
  if (!response.ok) {
    const data = await response.json().catch(() => ({}));
    const detail =
        Array.isArray(data.detail)
            ? data.detail.map((d) => (d.loc || []).slice(1).join(".") + ": " + d.msg).join("; ")
            : data.detail;
    throw Object.assign(new Error(detail || response.statusText), {status : response.status});
  }
  return response;
}

// Above this many tokens the page asks for matrices as float16 (half of float32's bytes, a causal
// pattern's lower triangle only), shows their values to 3 significant digits, and draws the model's
// own pattern rather than recomputing the softmax from the raw scores
export const LONG_TEXT = 512;
export const patternEncoding = () =>
    (state.tokens && state.tokens.length > LONG_TEXT ? "f16" : "f32");
let HALF = null; // every float16 bit pattern's value, built once

export function halfTable() {
  if (HALF) return HALF;
  HALF = new Float32Array(65536);
  for (let h = 0; h < 65536; h++) {
    const sign = h & 0x8000 ? -1 : 1, e = (h >> 10) & 0x1f, f = h & 0x3ff;
    HALF[h] = sign * (e === 0    ? f * 2 ** -24
                      : e === 31 ? (f ? NaN : Infinity)
                                 : (1 + f / 1024) * 2 ** (e - 15));
  }
  return HALF;
}

export function decodeMatrix(m) {
  // {shape, f32: base64} or {shape, f16: base64, scale, lower} -> array of Float32Array rows (a
  // `lower` matrix holds only its lower triangle, row by row: the rest is 0); nested lists pass
  // through.
  if (!m || !(m.f32 || m.f16)) return m;
  const text = atob(m.f32 || m.f16), bytes = new Uint8Array(text.length);
  for (let i = 0; i < text.length; i++)
    bytes[i] = text.charCodeAt(i); // a plain loop: megabytes at 2,048 tokens
  const [rows, cols] = m.shape;
  let flat;
  if (m.f32)
    flat = new Float32Array(bytes.buffer);
  else {
    const half = new Uint16Array(bytes.buffer), table = halfTable(), scale = m.scale;
    flat = new Float32Array(rows * cols);
    for (let i = 0, k = 0; i < rows; i++) {
      const n = m.lower ? i + 1 : cols, o = i * cols;
      for (let j = 0; j < n; j++) flat[o + j] = table[half[k++]] * scale;
    }
  }
  const out = [];
  for (let i = 0; i < rows; i++) out.push(flat.subarray(i * cols, (i + 1) * cols));
  return out;
}

export function body(extra) {
  // the model, the text, and the experiment: knocked-out heads and a training step, only when set
  // (so an exported page's precomputed keys, made without them, still match)
  const b = {model : state.model, text : state.text};
  if (state.ablate.length) {
    b.ablate = state.ablate.map((h) => h.slice());
    b.ablation = state.ablation;
  }
  if (state.step !== null) b.step = state.step;
  return Object.assign(b, extra || {});
}
export const plainBody = (extra) => {
  const b = body(extra);
  delete b.ablate;
  delete b.ablation;
  return b;
};
export const headName = (h) => `L${h[0]}H${h[1]}`;
export const isOff = (l, hd) => state.ablate.some((h) => h[0] === l && h[1] === hd);

export function setStatus(message, isError) {
  const el = $("status");
  el.textContent = message || "";
  el.className = isError ? "error" : "";
}

export async function guarded(fn) {
  try {
    await fn();
  } catch (err) {
    setStatus(err.message, true);
  }
}

// ---------------------------------------------------------------------------------------------
// Small helpers: numbers, colours, SVG
export const fmt = (x, d = 4) =>
    (x === null || x === undefined || !isFinite(x) ? "−∞" : Number(x).toPrecision(d));
// Tokens arrive as the text they read as (the server turns byte-level BPE's stand-ins back into
// characters); SentencePiece pieces keep their "▁" for a space and "<0x0A>" for a byte.
export const show = (t) =>
    t.replace(/<0x0A>/g, "\n").replace(/\n/g, "⏎").replace(/\t/g, "⇥").replace(/[ ▁]/g, "␣");

export function svg(tag, attrs, parent) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, v);
  if (parent) parent.appendChild(el);
  return el;
}

export function clear(el) {
  while (el.firstChild) el.removeChild(el.firstChild);
}

export function blues(w) {
  // 0 -> white, 1 -> deep blue
  const t = Math.max(0, Math.min(1, w));
  return `rgb(${Math.round(255 - 222 * t)},${Math.round(255 - 153 * t)},${
      Math.round(255 - 75 * t)})`;
}

export function diverging(x, maxAbs) {
  // negative -> red, 0 -> white, positive -> blue
  if (x === null || !isFinite(x)) return "#2b2b2b";
  const t = Math.max(-1, Math.min(1, x / (maxAbs || 1)));
  if (t >= 0)
    return `rgb(${Math.round(255 - 222 * t)},${Math.round(255 - 153 * t)},${
        Math.round(255 - 75 * t)})`;
  return `rgb(${Math.round(255 - 30 * -t)},${Math.round(255 - 190 * -t)},${
      Math.round(255 - 190 * -t)})`;
}

export function softmaxRow(scores, visible) {
  // softmax over the visible entries; invisible ones get exactly 0 (as attnlab.model.attention
  // does)
  let max = -Infinity;
  for (let j = 0; j < scores.length; j++)
    if (visible(j) && scores[j] > max) max = scores[j];
  const out = new Array(scores.length).fill(0);
  if (max === -Infinity) return out;
  let sum = 0;
  for (let j = 0; j < scores.length; j++)
    if (visible(j)) {
      out[j] = Math.exp(scores[j] - max);
      sum += out[j];
    }
  for (let j = 0; j < scores.length; j++) out[j] /= sum;
  return out;
}

export function barRow(tag, cellTag, label, fraction, number) {
  // label | bar of width fraction | number; styles set through the DOM, which the page's CSP allows
  const row = document.createElement(tag);
  const cells = [ "tok", "bar", "num" ].map((cls) => {
    const cell = document.createElement(cellTag);
    cell.className = cls;
    row.appendChild(cell);
    return cell;
  });
  cells[0].textContent = label;
  const bar = document.createElement("span");
  bar.style.width = (100 * fraction).toFixed(2) + "%";
  cells[1].appendChild(bar);
  cells[2].textContent = number;
  return row;
}

export function fillSelect(select, n, label) {
  const current = Number(select.value || 0);
  clear(select);
  for (let i = 0; i < n; i++) {
    const o = document.createElement("option");
    o.value = i;
    o.textContent = label(i);
    select.appendChild(o);
  }
  select.value = String(Math.min(current, n - 1));
}

export function chips(container, tokens, selected, onClick) {
  clear(container);
  tokens.forEach((t, i) => {
    const b = document.createElement("button");
    b.type = "button";
    b.className = "chip" + (i === selected ? " active" : "");
    b.textContent = show(t);
    b.title = `token ${i}`;
    b.dataset.index = i;
    b.addEventListener("click", () => onClick(i));
    container.appendChild(b);
  });
}
