"""Progress lines: a worker's state from its log markers, at most one line per interval."""

from types import SimpleNamespace

import pytest

from e2e_test.infra.cluster import progress
from e2e_test.infra.errors import ConfigError

VLLM_LOG = """\
(EngineCore pid=10453) INFO 12-01 08:19:04 [core.py:133] Initializing a V1 LLM engine (v0.32.0)
(Worker pid=10508) INFO 12-01 08:19:13 [cpu_model_runner.py:68] Starting to load model /m...
(Worker pid=10508) INFO 12-01 08:19:14 [default_loader.py:501] Loading weights took 0.56 seconds
(EngineCore pid=10453) INFO 12-01 08:19:16 [utils.py:347] Using LBHNC KV cache layout.
(Worker pid=10508) INFO 12-01 08:19:16 [cpu_model_runner.py:87] Warming up model for the compilation...
(Worker pid=10508) INFO 12-01 08:20:37 [cpu_model_runner.py:91] Warming up done.
(APIServer pid=10303) INFO 12-01 08:20:43 [entry.py:140] Starting vLLM server on http://127.0.0.1:1
"""


def test_state_is_the_last_marker_in_the_log():
    lines = VLLM_LOG.splitlines(keepends=True)
    assert progress.state_of("".join(lines[:1])) == "initializing engine"
    assert progress.state_of("".join(lines[:2])) == "loading weights"
    assert progress.state_of("".join(lines[:3])) == "weights loaded"
    assert progress.state_of("".join(lines[:5])) == "compiling / warming up"
    assert progress.state_of("".join(lines[:6])) == "engine initialized"
    assert progress.state_of(VLLM_LOG) == "serving, waiting for health"
    assert progress.state_of("Triton is installed, but doesn't include CPU backend.") is None


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _worker(name, log, started=90.0):
    return SimpleNamespace(name=name, ready_s=None, command=SimpleNamespace(metadata={}),
                           process=SimpleNamespace(log_path=str(log), started_at=started))


def test_boot_progress_one_line_per_interval_with_each_role(tmp_path, monkeypatch):
    lines = []
    monkeypatch.setattr(progress, "sink", lines.append)
    clock = Clock()
    p_log, d_log = tmp_path / "p.log", tmp_path / "d.log"
    p_log.write_text(VLLM_LOG.splitlines(keepends=True)[1])
    d_log.write_text("")
    p, d = _worker("prefill-0", p_log), _worker("decode-0", d_log)
    boot = progress.BootProgress("1p1d", [p, d], every_s=10, clock=clock)
    assert boot.tick([p, d]) is None                 # negative control: not yet 10 s
    clock.t += 10
    assert boot.tick([p, d]) == "1p1d booting: prefill-0 loading weights, 20 s; decode-0 " \
                                "starting, 20 s"
    assert boot.tick([p, d]) is None                 # same instant: no second line
    with open(p_log, "a") as f:                      # the log grows; only the new part is read
        f.write("".join(VLLM_LOG.splitlines(keepends=True)[2:5]))
    d.ready_s = 21.3
    clock.t += 10
    assert boot.tick([p]) == "1p1d booting: prefill-0 compiling / warming up, 30 s; " \
                             "decode-0 ready in 21.3 s"
    assert len(lines) == 2
    assert progress.BootProgress("1", [p], every_s=0, clock=clock).tick([p]) is None


def test_engine_markers_override_the_defaults(tmp_path):
    log = tmp_path / "w.log"
    log.write_text("stage two begins\n")
    w = _worker("worker-0", log)
    w.command.metadata["progress_markers"] = ((r"stage two", "stage 2"),)
    boot = progress.BootProgress("1", [w], every_s=1, clock=Clock())
    assert "worker-0 stage 2" in boot.line([w])


def test_load_progress_and_the_interval_setting(monkeypatch):
    monkeypatch.setattr(progress, "sink", lambda line: None)
    clock = Clock()
    lp = progress.LoadProgress("gsm8k on 1", 32, every_s=10, clock=clock)
    assert lp.tick(3) is None
    clock.t += 12
    assert lp.tick(12) == "gsm8k on 1: 12/32 done, 12 s"
    clock.t += 12
    assert lp.tick(32) is None                       # finished: the caller prints the summary
    assert progress.interval_s({}) == 10 and progress.interval_s({"E2E_PROGRESS_S": "0"}) == 0
    with pytest.raises(ConfigError, match="E2E_PROGRESS_S"):
        progress.interval_s({"E2E_PROGRESS_S": "often"})


def test_a_failing_sink_never_breaks_a_run(capsys):
    """The sink of a finished nested pytest session writes to a closed file: the line goes to
    stderr instead of raising into a cluster's boot (seen in the CPU lane)."""
    def closed(_line):
        raise ValueError("I/O operation on closed file.")
    before = progress.sink
    progress.set_sink(closed)
    try:
        progress.emit("1 booting: worker-0 starting, 10 s")
    finally:
        progress.set_sink(before)
    assert "worker-0 starting" in capsys.readouterr().err


def test_the_engine_phrases_come_from_the_engines():
    """vLLM's own phrases are its engine module's (Engine.progress_markers); the generic list
    names no engine."""
    from e2e_test.infra.engines import vllm
    assert not any("vLLM" in p for p, _ in progress.MARKERS)
    assert set(vllm.ENGINE.progress_markers) <= set(progress.known_markers())
    assert progress.state_of(VLLM_LOG, progress.MARKERS) != "serving, waiting for health"


def test_boot_phases_are_when_each_state_was_first_seen(tmp_path, monkeypatch):
    """Every state in a read is noted with the time it was first seen (several in one read
    share it), whatever was printed; later reads never move an earlier state."""
    monkeypatch.setattr(progress, "sink", lambda line: None)
    clock = Clock()
    log = tmp_path / "w.log"
    log.write_text("")
    w = _worker("worker-0", log, started=100.0)
    boot = progress.BootProgress("1", [w], every_s=10, clock=clock)
    clock.t = 125.0
    boot.tick([w])
    assert boot.phases == {"worker-0": {}}           # nothing logged yet: still starting
    log.write_text(VLLM_LOG.splitlines(keepends=True)[0])
    boot.tick([w])
    clock.t = 130.0
    with open(log, "a") as f:
        f.write("".join(VLLM_LOG.splitlines(keepends=True)[1:3]))
    boot.tick([w])
    clock.t = 150.0
    with open(log, "a") as f:
        f.write("".join(VLLM_LOG.splitlines(keepends=True)[3:]) + VLLM_LOG)
    boot.tick([w])
    assert boot.phases["worker-0"] == {
        "initializing engine": 25.0, "loading weights": 30.0, "weights loaded": 30.0,
        "compiling / warming up": 50.0, "engine initialized": 50.0,
        "serving, waiting for health": 50.0}


def test_states_in_order_of_first_occurrence():
    assert progress.states_in(VLLM_LOG)[:3] == ["initializing engine", "loading weights",
                                                 "weights loaded"]
    assert progress.states_in("nothing here") == []


def test_tokenspeed_boot_markers_read_its_h200_log():
    from e2e_test.infra.engines import tokenspeed
    log = ("[2026-12-01 22:49:54,587 None] - INFO - Inferred world_size (1) from attn_tp_size\n"
           "2026-12-01 22:49:54,612 [smg_grpc_servicer.tokenspeed.server] INFO Launching "
           "TokenSpeed scheduler + AsyncLLM...\n"
           "Loading safetensors checkpoint shards:   0% Completed | 0/1\n"
           "[2026-12-01 22:50:18,359  ATTN TP RANK 0] - WARNING - KVStore L2 cache will not be "
           "used during normal execution (event_loop.py:277)\n")
    assert set(tokenspeed.ENGINE.progress_markers) <= set(progress.known_markers())
    assert progress.states_in(log) == ["server imported, starting engine", "loading weights",
                                       "allocating KV cache"]


def test_a_config_dump_is_no_compile():
    """The engine's config line names compile settings long before anything compiles; only a
    line that starts or reports a compile is that state."""
    config = ("(EngineCore pid=1) INFO [core.py:133] Initializing a V1 LLM engine (v0.32.0) "
              "with config: compilation_config={'compile_sizes': None, 'compile_mm_encoder': "
              "False}\n(APIServer pid=2) WARNING Enforce eager set, disabling torch.compile and "
              "CUDAGraphs.\n")
    assert progress.states_in(config) == ["initializing engine"]
    assert progress.state_of("INFO torch.compile takes 12.3 s in total") == \
        "compiling / warming up"
    assert progress.state_of("Capturing CUDA graphs (mixed prefill-decode, PIECEWISE)") == \
        "compiling / warming up"


def test_a_worker_relaunched_into_a_new_log_is_read_from_its_start(tmp_path, monkeypatch):
    """A worker moved to other ports (address in use) writes a new log: its state and phases
    start over from that log and its own launch, not from the old log's offset."""
    monkeypatch.setattr(progress, "sink", lambda line: None)
    clock = Clock()
    old, new = tmp_path / "w.log", tmp_path / "w.1.log"
    old.write_text(VLLM_LOG)
    w = _worker("worker-0", old, started=100.0)
    boot = progress.BootProgress("1", [w], every_s=10, clock=clock)
    clock.t = 110.0
    boot.tick([w])
    assert boot.states["worker-0"] == "serving, waiting for health"
    new.write_text(VLLM_LOG.splitlines(keepends=True)[0])
    w.process = SimpleNamespace(log_path=str(new), started_at=111.0)
    clock.t = 115.0
    boot.tick([w])
    assert boot.states["worker-0"] == "initializing engine"
    assert boot.phases["worker-0"] == {"initializing engine": 4.0}
