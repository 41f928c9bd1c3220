// A small Markdown renderer for model replies that builds DOM nodes and never parses HTML:
// every piece of model text reaches the page through textContent / createTextNode, so any
// markup in it shows as text. Covers what chat replies use: fenced code, inline code,
// headings, lists, quotes, rules, bold, italic and http(s) links.

const FENCE = /^\s*(`{3,}|~{3,})\s*([\w+#.-]*)\s*$/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const BULLET = /^\s*[-*+]\s+(.*)$/;
const NUMBERED = /^\s*(\d{1,9})[.)]\s+(.*)$/;
const QUOTE = /^\s*>\s?(.*)$/;
const RULE = /^\s*([-*_])(\s*\1){2,}\s*$/;
// One inline token: a code span, **bold**, *italic* / _italic_, or [text](http(s) URL).
// A code span's backtick runs are whole (CommonMark): trying every part of a long run made
// one search cubic in its length, and a reply of a few thousand backticks froze the page.
const INLINE =
  /(?<!`)(`+)(?!`)([\s\S]*?[^`])\1(?!`)|\*\*(?=\S)([\s\S]*?\S)\*\*|(?<![\w*])\*(?=\S)([^*]*?\S)\*(?!\w)|(?<!\w)_(?=\S)([^_]*?\S)_(?!\w)|\[([^\]\n]+)\]\((https?:\/\/[^\s()]+)\)/;

function el(tag, className) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  return node;
}

/** Append the inline Markdown of `text` to `parent`. */
function appendInline(parent, text) {
  let rest = text;
  while (rest) {
    const m = INLINE.exec(rest);
    if (!m) {
      parent.append(document.createTextNode(rest));
      return;
    }
    if (m.index > 0) parent.append(document.createTextNode(rest.slice(0, m.index)));
    if (m[1]) {
      const code = el("code");
      code.textContent = m[2].trim() ? m[2].replace(/^ (.*) $/, "$1") : m[2];
      parent.append(code);
    } else if (m[3] !== undefined) {
      const strong = el("strong");
      appendInline(strong, m[3]);
      parent.append(strong);
    } else if (m[4] !== undefined || m[5] !== undefined) {
      const em = el("em");
      appendInline(em, m[4] !== undefined ? m[4] : m[5]);
      parent.append(em);
    } else {
      const link = el("a");
      link.href = m[7]; // the pattern admits http(s) URLs only
      link.rel = "noopener noreferrer";
      link.target = "_blank";
      link.textContent = m[6];
      parent.append(link);
    }
    rest = rest.slice(m.index + m[0].length);
  }
}

function appendLines(parent, lines) {
  lines.forEach((line, i) => {
    if (i > 0) parent.append(el("br"));
    appendInline(parent, line);
  });
}

/** Render `text` as Markdown into a new DocumentFragment. An unclosed code fence (a reply
 * still streaming) renders as code up to the end. */
export function renderMarkdown(text) {
  const out = document.createDocumentFragment();
  const lines = text.replace(/\r\n?/g, "\n").split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = FENCE.exec(line);
    if (fence) {
      const body = [];
      i += 1;
      while (i < lines.length && !lines[i].trim().startsWith(fence[1])) body.push(lines[i++]);
      i += 1; // the closing fence
      const pre = el("pre");
      const code = el("code");
      if (fence[2]) {
        code.dataset.lang = fence[2];
        pre.dataset.lang = fence[2];
      }
      code.textContent = body.join("\n");
      pre.append(code);
      out.append(pre);
      continue;
    }
    if (!line.trim()) {
      i += 1;
      continue;
    }
    const heading = HEADING.exec(line);
    if (heading) {
      const h = el(`h${Math.min(heading[1].length + 2, 6)}`); // h3..h6: replies are small
      appendInline(h, heading[2]);
      out.append(h);
      i += 1;
      continue;
    }
    if (RULE.test(line)) {
      out.append(el("hr"));
      i += 1;
      continue;
    }
    const listKind = BULLET.test(line) ? BULLET : NUMBERED.test(line) ? NUMBERED : null;
    if (listKind) {
      const list = el(listKind === BULLET ? "ul" : "ol");
      const first = NUMBERED.exec(line);
      if (listKind === NUMBERED && first[1] !== "1") list.start = Number(first[1]);
      while (i < lines.length && listKind.test(lines[i])) {
        const item = el("li");
        const m = listKind.exec(lines[i]);
        appendInline(item, listKind === BULLET ? m[1] : m[2]);
        list.append(item);
        i += 1;
      }
      out.append(list);
      continue;
    }
    if (QUOTE.test(line)) {
      const quote = el("blockquote");
      const body = [];
      while (i < lines.length && QUOTE.test(lines[i])) body.push(QUOTE.exec(lines[i++])[1]);
      appendLines(quote, body);
      out.append(quote);
      continue;
    }
    const paragraph = [];
    while (
      i < lines.length &&
      lines[i].trim() &&
      !FENCE.test(lines[i]) &&
      !HEADING.test(lines[i]) &&
      !BULLET.test(lines[i]) &&
      !NUMBERED.test(lines[i]) &&
      !QUOTE.test(lines[i])
    ) {
      paragraph.push(lines[i++]);
    }
    const p = el("p");
    appendLines(p, paragraph);
    out.append(p);
  }
  return out;
}
