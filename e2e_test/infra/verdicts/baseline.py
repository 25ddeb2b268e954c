"""The baseline topology's evidence, computed once per session and shared between processes.

Every comparison of a topology (PD, DP, EPD, AFD, the KV-corruption negative controls) is
judged against passes measured on a baseline topology of the same engine: the regular `1`,
or for AFD its native DP baseline. `Evidence` holds what a comparison reads for one
(engine, topology, what): the oracle's pass (index -> steps), the control arm, the path arm
where the engine has one, and for `recall` the pass codes `1` copied in every pass.
`compute(cluster, what)` measures it on a running baseline topology.

`EvidenceCache(folder)` computes a key once for every process that asks (pytest-xdist's
documented pattern for "session-scoped fixtures that execute only once": a `FileLock` per
key and a folder the processes share). The value is pickled and written atomically; a
compute that raised leaves its error text instead, and every later `get` raises it, so a
baseline that failed fails its dependants at once instead of being measured again for each.
A process that is about to measure an engine's evidence claims it (`claim`), and the others
wait for the files instead of booting the baseline topology themselves (`wait`).

A topology's own pass of an eval, which several of its tests judge (test_evals' scored
pass and test_pd's comparison), is kept with its Cluster object (`own_pass`, `scored_pass`):
computed by whichever test asks first in this process.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import tempfile
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from filelock import FileLock

from ..errors import HarnessError
from ..load import load
from ..specs import settings
from . import comparisons, oracle, proof
from .evals import EvalResult, gsm8k, mmlu, recall

CONCURRENCY = settings.get("E2E_EVAL_CONCURRENCY")
RECALL_N = 8
EVAL_MODULES = {"gsm8k": gsm8k, "mmlu": mmlu}
# The greedy prompts of the AFD comparison (a tiny random-weight MoE: test_afd.py).
AFD_PROMPTS = [
    "The capital of France is",
    "Write one sentence about the sea.",
    "1 + 1 =",
    "List three colors:",
    "Once upon a time",
    "The quick brown fox",
    "Translate 'good morning' to Spanish:",
    "def fibonacci(n):",
]
AFD_MAX_TOKENS = 16
IMAGE_SEEDS = range(8)
IMAGE_MAX_TOKENS = 16
# what -> the kind of topology it is measured on (the baseline of the topologies judged by it)
WHATS = {"gsm8k": "regular", "mmlu": "regular", "recall": "regular",
         "image-prompts": "regular", "afd-prompts": "afd-native"}


class EvidenceError(HarnessError):
    """The baseline's evidence could not be measured (its error, as it was raised where it
    was computed), or it did not come."""


@dataclass
class Evidence:
    engine: str
    topology: str                     # the topology it was measured on ("1", "native-dp2")
    what: str
    passes: oracle.Pass               # index -> steps (None where the request failed)
    control: oracle.ControlArm
    path: oracle.PathArm | None = None
    # gsm8k/mmlu, where the engine's scored pass is the oracle's pass (logprobs on completions)
    scored: EvalResult | None = None
    # recall: copied (the codes copied in every pass), unstable, texts, control_texts,
    # prompt_words
    recall: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.engine}/{self.topology}"


# -- the passes ---------------------------------------------------------------------------------

def eval_n(cluster, name: str) -> int:
    """Items of eval `name`: E2E_GSM8K_N / E2E_MMLU_N, else the model's registry n."""
    acc = cluster.spec.accuracy.get(name)
    return settings.get(f"E2E_{name.upper()}_N") or (acc.n if acc else 32)


def max_prompt_tokens(cluster, name: str) -> int | None:
    return (cluster.spec.max_model_len or 4096) - 8 if name == "mmlu" else None


def label(cluster, suffix: str = "") -> str:
    return f"{cluster.engine}/{cluster.topology.name}{suffix}"


_OWN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _memo(cluster, key, fn):
    mine = _OWN.setdefault(cluster, {})
    if key not in mine:
        mine[key] = fn()
    return mine[key]


def scored_pass(cluster, name: str) -> EvalResult:
    """Eval `name` scored on this topology; it carries the oracle's logprobs where the engine
    returns them on completions (Engine.logprobs_api), and is then this topology's own
    pass. Once per Cluster object."""
    def run():
        mpt = max_prompt_tokens(cluster, name)
        lp = cluster.driver.logprobs_api == "completions"
        return EVAL_MODULES[name].run(
            cluster.gateway_url, cluster.model_name, n=eval_n(cluster, name),
            concurrency=CONCURRENCY, watchdog=cluster.watchdog(name),
            logprobs=cluster.driver.top_logprobs if lp else None,
            **({"max_prompt_tokens": mpt} if mpt else {}))
    return _memo(cluster, ("scored", name), run)


def scored_is_oracle(cluster) -> bool:
    return cluster.driver.logprobs_api == "completions"


def own_pass(cluster, name: str) -> oracle.Pass:
    """This topology's oracle pass of eval `name`: the scored pass where it carries the
    logprobs, else a pass of its own with the same prompts, asked the engine's way. Once per
    Cluster object."""
    if scored_is_oracle(cluster):
        return _memo(cluster, ("pass", name),
                     lambda: oracle.steps_by_index(scored_pass(cluster, name).items))
    return _memo(cluster, ("pass", name), lambda: comparisons.eval_pass(
        cluster.gateway_url, cluster.model_name, name, eval_n(cluster, name),
        concurrency=CONCURRENCY, max_prompt_tokens=max_prompt_tokens(cluster, name),
        watchdog=cluster.watchdog(f"{name} oracle pass"),
        logprobs=cluster.driver.top_logprobs, api=cluster.driver.logprobs_api))


def eval_requests(cluster, name: str, n: int | None = None) -> list[load.Request]:
    return comparisons.requests(name, cluster.model_name, n or eval_n(cluster, name),
                                max_prompt_tokens=max_prompt_tokens(cluster, name),
                                logprobs=cluster.driver.top_logprobs,
                                api=cluster.driver.logprobs_api)


def path_arm(cluster, name: str, reqs) -> oracle.PathArm | None:
    """The path arm of `reqs` (Engine.first_step_path_arm), where the engine has one. Runs
    after the control arm's passes: it resets the worker's prefix cache."""
    return cluster.driver.first_step_path_arm(cluster, name, reqs, label(cluster), CONCURRENCY,
                                              cluster.watchdog(f"{name} path arm"))


def image_requests(cluster) -> list[load.Request]:
    """Greedy image chats, one random picture per seed (the EPD comparison's prompts)."""
    reqs = []
    for seed in IMAGE_SEEDS:
        body = proof.image_chat_body(cluster.model_name, "Describe this picture.",
                                     proof.random_png_data_uri(seed), max_tokens=IMAGE_MAX_TOKENS)
        body.update(logprobs=True, top_logprobs=cluster.driver.top_logprobs)
        reqs.append(load.Request("/v1/chat/completions", body, tag=seed))
    return reqs


def afd_requests(cluster) -> list[load.Request]:
    return [load.Request("/v1/completions", {
        "model": cluster.model_name, "prompt": p, "max_tokens": AFD_MAX_TOKENS,
        "temperature": 0, "logprobs": cluster.driver.top_logprobs}, tag=i)
        for i, p in enumerate(AFD_PROMPTS)]


def compute(cluster, what: str) -> Evidence:
    """`what`'s evidence, measured on the running baseline topology `cluster`."""
    if what not in WHATS:
        raise ValueError(f"unknown evidence {what!r} (known: {', '.join(WHATS)})")
    ev = {"engine": cluster.engine, "topology": cluster.topology.name, "what": what}
    if what in EVAL_MODULES:
        base = own_pass(cluster, what)
        arm = comparisons.control_arm(
            cluster.gateway_url, cluster.model_name, what, base, label(cluster),
            eval_n(cluster, what), concurrency=CONCURRENCY,
            max_prompt_tokens=max_prompt_tokens(cluster, what),
            watchdog=cluster.watchdog(f"{what} control arm"),
            logprobs=cluster.driver.top_logprobs, api=cluster.driver.logprobs_api)
        return Evidence(**ev, passes=base, control=arm,
                        path=path_arm(cluster, what, eval_requests(cluster, what)),
                        scored=scored_pass(cluster, what) if scored_is_oracle(cluster) else None)
    if what == "recall":
        return _recall(cluster, ev)
    reqs = image_requests(cluster) if what == "image-prompts" else afd_requests(cluster)
    mine = comparisons.run_pass(cluster.gateway_url, reqs, concurrency=len(reqs),
                                watchdog=cluster.watchdog(what))
    arm = comparisons.control_arm_of(cluster.gateway_url, reqs, mine, label(cluster), what,
                                     len(reqs))
    return Evidence(**ev, passes=mine, control=arm)


def _recall(cluster, ev: dict) -> Evidence:
    """The recall prompts, then their control arm; the codes required of a disaggregated
    topology are those `1` copied in its pass and in every control pass (recall.stable_codes):
    one it copies only sometimes is a near-tie on `1` itself, not a KV test."""
    texts: dict = {}
    reqs = comparisons.requests("recall", cluster.model_name, RECALL_N,
                                logprobs=cluster.driver.top_logprobs,
                                api=cluster.driver.logprobs_api)
    base = comparisons.run_pass(cluster.gateway_url, reqs, CONCURRENCY, texts=texts,
                                watchdog=cluster.watchdog("recall"))
    control_texts: list = []
    arm = comparisons.control_arm(cluster.gateway_url, cluster.model_name, "recall", base,
                                  label(cluster), RECALL_N, concurrency=CONCURRENCY,
                                  watchdog=cluster.watchdog("recall control arm"),
                                  logprobs=cluster.driver.top_logprobs,
                                  api=cluster.driver.logprobs_api, texts=control_texts)
    copied, unstable = recall.stable_codes(texts, control_texts)
    return Evidence(**ev, passes=base, control=arm, path=path_arm(cluster, "recall", reqs),
                    recall={"copied": copied, "unstable": unstable, "texts": texts,
                            "control_texts": control_texts,
                            "prompt_words": len(comparisons.prompt_text(reqs[0]).split())})


def unavailable(what: str, spec) -> str | None:
    """Why the session's model (a ModelSpec) has no `what` to measure; None where it has."""
    if what == "image-prompts" and "multimodal" not in spec.features:
        return f"{spec.id} is not multimodal"
    return None


def baseline_topology(what: str, judged, selected=()) -> str:
    """The name of the topology `what` is measured on, for a test on topology `judged`
    (a Topology): `1`, or for afd-prompts the native DP baseline: `judged` itself where it is
    one, else the first native-dpN of the session's `selected` topologies, else the one with
    as many GPUs as `judged`'s XaYf."""
    if WHATS[what] == "regular":
        return "1"
    if judged.native_baseline:
        return judged.name
    native = [t.name for t in selected if getattr(t, "native_baseline", False)]
    if native:
        return native[0]
    return f"native-dp{sum(g.count for g in judged.roles)}"


# -- the cache ----------------------------------------------------------------------------------

MISSING = object()     # peek/wait: nothing stored (MISSING outside)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:       # a zombie is not alive (a dead worker not yet reaped by its parent)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


class EvidenceCache:
    """Values computed once per key for every process that shares `folder`."""

    def __init__(self, folder: Path | str, lock_timeout_s: float = -1):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.lock_timeout_s = lock_timeout_s

    @staticmethod
    def key(*parts: str) -> str:
        return "--".join(_slug(str(p)) for p in parts)

    def _paths(self, key: str) -> tuple[Path, Path, Path]:
        return (self.folder / f"{key}.pkl", self.folder / f"{key}.err",
                self.folder / f"{key}.lock")

    def peek(self, key: str) -> Any:
        """The stored value, MISSING when there is none; a stored error is raised."""
        value, err, _ = self._paths(key)
        if value.exists():
            return pickle.loads(value.read_bytes())
        if err.exists():
            raise EvidenceError(err.read_text())
        return MISSING

    def has(self, key: str) -> bool:
        """Whether `key` is stored; a stored error is raised."""
        value, err, _ = self._paths(key)
        if value.exists():
            return True
        if err.exists():
            raise EvidenceError(err.read_text())
        return False

    def get(self, key: str, compute: Callable[[], Any]) -> Any:
        """The value of `key`: stored, or compute() now (under the key's lock, so that
        another process asking meanwhile waits for it instead of computing it too)."""
        value, err, lock = self._paths(key)
        got = self.peek(key)
        if got is not MISSING:
            return got
        with FileLock(lock, timeout=self.lock_timeout_s):
            got = self.peek(key)
            if got is not MISSING:
                return got
            try:
                got = compute()
            except Exception as e:
                _atomic_write(err, f"{key}: {type(e).__name__}: {e}".encode())
                raise
            _atomic_write(value, pickle.dumps(got))
            return got

    # -- claims: a process about to compute a group of keys ----------------------------------
    def _claim_path(self, name: str) -> Path:
        return self.folder / f"claim--{_slug(name)}.json"

    def claimed_by(self, name: str) -> dict | None:
        """The live claim on `name` ({"pid", "worker"}); None where there is none, or its
        process is gone."""
        p = self._claim_path(name)
        try:
            owner = json.loads(p.read_text())
            pid = int(owner["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return owner if _alive(pid) else None

    def claim(self, name: str, worker: str) -> bool:
        """Claim `name` for this process; False where another live process holds it (a claim
        of a process that is gone is taken over)."""
        p = self._claim_path(name)
        with FileLock(p.with_suffix(".lock"), timeout=self.lock_timeout_s):
            owner = self.claimed_by(name)
            if owner is not None and owner["pid"] != os.getpid():
                return False
            _atomic_write(p, json.dumps({"pid": os.getpid(), "worker": worker}).encode())
            return True

    def release(self, name: str) -> None:
        p = self._claim_path(name)
        with FileLock(p.with_suffix(".lock"), timeout=self.lock_timeout_s):
            owner = self.claimed_by(name)
            if owner is not None and owner["pid"] == os.getpid():
                p.unlink(missing_ok=True)

    def wait(self, key: str, claim: str, timeout_s: float, poll_s: float = 0.5) -> Any:
        """The value of `key` once the claim's process stored it (an error it stored is
        raised); MISSING as soon as no live process claims `claim` and the key is still
        missing (the caller computes it then). Past `timeout_s`: EvidenceError."""
        t0 = time.monotonic()
        while True:
            got = self.peek(key)
            if got is not MISSING:
                return got
            owner = self.claimed_by(claim)
            if owner is None:
                got = self.peek(key)       # stored just before the claim was released
                return got
            if time.monotonic() - t0 > timeout_s:
                raise EvidenceError(f"{key}: not measured after {timeout_s:.0f} s by "
                                    f"{owner['worker']} (pid {owner['pid']}), which claimed "
                                    f"{claim}")
            time.sleep(poll_s)

