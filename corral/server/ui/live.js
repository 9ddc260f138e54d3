// The live view: loaded models from /api/ps, slots, queue and the token rate from /metrics,
// polled once a second while the view is open.
import { $, api, el, formatBytes, getJSON, onView } from "/ui/app.js";

const WINDOW = 60; // seconds of rate history in the chart
const history = new Map(); // model -> { last: [time, sampled], rates: [tokens/s] }
let timer = null;

// Prometheus text lines with a model label: { model: { name: value } }.
export function parseMetrics(textBody) {
  const out = {};
  const line = /^corral_(\w+)\{model="((?:[^"\\]|\\.)*)"\}\s+(\S+)$/;
  for (const row of textBody.split("\n")) {
    const m = row.match(line);
    if (!m) continue;
    const model = m[2].replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
    (out[model] ||= {})[m[1]] = Number(m[3]);
  }
  return out;
}

function processor(model) {
  if (!model.size) return "";
  const gpu = Math.round((100 * (model.size_vram || 0)) / model.size);
  if (gpu <= 0) return "100% CPU";
  if (gpu >= 100) return "100% GPU";
  return `${100 - gpu}%/${gpu}% CPU/GPU`;
}

function until(model, busy) {
  if (busy) return "busy (the timer starts when it is idle)";
  const seconds = Math.round((new Date(model.expires_at).getTime() - Date.now()) / 1000);
  if (seconds > 3e8) return "forever";
  if (seconds <= 0) return "unloading";
  const m = Math.floor(seconds / 60);
  return m ? `${m}m ${seconds % 60}s` : `${seconds}s`;
}

function rate(name, sampled, now) {
  const entry = history.get(name) || { last: null, rates: [] };
  if (entry.last && sampled >= entry.last[1] && now > entry.last[0]) {
    entry.rates.push((sampled - entry.last[1]) / ((now - entry.last[0]) / 1000));
    if (entry.rates.length > WINDOW) entry.rates.shift();
  }
  entry.last = [now, sampled];
  history.set(name, entry);
  return entry.rates;
}

function chart(rates) {
  const canvas = el("canvas", { width: "240", height: "48", role: "img", "data-points": rates.length,
    "aria-label": "Tokens per second over the last minute" });
  const g = canvas.getContext("2d");
  const top = Math.max(1, ...rates);
  g.strokeStyle = "#2f6fdf";
  g.lineWidth = 2;
  g.beginPath();
  rates.forEach((r, i) => {
    const x = (canvas.width * (i + WINDOW - rates.length)) / (WINDOW - 1);
    const y = canvas.height - 2 - ((canvas.height - 4) * r) / top;
    if (i) g.lineTo(x, y); else g.moveTo(x, y);
  });
  g.stroke();
  return canvas;
}

function slotBoxes(busy, slots) {
  const box = el("span", { class: "slots", "aria-hidden": "true" });
  for (let i = 0; i < slots; i++) box.append(el("span", { class: i < busy ? "slot busy" : "slot" }));
  return box;
}

function card(model, metrics, now) {
  const m = metrics[model.name] || {};
  const slots = model.slots ?? m.slots ?? 1;
  const busy = model.slots_busy ?? m.busy_slots ?? 0;
  const rates = rate(model.name, m.sampled_tokens_total || 0, now);
  const current = rates.length ? rates[rates.length - 1] : 0;
  const field = (label, key, value, extra) => [el("dt", { text: label }),
    el("dd", { "data-field": key }, String(value), extra || null)];
  const size = model.size_cap > model.size ? `${formatBytes(model.size)} (up to ${formatBytes(model.size_cap)})` : formatBytes(model.size);
  return el("article", { class: "card", "data-model": model.name, "aria-label": model.name },
    el("h2", { text: model.name }),
    el("dl", {},
      ...field("Processor", "processor", processor(model)),
      ...field("Size", "size", size),
      ...field("Context", "context", model.context_length || ""),
      ...field("Slots busy", "busy", busy, slotBoxes(busy, slots)),
      ...field("Slots idle", "idle", Math.max(0, slots - busy)),
      ...field("Slots up to", "slots-cap", model.slots_cap ?? slots),
      ...field("Queue", "queue", m.queue_depth ?? 0),
      ...field("Tokens/s", "rate", current.toFixed(1)),
      ...field("Until unload", "until", until(model, busy > 0))),
    chart(rates),
    el("div", { class: "muted caption", text: `last minute, peak ${Math.max(0, ...rates).toFixed(1)} tokens/s` }));
}

async function poll() {
  try {
    const [ps, metricsResponse] = await Promise.all([getJSON("/api/ps"), api("/metrics")]);
    const metrics = metricsResponse.ok ? parseMetrics(await metricsResponse.text()) : {};
    const now = Date.now();
    const models = ps.models || [];
    $("live-empty").hidden = models.length > 0;
    $("live-empty").textContent = "No model is loaded.";
    $("live-models").replaceChildren(...models.map((model) => card(model, metrics, now)));
  } catch (error) {
    $("live-empty").hidden = false;
    $("live-empty").textContent = `Error: ${error.message}`;
  }
}

function tick() {
  if ($("view-live").hidden) { timer = null; return; }
  poll().finally(() => { timer = setTimeout(tick, 1000); });
}

export function startLive() {
  onView("live", () => { if (!timer) tick(); });
}
