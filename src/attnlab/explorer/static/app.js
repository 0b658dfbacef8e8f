// attnlab explorer: eight views of attention on a real model, drawn with SVG and Canvas. This file
// is the page: it wires the header (model, text, layer, head, tabs), runs the text and refreshes
// the view shown.
//
// Design choices:
// - Plain JavaScript modules, no framework and no build step: the files ship in the Python package
// and run
//   offline. core.js holds the state, the API client and the drawing helpers; each view is one
//   module under views/ that imports only core.js (training.js also heads.js, whose grid it
//   redraws): it loads alone.
// - An exported HTML file (attnlab export-html) or a notebook cannot import sibling files: the
// exporter
//   inlines these same modules, in dependency order, as one module script
//   (explorer/page_modules.py).
// - Large matrices (a 512-token heatmap) go to a <canvas>; small, interactive figures to SVG.

import {$, EXPORT, api, body, fillSelect, page, setStatus, state} from "./core.js";
import {pictureSvg, wireSave} from "./save.js";
import {atlasCells, loadAtlas, wireAtlas} from "./views/atlas.js";
import {loadBlock, wireBlock} from "./views/block.js";
import {loadDict, wireDict} from "./views/dict.js";
import {expertsShown, loadExperts, wireExperts} from "./views/experts.js";
import {generationState, loadGenerate, wireGenerate} from "./views/generate.js";
import {loadHeads, wireHeads} from "./views/heads.js";
import {loadKnockout, wireKnockout} from "./views/knockout.js";
import {loadMatrix, wireMatrix} from "./views/matrix.js";
import {loadNext, wireNext} from "./views/next.js";
import {fetchTraining, loadTraining, wireTraining} from "./views/training.js";

const LOADERS = {
  dict : loadDict,
  matrix : loadMatrix,
  heads : loadHeads,
  block : loadBlock,
  next : loadNext,
  generate : loadGenerate,
  atlas : loadAtlas,
  experts : loadExperts
};

let refreshing = null, refreshAgain = false;

function refresh() {
  // one refresh at a time: a click while one runs asks for one more after it (with the state as it
  // is then), so answers never land out of order (a slow answer for three knocked-out heads drawn
  // after the one for four) and the page is marked loading until the last has drawn
  if (!state.info) return Promise.resolve();
  if (refreshing) {
    refreshAgain = true;
    return refreshing;
  }
  document.body.dataset.loading = "1";
  refreshing = (async () => {
    try {
      do {
        refreshAgain = false;
        await refreshOnce();
      } while (refreshAgain);
    } finally {
      refreshing = null;
      delete document.body.dataset.loading;
      document.body.dataset.ready = state.view;
    }
  })();
  return refreshing;
}

async function refreshOnce() {
  document.querySelectorAll("#tabs button[data-view]")
      .forEach((b) => b.classList.toggle("active", b.dataset.view === state.view));
  document.querySelectorAll(".view").forEach(
      (v) => v.classList.toggle("active", v.id === "view-" + state.view));
  $("picker").style.visibility =
      state.view === "next" || state.view === "atlas" ? "hidden" : "visible";
  document.querySelector(".head-pick").style.visibility =
      [ "block", "next", "atlas", "experts" ].includes(state.view) ? "hidden" : "visible";
  try {
    await loadTraining();
    await Promise.all([ LOADERS[state.view](), loadKnockout() ]);
    const tr = state.training;
    if (tr && tr.lazy && !tr.score_steps.includes(state.step))
      fetchTraining(); // this step's scores join the curves
    setStatus(
        `${state.tokens.length} tokens · ${state.model}` +
        (state.step !== null ? ` · step ${state.step}` : "") +
        (state.ablate.length
             ? ` · ${state.ablate.length} head${state.ablate.length > 1 ? "s" : ""} knocked out`
             : ""));
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
    state.layer = Number($("layer").value);
    state.head = Number($("head").value);
  } catch (err) {
    setStatus(err.message, true);
    delete document.body.dataset.loading;
    return;
  }
  await refresh();
}

function wire() {
  $("run").addEventListener("click", () => {
    state.next.appended = "";
    runText();
  });
  $("text").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) {
      e.preventDefault();
      $("run").click();
    }
  });
  $("model").addEventListener("change", () => {
    state.model = $("model").value;
    state.matrix.mask = null;
    state.ablate = [];
    state.step = null;
    state.training = null;
    runText();
  });
  $("layer").addEventListener("change", () => {
    state.layer = Number($("layer").value);
    refresh();
  });
  $("head").addEventListener("change", () => {
    state.head = Number($("head").value);
    refresh();
  });
  document.querySelectorAll("#tabs button[data-view]")
      .forEach((b) => b.addEventListener("click", () => {
        state.view = b.dataset.view;
        refresh();
      }));
  for (const wireView of [wireDict, wireMatrix, wireHeads, wireBlock, wireNext, wireKnockout,
                          wireTraining, wireSave, wireGenerate, wireAtlas, wireExperts])
    wireView();
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
    o.textContent =
        `${m.name} (${m.causal ? "decoder" : "encoder"}, ${m.n_layers}×${m.n_heads} heads)`;
    select.appendChild(o);
  }
  state.model = state.models[0].name;
  if (!EXPORT && state.models[0].example)
    $("text").value = state.models[0].example; // e.g. the induction experiment's repeated spans
  if (EXPORT) {
    $("text").value = EXPORT.text;
    $("text").readOnly = true;
    $("run").disabled = true;
    $("run").title = "an exported page shows its own text only";
    state.view = EXPORT.view || "dict";
    if (EXPORT.ablate && EXPORT.ablate.length) {
      state.ablate = EXPORT.ablate;
      state.ablation = EXPORT.ablation || "zero";
    }
  }
  await runText();
}

page.refresh = refresh;
page.runText = runText;

// A small handle for tests and the curious: the current state and the numbers each view shows.
window.attnlab = {
  state,
  matrixValues : () => state.matrix.shown,
  dictWeights : () => state.dict.weights,
  refresh,
  pictureSvg,
  generationState,
  atlasCells,
  expertsShown
};
document.addEventListener("DOMContentLoaded", start);
