"""Run furnace-trio replicas behind nginx, sharing sessions through Redis (or Valkey).

    python deploy/cluster.py --replicas 2                 # CPU: two replicas
    python deploy/cluster.py --gpus 0,1,2,3               # one replica per GPU
    python deploy/cluster.py --gpus all                   # every GPU nvidia-smi lists
    python deploy/cluster.py --gpus 0,0 --kv-cache-mb 4096  # two on one GPU, half the KV each

It starts ``redis-server`` (unless ``--redis-url`` names one already running), one
``python -m furnace_trio.server.serve`` per replica on loopback ports from
``--base-port`` (each with ``CUDA_VISIBLE_DEVICES`` set to its GPU, and
``FURNACE_SESSION_STORE`` pointing at Redis), and nginx from
``deploy/nginx.conf.template`` on ``--listen``. Ctrl-C (or SIGTERM) drains the replicas
and stops everything. Other ``FURNACE_*`` settings are passed on from the environment
(the model, the API key, limits). docs/deploy.md explains the layout.

The functions are what ``tests/cluster`` starts its cluster with.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "deploy" / "nginx.conf.template"
HYPERCORN_TOML = ROOT / "hypercorn.toml"


def render_nginx(
    *,
    prefix: Path | str,
    listen: str,
    replicas: Sequence[str],
    max_body: str = "4m",
    fail_timeout_s: int = 5,
    resolver: str | None = None,
    tries: int | None = None,
    error_log: str | None = None,
    access_log: str | None = None,
    template: Path = TEMPLATE,
) -> str:
    """The nginx configuration for ``replicas`` (``host:port`` each).

    With ``resolver`` (a DNS server's address), each replica is a name that nginx
    re-resolves while it runs (``server ... resolve``, nginx 1.27.3 or later): one headless
    Service's name stands for all its ready pods (deploy/k8s/). ``tries`` defaults to the
    number of replicas; logs default to files under ``prefix``."""
    resolve = " resolve" if resolver else ""
    servers = "\n        ".join(
        f"server {address}{resolve} max_fails=1 fail_timeout={fail_timeout_s}s;"
        for address in replicas
    )
    values = {
        "@PREFIX@": str(prefix),
        "@ERROR_LOG@": error_log or f"{prefix}/error.log",
        "@ACCESS_LOG@": access_log or f"{prefix}/access.log",
        "@LISTEN@": listen,
        "@RESOLVER@": (
            f"resolver {resolver} valid=5s;  # re-resolve the replicas' name every 5 s"
            if resolver
            else "# no resolver: the replicas are addresses"
        ),
        "@SERVERS@": servers,
        "@MAX_BODY@": max_body,
        "@TRIES@": str(tries if tries is not None else max(1, len(replicas))),
    }
    lines = []
    for line in template.read_text().splitlines(keepends=True):
        if not line.lstrip().startswith("#"):  # the header's comments name the placeholders
            for name, value in values.items():
                line = line.replace(name, value)
        lines.append(line)
    return "".join(lines)


@dataclass(slots=True)
class Replica:
    """One furnace-trio process on ``port``; ``gpu`` is its ``CUDA_VISIBLE_DEVICES``."""

    name: str
    port: int
    env: dict[str, str]
    log: Path
    gpu: str | None = None
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        """The process's environment: ``base`` (the caller's), the replica's settings, and
        for a GPU replica ``CUDA_VISIBLE_DEVICES`` (the process sees only its device, as
        ``cuda:0``) and ``FURNACE_DEVICE=cuda`` unless a setting says otherwise."""
        env = {**base, **self.env}
        if self.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.gpu
            env.setdefault("FURNACE_DEVICE", "cuda")
        return env

    def start(self) -> None:
        env = self.environment(os.environ)
        command = [
            sys.executable,
            "-m",
            "furnace_trio.server.serve",
            "-c",
            str(HYPERCORN_TOML),
            "--bind",
            self.address,
        ]
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(command, env=env, stdout=log, stderr=log)

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        wait_http(f"{self.url}/health", timeout_s, self.process)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int | None:
        """Signal the process (SIGTERM: drain, then exit) and wait; its exit status."""
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(sig)
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.process = None
        return process.returncode


def wait_http(url: str, timeout_s: float, process: subprocess.Popen[bytes] | None = None) -> None:
    """Poll ``url`` until it answers 200 (bounded); fail early if ``process`` exits."""
    deadline = time.monotonic() + timeout_s
    while True:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer within {timeout_s} s")
        time.sleep(0.2)


def start_redis(port: int, directory: Path) -> subprocess.Popen[bytes]:
    """A throwaway redis-server (or valkey-server) on loopback, no persistence."""
    binary = shutil.which("redis-server") or shutil.which("valkey-server")
    if binary is None:
        raise RuntimeError("redis-server not found: apt-get install redis-server")
    command = [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", ""]
    command += ["--appendonly", "no", "--dir", str(directory)]
    log = (directory / "redis.log").open("ab")
    return subprocess.Popen(command, stdout=log, stderr=log)


def start_nginx(config: str, directory: Path) -> subprocess.Popen[bytes]:
    binary = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(binary).exists():
        raise RuntimeError("nginx not found: apt-get install nginx")
    for sub in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (directory / sub).mkdir(parents=True, exist_ok=True)
    path = directory / "nginx.conf"
    path.write_text(config)
    log = (directory / "nginx.out").open("ab")
    return subprocess.Popen([binary, "-c", str(path), "-p", str(directory)], stdout=log, stderr=log)


def make_replicas(
    count: int,
    base_port: int,
    directory: Path,
    env: Mapping[str, str],
    gpus: Sequence[str] | None = None,
) -> list[Replica]:
    """``count`` replicas (or one per entry of ``gpus``) on ports from ``base_port``."""
    devices: Sequence[str | None] = list(gpus) if gpus else [None] * count
    return [
        Replica(f"replica{i}", base_port + i, dict(env), directory / f"replica{i}.log", gpu)
        for i, gpu in enumerate(devices)
    ]


def gpu_list(spec: str) -> list[str]:
    """``--gpus``: comma-separated device indices (a device named twice runs two replicas
    on it), or ``all``: every GPU ``nvidia-smi`` lists."""
    if spec.strip() == "all":
        listed = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        devices = [line.strip() for line in listed.splitlines() if line.strip()]
    else:
        devices = [part.strip() for part in spec.split(",")]
    if not devices or not all(d.isdigit() for d in devices):
        raise ValueError(f"--gpus {spec!r}: device indices such as 0,1 (or all)")
    return devices


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2, help="CPU replicas (without --gpus)")
    parser.add_argument("--gpus", help="comma-separated CUDA devices, one replica each, or all")
    parser.add_argument("--listen", default="127.0.0.1:8000", help="nginx's address")
    parser.add_argument("--base-port", type=int, default=8100, help="the first replica's port")
    parser.add_argument("--redis-port", type=int, default=6390)
    parser.add_argument("--redis-url", help="use this Redis/Valkey instead of starting one")
    parser.add_argument("--kv-cache-mb", type=int, help="FURNACE_KV_CACHE_MB for each replica")
    parser.add_argument("--dir", default="/tmp/furnace-cluster", help="logs and nginx files")
    args = parser.parse_args(argv)
    directory = Path(args.dir).resolve()
    directory.mkdir(parents=True, exist_ok=True)

    redis = None
    url = args.redis_url
    if url is None:
        redis = start_redis(args.redis_port, directory)
        url = f"redis://127.0.0.1:{args.redis_port}/0"
    env = {"FURNACE_SESSION_STORE": url}
    if args.kv_cache_mb:
        env["FURNACE_KV_CACHE_MB"] = str(args.kv_cache_mb)
    gpus = gpu_list(args.gpus) if args.gpus else None
    replicas = make_replicas(args.replicas, args.base_port, directory, env, gpus)
    nginx = None
    try:
        for replica in replicas:
            replica.start()
        for replica in replicas:
            replica.wait_ready()
        config = render_nginx(
            prefix=directory, listen=args.listen, replicas=[r.address for r in replicas]
        )
        nginx = start_nginx(config, directory)
        wait_http(f"http://{args.listen}/health", 30, nginx)
        print(f"serving on http://{args.listen}/v1 ({len(replicas)} replicas; logs in {directory})")
        signal.signal(signal.SIGTERM, _interrupt)
        while all(r.process is not None and r.process.poll() is None for r in replicas):
            time.sleep(1)
        print("a replica exited; stopping", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut the stop
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for replica in replicas:
            replica.stop()
        for process in (nginx, redis):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGQUIT if process is nginx else signal.SIGTERM)
                process.wait(10)


if __name__ == "__main__":
    raise SystemExit(main())
