"""What the FAKE engine's server imports (tests/fake_engine_server.py), with
FAKE_ENGINE_IMPORT_S=S seconds of import time: a heavy runtime's imports, for the held
restarts of Cluster.hold_restarts (tests/test_cluster.py). Never part of a real engine."""

import os
import time

time.sleep(float(os.environ.get("FAKE_ENGINE_IMPORT_S", "0")))
IMPORTED_AT = time.time()
