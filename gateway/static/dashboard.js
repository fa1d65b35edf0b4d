// fairgate live dashboard: polls /admin/state (session cookie) and redraws.
"use strict";

const REFRESH_MS = 1000;
const CLASSES = ["interactive", "default", "batch"];

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v !== undefined && v !== null) node.setAttribute(k, v);
  }
  for (const child of children.flat()) {
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function fmt(x, digits = 1) {
  return x === null || x === undefined ? "–" : Number(x).toFixed(digits);
}

function table(headers, rows, empty) {
  if (!rows.length) return el("p", { class: "empty" }, empty);
  return el("table", {},
    el("thead", {}, el("tr", {}, headers.map((h) => el("th", {}, h)))),
    el("tbody", {}, rows));
}

function queuesPanel(model, queues) {
  const rows = CLASSES.map((c) => {
    const q = queues[c];
    return el("tr", { "data-class": c },
      el("td", {}, c),
      el("td", { "data-metric": "depth", "data-model": model, "data-class": c }, q.depth),
      el("td", { "data-metric": "oldest-wait", "data-class": c }, fmt(q.oldest_wait_s, 2)),
      el("td", { "data-metric": "active-users", "data-class": c }, q.active_users));
  });
  return el("div", { class: "panel" }, el("h3", {}, "Queues by class"),
    table(["class", "queued", "oldest wait s", "users"], rows, ""));
}

function usersPanel(queues) {
  const rows = [];
  for (const c of CLASSES) {
    for (const u of queues[c].users) {
      rows.push(el("tr", { "data-user": u.user },
        el("td", {}, u.user), el("td", {}, c),
        el("td", { "data-metric": "user-queued" }, u.queued),
        el("td", {}, fmt(u.oldest_wait_s, 2)), el("td", {}, fmt(u.score, 0))));
    }
  }
  rows.sort((a, b) => Number(b.children[2].textContent) - Number(a.children[2].textContent));
  return el("div", { class: "panel" }, el("h3", {}, "Top queued users"),
    table(["user", "class", "queued", "oldest wait s", "fairness score"], rows.slice(0, 20),
      "nobody is waiting"));
}

function gateBadges(gates, inTransit) {
  return CLASSES.map((c) => {
    const g = gates[c];
    // "in_transit": the snapshot had room, the requests on their way used it up
    const reason = g.reason === "in_transit" ? `in transit (${inTransit})` : g.reason;
    const label = g.open ? `${c}: open` : `${c}: ${reason}`;
    return el("span", { class: `gate ${g.open ? "open" : "closed"}`, "data-gate": c,
                        "data-reason": g.reason || "" }, label);
  });
}

function backendsPanel(backends) {
  const rows = backends.map((b) => {
    const s = b.snapshot || {};
    const state = !b.healthy ? "unhealthy" : b.drained ? "drained" : "healthy";
    return el("tr", { "data-backend": b.name },
      el("td", {}, b.name),
      el("td", { class: state, "data-metric": "backend-state" }, state),
      el("td", { "data-metric": "backend-waiting" }, s.waiting ?? "–"),
      el("td", { "data-metric": "backend-running" }, s.running ?? "–"),
      el("td", { "data-metric": "backend-in-transit" }, b.in_transit),
      el("td", {}, s.kv_usage === undefined ? "–" : fmt(100 * s.kv_usage, 0) + "%"),
      el("td", {}, fmt(s.tpot_ms, 1)),
      el("td", {}, b.inflight),
      el("td", { "data-metric": "dispatch-rate" }, fmt(b.dispatch_rate_per_s, 1)),
      el("td", {}, gateBadges(b.gates, b.in_transit)));
  });
  return el("div", { class: "panel wide" }, el("h3", {}, "Backends"),
    table(["backend", "state", "waiting", "running", "in transit", "KV", "TPOT ms",
           "in flight", "dispatch/s", "gates"], rows, "no backends"));
}

function sharesPanel(shares) {
  const rows = shares.map((s) => {
    const bar = el("div", { class: "bar" });
    bar.style.width = `${(100 * s.share).toFixed(1)}%`;  // CSSOM: allowed by the page's CSP
    return el("tr", { "data-user": s.user },
      el("td", {}, s.user),
      el("td", { "data-metric": "share" }, fmt(100 * s.share, 1) + "%"),
      el("td", { class: "barcell" }, bar));
  });
  return el("div", { class: "panel" }, el("h3", {}, "Service share (last minutes, this replica)"),
    table(["user", "share", ""], rows, "no service yet"));
}

function batchesPanel(batches) {
  const rows = (batches || []).map((b) => el("tr", { "data-batch": b.id },
    el("td", {}, b.id), el("td", {}, b.user), el("td", {}, b.status),
    el("td", { "data-metric": "progress" }, `${b.completed + b.failed} / ${b.total}`),
    el("td", {}, String(b.failed))));
  return el("section", { class: "model" }, el("h2", {}, "Running batches"),
    el("div", { class: "panel" },
      table(["batch", "owner", "status", "done", "failed"], rows, "no batch running")));
}

function render(state) {
  const root = document.getElementById("models");
  const sections = Object.entries(state.models).map(([model, m]) =>
    el("section", { class: "model", "data-model": model },
      el("h2", {}, model),
      el("div", { class: "grid" },
        backendsPanel(m.backends), queuesPanel(model, m.queues),
        usersPanel(m.queues), sharesPanel(m.service_shares))));
  root.replaceChildren(...sections, batchesPanel(state.batches));
  document.getElementById("meta").textContent =
    `replica ${state.replica_id} · fairness ${state.fairness}`;
}

async function refresh() {
  const status = document.getElementById("status");
  try {
    const resp = await fetch("/admin/state", { credentials: "same-origin", cache: "no-store" });
    if (resp.status === 401 || resp.status === 403) {
      window.location.assign("/dashboard");
      return;
    }
    if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
    render(await resp.json());
    status.textContent = `live · ${new Date().toLocaleTimeString()}`;
    status.className = "status ok";
    document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
  } catch (err) {
    status.textContent = `error: ${err.message}`;
    status.className = "status bad";
  } finally {
    setTimeout(refresh, REFRESH_MS);
  }
}

document.addEventListener("DOMContentLoaded", refresh);
