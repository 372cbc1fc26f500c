// The console's shell: sign-in when the server requires a key, the tabs, the model card.

import { AuthError, getJSON, setApiKey, apiKey, badKeyCharacter } from "./api.js";
import { Chat } from "./chat.js";
import { Dashboard } from "./dashboard.js";
import * as fmt from "./format.js";

const $ = (id) => document.getElementById(id);
const TABS = ["chat", "dashboard", "model"];

let chat;
let dashboard;
let retry = null; // the timer of the next try to load, while the server does not answer

function selectTab(name, focus = false) {
  for (const tab of TABS) {
    const selected = tab === name;
    const button = $(`tab-${tab}`);
    button.setAttribute("aria-selected", String(selected));
    button.tabIndex = selected ? 0 : -1;
    $(`panel-${tab}`).hidden = !selected;
    if (selected && focus) button.focus();
  }
  if (name === "dashboard") dashboard.show();
  else dashboard.hide();
  // Arrow keys keep the focus on the tabs; a click or the first load goes to the prompt.
  if (name === "chat" && !focus) $("prompt").focus();
}

function setUpTabs() {
  TABS.forEach((name, i) => {
    const button = $(`tab-${name}`);
    button.addEventListener("click", () => selectTab(name));
    button.addEventListener("keydown", (e) => { // the WAI-ARIA tabs pattern
      const step = { ArrowRight: 1, ArrowLeft: -1 }[e.key];
      if (step) selectTab(TABS[(i + step + TABS.length) % TABS.length], true);
      else if (e.key === "Home") selectTab(TABS[0], true);
      else if (e.key === "End") selectTab(TABS[TABS.length - 1], true);
      else return;
      e.preventDefault();
    });
  });
}

function showCard(info) {
  const rows = [
    ["Model", info.model],
    ["Architecture", info.architecture],
    ["Parameters", fmt.count(info.num_parameters)],
    ["Weight format", info.weight_format],
    ["Weights in memory", fmt.bytes(info.weight_bytes)],
    ["Context window", info.max_model_len && `${fmt.integer(info.max_model_len)} tokens`],
    ["KV cache format", info.kv_cache_dtype
      && `${info.kv_cache_dtype}, blocks of ${info.kv_block_size} tokens`],
    ["KV bytes per token", info.kv_bytes_per_token && fmt.bytes(info.kv_bytes_per_token)],
    ["KV capacity", info.kv_capacity_tokens
      && `${fmt.integer(info.kv_capacity_tokens)} tokens, all sequences together`],
    ["KV per full-context sequence", info.kv_bytes_per_sequence
      && fmt.bytes(info.kv_bytes_per_sequence)],
    ["Full-context sequences that fit", fmt.number(info.full_context_sequences)],
    ["Device", info.device],
    ["Speculative decoding", info.speculative || "off"],
    ["Cost per hour", info.cost_per_hour ? fmt.dollars(info.cost_per_hour) : "not set (--cost-per-hour)"],
    ["API key required", info.auth_required ? "yes" : "no"],
  ];
  const card = $("card");
  card.replaceChildren();
  for (const [name, value] of rows) {
    const dt = document.createElement("dt");
    dt.textContent = name;
    const dd = document.createElement("dd");
    dd.textContent = value === undefined || value === null || value === "" ? "–" : String(value);
    card.append(dt, dd);
  }
  $("model-name").textContent = info.model || "";
  document.title = `${info.model} · llmserve`;
}

// Only the sign-in form, or only the notice that the server is unavailable: the tabs and
// panels are hidden until the model card loads.
function hideConsole() {
  for (const tab of TABS) $(`panel-${tab}`).hidden = true;
  document.querySelector(".tabs").hidden = true;
  $("sign-out").hidden = true;
}

function showSignIn(message = "") {
  $("unavailable").hidden = true;
  $("signin").hidden = false;
  hideConsole();
  $("signin-error").textContent = message;
  $("api-key").focus();
}

function showUnavailable(message) {
  $("signin").hidden = true;
  hideConsole();
  const notice = $("unavailable");
  notice.hidden = false;
  notice.textContent = `The server is not available: ${message}. Trying again every 3 s.`;
}

async function load() {
  clearTimeout(retry); // one chain of tries, however many sign-ins start one
  retry = null;
  let info;
  try {
    info = await getJSON("console/api/info");
  } catch (e) {
    if (e instanceof AuthError) {
      showSignIn(apiKey() ? "That key was not accepted: it is wrong or was revoked." : "");
    } else {
      showUnavailable(e.message);
      retry = setTimeout(load, 3000);
    }
    return;
  }
  $("signin").hidden = true;
  $("unavailable").hidden = true;
  document.querySelector(".tabs").hidden = false;
  $("sign-out").hidden = !info.auth_required;
  showCard(info);
  chat.setInfo(info);
  dashboard.setInfo(info);
  dashboard.start();
  const current = TABS.find((t) => $(`tab-${t}`).getAttribute("aria-selected") === "true");
  selectTab(current || "chat");
}

function main() {
  chat = new Chat($("panel-chat"), {
    onAuthError: () => { setApiKey(""); showSignIn("The key was refused; sign in again."); },
  });
  dashboard = new Dashboard({ charts: $("charts"), tiles: $("tiles"), status: $("dash-status"),
    outage: $("dash-outage") });
  setUpTabs();
  $("signin-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const key = $("api-key").value.trim();
    const bad = badKeyCharacter(key);
    if (bad) {
      showSignIn(`That key holds ${bad}, which an HTTP header cannot carry (pasted with `
        + "the key, perhaps): enter the key alone.");
      return;
    }
    $("api-key").value = "";
    setApiKey(key);
    load();
  });
  $("sign-out").addEventListener("click", () => {
    setApiKey("");
    chat.clear();
    dashboard.stop();
    $("model-name").textContent = "";
    document.title = "llmserve";
    showSignIn();
  });
  if (badKeyCharacter(apiKey())) setApiKey(""); // stored by an older page: sign in again
  load();
}

main();
