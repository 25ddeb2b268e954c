"""scripts/device_session.py and scripts/gpu_runs.sh, on this machine (no GPU: nothing reaches an
engine). The packing of what a device session carries into calls that fit, several lane runs
in one call through the real gpu_lane.sh (its bench mode, which refuses before any process
starts), and the publication of a recorded H200 run into the index."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("device_session",
                                               ROOT / "scripts" / "device_session.py")
ds = importlib.util.module_from_spec(_spec)
sys.modules["device_session"] = ds       # dataclasses look their module up
_spec.loader.exec_module(ds)
RUNS = ROOT / "scripts" / "gpu_runs.sh"
MiB = 2**20
RECORDED = ROOT / "docs" / "validation" / "h100-e2e-1gpu-pd-tokenspeed-pd-896a6a9"


# A fresh HOME (as .ci/run's clone runs) has no git identity: every commit here names one.
GIT_ENV = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}


def _git(repo, *args):
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True,
                          env=GIT_ENV)


def _file(p: Path, size: int) -> Path:
    """A file of `size` bytes, sparse: the packing reads sizes (st_size) only, and a session
    tree written out byte by byte was some 280 MB a test."""
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "wb") as f:
        f.truncate(size)
    return p


def _session_tree(repo: Path, parts=(50, 50, 30), tracked_mb=3) -> Path:
    """A scratch checkout with what `prepare` leaves: engine parts, wheels, datasets, GGUF."""
    _git(repo, "init", "-q")
    _file(repo / "docs" / "validation" / "run" / "big.bin", tracked_mb * MiB)
    _file(repo / "README.md", 100)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "init")
    ds.ensure_excludes(repo)
    names = [f"p{i}" for i in range(len(parts))]
    for n, mb in zip(names, parts):
        _file(repo / ".ts-stage" / n, mb * 1_000_000)
    (repo / ".ts-stage" / "manifest.json").write_text(json.dumps({"parts": names}))
    _file(repo / ".ts-stage" / "setup.sh", 5000)
    _file(repo / ".whl" / "smg-1.13.0-cp38-abi3-manylinux2014_x86_64.whl", 37_400_000)
    _file(repo / ".whl" / "py_spy-0.4.3-py2.py3-none-manylinux1_x86_64.whl", 2_800_000)
    _file(repo / ".carry" / "datasets" / "gsm8k" / "test.jsonl", 4_700_000)
    _file(repo / ".carry" / "datasets" / "mmlu" / "test.jsonl", 7_400_000)
    for i in range(2):
        _file(repo / ".carry" / "model" / f"model.gguf.part{i:02d}", 50_000_000 if i == 0 else 48_000_000)
    _file(repo / ".carry" / "model" / "gguf-0.19.0-py3-none-any.whl", 100_000)
    return repo


def test_every_item_is_carried_once_in_calls_that_fit(tmp_path):
    repo = _session_tree(tmp_path)
    tree = ds.tree_bytes(repo)
    assert 3 * MiB <= tree < 3 * MiB + 64 * 1024            # docs/validation travels, .carry not
    calls, space = ds.plan_calls(["tokenspeed"], repo)
    assert space == ds.CARRY_LIMIT - tree - ds.MARGIN
    carried = [p for c in calls for p in c.carry]
    items = ([f".ts-stage/p{i}" for i in range(3)] + [".carry/datasets"]
             + [f".whl/{p.name}" for p in (repo / ".whl").iterdir()]
             + [f".carry/model/{p.name}" for p in (repo / ".carry" / "model").iterdir()])
    assert sorted(set(carried) - {".ts-stage/setup.sh", ".ts-stage/manifest.json"}) == sorted(items)
    assert len(carried) == len(set(carried)) + 2 * 2       # setup.sh, manifest.json with each part
    for c in calls:
        assert c.size <= space and len(c.carry) <= ds.MAX_PATHS
        assert c.size == sum(ds.path_bytes(repo / p) for p in c.carry)
    # the parts in their order, one a call, each call's install after its copies
    assert [c.carry[0] for c in calls[:3]] == [".ts-stage/p0", ".ts-stage/p1", ".ts-stage/p2"]
    for c in calls[:3]:
        assert c.commands[-1] == "bash .ts-stage/setup.sh"
    assert "cp .whl/smg-1.13.0" in " ".join(c.command for c in calls)
    # 60 MiB of room: the parts leave 12.9, 12.9 and 32.9 MB; the GGUF's 50 and 48 MB parts
    # and the 37.4 MB smg wheel need calls of their own, the rest fills the gaps
    assert len(calls) == 6
    assert [c.size // 1_000_000 for c in calls[3:]] == [50, 48, 37]


def test_an_item_larger_than_a_call_is_an_error_not_a_refused_call(tmp_path):
    """With docs/validation's 48 MiB travelling, a 50 MB part cannot fit: said before any call
    (the device tool would refuse it, as it did three sessions running)."""
    repo = _session_tree(tmp_path, tracked_mb=20)
    with pytest.raises(ds.SessionError, match=r"\.ts-stage/p0 \(47\.7 MiB .*does not fit a "
                                              r"call's 43\.0 MiB of room: cut it smaller"):
        ds.plan_calls(["tokenspeed"], repo)


def test_the_carry_list_never_passes_eight_paths():
    small = [ds.Item(f"f{i}", 1000, f"cp f{i} /x") for i in range(11)]
    calls = ds.pack(small, 10 * MiB)
    assert [len(c.carry) for c in calls] == [8, 3]


def test_missing_parts_are_named(tmp_path):
    repo = _session_tree(tmp_path)
    (repo / ".ts-stage" / "p1").unlink()
    with pytest.raises(ds.SessionError, match=r"\.ts-stage: parts missing: p1"):
        ds.plan_calls(["tokenspeed"], repo)
    shutil.rmtree(repo / ".carry" / "model")
    (repo / ".ts-stage" / "p1").write_bytes(b"x")
    with pytest.raises(ds.SessionError, match="no GGUF parts"):
        ds.plan_calls(["tokenspeed"], repo)


def test_the_cli_has_no_detach_or_attach():
    """docs/validation travels with every call: nothing takes it out of the index."""
    assert not hasattr(ds, "detach") and not hasattr(ds, "attach")
    for cmd in ("detach", "attach"):
        with pytest.raises(SystemExit) as e:
            ds.main([cmd])
        assert e.value.code == 2


def _runs(tmp_path, *args, **env):
    e = {k: v for k, v in os.environ.items() if not k.startswith("E2E_")}
    stage = tmp_path / "env.sh"
    stage.write_text("export STAGED_MARK=1\n")
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text("{}")
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    e.update({"PATH": f"{Path(sys.executable).parent}:{e['PATH']}", "E2E_STAGE_ENV": str(stage),
              "E2E_MODEL_PATH": str(tmp_path / "model"), "E2E_DATASET_DIR": str(tmp_path),
              "E2E_BYTECODE": "0", "OUT": str(out), **env})
    return subprocess.run(["bash", str(RUNS), *args], cwd=tmp_path, env=e, capture_output=True,
                          text=True, timeout=300, check=False), out


@pytest.mark.parametrize("spec, says", [
    ("a b:e2e-1gpu-pd", "NAME must be letters"),
    ("a:", "no LANE"),
    ("a:e2e-1gpu-pd:PATH=/x", "'PATH=/x' is not VAR=VALUE with an E2E_"),
    ("a:e2e-1gpu-pd:E2E_X=1:more", "more than three"),
])
def test_a_bad_spec_stops_it_before_any_run(tmp_path, spec, says):
    r, out = _runs(tmp_path, "vllm", "ok:bench", spec)
    assert r.returncode == 2 and says in r.stderr, r.stderr
    assert not list(out.iterdir())                          # the good spec did not run either


def test_a_spec_may_give_its_run_pytest_options(tmp_path):
    """PYTEST_ADDOPTS in a spec: that run's pytest options (e.g. --e2e-shuffle);
    PATH=/x above is the negative control."""
    r, out = _runs(tmp_path, "vllm", "serial:bench:PYTEST_ADDOPTS=--e2e-shuffle=1",
                   "--", "--a", "1", "--b", "1")
    assert r.returncode == 1 and "gpu_runs: serial rc=" in r.stdout, r.stdout + r.stderr
    assert [p.name for p in out.iterdir()] == ["serial.tar.xz"]


def test_a_name_given_twice_is_refused(tmp_path):
    r, _out = _runs(tmp_path, "vllm", "a:bench", "a:bench")
    assert r.returncode == 2 and "'a' named twice" in r.stderr


def test_two_runs_in_one_call_each_in_one_file_with_its_own_variables(tmp_path):
    """The bench mode with A = B refuses in its own log before any process starts: each run
    goes through gpu_lane.sh, gets its own variables, and leaves NAME.tar.xz with the lane's
    log, what gpu_lane.sh printed and the spec; a failed run makes the call's exit 1."""
    r, out = _runs(tmp_path, "vllm", "one:bench:E2E_GIT_SHA=aaaaaaa",
                   "two:bench:E2E_GIT_SHA=bbbbbbb,E2E_LANE_LIMIT_S=100",
                   "--", "--a", "1", "--b", "1")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "gpu_lane: vllm bench sha aaaaaaa" in r.stdout and "sha bbbbbbb" in r.stdout
    assert "gpu_runs: two rc=" in r.stdout and "limit=100s" in r.stdout
    assert sorted(p.name for p in out.iterdir()) == ["one.tar.xz", "two.tar.xz"]
    with tarfile.open(out / "two.tar.xz") as t:
        names = t.getnames()
        log = t.extractfile("two/lane.log").read().decode()
        spec = t.extractfile("two/spec.txt").read().decode()
    assert {"two/driver.log", "two/lane.log", "two/spec.txt"} <= set(names)
    assert "A and B are both 1 asked as completions: nothing to compare" in log
    assert spec.strip() == "two:bench:E2E_GIT_SHA=bbbbbbb,E2E_LANE_LIMIT_S=100"


def test_a_run_that_would_outlast_the_call_is_not_started(tmp_path):
    r, out = _runs(tmp_path, "vllm", "late:bench", E2E_CALL_LIMIT_S="80")
    assert r.returncode == 1
    assert "gpu_runs: late skipped: 50s left of the call's 80s (at least 60s needed)" in r.stdout
    assert not list(out.iterdir())


def _packed_run(tmp_path, name="serial", tests=True) -> Path:
    """A recorded H200 run packed as gpu_runs.sh packs one: NAME/results/venv-ENGINE/ with
    clusters/ unpacked, NAME/lane.log beside."""
    src = tmp_path / "src" / name
    run = src / "results" / "venv-tokenspeed"
    shutil.copytree(RECORDED, run, ignore=shutil.ignore_patterns(
        "clusters.tar.xz", "note.json", "lane.log.xz", *([] if tests else ["tests"])))
    with tarfile.open(RECORDED / "clusters.tar.xz") as t:
        t.extractall(run, filter="data")
    (src / "lane.log").write_text("23 passed\n")
    f = tmp_path / f"{name}.tar.xz"
    with tarfile.open(f, "w:xz") as t:
        t.add(src, arcname=name)
    return f


def _publish_repo(tmp_path) -> Path:
    from e2e_test.infra.reports import validation_page as vp
    repo = tmp_path / "repo"
    (repo / "docs" / "validation").mkdir(parents=True)
    (repo / "docs" / "validation.md").write_text(
        f"# Validation\n\nprose\n\n{vp.BEGIN}\nold table\n{vp.END}\n\nmore prose\n")
    return repo


def test_publish_indexes_a_run_keeps_its_folder_and_rewrites_the_table(tmp_path):
    from e2e_test.infra.reports import index
    repo = _publish_repo(tmp_path)
    f = _packed_run(tmp_path)
    [dest] = ds.publish([f], "nvidia-h200 (1x H200)", "One H200 machine.", repo=repo,
                        log=lambda s: None)
    assert dest.name == "h200-e2e-1gpu-pd-tokenspeed-serial-896a6a9"
    assert (dest / "clusters.tar.xz").is_file() and not (dest / "clusters").exists()
    assert len(list((dest / "tests").glob("*.json"))) == 23
    assert all("\n" not in f.read_text() for f in (dest / "tests").glob("*.json"))
    note = json.loads((dest / "note.json").read_text())
    assert note["lane"] == "e2e-1gpu-pd (tokenspeed), serial"
    assert note["note"].startswith("One H200 machine. This run: serial. boots ")
    idx = repo / "docs" / "validation" / "index.jsonl"
    [line] = index.read(idx)
    assert line["run"] == dest.name and line["lane"] == "e2e-1gpu-pd"
    # the oracle records in the sidecar beside the index, not in its line
    assert json.loads(index.dumps(index.index_line(dest))) == line
    assert line["oracle_records"]
    assert "oracle_records" not in json.loads(idx.read_text())
    assert index.sidecar(idx).is_file()
    assert index.counts(line)["passed"] == 23 and index.green(line)
    md = (repo / "docs" / "validation.md").read_text()
    assert "old table" not in md and md.startswith("# Validation\n\nprose\n")
    assert f"[{dest.name}](validation/{dest.name}/)" in md and md.endswith("more prose\n")
    with pytest.raises(ds.SessionError, match="exists already"):
        ds.publish([f], "d", "n", repo=repo, log=lambda s: None)


def test_publish_keeps_one_folder_per_lane_and_engine(tmp_path):
    """A later green run of the same lane and engine takes the kept folder's place; the
    earlier one stays as its index line (negative control: the first publish kept it)."""
    from e2e_test.infra.reports import index
    repo = _publish_repo(tmp_path)
    [first] = ds.publish([_packed_run(tmp_path, "serial")], "d", "n", repo=repo,
                         log=lambda s: None)
    assert first.is_dir()
    run = json.loads((RECORDED / "run.json").read_text())
    f = _packed_run(tmp_path, "later")
    with tarfile.open(f) as t:                  # the same run, a minute later
        t.extractall(tmp_path / "x", filter="data")
    rj = tmp_path / "x" / "later" / "results" / "venv-tokenspeed" / "run.json"
    rj.write_text(json.dumps(dict(run, started="2099-01-01 00:00:00 UTC")))
    f.unlink()
    with tarfile.open(f, "w:xz") as t:
        t.add(tmp_path / "x" / "later", arcname="later")
    [second] = ds.publish([f], "d", "n", repo=repo, log=lambda s: None)
    assert second.is_dir() and not first.exists()
    runs = [x["run"] for x in index.read(repo / "docs" / "validation" / "index.jsonl")]
    assert runs == [first.name, second.name]


def test_publish_refuses_a_run_that_tested_nothing(tmp_path):
    repo = tmp_path / "repo"
    (repo / "docs" / "validation").mkdir(parents=True)
    f = _packed_run(tmp_path, "empty", tests=False)
    with pytest.raises(ds.SessionError, match="no test records under tests/"):
        ds.publish([f], "d", "n", repo=repo, log=lambda s: None)
    with pytest.raises(ds.SessionError, match="--note"):
        ds.publish([f], "d", " ", repo=repo, log=lambda s: None)
    assert not list((repo / "docs" / "validation").iterdir())       # no index line either


def test_the_tiny_vlm_is_the_epd_runs_model_only():
    """A call of several runs sets the VLM's path on its e2e-1gpu-epd spec alone: a call-wide
    E2E_MODEL_PATH (as the calls printed before) would run every other lane of the call on
    the VLM too (the control: the other specs are left as they are)."""
    assert ds.vlm_spec("epd:e2e-1gpu-epd") == "epd:e2e-1gpu-epd:E2E_MODEL_PATH=/root/tiny-vlm"
    assert ds.vlm_spec("e:e2e-1gpu-epd:E2E_ENFORCE_EAGER=1") == \
        "e:e2e-1gpu-epd:E2E_ENFORCE_EAGER=1,E2E_MODEL_PATH=/root/tiny-vlm"
    assert ds.vlm_spec("e:e2e-1gpu-epd:E2E_MODEL_PATH=/x") == "e:e2e-1gpu-epd:E2E_MODEL_PATH=/x"
    assert ds.vlm_spec("chat:e2e-1gpu-chat") == "chat:e2e-1gpu-chat"


def test_a_second_tokenspeed_version_runs_on_its_own_staged_site():
    """TokenSpeed 0.1.1's lane calls source the env file its setup.sh writes, not 0.1.0's
    (gpu_lane.sh's default); 0.1.0's and vLLM's calls set no E2E_STAGE_ENV (the control)."""
    new = ds.lane_command("tokenspeed-0.1.1", ["pd:e2e-1gpu-pd"], "abc1234")
    assert "E2E_STAGE_ENV=/root/stage/ts011-env.sh bash scripts/gpu_runs.sh tokenspeed pd:" in new
    for stage in ("tokenspeed", "vllm"):
        cmd = ds.lane_command(stage, ["pd:e2e-1gpu-pd"], "abc1234")
        assert "E2E_STAGE_ENV" not in cmd and f"gpu_runs.sh {stage} pd:e2e-1gpu-pd" in cmd
    assert ds.STAGES["tokenspeed-0.1.1"] in " ".join(ds.EXCLUDES)


def test_check_flags_refuses_a_flags_file_that_is_not_its_releases(tmp_path, monkeypatch):
    """prepare re-reads each TokenSpeed bundle's wheel (scripts/engine_flags.py --check): the
    committed flags file must be that release's, or prepare stops with the command that
    rewrites it."""
    import zipfile
    repo = tmp_path / "repo"
    (repo / "scripts" / "stage_profiles").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "engine_flags.py", repo / "scripts")
    wheel = tmp_path / "tokenspeed-9.9-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(ds.FLAG_SOURCE[1], "p.add_argument('--port', type=int)\n"
                                      "p.add_argument('--eager', action='store_true')\n")
    monkeypatch.setattr(ds, "_pip_download", lambda spec, dest, binary=True: wheel)
    flags = repo / "scripts" / "stage_profiles" / "tokenspeed-9.9.flags.json"
    subprocess.run([sys.executable, "scripts/engine_flags.py", str(wheel), ds.FLAG_SOURCE[1],
                    "--out", str(flags)], cwd=repo, check=True, capture_output=True)
    said = []
    ds.check_flags(repo, "tokenspeed-9.9", said.append)
    assert said == [f"prepare: engine_flags: {flags} matches {wheel.name} (2 flags)"]
    # negative control: a file with a flag the release lacks
    flags.write_text(flags.read_text().replace("--eager", "--skip-server-warmup"))
    with pytest.raises(ds.SessionError, match="is not tokenspeed-9.9-py3-none-any.whl's flags"):
        ds.check_flags(repo, "tokenspeed-9.9")
