"""TokenSpeed's KV corruption (engines/kv_corrupt_tokenspeed.py), its pure parts over host
memory, in both layouts of the decode's KV pool it knows:

- per_buffer (TokenSpeed 0.1.0): per layer a K and a V buffer, page p of buffer b at
  ptr[b] + p * item_len[b], `offsets` naming each layer's two; `prefill(kv_indices)`;
- arena (TokenSpeed 0.1.1): one uint8 arena laid out by a cache plan, page p of field
  `layer.N.k` at `field_page_byte_offset(field, 0) + p * page_stride_bytes` (here each layer's
  K and V interleaved in one plane: a page stride twice the payload); `prefill(block_manifest)`.

Stand-ins of the two TokenSpeed classes it patches, of the plan and of the manifest, and for
0.1.1 of its forward thread and its control-plane guard (fakes for a unit test of the patching
and index logic, not an engine: the real decode runs in the lane e2e-1gpu-kv-corrupt). The
"transfer" writes a pattern into the pages the receiver was given, as Mooncake writes the
prefill's KV, then reports success the way DisaggDecodeExecutor.generate_events does: on 0.1.1
under the guard, which raises on any tensor op of that thread but a view, as TokenSpeed's does.
"""

import queue
import threading
import types
from concurrent.futures import Future
from dataclasses import dataclass

import pytest
from lazy_import import lazy

from e2e_test.infra.engines import kv_corrupt as kc
from e2e_test.infra.engines import kv_corrupt_tokenspeed as kt

torch = lazy("torch")               # None in a `.[dev]` venv: the patching logic still runs

# The KV pool's tests write through torch tensors (torch comes with the cpu extra).
needs_torch = pytest.mark.skipif(torch is None, reason="needs torch: pip install -e '.[cpu]'")

LAYERS, PAGES, PAGE_TOKENS, HEADS, DIM = 3, 12, 4, 2, 8
PAYLOAD = PAGE_TOKENS * HEADS * DIM * 2          # bytes of one page of one K (or V), bf16


@dataclass
class KVArgs:                      # the fields of TokenSpeed 0.1.0's KVArgs that the module reads
    kv_data_ptrs: list
    kv_data_lens: list
    kv_item_lens: list
    offsets: list


def pool():
    """(K, V, kv_args) of a bfloat16 per-buffer MHA pool in host memory (0.1.0): K and V
    [pages, tokens, heads, dim] per layer, every value distinct from the transfers' patterns."""
    ks = [torch.full((PAGES, PAGE_TOKENS, HEADS, DIM), -1.0 - i, dtype=torch.bfloat16)
          for i in range(LAYERS)]
    vs = [torch.full((PAGES, PAGE_TOKENS, HEADS, DIM), -10.0 - i, dtype=torch.bfloat16)
          for i in range(LAYERS)]
    bufs = ks + vs
    args = KVArgs([b.data_ptr() for b in bufs], [b.nbytes for b in bufs],
                  [b[0].nbytes for b in bufs],
                  [[i, LAYERS + i] for i in range(LAYERS)])
    return ks, vs, args


# -- fakes of TokenSpeed 0.1.1's cache plan (pd/cache_protocol.py, recipes/plan.py) ------------

@dataclass
class FakeGroup:
    group_id: str
    page_count: int


@dataclass
class FakePlane:
    plane_id: str
    bytes_per_lcm_block: int
    arena_offset_bytes: int


@dataclass
class FakeField:
    group_id: str
    field_id: str
    plane_id: str
    dtype: str
    field_offset_bytes: int
    page_stride_bytes: int
    payload_bytes: int


@dataclass
class FakePlan:
    groups: list
    planes: list
    fields: list
    arena_bytes: int

    def group(self, group_id):
        return next(g for g in self.groups if g.group_id == group_id)

    def field_page_byte_offset(self, field_id, page_id):    # recipes/plan.py's formula
        f = next(x for x in self.fields if x.field_id == field_id)
        plane = next(x for x in self.planes if x.plane_id == f.plane_id)
        return (plane.arena_offset_bytes + plane.bytes_per_lcm_block - f.page_stride_bytes
                + page_id * f.page_stride_bytes + f.field_offset_bytes)


@dataclass
class FakeContract:                # CacheTransferContract: the plan, fields per group
    plan: FakePlan

    def fields_for_group(self, group_id):
        return tuple(sorted((f for f in self.plan.fields if f.group_id == group_id),
                            key=lambda f: f.field_id))


@dataclass
class ArenaKVArgs:                 # the fields of TokenSpeed 0.1.1's KVArgs that the module reads
    kv_data_ptr: int
    cache_layout: FakeContract
    arena: object = None           # keeps the host memory alive


@dataclass
class FakeGroupBlocks:
    group_id: str
    block_ids: tuple


@dataclass
class FakeManifest:                # CachePDBlockManifest
    groups: tuple
    prefix_len: int = 0
    prompt_len: int = 1


def manifest(pages, group="full"):
    return FakeManifest((FakeGroupBlocks(group, tuple(pages)),), 0, len(pages) * PAGE_TOKENS)


def arena_pool():
    """(K, V, kv_args) of a bfloat16 arena (0.1.1): one plane per layer, page p of it holding
    that layer's K then its V (stride 2 * PAYLOAD), so K and V are strided views of the arena;
    values as in `pool`."""
    stride = 2 * PAYLOAD
    plane_bytes = PAGES * stride                  # (num_lcm_blocks + 1) parents of one page
    arena = torch.zeros(LAYERS * plane_bytes, dtype=torch.uint8)
    planes, fields, ks, vs = [], [], [], []
    el = arena.view(torch.bfloat16)
    for i in range(LAYERS):
        planes.append(FakePlane(f"unit.{i}", stride, i * plane_bytes))
        for plane, off in (("k", 0), ("v", PAYLOAD)):
            fields.append(FakeField("full", f"layer.{i}.{plane}", f"unit.{i}", "bfloat16", off,
                                    stride, PAYLOAD))
            view = el.as_strided((PAGES, PAGE_TOKENS, HEADS, DIM),
                                 (stride // 2, HEADS * DIM, DIM, 1),
                                 (i * plane_bytes + off) // 2)
            (ks if plane == "k" else vs).append(view)
        ks[-1].fill_(-1.0 - i)
        vs[-1].fill_(-10.0 - i)
    plan = FakePlan([FakeGroup("full", PAGES)], planes, fields, arena.nbytes)
    return ks, vs, ArenaKVArgs(arena.data_ptr(), FakeContract(plan), arena)


def page(t, p):
    return t[p]


class FakeForwardThread:
    """TokenSpeed 0.1.1's ForwardThread (runtime/execution/forward_thread.py): one thread runs
    the submitted closures in order; `run` waits for one."""

    def __init__(self, device):
        self._queue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="fake::forward", daemon=True)
        self._thread.start()
        self.ran = 0

    def _run(self):
        while (item := self._queue.get()) is not None:
            fn, future = item
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 (relayed to the waiter, as TokenSpeed)
                future.set_exception(e)
            self.ran += 1

    def submit(self, fn):
        future = Future()
        self._queue.put((fn, future))
        return future

    def run(self, fn):
        return self.submit(fn).result()

    def shutdown(self):
        self._queue.put(None)
        self._thread.join(timeout=5)


def control_plane_guard():
    """TokenSpeed 0.1.1's `_NoDeviceWork` (runtime/execution/device.py) over host tensors: on
    the thread that enters it, any tensor op whose outputs do not all alias an input raises."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class NoTensorWork(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            returns = func._schema.returns
            if not (returns and all(r.alias_info is not None and not r.alias_info.is_write
                                    for r in returns)):
                raise RuntimeError(f"control-plane thread ran {func}")
            return func(*args, **(kwargs or {}))

    return NoTensorWork()


def stand_ins(shape="per_buffer"):
    """Modules named as TokenSpeed's with the two classes (and the KVArgs the decode module
    imports), their methods' arguments as in TokenSpeed 0.1.0 (`per_buffer`) or 0.1.1
    (`arena`)."""
    if shape == "per_buffer":
        class MooncakeKVReceiver:
            def __init__(self, mgr, bootstrap_room):
                self.kv_mgr, self.bootstrap_room, self.asked = mgr, bootstrap_room, None

            def prefill(self, kv_indices, aux_index=None, decode_prefix_len=0,
                        mla_l1_5_args=None, mamba_indices=None):
                self.asked = list(kv_indices)
        kv_args_cls = KVArgs
    else:
        class MooncakeKVReceiver:
            def __init__(self, mgr, bootstrap_room):
                self.kv_mgr, self.bootstrap_room, self.asked = mgr, bootstrap_room, None

            def prefill(self, block_manifest=None):
                if block_manifest is None:
                    raise ValueError("Mooncake PD requires a block manifest")
                self.asked = list(block_manifest.groups[0].block_ids)
        kv_args_cls = ArenaKVArgs
        fmod = types.ModuleType("forward_thread")
        fmod.ForwardThread = type("ForwardThread", (FakeForwardThread,), {})

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
    dmod.KVArgs = kv_args_cls
    mods = {kt.PATCHES[0][0]: rmod, kt.PATCHES[1][0]: dmod}
    if shape != "per_buffer":
        mods[kt.FORWARD_THREAD[0]] = fmod
    return mods


POOLS = {"per_buffer": pool, "arena": arena_pool}


def transfer(mods, mgr, ks, vs, room, pages, value):
    """One request's KV through the stand-ins: the decode asks for it into `pages` (as each
    release's DisaggDecodeExecutor calls `prefill`), the "prefill" writes `value` + layer into
    each (K) and its negative (V), success is reported."""
    r = mods[kt.PATCHES[0][0]].MooncakeKVReceiver(mgr, room)
    if isinstance(mgr.kv_args, ArenaKVArgs):
        r.prefill(block_manifest=manifest(pages))
    else:
        r.prefill(pages, 0, 0)
    assert r.asked == pages                       # the engine's own method still ran
    for layer in range(LAYERS):
        for p in pages:
            page(ks[layer], p).fill_(value + layer)
            page(vs[layer], p).fill_(-(value + layer))
    if isinstance(mgr.kv_args, ArenaKVArgs):        # 0.1.1: popped on the guarded control plane
        with control_plane_guard():
            assert mgr.pop_prefill_metadata(room) == (-1, None)
    else:
        assert mgr.pop_prefill_metadata(room) == (-1, None)
    assert mgr.popped[-1] == room


@pytest.fixture(params=list(POOLS))
def decode(request, tmp_path):
    mods = stand_ins(request.param)
    ks, vs, args = POOLS[request.param]()
    mgr = mods[kt.PATCHES[1][0]].MooncakeKVManagerDecode(args)
    folder = str(tmp_path / "kv-corrupt" / "decode-0")
    state = kt.install("runtime", folder, modules=mods, device="cpu", seed=0)
    assert state.layout.name == request.param
    ft = None
    if kt.FORWARD_THREAD[0] in mods:                # the engine builds it after the preload
        ft = mods[kt.FORWARD_THREAD[0]].ForwardThread("cpu")
        assert state.forward_thread is ft
    yield mods, mgr, ks, vs, folder, state
    if ft is not None:
        ft.shutdown()


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


@pytest.mark.parametrize("shape", list(POOLS))
def test_install_from_env_says_what_it_did(shape, capsys, monkeypatch):
    assert kt.install_from_env({}) is None                      # not asked: nothing, silent
    assert capsys.readouterr().err == ""
    # TokenSpeed is not installed here: the patch points cannot be imported
    assert kt.install_from_env({kt.ENV_SETTING: "runtime", kt.ENV_DIR: "/x"}) is None
    assert "NOT installed on TokenSpeed's decode: ModuleNotFoundError" in capsys.readouterr().err
    mods = stand_ins(shape)
    real, real_ft = kt.patch_points, kt.forward_thread_class
    monkeypatch.setattr(kt, "patch_points", lambda modules=None: real(mods))
    monkeypatch.setattr(kt, "forward_thread_class", lambda modules=None: real_ft(mods))
    assert kt.install_from_env({kt.ENV_SETTING: "runtime", kt.ENV_DIR: ""}) is not None
    err = capsys.readouterr().err
    assert "installed on TokenSpeed's decode (setting 'runtime'" in err
    assert "MooncakeKVReceiver.prefill, MooncakeKVManagerDecode.pop_prefill_metadata" in err
    arg = {"per_buffer": "kv_indices", "arena": "block_manifest"}[shape]
    where = {"per_buffer": "the calling thread", "arena": "the forward thread (ForwardThread.run)"}
    assert f"; layout {shape} (prefill({arg})); corrupts on {where[shape]}" in err


@needs_torch
@pytest.mark.parametrize("decode", ["arena"], indirect=True)
def test_on_0_1_1_the_corruption_runs_on_the_forward_thread(decode):
    """The control plane that pops the metadata is guarded (no tensor op but a view); the
    corruption is handed to the forward thread and has run when the pop returns."""
    mods, mgr, ks, vs, folder, state = decode
    kc.set_kind(folder, "zero_layer:1")
    before = state.forward_thread.ran
    transfer(mods, mgr, ks, vs, 7, [2, 3], 100.0)
    assert state.forward_thread.ran == before + 1
    assert (page(ks[1], 2) == 0).all() and (page(ks[0], 2) == 100).all()
    assert kc.read_counts(folder) == {"zero_layer": {"requests": 1, "blocks": 2}}


@needs_torch
def test_on_0_1_1_a_corruption_on_the_control_plane_is_refused(tmp_path, caplog):
    """The negative control of the test above: the same corruption run in place, on the
    guarded thread, is refused by the guard; the pages stay as transferred, nothing is
    counted, and the log says why. Without a forward thread built after the hook installed,
    the same, named."""
    for built in (True, False):
        mods = stand_ins("arena")
        ks, vs, args = arena_pool()
        mgr = mods[kt.PATCHES[1][0]].MooncakeKVManagerDecode(args)
        folder = str(tmp_path / f"kc-{built}")
        state = kt.install("runtime", folder, modules=mods, device="cpu", seed=0)
        if built:
            ft = mods[kt.FORWARD_THREAD[0]].ForwardThread("cpu")
            state.forward_thread = state.forward_thread_class = None
        kc.set_kind(folder, "zero_layer:1")
        caplog.clear()
        transfer(mods, mgr, ks, vs, 7, [2, 3], 100.0)
        assert (page(ks[1], 2) == 101).all() and kc.read_counts(folder) == {}
        assert "e2e-kv-corrupt: corruption failed" in caplog.text
        why = "control-plane thread ran" if built else "none was built after the hook installed"
        assert why in caplog.text
        if built:
            ft.shutdown()


def test_an_unknown_or_mixed_shape_is_refused_with_its_line(capsys, monkeypatch):
    """A receiver whose `prefill` names neither layout's argument, or one that names 0.1.1's
    while KVArgs is 0.1.0's: nothing patched, and the decode's log says why."""
    mods = stand_ins("arena")
    recv = mods[kt.PATCHES[0][0]].MooncakeKVReceiver
    original = recv.prefill
    recv.prefill = lambda self, blocks=None: None
    with pytest.raises(ValueError, match="first argument is none of 'kv_indices' "
                                         r"\(per_buffer\), 'block_manifest' \(arena\)"):
        kt.install("runtime", "", modules=mods, device="cpu")
    real = kt.patch_points
    monkeypatch.setattr(kt, "patch_points", lambda modules=None: real(mods))
    assert kt.install_from_env({kt.ENV_SETTING: "runtime", kt.ENV_DIR: ""}) is None
    err = capsys.readouterr().err
    assert "NOT installed on TokenSpeed's decode: ValueError: " in err
    assert "first argument is none of" in err
    recv.prefill = original
    mods[kt.PATCHES[1][0]].KVArgs = KVArgs                        # 0.1.0's fields
    with pytest.raises(ValueError, match=r"arena layout, but KVArgs has no \['kv_data_ptr', "
                                         r"'cache_layout'\]"):
        kt.install("runtime", "", modules=mods, device="cpu")
    assert mods[kt.PATCHES[0][0]].MooncakeKVReceiver.prefill is original   # nothing patched


@needs_torch
def test_arena_page_views_alias_the_arena_at_the_transfers_offsets():
    ks, vs, args = arena_pool()
    layers = kt.arena_page_layers(args, device="cpu")
    assert list(layers) == [f"layer.{i}" for i in range(LAYERS)]
    k1, v1 = layers["layer.1"]
    assert tuple(k1.shape) == (PAGES, PAYLOAD) and k1.stride() == (2 * PAYLOAD, 1)
    assert v1.data_ptr() - k1.data_ptr() == PAYLOAD and v1.stride() == k1.stride()
    k1[5].zero_()                                  # bytes of page 5 of layer 1's K
    assert (page(ks[1], 5) == 0).all() and (page(ks[1], 4) == -2).all()
    assert (page(vs[1], 5) == -11).all() and (ks[0] == -1).all() and (vs[2] == -12).all()
    assert kt.arena_value_dtype(args) == "bfloat16"
    # a layer with another plane (mxfp8 scales) is refused, as is a pool of two groups
    plan = args.cache_layout.plan
    plan.fields.append(FakeField("full", "layer.2.k_scale", "unit.2", "uint8", 0,
                                 2 * PAYLOAD, 8))
    with pytest.raises(ValueError, match="layer 2: fields .* are not a k and a v"):
        kt.arena_page_layers(args, device="cpu")
    plan.fields.pop()
    plan.groups.append(FakeGroup("swa", PAGES))
    with pytest.raises(ValueError, match=r"cache groups \['full', 'swa'\], not one"):
        kt.arena_page_layers(args, device="cpu")


def test_arena_pages_are_checked_against_the_plan_before_any_device_op():
    """Pure index logic (no memory is touched: the plan alone): a manifest's block IDs are the
    pages, each inside the group and inside every field's span of the arena."""
    stride = 2 * PAYLOAD
    planes = [FakePlane(f"unit.{i}", stride, i * PAGES * stride) for i in range(LAYERS)]
    fields = [FakeField("full", f"layer.{i}.{p}", f"unit.{i}", "bfloat16", off, stride, PAYLOAD)
              for i in range(LAYERS) for p, off in (("k", 0), ("v", PAYLOAD))]
    plan = FakePlan([FakeGroup("full", PAGES)], planes, fields, LAYERS * PAGES * stride)
    args = ArenaKVArgs(0, FakeContract(plan))
    assert kt.manifest_pages(args, manifest([3, 4, 11])) == [3, 4, 11]
    assert kt.manifest_pages(args, None) == []
    with pytest.raises(ValueError, match=r"manifest names groups \['swa'\], the arena"):
        kt.manifest_pages(args, manifest([3], group="swa"))
    kt.check_arena_pages(args, [0, 3, 11])
    kt.check_arena_pages(args, [])
    for bad in (12, -1, 10**6):
        with pytest.raises(ValueError, match=rf"pages \[{bad}\].*arena's 12 pages"):
            kt.check_arena_pages(args, [1, bad])
    # an arena shorter than the plan's pages bounds them: the last plane holds 9 pages only
    plan.arena_bytes -= 3 * stride
    with pytest.raises(ValueError, match=r"pages \[9\].*arena's 9 pages"):
        kt.check_arena_pages(args, [9])


# -- through the real launcher: the preload installs the patch in the waiting interpreter ----

RECEIVERS = {"per_buffer": """
class MooncakeKVReceiver:
    def prefill(self, kv_indices, aux_index=None, decode_prefix_len=0, mla_l1_5_args=None,
                mamba_indices=None):
        pass
""", "arena": """
class MooncakeKVReceiver:
    def prefill(self, block_manifest=None):
        pass
"""}
FORWARD = """
class ForwardThread:
    def __init__(self, device):
        pass

    def run(self, fn):
        return fn()
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


@pytest.mark.parametrize("shape", list(RECEIVERS))
def test_the_launchers_preload_installs_it_in_the_scheduler_only_when_asked(shape, tmp_path):
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
    (pkg / "receiver.py").write_text(RECEIVERS[shape])
    (pkg / "decode.py").write_text(DECODE)
    if shape == "arena":                           # 0.1.1 has a forward thread, 0.1.0 none
        ex = tmp_path / "tokenspeed" / "runtime" / "execution"
        ex.mkdir()
        (ex / "__init__.py").write_text("")
        (ex / "forward_thread.py").write_text(FORWARD)
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
        assert (f"; layout {shape} (" in proc.stderr) == asked, proc.stderr
        where = {"per_buffer": "calling", "arena": "forward"}[shape]
        assert (f"; corrupts on the {where} thread" in proc.stderr) == asked, proc.stderr
