// View 2, the attention matrix: raw q·kᵀ, scaled, masked and softmaxed, for any mask, on a canvas
// that zooms and pans.
//
// The matrix is painted once into an offscreen canvas, one pixel per cell, and drawn scaled: zoom
// and pan redraw one image, not T² rectangles (2,048 tokens: 4.2M cells).

import {
  $,
  EXPORT,
  LONG_TEXT,
  api,
  body,
  decodeMatrix,
  fmt,
  page,
  patternEncoding,
  show,
  softmaxRow,
  state
} from "../core.js";
import {loadMap, wireMap} from "./map.js";

// the stages fetch a head's whole T×T matrix twice (scores and pattern): up to this many tokens
export const STAGES_MAX = 2048;

export function matrixMode() {
  // "map" (the whole context, tiled: views/map.js) or "stages": the one picked, where this text
  // allows it, else the map above LONG_TEXT tokens; an exported page has no server to tile for it
  const T = state.tokens.length, picked = state.matrix.mode;
  if (EXPORT) return "stages";
  if (picked === "stages" && T <= STAGES_MAX) return "stages";
  if (picked === "map") return "map";
  return T > LONG_TEXT ? "map" : "stages";
}

export async function loadMatrix() {
  const m = state.matrix, mode = matrixMode();
  $("matrix-map").hidden = mode !== "map";
  $("matrix-stages").hidden = mode !== "stages";
  $("matrix-mode").hidden = !!EXPORT;
  document.querySelectorAll("#matrix-mode button").forEach((b) => {
    b.classList.toggle("active", b.dataset.mode === mode);
    b.disabled = b.dataset.mode === "stages" && state.tokens.length > STAGES_MAX;
  });
  $("matrix-mode-note").textContent =
      state.tokens.length > STAGES_MAX
          ? `the stages need the whole ${state.tokens.length}×${
                state.tokens.length} matrix: up to ${STAGES_MAX} tokens`
          : "";
  if (mode === "map") return loadMap();
  m.data = await api("/api/pattern",
                     body({layer : state.layer, head : state.head, encoding : patternEncoding()}));
  m.raw = decodeMatrix(m.data.raw);
  m.pattern = decodeMatrix(m.data.pattern);
  if (m.mask === null) m.mask = state.info.causal ? "causal" : "none";
  drawMatrix();
}

export function matrixValues() {
  // the stage shown: raw q·kᵀ -> ×scale -> mask (−∞ as null) -> softmax, for the mask chosen here
  const m = state.matrix, T = m.raw.length, S = m.raw[0].length, scale = m.data.scale;
  const visible = (i, j) => m.mask === "none" || j <= i + S - T;
  if (T > LONG_TEXT && m.stage === "softmax" &&
      m.mask === (state.info.causal ? "causal" : "none")) {
    return {
      rows : m.pattern,
      visible,
      model : true
    }; // a long text: the model's own pattern, not recomputed here
  }
  const rows = [];
  m.maxScaled = 0; // the largest |score| shown: bounds a softmax recomputed from float16 scores
                   // (shownPrecision)
  for (let i = 0; i < T; i++) {
    const raw = m.raw[i];
    for (let j = 0; j < S; j++)
      if (visible(i, j)) m.maxScaled = Math.max(m.maxScaled, Math.abs(raw[j] * scale));
    if (m.stage === "raw")
      rows.push(Array.from(raw));
    else if (m.stage === "scaled")
      rows.push(Array.from(raw, (x) => x * scale));
    else if (m.stage === "masked")
      rows.push(Array.from(raw, (x, j) => (visible(i, j) ? x * scale : null)));
    else
      rows.push(softmaxRow(Array.from(raw, (x) => x * scale), (j) => visible(i, j)));
  }
  return {rows, visible};
}

export function drawMatrix() {
  // values of the chosen stage -> one pixel per cell in an offscreen image -> painted at the zoom
  // and pan
  const t0 = performance.now();
  const m = state.matrix, tokens = m.data.tokens, T = tokens.length;
  const {rows, visible, model} = matrixValues();
  m.shown = rows;
  m.shownModel = !!model;
  let maxAbs = 0;
  for (const row of rows)
    for (const x of row)
      if (x !== null && Math.abs(x) > maxAbs) maxAbs = Math.abs(x);
  const image = document.createElement("canvas");
  image.width = T;
  image.height = T;
  const ictx = image.getContext("2d");
  const pixels = ictx.createImageData(T, T);
  const dark = m.stage === "masked" || m.stage === "softmax", px = pixels.data;
  // a long text spreads its weights thin (1/T each): there full blue is the 99th percentile of the
  // visible weights (a sample of them), else all but a few cells would be white
  let top = maxAbs;
  if (T > 128 && m.stage === "softmax") {
    const sample = [];
    for (let k = 0; k < 20000; k++) {
      const i = Math.floor(Math.random() * T), j = Math.floor(Math.random() * T);
      if (visible(i, j)) sample.push(rows[i][j]);
    }
    sample.sort((a, b) => a - b);
    top = Math.max(1e-9, sample[Math.floor(0.99 * (sample.length - 1))] || maxAbs);
  }
  m.colourTop = top;
  for (let i = 0; i < T; i++) {
    const row = rows[i];
    for (let j = 0; j < T; j++) {
      const o = 4 * (i * T + j);
      px[o + 3] = 255;
      if (dark && !visible(i, j)) {
        px[o] = px[o + 1] = px[o + 2] = 43;
        continue;
      } // masked: dark
      const x = row[j];
      if (x === null || !isFinite(x)) {
        px[o] = px[o + 1] = px[o + 2] = 43;
        continue;
      }
      const t = m.stage === "softmax" ? Math.min(1, Math.max(0, x / (top || 1)))
                                      : Math.max(-1, Math.min(1, x / (maxAbs || 1)));
      if (t >= 0) {
        px[o] = 255 - 222 * t;
        px[o + 1] = 255 - 153 * t;
        px[o + 2] = 255 - 75 * t;
      } // blues / diverging, as blues()
      else {
        px[o] = 255 + 30 * t;
        px[o + 1] = 255 + 190 * t;
        px[o + 2] = 255 + 190 * t;
      }
    }
  }
  ictx.putImageData(pixels, 0, 0);
  m.image = image;
  if (m.imageFor !== m.data) {
    m.zoom = 1;
    m.panX = 0;
    m.panY = 0;
    m.imageFor = m.data;
  }
  const base = Math.min(30, 620 / T);
  const margin = Math.min(110, 8 + 7 * Math.max(...tokens.map((t) => show(t).length)));
  const size = Math.ceil(margin + base * T + 4);
  const canvas = $("matrix-canvas");
  const ratio = window.devicePixelRatio || 1;
  canvas.width = size * ratio;
  canvas.height = size * ratio;
  canvas.style.width = size + "px";
  canvas.style.height = size + "px";
  m.base = base;
  m.margin = margin;
  m.size = size;
  paintMatrix();
  const modelMask = state.info.causal ? "causal" : "none";
  let note = `layer ${state.layer} head ${state.head} · rows: queries, columns: keys · ${T}×${T}`;
  if (model) {
    note += " · the model's hook_pattern";
  } else if (m.stage === "softmax" && m.mask === modelMask) {
    let diff = 0;
    for (let i = 0; i < T; i++)
      for (let j = 0; j < T; j++) diff = Math.max(diff, Math.abs(rows[i][j] - m.pattern[i][j]));
    note += ` · max |this − the model's hook_pattern| = ${diff.toExponential(1)}`;
  } else if (m.mask !== modelMask) {
    note += ` · mask ${m.mask}: not the mask this ${
        state.info.causal ? "decoder" : "encoder"} was trained with`;
  }
  note +=
      m.stage === "softmax"
          ? (m.colourTop < maxAbs
                 ? ` · colour: white 0 → blue ${
                       fmt(m.colourTop, 3)} and above (the 99th percentile weight; the largest is ${
                       fmt(maxAbs, 3)})`
                 : ` · colour: white 0 → blue ${fmt(maxAbs, 3)} (the largest weight)`)
          : ` · colour: red −${fmt(maxAbs, 3)} → white 0 → blue +${fmt(maxAbs, 3)}`;
  $("matrix-note").textContent =
      note + (base >= 9 ? "" : " · hover for tokens and values, zoom in for labels");
  document.querySelectorAll("#matrix-stage button")
      .forEach((b) => b.classList.toggle("active", b.dataset.stage === m.stage));
  document.querySelectorAll("#matrix-mask button")
      .forEach((b) => b.classList.toggle("active", b.dataset.mask === m.mask));
  const cost = m.data.cost;
  const drawMs = performance.now() - t0;
  state.timings.matrixDrawMs = drawMs;
  if (cost) {
    const half = !!m.data.raw.f16,
          sent = 0.75 * [ "raw", "pattern" ].reduce(
                            (n, k) => n + (m.data[k].f16 || m.data[k].f32 || "").length, 0);
    $("matrix-cost").textContent =
        `cost: ${T}×${T} = ${cost.entries_per_head.toLocaleString()} scores per head ` +
        `(${(cost.bytes_per_head / 1e6).toFixed(1)} MB in float32) · server ${
            cost.server_ms.toFixed(0)} ms · ` +
        `sent ${(sent / 1e6).toFixed(1)} MB (scores and pattern${
            half ? ", as float16: values to 3 digits" : ""}) · drawn in ${drawMs.toFixed(0)} ms`;
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
  m.geometry = {cell, margin, panX : m.panX, panY : m.panY};
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, size, size);
  ctx.save();
  ctx.beginPath();
  ctx.rect(margin, margin, size - margin - 4, size - margin - 4);
  ctx.clip();
  ctx.imageSmoothingEnabled =
      cell < 1; // shrinking a long text's matrix: average; enlarging: crisp cells
  ctx.imageSmoothingQuality = "high";
  ctx.drawImage(m.image, margin - m.panX * cell, margin - m.panY * cell, T * cell, T * cell);
  ctx.restore();
  if (cell >= 9) {
    const first = Math.floor(m.panX), firstRow = Math.floor(m.panY),
          n = Math.ceil((size - margin) / cell) + 1;
    ctx.fillStyle = "#222";
    ctx.font = `${Math.min(13, cell - 1)}px sans-serif`;
    ctx.textBaseline = "middle";
    ctx.textAlign = "right";
    for (let i = firstRow; i < Math.min(T, firstRow + n); i++)
      ctx.fillText(show(tokens[i]), margin - 4, margin + (i - m.panY + 0.5) * cell);
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
    ctx.textAlign = "left";
    ctx.textBaseline = "top";
    ctx.fillText(`×${m.zoom.toFixed(1)} · rows ${Math.floor(m.panY)}–${
                     Math.min(T, Math.ceil(m.panY + (size - margin - 4) / cell)) - 1}`,
                 4, 4);
  }
}

function zoomMatrix(factor, x, y) {
  // zoom by `factor` keeping the cell under (x, y) (canvas pixels; default: the centre) where it is
  const m = state.matrix;
  if (!m.image) return;
  const cx = x === undefined ? (m.size + m.margin) / 2 : x,
        cy = y === undefined ? (m.size + m.margin) / 2 : y;
  const cell = m.base * m.zoom;
  const ci = (cx - m.margin) / cell + m.panX, cj = (cy - m.margin) / cell + m.panY;
  m.zoom = Math.max(1, Math.min(Math.max(1, 40 / m.base), m.zoom * factor)); // up to 40-pixel cells
  const next = m.base * m.zoom;
  m.panX = ci - (cx - m.margin) / next;
  m.panY = cj - (cy - m.margin) / next;
  clampPan();
  paintMatrix();
}

function matrixCell(event) {
  const m = state.matrix, r = $("matrix-canvas").getBoundingClientRect();
  const {cell, margin} = m.geometry;
  const x = event.clientX - r.left, y = event.clientY - r.top;
  return {
    x,
    y,
    j : Math.floor((x - margin) / cell + m.panX),
    i : Math.floor((y - margin) / cell + m.panY)
  };
}

function shownPrecision() {
  // the significant digits the hover shows, each one correct, and the magnitude below which a value
  // is only shown as "< tiny": float32 is exact to 6 digits; float16 (a long text) has a relative
  // error of at most 2^-11, under half a unit in the third digit, down to its `tiny`; a softmax
  // recomputed here from float16 scores (another mask) moves each score by at most 2^-11 of the
  // largest |score| M, so each weight by a factor of at most e^(2·2^-11·M): fewer digits, and "≈"
  // when even the first is not sure
  const m = state.matrix;
  if (!m.data.raw.f16) return {digits : 6, rawDigits : 4, tiny : 0, rawTiny : 0};
  const rawTiny = m.data.raw.tiny, factor = m.stage === "raw" ? 1 : m.data.scale;
  if (m.shownModel) return {digits : 3, rawDigits : 3, tiny : m.data.pattern.tiny, rawTiny};
  if (m.stage !== "softmax") return {digits : 3, rawDigits : 3, tiny : rawTiny * factor, rawTiny};
  const error = 2 * Math.expm1(2 * 2 ** -11 * m.maxScaled);
  return {
    digits : Math.max(1, Math.min(3, Math.floor(-Math.log10(error)))),
    rawDigits : 3,
    tiny : 0,
    rawTiny,
    rough : error > 0.1
  };
}

const fmtCell = (x, digits, tiny) => (x !== null && x !== undefined && x !== 0 && Math.abs(x) < tiny
                                          ? (x < 0 ? "> −" : "< ") + tiny.toPrecision(2)
                                          : fmt(x, digits));

function matrixHover(event) {
  const m = state.matrix;
  if (!m.shown) return;
  const tip = $("matrix-tip");
  const {x, y, i, j} = matrixCell(event);
  const T = m.shown.length;
  if (x < m.margin || y < m.margin || i < 0 || j < 0 || i >= T || j >= T) {
    tip.style.display = "none";
    return;
  }
  const raw = m.raw[i][j];
  tip.style.display = "block";
  tip.style.left = (x + 14) + "px";
  tip.style.top = (y + 14) + "px";
  const p = shownPrecision();
  tip.textContent = `query ${i} “${show(m.data.tokens[i])}” → key ${j} “${
                        show(m.data.tokens[j])}”: ${m.stage} = ` +
                    `${p.rough ? "≈" : ""}${fmtCell(m.shown[i][j], p.digits, p.tiny)}` +
                    ` (raw ${fmtCell(raw, p.rawDigits, p.rawTiny)}, scaled ${
                        fmtCell(raw * m.data.scale, p.rawDigits, p.rawTiny * m.data.scale)})`;
}

function wireMatrixZoom() {
  const canvas = $("matrix-canvas");
  canvas.addEventListener("wheel", (e) => {
    e.preventDefault();
    const {x, y} = matrixCell(e);
    zoomMatrix(e.deltaY < 0 ? 1.25 : 0.8, x, y);
  }, {passive : false});
  canvas.addEventListener("pointerdown", (e) => {
    const m = state.matrix;
    if (!m.image) return;
    const start = {x : e.clientX, y : e.clientY, panX : m.panX, panY : m.panY};
    const move = (ev) => {
      const cell = m.base * m.zoom;
      m.panX = start.panX - (ev.clientX - start.x) / cell;
      m.panY = start.panY - (ev.clientY - start.y) / cell;
      clampPan();
      paintMatrix();
    };
    const up = () => {
      window.removeEventListener("pointermove", move);
      window.removeEventListener("pointerup", up);
    };
    window.addEventListener("pointermove", move);
    window.addEventListener("pointerup", up);
  });
  $("zoom-in").addEventListener("click", () => zoomMatrix(2));
  $("zoom-out").addEventListener("click", () => zoomMatrix(0.5));
  $("zoom-reset").addEventListener("click", () => {
    const m = state.matrix;
    m.zoom = 1;
    m.panX = 0;
    m.panY = 0;
    if (m.image) paintMatrix();
  });
}

export function wireMatrix() {
  wireMatrixZoom();
  wireMap();
  document.querySelectorAll("#matrix-mode button")
      .forEach((b) => b.addEventListener("click", () => {
        state.matrix.mode = b.dataset.mode;
        page.refresh();
      }));
  document.querySelectorAll("#matrix-stage button")
      .forEach((b) => b.addEventListener("click", () => {
        state.matrix.stage = b.dataset.stage;
        drawMatrix();
      }));
  document.querySelectorAll("#matrix-mask button")
      .forEach((b) => b.addEventListener("click", () => {
        state.matrix.mask = b.dataset.mask;
        drawMatrix();
      }));
  $("matrix-canvas").addEventListener("mousemove", matrixHover);
  $("matrix-canvas")
      .addEventListener("mouseleave", () => { $("matrix-tip").style.display = "none"; });
}
