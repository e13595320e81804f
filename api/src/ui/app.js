// corral dashboard: polls the REST API once a second and draws what it
// returns. No framework, no CDN: this file is embedded in the daemon.
"use strict";

const HISTORY_SECONDS = 300;
const COLORS = ["#2459c8", "#c2410c", "#15803d", "#7e22ce", "#b91c1c", "#0e7490", "#a16207", "#be185d"];
const cpuHistory = new Map(); // class -> [{t, used, ent}]
let prevDisks = new Map(); // "vm/disk" -> {t, stats}
let lastClasses = [];
let lastVms = [];

// The token: from the URL fragment (#token=..., never sent to the server),
// then kept in this tab's sessionStorage.
(function takeToken() {
  const m = /(?:^#|&)token=([^&]+)/.exec(location.hash);
  if (m) {
    sessionStorage.setItem("corral-token", decodeURIComponent(m[1]));
    window.history.replaceState(null, "", location.pathname);
  }
})();

function token() { return sessionStorage.getItem("corral-token") || ""; }

class ApiError extends Error {
  constructor(status, code, message) { super(message); this.status = status; this.code = code; }
}

async function api(method, path, body) {
  const headers = { "Accept": "application/json" };
  const t = token();
  if (t) headers["Authorization"] = "Bearer " + t;
  const init = { method, headers };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const r = await fetch(path, init);
  const text = await r.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch (_) { data = null; }
  if (!r.ok) {
    const e = data && data.error ? data.error : { code: "http_" + r.status, message: text.slice(0, 200) };
    throw new ApiError(r.status, e.code, e.message);
  }
  return data;
}

const fmt = (v, digits = 1) => (v === null || v === undefined || Number.isNaN(v)) ? "–" : (Math.abs(v) < 0.05 && digits === 1 ? "0.0" : v.toFixed(digits));
const pct = (v) => (v === null || v === undefined) ? "–" : (100 * v).toFixed(1) + " %";

function cell(row, text, attrs = {}) {
  const td = document.createElement("td");
  td.textContent = text;
  for (const [k, v] of Object.entries(attrs)) td.setAttribute(k, v);
  row.appendChild(td);
  return td;
}

function setConn(ok, text) {
  const el = document.getElementById("conn");
  el.textContent = text;
  el.className = "pill " + (ok ? "ok" : "bad");
}

function renderClasses(classes, vms) {
  const running = new Set(vms.filter((v) => v.state === "running").map((v) => v.class));
  const wanting = classes.filter((c) => running.has(c.name));
  const shareSum = wanting.reduce((s, c) => s + c.shares, 0);
  const usedSum = classes.reduce((s, c) => s + (c.used_pct || 0), 0);
  const tbody = document.querySelector("#classes tbody");
  tbody.replaceChildren();
  classes.forEach((c, i) => {
    const tr = document.createElement("tr");
    tr.dataset.class = c.name;
    const name = cell(tr, c.name, { "data-field": "name", class: "text" });
    name.style.borderLeft = "4px solid " + COLORS[i % COLORS.length];
    cell(tr, String(c.shares), { "data-field": "shares" });
    cell(tr, c.cap == null ? "–" : String(c.cap), { "data-field": "cap" });
    cell(tr, c.reservation == null ? "–" : String(c.reservation), { "data-field": "reservation" });
    cell(tr, String(c.vms.length), { "data-field": "vms" });
    const used = cell(tr, fmt(c.used_pct), { "data-field": "used" });
    // Red when the class gets clearly less than the scheduler entitles it
    // to: the promise is broken (a class below its entitlement because it
    // wants less is not marked: its VMs are idle, not starved).
    if (c.used_pct != null && c.entitlement_pct != null && c.entitlement_pct > 5 &&
        c.used_pct < 0.9 * c.entitlement_pct && running.has(c.name)) used.className = "over";
    cell(tr, fmt(c.entitlement_pct), { "data-field": "entitlement" });
    const got = usedSum > 0 && c.used_pct != null ? c.used_pct / usedSum : null;
    const promise = running.has(c.name) && shareSum > 0 ? c.shares / shareSum : null;
    cell(tr, pct(got), { "data-field": "got" });
    cell(tr, pct(promise), { "data-field": "promise" });
    const td = document.createElement("td");
    const b = document.createElement("button");
    b.textContent = "edit";
    b.dataset.editClass = c.name;
    b.addEventListener("click", () => openClassEditor(c));
    td.appendChild(b);
    tr.appendChild(td);
    tbody.appendChild(tr);
  });
}

function renderVms(vms) {
  const tbody = document.querySelector("#vms tbody");
  tbody.replaceChildren();
  for (const v of vms) {
    const tr = document.createElement("tr");
    tr.dataset.vm = v.name;
    cell(tr, v.name, { "data-field": "name", class: "text" });
    cell(tr, v.state + (v.exit ? " (" + v.exit.reason + ")" : ""), { "data-field": "state", class: "text" });
    cell(tr, v.class, { "data-field": "class", class: "text" });
    cell(tr, String(v.vcpus), { "data-field": "vcpus" });
    cell(tr, String(v.memory_mib), { "data-field": "memory" });
    cell(tr, fmt(v.sched ? v.sched.used_pct : null), { "data-field": "used" });
    cell(tr, fmt(v.sched ? v.sched.entitlement_pct : null), { "data-field": "entitlement" });
    cell(tr, v.sched ? (v.sched.parked ? "yes" : "no") : "–", { "data-field": "parked" });
    tbody.appendChild(tr);
  }
}

function renderDisks(vms, now) {
  const tbody = document.querySelector("#disks tbody");
  tbody.replaceChildren();
  const next = new Map();
  for (const v of vms) {
    for (const d of v.disks || []) {
      const key = v.name + "/" + d.id;
      const s = d.stats;
      if (s) next.set(key, { t: now, stats: s });
      const p = prevDisks.get(key);
      let mbps = null, ops = null, thr = null;
      if (s && p && now > p.t) {
        const dt = (now - p.t) / 1000;
        mbps = ((s.read_bytes + s.write_bytes) - (p.stats.read_bytes + p.stats.write_bytes)) / dt / 1e6;
        ops = ((s.read_ops + s.write_ops + s.other_ops) - (p.stats.read_ops + p.stats.write_ops + p.stats.other_ops)) / dt;
        thr = Math.min(1, Math.max(0, (s.throttled_seconds - p.stats.throttled_seconds) / dt));
      }
      const tr = document.createElement("tr");
      tr.dataset.disk = key;
      cell(tr, v.name, { class: "text" });
      cell(tr, d.id, { "data-field": "id", class: "text" });
      cell(tr, d.group || "–", { class: "text" });
      cell(tr, fmt(mbps, 2), { "data-field": "mbps" });
      cell(tr, d.limits.bps ? fmt(d.limits.bps / 1e6, 2) : "–", { "data-field": "limit-mbps" });
      cell(tr, fmt(ops, 0), { "data-field": "ops" });
      cell(tr, d.limits.iops ? String(d.limits.iops) : "–", { "data-field": "limit-ops" });
      cell(tr, pct(thr), { "data-field": "throttled" });
      cell(tr, s ? String(s.queue_depth) : "–", { "data-field": "queue" });
      const td = document.createElement("td");
      const b = document.createElement("button");
      b.textContent = "limits";
      b.dataset.editDisk = key;
      b.addEventListener("click", () => openDiskEditor(v.name, d));
      td.appendChild(b);
      tr.appendChild(td);
      tbody.appendChild(tr);
    }
  }
  prevDisks = next;
}

function recordHistory(classes, now) {
  for (const c of classes) {
    if (!cpuHistory.has(c.name)) cpuHistory.set(c.name, []);
    const h = cpuHistory.get(c.name);
    h.push({ t: now, used: c.used_pct, ent: c.entitlement_pct });
    while (h.length && now - h[0].t > HISTORY_SECONDS * 1000) h.shift();
  }
  for (const name of [...cpuHistory.keys()]) {
    if (!classes.some((c) => c.name === name)) cpuHistory.delete(name);
  }
}

function drawChart(classes, capacityPct, now) {
  const cv = document.getElementById("cpu-chart");
  const ctx = cv.getContext("2d");
  const W = cv.width, H = cv.height, L = 48, R = 8, T = 10, B = 22;
  ctx.clearRect(0, 0, W, H);
  let ymax = Math.max(100, capacityPct || 0);
  for (const h of cpuHistory.values()) for (const p of h) ymax = Math.max(ymax, p.used || 0, p.ent || 0);
  ymax = Math.ceil(ymax / 50) * 50;
  const x = (t) => L + (W - L - R) * (1 - (now - t) / (HISTORY_SECONDS * 1000));
  const y = (v) => T + (H - T - B) * (1 - v / ymax);
  ctx.strokeStyle = "#d9dde5"; ctx.fillStyle = "#667085"; ctx.font = "11px system-ui"; ctx.lineWidth = 1;
  for (let v = 0; v <= ymax; v += 50) {
    ctx.beginPath(); ctx.moveTo(L, y(v)); ctx.lineTo(W - R, y(v)); ctx.stroke();
    ctx.fillText(v + " %", 4, y(v) + 4);
  }
  for (let s = 0; s <= HISTORY_SECONDS; s += 60) {
    ctx.fillText(s === 0 ? "now" : "-" + s / 60 + " min", x(now - s * 1000) - 16, H - 6);
  }
  const legend = document.getElementById("legend");
  legend.replaceChildren();
  classes.forEach((c, i) => {
    const h = cpuHistory.get(c.name) || [];
    const color = COLORS[i % COLORS.length];
    const line = (key, dash) => {
      ctx.strokeStyle = color; ctx.lineWidth = dash ? 1.5 : 2; ctx.setLineDash(dash ? [5, 4] : []);
      ctx.beginPath();
      let started = false;
      for (const p of h) {
        if (p[key] === null || p[key] === undefined) { started = false; continue; }
        if (!started) { ctx.moveTo(x(p.t), y(p[key])); started = true; } else ctx.lineTo(x(p.t), y(p[key]));
      }
      ctx.stroke();
    };
    line("used", false);
    line("ent", true);
    ctx.setLineDash([]);
    const item = document.createElement("span");
    item.innerHTML = '<i style="background:' + color + '"></i>';
    item.append(c.name + " used ");
    const dash = document.createElement("i");
    dash.className = "dash"; dash.style.borderColor = color;
    item.append(dash, " entitlement");
    legend.appendChild(item);
  });
}

let editing = null;

function openClassEditor(c) {
  editing = c.name;
  const f = document.getElementById("edit-class-form");
  document.getElementById("edit-class-name").textContent = c.name;
  f.shares.value = c.shares;
  f.cap.value = c.cap == null ? "" : c.cap;
  f.reservation.value = c.reservation == null ? "" : c.reservation;
  document.getElementById("edit-class-error").textContent = "";
  document.getElementById("edit-class").showModal();
}

document.getElementById("edit-class-save").addEventListener("click", async (ev) => {
  ev.preventDefault();
  const f = document.getElementById("edit-class-form");
  const num = (s) => (s.trim() === "" ? null : Number(s));
  const body = { shares: Number(f.shares.value), cap: num(f.cap.value), reservation: num(f.reservation.value) };
  try {
    await api("PATCH", "/v1/classes/" + encodeURIComponent(editing), body);
    document.getElementById("edit-class").close();
    await refresh();
  } catch (e) {
    document.getElementById("edit-class-error").textContent = e.message;
  }
});

let editingDisk = null;

function openDiskEditor(vm, d) {
  editingDisk = { vm, disk: d.id, limits: Object.assign({}, d.limits) };
  const f = document.getElementById("edit-disk-form");
  document.getElementById("edit-disk-name").textContent = vm + " / " + d.id;
  f.bps.value = d.limits.bps || "";
  f.iops.value = d.limits.iops || "";
  document.getElementById("edit-disk-error").textContent = "";
  document.getElementById("edit-disk").showModal();
}

document.getElementById("edit-disk-save").addEventListener("click", async (ev) => {
  ev.preventDefault();
  const f = document.getElementById("edit-disk-form");
  // The API replaces a disk's limits: keep the keys this form does not show.
  const limits = Object.assign({}, editingDisk.limits);
  limits.bps = f.bps.value.trim() === "" ? null : Number(f.bps.value);
  limits.iops = f.iops.value.trim() === "" ? null : Number(f.iops.value);
  try {
    await api("PATCH", "/v1/vms/" + encodeURIComponent(editingDisk.vm) + "/disks/" + encodeURIComponent(editingDisk.disk), limits);
    document.getElementById("edit-disk").close();
    await refresh();
  } catch (e) {
    document.getElementById("edit-disk-error").textContent = e.message;
  }
});

document.getElementById("auth-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem("corral-token", document.getElementById("token").value.trim());
  document.getElementById("auth").hidden = true;
  refresh();
});

async function refresh() {
  const now = Date.now();
  try {
    const [status, classes, vms] = await Promise.all([api("GET", "/v1/status"), api("GET", "/v1/classes"), api("GET", "/v1/vms")]);
    lastClasses = classes; lastVms = vms;
    document.getElementById("host").textContent =
      "corral " + status.version + " · capacity " + status.capacity_pct + " % of one CPU · " +
      status.running_vms + "/" + status.vms + " VMs running · memory " + status.memory_mib + "/" + status.memory_budget_mib + " MiB";
    recordHistory(classes, now);
    renderClasses(classes, vms);
    renderVms(vms);
    renderDisks(vms, now);
    drawChart(classes, status.capacity_pct, now);
    document.getElementById("updated").textContent = "updated " + new Date(now).toLocaleTimeString();
    document.body.dataset.refreshes = String(Number(document.body.dataset.refreshes || 0) + 1);
    setConn(true, "live");
  } catch (e) {
    if (e.status === 401) {
      document.getElementById("auth").hidden = false;
      setConn(false, "needs the API token");
    } else {
      setConn(false, e.message || "daemon unreachable");
    }
  }
}

refresh();
setInterval(refresh, 1000);
