"""The HTML run report: data from a real tiny run, hand-written edge cases, the command line,
PNG plots, and the page itself in a real headless chromium (scripts/install_browser.sh)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from grpo.record import report
from grpo.record.runlog import read_jsonl
from grpo.rl.adapter import RLAdapter

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
REPO = Path(__file__).resolve().parents[1]

INJECTED_PROMPT = '<img src=x onerror="window.__pwned = 1"> & <b>bold</b>'
INJECTED_RESPONSE = "</script><script>window.__pwned = 2</script><!-- </SCRIPT> \u2028 end"


class LetterAdapter(RLAdapter):
    """A task the random tiny model gets varied rewards on: letters in the response, mod 3."""

    def build_dataset(self) -> list[dict]:
        return [{"q": f"{i}+{i}"} for i in range(6)]

    def build_eval_dataset(self) -> list[dict]:
        return [{"q": "2+2"}, {"q": "3+1"}]

    def make_prompt(self, sample: dict, tokenizer) -> list[int]:
        return tokenizer.encode(f"Q: {sample['q']}\nA:")

    def compute_reward(self, response: str, sample: dict) -> float:
        return (sum(c.isalpha() for c in response) % 3) / 2


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> Path:
    """3 real GRPO steps of the tiny model (about 10 s), with held-out eval at steps 0 and 3."""
    from grpo.rl.loop import run_grpo

    run_dir = tmp_path_factory.mktemp("real_run")
    run_grpo(LetterAdapter(), {"base_model": "tiny", "steps": 3, "batch_size": 2, "group_size": 4,
                               "max_tokens": 8, "report": False, "progress": False, "eval_samples": 2},
             run_dir=run_dir)
    assert not (run_dir / "report.html").exists()  # report=False is honoured
    return run_dir


def payload_of(html_path: Path) -> dict:
    """The JSON the page embeds, read back the way the page's script reads it."""
    text = html_path.read_text(encoding="utf-8")
    match = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', text, re.S)
    assert match, "no embedded data"
    return json.loads(match.group(1))


def write_jsonl(path: Path, rows: list) -> None:
    # json.dumps writes NaN/Infinity literally, as a careless logger would.
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def make_run(run_dir: Path, metrics: list, rollouts: list | None = None, config: str | None = None) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(run_dir / "metrics.jsonl", metrics)
    if rollouts is not None:
        write_jsonl(run_dir / "rollouts.jsonl", rollouts)
    if config is not None:
        (run_dir / "config.yaml").write_text(config)
    return run_dir


def edge_run(run_dir: Path) -> Path:
    """No eval lines, NaN/None/missing/odd values, a cut last line, an injected prompt/response."""
    metrics = [
        {"step": 0, "reward/mean": 0.5, "reward/std": 0.1, "entropy": float("nan"), "time/step": 1.0},
        {"step": 1, "reward/mean": None, "accuracy": "high", "flag": True, "time/step": 2.0},
        {"reward/mean": 9.0},  # no step: not placeable, left out
        {"step": 2, "reward/mean": 0.75, "reward/std": float("inf"), "time/step": 3.0},
        '{"step": 3, "reward/mean": 0.',  # cut by a kill
    ]
    rollouts = [
        {"step": 2, "group": 0, "sample": 0, "prompt": INJECTED_PROMPT, "response": INJECTED_RESPONSE,
         "reward": 1.0, "advantage": 0.5, "truncated": False, "num_tokens": 12},
        {"step": 2, "group": 0, "sample": 1, "prompt": INJECTED_PROMPT, "response": "plain",
         "reward": None, "advantage": None, "truncated": True, "num_tokens": 8},
        {"step": 2, "group": 1, "sample": 0, "prompt": "p1", "response": "x" * 5000, "reward": float("nan")},
    ]
    return make_run(run_dir, metrics, rollouts)


# --------------------------------------------------------------------------- data


def test_report_of_real_run_matches_its_logs(real_run):
    path = report.write_report(real_run, png=False)
    assert path == real_run / "report.html"

    data = payload_of(path)
    (run,) = data["runs"]
    metrics = read_jsonl(real_run / "metrics.jsonl")
    train = [r for r in metrics if "reward/mean" in r]
    evals = [r for r in metrics if "eval/accuracy" in r]
    assert [r["step"] for r in train] == [0, 1, 2]
    assert [r["step"] for r in evals] == [0, 3]
    assert run["metrics"]["reward/mean"] == [[r["step"], r["reward/mean"]] for r in train]
    assert run["metrics"]["eval/accuracy"] == [[r["step"], r["eval/accuracy"]] for r in evals]
    assert run["summary"]["steps_done"] == 3
    assert run["summary"]["reward_last"] == train[-1]["reward/mean"]

    panels = {p["id"]: p["keys"] for p in data["panels"]}
    assert panels["reward"] == ["reward/mean"]
    assert panels["eval"][0] == "eval/accuracy" and "eval/pass@2" in panels["eval"]
    assert "eval/items" not in panels["eval"]
    assert panels["time"][:3] == ["time/sample", "time/score", "time/train"]

    rollouts = read_jsonl(real_run / "rollouts.jsonl")
    assert sorted(run["rollouts"], key=int) == ["0", "1", "2"]
    for step, groups in run["rollouts"].items():
        rows = [r for r in rollouts if r["step"] == int(step)]
        samples = [s for g in groups for s in g["samples"]]
        assert len(groups) == 2 and len(samples) == len(rows) == 2 * 4  # batch_size x group_size
        assert [s["response"] for s in samples] == [r["response"] for r in rows]
        assert [s["advantage"] for s in samples] == [r["advantage"] for r in rows]
        # advantages are centred within each group
        for g in groups:
            assert sum(s["advantage"] for s in g["samples"]) == pytest.approx(0.0, abs=1e-9)


def test_the_loops_hook_writes_the_report_and_never_raises(real_run, tmp_path, capsys):
    from grpo.rl.config import GRPOConfig
    from grpo.rl.loop import refresh_report as loop_write_report

    cfg = GRPOConfig.from_any({"base_model": "tiny", "report": True})
    copy = tmp_path / "run"
    shutil.copytree(real_run, copy, ignore=shutil.ignore_patterns("checkpoints"))
    loop_write_report(copy, cfg)
    assert payload_of(copy / "report.html")["runs"][0]["summary"]["steps_done"] == 3

    # a broken run directory costs the report, never the training
    loop_write_report(tmp_path / "missing", cfg)
    assert "report not written: ReportError" in capsys.readouterr().out


def test_metric_series_skips_what_is_not_a_finite_number(tmp_path):
    run = report.load_run(edge_run(tmp_path / "edge"))
    assert run.metrics["reward/mean"] == [(0, 0.5), (1, None), (2, 0.75)]
    assert run.metrics["reward/std"] == [(0, 0.1), (2, None)]
    assert run.metrics["entropy"] == [(0, None)]
    assert "accuracy" not in run.metrics and "flag" not in run.metrics  # a string, a boolean
    assert run.metrics["time/step"] == [(0, 1.0), (1, 2.0), (2, 3.0)]


def test_repeated_step_keeps_train_and_eval_lines_and_the_last_value():
    series = report.metric_series([
        {"step": 5, "reward/mean": 0.1}, {"step": 5, "eval/accuracy": 0.4},
        {"step": 5, "reward/mean": 0.3}, {"step": 2.0, "reward/mean": 0.2},
    ])
    assert series == {"eval/accuracy": [(5, 0.4)], "reward/mean": [(2, 0.2), (5, 0.3)]}


def test_edge_case_run_renders_and_escapes_injection(tmp_path):
    path = report.write_report(edge_run(tmp_path / "edge"))
    text = path.read_text()
    # our two script elements and nothing a prompt or response could add
    assert text.count("</script>") == 2 and text.lower().count("</script") == 2
    assert "<img" not in text and "<!--" not in text
    data = payload_of(path)
    (run,) = data["runs"]
    (g0, g1) = run["rollouts"]["2"]
    assert g0["prompt"] == INJECTED_PROMPT
    assert [s["response"] for s in g0["samples"]] == [INJECTED_RESPONSE, "plain"]
    assert [s["reward"] for s in g0["samples"] + g1["samples"]] == [1.0, None, None]
    assert g1["samples"][0]["response"].startswith("x" * report.MAX_TEXT_CHARS)
    assert g1["samples"][0]["response"].endswith(f"[{5000 - report.MAX_TEXT_CHARS} more characters not shown]")
    panels = {p["id"]: p["keys"] for p in data["panels"]}
    assert panels["eval"] == [] and panels["kl"] == []
    assert run["config"] == {} and run["summary"]["steps_done"] == 3


def test_embed_json_round_trips_every_dangerous_string():
    value = {"s": "</script><!--<script>&amp;\u2028", "n": [1, None]}
    text = report.embed_json(value)
    assert "<" not in text and ">" not in text and "&" not in text
    assert json.loads(text) == value
    with pytest.raises(ValueError):
        report.embed_json({"x": math.nan})  # never writes JSON the page cannot parse


def test_rollouts_are_capped_per_step_and_in_steps():
    rows = [{"step": s, "group": i // 4, "sample": i % 4, "prompt": f"p{s}", "response": f"r{i}", "reward": 1}
            for s in range(10) for i in range(20)]
    kept, n = report.rollouts_by_step(rows, per_step=6, max_steps=4)
    assert sorted(kept, key=int) == ["0", "3", "6", "9"]  # evenly spaced, first and last kept
    assert n == 4 * 6
    assert [len(g["samples"]) for g in kept["9"]] == [4, 2]
    assert [g["prompt"] for g in kept["9"]] == ["p9", "p9"]


def test_a_long_run_is_capped_to_what_a_page_can_hold(tmp_path):
    metrics = [{"step": s, "reward/mean": s / 300, "reward/std": 0.1, "accuracy": 0.5, "entropy": 1.0,
                "kl/sample_train": 1e-6, "time/sample": 0.1, "time/train": 0.2, "loss": 0.3}
               for s in range(300)]
    metrics += [{"step": s, "eval/accuracy": 0.2, "eval/pass@4": 0.4} for s in range(0, 301, 10)]
    rollouts = [{"step": s, "group": i // 4, "sample": i % 4, "prompt": "Q: " * 100, "response": "A " * 200,
                 "reward": i % 2, "advantage": 0.5, "truncated": False, "num_tokens": 200}
                for s in range(300) for i in range(16)]
    run_dir = make_run(tmp_path / "long", metrics, rollouts)
    path = report.write_report(run_dir)
    run = payload_of(path)["runs"][0]
    assert len(run["rollouts"]) == report.MAX_ROLLOUT_STEPS
    assert run["rollouts_total"] == 4800 and run["rollouts_shown"] == 16 * report.MAX_ROLLOUT_STEPS


# --------------------------------------------------------------------------- several runs


def test_sweep_labels_name_the_config_keys_that_differ(tmp_path):
    base = "base_model: tiny\nsteps: 3\nlearning_rate: {lr}\nwandb:\n  name: {name}\n"
    a = make_run(tmp_path / "sweep" / "0", [{"step": 0, "reward/mean": 0.1}], config=base.format(lr=1e-5, name="a"))
    b = make_run(tmp_path / "sweep" / "1", [{"step": 0, "reward/mean": 0.2}], config=base.format(lr=1e-4, name="b"))
    runs = [report.load_run(a), report.load_run(b)]
    report.label_runs(runs)
    assert [r.label for r in runs] == ["0 (learning_rate=1e-05)", "1 (learning_rate=0.0001)"]

    (b / ".hydra").mkdir()
    (b / ".hydra" / "overrides.yaml").write_text("- learning_rate=1e-4\n- group_size=8\n")
    runs = [report.load_run(a), report.load_run(b)]
    report.label_runs(runs)
    assert runs[1].label == "1 (learning_rate=1e-4, group_size=8)"


def test_find_runs_reads_a_sweep_directory_in_natural_order(tmp_path):
    for i in (10, 2, 0):
        make_run(tmp_path / "multirun" / "day" / str(i), [{"step": 0, "reward/mean": i}])
    found = report.find_runs([tmp_path / "multirun"])
    assert [p.name for p in found] == ["0", "2", "10"]
    assert report.find_runs([found[0], found[0], tmp_path / "multirun"]) == found  # no duplicates


@pytest.mark.parametrize(("make", "message"), [
    (lambda d: d / "nope", "does not exist"),
    (lambda d: d, "no run found under"),
    (lambda d: (d / "metrics.jsonl").parent / "file.txt", "is not a directory"),
])
def test_find_runs_names_the_bad_path(tmp_path, make, message):
    (tmp_path / "file.txt").write_text("x")
    path = make(tmp_path)
    with pytest.raises(report.ReportError, match=message) as err:
        report.find_runs([path])
    assert str(path) in str(err.value) and "metrics.jsonl" in str(err.value)


def test_command_line_overlays_runs_and_reports_bad_paths(tmp_path):
    a = make_run(tmp_path / "a", [{"step": s, "reward/mean": s / 10} for s in range(4)])
    b = make_run(tmp_path / "b", [{"step": s, "reward/mean": s / 5} for s in range(6)])
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = tmp_path / "sweep.html"
    done = subprocess.run([sys.executable, "-m", "grpo.record.report", str(a), str(b), "-o", str(out)],
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"wrote {out}" in done.stdout
    data = payload_of(out)
    assert [r["label"] for r in data["runs"]] == ["a", "b"] and data["title"] == "grpo: 2 runs"
    assert [len(r["metrics"]["reward/mean"]) for r in data["runs"]] == [4, 6]

    done = subprocess.run([sys.executable, "-m", "grpo.record.report", str(tmp_path / "nope")],
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2
    assert "error:" in done.stderr and "does not exist" in done.stderr and "Traceback" not in done.stderr


def test_png_plots_are_real_images(real_run, tmp_path):
    import matplotlib.image

    run_dir = tmp_path / "run"
    shutil.copytree(real_run, run_dir, ignore=shutil.ignore_patterns("checkpoints"))
    report.write_report(run_dir, png=True)
    plots = run_dir / "report_plots"
    assert [p.name for p in plots.iterdir()] == ["overview.png"]
    image = matplotlib.image.imread(plots / "overview.png")
    assert (plots / "overview.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert image.shape[0] > 1000 and image.shape[1] > 1000
    assert image[..., :3].std() > 0.02  # drawn, not blank


# --------------------------------------------------------------------------- in a real browser


@pytest.fixture(scope="module")
def browser():
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.skip("chromium is not installed: run scripts/install_browser.sh (as root) for the browser tests")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium missing: pip install -e '.[dev]'")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1800"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def open_page(driver, path: Path) -> None:
    driver.get(path.resolve().as_uri())
    driver.get_log("browser")  # drop what an earlier page left
    driver.refresh()


def console_errors(driver) -> list:
    return [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]


def chart_points(driver) -> dict:
    return driver.execute_script(
        "return Object.fromEntries(Array.from(document.querySelectorAll('.chart'))"
        ".map(c => [c.dataset.panel, Number(c.dataset.points)]))")


def test_browser_shows_plots_and_rollouts_of_a_real_run(browser, real_run, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    path = report.write_report(real_run)
    open_page(browser, path)
    assert console_errors(browser) == []

    metrics = read_jsonl(real_run / "metrics.jsonl")
    points = chart_points(browser)
    count = lambda *keys: sum(isinstance(r.get(k), (int, float)) for r in metrics for k in keys)  # noqa: E731
    assert points["reward"] == count("reward/mean") == 3
    assert points["entropy"] == count("entropy") == 3
    eval_keys = [k for k in {k for r in metrics for k in r} if k.startswith("eval/") and k not in ("eval/items", "eval/failures")]
    assert points["eval"] == count(*eval_keys) == 2 * len(eval_keys)
    assert browser.find_elements(By.CSS_SELECTOR, ".chart[data-panel=reward] path.series")

    # choosing a step shows that step's groups and responses
    rollouts = read_jsonl(real_run / "rollouts.jsonl")
    Select(browser.find_element(By.ID, "step-select")).select_by_value("1")
    rows = [r for r in rollouts if r["step"] == 1]
    shown = browser.find_elements(By.CSS_SELECTOR, "#groups tr.sample pre.response")
    assert [e.get_attribute("textContent") for e in shown] == [r["response"] for r in rows]
    assert len(browser.find_elements(By.CSS_SELECTOR, "#groups .group")) == len({r["group"] for r in rows})
    rewards = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#groups td.reward")]
    assert [float(x) for x in rewards] == [r["reward"] for r in rows]

    # the reward filter keeps exactly the responses it names
    Select(browser.find_element(By.ID, "reward-filter")).select_by_value("positive")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#groups tr.sample")) == sum(r["reward"] > 0 for r in rows)
    Select(browser.find_element(By.ID, "reward-filter")).select_by_value("all")

    # clicking the left edge of the reward plot opens step 0
    svg = browser.find_element(By.CSS_SELECTOR, ".chart[data-panel=reward] svg")
    from selenium.webdriver.common.action_chains import ActionChains

    ActionChains(browser).move_to_element_with_offset(svg, -svg.size["width"] // 2 + 60, 0).click().perform()
    assert Select(browser.find_element(By.ID, "step-select")).first_selected_option.get_attribute("value") == "0"
    assert not browser.find_element(By.ID, "tooltip").get_attribute("hidden")
    assert console_errors(browser) == []

    shot = tmp_path / "report.png"
    browser.execute_script("window.scrollTo(0, 0)")
    assert browser.save_screenshot(str(shot))
    import matplotlib.image

    image = matplotlib.image.imread(shot)
    assert shot.stat().st_size > 20_000 and image.shape[0] >= 1000 and image.shape[1] >= 1000
    assert image[..., :3].std() > 0.05  # plots and text, not a blank page


def test_browser_shows_injected_text_as_text(browser, tmp_path):
    from selenium.webdriver.common.by import By

    open_page(browser, report.write_report(edge_run(tmp_path / "edge")))
    assert console_errors(browser) == []
    assert browser.execute_script("return window.__pwned === undefined")
    assert not browser.find_elements(By.CSS_SELECTOR, "#groups img, #groups pre *")
    prompt = browser.find_element(By.CSS_SELECTOR, "#groups .group pre.prompt").get_attribute("textContent")
    assert prompt == INJECTED_PROMPT
    first = browser.find_element(By.CSS_SELECTOR, "#groups pre.response").get_attribute("textContent")
    assert first == INJECTED_RESPONSE
    points = chart_points(browser)
    assert points["reward"] == 2 and points["eval"] == 0  # None/NaN left out; no eval lines
    empty = browser.find_element(By.CSS_SELECTOR, ".chart[data-panel=eval] text.empty").text
    assert "no held-out evaluation" in empty


def test_browser_overlays_a_sweep(browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    a = make_run(tmp_path / "a", [{"step": s, "reward/mean": s / 10} for s in range(4)],
                 [{"step": 3, "group": 0, "sample": 0, "prompt": "pa", "response": "ra", "reward": 1}])
    b = make_run(tmp_path / "b", [{"step": s, "reward/mean": s / 5} for s in range(6)],
                 [{"step": 5, "group": 0, "sample": 0, "prompt": "pb", "response": "rb", "reward": 0}])
    out = report.build_report([a, b], tmp_path / "sweep.html")
    open_page(browser, out)
    assert console_errors(browser) == []
    assert browser.execute_script(
        "return document.querySelector('.chart[data-panel=reward]').dataset.series") == "2"
    assert chart_points(browser)["reward"] == 10
    assert len(browser.find_elements(By.CSS_SELECTOR, "#legend > span")) == 2
    Select(browser.find_element(By.ID, "run-select")).select_by_value("1")
    assert browser.find_element(By.CSS_SELECTOR, "#groups pre.response").text == "rb"


# --------------------------------------------------------------------------- multi-turn episodes


@pytest.fixture(scope="module")
def agent_run(tmp_path_factory) -> Path:
    """2 real GRPO steps of the tiny model on 3-turn episodes whose tool fails for one item."""
    from toy_agent import ToyAgent

    from grpo.rl.loop import run_grpo

    run_dir = tmp_path_factory.mktemp("agent_run")
    run_grpo(ToyAgent(num_items=4, max_turns=3, behaviour={1: "raise"}),
             {"base_model": "tiny", "steps": 2, "batch_size": 2, "group_size": 2, "max_tokens": 16,
              "report": False, "progress": False}, run_dir=run_dir)
    return run_dir


CALC_ROW = {"step": 0, "group": 0, "sample": 0, "prompt": "What is 2 + 3?", "response": "x", "reward": 1.0,
            "advantage": 0.5, "num_tokens": 20, "end_reason": "done",
            "turns": [{"role": "model", "text": "Let me see <calc>2+3</calc>"},
                      {"role": "observation", "text": "<result>5</result>", "tool": "calc", "tool_input": "2+3"},
                      {"role": "model", "text": " so <b>5</b>"}]}


def test_episode_traces_reach_the_page_data(agent_run, tmp_path):
    data = payload_of(report.write_report(agent_run))
    (run,) = data["runs"]
    rows = read_jsonl(agent_run / "rollouts.jsonl")
    samples = [s for step in sorted(run["rollouts"], key=int) for g in run["rollouts"][step] for s in g["samples"]]
    assert len(samples) == len(rows) == 2 * 2 * 2
    for s, r in zip(samples, rows, strict=True):
        assert [t["text"] for t in s["turns"]] == [t["text"] for t in r["turns"]]
        assert [t.get("error") for t in s["turns"]] == [t.get("error") for t in r["turns"]]
        assert s["end_reason"] == r["end_reason"]
    panels = {p["id"]: p["keys"] for p in data["panels"]}
    assert panels["episode"] == ["episode/turns", "episode/tool_calls", "episode/observations",
                                 "episode/tool_error_rate"]
    assert panels["prefix"] == ["sampler/prefix_hit_rate"]


def test_browser_shows_multi_turn_traces(browser, agent_run, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    path = report.write_report(agent_run)
    open_page(browser, path)
    assert console_errors(browser) == []
    rows = [r for r in read_jsonl(agent_run / "rollouts.jsonl") if r["step"] == 1]
    Select(browser.find_element(By.ID, "step-select")).select_by_value("1")
    episodes = browser.find_elements(By.CSS_SELECTOR, "#groups tr.sample .episode")
    assert len(episodes) == len(rows)
    for view, row in zip(episodes, rows, strict=True):
        turns = view.find_elements(By.CSS_SELECTOR, ".turn")
        assert len(turns) == len(row["turns"])
        for t_el, turn in zip(turns, row["turns"], strict=True):
            kind = "turn-model" if turn["role"] == "model" else "turn-error" if turn.get("error") else "turn-tool"
            assert kind in t_el.get_attribute("class").split()
            text = t_el.find_elements(By.CSS_SELECTOR, "pre.turn-text")
            assert (text[0].get_attribute("textContent") if text else "") == turn["text"]
        assert f"ended: {row['end_reason']}" in view.find_element(By.CSS_SELECTOR, ".episode-end").text
    errors = [t for r in rows for t in r["turns"] if t.get("error")]
    assert errors and len(browser.find_elements(By.CSS_SELECTOR, "#groups .turn-error")) == len(errors)
    assert points_of(browser, "episode") > 0
    rollouts = browser.find_element(By.ID, "rollouts")
    browser.execute_script("arguments[0].scrollIntoView()", rollouts)
    shot = tmp_path / "episodes.png"
    assert rollouts.screenshot(str(shot))
    import matplotlib.image

    image = matplotlib.image.imread(shot)
    assert image.shape[0] > 300 and image[..., :3].std() > 0.05  # drawn turns, not a blank box


def points_of(driver, panel: str) -> int:
    return chart_points(driver)[panel]


def test_browser_sets_tool_calls_apart_and_shows_trace_text_as_text(browser, tmp_path):
    from selenium.webdriver.common.by import By

    run_dir = make_run(tmp_path / "calc", [{"step": 0, "reward/mean": 1.0}], [CALC_ROW])
    open_page(browser, report.write_report(run_dir))
    assert console_errors(browser) == []
    chips = browser.find_elements(By.CSS_SELECTOR, ".turn-model .tool-call")
    assert [c.text for c in chips] == ["<calc>2+3</calc>"]
    assert browser.find_element(By.CSS_SELECTOR, ".turn-tool .turn-label").text == "calc(2+3) →"
    last = browser.find_elements(By.CSS_SELECTOR, ".turn-model pre.turn-text")[-1]
    assert last.get_attribute("textContent") == " so <b>5</b>" and not last.find_elements(By.CSS_SELECTOR, "b")


@pytest.mark.skipif(not os.environ.get("GRPO_REPORT_RUN"), reason="set GRPO_REPORT_RUN=<run dir> to check a real run")
def test_browser_shows_the_episodes_of_a_given_run(browser, tmp_path):
    """The report of a real run (e.g. `python -m grpo adapter=tools`) in chromium: every episode of
    its last step (or GRPO_REPORT_STEP) is drawn turn by turn, tool calls set apart.
    GRPO_REPORT_SHOT=<png> keeps the screenshot (docs/tools_report.png was taken this way)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    run_dir = tmp_path / "run"
    shutil.copytree(os.environ["GRPO_REPORT_RUN"], run_dir, ignore=shutil.ignore_patterns("checkpoints", "wandb"))
    open_page(browser, report.write_report(run_dir))
    assert console_errors(browser) == []
    rows = read_jsonl(run_dir / "rollouts.jsonl")
    step = int(os.environ.get("GRPO_REPORT_STEP", max(r["step"] for r in rows)))  # default: the last
    rows = [r for r in rows if r["step"] == step][: report.MAX_ROLLOUTS_PER_STEP]
    Select(browser.find_element(By.ID, "step-select")).select_by_value(str(step))
    views = browser.find_elements(By.CSS_SELECTOR, "#groups .episode")
    assert len(views) == len(rows)
    assert len(browser.find_elements(By.CSS_SELECTOR, "#groups .turn")) == sum(len(r["turns"]) for r in rows)
    calls = sum(t["role"] == "observation" for r in rows for t in r["turns"])
    assert len(browser.find_elements(By.CSS_SELECTOR, "#groups .turn-tool, #groups .turn-error")) == calls
    browser.set_window_size(1400, 2400)
    section = browser.find_element(By.ID, "rollouts")
    browser.execute_script("arguments[0].scrollIntoView()", section)
    shot = Path(os.environ.get("GRPO_REPORT_SHOT") or tmp_path / "episodes.png")
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 20_000
    browser.set_window_size(1400, 1800)
