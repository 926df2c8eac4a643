// The fleet page: polls /fleet/snapshot (services/fleetview) and renders it. Every value is set
// with textContent (process ids and errors come from Redis: never parsed as HTML).
"use strict";
const REFRESH_MS = 2000;
const KEY_STORE = "mmfleet-api-key";

function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else if (k.startsWith("data-")) e.setAttribute(k, v); else e[k] = v;
  }
  for (const k of kids) e.append(k instanceof Node ? k : document.createTextNode(String(k)));
  return e;
}
const dash = "–";
function secs(s) {
  if (s === null || s === undefined) return dash;
  if (s < 1e-3) return (s * 1e6).toFixed(0) + " µs";
  if (s < 1) return (s * 1e3).toFixed(s < 0.01 ? 2 : 1) + " ms";
  return s.toFixed(2) + " s";
}
function q3(q) { return q && q.count > 0 ? [q.p50, q.p90, q.p99].map(secs).join(" / ") : dash; }
function num(x, digits) {
  if (x === null || x === undefined) return dash;
  return x.toLocaleString(undefined, { maximumFractionDigits: digits === undefined ? 1 : digits });
}
function bytes(b) {
  if (b === null || b === undefined) return dash;
  const u = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0;
  while (Math.abs(b) >= 1024 && i < u.length - 1) { b /= 1024; i++; }
  return b.toFixed(i ? 1 : 0) + " " + u[i];
}
function pct(r) { return r === null || r === undefined ? dash : (r * 100).toFixed(1) + " %"; }
function pairs(obj, fmt) {
  const e = Object.entries(obj || {});
  return e.length ? e.map(([k, v]) => k + ": " + (fmt || num)(v)).join("  ") : dash;
}
function ago(s) { return s < 90 ? s.toFixed(0) + " s" : s < 5400 ? (s / 60).toFixed(0) + " min" : (s / 3600).toFixed(1) + " h"; }
function field(card, name, text) { document.querySelector(`#${card} [data-field="${name}"]`).textContent = text; }

function renderStages(snap) {
  const body = document.querySelector("#stages tbody");
  body.replaceChildren(...snap.stages.map(s => {
    const lag = el("td", { "data-field": "lag" });
    const parts = Object.entries(s.lag);
    if (!parts.length) lag.append(dash);
    for (const [p, n] of parts) lag.append(el("span", { class: "lag" + (n > 0 ? " hot" : "") }, `p${p}:${n}`));
    const workers = s.workers_up + (s.workers_down ? ` (+${s.workers_down} down)` : "");
    return el("tr", { "data-stage": s.stage },
      el("td", {}, s.stage), el("td", { class: "num", "data-field": "workers_up" }, workers),
      el("td", { class: "num", "data-field": "records_total" }, num(s.records_total, 0)),
      el("td", { class: "num", "data-field": "records_per_s" }, num(s.records_per_s, 2)), lag,
      el("td", { class: "num", "data-field": "queue_wait" }, q3(s.queue_wait)),
      el("td", { class: "num", "data-field": "transfer" }, q3(s.transfer)),
      el("td", { class: "num", "data-field": "compute" }, q3(s.compute)));
  }));
}

function renderHist(id, h) {
  const box = document.getElementById(id);
  const max = Math.max(1, ...h.counts);
  box.replaceChildren(...h.counts.map((c, i) => el("div", { class: "col", title: `≤ ${h.bounds[i]} s: ${c}` },
    Object.assign(el("div", { class: "b" }), { style: `height:${(80 * c / max).toFixed(1)}%` }),
    el("div", { class: "l" }, h.bounds[i]))));
  let q = box.nextElementSibling;
  if (!q) { q = el("div", { class: "hist-q" }); box.after(q); }
  q.textContent = `${num(h.quantiles.count, 0)} in the window · p50 / p90 / p99 ${q3(h.quantiles)}`;
  box.setAttribute("data-count", String(h.quantiles.count));
}

function renderProcesses(snap) {
  const body = document.querySelector("#processes tbody");
  body.replaceChildren(...snap.processes.map(p => el("tr", { class: p.state, "data-process": p.id, "data-state": p.state },
    el("td", {}, p.id), el("td", {}, p.kind === "gateway" ? "gateway" : p.stages.join(", ")),
    el("td", {}, el("span", { class: "state " + p.state }, p.state)), el("td", {}, p.host),
    el("td", { class: "num" }, p.pid), el("td", { class: "num" }, ago(p.up_s)),
    el("td", { class: "num" }, bytes(p.pool_used_bytes)), el("td", {}, p.error || ""))));
}

function render(snap) {
  renderStages(snap);
  const g = snap.gateway;
  field("requests", "requests_per_s", num(g.requests_per_s, 2));
  field("requests", "inflight", num(g.inflight, 0));
  field("requests", "by_status", pairs(g.requests_by_status, v => num(v, 0)));
  field("requests", "rejections", pairs(g.rejections, v => num(v, 0)));
  field("requests", "e2e", q3(g.e2e));
  renderHist("ttft", g.ttft); renderHist("itl", g.itl);
  const c = snap.cache;
  field("cache", "hit_rate", pct(c.hit_rate));
  field("cache", "hits_misses", `${num(c.hits, 0)} / ${num(c.misses, 0)}`);
  field("cache", "by_source", pairs(c.hits_by_source, v => num(v, 0)));
  field("cache", "pool_bytes", pairs(c.pool_bytes, bytes));
  field("cache", "encoder_items", num(c.encoder_items_total, 0));
  const r = snap.routing;
  field("routing", "kv_hit_rate", pct(r.kv_hit_rate));
  field("routing", "decisions", pairs(r.decisions, v => num(v, 0)));
  field("routing", "prefix_hit_rate", `${pct(r.prefix_hit_rate)} (${num(r.prefix_blocks_hit, 0)} of ${num(r.prefix_blocks_hit + r.prefix_blocks_computed, 0)} blocks)`);
  const n = snap.nixl;
  field("nixl", "rates", `${bytes(n.in_bytes_per_s)}/s / ${bytes(n.out_bytes_per_s)}/s`);
  field("nixl", "totals", `${bytes(n.in_bytes_total)} in · ${bytes(n.out_bytes_total)} out`);
  field("nixl", "pool", `${bytes(n.pool_used_bytes)} of ${bytes(n.pool_capacity_bytes)}`);
  field("nixl", "transfer", q3(n.transfer));
  document.getElementById("pool-bar").style.width =
    (n.pool_capacity_bytes ? Math.min(100, 100 * n.pool_used_bytes / n.pool_capacity_bytes) : 0).toFixed(1) + "%";
  renderProcesses(snap);
  const status = document.getElementById("status");
  const up = snap.processes.filter(p => p.state === "up").length;
  status.textContent = `${up} of ${snap.processes.length} processes up · window ${snap.window_s} s, rates over ${snap.rate_window_s} s · ` +
    new Date(snap.taken_unix_ms).toLocaleTimeString() + (snap.problems.length ? " · " + snap.problems.join("; ") : "");
  status.className = snap.problems.length ? "bad" : "";
  document.body.setAttribute("data-updated", String(snap.taken_unix_ms));
}

async function poll() {
  const status = document.getElementById("status");
  try {
    const key = sessionStorage.getItem(KEY_STORE);
    const resp = await fetch("/fleet/snapshot", { headers: key ? { Authorization: "Bearer " + key } : {}, cache: "no-store" });
    if (resp.status === 401) {
      const entered = window.prompt("API key for this fleet (kept for this tab only)");
      if (entered) sessionStorage.setItem(KEY_STORE, entered.trim());
      status.textContent = "this gateway wants an API key"; status.className = "bad";
    } else if (!resp.ok) {
      status.textContent = `snapshot failed: HTTP ${resp.status}`; status.className = "bad";
    } else {
      render(await resp.json());
    }
  } catch (err) {
    status.textContent = "gateway unreachable: " + err; status.className = "bad";
  }
  setTimeout(poll, REFRESH_MS);
}
poll();
