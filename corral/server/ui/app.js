// The page's entry: views, the API helper (with the API-key prompt), and start-up.
import { startChat } from "/ui/chat.js";
import { startModels } from "/ui/models.js";
import { startLive } from "/ui/live.js";

const KEY = "corral.key";

export const $ = (id) => document.getElementById(id);

// Asked once per tab: sessionStorage, so the key leaves with the tab.
let asking = null;
function askKey() {
  if (asking) return asking;
  const dialog = $("key-dialog");
  const form = $("key-form");
  const input = $("api-key");
  asking = new Promise((resolve) => {
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      sessionStorage.setItem(KEY, input.value);
      dialog.close();
      asking = null;
      resolve();
    }, { once: true });
  });
  dialog.showModal();
  input.focus();
  return asking;
}

function headers(extra) {
  const out = { ...(extra || {}) };
  const key = sessionStorage.getItem(KEY);
  if (key) out.Authorization = `Bearer ${key}`;
  return out;
}

// fetch for the daemon's API: JSON bodies, the key when one is set, and one retry after
// asking for a key when the daemon answers 401.
export async function api(path, { method = "GET", body, signal } = {}) {
  const init = { method, signal, headers: headers(body === undefined ? {} : { "Content-Type": "application/json" }) };
  if (body !== undefined) init.body = JSON.stringify(body);
  let response = await fetch(path, init);
  if (response.status === 401) {
    await askKey();
    init.headers = headers(init.headers);
    response = await fetch(path, init);
  }
  return response;
}

// The message of an error answer, in any of the API's shapes.
export async function errorText(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    if (typeof body.error === "string") return body.error;
    if (body.error && body.error.message) return body.error.message;
  } catch (_) { /* not JSON: the text itself */ }
  return text || `HTTP ${response.status}`;
}

export async function getJSON(path) {
  const response = await api(path);
  if (!response.ok) throw new Error(await errorText(response));
  return response.json();
}

// Lines of an NDJSON stream, as objects, as they arrive.
export async function* ndjson(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffered = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffered += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffered.indexOf("\n")) >= 0) {
      const line = buffered.slice(0, cut).trim();
      buffered = buffered.slice(cut + 1);
      if (line) yield JSON.parse(line);
    }
  }
  if (buffered.trim()) yield JSON.parse(buffered);
}

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (name === "class") node.className = value;
    else if (name === "text") node.textContent = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else if (value !== false && value !== undefined && value !== null) node.setAttribute(name, value === true ? "" : value);
  }
  for (const child of children) if (child !== null && child !== undefined) node.append(child);
  return node;
}

export function formatBytes(n) {
  if (!n) return "0 B";
  const units = ["B", "KB", "MB", "GB", "TB"];
  const i = Math.min(units.length - 1, Math.floor(Math.log(n) / Math.log(1000)));
  return `${(n / 1000 ** i).toFixed(i ? 1 : 0)} ${units[i]}`;
}

const views = ["chat", "models", "live"];
const listeners = {};
export function onView(name, callback) { listeners[name] = callback; }

function show() {
  const name = views.includes(location.hash.slice(1)) ? location.hash.slice(1) : "chat";
  for (const view of views) {
    $(`view-${view}`).hidden = view !== name;
    const link = document.querySelector(`nav a[data-view="${view}"]`);
    if (view === name) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  if (listeners[name]) listeners[name]();
}

async function start() {
  window.addEventListener("hashchange", show);
  startChat();
  startModels();
  startLive();
  show();
  try {
    const version = await getJSON("/api/version");
    $("version").textContent = `v${version.corral || version.version}`;
  } catch (_) { /* the views report their own errors */ }
}

start();
