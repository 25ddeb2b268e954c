"""Error types. The first line of every message is a sentence a user can act on."""


class HarnessError(Exception):
    """Base class: bad input, a failed precondition, or a failed run."""

    def __init__(self, summary: str, details: str = ""):
        super().__init__(summary + (("\n" + details) if details else ""))
        self.summary = summary
        self.details = details

    def add_detail(self, line: str) -> None:
        """`line` first in the details; the summary stays the message's first line."""
        self.details = line + (("\n" + self.details) if self.details else "")
        self.args = (self.summary + "\n" + self.details,)


class ConfigError(HarnessError):
    """Invalid registry entry, topology string, device list, dataset folder or option.

    Raised before any process starts."""


class SettingError(ConfigError):
    """A variable (or the option standing for it) has a value the harness does not accept."""


class StartupError(HarnessError):
    """A worker or the gateway failed to become ready."""


class StallError(HarnessError):
    """In-flight requests made no progress for the watchdog window."""


class TeardownError(HarnessError):
    """Something survived teardown: a process, a port, GPU memory or a /dev/shm segment."""


class WorkerDied(HarnessError):
    """A worker or the gateway exited while requests were running."""


class UpstreamBug(WorkerDied):
    """A worker died of a bug of the engine or the gateway that the engine module names
    (Engine.known_crashes): the message says which, in one sentence, with its upstream
    reference. Tests that cannot pass until it is fixed are `xfail(raises=UpstreamBug)`.
    docs/upstream.md lists every upstream finding of the harness."""


class PreflightError(HarnessError):
    """What an earlier run left (processes, GPU memory held by others) blocks this start."""
