"""scripts/probe_boot.py --first-forward over a hand-made speedscope file (pure logic): the
first forward's span runs from the first sample inside a forward frame to the last one before
a pause of more than half a second, and each of its samples is counted under its innermost
known cost."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("probe_boot", ROOT / "scripts" / "probe_boot.py")
probe_boot = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe_boot)

FRAMES = [
    {"name": "run_event_loop", "file": "tokenspeed/runtime/engine/event_loop.py"},       # 0
    {"name": "EventLoop._dispatch_forward", "file": "tokenspeed/runtime/engine/event_loop.py"},  # 1
    {"name": "CompileCallable.__call__", "file": "nvidia_cutlass_dsl/cutlass/base_dsl/compiler.py"},  # 2
    {"name": "triton_key", "file": "triton/runtime/cache.py"},                            # 3
    {"name": "compile_wrapper", "file": "torch/_dynamo/eval_frame.py"},                   # 4
    {"name": "Socket.recv_pyobj", "file": "zmq/sugar/socket.py"},                          # 5
    {"name": "torch_mm", "file": "tokenspeed_kernel/ops/gemm.py"},                         # 6
    # py-spy's frame of the process: no file, named by its command line
    {"name": 'process 7:"python3 -m e2e_warm_spawn --call triton.runtime.cache:triton_key"',
     "file": "", "line": 0},                                                                # 7
]


def _doc(samples):
    return {"shared": {"frames": FRAMES},
            "profiles": [{"type": "sampled", "name": "Process 1 Thread 1 \"MainThread\"",
                          "unit": "seconds", "samples": samples,
                          "weights": [0.01] * len(samples)}]}


def test_first_forward_span_and_costs(tmp_path, capsys):
    idle = [7, 0, 5]
    fwd = [7, 0, 1]
    samples = ([idle] * 100                      # 1 s idle: not part of it
               + [fwd + [2]] * 50 + [fwd + [3]] * 20 + [fwd + [4]] * 10 + [fwd + [6]] * 20
               + [idle] * 30                     # a pause under 0.5 s: still the same forward
               + [fwd + [6]] * 10
               + [idle] * 80                     # a pause over 0.5 s: the first forward ended
               + [fwd + [2]] * 40)               # a later forward: not counted
    (tmp_path / "w.json").write_text(json.dumps(_doc(samples)))
    assert probe_boot.first_forward(tmp_path, 100) == 0
    out = capsys.readouterr().out
    assert "first forward 1.00-2.39 s (1.40 s)" in out, out
    assert "0.50 s  CuTe DSL (cute.compile)" in out
    assert "0.20 s  triton's cache key" in out
    assert "0.10 s  torch.compile" in out
    # 30 idle + 30 gemm samples inside the span; not "triton's cache key" although the
    # process's frame at the bottom of each of them names triton_key
    assert "0.60 s  other" in out


def test_negative_control_no_forward_no_line(tmp_path, capsys):
    (tmp_path / "w.json").write_text(json.dumps(_doc([[7, 0, 5]] * 200)))
    (tmp_path / "probe-boot.json").write_text(json.dumps({"profiles": []}))
    (tmp_path / "broken.json").write_text("{")
    assert probe_boot.first_forward(tmp_path, 100) == 0
    assert capsys.readouterr().out == ""
