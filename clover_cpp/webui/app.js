// clover-cpp serve's web chat (docs/serve.md, "Web chat"), served by llama-server from --path. Plain JavaScript,
// no build step, no dependencies. It uses llama-server's API: GET v1/models and props, then streamed POST
// v1/chat/completions (server-sent events) with the OpenAI request shape plus the block-diffusion fields (mode,
// block_size, threshold) and, when the live canvas is on, return_canvas, whose chunks carry each LowConfidence
// step's block ("canvas": block, step, cells). The final chunk's timings give the stats. The conversation is kept
// here, in the page; the API key (servers started with --api-key) in sessionStorage.
'use strict';

const KEY_STORAGE = 'clover-api-key';
const SETTINGS_STORAGE = 'clover-webui-settings';
const SETTING_IDS = ['mode', 'block-size', 'threshold', 'temperature', 'max-tokens', 'thinking', 'show-canvas'];

const $ = (id) => document.getElementById(id);
const state = { model: null, messages: [], busy: false, controller: null, defaults: {} };

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE) || '';
}

function headers() {
  const h = { 'Content-Type': 'application/json' };
  const key = apiKey();
  if (key) h.Authorization = 'Bearer ' + key;
  return h;
}

async function errorMessage(resp) {
  try {
    const body = await resp.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (_) { /* not JSON */ }
  return 'HTTP ' + resp.status;
}

// ------------------------------------------------------------------------------------ settings
function loadSettings() {
  let saved = {};
  try { saved = JSON.parse(localStorage.getItem(SETTINGS_STORAGE) || '{}'); } catch (_) { saved = {}; }
  for (const id of SETTING_IDS) {
    if (!(id in saved)) continue;
    const input = $(id);
    if (input.type === 'checkbox') input.checked = Boolean(saved[id]); else input.value = saved[id];
  }
}

function saveSettings() {
  const out = {};
  for (const id of SETTING_IDS) {
    const input = $(id);
    out[id] = input.type === 'checkbox' ? input.checked : input.value;
  }
  try { localStorage.setItem(SETTINGS_STORAGE, JSON.stringify(out)); } catch (_) { /* storage off */ }
}

function numberSetting(id, parse) {
  const raw = $(id).value.trim();
  if (raw === '') return undefined;
  const value = parse(raw);
  return Number.isFinite(value) ? value : undefined;
}

function requestBody() {
  const body = {
    model: state.model,
    messages: state.messages,
    stream: true,
    stream_options: { include_usage: true },
    chat_template_kwargs: { enable_thinking: $('thinking').checked },
  };
  const mode = $('mode').value;
  if (mode) body.mode = mode;
  const fields = [['block_size', 'block-size', (s) => parseInt(s, 10)], ['threshold', 'threshold', parseFloat],
    ['temperature', 'temperature', parseFloat], ['max_tokens', 'max-tokens', (s) => parseInt(s, 10)]];
  for (const [name, id, parse] of fields) {
    const value = numberSetting(id, parse);
    if (value !== undefined) body[name] = value;
  }
  if ($('show-canvas').checked && mode !== 'ar') body.return_canvas = true;
  return body;
}

// ------------------------------------------------------------------------------------ connection and key
async function connect() {
  let resp;
  try {
    resp = await fetch('v1/models', { headers: headers() });
  } catch (err) {
    $('model').textContent = 'server unreachable';
    return;
  }
  if (resp.status === 401) {
    askKey();
    return;
  }
  if (!resp.ok) {
    $('model').textContent = await errorMessage(resp);
    return;
  }
  const card = (await resp.json()).data[0];
  state.model = card.id;
  $('model').textContent = card.id;
  try {  // the server's defaults for what a request leaves out (mode, block size, threshold)
    const props = await fetch('props', { headers: headers() });
    if (props.ok) state.defaults = ((await props.json()).default_generation_settings || {}).params || {};
  } catch (_) { state.defaults = {}; }
  const d = state.defaults;
  if (d.block_size) $('block-size').placeholder = 'server: ' + d.block_size;
  if (typeof d.threshold === 'number') $('threshold').placeholder = 'server: ' + Number(d.threshold.toPrecision(3));
  $('send').disabled = false;
  document.body.dataset.ready = '1';
}

// the server answered 401: ask for a key, saying so when the one sent was refused
function askKey() {
  delete document.body.dataset.ready;
  $('send').disabled = true;
  $('model').textContent = 'API key needed';
  $('key-error').textContent = apiKey() ? 'The server refused this key.' : '';
  $('key-panel').hidden = false;
  $('api-key').focus();
}

function submitKey(event) {
  event.preventDefault();
  const key = $('api-key').value.trim();
  if (!key) {
    $('key-error').textContent = 'Enter the key.';
    return;
  }
  sessionStorage.setItem(KEY_STORAGE, key);
  $('api-key').value = '';
  $('key-panel').hidden = true;
  connect();
}

// ------------------------------------------------------------------------------------ one answer on screen
const messagesBox = () => $('messages');

function nearBottom() {
  const box = messagesBox();
  return box.scrollHeight - box.scrollTop - box.clientHeight < 80;
}

function follow(stick) {
  if (stick) messagesBox().scrollTop = messagesBox().scrollHeight;
}

function addUserMessage(text) {
  const node = el('div', 'msg user');
  node.appendChild(el('div', 'content', text));
  messagesBox().appendChild(node);
  return node;
}

// A token piece in a canvas cell: spaces, tabs and newlines made visible
function cellText(piece) {
  if (piece === '') return '\u2205';
  return piece.replace(/\n/g, '\u21b5').replace(/\t/g, '\u21e5').replace(/ /g, '\u2423');
}

class Answer {
  constructor() {
    this.node = el('div', 'msg assistant');
    this.node.dataset.state = 'streaming';
    this.reasoning = el('details', 'reasoning');
    this.reasoning.hidden = true;
    this.reasoning.open = true;
    this.reasoningLabel = el('summary', null, 'Thinking…');
    this.reasoningText = el('div', 'reasoning-text');
    this.reasoning.append(this.reasoningLabel, this.reasoningText);
    this.content = el('div', 'content');
    this.canvasBox = el('div', 'canvas-box');
    this.canvasBox.hidden = true;
    const head = el('div', 'canvas-head');
    this.canvasInfo = el('span', 'canvas-info');
    head.append(el('span', 'canvas-title', 'Block canvas'), this.canvasInfo);
    this.canvas = el('div', 'canvas');
    this.canvasBox.append(head, this.canvas);
    this.stats = el('div', 'stats');
    this.node.append(this.reasoning, this.content, this.canvasBox, this.stats);
    messagesBox().appendChild(this.node);
    this.text = '';
    this.thought = '';
    this.cells = null;     // the last canvas frame
    this.block = -1;       // the block of the last canvas frame
    this.window = 0;       // canvas windows seen
    this.step = 0;         // steps in the current window
    this.frames = 0;       // canvas frames seen
    this.mixed = 0;        // frames with both masked and filled cells
  }

  addReasoning(text) {
    const stick = nearBottom();
    this.thought += text;
    this.reasoning.hidden = false;
    this.reasoningText.textContent = this.thought;
    follow(stick);
  }

  addContent(text) {
    const stick = nearBottom();
    if (!this.text && this.thought) this.reasoning.open = false;  // the answer starts: fold the reasoning away
    this.text += text;
    this.content.textContent = this.text;
    follow(stick);
  }

  // one LowConfidence step of a block: {block, step, n_produced, done, eog, cells: [text or null], tokens}
  showCanvas(frame) {
    const stick = nearBottom();
    const cells = frame.cells;
    const prev = this.cells;
    const fresh = !prev || frame.block !== this.block || prev.length !== cells.length;
    this.block = frame.block;
    if (fresh) {
      this.window += 1;
      this.step = 0;
      this.canvas.replaceChildren(...cells.map(() => el('span', 'cell masked')));
    }
    this.step += 1;
    let filled = 0;
    cells.forEach((piece, i) => {
      const cell = this.canvas.children[i];
      // still masked: a fresh window's cells start masked, and within a window a filled cell never empties
      if (piece === null) return;
      filled += 1;
      const isNew = fresh || prev[i] !== piece;
      cell.className = isNew ? 'cell filled new' : 'cell filled';
      cell.textContent = cellText(piece);
      cell.title = JSON.stringify(piece);
    });
    this.cells = cells;
    this.frames += 1;
    if (filled > 0 && filled < cells.length) this.mixed += 1;
    this.node.dataset.canvasFrames = String(this.frames);
    this.node.dataset.canvasMixed = String(this.mixed);
    this.canvasInfo.textContent = `window ${this.window} · step ${this.step} · ${filled}/${cells.length} filled`;
    this.canvasBox.hidden = false;
    follow(stick);
  }

  // the final chunk's timings (llama-server's, with the passes of a block-diffusion model), and the request
  showStats(timings, request, finish) {
    if (!timings) return;
    const d = state.defaults;
    const mode = request.mode || d.mode || 'auto';
    const passes = (timings.block_passes || 0) + (timings.causal_passes || 0);
    let head = mode;
    if (mode === 'diffusion') {
      const width = request.block_size || (this.cells && this.cells.length) || d.block_size;
      const threshold = request.threshold !== undefined ? request.threshold : d.threshold;
      head += ` B=${width}` + (typeof threshold === 'number' ? ` threshold=${Number(threshold).toFixed(2)}` : '');
    }
    const parts = [
      ['mode', head],
      ['tokens', `${timings.predicted_n} tokens`],
      ['tok-s', `${Number(timings.predicted_per_second).toFixed(1)} tok/s`],
      ['tpf', `TPF ${Number(timings.tokens_per_pass || 1).toFixed(2)}`],
      ['passes', `${passes} passes`],
      ['stop', `stop: ${finish || 'unknown'}`],
    ];
    this.stats.replaceChildren(...parts.map(([name, text]) => {
      const span = el('span', 'stat', text);
      span.dataset.stat = name;
      return span;
    }));
  }

  error(message) {
    this.node.appendChild(el('div', 'error', message));
  }

  finish(how) {
    if (this.thought) {
      this.reasoningLabel.textContent = `Reasoning (${this.thought.length} characters)`;
      if (this.text) this.reasoning.open = false;
    }
    if (!this.text && !this.thought && how === 'done') this.content.appendChild(el('span', 'empty', '(empty answer)'));
    this.canvas.querySelectorAll('.new').forEach((cell) => cell.classList.remove('new'));
    this.canvasBox.classList.add('done');
    this.node.dataset.state = how;
  }
}

// ------------------------------------------------------------------------------------ the stream
async function* sseData(resp) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = '';
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf('\n')) >= 0) {
      const line = buffer.slice(0, end).replace(/\r$/, '');
      buffer = buffer.slice(end + 1);
      if (line.startsWith('data:')) yield line.slice(5).trim();
    }
  }
}

function setBusy(busy) {
  state.busy = busy;
  $('send').hidden = busy;
  $('stop').hidden = !busy;
}

async function send(event) {
  event.preventDefault();
  const text = $('prompt').value.trim();
  if (!text || state.busy || !state.model) return;
  saveSettings();
  $('prompt').value = '';
  const conversation = state.messages;  // "New chat" during the answer starts another one
  conversation.push({ role: 'user', content: text });
  const userNode = addUserMessage(text);
  const answer = new Answer();
  follow(true);
  setBusy(true);
  state.controller = new AbortController();
  let how = 'done';
  const request = requestBody();
  let finish = null;
  try {
    const resp = await fetch('v1/chat/completions', {
      method: 'POST', headers: headers(), body: JSON.stringify(request), signal: state.controller.signal,
    });
    if (resp.status === 401) {  // the key is missing or wrong: ask, and give the prompt back
      how = 'key';
      userNode.remove();
      answer.node.remove();
      $('prompt').value = text;
      askKey();
      return;
    }
    if (!resp.ok) {
      answer.error(await errorMessage(resp));
      how = 'error';
      return;
    }
    for await (const data of sseData(resp)) {
      if (data === '[DONE]') break;
      const chunk = JSON.parse(data);
      if (chunk.error) {
        answer.error(chunk.error.message || 'generation failed');
        how = 'error';
        break;
      }
      if (chunk.canvas) answer.showCanvas(chunk.canvas);
      for (const choice of chunk.choices || []) {
        finish = choice.finish_reason || finish;
        const delta = choice.delta || {};
        if (delta.reasoning_content) answer.addReasoning(delta.reasoning_content);
        if (delta.content) answer.addContent(delta.content);
      }
      if (chunk.timings) answer.showStats(chunk.timings, request, finish);
    }
  } catch (err) {
    if (err.name === 'AbortError') {
      how = 'stopped';
    } else {
      answer.error(String(err.message || err));
      how = 'error';
    }
  } finally {
    if (how === 'done' || how === 'stopped' || answer.text) {
      conversation.push({ role: 'assistant', content: answer.text });
    } else {
      conversation.pop();  // a failed turn (or one refused for its key) is not part of the conversation
    }
    if (answer.node.isConnected) answer.finish(how);
    state.controller = null;
    setBusy(false);
  }
}

function newChat() {
  if (state.controller) state.controller.abort();
  state.messages = [];
  messagesBox().replaceChildren();
  $('prompt').focus();
}

document.addEventListener('DOMContentLoaded', () => {
  loadSettings();
  $('send').disabled = true;
  $('composer').addEventListener('submit', send);
  $('stop').addEventListener('click', () => state.controller && state.controller.abort());
  $('new-chat').addEventListener('click', newChat);
  $('key-form').addEventListener('submit', submitKey);
  for (const id of SETTING_IDS) $(id).addEventListener('change', saveSettings);
  $('prompt').addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $('composer').requestSubmit();
    }
  });
  connect();
});
