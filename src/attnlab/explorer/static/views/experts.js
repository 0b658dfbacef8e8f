// View 8, the experts: a mixture of experts' router on the text (POST /api/experts). Left, one
// layer as a heatmap, tokens × experts, coloured by the router's score (hook_expert_weights), with
// each token's chosen experts (hook_expert_indices) outlined and their weights written where the
// cells are big enough; right, every layer's load: how many tokens chose each expert. The header's
// layer menu, the ◀ ▶ buttons or a click on a layer's row switch the heatmap's layer.
//
// Design choices:
// - The heatmap is a <canvas> (512 tokens × 64 experts is 32,768 cells); the load table is SVG
//   (layers × experts, small), with the counts written in it.
// - A score's colour is its share of the layer's largest score, so a router spread over 64 experts
//   (scores near 1/64) is as legible as one over 8.
// - A dense model has no router: the view says so in one line and asks the server nothing.

import {$, api, blues, body, clear, fmt, page, show, state, svg} from "../core.js";

const CHOSEN = "#e4572e";
const expertsState = {
  data : null,
  // what the heatmap drew, for tests: {layer, scores, chosen, weights, marked: [token, expert,
  // weight] of each outlined cell, geometry: the cells' size and the margins, in canvas pixels}
  shown : null,
  geometry : null
};

export const expertsShown = () => expertsState.shown;

export async function loadExperts() {
  const info = state.info;
  $("experts-panels").hidden = !info.n_experts;
  if (!info.n_experts) {
    expertsState.data = expertsState.shown = null;
    $("experts-note").textContent =
        `model '${state.model}' has no experts (a dense MLP in every block), so no router to ` +
        "show; pick a mixture-of-experts model (Mixtral, Qwen2-MoE, Qwen3-MoE)";
    return;
  }
  expertsState.data = await api("/api/experts", body({layer : state.layer}));
  drawHeatmap();
  drawLoad();
}

function drawHeatmap() {
  const d = expertsState.data, T = d.tokens.length, E = d.n_experts, canvas = $("experts-canvas");
  const cw = Math.max(6, Math.min(48, Math.floor(640 / E)));
  const ch = Math.max(2, Math.min(20, Math.floor(720 / T)));
  const left = ch >= 9 ? 96 : 44, top = 26;
  canvas.width = left + E * cw + 4;
  canvas.height = top + T * ch + 4;
  expertsState.geometry = {cw, ch, left, top};
  const ctx = canvas.getContext("2d");
  ctx.fillStyle = "#ffffff";
  ctx.fillRect(0, 0, canvas.width, canvas.height);
  let max = 0;
  for (const row of d.scores)
    for (const s of row) max = Math.max(max, s);
  ctx.font = "10px ui-monospace, monospace";
  ctx.textAlign = "center";
  ctx.fillStyle = "#555";
  for (let e = 0; e < E; e++)
    if (cw >= 14 || e % Math.ceil(14 / cw) === 0) ctx.fillText(`E${e}`, left + (e + 0.5) * cw, 16);
  const gap = (n) => (n > 4 ? 1 : 0);
  for (let t = 0; t < T; t++) {
    for (let e = 0; e < E; e++) {
      ctx.fillStyle = blues(max > 0 ? d.scores[t][e] / max : 0);
      ctx.fillRect(left + e * cw, top + t * ch, cw - gap(cw), ch - gap(ch));
    }
    if (ch >= 9) {
      ctx.fillStyle = "#333";
      ctx.textAlign = "right";
      ctx.fillText(`${t} ${show(d.tokens[t]).slice(0, 8)}`, left - 6, top + t * ch + ch - 3);
    }
  }
  if (ch < 9) {
    ctx.fillStyle = "#555";
    ctx.textAlign = "right";
    ctx.fillText("0", left - 6, top + 8);
    ctx.fillText(String(T - 1), left - 6, top + T * ch);
  }
  const marked = [];
  ctx.strokeStyle = CHOSEN;
  ctx.lineWidth = ch >= 6 && cw >= 6 ? 2 : 1;
  ctx.textAlign = "center";
  for (let t = 0; t < T; t++)
    d.chosen[t].forEach((e, j) => {
      const x = left + e * cw, y = top + t * ch, w = d.weights[t][j];
      ctx.strokeRect(x + 1, y + 1, Math.max(1, cw - 2 - gap(cw)), Math.max(1, ch - 2 - gap(ch)));
      if (cw >= 30 && ch >= 12) {
        ctx.fillStyle = d.scores[t][e] / max > 0.55 ? "#ffffff" : "#222";
        ctx.fillText(w.toFixed(2), x + cw / 2, y + ch - 4);
      }
      marked.push([ t, e, w ]);
    });
  expertsState.shown = {
    layer : d.layer,
    scores : d.scores,
    chosen : d.chosen,
    weights : d.weights,
    marked,
    geometry : expertsState.geometry
  };
  $("experts-caption").textContent =
      `layer ${d.layer}: the router's score of every expert for each token (${d.hooks.scores}; ` +
      `white 0 → blue ${fmt(max, 3)}, the layer's largest); outlined: the ${
          d.experts_per_token} chosen (${d.hooks.chosen}) with their weight`;
  $("experts-note").textContent =
      `${T} tokens · ${E} experts, ${d.experts_per_token} chosen per token · weights ` +
      (d.norm_topk_prob ? "renormalised to sum to 1 over the chosen"
                        : "the router's scores as they are (not renormalised)") +
      (d.shared_expert ? " · plus a shared expert every token goes through, gated on its own" : "");
}

function drawLoad() {
  const d = expertsState.data, el = $("experts-load"), counts = d.load.counts;
  const L = d.n_layers, E = d.n_experts, T = d.tokens.length;
  const w = Math.max(10, Math.min(40, Math.floor(520 / E)));
  const h = Math.max(10, Math.min(24, Math.floor(420 / L)));
  const left = 34, top = 22;
  clear(el);
  el.setAttribute("width", left + E * w + 8);
  el.setAttribute("height", top + L * h + 8);
  for (let e = 0; e < E; e++)
    if (w >= 18 || e % Math.ceil(18 / w) === 0) {
      const t = svg("text", {x : left + (e + 0.5) * w, y : 14, class : "load-axis"}, el);
      t.textContent = `E${e}`;
    }
  for (let l = 0; l < L; l++) {
    const row =
        svg("g", {class : "load-row" + (l === d.layer ? " current" : ""), "data-layer" : l}, el);
    row.addEventListener("click", () => setLayer(l));
    const label = svg("text", {x : left - 6, y : top + l * h + h * 0.7, class : "load-label"}, row);
    label.textContent = `L${l}`;
    for (let e = 0; e < E; e++) {
      const n = counts[l][e];
      const cell = svg("rect", {
        x : left + e * w,
        y : top + l * h,
        width : w - 1,
        height : h - 1,
        fill : blues(n / T),
        class : "load-cell",
        "data-expert" : e,
        "data-count" : n
      },
                       row);
      svg("title", {}, cell).textContent = `layer ${l}, expert ${e}: chosen by ${n} of ${
          T} tokens · mean score ${fmt(d.load.mean_scores[l][e], 3)}`;
      if (w >= 22 && h >= 14) {
        const t = svg("text", {
          x : left + (e + 0.5) * w,
          y : top + l * h + h * 0.7,
          class : "load-count" + (n / T > 0.55 ? " light" : "")
        },
                      row);
        t.textContent = String(n);
      }
    }
    if (l === d.layer)
      svg("rect", {
        x : left - 1,
        y : top + l * h - 1,
        width : E * w + 1,
        height : h + 1,
        class : "load-current"
      },
          el);
  }
  const fair = (T * d.experts_per_token) / E;
  $("experts-load-caption").textContent =
      `load: tokens routed to each expert, per layer (white 0 → blue all ${T}); balanced would be ${
          fmt(fair, 3)} each · click a layer to show it`;
}

function hover(event) {
  const d = expertsState.data, g = expertsState.geometry, tip = $("experts-tip");
  if (!d || !g) return;
  const canvas = $("experts-canvas"), r = canvas.getBoundingClientRect();
  const x = (event.clientX - r.left) * (canvas.width / r.width),
        y = (event.clientY - r.top) * (canvas.height / r.height);
  const e = Math.floor((x - g.left) / g.cw), t = Math.floor((y - g.top) / g.ch);
  if (e < 0 || e >= d.n_experts || t < 0 || t >= d.tokens.length) {
    tip.style.display = "none";
    return;
  }
  const j = d.chosen[t].indexOf(e);
  tip.textContent =
      `token ${t} “${show(d.tokens[t])}” · expert ${e}: score ${fmt(d.scores[t][e])} · ${
          j >= 0 ? `chosen (${j + 1} of ${d.experts_per_token}), weight ${fmt(d.weights[t][j])}`
                 : "not chosen"}`;
  tip.style.display = "block";
  tip.style.left = (event.clientX - r.left + 14) + "px";
  tip.style.top = (event.clientY - r.top + 10) + "px";
}

function setLayer(l) {
  if (!state.info || l < 0 || l >= state.info.n_layers) return;
  state.layer = l;
  $("layer").value = String(l);
  page.refresh();
}

export function wireExperts() {
  $("experts-canvas").addEventListener("mousemove", hover);
  $("experts-canvas")
      .addEventListener("mouseleave", () => { $("experts-tip").style.display = "none"; });
  $("experts-prev").addEventListener("click", () => setLayer(state.layer - 1));
  $("experts-next").addEventListener("click", () => setLayer(state.layer + 1));
}
