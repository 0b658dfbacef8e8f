// View 3, heads: one head's pattern as arcs between tokens, and every layer × head as thumbnails
// that open a head or knock it out (with each head's standout score and, for a training run, its
// score curve).

import {
  $,
  api,
  blues,
  body,
  clear,
  decodeMatrix,
  isOff,
  page,
  patternEncoding,
  show,
  state,
  svg
} from "../core.js";

export async function loadHeads() {
  const [pattern, grid] = await Promise.all([
    api("/api/pattern",
        body({layer : state.layer, head : state.head, encoding : patternEncoding()})),
    api("/api/heads", body()),
  ]);
  state.heads.pattern = decodeMatrix(pattern.pattern);
  state.heads.grid = grid;
  drawArcs();
  drawGrid();
  const scoresKey = state.model + " " + state.step;
  if (state.heads.scoresFor !== scoresKey) {
    // head scores come from attnlab.inspection, once per model (they don't depend on the text):
    // draw the grid first and add them when they arrive (at the chosen training step, for a run
    // with snapshots)
    state.heads.scoresFor = scoresKey;
    state.heads.scores = null;
    api(`/api/models/${encodeURIComponent(state.model)}/head-scores` +
        (state.step !== null ? `?step=${state.step}` : ""))
        .then((s) => {
          state.heads.scores = s.available ? s : null;
          if (state.view === "heads") drawGrid();
        })
        .catch(() => { state.heads.scoresFor = null; });
  }
}

const LONG_ARCS =
    200; // past this many tokens the arcs show one token's strongest links, not every query's

export function drawArcs() {
  const h = state.heads, tokens = state.tokens;
  if (tokens.length > LONG_ARCS) return drawTokenArcs();
  const P = h.pattern, T = tokens.length;
  const el = $("arcs");
  clear(el);
  const rowH = 18, x0 = 110, top = 12;
  el.setAttribute("height", top * 2 + rowH * T);
  const y = (i) => top + rowH * (i + 0.5);
  const arcs = svg("g", {id : "arc-paths"}, el);
  const perQuery = T > 64 ? 4 : 8; // at most this many arcs per query, so 512 tokens stay drawable
  for (let i = 0; i < T; i++) {
    if (h.selected !== null && h.selected !== i) continue;
    const row = Array.from(P[i])
                    .map((w, j) => [w, j])
                    .filter(([ w ]) => w >= h.threshold)
                    .sort((a, b) => b[0] - a[0])
                    .slice(0, perQuery);
    for (const [w, j] of row) {
      const attrs = {
        class : "arc",
        "stroke-width" : (0.4 + 9 * w).toFixed(2),
        "stroke-opacity" : (0.25 + 0.75 * w).toFixed(3),
        "data-q" : i,
        "data-k" : j,
        "data-w" : w.toFixed(5)
      };
      if (i === j) {
        svg("circle", Object.assign(attrs, {cx : x0 + 10, cy : y(i), r : 6, fill : "none"}), arcs);
      } else {
        const bulge = 14 + Math.min(280, 0.55 * rowH * Math.abs(i - j));
        attrs.d =
            `M ${x0 + 4} ${y(i)} C ${x0 + bulge} ${y(i)}, ${x0 + bulge} ${y(j)}, ${x0 + 4} ${y(j)}`;
        svg("path", attrs, arcs);
        svg("circle", {cx : x0 + 4, cy : y(j), r : 1.5 + 2 * w, class : "arc-end"}, arcs);
      }
    }
  }
  tokens.forEach((t, i) => {
    const g = svg("text", {
      x : x0 - 6,
      y : y(i) + 4,
      class : "arc-token" + (h.selected === i ? " active" : ""),
      "data-index" : i
    },
                  el);
    g.textContent = show(t);
    g.addEventListener("click", () => {
      h.selected = h.selected === i ? null : i;
      drawArcs();
      drawGrid();
    });
  });
  el.setAttribute("width", x0 + 40 + Math.min(280, 0.55 * rowH * Math.max(1, T - 1)));
  $("arcs-title").textContent =
      `layer ${state.layer} head ${state.head}` +
      (h.selected !== null ? ` · where “${show(tokens[h.selected])}” attends` : " · every query") +
      (state.info.causal ? " · causal: arcs go to earlier tokens" : "");
  $("arc-threshold-out").textContent = h.threshold.toFixed(2);
}

function drawTokenArcs() {
  // a long text: the chosen token (the last one unless clicked) and the 12 keys it attends to most,
  // in text order, with the gaps between them marked; click a key to follow where that token
  // attends
  const h = state.heads, P = h.pattern, tokens = state.tokens, T = tokens.length;
  if (h.selected === null || h.selected >= T) h.selected = T - 1;
  const q = h.selected;
  const top = Array.from(P[q])
                  .map((w, j) => [w, j])
                  .sort((a, b) => b[0] - a[0])
                  .slice(0, 12); // however spread out
  const shown = Array.from(new Set([ q, ...top.map(([, j ]) => j) ])).sort((a, b) => a - b);
  const el = $("arcs");
  clear(el);
  const rowH = 20, x0 = 150, pad = 12;
  const y = (k) => pad + rowH * (k + 0.5);
  const row = new Map(shown.map((j, k) => [j, k]));
  const arcs = svg("g", {id : "arc-paths"}, el);
  for (const [w, j] of top) {
    const attrs = {
      class : "arc",
      "stroke-width" : (0.4 + 9 * w).toFixed(2),
      "stroke-opacity" : (0.25 + 0.75 * w).toFixed(3),
      "data-q" : q,
      "data-k" : j,
      "data-w" : w.toFixed(5)
    };
    if (j === q) {
      svg("circle", Object.assign(attrs, {cx : x0 + 10, cy : y(row.get(q)), r : 6, fill : "none"}),
          arcs);
      continue;
    }
    const bulge = 14 + Math.min(240, 14 * Math.abs(row.get(q) - row.get(j)));
    attrs.d = `M ${x0 + 4} ${y(row.get(q))} C ${x0 + bulge} ${y(row.get(q))}, ${x0 + bulge} ${
        y(row.get(j))}, ${x0 + 4} ${y(row.get(j))}`;
    svg("path", attrs, arcs);
    svg("circle", {cx : x0 + 4, cy : y(row.get(j)), r : 1.5 + 2 * w, class : "arc-end"}, arcs);
  }
  shown.forEach((j, k) => {
    const gap = k > 0 && j - shown[k - 1] > 1 ? ` (+${j - shown[k - 1] - 1})` : "";
    const label = svg("text", {
      x : x0 - 6,
      y : y(k) + 4,
      class : "arc-token" + (j === q ? " active" : ""),
      "data-index" : j
    },
                      el);
    label.textContent = `${gap} #${j} ${show(tokens[j]).slice(0, 12)}`;
    label.addEventListener("click", () => {
      h.selected = j;
      drawArcs();
    });
  });
  el.setAttribute("height", 2 * pad + rowH * shown.length);
  el.setAttribute("width", x0 + 280);
  $("arcs-title").textContent =
      `layer ${state.layer} head ${state.head} · ${T} tokens: where #${q} “${
          show(tokens[q])}” attends most ` +
      `(its ${top.length} strongest links; (+n) = n tokens between) · click a token to follow it`;
  $("arc-threshold-out").textContent = h.threshold.toFixed(2);
}

export function drawGrid() {
  const h = state.heads, grid = h.grid, container = $("heads-grid");
  clear(container);
  const scores = h.scores;
  $("grid-title").textContent =
      "all layers × heads" + (grid.pooled ? " (max-pooled thumbnails)" : "") +
      (h.selected !== null && !grid.pooled ? ` · outlined row: “${show(grid.tokens[h.selected])}”`
                                           : "") +
      (scores ? " · head scores from attnlab.inspection" : "");
  const table = document.createElement("table");
  table.className = "grid";
  const header = document.createElement("tr");
  header.innerHTML =
      "<th></th>" + grid.thumbnails[0].map((_, hd) => `<th>head ${hd}</th>`).join("");
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
      c.width = size;
      c.height = size;
      c.className = "thumb" + (l === state.layer && hd === state.head ? " current" : "") +
                    (isOff(l, hd) ? " off" : "");
      c.dataset.layer = l;
      c.dataset.head = hd;
      const ctx = c.getContext("2d");
      const n = thumb.length, cs = size / n;
      for (let i = 0; i < n; i++)
        for (let j = 0; j < thumb[i].length; j++) {
          ctx.fillStyle = blues(thumb[i][j]);
          ctx.fillRect(j * cs, i * cs, Math.ceil(cs), Math.ceil(cs));
        }
      if (h.selected !== null && !grid.pooled && h.selected < n) {
        ctx.strokeStyle = "#e4572e";
        ctx.lineWidth = 1.5;
        ctx.strokeRect(0.75, h.selected * cs + 0.75, size - 1.5, cs - 1.5);
      }
      if (isOff(l, hd)) { // knocked out: a red cross over the pattern it still computes (its output
                          // z is ablated)
        ctx.strokeStyle = "#b42318";
        ctx.lineWidth = 3;
        ctx.beginPath();
        ctx.moveTo(6, 6);
        ctx.lineTo(size - 6, size - 6);
        ctx.moveTo(size - 6, 6);
        ctx.lineTo(6, size - 6);
        ctx.stroke();
      }
      c.title = `layer ${l} head ${hd}` +
                (state.clickMode === "knock" ? " · click to knock out / restore" : "");
      c.addEventListener("click",
                         () => (state.clickMode === "knock" ? toggleHead(l, hd) : openHead(l, hd)));
      td.appendChild(c);
      if (state.training && state.training.available) td.appendChild(sparkline(l, hd));
      if (scores) {
        const best = bestScore(scores, l, hd);
        if (best) {
          const s = document.createElement("div");
          s.className = "score" + (best.standout ? " standout" : "");
          s.textContent = `${SCORE_LABELS[best.name] || best.name} ${best.value.toFixed(2)}`;
          s.title = `${best.name} score ${best.value.toFixed(3)} (stands out from ${
              scores.thresholds[best.name]})`;
          td.appendChild(s);
        }
      }
      tr.appendChild(td);
    });
    table.appendChild(tr);
  });
  container.appendChild(table);
}

const SCORE_LABELS = {
  previous_token : "prev",
  duplicate_token : "dup",
  induction : "ind",
  first_token : "first",
  copying : "copy"
};

function bestScore(scores, l, hd) {
  // the head's score that stands out most, relative to its threshold
  let best = null;
  for (const [name, grid] of Object.entries(scores.scores)) {
    const value = grid[l][hd];
    if (value === null) continue;
    const ratio = value / (scores.thresholds[name] || 1);
    if (!best || ratio > best.ratio) best = {name, value, ratio, standout : ratio >= 1};
  }
  return best;
}

function sparkline(l, hd) {
  // this head's score over training (the score it ends highest in, relative to its threshold), step
  // marked
  const tr = state.training, W = 56, H = 20;
  const final = tr.score_steps.length - 1;
  let name = null, best = -Infinity;
  for (const [score, perStep] of Object.entries(tr.scores)) {
    const v = perStep[final][l][hd];
    if (v !== null && v / (tr.thresholds[score] || 1) > best) {
      best = v / (tr.thresholds[score] || 1);
      name = score;
    }
  }
  const el = svg("svg", {width : W, height : H, class : "spark", "data-score" : name});
  if (name === null) return el;
  const values = tr.scores[name].map((perStep) => perStep[l][hd] || 0), steps = tr.score_steps;
  const lo = name === "copying" ? -1 : 0, last = steps[steps.length - 1] || 1;
  const x = (step) => 1 + (W - 2) * step / last, yv = (v) => H - 1 - (H - 2) * (v - lo) / (1 - lo);
  svg("path", {
    d : values.map((v, k) => `${k ? "L" : "M"}${x(steps[k]).toFixed(1)},${yv(v).toFixed(1)}`)
            .join(" ")
  },
      el);
  if (state.step !== null)
    svg("line", {x1 : x(state.step), x2 : x(state.step), y1 : 0, y2 : H}, el);
  const title = svg("title", {}, el);
  title.textContent = `${name} score of layer ${l} head ${hd} over training: ` +
                      values.map((v, k) => `${steps[k]}: ${v.toFixed(2)}`).join(", ");
  return el;
}

function toggleHead(l, hd) {
  state.ablate = isOff(l, hd) ? state.ablate.filter((h) => h[0] !== l || h[1] !== hd)
                              : state.ablate.concat([ [ l, hd ] ]);
  page.refresh();
}

export function openHead(l, hd) {
  state.layer = l;
  state.head = hd;
  $("layer").value = l;
  $("head").value = hd;
  page.refresh();
}

export function wireHeads() {
  const stepHead = (delta) => {
    const H = state.info.n_heads, L = state.info.n_layers;
    let index = state.layer * H + state.head + delta;
    index = (index + H * L) % (H * L);
    openHead(Math.floor(index / H), index % H);
  };
  $("head-prev").addEventListener("click", () => stepHead(-1));
  $("head-next").addEventListener("click", () => stepHead(1));
  $("arc-threshold").addEventListener("input", (e) => {
    state.heads.threshold = Number(e.target.value);
    if (state.heads.pattern) drawArcs();
  });
  document.querySelectorAll("#click-mode button").forEach((b) => b.addEventListener("click", () => {
    state.clickMode = b.dataset.click;
    document.querySelectorAll("#click-mode button")
        .forEach((x) => x.classList.toggle("active", x === b));
    if (state.heads.grid) drawGrid();
  }));
}
