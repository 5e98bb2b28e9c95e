"use strict";
// The page at /: an image -> POST v1/classify -> the top-k classes as bars, the map drawn over the image on a
// canvas, what the resize did, the timing split. The models ready (v1/models) fill the model picker; the card
// (v1/model) follows the model chosen.
// Plain DOM and no build step; every URL is relative, so the page also works behind a path prefix.

// service/postprocess.py's colour ramp (dark blue -> cyan -> yellow -> red): the same colours as its PNG overlays.
const RAMP = [[48, 18, 59], [70, 107, 227], [40, 188, 235], [50, 242, 152], [164, 252, 60],
  [251, 185, 56], [245, 105, 24], [122, 4, 3]];
const VIEW_SIDE = 384; // the longest side of the drawn image, in canvas pixels
const STATUS_TEXT = {
  400: "The server could not read this image",
  408: "The upload was too slow",
  413: "The image is too large for this server",
  415: "This file is not an image type the server accepts (JPEG, PNG, WebP, BMP, GIF or TIFF)",
  422: "The server refused these options",
  429: "The server is busy",
  500: "The server failed on this image",
  503: "The model is not ready (warming up or shutting down)",
  504: "The server took too long",
};
const MAP_TEXT = {
  rollout: "Attention rollout: how attention flows from the class token to each patch (the same map for every class).",
  relevance: "Relevance: what each patch added to the score (from the most against, dark blue, to the most for, " +
    "red) of",
  none: "No map requested.",
};

const $ = (id) => document.getElementById(id);
// `result` is the answer shown (its map on #view); `beside`, with "both", the relevance answer drawn on #view-relevance
const state = {card: null, file: null, image: null, imageUrl: null, size: null, result: null, beside: null,
  geometry: null, chosen: 0, request: 0, answers: 0};

// ---- geometry: service/preprocess.py's fit_box and native_size, with Python's round (half to even)
function roundEven(x) {
  const r = Math.round(x);
  return Math.abs(x % 1) === 0.5 && r % 2 !== 0 ? r - 1 : r;
}

function fitBox(width, height, targetW, targetH) {
  const scale = Math.max(targetW / width, targetH / height); // cover the target, crop the overflow
  const cropW = Math.min(width, Math.max(1, roundEven(targetW / scale)));
  const cropH = Math.min(height, Math.max(1, roundEven(targetH / scale)));
  const left = Math.floor((width - cropW) / 2), top = Math.floor((height - cropH) / 2);
  return [left, top, left + cropW, top + cropH];
}

function nativeSize(width, height, patch, maxTokens) {
  let cols = Math.max(1, roundEven(width / patch)), rows = Math.max(1, roundEven(height / patch));
  if (cols * rows > maxTokens) {
    const shrink = Math.sqrt(maxTokens / (cols * rows));
    cols = Math.max(1, Math.floor(cols * shrink));
    rows = Math.max(1, Math.floor(rows * shrink));
    while (cols * rows > maxTokens) {
      if (cols >= rows) cols -= 1; else rows -= 1;
    }
  }
  return [cols * patch, rows * patch];
}

function geometry(resize, [width, height], card) {
  if (resize === "fit") {
    return {input: [card.image_width, card.image_height], box: fitBox(width, height, card.image_width,
      card.image_height)};
  }
  return {input: nativeSize(width, height, card.patch_size, card.max_native_tokens), box: [0, 0, width, height]};
}

function describeGeometry(resize, [width, height], {input, box}, patch) {
  const [inW, inH] = input, grid = `${inW / patch}×${inH / patch} patches of ${patch} px`;
  const [left, top, right, bottom] = box;
  if (resize === "native") {
    return `native: your ${width}×${height} image → ${inW}×${inH} model input (${grid}), aspect ratio kept, ` +
      "nothing cropped.";
  }
  const cropped = right - left === width && bottom - top === height ? "nothing cropped" :
    `centre crop ${right - left}×${bottom - top} at (${left}, ${top}), the rest dimmed in the picture`;
  return `fit: your ${width}×${height} image → ${cropped} → ${inW}×${inH} model input (${grid}).`;
}

// ---- drawing
function rampColor(value) {
  const position = Math.min(Math.max(value, 0), 1) * (RAMP.length - 1);
  const low = Math.min(Math.floor(position), RAMP.length - 2), frac = position - low;
  return RAMP[low].map((c, i) => Math.round(c * (1 - frac) + RAMP[low + 1][i] * frac));
}

function heatCanvas(grid) {
  const heat = document.createElement("canvas");
  heat.width = grid.width;
  heat.height = grid.height;
  const context = heat.getContext("2d"), pixels = context.createImageData(grid.width, grid.height);
  grid.values.flat().forEach((value, i) => pixels.data.set([...rampColor(value), 255], 4 * i));
  context.putImageData(pixels, 0, 0);
  return heat;
}

function draw() {
  drawOn($("view"), state.result);
  $("view-relevance").hidden = !state.beside;
  $("views").classList.toggle("pair", Boolean(state.beside)); // two half-width canvases, side by side
  if (state.beside) drawOn($("view-relevance"), state.beside);
}

function drawOn(canvas, answer) {
  const context = canvas.getContext("2d");
  if (!state.size) {
    context.clearRect(0, 0, canvas.width, canvas.height);
    canvas.dataset.drawn = "nothing";
    canvas.setAttribute("aria-label", "No image");
    return;
  }
  const [width, height] = state.size, scale = VIEW_SIDE / Math.max(width, height);
  canvas.width = Math.max(1, Math.round(width * scale));
  canvas.height = Math.max(1, Math.round(height * scale));
  context.imageSmoothingEnabled = scale < 1; // small images (28×28) are shown as crisp enlarged pixels
  if (state.image) {
    context.drawImage(state.image, 0, 0, canvas.width, canvas.height);
  } else {
    context.fillStyle = "#777";
    context.fillRect(0, 0, canvas.width, canvas.height);
  }
  const map = answer && (answer.rollout || answer.relevance);
  const [left, top, right, bottom] = state.geometry ? state.geometry.box.map((v) => v * scale) : [0, 0, 0, 0];
  if (map) {
    context.imageSmoothingEnabled = true; // the patch grid, bilinear, over the part of the image the model saw
    context.globalAlpha = Number($("opacity").value) / 100;
    context.drawImage(heatCanvas(map), left, top, right - left, bottom - top);
    context.globalAlpha = 1;
  }
  if (state.geometry && (right - left < canvas.width || bottom - top < canvas.height)) {
    context.fillStyle = "rgba(0, 0, 0, 0.6)"; // what fit cropped away
    context.fillRect(0, 0, canvas.width, top);
    context.fillRect(0, bottom, canvas.width, canvas.height - bottom);
    context.fillRect(0, top, left, bottom - top);
    context.fillRect(right, top, canvas.width - right, bottom - top);
  }
  const kind = map ? (answer.rollout ? "rollout" : "relevance") : "none";
  canvas.dataset.drawn = answer ? kind : "image";
  canvas.setAttribute("aria-label", answer && map ? `The image with the ${kind} map at ` +
    `${$("opacity").value}% opacity` : "The image");
}

function drawScale() {
  const canvas = $("scale"), context = canvas.getContext("2d");
  for (let x = 0; x < canvas.width; x++) {
    context.fillStyle = `rgb(${rampColor(x / (canvas.width - 1)).join(",")})`;
    context.fillRect(x, 0, 1, canvas.height);
  }
}

// ---- the models and the chosen one's card
async function fetchJson(url) {
  try {
    const response = await fetch(url);
    return response.ok ? await response.json() : null;
  } catch (error) {
    return null;
  }
}

async function loadModels() {
  const listed = await fetchJson("v1/models");
  const ready = listed ? listed.models.filter((m) => m.state === "READY") : [];
  if (!ready.length) {
    $("status").textContent = "No model is ready yet; trying again…";
    setTimeout(loadModels, 2000);
    return;
  }
  // One entry per model (its newest ready version), then each version of a model that has several.
  const names = [...new Set(ready.map((m) => m.name))];
  const choices = names.flatMap((name) => {
    const versions = ready.filter((m) => m.name === name).map((m) => m.version);
    const newest = new Option(`${name} (newest: ${versions[0]})`, JSON.stringify({model: name}));
    const pinned = versions.length > 1 ?
      versions.map((v) => new Option(`${name} version ${v}`, JSON.stringify({model: name, version: v}))) : [];
    return [newest, ...pinned];
  });
  $("model").replaceChildren(...choices);
  $("model-row").hidden = choices.length < 2;
  await loadCard();
}

function chosenModel() {
  return $("model").value ? JSON.parse($("model").value) : {};
}

async function loadCard() {
  const card = await fetchJson(`v1/model?${new URLSearchParams(chosenModel())}`);
  if (!card) {
    $("status").textContent = "The model card is not available yet; trying again…";
    setTimeout(loadCard, 2000);
    return;
  }
  state.card = card;
  showCard(card);
  $("status").textContent = "Choose an image, or one of the samples.";
  showInspection(await fetchJson(`v1/models/${encodeURIComponent(card.name)}/inspect?` +
    new URLSearchParams({version: card.version})));
}

// ---- what the model learned (GET v1/models/{name}/inspect, stored by `vitserve export`)
function showInspection(found) {
  $("inspection").hidden = !found;
  if (!found) return;
  const [depth, heads] = [found.mean_attention_distance_px.length, found.mean_attention_distance_px[0].length];
  $("inspection-about").textContent = `The ${found.filters}; the attention distances average over ` +
    `${found.images} images (in pixels, at most ${found.max_distance_px.toFixed(1)}): ${depth} layers of ` +
    `${heads} heads.`;
  $("inspection-filters").replaceChildren(...found.components.map((component, i) => {
    const tile = componentTile(component);
    tile.title = `component ${i + 1}: ${(100 * found.explained_variance[i]).toFixed(1)}% of the variance`;
    return tile;
  }));
  drawSimilarity(found.position_similarity);
  drawDistances(found.mean_attention_distance_px, found.max_distance_px);
}

function componentTile(component) { // (C, k, k) -> a k x k canvas, grey or RGB, stretched to its own range
  const [channels, rows, cols] = [component.length, component[0].length, component[0][0].length];
  const values = component.flat(2), low = Math.min(...values), span = Math.max(...values) - low || 1;
  const tile = document.createElement("canvas");
  [tile.width, tile.height] = [cols, rows];
  const context = tile.getContext("2d"), pixels = context.createImageData(cols, rows);
  for (let r = 0; r < rows; r++) {
    for (let c = 0; c < cols; c++) {
      const rgb = [0, 1, 2].map((k) => Math.round(255 * (component[channels === 3 ? k : 0][r][c] - low) / span));
      pixels.data.set([...rgb, 255], 4 * (r * cols + c));
    }
  }
  context.putImageData(pixels, 0, 0);
  return tile;
}

function drawSimilarity(similarity) { // (gh, gw, gh, gw): a gh x gw grid of gh x gw tiles, a gap between tiles
  const canvas = $("inspection-similarity"), context = canvas.getContext("2d");
  const [gh, gw] = [similarity.length, similarity[0].length];
  const cell = Math.max(1, Math.floor(canvas.width / (gw * (gw + 1))));
  context.clearRect(0, 0, canvas.width, canvas.height);
  similarity.forEach((row, r) => row.forEach((tile, c) => tile.forEach((line, i) => line.forEach((value, j) => {
    context.fillStyle = `rgb(${rampColor((value + 1) / 2).join(",")})`;
    context.fillRect((c * (gw + 1) + j) * cell, (r * (gh + 1) + i) * cell, cell, cell);
  }))));
}

function drawDistances(distances, maxDistance) { // a dot per head at each depth, as Figure 7 (right)
  const canvas = $("inspection-distance"), context = canvas.getContext("2d");
  const [w, h, margin] = [canvas.width, canvas.height, 24];
  context.clearRect(0, 0, w, h);
  context.strokeStyle = context.fillStyle = "#555";
  context.strokeRect(margin, 4, w - margin - 4, h - margin - 4);
  context.font = "10px sans-serif";
  context.fillText("depth →", w / 2 - 16, h - 6);
  context.fillText(`${Math.round(maxDistance)}px`, 0, 12);
  distances.forEach((layer, l) => layer.forEach((distance, head) => {
    const x = margin + (l + 0.5) * (w - margin - 4) / distances.length;
    const y = h - margin - (h - margin - 4) * distance / maxDistance;
    context.fillStyle = `rgb(${RAMP[(head * 3) % RAMP.length].join(",")})`;
    context.fillRect(x - 2 + head % 3 - 1, y - 2, 4, 4);
  }));
}

// A cheaper answer says so (docs/token-budgets.md): the tokens it ran on, why, and that budget's measured accuracy.
function showBudget(budget) {
  const line = $("budget");
  line.hidden = !budget || !budget.reason;
  if (line.hidden) return;
  const why = budget.reason === "load" ? "the server was under load" : "the request asked for it (max_tokens)";
  line.textContent = `Answered at a reduced token budget because ${why}: ${budget.tokens} of ` +
    `${budget.full_tokens} tokens (a ${budget.grid[0]}x${budget.grid[1]} input)` +
    (budget.accuracy === null ? "." : `; this budget's measured accuracy is ${percent(budget.accuracy)}.`);
  line.className = "warning";
}

// How far the image is from what the model was trained on (docs/ood.md): hidden for a file without the score.
function showOod(ood) {
  const line = $("ood");
  line.hidden = !ood;
  if (!ood) return;
  line.textContent = (ood.outside ? "Unlike the training images: trust this answer less. " :
    "Like the training images. ") + `Out-of-distribution score ${ood.score.toFixed(1)} ` +
    `(threshold ${ood.threshold.toFixed(1)}, which about 1% of held-out images exceed).`;
  line.className = ood.outside ? "warning" : "";
}

// The scores are softmax(logits / temperature); a file exported with a labelled set carries a fitted temperature,
// one per answer where it has a curve (docs/calibration.md), and its card the calibration error before and after.
function calibrationText(card) {
  const c = card.calibration;
  if (!c) return "uncalibrated softmax (the file carries no temperature)";
  const how = card.temperature_by_entropy ? "a temperature per answer, by its uncertainty" :
    `temperature ${card.temperature.toFixed(2)}`;
  return `calibrated (${how}): calibration error ` +
    `${(100 * c.ece_before).toFixed(1)}% → ${(100 * c.ece_after).toFixed(1)}% on ${c.report_images} held-out images`;
}

function showCard(card) {
  $("model-title").textContent = `· ${card.name} ${card.version}`;
  const accuracy = card.test_accuracy === null ? "not recorded" : `${(100 * card.test_accuracy).toFixed(2)}%`;
  const fields = [["Name", card.name], ["Version", card.version], ["Classes", card.labels.length],
    ["Trained resolution", `${card.image_width}×${card.image_height} px, ${card.channels} channel(s)`],
    ["Patch size", `${card.patch_size} px`], ["Test accuracy", accuracy], ["Execution provider", card.provider],
    ["Precision", card.precision], ["Maps", card.maps.join(", ")], ["Confidence", calibrationText(card)],
    ["Embedding", card.embedding_size ? `${card.embedding_size} values (POST v1/embed)` : "none in this file"],
    ["Token budgets", budgetsText(card)]];
  $("card-fields").replaceChildren(...fields.flatMap(([term, value]) => [element("dt", term), element("dd", value)]));
  $("labels-summary").textContent = `Labels (${card.labels.length})`;
  $("labels").replaceChildren(...card.labels.map((label) => element("li", label)));
  $("target").replaceChildren(new Option("the top-1", ""),
    ...card.labels.map((label, index) => new Option(`${index}: ${label}`, String(index))));
  const cheaper = (card.budgets || []).filter((budget) => budget.served).slice(1);
  $("max-tokens").replaceChildren(new Option("the full budget", ""), ...cheaper.map((b) =>
    new Option(`${b.tokens} tokens (${b.grid[0]}×${b.grid[1]})` + (b.accuracy === null ? "" :
      `, ${percent(b.accuracy)}`), String(b.tokens))));
  $("max-tokens").disabled = !cheaper.length;
  $("top-k").max = card.labels.length;
  $("top-k").value = Math.min(5, card.labels.length);
  const relevance = card.maps.includes("relevance");
  const choices = ["relevance", "both"].map((v) => document.querySelector(`input[name="map"][value="${v}"]`));
  choices.forEach((choice) => { choice.disabled = !relevance; });
  if (!relevance && choices.some((c) => c.checked)) {
    document.querySelector('input[name="map"][value="rollout"]').checked = true;
  }
  $("map-note").textContent = relevance ? "" : "This model's file has no relevance path: rollout only.";
  $("map-note").hidden = relevance;
}

// The budgets the server answers at (docs/token-budgets.md): tokens, with each one's measured accuracy.
function budgetsText(card) {
  const served = (card.budgets || []).filter((budget) => budget.served);
  if (served.length < 2) return "the full budget only";
  const rungs = served.map((b) => `${b.tokens}` + (b.accuracy === null ? "" : ` (${percent(b.accuracy)})`));
  return `${rungs.join(", ")} tokens` + (card.degrade_under_load ? "; cheaper under load" : "; refuses under load");
}

function element(tag, text) {
  const node = document.createElement(tag);
  node.textContent = text;
  return node;
}

// ---- samples
async function loadSamples() {
  const response = await fetch("web/samples/samples.json");
  if (!response.ok) return;
  const {about, samples} = await response.json();
  $("samples-about").textContent = about.split(". ")[0] + ".";
  $("samples").replaceChildren(...samples.map((sample) => {
    const button = document.createElement("button"), picture = document.createElement("img");
    picture.src = `web/samples/${sample.file}`;
    picture.alt = "";
    button.type = "button";
    button.append(picture, element("span", sample.label));
    button.setAttribute("aria-label", `Sample: ${sample.label} (${sample.source})`);
    button.addEventListener("click", () => chooseSample(sample));
    const item = document.createElement("li");
    item.append(button);
    return item;
  }));
}

async function chooseSample(sample) {
  const response = await fetch(`web/samples/${sample.file}`);
  const blob = await response.blob();
  choose(new File([blob], sample.file, {type: blob.type}));
}

// ---- an image, and its classification
async function choose(file) {
  if (!file) return;
  if (!state.card) {
    $("status").textContent = "Wait for the model card before choosing an image.";
    return;
  }
  const chosen = ++state.chosen, picture = new Image();
  if (state.imageUrl) URL.revokeObjectURL(state.imageUrl);
  state.imageUrl = URL.createObjectURL(file);
  picture.src = state.imageUrl;
  const drawable = await picture.decode().then(() => true, () => false); // TIFF, or not an image: the server decides
  if (chosen !== state.chosen) return; // another image was chosen meanwhile
  Object.assign(state, {file, result: null, geometry: null, image: drawable ? picture : null,
    size: drawable ? [picture.naturalWidth, picture.naturalHeight] : null});
  classify();
}

function options() {
  const form = $("options");
  const map = form.elements.map.value, resize = form.elements.resize.value;
  const ask = (kind) => {
    const params = new URLSearchParams({...chosenModel(), top_k: $("top-k").value || "5", map: kind, resize});
    if (kind !== "none") params.set("map_format", "grid");
    if (kind === "relevance" && $("target").value !== "") params.set("target", $("target").value);
    if ($("max-tokens").value !== "") params.set("max_tokens", $("max-tokens").value);
    return params;
  };
  // "both": the rollout answer is shown, and a second request's relevance map drawn beside it
  const beside = map === "both" ? ask("relevance") : null;
  return {map, resize, params: ask(map === "both" ? "rollout" : map), beside};
}

async function post(params) {
  const body = new FormData();
  body.append("file", state.file, state.file.name || "pasted image");
  const response = await fetch(`v1/classify?${params}`, {method: "POST", body});
  return {response, answer: await response.json().catch(() => null)};
}

async function classify() {
  if (!state.file) return;
  const request = ++state.request, {resize, params, beside} = options();
  $("status").textContent = `Classifying ${state.file.name || "the pasted image"}…`;
  const started = performance.now();
  let replies;
  try {
    replies = await Promise.all([post(params), ...(beside ? [post(beside)] : [])]);
  } catch (error) {
    if (request === state.request) showError(null, null, null);
    return;
  }
  if (request !== state.request) return; // a newer request (options changed) answers instead
  const failed = replies.find(({response}) => !response.ok);
  if (failed) {
    showError(failed.response.status, failed.answer, failed.response.headers.get("Retry-After"));
    return;
  }
  state.result = replies[0].answer;
  state.beside = beside ? replies[1].answer : null;
  showResult(state.result, resize, performance.now() - started);
}

function showError(status, answer, retryAfter) {
  const error = answer && answer.error ? answer.error : null;
  let text = status === null ? "Could not reach the server." :
    `${STATUS_TEXT[status] || "The server refused the request"} (HTTP ${status}` +
    `${error ? `, ${error.code}` : ""})${error ? `: ${error.message}` : "."}`;
  if (retryAfter) text += ` Try again in ${retryAfter} s.`;
  $("error").textContent = text;
  $("error").hidden = false;
  $("status").textContent = "The image was not classified.";
  state.result = null;
  state.beside = null;
  state.geometry = null;
  $("predictions").replaceChildren();
  $("timing").replaceChildren();
  $("map-caption").textContent = "";
  $("geometry").textContent = "—";
  draw();
  answered();
}

function answered() { // a count of answers shown, for whoever waits on the page (the browser tests)
  $("result").dataset.answers = String(++state.answers);
}

function showResult(answer, resize, roundTripMs) {
  $("error").hidden = true;
  const map = answer.rollout || answer.relevance;
  if (!state.size && map) {
    state.size = [map.width * state.card.patch_size, map.height * state.card.patch_size]; // the map alone
  }
  if (state.size) {
    state.geometry = geometry(resize, state.size, state.card);
    // the server's input: a cheaper token budget resamples the trained-size input, whose region its map covers
    const cheaper = answer.budget && answer.budget.reason && resize === "fit";
    if (map) state.geometry.input = cheaper ? [state.card.image_width, state.card.image_height] :
      [map.width, map.height].map((n) => n * state.card.patch_size);
    $("geometry").textContent = describeGeometry(resize, state.size, state.geometry, state.card.patch_size);
  }
  showPredictions(answer.predictions);
  $("predictions-heading").textContent = state.card.calibration ? "Top classes (calibrated confidence)" : "Top classes";
  showOod(answer.ood);
  showBudget(answer.budget);
  showTiming(answer.timing_ms, roundTripMs);
  const explained = answer.relevance || (state.beside && state.beside.relevance);
  const target = explained && explained.target;
  const relevanceText = target ? `${MAP_TEXT.relevance} ${target.label} (${percent(target.score)}).` : "";
  $("map-caption").textContent = state.beside ? `Left: ${MAP_TEXT.rollout} Right: ${relevanceText}` :
    answer.relevance ? relevanceText : MAP_TEXT[answer.rollout ? "rollout" : "none"];
  $("status").textContent = `${state.file.name || "The pasted image"}: ${answer.predictions[0].label}, ` +
    `${percent(answer.predictions[0].score)}.` + (state.image ? "" : " This browser cannot draw this image; the " +
    "map is drawn alone.");
  draw();
  answered();
}

function showPredictions(predictions) {
  $("predictions").replaceChildren(...predictions.map(({label, score, index}) => {
    const item = document.createElement("li"), bar = document.createElement("span");
    const fill = document.createElement("span");
    bar.className = "bar";
    bar.setAttribute("aria-hidden", "true");
    fill.style.width = `${(100 * score).toFixed(1)}%`;
    bar.append(fill);
    item.append(element("span", `${label} (${index})`), bar, element("span", percent(score)));
    return item;
  }));
}

function showTiming(timing, roundTripMs) {
  const rest = timing.total - timing.queue - timing.preprocess - timing.inference;
  const rows = [["Queue", timing.queue], ["Preprocess", timing.preprocess], ["Inference", timing.inference],
    ["Rest (upload, encoding)", Math.max(0, rest)], ["Total on the server", timing.total],
    ["Round trip, seen by this page", roundTripMs]];
  $("timing").replaceChildren(...rows.flatMap(([term, ms]) => [element("dt", term), element("dd",
    `${ms.toFixed(1)} ms`)]));
}

function percent(score) {
  return `${(100 * score).toFixed(1)}%`;
}

// ---- wiring: file input, drop, paste, options
function wire() {
  $("file").addEventListener("change", (event) => choose(event.target.files[0]));
  const zone = $("drop-zone");
  document.addEventListener("dragover", (event) => event.preventDefault()); // a missed drop must not navigate
  document.addEventListener("drop", (event) => {
    event.preventDefault();
    zone.classList.remove("dragging");
    choose(event.dataTransfer.files[0]);
  });
  zone.addEventListener("dragenter", () => zone.classList.add("dragging"));
  zone.addEventListener("dragleave", () => zone.classList.remove("dragging"));
  document.addEventListener("paste", (event) => {
    const file = [...event.clipboardData.files][0];
    if (file) choose(file);
  });
  $("options").addEventListener("submit", (event) => event.preventDefault());
  $("options").addEventListener("change", async (event) => {
    if (event.target === $("model")) await loadCard(); // a new card: its labels, maps and resolution
    $("target").disabled = !["relevance", "both"].includes(options().map);
    classify();
  });
  $("opacity").addEventListener("input", () => {
    $("opacity-value").textContent = `${$("opacity").value}%`;
    draw();
  });
}

wire();
drawScale();
loadModels().then(loadSamples);
