from __future__ import annotations

import threading

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


def test_every_charge_after_the_cap_is_passed_names_the_charge_that_passed_it() -> None:
    """Items charged at once from several threads: whichever is reported, the message is the same."""
    account = RequestAccount(1000)
    with pytest.raises(RequestTooLarge) as first:
        account.charge(1200, "decoded media")
    with pytest.raises(RequestTooLarge) as later:
        account.charge(500, "processed tensors")
    assert (
        first.value.message
        == later.value.message
        == ("decoded media reached 1,200 bytes, over limits.max_multimodal_cpu_bytes_per_request=1,000")
    )
    assert account.total == 1700


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


def test_settles_from_several_threads_are_all_counted() -> None:
    """The media threads loading a request's items count their storage at once: none is lost."""
    account = RequestAccount(None)
    start = threading.Barrier(4)
    arrays = [[np.zeros(10, dtype=np.uint8) for _ in range(3000)] for _ in range(4)]

    def settle(mine: list[np.ndarray]) -> None:
        start.wait()
        for array in mine:
            account.settle(0, array)
            account.charge(1, "decoded media")

    threads = [threading.Thread(target=settle, args=(mine,)) for mine in arrays]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert account.total == 4 * 3000 * (10 + 1)
