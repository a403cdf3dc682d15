"""A cluster on loopback for ``nox -s cluster``: Redis, two replicas of the default model
sharing sessions through it, and nginx in front, all from ``deploy/`` (the template and
the functions of ``deploy/cluster.py``). Debian's nginx and redis-server must be installed
(``nox -s cluster`` installs them).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from deploy.cluster import Replica, render_nginx, start_nginx, start_redis, wait_http

#: Results the tests measure; the nox session prints them in one line at the end.
RESULTS: dict[str, Any] = {}
#: How long nginx skips a replica that failed (the template's fail_timeout).
FAIL_TIMEOUT_S = 3


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@dataclass(slots=True)
class Cluster:
    url: str  # nginx
    redis_url: str
    replicas: list[Replica]
    nginx: subprocess.Popen[bytes] | None
    redis: subprocess.Popen[bytes] | None
    directory: Path
    stopped: dict[str, int | None] = field(default_factory=dict)

    def replica_at(self, address: str) -> Replica:
        return next(r for r in self.replicas if r.address == address)

    def other(self, replica: Replica) -> Replica:
        return next(r for r in self.replicas if r is not replica)

    def stop(self) -> dict[str, int | None]:
        """Replicas first (SIGTERM: drain), then nginx (SIGQUIT: graceful), then Redis."""
        for replica in self.replicas:
            if replica.process is not None:
                self.stopped[replica.name] = replica.stop(signal.SIGTERM, timeout_s=120)
        for name, sig in (("nginx", signal.SIGQUIT), ("redis", signal.SIGTERM)):
            process = getattr(self, name)
            if process is not None:
                process.send_signal(sig)
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
                self.stopped[name] = process.returncode
                setattr(self, name, None)
        return self.stopped


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    for binary in ("nginx", "redis-server"):
        if shutil.which(binary) is None and not Path(f"/usr/sbin/{binary}").exists():
            pytest.fail(f"{binary} not found: apt-get install nginx redis-server")
    directory = tmp_path_factory.mktemp("cluster")
    listen_port, redis_port, *replica_ports = free_ports(4)
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    cluster = Cluster(
        url=f"http://127.0.0.1:{listen_port}",
        redis_url=redis_url,
        replicas=[],
        nginx=None,
        redis=start_redis(redis_port, directory),
        directory=directory,
    )
    try:
        client = redis.Redis.from_url(redis_url)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.1)
        client.close()
        env = {
            "FURNACE_SESSION_STORE": redis_url,
            "FURNACE_DRAIN_TIMEOUT_S": "120",
            "FURNACE_LOG_LEVEL": "INFO",
            "PYTHONPATH": os.pathsep.join(
                [str(Path(__file__).resolve().parents[2] / "src"), os.environ.get("PYTHONPATH", "")]
            ),
        }
        cluster.replicas = [
            Replica(f"replica{i}", port, dict(env), directory / f"replica{i}.log")
            for i, port in enumerate(replica_ports)
        ]
        for replica in cluster.replicas:
            replica.start()
        for replica in cluster.replicas:
            replica.wait_ready(timeout_s=600)
        config = render_nginx(
            prefix=directory,
            listen=f"127.0.0.1:{listen_port}",
            replicas=[r.address for r in cluster.replicas],
            fail_timeout_s=FAIL_TIMEOUT_S,
        )
        cluster.nginx = start_nginx(config, directory)
        wait_http(f"{cluster.url}/health", 30, cluster.nginx)
        yield cluster
    finally:
        cluster.stop()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Leave the measured results where ``nox -s cluster`` prints them from."""
    path = os.environ.get("CLUSTER_SUMMARY_FILE")
    if path and RESULTS:
        import json

        Path(path).write_text(json.dumps(RESULTS))
