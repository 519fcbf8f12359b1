// Twinkle's small SVG line charts: axes with round-number ticks, several series overlaid, and a
// hover (or touch) readout of every series' value at the nearest x. No dependencies.
"use strict";
const TW = (() => {
  const NS = "http://www.w3.org/2000/svg";
  const PALETTE = ["#5aa9ff", "#ffa94d", "#51cf66", "#ff6b8b", "#b197fc", "#ffd43b", "#3bc9db", "#f783ac"];
  const hovered = {}; // chart name -> x last hovered, so a refresh keeps the readout where it was

  function esc(s) {
    return String(s ?? "").replace(/[&<>"']/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
  }
  function fmt(v) {
    if (v === null || v === undefined || !isFinite(v)) return "n/a";
    const a = Math.abs(v);
    if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(2).replace("e+", "e");
    return String(+v.toPrecision(4));
  }
  function bytes(n) {
    if (n === null || n === undefined) return "n/a";
    const u = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(n) >= 1024 && i < u.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(1) : n) + " " + u[i];
  }
  function duration(s) {
    if (s === null || s === undefined) return "n/a";
    if (s < 1) return (s * 1000).toFixed(0) + " ms";
    if (s < 120) return s.toFixed(1) + " s";
    if (s < 7200) return (s / 60).toFixed(0) + " min";
    if (s < 172800) return (s / 3600).toFixed(1) + " h";
    return (s / 86400).toFixed(1) + " d";
  }
  // Round-number ticks covering [lo, hi]: steps of 1, 2 or 5 times a power of ten.
  function niceTicks(lo, hi, count, integer) {
    if (!(hi > lo)) { const pad = Math.abs(lo) * 0.1 || 1; lo -= pad; hi += pad; }
    const raw = (hi - lo) / count, mag = Math.pow(10, Math.floor(Math.log10(raw))), r = raw / mag;
    let step = (r <= 1 ? 1 : r <= 2 ? 2 : r <= 5 ? 5 : 10) * mag;
    if (integer) step = Math.max(1, Math.round(step));
    const start = Math.floor(lo / step) * step, end = Math.ceil(hi / step) * step, ticks = [];
    for (let v = start; v <= end + step * 1e-9; v += step) ticks.push(+v.toPrecision(12));
    return {lo: start, hi: end, ticks};
  }
  function el(tag, attrs, parent) {
    const e = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (parent) parent.appendChild(e);
    return e;
  }
  // spec: {name, title, series: [{label, color, points: [{step, value}]}], xlabel, format}
  function chart(box, spec) {
    const format = spec.format || fmt, W = Math.max(box.clientWidth || 320, 240), H = spec.height || 200;
    const M = {l: 56, r: 12, t: 10, b: 30}, pw = W - M.l - M.r, ph = H - M.t - M.b;
    const all = spec.series.flatMap(s => s.points);
    box.innerHTML = "";
    box.classList.add("chart");
    const head = document.createElement("div");
    head.className = "chart-head";
    const last = spec.series.map(s => s.points.length ? s.points[s.points.length - 1].value : null);
    head.innerHTML = `<span class="chart-title">${esc(spec.title)}</span><span class="chart-last">${
      spec.series.length === 1 ? esc(format(last[0])) : ""}</span>`;
    box.appendChild(head);
    const svg = el("svg", {viewBox: `0 0 ${W} ${H}`, width: W, height: H, "data-curve": spec.name,
      "data-points": spec.series.length ? spec.series[0].points.length : 0, role: "img", "aria-label": spec.title});
    box.appendChild(svg);
    if (!all.length) {
      el("text", {x: W / 2, y: H / 2, class: "empty", "text-anchor": "middle"}, svg).textContent = "no points yet";
      return;
    }
    const xs = all.map(p => p.step), ys = all.map(p => p.value);
    const X = niceTicks(Math.min(...xs), Math.max(...xs), Math.max(2, Math.floor(pw / 70)), true);
    const Y = niceTicks(Math.min(...ys), Math.max(...ys), Math.max(2, Math.floor(ph / 40)), false);
    const sx = x => M.l + pw * (x - X.lo) / (X.hi - X.lo), sy = y => M.t + ph - ph * (y - Y.lo) / (Y.hi - Y.lo);
    const axis = el("g", {class: "axis"}, svg);
    for (const t of Y.ticks) {
      el("line", {x1: M.l, x2: M.l + pw, y1: sy(t), y2: sy(t), class: "gl"}, axis);
      el("text", {x: M.l - 6, y: sy(t) + 4, "text-anchor": "end", class: "tick y"}, axis).textContent = format(t);
    }
    for (const t of X.ticks) {
      el("line", {x1: sx(t), x2: sx(t), y1: M.t + ph, y2: M.t + ph + 4, class: "tickmark"}, axis);
      el("text", {x: sx(t), y: M.t + ph + 17, "text-anchor": "middle", class: "tick x"}, axis).textContent = t;
    }
    el("line", {x1: M.l, x2: M.l + pw, y1: M.t + ph, y2: M.t + ph, class: "frame"}, axis);
    el("line", {x1: M.l, x2: M.l, y1: M.t, y2: M.t + ph, class: "frame"}, axis);
    el("text", {x: M.l + pw, y: H - 2, "text-anchor": "end", class: "xlabel"}, axis).textContent = spec.xlabel || "step";
    spec.series.forEach((s, i) => {
      const color = s.color || PALETTE[i % PALETTE.length];
      const pts = s.points.map(p => sx(p.step).toFixed(1) + "," + sy(p.value).toFixed(1)).join(" ");
      el("polyline", {points: pts, fill: "none", stroke: color, "stroke-width": 2, "stroke-linejoin": "round",
        "data-label": s.label}, svg);
      if (s.points.length === 1) el("circle", {cx: sx(s.points[0].step), cy: sy(s.points[0].value), r: 3, fill: color}, svg);
    });
    const cursor = el("line", {y1: M.t, y2: M.t + ph, class: "cursor", visibility: "hidden"}, svg);
    const dots = spec.series.map((s, i) => el("circle", {r: 4, fill: s.color || PALETTE[i % PALETTE.length],
      visibility: "hidden", class: "dot"}, svg));
    const tip = document.createElement("div");
    tip.className = "tip";
    box.appendChild(tip);
    const steps = [...new Set(xs)].sort((a, b) => a - b);
    function show(x) {
      const step = steps.reduce((best, s) => Math.abs(s - x) < Math.abs(best - x) ? s : best, steps[0]);
      hovered[spec.name] = step;
      cursor.setAttribute("x1", sx(step)); cursor.setAttribute("x2", sx(step)); cursor.setAttribute("visibility", "visible");
      const rows = [], ys = [];
      spec.series.forEach((s, i) => {
        const p = s.points.find(q => q.step === step);
        dots[i].setAttribute("visibility", p ? "visible" : "hidden");
        if (!p) return;
        ys.push(sy(p.value));
        dots[i].setAttribute("cx", sx(p.step)); dots[i].setAttribute("cy", sy(p.value));
        rows.push(`<div><i style="background:${s.color || PALETTE[i % PALETTE.length]}"></i>${esc(s.label)}: <b>${esc(format(p.value))}</b></div>`);
      });
      tip.innerHTML = `<div class="tip-x">${esc(spec.xlabel || "step")} ${step}</div>` + rows.join("");
      tip.style.display = "block";
      const cx = sx(step) / W * box.clientWidth;  // beside the cursor, on whichever side it fits
      const left = cx + 12 + tip.offsetWidth <= box.clientWidth ? cx + 12 : cx - 12 - tip.offsetWidth;
      tip.style.left = Math.max(left, 0) + "px";
      // above or below the plot's middle, whichever half the hovered points are not in
      const sr = svg.getBoundingClientRect(), br = box.getBoundingClientRect(), k = sr.height / H;
      const high = ys.reduce((a, b) => a + b, 0) / Math.max(ys.length, 1) < M.t + ph / 2;
      tip.style.top = (sr.top - br.top + (high ? (M.t + ph) * k - tip.offsetHeight - 4 : M.t * k + 4)) + "px";
    }
    function hide() {
      delete hovered[spec.name];
      tip.style.display = "none"; cursor.setAttribute("visibility", "hidden");
      dots.forEach(d => d.setAttribute("visibility", "hidden"));
    }
    const toX = ev => {
      const r = svg.getBoundingClientRect();
      return X.lo + (((ev.clientX - r.left) / r.width) * W - M.l) / pw * (X.hi - X.lo);
    };
    svg.addEventListener("pointermove", ev => show(toX(ev)));
    svg.addEventListener("pointerdown", ev => show(toX(ev)));
    svg.addEventListener("pointerleave", hide);
    if (hovered[spec.name] !== undefined) show(hovered[spec.name]);
  }
  function legend(box, series) {
    box.innerHTML = series.map((s, i) => `<span class="key"><i style="background:${s.color || PALETTE[i % PALETTE.length]}"></i>${esc(s.label)}</span>`).join("");
  }
  return {chart, legend, esc, fmt, bytes, duration, PALETTE};
})();
