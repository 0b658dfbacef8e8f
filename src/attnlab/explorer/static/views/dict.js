// View 1, the soft dictionary: keys and values on their top two principal axes (or six toy 2-D
// keys), a query to drag, and the weights softmax(q·k × scale) as threads.
//
// The only arithmetic done here is what the interactions need: a softmax of the real scores under a
// different scale, and the 2-D scores of a dragged query. Everything else is the model's.

import {
  $,
  api,
  barRow,
  body,
  chips,
  clear,
  decodeMatrix,
  guarded,
  patternEncoding,
  show,
  softmaxRow,
  state,
  svg
} from "../core.js";

const TOY = {
  tokens : [ "cat", "dog", "mat", "sat", "it", "tired" ],
  keys : [ [ 2.2, 1.6 ], [ 1.6, 2.3 ], [ -2.0, 1.0 ], [ -1.2, -2.1 ], [ 1.3, 0.6 ], [ 0.2, -2.4 ] ],
  values :
      [ [ 1.5, 1.8 ], [ 1.0, 2.2 ], [ -2.2, 0.6 ], [ -1.5, -1.6 ], [ 0.8, 0.9 ], [ 0.6, -2.0 ] ],
  scale : 1 / Math.SQRT2,
};

export async function loadDict() {
  const d = state.dict;
  if (d.mode === "toy") {
    d.data = {
      tokens : TOY.tokens,
      keys : TOY.keys,
      values : TOY.values,
      queries : null,
      raw : null,
      scale : TOY.scale,
      causal : false
    };
    if (!d.query) d.query = [ 1.0, 1.0 ];
    d.queryToken = null;
  } else {
    const [projection, pattern] = await Promise.all([
      api("/api/projection", body({layer : state.layer, head : state.head})),
      api("/api/pattern",
          body({layer : state.layer, head : state.head, encoding : patternEncoding()})),
    ]);
    d.data = Object.assign({raw : decodeMatrix(pattern.raw)}, projection);
    // a long text's raw scores are float16: its real tokens' weights are the model's own pattern
    // instead
    if (pattern.pattern.f16) d.data.pattern = decodeMatrix(pattern.pattern);
    if (d.queryToken === null || d.queryToken >= d.data.tokens.length)
      d.queryToken = d.data.tokens.length - 1;
    d.query = d.data.queries[d.queryToken];
  }
  drawDict();
}

export function dictWeights() {
  // exact weights for a real token's query (its real scores, re-scaled); 2-D scores for a dragged
  // one
  const d = state.dict, data = d.data, scale = data.scale * d.mult;
  if (d.queryToken !== null && data.pattern && d.mult === 1)
    return Array.from(data.pattern[d.queryToken]);
  if (d.queryToken !== null && data.raw) {
    const i = d.queryToken;
    const w = data.sliding_window; // a sliding window: the query and the w − 1 keys before it
    return softmaxRow(Array.from(data.raw[i], (s) => s * scale),
                      (j) => !data.causal || (j <= i && (w == null || j > i - w)));
  }
  const scores = data.keys.map((k) => scale * (d.query[0] * k[0] + d.query[1] * k[1]));
  return softmaxRow(scores, () => true);
}

function extent(points) {
  let xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  xs.push(0);
  ys.push(0);
  const pad = (a, b) => {
    const r = (b - a) || 1;
    return [ a - 0.12 * r, b + 0.12 * r ];
  };
  return [ pad(Math.min(...xs), Math.max(...xs)), pad(Math.min(...ys), Math.max(...ys)) ];
}

function scaler(points, width, height) {
  const [[ x0, x1 ], [ y0, y1 ]] = extent(points);
  const m = 28;
  const sx = (width - 2 * m) / (x1 - x0), sy = (height - 2 * m) / (y1 - y0);
  return {
    to : (p) => [m + (p[0] - x0) * sx, height - m - (p[1] - y0) * sy],
    from : (x, y) => [x0 + (x - m) / sx, y0 + (height - m - y) / sy],
  };
}

export function drawDict() {
  const d = state.dict, data = d.data;
  const weights = dictWeights();
  d.weights = weights;
  const keysSvg = $("dict-keys"), valuesSvg = $("dict-values");
  const W = +keysSvg.getAttribute("width"), H = +keysSvg.getAttribute("height");
  if (!d.keyScale || d.keyScaleFor !== data) {
    // fix the axes per head (not per drag) so that the picture holds still while the query moves
    d.keyScale = scaler(data.keys.concat(data.queries || [ d.query ]), W, H);
    d.valueScale =
        scaler(data.values, +valuesSvg.getAttribute("width"), +valuesSvg.getAttribute("height"));
    d.keyScaleFor = data;
  }
  const ks = d.keyScale, vs = d.valueScale;
  clear(keysSvg);
  const origin = ks.to([ 0, 0 ]);
  svg("line", {x1 : 0, x2 : W, y1 : origin[1], y2 : origin[1], class : "axis"}, keysSvg);
  svg("line", {x1 : origin[0], x2 : origin[0], y1 : 0, y2 : H, class : "axis"}, keysSvg);
  const q = ks.to(d.query);
  const threads = svg("g", {id : "dict-threads"}, keysSvg);
  data.keys.forEach((k, j) => {
    const p = ks.to(k);
    svg("line", {
      x1 : q[0],
      y1 : q[1],
      x2 : p[0],
      y2 : p[1],
      class : "thread",
      "stroke-width" : (0.3 + 12 * weights[j]).toFixed(2),
      "stroke-opacity" : (0.15 + 0.85 * weights[j]).toFixed(3),
      "data-w" : weights[j].toFixed(6),
      "data-key" : j
    },
        threads);
  });
  // with many tokens, label only the 20 most attended (and the query's own token), or the labels
  // are a blur
  const labelFrom = data.keys.length <= 80 ? 0 : weights.slice().sort((a, b) => b - a)[19];
  data.keys.forEach((k, j) => {
    const p = ks.to(k);
    const g =
        svg("g", {class : "key" + (j === d.queryToken ? " self" : ""), "data-index" : j}, keysSvg);
    svg("circle", {cx : p[0], cy : p[1], r : 4 + 6 * Math.sqrt(weights[j])}, g);
    if (weights[j] >= labelFrom || j === d.queryToken) {
      const label = svg("text", {x : p[0] + 7, y : p[1] - 6}, g);
      label.textContent = show(data.tokens[j]);
    }
    g.addEventListener("click", () => attendAs(j));
  });
  const qdot = svg("circle", {id : "dict-query", cx : q[0], cy : q[1], r : 9}, keysSvg);
  qdot.addEventListener("pointerdown", startDrag);
  // values panel: the output is the weighted blend of the values (a hollow star)
  clear(valuesSvg);
  const out = [ 0, 0 ];
  data.values.forEach((v, j) => {
    out[0] += weights[j] * v[0];
    out[1] += weights[j] * v[1];
  });
  const o = vs.to(out);
  data.values.forEach((v, j) => {
    const p = vs.to(v);
    svg("line", {
      x1 : o[0],
      y1 : o[1],
      x2 : p[0],
      y2 : p[1],
      class : "thread value-thread",
      "stroke-width" : (0.3 + 8 * weights[j]).toFixed(2),
      "stroke-opacity" : (0.1 + 0.8 * weights[j]).toFixed(3)
    },
        valuesSvg);
  });
  data.values.forEach((v, j) => {
    const p = vs.to(v);
    const s = 4 + 5 * Math.sqrt(weights[j]);
    svg("rect", {x : p[0] - s, y : p[1] - s, width : 2 * s, height : 2 * s, class : "value"},
        valuesSvg);
    if (weights[j] >= labelFrom) {
      const t = svg("text", {x : p[0] + s + 3, y : p[1] + 4}, valuesSvg);
      t.textContent = show(data.tokens[j]);
    }
  });
  svg("polygon", {id : "dict-output", points : starPoints(o[0], o[1], 13, 5.5), class : "star"},
      valuesSvg);
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
  $("dict-scale-out").textContent =
      `${d.mult.toFixed(2)} → scale ${scale.toPrecision(3)}` +
      (d.mode === "real" ? ` (1/√d_head = ${data.scale.toPrecision(3)})` : "");
  if (d.mode === "toy") {
    $("dict-keys-caption").textContent = "toy: six hand-placed 2-D keys (d_k = 2)";
    $("dict-values-caption").textContent = "toy values; ☆ = Σ weight × value";
  } else {
    $("dict-keys-caption").textContent =
        `layer ${state.layer} head ${state.head}: keys on their top two principal axes ` +
        `(${(100 * data.keys_variance_kept).toFixed(0)}% of their variance)`;
    $("dict-values-caption").textContent = `values, projected the same way (${
        (100 * data.values_variance_kept).toFixed(0)}%); ☆ = Σ weight × value`;
  }
  $("dict-note").textContent =
      d.queryToken !== null
          ? `query of token ${d.queryToken} “${
                show(data.tokens[d.queryToken])}”: the model's own scores q·k, ×${
                scale.toPrecision(3)}, softmax` +
                (data.causal ? " (causal: later tokens masked" +
                                   (data.sliding_window
                                        ? `, and those more than ${data.sliding_window - 1} back`
                                        : "") +
                                   ")"
                             : "") +
                (d.mult === 1 ? " = the model's attention pattern" : "")
          : (d.mode === "toy" && d.toyAt !== null && d.toyAt !== undefined
                 ? `query placed on the key of “${data.tokens[d.toyAt]}”: `
                 : "dragged query: ") +
                "scores from the 2-D points, q₂·k₂ × scale" +
                (d.mode === "real" ? " (an approximation: the real q and k have more dimensions)"
                                   : "");
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
  if (!d.data.queries) {
    d.query = d.data.keys[j].slice();
    d.queryToken = null;
    d.toyAt = j;
  } // toy: query at that key
  else {
    d.queryToken = j;
    d.query = d.data.queries[j];
  }
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
    if (frame === null)
      frame = requestAnimationFrame(() => {
        frame = null;
        drawDict();
      });
  };
  const up = () => {
    window.removeEventListener("pointermove", move);
    window.removeEventListener("pointerup", up);
    if (frame !== null) {
      cancelAnimationFrame(frame);
      frame = null;
    }
    drawDict();
  };
  window.addEventListener("pointermove", move);
  window.addEventListener("pointerup", up);
}

export function wireDict() {
  document.querySelectorAll("#dict-mode button").forEach((b) => b.addEventListener("click", () => {
    state.dict.mode = b.dataset.mode;
    state.dict.query = null;
    document.querySelectorAll("#dict-mode button")
        .forEach((x) => x.classList.toggle("active", x === b));
    guarded(loadDict);
  }));
  $("dict-scale").addEventListener("input", (e) => {
    state.dict.mult = Math.pow(10, Number(e.target.value));
    if (state.dict.data) drawDict();
  });
}
