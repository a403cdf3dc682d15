"""Two replicas of the default model behind nginx, sharing sessions through Redis
(``nox -s cluster``): affinity, a turn lock across replicas, the Responses API on any
replica, failover after a replica is killed, a rolling restart under load, a clean stop.

The tests run in file order on one cluster (the failover test restarts the replica it
killed; the last test stops everything). Greedy sampling throughout, so texts compare.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from deploy.cluster import Replica

from .conftest import FAIL_TIMEOUT_S, RESULTS, Cluster

pytestmark = pytest.mark.cluster

MODEL = "SmolLM2-135M-Instruct"
#: A system prompt long enough that recomputing a conversation's KV shows in its TTFT.
SYSTEM = " ".join(
    f"Rule {i}: answer briefly, politely and in plain English about the topic asked."
    for i in range(1, 25)
)


@dataclass(slots=True)
class Reply:
    status: int
    text: str = ""
    ttft: float | None = None
    upstreams: list[str] = field(default_factory=list)
    done: bool = False
    cached_tokens: int | None = None
    error: str | None = None
    started: float = 0.0
    ended: float = 0.0

    @property
    def replica(self) -> str:
        """The replica that answered (nginx lists the ones it tried, the last answered)."""
        return self.upstreams[-1] if self.upstreams else ""


def chat(
    base: str,
    messages: list[dict[str, Any]],
    *,
    session: str | None = None,
    max_tokens: int = 16,
    ignore_eos: bool = False,
    on_first: Callable[[], object] | None = None,
) -> Reply:
    """One streamed greedy chat completion; what it said, when, and from where."""
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    headers = {"X-Session-Id": session} if session is not None else {}
    started = time.monotonic()
    reply = Reply(0, started=started)
    try:
        with (
            httpx.Client(timeout=300) as client,
            client.stream(
                "POST", f"{base}/v1/chat/completions", json=body, headers=headers
            ) as response,
        ):
            reply.status = response.status_code
            upstream = response.headers.get("x-furnace-upstream", "")
            reply.upstreams = [a.strip() for a in re.split(r"[,:]\s", upstream) if a.strip()]
            if response.status_code != 200:
                response.read()
                reply.error = response.text
                return reply
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    reply.done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    reply.error = json.dumps(event["error"])
                    break
                for choice in event.get("choices", []):
                    text = choice.get("delta", {}).get("content")
                    if text:
                        if reply.ttft is None:
                            reply.ttft = time.monotonic() - started
                            if on_first is not None:
                                on_first()
                        reply.text += text
                usage = event.get("usage")
                if usage:
                    details = usage.get("prompt_tokens_details") or {}
                    reply.cached_tokens = details.get("cached_tokens")
    except httpx.HTTPError as exc:
        reply.error = repr(exc)
    finally:
        reply.ended = time.monotonic()
    return reply


def requests_total(base: str) -> float:
    """A replica's finished requests (its own /metrics)."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("furnace_requests_total{")
    )


def test_session_turns_land_on_one_replica(cluster: Cluster) -> None:
    before = {r.address: requests_total(r.url) for r in cluster.replicas}
    replies = [
        chat(
            cluster.url,
            [{"role": "user", "content": f"Say a word about the number {i}."}],
            session="affinity-1",
            max_tokens=6,
        )
        for i in range(4)
    ]
    assert all(r.status == 200 and r.done for r in replies), replies
    answered = {r.replica for r in replies}
    assert len(answered) == 1, answered
    owner = answered.pop()
    after = {r.address: requests_total(r.url) for r in cluster.replicas}
    assert after[owner] - before[owner] == 4
    other = cluster.other(cluster.replica_at(owner)).address
    assert after[other] == before[other]
    assert replies[-1].cached_tokens and replies[-1].cached_tokens > 0


def test_a_turn_in_flight_locks_the_session_on_every_replica(cluster: Cluster) -> None:
    session = "busy-1"
    first = chat(
        cluster.url, [{"role": "user", "content": "Hello."}], session=session, max_tokens=4
    )
    assert first.status == 200 and first.done
    owner = cluster.replica_at(first.replica)
    other = cluster.other(owner)
    streaming = threading.Event()
    results: list[Reply] = []
    worker = threading.Thread(
        target=lambda: results.append(
            chat(
                cluster.url,
                [{"role": "user", "content": "Count to fifty."}],
                session=session,
                max_tokens=40,
                ignore_eos=True,
                on_first=streaming.set,
            )
        )
    )
    worker.start()
    try:
        assert streaming.wait(300), "the long turn never streamed"
        clash = httpx.post(
            f"{other.url}/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "Hi?"}],
                "max_tokens": 4,
            },
            headers={"X-Session-Id": session},
            timeout=60,
        )
    finally:
        worker.join(300)
    assert clash.status_code == 409, clash.text
    assert clash.json()["error"]["code"] == "session_busy"
    long_turn = results[0]
    assert long_turn.status == 200 and long_turn.done, long_turn
    # the lock is free again, and the other replica continues the whole conversation
    after = chat(other.url, [{"role": "user", "content": "Thanks."}], session=session, max_tokens=4)
    assert after.status == 200 and after.done, after
    kept = httpx.get(f"{other.url}/v1/sessions/{session}", timeout=30).json()
    assert kept["turns"] == 3
    assert [m["content"] for m in kept["messages"] if m["role"] == "user"] == [
        "Hello.",
        "Count to fifty.",
        "Thanks.",
    ]


def test_responses_continue_on_any_replica(cluster: Cluster) -> None:
    def create(base: str, headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
        body = {"model": MODEL, "max_output_tokens": 8, "temperature": 0, **body}
        return httpx.post(f"{base}/v1/responses", json=body, headers=headers or {}, timeout=300)

    def upstream(response: httpx.Response) -> str:
        return response.headers["x-furnace-upstream"].split(", ")[-1]

    # The first turn names no conversation yet: least-connections picks its replica.
    first = create(cluster.url, input="Name a fruit.")
    assert first.status_code == 200, first.text
    key = first.headers["x-session-id"]  # the conversation's routing key, echoed below
    # From the second turn on the client echoes the key, and the hash routes every turn
    # to one replica (the second recomputes the conversation if that is not the first's).
    replies = [first]
    for text in ("Another one.", "And one more."):
        reply = create(
            cluster.url,
            {"X-Session-Id": key},
            input=text,
            previous_response_id=replies[-1].json()["id"],
        )
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-session-id"] == key
        replies.append(reply)
    second, third = replies[1:]
    assert upstream(second) == upstream(third)
    assert third.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0
    owner = cluster.replica_at(upstream(third))
    # any replica continues it (from the store), and any replica finds what the other stored
    other = cluster.other(owner)
    fourth = create(other.url, input="And a vegetable.", previous_response_id=third.json()["id"])
    assert fourth.status_code == 200, fourth.text
    assert fourth.json()["usage"]["input_tokens"] > third.json()["usage"]["input_tokens"]
    stored = httpx.get(f"{owner.url}/v1/responses/{fourth.json()['id']}", timeout=30)
    assert stored.status_code == 200
    assert stored.json()["output"] == fourth.json()["output"]


def test_failover_continues_the_conversation(cluster: Cluster) -> None:
    session = "failover-1"
    sent: list[dict[str, Any]] = []  # the conversation as the client saw it
    replies: list[Reply] = []
    turns = [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a river?"}],
        [{"role": "user", "content": "What is a lake?"}],
        [{"role": "user", "content": "What is the sea?"}],
    ]
    for messages in turns:
        turn_send(cluster, session, messages, sent, replies)
    assert len({r.replica for r in replies}) == 1
    owner = cluster.replica_at(replies[0].replica)
    survivor = cluster.other(owner)
    normal_ttft = statistics.mean(r.ttft or 0.0 for r in replies[1:])

    assert owner.stop(signal.SIGKILL) is not None  # the replica is lost, its KV with it
    failover = turn_send(
        cluster, session, [{"role": "user", "content": "What is rain?"}], sent, replies
    )
    assert failover.replica == survivor.address
    assert failover.cached_tokens == 0  # the survivor recomputed the conversation
    # the text a stateless request for the same conversation gives
    stateless = chat(survivor.url, sent[:-1])
    assert stateless.status == 200 and stateless.done, stateless
    assert failover.text == stateless.text
    after = turn_send(
        cluster, session, [{"role": "user", "content": "What is snow?"}], sent, replies
    )
    assert after.replica == survivor.address
    assert after.cached_tokens and after.cached_tokens > 0

    RESULTS["ttft_normal_s"] = round(normal_ttft, 3)
    RESULTS["ttft_failover_s"] = round(failover.ttft or 0.0, 3)
    RESULTS["ttft_after_failover_s"] = round(after.ttft or 0.0, 3)
    RESULTS["failover_prompt_recomputed"] = True
    owner.start()  # back for the rolling restart
    owner.wait_ready(timeout_s=600)
    wait_admitted(cluster, owner)


def wait_admitted(cluster: Cluster, replica: Replica, timeout_s: float = 300.0) -> None:
    """Until nginx routes stateless requests to ``replica`` again.

    nginx's passive checks mark a replica that refused a connection as failed; once
    ``fail_timeout`` has passed it offers it one request at a time, and only a request that
    completes there restores it. Until then, a stop of the other replica leaves nginx with
    no live replica (502). So a rolling restart waits for a short request through nginx
    to be answered by the replica it restarted before it stops the next one."""
    deadline = time.monotonic() + timeout_s
    while True:
        reply = chat(cluster.url, [{"role": "user", "content": "Hi."}], max_tokens=1)
        if reply.status == 200 and reply.done and reply.replica == replica.address:
            return
        assert time.monotonic() < deadline, f"nginx never routed to {replica.address} again"
        time.sleep(FAIL_TIMEOUT_S / 10)


def turn_send(
    cluster: Cluster,
    session: str,
    messages: list[dict[str, Any]],
    sent: list[dict[str, Any]],
    replies: list[Reply],
) -> Reply:
    """Send a session turn's new ``messages`` through nginx; keep the client's view of the
    conversation in ``sent`` (what a stateless request would send)."""
    sent.extend(messages)
    reply = chat(cluster.url, messages, session=session)
    assert reply.status == 200 and reply.done, reply
    sent.append({"role": "assistant", "content": reply.text})
    replies.append(reply)
    return reply


def test_rolling_restart_loses_no_request(cluster: Cluster) -> None:
    stop = threading.Event()
    replies: list[Reply] = []
    lock = threading.Lock()

    def client(number: int) -> None:
        while not stop.is_set():
            reply = chat(
                cluster.url,
                [{"role": "user", "content": f"Tell me about {number}."}],
                max_tokens=12,
                ignore_eos=True,
            )
            with lock:
                replies.append(reply)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(3)]
    for thread in threads:
        thread.start()
    windows: list[tuple[str, float, float]] = []
    codes = []
    try:
        time.sleep(5)
        for replica in cluster.replicas:
            down = time.monotonic()
            codes.append(replica.stop(signal.SIGTERM, timeout_s=180))  # drain, then exit
            replica.start()
            replica.wait_ready(timeout_s=600)
            windows.append((replica.address, down, time.monotonic()))
            wait_admitted(cluster, replica)
    finally:
        stop.set()
        for thread in threads:
            thread.join(600)
    assert codes == [0, 0]
    lost = [r for r in replies if not (r.status == 200 and r.done and r.text)]
    assert not lost, lost
    drained = 0
    for address, down, up in windows:
        # in flight when the drain began on that replica: finished there
        drained += sum(1 for r in replies if r.replica == address and r.started < down < r.ended)
        # sent once the drain had begun (a margin for the signal's delivery): the live one
        late = [r for r in replies if down + 0.5 < r.started < up]
        assert late, "no request was sent while a replica was down"
        assert all(r.replica != address for r in late), [r.upstreams for r in late]
    RESULTS["rolling_requests"] = len(replies)
    RESULTS["rolling_lost"] = len(lost)
    RESULTS["rolling_finished_while_draining"] = drained


def test_everything_stops_cleanly(cluster: Cluster) -> None:
    ports = [r.port for r in cluster.replicas] + [int(cluster.url.rsplit(":", 1)[1])]
    stopped = cluster.stop()
    assert stopped == {"replica0": 0, "replica1": 0, "nginx": 0, "redis": 0}, stopped
    for port in ports:
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", port)) != 0
    RESULTS["clean_stop"] = True
