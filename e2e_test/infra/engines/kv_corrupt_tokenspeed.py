"""KV corruption negative controls on TokenSpeed: received KV corrupted inside a real decode.

TokenSpeed has no connector to load in its place (its transfer backend is a closed choice;
nothing under `runtime/pd` loads a module by name), so this module patches two methods of its
Mooncake decode path in the decode worker's scheduler process. The TokenSpeed builder
(engines/tokenspeed.py) has the warm-spawn launcher preload it into the waiting scheduler
interpreter of the decode worker of the `kv_corrupt` profile, after the engine's own modules and
before the servicer's request; at import, with `HARNESS_KV_CORRUPT` set (a kind of
engines/kv_corrupt.py, or `runtime`: its control file in `HARNESS_KV_CORRUPT_DIR`), it installs:

- `MooncakeKVReceiver.prefill(...)` (`pd/mooncake/receiver.py`): the decode hands the prefill
  the pages its KV is to be written into; recorded per bootstrap room, and for
  `stale_last_block` what the last of them holds before the transfer writes it;
- `MooncakeKVManagerDecode.pop_prefill_metadata(room)` (`pd/mooncake/decode.py`): called only by
  `DisaggDecodeExecutor.generate_events` once the room's transfer succeeded, before its
  `RemotePrefillDoneEvent` reaches the scheduler: the corruption is applied to those pages
  there, and the device synchronised, so the decode's first step already reads it.

Where the corruption's device work runs follows the release. TokenSpeed 0.1.0 calls both
methods on its scheduler thread, and the corruption runs there. TokenSpeed 0.1.1 runs device
work on one forward thread per rank (`runtime/execution/forward_thread.py`) and bans it on the
control-plane thread that calls `pop_prefill_metadata` (`device.py` `_NoDeviceWork`: "device
work crosses only through DeviceHandle"); there the corruption is handed to that thread with
`ForwardThread.run`, which TokenSpeed keeps for "the low-rate PD events that must see their
device write land", and returns once it has run, before the room's event reaches the scheduler.
`install` records the forward thread by wrapping `ForwardThread.__init__` (the preload runs
before the engine builds it).

Two layouts of the decode's pool are known (`LAYOUTS`), told apart by the first argument of
`MooncakeKVReceiver.prefill` and checked against the fields of `KVArgs`:

- `per_buffer` (TokenSpeed 0.1.0): `prefill(kv_indices)`, the pages; page p of KV buffer b lies
  at `kv_args.kv_data_ptrs[b] + p * kv_args.kv_item_lens[b]` (the prefill side's
  `_layer_transfer_blocks`), and `kv_args.offsets[layer]` names each layer's buffers (an MHA
  pool: its K, then its V);
- `arena` (TokenSpeed 0.1.1): `prefill(block_manifest)`, a `CachePDBlockManifest` whose one
  group's `block_ids` are the decode's pages; the whole cache is one uint8 arena at
  `kv_args.kv_data_ptr`, laid out by `kv_args.cache_layout.plan`: page p of field `layer.N.k`
  (or `.v`) lies at `field_page_byte_offset(field, 0) + p * page_stride_bytes`, for
  `payload_bytes` (the prefill side's `_cache_transfer_blocks` writes exactly there).

The corruption works on those bytes through views of that memory (`byte_view`), whatever the
cache's dtype, with engines/kv_corrupt.py's Corruptor and kinds. One kind differs:
`cross_request` cannot hold a request back for a partner here (its completion is an event of
TokenSpeed's own scheduler), so each request receives the newest earlier request's KV as that
one arrived (`Donors`, counted `from_earlier`); the first of a case, with none before it, goes
uncorrupted (`unpaired`).

A patch of two methods, not a hook: `install` checks that both exist with the arguments it
reads and prints one line to the worker's log, installed (and on which layout) or why not. A
decode that corrupts nothing fails its case as "not a negative control"
(e2e_test/router/test_kv_corrupt.py). The pure parts are unit-tested in
tests/test_kv_corrupt_tokenspeed.py over host memory, with stand-ins of the two classes in
both layouts.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import sys
from collections.abc import Callable

from . import kv_corrupt as kc

# The decode worker's environment (engines/tokenspeed.py sets them there only; not settings of
# the harness, which has no E2E_ name for them).
ENV_SETTING = "HARNESS_KV_CORRUPT"      # a kind, or "runtime" (the control file)
ENV_DIR = "HARNESS_KV_CORRUPT_DIR"      # the control file and counts.json
MODULE = "e2e_test.infra.engines.kv_corrupt_tokenspeed"
# What is patched, and the first argument after self each wrapper reads (the receiver's:
# the layout's `prefill_arg`, see LAYOUTS).
PATCHES = (("tokenspeed.runtime.pd.mooncake.receiver", "MooncakeKVReceiver", "prefill",
            None),
           ("tokenspeed.runtime.pd.mooncake.decode", "MooncakeKVManagerDecode",
            "pop_prefill_metadata", "bootstrap_room"))
# TokenSpeed 0.1.1's data plane (absent in 0.1.0): the thread the corruption runs on there.
FORWARD_THREAD = ("tokenspeed.runtime.execution.forward_thread", "ForwardThread")


def byte_view(ptr: int, nbytes: int, device: str = "cuda"):
    """A uint8 tensor over `nbytes` of memory at `ptr`, no copy: device memory through the CUDA
    array interface, host memory (the unit tests) through NumPy's."""
    import torch
    iface = {"shape": (int(nbytes),), "typestr": "|u1", "data": (int(ptr), False),
             "version": 3}
    holder = type("_Memory", (), {})()
    if device == "cuda":
        holder.__cuda_array_interface__ = {**iface, "strides": None}
        return torch.as_tensor(holder, device="cuda")
    import numpy as np
    holder.__array_interface__ = iface
    return torch.from_numpy(np.asarray(holder))


def page_layers(kv_args, device: str = "cuda") -> dict:
    """layer name -> (K pages, V pages) of a decode's registered KV pool, each a uint8 view
    [pages, bytes per page] (`kv_args`: TokenSpeed 0.1.0's KVArgs, pd/mooncake/entities.py:
    per-buffer `kv_data_ptrs`, `kv_data_lens`, `kv_item_lens`, `offsets`). A
    layer whose buffers are not exactly a K and a V of one page size is a ValueError (an MLA
    or DeepSeek-V4 pool: not supported here)."""
    out = {}
    for layer, bufs in enumerate(kv_args.offsets):
        views = []
        for b in bufs:
            item = int(kv_args.kv_item_lens[b])
            pages = int(kv_args.kv_data_lens[b]) // item
            views.append(byte_view(kv_args.kv_data_ptrs[b], pages * item, device)
                         .view(pages, item))
        if len(views) != 2 or views[0].shape != views[1].shape:
            raise ValueError(f"layer {layer}: buffers {list(bufs)} are not a K and a V of one "
                             f"page size ({[tuple(v.shape) for v in views]})")
        out[f"layer.{layer}"] = tuple(views)
    if not out:
        raise ValueError("the KV pool registers no layer")
    return out


def check_pages(kv_args, pages: list[int]) -> None:
    """Every page lies inside every KV buffer of TokenSpeed 0.1.0's pool (`kv_data_lens[b] //
    kv_item_lens[b]` pages each), checked on the host before any device op: a page out of
    range would index device memory outside the buffer (a device-side assert that poisons
    the worker's CUDA context). A ValueError names the page and the buffer's size."""
    for layer, bufs in enumerate(kv_args.offsets):
        for b in bufs:
            item, length = int(kv_args.kv_item_lens[b]), int(kv_args.kv_data_lens[b])
            n = length // item if item > 0 else 0
            bad = [p for p in pages if not 0 <= p < n]
            if bad:
                raise ValueError(f"pages {bad[:4]} (of {len(pages)}, {min(pages)}..{max(pages)})"
                                 f" outside layer {layer}'s buffer {b}: {n} pages of {item} "
                                 f"bytes ({length} bytes)")


def kv_indices_pages(kv_args, kv_indices) -> list[int]:
    """The pages of TokenSpeed 0.1.0's `prefill(kv_indices)`: the indices themselves."""
    return [int(p) for p in kv_indices]


def arena_group(kv_args) -> str:
    """The one cache group of TokenSpeed 0.1.1's `kv_args.cache_layout.plan` (the pool of a
    model of full-attention layers only); a ValueError for a pool of several groups (sliding
    window, Mamba or other state layers: not supported here)."""
    groups = [g.group_id for g in kv_args.cache_layout.plan.groups]
    if len(groups) != 1:
        raise ValueError(f"the KV arena has cache groups {groups}, not one: not supported here")
    return groups[0]


def manifest_pages(kv_args, block_manifest) -> list[int]:
    """The pages of TokenSpeed 0.1.1's `prefill(block_manifest)`: the `block_ids` of the
    manifest's one group (`CachePDBlockManifest`, pd/cache_protocol.py), which the prefill
    writes as the decode's own pages (an unsharded destination, `_cache_transfer_blocks`).
    None (which TokenSpeed refuses itself): no pages."""
    if block_manifest is None:
        return []
    group = arena_group(kv_args)
    got = [g.group_id for g in block_manifest.groups]
    if got != [group]:
        raise ValueError(f"the block manifest names groups {got}, the arena {[group]}")
    return [int(p) for p in block_manifest.groups[0].block_ids]


def _arena_fields(kv_args) -> list[tuple[int, str, int, int, int, str]]:
    """(layer, plane, offset of page 0, page stride, payload bytes, dtype) of each field of
    TokenSpeed 0.1.1's arena group (`fields_for_group`, `field_page_byte_offset`: the offsets
    the prefill's `_cache_transfer_blocks` writes at), in the plan's order."""
    layout = kv_args.cache_layout
    out = []
    for f in layout.fields_for_group(arena_group(kv_args)):
        parts = f.field_id.split(".")
        if len(parts) != 3 or parts[0] != "layer" or not parts[1].isdigit():
            raise ValueError(f"cache field {f.field_id!r} is not a layer's K or V")
        out.append((int(parts[1]), parts[2], int(layout.plan.field_page_byte_offset(
            f.field_id, 0)), int(f.page_stride_bytes), int(f.payload_bytes), str(f.dtype)))
    return out


def arena_page_layers(kv_args, device: str = "cuda") -> dict:
    """layer name -> (K pages, V pages) of TokenSpeed 0.1.1's KV arena (`kv_args.kv_data_ptr`,
    `plan.arena_bytes` bytes), each a uint8 view [pages, payload bytes] strided by the field's
    page stride. A layer whose fields are not exactly a `k` and a `v` of one size is a
    ValueError (an MLA pool, mxfp8 scale planes: not supported here)."""
    plan = kv_args.cache_layout.plan
    pages = int(plan.group(arena_group(kv_args)).page_count)
    arena_bytes = int(plan.arena_bytes)
    arena = byte_view(kv_args.kv_data_ptr, arena_bytes, device)
    planes: dict[int, dict[str, object]] = {}
    for layer, plane, off, stride, size, _ in _arena_fields(kv_args):
        if off < 0 or size > stride or off + (pages - 1) * stride + size > arena_bytes:
            raise ValueError(f"layer {layer} {plane}: {pages} pages of {stride} bytes from "
                             f"{off} overrun the {arena_bytes}-byte arena")
        planes.setdefault(layer, {})[plane] = arena.as_strided((pages, size), (stride, 1), off)
    out = {}
    for layer in sorted(planes):
        got = planes[layer]
        if sorted(got) != ["k", "v"] or got["k"].shape != got["v"].shape:
            raise ValueError(f"layer {layer}: fields {sorted(got)} are not a k and a v of one "
                             f"page size")
        out[f"layer.{layer}"] = (got["k"], got["v"])
    if not out:
        raise ValueError("the KV arena holds no layer")
    return out


def check_arena_pages(kv_args, pages: list[int]) -> None:
    """Every page lies inside TokenSpeed 0.1.1's arena group (`page_count` pages) and every
    field's span of the arena, checked on the host before any device op (as `check_pages`).
    A ValueError names the page and the bound."""
    plan = kv_args.cache_layout.plan
    n = int(plan.group(arena_group(kv_args)).page_count)
    arena_bytes = int(plan.arena_bytes)
    for layer, plane, off, stride, size, _ in _arena_fields(kv_args):
        fit = (arena_bytes - off - size) // stride + 1 if stride > 0 else 0
        n = min(n, max(fit, 0))
    bad = [p for p in pages if not 0 <= p < n]
    if bad:
        raise ValueError(f"pages {bad[:4]} (of {len(pages)}, {min(pages)}..{max(pages)}) "
                         f"outside the KV arena's {n} pages ({arena_bytes} bytes)")


def arena_value_dtype(kv_args) -> str:
    """The dtype TokenSpeed 0.1.1's plan views its K/V bytes as (`CacheFieldLayout.dtype`)."""
    return _arena_fields(kv_args)[0][5]


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one TokenSpeed release's Mooncake decode names the pages it receives and reaches
    its KV pool: the first argument of `MooncakeKVReceiver.prefill`, the `KVArgs` fields read,
    and the functions that read them."""
    name: str
    prefill_arg: str
    kv_args_fields: tuple[str, ...]
    pages: Callable          # (kv_args, the prefill argument) -> [page]
    page_layers: Callable    # (kv_args, device) -> {"layer.N": (K pages, V pages)}
    check_pages: Callable    # (kv_args, pages) -> None, or ValueError
    value_dtype: Callable    # kv_args -> the dtype `scale` reads the bytes as


LAYOUTS = (
    Layout("per_buffer", "kv_indices", ("kv_data_ptrs", "kv_data_lens", "kv_item_lens",
                                        "offsets"),
           kv_indices_pages, page_layers, check_pages,
           lambda kv_args: PageCorruptor.VALUE_DTYPE),
    Layout("arena", "block_manifest", ("kv_data_ptr", "cache_layout"),
           manifest_pages, arena_page_layers, check_arena_pages, arena_value_dtype),
)


class PageCorruptor(kc.Corruptor):
    """engines/kv_corrupt.py's Corruptor over page views (`page_layers`): blocks are pages."""

    def __init__(self, layers: dict, seed: int = 0, value_dtype: str | None = None):
        first = next(iter(layers.values()))[0]
        super().__init__(layers, int(first.shape[0]), seed=seed)
        if value_dtype:
            self.VALUE_DTYPE = value_dtype

    def views(self, name):
        return self.caches[name]

    def _idx(self, blocks):
        import torch
        dev = next(iter(self.caches.values()))[0].device
        return torch.tensor(blocks, dtype=torch.long, device=dev)

    # The pages are bytes (0.1.0's KVArgs carries no dtype; 0.1.1's plan does, `value_dtype`):
    # `scale` reads them as the pool's values, bf16 for a bf16 model under --kv-cache-dtype
    # auto, TokenSpeed's default, which the harness leaves as it is.
    VALUE_DTYPE = "bfloat16"

    def scale(self, blocks: list[int], factor: float) -> None:
        import torch
        dt = getattr(torch, self.VALUE_DTYPE)
        idx = self._idx(blocks)
        for h in self.halves():
            h[idx] = (h[idx].view(dt) * factor).to(dt).view(torch.uint8)


class DecodeState(kc._State):
    """The decode's corruption state: the pages each bootstrap room receives, and what each
    kind does when its transfer has succeeded (`arrived`)."""

    def __init__(self, setting: str, folder: str, device: str = "cuda", seed: int = 0,
                 layout: Layout = LAYOUTS[0], forward_thread_class: type | None = None):
        super().__init__(setting, folder)
        self.layout = layout
        self.device = device
        self.seed = seed
        self.pages: dict[int, list[int]] = {}       # room -> the pages it receives
        self.last_kind: kc.Kind | None = None
        self._corruptors: dict[int, PageCorruptor] = {}     # id(kv_args) -> its corruptor
        self.forward_thread_class = forward_thread_class    # TokenSpeed 0.1.1's ForwardThread
        self.forward_thread = None      # its instance, once the engine builds it

    def on_data_plane(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the forward thread where the engine has one (TokenSpeed 0.1.1), waiting
        for it; on the calling thread otherwise (0.1.0). Only `pop_prefill_metadata`'s wrapper
        calls it, on the control plane in both releases."""
        ft = self.forward_thread
        if ft is None and self.forward_thread_class is not None:
            raise RuntimeError("the engine has a ForwardThread class, but none was built after "
                               "the hook installed: its device work has no thread to run on")
        if ft is None:
            fn()
        else:
            ft.run(fn)

    def page_corruptor(self, kv_args) -> PageCorruptor:
        c = self._corruptors.get(id(kv_args))
        if c is None:
            c = self._corruptors[id(kv_args)] = PageCorruptor(
                self.layout.page_layers(kv_args, self.device), seed=self.seed,
                value_dtype=self.layout.value_dtype(kv_args))
            k = next(iter(c.caches.values()))[0]
            kc.log.warning("e2e-kv-corrupt: %d KV layers, %d pages of %d bytes per buffer",
                           len(c.caches), k.shape[0], k.shape[1])
        return c

    def received(self, kv_args, room: int, pages: list[int]) -> None:
        """The decode asked for `room`'s KV into these pages (before the transfer)."""
        self.layout.check_pages(kv_args, pages)
        self.pages[room] = pages
        if pages and self.current().name == "stale_last_block":
            # Every stream idle before and after: the scheduler thread's current stream is not
            # the one TokenSpeed's forward and transfer run on (without it, an index kernel
            # asserted out of bounds; with CUDA_LAUNCH_BLOCKING=1 the case passed).
            import torch
            if self.device == "cuda":
                torch.cuda.synchronize()
            self.stale[room] = (pages[-1:], self.page_corruptor(kv_args).snapshot(pages[-1:]))
            if self.device == "cuda":
                torch.cuda.synchronize()

    def arrived(self, kv_args, room: int) -> None:
        """`room`'s transfer succeeded: corrupt its pages as the current kind says."""
        pages = self.pages.pop(room, [])
        kind = self.current()
        if kind != self.last_kind:          # a new case: no donor from the one before
            self.donors.clear()
            self.last_kind = kind
        if kind.name == "none" or not pages:
            self.stale.pop(room, None)
            return
        self.layout.check_pages(kv_args, pages)
        import torch
        c = self.page_corruptor(kv_args)
        if self.device == "cuda":
            torch.cuda.synchronize()
        with torch.inference_mode():
            if kind.name == "cross_request":
                self._cross(c, room, pages)
            else:
                kc.corrupt_one(c, self, kind, room, pages, unit="page")
            self.stale.pop(room, None)
            if self.device == "cuda":
                torch.cuda.synchronize()

    def _cross(self, c: PageCorruptor, room: int, pages: list[int]) -> None:
        donor = self.donors.for_request(room)
        self.donors.add(room, c.snapshot(pages))        # its own KV, before anything touches it
        if donor is None:
            self.count("cross_request", unpaired=1)
            kc.log.warning("e2e-kv-corrupt: kind=cross_request room=%s first of its case: "
                           "released uncorrupted", room)
            return
        n = c.transplant(donor[1], pages)
        if n:
            self.count("cross_request", requests=1, blocks=n, from_earlier=1)
            kc.log.warning("e2e-kv-corrupt: kind=cross_request room=%s received room=%s's KV "
                           "in %d of its %d pages", room, donor[0], n, len(pages))


def choose_layout(prefill, decode_module) -> Layout:
    """The layout (LAYOUTS) whose `prefill_arg` is the first argument of the receiver's
    `prefill`, checked against the fields of the `KVArgs` that `decode_module` imports (where
    it has one); a ValueError naming what was found otherwise."""
    params = list(inspect.signature(prefill).parameters)
    layout = next((x for x in LAYOUTS if params[1:2] == [x.prefill_arg]), None)
    if layout is None:
        known = ", ".join(f"{x.prefill_arg!r} ({x.name})" for x in LAYOUTS)
        raise ValueError(f"{PATCHES[0][0]}.{PATCHES[0][1]}.{PATCHES[0][2]}{tuple(params)}: its "
                         f"first argument is none of {known}")
    kv_args_cls = getattr(decode_module, "KVArgs", None)
    if kv_args_cls is not None and dataclasses.is_dataclass(kv_args_cls):
        have = {f.name for f in dataclasses.fields(kv_args_cls)}
        missing = [f for f in layout.kv_args_fields if f not in have]
        if missing:
            raise ValueError(f"prefill({layout.prefill_arg}) is the {layout.name} layout, but "
                             f"KVArgs has no {missing}")
    return layout


def patch_points(modules: dict | None = None) -> tuple[list[tuple[type, str]], Layout]:
    """(class, method) of each of PATCHES, imported (or from `modules`: name -> module, the
    tests' stand-ins), and the layout the receiver's `prefill` names; a ValueError naming what
    is missing or has other arguments."""
    out, mods = [], []
    for module, cls_name, method, first in PATCHES:
        mod = (modules or {}).get(module) or __import__(module, fromlist=[cls_name])
        cls = getattr(mod, cls_name, None)
        fn = getattr(cls, method, None) if cls is not None else None
        if fn is None:
            raise ValueError(f"{module}.{cls_name}.{method} is gone")
        params = list(inspect.signature(fn).parameters)
        if first is not None and params[1:2] != [first]:
            raise ValueError(f"{module}.{cls_name}.{method}{tuple(params)}: its first argument "
                             f"is not {first!r}")
        out.append((cls, method))
        mods.append(mod)
    return out, choose_layout(getattr(*out[0]), mods[1])


def forward_thread_class(modules: dict | None = None) -> type | None:
    """TokenSpeed 0.1.1's ForwardThread (FORWARD_THREAD), imported (or from `modules`); None
    where the release has none (0.1.0)."""
    module, cls_name = FORWARD_THREAD
    mod = (modules or {}).get(module)
    if mod is None and modules is None:
        try:
            mod = __import__(module, fromlist=[cls_name])
        except ModuleNotFoundError:
            return None
    cls = getattr(mod, cls_name, None)
    if cls is not None and not callable(getattr(cls, "run", None)):
        raise ValueError(f"{module}.{cls_name} has no run(fn)")
    return cls


def install(setting: str, folder: str, modules: dict | None = None, device: str = "cuda",
            seed: int | None = None) -> DecodeState:
    """Patch the two methods (see the module's doc) to corrupt as `setting` says; the state
    (its `layout`: the one the receiver's `prefill` names; its `forward_thread`, once the
    engine builds one). Raises ValueError (a bad setting, a patch point gone, an unknown
    layout) before patching anything."""
    kc.check_setting(setting)
    ((recv_cls, recv_name), (mgr_cls, mgr_name)), layout = patch_points(modules)
    ft_cls = forward_thread_class(modules)
    state = DecodeState(setting, folder, device, os.getpid() if seed is None else seed, layout,
                        ft_cls)
    if folder:
        os.makedirs(folder, exist_ok=True)
    prefill, pop = getattr(recv_cls, recv_name), getattr(mgr_cls, mgr_name)

    @functools.wraps(prefill)
    def prefill_wrapper(self, *args, **kwargs):
        # by position (0.1.0's DisaggDecodeExecutor) or by name (0.1.1's)
        try:
            arg = args[0] if args else kwargs.get(layout.prefill_arg)
            kv_args = self.kv_mgr.kv_args
            state.received(kv_args, self.bootstrap_room, layout.pages(kv_args, arg))
        except Exception:  # noqa: BLE001 (the engine's own path goes on; logged)
            kc.log.exception("e2e-kv-corrupt: recording the pages failed")
        return prefill(self, *args, **kwargs)

    @functools.wraps(pop)
    def pop_wrapper(self, bootstrap_room, *args, **kwargs):
        out = pop(self, bootstrap_room, *args, **kwargs)
        try:
            state.on_data_plane(functools.partial(state.arrived, self.kv_args, bootstrap_room))
        except Exception:  # noqa: BLE001 (as above)
            kc.log.exception("e2e-kv-corrupt: corruption failed")
        return out

    setattr(recv_cls, recv_name, prefill_wrapper)
    setattr(mgr_cls, mgr_name, pop_wrapper)
    if ft_cls is not None:
        init = ft_cls.__init__

        @functools.wraps(init)
        def init_wrapper(self, *args, **kwargs):
            init(self, *args, **kwargs)
            state.forward_thread = self         # one rank, one forward thread per process

        ft_cls.__init__ = init_wrapper
    return state


def install_from_env(environ=None) -> DecodeState | None:
    """What the preload does: install as HARNESS_KV_CORRUPT and HARNESS_KV_CORRUPT_DIR say,
    printing one line either way; nothing without HARNESS_KV_CORRUPT (the harness's own
    process, every other worker)."""
    env = os.environ if environ is None else environ
    setting = env.get(ENV_SETTING, "")
    if not setting:
        return None
    folder = env.get(ENV_DIR, "")
    try:
        state = install(setting, folder)
    except Exception as e:  # noqa: BLE001 (the worker runs unpatched; its case fails, named)
        print(f"e2e-kv-corrupt (pid {os.getpid()}): NOT installed on TokenSpeed's decode: "
              f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return None
    print(f"e2e-kv-corrupt (pid {os.getpid()}): installed on TokenSpeed's decode (setting "
          f"{setting!r}, folder {folder}): "
          + ", ".join(f"{c}.{m}" for _, c, m, _ in PATCHES)
          + f"; layout {state.layout.name} (prefill({state.layout.prefill_arg}))"
          + ("; corrupts on the forward thread (ForwardThread.run)"
             if state.forward_thread_class is not None else "; corrupts on the calling thread"),
          file=sys.stderr, flush=True)
    return state


# Installed at import: the launcher's --preload imports this module in the waiting scheduler
# interpreter, in its main thread, before the servicer's request.
STATE = install_from_env()
