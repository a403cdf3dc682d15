"""``deploy/cluster.py`` without starting anything: one replica per GPU sees only its
device, and the loopback nginx configuration names every replica (``nox -s cluster``
runs the whole cluster)."""

from __future__ import annotations

from pathlib import Path

import pytest
from deploy.cluster import gpu_list, make_replicas, render_nginx


def test_one_replica_per_gpu_sees_only_its_device(tmp_path: Path) -> None:
    replicas = make_replicas(
        0, 8100, tmp_path, {"FURNACE_SESSION_STORE": "redis://127.0.0.1:6390/0"}, ["0", "1", "1"]
    )
    assert [r.port for r in replicas] == [8100, 8101, 8102]
    assert len({r.log for r in replicas}) == 3
    envs = [r.environment({"PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "0,1"}) for r in replicas]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1", "1"]
    assert all(e["FURNACE_DEVICE"] == "cuda" for e in envs)
    assert all(e["FURNACE_SESSION_STORE"] == "redis://127.0.0.1:6390/0" for e in envs)
    assert all(e["PATH"] == "/usr/bin" for e in envs)
    # a device setting of the caller's wins; CPU replicas keep the caller's devices
    (gpu,) = make_replicas(0, 8100, tmp_path, {}, ["2"])
    assert gpu.environment({"FURNACE_DEVICE": "cuda:0"})["FURNACE_DEVICE"] == "cuda:0"
    cpu = make_replicas(2, 8100, tmp_path, {})
    assert [r.gpu for r in cpu] == [None, None]
    assert "CUDA_VISIBLE_DEVICES" not in cpu[0].environment({})


def test_gpu_lists() -> None:
    assert gpu_list("0,1, 2") == ["0", "1", "2"]
    assert gpu_list("0,0") == ["0", "0"]  # two replicas on one GPU
    for bad in ("", "0,,1", "cuda:0"):
        with pytest.raises(ValueError, match="--gpus"):
            gpu_list(bad)


def test_the_loopback_configuration_names_every_replica(tmp_path: Path) -> None:
    conf = render_nginx(
        prefix=tmp_path, listen="127.0.0.1:8000", replicas=["127.0.0.1:8100", "127.0.0.1:8101"]
    )
    body = "\n".join(line for line in conf.splitlines() if not line.lstrip().startswith("#"))
    for address in ("127.0.0.1:8100", "127.0.0.1:8101"):
        # once in each upstream: the session hash and least-connections
        assert body.count(f"server {address} max_fails=1 fail_timeout=5s;") == 2
    assert " resolve " not in body and "resolver" not in body
    assert "proxy_next_upstream_tries 2;" in body
    assert f"error_log {tmp_path}/error.log warn;" in body
    assert "@" not in body  # every placeholder filled in
