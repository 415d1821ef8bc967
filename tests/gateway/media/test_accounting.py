from __future__ import annotations

import numpy as np
import pytest

from gateway.errors import RequestTooLarge
from gateway.media.accounting import RequestAccount


def test_raw_body_is_charged_first() -> None:
    account = RequestAccount(1000, raw_body_bytes=600)
    account.charge(300, "decoded media")
    with pytest.raises(RequestTooLarge) as raised:
        account.charge(200, "decoded media")
    assert raised.value.message == (
        "decoded media reached 1,100 bytes (raw body 600 included), over "
        "limits.max_multimodal_cpu_bytes_per_request=1,000"
    )


def test_views_of_counted_storage_add_nothing() -> None:
    account = RequestAccount(10_000)
    array = np.zeros(4000, dtype=np.uint8)
    assert account.count_storage(array) == 4000
    assert account.count_storage(array[100:200]) == 0
    assert account.total == 4000


def test_no_cap_counts_without_refusing() -> None:
    account = RequestAccount(None, raw_body_bytes=10)
    account.charge(1 << 40, "decoded media")
    assert account.total == (1 << 40) + 10


def test_settle_replaces_a_prediction_with_the_storage_itself() -> None:
    account = RequestAccount(100_000)
    account.charge(30_000, "decoded media")  # predicted from a header
    image = np.zeros((100, 100, 3), dtype=np.uint8)
    account.settle(30_000, image)
    assert account.total == 30_000
    account.settle(0, image[::2])  # a view of the same pixels adds nothing
    assert account.total == 30_000
