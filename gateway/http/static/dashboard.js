// fairgate live dashboard: polls /admin/state (session cookie) and redraws; charts the
// last 15 minutes in inline SVG (no library); drains, undrains and cancels after a
// confirmation, sending the session's CSRF token.
"use strict";

const REFRESH_MS = 1000;
const CLASSES = ["interactive", "default", "batch"];
const SVG = "http://www.w3.org/2000/svg";
const CHART_W = 360;
const CHART_H = 110;
const PAD = { left: 38, right: 6, top: 6, bottom: 16 };
let csrfToken = null;  // from /admin/state: the page's writes send it as X-CSRF-Token

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

// headers: a label, or [label, what it means] (shown as the column's tooltip)
function table(headers, rows, empty) {
  if (!rows.length) return el("p", { class: "empty" }, empty);
  const th = (h) => (Array.isArray(h) ? el("th", { title: h[1] }, h[0]) : el("th", {}, h));
  return el("table", {},
    el("thead", {}, el("tr", {}, headers.map(th))),
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
    table(["class", ["queued", "requests waiting in fairgate's queue (every replica)"],
           ["oldest wait s", "how long the oldest queued request has waited"],
           ["users", "users with a queued request"]], rows, ""));
}

function actionButton(action, label, attrs) {
  return el("button", { type: "button", class: "action", "data-action": action, ...attrs },
    label);
}

function usersPanel(queues) {
  const rows = [];
  for (const c of CLASSES) {
    for (const u of queues[c].users) {
      const cancel = u.oldest_request_id ? actionButton("cancel", "cancel oldest",
        { "data-request": u.oldest_request_id, "data-label": `${u.user}'s oldest ${c} request` })
        : "";
      rows.push(el("tr", { "data-user": u.user },
        el("td", {}, u.user), el("td", {}, c),
        el("td", { "data-metric": "user-queued" }, u.queued),
        el("td", {}, fmt(u.oldest_wait_s, 2)), el("td", {}, fmt(u.score, 0)),
        el("td", {}, cancel)));
    }
  }
  rows.sort((a, b) => Number(b.children[2].textContent) - Number(a.children[2].textContent));
  return el("div", { class: "panel" }, el("h3", {}, "Top queued users"),
    table(["user", "class", "queued", "oldest wait s",
           ["fairness score", "the user's virtual service counter: the lowest is served next"],
           ""], rows.slice(0, 20),
      "nobody is waiting"));
}

function gateBadges(gates, inTransit) {
  return CLASSES.map((c) => {
    const g = gates[c];
    // "in_transit": the snapshot had room, the requests on their way used it up
    const reason = g.reason === "in_transit" ? `in transit (${inTransit})` : g.reason;
    const label = g.open ? `${c}: open` : `${c}: ${reason}`;
    return el("span", { class: `gate ${g.open ? "open" : "closed"}`, "data-gate": c,
                        "data-reason": g.reason || "", title: GATE_REASONS[g.reason || "open"] || "" },
      label);
  });
}

const GATE_REASONS = {
  open: "fairgate may dispatch this class to the backend now",
  in_transit: "the room the last snapshot showed is taken by requests on their way",
  waiting: "vLLM's waiting queue is at this class's bound",
  tpot: "streaming is slower than this class's TPOT bound",
  kv: "KV cache use is above this class's bound",
  stale: "no fresh /metrics snapshot: the backend is not scraped or does not answer",
  drained: "an operator drained it: no new requests go to it",
  prefill_tokens: "the prompt tokens sent and not yet prefilled fill this class's budget",
};

function plural(n, noun) {
  // "1 free slot", "3 free slots"
  return `${n} ${noun}${n === 1 ? "" : "s"}`;
}

function pacingCell(pacing) {
  // adaptive pacing: how many of each class may wait at the backend, why it last moved,
  // and the free batch slots the latest snapshot's burst may fill too (they do not wait)
  // (the reason on hover: the cell keeps one line per class)
  return CLASSES.map((c) => el("div", { "data-pacing": c, "data-reason": pacing[c].reason,
                                        title: `last moved: ${pacing[c].reason}` },
    `${c}: ${fmt(pacing[c].allowance, 1)}` +
    (pacing[c].free_slots ? ` + ${plural(pacing[c].free_slots, "free slot")}` : "")));
}

function waitingCell(s) {
  // vLLM's waiting queue: those beyond the batch's free slots wait for a running request
  // to finish; the rest entered a free slot and start at the next engine step
  if (s.waiting === undefined) return "–";
  const entering = s.waiting - (s.waiting_queued ?? s.waiting);
  return [
    el("div", { "data-metric": "backend-waiting-queued" }, `${s.waiting_queued ?? "–"} queued`),
    el("div", { "data-metric": "backend-waiting-entering" }, `${entering} entering`),
  ];
}

function pct(x) {
  return x === null || x === undefined ? "–" : fmt(100 * x, 0) + "%";
}

function prefixCell(b) {
  // prefix cache: vLLM's recent hit rate (its counters) beside the prefix index's
  // prediction at dispatch, then this replica's dispatches by reason
  const p = b.prefix_cache || {};
  const reasons = Object.entries(b.dispatch_reasons || {}).sort();
  return [
    el("div", { "data-metric": "prefix-hit", title: "vLLM's prefix cache hit rate, recent window" },
      `vLLM ${pct(p.hit_ratio)}`),
    el("div", { "data-metric": "prefix-predicted",
                title: "the hit rate fairgate's prefix index predicted at dispatch" },
      `index ${pct(p.predicted_hit_ratio)}`),
    ...reasons.map(([r, n]) => el("div", { "data-reason-count": r,
      title: `this replica's dispatches here chosen by ${r === "load" ? "least load" : r}` },
      `${r}: ${n}`)),
  ];
}

function prefillCell(b) {
  // length-aware pool (the prompt lengths it takes) and the prefill-token gate: the
  // uncached prompt tokens dispatched there and maybe not yet scheduled
  const span = b.prompt_tokens || {};
  const range = span.max === null || span.max === undefined
    ? (span.min ? `≥ ${span.min}` : "any length") : `${span.min}–${span.max}`;
  const p = b.prefill || {};
  return [
    el("div", { "data-metric": "prompt-range",
                title: "the estimated prompt lengths (tokens) this backend takes" },
      `${b.pool ? b.pool + ": " : ""}${range}`),
    el("div", { "data-metric": "pending-prefill",
                title: "prompt tokens dispatched here and maybe not yet prefilled" },
      `${p.pending_tokens ?? "–"} tok pending`),
  ];
}

function loraCell(b) {
  // LoRA adapters resident here (docs/adapters.md), those with live requests marked *
  const l = b.lora;
  if (!l) return [el("div", { "data-metric": "lora" }, "–")];
  const names = l.resident.map((a) => (l.active.includes(a) ? `${a}*` : a)).join(", ");
  const slots = l.slots === null ? "" : ` (${l.resident.length}/${l.slots} slots)`;
  return [el("div", { "data-metric": "lora",
                      title: "resident adapters; * with live requests; of vLLM's --max-loras" },
    `${names || "none"}${slots}`)];
}

const ORIGINS = {
  config: "in the config file",
  admin: "added with POST /admin/backends",
  dns: "found by a DNS name (discovery)",
};

function nameCell(b) {
  // where the backend comes from: backends added at runtime appear and leave here
  return [el("div", {}, b.name),
    el("div", { class: "origin", "data-metric": "backend-origin", title: ORIGINS[b.origin] || "" },
      b.origin || "config")];
}

function drainCell(b) {
  // a drain with migrate: when this backend's running streams move (every replica's), and
  // how many of this replica's run there
  const running = el("div", { "data-metric": "running-here" }, `${b.running ?? 0} running here`);
  if (b.leaving_since) {  // removed: drained until nothing runs there, then gone
    return [el("div", { "data-metric": "leaving" }, "leaving: removed once idle"), running];
  }
  if (b.drained) {
    const when = b.migrate_at ? new Date(b.migrate_at * 1000).toLocaleTimeString() : "";
    return [actionButton("undrain", "undrain", { "data-backend": b.name }),
      el("div", { "data-metric": "migrate-at" }, when ? `streams move at ${when}` : ""), running];
  }
  return [actionButton("drain", "drain", { "data-backend": b.name }),
    actionButton("migrate", "drain and move streams", { "data-backend": b.name }), running];
}

function backendsPanel(backends) {
  const rows = backends.map((b) => {
    const s = b.snapshot || {};
    const state = b.leaving_since ? "leaving" : !b.healthy ? "unhealthy"
      : b.drained ? "drained" : "healthy";
    return el("tr", { "data-backend": b.name },
      el("td", {}, ...nameCell(b)),
      el("td", { class: state, "data-metric": "backend-state" }, state),
      el("td", { "data-metric": "backend-waiting" }, s.waiting ?? "–"),
      el("td", {}, waitingCell(s)),
      el("td", { "data-metric": "backend-running" }, s.running ?? "–"),
      el("td", { "data-metric": "backend-in-transit" }, b.in_transit),
      el("td", {}, s.kv_usage === undefined ? "–" : fmt(100 * s.kv_usage, 0) + "%"),
      el("td", {}, fmt(s.tpot_ms, 1)),
      el("td", {}, b.inflight),
      el("td", { "data-metric": "dispatch-rate" }, fmt(b.dispatch_rate_per_s, 1)),
      el("td", {}, gateBadges(b.gates, b.in_transit)),
      el("td", {}, pacingCell(b.pacing)),
      el("td", {}, prefixCell(b)),
      el("td", {}, prefillCell(b)),
      el("td", {}, ...loraCell(b)),
      el("td", {}, ...drainCell(b)));
  });
  return el("div", { class: "panel wide" }, el("h3", {}, "Backends"),
    table([["backend", "its name and origin: config (the file), admin (POST /admin/backends) or dns (discovery)"],
           "state",
           ["waiting", "vLLM's num_requests_waiting (latest snapshot)"],
           ["of which", "queued: waiting for a running request to end; entering: start at the next engine step"],
           ["running", "vLLM's num_requests_running"],
           ["in transit", "dispatched since the snapshot, not yet seen by vLLM"],
           ["KV", "vLLM's KV cache usage"], ["TPOT ms", "time per output token, recent window"],
           ["in flight", "dispatched by fairgate and not finished (every replica)"],
           ["dispatch/s", "this replica's dispatches, last 10 s"],
           ["gates", "may fairgate dispatch each class here now? hover a badge for why not"],
           ["pacing allowance", "how many of each class may wait at vLLM (adaptive pacing); hover a line for why it last moved"],
           ["prefix cache", "vLLM's hit rate, the prefix index's prediction, dispatches by reason"],
           ["prompts, pending prefill", "the prompt lengths it takes; prompt tokens not yet prefilled"],
           ["LoRA adapters", "resident adapters (* with live requests) and vLLM's adapter slots"],
           ""], rows,
          "no backends"));
}

function sharesPanel(shares, ratios) {
  // vs weight: served ÷ entitled share of a backlogged user (fairgate_share_ratio)
  const owed = (ratios && ratios.users) || {};
  const listed = new Set(shares.map((s) => s.user));
  const all = shares.concat(Object.keys(owed).filter((u) => !listed.has(u))
    .map((u) => ({ user: u, share: 0 })));
  const rows = all.map((s) => {
    const bar = el("div", { class: "bar" });
    bar.style.width = `${(100 * s.share).toFixed(1)}%`;  // CSSOM: allowed by the page's CSP
    return el("tr", { "data-user": s.user },
      el("td", {}, s.user),
      el("td", { "data-metric": "share" }, fmt(100 * s.share, 1) + "%"),
      el("td", { "data-metric": "share_ratio" },
        s.user in owed ? fmt(owed[s.user], 2) + "×" : "–"),
      el("td", { class: "barcell" }, bar));
  });
  return el("div", { class: "panel" },
    el("h3", {}, "Service share (decayed, all replicas)"),
    table(["user", ["share", "of the service (tokens, weighted) every replica gave, decayed"],
           ["vs weight", "served share ÷ the share its weight entitles it to, while backlogged (1 = fair)"],
           ""], rows, "no service yet"));
}

function movesPanel(moves) {
  // continued answers (failover, drain, preempt) and preemptions, this replica's counts
  const reasons = (moves && moves.continuations) || {};
  const rows = Object.entries(reasons).map(([reason, r]) => el("tr", { "data-reason": reason },
    el("td", {}, reason), el("td", { "data-metric": "continued" }, fmt(r.continued || 0, 0)),
    el("td", { "data-metric": "failed" }, fmt(r.failed || 0, 0)),
    el("td", { "data-metric": "recomputed" }, fmt(r.recomputed_tokens || 0, 0))));
  const preempted = Object.entries((moves && moves.preempted) || {})
    .map(([what, n]) => `${what}: ${fmt(n, 0)}`).join(" · ");
  // preempted answers by model, class and user (top users, rest: other)
  const users = Object.entries((moves && moves.preempted_users) || {}).map(([what, u]) =>
    el("tr", { "data-preempted": what }, el("td", {}, what),
      el("td", { "data-metric": "preemptions" }, fmt(u.preemptions || 0, 0)),
      el("td", { "data-metric": "preempted-tokens" }, fmt(u.tokens || 0, 0))));
  return el("section", { class: "model" }, el("h2", {}, "Continued answers and preemption"),
    el("div", { class: "panel" },
      table(["reason", "continued", "failed", "tokens sent again"], rows,
            "no answer continued yet"),
      el("p", { class: "meta", "data-metric": "preempted" },
         `preempted (this replica): ${preempted || "none"}`),
      table(["model · class · user", "preempted",
             ["tokens sent again", "prompt plus generated tokens the preempted answers' continuations recompute"]],
            users, "no answer preempted yet")));
}

function batchesPanel(batches) {
  const rows = (batches || []).map((b) => el("tr", { "data-batch": b.id },
    el("td", {}, b.id), el("td", {}, b.user), el("td", {}, b.status),
    el("td", { "data-metric": "progress" }, `${b.completed + b.failed} / ${b.total}`),
    el("td", {}, String(b.failed))));
  return el("section", { class: "model" }, el("h2", {}, "Running batches"),
    el("div", { class: "panel" },
      table(["batch", "owner", "status", ["done", "lines answered (completed + failed) / lines"],
             ["failed", "lines answered with an error (in the error file)"]], rows,
            "no batch running")));
}

function usagePanel(usage) {
  if (!usage) return el("section", { class: "model" });
  const counts = (r) => [el("td", { "data-metric": "tokens" }, String(r.total_tokens)),
    el("td", {}, String(r.requests)), el("td", { "data-metric": "errors" }, String(r.errors)),
    el("td", { "data-metric": "cancelled" }, String(r.cancelled ?? 0))];
  const heads = [["tokens", "prompt + completion tokens today"], "requests",
    ["errors", "requests that failed (the backend or fairgate)"],
    ["cancelled", "requests their caller ended: a client that hung up, a cancelled batch's lines"]];
  const tenants = usage.tenants.map((r) => el("tr", { "data-tenant": r.tenant },
    el("td", {}, r.tenant), ...counts(r)));
  const users = usage.users.map((r) => el("tr", { "data-usage-user": r.user },
    el("td", {}, r.user), el("td", {}, r.tenant), ...counts(r)));
  const budgets = usage.budgets.map((b) => {
    const bar = el("div", { class: "bar" });
    bar.style.width = `${Math.min(100, (100 * b.used) / b.limit).toFixed(1)}%`;
    return el("tr", { "data-budget": `${b.tenant}/${b.period}` },
      el("td", {}, b.tenant), el("td", {}, b.period),
      el("td", { "data-metric": "used" }, `${b.used} / ${b.limit}`),
      el("td", { class: "barcell" }, bar));
  });
  return el("section", { class: "model", id: "usage" }, el("h2", {}, `Usage today (${usage.day}, UTC)`),
    el("div", { class: "grid" },
      el("div", { class: "panel" }, el("h3", {}, "Top tenants"),
        table(["tenant", ...heads], tenants, "no usage today")),
      el("div", { class: "panel" }, el("h3", {}, "Top users"),
        table(["user", "tenant", ...heads], users, "no usage today")),
      el("div", { class: "panel" }, el("h3", {}, "Tenant budgets"),
        table(["tenant", "period", "used", ""], budgets, "no tenant budgets"))));
}

// ---------------------------------------------------------------- history charts (SVG)

function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  for (const child of children.flat()) {
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

// series: [{name, points: [[t, value|null], …]}]; a null value breaks the line
function chart(id, title, series, now, windowS, unit, hint) {
  const values = series.flatMap((s) => s.points.map((p) => p[1])).filter((v) => v !== null);
  const top = Math.max(...values, 0) || 1;
  const w = CHART_W - PAD.left - PAD.right;
  const h = CHART_H - PAD.top - PAD.bottom;
  const x = (t) => PAD.left + w * Math.min(1, Math.max(0, 1 - (now - t) / windowS));
  const y = (v) => PAD.top + h * (1 - v / top);
  const shapes = [];
  let drawn = 0;
  series.forEach((s, i) => {
    let run = [];
    const flush = () => {
      if (run.length > 1) shapes.push(svg("polyline", { class: `line s${i % 5}`, points: run.join(" ") }));
      run = [];
    };
    for (const [t, v] of s.points) {
      if (v === null || v === undefined) { flush(); continue; }
      run.push(`${x(t).toFixed(1)},${y(v).toFixed(1)}`);
      drawn += 1;
    }
    flush();
    const last = [...s.points].reverse().find((p) => p[1] !== null && p[1] !== undefined);
    if (last) shapes.push(svg("circle", { class: `dot s${i % 5}`, cx: x(last[0]), cy: y(last[1]), r: 2 }));
  });
  const axis = [
    svg("line", { class: "axis", x1: PAD.left, y1: PAD.top + h, x2: PAD.left + w, y2: PAD.top + h }),
    svg("line", { class: "axis", x1: PAD.left, y1: PAD.top, x2: PAD.left, y2: PAD.top + h }),
    svg("text", { class: "tick", x: PAD.left - 3, y: PAD.top + 8, "text-anchor": "end" },
      Number(top.toPrecision(2))),
    svg("text", { class: "tick", x: PAD.left - 3, y: PAD.top + h, "text-anchor": "end" }, 0),
    svg("text", { class: "tick", x: PAD.left, y: CHART_H - 3 }, `−${Math.round(windowS / 60)} min`),
    svg("text", { class: "tick", x: PAD.left + w, y: CHART_H - 3, "text-anchor": "end" }, "now"),
  ];
  const legend = el("div", { class: "legend" }, series.map((s, i) => {
    const last = [...s.points].reverse().find((p) => p[1] !== null && p[1] !== undefined);
    return el("span", { class: `key s${i % 5}`, "data-series": s.name },
      `${s.name} ${last ? fmt(last[1], unit === "s" ? 3 : 1) : "–"}`);
  }));
  // data-values: the plotted [time, value] pairs by series, for tests and the curious
  return el("div", { class: "chart", "data-chart": id, "data-points": drawn,
                     "data-values": JSON.stringify(series.map((s) => [s.name, s.points])) },
    el("h4", { title: hint || "" }, title),
    svg("svg", { viewBox: `0 0 ${CHART_W} ${CHART_H}`, width: CHART_W, height: CHART_H,
                 role: "img", "aria-label": title }, axis, shapes),
    legend);
}

function historySection(history, models, now) {  // now: the server's clock, not the browser's
  const samples = (history && history.samples) || [];
  const windowS = (history && history.window_s) || 900;
  const scope = (history && history.scope) || "this replica";
  const at = (f) => samples.map((s) => [s.t, f(s)]);
  const charts = [];
  for (const model of Object.keys(models)) {
    charts.push(chart(`queue-depth:${model}`, `Queued by class · ${model}`,
      CLASSES.map((c) => ({ name: c,
        points: at((s) => (s.models[model] && s.models[model].depth ? s.models[model].depth[c] : null)) })),
      now, windowS, "", "requests in fairgate's queue at the end of each interval"));
  }
  charts.push(chart("dispatch-rate", "Dispatches/s",
    Object.keys(models).map((m) => ({ name: m,
      points: at((s) => (s.models[m] ? s.models[m].dispatch_rate_per_s : null)) })),
    now, windowS, "", "requests sent to a backend per second, every worker and replica"));
  charts.push(chart("ttft", "Time to first token, s (streams, as clients saw it)",
    [{ name: "p50", points: at((s) => s.ttft_p50_s) },
     { name: "p99", points: at((s) => s.ttft_p99_s) },
     { name: "max", points: at((s) => s.ttft_max_s) }], now, windowS, "s",
    "from a stream's arrival to its first token written to the client, streams that ended in the interval"));
  const backends = [...new Set(samples.flatMap((s) => Object.keys(s.gate_closed_pct || {})))].sort();
  charts.push(chart("gate-closed", "Gates closed, % of the time (all classes)",
    backends.map((b) => ({ name: b, points: at((s) => {
      const closed = (s.gate_closed_pct || {})[b];
      return closed === undefined ? null : closed;
    }) })), now, windowS, "",
    "the share of the time the gate badges were red, sampled every second as the badges decide"));
  return [el("h2", {}, `Last ${Math.round(windowS / 60)} minutes`,
    el("span", { class: "meta", "data-history-scope": scope },
      ` · ${scope} · a sample every ${history ? history.interval_s : "?"} s`)),
    el("div", { class: "charts" }, charts)];
}

// ---------------------------------------------------------------- actions (confirmed)

function flash(text, ok) {
  const node = document.getElementById("flash");
  node.textContent = text;
  node.className = `flash ${ok ? "ok" : "bad"}`;
}

function describe(button) {
  const action = button.dataset.action;
  if (action === "cancel") {
    return { text: `Cancel ${button.dataset.label} (${button.dataset.request})? Its client gets a 409.`,
             method: "DELETE", url: `/admin/requests/${encodeURIComponent(button.dataset.request)}`,
             done: "cancelled" };
  }
  const name = button.dataset.backend;
  if (action === "migrate") {
    return { text: `Drain ${name} and migrate its streams? No new requests go to it; after ` +
                   "the grace time its running streams move to other backends and continue there.",
             method: "POST", url: `/admin/backends/${encodeURIComponent(name)}/drain`,
             grace: true, done: `drained ${name}, streams move` };
  }
  return { text: action === "drain"
             ? `Drain ${name}? No new requests go to it; requests in flight finish.`
             : `Undrain ${name}? Requests are dispatched to it again.`,
           method: "POST", url: `/admin/backends/${encodeURIComponent(name)}/${action}`,
           done: `${action}ed ${name}` };
}

async function perform(what) {
  try {
    const headers = { "X-CSRF-Token": csrfToken || "" };
    let sent;
    if (what.grace) {
      headers["Content-Type"] = "application/json";
      sent = JSON.stringify({ migrate: true,
                              grace_s: Number(document.getElementById("grace-s").value) });
    }
    const resp = await fetch(what.url, { method: what.method, credentials: "same-origin",
                                         headers, body: sent });
    const body = await resp.json().catch(() => ({}));
    if (resp.ok) flash(what.done, true);
    else flash(`failed: ${(body.error && body.error.message) || `HTTP ${resp.status}`}`, false);
  } catch (err) {
    flash(`failed: ${err.message}`, false);
  }
  await load();
}

let pending = null;

function confirmAction(button) {
  pending = describe(button);
  const dialog = document.getElementById("confirm");
  document.getElementById("confirm-text").textContent = pending.text;
  document.getElementById("confirm-grace").hidden = !pending.grace;
  dialog.returnValue = "";
  dialog.showModal();
}

document.addEventListener("click", (event) => {
  const button = event.target.closest("button[data-action]");
  if (button) confirmAction(button);
});

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("confirm").addEventListener("close", (event) => {
    const what = pending;
    pending = null;
    if (what && event.target.returnValue === "yes") perform(what);
  });
});

// ---------------------------------------------------------------- refresh

function render(state) {
  csrfToken = state.csrf_token;
  document.getElementById("history").replaceChildren(...historySection(state.history, state.models, state.time));
  const root = document.getElementById("models");
  const sections = Object.entries(state.models).map(([model, m]) =>
    el("section", { class: "model", "data-model": model },
      el("h2", {}, model),
      el("div", { class: "grid" },
        backendsPanel(m.backends), queuesPanel(model, m.queues),
        usersPanel(m.queues), sharesPanel(m.service_shares, m.share_ratios))));
  root.replaceChildren(...sections, usagePanel(state.usage_today), batchesPanel(state.batches),
                       movesPanel(state.moves));
  const grafana = document.getElementById("grafana");
  if (state.grafana_url) grafana.setAttribute("href", state.grafana_url);
  grafana.hidden = !state.grafana_url;
  document.getElementById("meta").textContent =
    `replica ${state.replica_id} · fairness ${state.fairness}`;
}

async function load() {
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
  }
}

async function refresh() {
  await load();
  setTimeout(refresh, REFRESH_MS);
}

document.addEventListener("DOMContentLoaded", refresh);
