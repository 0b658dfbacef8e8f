// View 5, next token: the distribution under temperature, top-k and top-p, sampling that appends to
// the text, who wrote the top prediction (direct logit attribution), and with heads knocked out,
// the distribution before and after.

import {
  $,
  api,
  barRow,
  body,
  clear,
  diverging,
  fmt,
  guarded,
  headName,
  page,
  plainBody,
  show,
  state,
  svg
} from "../core.js";

function nextRequest(extra) {
  const n = state.next;
  return body(Object.assign({
    temperature : n.temperature,
    top_k : n.topK > 0 ? n.topK : null,
    top_p : n.topP < 1 ? n.topP : null,
    k : 10
  },
                            extra || {}));
}

export async function loadNext() {
  const n = state.next;
  $("next-temp-out").textContent = n.temperature.toFixed(2);
  $("next-topp-out").textContent = n.topP.toFixed(2);
  const bars = $("next-bars");
  if (!state.info.causal) {
    clear(bars);
    $("next-note").textContent =
        `${state.model} is an encoder (bidirectional, no LM head): it does not predict a next ` +
        "token. Pick a causal model.";
    $("next-text").textContent = "";
    return;
  }
  n.data = await api("/api/next", nextRequest());
  // with heads knocked out, the same request without them: the two distributions side by side
  n.before = state.ablate.length ? await api("/api/next", plainBody(nextRequest({k : 50}))) : null;
  n.afterWide = state.ablate.length ? await api("/api/next", nextRequest({k : 50})) : null;
  drawNext();
  await loadAttribution();
}

async function loadAttribution() {
  // who wrote the most likely next token: each head's and MLP's direct contribution to its logit
  const n = state.next, top = n.data.candidates[0], el = $("dla");
  clear(el);
  try {
    n.dla = await api("/api/attribution", body({token : top.id}));
  } catch (err) {
    n.dla = null;
    $("dla-title").textContent = "who wrote this prediction: " + err.message;
    return;
  }
  const d = n.dla, L = d.heads.length, H = d.heads[0].length,
        cell = Math.max(14, Math.min(36, Math.floor(300 / H)));
  const left = 50, top0 = 18, rows = L, hasMlp = d.mlps !== null;
  const values = d.heads.flat().concat(hasMlp ? d.mlps : []),
        maxAbs = Math.max(...values.map(Math.abs), 1e-9);
  el.setAttribute("width", left + cell * (H + (hasMlp ? 1.5 : 0)) + 10);
  el.setAttribute("height", top0 + cell * rows + 8);
  for (let h = 0; h < H; h++) {
    const t = svg("text", {x : left + (h + 0.5) * cell, y : 12, "text-anchor" : "middle"}, el);
    t.textContent = `H${h}`;
  }
  if (hasMlp) {
    const t = svg("text", {x : left + (H + 1) * cell, y : 12, "text-anchor" : "middle"}, el);
    t.textContent = "MLP";
  }
  for (let l = 0; l < L; l++) {
    const t = svg("text", {x : left - 6, y : top0 + (l + 0.6) * cell, "text-anchor" : "end"}, el);
    t.textContent = `L${l}`;
    const cellAt = (x, v, what) => {
      const r = svg("rect", {
        x,
        y : top0 + l * cell,
        width : cell - 2,
        height : cell - 2,
        fill : diverging(v, maxAbs),
        "data-value" : v.toFixed(4)
      },
                    el);
      svg("title", {}, r).textContent =
          `${what}: ${v >= 0 ? "+" : ""}${v.toFixed(3)} to the logit of “${show(d.answer)}”`;
    };
    for (let h = 0; h < H; h++) cellAt(left + h * cell, d.heads[l][h], `L${l}H${h}`);
    if (hasMlp) cellAt(left + (H + 0.5) * cell, d.mlps[l], `L${l} MLP`);
  }
  const best = d.heads.flatMap((row, l) => row.map((v, h) => [v, `L${l}H${h}`]))
                   .concat(hasMlp ? d.mlps.map((v, l) => [v, `L${l} MLP`]) : [])
                   .sort((a, b) => b[0] - a[0])
                   .slice(0, 3);
  $("dla-title").textContent =
      `who wrote “${show(d.answer)}” (logit ${
          d.logit.toFixed(2)}): direct contributions, blue adds, red subtracts; ` +
      `most: ${
          best.map(([ v, name ]) => `${name} ${v >= 0 ? "+" : ""}${v.toFixed(2)}`).join(", ")}`;
}

function probOf(list, id) {
  const c = list.candidates.find((x) => x.id === id);
  return c ? c.prob : null;
}

export function drawNext() {
  const n = state.next, data = n.data;
  $("next-note").textContent =
      `temperature ${n.temperature.toFixed(2)}` + (n.topK ? ` · top-k ${n.topK}` : "") +
      (n.topP < 1 ? ` · top-p ${n.topP.toFixed(2)}` : "") +
      ` · ${data.kept} token${
          data.kept === 1 ? "" : "s"} can be drawn · click a bar to append that token`;
  const textEl = $("next-text");
  clear(textEl);
  const base = n.appended && state.text.endsWith(n.appended)
                   ? state.text.slice(0, state.text.length - n.appended.length)
                   : state.text;
  textEl.appendChild(document.createTextNode(base));
  if (n.appended && base !== state.text) {
    const span = document.createElement("mark");
    span.textContent = n.appended;
    textEl.appendChild(span);
  }
  const bars = $("next-bars");
  clear(bars);
  const compare = n.before !== null && n.before !== undefined;
  $("next-bars-title").textContent =
      compare ? `after knocking out ${state.ablate.map(headName).join(", ")} (${
                    state.ablation}) · change from before`
              : "";
  $("next-before-wrap").hidden = !compare;
  const delta = (row, now, then) => {
    const d = document.createElement("span");
    d.className = "delta";
    if (then === null)
      d.textContent = "new";
    else {
      const pp = 100 * (now - then);
      d.textContent = (pp >= 0 ? "+" : "−") + Math.abs(pp).toFixed(2) + " pp";
      d.classList.add(pp >= 0 ? "up" : "down");
    }
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
      d.textContent =
          after === null
              ? "→ <" +
                    (100 * n.afterWide.candidates[n.afterWide.candidates.length - 1].prob)
                        .toFixed(2) +
                    "%"
              : "→ " + (100 * after).toFixed(2) + "%";
      row.appendChild(d);
      before.appendChild(row);
    });
  }
}

function appendText(newText) {
  // generation appends to the text: the added part is highlighted, and every view re-runs on the
  // new text
  const n = state.next;
  n.appended =
      newText.startsWith(state.text) ? (n.appended || "") + newText.slice(state.text.length) : "";
  $("text").value = newText;
  return page.runText();
}

async function sampleNext(greedy) {
  document.body.dataset.loading = "1"; // busy from the click on, until the views have re-run
  try {
    const data = await api(
        "/api/next", nextRequest(greedy ? {temperature : 0}
                                        : {sample : true, seed : Math.floor(Math.random() * 1e9)}));
    await appendText((greedy ? data.candidates[0] : data.chosen).text);
  } finally {
    delete document.body.dataset.loading;
  }
}

export function wireNext() {
  const nextControl = (id, apply) => $(id).addEventListener("change", (e) => {
    apply(Number(e.target.value));
    page.refresh();
  });
  nextControl("next-temp", (v) => { state.next.temperature = v; });
  nextControl("next-topk", (v) => { state.next.topK = Math.max(0, Math.floor(v)); });
  nextControl("next-topp", (v) => { state.next.topP = v; });
  $("next-temp")
      .addEventListener(
          "input", (e) => { $("next-temp-out").textContent = Number(e.target.value).toFixed(2); });
  $("next-topp")
      .addEventListener(
          "input", (e) => { $("next-topp-out").textContent = Number(e.target.value).toFixed(2); });
  $("next-sample").addEventListener("click", () => guarded(() => sampleNext(false)));
  $("next-greedy").addEventListener("click", () => guarded(() => sampleNext(true)));
}
