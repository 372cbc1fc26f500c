// Talking to the server: the key lives in this tab's sessionStorage only and travels in the
// Authorization header, never in a URL. Paths are relative, so the console works behind a
// reverse proxy that serves it under a prefix.

const KEY = "llmserve.apiKey";

export class AuthError extends Error {}

export class APIError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

export function apiKey() {
  return sessionStorage.getItem(KEY) || "";
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY, key);
  else sessionStorage.removeItem(KEY);
}

// A description of the first character of ``key`` that an HTTP header cannot carry (the
// browser refuses to send it), or "" when there is none. Keys are printable ASCII.
export function badKeyCharacter(key) {
  const bad = [...key].find((c) => c < "!" || c > "~");
  if (bad === undefined) return "";
  const code = bad.codePointAt(0).toString(16).toUpperCase().padStart(4, "0");
  return bad === " " ? "a space" : `the character U+${code}`;
}

export function headers(extra = {}) {
  const key = apiKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : { ...extra };
}

// The message of an error in OpenAI's envelope, or the status line.
export async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  let code;
  try {
    const body = await response.json();
    if (body && body.error) {
      message = body.error.message || message;
      code = body.error.code;
    }
  } catch (_) { /* not JSON */ }
  if (response.status === 401) return new AuthError(message);
  const retry = response.headers.get("Retry-After");
  // The wait, unless the server's message gives it already ("try again in 30 s"); a bare
  // "retry later" still gets the seconds.
  if (retry && !/\b(in|after) \d+(\.\d+)? ?s\b/i.test(message)) {
    message += ` (retry after ${retry} s)`;
  }
  return new APIError(response.status, message, code);
}

// fetch, with the browser's bare "Failed to fetch" (no answer at all: the server is down
// or unreachable) said in words; a Stop (AbortError) passes through.
async function request(path, options) {
  try {
    return await fetch(path, options);
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new Error(`the server could not be reached (${e.message})`);
  }
}

export async function getJSON(path) {
  const response = await request(path, { headers: headers(), cache: "no-store" });
  if (!response.ok) throw await errorOf(response);
  return response.json();
}

export async function getText(path) {
  const response = await request(path, { headers: headers(), cache: "no-store" });
  if (!response.ok) throw await errorOf(response);
  return response.text();
}

// POST a streaming request and call onEvent(object) for each server-sent event's JSON;
// returns at [DONE]. A stream that closes without [DONE] (a proxy's timeout, a server that
// went away) throws: the answer is cut, not complete.
export async function postStream(path, body, onEvent, signal) {
  const response = await request(path, {
    method: "POST",
    headers: headers({ "Content-Type": "application/json", Accept: "text/event-stream" }),
    body: JSON.stringify(body),
    signal,
  });
  if (!response.ok) throw await errorOf(response);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let carry = ""; // a CR at the end of a read: its LF may open the next one
  // One event's data lines, joined; true at [DONE].
  const dispatch = (event) => {
    const data = event.split("\n").filter((l) => l.startsWith("data:"))
      .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
    if (!data) return false;
    if (data === "[DONE]") return true;
    onEvent(JSON.parse(data));
    return false;
  };
  for (;;) {
    const { value, done } = await reader.read();
    // Events end at a blank line; the spec allows CRLF, CR or LF line endings.
    let text = carry + (done ? decoder.decode() : decoder.decode(value, { stream: true }));
    carry = !done && text.endsWith("\r") ? "\r" : "";
    if (carry) text = text.slice(0, -1);
    buffer += text.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      if (dispatch(event)) {
        reader.cancel().catch(() => {});
        return;
      }
    }
    if (done) {
      if (buffer.trim() && dispatch(buffer)) return; // a last event without its blank line
      throw new Error("the connection closed before the answer was complete");
    }
  }
}
