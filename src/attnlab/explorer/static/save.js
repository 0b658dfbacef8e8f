// "save PNG / save SVG": the shown view as a standalone SVG (its SVG drawings inlined with their
// computed styles, canvases as embedded PNGs, text as text), and that SVG as a PNG; the matrix's
// PNG is its canvas.

import {$, SVG_NS, guarded, state, svg} from "./core.js";

const STYLE_PROPS = [
  "fill", "fill-opacity", "stroke", "stroke-width", "stroke-opacity", "stroke-linecap",
  "stroke-dasharray", "opacity", "font-family", "font-size", "font-weight", "text-anchor",
  "dominant-baseline"
];

function inlineSvg(source, x, y) {
  // a copy of an SVG drawing with its computed styles written on each element (no stylesheet
  // travels with it)
  const copy = source.cloneNode(true);
  const from = [ source, ...source.querySelectorAll("*") ],
        to = [ copy, ...copy.querySelectorAll("*") ];
  from.forEach((el, k) => {
    const cs = getComputedStyle(el);
    // as presentation attributes, not a style attribute (which the page's CSP refuses, even on a
    // copy)
    for (const p of STYLE_PROPS) {
      const v = cs.getPropertyValue(p);
      if (v) to[k].setAttribute(p, v);
    }
  });
  copy.removeAttribute("id");
  copy.setAttribute("x", x);
  copy.setAttribute("y", y);
  return copy;
}

function viewToSvg(root) {
  // walk the view's boxes: backgrounds and borders as rects, canvases as images, SVGs inlined, text
  // as text
  const box = root.getBoundingClientRect();
  const W = Math.ceil(Math.max(root.scrollWidth, box.width)),
        H = Math.ceil(Math.max(root.scrollHeight, box.height));
  const out = document.createElementNS(SVG_NS, "svg");
  out.setAttribute("xmlns", SVG_NS);
  out.setAttribute("width", W);
  out.setAttribute("height", H);
  out.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg("rect", {x : 0, y : 0, width : W, height : H, fill : "#ffffff"}, out);
  const rel = (r) => ({x : r.left - box.left, y : r.top - box.top, w : r.width, h : r.height});
  const transparent = (c) => !c || c === "transparent" || c.endsWith(", 0)");
  const walk = (el) => {
    const cs = getComputedStyle(el);
    if (cs.display === "none" || cs.visibility === "hidden" || el.hidden) return;
    const r = rel(el.getBoundingClientRect());
    if (r.w === 0 && r.h === 0) return;
    const bg = cs.backgroundColor,
          border = parseFloat(cs.borderTopWidth) > 0 && !transparent(cs.borderTopColor);
    if (!transparent(bg) || border) {
      svg("rect", {
        x : r.x,
        y : r.y,
        width : r.w,
        height : r.h,
        rx : parseFloat(cs.borderTopLeftRadius) || 0,
        fill : transparent(bg) ? "none" : bg,
        stroke : border ? cs.borderTopColor : "none",
        "stroke-width" : border ? cs.borderTopWidth : 0
      },
          out);
    }
    if (el.tagName === "CANVAS") {
      svg("image", {
        x : r.x,
        y : r.y,
        width : r.w,
        height : r.h,
        href : el.toDataURL("image/png"),
        preserveAspectRatio : "none"
      },
          out);
      return;
    }
    if (el.namespaceURI === SVG_NS) {
      out.appendChild(inlineSvg(el, r.x, r.y));
      return;
    }
    if (el.tagName === "SELECT") {
      text(el.options[el.selectedIndex] ? el.options[el.selectedIndex].text : "", el, r);
      return;
    }
    if (el.tagName === "INPUT" || el.tagName === "TEXTAREA") return;
    for (const child of el.childNodes) {
      if (child.nodeType === 1)
        walk(child);
      else if (child.nodeType === 3 && child.textContent.trim())
        textNode(child, cs);
    }
  };
  const text = (content, el, r) => {
    const cs = getComputedStyle(el);
    const t = svg("text", {
      x : r.x + 4,
      y : r.y + r.h * 0.7,
      fill : cs.color,
      "font-size" : cs.fontSize,
      "font-family" : cs.fontFamily
    },
                  out);
    t.textContent = content;
  };
  const textNode = (node, cs) => {
    // one <text> per line box: each word placed where the page laid it out
    const range = document.createRange();
    const words = node.textContent.split(/(\s+)/);
    let offset = 0, line = null;
    for (const word of words) {
      if (word.trim()) {
        range.setStart(node, offset);
        range.setEnd(node, offset + word.length);
        const rr = range.getClientRects()[0];
        if (rr) {
          const r = rel(rr);
          if (!line || Math.abs(line.y - r.y) > 2) {
            line = {
              y : r.y,
              el : svg("text", {
                x : r.x,
                y : r.y + r.h * 0.78,
                fill : cs.color,
                "font-size" : cs.fontSize,
                "font-family" : cs.fontFamily,
                "font-weight" : cs.fontWeight,
                "xml:space" : "preserve"
              },
                       out)
            };
            line.el.textContent = word;
          } else
            line.el.textContent += " " + word;
        }
      }
      offset += word.length;
    }
  };
  walk(root);
  return out;
}

function download(blob, name) {
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = name;
  document.body.appendChild(a);
  a.click();
  setTimeout(() => {
    URL.revokeObjectURL(a.href);
    a.remove();
  }, 1000);
}

function fileName(ext) {
  const what = state.view === "next" || state.view === "block"
                   ? state.view
                   : `${state.view}-L${state.layer}H${state.head}`;
  return `attnlab-${state.model}-${what}${state.step !== null ? "-step" + state.step : ""}${
      state.ablate.length ? "-knockout" : ""}.${ext}`;
}

function shownRoot() {
  // the view, with the training and knockout bars above it when they are shown
  return [ $("training"), $("knockout"), $("view-" + state.view) ].filter((el) => !el.hidden);
}

export function pictureSvg() {
  const parts = shownRoot().map((el) => viewToSvg(el));
  const W = Math.max(...parts.map((p) => +p.getAttribute("width"))),
        H = parts.reduce((a, p) => a + +p.getAttribute("height"), 0);
  const out = document.createElementNS(SVG_NS, "svg");
  out.setAttribute("xmlns", SVG_NS);
  out.setAttribute("width", W);
  out.setAttribute("height", H);
  out.setAttribute("viewBox", `0 0 ${W} ${H}`);
  let y = 0;
  for (const p of parts) {
    p.setAttribute("y", y);
    y += +p.getAttribute("height");
    out.appendChild(p);
  }
  return new XMLSerializer().serializeToString(out);
}

async function savePicture(kind) {
  if (kind === "svg")
    return download(new Blob([ pictureSvg() ], {type : "image/svg+xml"}), fileName("svg"));
  if (state.view === "matrix" && $("training").hidden && $("knockout").hidden) {
    // the canvas view: its own pixels
    const canvas = $("matrix-map").hidden ? $("matrix-canvas")
                                          : $("map-canvas"); // the stages, or the whole context
    return new Promise((resolve) => canvas.toBlob((b) => {
      download(b, fileName("png"));
      resolve();
    }, "image/png"));
  }
  const source = pictureSvg();
  const image = new Image();
  image.src = "data:image/svg+xml;base64," + btoa(unescape(encodeURIComponent(source)));
  await image.decode();
  const scale = 2, canvas = document.createElement("canvas");
  canvas.width = image.width * scale;
  canvas.height = image.height * scale;
  const ctx = canvas.getContext("2d");
  ctx.scale(scale, scale);
  ctx.drawImage(image, 0, 0);
  return new Promise((resolve) => canvas.toBlob((b) => {
    download(b, fileName("png"));
    resolve();
  }, "image/png"));
}

export function wireSave() {
  $("save-png").addEventListener("click", () => guarded(() => savePicture("png")));
  $("save-svg").addEventListener("click", () => guarded(() => savePicture("svg")));
}
