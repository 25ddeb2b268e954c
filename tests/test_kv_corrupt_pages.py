"""TokenSpeed's corruption hook checks every page against the pool's buffers on the host,
before any device op (kv_corrupt_tokenspeed.check_pages). Pure: no torch, no engine."""

import types

import pytest

from e2e_test.infra.engines import kv_corrupt_tokenspeed as kct


def _kv_args(pages: int = 8, item: int = 4096, layers: int = 2):
    """An MHA pool's KVArgs as TokenSpeed fills it: each layer's K, then its V."""
    n = 2 * layers
    return types.SimpleNamespace(kv_data_lens=[pages * item] * n, kv_item_lens=[item] * n,
                                 offsets=[(i, layers + i) for i in range(layers)])


def test_pages_inside_the_pool_pass():
    kct.check_pages(_kv_args(), [0, 3, 7])
    kct.check_pages(_kv_args(), [])


@pytest.mark.parametrize("page", [8, 9, -1, 10**6])
def test_a_page_outside_the_pool_is_refused_before_any_device_op(page):
    with pytest.raises(ValueError, match=rf"pages \[{page}\].*buffer 0: 8 pages of 4096 bytes"):
        kct.check_pages(_kv_args(), [1, page])


def test_a_smaller_buffer_bounds_the_pages():
    """Each buffer's own length counts: a page inside the K buffer but past a shorter V."""
    args = _kv_args()
    args.kv_data_lens[2] = 4 * 4096          # layer 0's V: 4 pages
    with pytest.raises(ValueError, match="layer 0's buffer 2: 4 pages"):
        kct.check_pages(args, [5])
