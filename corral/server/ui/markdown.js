// Markdown for a model's answers, built as DOM nodes whose text is only ever set with
// textContent. No string of the model's becomes HTML, so there is nothing to sanitize:
// "<script>" in an answer is shown as those characters. The subset is what chat models
// write: fenced code (with a Copy button), tables, headings, lists, quotes, rules,
// paragraphs, and inline code, bold, italics and links (http, https and mailto only).
// A fence still open while the answer streams is shown as code up to the end.

const SAFE_LINK = /^(https?:|mailto:)/i;
const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\*\*([^*\n]+)\*\*|__([^_\n]+)__|\*([^*\s][^*\n]*)\*|_([^_\s][^_\n]*)_|\[([^\]\n]+)\]\(([^)\s]+)\)/g;

function text(parent, value) {
  // Single newlines inside a paragraph are line breaks, as chat UIs show them.
  value.split("\n").forEach((part, i) => {
    if (i) parent.append(document.createElement("br"));
    if (part) parent.append(document.createTextNode(part));
  });
}

export function inline(parent, source) {
  let last = 0;
  for (const m of source.matchAll(INLINE)) {
    if (m.index > last) text(parent, source.slice(last, m.index));
    last = m.index + m[0].length;
    if (m[1]) {
      const code = document.createElement("code");
      code.textContent = m[2];
      parent.append(code);
    } else if (m[3] || m[4]) {
      const strong = document.createElement("strong");
      inline(strong, m[3] || m[4]);
      parent.append(strong);
    } else if (m[5] || m[6]) {
      const em = document.createElement("em");
      inline(em, m[5] || m[6]);
      parent.append(em);
    } else if (SAFE_LINK.test(m[8])) {
      const a = document.createElement("a");
      a.href = m[8];
      a.rel = "noopener noreferrer";
      a.target = "_blank";
      a.textContent = m[7];
      parent.append(a);
    } else {
      text(parent, m[0]);
    }
  }
  if (last < source.length) text(parent, source.slice(last));
}

function codeBlock(lang, lines) {
  const pre = document.createElement("pre");
  const code = document.createElement("code");
  if (lang) code.dataset.lang = lang;
  code.textContent = lines.join("\n");
  const copy = document.createElement("button");
  copy.type = "button";
  copy.className = "copy";
  copy.textContent = "Copy";
  copy.addEventListener("click", () => {
    navigator.clipboard.writeText(code.textContent).then(() => { copy.textContent = "Copied"; },
      () => { copy.textContent = "Copy failed"; });
  });
  pre.append(copy, code);
  return pre;
}

const FENCE = /^\s{0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const BULLET = /^\s{0,3}([-*+])\s+(.*)$/;
const NUMBER = /^\s{0,3}(\d{1,9})[.)]\s+(.*)$/;
const QUOTE = /^\s{0,3}>\s?(.*)$/;
const RULE = /^\s{0,3}([-*_])(\s*\1){2,}\s*$/;
const TABLE_RULE = /^\s*\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*$/;

function cells(line) {
  return line.trim().replace(/^\|/, "").replace(/\|$/, "").split("|").map((c) => c.trim());
}

// A GFM table: a header row, a rule of dashes, then rows while lines hold a "|".
function table(lines, i) {
  const node = document.createElement("table");
  const head = node.createTHead().insertRow();
  for (const cell of cells(lines[i])) {
    const th = document.createElement("th");
    inline(th, cell);
    head.append(th);
  }
  const body = node.createTBody();
  i += 2;
  while (i < lines.length && lines[i].includes("|") && lines[i].trim()) {
    const row = body.insertRow();
    for (const cell of cells(lines[i])) inline(row.insertCell(), cell);
    i++;
  }
  return [node, i];
}

function list(lines, i, pattern, ordered) {
  const node = document.createElement(ordered ? "ol" : "ul");
  const first = lines[i].match(pattern);
  if (ordered && first[1] !== "1") node.start = Number(first[1]);
  while (i < lines.length) {
    const m = lines[i].match(pattern);
    if (!m) {
      // An indented line continues the item before it.
      if (/^\s{2,}\S/.test(lines[i]) && node.lastChild) {
        node.lastChild.append(document.createElement("br"));
        inline(node.lastChild, lines[i].trim());
        i++;
        continue;
      }
      break;
    }
    const item = document.createElement("li");
    inline(item, m[2]);
    node.append(item);
    i++;
  }
  return [node, i];
}

export function render(source) {
  const out = document.createDocumentFragment();
  const lines = source.replace(/\r\n?/g, "\n").split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if ((m = line.match(FENCE))) {
      const fence = m[1];
      const body = [];
      i++;
      while (i < lines.length && !lines[i].trim().startsWith(fence)) body.push(lines[i++]);
      i++; // the closing fence, or past the end while it streams
      out.append(codeBlock(m[2], body));
    } else if (line.includes("|") && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1])) {
      const [node, next] = table(lines, i);
      out.append(node);
      i = next;
    } else if ((m = line.match(HEADING))) {
      const h = document.createElement(`h${Math.min(m[1].length + 2, 6)}`);
      inline(h, m[2]);
      out.append(h);
      i++;
    } else if (RULE.test(line)) {
      out.append(document.createElement("hr"));
      i++;
    } else if (BULLET.test(line)) {
      const [node, next] = list(lines, i, BULLET, false);
      out.append(node);
      i = next;
    } else if (NUMBER.test(line)) {
      const [node, next] = list(lines, i, NUMBER, true);
      out.append(node);
      i = next;
    } else if (QUOTE.test(line)) {
      const body = [];
      while (i < lines.length && (m = lines[i].match(QUOTE))) { body.push(m[1]); i++; }
      const quote = document.createElement("blockquote");
      quote.append(render(body.join("\n")));
      out.append(quote);
    } else if (!line.trim()) {
      i++;
    } else {
      const body = [];
      while (i < lines.length && lines[i].trim() && !FENCE.test(lines[i]) && !HEADING.test(lines[i])
             && !BULLET.test(lines[i]) && !NUMBER.test(lines[i]) && !QUOTE.test(lines[i])
             && !(lines[i].includes("|") && TABLE_RULE.test(lines[i + 1] || ""))) {
        body.push(lines[i++]);
      }
      const p = document.createElement("p");
      inline(p, body.join("\n"));
      out.append(p);
    }
  }
  return out;
}
