// The report page: training curves drawn as inline SVG, and a rollout browser.
// Everything comes from the JSON in #report-data (written by grpo/report.py); no network.
// Text from the run (prompts, responses, config) only ever goes through textContent, so it
// is shown, never interpreted as HTML.
"use strict";
(function () {
  const DATA = JSON.parse(document.getElementById("report-data").textContent);
  const RUNS = DATA.runs;
  const MULTI = RUNS.length > 1;
  const PALETTE = ["#3266d4", "#e8590c", "#2f9e44", "#c2255c", "#7048e8",
                   "#0c8599", "#f08c00", "#5c940d", "#862e9c", "#495057"];
  const DASHES = ["", "6 4", "2 3", "9 3 2 3"];
  const SVGNS = "http://www.w3.org/2000/svg";
  const tooltip = document.getElementById("tooltip");

  // ------------------------------------------------------------------ small helpers

  function el(tag, attrs, children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "text") node.textContent = v;
      else if (k === "class") node.className = v;
      else node.setAttribute(k, v);
    }
    for (const child of children || []) node.append(child);
    return node;
  }

  function svgEl(tag, attrs) {
    const node = document.createElementNS(SVGNS, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    return node;
  }

  function isNum(v) { return typeof v === "number" && isFinite(v); }

  function fmt(v) {
    if (!isNum(v)) return "–";
    const a = Math.abs(v);
    if (a === 0) return "0";
    if (a >= 1e5 || a < 1e-3) return v.toExponential(2);
    if (Number.isInteger(v)) return String(v);
    return String(Number(v.toPrecision(4)));
  }

  // Axis labels with as many digits as the tick spacing needs. A series that barely moves
  // around a large value (entropy 10.79001 .. 10.79004) is labelled relative to an offset,
  // shown once in the corner, as matplotlib does.
  function tickLabels(ticks, step) {
    const maxAbs = Math.max(...ticks.map(Math.abs));
    const offset = step < 1e-4 * maxAbs ? ticks[Math.floor(ticks.length / 2)] : 0;
    const labels = ticks.map((t) => {
      const v = t - offset;
      if (Math.abs(v) < step * 1e-6) return "0";
      let text;
      if (Math.abs(v) >= 1e5 || step < 1e-3) {
        const digits = Math.floor(Math.log10(Math.abs(v))) - Math.floor(Math.log10(step) + 1e-9);
        text = v.toExponential(Math.max(0, Math.min(6, digits)));
      } else {
        text = v.toFixed(Math.max(0, Math.min(8, -Math.floor(Math.log10(step) + 1e-9))));
      }
      return offset && v > 0 ? "+" + text : text;
    });
    const digits = offset ? Math.min(15, Math.ceil(Math.log10(Math.abs(offset) / step)) + 1) : 0;
    return { labels, offset: offset ? Number(offset.toPrecision(digits)).toString() : null };
  }

  function niceTicks(lo, hi, n) {
    const span = hi - lo;
    const mag = Math.pow(10, Math.floor(Math.log10(span / n)));
    const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => span / s <= n) || span;
    const ticks = [];
    for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(Number(t.toFixed(10)));
    return ticks;
  }

  function styleOf(runIndex, keyIndex) {
    return MULTI ? { color: PALETTE[runIndex % PALETTE.length], dash: DASHES[keyIndex % DASHES.length] }
                 : { color: PALETTE[keyIndex % PALETTE.length], dash: "" };
  }

  function lineSample(color, dash) {
    const s = svgEl("svg", { width: 22, height: 8 });
    s.append(svgEl("line", { x1: 1, y1: 4, x2: 21, y2: 4, stroke: color, "stroke-width": 2, "stroke-dasharray": dash }));
    return s;
  }

  function showTooltip(event, title, lines) {
    tooltip.replaceChildren(el("b", { text: title }));
    for (const [color, label, value] of lines) {
      tooltip.append(el("div", {}, [el("span", { class: "swatch", style: `background:${color}` }), ` ${label}: `,
                                    el("span", { text: value })]));
    }
    tooltip.hidden = false;
    const box = tooltip.getBoundingClientRect();
    const x = Math.min(event.clientX + 14, window.innerWidth - box.width - 8);
    const y = Math.min(event.clientY + 14, window.innerHeight - box.height - 8);
    tooltip.style.left = `${Math.max(4, x)}px`;
    tooltip.style.top = `${Math.max(4, y)}px`;
  }

  // ------------------------------------------------------------------ run cards

  function runCards() {
    const box = document.getElementById("runs");
    document.getElementById("generated").textContent =
      `generated ${DATA.generated} · ${RUNS.length} run${MULTI ? "s" : ""}`;
    RUNS.forEach((run, ri) => {
      const s = run.summary;
      const arrow = (a, b) => (isNum(a) || isNum(b) ? `${fmt(a)} → ${fmt(b)}` : "–");
      const stats = [
        ["steps", `${s.steps_done}${s.steps_planned != null ? " / " + s.steps_planned : ""}`],
        ["model", s.base_model ?? "–"],
        ["loss", s.loss_fn ?? "–"],
        ["reward", arrow(s.reward_first, s.reward_last)],
        ["train accuracy", fmt(s.accuracy_last)],
        ["eval accuracy", arrow(s.eval_accuracy_first, s.eval_accuracy_last)],
        [`objective (${s.objective})`, fmt(s.objective_value)],
        ["s / step", fmt(s.seconds_per_step)],
        ["reward failures", String(s.failures)],
        ["checkpoints", String(s.checkpoints)],
      ];
      const dl = el("dl", { class: "stats" });
      for (const [k, v] of stats) dl.append(el("dt", { text: k }), el("dd", { text: String(v) }));
      const card = el("div", { class: "card run-card" }, [
        el("h3", {}, [el("span", { class: "swatch", style: `background:${PALETTE[ri % PALETTE.length]}` }),
                      el("span", { text: run.label })]),
        el("div", { class: "muted", text: run.path, style: "font-size:12px;margin-bottom:6px" }),
        dl,
      ]);
      const config = Object.entries(run.config);
      if (config.length) {
        card.append(el("details", {}, [el("summary", { text: `config (${config.length} keys)` }),
          el("pre", { class: "config", text: config.map(([k, v]) => `${k}: ${v}`).join("\n") })]));
      }
      if (run.failures.length) {
        card.append(el("details", {}, [el("summary", { text: `last ${run.failures.length} reward failures` }),
          el("pre", { class: "config", text: run.failures.map(
            (f) => `step ${f.step} group ${f.group} sample ${f.sample}: ${f.error}`).join("\n") })]));
      }
      box.append(card);
    });
    if (MULTI) {
      const legend = document.getElementById("legend");
      RUNS.forEach((run, ri) => legend.append(el("span", {}, [lineSample(PALETTE[ri % PALETTE.length], ""),
                                                                el("span", { text: run.label })])));
    }
  }

  // ------------------------------------------------------------------ charts

  const W = 460, H = 230, M = { l: 50, r: 12, t: 8, b: 26 };

  function drawChart(card, keys, band, emptyText) {
    const old = card.querySelector("svg.plot");
    if (old) old.remove();
    const oldLegend = card.querySelector(".legend");
    if (oldLegend) oldLegend.remove();
    const svg = svgEl("svg", { class: "plot", viewBox: `0 0 ${W} ${H}`, role: "img" });
    const series = [];
    RUNS.forEach((run, ri) => keys.forEach((key, ki) => {
      const pts = run.metrics[key] || [];
      if (!pts.some((p) => isNum(p[1]))) return;
      const stdKey = band[key];
      const std = stdKey ? new Map((run.metrics[stdKey] || []).map((p) => [p[0], p[1]])) : null;
      series.push({ run: ri, key, pts, std, ...styleOf(ri, ki),
                    label: MULTI ? `${run.label}: ${key}` : key });
    }));
    const nPoints = series.reduce((n, s) => n + s.pts.filter((p) => isNum(p[1])).length, 0);
    card.dataset.points = String(nPoints);
    card.dataset.series = String(series.length);
    if (!nPoints) {
      svg.append(svgEl("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }));
      svg.lastChild.textContent = emptyText;
      card.append(svg);
      return;
    }

    // Ranges over every drawn point (and the ±std band), padded when flat.
    let x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity;
    for (const s of series) for (const [x, y] of s.pts) {
      if (!isNum(y)) continue;
      const d = s.std && isNum(s.std.get(x)) ? s.std.get(x) : 0;
      x0 = Math.min(x0, x); x1 = Math.max(x1, x); y0 = Math.min(y0, y - d); y1 = Math.max(y1, y + d);
    }
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    if (y0 === y1) { const p = Math.abs(y0) * 0.1 || 1; y0 -= p; y1 += p; }
    const pad = (y1 - y0) * 0.05; y0 -= pad; y1 += pad;
    const sx = (x) => M.l + (x - x0) / (x1 - x0) * (W - M.l - M.r);
    const sy = (y) => H - M.b - (y - y0) / (y1 - y0) * (H - M.t - M.b);

    const axis = svgEl("g", { class: "axis" });
    const yTicks = niceTicks(y0, y1, 5);
    const yStep = yTicks.length > 1 ? yTicks[1] - yTicks[0] : Math.abs(y1 - y0) || 1;
    const yLabels = tickLabels(yTicks, yStep);
    yTicks.forEach((t, i) => {
      axis.append(svgEl("line", { x1: M.l, x2: W - M.r, y1: sy(t), y2: sy(t) }));
      const label = svgEl("text", { x: M.l - 5, y: sy(t) + 3, "text-anchor": "end" });
      label.textContent = yLabels.labels[i];
      axis.append(label);
    });
    if (yLabels.offset !== null) {
      const note = svgEl("text", { x: M.l + 4, y: M.t + 10, class: "offset" });
      note.textContent = `values − ${yLabels.offset}`;
      axis.append(note);
    }
    for (const t of niceTicks(x0, x1, 6).filter(Number.isInteger)) {
      const label = svgEl("text", { x: sx(t), y: H - M.b + 14, "text-anchor": "middle" });
      label.textContent = String(t);
      axis.append(label);
    }
    const xName = svgEl("text", { x: W - M.r, y: H - 2, "text-anchor": "end" });
    xName.textContent = "step";
    axis.append(xName);
    svg.append(axis);

    for (const s of series) {
      if (s.std) {  // the band: upper edge left to right, lower edge back
        const pts = s.pts.filter((p) => isNum(p[1]) && isNum(s.std.get(p[0])));
        if (pts.length > 1) {
          const up = pts.map((p) => `${sx(p[0])},${sy(p[1] + s.std.get(p[0]))}`);
          const down = pts.slice().reverse().map((p) => `${sx(p[0])},${sy(p[1] - s.std.get(p[0]))}`);
          svg.append(svgEl("polygon", { points: up.concat(down).join(" "), fill: s.color, opacity: 0.13 }));
        }
      }
      // A missing value breaks the line instead of bridging over it.
      let d = "", pen = "M";
      for (const [x, y] of s.pts) {
        if (!isNum(y)) { pen = "M"; continue; }
        d += `${pen}${sx(x).toFixed(1)},${sy(y).toFixed(1)}`;
        pen = "L";
      }
      svg.append(svgEl("path", { d, class: "series", stroke: s.color, "stroke-dasharray": s.dash }));
      const finite = s.pts.filter((p) => isNum(p[1]));
      if (finite.length <= 40) {  // sparse series (eval, short runs): mark each point
        for (const [x, y] of finite) svg.append(svgEl("circle", { cx: sx(x), cy: sy(y), r: 2.6, fill: s.color }));
      }
    }

    // Hover: a cursor at the nearest step and the value of every series there.
    const steps = Array.from(new Set(series.flatMap((s) => s.pts.filter((p) => isNum(p[1])).map((p) => p[0]))))
      .sort((a, b) => a - b);
    const cursor = svgEl("line", { class: "cursor", y1: M.t, y2: H - M.b, visibility: "hidden" });
    svg.append(cursor);
    const nearestStep = (event) => {
      const pt = svg.createSVGPoint();
      pt.x = event.clientX; pt.y = event.clientY;
      const ctm = svg.getScreenCTM();
      if (!ctm) return null;
      const x = x0 + (pt.matrixTransform(ctm.inverse()).x - M.l) / (W - M.l - M.r) * (x1 - x0);
      return steps.reduce((best, s) => (Math.abs(s - x) < Math.abs(best - x) ? s : best), steps[0]);
    };
    svg.addEventListener("mousemove", (event) => {
      const step = nearestStep(event);
      if (step === null) return;
      cursor.setAttribute("x1", sx(step)); cursor.setAttribute("x2", sx(step));
      cursor.setAttribute("visibility", "visible");
      showTooltip(event, `step ${step}`, series.map((s) => {
        const hit = s.pts.find((p) => p[0] === step);
        const std = s.std && hit && isNum(s.std.get(step)) ? ` ± ${fmt(s.std.get(step))}` : "";
        return [s.color, s.label, hit ? fmt(hit[1]) + std : "–"];
      }));
    });
    svg.addEventListener("mouseleave", () => { cursor.setAttribute("visibility", "hidden"); tooltip.hidden = true; });
    svg.addEventListener("click", (event) => {
      const step = nearestStep(event);
      if (step !== null) browser.goToStep(step, true);
    });
    card.append(svg);

    const legend = el("div", { class: "legend" });
    keys.forEach((key, ki) => {
      if (!series.some((s) => s.key === key)) return;
      const st = styleOf(0, ki);
      legend.append(el("span", {}, [lineSample(MULTI ? "currentColor" : st.color, st.dash), el("span", { text: key })]));
    });
    card.append(legend);
  }

  function charts() {
    const box = document.getElementById("charts");
    for (const panel of DATA.panels) {
      const card = el("div", { class: "card chart", "data-panel": panel.id }, [el("h3", { text: panel.title })]);
      box.append(card);
      drawChart(card, panel.keys, panel.band, panel.empty);
    }
    // Any other logged metric, picked from a list.
    const drawn = new Set(DATA.panels.flatMap((p) => p.keys.concat(Object.values(p.band))));
    const others = DATA.metric_keys.filter((k) => !drawn.has(k));
    if (!others.length) return;
    const select = el("select", { id: "metric-select" });
    for (const k of others) select.append(el("option", { value: k, text: k }));
    const card = el("div", { class: "card chart", "data-panel": "explore" },
                    [el("h3", {}, ["Any metric: ", select])]);
    box.append(card);
    const draw = () => drawChart(card, [select.value], {}, "no data");
    select.addEventListener("change", draw);
    draw();
  }

  // ------------------------------------------------------------------ rollout browser

  const browser = (function () {
    const runSelect = document.getElementById("run-select");
    const stepSelect = document.getElementById("step-select");
    const filter = document.getElementById("reward-filter");
    const minReward = document.getElementById("reward-min");
    const textFilter = document.getElementById("text-filter");
    const summary = document.getElementById("step-summary");
    const groupsBox = document.getElementById("groups");
    let run = RUNS[0];

    function stepsOf(r) { return Object.keys(r.rollouts).map(Number).sort((a, b) => a - b); }

    function fillSteps() {
      stepSelect.replaceChildren();
      for (const step of stepsOf(run)) {
        const n = run.rollouts[String(step)].reduce((k, g) => k + g.samples.length, 0);
        stepSelect.append(el("option", { value: String(step), text: `${step} · ${n} responses` }));
      }
      if (stepSelect.options.length) stepSelect.selectedIndex = stepSelect.options.length - 1;
    }

    function keep(sample, group) {
      const r = sample.reward;
      switch (filter.value) {
        case "positive": if (!(isNum(r) && r > 0)) return false; break;
        case "nonpositive": if (!(isNum(r) && r <= 0)) return false; break;
        case "failed": if (isNum(r)) return false; break;
        case "truncated": if (!sample.truncated) return false; break;
        case "best": {
          const best = Math.max(...group.samples.map((s) => (isNum(s.reward) ? s.reward : -Infinity)));
          if (!(isNum(r) && r === best)) return false;
          break;
        }
        default: break;
      }
      const lo = parseFloat(minReward.value);
      if (isFinite(lo) && !(isNum(r) && r >= lo)) return false;
      const needle = textFilter.value.trim().toLowerCase();
      return !needle || sample.response.toLowerCase().includes(needle);
    }

    function signClass(v) { return !isNum(v) ? "zero" : v > 0 ? "pos" : v < 0 ? "neg" : "zero"; }

    // A model turn's text with each call of a tool the episode used (<name>...</name>) set
    // apart as a chip; any other markup stays plain text.
    function modelText(text, tools) {
      const pre = el("pre", { class: "turn-text" });
      if (!tools.length) { pre.textContent = text; return pre; }
      const names = tools.map((t) => t.replace(/[.*+?^${}()|[\]\\]/g, "\\$&")).join("|");
      const call = new RegExp(`<(${names})>([\\s\\S]*?)<\\/\\1>`, "g");
      let last = 0, m;
      while ((m = call.exec(text)) !== null) {
        if (m.index > last) pre.append(text.slice(last, m.index));
        pre.append(el("span", { class: "tool-call", title: `tool call: ${m[1]}`, text: m[0] }));
        last = m.index + m[0].length;
      }
      if (last < text.length) pre.append(text.slice(last));
      return pre;
    }

    // An episode (grpo.episodes): its turns in order, model text, tool results and errors told apart.
    function episodeView(s) {
      const box = el("div", { class: "episode" });
      const tools = Array.from(new Set(s.turns.filter((t) => t.tool).map((t) => t.tool)));
      for (const t of s.turns) {
        if (t.role === "model") {
          box.append(el("div", { class: "turn turn-model" }, [el("span", { class: "turn-label", text: "model" }),
                                                              modelText(t.text, tools)]));
          continue;
        }
        const label = t.tool ? `${t.tool}(${t.tool_input ?? ""})` : "environment";
        const kids = [el("span", { class: "turn-label", text: t.error ? `${label} · error` : `${label} →` })];
        if (t.error) kids.push(el("span", { class: "turn-error-text", text: t.error }));
        if (t.text) kids.push(el("pre", { class: "turn-text", text: t.text }));
        box.append(el("div", { class: `turn ${t.error ? "turn-error" : "turn-tool"}` }, kids));
      }
      const calls = s.turns.filter((t) => t.role !== "model").length;
      const errors = s.turns.filter((t) => t.error).length;
      box.append(el("div", { class: "episode-end muted",
        text: `${s.turns.filter((t) => t.role === "model").length} model turns · ${calls} tool calls · ` +
              `${errors} errors · ended: ${s.end_reason}${s.turns_cut ? ` · ${s.turns_cut} more turns not shown` : ""}` }));
      return box;
    }

    function render() {
      groupsBox.replaceChildren();
      if (!stepSelect.options.length) {
        summary.textContent = "No rollouts were logged in this run (rollouts.jsonl is empty or missing).";
        return;
      }
      const groups = run.rollouts[stepSelect.value] || [];
      const all = groups.flatMap((g) => g.samples);
      const scored = all.filter((s) => isNum(s.reward));
      const mean = scored.length ? scored.reduce((a, s) => a + s.reward, 0) / scored.length : NaN;
      const maxTokens = Math.max(1, ...all.map((s) => (isNum(s.num_tokens) ? s.num_tokens : 0)));
      let shown = 0;
      for (const group of groups) {
        const visible = group.samples.filter((s) => keep(s, group));
        if (!visible.length) continue;
        shown += visible.length;
        const rewards = group.samples.map((s) => s.reward).filter(isNum);
        const gmean = rewards.length ? rewards.reduce((a, b) => a + b, 0) / rewards.length : NaN;
        const flat = rewards.length < 2 || Math.max(...rewards) - Math.min(...rewards) < 1e-9;
        const head = el("div", { class: "group-head" }, [
          el("b", { text: `group ${group.group}` }),
          el("span", { class: "muted", text: `mean reward ${fmt(gmean)}` }),
          el("span", { class: "tag", text: flat ? "flat: no signal" : "mixed" }),
          el("span", { class: "muted", text: `${visible.length} of ${group.samples.length} shown` }),
        ]);
        const table = el("table", { class: "samples" }, [el("tr", {}, ["#", "reward", "advantage", "tokens", "response"]
          .map((h) => el("th", { text: h })))]);
        for (const s of visible) {
          const tokens = el("td", { class: "num" }, [fmt(s.num_tokens)]);
          if (s.truncated) tokens.append(" ", el("span", { class: "tag", text: "truncated" }));
          tokens.append(el("span", { class: "lenbar",
                                     style: `width:${Math.round(100 * (s.num_tokens || 0) / maxTokens)}%` }));
          table.append(el("tr", { class: "sample" }, [
            el("td", { class: "num muted", text: String(s.sample) }),
            el("td", { class: `num reward ${signClass(s.reward)}`, text: isNum(s.reward) ? fmt(s.reward) : "failed" }),
            el("td", { class: `num ${signClass(s.advantage)}`, text: fmt(s.advantage) }),
            tokens,
            el("td", {}, [s.turns ? episodeView(s) : el("pre", { class: "response", text: s.response })]),
          ]));
        }
        groupsBox.append(el("div", { class: "card group", "data-group": String(group.group) },
                            [head, el("pre", { class: "prompt", text: group.prompt }), table]));
      }
      const truncated = all.filter((s) => s.truncated).length;
      let text = `step ${stepSelect.value}: ${groups.length} groups, ${all.length} responses, ${shown} shown · ` +
                 `mean reward ${fmt(mean)} · ${truncated} truncated · ${all.length - scored.length} failed`;
      if (run.rollouts_shown < run.rollouts_total) {
        text += ` · ${run.rollouts_shown} of ${run.rollouts_total} logged responses embedded in this page`;
      }
      summary.textContent = text;
    }

    function goToStep(step, scroll) {
      const steps = stepsOf(run);
      if (!steps.length) return;
      const nearest = steps.reduce((best, s) => (Math.abs(s - step) < Math.abs(best - step) ? s : best), steps[0]);
      stepSelect.value = String(nearest);
      render();
      if (scroll) document.getElementById("rollouts").scrollIntoView({ behavior: "smooth" });
    }

    function move(delta) {
      const i = stepSelect.selectedIndex + delta;
      if (i >= 0 && i < stepSelect.options.length) { stepSelect.selectedIndex = i; render(); }
    }

    RUNS.forEach((r, i) => runSelect.append(el("option", { value: String(i), text: r.label })));
    if (!MULTI) document.getElementById("run-picker").hidden = true;
    runSelect.addEventListener("change", () => { run = RUNS[Number(runSelect.value)]; fillSteps(); render(); });
    stepSelect.addEventListener("change", render);
    filter.addEventListener("change", render);
    for (const input of [minReward, textFilter]) input.addEventListener("input", render);
    document.getElementById("step-prev").addEventListener("click", () => move(-1));
    document.getElementById("step-next").addEventListener("click", () => move(1));
    fillSteps();
    render();
    return { goToStep };
  })();

  runCards();
  charts();
})();
