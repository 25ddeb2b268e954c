"""scripts/engine_flags.py: an engine release's flags read from its source without importing
it, and what a parser with those flags refuses."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "engine_flags", Path(__file__).resolve().parent.parent / "scripts" / "engine_flags.py")
ef = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ef)

SOURCE = '''
import argparse
MODES = ("null", "prefill", "decode")
def add_cli_args(parser):
    parser.add_argument("model_path", nargs="?")
    parser.add_argument("--port", type=int)
    parser.add_argument("--mode", "--disagg-mode", choices=MODES)
    parser.add_argument("--backend", choices=["a", "b"])
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction)
    parser.add_argument("--sizes", type=int, nargs="+")
    parser.add_argument("--fp4", type=bool, nargs="?", const=True)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--cache-off", action="store_true")
'''


def test_extract_reads_every_form():
    f = ef.extract(SOURCE)
    assert sorted(f) == ["--backend", "--cache-off", "--disagg-mode", "--eager", "--fp4",
                         "--mode", "--no-prefix-caching", "--port", "--prefix-caching",
                         "--sizes"]
    assert f["--mode"] == f["--disagg-mode"] == {"value": True,
                                                 "choices": ["null", "prefill", "decode"]}
    assert f["--backend"]["choices"] == ["a", "b"]
    assert f["--eager"] == f["--no-prefix-caching"] == {"value": False, "choices": None}
    assert f["--fp4"]["value"] == "optional" and f["--sizes"]["value"] is True
    with pytest.raises(ef.FlagsError, match="no add_argument"):
        ef.extract("x = 1\n")


def test_refused_names_what_the_parser_would_refuse():
    f = ef.extract(SOURCE)
    ok = ["--port", "1", "--mode=decode", "--eager", "--sizes", "1", "2", "--fp4",
          "--no-prefix-caching", "--backend", "b", "--fp4", "0"]
    assert ef.refused(ok, f) == []
    assert ef.refused(["--skip-warmup", "--eager=1", "--mode", "encode", "--port"], f) == [
        "--skip-warmup: no such flag", "--eager: takes no value",
        "--mode encode: not one of null, prefill, decode", "--port: no value"]
    assert ef.refused(["--port", "--eager"], f) == ["--port: no value"]


def test_cli_writes_then_checks(tmp_path, capsys):
    import zipfile
    wheel = tmp_path / "eng-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("eng/args.py", SOURCE)
    out = tmp_path / "f.json"
    assert ef.main([str(wheel), "eng/args.py", "--out", str(out)]) == 0
    assert ef.main([str(wheel), "eng/args.py", "--check", str(out)]) == 0
    out.write_text(out.read_text().replace("--eager", "--eagre"))
    assert ef.main([str(wheel), "eng/args.py", "--check", str(out)]) == 1
    assert ef.main([str(wheel), "eng/nope.py", "--check", str(out)]) == 2
    assert "cannot read eng/nope.py" in capsys.readouterr().err
