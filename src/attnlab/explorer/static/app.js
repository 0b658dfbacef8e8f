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
"use strict";

(function () {
  const EXPORT = window.ATTNLAB_EXPORT || null;
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
    const response = await fetch(path, body ? {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
    } : {});
    const data = await response.json();
    if (!response.ok) {
      const detail = Array.isArray(data.detail) ? data.detail.map((d) => (d.loc || []).slice(1).join(".") + ": " + d.msg).join("; ") : data.detail;
      throw new Error(detail || response.statusText);
    }
    if (body) state.responses.set(key, data);
    return data;
  }

  function decodeMatrix(m) {
    // {shape, f32: base64} -> array of Float32Array rows; nested lists pass through.
    if (!m || !m.f32) return m;
    const bytes = Uint8Array.from(atob(m.f32), (c) => c.charCodeAt(0));
    const flat = new Float32Array(bytes.buffer);
    const [rows, cols] = m.shape;
    const out = [];
    for (let i = 0; i < rows; i++) out.push(flat.subarray(i * cols, (i + 1) * cols));
    return out;
  }

  const body = (extra) => Object.assign({ model: state.model, text: state.text }, extra || {});

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
    // softmax over the visible entries; invisible ones get exactly 0 (as attnlab.attention does)
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
        api("/api/pattern", body({ layer: state.layer, head: state.head, encoding: "f32" })),
      ]);
      d.data = Object.assign({ raw: decodeMatrix(pattern.raw) }, projection);
      if (d.queryToken === null || d.queryToken >= d.data.tokens.length) d.queryToken = d.data.tokens.length - 1;
      d.query = d.data.queries[d.queryToken];
    }
    drawDict();
  }

  function dictWeights() {
    // exact weights for a real token's query (its real scores, re-scaled); 2-D scores for a dragged one
    const d = state.dict, data = d.data, scale = data.scale * d.mult;
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
    m.data = await api("/api/pattern", body({ layer: state.layer, head: state.head, encoding: "f32" }));
    m.raw = decodeMatrix(m.data.raw);
    m.pattern = decodeMatrix(m.data.pattern);
    if (m.mask === null) m.mask = state.info.causal ? "causal" : "none";
    drawMatrix();
  }

  function matrixValues() {
    // the stage shown: raw q·kᵀ -> ×scale -> mask (−∞ as null) -> softmax, for the mask chosen here
    const m = state.matrix, T = m.raw.length, S = m.raw[0].length, scale = m.data.scale;
    const visible = (i, j) => m.mask === "none" || j <= i + S - T;
    const rows = [];
    for (let i = 0; i < T; i++) {
      const raw = Array.from(m.raw[i]);
      if (m.stage === "raw") rows.push(raw);
      else if (m.stage === "scaled") rows.push(raw.map((x) => x * scale));
      else if (m.stage === "masked") rows.push(raw.map((x, j) => (visible(i, j) ? x * scale : null)));
      else rows.push(softmaxRow(raw.map((x) => x * scale), (j) => visible(i, j)));
    }
    return { rows, visible };
  }

  function drawMatrix() {
    const m = state.matrix, tokens = m.data.tokens, T = tokens.length;
    const { rows, visible } = matrixValues();
    m.shown = rows;
    const canvas = $("matrix-canvas");
    const cell = Math.max(1, Math.min(30, Math.floor(620 / T)));
    const labels = cell >= 9;
    const margin = labels ? Math.min(110, 8 + 7 * Math.max(...tokens.map((t) => show(t).length))) : 4;
    m.geometry = { cell, margin };
    const ratio = window.devicePixelRatio || 1;
    const size = margin + cell * T + 4;
    canvas.width = size * ratio; canvas.height = size * ratio;
    canvas.style.width = size + "px"; canvas.style.height = size + "px";
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, size, size);
    let maxAbs = 0;
    for (const row of rows) for (const x of row) if (x !== null && Math.abs(x) > maxAbs) maxAbs = Math.abs(x);
    for (let i = 0; i < T; i++) {
      for (let j = 0; j < T; j++) {
        const x = rows[i][j];
        if (!visible(i, j) && (m.stage === "masked" || m.stage === "softmax")) ctx.fillStyle = "#2b2b2b"; // masked: dark
        else ctx.fillStyle = m.stage === "softmax" ? blues(x / maxAbs) : diverging(x, maxAbs);
        ctx.fillRect(margin + j * cell, margin + i * cell, cell, cell);
      }
    }
    if (labels) {
      ctx.fillStyle = "#222";
      ctx.font = `${Math.min(13, cell - 1)}px sans-serif`;
      ctx.textBaseline = "middle";
      ctx.textAlign = "right";
      tokens.forEach((t, i) => ctx.fillText(show(t), margin - 4, margin + (i + 0.5) * cell));
      tokens.forEach((t, j) => {
        ctx.save();
        ctx.translate(margin + (j + 0.5) * cell, margin - 4);
        ctx.rotate(-Math.PI / 2);
        ctx.textAlign = "left";
        ctx.fillText(show(t), 0, 0);
        ctx.restore();
      });
    }
    const modelMask = state.info.causal ? "causal" : "none";
    let note = `layer ${state.layer} head ${state.head} · rows: queries, columns: keys · ${T}×${T}`;
    if (m.stage === "softmax" && m.mask === modelMask) {
      let diff = 0;
      for (let i = 0; i < T; i++) for (let j = 0; j < T; j++) diff = Math.max(diff, Math.abs(rows[i][j] - m.pattern[i][j]));
      note += ` · max |this − the model's hook_pattern| = ${diff.toExponential(1)}`;
    } else if (m.mask !== modelMask) {
      note += ` · mask ${m.mask}: not the mask this ${state.info.causal ? "decoder" : "encoder"} was trained with`;
    }
    note += m.stage === "softmax" ? ` · colour: white 0 → blue ${fmt(maxAbs, 3)} (the largest weight)` : ` · colour: red −${fmt(maxAbs, 3)} → white 0 → blue +${fmt(maxAbs, 3)}`;
    $("matrix-note").textContent = note + (labels ? "" : " · hover for tokens and values");
    document.querySelectorAll("#matrix-stage button").forEach((b) => b.classList.toggle("active", b.dataset.stage === m.stage));
    document.querySelectorAll("#matrix-mask button").forEach((b) => b.classList.toggle("active", b.dataset.mask === m.mask));
  }

  function matrixHover(event) {
    const m = state.matrix;
    if (!m.shown) return;
    const tip = $("matrix-tip");
    const r = event.target.getBoundingClientRect();
    const { cell, margin } = m.geometry;
    const j = Math.floor((event.clientX - r.left - margin) / cell), i = Math.floor((event.clientY - r.top - margin) / cell);
    const T = m.shown.length;
    if (i < 0 || j < 0 || i >= T || j >= T) { tip.style.display = "none"; return; }
    const raw = m.raw[i][j];
    tip.style.display = "block";
    tip.style.left = (event.clientX - r.left + 14) + "px";
    tip.style.top = (event.clientY - r.top + 14) + "px";
    tip.textContent = `query ${i} “${show(m.data.tokens[i])}” → key ${j} “${show(m.data.tokens[j])}”: ${m.stage} = ${fmt(m.shown[i][j], 6)}` +
      ` (raw ${fmt(raw)}, scaled ${fmt(raw * m.data.scale)})`;
  }

  // ---------------------------------------------------------------------------------------------
  // View 3: heads (arcs and the grid of thumbnails)
  async function loadHeads() {
    const [pattern, grid] = await Promise.all([
      api("/api/pattern", body({ layer: state.layer, head: state.head, encoding: "f32" })),
      api("/api/heads", body()),
    ]);
    state.heads.pattern = decodeMatrix(pattern.pattern);
    state.heads.grid = grid;
    drawArcs();
    drawGrid();
    if (state.heads.scoresFor !== state.model) {
      // head scores come from attnlab.inspection, once per model (they don't depend on the text): draw the
      // grid first and add them when they arrive
      state.heads.scoresFor = state.model;
      state.heads.scores = null;
      api(`/api/models/${encodeURIComponent(state.model)}/head-scores`).then((s) => {
        state.heads.scores = s.available ? s : null;
        if (state.view === "heads") drawGrid();
      }).catch(() => { state.heads.scoresFor = null; });
    }
  }

  function drawArcs() {
    const h = state.heads, P = h.pattern, tokens = state.tokens, T = tokens.length;
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
        c.className = "thumb" + (l === state.layer && hd === state.head ? " current" : "");
        c.dataset.layer = l; c.dataset.head = hd;
        const ctx = c.getContext("2d");
        const n = thumb.length, cs = size / n;
        for (let i = 0; i < n; i++) for (let j = 0; j < thumb[i].length; j++) {
          ctx.fillStyle = blues(thumb[i][j]);
          ctx.fillRect(j * cs, i * cs, Math.ceil(cs), Math.ceil(cs));
        }
        if (h.selected !== null && !grid.pooled) {
          ctx.strokeStyle = "#e4572e"; ctx.lineWidth = 1.5;
          ctx.strokeRect(0.75, h.selected * cs + 0.75, size - 1.5, cs - 1.5);
        }
        c.title = `layer ${l} head ${hd}`;
        c.addEventListener("click", () => openHead(l, hd));
        td.appendChild(c);
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
    drawNext();
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
    data.candidates.forEach((c) => {
      const row = barRow("button", "span", show(c.piece), c.prob, (100 * c.prob).toFixed(2) + "%");
      row.type = "button";
      row.className = "next-bar";
      row.dataset.id = c.id;
      row.title = `id ${c.id} · logit ${fmt(c.logit)}`;
      row.addEventListener("click", () => appendText(c.text));
      bars.appendChild(row);
    });
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
  // Wiring
  const LOADERS = { dict: loadDict, matrix: loadMatrix, heads: loadHeads, block: loadBlock, next: loadNext };

  async function refresh() {
    if (!state.info) return;
    document.querySelectorAll("#tabs button[data-view]").forEach((b) => b.classList.toggle("active", b.dataset.view === state.view));
    document.querySelectorAll(".view").forEach((v) => v.classList.toggle("active", v.id === "view-" + state.view));
    $("picker").style.visibility = state.view === "next" ? "hidden" : "visible";
    document.querySelector(".head-pick").style.visibility = state.view === "block" || state.view === "next" ? "hidden" : "visible";
    document.body.dataset.loading = "1";
    try {
      await LOADERS[state.view]();
      setStatus(`${state.tokens.length} tokens · ${state.model}`);
    } catch (err) {
      setStatus(err.message, true);
    } finally {
      delete document.body.dataset.loading;
      document.body.dataset.ready = state.view;
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
    $("model").addEventListener("change", () => { state.model = $("model").value; state.matrix.mask = null; runText(); });
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
    if (EXPORT) {
      $("text").value = EXPORT.text;
      $("text").readOnly = true;
      $("run").disabled = true;
      $("run").title = "an exported page shows its own text only";
      state.view = EXPORT.view || "dict";
    }
    await runText();
  }

  // A small handle for tests and the curious: the current state and the numbers each view shows.
  window.attnlab = { state, matrixValues: () => state.matrix.shown, dictWeights: () => state.dict.weights, refresh };
  document.addEventListener("DOMContentLoaded", start);
})();
