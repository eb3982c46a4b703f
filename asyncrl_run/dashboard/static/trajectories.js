// The trajectory browser: a filtered list of the recorded samples (newest first, paged) and one sample
// opened: its turns and tool calls, and its tokens coloured by loss mask (and by the trust band once trained).
"use strict";

const Trajectories = (() => {
  let next = null, filters = "", opened = null, envsKnown = new Set(), listed = false;

  function query(extra) {
    const form = new FormData(document.getElementById("filters"));
    const params = new URLSearchParams();
    for (const [k, v] of form.entries()) if (String(v).trim() !== "") params.set(k, String(v).trim());
    for (const [k, v] of Object.entries(extra || {})) params.set(k, v);
    return params;
  }

  function row(s) {
    const tr = el("tr", {class: "sample-row", "data-ref": s.ref},
      el("td", {}, new Date(Number(s.ref.split("-")[0])).toLocaleTimeString()), el("td", {}, s.env),
      el("td", {class: s.status === "failed" ? "bad" : ""}, [s.status, s.reason !== s.status ? s.reason : ""].filter(Boolean).join(": ")),
      el("td", {}, fmt(s.reward, 3)), el("td", {}, fmt(s.num_turns)), el("td", {}, `${s.loss_tokens} / ${s.num_tokens}`),
      el("td", {}, s.trained_step === null ? "-" : `step ${s.trained_step}`),
      el("td", {}, s.weight_versions.length ? `v${s.weight_versions[0]}` + (s.weight_versions[1] !== s.weight_versions[0]
        ? `-${s.weight_versions[1]}` : "") : "-"));
    tr.onclick = () => { window.location.hash = `sample=${s.ref}`; };
    if (s.ref === opened) tr.classList.add("selected");
    addEnvs([s.env]);
    return tr;
  }

  function addEnvs(envs) {  // the env filter's choices: the run's envs, and any a listed sample has
    for (const env of envs) {
      if (envsKnown.has(env)) continue;
      envsKnown.add(env);
      document.querySelector("#filters select[name=env]").append(el("option", {value: env}, env));
    }
  }

  async function list(more) {
    const params = query(more && next ? {before: next} : {});
    const body = await api(`/api/samples?${params}`);
    const tbody = document.querySelector("#samples tbody");
    if (!more) tbody.replaceChildren();
    tbody.append(...body.samples.map(row));
    next = body.next;
    document.getElementById("more").hidden = !next;
    document.getElementById("samples-note").textContent =
      `${tbody.children.length} shown (${body.scanned} looked at in this page)`;
    listed = true;
  }

  function tokenTitle(t, i) {
    const parts = [`#${i} id ${t.ids[i]} ${JSON.stringify(t.text[i])}`, t.loss_mask[i] ? "trained (loss mask 1)" : "not trained (prompt / observation)"];
    if (t.loss_mask[i]) {
      parts.push(`rollout log-prob ${fmt(t.rollout_logprobs[i], 4)} (weights v${t.weight_versions[i]})`);
      if (t.trainer_logprobs) parts.push(`trainer log-prob ${fmt(t.trainer_logprobs[i], 4)}`,
                                         t.kept[i] ? "kept by the IS band" : "masked by the IS band");
    }
    return parts.join("\n");
  }

  // Colour of a trained token by its rollout probability, or by |trainer - rollout| log-prob (the mode chosen).
  function heat(t, i, mode) {
    if (!t.loss_mask[i] || mode === "mask") return "";
    if (mode === "rollout") {
      const p = Math.exp(t.rollout_logprobs[i] ?? 0);
      return `background: hsl(${Math.round(120 * p)}, 65%, 80%)`;
    }
    if (!t.trainer_logprobs) return "";
    const d = Math.min(1, Math.abs((t.trainer_logprobs[i] ?? 0) - (t.rollout_logprobs[i] ?? 0)));
    return `background: hsl(0, ${Math.round(20 + 60 * d)}%, ${Math.round(92 - 30 * d)}%)`;
  }

  const TOKENS_AT_ONCE = 20000;  // a long agent episode's tokens are drawn on demand past this many

  function tokenView(d, mode, all) {
    const t = d.tokens, box = el("div", {class: "tokens", id: "tokens"});
    const shown = all ? t.ids.length : Math.min(t.ids.length, TOKENS_AT_ONCE);
    for (let i = 0; i < shown; i++) {
      let cls = t.loss_mask[i] ? "tok loss" : "tok ctx";
      if (t.loss_mask[i] && t.kept) cls += t.kept[i] ? " kept" : " band-masked";
      const span = el("span", {class: cls, "data-i": String(i), title: tokenTitle(t, i)}, t.text[i]);
      const style = heat(t, i, mode);
      if (style) span.setAttribute("style", style);
      box.append(span);
    }
    if (shown < t.ids.length) {
      box.append(el("button", {id: "all-tokens", onclick: () => box.replaceWith(tokenView(d, mode, true))},
                    `show all ${t.ids.length} tokens (${shown} shown)`));
    }
    box.onclick = ev => {
      const i = ev.target.dataset && ev.target.dataset.i;
      if (i !== undefined) document.getElementById("token-info").textContent = tokenTitle(t, Number(i));
    };
    return box;
  }

  function turnView(turn, i) {
    const head = el("div", {class: "turn-head"}, turn.kind === "model" ? `model turn` : (i === 0 ? "prompt" : "observation"),
      el("span", {class: "muted"}, ` tokens ${turn.start}-${turn.end}`));
    const box = el("div", {class: `turn ${turn.kind}`}, head);
    if (turn.kind === "model" && turn.reasoning) box.append(el("div", {class: "reasoning"}, turn.reasoning));
    box.append(el("pre", {}, turn.kind === "model" && turn.content !== undefined ? turn.content : turn.text));
    for (const call of turn.tool_calls || []) {
      box.append(el("div", {class: "tool-call"}, el("b", {}, `tool call ${call.name}`), el("pre", {}, JSON.stringify(call.arguments, null, 1))));
    }
    return box;
  }

  function detailView(d) {
    const trained = d.trained;
    const facts = [["sample", d.sample_id], ["stream id", d.ref], ["env", d.env], ["task", d.task_id],
      ["group", d.group_id], ["outcome", [d.status, d.outcome, d.reason].filter(Boolean).join(" / ")],
      ["reward", fmt(d.reward, 4)], ["turns", fmt(d.num_turns)], ["tokens", fmt(d.num_tokens)],
      ["weight versions", d.weight_versions.join(" - ") || "-"],
      ["trained", trained ? `step ${trained.step} at weights v${trained.weight_version}` : "not (yet) trained"]];
    const counts = el("p", {class: "counts"}, "tokens shown as trained: ",
      el("b", {id: "trained-count"}, String(d.tokens.loss_mask.filter(Boolean).length)), ` of ${d.num_tokens}`);
    if (trained) counts.append(" (kept by the IS band: ", el("b", {id: "kept-count"}, String(trained.kept_tokens)),
                               ", masked: ", el("b", {id: "band-masked-count"}, String(trained.band_masked_tokens)), ")");
    const legend = el("p", {class: "legend"}, el("span", {class: "tok ctx"}, "prompt / observation"), " ",
      el("span", {class: "tok loss"}, "trained (loss mask)"), " ", el("span", {class: "tok loss kept"}, "kept by IS band"),
      " ", el("span", {class: "tok loss band-masked"}, "masked by IS band"));
    return el("div", {},
      el("h2", {}, `Sample ${d.sample_id}`, el("button", {class: "close", onclick: () => { window.location.hash = "samples"; }}, "close")),
      el("dl", {class: "facts"}, ...facts.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, v)])),
      el("h3", {}, "Turns"), el("div", {class: "turns"}, ...d.turns.map(turnView)),
      el("h3", {}, "Tokens"), legend, colourBy(d), counts, tokenView(d, colourMode),
      el("pre", {id: "token-info", class: "token-info"}, "click a token for its log-probs"));
  }

  let colourMode = "mask";

  function colourBy(d) {
    const select = el("select", {id: "colour-by"},
      el("option", {value: "mask"}, "loss mask and IS band"), el("option", {value: "rollout"}, "rollout probability"),
      ...(d.tokens.trainer_logprobs ? [el("option", {value: "delta"}, "|trainer - rollout| log-prob")] : []));
    select.value = colourMode;
    select.onchange = () => {
      colourMode = select.value;
      document.getElementById("tokens").replaceWith(tokenView(d, colourMode, !document.getElementById("all-tokens")));
    };
    return el("p", {}, "colour trained tokens by ", select);
  }

  async function open(ref) {
    opened = ref;
    for (const tr of document.querySelectorAll(".sample-row")) tr.classList.toggle("selected", tr.dataset.ref === ref);
    const box = document.getElementById("sample");
    box.hidden = false;
    box.replaceChildren(el("p", {class: "muted"}, "loading..."));
    try {
      box.replaceChildren(detailView(await api(`/api/samples/${encodeURIComponent(ref)}`)));
      box.dataset.ref = ref;
    } catch (err) {
      box.replaceChildren(el("p", {class: "error"}, err.message));
    }
  }

  async function show(hash) {
    try {
      if (!listed) await list(false);
      if (hash.startsWith("sample=")) await open(decodeURIComponent(hash.slice("sample=".length)));
      else { opened = null; document.getElementById("sample").hidden = true; }
    } catch (err) {
      document.getElementById("samples-note").textContent = err.message;
    }
  }

  document.getElementById("filters").addEventListener("submit", ev => { ev.preventDefault(); list(false).catch(err => {
    document.getElementById("samples-note").textContent = err.message; }); });
  document.getElementById("more").addEventListener("click", () => list(true));
  return {show, list, addEnvs};
})();
