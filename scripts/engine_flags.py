"""The command-line flags an engine release accepts, read from its wheel without importing it.

    python scripts/engine_flags.py WHEEL SOURCE --out FILE     write the flags file
    python scripts/engine_flags.py WHEEL SOURCE --check FILE   exit 1 where FILE differs

SOURCE is the module inside the wheel whose `add_argument` calls define the flags (TokenSpeed:
tokenspeed/runtime/utils/server_args.py; the gRPC servicer parses its argv with that module's
`prepare_server_args`, an ArgumentParser with allow_abbrev=False, so a flag is accepted only as
spelled there). The file holds each flag with whether it takes a value and its choices where
they are literal. The unit tests check every argv the harness builds against the files of the
staged releases (tests/test_engines_tokenspeed.py), so a flag a release refuses (argparse exit 2
at the worker's start, on the device) is found here; `scripts/device_session.py prepare`
re-reads each bundle's wheel with --check, so a file cannot drift from its release.

Read statically (ast): the engine's import needs CUDA and its kernels. An option string is every
literal starting with `--` in an `add_argument` call; `action=argparse.BooleanOptionalAction`
adds its `--no-` form; `choices` are kept where they are a literal list or tuple, or a name
bound to one at module level.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import zipfile
from pathlib import Path

NO_VALUE = {"store_true", "store_false", "store_const", "count", "help", "version",
            "BooleanOptionalAction"}


class FlagsError(Exception):
    pass


def _literal_strings(node, names: dict) -> list[str] | None:
    if isinstance(node, ast.Name) and node.id in names:
        node = names[node.id]
    if isinstance(node, (ast.List, ast.Tuple)) and all(isinstance(e, ast.Constant)
                                                       for e in node.elts):
        return [str(e.value) for e in node.elts]
    return None


def _action(call: ast.Call) -> str | None:
    for kw in call.keywords:
        if kw.arg == "action":
            v = kw.value
            if isinstance(v, ast.Constant):
                return str(v.value)
            if isinstance(v, ast.Attribute):
                return v.attr
            if isinstance(v, ast.Name):
                return v.id
    return None


def extract(source: str) -> dict[str, dict]:
    """{flag: {"value": True | False | "optional", "choices": [str] | None}} of every
    add_argument in source ("optional": nargs "?" or "*", a value only where one follows)."""
    tree = ast.parse(source)
    names = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign)
             for t in n.targets if isinstance(t, ast.Name)}
    out: dict[str, dict] = {}
    for call in ast.walk(tree):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                and call.func.attr == "add_argument"):
            continue
        opts = [a.value for a in call.args
                if isinstance(a, ast.Constant) and isinstance(a.value, str)
                and a.value.startswith("--")]
        action = _action(call)
        choices = next((_literal_strings(kw.value, names) for kw in call.keywords
                        if kw.arg == "choices"), None)
        nargs = next((kw.value.value for kw in call.keywords
                      if kw.arg == "nargs" and isinstance(kw.value, ast.Constant)), None)
        value = "optional" if nargs in ("?", "*") else action not in NO_VALUE
        for opt in opts:
            out[opt] = {"value": value, "choices": choices}
            if action == "BooleanOptionalAction":
                out["--no-" + opt[2:]] = {"value": False, "choices": None}
    if not out:
        raise FlagsError("no add_argument call with a --flag found")
    return dict(sorted(out.items()))


def read_wheel(wheel: Path, source: str) -> dict:
    try:
        with zipfile.ZipFile(wheel) as z:
            text = z.read(source).decode()
    except (OSError, KeyError, zipfile.BadZipFile) as e:
        raise FlagsError(f"{wheel}: cannot read {source} ({e})") from None
    return {"wheel": wheel.name, "source": source, "flags": extract(text)}


def refused(args: list[str], flags: dict[str, dict]) -> list[str]:
    """What a parser with these flags refuses in args (an engine's argv after its entry
    point): an unknown flag, a missing value, a value outside the flag's choices."""
    bad = []
    i = 0
    while i < len(args):
        tok = args[i]
        i += 1
        if not tok.startswith("--"):
            continue
        name, eq, val = tok.partition("=")
        f = flags.get(name)
        if f is None:
            bad.append(f"{name}: no such flag")
            continue
        if not f["value"]:
            if eq:
                bad.append(f"{name}: takes no value")
            continue
        if not eq:
            if i >= len(args) or args[i].startswith("--"):
                if f["value"] != "optional":
                    bad.append(f"{name}: no value")
                continue
            val = args[i]
            i += 1
        if f["choices"] is not None and val not in f["choices"]:
            bad.append(f"{name} {val}: not one of {', '.join(f['choices'])}")
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("wheel", type=Path)
    ap.add_argument("source")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--out", type=Path)
    g.add_argument("--check", type=Path)
    a = ap.parse_args(argv)
    try:
        got = read_wheel(a.wheel, a.source)
    except FlagsError as e:
        print(f"engine_flags: error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(got, indent=1, sort_keys=True) + "\n"
    if a.out:
        a.out.write_text(text)
        print(f"engine_flags: {len(got['flags'])} flags of {a.wheel.name} in {a.out}")
        return 0
    if not a.check.is_file() or a.check.read_text() != text:
        print(f"engine_flags: {a.check} is not {a.wheel.name}'s flags: rewrite it with "
              f"`python scripts/engine_flags.py {a.wheel} {a.source} --out {a.check}`",
              file=sys.stderr)
        return 1
    print(f"engine_flags: {a.check} matches {a.wheel.name} ({len(got['flags'])} flags)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
