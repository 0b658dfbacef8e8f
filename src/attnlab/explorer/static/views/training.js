// The training bar: a step slider over a run's snapshots, and the loss curve with the step marked;
// every view shows the model at that step (state.step rides in every request).

import {$, api, clear, page, setStatus, state, svg} from "../core.js";
import {drawGrid} from "./heads.js";

export async function loadTraining() {
  const steps = state.info.steps || [];
  $("training").hidden = steps.length === 0;
  if (!steps.length) {
    state.training = null;
    state.step = null;
    return;
  }
  if (!state.training || state.training.model !== state.model) {
    // the slider at once; the loss curve and the heads' score curves when the server has computed
    // them
    const model = state.model;
    state.training = {
      model,
      steps,
      start_step : state.info.start_step,
      metrics : [],
      available : false,
      scores : {},
      score_steps : []
    };
    fetchTraining();
    const start = state.info.start_step !== null && steps.includes(state.info.start_step)
                      ? state.info.start_step
                      : steps[steps.length - 1];
    const slider = $("step");
    slider.max = steps.length - 1;
    slider.value = steps.indexOf(start);
    state.step = start;
  }
  drawTraining();
}

export function fetchTraining() {
  // the loss curve and every head's score curve; a Hub model's revisions are fetched as the slider
  // reaches them, so its curves cover the steps shown so far and are asked for again after each new
  // step (`lazy`)
  const model = state.model;
  return api(`/api/models/${encodeURIComponent(model)}/training`)
      .then((tr) => {
        if (!state.training || state.training.model !== model) return;
        if (state.training.lazy && tr.score_steps.length < state.training.score_steps.length)
          return; // an older answer
        Object.assign(state.training, tr);
        drawTraining();
        if (state.view === "heads" && state.heads.grid) drawGrid();
      })
      .catch((err) => setStatus(err.message, true));
}

export function drawTraining() {
  const tr = state.training, el = $("loss-curve");
  $("step-out").textContent =
      `${state.step} (${tr.steps.indexOf(state.step) + 1} of ${tr.steps.length})`;
  clear(el);
  const W = +el.getAttribute("width"), H = +el.getAttribute("height"), left = 34, bottom = 14;
  const metrics = tr.metrics.filter((r) => r.val_loss !== null && r.val_loss !== undefined);
  const lastStep = tr.steps[tr.steps.length - 1] || 1;
  const x = (step) => left + (W - left - 6) * step / lastStep;
  if (metrics.length) {
    const values = metrics.map((r) => r.val_loss), lo = Math.min(...values),
          hi = Math.max(...values);
    const y = (v) => 4 + (H - bottom - 8) * (hi === lo ? 0.5 : (hi - v) / (hi - lo));
    svg("path", {
      class : "curve-loss",
      d : metrics
              .map((r, i) => `${i ? "L" : "M"}${x(r.iter).toFixed(1)},${y(r.val_loss).toFixed(1)}`)
              .join(" ")
    },
        el);
    const t = (text, tx, ty, anchor) => {
      const e = svg("text", {x : tx, y : ty, class : "strip-axis", "text-anchor" : anchor}, el);
      e.textContent = text;
    };
    t(hi.toFixed(2), left - 3, 10, "end");
    t(lo.toFixed(2), left - 3, H - bottom, "end");
    // the title under the plot, where the step marker (down to H − bottom + 2) never crosses it
    t("val loss", (left + W - 6) / 2, H - 2, "middle");
    t(`step ${lastStep}`, W - 6, H - 2, "end");
    t("0", left, H - 2, "start");
  }
  svg("line", {
    x1 : x(state.step),
    x2 : x(state.step),
    y1 : 0,
    y2 : H - bottom + 2,
    class : "curve-marker",
    id : "step-marker"
  },
      el);
  $("training-note").textContent =
      `every view shows the model at step ${state.step}` +
      (tr.revisions ? ` (Hub revision ${tr.revisions[state.step]}, fetched when first shown)`
                    : "") +
      (tr.start_step !== null && tr.start_step !== undefined
           ? ` · the phase change is at step ${tr.start_step}`
           : "");
}

export function wireTraining() {
  $("step").addEventListener("input", () => {
    if (!state.training) return;
    state.step = state.training.steps[Number($("step").value)];
    drawTraining();
  });
  $("step").addEventListener("change", () => {
    if (state.training) {
      state.step = state.training.steps[Number($("step").value)];
      page.refresh();
    }
  });
}
