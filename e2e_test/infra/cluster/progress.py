"""Progress lines for long work, few enough for a CI log: one line per interval, not per step.

- `BootProgress`: while a topology boots, every E2E_PROGRESS_S seconds (default 10) one line
  with each role's state, e.g. "1p1d booting: prefill-0 loading weights, 23 s; decode-0 ready
  in 21.3 s". The state is the latest log marker a worker has written (read incrementally from
  its log), or "ready" once its health probe answered.
- `LoadProgress`: during an eval or burst, every interval "gsm8k on 1: 12/32 done, 10 s".

Lines go to `sink` (default: stderr, flushed); the pytest plugin points the sink past the
output capture so a lane's log shows them live. E2E_PROGRESS_S=0 turns them off.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

from ..engines import all_engines
from ..specs import settings

# (regex, state): the state of a worker is that of the marker found last in its log. Phrases
# any server may write (uvicorn, SGLang-style servers); each engine adds its own
# (Engine.progress_markers, read by `known_markers()`), and a WorkerCommand may give its own
# list as `metadata["progress_markers"]`.
MARKERS: tuple[tuple[str, str], ...] = (
    (r"init(ializ)?ing (the )?engine", "initializing engine"),
    (r"Starting to load model|Loading safetensors|Load weight begin|loading weights",
     "loading weights"),
    (r"Loading weights took|Load weight end|Model loading took", "weights loaded"),
    # Lines that start or report a compile; not the bare word, which a worker's config dump
    # (`compile_sizes`, "disabling torch.compile" under eager) carries long before any
    # compiling (boot phases would date the compile from the config line).
    (r"Warming up model|torch\.compile takes|Dynamo bytecode transform|\bcompiling\b"
     r"|Capturing (cuda |CUDA )?graph", "compiling / warming up"),
    (r"KV cache size|Available KV cache|allocat\w* KV cache|Memory profiling",
     "allocating KV cache"),
    (r"init engine .* took|Warming up done|Graph capturing finished", "engine initialized"),
    (r"Uvicorn running|Application startup complete|server is fired up",
     "serving, waiting for health"),
)


def known_markers() -> tuple[tuple[str, str], ...]:
    """The generic markers, then every registered engine's own (Engine.progress_markers)."""
    out = list(MARKERS)
    for e in all_engines():
        out += [m for m in e.progress_markers if m not in out]
    return tuple(out)


def _sink_default(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


sink = _sink_default


def set_sink(fn) -> None:
    global sink
    sink = fn


def emit(line: str) -> None:
    """A progress line never breaks a run: a sink that fails (a closed terminal, the
    reporter of a finished nested pytest session) falls back to stderr."""
    try:
        sink(line)
    except (ValueError, OSError):
        try:
            _sink_default(line)
        except (ValueError, OSError):
            pass


def interval_s(environ: dict | None = None) -> float:
    """E2E_PROGRESS_S, checked by settings.py (0 turns progress off)."""
    return float(settings.get("E2E_PROGRESS_S", environ))


def states_in(text: str, markers=None) -> list[str]:
    """Every state whose marker occurs in `text`, in the order of their first occurrence."""
    first: dict[str, int] = {}
    for pattern, state in (known_markers() if markers is None else markers):
        m = re.search(pattern, text, flags=re.IGNORECASE)
        if m and (state not in first or m.start() < first[state]):
            first[state] = m.start()
    return sorted(first, key=first.get)


def state_of(text: str, markers=None) -> str | None:
    """The state of the marker that occurs last in `text`, None when none does; `markers`:
    (regex, state) pairs, by default `known_markers()`."""
    best, pos = None, -1
    for pattern, state in (known_markers() if markers is None else markers):
        for m in re.finditer(pattern, text, flags=re.IGNORECASE):
            if m.start() >= pos:        # a tie: the later, more specific marker
                best, pos = state, m.start()
    return best


class BootProgress:
    """Call `tick(pending)` from the readiness loop; it prints at most one line per interval,
    and reads the pending workers' new log lines on every call, noting when each state was
    first seen (`phases`: worker -> {state: seconds since its launch}; as fine as the loop's
    poll, 0.25 s). Workers are duck-typed: name, ready_s, process.log_path,
    process.started_at, command."""

    def __init__(self, topology: str, workers, every_s: float | None = None, clock=None):
        self.topology, self.workers = topology, list(workers)
        self.every = interval_s() if every_s is None else every_s
        self.clock = clock or time.monotonic
        self.next_at = self.clock() + self.every
        self.offsets: dict[str, int] = {}
        self.tails: dict[str, bytes] = {}
        self.states: dict[str, str] = {}
        self.phases: dict[str, dict[str, float]] = {}
        self.paths: dict[str, Path] = {}
        self.markers = known_markers()

    def observe(self, pending) -> None:
        """Read every pending worker's new log lines: its state, and when each state was
        first seen."""
        for w in pending:
            self._read_state(w)

    def _read_state(self, w) -> str:
        path = Path(getattr(w.process, "log_path", "") or "")
        markers = (getattr(getattr(w, "command", None), "metadata", None) or {}).get(
            "progress_markers") or self.markers
        if self.paths.setdefault(w.name, path) != path:
            # relaunched (a port taken meanwhile: Cluster._handle_early_exit) into a new log:
            # read it from its start, and its phases from its own launch
            self.paths[w.name] = path
            for d in (self.offsets, self.tails, self.states, self.phases):
                d.pop(w.name, None)
        try:
            with open(path, "rb") as f:
                f.seek(self.offsets.get(w.name, 0))
                # with the last bytes of the previous read, so a marker split across two
                # reads is still found
                chunk = self.tails.get(w.name, b"") + f.read()
                self.offsets[w.name] = f.tell()
        except OSError:
            chunk = b""
        self.tails[w.name] = chunk[-200:]
        text = chunk.decode(errors="replace")
        found = state_of(text, markers)
        if found:
            self.states[w.name] = found
        t0 = getattr(w.process, "started_at", None)
        if t0 is not None:
            seen = self.phases.setdefault(w.name, {})
            for state in states_in(text, markers):
                seen.setdefault(state, round(self.clock() - t0, 2))
        return self.states.get(w.name, "starting")

    def line(self, pending) -> str:
        self.observe(pending)
        now = self.clock()
        parts = []
        for w in self.workers:
            if w in pending:
                t0 = getattr(w.process, "started_at", None)
                age = f", {now - t0:.0f} s" if t0 is not None else ""
                parts.append(f"{w.name} {self.states.get(w.name, 'starting')}{age}")
            elif getattr(w, "ready_s", None) is not None:
                parts.append(f"{w.name} ready in {w.ready_s:.1f} s")
        return f"{self.topology} booting: " + "; ".join(parts)

    def tick(self, pending) -> str | None:
        self.observe(pending)
        if not self.every or not pending or self.clock() < self.next_at:
            return None
        self.next_at = self.clock() + self.every
        text = self.line(pending)
        emit(text)
        return text


class LoadProgress:
    """n/N done for a load run; `tick(done)` prints at most one line per interval."""

    def __init__(self, label: str, total: int, every_s: float | None = None, clock=None):
        self.label, self.total = label, total
        self.every = interval_s() if every_s is None else every_s
        self.clock = clock or time.monotonic
        self.t0 = self.clock()
        self.next_at = self.t0 + self.every

    def tick(self, done: int) -> str | None:
        if not self.every or self.clock() < self.next_at or done >= self.total:
            return None
        self.next_at = self.clock() + self.every
        text = f"{self.label}: {done}/{self.total} done, {self.clock() - self.t0:.0f} s"
        emit(text)
        return text
