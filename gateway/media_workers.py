"""Running work on a request's media bytes on the media threads (`media.load_workers`).

A thread cannot be stopped from outside, and a decode that runs on after its request is gone holds memory the
budget no longer counts. So work cancelled before it starts never starts; work cancelled while it runs is told to
stop (its `DecodeControl`) and is waited for, so the caller returns, and gives back the budget it holds, only
once the thread has let go of the item. Whatever a client's bytes make a decoder raise is the client's error: a
400 naming the item, never a 500.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from gateway.errors import BadRequest, GatewayError, RequestTooLarge
from gateway.image_loader import DecodeCancelled, DecodeControl

T = TypeVar("T")


async def run_on_worker(
    executor: ThreadPoolExecutor, locator: str, call: Callable[[], T], *, control: DecodeControl | None = None
) -> T:
    """`call()` on a media thread; the item's `locator` names it in errors."""
    future = executor.submit(_as_client_error, locator, call)
    try:
        return await asyncio.wrap_future(future)
    except asyncio.CancelledError:
        if not future.cancel():  # already running
            if control is not None:
                control.cancel()
            await _finished(future)
        raise


async def _finished(future: Future[Any]) -> None:
    """Wait until the thread is done with `future`, through any further cancellation of the caller."""
    waiter = asyncio.wrap_future(future)
    while not waiter.done():
        try:
            await asyncio.shield(waiter)
        except asyncio.CancelledError:
            continue
        except Exception:
            break  # the caller is cancelled: the work's own error is of no use to it
    if not waiter.cancelled():
        waiter.exception()  # retrieved, so it is never reported as unhandled


def _as_client_error(locator: str, call: Callable[[], T]) -> T:
    try:
        return call()
    except (GatewayError, DecodeCancelled):
        raise
    except MemoryError:
        raise RequestTooLarge(f"{locator}: decoding this item ran out of memory", reason="media_too_large") from None
    except Exception as exc:
        raise BadRequest(
            f"{locator}: media cannot be decoded ({type(exc).__name__}: {exc})", reason="bad_media"
        ) from exc
