// The models view: pull by name with a progress bar, delete, and a model's details.
import { $, api, el, errorText, formatBytes, getJSON, ndjson, onView } from "/ui/app.js";


function when(iso) {
  const date = new Date(iso);
  return Number.isNaN(date.getTime()) ? "" : date.toLocaleString();
}

let refreshes = 0;

// Only the latest refresh draws the table (an earlier answer may come last), and the
// table says it is busy meanwhile.
async function refresh() {
  const rows = $("model-rows");
  const mine = ++refreshes;
  rows.setAttribute("aria-busy", "true");
  let drawn;
  try {
    const { models = [] } = await getJSON("/api/tags");
    drawn = models.map(row);
  } catch (error) {
    drawn = [el("tr", {}, el("td", { colspan: "7", class: "error", role: "alert", text: error.message }))];
  }
  if (mine !== refreshes) return;
  rows.replaceChildren(...drawn);
  rows.removeAttribute("aria-busy");
}

function row(model) {
  const d = model.details || {};
  const remove = el("button", { type: "button", text: "Delete", "aria-label": `Delete ${model.name}` });
  // Two clicks, the second within a few seconds: no browser dialog, nothing removed by a slip.
  remove.addEventListener("click", async () => {
    if (remove.dataset.armed !== "1") {
      remove.dataset.armed = "1";
      remove.textContent = "Confirm delete";
      setTimeout(() => { remove.dataset.armed = ""; remove.textContent = "Delete"; }, 4000);
      return;
    }
    const response = await api("/api/delete", { method: "DELETE", body: { model: model.name } });
    if (!response.ok) $("pull-status").textContent = await errorText(response);
    refresh();
  });
  return el("tr", {},
    el("td", {}, el("button", { type: "button", class: "link", text: model.name,
      "aria-label": `Show ${model.name}`, onclick: () => details(model.name) })),
    el("td", { text: formatBytes(model.size) }),
    el("td", { text: d.family || "" }),
    el("td", { text: d.parameter_size || "" }),
    el("td", { text: d.quantization_level || "" }),
    el("td", { text: when(model.modified_at) }),
    el("td", {}, remove));
}

function section(title, value) {
  if (!value) return null;
  return el("details", {}, el("summary", { text: title }), el("pre", { text: value }));
}

async function details(name) {
  const box = $("model-details");
  box.hidden = false;
  box.replaceChildren(el("p", { class: "muted", text: `Loading ${name}…` }));
  const response = await api("/api/show", { method: "POST", body: { model: name } });
  if (!response.ok) {
    box.replaceChildren(el("p", { class: "error", role: "alert", text: await errorText(response) }));
    return;
  }
  const show = await response.json();
  const d = show.details || {};
  const info = show.model_info || {};
  const facts = [["Architecture", info["general.architecture"]], ["Parameters", d.parameter_size],
    ["Quantization", d.quantization_level], ["Format", d.format],
    ["Context length", info[`${info["general.architecture"]}.context_length`]],
    ["Capabilities", (show.capabilities || []).join(", ")]];
  // A reranker cannot chat: say where it is used instead.
  if ((show.capabilities || []).includes("rerank")) facts.push(["Use", "POST /v1/rerank or /v2/rerank: scores documents against a query"]);
  box.replaceChildren(el("h2", { text: name }),
    el("dl", {}, ...facts.filter(([, v]) => v !== undefined && v !== "").flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { text: String(v) })])),
    ...[section("Parameters", show.parameters), section("Template", show.template),
      section("System", show.system), section("License", show.license)].filter(Boolean));
}

async function pull(event) {
  event.preventDefault();
  const name = $("pull-name").value.trim();
  const bar = $("pull-progress");
  const status = $("pull-status");
  if (!name) return;
  bar.hidden = false;
  bar.removeAttribute("value");
  status.textContent = "pulling manifest";
  try {
    const response = await api("/api/pull", { method: "POST", body: { model: name, stream: true, insecure: $("pull-insecure").checked } });
    if (!response.ok) throw new Error(await errorText(response));
    for await (const part of ndjson(response)) {
      if (part.error) throw new Error(part.error);
      status.textContent = part.status || "";
      if (part.total) {
        bar.max = part.total;
        bar.value = part.completed || 0;
        status.textContent = `${part.status} ${formatBytes(part.completed || 0)} / ${formatBytes(part.total)}`;
      }
    }
    bar.max = 1;
    bar.value = 1;
    $("pull-name").value = "";
  } catch (error) {
    bar.hidden = true;
    status.textContent = `Error: ${error.message}`;
  }
  refresh();
}

export function startModels() {
  $("pull-form").addEventListener("submit", pull);
  onView("models", refresh);
}
