"""docs/validation.md's "What has run" table, generated from the index (reports/index.py):
one row per lane × engine × device, its latest indexed run.

  python -m e2e_test report --table [INDEX]                    print the table
  python -m e2e_test report --table [INDEX] --out docs/validation.md   rewrite its table

The table sits between BEGIN and END in the page; tests/test_validation_index.py checks the
committed one is what the committed index gives.
"""

from __future__ import annotations

from pathlib import Path

from . import index

BEGIN = "<!-- BEGIN what-has-run: python -m e2e_test report --table --out docs/validation.md -->"
END = "<!-- END what-has-run -->"
HEAD = ("| lane | engine | device | latest run | date | SHA | passed / failed / skipped / error "
        "| wall | boot share |\n|---|---|---|---|---|---|---|---|---|")


def _cell(x) -> str:
    return "—" if x in (None, "") else str(x).replace("|", "/")


def latest(lines: list[dict]) -> list[dict]:
    """Per lane × engine × device, the latest run (by date, then name), sorted by lane,
    engine, device."""
    by: dict[tuple, dict] = {}
    for x in sorted(lines, key=lambda x: (index.date_key(x), x["run"])):
        by[(*index.lane_engine(x), x.get("device") or "?")] = x
    return [by[k] for k in sorted(by)]


def table(lines: list[dict], folder: Path) -> str:
    """The markdown table; a run whose folder is kept under `folder` links to it (the path
    as docs/validation.md sees it), else names its index line."""
    if not lines:
        raise ValueError("the index holds no run: no table")
    rows = [HEAD]
    for x in latest(lines):
        c = index.counts(x)
        t = x.get("time") or {}
        share = (t.get("share_pct") or {}).get("boot")
        run = (f"[{x['run']}](validation/{x['run']}/)" if (Path(folder) / x["run"]).is_dir()
               else f"{x['run']} (index line)")
        wall = x.get("wall_s")
        rows.append("| " + " | ".join(_cell(v) for v in (
            *index.lane_engine(x), x.get("device"), run, index.date_key(x) or None,
            (x.get("sha") or "")[:12] or None,
            f"{c['passed']} / {c['failed']} / {c['skipped']} / {c['error']}",
            f"{wall:.0f} s" if wall is not None else None,
            f"{share:.0f} %" if share is not None else None)) + " |")
    return "\n".join(rows)


def replace_block(text: str, block: str, where: str = "the page") -> str:
    """`text` with what lies between BEGIN and END replaced by `block`."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"{where} has no {BEGIN} ... {END} block to write the table into")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{block}\n{END}{tail}"


def block_of(text: str) -> str | None:
    if BEGIN not in text or END not in text:
        return None
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")
