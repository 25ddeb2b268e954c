"""The published runs as data: one JSON line per run in docs/validation/index.jsonl, and the
runs' oracle records beside it in docs/validation/oracle_records.jsonl.xz.

A line holds what the reports read across runs, so they need no run folder:
  run, lane, engine, device, sha, date, command, exit_code, wall_s, note
  tests          [{id, outcome, duration_s, engine, topology, message}] (message: a failing
                 test's first line)
  time           the time report's totals and shares (timing.json; null without one)
  oracle         each comparison verdict in the records: where it sits, ok, counts, bounds,
                 budget, rank tests ([] without any)
  trend          the trend page's values for this run (html_report.trend_points)
  proofs, bursts the disaggregation proofs' figures and each burst's counts, per test
  oracle_records the records' oracle inputs with their items, compacted (oracle_inputs), for
                 scripts/rejudge_oracle.py; rejudge: note.json's `rejudge` where it has one
A value the run did not record is null, never guessed. Lines are sorted-key JSON, so the
same folder always gives the same line.

`oracle_records` is most of a line's bytes and compresses some fortyfold, so index.jsonl holds
every key but it: the sidecar beside the index (SIDECAR) holds one line per run that has
records, {"run", "oracle_records"}, in publication order, xz-compressed; docs/ travels with
every device call and stays under 8 MiB. append writes both files; read merges the sidecar
back, so a line read is the line index_line gives.

  index_line(run_dir) -> dict     append(index, run_dir)     read(index) -> [dict]
"""

from __future__ import annotations

import json
import lzma
import os
import re
import shlex
import xml.etree.ElementTree as ET
from pathlib import Path

from ..verdicts import oracle as oracle_rule
from . import report

# A folder name's commit: seven or more hex digits between dashes
# (h200-e2e-1gpu-pd-vllm-SHA-serial).
_NAME_SHA = re.compile(r"(?:^|-)([0-9a-f]{7,40})(?=-|$)")
MESSAGE_CHARS = 200
GREEN = ("passed", "skipped")


def _json(p: Path) -> dict:
    return json.loads(p.read_text()) if p.is_file() else {}


def _first_line(text) -> str | None:
    if not text:
        return None
    line = next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")
    return line[:MESSAGE_CHARS] or None


def plain_nodeid(nodeid: str) -> str:
    """A node id without the `@group` pytest-xdist appends under --dist loadgroup (records,
    the JUnit file and the index name a test the same way with or without xdist). Pure."""
    at = nodeid.rfind("@")
    return nodeid[:at] if at > nodeid.rfind("]") else nodeid


def _junit(d: Path) -> dict[str, dict]:
    """test id (as the records name it) -> {outcome, duration_s, message} from junit*.xml."""
    out: dict[str, dict] = {}
    for f in sorted(d.glob("junit*.xml")):
        for case in ET.parse(f).getroot().iter("testcase"):
            cls, name = case.get("classname", ""), case.get("name", "")
            tid = plain_nodeid(f"{cls.replace('.', '/')}.py::{name}" if cls else name)
            outcome, message = "passed", None
            for tag, what in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
                el = case.find(tag)
                if el is not None:
                    outcome = what
                    message = _first_line(el.get("message") or el.text)
                    break
            out[tid] = {"outcome": outcome, "message": message,
                        "duration_s": round(float(case.get("time") or 0), 3)}
    return out


def _tests(d: Path, records: list[dict]) -> list[dict]:
    """Per test: the junit outcome where there is one (it sees setup and teardown errors the
    record cannot), else the record's; the duration from junit, else null."""
    junit = _junit(d)
    out = []
    for r in records:
        j = junit.pop(r["test"], {})
        outcome = j.get("outcome") or r.get("outcome")
        message = None
        if outcome not in GREEN:
            message = (_first_line(r.get("error")) or _first_line(r.get("message"))
                       or _first_line(r.get("fail_message")) or j.get("message"))
        out.append({"id": r["test"], "outcome": outcome, "duration_s": j.get("duration_s"),
                    "engine": r.get("engine"), "topology": r.get("topology"),
                    "message": message})
    for tid, j in junit.items():             # a test that left no record (setup error)
        out.append({"id": tid, "outcome": j["outcome"], "duration_s": j["duration_s"],
                    "engine": None, "topology": None,
                    "message": j["message"] if j["outcome"] not in GREEN else None})
    return sorted(out, key=lambda t: t["id"])


TIME_KEYS = ("wall_s", "boots", "boot_s", "traffic_s", "teardown_s", "idle_s", "share_pct",
             "boot_waited_s", "boot_waited_pct", "headline")


def _time(d: Path) -> dict | None:
    rep = _json(d / "timing.json")
    return {k: rep.get(k) for k in TIME_KEYS} if rep else None


def _verdicts(rec, path: str = ""):
    """(path, verdict dict) for every oracle.Verdict.to_dict() inside a record."""
    if isinstance(rec, dict):
        if "comparison" in rec and "numerics_budget" in rec:
            yield path, rec
            return
        for k, v in rec.items():
            yield from _verdicts(v, f"{path}.{k}" if path else k)
    elif isinstance(rec, list):
        for i, v in enumerate(rec):
            yield from _verdicts(v, f"{path}[{i}]")


def _verdict_summary(test: str, path: str, v: dict) -> dict:
    cmp = v.get("comparison") or {}
    th = v.get("thresholds") or {}
    rank = v.get("first_step_rank_test") or {}
    path_rank = v.get("path_rank_test") or {}
    return {"test": test, "at": path, "ok": v.get("ok"), "message": _first_line(v.get("message")),
            "name": cmp.get("name"), "a": cmp.get("a"), "b": cmp.get("b"),
            "counts": cmp.get("counts"), "compared": cmp.get("compared"),
            "numerics_budget": v.get("numerics_budget"),
            "first_step_max": th.get("first_step_max"), "gap_max": th.get("gap_max"),
            "max_first_step_delta": cmp.get("max_first_step_delta"),
            "max_numerics_gap": cmp.get("max_numerics_gap"),
            "rank_p": rank.get("p"), "path_rank_p": path_rank.get("p")}


def _oracle(records: list[dict]) -> list[dict]:
    out, seen = [], set()
    for r in records:
        for path, v in _verdicts({k: x for k, x in r.items() if k != "test"}):
            s = _verdict_summary(r["test"], path, v)
            key = json.dumps({k: x for k, x in s.items() if k != "at"}, sort_keys=True)
            if key not in seen:          # `oracle` repeats the test's own verdict
                seen.add(key)
                out.append(s)
    return out


# An oracle item in the index: a list in this order, trailing empties left out (the field
# names would be most of its bytes). expand_item reads it back.
ITEM_FIELDS = ("index", "verdict", "divergence", "first_step_delta", "max_step_delta", "gap",
               "position", "tokens", "compared", "text_only", "reason")


def compact_item(item: dict) -> list:
    """An oracle item with what re-judging reads (oracle.ItemVerdict.from_dict, classify):
    the reason only where classify keeps it (an error, a structural divergence), the
    divergence explicit (from_dict reads it before the reason). ItemVerdict.from_dict(
    expand_item(compact_item(d))) judges as ItemVerdict.from_dict(d)."""
    iv = oracle_rule.ItemVerdict.from_dict(item)
    d = iv.to_dict()
    if not (iv.verdict == "error" or iv.divergence in oracle_rule.STRUCTURAL):
        d["reason"] = None
    d["divergence"] = iv.divergence
    row = [None if k in ("compared", "text_only", "reason") and not d[k] else d[k]
           for k in ITEM_FIELDS]                # their defaults: 0, 0, ""
    while row and row[-1] is None:
        row.pop()
    return row


def expand_item(row: list | dict) -> dict:
    """A compacted item (compact_item) as the record's dict; a dict is returned as it is."""
    if isinstance(row, dict):
        return row
    d = dict(zip(ITEM_FIELDS, row))
    return {"divergence": None, **{k: v for k, v in d.items() if v is not None}}


def _expand_cmp(c):
    if not isinstance(c, dict) or "items" not in c:
        return c
    return dict(c, items=[expand_item(i) for i in c["items"]])


def _expand_arm(a):
    if not isinstance(a, dict) or not a.get("items"):
        return a
    return dict(a, items=[[expand_item(i) for i in items] for items in a["items"]])


def _expand_path(a):
    if not isinstance(a, dict):
        return a
    return dict(a, comparisons=[_expand_cmp(c) for c in a.get("comparisons", [])])


def expand_record(r: dict) -> dict:
    """An index line's oracle record (oracle_inputs) with its items as dicts again: the
    shape of a tests/*.json record, for scripts/rejudge_oracle.py."""
    out = dict(r)
    if "oracle_control" in r:
        out["oracle_control"] = {k: _expand_arm(v) for k, v in r["oracle_control"].items()}
    if "oracle_path_arm" in r:
        out["oracle_path_arm"] = {k: _expand_path(v) for k, v in r["oracle_path_arm"].items()}
    if "pd_vs_regular" in r:
        out["pd_vs_regular"] = {k: {"comparison": _expand_cmp(v["comparison"])}
                                for k, v in r["pd_vs_regular"].items()}
    if "oracle_negative_control" in r:
        out["oracle_negative_control"] = {
            "comparison": _expand_cmp(r["oracle_negative_control"]["comparison"])}
    if "kv_recall" in r:
        kv = r["kv_recall"]
        out["kv_recall"] = {
            **({"control": _expand_arm(kv["control"])} if "control" in kv else {}),
            **({"path_arm": _expand_path(kv["path_arm"])} if "path_arm" in kv else {}),
            **({"oracle": {"comparison": _expand_cmp(kv["oracle"]["comparison"])}}
               if "oracle" in kv else {})}
    if "oracle_dp" in r:
        out["oracle_dp"] = {k: [{"comparison": _expand_cmp(v["comparison"])} for v in vs]
                            for k, vs in r["oracle_dp"].items()}
    if "oracle_perturbed" in r:
        pert = r["oracle_perturbed"]
        out["oracle_perturbed"] = dict(pert, verdict={
            "comparison": _expand_cmp(pert["verdict"]["comparison"])})
    return out


def _cmp(c: dict | None) -> dict | None:
    if not isinstance(c, dict) or "items" not in c:
        return c
    return {"name": c["name"], "a": c["a"], "b": c["b"],
            "max_first_step_delta": c.get("max_first_step_delta"),
            "items": [compact_item(i) for i in c["items"]]}


def _arm(a: dict | None) -> dict | None:
    """A control arm record (ControlArm.to_dict): the comparisons' names and their items."""
    if not isinstance(a, dict) or not a.get("items"):
        return a if not isinstance(a, dict) else {k: v for k, v in a.items() if k != "items"}
    return {"comparisons": [{"name": c["name"], "a": c["a"], "b": c["b"]}
                            for c in a["comparisons"]],
            "items": [[compact_item(i) for i in items] for items in a["items"]]}


def _path_arm(a: dict | None) -> dict | None:
    if not isinstance(a, dict):
        return a
    return dict(a, comparisons=[_cmp(c) for c in a.get("comparisons", [])])


def oracle_inputs(r: dict) -> dict | None:
    """The keys of a record scripts/rejudge_oracle.py reads, items compacted; None where the
    record holds none."""
    out: dict = {}
    if r.get("oracle_control"):
        out["oracle_control"] = {k: _arm(v) for k, v in r["oracle_control"].items()}
    if r.get("oracle_path_arm"):
        out["oracle_path_arm"] = {k: _path_arm(v) for k, v in r["oracle_path_arm"].items()}
    if r.get("pd_vs_regular"):
        out["pd_vs_regular"] = {k: {"comparison": _cmp(v.get("comparison"))}
                                for k, v in r["pd_vs_regular"].items()}
    if r.get("oracle_negative_control"):
        out["oracle_negative_control"] = {
            "comparison": _cmp(r["oracle_negative_control"].get("comparison"))}
    kv = r.get("kv_recall")
    if isinstance(kv, dict):
        slim = {}
        if isinstance(kv.get("control"), dict):
            slim["control"] = _arm(kv["control"])
        if isinstance(kv.get("path_arm"), dict):
            slim["path_arm"] = _path_arm(kv["path_arm"])
        if isinstance(kv.get("oracle"), dict):
            slim["oracle"] = {"comparison": _cmp(kv["oracle"].get("comparison"))}
        if slim:
            out["kv_recall"] = slim
    if r.get("oracle_dp"):
        out["oracle_dp"] = {k: [{"comparison": _cmp(v.get("comparison"))} for v in vs]
                            for k, vs in r["oracle_dp"].items()}
    pert = r.get("oracle_perturbed")
    if isinstance(pert, dict) and isinstance(pert.get("verdict"), dict):
        out["oracle_perturbed"] = {"eps": pert.get("eps"), "seed": pert.get("seed"), "verdict": {
            "comparison": _cmp(pert["verdict"].get("comparison"))}}
    if not out:
        return None
    return {"test": r.get("test"), "engine": r.get("engine"), **out}


_PROOF = re.compile(r".+_proof(_negative_control)?")
BURST_KEYS = ("name", "n", "ok", "status_counts", "admission")


def _proofs(records: list[dict]) -> dict:
    """{test id: {key: value}} for every disaggregation proof a record holds (pd_proof,
    epd_proof, afd_ffn_proof and their negative controls): the figures the exact proofs are
    held to (tests/test_proof_exact.py)."""
    out = {}
    for r in records:
        got = {k: v for k, v in r.items() if _PROOF.fullmatch(k) and v}
        if got:
            out[r["test"]] = got
    return out


def _bursts(records: list[dict]) -> dict:
    """{test id: [burst]}: each burst's name, size, successes, status counts and the
    gateway's admission limits."""
    out = {}
    for r in records:
        bs = [{k: b.get(k) for k in BURST_KEYS} for b in (r.get("bursts") or {}).values()]
        if bs:
            out[r["test"]] = bs
    return out


def _sha(run: dict, summary: dict, name: str) -> str | None:
    if run.get("git_sha"):
        return run["git_sha"]
    m = _NAME_SHA.findall(name)
    if m:
        return m[-1]
    return summary.get("git_sha")


def _engine(run: dict, records: list[dict], note_lane: str | None) -> str | None:
    if run.get("engines"):
        return run["engines"]
    engines = sorted({r["engine"] for r in records if r.get("engine")})
    if engines:
        return "+".join(engines)
    m = re.search(r"\((\w+)\)", note_lane or "")
    return m.group(1) if m else None


def _lane(run: dict, note_lane: str | None) -> str | None:
    """The lane's name as the lane runner wrote it; a note's `e2e-1gpu-pd (vllm), ...`: its
    first word where that is a lane's name; else the text recorded."""
    if run.get("engines") and run.get("lane"):
        return run["lane"]
    text = run.get("lane") or note_lane
    if not text:
        return None
    first = text.split()[0].rstrip(",:")
    return first if re.fullmatch(r"e2e-[\w-]+", first) else text


def index_line(run_dir: Path) -> dict:
    d = Path(run_dir)
    loaded = report.load_results(d) if report.has_results(d) else {
        "dir": d, "run": {}, "summary": {}, "tests": []}
    own_run = _json(d / "run.json")          # what the lane wrote, before note.json filled it
    note = _json(d / "note.json")
    run, s, records = loaded["run"], loaded["summary"], loaded["tests"]
    argv = own_run.get("command") or own_run.get("argv") or s.get("argv")
    if isinstance(argv, list):
        argv = shlex.join(str(a) for a in argv)
    from .html_report import trend_points
    return {
        "run": d.name,
        "lane": _lane(own_run, note.get("lane")),
        "engine": _engine(own_run, records, note.get("lane")),
        # the publisher's words for the machine (note.json) name it alike across runs
        "device": note.get("device") or run.get("device") or None,
        "sha": _sha(own_run, s, d.name),
        "date": own_run.get("started") or run.get("date") or s.get("finished") or None,
        "command": argv or None,
        "exit_code": own_run.get("exit_code"),
        "wall_s": own_run.get("wall_s") if own_run.get("wall_s") is not None
        else s.get("wall_s"),
        "note": run.get("note") or None,
        "tests": _tests(d, records),
        "time": _time(d),
        "oracle": _oracle(records),
        "proofs": _proofs(records),
        "bursts": _bursts(records),
        "trend": trend_points(loaded),
        "oracle_records": [x for x in (oracle_inputs(r) for r in records) if x],
        "rejudge": note.get("rejudge"),
    }


def dumps(line: dict) -> str:
    return json.dumps(line, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


SIDECAR = "oracle_records.jsonl.xz"
RECORDS = "oracle_records"
# xz's strongest preset: about 0.5 s to rewrite 2 MB of records on publish, a tenth smaller
# than the default preset; lzma.compress gives the same bytes for the same content.
XZ_PRESET = 9 | lzma.PRESET_EXTREME


def sidecar(index: Path) -> Path:
    """The oracle records' file beside an index."""
    return Path(index).with_name(SIDECAR)


def _run_lines(text: str, where) -> list[dict]:
    """Each non-blank line of `text` as a JSON object with a `run` key; one that is not is an
    error naming `where` and the line."""
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{where}:{i}: not JSON ({e})") from None
        if not isinstance(obj, dict) or "run" not in obj:
            raise ValueError(f"{where}:{i}: not a run line (no `run` key)")
        out.append(obj)
    return out


def _sidecar_text(path: Path) -> str:
    """The sidecar's lines as text; empty where there is no sidecar."""
    if not path.is_file():
        return ""
    try:
        return lzma.decompress(path.read_bytes()).decode()
    except (lzma.LZMAError, EOFError) as e:
        raise ValueError(f"{path}: not an xz file ({e})") from None


def _records(path: Path) -> dict[str, list]:
    """run -> its oracle records, from the sidecar; a run named twice is an error."""
    out: dict[str, list] = {}
    for e in _run_lines(_sidecar_text(path), path):
        if e["run"] in out:
            raise ValueError(f"{path}: {e['run']} is named twice")
        out[e["run"]] = e.get(RECORDS) or []
    return out


def read(index: Path) -> list[dict]:
    """The index's lines, in file order (publication order), each with its `oracle_records`
    from the sidecar ([] where it has none; a line that holds the key itself keeps it). A
    line that is not a JSON object, a run with records both in its line and in the sidecar,
    and a sidecar entry for a run the index lacks are errors naming them."""
    lines = _run_lines(Path(index).read_text(), index)
    side = sidecar(index)
    records = _records(side)
    unknown = sorted(records.keys() - {x["run"] for x in lines})
    if unknown:
        raise ValueError(f"{side}: {unknown[0]} is not a run of {index}")
    out = []
    for x in lines:
        if RECORDS in x and x["run"] in records:
            raise ValueError(f"{index}: {x['run']} has oracle records in its line and in {side}")
        own = x.get(RECORDS) or []
        out.append(dict(sorted({**x, RECORDS: records.get(x["run"], own)}.items())))
    return out


def _write_xz(path: Path, text: str) -> None:
    """The whole file, compressed, replaced at once (a reader never sees half of it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(lzma.compress(text.encode(), preset=XZ_PRESET))
    os.replace(tmp, path)


def append(index: Path, run_dir: Path) -> dict:
    """Add run_dir's line to the index, its oracle records (where it has any) to the sidecar;
    a run already indexed, or already in the sidecar, is an error and nothing is written.
    Returns the line as read gives it."""
    index = Path(index)
    side = sidecar(index)
    line = index_line(run_dir)
    if index.is_file() and any(x["run"] == line["run"]
                               for x in _run_lines(index.read_text(), index)):
        raise ValueError(f"{index}: {line['run']} is indexed already")
    text = _sidecar_text(side)
    if any(e["run"] == line["run"] for e in _run_lines(text, side)):
        raise ValueError(f"{side}: {line['run']} has oracle records there already")
    # the sidecar first: a failure between the two writes leaves an entry read() names as
    # unknown, never a line read without its records
    if line[RECORDS]:
        _write_xz(side, text + dumps({"run": line["run"], RECORDS: line[RECORDS]}) + "\n")
    with index.open("a") as f:
        f.write(dumps({k: v for k, v in line.items() if k != RECORDS}) + "\n")
    return line


def counts(line: dict) -> dict[str, int]:
    out = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    for t in line.get("tests") or []:
        out[t["outcome"]] = out.get(t["outcome"], 0) + 1
    return out


def green(line: dict) -> bool:
    """Every test passed or skipped, at least one passed, and the lane exited 0 (or did not
    say)."""
    c = counts(line)
    return (c["passed"] > 0 and not any(n for o, n in c.items() if o not in GREEN)
            and line.get("exit_code") in (0, None))


def lane_engine(line: dict) -> tuple[str, str]:
    return (line.get("lane") or "?", line.get("engine") or "?")


def date_key(line: dict) -> str:
    """A sortable form of the recorded date (`YYYY-MM-DD hh:mm:ss UTC`, `YYYY-MM-DDThh:mm:ssZ`,
    `YYYY-MM-DD hh:mm UTC`): its minute; no date sorts first."""
    return (line.get("date") or "").replace("T", " ")[:16]


def kept(lines: list[dict], cited: set[str] = frozenset()) -> set[str]:
    """The runs whose folders stay beside the index: per lane × engine the latest green run,
    and every run that `cited` names (docs, code, tests cite a folder by name: a run with
    another selection of the same lane, or a failure a document reads from)."""
    groups: dict[tuple, list[dict]] = {}
    for x in lines:
        groups.setdefault(lane_engine(x), []).append(x)
    out = {x["run"] for x in lines if x["run"] in cited}
    for runs in groups.values():
        runs = sorted(runs, key=lambda x: (date_key(x), x["run"]))
        pick = [x for x in runs if green(x)]
        if pick:
            out.add(pick[-1]["run"])
    return out


def prune(folder: Path, lines: list[dict], cited: set[str] = frozenset()) -> list[Path]:
    """Remove the run folders under `folder` that are indexed but not kept (kept()); a
    folder the index does not hold is never removed. Returns what was removed."""
    import shutil
    keep = kept(lines, cited)
    indexed = {x["run"] for x in lines}
    gone = []
    for d in sorted(Path(folder).iterdir()):
        if d.is_dir() and d.name in indexed and d.name not in keep:
            shutil.rmtree(d)
            gone.append(d)
    return gone


CITATION = re.compile(r"docs/validation/([A-Za-z0-9_.-]+)")


def citations(texts) -> set[str]:
    """Run folder names cited as docs/validation/NAME in the given texts."""
    return {m.group(1).rstrip(".") for t in texts for m in CITATION.finditer(t)}


# The committed index of this checkout (the reports' default input).
COMMITTED = Path(__file__).resolve().parents[3] / "docs" / "validation" / "index.jsonl"
