"""KV corruption negative controls on TokenSpeed: received KV corrupted inside a real decode.

TokenSpeed 0.1.0 has no connector to load in its place (its transfer backend is a closed
choice, `--disaggregation-transfer-backend mooncake|mooncake_async`; nothing under
`runtime/pd` loads a module by name), so this module patches two methods of its Mooncake decode
path in the decode worker's scheduler process. The TokenSpeed builder (engines/tokenspeed.py)
has the warm-spawn launcher preload it into the waiting scheduler interpreter of the decode
worker of the `kv_corrupt` profile, after the engine's own modules and before the servicer's
request; at import, with `HARNESS_KV_CORRUPT` set (a kind of engines/kv_corrupt.py, or `runtime`:
its control file in `HARNESS_KV_CORRUPT_DIR`), it installs:

- `MooncakeKVReceiver.prefill(kv_indices, ...)` (`pd/mooncake/receiver.py`): the decode hands
  the prefill the pages its KV is to be written into; recorded per bootstrap room, and for
  `stale_last_block` what the last of them holds before the transfer writes it;
- `MooncakeKVManagerDecode.pop_prefill_metadata(room)` (`pd/mooncake/decode.py`): called only by
  `DisaggDecodeExecutor.generate_events` once the room's transfer succeeded, before its
  `RemotePrefillDoneEvent` reaches the scheduler: the corruption is applied to those pages
  there, and the device synchronised, so the decode's first step already reads it.

The pages are the ones the transfer wrote: page p of KV buffer b lies at
`kv_args.kv_data_ptrs[b] + p * kv_args.kv_item_lens[b]` (the prefill side's
`_layer_transfer_blocks`, `pd/mooncake/prefill.py`), and `kv_args.offsets[layer]` names each
layer's buffers (an MHA pool: its K, then its V). The corruption works on those bytes through
views of that memory (`byte_view`), whatever the cache's dtype, with engines/kv_corrupt.py's
Corruptor and kinds. One kind differs: `cross_request` cannot hold a request back for a partner
here (its completion is an event of TokenSpeed's own scheduler), so each request receives the
newest earlier request's KV as that one arrived (`Donors`, counted `from_earlier`); the first of
a case, with none before it, goes uncorrupted (`unpaired`).

A patch of two methods of TokenSpeed 0.1.0, not a hook: `install` checks that both exist with
the first argument it uses and prints one line to the worker's log, installed or why not. A
decode that corrupts nothing fails its case as "not a negative control"
(e2e_test/router/test_kv_corrupt.py). The pure parts are unit-tested in
tests/test_kv_corrupt_tokenspeed.py over host memory, with stand-ins of the two classes.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys

from . import kv_corrupt as kc

# The decode worker's environment (engines/tokenspeed.py sets them there only; not settings of
# the harness, which has no E2E_ name for them).
ENV_SETTING = "HARNESS_KV_CORRUPT"      # a kind, or "runtime" (the control file)
ENV_DIR = "HARNESS_KV_CORRUPT_DIR"      # the control file and counts.json
MODULE = "e2e_test.infra.engines.kv_corrupt_tokenspeed"
# What is patched, and the first argument after self each wrapper reads.
PATCHES = (("tokenspeed.runtime.pd.mooncake.receiver", "MooncakeKVReceiver", "prefill",
            "kv_indices"),
           ("tokenspeed.runtime.pd.mooncake.decode", "MooncakeKVManagerDecode",
            "pop_prefill_metadata", "bootstrap_room"))


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
    [pages, bytes per page] (`kv_args`: TokenSpeed's KVArgs, pd/mooncake/entities.py). A
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
    """Every page lies inside every KV buffer of the pool (`kv_data_lens[b] //
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


class PageCorruptor(kc.Corruptor):
    """engines/kv_corrupt.py's Corruptor over page views (`page_layers`): blocks are pages."""

    def __init__(self, layers: dict, seed: int = 0):
        first = next(iter(layers.values()))[0]
        super().__init__(layers, int(first.shape[0]), seed=seed)

    def views(self, name):
        return self.caches[name]

    def _idx(self, blocks):
        import torch
        dev = next(iter(self.caches.values()))[0].device
        return torch.tensor(blocks, dtype=torch.long, device=dev)

    # The pages are bytes (KVArgs carries no dtype): `scale` reads them as the pool's values,
    # bf16 for a bf16 model under --kv-cache-dtype auto, TokenSpeed's default, which the harness
    # leaves as it is.
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

    def __init__(self, setting: str, folder: str, device: str = "cuda", seed: int = 0):
        super().__init__(setting, folder)
        self.device = device
        self.seed = seed
        self.pages: dict[int, list[int]] = {}       # room -> the pages it receives
        self.last_kind: kc.Kind | None = None
        self._corruptors: dict[int, PageCorruptor] = {}     # id(kv_args) -> its corruptor

    def page_corruptor(self, kv_args) -> PageCorruptor:
        c = self._corruptors.get(id(kv_args))
        if c is None:
            c = self._corruptors[id(kv_args)] = PageCorruptor(
                page_layers(kv_args, self.device), seed=self.seed)
            k = next(iter(c.caches.values()))[0]
            kc.log.warning("e2e-kv-corrupt: %d KV layers, %d pages of %d bytes per buffer",
                           len(c.caches), k.shape[0], k.shape[1])
        return c

    def received(self, kv_args, room: int, kv_indices) -> None:
        """The decode asked for `room`'s KV into these pages (before the transfer)."""
        pages = [int(p) for p in kv_indices]
        check_pages(kv_args, pages)
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
        check_pages(kv_args, pages)
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


def patch_points(modules: dict | None = None) -> list[tuple[type, str]]:
    """(class, method) of each of PATCHES, imported (or from `modules`: name -> module, the
    tests' stand-ins); a ValueError naming what is missing or has other arguments."""
    out = []
    for module, cls_name, method, first in PATCHES:
        mod = (modules or {}).get(module) or __import__(module, fromlist=[cls_name])
        cls = getattr(mod, cls_name, None)
        fn = getattr(cls, method, None) if cls is not None else None
        if fn is None:
            raise ValueError(f"{module}.{cls_name}.{method} is gone")
        params = list(inspect.signature(fn).parameters)
        if params[1:2] != [first]:
            raise ValueError(f"{module}.{cls_name}.{method}{tuple(params)}: its first argument "
                             f"is not {first!r}")
        out.append((cls, method))
    return out


def install(setting: str, folder: str, modules: dict | None = None, device: str = "cuda",
            seed: int | None = None) -> DecodeState:
    """Patch the two methods (see the module's doc) to corrupt as `setting` says; the state.
    Raises ValueError (a bad setting, a patch point gone) before patching anything."""
    kc.check_setting(setting)
    (recv_cls, recv_name), (mgr_cls, mgr_name) = patch_points(modules)
    state = DecodeState(setting, folder, device, os.getpid() if seed is None else seed)
    if folder:
        os.makedirs(folder, exist_ok=True)
    prefill, pop = getattr(recv_cls, recv_name), getattr(mgr_cls, mgr_name)

    @functools.wraps(prefill)
    def prefill_wrapper(self, kv_indices, *args, **kwargs):
        try:
            state.received(self.kv_mgr.kv_args, self.bootstrap_room, kv_indices)
        except Exception:  # noqa: BLE001 (the engine's own path goes on; logged)
            kc.log.exception("e2e-kv-corrupt: recording the pages failed")
        return prefill(self, kv_indices, *args, **kwargs)

    @functools.wraps(pop)
    def pop_wrapper(self, bootstrap_room, *args, **kwargs):
        out = pop(self, bootstrap_room, *args, **kwargs)
        try:
            state.arrived(self.kv_args, bootstrap_room)
        except Exception:  # noqa: BLE001 (as above)
            kc.log.exception("e2e-kv-corrupt: corruption failed")
        return out

    setattr(recv_cls, recv_name, prefill_wrapper)
    setattr(mgr_cls, mgr_name, pop_wrapper)
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
          + ", ".join(f"{c}.{m}" for _, c, m, _ in PATCHES), file=sys.stderr, flush=True)
    return state


# Installed at import: the launcher's --preload imports this module in the waiting scheduler
# interpreter, in its main thread, before the servicer's request.
STATE = install_from_env()
