"""The HTML run and trend pages: built from the committed docs/validation/ folders, checked as
text, and rendered in a real headless Chromium (skipped, with the reason, where it is missing)."""

import json
import shutil
from pathlib import Path

import pytest

from e2e_test.infra.cluster.cluster import results_root
from e2e_test.infra.reports import browser, html_report
from e2e_test.infra.specs import settings

REPO = Path(__file__).resolve().parents[1]
VALIDATION = REPO / "docs" / "validation"
RUNS = sorted(p for p in VALIDATION.iterdir() if p.is_dir())


def test_run_page_has_plans_ready_times_tests_plots_and_teardown():
    page = html_report.render_run(VALIDATION / "h200x2-pd")
    assert "prefill-0: gpu 0" in page and "decode-0: gpu 1" in page
    assert "prefill-0: 62.7 s" in page
    assert "test_pd_kv_transfer_proof[vllm-1p1d]" in page
    assert "KV proof: decode got 1446/1446 prompt tokens by transfer" in page
    assert page.count("data:image/png;base64,") == 5          # the five burst PNGs, embedded
    assert "clean in 5.4 s" in page and "GPU memory back to baseline" in page
    assert "<script" not in page and "http://" not in page and "https://" not in page


def test_run_page_shows_sha_command_and_oracle_items(tmp_path):
    d = tmp_path / "run"
    shutil.copytree(VALIDATION / "h200x2-pd", d)
    (d / "run.json").write_text(json.dumps({"lane": "x", "git_sha": "abc123",
                                            "argv": ["pytest", "-m", "pd and vllm"]}))
    rec = json.loads(next((d / "tests").glob("*kv_transfer*")).read_text())
    rec["oracle"] = {"verdict": "pass", "baseline": "1", "items": [
        {"index": 0, "verdict": "identical", "tokens": 32},
        {"index": 1, "verdict": "numerics", "first_divergence": 17},
        {"index": 2, "verdict": "mismatch", "first_divergence": 3}],
        "control": {"verdict": "pass", "items": [{"index": 0, "verdict": "identical"}]}}
    (d / "tests" / "oracle.json").write_text(json.dumps(rec))
    page = html_report.render_run(d)
    assert "<code>abc123</code>" in page and "pytest -m &#x27;pd and vllm&#x27;" in page
    assert "Comparison verdicts" in page and "identical 1, mismatch 1, numerics 1" in page
    assert '<tr class="mismatch">' in page and "first_divergence" in page
    assert "control arm (baseline against itself)" in page


def test_wilson_interval_and_proportion_change():
    lo, hi = html_report.wilson(8, 32)
    assert round(lo, 3) == 0.133 and round(hi, 3) == 0.421      # textbook Wilson 95 %
    assert html_report.wilson(0, 0) == (0.0, 1.0)
    assert not html_report.proportion_changed(8, 32, 10, 32)    # 25 % vs 31 % at n=32: noise
    assert html_report.proportion_changed(8, 32, 28, 32)        # negative control: a real drop


def test_beyond_noise_flags_a_shift_and_not_jitter():
    hist = [80.0, 82.0, 79.0, 81.0]
    assert not html_report.beyond_noise(hist, 83.0)
    assert html_report.beyond_noise(hist, 140.0)                # negative control
    assert not html_report.beyond_noise([], 140.0)


def test_trend_marks_a_changed_window_and_accuracy(tmp_path):
    """Two copies of one run, the second with a different engine window and a collapsed
    accuracy: both are marked; the unchanged series are not."""
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(VALIDATION / "h200x2-pd", a)
    shutil.copytree(VALIDATION / "h200x2-pd", b)
    for f in (b / "tests").glob("*.json"):
        rec = json.loads(f.read_text())
        for burst in (rec.get("bursts") or {}).values():
            if burst.get("effective_window"):
                burst["effective_window"]["max_num_seqs"] = 256
        for ev in (rec.get("evals") or {}).values():
            if ev["eval"] == "mmlu":
                ev["correct"] = ev["scored"]
        f.write_text(json.dumps(rec))
    data = html_report.collect_trend([a, b])
    win = data["series"]["window"]["vllm 1 within-capacity-plain"]
    assert win == [1024, 256] and html_report.mark_changes("window", win) == [False, True]
    acc = data["series"]["accuracy"]["vllm 1 mmlu"]
    assert html_report.mark_changes("accuracy", acc) == [False, True]
    ready = data["series"]["ready_s"]["vllm 1p1d prefill-0"]
    assert html_report.mark_changes("ready_s", ready) == [False, False]
    page = html_report.render_trend([a, b])
    assert "Ready time per role" in page and "Wilson" in page and "▲" in page


def test_console_error_collection_names_each_kind():
    events = [{"method": "Runtime.consoleAPICalled",
               "params": {"type": "error", "args": [{"value": "boom"}]}},
              {"method": "Runtime.consoleAPICalled",
               "params": {"type": "log", "args": [{"value": "fine"}]}},
              {"method": "Runtime.exceptionThrown", "params": {"exceptionDetails": {
                  "exception": {"description": "TypeError: x\n at y"}}}},
              {"method": "Log.entryAdded", "params": {"entry": {
                  "level": "error", "source": "network", "text": "Failed to load", "url": "u"}}}]
    assert browser.console_errors(events) == ["console.error: boom", "uncaught: TypeError: x",
                                              "network: Failed to load u"]


def _need_chromium():
    if browser.find_chromium() is None:
        if settings.get("E2E_REQUIRE_CHROMIUM"):
            pytest.fail("E2E_REQUIRE_CHROMIUM=1 but no Chromium found (apt-get install -y "
                        "chromium)")
        pytest.skip("no Chromium on this machine (Debian: apt-get install -y chromium; "
                    ".ci/run installs it)")
    pytest.importorskip("websockets", reason="the DevTools client needs the websockets package")


def test_pages_render_in_headless_chromium_without_console_errors(tmp_path):
    _need_chromium()
    shots = results_root() / "browser"
    pages = {"run": (tmp_path / "run.html", html_report.render_run(VALIDATION / "h200x2-pd")),
             "trend": (tmp_path / "trend.html", html_report.render_trend(RUNS))}
    for name, (path, text) in pages.items():
        path.write_text(text)
        rep = browser.render(path, screenshot=shots / f"{name}.png")
        assert rep.console_errors == [], f"{name} page: {rep.console_errors}"
        assert rep.text_length > 1000, f"{name} page rendered almost no text"
        assert Path(rep.screenshot).stat().st_size > 10_000
    assert "1p1d" in pages["run"][1] and "Trend" in pages["trend"][1]


def test_index_trend_and_flake_view_render_in_headless_chromium(tmp_path):
    """The trend page from the committed index alone and the flake view it links, loaded in a
    real browser: no console error, text on the page, the link between them. Their screenshots
    are of the first screen: the whole index page is some 9000 x 17000 pixels (its tables have
    a column per run), which Chromium takes over 10 s to capture, and nothing here reads it."""
    _need_chromium()
    from e2e_test.infra.reports import flakes, index
    lines = index.read(VALIDATION / "index.jsonl")
    shots = results_root() / "browser"
    pages = {"trend-index": (tmp_path / "trend.html",
                             html_report.render_trend(lines=lines, flakes_href="flakes.html")),
             "flakes": (tmp_path / "flakes.html", flakes.render(lines, trend_href="trend.html"))}
    for name, (path, text) in pages.items():
        path.write_text(text)
    for name, (path, text) in pages.items():
        rep = browser.render(path, screenshot=shots / f"{name}.png", full_page=False)
        assert rep.console_errors == [], f"{name} page: {rep.console_errors}"
        assert rep.text_length > 1000, f"{name} page rendered almost no text"
    assert 'href="flakes.html"' in pages["trend-index"][1]
    assert "Wilson" in pages["flakes"][1] and 'href="trend.html"' in pages["flakes"][1]


def test_chromium_check_catches_a_broken_page(tmp_path):
    """Negative control: a page with a console.error, an exception and a missing image."""
    _need_chromium()
    bad = tmp_path / "bad.html"
    bad.write_text('<!DOCTYPE html><html><body><img src="missing.png">'
                   '<script>console.error("boom"); null.x;</script></body></html>')
    errs = browser.render(bad).console_errors
    assert any("boom" in e for e in errs) and any(e.startswith("uncaught:") for e in errs)
    assert any("missing.png" in e for e in errs)
