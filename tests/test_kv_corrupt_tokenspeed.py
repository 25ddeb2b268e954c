"""TokenSpeed's KV corruption (engines/kv_corrupt_tokenspeed.py), its pure parts over host
memory: a KV pool laid out as TokenSpeed's MHA pool registers it for the transfer (per layer a
K and a V buffer, page p of buffer b at ptr[b] + p * item_len[b], `offsets` naming each layer's
two), and stand-ins of the two TokenSpeed classes it patches (a unit test of the patching
logic, not an engine: the real decode runs in the lane e2e-1gpu-kv-corrupt). The "transfer"
writes a pattern into the pages the receiver was given, as Mooncake writes the prefill's KV,
then reports success the way DisaggDecodeExecutor.generate_events does.
"""

import types
from dataclasses import dataclass

import pytest
from lazy_import import lazy

from e2e_test.infra.engines import kv_corrupt as kc
from e2e_test.infra.engines import kv_corrupt_tokenspeed as kt

torch = lazy("torch")               # None in a `.[dev]` venv: the patching logic still runs

# The KV pool's tests write through torch tensors (torch comes with the cpu extra).
needs_torch = pytest.mark.skipif(torch is None, reason="needs torch: pip install -e '.[cpu]'")

LAYERS, PAGES, PAGE_TOKENS, HEADS, DIM = 3, 12, 4, 2, 8


@dataclass
class KVArgs:                      # the fields of TokenSpeed's KVArgs that the module reads
    kv_data_ptrs: list
    kv_data_lens: list
    kv_item_lens: list
    offsets: list


def pool():
    """(K buffers, V buffers, kv_args) of a bfloat16 MHA pool in host memory, every value
    distinct from the patterns the transfers write."""
    ks = [torch.full((PAGES * PAGE_TOKENS, HEADS, DIM), -1.0 - i, dtype=torch.bfloat16)
          for i in range(LAYERS)]
    vs = [torch.full((PAGES * PAGE_TOKENS, HEADS, DIM), -10.0 - i, dtype=torch.bfloat16)
          for i in range(LAYERS)]
    bufs = ks + vs
    args = KVArgs([b.data_ptr() for b in bufs], [b.nbytes for b in bufs],
                  [b[0].nbytes * PAGE_TOKENS for b in bufs],
                  [[i, LAYERS + i] for i in range(LAYERS)])
    return ks, vs, args


def page(t, p):
    return t[p * PAGE_TOKENS:(p + 1) * PAGE_TOKENS]


def stand_ins():
    """Modules named as TokenSpeed's with the two classes, their methods' arguments as in
    TokenSpeed 0.1.0."""
    class MooncakeKVReceiver:
        def __init__(self, mgr, bootstrap_room):
            self.kv_mgr, self.bootstrap_room, self.asked = mgr, bootstrap_room, None

        def prefill(self, kv_indices, aux_index=None, decode_prefix_len=0, mla_l1_5_args=None,
                    mamba_indices=None):
            self.asked = list(kv_indices)

    class MooncakeKVManagerDecode:
        def __init__(self, kv_args):
            self.kv_args, self.popped = kv_args, []

        def pop_prefill_metadata(self, bootstrap_room):
            self.popped.append(bootstrap_room)
            return -1, None

    rmod = types.ModuleType("receiver")
    rmod.MooncakeKVReceiver = MooncakeKVReceiver
    dmod = types.ModuleType("decode")
    dmod.MooncakeKVManagerDecode = MooncakeKVManagerDecode
    return {kt.PATCHES[0][0]: rmod, kt.PATCHES[1][0]: dmod}


def transfer(mods, mgr, ks, vs, room, pages, value):
    """One request's KV through the stand-ins: the decode asks for it into `pages`, the
    "prefill" writes `value` + layer into each (K) and its negative (V), success is reported."""
    r = mods[kt.PATCHES[0][0]].MooncakeKVReceiver(mgr, room)
    r.prefill(pages, 0, 0)
    assert r.asked == pages                       # the engine's own method still ran
    for layer in range(LAYERS):
        for p in pages:
            page(ks[layer], p).fill_(value + layer)
            page(vs[layer], p).fill_(-(value + layer))
    assert mgr.pop_prefill_metadata(room) == (-1, None)
    assert mgr.popped[-1] == room


@pytest.fixture
def decode(tmp_path):
    mods = stand_ins()
    ks, vs, args = pool()
    mgr = mods[kt.PATCHES[1][0]].MooncakeKVManagerDecode(args)
    folder = str(tmp_path / "kv-corrupt" / "decode-0")
    state = kt.install("runtime", folder, modules=mods, device="cpu", seed=0)
    return mods, mgr, ks, vs, folder, state


@needs_torch
def test_page_views_alias_the_pool_at_the_transfers_offsets():
    ks, vs, args = pool()
    layers = kt.page_layers(args, device="cpu")
    assert list(layers) == [f"layer.{i}" for i in range(LAYERS)]
    k1, _ = layers["layer.1"]
    assert tuple(k1.shape) == (PAGES, PAGE_TOKENS * HEADS * DIM * 2)
    k1[5].zero_()                                  # bytes of page 5 of layer 1's K
    assert (page(ks[1], 5) == 0).all() and (page(ks[1], 4) == -2).all()
    assert (page(vs[1], 5) == -11).all() and (ks[0] == -1).all()
    # a layer that is not a K and a V of one page size is refused
    args.offsets[2] = [2]
    with pytest.raises(ValueError, match="not a K and a V"):
        kt.page_layers(args, device="cpu")


@needs_torch
def test_none_corrupts_nothing(decode):
    mods, mgr, ks, vs, folder, _ = decode
    kc.set_kind(folder, "none")
    transfer(mods, mgr, ks, vs, 7, [2, 3], 100.0)
    assert (page(ks[0], 2) == 100).all() and (page(vs[2], 3) == -102).all()
    assert kc.read_counts(folder) == {}


@needs_torch
def test_zero_layer_zeroes_that_layers_received_pages_only(decode):
    mods, mgr, ks, vs, folder, _ = decode
    kc.set_kind(folder, "zero_layer:1")
    transfer(mods, mgr, ks, vs, 7, [2, 3], 100.0)
    for p in (2, 3):
        assert (page(ks[1], p) == 0).all() and (page(vs[1], p) == 0).all()
        assert (page(ks[0], p) == 100).all() and (page(vs[2], p) == -102).all()
    assert (page(ks[1], 4) == -2).all()            # a page it did not receive
    assert kc.read_counts(folder) == {"zero_layer": {"requests": 1, "blocks": 2}}


@needs_torch
def test_swap_kv_exchanges_k_and_v(decode):
    mods, mgr, ks, vs, folder, _ = decode
    kc.set_kind(folder, "swap_kv:-1")
    transfer(mods, mgr, ks, vs, 7, [6], 50.0)
    assert (page(ks[2], 6) == -52).all() and (page(vs[2], 6) == 52).all()
    assert (page(ks[1], 6) == 51).all()


@needs_torch
def test_stale_last_block_restores_what_the_last_page_held_before_the_transfer(decode):
    mods, mgr, ks, vs, folder, _ = decode
    kc.set_kind(folder, "stale_last_block")
    transfer(mods, mgr, ks, vs, 7, [2, 3, 4], 100.0)
    assert (page(ks[0], 4) == -1).all() and (page(vs[2], 4) == -12).all()   # as before
    assert (page(ks[0], 3) == 100).all()           # the others as transferred
    assert kc.read_counts(folder)["stale_last_block"] == {"requests": 1, "blocks": 1}


@needs_torch
def test_bitflip_changes_every_chosen_page(decode):
    mods, mgr, ks, vs, folder, _ = decode
    kc.set_kind(folder, "bitflip:1")
    transfer(mods, mgr, ks, vs, 7, [2, 3], 100.0)
    for p in (2, 3):
        intact = all((page(ks[layer], p) == 100.0 + layer).all()
                     and (page(vs[layer], p) == -(100.0 + layer)).all()
                     for layer in range(LAYERS))
        assert not intact, f"page {p} is as transferred"
    c = kc.read_counts(folder)["bitflip"]
    assert c["requests"] == 1 and c["blocks"] == 2 and c["blocks_seen"] == 2


@needs_torch
def test_scale_multiplies_every_layers_received_pages_only(decode):
    mods, mgr, ks, vs, folder, _ = decode
    kc.set_kind(folder, "scale:0.5")
    transfer(mods, mgr, ks, vs, 7, [2, 3], 100.0)
    for p in (2, 3):
        for layer in range(LAYERS):
            assert (page(ks[layer], p) == 1.5 * (100 + layer)).all()
            assert (page(vs[layer], p) == -1.5 * (100 + layer)).all()
    assert (page(ks[1], 4) == -2).all()            # a page it did not receive
    assert kc.read_counts(folder) == {"scale": {"requests": 1, "blocks": 2}}


@needs_torch
def test_cross_request_gives_each_request_the_previous_ones_kv(decode):
    mods, mgr, ks, vs, folder, _ = decode
    kc.set_kind(folder, "cross_request")
    transfer(mods, mgr, ks, vs, 1, [2, 3], 100.0)      # the first of the case: its own
    assert (page(ks[0], 2) == 100).all()
    transfer(mods, mgr, ks, vs, 2, [5, 6, 7], 200.0)   # receives room 1's, as it arrived
    assert (page(ks[0], 5) == 100).all() and (page(vs[1], 6) == -101).all()
    assert (page(ks[0], 7) == 200).all()               # beyond the donor's two pages
    assert kc.read_counts(folder)["cross_request"] == {
        "requests": 1, "blocks": 2, "unpaired": 1, "from_earlier": 1}
    # a new case starts afresh, after `none` or after another kind (no request under `none`
    # between them): its first request has no donor
    for n, between in enumerate(("none", "zero_layer")):
        room, p = 3 + 2 * n, 8 + 2 * n
        kc.set_kind(folder, between)
        transfer(mods, mgr, ks, vs, room, [p], 100.0 * room)
        kc.set_kind(folder, "cross_request")
        transfer(mods, mgr, ks, vs, room + 1, [p + 1], 100.0 * (room + 1))
        assert (page(ks[0], p + 1) == 100.0 * (room + 1)).all(), between
        assert kc.read_counts(folder)["cross_request"]["unpaired"] == 2 + n


@needs_torch
def test_a_kind_set_outside_runtime_mode_and_a_bad_one(tmp_path):
    mods = stand_ins()
    ks, vs, args = pool()
    mgr = mods[kt.PATCHES[1][0]].MooncakeKVManagerDecode(args)
    kt.install("zero_layer", str(tmp_path), modules=mods, device="cpu")
    transfer(mods, mgr, ks, vs, 7, [1], 10.0)
    assert (page(ks[0], 1) == 0).all()
    with pytest.raises(ValueError, match="unknown KV corruption kind"):
        kt.install("zero", str(tmp_path), modules=stand_ins(), device="cpu")


def test_a_patch_point_gone_or_changed_is_refused_before_patching():
    mods = stand_ins()
    cls = mods[kt.PATCHES[1][0]].MooncakeKVManagerDecode
    original = mods[kt.PATCHES[0][0]].MooncakeKVReceiver.prefill
    cls.pop_prefill_metadata = lambda self, room: (-1, None)      # renamed argument
    with pytest.raises(ValueError, match="first argument is not 'bootstrap_room'"):
        kt.install("runtime", "", modules=mods, device="cpu")
    assert mods[kt.PATCHES[0][0]].MooncakeKVReceiver.prefill is original   # nothing patched
    del cls.pop_prefill_metadata
    with pytest.raises(ValueError, match="pop_prefill_metadata is gone"):
        kt.install("runtime", "", modules=mods, device="cpu")


def test_install_from_env_says_what_it_did(capsys, monkeypatch):
    assert kt.install_from_env({}) is None                      # not asked: nothing, silent
    assert capsys.readouterr().err == ""
    # TokenSpeed is not installed here: the patch points cannot be imported
    assert kt.install_from_env({kt.ENV_SETTING: "runtime", kt.ENV_DIR: "/x"}) is None
    assert "NOT installed on TokenSpeed's decode: ModuleNotFoundError" in capsys.readouterr().err
    mods = stand_ins()
    monkeypatch.setattr(kt, "patch_points", lambda modules=None: [
        (mods[kt.PATCHES[0][0]].MooncakeKVReceiver, "prefill"),
        (mods[kt.PATCHES[1][0]].MooncakeKVManagerDecode, "pop_prefill_metadata")])
    assert kt.install_from_env({kt.ENV_SETTING: "runtime", kt.ENV_DIR: ""}) is not None
    err = capsys.readouterr().err
    assert "installed on TokenSpeed's decode (setting 'runtime'" in err
    assert "MooncakeKVReceiver.prefill, MooncakeKVManagerDecode.pop_prefill_metadata" in err


# -- through the real launcher: the preload installs the patch in the waiting interpreter ----

RECEIVER = """
class MooncakeKVReceiver:
    def prefill(self, kv_indices, aux_index=None, decode_prefix_len=0, mla_l1_5_args=None,
                mamba_indices=None):
        pass
"""
DECODE = """
class MooncakeKVManagerDecode:
    def pop_prefill_metadata(self, bootstrap_room):
        return -1, None
"""
TARGET = """
import os, sys
def work(conn):
    from tokenspeed.runtime.pd.mooncake import decode, receiver
    conn.send({"pid": os.getpid(),
               "receiver": hasattr(receiver.MooncakeKVReceiver.prefill, "__wrapped__"),
               "decode": hasattr(decode.MooncakeKVManagerDecode.pop_prefill_metadata,
                                 "__wrapped__"),
               "harness": "e2e_test.infra.engines.kv_corrupt_tokenspeed" in sys.modules})
    conn.close()
"""
ENTRY = """
import json, multiprocessing as mp
import stand_in_ts_target
if __name__ == "__main__":
    mp.set_start_method("spawn", force=True)
    r, w = mp.Pipe(duplex=False)
    p = mp.Process(target=stand_in_ts_target.work, args=(w,))
    p.start()
    w.close()
    print("RESULT " + json.dumps(r.recv()), flush=True)
    p.join(30)
"""


def test_the_launchers_preload_installs_it_in_the_scheduler_only_when_asked(tmp_path):
    """The decode's command as engines/tokenspeed.py builds it for the kv_corrupt profile: the
    waiting scheduler interpreter preloads this module, which patches TokenSpeed's two classes
    (stand-in modules of those names here) in the process that runs the target, and says so in
    the log. The negative control, the same without HARNESS_KV_CORRUPT: nothing patched."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from e2e_test.infra.engines import LAUNCHERS
    pkg = tmp_path / "tokenspeed" / "runtime" / "pd" / "mooncake"
    pkg.mkdir(parents=True)
    for d in (tmp_path / "tokenspeed", tmp_path / "tokenspeed" / "runtime",
              tmp_path / "tokenspeed" / "runtime" / "pd", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "receiver.py").write_text(RECEIVER)
    (pkg / "decode.py").write_text(DECODE)
    (tmp_path / "stand_in_ts_target.py").write_text(TARGET)
    (tmp_path / "stand_in_ts_entry.py").write_text(ENTRY)
    repo = str(Path(kt.__file__).resolve().parents[3])
    base = {**os.environ, "PYTHONPATH": os.pathsep.join([LAUNCHERS, str(tmp_path), repo])}
    argv = [sys.executable, "-m", "e2e_warm_spawn", "--run", "stand_in_ts_entry",
            "--target", "stand_in_ts_target:work", "--preload", "stand_in_ts_target",
            "--preload", kt.MODULE, "--"]
    for asked in (True, False):
        env = dict(base)
        if asked:
            env.update({kt.ENV_SETTING: "runtime", kt.ENV_DIR: str(tmp_path / "kc")})
        proc = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=120, check=False)
        assert proc.returncode == 0, proc.stderr
        out = json.loads(next(x for x in proc.stdout.splitlines()
                              if x.startswith("RESULT "))[len("RESULT "):])
        assert out["harness"]                      # preloaded either way
        assert (out["receiver"], out["decode"]) == (asked, asked), (out, proc.stderr)
        line = f"e2e-kv-corrupt (pid {out['pid']}): installed on TokenSpeed's decode"
        assert (line in proc.stderr) == asked, proc.stderr
