"""A FAKE engine for the harness's unit tests (never a stand-in for a real one).

A stdlib HTTP server that speaks just enough of the OpenAI API for the smg gateway and the
Cluster's readiness: /health, /v1/models, /v1/chat/completions (echoes a fixed reply) and a
Prometheus /metrics with one work counter. Failure modes for Cluster tests, from the env:

  FAKE_ENGINE_DELAY_S=S           sleep S seconds before binding (a slow start)
  FAKE_ENGINE_EXIT=CODE           print an error line and exit with CODE instead of serving
  FAKE_ENGINE_BUSY_ONCE=FILE      if FILE does not exist: create it, print "Address already
                                  in use" and exit 1 (a port collision, once)
  FAKE_ENGINE_IGNORE_TERM=1       ignore SIGTERM (a worker that needs SIGKILL)
  FAKE_ENGINE_IMPORT_S=S          its imports take S seconds (fake_engine_import.py; run as
                                  `-m fake_engine_server` with tests/ on PYTHONPATH)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

try:                    # beside it, run by path or as `-m fake_engine_server`
    import fake_engine_import
except ImportError:     # its folder not on the path
    fake_engine_import = None

COUNTER = "fake:tokens_total"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", required=True)
    a = p.parse_args()
    print(f"fake engine: model {a.model} port {a.port}, pid {os.getpid()}, imported at "
          f"{getattr(fake_engine_import, 'IMPORTED_AT', None)}", flush=True)
    if os.environ.get("FAKE_ENGINE_IGNORE_TERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(float(os.environ.get("FAKE_ENGINE_DELAY_S", "0")))
    if os.environ.get("FAKE_ENGINE_EXIT"):
        print("RuntimeError: fake engine told to fail at start", flush=True)
        return int(os.environ["FAKE_ENGINE_EXIT"])
    busy = os.environ.get("FAKE_ENGINE_BUSY_ONCE")
    if busy and not os.path.exists(busy):
        open(busy, "w").close()
        print("OSError: [Errno 98] Address already in use", flush=True)
        return 1
    served = {"tokens": 0}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, code: int, body, ctype="application/json"):
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                return self._send(200, b"", "text/plain")
            if self.path == "/v1/models":
                return self._send(200, {"object": "list", "data": [
                    {"id": a.model, "object": "model", "owned_by": "fake"}]})
            if self.path == "/metrics":
                text = f"# TYPE {COUNTER} counter\n{COUNTER} {served['tokens']}\n"
                return self._send(200, text.encode(), "text/plain")
            return self._send(404, {"error": "not found"})

        def do_POST(self):
            n = int(self.headers.get("Content-Length") or 0)
            req = json.loads(self.rfile.read(n) or b"{}")
            if self.path != "/v1/chat/completions":
                return self._send(404, {"error": "not found"})
            served["tokens"] += 3
            return self._send(200, {
                "id": "fake-1", "object": "chat.completion", "created": int(time.time()),
                "model": req.get("model", a.model),
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": "OK fake"}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}})

    ThreadingHTTPServer(("127.0.0.1", a.port), Handler).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
