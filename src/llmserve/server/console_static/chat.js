// The chat playground: a conversation streamed from /v1/chat/completions, with the
// system prompt and sampling controls, Stop (the server aborts the request when the
// connection closes), Copy and Regenerate, and each answer's TTFT and tokens/s.

import { AuthError, postStream } from "./api.js";
import * as fmt from "./format.js";

export class Chat {
  constructor(root, { onAuthError }) {
    this.root = root;
    this.onAuthError = onAuthError;
    this.model = null;
    this.maxTokensLimit = null;
    this.history = []; // {role, content} of finished turns
    this.controller = null;
    this.$ = (id) => root.querySelector(`#${id}`);
    this.list = this.$("messages");
    this.prompt = this.$("prompt");
    this.sendButton = this.$("send");
    this.stopButton = this.$("stop");
    this.$("composer").addEventListener("submit", (e) => {
      e.preventDefault();
      this.send();
    });
    // Enter sends (Shift+Enter: a new line); on touch screens, whose keyboards have no
    // Shift+Enter, Enter is a new line and the Send button sends.
    const touch = window.matchMedia("(pointer: coarse)").matches;
    if (touch) this.prompt.placeholder = "Send a message (the Send button sends)";
    this.prompt.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing && !touch) {
        e.preventDefault();
        this.send();
      }
    });
    this.stopButton.addEventListener("click", () => this.stop());
    this.$("clear").addEventListener("click", () => this.clear());
    this.announcer = this.$("chat-announcer"); // finished answers, for screen readers
  }

  setInfo(info) {
    this.model = info.model;
    this.maxTokensLimit = info.max_model_len;
    if (info.max_model_len) this.$("max-tokens").max = String(info.max_model_len);
  }

  get busy() {
    return this.controller !== null;
  }

  clear() {
    this.stop();
    this.history = [];
    this.list.replaceChildren();
    this.prompt.focus();
  }

  stop() {
    if (this.controller) this.controller.abort();
  }

  send() {
    const text = this.prompt.value.trim();
    if (!text || this.busy) return;
    this.prompt.value = "";
    this.history.push({ role: "user", content: text });
    this.addMessage("user", text);
    this.answer();
  }

  regenerate() {
    if (this.busy) return;
    // Drop the last answer (and its bubble) and ask again with the same conversation.
    if (this.history.length && this.history[this.history.length - 1].role === "assistant") {
      this.history.pop();
      const bubbles = this.list.querySelectorAll(".message.assistant");
      if (bubbles.length) bubbles[bubbles.length - 1].remove();
    }
    if (this.history.length) this.answer();
  }

  addMessage(role, text) {
    const item = document.createElement("li");
    item.className = `message ${role}`;
    const who = document.createElement("span");
    who.className = "who";
    who.textContent = role === "user" ? "You" : "Model";
    const body = document.createElement("div");
    body.className = "text";
    body.textContent = text;
    item.append(who, body);
    this.list.append(item);
    this.reveal(item);
    return item;
  }

  // Scrolls the end of ``item`` into view above the composer, which stays pinned to the
  // bottom of the window over the messages.
  reveal(item) {
    item.style.scrollMarginBottom = `${this.$("composer").offsetHeight + 8}px`;
    item.scrollIntoView({ block: "end" });
  }

  sampling() {
    const number = (id) => {
      const v = this.$(id).value.trim();
      return v === "" ? null : Number(v);
    };
    const body = {};
    const temperature = number("temperature");
    const topP = number("top-p");
    const maxTokens = number("max-tokens");
    const seed = number("seed");
    if (temperature !== null) body.temperature = temperature;
    if (topP !== null) body.top_p = topP;
    if (maxTokens !== null) body.max_tokens = Math.round(maxTokens);
    if (seed !== null) body.seed = Math.round(seed);
    return body;
  }

  async answer() {
    // This conversation: "New chat" or signing out starts another while this answer may
    // still be arriving, and what arrives belongs to this one only.
    const history = this.history;
    const system = this.$("system-prompt").value.trim();
    const messages = [...(system ? [{ role: "system", content: system }] : []), ...history];
    const item = this.addMessage("assistant", "");
    item.setAttribute("aria-busy", "true");
    const text = item.querySelector(".text");
    const stats = document.createElement("div");
    stats.className = "stats";
    stats.textContent = "Waiting for the first token…";
    item.append(stats);

    this.controller = new AbortController();
    this.sendButton.disabled = true;
    this.stopButton.disabled = false;
    const started = performance.now();
    let first = null;
    let last = null;
    let content = "";
    let pieces = 0; // content deltas received
    let usage = null;
    let finish = null;
    let failure = null;
    try {
      await postStream("v1/chat/completions", {
        ...(this.model ? { model: this.model } : {}),
        messages,
        stream: true,
        stream_options: { include_usage: true },
        ...this.sampling(),
      }, (event) => {
        if (event.error) {
          failure = event.error.message || "the server ended the stream with an error";
          return;
        }
        if (event.usage) usage = event.usage;
        for (const choice of event.choices || []) {
          const delta = choice.delta && choice.delta.content;
          if (delta) {
            last = performance.now();
            if (first === null) first = last;
            content += delta;
            pieces += 1;
            text.textContent = content;
            this.reveal(item);
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      }, this.controller.signal);
    } catch (e) {
      if (e.name === "AbortError") finish = "stopped";
      else if (e instanceof AuthError) {
        failure = e.message;
        this.onAuthError(e);
      } else failure = failure || e.message; // the server's own error event first
    } finally {
      this.controller = null;
      this.sendButton.disabled = false;
      this.stopButton.disabled = true;
      item.removeAttribute("aria-busy");
    }

    if (history !== this.history) return; // a new conversation started meanwhile

    if (failure) {
      item.classList.add("error");
      const error = document.createElement("div");
      error.className = "error";
      error.setAttribute("role", "alert");
      error.textContent = failure;
      item.insertBefore(error, stats);
    }
    if (content) {
      history.push({ role: "assistant", content });
    } else if (history.length && history[history.length - 1].role === "user") {
      // Nothing came back: the question goes back to the composer, so that the next
      // message does not follow an unanswered one (templates that need alternating roles
      // would refuse every later turn).
      const question = history.pop();
      const bubbles = this.list.querySelectorAll(".message.user");
      if (bubbles.length) bubbles[bubbles.length - 1].remove();
      if (!this.prompt.value.trim()) this.prompt.value = question.content;
    }
    // A cut stream has no usage: its pieces are counted instead (a piece may hold more
    // than one token, so that count is a lower bound, and says so).
    const tokens = usage ? usage.completion_tokens : (pieces || null);
    const parts = [];
    if (first !== null) parts.push(`TTFT ${fmt.millis((first - started) / 1000)}`);
    if (tokens !== null && tokens > 1 && last > first) {
      const rate = fmt.number((tokens - 1) / ((last - first) / 1000));
      parts.push(usage ? `${rate} tokens/s` : `≥ ${rate} tokens/s`);
    }
    if (tokens !== null) parts.push(usage ? `${tokens} tokens` : `≥ ${tokens} tokens`);
    if (finish) parts.push(finish === "length" ? "stopped at max tokens" : finish);
    stats.textContent = parts.join(" · ");
    stats.title = "TTFT: from sending to the first token; tokens/s: decode rate after it";
    this.announcer.textContent = failure ? `Error: ${failure}` : `Model: ${content}`;
    if (content) this.addActions(item, content);
    this.reveal(item);
    this.prompt.focus();
  }

  addActions(item, content) {
    const actions = document.createElement("div");
    actions.className = "actions";
    const copy = document.createElement("button");
    copy.type = "button";
    copy.className = "quiet";
    copy.textContent = "Copy";
    copy.disabled = !content;
    copy.addEventListener("click", async () => {
      await copyText(content);
      copy.textContent = "Copied";
      setTimeout(() => { copy.textContent = "Copy"; }, 1500);
    });
    const again = document.createElement("button");
    again.type = "button";
    again.className = "quiet regenerate";
    again.textContent = "Regenerate";
    again.addEventListener("click", () => this.regenerate());
    actions.append(copy, again);
    item.append(actions);
    // Only the newest answer can be regenerated.
    for (const b of this.list.querySelectorAll(".regenerate")) b.hidden = b !== again;
  }
}

async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
  } catch (_) { // no clipboard permission (plain http on another host): the old way
    const area = document.createElement("textarea");
    area.value = text;
    area.setAttribute("readonly", "");
    area.style.position = "fixed";
    area.style.opacity = "0";
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
}
