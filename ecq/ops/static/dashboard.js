// The ECQ dashboard: polls /api/v1/dashboard every 2 s and fills the page (ecq/ops/dashboard.py).
// No framework; every value is written with textContent (nothing from the broker becomes HTML).
// Elements with data-k="a.b" show that path of the JSON, formatted by data-fmt; their raw value goes in
// data-value (tests read it). With admin_token set (<html data-auth="token">) the page asks for the token,
// keeps it in sessionStorage (this tab only) and sends it as "Authorization: Bearer".
"use strict";

const API = "/api/v1/dashboard";
const POLL_MS = 2000;
const TOKEN_KEY = "ecq-admin-token";
const SVG = "http://www.w3.org/2000/svg";
const $ = id => document.getElementById(id);

const pair = (big, bigUnit, small, smallUnit) => `${big} ${bigUnit}` + (small ? ` ${small} ${smallUnit}` : "");
const num = v => Math.round(v).toLocaleString("en-US");
const FORMATS = {
  int: num,
  text: String,
  rate: v => (v < 10 ? v.toFixed(2) : v < 100 ? v.toFixed(1) : num(v)),
  bytes: v => {
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
    return i === 0 ? `${v} B` : `${v.toFixed(1)} ${units[i]}`;
  },
  age: s => (s < 60 ? `${+s.toFixed(1)} s` : s < 3600 ? pair(Math.floor(s / 60), "min", Math.floor(s % 60), "s")
    : pair(Math.floor(s / 3600), "h", Math.floor((s % 3600) / 60), "min")),
  time: ms => new Date(ms).toISOString().slice(11, 19) + " UTC",
  ok: v => (v ? "yes" : "no"),
  gc: running => (running ? "running" : "idle"),
};

function lookup(data, path) {
  return path.split(".").reduce((o, k) => (o == null ? undefined : o[k]), data);
}

function show(el, value, kind) {
  el.dataset.value = value == null ? "" : String(value);
  el.textContent = value == null ? "–" : FORMATS[kind || "int"](value);
}

function fillFields(data) {
  for (const el of document.querySelectorAll("[data-k]")) show(el, lookup(data, el.dataset.k), el.dataset.fmt);
}

function sparkline(values, label) {
  const width = 300, height = 32;
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("preserveAspectRatio", "none");
  const known = values.filter(v => v != null);
  const top = Math.max(...known, 0) || 1;
  const title = document.createElementNS(SVG, "title");
  title.textContent = `${label}: highest ${FORMATS.rate(Math.max(...known, 0))} over the last 10 minutes`;
  const base = document.createElementNS(SVG, "line");
  for (const [k, v] of [["x1", 0], ["x2", width], ["y1", height - 0.5], ["y2", height - 0.5]]) base.setAttribute(k, v);
  base.setAttribute("class", "base");
  svg.append(title, base);
  const step = width / Math.max(values.length - 1, 1);
  const points = values.map((v, i) => (v == null ? null : [i * step, height - 1 - (v / top) * (height - 3)]))
    .filter(Boolean).map(([x, y]) => `${x.toFixed(1)},${y.toFixed(1)}`);
  if (points.length > 1) {
    const area = document.createElementNS(SVG, "path");
    area.setAttribute("class", "area");
    area.setAttribute("d", `M${points[0].split(",")[0]},${height} L${points.join(" L")} L${points.at(-1).split(",")[0]},${height} Z`);
    const line = document.createElementNS(SVG, "polyline");
    line.setAttribute("points", points.join(" "));
    svg.append(area, line);
  }
  return svg;
}

function fillSparklines(history) {
  for (const el of document.querySelectorAll("[data-series]")) {
    el.replaceChildren(sparkline(history.rates[el.dataset.series] || [], `${el.dataset.series} per second`));
  }
  for (const el of document.querySelectorAll("[data-gauge]")) {
    el.replaceChildren(sparkline(history.gauges[el.dataset.gauge] || [], el.dataset.label));
  }
}

function row(cells) {
  const tr = document.createElement("tr");
  for (const [value, kind, cls] of cells) {
    const td = document.createElement("td");
    if (cls) td.className = cls;
    show(td, value, kind);
    tr.append(td);
  }
  return tr;
}

function fillTable(tbody, rows, empty, columns) {
  if (rows.length) {
    tbody.replaceChildren(...rows.map(row));
  } else {
    const td = document.createElement("td");
    td.colSpan = columns;
    td.className = "empty";
    td.textContent = empty;
    const tr = document.createElement("tr");
    tr.append(td);
    tbody.replaceChildren(tr);
  }
}

function queueRows(queues) {
  return queues.map(q => [[q.clientid, "text", "clientid"], [q.pending, "int", "num"],
    [q.pending_bytes, "bytes", "num"], [q.oldest_pending_age_s, "age", "num"]]);
}

function fillTables(data) {
  fillTable($("top"), queueRows(data.lag.queues), "no entry is pending", 4);
  fillTable($("oldest"), queueRows(data.oldest), "no entry is pending", 4);
  const reasons = Object.keys(data.totals).filter(k => k.startsWith("refused:")).sort();
  fillTable($("refused"), reasons.map(k => [[k.slice(8), "text"], [data.rates[k], "rate", "num"],
    [data.totals[k], "int", "num"]]), "none refused since start", 3);
  fillTable($("scq"), data.scq.map(q => [[q.queue, "text", "clientid"], [q.readers, "int", "num"],
    [q.lagging, "int", "num"], [q.pending, "int", "num"], [q.oldest_pending_age_s, "age", "num"],
    [q.slowest.map(r => `${r.reader} ${num(r.pending)}`).join(", ") || "none pending", "text"]]),
    "no SCQ reader here", 6);
}

function fillCluster(cluster) {
  $("panel-cluster").hidden = cluster == null;
  if (cluster == null) return;
  const problems = cluster.problems.map(p => { const li = document.createElement("li"); li.textContent = p; return li; });
  $("cluster-problems").replaceChildren(...problems);
  const servers = Object.entries(cluster.leaders).sort();
  fillTable($("cluster-servers"), servers.map(([server, streams]) => [[server, "text"],
    [streams.length, "int", "num"]]), "no leader known", 2);
  const streams = Object.entries(cluster.streams).sort();
  fillTable($("cluster-streams"), streams.map(([name, s]) => [[name, "text"], [s.leader, "text"],
    [`${s.replicas_current} of ${s.replicas}`, "text", "num"], [s.lagging.join(", ") || "none", "text"]]),
    "streams not checked yet", 4);
}

function fillHeader(data) {
  $("node").textContent = `${data.node} (${data.backend})`;
  const badge = $("health");
  const state = data.health.status !== "ok" ? "degraded" : data.ready.ready ? "ok" : "draining";
  badge.className = `badge ${state}`;
  badge.textContent = state === "ok" ? "healthy" : state === "degraded" ? "degraded" : `not ready: ${data.ready.reason}`;
  badge.title = data.health.reason || data.ready.reason || "";
  show($("updated"), data.at_ms, "time");
  $("updated").textContent = `updated ${FORMATS.time(data.at_ms)}`;
}

function render(data) {
  fillHeader(data);
  fillFields(data);
  fillSparklines(data.history);
  fillTables(data);
  fillCluster(data.cluster);
  for (const el of document.querySelectorAll("[data-backend]")) el.hidden = el.dataset.backend !== data.backend;
  const eventsOn = Object.keys(data.events).length > 0;
  $("events-off").hidden = eventsOn;
  $("events-on").hidden = !eventsOn;
  $("problem").textContent = "";
  $("panels").hidden = false;
}

function askForToken(message) {
  $("panels").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message;
  $("health").className = "badge";
  $("health").textContent = "signed out";
  $("token").focus();
}

let timer = null;

async function poll() {
  clearTimeout(timer);
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (document.documentElement.dataset.auth === "token" && !token) {
    askForToken("");
    return;
  }
  try {
    const response = await fetch(API, {headers: token ? {Authorization: `Bearer ${token}`} : {}, cache: "no-store"});
    if (response.status === 401) {
      sessionStorage.removeItem(TOKEN_KEY);
      askForToken(token ? "That token was refused." : "This admin API needs its token.");
      return;
    }
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    render(await response.json());
  } catch (error) {
    $("problem").textContent = `Last poll failed (${error.message}); showing the figures from before.`;
    $("health").className = "badge down";
    $("health").textContent = "unreachable";
  }
  timer = setTimeout(poll, POLL_MS);
}

function signIn(event) {
  event.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, $("token").value.trim());
  $("token").value = "";
  $("login").hidden = true;
  poll();
}

document.addEventListener("DOMContentLoaded", () => {
  $("login-form").addEventListener("submit", signIn);
  poll();
});
