// kvlab's page: five views that draw what the server's JSON API computes.
// No formula lives here: the planner, the crossover sweep, the step-through runs and the block
// pool all come from /api/* (kvlab.plan, kvlab.generate, the engine). This file only formats,
// draws and sends requests.
"use strict";

const $ = (sel, root = document) => root.querySelector(sel);
const $$ = (sel, root = document) => [...root.querySelectorAll(sel)];

const fmt = {
  int: (n) => (n == null ? "—" : Math.round(n).toLocaleString("en-US")),
  bytes(n) {
    if (n == null) return "—";
    const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let i = 0;
    while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return `${n.toFixed(i && n < 100 ? 1 : 0)} ${units[i]}`;
  },
  // a duration in the unit that keeps 3 significant digits readable: 1.31 s, 14.6 ms, 830 µs
  time(s) {
    if (s == null) return "—";
    const sig = (x) => x.toLocaleString("en-US", { maximumSignificantDigits: 3 });
    return s >= 1 ? `${sig(s)} s` : s >= 1e-3 ? `${sig(s * 1e3)} ms` : `${sig(s * 1e6)} µs`;
  },
  compact: (n) => (n == null ? "" : n.toLocaleString("en-US", { notation: "compact", maximumSignificantDigits: 3 })),
  pct: (x) => `${(100 * x).toFixed(1)}%`,
};

function showError(msg) {
  const el = $("#error");
  el.textContent = msg || "";
  el.hidden = !msg;
}

// With `kvlab serve --api-key`, /v1 and /api need the key: the page keeps it for this tab only
// (sessionStorage, gone when the tab closes) and sends it as a bearer token; a 401 asks for it.
const KEY_ITEM = "kvlab-api-key";

function authHeaders() {
  const key = sessionStorage.getItem(KEY_ITEM);
  return key ? { Authorization: `Bearer ${key}` } : {};
}

// Every call goes through here so the page shows the server's OpenAI-style error message.
async function api(path, body) {
  const init = body === undefined ? { headers: authHeaders() } : {
    method: "POST", headers: { "Content-Type": "application/json", ...authHeaders() }, body: JSON.stringify(body),
  };
  const res = await fetch(path, init);
  if (res.status === 401) $("#auth").hidden = false;
  const data = await res.json().catch(() => ({ error: { message: `${res.status} ${res.statusText}` } }));
  if (!res.ok) throw new Error(data.error ? data.error.message : `${res.status}`);
  return data;
}

async function guarded(fn) {
  try { showError(""); await fn(); } catch (e) { showError(e.message); }
}

function debounce(fn, ms = 200) {
  let t;
  return (...args) => { clearTimeout(t); t = setTimeout(() => fn(...args), ms); };
}

function tokenSpan(tok, cls) {
  const s = document.createElement("span");
  s.className = `tok ${cls}`;
  s.textContent = tok.text.replace(/\n/g, "⏎") || "·";
  s.title = `token id ${tok.id}`;
  return s;
}

function stats(dl, rows) {
  dl.replaceChildren(...rows.flatMap(([k, v, key]) => {
    const dt = document.createElement("dt"); dt.textContent = k;
    const dd = document.createElement("dd"); dd.textContent = v;
    if (key) dd.dataset.key = key;
    return [dt, dd];
  }));
}

// A uPlot chart that is rebuilt when its data changes shape; vertical markers drawn in a hook.
function lineChart(el, { title, xLabel, yLabel, logX, series, data, markers = [] }) {
  el.replaceChildren();
  const opts = {
    title, width: Math.max(320, el.clientWidth || 560), height: 260,
    scales: { x: { time: false, distr: logX ? 3 : 1 } },
    // compact tick labels (1M, 16.8M) so long numbers are never cut at the chart's edges
    // x is a count (steps, batch, tokens): no label on fractional ticks
    axes: [{ label: xLabel, values: (u, ticks) => ticks.map((t) => (Number.isInteger(t) ? fmt.compact(t) : "")) },
      { label: yLabel, size: 60, values: (u, ticks) => ticks.map(fmt.compact) }],
    series: [{ label: xLabel }, ...series],
    hooks: {
      draw: [(u) => {
        const ctx = u.ctx;
        markers.forEach((m, i) => {
          if (m.x == null) return;
          const x = u.valToPos(m.x, "x", true);
          ctx.save();
          ctx.strokeStyle = m.color; ctx.setLineDash([6, 4]); ctx.lineWidth = 2;
          ctx.beginPath(); ctx.moveTo(x, u.bbox.top); ctx.lineTo(x, u.bbox.top + u.bbox.height); ctx.stroke();
          ctx.fillStyle = m.color; ctx.font = `${12 * devicePixelRatio}px sans-serif`;
          // labels near the right edge go to the left of their line, so they are never cut
          const w = ctx.measureText(m.label).width;
          const right = x + 4 + w <= u.bbox.left + u.bbox.width;
          ctx.textAlign = right ? "left" : "right";
          ctx.fillText(m.label, right ? x + 4 : x - 4, u.bbox.top + 14 * devicePixelRatio * (1 + i));
          ctx.restore();
        });
      }],
    },
  };
  el.chart = new uPlot(opts, data, el);
}

// --- shared pickers --------------------------------------------------------------------------

let options = null;

async function loadOptions() {
  options = await api("/api/options");
  const s = options.served;
  $("#served").textContent = `serving ${s.id}: ${fmt.int(s.max_model_len)}-token context, ` +
    `${fmt.int(s.num_blocks)} KV blocks of ${s.block_size} tokens (${fmt.bytes(s.kv_bytes_per_token)} per token)`;
  for (const sel of $$(".model-select")) {
    sel.replaceChildren(...options.models.map((m) => new Option(m.alias, m.id, false, m.id === options.default_model)));
  }
  for (const sel of $$(".kv-select")) sel.replaceChildren(...options.kv_dtypes.map((d) => new Option(d, d, false, d === "bf16")));
  for (const sel of $$(".gpu-select")) {
    sel.replaceChildren(...options.gpus.map((g) => new Option(g.name, g.key, false, g.key === "h100-sxm")));
  }
}

// --- 1. step through ---------------------------------------------------------------------------

const steps = { data: null, runs: 0, marker: { x: null, label: "", color: "#2b8a3e" } };

function drawStep(i) {
  const d = steps.data;
  const st = d.steps[i];
  $("#step-slider").value = i;
  $("#step-label").textContent = `step ${i + 1} of ${d.steps.length}: generated “${st.token.text}”`;
  const seq = d.prompt.concat(d.steps.map((s) => s.token));
  const fill = (root, side) => {
    const [from, to] = side.computed;
    root.replaceChildren(...seq.map((tok, p) => {
      const cls = p >= from && p < to ? "computed" : p < side.read_from_cache ? "cached" : p === to ? "new" : "later";
      return tokenSpan(tok, cls);
    }));
  };
  fill($('[data-testid="cache-tokens"]'), st.cache);
  fill($('[data-testid="nocache-tokens"]'), st.no_cache);
  drawChoice(st);
  $('[data-testid="cache-total"]').textContent = fmt.int(st.cache.processed_total);
  $('[data-testid="nocache-total"]').textContent = fmt.int(st.no_cache.processed_total);
  $('[data-testid="cache-time"]').textContent = fmt.time(st.cache.seconds);
  $('[data-testid="nocache-time"]').textContent = fmt.time(st.no_cache.seconds);
  steps.marker.x = i + 1;
  steps.marker.label = `step ${i + 1}`;
  $("#steps-chart").chart?.redraw(false);
}

// The chosen token's probability and the runners-up at this step, as bars (greedy picks the top).
function drawChoice(st) {
  const c = st.choice;
  const box = $('[data-testid="step-choice"]');
  const head = document.createElement("p");
  head.textContent = `The model gave “${st.token.text}” a probability of ${fmt.pct(c.p)}` +
    (c.rank === 1 ? " (the most likely token, so greedy picked it). The most likely tokens were:" :
      ` (rank ${c.rank}). The most likely tokens were:`);
  const rows = c.top.map((t) => {
    const row = document.createElement("div");
    row.className = "alt" + (t.id === st.token.id ? " chosen" : "");
    const bar = document.createElement("span");
    bar.className = "bar";
    bar.style.width = `${Math.max(1, 200 * t.p)}px`;
    row.append(tokenSpan(t, t.id === st.token.id ? "new" : "later"), bar,
      Object.assign(document.createElement("span"), { className: "p", textContent: fmt.pct(t.p) }));
    return row;
  });
  box.replaceChildren(head, ...rows);
}

// The form's prompt through /api/steps; only the latest run is drawn (the first view's own run
// may still be on its way when the person asks for another).
async function runSteps() {
  const f = new FormData($("#steps-form"));
  const run = ++steps.runs;
  const data = await api("/api/steps", { prompt: f.get("prompt"), max_tokens: Number(f.get("max_tokens")) });
  if (run !== steps.runs) return;
  steps.data = data;
  const d = steps.data;
  $("#steps-out").hidden = false;
  $("#step-slider").max = d.steps.length - 1;
  $('[data-testid="steps-summary"]').textContent =
    `${d.prompt.length} prompt + ${d.steps.length} new tokens: ${fmt.int(d.totals.cache)} tokens processed with ` +
    `the cache (${d.formula.cache}) vs ${fmt.int(d.totals.no_cache)} without (${d.formula.no_cache}), ` +
    `${d.ratio.toFixed(1)}× the work. ` +
    (d.same_tokens ? "Both runs produced the same tokens." : "The two runs' tokens differ (16-bit rounding).");
  const x = d.steps.map((s) => s.step + 1);
  lineChart($("#steps-chart"), {
    title: "tokens processed so far", xLabel: "step", yLabel: "tokens",
    series: [{ label: "with cache", stroke: "#2a7de1", width: 2 }, { label: "without cache", stroke: "#e8590c", width: 2 }],
    data: [x, d.steps.map((s) => s.cache.processed_total), d.steps.map((s) => s.no_cache.processed_total)],
    markers: [steps.marker],
  });
  drawStep(0);
}

// --- 2. planner --------------------------------------------------------------------------------

function modelChoice(form) {
  const text = form.elements.config ? form.elements.config.value.trim() : "";
  if (!text) return { model: form.elements.model.value };
  let config;
  try { config = JSON.parse(text); } catch (e) { throw new Error(`the pasted config.json is not valid JSON: ${e.message}`); }
  return { config };
}

async function runPlanner() {
  const form = $("#planner-form");
  const tp = form.elements.tp.value;
  const v = await api("/api/plan", {
    ...modelChoice(form), context: Number(form.elements.context.value), users: Number(form.elements.users.value),
    kv_dtype: form.elements.kv_dtype.value, gpu: form.elements.gpu.value, gpus: Number(form.elements.gpus.value),
    tp: tp ? Number(tp) : null,
  });
  $("#planner-out").hidden = false;
  const mem = v.memory;
  const scale = Math.max(mem.total_bytes, mem.gpu_bytes);
  const bar = $('[data-testid="membar"]');
  bar.replaceChildren(...mem.segments.map((s) => {
    const div = document.createElement("div");
    div.className = `seg ${s.key}`;
    div.dataset.key = s.key;
    div.dataset.bytes = s.bytes;
    div.style.width = `${(100 * s.bytes) / scale}%`;
    div.title = `${s.label}: ${fmt.bytes(s.bytes)}`;
    return div;
  }));
  const cap = document.createElement("div");
  cap.className = "capacity";
  cap.style.left = `${(100 * mem.gpu_bytes) / scale}%`;
  cap.title = `one GPU: ${fmt.bytes(mem.gpu_bytes)}`;
  bar.append(cap);
  $('[data-testid="membar-legend"]').replaceChildren(...mem.segments.map((s) => {
    const span = document.createElement("span");
    span.className = `key ${s.key}`;
    span.textContent = `${s.label}: ${fmt.bytes(s.bytes)}`;
    return span;
  }), Object.assign(document.createElement("span"), {
    className: "key gpu", textContent: `one ${v.plan.gpu_name}: ${fmt.bytes(mem.gpu_bytes)} (${fmt.bytes(mem.usable_bytes)} usable)`,
  }));
  const p = v.plan;
  const where = v.gpus === 1 ? "one GPU" : `${v.gpus} GPUs (TP ${v.tp})`;
  stats($('[data-testid="planner-stats"]'), [
    ["KV cache per token", fmt.bytes(p.kv_bytes_per_token), "kv_bytes_per_token"],
    ["KV cache per user", fmt.bytes(p.kv_bytes_per_sequence), "kv_bytes_per_sequence"],
    ["GPUs for the cache alone", fmt.int(v.gpus_cache_only), "gpus_cache_only"],
    ["GPUs for everything", v.gpus_everything == null ? "more than 4,096" : fmt.int(v.gpus_everything), "gpus_everything"],
    [`max users on ${where}`, fmt.int(v.max_users), "max_users"],
    [`fits on ${where}`, mem.fits ? "yes" : "no", "fits"],
    ["valid TP sizes", p.valid_tp_sizes.join(", "), "valid_tp_sizes"],
  ]);
  $('[data-testid="planner-notes"]').replaceChildren(...p.notes.map((n) => Object.assign(document.createElement("li"), { textContent: n })));
}

// --- 3. crossover ------------------------------------------------------------------------------

function crossoverInputs(form) {
  const context = 2 ** Number(form.elements.context.value);
  const batch = 2 ** Number(form.elements.batch.value);
  form.elements.context_out.value = fmt.int(context);
  form.elements.batch_out.value = fmt.int(batch);
  return { context, batch };
}

async function runCrossover() {
  const form = $("#crossover-form");
  const { context, batch } = crossoverInputs(form);
  const v = await api("/api/crossover", {
    ...modelChoice(form), context, batch, kv_dtype: form.elements.kv_dtype.value, gpu: form.elements.gpu.value,
  });
  $("#crossover-out").hidden = false;
  const cb = v.crossover_batch, cc = v.crossover_context;
  $('[data-testid="crossover-summary"]').textContent =
    `At ${fmt.int(context)} tokens the cache reads overtake the weight reads from a batch of ` +
    `${cb == null ? "— (never)" : fmt.int(cb)}; at a batch of ${fmt.int(batch)} from a context of ` +
    `${cc == null ? "— (never)" : fmt.int(cc)} tokens.`;
  const pt = v.point;
  const reads = pt.weights_s + pt.kv_s;
  stats($('[data-testid="crossover-point"]'), [
    ["weight reads", fmt.time(pt.weights_s), "weights_s"],
    ["cache reads", fmt.time(pt.kv_s), "kv_s"],
    ["compute", fmt.time(pt.compute_s), "compute_s"],
    ["decode step", fmt.time(pt.step_s), "step_s"],
    ["dominant", pt.compute_s > reads ? "compute" : pt.kv_s >= pt.weights_s ? "cache" : "weights", "dominant"],
    ["compute-bound from batch", v.compute_bound_batch == null ? "never" : fmt.int(v.compute_bound_batch),
      "compute_bound_batch"],
    ["tokens/s (batch)", fmt.int(v.tokens_per_s), "tokens_per_s"],
  ]);
  // one unit for both charts, picked by the slowest step shown: s, ms or µs
  const top = Math.max(...v.by_batch.concat(v.by_context).map((r) => r.step_s));
  const [unit, scale] = top >= 1 ? ["s", 1] : top >= 1e-3 ? ["ms", 1e3] : ["µs", 1e6];
  const col = (rows, k) => rows.map((r) => r[k] * scale);
  const series = [
    { label: `weights (${unit})`, stroke: "#555", width: 2 },
    { label: `cache (${unit})`, stroke: "#2a7de1", width: 2 },
    { label: `compute (${unit})`, stroke: "#7048e8", width: 2 },
    { label: `step (${unit})`, stroke: "#e8590c", width: 2, dash: [4, 3] },
  ];
  const data = (rows, x) => [rows.map((r) => r[x]), ...["weights_s", "kv_s", "compute_s", "step_s"].map((k) => col(rows, k))];
  lineChart($("#chart-batch"), {
    xLabel: "batch", yLabel: unit, logX: true, series,
    data: data(v.by_batch, "batch"),
    markers: [{ x: cb, label: `cache dominates from ${fmt.int(cb)}`, color: "#c92a2a" }, { x: batch, label: "you", color: "#2b8a3e" }],
  });
  lineChart($("#chart-context"), {
    xLabel: "context (tokens)", yLabel: unit, logX: true, series,
    data: data(v.by_context, "context"),
    markers: [{ x: cc, label: `cache dominates from ${fmt.int(cc)}`, color: "#c92a2a" }, { x: context, label: "you", color: "#2b8a3e" }],
  });
}

// --- 4. live cache -----------------------------------------------------------------------------

const live = { timer: null, gen: 0, inflight: 0 };

const BLOCK_STATES = { f: "free", u: "used", s: "used shared", c: "cached" };
const MAX_CELLS = 2048; // drawn blocks per pool; a bigger pool's rest is counted, not drawn
const MAX_TABLE_CELLS = 48; // physical ids shown per request and layer group

function cell(state, title, label) {
  const el = document.createElement("span");
  el.className = `blk ${state}${label === undefined ? "" : " lbl"}`;
  el.title = title;
  if (label !== undefined) el.textContent = label;
  return el;
}

// A pool of any size reads at a glance: one bar for the whole pool (in use, shared, cached,
// free), then only the blocks that hold something, by physical id; free blocks are a count.
function drawBlockMap(c) {
  const owners = new Map(); // "group:block" -> request ids
  for (const r of c.requests) {
    r.blocks.forEach((table, gi) => table.forEach((b) => {
      const k = `${gi}:${b}`;
      owners.set(k, [...(owners.get(k) || []), r.id]);
    }));
  }
  $('[data-testid="blockmap"]').replaceChildren(...c.groups.map((g, gi) => {
    const counts = { used: 0, "used shared": 0, cached: 0, free: 0 };
    const cells = [];
    for (let i = 0; i < g.blocks.length; i++) {
      const state = BLOCK_STATES[g.blocks[i]];
      counts[state]++;
      if (state === "free" || cells.length >= MAX_CELLS) continue;
      const who = owners.get(`${gi}:${i}`);
      cells.push(cell(state, `physical block ${i}: ${state}${who ? ` (${who.join(", ")})` : ""}`));
    }
    const wrap = document.createElement("div");
    wrap.className = "group";
    const h = document.createElement("h3");
    h.textContent = `${g.name} (${g.layers} layers): ${fmt.int(g.blocks.length)} blocks of ${c.block_size} tokens`;
    const bar = document.createElement("div");
    bar.className = "poolbar";
    bar.dataset.testid = "poolbar";
    for (const [state, n] of Object.entries(counts)) {
      const seg = cell(state, `${fmt.int(n)} ${state === "used shared" ? "shared" : state}`);
      seg.style.width = `${(100 * n) / g.blocks.length}%`;
      seg.dataset.count = n;
      bar.append(seg);
    }
    const held = g.blocks.length - counts.free;
    const say = document.createElement("p");
    say.className = "hint";
    say.dataset.testid = "pool-summary";
    say.textContent = `${fmt.int(counts.used + counts["used shared"])} in use (${fmt.int(counts["used shared"])} shared), ` +
      `${fmt.int(counts.cached)} cached, ${fmt.int(counts.free)} free. ` +
      (held ? `The ${fmt.int(held)} that hold something, by physical id` +
        (held > MAX_CELLS ? ` (the first ${fmt.int(MAX_CELLS)}):` : ":") : "No block holds anything.");
    const grid = document.createElement("div");
    grid.className = "grid";
    grid.append(...cells);
    wrap.append(h, bar, say, grid);
    return wrap;
  }));
}

// The prefix tiers behind the pool (--kv-offload-ram / --kv-offload-dir): each one's bytes held
// against its budget, and the blocks it served, missed and took in since the server started.
function drawTiers(s) {
  const box = $('[data-testid="tiers"]');
  box.hidden = !s.tiers.length;
  if (!s.tiers.length) return;
  const h = document.createElement("h3");
  h.textContent = `Prefix tiers behind the pool: ${fmt.int(s.external_hits_tokens)} prompt tokens loaded ` +
    `instead of computed`;
  box.replaceChildren(h, ...s.tiers.map((t) => {
    const row = document.createElement("div");
    row.className = "tier";
    row.dataset.testid = `tier-${t.name}`;
    const bar = document.createElement("div");
    bar.className = "poolbar";
    const full = t.budget ? Math.min(1, t.used / t.budget) : 0;
    const seg = cell("cached", `${fmt.bytes(t.used)} held`);
    seg.style.width = `${100 * full}%`;
    bar.append(seg);
    const say = document.createElement("p");
    say.className = "hint";
    say.dataset.testid = `tier-${t.name}-summary`;
    const asked = t.hits + t.misses;
    say.textContent = `${t.name === "ram" ? "RAM" : "disk"}: ${fmt.bytes(t.used)} of ${fmt.bytes(t.budget)} ` +
      `(${fmt.int(t.blocks)} blocks); ${fmt.int(t.hits)} hits, ${fmt.int(t.misses)} misses` +
      (asked ? ` (${fmt.pct(t.hits / asked)} hit)` : "") + `, ${fmt.int(t.stored)} stored` +
      (t.bad ? `, ${fmt.int(t.bad)} bad files dropped` : "") + (t.writable ? "" : "; not writable: serving what it holds");
    row.append(bar, say);
    return row;
  }));
}

// Each request's block tables: logical block i (position in the row) -> physical block id.
function blockTables(r, c) {
  const td = document.createElement("td");
  r.blocks.forEach((table, gi) => {
    const row = document.createElement("div");
    row.className = "btable";
    const states = c.groups[gi].blocks;
    row.append(...table.slice(0, MAX_TABLE_CELLS).map((b, i) =>
      cell(BLOCK_STATES[states[b]], `logical block ${i} -> physical block ${b}`, b)));
    if (table.length > MAX_TABLE_CELLS) row.append(` +${table.length - MAX_TABLE_CELLS}`);
    td.append(row);
  });
  return td;
}

async function pollCache() {
  const c = await api("/api/cache");
  const s = c.stats;
  stats($('[data-testid="live-stats"]'), [
    ["blocks", `${fmt.int(c.num_blocks)} × ${c.block_size} tokens`, "num_blocks"],
    ["in use", fmt.int(s.used_blocks), "used_blocks"],
    ["cached prefix", fmt.int(s.cached_blocks), "cached_blocks"],
    ["free", fmt.int(s.free_blocks), "free_blocks"],
    ["KV usage", fmt.pct(s.usage), "usage"],
    ["prefix hit rate", `${fmt.pct(s.hit_rate)} (${fmt.int(s.prefix_hits_tokens)} of ${fmt.int(s.prefix_queries_tokens)} tokens)`, "hit_rate"],
    ["preemptions", fmt.int(s.preemptions), "preemptions"],
    ["swapped out / in", `${fmt.int(s.swapped_out_blocks)} / ${fmt.int(s.swapped_in_blocks)} blocks`, "swaps"],
    ["running / waiting", `${s.running} / ${s.waiting}`, "queues"],
  ]);
  drawBlockMap(c);
  drawTiers(s);
  $('[data-testid="live-requests"] tbody').replaceChildren(...c.requests.map((r) => {
    const tr = document.createElement("tr");
    for (const v of [r.id, r.status, r.num_tokens, r.num_cached_tokens]) {
      tr.append(Object.assign(document.createElement("td"), { textContent: v }));
    }
    tr.append(blockTables(r, c));
    return tr;
  }));
}

// One /v1/completions call with a list of prompts: each is its own engine request, and the
// browser's six connections per host stay free for the polling that draws them.
async function sendLoad(ev) {
  ev.preventDefault();
  const f = new FormData(ev.target);
  const count = Number(f.get("count"));
  const status = $('[data-testid="load-status"]');
  const prompts = Array.from({ length: count }, (_, i) => `${f.get("prompt")} (${i})`);
  live.inflight += count;
  status.textContent = `${live.inflight} running`;
  try {
    const res = await api("/v1/completions", {
      model: options.served.id, prompt: prompts, max_tokens: Number(f.get("max_tokens")), temperature: 0, ignore_eos: true,
    });
    status.textContent = `done: ${res.choices.length} completed, ${fmt.int(res.usage.prompt_tokens_details.cached_tokens)} prompt tokens from the cache`;
  } finally {
    live.inflight -= count;
  }
}

// One polling loop at a time (a generation number retires the old one), never overlapping calls.
function setLivePolling(on) {
  const gen = ++live.gen;
  clearTimeout(live.timer);
  const tick = async () => {
    if (gen !== live.gen) return;
    await pollCache().catch((e) => showError(e.message));
    if (gen === live.gen) live.timer = setTimeout(tick, 200);
  };
  if (on) tick();
}

// --- wiring ------------------------------------------------------------------------------------

// --- 5. eviction ------------------------------------------------------------------------------

async function runEvict(ev) {
  ev.preventDefault();
  const f = new FormData(ev.target);
  const d = await api("/api/evict", { prompt: f.get("prompt"), budget: Number(f.get("budget")) });
  $("#evict-out").hidden = false;
  $('[data-testid="evict-policies"]').replaceChildren(...d.policies.map((p) => {
    const row = document.createElement("div");
    row.className = "policy";
    row.dataset.policy = p.policy;
    const h = document.createElement("h3");
    const saved = 1 - p.kv_bytes_kept / p.kv_bytes_full;
    h.textContent = `${p.policy}: ${p.kept} of ${d.tokens.length} tokens kept, ` +
      `${fmt.bytes(p.kv_bytes_kept)} of ${fmt.bytes(p.kv_bytes_full)} (${fmt.pct(saved)} saved)`;
    const toks = document.createElement("div");
    toks.className = "tokens";
    toks.append(...d.tokens.map((t, i) => {
      const span = tokenSpan(t, p.roles[i]);
      if (p.mass) {
        span.style.setProperty("--mass", p.mass[i].toFixed(3));
        span.classList.add("scored");
        span.title += `, attention mass ${(100 * p.mass[i]).toFixed(0)}% of the top token's`;
      }
      return span;
    }));
    row.append(h, toks);
    return row;
  }));
  drawMeasured(d.measured);
}

// The frontier as `kvlab evict` measured it on real models of the served model's family.
function drawMeasured(rows) {
  const box = $('[data-testid="evict-measured"]');
  box.hidden = !rows.length;
  const body = box.querySelector("tbody");
  body.replaceChildren(...rows.map((r) => {
    const tr = document.createElement("tr");
    tr.dataset.policy = r.policy;
    const cells = [r.model, r.task, r.context.toLocaleString(), `${r.budget.toLocaleString()} (${fmt.pct(r.ratio)})`,
      r.policy, `${fmt.pct(r.accuracy)} [${fmt.pct(r.low)}-${fmt.pct(r.high)}]`, fmt.pct(r.full_accuracy),
      String(r.trials)];
    tr.append(...cells.map((text) => {
      const td = document.createElement("td");
      td.textContent = text;
      return td;
    }));
    tr.title = `${r.command} (${r.cpu})`;
    return tr;
  }));
}

function show(view) {
  for (const b of $$("nav button")) b.setAttribute("aria-selected", String(b.dataset.view === view));
  for (const s of $$(".view")) s.hidden = s.id !== `view-${view}`;
  setLivePolling(view === "live");
  if (view === "planner" && $("#planner-out").hidden) guarded(runPlanner);
  if (view === "crossover" && $("#crossover-out").hidden) guarded(runCrossover);
}

// The pickers, then the first view filled at once: its example prompt stepped through on the
// served model (about a second), so the page opens on a real generation, not an empty form.
async function firstView() {
  await loadOptions();
  await runSteps();
}

async function main() {
  for (const b of $$("nav button")) b.addEventListener("click", () => show(b.dataset.view));
  $("#steps-form").addEventListener("submit", (ev) => { ev.preventDefault(); guarded(runSteps); });
  $("#step-slider").addEventListener("input", (ev) => drawStep(Number(ev.target.value)));
  $("#step-prev").addEventListener("click", () => drawStep(Math.max(0, Number($("#step-slider").value) - 1)));
  $("#step-next").addEventListener("click", () => drawStep(Math.min(steps.data.steps.length - 1, Number($("#step-slider").value) + 1)));
  const planner = debounce(() => guarded(runPlanner));
  $("#planner-form").addEventListener("input", planner);
  $("#planner-form").addEventListener("submit", (ev) => { ev.preventDefault(); planner(); });
  const crossover = debounce(() => guarded(runCrossover));
  $("#crossover-form").addEventListener("input", (ev) => { crossoverInputs(ev.currentTarget); crossover(); });
  $("#load-form").addEventListener("submit", (ev) => guarded(() => sendLoad(ev)));
  $("#evict-form").addEventListener("submit", (ev) => guarded(() => runEvict(ev)));
  $("#auth").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(KEY_ITEM, new FormData(ev.target).get("key"));
    ev.target.hidden = true;
    guarded(firstView);
  });
  await guarded(firstView);
  crossoverInputs($("#crossover-form"));
  document.body.dataset.ready = "true";
}

main();
