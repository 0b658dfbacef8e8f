// View 4, through a block: one token's path through one layer, stage by stage, each with its hook
// name, its equation, its shape and its values.

import {$, api, blues, body, chips, clear, diverging, fmt, guarded, show, state} from "../core.js";

export async function loadBlock() {
  const b = state.block;
  if (b.token === null || b.token >= state.tokens.length) b.token = state.tokens.length - 1;
  b.data = await api("/api/trace", body({layer : state.layer, token : b.token}));
  b.stage = Math.min(b.stage, b.data.stages.length - 1);
  drawBlock();
}

export function drawBlock() {
  const b = state.block, stages = b.data.stages;
  chips($("block-tokens"), state.tokens, b.token, (i) => {
    b.token = i;
    guarded(loadBlock);
  });
  const pipe = $("block-pipeline");
  clear(pipe);
  stages.forEach((s, k) => {
    const li = document.createElement("li");
    li.textContent = s.title;
    li.className = (k === b.stage ? "current" : "") + (s.values === null ? " skipped" : "");
    li.addEventListener("click", () => {
      b.stage = k;
      drawBlock();
    });
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
    card.addEventListener("click", () => {
      b.stage = k;
      drawBlock();
    });
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
  const tokenShape = s.dims[0] === "pos" ? s.shape.slice(1) : [ s.shape[0], s.shape[2] ];
  meta.textContent =
      `${s.hook ? s.hook : "computed from the cached q and k"} · full shape ${dimsText(s)} · ` +
      `this token: [${tokenShape.join(", ")}]`;
  card.appendChild(meta);
  if (!current) return card;
  const rows = Array.isArray(s.values[0]) ? s.values : [ s.values ];
  const flat = rows.flat().filter((x) => x !== null);
  const maxAbs = Math.max(...flat.map(Math.abs), 1e-9);
  const norm = Math.sqrt(flat.reduce((a, x) => a + x * x, 0));
  const stats = document.createElement("div");
  stats.className = "meta";
  stats.textContent =
      `min ${fmt(Math.min(...flat))} · max ${fmt(Math.max(...flat))} · ‖x‖ ${fmt(norm)}` +
      (rows.length === 1
           ? ` · first values: ${rows[0].slice(0, 6).map((x) => fmt(x, 3)).join(", ")} …`
           : "");
  card.appendChild(stats);
  const isAttention = s.dims[1] === "query_pos";
  const cols = rows[0].length;
  const cell = Math.max(2, Math.min(isAttention ? 28 : 14, Math.floor(880 / cols)));
  const canvas = document.createElement("canvas");
  canvas.className = "strip";
  canvas.width = cols * cell + 70;
  canvas.height = rows.length * Math.max(cell, 12) + (isAttention && cell >= 9 ? 60 : 4);
  const ctx = canvas.getContext("2d");
  const rh = Math.max(cell, 12);
  ctx.font = "10px sans-serif";
  rows.forEach((row, r) => {
    if (rows.length > 1) {
      ctx.fillStyle = "#555";
      ctx.fillText(`head ${r}`, 0, r * rh + rh / 2 + 3);
    }
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
  canvas.title = isAttention       ? "rows: heads, columns: keys"
                 : rows.length > 1 ? "rows: heads, columns: d_head"
                                   : "one cell per dimension";
  canvas.addEventListener("mousemove", (e) => {
    const r = canvas.getBoundingClientRect();
    const c = Math.floor((e.clientX - r.left - 70) / cell),
          row = Math.floor((e.clientY - r.top) / rh);
    if (row >= 0 && row < rows.length && c >= 0 && c < cols) {
      canvas.title = (rows.length > 1 ? `head ${row}, ` : "") +
                     (isAttention ? `key ${c} “${show(state.tokens[c])}”` : `dim ${c}`) +
                     `: ${fmt(rows[row][c], 6)}`;
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

export function wireBlock() {
  $("stage-prev").addEventListener("click", () => stepStage(-1));
  $("stage-next").addEventListener("click", () => stepStage(1));
  document.addEventListener("keydown", (e) => {
    if (state.view !== "block" || e.target.tagName === "TEXTAREA" || e.target.tagName === "INPUT")
      return;
    if (e.key === "ArrowRight") stepStage(1);
    if (e.key === "ArrowLeft") stepStage(-1);
  });
}
