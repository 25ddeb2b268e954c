"""RayHandle's judgement of a node (pure logic: the actor is a named fake, Ray's clock and
`ray.get` are replaced). A call that times out is silence, and silence is loss only after
SILENT_LOST_S; what Ray reports as a dead or unreachable actor is loss at once.

The failure this guards against: on two busy cores, both nodes' status calls take over 5 s
while the engines initialise, and a rule of "no answer within 5 s: lost" fails a healthy 1p1d
boot naming both nodes lost (docs/lifecycle.md, table "Lifecycle figures")."""

from pathlib import Path

import pytest

# the `multinode` extra; .ci/run installs it
ray = pytest.importorskip("ray", reason="needs ray: pip install -e '.[multinode]'")

from e2e_test.infra.lifecycle import ray_launcher  # noqa: E402
from e2e_test.infra.specs.plan import Node  # noqa: E402


class FakeActorForUnitTest:
    """Stands in for a Ray actor handle: `x.method.remote()` gives the method's name."""
    def __getattr__(self, name):
        return type("M", (), {"remote": staticmethod(lambda *a: name)})


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def handle(monkeypatch, script):
    """A RayHandle whose calls answer from `script`: each item is an answer, or an exception
    raised after the call's own timeout has passed on the fake clock."""
    clock = Clock()
    monkeypatch.setattr(ray_launcher.time, "monotonic", clock)
    h = ray_launcher.RayHandle("decode-0", ["x"], Path("/nonexistent/log"),
                               Node(1, "10.77.0.3"), FakeActorForUnitTest())
    answers = iter(script)

    def get(ref, timeout):
        a = next(answers)
        if isinstance(a, BaseException):
            clock.t += timeout if isinstance(a, ray.exceptions.GetTimeoutError) else 0.1
            raise a
        clock.t += 0.01
        return a
    h.ray_get = get
    return h, clock


def timeout():
    return ray.exceptions.GetTimeoutError("timed out")


def test_a_stall_of_seconds_is_not_loss(monkeypatch):
    # 3 status calls of 5 s without an answer (15 s), then the node answers again.
    h, _ = handle(monkeypatch, [timeout(), timeout(), timeout(), (True, None)])
    assert all(h.alive() for _ in range(4))
    assert h.lost is None and h.silent_since is None


def test_silence_past_the_window_is_loss(monkeypatch):
    n = int(ray_launcher.SILENT_LOST_S / ray_launcher.STATUS_TIMEOUT_S)
    h, _ = handle(monkeypatch, [timeout()] * (n + 1))
    seen = [h.alive() for _ in range(n + 1)]
    assert seen[:n - 1] == [True] * (n - 1) and seen[-1] is False, seen
    assert "node 1 (10.77.0.3) lost: its actor has not answered for 60 s" == h.death_reason()


def test_an_answer_resets_the_silence(monkeypatch):
    n = int(ray_launcher.SILENT_LOST_S / ray_launcher.STATUS_TIMEOUT_S)
    script = ([timeout()] * (n - 1) + [(True, None)]) * 2
    h, _ = handle(monkeypatch, script)
    assert all(h.alive() for _ in range(len(script)))


def test_an_unreachable_actor_is_loss_at_once(monkeypatch):
    # What a killed raylet gives (measured: about 3 s after the kill).
    err = ray.exceptions.ActorUnavailableError("The actor is temporarily unavailable: "
                                               "RpcError: failed to connect", b"\x00" * 16)
    h, _ = handle(monkeypatch, [(True, None), err])
    assert h.alive() is True
    assert h.alive() is False
    assert h.death_reason().startswith("node 1 (10.77.0.3) lost: its actor died "
                                       "(ActorUnavailableError"), h.death_reason()


def test_an_exited_worker_is_not_a_lost_node(monkeypatch):
    h, _ = handle(monkeypatch, [(False, -9)])
    assert h.alive() is False and h.death_reason() == "signal 9" and h.lost is None


def test_a_start_that_timed_out_is_loss(monkeypatch):
    # RayLauncher.start waits 120 s for the actor's start: past the window at once.
    h, clock = handle(monkeypatch, [])
    clock.t += 120
    h.lose(timeout(), 120)
    assert h.lost and "not answered for 120 s" in h.lost


def test_silence_on_a_node_ray_declared_dead_is_loss_at_once(monkeypatch):
    # The GCS's own verdict (its health checks) ends the silence window early.
    h, _ = handle(monkeypatch, [timeout()])
    h.node_dead = lambda: True
    assert h.alive() is False
    assert h.death_reason().startswith("node 1 (10.77.0.3) lost: Ray reports the node dead")


def test_a_gcs_that_does_not_answer_gives_no_verdict(monkeypatch):
    def gcs_down():
        raise ConnectionError("GCS unreachable")
    h, _ = handle(monkeypatch, [timeout(), (True, None)])
    h.node_dead = gcs_down
    assert h.alive() is True and h.alive() is True and h.lost is None
