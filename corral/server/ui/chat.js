// The chat view: a model picker, a transcript (role="log"), a composer, and the
// conversations kept in this browser's localStorage.
import { $, api, el, errorText, getJSON, ndjson, onView } from "/ui/app.js";
import { render } from "/ui/markdown.js";
import { Conversations } from "/ui/conversations.js";

const store = new Conversations(localStorage);
let running = null; // { controller, message } while an answer streams
let pending = []; // images and audio clips attached to the next message: { name, data (base64), url }

// What a base64 attachment is, by its first bytes, as the daemon tells them apart:
// WAV, MP3 and FLAC are audio (Ollama's `images` carries both), anything else a picture.
function audioType(data) {
  const head = atob(data.slice(0, 16));
  if (head.startsWith("RIFF") && head.slice(8, 12) === "WAVE") return "audio/wav";
  if (head.startsWith("fLaC")) return "audio/flac";
  if (head.startsWith("ID3") || (head.charCodeAt(0) === 0xff && (head.charCodeAt(1) & 0xe0) === 0xe0)) return "audio/mpeg";
  return null;
}

function mediaNode(data, label) {
  const audio = audioType(data);
  return audio
    ? el("audio", { class: "clip", controls: "", "aria-label": label, src: `data:${audio};base64,${data}` })
    : el("img", { class: "thumb", alt: label, src: `data:image/png;base64,${data}` });
}

function thinkingBlock(message, open) {
  const details = el("details", { class: "thinking", open }, el("summary", { text: "Thinking" }));
  details.append(el("div", { class: "thinking-text", text: message.thinking || "" }));
  return details;
}

function toolCalls(message) {
  const box = el("div", { class: "tool-calls" });
  for (const call of message.tool_calls || []) {
    const fn = call.function || {};
    box.append(el("div", { class: "tool-call" },
      el("span", { class: "tool-label", text: "Tool call" }),
      el("code", { text: `${fn.name}(${JSON.stringify(fn.arguments ?? {})})` })));
  }
  return box;
}

// One message's node; an assistant's is filled again on every streamed piece.
function fill(node, message) {
  // Filled again on every piece: a thinking block the reader opened stays open.
  const open = !!node.querySelector("details.thinking[open]");
  node.replaceChildren();
  if (message.role === "user") {
    // Attachments first: Ollama's `images` are read in front of the text, so the
    // transcript shows them where the model reads them.
    for (const image of message.images || []) node.append(mediaNode(image, "attached file"));
    node.append(el("div", { class: "content" }, ...(message.content || "").split("\n").flatMap(
      (line, i) => (i ? [el("br"), line] : [line]))));
  } else {
    if (message.thinking) node.append(thinkingBlock(message, open));
    const content = el("div", { class: "content" });
    content.append(render(message.content || ""));
    node.append(content);
    if (message.tool_calls && message.tool_calls.length) node.append(toolCalls(message));
  }
  if (message.error) node.append(el("div", { class: "error", role: "alert", text: message.error }));
  if (message.note) node.append(el("div", { class: "note muted", text: message.note }));
}

function messageNode(message) {
  const who = message.role === "user" ? "You" : "Model";
  const node = el("article", { class: `msg ${message.role}`, "aria-label": who });
  fill(node, message);
  return node;
}

function showConversation() {
  const log = $("transcript");
  log.replaceChildren(...store.current().messages.map(messageNode));
  log.scrollTop = log.scrollHeight;
  listConversations();
}

function listConversations() {
  const list = $("conversation-list");
  list.replaceChildren(...store.all().map((c) => el("li", { class: c.id === store.currentId ? "current" : "" },
    el("button", { type: "button", class: "link", text: c.title || "New chat",
      onclick: () => { if (!running) { store.select(c.id); showConversation(); } } }),
    el("button", { type: "button", class: "icon", "aria-label": `Delete ${c.title || "chat"}`, text: "×",
      onclick: () => { if (!running) { store.remove(c.id); showConversation(); } } }))));
}

async function loadModels() {
  const select = $("model");
  let models = [];
  try {
    models = (await getJSON("/api/tags")).models || [];
  } catch (error) {
    $("transcript").append(messageNode({ role: "assistant", error: error.message }));
  }
  const remembered = store.current().model || localStorage.getItem("corral.model");
  select.replaceChildren(...models.map((m) => el("option", { value: m.name, text: m.name })));
  if (models.some((m) => m.name === remembered)) select.value = remembered;
  await capabilities();
}

async function capabilities() {
  const model = $("model").value;
  const think = $("think");
  think.parentElement.hidden = true;
  if (!model) return;
  localStorage.setItem("corral.model", model);
  try {
    const response = await api("/api/show", { method: "POST", body: { model } });
    const caps = response.ok ? (await response.json()).capabilities || [] : [];
    // An answer for a model picked before this one may come last: only the current one's
    // counts, or a text model would be sent `think` and refuse it.
    if ($("model").value !== model) return;
    think.parentElement.hidden = !caps.includes("thinking");
    think.checked = caps.includes("thinking");
  } catch (_) { /* the send reports what is wrong */ }
}

function setRunning(value) {
  running = value;
  $("send").hidden = !!value;
  $("stop").hidden = !value;
}

async function stream(response, message, node) {
  let queued = false;
  const paint = () => {
    if (queued) return;
    queued = true;
    requestAnimationFrame(() => {
      queued = false;
      fill(node, message);
      const log = $("transcript");
      log.scrollTop = log.scrollHeight;
    });
  };
  for await (const part of ndjson(response)) {
    if (part.error) { message.error = part.error; break; }
    const piece = part.message || {};
    message.content += piece.content || "";
    if (piece.thinking) message.thinking = (message.thinking || "") + piece.thinking;
    if (piece.tool_calls) message.tool_calls = [...(message.tool_calls || []), ...piece.tool_calls];
    if (part.done) {
      const seconds = (part.eval_duration || 0) / 1e9;
      message.note = `${part.eval_count || 0} tokens` +
        (seconds > 0 ? `, ${(part.eval_count / seconds).toFixed(1)} tokens/s` : "");
    }
    paint();
  }
}

async function send() {
  const box = $("message");
  const model = $("model").value;
  const text = box.value;
  if (running || (!text.trim() && !pending.length)) return;
  if (!model) return;
  const conversation = store.current();
  const user = { role: "user", content: text };
  if (pending.length) user.images = pending.map((p) => p.data);
  const history = conversation.messages.filter((m) => !m.error && !m.failed)
    .map(({ role, content, images, tool_calls }) => ({ role, content, images, tool_calls }));
  const answer = { role: "assistant", content: "" };
  box.value = "";
  pending = [];
  $("attachments").replaceChildren();
  store.add(user, model);
  const userNode = messageNode(user);
  const node = messageNode(answer);
  $("transcript").append(userNode, node);
  listConversations();
  const controller = new AbortController();
  setRunning({ controller });
  const body = { model, messages: [...history, user], stream: true };
  if (!$("think").parentElement.hidden) body.think = $("think").checked;
  try {
    const response = await api("/api/chat", { method: "POST", body, signal: controller.signal });
    if (!response.ok) {
      // Refused before it started: the user's words stay, marked, and are not sent again.
      user.failed = true;
      answer.error = await errorText(response);
    } else {
      await stream(response, answer, node);
    }
  } catch (error) {
    if (error.name === "AbortError") answer.note = "Stopped.";
    else answer.error = error.message;
  }
  fill(node, answer);
  store.add(answer, model);
  setRunning(null);
  box.focus();
}

function attach(files) {
  for (const file of files) {
    const reader = new FileReader();
    reader.onload = () => {
      const url = String(reader.result);
      const item = { name: file.name, data: url.slice(url.indexOf(",") + 1), url };
      pending.push(item);
      $("attachments").append(el("span", { class: "chip" },
        mediaNode(item.data, file.name),
        el("button", { type: "button", class: "icon", "aria-label": `Remove ${file.name}`, text: "×",
          onclick: (event) => { pending = pending.filter((p) => p !== item); event.target.parentElement.remove(); } })));
    };
    reader.readAsDataURL(file);
  }
}

export function startChat() {
  $("composer").addEventListener("submit", (event) => { event.preventDefault(); send(); });
  $("message").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", () => { if (running) running.controller.abort(); });
  $("new-chat").addEventListener("click", () => { if (!running) { store.create(); showConversation(); } });
  $("model").addEventListener("change", capabilities);
  $("attach").addEventListener("change", (event) => { attach(event.target.files); event.target.value = ""; });
  showConversation();
  onView("chat", loadModels); // again on each visit: a pull or delete may have changed them
}
