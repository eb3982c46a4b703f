// Line charts drawn as SVG, no library. drawChart(svg, series, opts): series = [{name, color, points: [[x, y], ...]}].
// The svg element gets data-points (points of the first series) so tests and scripts can count them.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";

function svgEl(name, attrs, text) {
  const el = document.createElementNS(SVG_NS, name);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

function niceNumber(v) {
  if (v === null || v === undefined || !isFinite(v)) return "-";
  const a = Math.abs(v);
  if (a === 0) return "0";
  if (Number.isInteger(v) && a < 1e4) return String(v);
  if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
  if (a >= 1e4) return (v / 1e3).toFixed(1) + "k";
  if (a >= 100) return v.toFixed(0);
  if (a >= 1) return v.toFixed(2);
  return v.toPrecision(2);
}

function extent(values, padded) {
  let lo = Infinity, hi = -Infinity;
  for (const v of values) { if (v < lo) lo = v; if (v > hi) hi = v; }
  if (lo === Infinity) return [0, 1];
  if (lo === hi) { const pad = Math.abs(lo) * 0.1 || 1; return [lo - pad, hi + pad]; }
  const pad = padded === false ? 0 : (hi - lo) * 0.05;
  return [lo - pad, hi + pad];
}

function drawChart(svg, series, opts) {
  opts = opts || {};
  const W = 360, H = 170, L = 46, R = 10, T = 10, B = 24;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("preserveAspectRatio", "none");
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const all = series.flatMap(s => s.points.filter(p => isFinite(p[1])));
  svg.dataset.points = String(series.length ? series[0].points.length : 0);
  const [x0, x1] = extent(all.map(p => p[0]), false);
  let [y0, y1] = opts.yZero ? extent([0, ...all.map(p => p[1])]) : extent(all.map(p => p[1]));
  if (opts.yZero && all.every(p => p[1] >= 0)) y0 = 0;  // a non-negative quantity: its axis starts at 0
  const sx = x => L + (x - x0) / (x1 - x0) * (W - L - R);
  const sy = y => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  for (let i = 0; i <= 4; i++) {
    const y = y0 + (y1 - y0) * i / 4;
    svg.appendChild(svgEl("line", {x1: L, x2: W - R, y1: sy(y), y2: sy(y), class: "grid"}));
    svg.appendChild(svgEl("text", {x: L - 4, y: sy(y) + 3, class: "tick", "text-anchor": "end"}, niceNumber(y)));
  }
  for (let i = 0; i <= 4; i++) {
    const x = x0 + (x1 - x0) * i / 4;
    if (opts.xInteger && !Number.isInteger(x)) continue;
    svg.appendChild(svgEl("text", {x: sx(x), y: H - 8, class: "tick", "text-anchor": "middle"},
                          opts.xFormat ? opts.xFormat(x) : niceNumber(x)));
  }
  if (!all.length) {
    svg.appendChild(svgEl("text", {x: W / 2, y: H / 2, class: "empty", "text-anchor": "middle"}, "no data yet"));
    return;
  }
  for (const s of series) {
    const pts = s.points.filter(p => isFinite(p[1]));
    if (!pts.length) continue;
    svg.appendChild(svgEl("polyline", {points: pts.map(p => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" "),
                                        class: "line", stroke: s.color}));
    const last = pts[pts.length - 1];
    const dot = svgEl("circle", {cx: sx(last[0]), cy: sy(last[1]), r: 2.5, fill: s.color});
    dot.appendChild(svgEl("title", {}, `${s.name}: ${niceNumber(last[1])} at ${niceNumber(last[0])}`));
    svg.appendChild(dot);
  }
  attachHover(svg, series, sx, sy, W, H, T, B);
}

function attachHover(svg, series, sx, sy, W, H, T, B) {
  const cursor = svgEl("line", {y1: T, y2: H - B, class: "cursor", visibility: "hidden"});
  const label = svgEl("text", {y: T + 10, class: "hover", visibility: "hidden"});
  svg.appendChild(cursor);
  svg.appendChild(label);
  const first = series[0].points;
  svg.onmousemove = ev => {
    if (!first.length) return;
    const box = svg.getBoundingClientRect();
    const x = (ev.clientX - box.left) / box.width * W;
    let best = 0;
    for (let i = 1; i < first.length; i++) if (Math.abs(sx(first[i][0]) - x) < Math.abs(sx(first[best][0]) - x)) best = i;
    const px = sx(first[best][0]);
    cursor.setAttribute("x1", px); cursor.setAttribute("x2", px);
    label.setAttribute("x", Math.min(px + 4, W - 120));
    label.textContent = `${niceNumber(first[best][0])}: ` +
      series.map(s => s.points[best] ? niceNumber(s.points[best][1]) : "-").join(" / ");
    cursor.setAttribute("visibility", "visible"); label.setAttribute("visibility", "visible");
  };
  svg.onmouseleave = () => { cursor.setAttribute("visibility", "hidden"); label.setAttribute("visibility", "hidden"); };
}
