"""Comments and docstrings say what and why, in the present tense: none under e2e_test/,
tests/ or scripts/ cites a commit SHA, a date, or "until" a date or a stop/session (history
lives in git log and docs/decisions.md). Comments are read through tokenize and docstrings
through ast, so a string the code uses (a record's folder name, a message) is not read."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("e2e_test", "tests", "scripts", "conftest.py")

# 7-40 lowercase hex digits holding at least one digit and one letter a-f, as a word
SHA = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
UNTIL = re.compile(r"\buntil\s+(?:20\d\d-\d\d-\d\d|(?:stop|session)\s+\d+)", re.IGNORECASE)
PATTERNS = (("commit SHA", SHA), ("date", DATE), ("until a date or stop", UNTIL))


def _docstrings(tree: ast.AST):
    """(first line, text) of every module, class and function docstring."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                yield body[0].value.lineno, body[0].value.value


def prose(source: str, shell: bool = False) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring line of a Python source, or of every
    comment of a shell script (from its first `#` not inside quotes: a whole-line comment or
    one after code)."""
    if shell:
        out = []
        for n, line in enumerate(source.splitlines(), 1):
            m = re.search(r"""(?:^|\s)(#.*)$""", line)
            if m and not (line.count("'", 0, m.start(1)) % 2 or line.count('"', 0, m.start(1)) % 2):
                out.append((n, m.group(1)))
        return out
    out = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
           if t.type == tokenize.COMMENT]
    for first, text in _docstrings(ast.parse(source)):
        out += [(first + i, line) for i, line in enumerate(text.split("\n"))]
    return sorted(out)


def history_hits(source: str, name: str, shell: bool = False) -> list[str]:
    """`name:line: what: text` for each comment or docstring line that cites history."""
    # Each comment and docstring line is a line of the source: a source none of the patterns
    # matches has no hit, and is not tokenized and parsed (most are not).
    if not any(pat.search(source) for _, pat in PATTERNS):
        return []
    hits = []
    for n, text in prose(source, shell):
        for what, pat in PATTERNS:
            m = pat.search(text)
            if m:
                hits.append(f"{name}:{n}: {what} {m.group(0)!r}: {text.strip()}")
    return hits


def _files():
    for entry in CHECKED:
        p = ROOT / entry
        if p.is_file():
            yield p
        else:
            yield from sorted(p.rglob("*.py"))
            yield from sorted(p.rglob("*.sh"))


def test_no_history_in_comments_or_docstrings():
    files = list(_files())
    assert len(files) > 100, f"found only {len(files)} files under {CHECKED}"
    hits = []
    for f in files:
        hits += history_hits(f.read_text(), str(f.relative_to(ROOT)), shell=f.suffix == ".sh")
    assert not hits, ("comments and docstrings cite history (say what and why; history goes "
                      "to git log or docs/decisions.md):\n" + "\n".join(hits))


SYNTHETIC = '''"""A module.

Measured on 2026-12-03, see below."""
X = "a string the code uses: run-44140a5, 2026-12-01"   # a value, not history


def f():
    """Nothing dated here."""
    return 1  # fixed at 9f29736


def g():
    # held until stop 38, then relaxed
    return "until 2026-12-05"
'''

CLEAN = '''"""A module whose prose says what and why."""
X = "run-44140a5"   # the record's folder (read from the string, not the comment)


def f():
    """Wait until the gateway is ready; a 0xfff mask and bf16 logits are not SHAs."""
    return 1  # 1e1p1d, deadbeef and 1234567 are not commit SHAs either
'''


def test_checker_finds_history_in_comments_and_docstrings():
    hits = history_hits(SYNTHETIC, "synthetic.py")
    assert [h.split(": ", 2)[:2] for h in hits] == [
        ["synthetic.py:3", "date '2026-12-03'"],
        ["synthetic.py:9", "commit SHA '9f29736'"],
        ["synthetic.py:13", "until a date or stop 'until stop 38'"],
    ], hits


def test_checker_finds_nothing_in_clean_source():
    assert history_hits(CLEAN, "clean.py") == []


def test_checker_reads_shell_comments_only():
    src = ('echo "build 2026-12-01"  # pinned at ac24287\n'
           "# until session 4\n"
           "X='#not a comment 5a89add'\n")
    hits = history_hits(src, "s.sh", shell=True)
    assert [h.split(": ", 2)[:2] for h in hits] == [
        ["s.sh:1", "commit SHA 'ac24287'"],
        ["s.sh:2", "until a date or stop 'until session 4'"]], hits
