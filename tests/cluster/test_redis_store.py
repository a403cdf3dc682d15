"""The shared session store's operations against a real redis-server of their own
(``nox -s cluster``; the normal suite needs no Redis)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from deploy.cluster import start_redis

from furnace_trio.engine.sessions import SharedHistory
from furnace_trio.server.redis_store import RedisStore
from furnace_trio.server.responses_store import StoredResponse

from .conftest import free_ports

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    directory: Path = tmp_path_factory.mktemp("redis")
    (port,) = free_ports(1)
    process = start_redis(port, directory)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 30
    try:
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.1)
        yield url
    finally:
        client.close()
        process.terminate()
        assert process.wait(30) == 0


@pytest.fixture
def store(redis_url: str) -> Iterator[RedisStore]:
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    client.close()
    store = RedisStore(redis_url, ttl_s=60)
    yield store
    store.close()


def test_a_lock_has_one_holder_until_released(store: RedisStore) -> None:
    assert store.lock("s", "a", 10_000)
    assert not store.lock("s", "b", 10_000)
    store.unlock("s", "b")  # not b's: still held
    assert not store.lock("s", "b", 10_000)
    store.unlock("s", "a")
    assert store.lock("s", "b", 10_000)


def test_a_lock_expires_and_only_its_holder_renews_it(store: RedisStore) -> None:
    assert store.lock("s", "a", 200)
    assert store.renew("s", "a", 200)
    assert not store.renew("s", "b", 10_000)
    time.sleep(0.5)  # the TTL passes: a dead replica's lock frees itself
    assert not store.renew("s", "a", 200)
    assert store.lock("s", "b", 10_000)
    store.unlock("s", "a")  # a late release of the expired lock frees nothing
    assert not store.lock("s", "c", 10_000)


def test_a_history_round_trips(store: RedisStore) -> None:
    history = SharedHistory(
        session_id="s",
        owner="o",
        messages=({"role": "user", "content": "hé"}, {"role": "assistant", "content": "x"}),
        prompt_messages=({"role": "user", "content": "hé"}, {"role": "assistant", "content": "y"}),
        history_text="<s>hé y",
        history_ids=(1, 2, 3),
        rng_state=(1 << 63) + 5,
        turns=1,
    )
    assert store.load_session("s") is None
    store.save_session(history, "rev1")
    assert store.load_session("s") == (history, "rev1")
    store.delete_session("s")
    assert store.load_session("s") is None


def test_a_stored_response_round_trips(store: RedisStore) -> None:
    record = StoredResponse(
        response_id="resp_1",
        owner="o",
        body={"id": "resp_1", "output": [{"type": "message"}]},
        input_items=({"id": "msg_1", "type": "message"},),
        session_id="resp_0",
        turns=2,
        messages=4,
        calls=frozenset({"call_a", "call_b"}),
        last_used=0.0,
    )
    store.save_response(record)
    loaded = store.load_response("resp_1")
    assert loaded is not None
    assert dataclasses.asdict(loaded) == dataclasses.asdict(record)
    store.delete_response("resp_1")
    assert store.load_response("resp_1") is None


def test_saved_entries_expire_with_the_sessions_ttl(redis_url: str) -> None:
    store = RedisStore(redis_url, ttl_s=0.2)
    history = SharedHistory("t", "o", (), (), "", (), 0, 0)
    store.save_session(history, "r")
    assert store.load_session("t") is not None
    time.sleep(0.5)
    assert store.load_session("t") is None
    store.close()
