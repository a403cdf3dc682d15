// The chat page of furnace-trio: plain JavaScript, no framework, no build step, and no
// request to any other site (the page's Content-Security-Policy allows none).
//
// A conversation is a server-side session (docs/sessions.md): each turn sends only the new
// user message with the conversation's session_id; the server keeps the history and its KV,
// so a turn computes only its new input (the "cached" figure under each answer), and a
// reload shows the conversation again from GET /v1/sessions/{id}. Answers stream as
// server-sent events from /v1/chat/completions. Stop aborts the fetch: the connection
// closes, the server frees the sequence, and the session stays as it was before the turn.
//
// Model output (and everything else from the server) is only ever written as text: Text
// nodes and textContent, never innerHTML.
"use strict";

(() => {
  const KEY_STORAGE = "furnace-trio.api-key";
  const SESSION_STORAGE = "furnace-trio.session";
  const SETTINGS_STORAGE = "furnace-trio.settings";
  // A turn sent right after Stop can find the previous one still ending on the server
  // (409 session_busy): it is retried for a few seconds.
  const BUSY_RETRIES = 20;
  const BUSY_RETRY_MS = 250;

  const $ = (id) => document.getElementById(id);
  const page = {
    conversation: $("conversation"),
    composer: $("composer"),
    message: $("message"),
    send: $("send"),
    stop: $("stop"),
    model: $("model"),
    newChat: $("new-chat"),
    keyForm: $("key-form"),
    key: $("api-key"),
    keyError: $("key-error"),
    temperature: $("temperature"),
    maxTokens: $("max-tokens"),
  };
  const chat = {
    sessionId: sessionStorage.getItem(SESSION_STORAGE) || newSessionId(),
    turns: 0,
    model: null,
    controller: null,
  };
  sessionStorage.setItem(SESSION_STORAGE, chat.sessionId);

  class Unauthorized extends Error {}

  function newSessionId() {
    const bytes = new Uint8Array(16);
    crypto.getRandomValues(bytes); // crypto.randomUUID exists only on https and localhost
    return "chat-" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
  }

  function headers(json) {
    const result = {};
    if (json) result["Content-Type"] = "application/json";
    const key = sessionStorage.getItem(KEY_STORAGE);
    if (key) result["Authorization"] = "Bearer " + key;
    return result;
  }

  async function errorText(response) {
    try {
      const body = await response.json();
      if (body && body.error && typeof body.error.message === "string") return body.error.message;
    } catch {
      // not an OpenAI error object
    }
    return `HTTP ${response.status}`;
  }

  async function errorCode(response) {
    try {
      const body = await response.json();
      return body && body.error ? body.error.code : null;
    } catch {
      return null;
    }
  }

  // A same-origin request with the API key; a 401 asks for the key and throws.
  async function request(path, options = {}) {
    const response = await fetch(path, {
      ...options,
      headers: headers(options.body !== undefined),
      credentials: "same-origin",
    });
    if (response.status === 401) {
      askForKey(await errorText(response));
      throw new Unauthorized("this server needs an API key: enter it above, then send again");
    }
    return response;
  }

  function delay(ms, signal) {
    return new Promise((resolve, reject) => {
      const timer = setTimeout(resolve, ms);
      signal?.addEventListener(
        "abort",
        () => {
          clearTimeout(timer);
          reject(signal.reason);
        },
        { once: true },
      );
    });
  }

  // --- the page ------------------------------------------------------------------------

  function askForKey(message) {
    page.keyForm.hidden = false;
    page.keyError.textContent = sessionStorage.getItem(KEY_STORAGE) ? message : "";
    page.model.textContent = "API key needed";
    page.key.focus();
  }

  function nearBottom() {
    const box = page.conversation;
    return box.scrollHeight - box.scrollTop - box.clientHeight < 80;
  }

  function addMessage(role, text) {
    const follow = nearBottom();
    const box = document.createElement("div");
    box.className = `message ${role}`;
    const body = document.createElement("div");
    body.className = "text";
    const node = document.createTextNode(text);
    body.append(node);
    const stats = document.createElement("div");
    stats.className = "stats";
    box.append(body, stats);
    page.conversation.append(box);
    if (follow) box.scrollIntoView({ block: "end" });
    return { box, text: node, stats };
  }

  function setBusy(busy) {
    page.send.disabled = busy;
    page.stop.disabled = !busy;
  }

  function number(input) {
    const value = input.value.trim();
    return value === "" || Number.isNaN(Number(value)) ? null : Number(value);
  }

  function statsText(usage, timing, finish) {
    const parts = [];
    if (usage) {
      const tokens = usage.completion_tokens;
      parts.push(`${tokens} token${tokens === 1 ? "" : "s"}`);
      const seconds = (timing.last - timing.first) / 1000;
      if (tokens > 1 && seconds > 0) parts.push(`${((tokens - 1) / seconds).toFixed(1)} tok/s`);
      const cached = usage.prompt_tokens_details?.cached_tokens ?? 0;
      parts.push(`${cached} of ${usage.prompt_tokens} prompt tokens cached`);
    }
    if (timing.first !== null) {
      parts.push(`first token after ${Math.round(timing.first - timing.sent)} ms`);
    }
    if (finish === "length") parts.push("cut at the token limit");
    return parts.join(" · ");
  }

  // --- the server ----------------------------------------------------------------------

  async function loadModel() {
    let response;
    try {
      response = await request("/v1/models");
    } catch (err) {
      if (!(err instanceof Unauthorized)) page.model.textContent = "the server is unreachable";
      return false;
    }
    if (!response.ok) {
      page.model.textContent = await errorText(response);
      return false;
    }
    const body = await response.json();
    chat.model = body.data.length ? body.data[0].id : null;
    page.model.textContent = chat.model ?? "no model";
    page.keyForm.hidden = true;
    page.keyError.textContent = "";
    return true;
  }

  // The conversation the server keeps for this tab's session, shown again after a reload.
  async function loadConversation() {
    let response;
    try {
      response = await request(`/v1/sessions/${encodeURIComponent(chat.sessionId)}`);
    } catch {
      return;
    }
    if (!response.ok) return; // 404: nothing said yet, or the session expired
    const session = await response.json();
    page.conversation.replaceChildren();
    for (const message of session.messages) {
      if (message.role !== "user" && message.role !== "assistant") continue;
      const content = Array.isArray(message.content)
        ? message.content.map((part) => part.text ?? "").join("")
        : (message.content ?? "");
      addMessage(message.role, content).box.dataset.state = "done";
    }
    chat.turns = session.turns;
  }

  // The SSE ``data`` payloads of a response body, one string per event.
  async function* serverEvents(body) {
    const reader = body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) return;
        buffer += value.replace(/\r\n/g, "\n");
        const events = buffer.split("\n\n");
        buffer = events.pop();
        for (const event of events) {
          const data = event
            .split("\n")
            .filter((line) => line.startsWith("data:"))
            .map((line) => line.slice(5).replace(/^ /, ""))
            .join("\n");
          if (data) yield data;
        }
      }
    } finally {
      reader.cancel().catch(() => {});
    }
  }

  async function postTurn(text, signal) {
    const body = {
      messages: [{ role: "user", content: text }],
      stream: true,
      stream_options: { include_usage: true },
      session_id: chat.sessionId,
    };
    if (chat.model !== null) body.model = chat.model;
    const temperature = number(page.temperature);
    if (temperature !== null) body.temperature = temperature;
    const maxTokens = number(page.maxTokens);
    if (maxTokens !== null) body.max_tokens = maxTokens;
    const json = JSON.stringify(body);
    for (let attempt = 0; ; attempt++) {
      const response = await request("/v1/chat/completions", {
        method: "POST",
        body: json,
        signal,
      });
      if (response.status !== 409 || attempt >= BUSY_RETRIES) return response;
      if ((await errorCode(response.clone())) !== "session_busy") return response;
      await response.body?.cancel();
      await delay(BUSY_RETRY_MS, signal);
    }
  }

  async function send(text) {
    if (chat.controller !== null || text.trim() === "") return;
    page.message.value = "";
    addMessage("user", text);
    const answer = addMessage("assistant", "");
    answer.box.dataset.state = "streaming";
    const controller = new AbortController();
    chat.controller = controller;
    setBusy(true);
    const timing = { sent: performance.now(), first: null, last: null };
    let usage = null;
    let finish = null;
    let complete = false;
    try {
      const response = await postTurn(text, controller.signal);
      if (!response.ok) throw new Error(await errorText(response));
      for await (const data of serverEvents(response.body)) {
        if (data === "[DONE]") {
          complete = true;
          break;
        }
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices ?? []) {
          const piece = choice.delta?.content;
          if (piece) {
            const now = performance.now();
            timing.first ??= now;
            timing.last = now;
            const follow = nearBottom();
            answer.text.appendData(piece);
            if (follow) answer.box.scrollIntoView({ block: "end" });
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      }
      if (!complete) throw new Error("the answer ended early: the connection was cut");
      chat.turns += 1;
      answer.box.dataset.state = "done";
      answer.stats.textContent = statsText(usage, timing, finish);
    } catch (err) {
      if (err.name === "AbortError") {
        answer.box.dataset.state = "stopped";
        answer.stats.textContent = "stopped: this turn is not kept in the conversation";
      } else {
        answer.box.dataset.state = "error";
        answer.stats.classList.add("error");
        answer.stats.textContent = err.message;
      }
    } finally {
      chat.controller = null;
      setBusy(false);
      page.message.focus();
    }
  }

  // Forget the server's copy of a conversation; best effort (idle sessions expire anyway).
  async function forget(sessionId) {
    for (let attempt = 0; attempt < BUSY_RETRIES; attempt++) {
      let response;
      try {
        response = await request(`/v1/sessions/${encodeURIComponent(sessionId)}`, {
          method: "DELETE",
        });
      } catch {
        return;
      }
      if (response.status !== 409) return;
      await delay(BUSY_RETRY_MS);
    }
  }

  // --- events --------------------------------------------------------------------------

  page.message.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      page.composer.requestSubmit();
    }
  });

  page.composer.addEventListener("submit", (event) => {
    event.preventDefault();
    send(page.message.value);
  });

  page.stop.addEventListener("click", () => chat.controller?.abort());

  page.newChat.addEventListener("click", () => {
    chat.controller?.abort();
    if (chat.turns > 0 || chat.controller !== null) forget(chat.sessionId);
    chat.sessionId = newSessionId();
    chat.turns = 0;
    sessionStorage.setItem(SESSION_STORAGE, chat.sessionId);
    page.conversation.replaceChildren();
    page.message.focus();
  });

  page.keyForm.addEventListener("submit", async (event) => {
    event.preventDefault();
    const key = page.key.value.trim();
    if (key) sessionStorage.setItem(KEY_STORAGE, key);
    else sessionStorage.removeItem(KEY_STORAGE);
    page.key.value = "";
    if (await loadModel()) await loadConversation();
  });

  for (const input of [page.temperature, page.maxTokens]) {
    input.addEventListener("change", () => {
      const settings = { temperature: page.temperature.value, maxTokens: page.maxTokens.value };
      sessionStorage.setItem(SETTINGS_STORAGE, JSON.stringify(settings));
    });
  }

  try {
    const settings = JSON.parse(sessionStorage.getItem(SETTINGS_STORAGE) ?? "{}");
    page.temperature.value = settings.temperature ?? "";
    page.maxTokens.value = settings.maxTokens ?? "";
  } catch {
    sessionStorage.removeItem(SETTINGS_STORAGE);
  }

  loadModel().then((ok) => (ok ? loadConversation() : undefined));
})();
