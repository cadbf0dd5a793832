// mlxq's page: transcribe a file or a recording as an async job (the transcript grows live from the
// job's event stream), recent jobs, and a streamed chat. Plain browser JavaScript, no build step.
"use strict";

const $ = (id) => document.getElementById(id);
const keyInput = $("key");
keyInput.value = localStorage.getItem("mlxq_key") || "";
keyInput.addEventListener("change", () => { localStorage.setItem("mlxq_key", keyInput.value); loadModels(); loadJobs(); });

function headers(extra = {}) {
  const key = keyInput.value.trim();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

async function api(path, options = {}) {
  const response = await fetch(path, { ...options, headers: headers(options.headers) });
  if (!response.ok) {
    let message = `HTTP ${response.status}`;
    try { message = (await response.json()).error.message; } catch (e) { /* not the envelope */ }
    throw new Error(message);
  }
  return response;
}

// Server-Sent Events over fetch (EventSource cannot send an Authorization header).
async function* sse(path, options = {}) {
  const response = await api(path, options);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const event = { event: "message", data: "" };
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) event.event = line.slice(6).trim();
        else if (line.startsWith("data:")) event.data += line.slice(5).trim();
      }
      if (event.data) yield event;
    }
  }
}

function clock(seconds) {
  const s = Math.max(0, Math.round(seconds));
  return `${Math.floor(s / 60)}:${String(s % 60).padStart(2, "0")}`;
}

// --- models ---------------------------------------------------------------------------------------
async function loadModels() {
  try {
    const models = (await (await api("/v1/models")).json()).data;
    fill($("speech-model"), models.filter((m) => m.kind === "speech"));
    // Text models first: the first one is the chat's default, and a vision model answers text more slowly.
    fill($("chat-model"), [...models.filter((m) => m.kind === "text"), ...models.filter((m) => m.kind === "vision")]);
  } catch (error) {
    $("job-status").textContent = `Cannot list models: ${error.message}`;
  }
}

function fill(select, models) {
  select.replaceChildren(...models.map((m) => new Option(m.id, m.id)));
}

// --- transcription --------------------------------------------------------------------------------
let recorded = null;
let recorder = null;

$("record").addEventListener("click", async () => {
  if (recorder) { recorder.stop(); return; }
  try {
    const stream = await navigator.mediaDevices.getUserMedia({ audio: true });
    const chunks = [];
    recorder = new MediaRecorder(stream);
    recorder.ondataavailable = (e) => chunks.push(e.data);
    recorder.onstop = () => {
      stream.getTracks().forEach((t) => t.stop());
      recorded = new Blob(chunks, { type: recorder.mimeType });
      recorder = null;
      $("record").textContent = "Record";
      $("job-status").textContent = `Recorded ${Math.round(recorded.size / 1024)} KiB: press Transcribe.`;
    };
    recorder.start();
    $("record").textContent = "Stop";
  } catch (error) {
    $("job-status").textContent = `Microphone unavailable: ${error.message}`;
  }
});

$("transcribe-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const file = $("audio-file").files[0] || (recorded && new File([recorded], "recording.webm"));
  if (!file) { $("job-status").textContent = "Choose a file or record first."; return; }
  const form = new FormData();
  form.append("file", file);
  form.append("model", $("speech-model").value);
  if ($("language").value.trim()) form.append("language", $("language").value.trim());
  $("transcript").replaceChildren();
  $("downloads").hidden = true;
  try {
    const job = await (await api("/v1/jobs/transcriptions", { method: "POST", body: form })).json();
    $("job-status").textContent = `Job ${job.id} queued.${job.warning ? ` ${job.warning}` : ""}`;
    loadJobs();
    await follow(job);
  } catch (error) {
    $("job-status").innerHTML = "";
    $("job-status").append(Object.assign(document.createElement("span"), { className: "error", textContent: error.message }));
  }
  loadJobs();
});

async function follow(job) {
  const progress = $("job-progress");
  progress.hidden = false;
  progress.value = 0;
  for await (const event of sse(job.links.events)) {
    const data = JSON.parse(event.data);
    if (event.event === "progress") {
      progress.value = data.percent;
      const eta = data.eta_s == null ? "" : `, about ${clock(data.eta_s)} left`;
      $("job-status").textContent = `Transcribing: ${clock(data.done_s)} of ${clock(data.total_s)} (${data.percent.toFixed(0)}%${eta})`;
    } else if (event.event === "segment") {
      const line = document.createElement("div");
      line.append(Object.assign(document.createElement("span"), { className: "t", textContent: clock(data.segment.start) }),
                  data.segment.text.trim());
      $("transcript").append(line);
    } else if (event.event === "done") {
      progress.value = 100;
      $("job-status").textContent = `Done: ${clock(data.result.duration || 0)} of audio.`;
      showDownloads(job);
    } else if (event.event === "error") {
      throw new Error(`${data.code}: ${data.message}`);
    }
  }
}

function showDownloads(job) {
  $("downloads").hidden = false;
  for (const link of $("downloads").querySelectorAll("a")) {
    link.onclick = async (e) => {
      e.preventDefault();
      const body = await (await api(`${job.links.result}?format=${link.dataset.format}`)).blob();
      const a = Object.assign(document.createElement("a"), {
        href: URL.createObjectURL(body), download: `${job.id}.${link.dataset.format === "text" ? "txt" : link.dataset.format}` });
      a.click();
      URL.revokeObjectURL(a.href);
    };
  }
}

// --- recent jobs ----------------------------------------------------------------------------------
async function loadJobs() {
  try {
    const jobs = (await (await api("/v1/jobs?limit=10")).json()).data;
    $("jobs-list").replaceChildren(...jobs.map((j) => {
      const row = document.createElement("tr");
      const created = j.created_at ? new Date(j.created_at * 1000).toLocaleTimeString() : "";
      for (const text of [j.id, j.kind, j.model, j.status, created]) row.insertCell().textContent = text ?? "";
      return row;
    }));
  } catch (error) {
    $("jobs-list").replaceChildren();
  }
}
$("jobs-refresh").addEventListener("click", loadJobs);

// --- chat -----------------------------------------------------------------------------------------
const history = [];

$("chat-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const text = $("chat-input").value.trim();
  if (!text) return;
  $("chat-input").value = "";
  history.push({ role: "user", content: text });
  const user = Object.assign(document.createElement("div"), { className: "msg user", textContent: `> ${text}` });
  const answer = Object.assign(document.createElement("div"), { className: "msg assistant" });
  $("chat-log").append(user, answer);
  const body = { model: $("chat-model").value, messages: history, stream: true, max_tokens: 256 };
  try {
    for await (const event of sse("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) })) {
      if (event.data === "[DONE]") break;
      const chunk = JSON.parse(event.data);
      if (chunk.error) throw new Error(chunk.error.message);
      answer.textContent += chunk.choices?.[0]?.delta?.content || "";
    }
    history.push({ role: "assistant", content: answer.textContent });
  } catch (error) {
    answer.className = "msg error";
    answer.textContent = error.message;
    history.pop();
  }
  answer.classList.add("done");  // the stream ended (a test and a stylesheet can tell)
});

loadModels();
loadJobs();
