// PlexRL's cluster page: polls GET /cluster (with the token from sessionStorage as `Authorization: Bearer`) and
// draws the services' timeline, the jobs and the queue. Every string from the server is written as text
// (textContent), never as HTML. For tests: <body data-state> is loading | login | live | error, each job row
// has data-job, and the canvas counts what it drew (data-spans, data-swaps, data-checkpoints, data-lanes,
// data-jobs).
"use strict";

(() => {
  const KEY = "plexrl-token";
  const POLL_MS = 2000;
  const RETRY_MS = 5000;
  const $ = (id) => document.getElementById(id);
  let timer = null;

  function setState(state) {
    document.body.dataset.state = state;
  }

  function takeTokenFromFragment() {
    // `/#token=...`: a link that logs in; the fragment never reaches the server, and is removed at once
    const m = /(?:^#|&)token=([^&]*)/.exec(location.hash);
    if (m) {
      sessionStorage.setItem(KEY, decodeURIComponent(m[1]));
      history.replaceState(null, "", location.pathname + location.search);
    }
  }

  function later(ms) {
    clearTimeout(timer);
    timer = setTimeout(refresh, ms);
  }

  async function refresh() {
    clearTimeout(timer);
    const token = sessionStorage.getItem(KEY);
    const headers = token ? { Authorization: "Bearer " + token } : {};
    let resp;
    try {
      resp = await fetch("cluster", { headers, cache: "no-store" });
    } catch (err) {
      showError("no answer from the server (" + err + "); trying again");
      later(RETRY_MS);
      return;
    }
    if (resp.status === 401) {
      sessionStorage.removeItem(KEY);
      $("login-error").textContent = token ? "The server refused that token." : "";
      setState("login");
      $("token").focus();
      return;
    }
    if (!resp.ok) {
      showError("the server answered HTTP " + resp.status + "; trying again");
      later(RETRY_MS);
      return;
    }
    const data = await resp.json();
    $("error").textContent = "";
    render(data);
    setState("live");
    later(POLL_MS);
  }

  function showError(text) {
    $("error").textContent = text;
    setState("error");
  }

  // -- formatting ------------------------------------------------------------------------------------------
  function num(x, digits) {
    return x === null || x === undefined || !isFinite(x) ? "–" : Number(x).toFixed(digits);
  }

  // one colour per job: its place in the jobs' list (submission order), over a ten-colour palette
  const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                   "#8c564b", "#e377c2", "#637939", "#bcbd22", "#17becf"];
  let order = new Map();

  function colour(job) {
    const i = order.has(job) ? order.get(job) : [...job].reduce((h, c) => (h * 31 + c.charCodeAt(0)) >>> 0, 7);
    return PALETTE[i % PALETTE.length];
  }

  function cell(row, text, cls) {
    const td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    row.appendChild(td);
    return td;
  }

  // -- rendering -------------------------------------------------------------------------------------------
  function render(data) {
    order = new Map(data.jobs.map((j, i) => [j.job_id, i]));
    const running = data.jobs.filter((j) => j.status === "running").length;
    const queued = data.jobs.filter((j) => j.status === "queued").length;
    $("summary").textContent =
      data.services.length + " service(s), " + running + " job(s) running, " + queued + " queued" +
      (data.healthy ? "" : " — the server is not accepting jobs");
    $("who").textContent = data.user === null ? "" : "signed in as " + data.user;
    renderJobs(data);
    renderServices(data);
    renderQueue(data);
    drawTimeline(data);
  }

  function renderJobs(data) {
    const body = $("jobs").tBodies[0];
    body.replaceChildren();
    for (const j of data.jobs) {
      const tr = document.createElement("tr");
      tr.dataset.job = j.job_id;
      tr.dataset.status = j.status;
      cell(tr, j.job_id, j.hidden ? "hidden-job" : "");
      cell(tr, j.user || "–");
      cell(tr, j.status, "status-" + j.status);
      cell(tr, j.iterations ? j.iterations_done + " of " + j.iterations : j.iterations_done + " calls", "num");
      cell(tr, num(j.reward, 3), "num");
      cell(tr, num(j.accuracy, 3), "num");
      cell(tr, num(j.slowdown, 2), "num");
      cell(tr, num(j.accelerator_seconds, 1), "num");
      cell(tr, j.service || "–");
      cell(tr, j.waiting || j.reason || "", "reason");
      body.appendChild(tr);
    }
  }

  function renderServices(data) {
    const body = $("services").tBodies[0];
    body.replaceChildren();
    for (const s of data.services) {
      const tr = document.createElement("tr");
      tr.dataset.service = s.id;
      cell(tr, s.id);
      cell(tr, s.jobs.join(", ") || "–");
      cell(tr, num(s.busy_s, 1), "num");
      cell(tr, num(s.swap_s, 2), "num");
      cell(tr, num(s.startup_s, 1), "num");
      cell(tr, num(s.idle_s, 1), "num");
      cell(tr, s.waiting.map((w) => (w.node ? w.job + ":" + w.node : w.job)).join(", ") || "–", "reason");
      body.appendChild(tr);
    }
  }

  function renderQueue(data) {
    const list = $("queue");
    list.replaceChildren();
    if (!data.queue.length) {
      const li = document.createElement("li");
      li.textContent = "no job is waiting";
      list.appendChild(li);
    }
    for (const q of data.queue) {
      const li = document.createElement("li");
      li.dataset.job = q.job_id;
      li.textContent = q.job_id + " (" + (q.user || "–") + ", " + num(q.waited_s, 0) + " s): " + q.waiting;
      list.appendChild(li);
    }
  }

  function hatch(ctx) {
    const tile = document.createElement("canvas");
    tile.width = tile.height = 6;
    const t = tile.getContext("2d");
    t.fillStyle = "#222";
    t.fillRect(0, 0, 6, 6);
    t.strokeStyle = "#fff";
    t.beginPath();
    t.moveTo(0, 6);
    t.lineTo(6, 0);
    t.stroke();
    return ctx.createPattern(tile, "repeat");
  }

  function drawTimeline(data) {
    const canvas = $("timeline");
    const lanes = data.services.map((s) => s.id);
    if (data.spans.some((s) => s.lane === "cpu")) lanes.push("cpu");
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth || 1100;
    const laneH = 28;
    const left = 90, top = 6, bottom = 22;
    const height = top + bottom + laneH * Math.max(lanes.length, 1);
    canvas.style.height = height + "px";
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
    const ctx = canvas.getContext("2d");
    ctx.scale(ratio, ratio);
    ctx.clearRect(0, 0, width, height);
    const span = Math.max(data.window_s, 1);
    const x = (t) => left + ((t + span) / span) * (width - left - 8);
    ctx.font = "12px system-ui, sans-serif";
    ctx.textBaseline = "middle";
    ctx.fillStyle = "#333";
    lanes.forEach((lane, i) => ctx.fillText(lane === "cpu" ? "CPU pool" : lane, 6, top + laneH * i + laneH / 2));
    // time axis: seconds before now
    ctx.fillStyle = "#777";
    ctx.strokeStyle = "#eee";
    for (let k = 0; k <= 5; k++) {
      const t = -span + (span * k) / 5;
      ctx.beginPath();
      ctx.moveTo(x(t), top);
      ctx.lineTo(x(t), height - bottom);
      ctx.stroke();
      ctx.textAlign = k === 5 ? "right" : "center";
      const label = span < 10 ? t.toFixed(1) : Math.round(t).toString();
      ctx.fillText(k === 5 ? "now" : label + " s", x(t), height - bottom / 2);
    }
    ctx.textAlign = "left";
    const swapFill = hatch(ctx);
    const counts = { node: 0, swap: 0, checkpoint: 0 };
    const jobs = new Set();
    for (const s of data.spans) {
      const i = lanes.indexOf(s.lane);
      if (i < 0 || s.end < -span) continue;
      const y = top + laneH * i + 3;
      const x0 = x(Math.max(s.start, -span));
      if (s.kind === "checkpoint") {
        ctx.fillStyle = "#0050c8";
        ctx.fillRect(x0 - 1, y - 2, 2, laneH - 2);
        ctx.beginPath();
        ctx.moveTo(x0 - 4, y - 3);
        ctx.lineTo(x0 + 4, y - 3);
        ctx.lineTo(x0, y + 3);
        ctx.fill();
        counts.checkpoint++;
        continue;
      }
      const w = Math.max(x(s.end) - x0, 1);
      if (s.kind === "swap") {
        ctx.fillStyle = swapFill;
        counts.swap++;
      } else if (s.kind === "load") {
        ctx.fillStyle = "#999";
      } else {
        ctx.fillStyle = colour(s.job);
        counts.node++;
        jobs.add(s.job);
      }
      ctx.fillRect(x0, y, w, laneH - 6);
    }
    canvas.dataset.spans = String(counts.node);
    canvas.dataset.swaps = String(counts.swap);
    canvas.dataset.checkpoints = String(counts.checkpoint);
    canvas.dataset.lanes = String(lanes.length);
    canvas.dataset.jobs = [...jobs].sort().join(",");
    renderLegend([...jobs].sort());
  }

  function renderLegend(jobs) {
    const legend = $("legend");
    legend.replaceChildren();
    const add = (text, swatch) => {
      const span = document.createElement("span");
      span.textContent = text;
      span.style.setProperty("--swatch", swatch);
      legend.appendChild(span);
    };
    for (const j of jobs) add(j, colour(j));
    add("swap", "repeating-linear-gradient(135deg, #222 0 3px, #fff 3px 4px)");
    add("engine start", "#999");
    add("checkpoint", "#0050c8");
  }

  // -- start -----------------------------------------------------------------------------------------------
  document.addEventListener("DOMContentLoaded", () => {
    $("login").addEventListener("submit", (ev) => {
      ev.preventDefault();
      sessionStorage.setItem(KEY, $("token").value.trim());
      $("token").value = "";
      refresh();
    });
    $("logout").addEventListener("click", () => {
      sessionStorage.removeItem(KEY);
      clearTimeout(timer);
      refresh();
    });
    takeTokenFromFragment();
    refresh();
  });
})();
