"""The flake view: per test × engine × lane over the indexed runs (reports/index.py), how
often it passed and failed, the failure rate's 95 % Wilson score interval, and the last
failure's first line.

  python -m e2e_test report --flakes [INDEX] [--html] [--out F]

A skipped test counts as neither; an error (setup or teardown) counts as a failure. The
test id's parameters stay in it (`test_eval[vllm-1p1d-gsm8k]`), so each topology and eval
is its own row.
"""

from __future__ import annotations

from .html_report import _page, _table, esc, wilson
from .index import lane_engine

FAILED = ("failed", "error")


def rows(lines: list[dict]) -> list[dict]:
    """One row per (test, engine, lane) seen passing or failing, sorted by failures (most
    first), then by name. `last_failure`: the latest failing run (in index order) and its
    message's first line."""
    acc: dict[tuple, dict] = {}
    for line in lines:
        lane, run_engine = lane_engine(line)
        for t in line.get("tests") or []:
            if t["outcome"] not in ("passed", *FAILED):
                continue
            name = t["id"].split("::")[-1]
            key = (name, t.get("engine") or run_engine, lane)
            row = acc.setdefault(key, {"test": name, "engine": key[1], "lane": lane,
                                       "passed": 0, "failed": 0, "last_failure": None})
            if t["outcome"] == "passed":
                row["passed"] += 1
            else:
                row["failed"] += 1
                row["last_failure"] = {"run": line["run"], "message": t.get("message")}
    out = []
    for row in acc.values():
        lo, hi = wilson(row["failed"], row["passed"] + row["failed"])
        out.append(dict(row, rate_low=lo, rate_high=hi))
    return sorted(out, key=lambda r: (-r["failed"], r["test"], r["engine"], r["lane"]))


HEAD = ["test", "engine", "lane", "pass", "fail", "failure rate (95 % Wilson)", "last failure"]


def _cells(r: dict) -> list[str]:
    last = r["last_failure"]
    where = f"{last['run']}: {last['message'] or '(no message recorded)'}" if last else ""
    return [r["test"], r["engine"], r["lane"], str(r["passed"]), str(r["failed"]),
            (f"{r['failed'] / (r['passed'] + r['failed']):.2f} "
             f"[{r['rate_low']:.2f}, {r['rate_high']:.2f}]"), where]


def text(lines: list[dict]) -> str:
    """A plain-text table, columns padded to their widest cell (the last one free)."""
    rs = rows(lines)
    if not rs:
        raise ValueError("no indexed run holds a test that passed or failed: no flake view")
    table = [HEAD] + [_cells(r) for r in rs]
    widths = [max(len(row[i]) for row in table) for i in range(len(HEAD) - 1)]
    return "\n".join("  ".join([c.ljust(w) for c, w in zip(row, widths)] + [row[-1]]).rstrip()
                     for row in table)


def render(lines: list[dict], trend_href: str | None = None) -> str:
    rs = rows(lines)
    if not rs:
        raise ValueError("no indexed run holds a test that passed or failed: no flake view")
    body = ["<h1>Flake view</h1>",
            (f"<p class=\"meta\">{len(lines)} indexed runs; per test × engine × lane: "
             "passes, failures (an error at setup or teardown is one), the failure rate with "
             "its 95 % Wilson score interval, and the last failure's first line. Skips are not "
             "counted.</p>")]
    if trend_href:
        body.append(f"<p class=\"meta\"><a id=\"trend\" href=\"{esc(trend_href)}\">trend page"
                    "</a></p>")
    body.append(_table(HEAD, [[esc(c) for c in _cells(r)] for r in rs],
                       ["failed" if r["failed"] else None for r in rs]))
    return _page("e2e flake view", body)
