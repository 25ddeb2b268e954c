"""The published runs as data (e2e_test/infra/reports/index.py, flakes.py, validation_page.py):
the index line of a run folder, the flake view, the trend page from the index alone, `report`
on a glob and beside its input, the committed table, citations and the size of docs/."""

import importlib.util
import json
import lzma
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from e2e_test.infra.reports import flakes, html_report, index, validation_page

REPO = Path(__file__).resolve().parents[1]
VALIDATION = REPO / "docs" / "validation"
INDEX = VALIDATION / "index.jsonl"
KEPT = sorted(p for p in VALIDATION.iterdir() if p.is_dir())
DOCS_LIMIT = 8 * 2**20

_spec = importlib.util.spec_from_file_location("rejudge_oracle",
                                               REPO / "scripts" / "rejudge_oracle.py")
rejudge = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rejudge)

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="e2e_test.router.test_chat" name="test_chat[vllm-1]" time="1.5" />
<testcase classname="e2e_test.router.test_pd" name="test_pd[vllm-1p1d]" time="2.25">
<failure message="AssertionError: the KV did not move&#10;second line">trace</failure></testcase>
<testcase classname="e2e_test.router.test_pd" name="test_setup[vllm-1p1d]" time="0.1">
<error message="fixture broke">trace</error></testcase>
</testsuite></testsuites>"""


def _verdict(ok: bool) -> dict:
    items = [{"index": i, "verdict": "identical", "first_step_delta": 0.01 * (i + 1),
              "max_step_delta": 0.02, "compared": 8, "reason": "", "divergence": None}
             for i in range(4)]
    return {"ok": ok, "message": "gsm8k vllm/1p1d vs vllm/1: 4 identical\nmore",
            "numerics_budget": 1,
            "comparison": {"name": "gsm8k", "a": "vllm/1", "b": "vllm/1p1d",
                           "counts": {"identical": 4, "numerics": 0, "mismatch": 0, "error": 0},
                           "compared": 4, "max_first_step_delta": 0.04, "items": items},
            "thresholds": {"first_step_max": 0.5, "gap_max": 1.0},
            "first_step_rank_test": {"p": 0.3}}


def _run_folder(root: Path, name="h200-e2e-1gpu-pd-vllm-abc1234-serial", run_json=True) -> Path:
    d = root / name
    (d / "tests").mkdir(parents=True)
    if run_json:
        (d / "run.json").write_text(json.dumps({
            "lane": "e2e-1gpu-pd", "engines": "vllm", "git_sha": "abc1234",
            "command": "python -m pytest e2e_test/router", "exit_code": 1,
            "started": "2026-12-02 13:12:09 UTC", "wall_s": 10.0, "device": "NVIDIA H200"}))
    (d / "summary.json").write_text(json.dumps({"finished": "2026-12-02T13:16:05Z",
                                                "wall_s": 9.5, "clusters": {}}))
    (d / "timing.json").write_text(json.dumps({"wall_s": 9.5, "boots": 1, "boot_s": 5.0,
                                               "share_pct": {"boot": 52.6, "traffic": 47.4}}))
    (d / "junit.xml").write_text(JUNIT)
    recs = [{"test": "e2e_test/router/test_chat.py::test_chat[vllm-1]", "outcome": "passed",
             "engine": "vllm", "topology": "1"},
            {"test": "e2e_test/router/test_pd.py::test_pd[vllm-1p1d]", "outcome": "passed",
             "engine": "vllm", "topology": "1p1d", "pd_vs_regular": {"gsm8k": _verdict(True)},
             "pd_proof": {"requests": 4, "nixl_bytes": 1024}}]
    for i, r in enumerate(recs):
        (d / "tests" / f"{i}.json").write_text(json.dumps(r))
    return d


# -- the index line ----------------------------------------------------------------------------

def test_index_line_of_a_synthetic_run_round_trips(tmp_path):
    d = _run_folder(tmp_path)
    line = index.index_line(d)
    assert (line["run"], line["lane"], line["engine"], line["sha"]) == \
        (d.name, "e2e-1gpu-pd", "vllm", "abc1234")
    assert line["date"] == "2026-12-02 13:12:09 UTC" and line["exit_code"] == 1
    tests = {t["id"].split("::")[1]: t for t in line["tests"]}
    # junit decides the outcome (it sees what the record cannot), with its duration
    assert tests["test_pd[vllm-1p1d]"]["outcome"] == "failed"
    assert tests["test_pd[vllm-1p1d]"]["duration_s"] == 2.25
    assert tests["test_pd[vllm-1p1d]"]["message"] == "AssertionError: the KV did not move"
    assert tests["test_setup[vllm-1p1d]"] == {
        "id": "e2e_test/router/test_pd.py::test_setup[vllm-1p1d]", "outcome": "error",
        "duration_s": 0.1, "engine": None, "topology": None, "message": "fixture broke"}
    assert tests["test_chat[vllm-1]"]["message"] is None
    assert line["time"]["share_pct"] == {"boot": 52.6, "traffic": 47.4}
    [v] = line["oracle"]
    assert v["counts"]["identical"] == 4 and v["first_step_max"] == 0.5 and v["rank_p"] == 0.3
    assert v["message"] == "gsm8k vllm/1p1d vs vllm/1: 4 identical"
    assert line["proofs"]["e2e_test/router/test_pd.py::test_pd[vllm-1p1d]"]["pd_proof"] == \
        {"requests": 4, "nixl_bytes": 1024}
    idx = tmp_path / "index.jsonl"
    index.append(idx, d)
    assert index.read(idx) == [line]
    assert index.dumps(line) == index.dumps(index.index_line(d))        # deterministic
    with pytest.raises(ValueError, match="indexed already"):
        index.append(idx, d)


def _sidecar_lines(idx: Path) -> list[dict]:
    return [json.loads(x) for x in lzma.decompress(index.sidecar(idx).read_bytes()).splitlines()]


def test_append_puts_the_oracle_records_in_the_sidecar_and_read_merges_them(tmp_path):
    """index.jsonl's line is the line less `oracle_records`; the sidecar beside it holds them,
    one entry per run with records, in order; read gives index_line's line back. A run with
    none adds no entry and reads back []."""
    a = _run_folder(tmp_path)
    b = _run_folder(tmp_path, name="h200-e2e-1gpu-pd-vllm-abc1234-second")
    bare = tmp_path / "bare"
    (bare / "tests").mkdir(parents=True)
    idx = tmp_path / "pub" / "index.jsonl"
    idx.parent.mkdir()
    lines = [index.append(idx, d) for d in (a, bare, b)]
    assert index.read(idx) == lines == [index.index_line(d) for d in (a, bare, b)]
    assert lines[0]["oracle_records"] and lines[1]["oracle_records"] == []
    stored = [json.loads(x) for x in idx.read_text().splitlines()]
    assert stored == [{k: v for k, v in x.items() if k != "oracle_records"} for x in lines]
    assert _sidecar_lines(idx) == [{"run": x["run"], "oracle_records": x["oracle_records"]}
                                   for x in (lines[0], lines[2])]
    xz = index.sidecar(idx).read_bytes()
    assert xz == lzma.compress(lzma.decompress(xz), preset=index.XZ_PRESET)    # deterministic
    assert sorted(p.name for p in idx.parent.iterdir()) == ["index.jsonl", index.SIDECAR]
    shutil.copy(idx, tmp_path / "index.jsonl")                # the index without its sidecar
    assert all(x["oracle_records"] == [] for x in index.read(tmp_path / "index.jsonl"))


def test_a_sidecar_entry_for_a_run_the_index_lacks_is_an_error(tmp_path):
    d = _run_folder(tmp_path)
    idx = tmp_path / "index.jsonl"
    index.append(idx, d)
    index.read(idx)                                             # the control: it reads
    idx.write_text("")
    with pytest.raises(ValueError, match=f"oracle_records.jsonl.xz: {d.name} is not a run of"):
        index.read(idx)
    # the run appended again: its sidecar entry is there already, nothing is written
    with pytest.raises(ValueError, match=f"{d.name} has oracle records there already"):
        index.append(idx, d)
    assert idx.read_text() == "" and len(_sidecar_lines(idx)) == 1
    idx.write_text(index.dumps(index.index_line(d)) + "\n")    # the records in the line too
    with pytest.raises(ValueError, match="has oracle records in its line and in"):
        index.read(idx)
    index.sidecar(idx).unlink()                       # a line of its own records, no sidecar
    assert index.read(idx) == [index.index_line(d)]
    index.sidecar(idx).write_bytes(b"not xz")
    with pytest.raises(ValueError, match="not an xz file"):
        index.read(idx)


def test_a_value_the_run_did_not_record_is_null(tmp_path):
    """No run.json: the SHA from the folder name, the date from the summary; a folder with
    nothing: null, never guessed."""
    line = index.index_line(_run_folder(tmp_path, run_json=False))
    assert line["sha"] == "abc1234" and line["date"] == "2026-12-02T13:16:05Z"
    assert line["exit_code"] is None and line["device"] is None
    (tmp_path / "bare").mkdir()
    bare = index.index_line(tmp_path / "bare")
    assert all(bare[k] is None for k in ("lane", "engine", "device", "sha", "date", "command"))
    assert bare["tests"] == [] and not index.green(bare)


def test_a_broken_index_line_is_named(tmp_path):
    bad = tmp_path / "index.jsonl"
    bad.write_text('{"run": "a"}\nnot json\n')
    with pytest.raises(ValueError, match=r"index.jsonl:2: not JSON"):
        index.read(bad)
    bad.write_text('{"no_run": 1}\n')
    with pytest.raises(ValueError, match="not a run line"):
        index.read(bad)


@pytest.mark.parametrize("d", KEPT, ids=lambda d: d.name)
def test_a_kept_folder_gives_its_committed_line(d):
    committed = {x["run"]: x for x in index.read(INDEX)}
    assert json.loads(index.dumps(index.index_line(d))) == committed[d.name]


def test_a_kept_folder_rejudges_the_same_from_its_line_and_its_records():
    lines = rejudge.lines()
    d = VALIDATION / "h100-e2e-1gpu-pd-vllm-vpd-ee38fb5"
    from_dir, from_line = rejudge.rejudge(d), rejudge.rejudge(lines[d.name])
    assert sum(r["rejudged"] for r in from_dir) == 4 and from_dir == from_line
    # negative control: an item that lost its first-step delta judges differently
    line = json.loads(json.dumps(lines[d.name]))
    for rec in line["oracle_records"]:
        for v in (rec.get("pd_vs_regular") or {}).values():
            for it in v["comparison"]["items"]:
                it[3] = 5.0                   # ITEM_FIELDS[3]: first_step_delta
    assert rejudge.rejudge(line) != from_dir


def test_the_perturbed_cases_rejudge_the_same_from_a_line_and_from_the_folder():
    """test_perturbed.py's records travel in the index (oracle_inputs): a line re-judges its
    two cases as the folder's tests/*.json do, in every kept folder that holds them."""
    dirs = sorted({d.parent.parent for d in VALIDATION.glob("*/tests/*test_perturbed.py*.json")})
    assert dirs, "no kept run folder holds test_perturbed.py's records"
    for d in dirs:
        from_line = rejudge.rejudge(rejudge.lines()[d.name])
        assert from_line == rejudge.rejudge(d), d.name
        assert sorted(r["expect"] for r in from_line
                      if "perturbed" in r["test"]) == ["pass", "shift"], d.name


def test_compact_item_keeps_what_judging_reads():
    from e2e_test.infra.verdicts import oracle
    item = {"index": 0, "verdict": "numerics", "position": 0, "tokens": ["a", "b"], "gap": 0.0,
            "first_step_delta": 0.0, "max_step_delta": None, "compared": 3,
            "reason": "token 0: near-tie 'a'/'b', gap 0.000 nats (top-k not reported: at least)"}
    back = oracle.ItemVerdict.from_dict(index.expand_item(index.compact_item(item)))
    orig = oracle.ItemVerdict.from_dict(item)
    assert oracle.classify(back, 1.0, 1.0) == oracle.classify(orig, 1.0, 1.0)
    assert back.position == 0 and back.first_step_delta == 0.0 and back.divergence == "bound"


def test_kept_is_the_latest_green_per_lane_and_engine_and_every_cited_run():
    def line(run, date, outcome, lane="l", engine="e"):
        return {"run": run, "date": date, "lane": lane, "engine": engine, "exit_code": 0,
                "tests": [{"id": "t", "outcome": outcome}]}
    lines = [line("a", "2026-01-01", "passed"), line("b", "2026-01-02", "passed"),
             line("c", "2026-01-03", "failed"), line("x", "2026-01-01", "failed", lane="m"),
             line("y", "2026-01-02", "failed", lane="m")]
    assert index.kept(lines) == {"b"}
    assert index.kept(lines, cited={"x"}) == {"b", "x"}
    assert index.kept(lines, cited={"c"}) == {"b", "c"}  # cited: kept beside the green one
    assert index.kept(lines, cited={"a"}) == {"a", "b"}


# -- the flake view ----------------------------------------------------------------------------

def test_wilson_interval_pinned():
    for k, lo, hi in [(0, 0.0, 0.2775), (5, 0.2366, 0.7634), (10, 0.7225, 1.0)]:
        got = html_report.wilson(k, 10)
        assert (round(got[0], 4), round(got[1], 4)) == (lo, hi), (k, got)
    assert html_report.wilson(1, 10) != html_report.wilson(0, 10)     # negative control


def _flaky_index() -> list[dict]:
    def run(name, outcome, msg=None):
        return {"run": name, "lane": "e2e-1gpu-pd", "engine": "vllm", "date": name,
                "tests": [{"id": "f.py::test_a[vllm-1]", "outcome": outcome, "engine": "vllm",
                           "message": msg},
                          {"id": "f.py::test_b[vllm-1]", "outcome": "passed", "engine": "vllm"},
                          {"id": "f.py::test_c[vllm-1]", "outcome": "skipped",
                           "engine": "vllm"}]}
    return [run("r1", "passed"), run("r2", "failed", "boom: first"), run("r3", "error", None),
            run("r4", "passed")]


def test_flake_view_counts_and_interval():
    rows = flakes.rows(_flaky_index())
    assert [(r["test"], r["passed"], r["failed"]) for r in rows] == [
        ("test_a[vllm-1]", 2, 2), ("test_b[vllm-1]", 4, 0)]       # skips are not counted
    assert rows[0]["last_failure"] == {"run": "r3", "message": None}
    text = flakes.text(_flaky_index()).splitlines()
    assert text[0].split() [:5] == ["test", "engine", "lane", "pass", "fail"]
    assert text[1].split()[:6] == ["test_a[vllm-1]", "vllm", "e2e-1gpu-pd", "2", "2", "0.50"]
    assert "[0.15, 0.85]" in text[1] and text[1].endswith("r3: (no message recorded)")
    assert "0.00 [0.00, 0.49]" in text[2]
    assert "test_c" not in "\n".join(text)


def test_flake_view_over_nothing_is_an_error():
    only_skips = [{"run": "r", "tests": [{"id": "t", "outcome": "skipped"}]}]
    with pytest.raises(ValueError, match="no flake view"):
        flakes.text(only_skips)


# -- report: the index alone, a glob, never the cwd --------------------------------------------

def _report(*args, cwd: Path) -> subprocess.CompletedProcess:
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, "-m", "e2e_test", "report", *map(str, args)],
                          cwd=cwd, capture_output=True, text=True, timeout=300, check=False)


def test_trend_renders_from_the_index_alone_beside_it(tmp_path):
    only = tmp_path / "pub"
    only.mkdir()
    shutil.copy(INDEX, only / "index.jsonl")
    cwd = tmp_path / "cwd"
    r = _report("--trend", only / "index.jsonl", cwd=cwd)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in only.iterdir()) == ["flakes.html", "index.jsonl", "trend.html"]
    assert not list(cwd.iterdir())
    page = (only / "trend.html").read_text()
    assert "Trend across indexed runs" in page and 'href="flakes.html"' in page
    assert page.count("data:image/png;base64,") >= 5 and "h200x2-afd" in page
    assert "test_pd_kv_recall[tokenspeed-1p1d]" in (only / "flakes.html").read_text()
    (only / "index.jsonl").write_text("not json\n")                    # negative control
    bad = _report("--trend", only / "index.jsonl", cwd=cwd)
    assert bad.returncode == 2 and "index.jsonl:1: not JSON" in bad.stderr


def test_report_on_a_glob_skips_folders_without_results(tmp_path):
    pub = tmp_path / "pub"
    shutil.copytree(VALIDATION / "h200x2-afd", pub / "a")
    (pub / "empty").mkdir()
    cwd = tmp_path / "cwd"
    r = _report(pub / "a", pub / "empty", cwd=cwd)
    assert r.returncode == 0, r.stderr
    assert "skipped" in r.stderr and "empty" in r.stderr and len(r.stderr.splitlines()) == 1
    assert "# Validation results" in r.stdout and not list(cwd.iterdir())
    none = _report(pub / "empty", cwd=cwd)                               # negative control
    assert none.returncode == 2 and "holds no results" in none.stderr
    assert len(none.stderr.splitlines()) == 1
    none = _report(pub / "empty", pub / "empty", cwd=cwd)
    assert none.returncode == 2 and "none of the folders" in none.stderr


def test_report_never_writes_into_the_cwd(tmp_path):
    pub = tmp_path / "pub"
    for n in ("a", "b"):
        shutil.copytree(VALIDATION / "h200x2-afd", pub / n)
    cwd = tmp_path / "cwd"
    for args in (["--trend", pub / "a", pub / "b"], ["--html", pub / "a"], ["--flakes"],
                 ["--table"], [pub / "a"]):
        r = _report(*args, cwd=cwd)
        assert r.returncode == 0, (args, r.stderr)
        assert not list(cwd.iterdir()), args
    assert (pub / "trend.html").is_file() and (pub / "a" / "run.html").is_file()
    r = _report("--trend", pub / "a", pub / "b", "--out", "t.html", cwd=cwd)   # asked: there
    assert r.returncode == 0 and (cwd / "t.html").is_file()


# -- the committed page, citations, size -------------------------------------------------------

def test_the_committed_table_is_up_to_date():
    page = (REPO / "docs" / "validation.md").read_text()
    lines = index.read(INDEX)
    assert validation_page.block_of(page) == validation_page.table(lines, VALIDATION)
    # negative control: one run fewer gives another table
    assert validation_page.block_of(page) != validation_page.table(lines[:-1], VALIDATION)


def _tracked(*paths) -> list[str]:
    return subprocess.run(["git", "ls-files", "-z", *paths], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout.split("\0")


def test_every_cited_run_is_a_kept_folder_or_an_index_line():
    """docs/validation/NAME in docs and code: a run of the index (its folder kept or not);
    NAME followed by * or { is a pattern some run must match."""
    runs = {x["run"] for x in index.read(INDEX)} | {"index.jsonl", index.SIDECAR, "trend.html",
                                                     "flakes.html"}
    missing = []
    for f in _tracked("docs", "e2e_test", "scripts", "README.md"):
        p = REPO / f
        if not f or f.startswith("docs/validation/") or not p.is_file() \
                or p.suffix not in (".md", ".py", ".yaml", ".sh"):
            continue
        text = p.read_text()
        for m in index.CITATION.finditer(text):
            name = m.group(1).rstrip(".")
            if any(c.isupper() for c in name):               # a placeholder: NAME, LANE
                continue
            pattern = text[m.end():m.end() + 1] in ("*", "{")
            if not (any(r.startswith(name) for r in runs) if pattern else name in runs):
                missing.append(f"{f}: {name}")
    assert missing == []
    assert "nope-123" not in runs and index.citations(["docs/validation/nope-123"]) == \
        {"nope-123"}                                          # what the check would flag


def tracked_bytes(repo: Path, path: str) -> int:
    files = subprocess.run(["git", "ls-files", "-z", path], cwd=repo, capture_output=True,
                           text=True, check=True).stdout.split("\0")
    return sum((repo / f).stat().st_size for f in files if f and (repo / f).is_file())


def test_docs_tracked_size_is_under_8_mib(tmp_path):
    size = tracked_bytes(REPO, "docs")
    assert size < DOCS_LIMIT, f"docs/ tracks {size / 2**20:.1f} MiB"
    # negative control: a 9 MiB tracked file is counted
    repo = tmp_path / "r"
    (repo / "docs").mkdir(parents=True)
    (repo / "docs" / "big.bin").write_bytes(b"x" * (9 * 2**20))
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "docs"], cwd=repo, check=True)
    assert tracked_bytes(repo, "docs") >= DOCS_LIMIT


def test_a_junit_case_named_with_its_xdist_group_is_the_records_test(tmp_path):
    """Under --dist loadgroup the JUnit file names a case `...[tokenspeed-1]@tokenspeed/1`
    (an H100 run of e2e-1gpu-pd indexed 46 tests for its 23): the index takes it as
    the record's test. The control: a case with no record stays a test of its own."""
    (tmp_path / "junit-x.xml").write_text(
        '<testsuites><testsuite>'
        '<testcase classname="e2e_test.router.test_a" name="test_x[tokenspeed-1]@tokenspeed/1"'
        ' time="2.5"/>'
        '<testcase classname="e2e_test.router.test_a" name="test_y[a@b]" time="1"/>'
        '</testsuite></testsuites>')
    recs = [{"test": "e2e_test/router/test_a.py::test_x[tokenspeed-1]", "outcome": "passed"}]
    tests = index._tests(tmp_path, recs)
    assert [(t["id"], t["duration_s"]) for t in tests] == [
        ("e2e_test/router/test_a.py::test_x[tokenspeed-1]", 2.5),
        ("e2e_test/router/test_a.py::test_y[a@b]", 1.0)]
    assert index.plain_nodeid("t.py::f[x]@g") == "t.py::f[x]"
    assert index.plain_nodeid("t.py::f[x@y]") == "t.py::f[x@y]"
