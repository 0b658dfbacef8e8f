// The knockout bar: which heads are off, and per token what changed (the loss on each next token
// for a decoder, the last hidden state's cosine for an encoder), against the same request without
// `ablate`.

import {$, api, body, clear, headName, page, show, state, svg} from "../core.js";

export async function loadKnockout() {
  const bar = $("knockout");
  bar.hidden = state.ablate.length === 0;
  if (!state.ablate.length) {
    state.knock = null;
    return;
  }
  $("knockout-list").textContent = state.ablate.map(headName).join(", ");
  document.querySelectorAll("#ablation-mode button")
      .forEach((b) => b.classList.toggle("active", b.dataset.ablation === state.ablation));
  state.knock = await api("/api/knockout", body());
  drawKnockout();
}

export function drawKnockout() {
  const k = state.knock, el = $("knockout-strip"), tokens = k.tokens, T = tokens.length;
  clear(el);
  const W = Math.min(1240, Math.max(600, document.body.clientWidth - 60)), labels = T <= 90;
  const H = labels ? 160 : 130, left = 46, right = 12, top = 24,
        bottom = labels ? 48 : 22; // the caption sits above the plot
  el.setAttribute("width", W);
  el.setAttribute("height", H);
  // decoders: a curve through the positions; encoders: one bar per token, each in its own band
  const band = (W - left - right) / T;
  const x = k.loss_before ? (i) => left + (W - left - right) * (T <= 1 ? 0.5 : i / (T - 1))
                          : (i) => left + band * (i + 0.5);
  const axis = (text, ax, ay, anchor) => {
    const t =
        svg("text", {x : ax, y : ay, class : "strip-axis", "text-anchor" : anchor || "start"}, el);
    t.textContent = text;
  };
  const mean = (a, from, to) => {
    const part = a.slice(from, to);
    return part.reduce((s, v) => s + v, 0) / Math.max(1, part.length);
  };
  let note;
  if (k.loss_before) {
    // position i predicts token i + 1: the loss is drawn under the token it predicts
    const before = k.loss_before, after = k.loss_after, n = before.length;
    const max = Math.max(...before, ...after, 1e-6);
    const y = (v) => top + (H - top - bottom) * (1 - v / max);
    svg("line", {x1 : left, x2 : W - right, y1 : y(0), y2 : y(0), class : "axis"}, el);
    for (const [values, cls] of [[ before, "curve-before" ], [ after, "curve-after" ]]) {
      svg("path", {
        class : cls,
        d : values.map((v, i) => `${i ? "L" : "M"}${x(i + 1).toFixed(1)},${y(v).toFixed(1)}`)
                .join(" ")
      },
          el);
    }
    axis(max.toFixed(1), left - 6, top + 8, "end");
    axis("0", left - 6, y(0), "end");
    axis("loss on each next token: grey before, red after", left + 4, 12);
    const half = Math.floor(n / 2);
    note = `mean loss, first half of the text: ${mean(before, 0, half).toFixed(2)} → ${
               mean(after, 0, half).toFixed(2)}; ` +
           `second half: ${mean(before, half, n).toFixed(2)} → ${
               mean(after, half, n).toFixed(2)} (nats per token)`;
  } else {
    // an encoder: how far each token's last hidden state turned, 1 − cosine, with the cosine
    // written on it
    const change = k.cosine.map((c) => 1 - c);
    const max = Math.max(
        ...change,
        0.2); // a fixed floor to the scale: a change of 0.005 stays a sliver, not a full bar
    const bw = Math.max(1, Math.min(band - 4, 80));
    change.forEach((v, i) => {
      const h = (H - top - bottom) * v / max;
      const r = svg("rect", {
        x : x(i) - bw / 2,
        y : H - bottom - h,
        width : bw,
        height : h,
        "data-index" : i,
        class : "strip-bar" + (i === state.heads.selected ? " selected" : "")
      },
                    el);
      svg("title", {}, r).textContent = `“${show(tokens[i])}”: cosine ${k.cosine[i].toFixed(4)}`;
      if (labels && T <= 40) axis(k.cosine[i].toFixed(3), x(i), H - bottom - h - 3, "middle");
    });
    axis(`bar: 1 − cosine(last hidden state after, before), full height ${
             max.toFixed(3)}; number: the cosine`,
         left + 4, 12);
    const order = k.cosine.map((c, i) => [c, i]).sort((a, b) => a[0] - b[0]).slice(0, 3);
    note = "cosine of the last hidden state, after vs before: " +
           order.map(([ c, i ]) => `“${show(tokens[i])}” ${c.toFixed(3)}`).join(", ") +
           (state.heads.selected !== null && state.heads.selected < T
                ? ` · “${show(tokens[state.heads.selected])}” ${
                      k.cosine[state.heads.selected].toFixed(3)}`
                : "");
  }
  if (labels)
    tokens.forEach((t, i) => {
      const label = svg("text", {
        x : x(i),
        y : H - bottom + 14 + (T > 45 && i % 2 ? 12 : 0),
        class : "strip-label",
        "text-anchor" : "middle"
      },
                        el);
      label.textContent = show(t).slice(0, T > 45 ? 3 : 8);
    });
  else
    axis(`position 0 … ${T - 1}`, left, H - 6);
  $("knockout-note").textContent = note;
}

export function wireKnockout() {
  document.querySelectorAll("#ablation-mode button")
      .forEach((b) => b.addEventListener("click", () => {
        state.ablation = b.dataset.ablation;
        page.refresh();
      }));
  $("knockout-clear").addEventListener("click", () => {
    state.ablate = [];
    page.refresh();
  });
}
