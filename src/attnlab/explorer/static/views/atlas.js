// View 7, the atlas: every head of the model as one grid (layers × heads), each coloured by what it
// does, measured on the standard probes (random tokens repeated: exactly `attnlab heads`) or on the
// current text. Hover for every score; click to open that head's matrix or its arcs.
//
// Design choices:
// - A head's colour is its role: the score that stands out most relative to its threshold (the
// scores and
//   thresholds are attnlab.inspection.scores', sent by POST /api/atlas), white → full colour as the
//   score goes from 0 to the threshold; at or above it, full colour and the score written in the
//   cell.
// - Copying (a property of the weights, not of where a head looks) is on hover only.

import {$, api, body, clear, fmt, page, state} from "../core.js";

const LABELS = {
  previous_token : "previous token",
  induction : "induction",
  duplicate_token : "duplicate token",
  first_token : "first-token sink",
  local_window : "local window",
  copying : "copying",
};
const SHORT = {
  previous_token : "prev",
  induction : "ind",
  duplicate_token : "dup",
  first_token : "sink",
  local_window : "local"
};
const COLOURS = {
  previous_token : [ 228, 87, 46 ],
  induction : [ 123, 44, 191 ],
  duplicate_token : [ 42, 157, 143 ],
  first_token : [ 69, 123, 157 ],
  local_window : [ 214, 150, 0 ],
};
const atlasState = {
  data : null,
  source : "probes",
  open : "matrix"
};

export async function loadAtlas() {
  atlasState.data = await api("/api/atlas", body());
  drawAtlas();
}

export function atlasRole(scores, thresholds, roles, l, h) {
  // the role of head (l, h): its score that stands out most relative to its threshold (null: no
  // score)
  let best = null;
  for (const name of roles) {
    const v = scores[name] ? scores[name][l][h] : null;
    if (v === null || v === undefined) continue;
    const ratio = v / thresholds[name];
    if (!best || ratio > best.ratio) best = {name, value : v, ratio};
  }
  return best;
}

export function atlasCells() {
  // for tests: each cell's layer, head, role and score as drawn
  return Array.from(document.querySelectorAll("#atlas-grid .atlas-cell"))
      .map((c) => ({
             layer : Number(c.dataset.layer),
             head : Number(c.dataset.head),
             role : c.dataset.role || null,
             score : c.dataset.score === undefined ? null : Number(c.dataset.score),
           }));
}

function colour(role) {
  if (!role) return "rgb(242,244,247)";
  const t = Math.max(0, Math.min(1, role.ratio)), [ r, g, b ] = COLOURS[role.name];
  const mix = (c) => Math.round(255 + (c - 255) * (0.12 + 0.88 * t));
  return `rgb(${mix(r)},${mix(g)},${mix(b)})`;
}

function drawAtlas() {
  const d = atlasState.data, source = d[atlasState.source], grid = $("atlas-grid");
  clear(grid);
  const table = document.createElement("table");
  table.className = "atlas";
  const header = document.createElement("tr");
  header.appendChild(document.createElement("th"));
  for (let h = 0; h < d.n_heads; h++) {
    const th = document.createElement("th");
    th.textContent = `H${h}`;
    header.appendChild(th);
  }
  table.appendChild(header);
  const counts = Object.fromEntries(d.roles.map((r) => [r, 0]));
  for (let l = 0; l < d.n_layers; l++) {
    const tr = document.createElement("tr");
    const th = document.createElement("th");
    th.textContent = `L${l}`;
    tr.appendChild(th);
    for (let h = 0; h < d.n_heads; h++) {
      const td = document.createElement("td");
      const cell = document.createElement("div");
      const role = atlasRole(source.scores, d.thresholds, d.roles, l, h);
      cell.className = "atlas-cell" + (role && role.ratio >= 1 ? " standout" : "") +
                       (l === state.layer && h === state.head ? " current" : "");
      cell.dataset.layer = l;
      cell.dataset.head = h;
      if (role) {
        cell.dataset.role = role.name;
        cell.dataset.score = role.value;
      }
      cell.style.background = colour(role);
      if (role && role.ratio >= 1) {
        cell.textContent = `${SHORT[role.name]} ${role.value.toFixed(2)}`;
        counts[role.name] += 1;
      }
      cell.addEventListener("mouseenter", (e) => hover(e, l, h));
      cell.addEventListener("mouseleave", () => { $("atlas-tip").style.display = "none"; });
      cell.addEventListener("click", () => openHead(l, h));
      td.appendChild(cell);
      tr.appendChild(td);
    }
    table.appendChild(tr);
  }
  grid.appendChild(table);
  drawLegend(counts);
  document.querySelectorAll("#atlas-source button")
      .forEach((b) => b.classList.toggle("active", b.dataset.source === atlasState.source));
  document.querySelectorAll("#atlas-click button")
      .forEach((b) => b.classList.toggle("active", b.dataset.open === atlasState.open));
  const n = d.n_layers * d.n_heads;
  $("atlas-note").textContent =
      `${n} heads (${d.n_layers} layers × ${d.n_heads}) · ` +
      (atlasState.source === "probes"
           ? `on the standard probes: ${source.notes.input} (the numbers of \`attnlab heads\`)`
           : `on this text: ${d.tokens.length} tokens` +
                 (d.ablated.length ? " with the knocked-out heads off (the probes never knock out)"
                                   : "")) +
      " · colour: the score that stands out most against its threshold; full colour and the score" +
      " written at or above it · hover for every score, click to open the head";
  $("atlas-cost").textContent =
      `this text scored in ${d.cost.text_ms.toFixed(0)} ms · probes ` +
      (d.cost.probes_cached ? "already computed" : `in ${d.cost.probes_ms.toFixed(0)} ms`);
}

function drawLegend(counts) {
  const el = $("atlas-legend");
  clear(el);
  for (const name of atlasState.data.roles) {
    const item = document.createElement("span");
    item.className = "atlas-key";
    const swatch = document.createElement("span");
    swatch.className = "swatch";
    swatch.style.background = `rgb(${COLOURS[name].join(",")})`;
    item.appendChild(swatch);
    item.appendChild(document.createTextNode(
        `${LABELS[name]} ≥ ${atlasState.data.thresholds[name]}: ${counts[name]}`));
    el.appendChild(item);
  }
}

function hover(event, l, h) {
  const d = atlasState.data, tip = $("atlas-tip"), wrap = tip.parentElement.getBoundingClientRect();
  const line = (source) => Object.keys(LABELS)
                               .filter((k) => d[source].scores[k])
                               .map((k) => {
                                 const v = d[source].scores[k][l][h];
                                 return `${SHORT[k] || k} ${v === null ? "n/a" : fmt(v, 3)}${
                                     v !== null && v >= d.thresholds[k] ? "*" : ""}`;
                               })
                               .join("  ");
  tip.textContent = `L${l}H${h} · probes: ${line("probes")} · this text: ${line("text")}`;
  tip.style.display = "block";
  const r = event.target.getBoundingClientRect();
  tip.style.left = (r.right - wrap.left + 12) + "px";
  tip.style.top = (r.top - wrap.top) + "px";
}

function openHead(l, h) {
  state.layer = l;
  state.head = h;
  $("layer").value = l;
  $("head").value = h;
  state.view = atlasState.open;
  page.refresh();
}

export function wireAtlas() {
  document.querySelectorAll("#atlas-source button")
      .forEach((b) => b.addEventListener("click", () => {
        atlasState.source = b.dataset.source;
        if (atlasState.data) drawAtlas();
      }));
  document.querySelectorAll("#atlas-click button")
      .forEach((b) => b.addEventListener("click", () => {
        atlasState.open = b.dataset.open;
        if (atlasState.data) drawAtlas();
      }));
}
