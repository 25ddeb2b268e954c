"""The KV corruption negative control's pure parts (engines/kv_corrupt.py) and the builder's
switch (engines/vllm.py): kind parsing, block selection, pairing, layer order, the KV views of
each cache layout on small CPU tensors. No engine starts; the real-engine run is
e2e_test/router/test_kv_corrupt.py."""

import json
import random

import pytest
from lazy_import import lazy

from e2e_test.infra.engines import EngineOptions, Ports, vllm
from e2e_test.infra.engines import kv_corrupt as kc
from e2e_test.infra.errors import ConfigError
from e2e_test.infra.specs.model_specs import get_spec
from e2e_test.infra.specs.plan import plan_cpu
from e2e_test.infra.specs.topology import parse
from e2e_test.infra.verdicts import oracle

torch = lazy("torch")               # None in a `.[dev]` venv: the pure parts still run

# The cache views and corruptor tests work on torch tensors (torch comes with the cpu extra).
needs_torch = pytest.mark.skipif(torch is None, reason="needs torch: pip install -e '.[cpu]'")


def test_parse_kind():
    assert kc.parse_kind(None) == kc.parse_kind("") == kc.parse_kind(" none ") == kc.Kind()
    assert kc.parse_kind("zero_layer") == kc.Kind("zero_layer", layer=0)
    assert kc.parse_kind("swap_kv:-1") == kc.Kind("swap_kv", layer=-1)
    assert kc.parse_kind("bitflip:0.25") == kc.Kind("bitflip", rate=0.25)
    assert str(kc.parse_kind("bitflip:0.25")) == "bitflip:0.25"
    assert kc.parse_kind("scale") == kc.Kind("scale", eps=0.05)
    assert kc.parse_kind("scale:-0.1") == kc.Kind("scale", eps=-0.1)
    assert str(kc.parse_kind("scale:0.02")) == "scale:0.02" and str(kc.Kind("scale")) == "scale"
    assert str(kc.parse_kind("zero_layer:3")) == "zero_layer:3"
    for bad in ("zero", "zero_layer:x", "bitflip:0", "bitflip:2", "cross_request:1",
                "scale:0", "scale:x", "scale:2",
                "stale_last_block:2"):
        with pytest.raises(ValueError):
            kc.parse_kind(bad)
    assert kc.check_setting("") == "" and kc.check_setting("runtime") == "runtime"


def test_flat_blocks_takes_both_shapes():
    assert kc.flat_blocks([3, 4]) == [3, 4]
    assert kc.flat_blocks(([3, 4], [7])) == [3, 4, 7]
    assert kc.flat_blocks(()) == [] and kc.flat_blocks(None) == []


def test_block_selection():
    rng = random.Random(0)
    assert kc.blocks_to_corrupt(kc.Kind("stale_last_block"), [5, 6, 9], rng) == [9]
    assert kc.blocks_to_corrupt(kc.Kind("zero_layer"), [5, 6], rng) == [5, 6]
    assert kc.blocks_to_corrupt(kc.Kind("none"), [5, 6], rng) == []
    assert kc.blocks_to_corrupt(kc.Kind("stale_last_block"), [], rng) == []
    hit = kc.blocks_to_corrupt(kc.Kind("bitflip", rate=0.01), list(range(20000)), rng)
    assert len(hit) == 200 and len(set(hit)) == 200 and hit == sorted(hit)
    assert kc.blocks_to_corrupt(kc.Kind("bitflip", rate=1.0), [1, 2], rng) == [1, 2]


def test_bitflip_hits_every_request_at_its_rate():
    """A request of few blocks is still hit (TokenSpeed's pages: 12 of them over a whole case
    went unhit at 10 % when each block was drawn alone), and never more than its rate asks
    plus one block."""
    rng = random.Random(0)
    bitflip = kc.Kind("bitflip", rate=0.1)
    for n in (1, 2, 9, 10, 11, 66):
        hit = kc.blocks_to_corrupt(bitflip, list(range(100, 100 + n)), rng)
        assert 1 <= len(hit) <= 0.1 * n + 1 and set(hit) <= set(range(100, 100 + n)), (n, hit)
    assert kc.blocks_to_corrupt(bitflip, [], rng) == []


def test_layer_order_is_numeric():
    names = [f"model.layers.{i}.self_attn.attn" for i in (10, 2, 1, 0)]
    assert kc.layer_order(names)[:3] == ["model.layers.0.self_attn.attn",
                                         "model.layers.1.self_attn.attn",
                                         "model.layers.2.self_attn.attn"]
    assert kc.pick_layer(names, -1) == "model.layers.10.self_attn.attn"
    with pytest.raises(ValueError):
        kc.pick_layer(names, 4)


def test_pairing_holds_a_lone_request_then_releases_it():
    p = kc.Pairing(hold_s=3.0)
    p.add("a", [1], now=0.0)
    assert p.take(now=1.0) == ([], []) and p.held == {"a"}
    p.add("b", [2, 3], now=1.5)
    pairs, alone = p.take(now=1.5)
    assert pairs == [(("a", [1]), ("b", [2, 3]))] and alone == [] and not p.held
    p.add("c", [4], now=2.0)
    assert p.take(now=4.9) == ([], [])
    assert p.take(now=5.0) == ([], [("c", [4])]) and not p.held


def test_donors_give_a_lone_request_the_newest_other_requests_kv():
    """cross_request where transfers come further apart than the hold: a lone request gets
    the newest other request's KV as it arrived, never its own; none before a second one."""
    d = kc.Donors(keep=2)
    d.add("a", "snap-a")
    assert d.for_request("a") is None                 # only itself: nothing to receive
    d.add("b", "snap-b")
    assert d.for_request("b") == ("a", "snap-a") and d.for_request("x") == ("b", "snap-b")
    d.add("c", "snap-c")                              # keeps the last two
    assert [r for r, _ in d.items] == ["b", "c"] and d.for_request("c") == ("b", "snap-b")
    d.clear()
    assert d.for_request("c") is None


@needs_torch
def test_transplant_writes_another_requests_blocks():
    caches = {"model.layers.0.self_attn.attn": cpu_cache(num_blocks=4)}
    c = kc.Corruptor(caches, num_blocks=4)
    before = caches["model.layers.0.self_attn.attn"].clone()
    snap = c.snapshot([0, 1])                         # request A's two blocks
    assert c.transplant(snap, [3]) == 1               # B has one block: A's first goes there
    after = caches["model.layers.0.self_attn.attn"]
    assert torch.equal(after[3], before[0])
    assert torch.equal(after[:3], before[:3])         # nothing else touched
    assert c.transplant(snap, []) == 0 and c.transplant([], [2]) == 0


def cpu_cache(num_blocks=3, heads=2, block_size=4, head_size=3, dtype=None):
    dtype = dtype or torch.float32
    return torch.arange(num_blocks * heads * block_size * 2 * head_size, dtype=dtype).view(
        num_blocks, heads, block_size, 2 * head_size)


@needs_torch
def test_kv_views_cpu_layout_matches_cpu_attn():
    t = cpu_cache()            # 2 KV heads: s[1] == 2 must not read as FlashInfer's layout
    k, v = kc.kv_views(t, 3)
    ref_k, ref_v = t.view(3, 2, 8, 3).chunk(2, dim=2)      # what cpu_attn.py does
    assert torch.equal(k, ref_k) and torch.equal(v, ref_v)


@needs_torch
def test_kv_views_gpu_layouts():
    fa = torch.zeros(2, 5, 4, 1, 3)         # (2, blocks, block_size, heads, head)
    k, v = kc.kv_views(fa, 5)
    k[1] = 1
    assert fa[0, 1].sum() == 12 and fa[1].sum() == 0
    fi = torch.zeros(5, 2, 4, 1, 3)         # FlashInfer (blocks, 2, ...)
    k, v = kc.kv_views(fi, 5)
    v[2] = 1
    assert fi[2, 1].sum() == 12 and fi[:, 0].sum() == 0
    with pytest.raises(ValueError):
        kc.kv_views(torch.zeros(7, 3), 5)


@needs_torch
def test_kv_views_gpu_packed_layout_matches_flash_attn():
    """vLLM 0.26 on a GPU registers [blocks, heads, block_size, 2 * head_size] (the H200:
    (76247, 3, 16, 128) for SmolLM2), K and V packed in the last dim: flash_attn.py reads
    `kv_cache.transpose(1, 2).split(head_size, dim=-1)`. The same shape on the CPU backend
    means K rows then V rows: the device decides."""
    t = cpu_cache()
    k, v = kc.kv_views(t, 3, "cuda")
    ref_k, ref_v = t.transpose(1, 2).split(3, dim=-1)      # what flash_attn.py does
    assert torch.equal(k.transpose(1, 2), ref_k) and torch.equal(v.transpose(1, 2), ref_v)
    k[1] = -1
    assert (t[1, ..., :3] == -1).all() and (t[1, ..., 3:] >= 0).all() and (t[0] >= 0).all()
    c = kc.Corruptor({"layers.0": t}, 3, device_type="cuda")
    before = t.clone()
    c.swap_kv([2], 0)
    assert torch.equal(t[2, ..., :3], before[2, ..., 3:]) and torch.equal(t[2, ..., 3:],
                                                                         before[2, ..., :3])
    assert torch.equal(t[0], before[0])


@needs_torch
def test_corruptor_operations():
    base = cpu_cache(dtype=torch.bfloat16)
    caches = {f"layers.{i}": base.clone() for i in range(2)}
    c = kc.Corruptor(caches, 3, seed=1)
    c.swap_kv([1], 0)
    k0, v0 = c.views("layers.0")
    rk, rv = kc.kv_views(base, 3)
    assert torch.equal(k0[1], rv[1]) and torch.equal(v0[1], rk[1]) and torch.equal(k0[0], rk[0])
    assert torch.equal(caches["layers.1"], base)           # the other layer untouched
    snap = c.snapshot([2])
    c.zero([2], -1)
    assert caches["layers.1"][2].abs().sum() == 0 and caches["layers.0"][2].abs().sum() > 0
    c.restore([2], snap)
    assert torch.equal(caches["layers.1"][2], base[2])
    assert c.exchange([0], [2, 1]) == 1
    assert torch.equal(caches["layers.1"][0], base[2]) and torch.equal(caches["layers.1"][2], base[0])
    before = caches["layers.0"][1].clone()
    c.bitflip([1])
    assert (caches["layers.0"][1] != before).sum() >= 1
    # scale: every layer's K and V of the chosen blocks only, by the factor
    caches = {f"layers.{i}": base.clone() for i in range(2)}
    c = kc.Corruptor(caches, 3, seed=1)
    c.scale([0, 2], 2.0)
    for t in caches.values():
        assert torch.equal(t[0], base[0] * 2) and torch.equal(t[2], base[2] * 2)
        assert torch.equal(t[1], base[1])


def test_counts_and_control_file(tmp_path):
    folder = str(tmp_path / "w")
    kc.set_kind(folder, "zero_layer:2")
    assert (tmp_path / "w" / "kind").read_text().strip() == "zero_layer:2"
    with pytest.raises(ValueError):
        kc.set_kind(folder, "nonsense")
    assert kc.read_counts(folder) == {}
    (tmp_path / "w" / "counts.json").write_text(json.dumps({"zero_layer": {"requests": 3,
                                                                           "blocks": 5}}))
    after = {"zero_layer": {"requests": 5, "blocks": 9}, "swap_kv": {"requests": 0}}
    assert kc.counts_delta(kc.read_counts(folder), after) == {
        "zero_layer": {"requests": 2, "blocks": 4}}


# -- the builder switch --------------------------------------------------------------------

SMOL = get_spec("SmolLM2-135M-Instruct")


def pd_commands(options):
    t = parse("1p1d")
    entries = {e.name: e for e in plan_cpu(t, (0, 1)).entries}
    ports = Ports(api=20100, aux={"nixl": 20101})
    return {n: vllm.build(SMOL, t, e, ports, "/m", options) for n, e in entries.items()}


def kv(cmd):
    return json.loads(cmd.argv[cmd.argv.index("--kv-transfer-config") + 1])


def test_off_by_default():
    for cmd in pd_commands(EngineOptions(state_dir="/s")).values():
        assert kv(cmd) == {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                           "kv_buffer_device": "cpu"}
        assert "PYTHONPATH" not in cmd.env


def test_on_the_decode_only():
    cmds = pd_commands(EngineOptions(state_dir="/s", engine_opts={"kv_corrupt": "runtime"}))
    assert kv(cmds["prefill-0"])["kv_connector"] == "NixlConnector"
    d = kv(cmds["decode-0"])
    assert d == {"kv_connector": "E2ECorruptingNixlConnector", "kv_role": "kv_both",
                 "kv_buffer_device": "cpu",
                 "kv_connector_module_path": "e2e_test.infra.engines.kv_corrupt",
                 "kv_connector_extra_config": {"e2e_corrupt": "runtime",
                                               "e2e_corrupt_dir": "/s/kv-corrupt/decode-0"}}
    assert cmds["decode-0"].env["PYTHONPATH"].split(":")[0] == vllm.HARNESS_ROOT
    assert cmds["decode-0"].kv_connector == "NixlConnector"     # what smg is told
    with pytest.raises(ConfigError):
        pd_commands(EngineOptions(state_dir="/s", engine_opts={"kv_corrupt": "zap"}))
    with pytest.raises(ConfigError):
        pd_commands(EngineOptions(engine_opts={"kv_corrupt": "zero_layer"}))      # no state folder


def _pass(n, answered=True):
    out = oracle.Pass()
    for i in range(n):
        out[i] = ([oracle.Step(" a", -0.1, {" a": -0.1, " b": -2.5})] if answered else None)
    return out


def test_a_kind_only_recorded_may_leave_nothing_answered_the_others_may_not():
    """bitflip:0.1 can make every recall request an HTTP error, and a recorded-only case
    would then raise 'no item answered'. For such a kind that is recorded as request
    errors; for `none` and the asserted kinds it stays an error (a verdict over nothing)."""
    from e2e_test.router.test_kv_corrupt import _judged
    control = oracle.ControlArm([oracle.compare("recall", "1", "1 second", _pass(4), _pass(4))])
    v, counts = _judged("recall", "1", "1p1d", _pass(4), _pass(4, answered=False), control,
                        recorded_only=True)
    assert v is None and counts["error"] == 4
    with pytest.raises(oracle.NoEvidenceError, match="no item answered"):
        _judged("recall", "1", "1p1d", _pass(4), _pass(4, answered=False), control,
                recorded_only=False)
    v, counts = _judged("recall", "1", "1p1d", _pass(4), _pass(4), control, recorded_only=True)
    assert v.ok and counts["identical"] == 4
