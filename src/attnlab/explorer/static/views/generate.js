// View 6, generation you can watch: a prompt (or a chat message through the model's template)
// written token by token as the server computes it, each new token with the attention rows of the
// step that wrote it, the KV cache growing beside it, and for any token clicked every head's row
// and its top candidates.
//
// Design choices:
// - The server streams one JSON line per token (POST /api/generate, application/x-ndjson), read
// here with
//   fetch and a stream reader: no websocket, no library. Stop aborts the request; the server sees
//   the connection close and stops generating within one token (so does closing the page).
// - Each token keeps its step's rows (every head's, [layer·head, key], decoded from float16 as the
// matrix
//   view's) and candidates, so clicking a token asks the server for nothing.
// - The chosen head (the header's layer and head) is drawn as a staircase: one row per new token
// over the
//   keys before it, the chapters' "each new token only attends to the tokens before it".
// - An exported page has no server to generate with: the view says so.

import {
  $,
  EXPORT,
  TOKEN,
  blues,
  clear,
  decodeMatrix,
  fmt,
  page,
  setStatus,
  show,
  state,
  barRow
} from "../core.js";

const gen = {
  start : null,
  steps : [],
  tail : "",
  end : null,
  controller : null,
  selected : null,
  received : 0,
  firstAt : null,
  lastAt : null,
  error : null,
  image : null,
  imageHead : null,
  frame : null, // the staircase, one pixel per (new token, key), of imageHead
};

export function generationState() {
  // for tests and the curious: what the stream brought, per token (rows as plain arrays)
  return {
    start : gen.start,
    end : gen.end,
    error : gen.error,
    steps : gen.steps.map((s) => ({
                            index : s.index,
                            id : s.id,
                            token : s.token,
                            piece : s.piece,
                            prob : s.prob,
                            kv_positions : s.kv_positions,
                            candidates : s.candidates,
                            rows : s.rows.map((r) => Array.from(r))
                          })),
    pageTokensPerS : pageRate(),
  };
}

const pageRate = () => (gen.received > 1 && gen.lastAt > gen.firstAt
                            ? (gen.received - 1) / ((gen.lastAt - gen.firstAt) / 1000)
                            : null);

export async function loadGenerate() {
  const prompt = $("gen-prompt");
  if (!prompt.value) prompt.value = state.text;
  const chat = $("gen-chat");
  const hasTemplate = !!(state.info && state.info.chat);
  chat.disabled = !hasTemplate;
  if (!hasTemplate) chat.checked = false;
  $("gen-chat-label").title =
      hasTemplate
          ? "the message goes through the model's chat template; the reply ends at its end of turn"
          : "this model carries no chat template";
  let note = "";
  if (EXPORT)
    note = "Generation runs on the explorer's server, which an exported page does not have: run " +
           "`attnlab explore MODEL` to generate.";
  else if (!state.info.causal)
    note = `${state.model} is an encoder: it does not generate. Pick a causal model.`;
  $("gen-start").disabled = !!note || !!gen.controller;
  if (note)
    $("gen-note").textContent = note;
  else if (!gen.start)
    $("gen-note").textContent =
        "Type a prompt and press Generate: each token appears as it is computed, with the " +
        "attention row of the step that wrote it.";
  drawAll();
}

function request() {
  const n = (id) => Number($(id).value);
  const b = {
    model : state.model,
    text : $("gen-prompt").value,
    chat : $("gen-chat").checked,
    max_new_tokens : Math.max(1, Math.floor(n("gen-max"))),
    temperature : Math.max(0, n("gen-temp")),
    top_k : n("gen-topk") > 0 ? Math.floor(n("gen-topk")) : null,
    seed : Math.floor(n("gen-seed")),
  };
  if (state.step !== null) b.step = state.step;
  return b;
}

async function startGeneration() {
  if (gen.controller) return;
  Object.assign(gen, {
    start : null,
    steps : [],
    tail : "",
    end : null,
    selected : null,
    received : 0,
    firstAt : null,
    lastAt : null,
    error : null,
    image : null
  });
  gen.controller = new AbortController();
  document.body.dataset.generating = "1";
  delete document.body.dataset.generated;
  $("gen-start").disabled = true;
  $("gen-stop").disabled = false;
  $("gen-use").disabled = true;
  $("gen-note").textContent = "connecting…";
  drawAll();
  try {
    const headers = {"Content-Type" : "application/json"};
    if (TOKEN) headers.Authorization = "token " + TOKEN;
    const response = await fetch("/api/generate", {
      method : "POST",
      headers,
      body : JSON.stringify(request()),
      signal : gen.controller.signal
    });
    if (!response.ok) {
      const data = await response.json().catch(() => ({}));
      const detail =
          Array.isArray(data.detail)
              ? data.detail.map((d) => (d.loc || []).slice(1).join(".") + ": " + d.msg).join("; ")
              : data.detail;
      throw new Error(detail || response.statusText);
    }
    await readLines(response.body, onLine);
  } catch (err) {
    if (err.name !== "AbortError") {
      gen.error = err.message;
      setStatus(err.message, true);
    }
  } finally {
    gen.controller = null;
    $("gen-start").disabled = false;
    $("gen-stop").disabled = true;
    $("gen-use").disabled = !gen.steps.length;
    delete document.body.dataset.generating;
    if (gen.frame !== null) {
      cancelAnimationFrame(gen.frame);
      gen.frame = null;
    }
    drawAll();
    document.body.dataset.generated = String(gen.steps.length);
  }
}

async function readLines(stream, each) {
  // NDJSON: split the bytes at newlines as they arrive; a line may span chunks
  const reader = stream.getReader(), decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, {stream : true});
    let cut;
    while ((cut = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 1);
      if (line) each(JSON.parse(line));
    }
  }
}

function onLine(event) {
  if (event.event === "start") {
    gen.start = event;
  } else if (event.event === "token") {
    const now = performance.now();
    gen.received += 1;
    if (gen.firstAt === null) gen.firstAt = now;
    gen.lastAt = now;
    event.rows = decodeMatrix(event.rows); // [layer·head] rows of index keys
    gen.steps.push(event);
    paintRow(gen.steps.length - 1);
    // one drawing per animation frame, however many tokens arrived in it
    if (gen.frame === null)
      gen.frame = requestAnimationFrame(() => {
        gen.frame = null;
        drawAll();
      });
    return;
  } else if (event.event === "end") {
    gen.end = event;
    gen.tail = event.tail || "";
  } else if (event.event === "error") {
    gen.error = event.detail;
    setStatus(event.detail, true);
  }
  drawAll();
}

function stopGeneration() {
  if (gen.controller) gen.controller.abort();
}

// Drawing -----------------------------------------------------------------------------------------
function drawAll() {
  drawTokens();
  drawStaircase();
  drawCache();
  drawDetail();
  drawNote();
}

function allTokens() {
  const s = gen.start;
  return s ? s.prompt_tokens.concat(gen.steps.map((x) => x.token)) : [];
}

function shownRow() {
  // the chosen head's row of the clicked token, else of the newest: [keys before that token]
  const step = gen.selected !== null ? gen.steps[gen.selected] : gen.steps[gen.steps.length - 1];
  if (!step || !gen.start) return null;
  return {step, row : step.rows[state.layer * gen.start.n_heads + state.head]};
}

function drawTokens() {
  const el = $("gen-tokens");
  clear(el);
  if (!gen.start) return;
  const shown = shownRow(), P = gen.start.prompt_tokens.length;
  let top = 0;
  if (shown)
    for (const w of shown.row) top = Math.max(top, w);
  allTokens().forEach((t, i) => {
    const b = document.createElement("button");
    b.type = "button";
    const k = i - P; // the generated token's number, or negative in the prompt
    b.className = "chip gen-chip" + (k < 0 ? " prompt" : " new") +
                  (shown && i === shown.step.index ? " active" : "") +
                  (k >= 0 && gen.steps[k].end_of_turn ? " eot" : "");
    b.textContent = show(t);
    b.dataset.index = i;
    if (shown && i < shown.row.length) {
      const w = shown.row[i];
      b.style.background = blues(top > 0 ? w / top : 0);
      if (top > 0 && w / top > 0.55) b.style.color = "#fff";
      b.title = `token ${i}: weight ${fmt(w, 3)} from the step that wrote #${shown.step.index}`;
    } else
      b.title =
          `token ${i}` +
          (k >= 0 ? " (generated: click for every head's row and the candidates)" : " (prompt)");
    if (k >= 0)
      b.addEventListener("click", () => {
        gen.selected = gen.selected === k ? null : k;
        drawAll();
      });
    el.appendChild(b);
  });
}

function paintRow(r) {
  // step r's row of the chosen head into the staircase image, one pixel per key (keys not yet
  // written: dark)
  const s = gen.start, head = state.layer * s.n_heads + state.head;
  const keys = s.prompt_tokens.length + s.budget;
  if (!gen.image || gen.imageHead !== head) {
    gen.image = document.createElement("canvas");
    gen.image.width = keys;
    gen.image.height = s.budget;
    gen.imageHead = head;
    for (let k = 0; k < gen.steps.length; k++)
      if (k !== r) paintRow(k);
  }
  const row = gen.steps[r].rows[head], ctx = gen.image.getContext("2d"),
        pixels = ctx.createImageData(keys, 1), px = pixels.data;
  let top = 0;
  for (const w of row) top = Math.max(top, w);
  for (let j = 0; j < keys; j++) {
    const o = 4 * j;
    px[o + 3] = 255;
    if (j >= row.length) {
      px[o] = px[o + 1] = px[o + 2] = 43;
      continue;
    }
    const t = top > 0 ? row[j] / top : 0; // as blues()
    px[o] = 255 - 222 * t;
    px[o + 1] = 255 - 153 * t;
    px[o + 2] = 255 - 75 * t;
  }
  ctx.putImageData(pixels, 0, r);
}

function drawStaircase() {
  // one row per new token (top to bottom), its step's weights over the keys before it, for the
  // chosen head
  const canvas = $("gen-rows"), s = gen.start;
  const title = $("gen-rows-title");
  if (!s || !gen.steps.length) {
    canvas.width = 1;
    canvas.height = 1;
    title.textContent = "";
    return;
  }
  if (gen.imageHead !== state.layer * s.n_heads + state.head) paintRow(0); // another head: repaint
  const keys = s.prompt_tokens.length + s.budget, n = gen.steps.length;
  const cw = Math.min(12, 760 / keys), rh = Math.min(12, 260 / s.budget);
  canvas.width = Math.ceil(cw * keys);
  canvas.height = Math.max(1, Math.ceil(rh * n));
  const ctx = canvas.getContext("2d");
  ctx.imageSmoothingEnabled = cw < 1 || rh < 1;
  ctx.drawImage(gen.image, 0, 0, keys, n, 0, 0, cw * keys, rh * n);
  if (gen.selected !== null) {
    ctx.strokeStyle = "#e4572e";
    ctx.lineWidth = 1.5;
    ctx.strokeRect(0.75, gen.selected * rh + 0.75, gen.steps[gen.selected].index * cw - 1.5,
                   Math.max(1, rh - 1.5));
  }
  title.textContent =
      `layer ${state.layer} head ${
          state.head}: each new token's row (top to bottom) over the tokens before it ` +
      "· white 0 → blue: the row's largest weight · dark: not yet written";
}

function drawCache() {
  const s = gen.start, el = $("gen-cache-text"), bar = $("gen-cache-fill");
  if (!s) {
    el.textContent = "";
    bar.style.width = "0";
    return;
  }
  const last = gen.steps[gen.steps.length - 1];
  const filled = last ? last.kv_positions : 0; // the newest token enters the cache at the next step
  const bytes = (n) => (n * s.kv_bytes_per_position / 1e6).toFixed(2) + " MB";
  bar.style.width = (100 * filled / s.kv_allocated_positions).toFixed(2) + "%";
  const rate = pageRate();
  el.textContent =
      `${filled} positions × ${(s.kv_bytes_per_position / 1024).toFixed(1)} kB = ${
          bytes(filled)} ` +
      `(a key and a value per layer and kv head: 2 × ${s.n_layers} × ${s.n_kv_heads} × ${
          s.d_head} numbers) · ` +
      `allocated once for ${s.kv_allocated_positions} positions: ${
          bytes(s.kv_allocated_positions)}` +
      (s.decode.path === "kernels" ? " · decoded by attnlab's C step"
                                   : ` · decoded through the modules (${s.decode.reason})`) +
      (rate ? ` · ${rate.toFixed(1)} tokens/s as received here` : "") +
      (gen.end && gen.end.tokens_per_s
           ? ` · ${gen.end.tokens_per_s.toFixed(1)} tokens/s on the server`
           : "");
}

function drawNote() {
  if (!gen.start) return;
  const s = gen.start, n = gen.steps.length;
  let text = `${s.prompt_tokens.length} prompt tokens${s.chat ? " (the chat template's)" : ""} · ${
      n} of at most ${s.budget} new`;
  if (gen.controller)
    text += " · generating…";
  else if (gen.end)
    text += gen.end.reason === "end_of_turn" ? " · ended at the end of the turn" : " · done";
  else if (!gen.error)
    text += " · stopped";
  if (gen.error) text += ` · ${gen.error}`;
  $("gen-note").textContent =
      text + " · click a generated token for every head's row and its candidates";
}

function drawDetail() {
  const panel = $("gen-detail");
  if (gen.selected === null || !gen.steps[gen.selected]) {
    panel.hidden = true;
    return;
  }
  panel.hidden = false;
  const step = gen.steps[gen.selected], s = gen.start;
  $("gen-detail-title").textContent =
      `#${step.index} “${show(step.token)}” (p = ${
          fmt(step.prob, 3)}), written by the step whose query was ` +
      `#${step.index - 1}: every head's weights over the ${
          step.index} tokens before it (rows: L0H0 … L${s.n_layers - 1}H${
          s.n_heads - 1}; click a row to follow that head)`;
  const canvas = $("gen-heads"), rows = step.rows, H = s.n_heads, n = rows.length, S = step.index;
  const rh = Math.max(1, Math.min(8, Math.floor(540 / n))),
        cw = Math.max(1, Math.min(10, Math.floor(880 / S))), left = 46;
  canvas.width = left + cw * S;
  canvas.height = rh * n;
  const ctx = canvas.getContext("2d");
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, canvas.width, canvas.height);
  ctx.font = "10px sans-serif";
  ctx.fillStyle = "#667085";
  ctx.textBaseline = "top";
  for (let r = 0; r < n; r++) {
    const row = rows[r];
    for (let j = 0; j < S; j++) {
      ctx.fillStyle = blues(row[j]);
      ctx.fillRect(left + j * cw, r * rh, cw, rh);
    }
    if (r % H === 0) {
      ctx.fillStyle = "#667085";
      if (rh * H >= 10) ctx.fillText(`L${r / H}`, 2, r * rh);
      ctx.fillStyle = "#d0d5dd";
      ctx.fillRect(left, r * rh, cw * S, r ? 1 : 0);
    }
  }
  const cur = state.layer * H + state.head;
  ctx.strokeStyle = "#e4572e";
  ctx.lineWidth = 1;
  ctx.strokeRect(left - 0.5, cur * rh - 0.5, cw * S + 1, rh + 1);
  canvas.dataset.rows = n;
  canvas.dataset.keys = S;
  const list = $("gen-candidates");
  clear(list);
  const best = step.candidates.length ? step.candidates[0].prob : 1;
  for (const c of step.candidates) {
    const row = barRow("div", "span", show(c.token), best > 0 ? c.prob / best : 0, fmt(c.prob, 3));
    row.className = "next-bar gen-candidate" + (c.id === step.id ? " chosen" : "");
    row.dataset.id = c.id;
    list.appendChild(row);
  }
  $("gen-candidates-title").textContent =
      `top candidates at #${step.index}` +
      (s.settings.temperature === 0
           ? " (greedy: the model's softmax; the most likely wins)"
           : ` (what it was drawn from: temperature ${s.settings.temperature}` +
                 (s.settings.top_k ? `, top-k ${s.settings.top_k}` : "") +
                 (s.settings.top_p ? `, top-p ${s.settings.top_p}` : "") + ")");
}

function headAt(event) {
  const canvas = $("gen-heads"), r = canvas.getBoundingClientRect(), s = gen.start,
        step = gen.steps[gen.selected];
  const n = step.rows.length, S = step.index;
  const rh = Math.max(1, Math.min(8, Math.floor(540 / n))),
        cw = Math.max(1, Math.min(10, Math.floor(880 / S))), left = 46;
  const x = event.clientX - r.left, y = event.clientY - r.top;
  const row = Math.floor(y / rh), key = Math.floor((x - left) / cw);
  if (row < 0 || row >= n) return null;
  return {
    layer : Math.floor(row / s.n_heads),
    head : row % s.n_heads,
    key : key >= 0 && key < S ? key : null,
    row,
    x,
    y
  };
}

export function wireGenerate() {
  $("gen-start").addEventListener("click", () => startGeneration());
  $("gen-stop").addEventListener("click", stopGeneration);
  $("gen-use").addEventListener("click", () => {
    // the prompt and what was generated become the page's text, for every other view
    if (!gen.start) return;
    $("text").value = gen.start.prompt_text + gen.steps.map((x) => x.piece).join("") + gen.tail;
    page.runText();
  });
  const canvas = $("gen-heads"), tip = $("gen-heads-tip");
  canvas.addEventListener("mousemove", (e) => {
    const at = headAt(e);
    if (!at || at.key === null) {
      tip.style.display = "none";
      return;
    }
    const w = gen.steps[gen.selected].rows[at.row][at.key];
    tip.style.display = "block";
    tip.style.left = at.x + 14 + "px";
    tip.style.top = at.y + 14 + "px";
    tip.textContent =
        `L${at.layer}H${at.head} → #${at.key} “${show(allTokens()[at.key])}”: ${fmt(w, 3)}`;
  });
  canvas.addEventListener("mouseleave", () => { tip.style.display = "none"; });
  canvas.addEventListener("click", (e) => {
    const at = headAt(e);
    if (!at) return;
    state.layer = at.layer;
    state.head = at.head;
    $("layer").value = at.layer;
    $("head").value = at.head;
    drawAll();
  });
  // a closed page aborts its requests; stop explicitly too, so the server hears it at once
  window.addEventListener("pagehide", stopGeneration);
}
