// The run and services tabs: polls /api/overview, /api/curves (only what it lacks) and /api/services.
"use strict";

const POLL_MS = 2000;
const state = {history: [], next: 0, rolloutRate: [], tab: "run"};

async function api(path) {
  const response = await fetch(path, {credentials: "same-origin", cache: "no-store"});
  if (response.status === 401) { window.location = "/login"; throw new Error("not logged in"); }
  const body = await response.json().catch(() => null);  // a proxy's or a crashed server's page is not JSON
  if (!response.ok) throw new Error((body && body.error) || `HTTP ${response.status} ${response.statusText}`.trim());
  if (body === null) throw new Error(`${path}: the answer is not JSON`);
  return body;
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v; else if (k.startsWith("data-")) node.setAttribute(k, v);
    else if (k === "title") node.title = v; else node[k] = v;
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(c ?? ""));
  return node;
}

function duration(s) {
  if (s === null || s === undefined) return "-";
  s = Math.round(s);
  const h = Math.floor(s / 3600), m = Math.floor(s % 3600 / 60), sec = s % 60;
  return h ? `${h}h${String(m).padStart(2, "0")}m` : m ? `${m}m${String(sec).padStart(2, "0")}s` : `${sec}s`;
}

function fmt(v, digits) {
  if (v === null || v === undefined || Number.isNaN(v)) return "-";
  return typeof v === "number" ? (digits === undefined ? niceNumber(v) : v.toFixed(digits)) : String(v);
}

// Overview ------------------------------------------------------------------------------------------
function showOverview(o) {
  document.getElementById("run-name").textContent = o.run || "-";
  const badge = document.getElementById("run-state");
  const label = o.finished ? "finished" : o.state;
  badge.textContent = label; badge.className = `badge ${label}`;
  document.getElementById("run-mode").textContent = o.mode && o.mode !== "?" ? `${o.mode} mode` : "";
  document.getElementById("step").textContent = o.step;
  document.getElementById("total-steps").textContent = o.total_steps || "?";
  document.getElementById("elapsed").textContent = duration(o.elapsed_s);
  document.getElementById("eta").textContent = duration(o.eta_s);
  document.getElementById("weights").textContent = o.weights || "-";
  const pct = o.total_steps ? Math.min(100, 100 * o.step / o.total_steps) : 0;
  document.getElementById("progress-bar").style.width = `${pct}%`;
  const rollout = document.getElementById("rollout-state");
  rollout.textContent = !Object.keys(o.rollout).length ? "no record yet"
    : o.pause_reasons.length ? `paused by ${o.pause_reasons.join(", ")}` : "dispatching";
  if (o.stall) rollout.textContent += ` | STALLED: no step for ${duration(o.stall.idle_s)}: ${o.stall.component}: ${o.stall.why}`;
  rollout.className = o.pause_reasons.length || o.stall ? "bad" : "";
  const error = document.getElementById("run-error");
  error.hidden = !o.error; error.textContent = o.error || "";
  Trajectories.addEnvs(o.envs || []);
  const t = o.trainer, r = o.rollout;
  const stats = [["reward", fmt(t.reward_mean, 3)], ["loss", fmt(t.loss, 4)], ["staleness", fmt(t.staleness_mean, 2)],
    ["masked fraction", fmt(t.masked_fraction, 3)], ["tokens/s", fmt(t.tokens_per_s)],
    ["episodes/s", fmt(r.episodes_per_s)], ["in flight", fmt(r.in_flight)], ["queued", fmt(r.queued)],
    ["completed", fmt(r.completed)], ["failed", fmt(r.failed)], ["retried", fmt(r.retried)],
    ["step time (wait / train / push)", `${fmt(t.wait_s, 2)} / ${fmt(t.train_s, 2)} / ${fmt(t.push_s, 2)} s`]];
  document.getElementById("run-stats").replaceChildren(
    ...stats.map(([k, v]) => el("div", {class: "stat"}, el("span", {class: "k"}, k), el("span", {class: "v"}, v))));
}

// Curves --------------------------------------------------------------------------------------------
// [svg id, id of the latest value, series [[keys (the first a record has), colour, label]], options]
const CHARTS = [
  ["chart-reward", "last-reward", [[["reward_mean"], "#2a7ab8", "reward"]]],
  ["chart-length", "last-length", [[["rollout/response_len_mean", "response_len_mean"], "#7a52b3", "generated"],
                                   [["rollout/episode_len_mean"], "#9d8fbd", "all tokens"]]],
  ["chart-agent", "last-agent", [[["rollout/turns_mean"], "#2a7ab8", "turns"],
                                 [["rollout/tool_calls_mean"], "#2f9a5b", "tool calls"],
                                 [["rollout/tool_call_parse_failures_mean"], "#c23b3b", "parse failures"],
                                 [["rollout/tool_errors_mean"], "#d0792c", "tool errors"]], {yZero: true}],
  ["chart-staleness", "last-staleness", [[["staleness_mean"], "#2a7ab8", "mean"], [["staleness_max"], "#d0792c", "max"]],
   {yZero: true}],
  ["chart-masked", "last-masked", [[["masked_fraction"], "#c23b3b", "all"],
                                   [["off_policy/masked_low_fraction"], "#d98585", "below"],
                                   [["off_policy/masked_high_fraction"], "#8a1f1f", "above"]], {yZero: true}],
  ["chart-throughput", "last-throughput", [[["tokens_per_s"], "#2f9a5b", "tokens/s"]], {yZero: true}],
  ["chart-kl", "last-kl", [[["off_policy/mismatch_kl", "mismatch_kl"], "#8a6d1f", "KL"]], {yZero: true}],
  ["chart-ess", "last-ess", [[["off_policy/ess_fraction"], "#4b6f88", "ESS"]]],
  ["chart-entropy", "last-entropy", [[["off_policy/entropy", "entropy"], "#4b6f88", "entropy"]]],
].map(([id, lastId, series, opts]) => [id, lastId, series, {xInteger: true, ...(opts || {})}]);

function pickKey(keys) {
  return keys.find(k => state.history.some(r => k in r)) || keys[0];
}

function drawCurves() {
  for (const [id, lastId, fields, opts] of CHARTS) {
    const series = fields.map(([keys, color, label]) => {
      const key = pickKey(keys);
      return {name: label, color, points: state.history.filter(r => key in r).map(r => [r.step, r[key]])};
    }).filter((s, i) => i === 0 || s.points.length);
    drawChart(document.getElementById(id), series, opts);
    const last = series[0].points[series[0].points.length - 1];
    document.getElementById(lastId).textContent = last ? niceNumber(last[1]) : "";
  }
  const rollout = state.rolloutRate.map(([t, v]) => [t / 60, v]);
  drawChart(document.getElementById("chart-rollout"), [{name: "episodes/s", color: "#2f9a5b", points: rollout}],
            {yZero: true, xFormat: x => `${x.toFixed(1)}m`});
  const last = rollout[rollout.length - 1];
  document.getElementById("last-rollout").textContent = last ? niceNumber(last[1]) : "";
}

async function pollRun() {
  showOverview(await api("/api/overview"));
  const curves = await api(`/api/curves?after=${state.next}`);
  if (curves.reset) state.history = [];
  state.history.push(...curves.trainer);
  state.next = curves.next;
  state.rolloutRate = curves.rollout_rate;
  drawCurves();
}

// Services ------------------------------------------------------------------------------------------
function health(ok) {
  if (ok === null || ok === undefined) return el("span", {class: "muted"}, "-");
  return el("span", {class: ok ? "good" : "bad"}, ok ? "healthy" : "down");
}

function rows(tableId, items, cells) {
  document.querySelector(`#${tableId} tbody`).replaceChildren(...items.map(item =>
    el("tr", {}, ...cells(item).map(c => el("td", {}, c)))));
}

function showServices(s) {
  document.getElementById("services-note").textContent = s.live ? ""
    : "a finished (replayed) run: no live service to ask; the env table is the run's last orchestrator record";
  rows("engines", s.engines, e => [e.id, e.url, e.error ? el("span", {class: "bad", title: e.error}, "down") : health(e.healthy),
    fmt(e.running), fmt(e.queued), e.token_usage === undefined ? "-" : `${(100 * e.token_usage).toFixed(1)}%`,
    fmt(e.generated_tokens)]);
  rows("envs", s.envs, e => [e.env, el("span", {class: e.healthy_services ? "good" : "bad"}, fmt(e.healthy_services)),
    fmt(e.in_flight), fmt(e.queued), fmt(e.completed), fmt(e.failed), fmt(e.groups_completed),
    ["model", "environment", "infrastructure"].map(c => fmt(e.outcomes[c] || 0)).join(" / ")]);
  rows("env-services", s.env_services, e => [e.name, e.env_id, e.url, health(e.healthy),
    `${e.in_flight} / ${e.capacity}`, fmt(e.weight), `${fmt(e.heartbeat_age_s, 1)} s ago`]);
  const o = s.orchestrator || {}, g = s.gateway || {};
  const orchestrator = o.error ? el("span", {class: "bad"}, o.error)
    : o.reachable ? el("span", {class: "good"}, o.pause_reasons && o.pause_reasons.length ? `paused by ${o.pause_reasons.join(", ")}` : "dispatching")
    : el("span", {class: "muted"}, "-");
  const gateway = g.error ? el("span", {class: "bad"}, g.error)
    : g.healthy ? el("span", {class: "good"}, `healthy: ${g.sessions_active} sessions, ${g.engines_healthy} engines`)
    : el("span", {class: "muted"}, "-");
  rows("run-services", [["orchestrator", o.url, orchestrator], ["gateway", g.url, gateway],
                        ["trainer /metrics", s.trainer_metrics, ""]], r => [r[0], r[1] || "-", r[2]]);
}

async function pollServices() {
  showServices(await api("/api/services"));
}

// Tabs and the poll loop ----------------------------------------------------------------------------
function showTab() {
  const hash = window.location.hash.replace(/^#/, "") || "run";
  const tab = hash.startsWith("sample") ? "samples" : hash;
  state.tab = ["run", "services", "samples"].includes(tab) ? tab : "run";
  for (const section of document.querySelectorAll(".tab")) section.hidden = section.id !== `tab-${state.tab}`;
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.dataset.tab === state.tab);
  if (state.tab === "samples") Trajectories.show(hash);
}

async function tick() {
  try {
    await pollRun();
    if (state.tab === "services") await pollServices();
  } catch (err) {
    const error = document.getElementById("run-error");
    error.hidden = false; error.textContent = `dashboard: ${err.message}`;
  }
  setTimeout(tick, POLL_MS);
}

window.addEventListener("hashchange", () => { showTab(); if (state.tab === "services") pollServices().catch(() => {}); });
showTab();
tick();
