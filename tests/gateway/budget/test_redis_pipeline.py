"""`gateway.budget.redis_pipeline.ScriptRunner` against a real `redis-server` on a free loopback port."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.budget.redis_pipeline import ScriptRunner, pack
from tests.redis_server import RedisServer

SCRIPTS = {
    "add": "return redis.call('INCRBY', KEYS[1], ARGV[1])",
    "echo": "return {KEYS[1], ARGV[1], ARGV[2]}",
    "fail": "return redis.error_reply('no such thing: ' .. ARGV[1])",
    # Busy for a while: Redis answers nothing else meanwhile (about 0.3 s for 30 million turns).
    "slow": "for _ = 1, tonumber(ARGV[1]) do end return 1",
}


def runner(server: RedisServer, *, socket_timeout_s: float = 2.0) -> ScriptRunner:
    pool = aioredis.BlockingConnectionPool.from_url(server.url, socket_timeout=socket_timeout_s, decode_responses=True)
    return ScriptRunner(pool, SCRIPTS, f"{{t:{uuid.uuid4().hex[:8]}}}")


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
        assert scripts.connections_made == 1
    finally:
        await scripts.aclose()


async def test_a_scripts_error_is_raised_and_its_connection_stays_usable(redis_server: RedisServer) -> None:
    scripts = runner(redis_server)
    try:
        with pytest.raises(ResponseError, match="no such thing: x"):
            await scripts("fail", "x")
        assert await scripts("add", 4) == 4
        assert scripts.connections_made == 1
    finally:
        await scripts.aclose()


async def test_concurrent_callers_share_one_connection_and_each_gets_its_own_reply(
    redis_server: RedisServer,
) -> None:
    scripts = runner(redis_server)
    try:
        key = scripts._key.decode()
        replies = await asyncio.gather(*(scripts("echo", f"caller-{i}", i) for i in range(300)))
        assert replies == [[key, f"caller-{i}", str(i)] for i in range(300)]
        results = await asyncio.gather(*(scripts("add", 1) for _ in range(50)))
        assert sorted(results) == list(range(1, 51))
        assert scripts.connections_made == 1
    finally:
        await scripts.aclose()


async def test_a_call_cancelled_before_its_reply_leaves_the_connection_in_step(redis_server: RedisServer) -> None:
    scripts = runner(redis_server)
    try:
        assert await scripts("add", 1) == 1
        call = asyncio.ensure_future(scripts("slow", 30_000_000))
        behind = asyncio.ensure_future(scripts("echo", "behind", 2))
        await asyncio.sleep(0.05)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        # The cancelled script's late reply is dropped in its turn, never read as another call's answer.
        assert await behind == [scripts._key.decode(), "behind", "2"]
        assert await scripts("echo", "b", 1) == [scripts._key.decode(), "b", "1"]
        assert scripts.connections_made == 1
    finally:
        await scripts.aclose()


async def test_redis_silent_past_the_socket_timeout_fails_every_waiting_call_then_a_fresh_connection_serves(
    own_redis: RedisServer,
) -> None:
    scripts = runner(own_redis, socket_timeout_s=0.2)
    try:
        assert await scripts("add", 1) == 1
        # Redis answers nobody for 0.7 s.
        own_redis.client().execute_command("CLIENT", "PAUSE", 700, "ALL")  # type: ignore[no-untyped-call]
        started = time.perf_counter()
        calls = [asyncio.ensure_future(scripts("add", 1)) for _ in range(3)]
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(outcome, RedisTimeoutError) for outcome in outcomes), outcomes
        assert time.perf_counter() - started < 0.65  # one timeout per attempt, not the whole pause
        await asyncio.sleep(0.8)
        # The adds written before the timeouts may have run once Redis woke; a fresh connection answers again.
        total = await scripts("add", 0)
        assert 1 <= total <= 7
        assert scripts.connections_made >= 2
    finally:
        await scripts.aclose()


async def test_send_writes_a_call_on_the_live_connection_and_returns_its_reply_future(
    redis_server: RedisServer,
) -> None:
    scripts = runner(redis_server)
    try:
        assert scripts.send("add", 1) is None  # nothing connected yet: the caller makes the call instead
        assert await scripts("add", 1) == 1
        reply = scripts.send("add", 5)
        assert reply is not None
        assert await reply == 6
        failed = scripts.send("fail", "y")
        assert failed is not None
        with pytest.raises(ResponseError, match="no such thing: y"):
            await failed
        await scripts.aclose()
        assert scripts.send("add", 1) is None
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


@pytest.mark.parametrize("over", ["tcp", "unix", "tls"])
async def test_the_url_s_password_and_database_hold_on_the_pipelined_connection(over: str, tmp_path: Path) -> None:
    server = RedisServer(tmp_path, password="s3cret", unix_socket=True, tls=over == "tls")
    server.start()
    try:
        url = {
            "tcp": f"redis://:s3cret@127.0.0.1:{server.port}/3",
            "unix": f"unix://{server.socket_path}?db=3&password=s3cret",
            "tls": f"rediss://:s3cret@127.0.0.1:{server.tls_port}/3?ssl_ca_certs={server.ca_path}",
        }[over]
        pool = aioredis.BlockingConnectionPool.from_url(url, socket_timeout=2.0, decode_responses=True)
        scripts = ScriptRunner(pool, SCRIPTS, "{t:db}")
        try:
            assert await scripts("add", 5) == 5
            assert server.client(db=3).get("{t:db}") == "5"  # AUTH and SELECT ran before the first script
            assert server.client(db=0).get("{t:db}") is None
        finally:
            await scripts.aclose()
        wrong = aioredis.BlockingConnectionPool.from_url(
            url.replace("s3cret", "wrong"), socket_timeout=2.0, decode_responses=True
        )
        refused = ScriptRunner(wrong, SCRIPTS, "{t:db}")
        with pytest.raises(RedisConnectionError, match="invalid username-password"):  # AuthenticationError over TCP
            await refused("add", 1)
        await refused.aclose()
    finally:
        server.stop()
