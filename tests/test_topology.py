"""Topology strings -> Topology data, and one-line ConfigErrors for bad strings."""

import pytest

from e2e_test.infra.errors import ConfigError
from e2e_test.infra.specs.topology import RoleGroup, parse

R = RoleGroup


def roles(text: str):
    return parse(text).roles


def one_line_error(text: str) -> str:
    with pytest.raises(ConfigError) as ei:
        parse(text)
    msg = str(ei.value)
    assert "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("text,kind,expected", [
    ("1", "regular", (R("worker", 1),)),
    ("dp2", "dp", (R("worker", 2),)),
    ("dp2-engine", "dp", (R("worker", 1, dp=2),)),
    ("1p1d", "pd", (R("prefill", 1), R("decode", 1))),
    ("2p1d", "pd", (R("prefill", 2), R("decode", 1))),
    ("1e1p1d", "epd", (R("encode", 1), R("prefill", 1), R("decode", 1))),
    ("1e2p1d", "epd", (R("encode", 1), R("prefill", 2), R("decode", 1))),
    ("2e1p1d", "epd", (R("encode", 2), R("prefill", 1), R("decode", 1))),
    ("1e1p2d", "epd", (R("encode", 1), R("prefill", 1), R("decode", 2))),
    ("1a1f", "afd", (R("attention", 1, dp=1), R("ffn", 1, dp=1))),
    ("2a2f", "afd", (R("attention", 1, dp=2), R("ffn", 1, dp=2))),
    ("4a4f", "afd", (R("attention", 1, dp=4), R("ffn", 1, dp=4))),
    ("native-dp4", "afd", (R("worker", 1, dp=4),)),
])
def test_parse(text, kind, expected):
    t = parse(text)
    assert t.kind == kind
    assert t.roles == expected
    assert t.name == text and str(t) == text


def test_counts_and_flags():
    t = parse("dp2")
    assert (t.num_workers, t.num_devices, t.engine_dp, t.native_baseline) == (2, 2, False, False)
    t = parse("dp2-engine")
    assert (t.num_workers, t.num_devices, t.engine_dp) == (1, 2, True)
    t = parse("1e2p1d")
    assert (t.num_workers, t.num_devices) == (4, 4)
    t = parse("4a4f")
    assert (t.num_workers, t.num_devices) == (2, 8)
    t = parse("native-dp4")
    assert (t.num_workers, t.num_devices, t.native_baseline) == (1, 4, True)
    assert parse("1p1d").group("decode") == R("decode", 1)
    assert parse("1p1d").group("encode") is None


def test_parse_normalises_and_accepts_topology():
    t = parse(" 1P1D ")
    assert t.name == "1p1d" and t.kind == "pd"
    assert parse(t) is t


def test_options_every_role():
    t = parse("1p1d,tp=2")
    assert t.roles == (R("prefill", 1, tp=2), R("decode", 1, tp=2))
    assert t.num_devices == 4
    assert t.name == "1p1d,tp=2"


def test_options_one_role():
    assert roles("1p1d,p.tp=2") == (R("prefill", 1, tp=2), R("decode", 1))
    assert roles("1p1d,d.dp=2") == (R("prefill", 1), R("decode", 1, dp=2))
    assert roles("1p1d,prefill.tp=2,decode.tp=4") == (R("prefill", 1, tp=2),
                                                      R("decode", 1, tp=4))
    assert roles("1,w.tp=2") == (R("worker", 1, tp=2),)
    assert parse("1p1d,d.dp=2").num_devices == 3


@pytest.mark.parametrize("text,expected", [
    ("garbage", "bad topology 'garbage': expected 1, dpN"),
    ("", "topology must be a non-empty string"),
    ("2", "bad topology '2'"),
    ("1p", "bad topology '1p'"),
    ("0p1d", "topology '0p1d': prefill count 0 must be 1..64"),
    ("1p0d", "topology '1p0d': decode count 0 must be 1..64"),
    ("0e1p1d", "encode count 0"),
    ("65p1d", "prefill count 65 must be 1..64"),
    ("dp1", "topology 'dp1': dp needs at least 2 (use `1` for one worker)"),
    ("dp0", "dp count 0 must be 1..64"),
    ("3a2f", "topology '3a2f': AFD needs attention ranks (3) to be a multiple of FFN ranks (2)"),
    ("1a2f", "AFD needs attention ranks (1) to be a multiple of FFN ranks (2)"),
    ("1p1d,tp2", "topology '1p1d,tp2': bad option 'tp2' (use tp=K, ROLE.tp=K or ROLE.node=K)"),
    ("1p1d,pp=2", "bad option 'pp=2'"),
    ("1p1d,p.node=x", "bad option 'p.node=x'"),
    ("1p1d,p.node=999", "node=999 must be 0..255"),
    ("1p1d,e.node=1", "no 'encode' role in pd"),
    ("1p1d,tp=3", "tp=3 must be 1, 2, 4, 8 or 16"),
    ("1p1d,tp=0", "tp=0 must be 1, 2, 4, 8 or 16"),
    ("1p1d,x.tp=2", ("topology '1p1d,x.tp=2': unknown role 'x' (roles: worker, encode, "
                     "prefill, decode, attention, ffn)")),
    ("1p1d,e.tp=2", "topology '1p1d,e.tp=2': no 'encode' role in pd"),
    ("1,a.tp=2", "no 'attention' role in regular"),
])
def test_errors_are_one_line(text, expected):
    assert expected in one_line_error(text)


def test_non_string():
    with pytest.raises(ConfigError, match="non-empty string"):
        parse(None)


def test_check_engine():
    """Which engine builds which kind: the engine registry (engines.for_topology)."""
    from e2e_test.infra.engines import for_topology
    assert for_topology("vllm", parse("2a2f")).name == "afd"
    assert for_topology("vllm", parse("1p1d")).name == "vllm"
    for_topology("tokenspeed", parse("1e1p1d"))
    for_topology("vllm", parse("2a2f"))
    for_topology("vllm", parse("1p1d"))
    for_topology("tokenspeed", parse("1p1d"))
    with pytest.raises(ConfigError) as ei:
        for_topology("vllm", parse("1e1p1d"))
    assert str(ei.value) == ("topology '1e1p1d' (epd) cannot run on engine 'vllm': "
                             "only tokenspeed")
    with pytest.raises(ConfigError) as ei:
        for_topology("tokenspeed", parse("2a2f"))
    assert str(ei.value) == "topology '2a2f' (afd) cannot run on engine 'tokenspeed': only vllm"
    with pytest.raises(ConfigError, match="only vllm"):
        for_topology("tokenspeed", parse("native-dp4"))


# -- lists of topologies (--topology, E2E_TOPOLOGIES): options stay with their topology ---------

@pytest.mark.parametrize("text,expected", [
    ("1,dp2,1p1d", ["1", "dp2", "1p1d"]),
    ("1p1d,p.node=0,d.node=1", ["1p1d,p.node=0,d.node=1"]),
    ("1,1p1d,p.tp=2", ["1", "1p1d,p.tp=2"]),
    ("1p1d,p.tp=2,1", ["1p1d,p.tp=2", "1"]),
    ("1p1d,tp=2;1", ["1p1d,tp=2", "1"]),
    ("1p1d,p.tp=2; 1p1d,d.node=1", ["1p1d,p.tp=2", "1p1d,d.node=1"]),
    (" 1 , dp2 ,", ["1", "dp2"]),
    ("", []),
])
def test_split_list(text, expected):
    from e2e_test.infra.specs.topology import split_list
    assert split_list(text) == expected
    for t in expected:
        parse(t)


def test_split_list_option_first_is_one_line():
    from e2e_test.infra.specs.topology import split_list
    with pytest.raises(ConfigError) as ei:
        split_list("p.node=0,1p1d")
    assert "option 'p.node=0' follows no topology" in str(ei.value)


def test_settings_read_topologies_with_options():
    from e2e_test.infra.specs import settings
    assert settings.get("E2E_TOPOLOGIES", {"E2E_TOPOLOGIES": "1,1p1d,p.tp=2"}) == \
        ("1", "1p1d,p.tp=2")
    assert settings.get("E2E_TOPOLOGIES", {"E2E_TOPOLOGIES": "1p1d,p.node=0,d.node=1"}) == \
        ("1p1d,p.node=0,d.node=1",)


def test_multinode_doc_command_collects_as_written(tmp_path):
    """docs/multinode.md's pytest command, run as written (collection only: nothing starts),
    parametrizes over `1p1d,p.node=0,d.node=1` instead of exiting 2 on `p.node=0`."""
    import os
    import re
    import shlex
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parents[1]
    doc = (repo / "docs" / "multinode.md").read_text()
    m = re.search(r"^(E2E_RAY_ADDRESS=auto \.venv/bin/python -m pytest .*?)$\n^\s+(--launcher .*)$",
                  doc, re.M)
    assert m, "the multi-node pytest command moved in docs/multinode.md"
    words = shlex.split(m.group(1).rstrip("\\") + " " + m.group(2))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("E2E_", "AFD_"))}
    env.update(w.split("=", 1) for w in words if re.match(r"^[A-Z][A-Z0-9_]*=", w))
    env["E2E_RESULTS_DIR"] = str(tmp_path)
    argv = [w for w in words if not re.match(r"^[A-Z][A-Z0-9_]*=", w)]
    assert argv[:3] == [".venv/bin/python", "-m", "pytest"]
    assert "1p1d,p.node=0,d.node=1" in argv
    r = subprocess.run([sys.executable, *argv[1:], "--collect-only", "-q", "-p",
                        "no:cacheprovider"], cwd=repo, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[vllm-1p1d,p.node=0,d.node=1]" in r.stdout, r.stdout[-2000:]
