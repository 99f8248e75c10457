// kiln debug: the page. Plain JS, no build step, no library: the layout is a layered one by
// topological rank, computed here so that collapsing a name scope only re-lays out the page.
"use strict";

const W = 150, H = 34, GAP = 170, VGAP = 58;
const TEXT_ZOOM = 0.3;  // below this scale node labels are unreadable: boxes only
const PRECISION_COLOURS = {
  fp32: "#dbe8ff", fp16: "#ffe9b3", bf16: "#ffd59e", int8: "#c9ecc9", int4: "#9fdca0",
};
const S = {
  session: null, graphs: null, compare: null, profile: null, exec: null,
  overlay: "none", selected: null, tensor: null, token: 0,
};
const panes = {};

const $ = (selector, root = document) => root.querySelector(selector);
const esc = (text) => String(text).replace(/[&<>"']/g, (c) => (
  { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
const fmt = (x, digits = 4) => (typeof x === "number" ? Number(x.toPrecision(digits)) : String(x));
const ms = (x) => (x >= 1 ? x.toFixed(2) : x.toPrecision(3)) + " ms";

async function api(path, options) {
  const response = await fetch(path, options);
  const data = await response.json();
  if (!response.ok) throw new Error(data.detail || response.statusText);
  return data;
}

function post(path, body) {
  return api(path, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body || {}),
  });
}

function status(text) { $("#status").textContent = text || ""; }

function scopeKey(scope, depth) { return scope.slice(0, depth).join("/"); }

// ---- a graph pane -------------------------------------------------------------------------

class Pane {
  constructor(name, root) {
    this.name = name;
    this.root = root;
    this.svg = $("svg.graph", root);
    this.view = $("g.viewport", root);
    this.t = { x: 0, y: 0, k: 1 };
    this.collapsed = new Set();
    this.linked = new Set();
    this.hits = [];
    this.hitAt = -1;
    this.diverge = null;
    this.bindEvents();
  }

  size() {
    // Measured while the pane is empty or on resize: measuring it full of SVG would force a
    // layout of every node before the page has drawn anything.
    if (!this.measured) this.measured = this.svg.getBoundingClientRect();
    return this.measured;
  }

  setGraph(graph) {
    this.size();
    this.graph = graph;
    this.nodes = graph.nodes;
    this.index = new Map(this.nodes.map((n, i) => [n.id, i]));
    this.tensors = new Set(graph.inputs);
    for (const n of this.nodes) for (const t of n.outputs) this.tensors.add(t);
    this.scopeSize = new Map();
    let deepest = 0;
    for (const n of this.nodes) {
      deepest = Math.max(deepest, n.scope.length);
      for (let d = 1; d <= n.scope.length; d++) {
        const key = scopeKey(n.scope, d);
        this.scopeSize.set(key, (this.scopeSize.get(key) || 0) + 1);
      }
    }
    const depth = $("select.depth", this.root);
    const options = ['<option value="0">all nodes</option>'];
    for (let d = 1; d <= Math.min(deepest, 6); d++) {
      options.push(`<option value="${d}">scopes at depth ${d}</option>`);
    }
    depth.innerHTML = options.join("");
    $(".count", this.root).textContent = `${this.nodes.length} nodes`;
    if (this.nodes.length > 3000) this.collapseAt(Math.min(deepest, 2), false);
    this.layout();
    this.drawn = null;
    this.fit();
  }

  collapseAt(depth, redraw = true) {
    this.collapsed = new Set();
    if (depth > 0) for (const key of this.scopeSize.keys()) {
      if (key.split("/").length === depth) this.collapsed.add(key);
    }
    $("select.depth", this.root).value = String(depth);
    if (redraw) this.redraw();
  }

  unitKey(i) {
    const scope = this.nodes[i].scope;
    for (let d = 1; d <= scope.length; d++) {
      const key = scopeKey(scope, d);
      if (this.collapsed.has(key)) return "g:" + key;
    }
    return "n:" + i;
  }

  // Layered layout: longest-path rank over the visible units (a collapsed scope is one unit),
  // sources pulled down next to their first consumer, then each row ordered by the mean
  // position of what it reads from and spread apart.
  layout() {
    const units = [], byKey = new Map();
    this.unitOf = new Array(this.nodes.length);
    this.nodes.forEach((n, i) => {
      const key = this.unitKey(i);
      let u = byKey.get(key);
      if (!u) {
        u = { key, members: [], preds: new Set(), succs: new Set(), rank: 0, x: 0, y: 0 };
        byKey.set(key, u);
        units.push(u);
      }
      u.members.push(i);
      this.unitOf[i] = u;
    });
    this.nodes.forEach((n, i) => {
      const b = this.unitOf[i];
      for (const j of n.in) {
        const a = this.unitOf[j];
        if (a !== b) { b.preds.add(a); a.succs.add(b); }
      }
    });
    this.rank(units);
    for (const u of units) {
      if (u.preds.size === 0 && u.succs.size > 0) {
        u.rank = Math.max(0, Math.min(...[...u.succs].map((s) => s.rank)) - 1);
      }
    }
    const rows = [];
    for (const u of units) (rows[u.rank] = rows[u.rank] || []).push(u);
    for (const row of rows) if (row) this.placeRow(row);
    this.units = units;
    this.byKey = byKey;
  }

  rank(units) {
    // Kahn's order, lowest first member first; a cycle (possible once scopes are collapsed)
    // is broken at its earliest unit, and its back edge is drawn upwards.
    const left = new Map(units.map((u) => [u, u.preds.size]));
    const ready = units.filter((u) => u.preds.size === 0);
    const placed = new Set();
    let cursor = 0;
    while (placed.size < units.length) {
      let u = ready.shift();
      if (!u) {
        while (placed.has(units[cursor])) cursor++;
        u = units[cursor];
      }
      if (placed.has(u)) continue;
      placed.add(u);
      let r = 0;
      for (const p of u.preds) if (placed.has(p)) r = Math.max(r, p.rank + 1);
      u.rank = r;
      for (const s of u.succs) {
        left.set(s, left.get(s) - 1);
        if (left.get(s) === 0 && !placed.has(s)) insertSorted(ready, s);
      }
    }
  }

  placeRow(row) {
    for (const u of row) {
      const above = [...u.preds].filter((p) => p.rank < u.rank);
      u.want = above.length ? above.reduce((s, p) => s + p.x, 0) / above.length : 0;
    }
    row.sort((a, b) => a.want - b.want || a.members[0] - b.members[0]);
    let previous = -Infinity, wanted = 0, got = 0;
    for (const u of row) {
      u.x = Math.max(u.want, previous + GAP);
      previous = u.x;
      wanted += u.want;
      got += u.x;
    }
    const shift = (wanted - got) / row.length;
    for (const u of row) { u.x += shift; u.y = u.rank * VGAP; }
  }

  // Only what lies in (or near) the view is in the DOM: an SVG text costs the browser more
  // than anything else here, so a graph of thousands of nodes draws as fast as a small one.
  // Panning past the drawn area, or zooming across the text threshold, draws again.
  visible(margin) {
    const box = this.size(), { x, y, k } = this.t;
    const mx = (box.width * margin) / k, my = (box.height * margin) / k;
    return { x0: -x / k - mx, x1: (box.width - x) / k + mx, y0: -y / k - my, y1: (box.height - y) / k + my };
  }

  render() {
    const r = this.visible(0.6);
    const inside = (x0, x1, y0, y1) => x1 >= r.x0 && x0 <= r.x1 && y1 >= r.y0 && y0 <= r.y1;
    this.drawn = { ...r, text: this.t.k >= TEXT_ZOOM };
    const edges = [], boxes = [];
    for (const b of this.units) {
      for (const a of b.preds) {
        const x1 = a.x, y1 = a.y + H, x2 = b.x, y2 = b.y;
        if (!inside(Math.min(x1, x2), Math.max(x1, x2), Math.min(y1, y2), Math.max(y1, y2))) continue;
        const dy = Math.max(18, Math.abs(y2 - y1) / 2);
        edges.push(`M${x1} ${y1}C${x1} ${y1 + dy} ${x2} ${y2 - dy} ${x2} ${y2}`);
      }
      if (inside(b.x - W / 2, b.x + W / 2, b.y, b.y + H)) boxes.push(this.box(b, this.drawn.text));
    }
    this.view.innerHTML = `<path class="edges" d="${edges.join("")}"></path>${boxes.join("")}`;
    this.els = new Map();
    for (const el of this.view.querySelectorAll("g.n")) this.els.set(el.dataset.k, el);
    this.paint();
  }

  stale() {
    const d = this.drawn, r = this.visible(0);
    return !d || (this.t.k >= TEXT_ZOOM) !== d.text
      || r.x0 < d.x0 || r.x1 > d.x1 || r.y0 < d.y0 || r.y1 > d.y1;
  }

  describe(key) {
    const u = this.byKey.get(key);
    if (!u) return "";
    if (key.startsWith("g:")) return `${key.slice(2)}: ${u.members.length} nodes (click to expand)`;
    const n = this.nodes[u.members[0]];
    return `${n.id} (${n.op})`;
  }

  box(u, text) {
    let op, name;
    if (u.key.startsWith("g:")) {
      const scope = u.key.slice(2);
      op = `▸ ${scope.split("/").pop()} (${u.members.length})`;
      name = scope;
    } else {
      const n = this.nodes[u.members[0]];
      op = n.op.split("::").pop();
      name = n.id.split(/[/.]/).slice(-2).join(".");
    }
    const cut = (s, k) => (s.length > k ? s.slice(0, k - 1) + "…" : s);
    const grp = u.key.startsWith("g:") ? " grp" : "";
    const head = `<g class="n${grp}" data-k="${esc(u.key)}" transform="translate(${u.x - W / 2},${u.y})">`
      + `<rect width="${W}" height="${H}" rx="4"></rect><circle class="bp" cx="-7" cy="${H / 2}" r="5"></circle>`;
    if (!text) return head + "</g>";  // too small to read: boxes only
    return head + `<text class="op" x="${W / 2}" y="14">${esc(cut(op, 24))}</text>`
      + `<text class="nm" x="${W / 2}" y="27">${esc(cut(name, 26))}</text></g>`;
  }

  redraw() {
    this.layout();
    this.drawn = null;
    this.apply();
  }

  // ---- classes and colours, without laying out again ----

  paint() {
    if (!this.els) return;
    const sel = S.selected && S.selected.pane === this.name ? S.selected.id : null;
    const hits = new Set(this.hits.map((i) => this.nodes[i].id));
    const values = overlayValues(this.name);
    for (const u of this.units) {
      const el = this.els.get(u.key);
      if (!el) continue;  // outside the drawn area
      const ids = u.members.map((i) => this.nodes[i].id);
      const classes = ["n"];
      if (u.key.startsWith("g:")) classes.push("grp");
      if (ids.includes(sel)) classes.push("sel");
      if (ids.some((id) => this.linked.has(id))) classes.push("link");
      if (ids.some((id) => hits.has(id))) classes.push("hit");
      if (ids.includes(this.diverge)) classes.push("div");
      const run = runState(this.name, ids);
      if (run.ran) classes.push("ran");
      if (run.current) classes.push("cur");
      if (run.breakpoint) classes.push("bp");
      el.setAttribute("class", classes.join(" "));
      el.firstChild.style.fill = values ? overlayColour(values, ids) : "";
    }
  }

  // ---- view: pan, zoom, fit, focus ----

  bindEvents() {
    let drag = null;
    this.svg.addEventListener("mousedown", (e) => {
      drag = { x: e.clientX, y: e.clientY, tx: this.t.x, ty: this.t.y, moved: false };
    });
    window.addEventListener("mousemove", (e) => {
      if (!drag) return;
      const dx = e.clientX - drag.x, dy = e.clientY - drag.y;
      if (Math.abs(dx) + Math.abs(dy) > 3) drag.moved = true;
      if (drag.moved) {
        this.svg.classList.add("panning");
        this.t.x = drag.tx + dx;
        this.t.y = drag.ty + dy;
        this.apply();
      }
    });
    window.addEventListener("mouseup", () => {
      if (drag && drag.moved) this.suppressClick = true;
      drag = null;
      this.svg.classList.remove("panning");
    });
    this.svg.addEventListener("wheel", (e) => {
      e.preventDefault();
      const box = this.svg.getBoundingClientRect();
      const px = e.clientX - box.left, py = e.clientY - box.top;
      const k = Math.min(4, Math.max(0.02, this.t.k * Math.exp(-e.deltaY * 0.0015)));
      this.t.x = px - ((px - this.t.x) * k) / this.t.k;
      this.t.y = py - ((py - this.t.y) * k) / this.t.k;
      this.t.k = k;
      this.apply();
    }, { passive: false });
    this.svg.addEventListener("mouseover", (e) => {
      const el = e.target.closest("g.n");
      $(".hover", this.root).textContent = el ? this.describe(el.dataset.k) : "";
    });
    this.svg.addEventListener("click", (e) => {
      if (this.suppressClick) { this.suppressClick = false; return; }
      const el = e.target.closest("g.n");
      if (!el) return;
      const key = el.dataset.k;
      if (key.startsWith("g:")) this.expand(key.slice(2));
      else select(this.name, this.nodes[Number(key.slice(2))].id);
    });
    $("button.fit", this.root).addEventListener("click", () => this.fit(true));
    $("select.depth", this.root).addEventListener("change", (e) => {
      this.collapseAt(Number(e.target.value));
      this.fit();
    });
    const search = $("input.search", this.root);
    search.addEventListener("input", () => this.search(search.value));
    search.addEventListener("keydown", (e) => { if (e.key === "Enter") this.nextHit(); });
  }

  apply() {
    const { x, y, k } = this.t;
    this.view.setAttribute("transform", `translate(${x},${y}) scale(${k})`);
    if (!this.drawn) this.render();  // a new layout: at once
    else if (this.stale() && !this.pending) {  // panning and zooming: once per frame
      this.pending = requestAnimationFrame(() => { this.pending = 0; if (this.stale()) this.render(); });
    }
  }

  fit(whole = false) {
    // The width of the graph, top first (readable); `whole`: all of it in view.
    const box = this.size();
    const xs = this.units.map((u) => u.x), bottom = Math.max(...this.units.map((u) => u.y)) + H;
    const lo = Math.min(...xs) - W / 2 - 10, hi = Math.max(...xs) + W / 2 + 10;
    let k = Math.min(1, Math.max(0.05, box.width / Math.max(1, hi - lo)));
    if (whole) k = Math.max(0.005, Math.min(k, (box.height - 24) / bottom));
    this.t = { k, x: box.width / 2 - ((lo + hi) / 2) * k, y: 12 };
    this.apply();
  }

  centerOn(id) {
    const i = this.index.get(id);
    if (i === undefined) return;
    const u = this.unitOf[i];
    const box = this.size();
    if (this.t.k < 0.4) this.t.k = 0.8;
    this.t.x = box.width / 2 - u.x * this.t.k;
    this.t.y = box.height / 2 - (u.y + H / 2) * this.t.k;
    this.apply();
  }

  reveal(id) {
    // Expand every collapsed scope holding `id`, then centre on it.
    const scope = this.nodes[this.index.get(id)].scope;
    let changed = false;
    for (let d = 1; d <= scope.length; d++) {
      changed = this.collapsed.delete(scopeKey(scope, d)) || changed;
    }
    if (changed) this.redraw();
    this.centerOn(id);
  }

  expand(key) {
    this.collapsed.delete(key);
    if ((this.scopeSize.get(key) || 0) > 60) {  // a big scope opens one level at a time
      const depth = key.split("/").length + 1;
      for (const k of this.scopeSize.keys()) {
        if (k.startsWith(key + "/") && k.split("/").length === depth) this.collapsed.add(k);
      }
    }
    this.redraw();
  }

  collapse(key) {
    this.collapsed.add(key);
    this.redraw();
  }

  search(text) {
    const q = text.trim().toLowerCase();
    this.hits = [];
    if (q) this.nodes.forEach((n, i) => {
      if (n.id.toLowerCase().includes(q) || n.op.toLowerCase().includes(q)) this.hits.push(i);
    });
    this.hitAt = -1;
    $(".hits", this.root).textContent = q ? `${this.hits.length} found` : "";
    this.paint();
  }

  nextHit() {
    if (!this.hits.length) return;
    this.hitAt = (this.hitAt + 1) % this.hits.length;
    const id = this.nodes[this.hits[this.hitAt]].id;
    this.reveal(id);
    select(this.name, id);
  }
}

function insertSorted(list, unit) {
  let i = list.length;
  while (i > 0 && list[i - 1].members[0] > unit.members[0]) i--;
  list.splice(i, 0, unit);
}

// ---- what ties the panes together: provenance ------------------------------------------------

function counterparts(pane, id) {
  const compiled = panes.compiled;
  if (pane === "compiled") {
    const node = compiled.nodes[compiled.index.get(id)];
    return (node.origin || [id]).filter((o) => panes.original.index.has(o));
  }
  return S.compiledOf.get(id) || [];
}

function runState(pane, ids) {
  const exec = S.exec;
  if (!exec || !panes.compiled.index) return {};  // the compiled graph is not drawn yet
  const position = (id) => panes.compiled.index.get(id);
  const compiled = pane === "compiled" ? ids : ids.flatMap((id) => S.compiledOf.get(id) || []);
  if (!compiled.length) return {};
  return {
    ran: compiled.every((id) => position(id) < exec.position),
    current: exec.position > 0 && compiled.includes(exec.next),  // paused there
    breakpoint: compiled.some((id) => exec.breakpoints.includes(id)),
  };
}

function paintAll() { for (const pane of Object.values(panes)) pane.paint(); paintTimeline(); }

// ---- overlays ------------------------------------------------------------------------------

function overlayValues(pane) {
  if (S.overlay === "latency") return S.profile && S.profile.available ? S.profile.node_ms[pane] : null;
  if (S.overlay === "error") return S.compare && S.compare.available ? S.compare.errors[pane] : null;
  if (S.overlay === "precision") return "precision";
  return null;
}

function overlayColour(values, ids) {
  if (values === "precision") {
    const graph = ids.map((id) => precisionOf(id)).filter(Boolean);
    const kinds = [...new Set(graph.flatMap((p) => p.split("/")))];
    if (!kinds.length) return "";
    return kinds.length === 1 ? PRECISION_COLOURS[kinds[0]] || "#eeeeee" : "#e6c8f0";
  }
  if (S.overlay === "latency") {
    const total = ids.reduce((s, id) => s + (values[id] || 0), 0);
    if (!total) return "";
    const t = Math.sqrt(total / S.maxMs);
    return `rgb(255,${Math.round(245 - 170 * t)},${Math.round(235 - 210 * t)})`;
  }
  const errors = ids.map((id) => values[id]).filter(Boolean);
  if (!errors.length) return "";
  return errors.every((e) => e.ok) ? "#d6f0d0" : "#ff8a65";
}

function precisionOf(id) {
  for (const pane of Object.values(panes)) {
    const i = pane.index ? pane.index.get(id) : undefined;
    if (i !== undefined) return pane.nodes[i].precision;
  }
  return null;
}

function legend() {
  const text = {
    none: "",
    latency: S.profile && S.profile.available
      ? `white → red: 0 → ${ms(S.maxMs)} per node (${S.profile.engine})`
      : (S.profile ? S.profile.why : "profiling…"),
    error: S.compare && S.compare.available
      ? `green: within ${S.compare.budget.text}; orange: beyond; dark red edge: first divergence`
      : (S.compare ? S.compare.why : "comparing…"),
    precision: Object.entries(PRECISION_COLOURS).map(([k]) => k).join(" · ") + " · violet: mixed",
  }[S.overlay];
  $("#legend").textContent = text;
}

// ---- selection and the node panel ---------------------------------------------------------

function select(pane, id, center = false) {
  S.selected = { pane, id };
  const other = pane === "original" ? panes.compiled : panes.original;
  panes[pane].linked = new Set();
  const linked = counterparts(pane, id);
  other.linked = new Set(linked);
  if (center) panes[pane].centerOn(id);
  if (linked.length) other.centerOn(linked[0]);
  paintAll();
  showDetails();
}

async function showDetails() {
  const token = ++S.token;
  if (!S.selected) { showOverview(); return; }
  const { pane, id } = S.selected;
  let node;
  try {
    node = await api(`/api/node?pane=${pane}&name=${encodeURIComponent(id)}`);
  } catch (error) { status(error.message); return; }
  if (token !== S.token) return;
  $("#details").innerHTML = nodeHtml(node);
  $("#details").dataset.node = node.name;
}

const nodeLink = (pane, id) => `<a class="node" data-pane="${pane}" data-id="${esc(id)}">${esc(id)}</a>`;
const tensorLink = (name) => `<a class="tensor" data-name="${esc(name)}">${esc(name)}</a>`;

function nodeHtml(node) {
  const parts = [`<h3>${esc(node.op)} <span class="muted">${esc(node.name)}</span></h3>`];
  if (node.scope.length) {
    const crumbs = node.scope.map((s, i) => `<button data-collapse="${esc(scopeKey(node.scope, i + 1))}" `
      + `data-pane="${node.pane}" title="collapse this scope">${esc(s)}</button>`);
    parts.push(`<div class="crumbs">scope: ${crumbs.join(" / ")}</div>`);
  }
  if (node.pane === "compiled") {
    parts.push(`<h4>original nodes (${node.origin.length})</h4><ul class="origin">`
      + node.origin.map((o) => `<li>${nodeLink("original", o)}</li>`).join("") + "</ul>");
    parts.push(`<div>passes: ${node.passes.length ? esc(node.passes.join(", ")) : '<span class="muted">none (as in the original)</span>'}</div>`);
  }
  if (node.pane === "original") {
    parts.push(`<h4>compiled into</h4>` + (node.compiled.length
      ? "<ul>" + node.compiled.map((c) => `<li>${nodeLink("compiled", c.name)} ${esc(c.op)}`
        + `${c.passes.length ? ` <span class="muted">by ${esc(c.passes.join(", "))}</span>` : ""}</li>`).join("") + "</ul>"
      : '<div class="muted">nothing: removed by a pass</div>'));
  }
  parts.push(`<div>precision: <b>${esc(node.precision || "—")}</b></div>`);
  if (node.compiled.length) {
    parts.push("<div>" + node.compiled.map((c) => `<button class="bp-toggle" data-node="${esc(c.name)}" data-on="${!c.breakpoint}">`
      + `${c.breakpoint ? "○ clear" : "● set"} breakpoint${node.compiled.length > 1 ? " on " + esc(c.name) : ""}</button>`
      + ` <span class="muted">${c.ran ? "ran" : "not run yet"}</span>`).join("<br>") + "</div>");
  }
  parts.push("<h4>tensors</h4><table>" + node.outputs.map((v) => `<tr><td>out</td><td>${tensorLink(v.name)}</td>`
    + `<td>${v.shape ? esc(JSON.stringify(v.shape)) : ""} ${esc(v.dtype || "")}</td></tr>`).join("")
    + node.inputs.filter((v) => v.name).map((v) => `<tr><td>in</td><td>${tensorLink(v.name)}</td>`
    + `<td>${v.shape ? esc(JSON.stringify(v.shape)) : ""} ${esc(v.dtype || "")}</td></tr>`).join("") + "</table>");
  parts.push(errorHtml(node));
  parts.push(kernelHtml(node));
  if (Object.keys(node.attributes).length) {
    parts.push("<h4>attributes</h4><table>" + Object.entries(node.attributes)
      .map(([k, v]) => `<tr><td>${esc(k)}</td><td>${esc(v)}</td></tr>`).join("") + "</table>");
  }
  return parts.join("");
}

function errorHtml(node) {
  if (node.pending.includes("comparison")) return '<h4>error</h4><div class="muted">comparing…</div>';
  if (!node.errors) return "";
  const reference = S.session.reference ? S.session.reference.label : "";
  const head = `<h4>error against ${esc(reference)}</h4>`;
  if (!node.errors.length) return head + '<div class="muted">no compared tensor (fused inside a kernel, or not computed on both sides)</div>';
  const rows = node.errors.map((r) => `<tr><td>${tensorLink(r.tensor)}</td><td>${fmt(r.max_abs)}</td>`
    + `<td>${r.cosine === null ? "—" : fmt(r.cosine, 6)}</td><td class="${r.ok ? "good" : "bad"}">${r.ok ? "ok" : "beyond"}</td></tr>`);
  const first = node.first_divergence ? '<div class="bad">the first divergence: the earliest layer beyond the budget whose inputs still agree, or the lower-precision layer whose error a full-precision layer after it carries beyond</div>' : "";
  return head + first + `<table><tr><th>tensor</th><th>max abs</th><th>cosine</th><th></th></tr>${rows.join("")}</table>`;
}

function kernelHtml(node) {
  if (node.pending.includes("profile")) return '<h4>kernels</h4><div class="muted">profiling…</div>';
  if (!node.kernels) return "";
  const parts = ["<h4>kernels</h4>"];
  if (!node.kernels.length) parts.push('<div class="muted">no kernel ran it (folded away, or inside another)</div>');
  else {
    parts.push("<table><tr><th>kernel</th><th>time</th><th>roofline</th></tr>" + node.kernels.map((k) => {
      const roof = k.efficiency === undefined ? "—"
        : `${fmt(k.achieved_gflops, 3)} of ${fmt(k.roof_gflops, 3)} GFLOP/s (${Math.round(100 * k.efficiency)}%, ${esc(k.bound)}-bound, ${fmt(k.intensity, 3)} FLOP/B)`;
      return `<tr><td>${esc(k.name)}<br><span class="muted">${esc(k.op_type)} · ${esc(k.kernel || "")} · ${esc(k.precision || "")}</span></td>`
        + `<td>${ms(k.median_ms)}<br><span class="muted">${(100 * k.share).toFixed(1)}%</span></td><td>${roof}</td></tr>`;
    }).join("") + "</table>");
  }
  for (const f of node.findings) {
    parts.push(`<div class="finding"><b>${esc(f.title)}</b> (${(100 * f.share).toFixed(0)}% of the time)<br>`
      + `${esc(f.evidence)}<br>→ <code>${esc(f.action)}</code></div>`);
  }
  return parts.join("");
}

function showOverview() {
  const s = S.session, parts = [`<h3>${esc(s.main.label)}</h3>`];
  parts.push(`<div>against: ${s.reference ? esc(s.reference.label) : '<span class="muted">nothing (give --against B)</span>'}</div>`);
  if (S.compare && S.compare.available) {
    const c = S.compare;
    parts.push(`<div>budget: ${esc(c.budget.text)}; ${c.layers.length} layers compared, ${c.diverging} beyond</div>`);
    parts.push(`<div>first divergence: ${c.first_divergence ? nodeLink("original", c.first_divergence) : '<span class="good">none</span>'}</div>`);
  }
  const notes = [...s.notes, ...((S.compare && S.compare.notes) || [])];
  if (notes.length) parts.push("<h4>notes</h4><ul>" + notes.map((n) => `<li>${esc(n)}</li>`).join("") + "</ul>");
  if (S.profile && S.profile.available && S.profile.findings.length) {
    parts.push("<h4>findings</h4>" + S.profile.findings.map((f) => `<div class="finding"><b>${esc(f.title)}</b> `
      + `(${(100 * f.share).toFixed(0)}%): ${f.graph_nodes.slice(0, 5).map((n) => nodeLink("compiled", n)).join(", ")}<br>`
      + `→ <code>${esc(f.action)}</code></div>`).join(""));
  }
  parts.push('<p class="muted">Click a node: its provenance, precision, error, kernels. Click a tensor to inspect it; '
    + "set breakpoints and Run / Step / Continue.</p>");
  $("#details").innerHTML = parts.join("");
}

// ---- tensors -------------------------------------------------------------------------------

async function showTensor(name, index) {
  S.tensor = { name, index };
  const query = (side) => `/api/tensor?name=${encodeURIComponent(name)}&side=${side}`
    + (index !== undefined && index !== null ? `&index=${encodeURIComponent(index)}` : "");
  const sides = S.session.reference ? ["main", "against"] : ["main"];
  let tensors;
  try {
    tensors = await Promise.all(sides.map((side) => api(query(side))));
  } catch (error) { status(error.message); return; }
  if (!S.tensor || S.tensor.name !== name) return;
  const label = { main: S.session.main.label, against: S.session.reference && S.session.reference.label };
  $("#tensor").innerHTML = `<h4>tensor</h4><h3>${esc(name)}</h3><div class="tsides ${sides.length === 1 ? "one" : ""}">`
    + tensors.map((t) => sideHtml(t, label[t.side])).join("") + "</div>";
  $("#tensor").dataset.name = name;
  $("#tensor").scrollIntoView({ block: "nearest" });
}

function sideHtml(t, label) {
  const head = `<div class="tside" data-side="${t.side}"><div class="muted">${esc(label)}</div>`;
  if (!t.available) return head + `<div class="muted" data-why>${esc(t.why)}</div></div>`;
  const stat = (key) => (t.stats[key] === undefined ? ""
    : `<tr><th>${key}</th><td data-stat="${key}" data-value="${esc(String(t.stats[key]))}">${fmt(t.stats[key], 6)}</td></tr>`);
  const rows = [`<tr><th>shape</th><td data-stat="shape">${esc(JSON.stringify(t.shape))}</td></tr>`,
    `<tr><th>dtype</th><td data-stat="dtype">${esc(t.dtype)}</td></tr>`,
    ...["min", "max", "mean", "std"].map(stat)];
  if (t.stats.nan || t.stats.inf) rows.push(`<tr><th>non-finite</th><td class="bad">${t.stats.nan} NaN, ${t.stats.inf} inf</td></tr>`);
  const values = t.slice.values.map((v) => fmt(v, 5)).join(", ") + (t.slice.truncated ? ", …" : "");
  return head + `<table class="stats">${rows.join("")}</table>${histogramSvg(t.histogram)}`
    + `<div class="vals-head">values at <input class="index" data-side="${t.side}" value="${esc(t.slice.index)}" title="numpy indexing, e.g. 0,:,:8"></div>`
    + `<div class="vals" data-shape="${esc(JSON.stringify(t.slice.shape))}">${esc(values)}</div></div>`;
}

function histogramSvg(h) {
  if (!h) return "";
  const top = Math.max(...h.counts), n = h.counts.length;
  const bars = h.counts.map((c, i) => `<rect x="${(i * 100) / n}" y="${60 - (58 * c) / top}" width="${100 / n - 0.3}" height="${(58 * c) / top}"></rect>`);
  return `<svg class="hist" viewBox="0 0 100 60" preserveAspectRatio="none"><title>${n} bins from ${fmt(h.edges[0])} to ${fmt(h.edges[n])}</title>${bars.join("")}</svg>`
    + `<div class="muted">${fmt(h.edges[0])} … ${fmt(h.edges[n])}</div>`;
}

// ---- execution -----------------------------------------------------------------------------

async function execute(action) {
  let state;
  try {
    status(action === "reset" ? "" : `${action}…`);
    state = await post(`/api/exec/${action}`);
  } catch (error) { status(error.message); return; }
  S.exec = state;
  showExec();
  paintAll();
  if (state.next) panes.compiled.centerOn(state.next);
  if (action === "step" && state.ran.length) {
    const last = panes.compiled.nodes[panes.compiled.index.get(state.ran[state.ran.length - 1])];
    if (last.outputs.length) await showTensor(last.outputs[0]);
  } else if (S.tensor) {
    await showTensor(S.tensor.name, S.tensor.index);
  }
  if (S.selected) showDetails();
}

function showExec() {
  const e = S.exec;
  const where = e.done ? "finished" : (e.position ? `paused before ${e.next}` : "not started");
  $("#exec-state").textContent = `${e.position}/${e.total} · ${where}`;
  $("#exec-state").dataset.position = e.position;
  status("");
}

async function toggleBreakpoint(node, on) {
  try {
    S.exec = { ...S.exec, ...(await post("/api/breakpoints", { node, on })) };
  } catch (error) { status(error.message); return; }
  paintAll();
  showDetails();
}

// ---- inputs --------------------------------------------------------------------------------

async function inputsChanged(promise) {
  try {
    const inputs = await promise;
    S.session.inputs = inputs;
  } catch (error) { status(error.message); return; }
  showInputs();
  S.compare = null;
  loadCompare();
  await execute("run");
}

function showInputs() {
  const inputs = S.session.inputs;
  $("#input-source").textContent = inputs.source;
  $("#input-source").title = inputs.tensors.map((t) => `${t.name} ${JSON.stringify(t.shape)} ${t.dtype}`).join("\n");
}

async function upload(file) {
  const body = await file.arrayBuffer();
  const npz = file.name.endsWith(".npz");
  const name = file.name.replace(/\.npy$/, "");
  await inputsChanged(api(npz ? "/api/inputs" : `/api/inputs/${encodeURIComponent(name)}`,
    { method: npz ? "POST" : "PUT", body }));
}

// ---- timeline ------------------------------------------------------------------------------

function renderTimeline() {
  const box = $("#timeline");
  const p = S.profile;
  if (!p || !p.available) {
    $("#timeline-note").textContent = p ? p.why : "profiling…";
    box.innerHTML = "";
    return;
  }
  const spans = p.timeline;
  const end = Math.max(...spans.map((s) => s.start_us + s.dur_us), 1);
  const width = Math.max(box.clientWidth - 4, spans.length * 10);
  const scale = width / end;
  $("#timeline-note").textContent = `${spans.length} kernels of one profiled run (${p.engine}), `
    + `P50 ${ms(p.latency.p50_ms)}; click a kernel for its node and original nodes`;
  box.innerHTML = `<svg width="${width}">` + spans.map((s, i) => {
    const x = s.start_us * scale, w = Math.max(1.5, s.dur_us * scale);
    const hue = (hash(s.op_type) % 12) * 30;
    const label = w > 40 ? `<text x="${x + 2}" y="${20 + (i % 3) * 26}">${esc(s.op_type)}</text>` : "";
    return `<rect data-i="${i}" x="${x}" y="${8 + (i % 3) * 26}" width="${w}" height="22" fill="hsl(${hue},55%,72%)">`
      + `<title>${esc(s.node)} (${esc(s.op_type)}) ${s.dur_us.toFixed(0)} µs → ${esc(s.graph_nodes.join(", "))}; `
      + `${s.original.length} original nodes</title></rect>${label}`;
  }).join("") + "</svg>";
  paintTimeline();
}

function paintTimeline() {
  if (!S.profile || !S.profile.available) return;
  const sel = S.selected;
  for (const rect of document.querySelectorAll("#timeline rect")) {
    const s = S.profile.timeline[Number(rect.dataset.i)];
    const on = sel && (sel.pane === "compiled" ? s.graph_nodes : s.original).includes(sel.id);
    rect.setAttribute("class", on ? "sel" : "");
  }
}

function hash(text) {
  let h = 0;
  for (const c of text) h = (h * 31 + c.charCodeAt(0)) >>> 0;
  return h;
}

// ---- loading -------------------------------------------------------------------------------

async function loadCompare() {
  try { S.compare = await api("/api/compare"); } catch (error) {
    S.compare = { available: false, why: error.message };
  }
  const first = S.compare.available ? S.compare.first_divergence : null;
  panes.original.diverge = first;
  panes.compiled.diverge = S.compare.available ? S.compare.first_compiled : null;
  const link = $("#first-divergence");
  link.hidden = !S.compare.available;
  link.textContent = first ? `first divergence: ${first}` : "no divergence";
  legend();
  paintAll();
  if (!S.selected) showOverview(); else showDetails();
}

async function loadProfile() {
  try { S.profile = await api("/api/profile"); } catch (error) {
    S.profile = { available: false, why: error.message };
  }
  if (S.profile.available) {
    const all = [...Object.values(S.profile.node_ms.compiled), ...Object.values(S.profile.node_ms.original)];
    S.maxMs = Math.max(...all, 1e-9);
  }
  renderTimeline();
  legend();
  paintAll();
  if (!S.selected) showOverview(); else showDetails();
}

function bindPage() {
  window.addEventListener("resize", () => { for (const pane of Object.values(panes)) pane.measured = null; });
  $("#overlay").addEventListener("change", (e) => { S.overlay = e.target.value; legend(); paintAll(); });
  for (const action of ["run", "step", "continue", "reset"]) {
    $(`#${action}`).addEventListener("click", () => execute(action));
  }
  $("#reseed").addEventListener("click", () => inputsChanged(post("/api/inputs/seed", { seed: Number($("#seed").value) })));
  $("#upload").addEventListener("change", (e) => { if (e.target.files[0]) upload(e.target.files[0]); });
  $("#first-divergence").addEventListener("click", (e) => {
    e.preventDefault();
    if (S.compare && S.compare.first_divergence) {
      panes.original.reveal(S.compare.first_divergence);
      select("original", S.compare.first_divergence, true);
    }
  });
  document.body.addEventListener("click", (e) => {
    const node = e.target.closest("a.node");
    if (node) {
      panes[node.dataset.pane].reveal(node.dataset.id);
      select(node.dataset.pane, node.dataset.id, true);
      return;
    }
    const tensor = e.target.closest("a.tensor");
    if (tensor) { showTensor(tensor.dataset.name); return; }
    const bp = e.target.closest("button.bp-toggle");
    if (bp) { toggleBreakpoint(bp.dataset.node, bp.dataset.on === "true"); return; }
    const crumb = e.target.closest("button[data-collapse]");
    if (crumb) { panes[crumb.dataset.pane].collapse(crumb.dataset.collapse); return; }
    const rect = e.target.closest("#timeline rect");
    if (rect) {
      const span = S.profile.timeline[Number(rect.dataset.i)];
      if (span.graph_nodes.length) {
        panes.compiled.reveal(span.graph_nodes[0]);
        select("compiled", span.graph_nodes[0], true);
      }
    }
  });
  document.body.addEventListener("change", (e) => {
    if (e.target.matches("input.index") && S.tensor) showTensor(S.tensor.name, e.target.value);
  });
}

async function main() {
  bindPage();
  panes.original = new Pane("original", $("#pane-original"));
  panes.compiled = new Pane("compiled", $("#pane-compiled"));
  try {
    [S.session, S.graphs] = await Promise.all([api("/api/session"), api("/api/graphs")]);
  } catch (error) { status(error.message); return; }
  S.exec = S.session.exec;
  S.compiledOf = new Map();
  for (const n of S.graphs.compiled.nodes) {
    for (const o of n.origin) {
      if (!S.compiledOf.has(o)) S.compiledOf.set(o, []);
      S.compiledOf.get(o).push(n.id);
    }
  }
  $("#title").textContent = S.session.main.label
    + (S.session.reference ? ` against ${S.session.reference.label}` : "");
  panes.original.setGraph(S.graphs.original);
  panes.compiled.setGraph(S.graphs.compiled);
  showExec();
  showInputs();
  showOverview();
  // Once the frame with both graphs is painted: ms since navigation began (the marker
  // benchmarks/debug_render.py and the browser test wait on).
  requestAnimationFrame(() => setTimeout(() => {
    document.body.dataset.ready = String(Math.round(performance.now()));
  }));
  loadCompare();
  loadProfile();
}

main();
