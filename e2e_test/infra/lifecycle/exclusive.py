"""The device lock of a session: tests that share the device against one that needs it alone.

Every test on a device holds the lock shared; a test timed against an engine's own pace (a
cancel, an idle check) holds it exclusively, so that no other process's test runs or boots
during it. Processes (pytest-xdist workers) share it through two files in the session's
scratch folder, locked with flock(2): `device.lock`, shared or exclusive, and `gate.lock`, which
a process holds exclusively while it waits for `device.lock`, so that a waiting exclusive
taker is not starved by shared takers that keep overlapping (a shared taker passes the gate
first). flock locks go with the open file, and the kernel drops them when their process dies.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path


class DeviceLock:
    def __init__(self, folder: Path | str):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def _locked(self, name: str, how: int):
        fd = os.open(self.folder / name, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, how)
            yield
        finally:
            os.close(fd)        # closing the file releases its lock

    @contextlib.contextmanager
    def _take(self, how: int):
        with contextlib.ExitStack() as held:
            with self._locked("gate.lock", fcntl.LOCK_EX):
                held.enter_context(self._locked("device.lock", how))
            yield

    def shared(self):
        return self._take(fcntl.LOCK_SH)

    def exclusive(self):
        return self._take(fcntl.LOCK_EX)
