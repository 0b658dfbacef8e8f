// The whole context as a map: one head's T×T pattern at any zoom, for texts up to the model's
// context (8,192 tokens on SmolLM2), from the queries and keys the server keeps for the text (POST
// /api/context).
//
// Design choices:
// - What crosses the wire is what the screen shows: an overview of the whole matrix max-pooled to
// the
//   canvas's pixels (the max, so a sharp head stays visible), then, as you zoom, 256×256 tiles of
//   finer levels (level ℓ: 2^ℓ × 2^ℓ max-pools, level 0 the cells themselves), as float16 bytes
//   behind a 32-byte header.
// - The overview is drawn first and stays underneath: a tile not yet fetched shows its coarser
// picture, never
//   a hole. At most 3 tile requests are in flight; a tile no longer on screen when its turn comes
//   is dropped.
// - Tiles and overviews are kept per head (a bounded LRU), so going back to a head redraws without
// asking.
// - Colour: white 0 → blue 1 on the square root of the weight (a long text's weights are small: 1/T
// spread
//   evenly), the same scale at every level, so zooming never changes a cell's colour; keys a causal
//   query cannot see are grey.

import {$, halfTable, send, show, state} from "../core.js";

export const TILE_CACHE = 160; // tiles kept in the page (256² cells each)
const IN_FLIGHT = 3; // tile requests at once (the server computes one at a time anyway)
const MAX_CELL = 40; // the deepest zoom: pixels per token
const MAGIC = "ATL1";

export const map = {
  key : null,
  context : null,
  head : null,
  overviews : new Map(),
  tiles : new Map(),
  view : null,
  queue : [],
  inFlight : 0,
  wanted : new Set(),
  loading : new Set(),
  complete : false,
  frames : 0,
  geometry : null,
  error : null,
  times :
      {}, // performance.now() of the context's request and answer, and of the last overview painted
};
state.matrix.map = map;

export function decodeCells(buffer) {
  // the server's binary answer -> {level, rows, cols, row0, col0, n, values: Float32Array}
  const view = new DataView(buffer);
  const magic = String.fromCharCode(...new Uint8Array(buffer, 0, 4));
  if (magic !== MAGIC)
    throw new Error(`not a pattern the explorer sent (magic ${JSON.stringify(magic)})`);
  const [level, rows, cols, row0, col0, n, size] =
      Array.from({length : 7}, (_, i) => view.getUint32(4 + 4 * i, true));
  const values = new Float32Array(rows * cols);
  if (size === 4)
    values.set(new Float32Array(buffer.slice(32)));
  else {
    const half = new Uint16Array(buffer.slice(32)), table = halfTable();
    for (let i = 0; i < values.length; i++) values[i] = table[half[i]];
  }
  return {level, rows, cols, row0, col0, n, values};
}

async function postContext(layers) {
  const b = {model : state.model, text : state.text};
  if (layers) b.layers = layers;
  if (state.ablate.length) {
    b.ablate = state.ablate.map((h) => h.slice());
    b.ablation = state.ablation;
  }
  if (state.step !== null) b.step = state.step;
  map.times.contextSent = performance.now();
  const context = await (await send("/api/context", b)).json();
  map.times.contextDone = performance.now();
  context.clientMs = map.times.contextDone - map.times.contextSent;
  return context;
}

async function getCells(path) {
  // a binary answer; a context the server no longer keeps is posted again, once
  for (let tries = 0;; tries++) {
    try {
      return decodeCells(
          await (await send(`/api/context/${map.context.id}/${path}`)).arrayBuffer());
    } catch (err) {
      if (err.status !== 404 || tries) throw err;
      if (err.message.startsWith("no context"))
        map.context = await postContext(map.context.layers);
      else if (err.message.includes("is not kept"))
        map.context = await postContext(layersAround(state.layer));
      else
        throw err;
      showMemory(map.context.memory);
    }
  }
}

// as many layers as the kept context holds (the explorer's budget), the one in view among them
function layersAround(layer) {
  const n = map.context.layers.length, total = map.context.n_layers;
  const first = Math.max(0, Math.min(layer - Math.floor(n / 2), total - n));
  return Array.from({length : n}, (_, i) => first + i);
}

const headKey = () => `${state.layer}/${state.head}`;
const causal = () => state.info.causal;

function remember(cache, key, value, limit) {
  cache.delete(key);
  cache.set(key, value);
  while (cache.size > limit) cache.delete(cache.keys().next().value);
}

function cellsImage(cells) {
  // one pixel per cell; a causal matrix's cells entirely above the diagonal (key block after query
  // block) grey
  const canvas = document.createElement("canvas");
  canvas.width = cells.cols;
  canvas.height = cells.rows;
  const image = canvas.getContext("2d").createImageData(cells.cols, cells.rows), px = image.data;
  const dark = causal();
  for (let i = 0; i < cells.rows; i++) {
    for (let j = 0; j < cells.cols; j++) {
      const o = 4 * (i * cells.cols + j);
      px[o + 3] = 255;
      if (dark && cells.col0 + j > cells.row0 + i) {
        px[o] = 226;
        px[o + 1] = 229;
        px[o + 2] = 234;
        continue;
      }
      const t = Math.sqrt(Math.max(0, Math.min(1, cells.values[i * cells.cols + j])));
      px[o] = 255 - 222 * t;
      px[o + 1] = 255 - 153 * t;
      px[o + 2] = 255 - 75 * t;
    }
  }
  canvas.getContext("2d").putImageData(image, 0, 0);
  return canvas;
}

export async function loadMap() {
  // the context (once per text), then this head's overview (once per head), painted; tiles follow
  const t0 = performance.now();
  const key = JSON.stringify([ state.model, state.text, state.ablate, state.ablation, state.step ]);
  if (map.key !== key) {
    map.key = null;
    map.overviews.clear();
    map.tiles.clear();
    map.queue = [];
    map.view = null;
    $("map-note").textContent = `running the model once over ${state.tokens.length} tokens…`;
    map.context = await postContext();
    map.key = key;
    showMemory(map.context.memory);
  }
  sizeCanvas();
  const head = headKey();
  map.head = head;
  if (!map.overviews.has(head)) {
    const size =
        Math.max(16, Math.min(4096, Math.round(map.plot * (window.devicePixelRatio || 1))));
    const cells = await getCells(`overview?layer=${state.layer}&head=${state.head}&size=${size}`);
    remember(map.overviews, head, {cells, image : cellsImage(cells)}, 64);
  }
  if (map.head !== head) return; // another head was picked meanwhile: its load paints
  if (!map.view) resetView();
  paintMap();
  map.times.painted = performance.now();
  state.timings.mapLoadMs = map.times.painted - t0;
  const T = map.context.n_tokens, level = map.overviews.get(head).cells.level;
  $("map-note").textContent =
      `layer ${state.layer} head ${state.head} · rows: queries, columns: keys · ${
          T.toLocaleString()}×${T.toLocaleString()} ` +
      `· overview: the max over each ${2 ** level}×${
          2 ** level} block · colour: √weight, white 0 → blue 1` +
      (causal() ? " · grey: masked (a query sees only the keys before it)" : "");
}

function showMemory(memory) {
  if (!memory) return;
  const mb = (x) => (x / 2 ** 20).toFixed(0) + " MB";
  $("map-memory").textContent =
      `text processed in ${map.context.seconds.toFixed(1)} s · queries and keys kept` +
      (map.context.layers.length < map.context.n_layers
           ? ` (layers ${map.context.layers[0]}-${map.context.layers.at(-1)} of ${
                 map.context.n_layers}: what the budget holds; another layer runs the text again)`
           : "") +
      `: ${mb(map.context.bytes)} (all contexts ${mb(memory.bytes)} of a ${
          mb(memory.budget_bytes)} budget)` +
      (memory.rss_bytes ? ` · server memory ${mb(memory.rss_bytes)}` : "");
}

function sizeCanvas() {
  const canvas = $("map-canvas"), tokens = map.context.tokens;
  const side = Math.max(320, Math.min(900, window.innerWidth - 60));
  const margin =
      Math.min(110, 8 + 7 * Math.max(...tokens.slice(0, 2000).map((t) => show(t).length)));
  const ratio = window.devicePixelRatio || 1;
  if (map.side !== side || canvas.width !== side * ratio) {
    canvas.width = side * ratio;
    canvas.height = side * ratio;
    canvas.style.width = side + "px";
    canvas.style.height = side + "px";
  }
  map.side = side;
  map.margin = margin;
  map.plot = side - margin - 4;
}

function resetView() { map.view = {z : map.plot / map.context.n_tokens, x0 : 0, y0 : 0}; }

function clampView() {
  const v = map.view, T = map.context.n_tokens;
  v.z = Math.max(map.plot / T, Math.min(MAX_CELL, v.z));
  const shown = map.plot / v.z;
  v.x0 = Math.max(0, Math.min(T - shown, v.x0));
  v.y0 = Math.max(0, Math.min(T - shown, v.y0));
}

export function wantedLevel() {
  // the coarsest level whose cells are still at least one device pixel: finer than the overview
  // means tiles
  const ratio = window.devicePixelRatio || 1;
  return Math.max(0, Math.ceil(Math.log2(1 / (map.view.z * ratio)) - 1e-9));
}

export function paintMap() {
  if (!map.context || !map.view) return;
  const head = map.head, overview = map.overviews.get(head);
  if (!overview) return;
  const canvas = $("map-canvas"), ctx = canvas.getContext("2d");
  const {margin, side, plot} = map, {z, x0, y0} = map.view, T = map.context.n_tokens;
  const ratio = window.devicePixelRatio || 1;
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, side, side);
  ctx.save();
  ctx.beginPath();
  ctx.rect(margin, margin, Math.min(plot, (T - x0) * z),
           Math.min(plot, (T - y0) * z)); // the plot, and the matrix's edge
  ctx.clip();
  const at = (token, origin) => margin + (token - origin) * z;
  const draw = (cells, image) => {
    const f = 2 ** cells.level;
    ctx.imageSmoothingEnabled = f * z < 1;
    ctx.drawImage(image, at(cells.col0 * f, x0), at(cells.row0 * f, y0), cells.cols * f * z,
                  cells.rows * f * z);
  };
  draw(overview.cells, overview.image);
  const level = wantedLevel();
  map.wanted = new Set();
  let missing = 0;
  if (level < overview.cells.level) {
    const span = 256 * 2 ** level, shown = plot / z;
    for (let r = Math.floor(y0 / span); r <= Math.floor(Math.min(T - 1, y0 + shown) / span); r++) {
      for (let c = Math.floor(x0 / span); c <= Math.floor(Math.min(T - 1, x0 + shown) / span);
           c++) {
        if (causal() && c > r) continue; // above the diagonal: nothing a query can see
        const key = `${head}/${level}/${r}/${c}`, tile = map.tiles.get(key);
        if (tile)
          draw(tile.cells, tile.image);
        else {
          map.wanted.add(key);
          missing++;
        }
      }
    }
  }
  ctx.restore();
  labels(ctx);
  map.complete = missing === 0;
  map.frames++;
  map.geometry = {z, x0, y0, level, margin, missing};
  if (missing) fetchTiles();
  $("map-zoom").textContent =
      `×${(z * T / plot).toFixed(1)} · ${
          level < overview.cells.level
              ? (level ? `tiles of ${2 ** level}×${2 ** level} maxima` : "single cells")
              : "overview"}` +
      ` · queries ${Math.floor(y0)}–${Math.min(T, Math.ceil(y0 + plot / z)) - 1}, keys ${
          Math.floor(x0)}–${Math.min(T, Math.ceil(x0 + plot / z)) - 1}` +
      (missing ? ` · loading ${missing} tile${missing > 1 ? "s" : ""}` : "");
}

function labels(ctx) {
  // token labels on both axes once a cell is tall enough for a line of text
  const {margin, plot} = map, {z, x0, y0} = map.view, tokens = map.context.tokens,
                 T = tokens.length;
  if (z < 9) return;
  const first = Math.floor(x0), firstRow = Math.floor(y0), n = Math.ceil(plot / z) + 1;
  ctx.fillStyle = "#222";
  ctx.font = `${Math.min(13, z - 1)}px sans-serif`;
  ctx.textBaseline = "middle";
  ctx.textAlign = "right";
  for (let i = firstRow; i < Math.min(T, firstRow + n); i++)
    ctx.fillText(show(tokens[i]).slice(0, 14), margin - 4, margin + (i - y0 + 0.5) * z);
  for (let j = first; j < Math.min(T, first + n); j++) {
    ctx.save();
    ctx.translate(margin + (j - x0 + 0.5) * z, margin - 4);
    ctx.rotate(-Math.PI / 2);
    ctx.textAlign = "left";
    ctx.fillText(show(tokens[j]).slice(0, 14), 0, 0);
    ctx.restore();
  }
}

function fetchTiles() {
  // the tiles the last paint wanted, IN_FLIGHT at a time; one no longer wanted when its turn comes
  // is dropped
  map.queue = Array.from(map.wanted);
  while (map.inFlight < IN_FLIGHT && map.queue.length) {
    const key = map.queue.shift();
    if (map.tiles.has(key) || map.loading.has(key)) continue;
    map.loading.add(key);
    map.inFlight++;
    const [layer, head, level, r, c] = key.split("/").map(Number), context = map.key;
    getCells(`tile?layer=${layer}&head=${head}&level=${level}&row=${r}&col=${c}`)
        .then((cells) => {
          if (map.key === context)
            remember(map.tiles, key, {cells, image : cellsImage(cells)}, TILE_CACHE);
        })
        .catch((err) => {
          map.error = err.message;
          $("map-note").textContent = err.message;
        })
        .finally(() => {
          map.inFlight--;
          map.loading.delete(key);
          if (map.key === context) paintMap();
        });
  }
}

export function zoomMap(factor, x, y) {
  // zoom by `factor` keeping the token under (x, y) (canvas pixels; default: the plot's centre) in
  // place
  if (!map.view) return;
  const v = map.view, {margin, plot} = map;
  const cx = x === undefined ? margin + plot / 2 : x, cy = y === undefined ? margin + plot / 2 : y;
  const col = v.x0 + (cx - margin) / v.z, row = v.y0 + (cy - margin) / v.z;
  v.z *= factor;
  clampView();
  v.x0 = col - (cx - margin) / v.z;
  v.y0 = row - (cy - margin) / v.z;
  clampView();
  paintMap();
}

export function mapCell(event) {
  // the token row and column under the pointer, and the finest cells painted there
  const r = $("map-canvas").getBoundingClientRect(), v = map.view;
  const x = event.clientX - r.left, y = event.clientY - r.top;
  return {
    x,
    y,
    i : Math.floor(v.y0 + (y - map.margin) / v.z),
    j : Math.floor(v.x0 + (x - map.margin) / v.z)
  };
}

export function cellValue(i, j) {
  // {value, level} of the finest cells held for token pair (i, j): a tile of the level shown, else
  // the overview
  const level = wantedLevel(), span = 256 * 2 ** level;
  const tile =
      map.tiles.get(`${map.head}/${level}/${Math.floor(i / span)}/${Math.floor(j / span)}`);
  const {cells} = tile || map.overviews.get(map.head);
  const f = 2 ** cells.level, ci = Math.floor(i / f) - cells.row0,
        cj = Math.floor(j / f) - cells.col0;
  return {value : cells.values[ci * cells.cols + cj], level : cells.level};
}

function hover(event) {
  const tip = $("map-tip");
  if (!map.view || !map.overviews.get(map.head)) return;
  const {x, y, i, j} = mapCell(event), T = map.context.n_tokens, tokens = map.context.tokens;
  if (x < map.margin || y < map.margin || i < 0 || j < 0 || i >= T || j >= T) {
    tip.style.display = "none";
    return;
  }
  const {value, level} = cellValue(i, j), f = 2 ** level;
  tip.style.display = "block";
  tip.style.left = (x + 14) + "px";
  tip.style.top = (y + 14) + "px";
  if (causal() && j > i && level === 0) {
    tip.textContent = `query ${i} → key ${j}: masked (a later token)`;
    return;
  }
  const weight = value.toPrecision(3);
  tip.textContent =
      level === 0
          ? `query ${i} “${show(tokens[i])}” → key ${j} “${show(tokens[j])}”: weight ${weight}`
          : `queries ${Math.floor(i / f) * f}–${
                Math.min(T, (Math.floor(i / f) + 1) * f) - 1} → keys ${Math.floor(j / f) * f}–` +
                `${Math.min(T, (Math.floor(j / f) + 1) * f) - 1}: largest weight ${
                    weight} (zoom in for single cells)`;
}

export function wireMap() {
  const canvas = $("map-canvas");
  canvas.addEventListener("wheel", (e) => {
    e.preventDefault();
    const {x, y} = mapCell(e);
    zoomMap(e.deltaY < 0 ? 1.25 : 0.8, x, y);
  }, {passive : false});
  canvas.addEventListener("pointerdown", (e) => {
    if (!map.view) return;
    const start = {x : e.clientX, y : e.clientY, x0 : map.view.x0, y0 : map.view.y0};
    const move = (ev) => {
      map.view.x0 = start.x0 - (ev.clientX - start.x) / map.view.z;
      map.view.y0 = start.y0 - (ev.clientY - start.y) / map.view.z;
      clampView();
      paintMap();
    };
    const up = () => {
      window.removeEventListener("pointermove", move);
      window.removeEventListener("pointerup", up);
    };
    window.addEventListener("pointermove", move);
    window.addEventListener("pointerup", up);
  });
  canvas.addEventListener("mousemove", hover);
  canvas.addEventListener("mouseleave", () => { $("map-tip").style.display = "none"; });
  $("map-zoom-in").addEventListener("click", () => zoomMap(2));
  $("map-zoom-out").addEventListener("click", () => zoomMap(0.5));
  $("map-zoom-reset").addEventListener("click", () => {
    if (map.view) {
      resetView();
      paintMap();
    }
  });
}
