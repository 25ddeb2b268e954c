"""The window preflight before bursts (bursts.check_window): pure, no engine started. The e2e
side (a real small-window `1` refused without admission) is in e2e_test/router/test_burst.py."""

import pytest

from e2e_test.infra.cluster.gateway import Admission
from e2e_test.infra.load.bursts import WindowError, check_window


def w(n, stage="regular", source="/server_info"):
    return {"max_num_seqs": n, "source": source, "stage": stage}


def test_window_holding_the_burst_passes():
    assert check_window({"worker-0": w(256)}, 16, None) == {"regular": 256}


def test_dp_workers_add_up():
    assert check_window({"worker-0": w(8), "worker-1": w(8)}, 16, None) == {"regular": 16}


def test_small_window_without_admission_names_both_numbers():
    with pytest.raises(WindowError) as ei:
        check_window({"worker-0": w(2)}, 16, None)
    msg = str(ei.value)
    assert "a burst of 16" in msg and "the window is 2" in msg and "worker-0: 2" in msg
    assert "configure admission" in msg and "give a window >= 16" in msg
    assert "\n" not in msg


def test_pd_smallest_stage_counts():
    with pytest.raises(WindowError, match=r"the window is 2: decode \(decode-0: 2\)"):
        check_window({"prefill-0": w(64, "prefill"), "decode-0": w(2, "decode")}, 8, None)


def test_small_window_with_admission_at_the_window_passes():
    adm = Admission(max_concurrent_requests=2, queue_size=2)
    assert check_window({"worker-0": w(2)}, 16, adm) == {"regular": 2}


def test_admission_above_the_window_fails():
    adm = Admission(max_concurrent_requests=8, queue_size=0)
    with pytest.raises(WindowError, match="smg admits 8 at once, but the window is 2"):
        check_window({"worker-0": w(2)}, 16, adm)


@pytest.mark.parametrize("admission", [None, Admission(max_concurrent_requests=2)])
def test_unknown_window_fails_even_with_admission(admission):
    unknown = {"max_num_seqs": None, "source": "unknown", "error": "RpcError: down"}
    with pytest.raises(WindowError) as ei:
        check_window({"worker-0": unknown}, 16, admission)
    msg = str(ei.value)
    assert "window of worker-0 is unknown" in msg and "RpcError: down" in msg
    assert "a burst of 16" in msg and "give the window" in msg


def test_no_serving_worker_fails():
    with pytest.raises(WindowError, match="no serving worker"):
        check_window({}, 4, None)


# --- the window a worker reports after the burst (test_burst.py's check) ------------------

from e2e_test.infra.load.bursts import check_effective_window


def test_effective_window_as_started_passes():
    assert check_effective_window(w(2), 2, "worker-0") == 2


def test_unknown_effective_window_fails():
    """test_burst.py accepted an unknown window (max_num_seqs None) as a pass."""
    unknown = {"max_num_seqs": None, "source": "unknown", "error": "/server_info HTTP 404"}
    with pytest.raises(WindowError, match=r"window of decode-0 is unknown \(unknown: "
                       r"/server_info HTTP 404\)"):
        check_effective_window(unknown, 2, "decode-0")
    with pytest.raises(WindowError, match="unknown"):
        check_effective_window({}, 2)


def test_other_effective_window_fails():
    with pytest.raises(WindowError, match="runs a window of 256, the burst was meant for 2"):
        check_effective_window(w(256), 2, "worker-0")
