// attnlab explorer: five views of attention on a real model, drawn with SVG and Canvas.
//
// Design choices:
// - Plain JavaScript, no framework and no build step: the file ships in the Python package and runs
//   offline. Large matrices (a 512-token heatmap) go to a <canvas>; small, interactive figures to SVG.
// - Every number comes from the JSON API (/api/...), one request per view and per head, fetched only
//   when that view is shown (lazy loading) and remembered until the text or the model changes.
// - In an exported HTML file (attnlab export-html) or a notebook, window.ATTNLAB_EXPORT holds the
//   precomputed responses and `api` answers from it instead of the network.
// - The only arithmetic done here is what the interactions need: a softmax of the real scores under a
//   different scale or mask, and the 2-D scores of a dragged query. Everything else is the model's.
// - Experiments: knocked-out heads (state.ablate) and a training step (state.step) ride along in every
//   request body, so every view shows that model and the cache keys them apart. The knockout bar compares
//   against the same request without `ablate`.
// - The matrix is painted once into an offscreen canvas, one pixel per cell, and drawn scaled: zoom and pan
//   redraw one image, not T² rectangles (2,048 tokens: 4.2M cells).
// - "save PNG / save SVG" turn the shown view into a standalone SVG (its SVG drawings inlined with their
//   computed styles, canvases as embedded PNGs, text as text), and that SVG into a PNG; the matrix's PNG
//   is its canvas itself.
"use strict";

(function () {
  const EXPORT = window.ATTNLAB_EXPORT || null;
  // A server listening beyond this machine needs the token its URL carries (/?token=...), sent with every call.
  const TOKEN = EXPORT ? null : new URLSearchParams(window.location.search).get("token");
  const $ = (id) => document.getElementById(id);
  const SVG_NS = "http://www.w3.org/2000/svg";

  const state = {
    models: [], model: null, info: null, text: "", tokens: [], layer: 0, head: 0, view: "dict",
    responses: new Map(),
    dict: { mode: "real", mult: 1, query: null, queryToken: null, toyAt: null, weights: [] },
    matrix: { stage: "softmax", mask: null, shown: null },
    heads: { threshold: 0.05, selected: null },
    block: { token: null, stage: 0 },  // token null: the last one
    next: { temperature: 1, topK: 0, topP: 1, appended: "" },
    ablate: [], ablation: "zero", step: null, clickMode: "open", training: null, knock: null,
    timings: {},
  };

  // ---------------------------------------------------------------------------------------------
  // Data
  function requestKey(path, body) {
    const keys = Object.keys(body || {}).sort();
    return path + " " + JSON.stringify(keys.map((k) => [k, body[k]]));
  }

  async function api(path, body) {
    const key = body ? requestKey(path, body) : path;
    if (EXPORT) {
      if (key in EXPORT.responses) return EXPORT.responses[key];
      throw new Error("this exported page holds precomputed data for its own text and settings only; " +
        "run `attnlab explore` for everything else");
    }
    if (body && state.responses.has(key)) return state.responses.get(key);
    const headers = TOKEN ? { Authorization: "token " + TOKEN } : {};
    const init = body ? { method: "POST", headers: Object.assign({ "Content-Type": "application/json" }, headers), body: JSON.stringify(body) }
      : { headers };
    let response = await fetch(path, init);
    // a full queue answers 503 at once with Retry-After: wait that long and ask again (a few times)
    for (let tries = 0; response.status === 503 && response.headers.has("Retry-After") && tries < 5; tries++) {
      await new Promise((resolve) => setTimeout(resolve, 1000 * (Number(response.headers.get("Retry-After")) || 1)));
      response = await fetch(path, init);
    }
    const data = await response.json();
    if (!response.ok) {
      const detail = Array.isArray(data.detail) ? data.detail.map((d) => (d.loc || []).slice(1).join(".") + ": " + d.msg).join("; ") : data.detail;
      throw new Error(detail || response.statusText);
    }
    if (body) state.responses.set(key, data);
    return data;
  }

  // Above this many tokens the page asks for matrices as float16 (half of float32's bytes, a causal pattern's
  // lower triangle only), shows their values to 3 significant digits, and draws the model's own pattern
  // rather than recomputing the softmax from the raw scores
  const LONG_TEXT = 512;
  const patternEncoding = () => (state.tokens && state.tokens.length > LONG_TEXT ? "f16" : "f32");
  let HALF = null; // every float16 bit pattern's value, built once

  function halfTable() {
    if (HALF) return HALF;
    HALF = new Float32Array(65536);
    for (let h = 0; h < 65536; h++) {
      const sign = h & 0x8000 ? -1 : 1, e = (h >> 10) & 0x1f, f = h & 0x3ff;
      HALF[h] = sign * (e === 0 ? f * 2 ** -24 : e === 31 ? (f ? NaN : Infinity) : (1 + f / 1024) * 2 ** (e - 15));
    }
    return HALF;
  }

  function decodeMatrix(m) {
    // {shape, f32: base64} or {shape, f16: base64, scale, lower} -> array of Float32Array rows (a `lower` matrix
    // holds only its lower triangle, row by row: the rest is 0); nested lists pass through.
    if (!m || !(m.f32 || m.f16)) return m;
    const text = atob(m.f32 || m.f16), bytes = new Uint8Array(text.length);
    for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i); // a plain loop: megabytes at 2,048 tokens
    const [rows, cols] = m.shape;
    let flat;
    if (m.f32) flat = new Float32Array(bytes.buffer);
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

  function body(extra) {
    // the model, the text, and the experiment: knocked-out heads and a training step, only when set (so an
    // exported page's precomputed keys, made without them, still match)
    const b = { model: state.model, text: state.text };
    if (state.ablate.length) { b.ablate = state.ablate.map((h) => h.slice()); b.ablation = state.ablation; }
    if (state.step !== null) b.step = state.step;
    return Object.assign(b, extra || {});
  }
  const plainBody = (extra) => { const b = body(extra); delete b.ablate; delete b.ablation; return b; };
  const headName = (h) => `L${h[0]}H${h[1]}`;
  const isOff = (l, hd) => state.ablate.some((h) => h[0] === l && h[1] === hd);

  function setStatus(message, isError) {
    const el = $("status");
    el.textContent = message || "";
    el.className = isError ? "error" : "";
  }

  async function guarded(fn) {
    try {
      await fn();
    } catch (err) {
      setStatus(err.message, true);
    }
  }

  // ---------------------------------------------------------------------------------------------
  // Small helpers: numbers, colours, SVG
  const fmt = (x, d = 4) => (x === null || x === undefined || !isFinite(x) ? "−∞" : Number(x).toPrecision(d));
  const show = (t) => t.replace(/\n/g, "⏎").replace(/ /g, "␣").replace(/^Ġ/, "␣").replace(/^▁/, "␣");

  function svg(tag, attrs, parent) {
    const el = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, v);
    if (parent) parent.appendChild(el);
    return el;
  }

  function clear(el) {
    while (el.firstChild) el.removeChild(el.firstChild);
  }

  function blues(w) {
    // 0 -> white, 1 -> deep blue
    const t = Math.max(0, Math.min(1, w));
    return `rgb(${Math.round(255 - 222 * t)},${Math.round(255 - 153 * t)},${Math.round(255 - 75 * t)})`;
  }

  function diverging(x, maxAbs) {
    // negative -> red, 0 -> white, positive -> blue
    if (x === null || !isFinite(x)) return "#2b2b2b";
    const t = Math.max(-1, Math.min(1, x / (maxAbs || 1)));
    if (t >= 0) return `rgb(${Math.round(255 - 222 * t)},${Math.round(255 - 153 * t)},${Math.round(255 - 75 * t)})`;
    return `rgb(${Math.round(255 - 30 * -t)},${Math.round(255 - 190 * -t)},${Math.round(255 - 190 * -t)})`;
  }

  function softmaxRow(scores, visible) {
    // softmax over the visible entries; invisible ones get exactly 0 (as attnlab.model.attention does)
    let max = -Infinity;
    for (let j = 0; j < scores.length; j++) if (visible(j) && scores[j] > max) max = scores[j];
    const out = new Array(scores.length).fill(0);
    if (max === -Infinity) return out;
    let sum = 0;
    for (let j = 0; j < scores.length; j++) if (visible(j)) { out[j] = Math.exp(scores[j] - max); sum += out[j]; }
    for (let j = 0; j < scores.length; j++) out[j] /= sum;
    return out;
  }

  function barRow(tag, cellTag, label, fraction, number) {
    // label | bar of width fraction | number; styles set through the DOM, which the page's CSP allows
    const row = document.createElement(tag);
    const cells = ["tok", "bar", "num"].map((cls) => {
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

  function fillSelect(select, n, label) {
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

  function chips(container, tokens, selected, onClick) {
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

  // ---------------------------------------------------------------------------------------------
  // View 1: the soft dictionary
  const TOY = {
    tokens: ["cat", "dog", "mat", "sat", "it", "tired"],
    keys: [[2.2, 1.6], [1.6, 2.3], [-2.0, 1.0], [-1.2, -2.1], [1.3, 0.6], [0.2, -2.4]],
    values: [[1.5, 1.8], [1.0, 2.2], [-2.2, 0.6], [-1.5, -1.6], [0.8, 0.9], [0.6, -2.0]],
    scale: 1 / Math.SQRT2,
  };

  async function loadDict() {
    const d = state.dict;
    if (d.mode === "toy") {
      d.data = { tokens: TOY.tokens, keys: TOY.keys, values: TOY.values, queries: null, raw: null, scale: TOY.scale, causal: false };
      if (!d.query) d.query = [1.0, 1.0];
      d.queryToken = null;
    } else {
      const [projection, pattern] = await Promise.all([
        api("/api/projection", body({ layer: state.layer, head: state.head })),
        api("/api/pattern", body({ layer: state.layer, head: state.head, encoding: patternEncoding() })),
      ]);
      d.data = Object.assign({ raw: decodeMatrix(pattern.raw) }, projection);
      // a long text's raw scores are float16: its real tokens' weights are the model's own pattern instead
      if (pattern.pattern.f16) d.data.pattern = decodeMatrix(pattern.pattern);
      if (d.queryToken === null || d.queryToken >= d.data.tokens.length) d.queryToken = d.data.tokens.length - 1;
      d.query = d.data.queries[d.queryToken];
    }
    drawDict();
  }

  function dictWeights() {
    // exact weights for a real token's query (its real scores, re-scaled); 2-D scores for a dragged one
    const d = state.dict, data = d.data, scale = data.scale * d.mult;
    if (d.queryToken !== null && data.pattern && d.mult === 1) return Array.from(data.pattern[d.queryToken]);
    if (d.queryToken !== null && data.raw) {
      const i = d.queryToken;
      const w = data.sliding_window;  // a sliding window: the query and the w − 1 keys before it
      return softmaxRow(Array.from(data.raw[i], (s) => s * scale), (j) => !data.causal || (j <= i && (w == null || j > i - w)));
    }
    const scores = data.keys.map((k) => scale * (d.query[0] * k[0] + d.query[1] * k[1]));
    return softmaxRow(scores, () => true);
  }

  function extent(points) {
    let xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
    xs.push(0); ys.push(0);
    const pad = (a, b) => { const r = (b - a) || 1; return [a - 0.12 * r, b + 0.12 * r]; };
    return [pad(Math.min(...xs), Math.max(...xs)), pad(Math.min(...ys), Math.max(...ys))];
  }

  function scaler(points, width, height) {
    const [[x0, x1], [y0, y1]] = extent(points);
    const m = 28;
    const sx = (width - 2 * m) / (x1 - x0), sy = (height - 2 * m) / (y1 - y0);
    return {
      to: (p) => [m + (p[0] - x0) * sx, height - m - (p[1] - y0) * sy],
      from: (x, y) => [x0 + (x - m) / sx, y0 + (height - m - y) / sy],
    };
  }

  function drawDict() {
    const d = state.dict, data = d.data;
    const weights = dictWeights();
    d.weights = weights;
    const keysSvg = $("dict-keys"), valuesSvg = $("dict-values");
    const W = +keysSvg.getAttribute("width"), H = +keysSvg.getAttribute("height");
    if (!d.keyScale || d.keyScaleFor !== data) {
      // fix the axes per head (not per drag) so that the picture holds still while the query moves
      d.keyScale = scaler(data.keys.concat(data.queries || [d.query]), W, H);
      d.valueScale = scaler(data.values, +valuesSvg.getAttribute("width"), +valuesSvg.getAttribute("height"));
      d.keyScaleFor = data;
    }
    const ks = d.keyScale, vs = d.valueScale;
    clear(keysSvg);
    const origin = ks.to([0, 0]);
    svg("line", { x1: 0, x2: W, y1: origin[1], y2: origin[1], class: "axis" }, keysSvg);
    svg("line", { x1: origin[0], x2: origin[0], y1: 0, y2: H, class: "axis" }, keysSvg);
    const q = ks.to(d.query);
    const threads = svg("g", { id: "dict-threads" }, keysSvg);
    data.keys.forEach((k, j) => {
      const p = ks.to(k);
      svg("line", { x1: q[0], y1: q[1], x2: p[0], y2: p[1], class: "thread", "stroke-width": (0.3 + 12 * weights[j]).toFixed(2),
        "stroke-opacity": (0.15 + 0.85 * weights[j]).toFixed(3), "data-w": weights[j].toFixed(6), "data-key": j }, threads);
    });
    // with many tokens, label only the 20 most attended (and the query's own token), or the labels are a blur
    const labelFrom = data.keys.length <= 80 ? 0 : weights.slice().sort((a, b) => b - a)[19];
    data.keys.forEach((k, j) => {
      const p = ks.to(k);
      const g = svg("g", { class: "key" + (j === d.queryToken ? " self" : ""), "data-index": j }, keysSvg);
      svg("circle", { cx: p[0], cy: p[1], r: 4 + 6 * Math.sqrt(weights[j]) }, g);
      if (weights[j] >= labelFrom || j === d.queryToken) {
        const label = svg("text", { x: p[0] + 7, y: p[1] - 6 }, g);
        label.textContent = show(data.tokens[j]);
      }
      g.addEventListener("click", () => attendAs(j));
    });
    const qdot = svg("circle", { id: "dict-query", cx: q[0], cy: q[1], r: 9 }, keysSvg);
    qdot.addEventListener("pointerdown", startDrag);
    // values panel: the output is the weighted blend of the values (a hollow star)
    clear(valuesSvg);
    const out = [0, 0];
    data.values.forEach((v, j) => { out[0] += weights[j] * v[0]; out[1] += weights[j] * v[1]; });
    const o = vs.to(out);
    data.values.forEach((v, j) => {
      const p = vs.to(v);
      svg("line", { x1: o[0], y1: o[1], x2: p[0], y2: p[1], class: "thread value-thread", "stroke-width": (0.3 + 8 * weights[j]).toFixed(2),
        "stroke-opacity": (0.1 + 0.8 * weights[j]).toFixed(3) }, valuesSvg);
    });
    data.values.forEach((v, j) => {
      const p = vs.to(v);
      const s = 4 + 5 * Math.sqrt(weights[j]);
      svg("rect", { x: p[0] - s, y: p[1] - s, width: 2 * s, height: 2 * s, class: "value" }, valuesSvg);
      if (weights[j] >= labelFrom) {
        const t = svg("text", { x: p[0] + s + 3, y: p[1] + 4 }, valuesSvg);
        t.textContent = show(data.tokens[j]);
      }
    });
    svg("polygon", { id: "dict-output", points: starPoints(o[0], o[1], 13, 5.5), class: "star" }, valuesSvg);
    drawDictText(weights);
  }

  function starPoints(cx, cy, R, r) {
    const pts = [];
    for (let i = 0; i < 10; i++) {
      const a = -Math.PI / 2 + (i * Math.PI) / 5, rad = i % 2 ? r : R;
      pts.push((cx + rad * Math.cos(a)).toFixed(1) + "," + (cy + rad * Math.sin(a)).toFixed(1));
    }
    return pts.join(" ");
  }

  function drawDictText(weights) {
    const d = state.dict, data = d.data;
    const scale = data.scale * d.mult;
    $("dict-scale-out").textContent = `${d.mult.toFixed(2)} → scale ${scale.toPrecision(3)}` +
      (d.mode === "real" ? ` (1/√d_head = ${data.scale.toPrecision(3)})` : "");
    if (d.mode === "toy") {
      $("dict-keys-caption").textContent = "toy: six hand-placed 2-D keys (d_k = 2)";
      $("dict-values-caption").textContent = "toy values; ☆ = Σ weight × value";
    } else {
      $("dict-keys-caption").textContent = `layer ${state.layer} head ${state.head}: keys on their top two principal axes ` +
        `(${(100 * data.keys_variance_kept).toFixed(0)}% of their variance)`;
      $("dict-values-caption").textContent = `values, projected the same way (${(100 * data.values_variance_kept).toFixed(0)}%); ☆ = Σ weight × value`;
    }
    $("dict-note").textContent = d.queryToken !== null
      ? `query of token ${d.queryToken} “${show(data.tokens[d.queryToken])}”: the model's own scores q·k, ×${scale.toPrecision(3)}, softmax` +
        (data.causal ? " (causal: later tokens masked" + (data.sliding_window ? `, and those more than ${data.sliding_window - 1} back` : "") + ")" : "") + (d.mult === 1 ? " = the model's attention pattern" : "")
      : (d.mode === "toy" && d.toyAt !== null && d.toyAt !== undefined ? `query placed on the key of “${data.tokens[d.toyAt]}”: ` : "dragged query: ") +
        "scores from the 2-D points, q₂·k₂ × scale" + (d.mode === "real" ? " (an approximation: the real q and k have more dimensions)" : "");
    chips($("dict-tokens"), data.tokens, d.queryToken, attendAs);
    const table = $("dict-weights");
    clear(table);
    const order = weights.map((w, j) => [w, j]).sort((a, b) => b[0] - a[0]).slice(0, 8);
    for (const [w, j] of order) {
      table.appendChild(barRow("tr", "td", show(data.tokens[j]), w, w.toFixed(4)));
    }
  }

  function attendAs(j) {
    const d = state.dict;
    if (!d.data.queries) { d.query = d.data.keys[j].slice(); d.queryToken = null; d.toyAt = j; } // toy: query at that key
    else { d.queryToken = j; d.query = d.data.queries[j]; }
    drawDict();
  }

  function startDrag(event) {
    event.preventDefault();
    const svgEl = $("dict-keys");
    let frame = null;
    const move = (e) => {
      const r = svgEl.getBoundingClientRect();
      state.dict.query = state.dict.keyScale.from(e.clientX - r.left, e.clientY - r.top);
      state.dict.queryToken = null;
      state.dict.toyAt = null;
      // one redraw per animation frame, however many pointer events arrive (512 threads stay smooth)
      if (frame === null) frame = requestAnimationFrame(() => { frame = null; drawDict(); });
    };
    const up = () => {
      window.removeEventListener("pointermove", move);
      window.removeEventListener("pointerup", up);
      if (frame !== null) { cancelAnimationFrame(frame); frame = null; }
      drawDict();
    };
    window.addEventListener("pointermove", move);
    window.addEventListener("pointerup", up);
  }

  // ---------------------------------------------------------------------------------------------
  // View 2: the attention matrix
  async function loadMatrix() {
    const m = state.matrix;
    m.data = await api("/api/pattern", body({ layer: state.layer, head: state.head, encoding: patternEncoding() }));
    m.raw = decodeMatrix(m.data.raw);
    m.pattern = decodeMatrix(m.data.pattern);
    if (m.mask === null) m.mask = state.info.causal ? "causal" : "none";
    drawMatrix();
  }

  function matrixValues() {
    // the stage shown: raw q·kᵀ -> ×scale -> mask (−∞ as null) -> softmax, for the mask chosen here
    const m = state.matrix, T = m.raw.length, S = m.raw[0].length, scale = m.data.scale;
    const visible = (i, j) => m.mask === "none" || j <= i + S - T;
    if (T > LONG_TEXT && m.stage === "softmax" && m.mask === (state.info.causal ? "causal" : "none")) {
      return { rows: m.pattern, visible, model: true }; // a long text: the model's own pattern, not recomputed here
    }
    const rows = [];
    m.maxScaled = 0; // the largest |score| shown: bounds a softmax recomputed from float16 scores (shownPrecision)
    for (let i = 0; i < T; i++) {
      const raw = m.raw[i];
      for (let j = 0; j < S; j++) if (visible(i, j)) m.maxScaled = Math.max(m.maxScaled, Math.abs(raw[j] * scale));
      if (m.stage === "raw") rows.push(Array.from(raw));
      else if (m.stage === "scaled") rows.push(Array.from(raw, (x) => x * scale));
      else if (m.stage === "masked") rows.push(Array.from(raw, (x, j) => (visible(i, j) ? x * scale : null)));
      else rows.push(softmaxRow(Array.from(raw, (x) => x * scale), (j) => visible(i, j)));
    }
    return { rows, visible };
  }

  function drawMatrix() {
    // values of the chosen stage -> one pixel per cell in an offscreen image -> painted at the zoom and pan
    const t0 = performance.now();
    const m = state.matrix, tokens = m.data.tokens, T = tokens.length;
    const { rows, visible, model } = matrixValues();
    m.shown = rows;
    m.shownModel = !!model;
    let maxAbs = 0;
    for (const row of rows) for (const x of row) if (x !== null && Math.abs(x) > maxAbs) maxAbs = Math.abs(x);
    const image = document.createElement("canvas");
    image.width = T; image.height = T;
    const ictx = image.getContext("2d");
    const pixels = ictx.createImageData(T, T);
    const dark = m.stage === "masked" || m.stage === "softmax", px = pixels.data;
    // a long text spreads its weights thin (1/T each): there full blue is the 99th percentile of the visible
    // weights (a sample of them), else all but a few cells would be white
    let top = maxAbs;
    if (T > 128 && m.stage === "softmax") {
      const sample = [];
      for (let k = 0; k < 20000; k++) { const i = Math.floor(Math.random() * T), j = Math.floor(Math.random() * T); if (visible(i, j)) sample.push(rows[i][j]); }
      sample.sort((a, b) => a - b);
      top = Math.max(1e-9, sample[Math.floor(0.99 * (sample.length - 1))] || maxAbs);
    }
    m.colourTop = top;
    for (let i = 0; i < T; i++) {
      const row = rows[i];
      for (let j = 0; j < T; j++) {
        const o = 4 * (i * T + j);
        px[o + 3] = 255;
        if (dark && !visible(i, j)) { px[o] = px[o + 1] = px[o + 2] = 43; continue; } // masked: dark
        const x = row[j];
        if (x === null || !isFinite(x)) { px[o] = px[o + 1] = px[o + 2] = 43; continue; }
        const t = m.stage === "softmax" ? Math.min(1, Math.max(0, x / (top || 1))) : Math.max(-1, Math.min(1, x / (maxAbs || 1)));
        if (t >= 0) { px[o] = 255 - 222 * t; px[o + 1] = 255 - 153 * t; px[o + 2] = 255 - 75 * t; } // blues / diverging, as blues()
        else { px[o] = 255 + 30 * t; px[o + 1] = 255 + 190 * t; px[o + 2] = 255 + 190 * t; }
      }
    }
    ictx.putImageData(pixels, 0, 0);
    m.image = image;
    if (m.imageFor !== m.data) { m.zoom = 1; m.panX = 0; m.panY = 0; m.imageFor = m.data; }
    const base = Math.min(30, 620 / T);
    const margin = Math.min(110, 8 + 7 * Math.max(...tokens.map((t) => show(t).length)));
    const size = Math.ceil(margin + base * T + 4);
    const canvas = $("matrix-canvas");
    const ratio = window.devicePixelRatio || 1;
    canvas.width = size * ratio; canvas.height = size * ratio;
    canvas.style.width = size + "px"; canvas.style.height = size + "px";
    m.base = base; m.margin = margin; m.size = size;
    paintMatrix();
    const modelMask = state.info.causal ? "causal" : "none";
    let note = `layer ${state.layer} head ${state.head} · rows: queries, columns: keys · ${T}×${T}`;
    if (model) {
      note += " · the model's hook_pattern";
    } else if (m.stage === "softmax" && m.mask === modelMask) {
      let diff = 0;
      for (let i = 0; i < T; i++) for (let j = 0; j < T; j++) diff = Math.max(diff, Math.abs(rows[i][j] - m.pattern[i][j]));
      note += ` · max |this − the model's hook_pattern| = ${diff.toExponential(1)}`;
    } else if (m.mask !== modelMask) {
      note += ` · mask ${m.mask}: not the mask this ${state.info.causal ? "decoder" : "encoder"} was trained with`;
    }
    note += m.stage === "softmax" ? (m.colourTop < maxAbs ? ` · colour: white 0 → blue ${fmt(m.colourTop, 3)} and above (the 99th percentile weight; the largest is ${fmt(maxAbs, 3)})`
      : ` · colour: white 0 → blue ${fmt(maxAbs, 3)} (the largest weight)`) : ` · colour: red −${fmt(maxAbs, 3)} → white 0 → blue +${fmt(maxAbs, 3)}`;
    $("matrix-note").textContent = note + (base >= 9 ? "" : " · hover for tokens and values, zoom in for labels");
    document.querySelectorAll("#matrix-stage button").forEach((b) => b.classList.toggle("active", b.dataset.stage === m.stage));
    document.querySelectorAll("#matrix-mask button").forEach((b) => b.classList.toggle("active", b.dataset.mask === m.mask));
    const cost = m.data.cost;
    const drawMs = performance.now() - t0;
    state.timings.matrixDrawMs = drawMs;
    if (cost) {
      const half = !!m.data.raw.f16, sent = 0.75 * ["raw", "pattern"].reduce((n, k) => n + (m.data[k].f16 || m.data[k].f32 || "").length, 0);
      $("matrix-cost").textContent = `cost: ${T}×${T} = ${cost.entries_per_head.toLocaleString()} scores per head ` +
        `(${(cost.bytes_per_head / 1e6).toFixed(1)} MB in float32) · server ${cost.server_ms.toFixed(0)} ms · ` +
        `sent ${(sent / 1e6).toFixed(1)} MB (scores and pattern${half ? ", as float16: values to 3 digits" : ""}) · drawn in ${drawMs.toFixed(0)} ms`;
    }
  }

  function clampPan() {
    const m = state.matrix, T = m.data.tokens.length, cell = m.base * m.zoom;
    const visibleCells = (m.size - m.margin - 4) / cell;
    m.panX = Math.max(0, Math.min(T - visibleCells, m.panX));
    m.panY = Math.max(0, Math.min(T - visibleCells, m.panY));
  }

  function paintMatrix() {
    // the offscreen image at the current zoom and pan, and the labels of the rows and columns in view
    const m = state.matrix, tokens = m.data.tokens, T = tokens.length;
    const canvas = $("matrix-canvas"), ctx = canvas.getContext("2d");
    const ratio = window.devicePixelRatio || 1, margin = m.margin, size = m.size;
    const cell = m.base * m.zoom;
    m.geometry = { cell, margin, panX: m.panX, panY: m.panY };
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, size, size);
    ctx.save();
    ctx.beginPath();
    ctx.rect(margin, margin, size - margin - 4, size - margin - 4);
    ctx.clip();
    ctx.imageSmoothingEnabled = cell < 1; // shrinking a long text's matrix: average; enlarging: crisp cells
    ctx.imageSmoothingQuality = "high";
    ctx.drawImage(m.image, margin - m.panX * cell, margin - m.panY * cell, T * cell, T * cell);
    ctx.restore();
    if (cell >= 9) {
      const first = Math.floor(m.panX), firstRow = Math.floor(m.panY), n = Math.ceil((size - margin) / cell) + 1;
      ctx.fillStyle = "#222";
      ctx.font = `${Math.min(13, cell - 1)}px sans-serif`;
      ctx.textBaseline = "middle";
      ctx.textAlign = "right";
      for (let i = firstRow; i < Math.min(T, firstRow + n); i++) ctx.fillText(show(tokens[i]), margin - 4, margin + (i - m.panY + 0.5) * cell);
      for (let j = first; j < Math.min(T, first + n); j++) {
        ctx.save();
        ctx.translate(margin + (j - m.panX + 0.5) * cell, margin - 4);
        ctx.rotate(-Math.PI / 2);
        ctx.textAlign = "left";
        ctx.fillText(show(tokens[j]), 0, 0);
        ctx.restore();
      }
    }
    if (m.zoom > 1) {
      ctx.fillStyle = "#667085";
      ctx.font = "11px sans-serif";
      ctx.textAlign = "left"; ctx.textBaseline = "top";
      ctx.fillText(`×${m.zoom.toFixed(1)} · rows ${Math.floor(m.panY)}–${Math.min(T, Math.ceil(m.panY + (size - margin - 4) / cell)) - 1}`, 4, 4);
    }
  }

  function zoomMatrix(factor, x, y) {
    // zoom by `factor` keeping the cell under (x, y) (canvas pixels; default: the centre) where it is
    const m = state.matrix;
    if (!m.image) return;
    const cx = x === undefined ? (m.size + m.margin) / 2 : x, cy = y === undefined ? (m.size + m.margin) / 2 : y;
    const cell = m.base * m.zoom;
    const ci = (cx - m.margin) / cell + m.panX, cj = (cy - m.margin) / cell + m.panY;
    m.zoom = Math.max(1, Math.min(Math.max(1, 40 / m.base), m.zoom * factor)); // up to 40-pixel cells
    const next = m.base * m.zoom;
    m.panX = ci - (cx - m.margin) / next; m.panY = cj - (cy - m.margin) / next;
    clampPan();
    paintMatrix();
  }

  function matrixCell(event) {
    const m = state.matrix, r = $("matrix-canvas").getBoundingClientRect();
    const { cell, margin } = m.geometry;
    const x = event.clientX - r.left, y = event.clientY - r.top;
    return { x, y, j: Math.floor((x - margin) / cell + m.panX), i: Math.floor((y - margin) / cell + m.panY) };
  }

  function shownPrecision() {
    // the significant digits the hover shows, each one correct, and the magnitude below which a value is only
    // shown as "< tiny": float32 is exact to 6 digits; float16 (a long text) has a relative error of at most
    // 2^-11, under half a unit in the third digit, down to its `tiny`; a softmax recomputed here from float16
    // scores (another mask) moves each score by at most 2^-11 of the largest |score| M, so each weight by a
    // factor of at most e^(2·2^-11·M): fewer digits, and "≈" when even the first is not sure
    const m = state.matrix;
    if (!m.data.raw.f16) return { digits: 6, rawDigits: 4, tiny: 0, rawTiny: 0 };
    const rawTiny = m.data.raw.tiny, factor = m.stage === "raw" ? 1 : m.data.scale;
    if (m.shownModel) return { digits: 3, rawDigits: 3, tiny: m.data.pattern.tiny, rawTiny };
    if (m.stage !== "softmax") return { digits: 3, rawDigits: 3, tiny: rawTiny * factor, rawTiny };
    const error = 2 * Math.expm1(2 * 2 ** -11 * m.maxScaled);
    return { digits: Math.max(1, Math.min(3, Math.floor(-Math.log10(error)))), rawDigits: 3, tiny: 0, rawTiny, rough: error > 0.1 };
  }

  const fmtCell = (x, digits, tiny) => (x !== null && x !== undefined && x !== 0 && Math.abs(x) < tiny
    ? (x < 0 ? "> −" : "< ") + tiny.toPrecision(2) : fmt(x, digits));

  function matrixHover(event) {
    const m = state.matrix;
    if (!m.shown) return;
    const tip = $("matrix-tip");
    const { x, y, i, j } = matrixCell(event);
    const T = m.shown.length;
    if (x < m.margin || y < m.margin || i < 0 || j < 0 || i >= T || j >= T) { tip.style.display = "none"; return; }
    const raw = m.raw[i][j];
    tip.style.display = "block";
    tip.style.left = (x + 14) + "px";
    tip.style.top = (y + 14) + "px";
    const p = shownPrecision();
    tip.textContent = `query ${i} “${show(m.data.tokens[i])}” → key ${j} “${show(m.data.tokens[j])}”: ${m.stage} = ` +
      `${p.rough ? "≈" : ""}${fmtCell(m.shown[i][j], p.digits, p.tiny)}` +
      ` (raw ${fmtCell(raw, p.rawDigits, p.rawTiny)}, scaled ${fmtCell(raw * m.data.scale, p.rawDigits, p.rawTiny * m.data.scale)})`;
  }

  function wireMatrixZoom() {
    const canvas = $("matrix-canvas");
    canvas.addEventListener("wheel", (e) => {
      e.preventDefault();
      const { x, y } = matrixCell(e);
      zoomMatrix(e.deltaY < 0 ? 1.25 : 0.8, x, y);
    }, { passive: false });
    canvas.addEventListener("pointerdown", (e) => {
      const m = state.matrix;
      if (!m.image) return;
      const start = { x: e.clientX, y: e.clientY, panX: m.panX, panY: m.panY };
      const move = (ev) => {
        const cell = m.base * m.zoom;
        m.panX = start.panX - (ev.clientX - start.x) / cell; m.panY = start.panY - (ev.clientY - start.y) / cell;
        clampPan();
        paintMatrix();
      };
      const up = () => { window.removeEventListener("pointermove", move); window.removeEventListener("pointerup", up); };
      window.addEventListener("pointermove", move);
      window.addEventListener("pointerup", up);
    });
    $("zoom-in").addEventListener("click", () => zoomMatrix(2));
    $("zoom-out").addEventListener("click", () => zoomMatrix(0.5));
    $("zoom-reset").addEventListener("click", () => { const m = state.matrix; m.zoom = 1; m.panX = 0; m.panY = 0; if (m.image) paintMatrix(); });
  }

  // ---------------------------------------------------------------------------------------------
  // View 3: heads (arcs and the grid of thumbnails)
  async function loadHeads() {
    const [pattern, grid] = await Promise.all([
      api("/api/pattern", body({ layer: state.layer, head: state.head, encoding: patternEncoding() })),
      api("/api/heads", body()),
    ]);
    state.heads.pattern = decodeMatrix(pattern.pattern);
    state.heads.grid = grid;
    drawArcs();
    drawGrid();
    const scoresKey = state.model + " " + state.step;
    if (state.heads.scoresFor !== scoresKey) {
      // head scores come from attnlab.inspection, once per model (they don't depend on the text): draw the
      // grid first and add them when they arrive
      // (at the chosen training step, for a run with snapshots)
      state.heads.scoresFor = scoresKey;
      state.heads.scores = null;
      api(`/api/models/${encodeURIComponent(state.model)}/head-scores` + (state.step !== null ? `?step=${state.step}` : "")).then((s) => {
        state.heads.scores = s.available ? s : null;
        if (state.view === "heads") drawGrid();
      }).catch(() => { state.heads.scoresFor = null; });
    }
  }

  const LONG_ARCS = 200; // past this many tokens the arcs show one token's strongest links, not every query's

  function drawArcs() {
    const h = state.heads, tokens = state.tokens;
    if (tokens.length > LONG_ARCS) return drawTokenArcs();
    const P = h.pattern, T = tokens.length;
    const el = $("arcs");
    clear(el);
    const rowH = 18, x0 = 110, top = 12;
    el.setAttribute("height", top * 2 + rowH * T);
    const y = (i) => top + rowH * (i + 0.5);
    const arcs = svg("g", { id: "arc-paths" }, el);
    const perQuery = T > 64 ? 4 : 8; // at most this many arcs per query, so 512 tokens stay drawable
    for (let i = 0; i < T; i++) {
      if (h.selected !== null && h.selected !== i) continue;
      const row = Array.from(P[i]).map((w, j) => [w, j]).filter(([w]) => w >= h.threshold).sort((a, b) => b[0] - a[0]).slice(0, perQuery);
      for (const [w, j] of row) {
        const attrs = { class: "arc", "stroke-width": (0.4 + 9 * w).toFixed(2), "stroke-opacity": (0.25 + 0.75 * w).toFixed(3),
          "data-q": i, "data-k": j, "data-w": w.toFixed(5) };
        if (i === j) {
          svg("circle", Object.assign(attrs, { cx: x0 + 10, cy: y(i), r: 6, fill: "none" }), arcs);
        } else {
          const bulge = 14 + Math.min(280, 0.55 * rowH * Math.abs(i - j));
          attrs.d = `M ${x0 + 4} ${y(i)} C ${x0 + bulge} ${y(i)}, ${x0 + bulge} ${y(j)}, ${x0 + 4} ${y(j)}`;
          svg("path", attrs, arcs);
          svg("circle", { cx: x0 + 4, cy: y(j), r: 1.5 + 2 * w, class: "arc-end" }, arcs);
        }
      }
    }
    tokens.forEach((t, i) => {
      const g = svg("text", { x: x0 - 6, y: y(i) + 4, class: "arc-token" + (h.selected === i ? " active" : ""), "data-index": i }, el);
      g.textContent = show(t);
      g.addEventListener("click", () => { h.selected = h.selected === i ? null : i; drawArcs(); drawGrid(); });
    });
    el.setAttribute("width", x0 + 40 + Math.min(280, 0.55 * rowH * Math.max(1, T - 1)));
    $("arcs-title").textContent = `layer ${state.layer} head ${state.head}` + (h.selected !== null ? ` · where “${show(tokens[h.selected])}” attends` : " · every query") +
      (state.info.causal ? " · causal: arcs go to earlier tokens" : "");
    $("arc-threshold-out").textContent = h.threshold.toFixed(2);
  }

  function drawTokenArcs() {
    // a long text: the chosen token (the last one unless clicked) and the 12 keys it attends to most, in text
    // order, with the gaps between them marked; click a key to follow where that token attends
    const h = state.heads, P = h.pattern, tokens = state.tokens, T = tokens.length;
    if (h.selected === null || h.selected >= T) h.selected = T - 1;
    const q = h.selected;
    const top = Array.from(P[q]).map((w, j) => [w, j]).sort((a, b) => b[0] - a[0]).slice(0, 12); // however spread out
    const shown = Array.from(new Set([q, ...top.map(([, j]) => j)])).sort((a, b) => a - b);
    const el = $("arcs");
    clear(el);
    const rowH = 20, x0 = 150, pad = 12;
    const y = (k) => pad + rowH * (k + 0.5);
    const row = new Map(shown.map((j, k) => [j, k]));
    const arcs = svg("g", { id: "arc-paths" }, el);
    for (const [w, j] of top) {
      const attrs = { class: "arc", "stroke-width": (0.4 + 9 * w).toFixed(2), "stroke-opacity": (0.25 + 0.75 * w).toFixed(3),
        "data-q": q, "data-k": j, "data-w": w.toFixed(5) };
      if (j === q) { svg("circle", Object.assign(attrs, { cx: x0 + 10, cy: y(row.get(q)), r: 6, fill: "none" }), arcs); continue; }
      const bulge = 14 + Math.min(240, 14 * Math.abs(row.get(q) - row.get(j)));
      attrs.d = `M ${x0 + 4} ${y(row.get(q))} C ${x0 + bulge} ${y(row.get(q))}, ${x0 + bulge} ${y(row.get(j))}, ${x0 + 4} ${y(row.get(j))}`;
      svg("path", attrs, arcs);
      svg("circle", { cx: x0 + 4, cy: y(row.get(j)), r: 1.5 + 2 * w, class: "arc-end" }, arcs);
    }
    shown.forEach((j, k) => {
      const gap = k > 0 && j - shown[k - 1] > 1 ? ` (+${j - shown[k - 1] - 1})` : "";
      const label = svg("text", { x: x0 - 6, y: y(k) + 4, class: "arc-token" + (j === q ? " active" : ""), "data-index": j }, el);
      label.textContent = `${gap} #${j} ${show(tokens[j]).slice(0, 12)}`;
      label.addEventListener("click", () => { h.selected = j; drawArcs(); });
    });
    el.setAttribute("height", 2 * pad + rowH * shown.length);
    el.setAttribute("width", x0 + 280);
    $("arcs-title").textContent = `layer ${state.layer} head ${state.head} · ${T} tokens: where #${q} “${show(tokens[q])}” attends most ` +
      `(its ${top.length} strongest links; (+n) = n tokens between) · click a token to follow it`;
    $("arc-threshold-out").textContent = h.threshold.toFixed(2);
  }

  function drawGrid() {
    const h = state.heads, grid = h.grid, container = $("heads-grid");
    clear(container);
    const scores = h.scores;
    $("grid-title").textContent = "all layers × heads" + (grid.pooled ? " (max-pooled thumbnails)" : "") +
      (h.selected !== null && !grid.pooled ? ` · outlined row: “${show(grid.tokens[h.selected])}”` : "") +
      (scores ? " · head scores from attnlab.inspection" : "");
    const table = document.createElement("table");
    table.className = "grid";
    const header = document.createElement("tr");
    header.innerHTML = "<th></th>" + grid.thumbnails[0].map((_, hd) => `<th>head ${hd}</th>`).join("");
    table.appendChild(header);
    grid.thumbnails.forEach((layer, l) => {
      const tr = document.createElement("tr");
      const th = document.createElement("th");
      th.textContent = `layer ${l}`;
      tr.appendChild(th);
      layer.forEach((thumb, hd) => {
        const td = document.createElement("td");
        const c = document.createElement("canvas");
        const size = 56;
        c.width = size; c.height = size;
        c.className = "thumb" + (l === state.layer && hd === state.head ? " current" : "") + (isOff(l, hd) ? " off" : "");
        c.dataset.layer = l; c.dataset.head = hd;
        const ctx = c.getContext("2d");
        const n = thumb.length, cs = size / n;
        for (let i = 0; i < n; i++) for (let j = 0; j < thumb[i].length; j++) {
          ctx.fillStyle = blues(thumb[i][j]);
          ctx.fillRect(j * cs, i * cs, Math.ceil(cs), Math.ceil(cs));
        }
        if (h.selected !== null && !grid.pooled && h.selected < n) {
          ctx.strokeStyle = "#e4572e"; ctx.lineWidth = 1.5;
          ctx.strokeRect(0.75, h.selected * cs + 0.75, size - 1.5, cs - 1.5);
        }
        if (isOff(l, hd)) { // knocked out: a red cross over the pattern it still computes (its output z is ablated)
          ctx.strokeStyle = "#b42318"; ctx.lineWidth = 3;
          ctx.beginPath(); ctx.moveTo(6, 6); ctx.lineTo(size - 6, size - 6); ctx.moveTo(size - 6, 6); ctx.lineTo(6, size - 6); ctx.stroke();
        }
        c.title = `layer ${l} head ${hd}` + (state.clickMode === "knock" ? " · click to knock out / restore" : "");
        c.addEventListener("click", () => (state.clickMode === "knock" ? toggleHead(l, hd) : openHead(l, hd)));
        td.appendChild(c);
        if (state.training && state.training.available) td.appendChild(sparkline(l, hd));
        if (scores) {
          const best = bestScore(scores, l, hd);
          if (best) {
            const s = document.createElement("div");
            s.className = "score" + (best.standout ? " standout" : "");
            s.textContent = `${SCORE_LABELS[best.name] || best.name} ${best.value.toFixed(2)}`;
            s.title = `${best.name} score ${best.value.toFixed(3)} (stands out from ${scores.thresholds[best.name]})`;
            td.appendChild(s);
          }
        }
        tr.appendChild(td);
      });
      table.appendChild(tr);
    });
    container.appendChild(table);
  }

  const SCORE_LABELS = { previous_token: "prev", duplicate_token: "dup", induction: "ind", first_token: "first", copying: "copy" };

  function bestScore(scores, l, hd) {
    // the head's score that stands out most, relative to its threshold
    let best = null;
    for (const [name, grid] of Object.entries(scores.scores)) {
      const value = grid[l][hd];
      if (value === null) continue;
      const ratio = value / (scores.thresholds[name] || 1);
      if (!best || ratio > best.ratio) best = { name, value, ratio, standout: ratio >= 1 };
    }
    return best;
  }

  function sparkline(l, hd) {
    // this head's score over training (the score it ends highest in, relative to its threshold), step marked
    const tr = state.training, W = 56, H = 20;
    const final = tr.score_steps.length - 1;
    let name = null, best = -Infinity;
    for (const [score, perStep] of Object.entries(tr.scores)) {
      const v = perStep[final][l][hd];
      if (v !== null && v / (tr.thresholds[score] || 1) > best) { best = v / (tr.thresholds[score] || 1); name = score; }
    }
    const el = svg("svg", { width: W, height: H, class: "spark", "data-score": name });
    if (name === null) return el;
    const values = tr.scores[name].map((perStep) => perStep[l][hd] || 0), steps = tr.score_steps;
    const lo = name === "copying" ? -1 : 0, last = steps[steps.length - 1] || 1;
    const x = (step) => 1 + (W - 2) * step / last, yv = (v) => H - 1 - (H - 2) * (v - lo) / (1 - lo);
    svg("path", { d: values.map((v, k) => `${k ? "L" : "M"}${x(steps[k]).toFixed(1)},${yv(v).toFixed(1)}`).join(" ") }, el);
    if (state.step !== null) svg("line", { x1: x(state.step), x2: x(state.step), y1: 0, y2: H }, el);
    const title = svg("title", {}, el);
    title.textContent = `${name} score of layer ${l} head ${hd} over training: ` + values.map((v, k) => `${steps[k]}: ${v.toFixed(2)}`).join(", ");
    return el;
  }

  function toggleHead(l, hd) {
    state.ablate = isOff(l, hd) ? state.ablate.filter((h) => h[0] !== l || h[1] !== hd) : state.ablate.concat([[l, hd]]);
    refresh();
  }

  function openHead(l, hd) {
    state.layer = l; state.head = hd;
    $("layer").value = l; $("head").value = hd;
    refresh();
  }

  // ---------------------------------------------------------------------------------------------
  // View 4: through a block
  async function loadBlock() {
    const b = state.block;
    if (b.token === null || b.token >= state.tokens.length) b.token = state.tokens.length - 1;
    b.data = await api("/api/trace", body({ layer: state.layer, token: b.token }));
    b.stage = Math.min(b.stage, b.data.stages.length - 1);
    drawBlock();
  }

  function drawBlock() {
    const b = state.block, stages = b.data.stages;
    chips($("block-tokens"), state.tokens, b.token, (i) => { b.token = i; guarded(loadBlock); });
    const pipe = $("block-pipeline");
    clear(pipe);
    stages.forEach((s, k) => {
      const li = document.createElement("li");
      li.textContent = s.title;
      li.className = (k === b.stage ? "current" : "") + (s.values === null ? " skipped" : "");
      li.addEventListener("click", () => { b.stage = k; drawBlock(); });
      pipe.appendChild(li);
    });
    // the current stage in full right under the pipeline, then every stage's hook and shape, compact
    const container = $("block-stages");
    clear(container);
    container.appendChild(stageCard(stages[b.stage], true));
    const all = document.createElement("div");
    all.className = "all-stages";
    stages.forEach((s, k) => {
      const card = stageCard(s, false);
      if (k === b.stage) card.classList.add("shown");
      card.addEventListener("click", () => { b.stage = k; drawBlock(); });
      all.appendChild(card);
    });
    container.appendChild(all);
  }

  const dimsText = (s) => "[" + s.shape.map((n, i) => `${s.dims[i]}=${n}`).join(", ") + "]";

  function stageCard(s, current) {
    const card = document.createElement("div");
    card.className = "stage" + (current ? " current" : " compact");
    card.dataset.key = s.key;
    const h = document.createElement("h3");
    h.textContent = s.title;
    const eq = document.createElement("code");
    eq.textContent = s.equation;
    h.appendChild(eq);
    card.appendChild(h);
    const meta = document.createElement("div");
    meta.className = "meta";
    if (s.values === null) {
      meta.textContent = "nothing happens here for this model";
      card.appendChild(meta);
      return card;
    }
    const tokenShape = s.dims[0] === "pos" ? s.shape.slice(1) : [s.shape[0], s.shape[2]];
    meta.textContent = `${s.hook ? s.hook : "computed from the cached q and k"} · full shape ${dimsText(s)} · ` +
      `this token: [${tokenShape.join(", ")}]`;
    card.appendChild(meta);
    if (!current) return card;
    const rows = Array.isArray(s.values[0]) ? s.values : [s.values];
    const flat = rows.flat().filter((x) => x !== null);
    const maxAbs = Math.max(...flat.map(Math.abs), 1e-9);
    const norm = Math.sqrt(flat.reduce((a, x) => a + x * x, 0));
    const stats = document.createElement("div");
    stats.className = "meta";
    stats.textContent = `min ${fmt(Math.min(...flat))} · max ${fmt(Math.max(...flat))} · ‖x‖ ${fmt(norm)}` +
      (rows.length === 1 ? ` · first values: ${rows[0].slice(0, 6).map((x) => fmt(x, 3)).join(", ")} …` : "");
    card.appendChild(stats);
    const isAttention = s.dims[1] === "query_pos";
    const cols = rows[0].length;
    const cell = Math.max(2, Math.min(isAttention ? 28 : 14, Math.floor(880 / cols)));
    const canvas = document.createElement("canvas");
    canvas.className = "strip";
    canvas.width = cols * cell + 70; canvas.height = rows.length * Math.max(cell, 12) + (isAttention && cell >= 9 ? 60 : 4);
    const ctx = canvas.getContext("2d");
    const rh = Math.max(cell, 12);
    ctx.font = "10px sans-serif";
    rows.forEach((row, r) => {
      if (rows.length > 1) { ctx.fillStyle = "#555"; ctx.fillText(`head ${r}`, 0, r * rh + rh / 2 + 3); }
      row.forEach((x, c) => {
        ctx.fillStyle = s.key === "pattern" ? blues(x) : diverging(x, maxAbs);
        ctx.fillRect(70 + c * cell, r * rh, cell - (cell > 4 ? 1 : 0), rh - 1);
      });
    });
    if (isAttention && cell >= 9) {
      ctx.fillStyle = "#333";
      state.tokens.forEach((t, j) => {
        ctx.save();
        ctx.translate(70 + (j + 0.6) * cell, rows.length * rh + 4);
        ctx.rotate(Math.PI / 2);
        ctx.fillText(show(t), 0, 0);
        ctx.restore();
      });
    }
    canvas.title = isAttention ? "rows: heads, columns: keys" : rows.length > 1 ? "rows: heads, columns: d_head" : "one cell per dimension";
    canvas.addEventListener("mousemove", (e) => {
      const r = canvas.getBoundingClientRect();
      const c = Math.floor((e.clientX - r.left - 70) / cell), row = Math.floor((e.clientY - r.top) / rh);
      if (row >= 0 && row < rows.length && c >= 0 && c < cols) {
        canvas.title = (rows.length > 1 ? `head ${row}, ` : "") + (isAttention ? `key ${c} “${show(state.tokens[c])}”` : `dim ${c}`) + `: ${fmt(rows[row][c], 6)}`;
      }
    });
    card.appendChild(canvas);
    return card;
  }

  function stepStage(delta) {
    const b = state.block;
    if (!b.data) return;
    b.stage = Math.max(0, Math.min(b.data.stages.length - 1, b.stage + delta));
    drawBlock();
  }

  // ---------------------------------------------------------------------------------------------
  // View 5: next token
  function nextRequest(extra) {
    const n = state.next;
    return body(Object.assign({ temperature: n.temperature, top_k: n.topK > 0 ? n.topK : null, top_p: n.topP < 1 ? n.topP : null, k: 10 }, extra || {}));
  }

  async function loadNext() {
    const n = state.next;
    $("next-temp-out").textContent = n.temperature.toFixed(2);
    $("next-topp-out").textContent = n.topP.toFixed(2);
    const bars = $("next-bars");
    if (!state.info.causal) {
      clear(bars);
      $("next-note").textContent = `${state.model} is an encoder (bidirectional, no LM head): it does not predict a next token. Pick a causal model.`;
      $("next-text").textContent = "";
      return;
    }
    n.data = await api("/api/next", nextRequest());
    // with heads knocked out, the same request without them: the two distributions side by side
    n.before = state.ablate.length ? await api("/api/next", plainBody(nextRequest({ k: 50 }))) : null;
    n.afterWide = state.ablate.length ? await api("/api/next", nextRequest({ k: 50 })) : null;
    drawNext();
    await loadAttribution();
  }

  async function loadAttribution() {
    // who wrote the most likely next token: each head's and MLP's direct contribution to its logit
    const n = state.next, top = n.data.candidates[0], el = $("dla");
    clear(el);
    try {
      n.dla = await api("/api/attribution", body({ token: top.id }));
    } catch (err) {
      n.dla = null;
      $("dla-title").textContent = "who wrote this prediction: " + err.message;
      return;
    }
    const d = n.dla, L = d.heads.length, H = d.heads[0].length, cell = Math.max(14, Math.min(36, Math.floor(300 / H)));
    const left = 50, top0 = 18, rows = L, hasMlp = d.mlps !== null;
    const values = d.heads.flat().concat(hasMlp ? d.mlps : []), maxAbs = Math.max(...values.map(Math.abs), 1e-9);
    el.setAttribute("width", left + cell * (H + (hasMlp ? 1.5 : 0)) + 10);
    el.setAttribute("height", top0 + cell * rows + 8);
    for (let h = 0; h < H; h++) { const t = svg("text", { x: left + (h + 0.5) * cell, y: 12, "text-anchor": "middle" }, el); t.textContent = `H${h}`; }
    if (hasMlp) { const t = svg("text", { x: left + (H + 1) * cell, y: 12, "text-anchor": "middle" }, el); t.textContent = "MLP"; }
    for (let l = 0; l < L; l++) {
      const t = svg("text", { x: left - 6, y: top0 + (l + 0.6) * cell, "text-anchor": "end" }, el); t.textContent = `L${l}`;
      const cellAt = (x, v, what) => {
        const r = svg("rect", { x, y: top0 + l * cell, width: cell - 2, height: cell - 2, fill: diverging(v, maxAbs), "data-value": v.toFixed(4) }, el);
        svg("title", {}, r).textContent = `${what}: ${v >= 0 ? "+" : ""}${v.toFixed(3)} to the logit of “${show(d.answer)}”`;
      };
      for (let h = 0; h < H; h++) cellAt(left + h * cell, d.heads[l][h], `L${l}H${h}`);
      if (hasMlp) cellAt(left + (H + 0.5) * cell, d.mlps[l], `L${l} MLP`);
    }
    const best = d.heads.flatMap((row, l) => row.map((v, h) => [v, `L${l}H${h}`])).concat(hasMlp ? d.mlps.map((v, l) => [v, `L${l} MLP`]) : [])
      .sort((a, b) => b[0] - a[0]).slice(0, 3);
    $("dla-title").textContent = `who wrote “${show(d.answer)}” (logit ${d.logit.toFixed(2)}): direct contributions, blue adds, red subtracts; ` +
      `most: ${best.map(([v, name]) => `${name} ${v >= 0 ? "+" : ""}${v.toFixed(2)}`).join(", ")}`;
  }

  function probOf(list, id) {
    const c = list.candidates.find((x) => x.id === id);
    return c ? c.prob : null;
  }

  function drawNext() {
    const n = state.next, data = n.data;
    $("next-note").textContent = `temperature ${n.temperature.toFixed(2)}` + (n.topK ? ` · top-k ${n.topK}` : "") + (n.topP < 1 ? ` · top-p ${n.topP.toFixed(2)}` : "") +
      ` · ${data.kept} token${data.kept === 1 ? "" : "s"} can be drawn · click a bar to append that token`;
    const textEl = $("next-text");
    clear(textEl);
    const base = n.appended && state.text.endsWith(n.appended) ? state.text.slice(0, state.text.length - n.appended.length) : state.text;
    textEl.appendChild(document.createTextNode(base));
    if (n.appended && base !== state.text) {
      const span = document.createElement("mark");
      span.textContent = n.appended;
      textEl.appendChild(span);
    }
    const bars = $("next-bars");
    clear(bars);
    const compare = n.before !== null && n.before !== undefined;
    $("next-bars-title").textContent = compare ? `after knocking out ${state.ablate.map(headName).join(", ")} (${state.ablation}) · change from before` : "";
    $("next-before-wrap").hidden = !compare;
    const delta = (row, now, then) => {
      const d = document.createElement("span");
      d.className = "delta";
      if (then === null) d.textContent = "new";
      else { const pp = 100 * (now - then); d.textContent = (pp >= 0 ? "+" : "−") + Math.abs(pp).toFixed(2) + " pp"; d.classList.add(pp >= 0 ? "up" : "down"); }
      row.appendChild(d);
    };
    data.candidates.forEach((c) => {
      const row = barRow("button", "span", show(c.piece), c.prob, (100 * c.prob).toFixed(2) + "%");
      row.type = "button";
      row.className = "next-bar";
      row.dataset.id = c.id;
      row.title = `id ${c.id} · logit ${fmt(c.logit)}`;
      row.addEventListener("click", () => appendText(c.text));
      if (compare) delta(row, c.prob, probOf(n.before, c.id));
      bars.appendChild(row);
    });
    const before = $("next-before");
    clear(before);
    if (compare) {
      n.before.candidates.slice(0, 10).forEach((c) => {
        const row = barRow("div", "span", show(c.piece), c.prob, (100 * c.prob).toFixed(2) + "%");
        row.className = "next-bar before";
        row.dataset.id = c.id;
        const after = probOf(n.afterWide, c.id);
        const d = document.createElement("span");
        d.className = "delta";
        d.textContent = after === null ? "→ <" + (100 * n.afterWide.candidates[n.afterWide.candidates.length - 1].prob).toFixed(2) + "%" : "→ " + (100 * after).toFixed(2) + "%";
        row.appendChild(d);
        before.appendChild(row);
      });
    }
  }

  function appendText(newText) {
    // generation appends to the text: the added part is highlighted, and every view re-runs on the new text
    const n = state.next;
    n.appended = newText.startsWith(state.text) ? (n.appended || "") + newText.slice(state.text.length) : "";
    $("text").value = newText;
    return runText();
  }

  async function sampleNext(greedy) {
    document.body.dataset.loading = "1"; // busy from the click on, until the views have re-run
    try {
      const data = await api("/api/next", nextRequest(greedy ? { temperature: 0 } : { sample: true, seed: Math.floor(Math.random() * 1e9) }));
      await appendText((greedy ? data.candidates[0] : data.chosen).text);
    } finally {
      delete document.body.dataset.loading;
    }
  }

  // ---------------------------------------------------------------------------------------------
  // Knockout: which heads are off, and per token what changed (loss for decoders, hidden-state cosine)
  async function loadKnockout() {
    const bar = $("knockout");
    bar.hidden = state.ablate.length === 0;
    if (!state.ablate.length) { state.knock = null; return; }
    $("knockout-list").textContent = state.ablate.map(headName).join(", ");
    document.querySelectorAll("#ablation-mode button").forEach((b) => b.classList.toggle("active", b.dataset.ablation === state.ablation));
    state.knock = await api("/api/knockout", body());
    drawKnockout();
  }

  function drawKnockout() {
    const k = state.knock, el = $("knockout-strip"), tokens = k.tokens, T = tokens.length;
    clear(el);
    const W = Math.min(1240, Math.max(600, document.body.clientWidth - 60)), labels = T <= 90;
    const H = labels ? 160 : 130, left = 46, right = 12, top = 24, bottom = labels ? 48 : 22; // the caption sits above the plot
    el.setAttribute("width", W); el.setAttribute("height", H);
    // decoders: a curve through the positions; encoders: one bar per token, each in its own band
    const band = (W - left - right) / T;
    const x = k.loss_before ? (i) => left + (W - left - right) * (T <= 1 ? 0.5 : i / (T - 1)) : (i) => left + band * (i + 0.5);
    const axis = (text, ax, ay, anchor) => { const t = svg("text", { x: ax, y: ay, class: "strip-axis", "text-anchor": anchor || "start" }, el); t.textContent = text; };
    const mean = (a, from, to) => { const part = a.slice(from, to); return part.reduce((s, v) => s + v, 0) / Math.max(1, part.length); };
    let note;
    if (k.loss_before) {
      // position i predicts token i + 1: the loss is drawn under the token it predicts
      const before = k.loss_before, after = k.loss_after, n = before.length;
      const max = Math.max(...before, ...after, 1e-6);
      const y = (v) => top + (H - top - bottom) * (1 - v / max);
      svg("line", { x1: left, x2: W - right, y1: y(0), y2: y(0), class: "axis" }, el);
      for (const [values, cls] of [[before, "curve-before"], [after, "curve-after"]]) {
        svg("path", { class: cls, d: values.map((v, i) => `${i ? "L" : "M"}${x(i + 1).toFixed(1)},${y(v).toFixed(1)}`).join(" ") }, el);
      }
      axis(max.toFixed(1), left - 6, top + 8, "end"); axis("0", left - 6, y(0), "end");
      axis("loss on each next token: grey before, red after", left + 4, 12);
      const half = Math.floor(n / 2);
      note = `mean loss, first half of the text: ${mean(before, 0, half).toFixed(2)} → ${mean(after, 0, half).toFixed(2)}; ` +
        `second half: ${mean(before, half, n).toFixed(2)} → ${mean(after, half, n).toFixed(2)} (nats per token)`;
    } else {
      // an encoder: how far each token's last hidden state turned, 1 − cosine, with the cosine written on it
      const change = k.cosine.map((c) => 1 - c);
      const max = Math.max(...change, 0.2); // a fixed floor to the scale: a change of 0.005 stays a sliver, not a full bar
      const bw = Math.max(1, Math.min(band - 4, 80));
      change.forEach((v, i) => {
        const h = (H - top - bottom) * v / max;
        const r = svg("rect", { x: x(i) - bw / 2, y: H - bottom - h, width: bw, height: h, "data-index": i,
          class: "strip-bar" + (i === state.heads.selected ? " selected" : "") }, el);
        svg("title", {}, r).textContent = `“${show(tokens[i])}”: cosine ${k.cosine[i].toFixed(4)}`;
        if (labels && T <= 40) axis(k.cosine[i].toFixed(3), x(i), H - bottom - h - 3, "middle");
      });
      axis(`bar: 1 − cosine(last hidden state after, before), full height ${max.toFixed(3)}; number: the cosine`, left + 4, 12);
      const order = k.cosine.map((c, i) => [c, i]).sort((a, b) => a[0] - b[0]).slice(0, 3);
      note = "cosine of the last hidden state, after vs before: " + order.map(([c, i]) => `“${show(tokens[i])}” ${c.toFixed(3)}`).join(", ") +
        (state.heads.selected !== null && state.heads.selected < T ? ` · “${show(tokens[state.heads.selected])}” ${k.cosine[state.heads.selected].toFixed(3)}` : "");
    }
    if (labels) tokens.forEach((t, i) => {
      const label = svg("text", { x: x(i), y: H - bottom + 14 + (T > 45 && i % 2 ? 12 : 0), class: "strip-label", "text-anchor": "middle" }, el);
      label.textContent = show(t).slice(0, T > 45 ? 3 : 8);
    });
    else axis(`position 0 … ${T - 1}`, left, H - 6);
    $("knockout-note").textContent = note;
  }

  // ---------------------------------------------------------------------------------------------
  // Training: the step slider, the loss curve with the step marked
  async function loadTraining() {
    const steps = state.info.steps || [];
    $("training").hidden = steps.length === 0;
    if (!steps.length) { state.training = null; state.step = null; return; }
    if (!state.training || state.training.model !== state.model) {
      // the slider at once; the loss curve and the heads' score curves when the server has computed them
      const model = state.model;
      state.training = { model, steps, start_step: state.info.start_step, metrics: [], available: false, scores: {}, score_steps: [] };
      fetchTraining();
      const start = state.info.start_step !== null && steps.includes(state.info.start_step) ? state.info.start_step : steps[steps.length - 1];
      const slider = $("step");
      slider.max = steps.length - 1;
      slider.value = steps.indexOf(start);
      state.step = start;
    }
    drawTraining();
  }

  function fetchTraining() {
    // the loss curve and every head's score curve; a Hub model's revisions are fetched as the slider reaches
    // them, so its curves cover the steps shown so far and are asked for again after each new step (`lazy`)
    const model = state.model;
    return api(`/api/models/${encodeURIComponent(model)}/training`).then((tr) => {
      if (!state.training || state.training.model !== model) return;
      if (state.training.lazy && tr.score_steps.length < state.training.score_steps.length) return; // an older answer
      Object.assign(state.training, tr);
      drawTraining();
      if (state.view === "heads" && state.heads.grid) drawGrid();
    }).catch((err) => setStatus(err.message, true));
  }

  function drawTraining() {
    const tr = state.training, el = $("loss-curve");
    $("step-out").textContent = `${state.step} (${tr.steps.indexOf(state.step) + 1} of ${tr.steps.length})`;
    clear(el);
    const W = +el.getAttribute("width"), H = +el.getAttribute("height"), left = 34, bottom = 14;
    const metrics = tr.metrics.filter((r) => r.val_loss !== null && r.val_loss !== undefined);
    const lastStep = tr.steps[tr.steps.length - 1] || 1;
    const x = (step) => left + (W - left - 6) * step / lastStep;
    if (metrics.length) {
      const values = metrics.map((r) => r.val_loss), lo = Math.min(...values), hi = Math.max(...values);
      const y = (v) => 4 + (H - bottom - 8) * (hi === lo ? 0.5 : (hi - v) / (hi - lo));
      svg("path", { class: "curve-loss", d: metrics.map((r, i) => `${i ? "L" : "M"}${x(r.iter).toFixed(1)},${y(r.val_loss).toFixed(1)}`).join(" ") }, el);
      const t = (text, tx, ty, anchor) => { const e = svg("text", { x: tx, y: ty, class: "strip-axis", "text-anchor": anchor }, el); e.textContent = text; };
      t(hi.toFixed(2), left - 3, 10, "end"); t(lo.toFixed(2), left - 3, H - bottom, "end");
      // the title under the plot, where the step marker (down to H − bottom + 2) never crosses it
      t("val loss", (left + W - 6) / 2, H - 2, "middle"); t(`step ${lastStep}`, W - 6, H - 2, "end"); t("0", left, H - 2, "start");
    }
    svg("line", { x1: x(state.step), x2: x(state.step), y1: 0, y2: H - bottom + 2, class: "curve-marker", id: "step-marker" }, el);
    $("training-note").textContent = `every view shows the model at step ${state.step}` +
      (tr.revisions ? ` (Hub revision ${tr.revisions[state.step]}, fetched when first shown)` : "") +
      (tr.start_step !== null && tr.start_step !== undefined ? ` · the phase change is at step ${tr.start_step}` : "");
  }

  // ---------------------------------------------------------------------------------------------
  // Pictures to keep: the shown view as SVG (and PNG)
  const STYLE_PROPS = ["fill", "fill-opacity", "stroke", "stroke-width", "stroke-opacity", "stroke-linecap", "stroke-dasharray",
    "opacity", "font-family", "font-size", "font-weight", "text-anchor", "dominant-baseline"];

  function inlineSvg(source, x, y) {
    // a copy of an SVG drawing with its computed styles written on each element (no stylesheet travels with it)
    const copy = source.cloneNode(true);
    const from = [source, ...source.querySelectorAll("*")], to = [copy, ...copy.querySelectorAll("*")];
    from.forEach((el, k) => {
      const cs = getComputedStyle(el);
      // as presentation attributes, not a style attribute (which the page's CSP refuses, even on a copy)
      for (const p of STYLE_PROPS) { const v = cs.getPropertyValue(p); if (v) to[k].setAttribute(p, v); }
    });
    copy.removeAttribute("id");
    copy.setAttribute("x", x); copy.setAttribute("y", y);
    return copy;
  }

  function viewToSvg(root) {
    // walk the view's boxes: backgrounds and borders as rects, canvases as images, SVGs inlined, text as text
    const box = root.getBoundingClientRect();
    const W = Math.ceil(Math.max(root.scrollWidth, box.width)), H = Math.ceil(Math.max(root.scrollHeight, box.height));
    const out = document.createElementNS(SVG_NS, "svg");
    out.setAttribute("xmlns", SVG_NS);
    out.setAttribute("width", W); out.setAttribute("height", H); out.setAttribute("viewBox", `0 0 ${W} ${H}`);
    svg("rect", { x: 0, y: 0, width: W, height: H, fill: "#ffffff" }, out);
    const rel = (r) => ({ x: r.left - box.left, y: r.top - box.top, w: r.width, h: r.height });
    const transparent = (c) => !c || c === "transparent" || c.endsWith(", 0)");
    const walk = (el) => {
      const cs = getComputedStyle(el);
      if (cs.display === "none" || cs.visibility === "hidden" || el.hidden) return;
      const r = rel(el.getBoundingClientRect());
      if (r.w === 0 && r.h === 0) return;
      const bg = cs.backgroundColor, border = parseFloat(cs.borderTopWidth) > 0 && !transparent(cs.borderTopColor);
      if (!transparent(bg) || border) {
        svg("rect", { x: r.x, y: r.y, width: r.w, height: r.h, rx: parseFloat(cs.borderTopLeftRadius) || 0,
          fill: transparent(bg) ? "none" : bg, stroke: border ? cs.borderTopColor : "none", "stroke-width": border ? cs.borderTopWidth : 0 }, out);
      }
      if (el.tagName === "CANVAS") {
        svg("image", { x: r.x, y: r.y, width: r.w, height: r.h, href: el.toDataURL("image/png"), preserveAspectRatio: "none" }, out);
        return;
      }
      if (el.namespaceURI === SVG_NS) { out.appendChild(inlineSvg(el, r.x, r.y)); return; }
      if (el.tagName === "SELECT") { text(el.options[el.selectedIndex] ? el.options[el.selectedIndex].text : "", el, r); return; }
      if (el.tagName === "INPUT" || el.tagName === "TEXTAREA") return;
      for (const child of el.childNodes) {
        if (child.nodeType === 1) walk(child);
        else if (child.nodeType === 3 && child.textContent.trim()) textNode(child, cs);
      }
    };
    const text = (content, el, r) => {
      const cs = getComputedStyle(el);
      const t = svg("text", { x: r.x + 4, y: r.y + r.h * 0.7, fill: cs.color, "font-size": cs.fontSize, "font-family": cs.fontFamily }, out);
      t.textContent = content;
    };
    const textNode = (node, cs) => {
      // one <text> per line box: each word placed where the page laid it out
      const range = document.createRange();
      const words = node.textContent.split(/(\s+)/);
      let offset = 0, line = null;
      for (const word of words) {
        if (word.trim()) {
          range.setStart(node, offset); range.setEnd(node, offset + word.length);
          const rr = range.getClientRects()[0];
          if (rr) {
            const r = rel(rr);
            if (!line || Math.abs(line.y - r.y) > 2) {
              line = { y: r.y, el: svg("text", { x: r.x, y: r.y + r.h * 0.78, fill: cs.color, "font-size": cs.fontSize, "font-family": cs.fontFamily,
                "font-weight": cs.fontWeight, "xml:space": "preserve" }, out) };
              line.el.textContent = word;
            } else line.el.textContent += " " + word;
          }
        }
        offset += word.length;
      }
    };
    walk(root);
    return out;
  }

  function download(blob, name) {
    const a = document.createElement("a");
    a.href = URL.createObjectURL(blob);
    a.download = name;
    document.body.appendChild(a);
    a.click();
    setTimeout(() => { URL.revokeObjectURL(a.href); a.remove(); }, 1000);
  }

  function fileName(ext) {
    const what = state.view === "next" || state.view === "block" ? state.view : `${state.view}-L${state.layer}H${state.head}`;
    return `attnlab-${state.model}-${what}${state.step !== null ? "-step" + state.step : ""}${state.ablate.length ? "-knockout" : ""}.${ext}`;
  }

  function shownRoot() {
    // the view, with the training and knockout bars above it when they are shown
    return [$("training"), $("knockout"), $("view-" + state.view)].filter((el) => !el.hidden);
  }

  function pictureSvg() {
    const parts = shownRoot().map((el) => viewToSvg(el));
    const W = Math.max(...parts.map((p) => +p.getAttribute("width"))), H = parts.reduce((a, p) => a + +p.getAttribute("height"), 0);
    const out = document.createElementNS(SVG_NS, "svg");
    out.setAttribute("xmlns", SVG_NS);
    out.setAttribute("width", W); out.setAttribute("height", H); out.setAttribute("viewBox", `0 0 ${W} ${H}`);
    let y = 0;
    for (const p of parts) { p.setAttribute("y", y); y += +p.getAttribute("height"); out.appendChild(p); }
    return new XMLSerializer().serializeToString(out);
  }

  async function savePicture(kind) {
    if (kind === "svg") return download(new Blob([pictureSvg()], { type: "image/svg+xml" }), fileName("svg"));
    if (state.view === "matrix" && $("training").hidden && $("knockout").hidden) {
      // the canvas view: its own pixels
      return new Promise((resolve) => $("matrix-canvas").toBlob((b) => { download(b, fileName("png")); resolve(); }, "image/png"));
    }
    const source = pictureSvg();
    const image = new Image();
    image.src = "data:image/svg+xml;base64," + btoa(unescape(encodeURIComponent(source)));
    await image.decode();
    const scale = 2, canvas = document.createElement("canvas");
    canvas.width = image.width * scale; canvas.height = image.height * scale;
    const ctx = canvas.getContext("2d");
    ctx.scale(scale, scale);
    ctx.drawImage(image, 0, 0);
    return new Promise((resolve) => canvas.toBlob((b) => { download(b, fileName("png")); resolve(); }, "image/png"));
  }

  // ---------------------------------------------------------------------------------------------
  // Wiring
  const LOADERS = { dict: loadDict, matrix: loadMatrix, heads: loadHeads, block: loadBlock, next: loadNext };

  let refreshing = null, refreshAgain = false;

  function refresh() {
    // one refresh at a time: a click while one runs asks for one more after it (with the state as it is then),
    // so answers never land out of order (a slow answer for three knocked-out heads drawn after the one for
    // four) and the page is marked loading until the last has drawn
    if (!state.info) return Promise.resolve();
    if (refreshing) { refreshAgain = true; return refreshing; }
    document.body.dataset.loading = "1";
    refreshing = (async () => {
      try {
        do { refreshAgain = false; await refreshOnce(); } while (refreshAgain);
      } finally {
        refreshing = null;
        delete document.body.dataset.loading;
        document.body.dataset.ready = state.view;
      }
    })();
    return refreshing;
  }

  async function refreshOnce() {
    document.querySelectorAll("#tabs button[data-view]").forEach((b) => b.classList.toggle("active", b.dataset.view === state.view));
    document.querySelectorAll(".view").forEach((v) => v.classList.toggle("active", v.id === "view-" + state.view));
    $("picker").style.visibility = state.view === "next" ? "hidden" : "visible";
    document.querySelector(".head-pick").style.visibility = state.view === "block" || state.view === "next" ? "hidden" : "visible";
    try {
      await loadTraining();
      await Promise.all([LOADERS[state.view](), loadKnockout()]);
      const tr = state.training;
      if (tr && tr.lazy && !tr.score_steps.includes(state.step)) fetchTraining(); // this step's scores join the curves
      setStatus(`${state.tokens.length} tokens · ${state.model}` + (state.step !== null ? ` · step ${state.step}` : "") +
        (state.ablate.length ? ` · ${state.ablate.length} head${state.ablate.length > 1 ? "s" : ""} knocked out` : ""));
    } catch (err) {
      setStatus(err.message, true);
    }
  }

  async function runText() {
    state.text = $("text").value;
    state.responses.clear();
    state.dict.queryToken = null;
    state.heads.selected = null;
    document.body.dataset.loading = "1";
    try {
      const run = await api("/api/run", body());
      state.info = run.model;
      state.tokens = run.tokens;
      fillSelect($("layer"), state.info.n_layers, (i) => String(i));
      fillSelect($("head"), state.info.n_heads, (i) => String(i));
      state.layer = Number($("layer").value); state.head = Number($("head").value);
    } catch (err) {
      setStatus(err.message, true);
      delete document.body.dataset.loading;
      return;
    }
    await refresh();
  }

  function wire() {
    $("run").addEventListener("click", () => { state.next.appended = ""; runText(); });
    $("text").addEventListener("keydown", (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); $("run").click(); } });
    $("model").addEventListener("change", () => {
      state.model = $("model").value; state.matrix.mask = null;
      state.ablate = []; state.step = null; state.training = null;
      runText();
    });
    wireMatrixZoom();
    $("step").addEventListener("input", () => {
      if (!state.training) return;
      state.step = state.training.steps[Number($("step").value)];
      drawTraining();
    });
    $("step").addEventListener("change", () => { if (state.training) { state.step = state.training.steps[Number($("step").value)]; refresh(); } });
    document.querySelectorAll("#click-mode button").forEach((b) => b.addEventListener("click", () => {
      state.clickMode = b.dataset.click;
      document.querySelectorAll("#click-mode button").forEach((x) => x.classList.toggle("active", x === b));
      if (state.heads.grid) drawGrid();
    }));
    document.querySelectorAll("#ablation-mode button").forEach((b) => b.addEventListener("click", () => { state.ablation = b.dataset.ablation; refresh(); }));
    $("knockout-clear").addEventListener("click", () => { state.ablate = []; refresh(); });
    $("save-png").addEventListener("click", () => guarded(() => savePicture("png")));
    $("save-svg").addEventListener("click", () => guarded(() => savePicture("svg")));
    $("layer").addEventListener("change", () => { state.layer = Number($("layer").value); refresh(); });
    $("head").addEventListener("change", () => { state.head = Number($("head").value); refresh(); });
    document.querySelectorAll("#tabs button[data-view]").forEach((b) => b.addEventListener("click", () => { state.view = b.dataset.view; refresh(); }));
    document.querySelectorAll("#dict-mode button").forEach((b) => b.addEventListener("click", () => {
      state.dict.mode = b.dataset.mode;
      state.dict.query = null;
      document.querySelectorAll("#dict-mode button").forEach((x) => x.classList.toggle("active", x === b));
      guarded(loadDict);
    }));
    $("dict-scale").addEventListener("input", (e) => { state.dict.mult = Math.pow(10, Number(e.target.value)); if (state.dict.data) drawDict(); });
    document.querySelectorAll("#matrix-stage button").forEach((b) => b.addEventListener("click", () => { state.matrix.stage = b.dataset.stage; drawMatrix(); }));
    document.querySelectorAll("#matrix-mask button").forEach((b) => b.addEventListener("click", () => { state.matrix.mask = b.dataset.mask; drawMatrix(); }));
    $("matrix-canvas").addEventListener("mousemove", matrixHover);
    $("matrix-canvas").addEventListener("mouseleave", () => { $("matrix-tip").style.display = "none"; });
    const stepHead = (delta) => {
      const H = state.info.n_heads, L = state.info.n_layers;
      let index = state.layer * H + state.head + delta;
      index = (index + H * L) % (H * L);
      openHead(Math.floor(index / H), index % H);
    };
    $("head-prev").addEventListener("click", () => stepHead(-1));
    $("head-next").addEventListener("click", () => stepHead(1));
    $("arc-threshold").addEventListener("input", (e) => { state.heads.threshold = Number(e.target.value); if (state.heads.pattern) drawArcs(); });
    $("stage-prev").addEventListener("click", () => stepStage(-1));
    $("stage-next").addEventListener("click", () => stepStage(1));
    document.addEventListener("keydown", (e) => {
      if (state.view !== "block" || e.target.tagName === "TEXTAREA" || e.target.tagName === "INPUT") return;
      if (e.key === "ArrowRight") stepStage(1);
      if (e.key === "ArrowLeft") stepStage(-1);
    });
    const nextControl = (id, apply) => $(id).addEventListener("change", (e) => { apply(Number(e.target.value)); refresh(); });
    nextControl("next-temp", (v) => { state.next.temperature = v; });
    nextControl("next-topk", (v) => { state.next.topK = Math.max(0, Math.floor(v)); });
    nextControl("next-topp", (v) => { state.next.topP = v; });
    $("next-temp").addEventListener("input", (e) => { $("next-temp-out").textContent = Number(e.target.value).toFixed(2); });
    $("next-topp").addEventListener("input", (e) => { $("next-topp-out").textContent = Number(e.target.value).toFixed(2); });
    $("next-sample").addEventListener("click", () => guarded(() => sampleNext(false)));
    $("next-greedy").addEventListener("click", () => guarded(() => sampleNext(true)));
  }

  async function start() {
    wire();
    try {
      state.models = EXPORT ? EXPORT.models : await api("/api/models");
    } catch (err) {
      setStatus(err.message, true);
      return;
    }
    const select = $("model");
    for (const m of state.models) {
      const o = document.createElement("option");
      o.value = m.name;
      o.textContent = `${m.name} (${m.causal ? "decoder" : "encoder"}, ${m.n_layers}×${m.n_heads} heads)`;
      select.appendChild(o);
    }
    state.model = state.models[0].name;
    if (!EXPORT && state.models[0].example) $("text").value = state.models[0].example; // e.g. the induction experiment's repeated spans
    if (EXPORT) {
      $("text").value = EXPORT.text;
      $("text").readOnly = true;
      $("run").disabled = true;
      $("run").title = "an exported page shows its own text only";
      state.view = EXPORT.view || "dict";
      if (EXPORT.ablate && EXPORT.ablate.length) { state.ablate = EXPORT.ablate; state.ablation = EXPORT.ablation || "zero"; }
    }
    await runText();
  }

  // A small handle for tests and the curious: the current state and the numbers each view shows.
  window.attnlab = { state, matrixValues: () => state.matrix.shown, dictWeights: () => state.dict.weights, refresh, pictureSvg };
  document.addEventListener("DOMContentLoaded", start);
})();
