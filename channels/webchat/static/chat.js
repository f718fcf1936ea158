// The web chat page (channels/webchat): plain JavaScript, no build step, nothing loaded
// from elsewhere. It keeps three promises of docs/webchat.md:
// - A message is kept in this browser (localStorage) until the gateway answered its POST
//   200, and posted again, with the same id, until it does: a closed tab, a dropped
//   network or a restarting gateway delays it, never loses it.
// - The page reads the visitor's log from the last event it has (`after=`), so a tab
//   that slept, lost the network or reloaded gets every reply it missed; an event it has
//   (by id) is never shown twice.
// - A reply's HTML (rendered by the gateway with raw HTML off) is rebuilt here element by
//   element from an allowlist, so even a mistake there runs and loads nothing.
"use strict";

(() => {
  const body = document.body;
  const API = body.dataset.api;
  const EMBED = body.dataset.embed === "1";
  const $ = (id) => document.getElementById(id);
  const log = $("log");
  const composer = $("composer");
  const input = $("message");
  const stopButton = $("stop");
  const attachButton = $("attach");
  const fileInput = $("file");
  const chips = $("attachments");
  const statusLine = $("status");
  const typingLine = $("typing");
  const conversationList = $("conversations");
  const historyMenu = $("history");
  const newButton = $("new");
  const earlier = $("earlier");
  const earlierWhat = $("earlier-what");
  const backButton = $("back");
  const who = $("who");
  const loginForm = $("login");
  const passwordInput = $("password");
  const loginError = $("login-error");
  const title = $("title");

  const state = {
    visitor: "",
    csrf: "",
    current: 1, // the conversation messages go to
    viewing: 1, // the conversation shown
    last: 0, // the id of the last event read: where the stream resumes
    seen: new Set(),
    conversations: new Map(),
    typing: new Set(),
    uploads: [],
    maxChars: 8000,
    maxUpload: 0,
    ready: false,
  };

  const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

  function headers(extra) {
    const all = Object.assign({}, extra || {});
    if (EMBED) all["X-Webchat-Embed"] = "1";
    if (state.csrf) all["X-CSRF-Token"] = state.csrf;
    return all;
  }

  function newId() {
    if (window.crypto && crypto.randomUUID) return crypto.randomUUID();
    const bytes = new Uint8Array(16);
    crypto.getRandomValues(bytes);
    return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
  }

  function setStatus(text) {
    if (statusLine.textContent !== text) statusLine.textContent = text;
    statusLine.hidden = !text;
  }

  // ------------------------------------------------------------------ safe HTML

  const ALLOWED = {
    P: [], BR: [], HR: [], STRONG: [], EM: [], DEL: [], S: [], PRE: [], BLOCKQUOTE: [],
    UL: [], LI: [], H1: [], H2: [], H3: [], H4: [], H5: [], H6: [], TABLE: [], THEAD: [],
    TBODY: [], TR: [], OL: ["start"], TH: ["style"], TD: ["style"], CODE: ["class"],
    A: ["href"],
  };
  const ATTRIBUTE_OK = {
    href: /^(https?:\/\/|mailto:)/i,
    class: /^language-[A-Za-z0-9_+#-]{1,30}$/,
    style: /^text-align:(left|right|center)$/,
    start: /^[0-9]{1,6}$/,
  };

  function copyInto(from, to) {
    for (const node of Array.from(from.childNodes)) {
      if (node.nodeType === Node.TEXT_NODE) {
        to.append(document.createTextNode(node.data));
        continue;
      }
      if (node.nodeType !== Node.ELEMENT_NODE) continue;
      const allowed = ALLOWED[node.tagName];
      if (!allowed) {
        copyInto(node, to); // an element not allowed: its text only
        continue;
      }
      const element = document.createElement(node.tagName.toLowerCase());
      for (const name of allowed) {
        const value = node.getAttribute(name);
        if (value !== null && ATTRIBUTE_OK[name].test(value)) element.setAttribute(name, value);
      }
      if (element.tagName === "A") {
        element.rel = "noopener noreferrer nofollow";
        element.target = "_blank";
      }
      copyInto(node, element);
      to.append(element);
    }
  }

  // HTML from the gateway, rebuilt from the allowlist in a document that runs nothing.
  function safeFragment(html) {
    const parsed = new DOMParser().parseFromString(html, "text/html");
    const fragment = document.createDocumentFragment();
    copyInto(parsed.body, fragment);
    return fragment;
  }

  const KEYWORDS = new Set(
    ("and as async await break case catch class const continue def default defer del do " +
      "elif else enum except export extends false final finally fn for from func function " +
      "go if impl import in interface is lambda let loop match mod mut new nil None none " +
      "not null or package pass pub raise return self static struct super switch this " +
      "throw True true try type typeof use var void while with yield").split(" ")
  );
  const HASH_COMMENTS = /^(py|python|sh|bash|shell|zsh|console|rb|ruby|yaml|yml|toml|r|perl|pl|ini|conf|dockerfile|make|makefile|nix|ps1|powershell)$/i;

  // Code blocks coloured by a small tokenizer: every piece stays text.
  function highlight(root) {
    for (const code of root.querySelectorAll("pre > code")) {
      const language = (code.className.match(/language-([A-Za-z0-9_+#-]+)/) || [])[1] || "";
      const pattern = HASH_COMMENTS.test(language)
        ? /(#[^\n]*)|("(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')|(\b\d[\w.]*)|([A-Za-z_]\w*)/g
        : /(\/\/[^\n]*|\/\*[\s\S]*?\*\/)|("(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|`(?:[^`\\]|\\.)*`)|(\b\d[\w.]*)|([A-Za-z_$][\w$]*)/g;
      const text = code.textContent;
      const out = document.createDocumentFragment();
      let at = 0;
      let match;
      while ((match = pattern.exec(text)) !== null) {
        const [all, comment, string, number, word] = match;
        if (match.index > at) out.append(text.slice(at, match.index));
        const kind = comment ? "comment" : string ? "string" : number ? "number"
          : word && KEYWORDS.has(word) ? "keyword" : "";
        if (kind) {
          const span = document.createElement("span");
          span.className = "tok-" + kind;
          span.textContent = all;
          out.append(span);
        } else {
          out.append(all);
        }
        at = match.index + all.length;
      }
      out.append(text.slice(at));
      code.textContent = "";
      code.append(out);
    }
  }

  // ------------------------------------------------------------------ showing events

  const isCommand = (text) => /^\/[A-Za-z]\w*(\s|$)/.test(text || "");

  function sizeText(size) {
    if (size >= 1048576) return (size / 1048576).toFixed(1) + " MB";
    return Math.max(1, Math.round(size / 1024)) + " KB";
  }

  function fileNode(file) {
    const link = document.createElement("a");
    link.href = file.url;
    link.className = "file";
    link.rel = "noopener";
    if (file.inline) {
      link.target = "_blank";
      const image = document.createElement("img");
      image.src = file.url;
      image.alt = file.name;
      image.loading = "lazy";
      link.append(image);
    } else {
      link.download = file.name;
      link.textContent = `${file.name} (${sizeText(file.size)})`;
    }
    return link;
  }

  function clock(seconds) {
    const when = new Date(seconds * 1000);
    const node = document.createElement("time");
    node.dateTime = when.toISOString();
    node.textContent = when.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
    return node;
  }

  function entry(kind, extraClass) {
    const item = document.createElement("li");
    item.className = `entry ${kind === "message" ? "mine" : "theirs"} ${extraClass || ""}`.trim();
    const speaker = document.createElement("span");
    speaker.className = "visually-hidden";
    speaker.textContent = kind === "message" ? "You: " : "Assistant: ";
    const bubble = document.createElement("div");
    bubble.className = "bubble";
    item.append(speaker, bubble);
    return [item, bubble];
  }

  function eventNode(event) {
    const command = event.kind === "message" && isCommand(event.text);
    const [item, bubble] = entry(event.kind, (command ? "command" : "") + (event.error ? " error" : ""));
    item.dataset.id = String(event.id);
    if (event.kind === "message") {
      item.dataset.messageId = event.message_id;
      if (event.text) {
        const text = document.createElement("p");
        text.className = "text";
        text.textContent = event.text;
        bubble.append(text);
      }
    } else {
      item.dataset.replyTo = event.message_id;
      bubble.append(safeFragment(event.html || ""));
      highlight(bubble);
    }
    for (const file of event.files || []) bubble.append(fileNode(file));
    item.append(clock(event.at));
    return item;
  }

  function pendingNode(item) {
    const [node, bubble] = entry("message", "pending" + (isCommand(item.text) ? " command" : ""));
    node.dataset.pending = item.id;
    if (item.text) {
      const text = document.createElement("p");
      text.className = "text";
      text.textContent = item.text;
      bubble.append(text);
    }
    for (const file of item.files || []) bubble.append(fileNode(file));
    const note = document.createElement("span");
    note.className = "note";
    note.textContent = item.failed ? `Not sent: ${item.failed}` : "Sending…";
    node.append(note);
    return node;
  }

  function pendingFor(id) {
    return log.querySelector(`li[data-pending="${CSS.escape(id)}"]`);
  }

  function draftFor(replyTo) {
    return log.querySelector(`li[data-draft-for="${CSS.escape(replyTo)}"]`);
  }

  function scrollToEnd() {
    log.lastElementChild?.scrollIntoView({ block: "end" });
  }

  function showEvent(event) {
    if (event.kind === "message") pendingFor(event.message_id)?.remove();
    if (event.kind === "reply") draftFor(event.message_id)?.remove();
    const node = eventNode(event);
    // Before the drafts and the messages still being sent, which come after it.
    const firstPending = log.querySelector("li[data-pending], li[data-draft-for]");
    log.insertBefore(node, firstPending);
    scrollToEnd();
  }

  function take(event) {
    if (state.seen.has(event.id)) return; // a second tab, a reload: shown once
    state.seen.add(event.id);
    state.last = Math.max(state.last, event.id);
    if (event.kind === "message") removeFromOutbox(event.message_id);
    if (event.conversation > state.current) {
      const wasViewingCurrent = state.viewing === state.current;
      state.current = event.conversation;
      noteConversation(event.conversation, event.kind === "message" && !isCommand(event.text) ? event.text : "", event.at);
      if (wasViewingCurrent) showConversation(state.current, []);
    } else if (event.kind === "message" && !isCommand(event.text)) {
      noteConversation(event.conversation, event.text, event.at);
    }
    if (event.conversation === state.viewing) showEvent(event);
  }

  function showNews(item) {
    if (item.type === "typing") {
      if (item.on) state.typing.add(item.message_id);
      else state.typing.delete(item.message_id);
      const busy = state.typing.size > 0;
      typingLine.hidden = !busy;
      stopButton.disabled = !busy;
    } else if (item.type === "draft" && state.viewing === state.current) {
      const answered = log.querySelector(`li[data-reply-to="${CSS.escape(item.reply_to)}"]`);
      if (answered) return; // the reply is here already
      let node = draftFor(item.reply_to);
      if (!node) {
        const [fresh] = entry("reply", "draft");
        node = fresh;
        node.dataset.draftFor = item.reply_to;
        node.setAttribute("aria-busy", "true"); // read once it is whole, as the reply
        log.append(node);
      }
      const bubble = node.querySelector(".bubble");
      bubble.replaceChildren(safeFragment(item.html));
      highlight(bubble);
      scrollToEnd();
    } else if (item.type === "notice") {
      setStatus(item.text);
    } else if (item.type === "reset") {
      location.reload(); // the log's numbering is not the one this page holds
    }
  }

  // ------------------------------------------------------------------ conversations

  function noteConversation(number, text, at) {
    const known = state.conversations.get(number);
    if (known && known.title) return;
    state.conversations.set(number, { number, title: (text || "").slice(0, 80), started_at: known ? known.started_at : at });
    renderConversations();
  }

  function renderConversations() {
    const items = Array.from(state.conversations.values()).sort((a, b) => b.number - a.number);
    if (!state.conversations.has(state.current)) items.unshift({ number: state.current, title: "" });
    conversationList.replaceChildren();
    for (const conversation of items) {
      const row = document.createElement("li");
      const button = document.createElement("button");
      button.type = "button";
      const name = conversation.title || (conversation.number === state.current ? "New conversation" : "Conversation " + conversation.number);
      button.textContent = conversation.number === state.current ? `${name} (current)` : name;
      if (conversation.number === state.viewing) button.setAttribute("aria-current", "true");
      button.addEventListener("click", () => {
        historyMenu.open = false;
        openConversation(conversation.number);
      });
      row.append(button);
      conversationList.append(row);
    }
  }

  function showConversation(number, events) {
    state.viewing = number;
    log.replaceChildren();
    for (const event of events) {
      state.seen.add(event.id);
      log.append(eventNode(event));
    }
    if (number === state.current) {
      for (const item of loadOutbox()) log.append(pendingNode(item));
      earlier.hidden = true;
    } else {
      const known = state.conversations.get(number);
      earlierWhat.textContent = `An earlier conversation${known && known.title ? ": " + known.title : ""}. New messages go to the current one.`;
      earlier.hidden = false;
    }
    showPlaceholder();
    renderConversations();
    scrollToEnd();
  }

  function showPlaceholder() {
    if (!log.children.length) {
      const [item, bubble] = entry("reply", "hello");
      const text = document.createElement("p");
      text.textContent = "Hello! Write a message below to start.";
      bubble.append(text);
      item.dataset.placeholder = "1";
      log.append(item);
    } else if (log.children.length > 1) {
      log.querySelector("li[data-placeholder]")?.remove();
    }
  }

  async function openConversation(number) {
    if (number === state.viewing) return;
    const response = await fetch(`${API}/history?conversation=${number}`, { headers: headers(), cache: "no-store" });
    if (!response.ok) return;
    const data = await response.json();
    showConversation(number, data.events);
    input.focus();
  }

  // ------------------------------------------------------------------ the outbox

  const outboxKey = () => "webchat-outbox-" + state.visitor;

  function loadOutbox() {
    try {
      return JSON.parse(localStorage.getItem(outboxKey()) || "[]");
    } catch (error) {
      return memoryOutbox;
    }
  }
  let memoryOutbox = []; // where localStorage is refused (a strict privacy setting)

  function saveOutbox(items) {
    memoryOutbox = items;
    try {
      localStorage.setItem(outboxKey(), JSON.stringify(items));
    } catch (error) {
      /* kept in memory only */
    }
  }

  function removeFromOutbox(id) {
    const items = loadOutbox();
    if (items.some((item) => item.id === id)) saveOutbox(items.filter((item) => item.id !== id));
  }

  let pumping = false;
  let pumpAgain = false;

  // Posts the kept messages one at a time, in order, until each is answered 200.
  async function pump() {
    if (pumping) {
      pumpAgain = true;
      return;
    }
    pumping = true;
    try {
      let delay = 500;
      for (;;) {
        pumpAgain = false;
        const item = loadOutbox().find((candidate) => !candidate.failed);
        if (!item) break;
        const outcome = await post(item);
        if (outcome.done) {
          removeFromOutbox(item.id);
          const node = pendingFor(item.id);
          if (node) node.querySelector(".note").textContent = "Sent";
          delay = 500;
          continue;
        }
        if (outcome.failed) {
          saveOutbox(loadOutbox().map((kept) => (kept.id === item.id ? Object.assign(kept, { failed: outcome.failed }) : kept)));
          const node = pendingFor(item.id);
          if (node) node.replaceWith(pendingNode(Object.assign(item, { failed: outcome.failed })));
          continue;
        }
        const wait = outcome.wait || delay;
        delay = Math.min(delay * 2, 8000);
        const node = pendingFor(item.id);
        if (node) node.querySelector(".note").textContent = outcome.note || "Waiting to send…";
        for (let waited = 0; waited < wait && !pumpAgain; waited += 250) await sleep(250);
      }
    } finally {
      pumping = false;
    }
  }

  async function post(item) {
    let response;
    try {
      response = await fetch(`${API}/messages`, {
        method: "POST",
        headers: headers({ "Content-Type": "application/json" }),
        body: JSON.stringify({ id: item.id, text: item.text, files: (item.files || []).map((f) => f.id) }),
      });
    } catch (error) {
      return { note: "Offline: it is sent when the connection is back" };
    }
    if (response.ok) return { done: true };
    const retryAfter = Number(response.headers.get("Retry-After")) || 0;
    if (response.status === 429 || response.status === 503 || response.status >= 500) {
      const note = response.status === 429 ? `Slow down: sending in ${retryAfter || 2} s` : "The chat is restarting: it is sent in a moment";
      return { wait: Math.max(1, retryAfter) * 1000, note };
    }
    if (response.status === 401 || response.status === 403) {
      item.refused = (item.refused || 0) + 1;
      if (item.refused <= 3) {
        await loadState(false); // a new token, or a new visitor: try again
        return { wait: 500 };
      }
    }
    const problem = await response.json().catch(() => ({}));
    return { failed: problem.error || `refused (${response.status})` };
  }

  function queue(text, files) {
    const item = { id: newId(), text, files: files || [], at: Date.now() / 1000 };
    saveOutbox([...loadOutbox(), item]);
    if (state.viewing !== state.current) showConversation(state.current, []);
    log.querySelector("li[data-placeholder]")?.remove();
    log.append(pendingNode(item));
    scrollToEnd();
    pump();
  }

  // ------------------------------------------------------------------ the stream

  let streamControl = null;
  let lastHeard = 0;

  // Reads the log from the last event this page has, as long as the page lives.
  async function readForever() {
    let delay = 500;
    for (;;) {
      const control = new AbortController();
      streamControl = control;
      try {
        const response = await fetch(`${API}/events?after=${state.last}`, {
          headers: headers(), cache: "no-store", signal: control.signal,
        });
        if (response.status === 401) {
          await loadState(false);
          throw new Error("who");
        }
        if (!response.ok || !response.body) throw new Error(String(response.status));
        setStatus("");
        delay = 500;
        lastHeard = Date.now();
        pump(); // the way is open again: what waits goes now
        const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
        let buffer = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          lastHeard = Date.now();
          buffer += value;
          let cut;
          while ((cut = buffer.indexOf("\n\n")) >= 0) {
            handleBlock(buffer.slice(0, cut));
            buffer = buffer.slice(cut + 2);
          }
        }
      } catch (error) {
        /* reconnect below */
      }
      setStatus(navigator.onLine === false ? "Offline: your messages are kept and sent when the connection is back." : "Reconnecting…");
      await sleep(delay);
      delay = Math.min(delay * 2, 8000);
    }
  }

  function handleBlock(block) {
    let kind = "message";
    const data = [];
    for (const line of block.split("\n")) {
      if (line.startsWith("event:")) kind = line.slice(6).trim();
      else if (line.startsWith("data:")) data.push(line.slice(5).trimStart());
    }
    if (!data.length) return; // a comment: the stream is alive
    const item = JSON.parse(data.join("\n"));
    if (kind === "log") take(item);
    else if (kind === "news") showNews(item);
  }

  // A stream silent past two heartbeats is dead (a sleeping laptop, a network that left
  // without a word): drop it, and the loop reconnects from the last event.
  function kick(silence) {
    if (streamControl && Date.now() - lastHeard > silence) streamControl.abort();
    pump();
  }

  setInterval(() => kick(40000), 5000);
  window.addEventListener("online", () => kick(0));
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden) kick(20000);
  });

  // ------------------------------------------------------------------ files

  function renderChips() {
    chips.replaceChildren();
    for (const upload of state.uploads) {
      const chip = document.createElement("li");
      chip.className = "chip" + (upload.error ? " error" : "");
      const label = document.createElement("span");
      label.textContent = upload.error ? `${upload.name}: ${upload.error}` : upload.ref ? upload.name : `${upload.name} (uploading…)`;
      const remove = document.createElement("button");
      remove.type = "button";
      remove.textContent = "×";
      remove.setAttribute("aria-label", `Remove ${upload.name}`);
      remove.addEventListener("click", () => {
        state.uploads = state.uploads.filter((other) => other !== upload);
        renderChips();
        input.focus();
      });
      chip.append(label, remove);
      chips.append(chip);
    }
  }

  async function upload(file) {
    const entry = { name: file.name, ref: null, error: "" };
    state.uploads.push(entry);
    renderChips();
    if (state.maxUpload <= 0) entry.error = "this chat takes no files";
    else if (file.size > state.maxUpload) entry.error = `larger than ${sizeText(state.maxUpload)}`;
    else {
      try {
        const response = await fetch(`${API}/uploads`, {
          method: "POST",
          headers: headers({ "Content-Type": file.type || "application/octet-stream", "X-Filename": encodeURIComponent(file.name) }),
          body: file,
        });
        const answer = await response.json().catch(() => ({}));
        if (response.ok) entry.ref = answer;
        else entry.error = answer.error || `refused (${response.status})`;
      } catch (error) {
        entry.error = "the upload did not get through; remove it and attach it again";
      }
    }
    renderChips();
  }

  // ------------------------------------------------------------------ the controls

  composer.addEventListener("submit", (event) => {
    event.preventDefault();
    const text = input.value.trim();
    if (state.uploads.some((u) => !u.ref && !u.error)) {
      setStatus("Wait for the files to finish uploading.");
      return;
    }
    const files = state.uploads.filter((u) => u.ref).map((u) => u.ref);
    if (!text && !files.length) return;
    if (text.length > state.maxChars) {
      setStatus(`A message may be ${state.maxChars} characters long.`);
      return;
    }
    queue(text, files);
    input.value = "";
    state.uploads = [];
    renderChips();
    input.focus();
  });

  function stopAnswer() {
    if (state.typing.size) queue("/stop");
  }

  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      composer.requestSubmit();
    }
  });
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && state.typing.size) {
      event.preventDefault();
      stopAnswer();
    }
  });
  stopButton.addEventListener("click", stopAnswer);
  newButton.addEventListener("click", () => {
    queue("/new");
    input.focus();
  });
  backButton.addEventListener("click", async () => {
    await openConversation(state.current);
  });
  attachButton.addEventListener("click", () => fileInput.click());
  fileInput.addEventListener("change", () => {
    for (const file of Array.from(fileInput.files || [])) upload(file);
    fileInput.value = "";
  });
  input.addEventListener("paste", (event) => {
    const files = Array.from(event.clipboardData?.files || []);
    if (files.length) {
      event.preventDefault();
      for (const file of files) upload(file);
    }
  });

  // ------------------------------------------------------------------ signing in

  async function signIn(password) {
    const response = await fetch(`${API}/login`, {
      method: "POST",
      headers: headers({ "Content-Type": "application/json" }),
      body: JSON.stringify({ password }),
    });
    if (response.ok) return "";
    const problem = await response.json().catch(() => ({}));
    return problem.error || `refused (${response.status})`;
  }

  loginForm.addEventListener("submit", async (event) => {
    event.preventDefault();
    loginError.textContent = "";
    const problem = await signIn(passwordInput.value);
    if (problem) {
      loginError.textContent = problem;
      return;
    }
    passwordInput.value = "";
    await start();
  });

  // ------------------------------------------------------------------ starting

  // Who this browser is, and the current conversation. `show` renders it all (the first
  // time); otherwise only the identity is refreshed (a new CSRF token).
  async function loadState(show) {
    for (let delay = 500; ; delay = Math.min(delay * 2, 8000)) {
      let response;
      try {
        response = await fetch(`${API}/state`, { headers: headers(), cache: "no-store" });
      } catch (error) {
        setStatus("Cannot reach the chat; trying again…");
        await sleep(delay);
        continue;
      }
      if (response.status === 401) {
        const problem = await response.json().catch(() => ({}));
        if (problem.login === "password") return "password";
      }
      if (!response.ok) {
        const problem = await response.json().catch(() => ({}));
        setStatus(problem.error || "The chat is not ready; trying again…");
        await sleep(Math.max(delay, (Number(response.headers.get("Retry-After")) || 0) * 1000));
        continue;
      }
      const data = await response.json();
      state.visitor = data.visitor;
      state.csrf = data.csrf;
      state.maxChars = data.max_message_chars;
      state.maxUpload = data.max_upload_bytes;
      if (show) {
        title.textContent = data.title;
        document.title = data.title;
        who.textContent = data.password ? `Signed in as ${data.visitor}` : `Visitor id: ${data.visitor}`;
        attachButton.hidden = state.maxUpload <= 0;
        state.current = data.conversation;
        state.conversations = new Map(data.conversations.map((c) => [c.number, c]));
        state.last = Math.max(state.last, data.last);
        showConversation(data.conversation, data.events);
      }
      setStatus("");
      return "ok";
    }
  }

  async function start() {
    const outcome = await loadState(true);
    if (outcome === "password") {
      const key = new URLSearchParams(location.hash.slice(1)).get("key");
      if (key) {
        history.replaceState(null, "", location.pathname + location.search); // off the screen
        if (!(await signIn(key))) return start();
      }
      composer.hidden = true;
      loginForm.hidden = false;
      passwordInput.focus();
      return;
    }
    loginForm.hidden = true;
    composer.hidden = false;
    if (!state.ready) {
      state.ready = true;
      readForever();
    }
    pump();
    input.focus();
  }

  start();
})();
