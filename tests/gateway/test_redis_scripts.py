"""`gateway.redis_scripts.ScriptRunner` against a real `redis-server` on a free loopback port."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from gateway.redis_scripts import ScriptRunner, pack
from tests.redis_server import RedisServer

SCRIPTS = {
    "add": "return redis.call('INCRBY', KEYS[1], ARGV[1])",
    "echo": "return {KEYS[1], ARGV[1], ARGV[2]}",
    "fail": "return redis.error_reply('no such thing: ' .. ARGV[1])",
    # Busy for a while: Redis answers nothing else meanwhile (about 0.3 s for 30 million turns).
    "slow": "for _ = 1, tonumber(ARGV[1]) do end return 1",
}


def runner(server: RedisServer, *, max_connections: int = 4, wait_timeout_s: float = 1.0) -> ScriptRunner:
    pool = aioredis.BlockingConnectionPool.from_url(server.url, socket_timeout=2.0, decode_responses=True)
    return ScriptRunner(
        pool, SCRIPTS, f"{{t:{uuid.uuid4().hex[:8]}}}", max_connections=max_connections, wait_timeout_s=wait_timeout_s
    )


def test_pack_writes_resp_bulk_strings() -> None:
    assert pack(b"EVALSHA", b"ab", b"") == b"*3\r\n$7\r\nEVALSHA\r\n$2\r\nab\r\n$0\r\n\r\n"


async def test_a_script_runs_with_its_key_and_arguments_and_loads_itself_when_redis_lost_it(
    redis_server: RedisServer,
) -> None:
    scripts = runner(redis_server)
    try:
        key = scripts._key.decode()
        assert await scripts("echo", "a", 7) == [key, "a", "7"]
        assert await scripts("add", 2) == 2
        redis_server.client().script_flush()
        assert await scripts("add", 3) == 5  # NOSCRIPT answered by sending the source
        assert await scripts("add", 1) == 6
        assert scripts.connections == 1  # one caller at a time: one connection, reused
    finally:
        await scripts.aclose()


async def test_a_scripts_error_is_raised_and_its_connection_stays_usable(redis_server: RedisServer) -> None:
    scripts = runner(redis_server, max_connections=1)
    try:
        with pytest.raises(ResponseError, match="no such thing: x"):
            await scripts("fail", "x")
        assert await scripts("add", 4) == 4
        assert scripts.connections == 1
    finally:
        await scripts.aclose()


async def test_callers_past_the_connection_cap_wait_in_turn_and_time_out_naming_the_cap(
    redis_server: RedisServer,
) -> None:
    scripts = runner(redis_server, max_connections=2, wait_timeout_s=0.2)
    try:
        results = await asyncio.gather(*(scripts("add", 1) for _ in range(20)))
        assert sorted(results) == list(range(1, 21))
        assert scripts.connections == 2
        # Both connections taken: a caller waits, gets the first one given back, or gives up after 0.2 s.
        held = [await scripts._acquire(), await scripts._acquire()]
        with pytest.raises(RedisConnectionError, match=r"within 0.2 s \(2 in use\)"):
            await scripts("add", 1)
        waiting = asyncio.ensure_future(scripts("add", 1))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        scripts._release(held.pop())
        assert await waiting == 21
        scripts._release(held.pop())
        assert scripts.connections == 2
    finally:
        await scripts.aclose()


async def test_a_call_cancelled_before_its_reply_drops_its_connection(redis_server: RedisServer) -> None:
    scripts = runner(redis_server, max_connections=1)
    try:
        call = asyncio.ensure_future(scripts("slow", 30_000_000))
        await asyncio.sleep(0.05)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert scripts.connections == 0
        # The late reply of the cancelled script is never read as the answer to the next call.
        assert await scripts("echo", "b", 1) == [scripts._key.decode(), "b", "1"]
    finally:
        await scripts.aclose()


async def test_a_redis_restart_costs_one_retry_on_a_fresh_connection(own_redis: RedisServer) -> None:
    scripts = runner(own_redis)
    try:
        assert await scripts("add", 1) == 1
        own_redis.stop()
        with pytest.raises((RedisConnectionError, OSError)):
            await scripts("add", 1)
        own_redis.start()
        assert await scripts("add", 1) == 1  # the old connection is gone; the new server has no key yet
    finally:
        await scripts.aclose()
