// tidal's chat page: one WebSocket to /v1/ws (protocol: docs/websocket.md) and a poll of /state.
"use strict";

const $ = (id) => document.getElementById(id);
const STATE_POLL_MS = 500;
const STATE_TIMEOUT_MS = 2000;  // a /state poll unanswered this long: the server is unreachable (hung or gone)
const FOLLOW_SLACK_PX = 40;     // this close to the bottom, the list follows new text; scrolled further up, it stays
const BUILT_IN_MODELS = { "tidal-tiny": "has random weights", "tidal-test": "is a timing model with no network" };

const conversation = [];   // the {role, content} turns sent with every request
let socket = null;         // the open (or opening) WebSocket
let socketOpen = null;     // a promise of it being open
let answer = null;         // the answer streaming now: {id, body, el, textEl, text, pending, stopping, sentAt,
                           //                              firstAt, lastAt, chunks}
let retryBody = null;      // a request refused for want of an API key, resent once a key is given
let nextId = 1;
let apiKey = sessionStorage.getItem("tidal-api-key") || "";

// ------------------------------------------------------------------ the connection

function base64url(text) {
  let binary = "";
  for (const byte of new TextEncoder().encode(text)) binary += String.fromCharCode(byte);
  return btoa(binary).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

function connect() {
  // a socket the server refused (it closes it next) or that is closing is no socket: open a new one
  if (socket && !socket.refused && socket.readyState <= WebSocket.OPEN) return socketOpen;
  const url = (location.protocol === "https:" ? "wss://" : "ws://") + location.host + "/v1/ws";
  // A browser cannot send an Authorization header on a WebSocket: the key rides in a subprotocol.
  const protocols = apiKey ? ["tidal", "tidal.bearer." + base64url(apiKey)] : ["tidal"];
  const ws = socket = new WebSocket(url, protocols);
  socketOpen = new Promise((resolve, reject) => {
    ws.onopen = () => { setConnection("connected"); resolve(ws); };
    ws.onerror = () => reject(new Error("cannot connect to " + url));
  });
  ws.onmessage = (event) => {
    const message = JSON.parse(event.data);
    if (message.type === "error" && message.id === null) ws.refused = true;  // e.g. a 401 for the key
    onMessage(message);
  };
  ws.onclose = () => {
    if (socket !== ws) return;  // already replaced (a new key, a refused connection): not the page's socket
    socket = null;
    setConnection("not connected");
    if (answer) endAnswer("error", "The connection to the server closed mid-answer.");
  };
  return socketOpen;
}

function setConnection(text) {
  $("connection").textContent = text;
  $("connection").classList.toggle("connected", text === "connected");
}

function onMessage(message) {
  if (message.type === "error" && message.id === null) return onConnectionError(message);
  if (!answer || message.id !== answer.id) return;  // a late message of an earlier answer
  if (message.type === "chunk") {
    if (answer.stopping) return;  // Stop was clicked: what was on screen then is the answer
    const choice = message.data.choices[0];
    const text = (choice.delta && choice.delta.content) || choice.text || "";
    const now = performance.now();
    if (answer.firstAt === null) answer.firstAt = now;
    answer.lastAt = now;
    answer.chunks += 1;
    answer.pendingChunks += 1;
    answer.pending += text;  // drawn at the next frame, with every other chunk that came before it
    requestFrame();
  } else if (message.type === "done") {
    if (message.cancelled) {
      endAnswer("stopped", "Stopped. The server aborted the request and freed its KV cache blocks.");
    } else if (answer.stopping) {  // the cancel crossed the answer's end: nothing was left to abort
      endAnswer("stopped", "Stopped. The server had already finished this answer; the rest is not shown.");
    } else {
      endAnswer("done", null, message.usage);
      if (message.hops) showHops(message.hops, message.id);
    }
  } else if (message.type === "error") {
    endAnswer("error", describeError(message));
  }
}

function onConnectionError(message) {
  if (message.status === 401) {
    askForKey(apiKey ? "The server refused this API key. Enter the right one:"
                     : "This server needs an API key (it runs with --api-key).");
    if (answer) {
      retryBody = answer.body;
      endAnswer("error", "401: the server needs an API key. Enter it in the panel on the right; " +
                         "the message is sent again.");
    }
  } else if (answer) {
    endAnswer("error", describeError(message));
  }
}

function describeError(message) {
  const text = message.error ? message.error.message : "unknown error";
  if (message.status === 503) {
    const wait = message.retry_after ? ` Retry after ${message.retry_after} s.` : " Try again shortly.";
    return `Server busy (503): ${text}${wait}`;
  }
  return `Error ${message.status}: ${text}`;
}

// ------------------------------------------------------------------ one answer

async function send(body) {
  const el = addMessage("assistant", "");
  el.classList.add("streaming");
  el.dataset.answer = "ui-" + nextId;
  answer = { id: "ui-" + nextId++, body, el, textEl: el.querySelector(".text"), text: "", pending: "",
             pendingChunks: 0, stopping: false, sentAt: performance.now(), firstAt: null, lastAt: null, chunks: 0 };
  scrollToEnd();  // the user's message and the answer to come, even if the list was scrolled up
  $("send").disabled = true;
  $("stop").disabled = false;
  const mine = answer;
  try {
    const ws = await connect();
    if (answer !== mine) return;  // ended while connecting (the connection closed)
    if (mine.stopping) return endAnswer("stopped", "Stopped before it was sent.");
    ws.send(JSON.stringify({ type: "request", id: answer.id, endpoint: "chat.completions", body }));
  } catch (error) {
    if (answer === mine) endAnswer("error", "Cannot reach the server: " + error.message);
  }
}

function stop() {
  if (!answer || answer.stopping) return;
  // The answer stops growing now: chunks already received but not drawn, and any still on their way,
  // are dropped. However far the page is behind the server, Stop means what is on screen.
  answer.stopping = true;
  answer.chunks -= answer.pendingChunks;  // "~N tokens" counts what the page shows
  answer.pending = "";
  answer.pendingChunks = 0;
  $("stop").disabled = true;
  notice(answer.el, "stopped", "Stopping...");
  if (socket && socket.readyState === WebSocket.OPEN) socket.send(JSON.stringify({ type: "cancel", id: answer.id }));
}

function endAnswer(how, text, usage) {
  const current = answer;
  answer = null;
  drawPending(current);  // what arrived before the end, not yet drawn
  current.el.classList.remove("streaming");
  const stillShown = current.el.isConnected;  // false once "New chat" cleared it mid-stream
  if (how === "error") {
    if (stillShown) conversation.pop();  // the question got no answer: it leaves the conversation
    current.el.classList.add("failed");
  } else if (stillShown) {
    conversation.push({ role: "assistant", content: current.text });
  }
  if (text) notice(current.el, how, text);
  else current.el.querySelector(".answer-notice")?.remove();
  if (current.firstAt !== null) showStats(usage, current);
  if (how === "error" && stillShown) {
    scrollToEnd();  // the error is where the user looks: in view, next to the input
    giveBackQuestion(current);
  }
  $("send").disabled = false;
  $("stop").disabled = true;
}

// A question the server refused goes back into the empty input, to be fixed (or just resent);
// one refused for want of an API key is sent again by itself once the key is given.
function giveBackQuestion(which) {
  if (retryBody) return;
  const question = which.el.previousElementSibling;
  if (question && question.classList.contains("user") && !$("prompt").value) {
    $("prompt").value = question.querySelector(".text").textContent;
  }
}

function showStats(usage, which = answer) {
  const ttft = which.firstAt - which.sentAt;
  // with usage: the server's token count; while streaming or when stopped: one token per chunk
  const tokens = usage ? usage.completion_tokens : which.chunks;
  const seconds = (which.lastAt - which.firstAt) / 1000;
  const rate = tokens > 1 && seconds > 0 ? ((tokens - 1) / seconds).toFixed(1) + " tokens/s" : "";
  const parts = [`TTFT ${Math.round(ttft)} ms`, `${usage ? "" : "~"}${tokens} tokens`, rate];
  let stats = which.el.querySelector(".answer-stats");
  if (!stats) {
    stats = document.createElement("div");
    stats.className = "answer-stats";
    which.el.appendChild(stats);
  }
  stats.textContent = parts.filter(Boolean).join(" · ");
}

// The server's hops of one answer, first byte in to last frame out (docs/metrics.md): a bar each,
// offset by the hops before it, so the waterfall shows where the answer's time went.
function showHops(hops, id) {
  const el = document.querySelector(`[data-answer="${id}"]`);
  if (!el || !hops.length) return;
  const total = hops.reduce((sum, [, ms]) => sum + ms, 0) || 1;
  const box = document.createElement("details");
  box.className = "hops";
  const summary = document.createElement("summary");
  summary.textContent = `where the time went: ${Math.round(total)} ms on the server`;
  box.appendChild(summary);
  let start = 0;
  for (const [hop, ms] of hops) {
    const row = document.createElement("div");
    row.className = "hop";
    const bar = document.createElement("span");
    bar.className = "hop-bar";
    bar.style.marginLeft = (100 * start / total) + "%";
    bar.style.width = Math.max(0.5, 100 * ms / total) + "%";
    const label = document.createElement("span");
    label.className = "hop-label";
    label.textContent = `${hop} ${ms < 10 ? ms.toFixed(2) : Math.round(ms)} ms`;
    row.append(label, bar);
    box.appendChild(row);
    start += ms;
  }
  el.appendChild(box);
}

// ------------------------------------------------------------------ drawing, once a frame

// Chunks arrive faster than a screen refreshes (hundreds a second): each adds to the answer's
// pending text, and one animation frame draws all of it as one appended text node (never rewriting
// what is already there) and scrolls once. The main thread stays free for the Stop button.
let frameRequested = false;
let scrollWanted = null;  // null: no scroll this frame; "follow": if the user was at the bottom; "end": always

function requestFrame() {
  if (frameRequested) return;
  frameRequested = true;
  requestAnimationFrame(drawFrame);
}

function drawFrame() {
  frameRequested = false;
  const list = $("messages");
  // read before writing: whether the user was following the end (one layout, not one per chunk)
  const following = list.scrollHeight - list.scrollTop - list.clientHeight <= FOLLOW_SLACK_PX;
  if (answer && answer.pending) {
    drawPending(answer);
    showStats(null);
    if (!scrollWanted) scrollWanted = "follow";
  }
  if (scrollWanted === "end" || (scrollWanted === "follow" && following)) list.scrollTop = list.scrollHeight;
  scrollWanted = null;
}

function drawPending(which) {
  if (!which.pending) return;
  which.textEl.appendChild(document.createTextNode(which.pending));
  which.text += which.pending;
  which.pending = "";
  which.pendingChunks = 0;
}

function scrollToEnd() {
  scrollWanted = "end";
  requestFrame();
}

function followEnd() {
  if (scrollWanted !== "end") scrollWanted = "follow";
  requestFrame();
}

// ------------------------------------------------------------------ the page

function addMessage(role, text) {
  const li = document.createElement("li");
  li.className = "message " + role;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  li.appendChild(body);
  $("messages").appendChild(li);
  followEnd();
  return li;
}

function notice(el, kind, text) {
  let box = el.querySelector(".answer-notice");
  if (!box) {
    box = document.createElement("div");
    el.appendChild(box);
  }
  box.className = "answer-notice " + kind;
  box.textContent = text;
  followEnd();
}

function requestBody() {
  const body = { messages: conversation.slice(), max_tokens: parseInt($("max-tokens").value, 10) || 256,
                 temperature: parseFloat($("temperature").value) };
  // empty: the server's default, which is the model's own (its generation config) where it has one
  if (Number.isNaN(body.temperature)) delete body.temperature;
  const seed = $("seed").value.trim();
  if (seed !== "") body.seed = parseInt(seed, 10);
  return body;
}

function submit(event) {
  event.preventDefault();
  const text = $("prompt").value;
  if (!text.trim() || answer) return;
  $("prompt").value = "";
  addMessage("user", text);
  conversation.push({ role: "user", content: text });
  send(requestBody());
}

function askForKey(why) {
  $("key-why").textContent = why;
  $("key-card").hidden = false;
  $("api-key").focus();
}

function useKey(event) {
  event.preventDefault();
  apiKey = $("api-key").value.trim();
  sessionStorage.setItem("tidal-api-key", apiKey);
  $("key-card").hidden = true;
  if (socket) socket.close();
  socket = null;
  if (retryBody && !answer) {
    const body = retryBody;
    retryBody = null;
    conversation.push(body.messages[body.messages.length - 1]);
    send(body);
  } else {
    connect().catch(() => {});  // connected with the key now, not at the next message
  }
}

// ------------------------------------------------------------------ the server panel

function reasons(list, counts) {
  list.replaceChildren();
  const nonzero = Object.entries(counts).filter(([, n]) => n > 0);
  if (!nonzero.length) {
    const li = document.createElement("li");
    li.className = "muted";
    li.textContent = "none";
    list.appendChild(li);
  }
  for (const [reason, count] of nonzero) {
    const li = document.createElement("li");
    li.dataset.reason = reason;
    li.innerHTML = "<span></span><span></span>";
    li.firstChild.textContent = reason;
    li.lastChild.textContent = count;
    list.appendChild(li);
  }
}

// The bar's length on a log scale: with 32,768 blocks one request holds a few hundredths of a percent,
// which a linear bar never shows. log(1 + used) / log(1 + total): 0 is empty, 1 block ~7%, full is full.
function kvBarFraction(used, total) {
  return total > 0 && used > 0 ? Math.log1p(used) / Math.log1p(total) : 0;
}

let modelShown = false;
let lastAnswered = null;  // when /state last answered (Date.now()), for "unreachable since"

async function fetchState() {
  const abort = new AbortController();
  const timer = setTimeout(() => abort.abort(), STATE_TIMEOUT_MS);  // a hung server never answers
  try {
    const response = await fetch("/state", { cache: "no-store", signal: abort.signal });
    if (!response.ok) throw new Error(`/state answered ${response.status}`);
    return await response.json();
  } finally {
    clearTimeout(timer);
  }
}

function showState(state) {
  $("state-running").textContent = state.requests_running;
  $("state-waiting").textContent = state.requests_waiting;
  const percent = (state.kv_usage * 100).toFixed(1);
  $("state-kv").textContent = `${state.kv_blocks_used} / ${state.kv_blocks_total} blocks (${percent}%)`;
  $("state-kv-bar").style.width = (kvBarFraction(state.kv_blocks_used, state.kv_blocks_total) * 100) + "%";
  reasons($("state-aborted"), state.aborted_last_minute);
  reasons($("state-rejected"), state.rejected_last_minute);
  $("server-card").classList.remove("unreachable");
  $("state-status").textContent = "";
  if (!modelShown) {
    modelShown = true;
    $("model").textContent = state.model;
    const why = BUILT_IN_MODELS[state.model];
    if (why) {
      $("model-note").hidden = false;
      $("model-note").textContent = `${state.model} ${why}: its answers are word salad. ` +
        "Serve a real model with: tidal serve --model /path/to/hf-model-dir";
    }
  }
}

// No answer from /state: the last numbers are not the server's now. They go, and the panel says since when.
function showUnreachable(why) {
  for (const id of ["state-running", "state-waiting", "state-kv"]) $(id).textContent = "-";
  $("state-kv-bar").style.width = "0";
  for (const id of ["state-aborted", "state-rejected"]) {
    const li = document.createElement("li");
    li.className = "muted";
    li.textContent = "-";
    $(id).replaceChildren(li);
  }
  $("server-card").classList.add("unreachable");
  const since = lastAnswered ? ` (last answer ${Math.round((Date.now() - lastAnswered) / 1000)} s ago)` : "";
  $("state-status").textContent = `unreachable${since}`;
  $("state-status").title = why;
}

async function pollState() {
  try {
    showState(await fetchState());
    lastAnswered = Date.now();
  } catch (error) {
    showUnreachable(error.name === "AbortError" ? `no answer within ${STATE_TIMEOUT_MS / 1000} s` : error.message);
  }
  setTimeout(pollState, STATE_POLL_MS);
}

$("composer").addEventListener("submit", submit);
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) submit(event);
});
$("stop").addEventListener("click", stop);
$("clear").addEventListener("click", () => {
  if (answer) stop();
  conversation.length = 0;
  $("messages").replaceChildren();
});
$("key-form").addEventListener("submit", useKey);
pollState();
connect().catch(() => {});  // at once, so the page shows "connected" (or asks for a key) before any message
