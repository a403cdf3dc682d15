"""The Kubernetes manifests in ``deploy/k8s/`` agree with the code and with each other
(no cluster needed): every ``FURNACE_*`` variable is a setting and its value parses, the
probes hit routes the app serves, ports line up from the process's ``--bind`` through the
Services to nginx's upstream, nginx's ConfigMap is ``deploy/nginx.conf.template`` rendered
(so it hashes on the same header as ``nox -s cluster``'s nginx), and the grace period
covers a drain.

After editing the template or ``deploy/k8s/nginx_configmap.py``, regenerate the ConfigMap:
``python -m deploy.k8s.nginx_configmap`` (from the repository root, ``PYTHONPATH=src:.``).
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy.cluster import TEMPLATE
from deploy.k8s import nginx_configmap

from furnace_trio.server.app import create_app
from furnace_trio.server.config import ServerConfig
from furnace_trio.server.lifecycle import CANCEL_GRACE_S
from furnace_trio.server.setting import settings_of

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
Doc = dict[str, Any]


def manifests() -> list[Doc]:
    docs: list[Doc] = []
    for path in sorted(K8S.glob("*.yaml")):
        docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d is not None)
    return docs


DOCS = manifests()


def of_kind(kind: str) -> list[Doc]:
    return [d for d in DOCS if d["kind"] == kind]


def named(kind: str, name: str) -> Doc:
    (doc,) = [d for d in of_kind(kind) if d["metadata"]["name"] == name]
    return doc


def workloads() -> list[Doc]:
    return of_kind("Deployment") + of_kind("StatefulSet")


def containers(workload: Doc) -> list[Doc]:
    return list(workload["spec"]["template"]["spec"]["containers"])


def furnace_deployments() -> list[Doc]:
    """The Deployments that run furnace-trio (one per model)."""
    found = [
        d
        for d in of_kind("Deployment")
        if any("furnace_trio.server.serve" in c.get("command", []) for c in containers(d))
    ]
    assert found, "no Deployment runs furnace_trio.server.serve"
    return found


def env_of(container: Doc) -> dict[str, str | None]:
    """Literal values; ``None`` for a value taken from a Secret or ConfigMap."""
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def container_port(container: Doc, port: str | int) -> int:
    if isinstance(port, int):
        assert port in [p["containerPort"] for p in container["ports"]], port
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p.get("name") == port]
    return int(number)


def selected_by(service: Doc) -> list[Doc]:
    """The workloads whose pods ``service`` selects."""
    selector = service["spec"]["selector"].items()
    return [
        w for w in workloads() if selector <= w["spec"]["template"]["metadata"]["labels"].items()
    ]


def nginx_conf() -> str:
    return str(named("ConfigMap", "furnace-nginx")["data"]["nginx.conf"])


def probes(container: Doc) -> Iterator[tuple[str, Doc]]:
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        if kind in container:
            yield kind, container[kind]


def test_the_kustomization_lists_every_manifest() -> None:
    (kustomization,) = of_kind("Kustomization")
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)
    namespaces = {d["metadata"].get("namespace") for d in DOCS if d["kind"] != "Kustomization"}
    assert namespaces == {None, nginx_configmap.NAMESPACE}  # None: the Namespace itself
    assert named("Namespace", nginx_configmap.NAMESPACE)


def test_selectors_match_their_pods() -> None:
    for workload in workloads():
        labels = workload["spec"]["template"]["metadata"]["labels"].items()
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels
    for service in of_kind("Service"):
        assert selected_by(service), f"{service['metadata']['name']} selects no pods"
    for budget in of_kind("PodDisruptionBudget"):
        selector = budget["spec"]["selector"]["matchLabels"].items()
        assert any(
            selector <= w["spec"]["template"]["metadata"]["labels"].items() for w in workloads()
        )


def test_every_furnace_variable_is_a_setting_and_its_value_parses() -> None:
    known = {
        record.env
        for field in dataclasses.fields(ServerConfig)
        for record in settings_of(field)
        if not record.file_only
    }
    for deployment in furnace_deployments():
        for container in containers(deployment):
            env = env_of(container)
            names = {name for name in env if name.startswith("FURNACE_")}
            assert names, "no settings"
            assert names <= known, f"not settings: {sorted(names - known)}"
            # The literal values through the server's own parser and range checks (values
            # from a Secret stand in as a placeholder).
            ServerConfig.from_env(
                {n: v if v is not None else "placeholder" for n, v in env.items()}
            )


def test_the_probes_hit_routes_the_app_serves() -> None:
    app = create_app(ServerConfig(device="cpu"))
    served = {rule.rule for rule in app.url_map.iter_rules() if "GET" in (rule.methods or ())}
    for deployment in furnace_deployments():
        for container in containers(deployment):
            found = dict(probes(container))
            assert set(found) == {"startupProbe", "readinessProbe", "livenessProbe"}
            for kind, probe in found.items():
                assert probe["httpGet"]["path"] == "/health", kind
                assert probe["httpGet"]["path"] in served
                assert container_port(container, probe["httpGet"]["port"]) == bind_port(container)


def bind_port(container: Doc) -> int:
    command = container["command"]
    host, port = command[command.index("--bind") + 1].rsplit(":", 1)
    assert host == "0.0.0.0"  # the pod's address, not its loopback
    return int(port)


def test_ports_agree_from_the_process_to_nginx() -> None:
    conf = nginx_conf()
    upstream = re.findall(r"^\s*server (\S+):(\d+) resolve ", conf, re.MULTILINE)
    assert upstream, "no resolved upstream server in the ConfigMap"
    for host, port in upstream:
        name, namespace, rest = host.split(".", 2)
        assert rest == "svc.cluster.local"
        service = named("Service", name)
        assert service["metadata"]["namespace"] == namespace
        assert service["spec"].get("clusterIP") == "None", "nginx must see the pods: headless"
        (service_port,) = [p for p in service["spec"]["ports"] if p["port"] == int(port)]
        (deployment,) = selected_by(service)
        assert deployment in furnace_deployments()
        (container,) = containers(deployment)
        assert container_port(container, service_port["targetPort"]) == bind_port(container)
    for service in of_kind("Service"):
        for workload in selected_by(service):
            for port in service["spec"]["ports"]:
                assert any(
                    p.get("name") == port["targetPort"] or p["containerPort"] == port["targetPort"]
                    for c in containers(workload)
                    for p in c["ports"]
                ), service["metadata"]["name"]
    # nginx listens where its container and Service say
    (listen,) = re.findall(r"^\s*listen (\S+);", conf, re.MULTILINE)
    nginx = named("Deployment", "furnace-nginx")
    (container,) = containers(nginx)
    assert container_port(container, "http") == int(listen.rsplit(":", 1)[-1])
    front = named("Service", "furnace-nginx")
    assert selected_by(front) == [nginx]


def test_nginx_reads_the_configmap_it_mounts() -> None:
    nginx = named("Deployment", "furnace-nginx")
    (container,) = containers(nginx)
    config_path = Path(container["command"][container["command"].index("-c") + 1])
    volumes = {v["name"]: v for v in nginx["spec"]["template"]["spec"]["volumes"]}
    (mount,) = [m for m in container["volumeMounts"] if config_path.parent == Path(m["mountPath"])]
    assert volumes[mount["name"]]["configMap"]["name"] == "furnace-nginx"
    assert config_path.name in named("ConfigMap", "furnace-nginx")["data"]
    # the pid and temporary files go to a writable emptyDir
    prefix = re.search(r"^pid (\S+)/nginx\.pid;", nginx_conf(), re.MULTILINE)
    assert prefix is not None
    (tmp,) = [m for m in container["volumeMounts"] if m["mountPath"] == prefix.group(1)]
    assert "emptyDir" in volumes[tmp["name"]]
    # `resolve` in an upstream needs nginx 1.27.3 or later
    version = re.search(r"nginx:(\d+)\.(\d+)", container["image"])
    assert version is not None and (int(version[1]), int(version[2])) >= (1, 28)


def test_the_configmap_is_the_template_rendered() -> None:
    text = (K8S / "nginx-configmap.yaml").read_text()
    assert text == nginx_configmap.render(), "stale: python -m deploy.k8s.nginx_configmap"
    conf = nginx_conf()
    # every directive of the template without a placeholder is there, in the same order
    fixed = [
        line.strip()
        for line in TEMPLATE.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#") and "@" not in line
    ]
    lines = iter(line.strip() for line in conf.splitlines())
    for line in fixed:
        assert any(line == other for other in lines), f"missing or out of order: {line}"
    # and so it routes alike: a session's turns by a consistent hash of X-Session-Id,
    # the rest to the replica with the fewest requests
    assert re.search(r"upstream furnace_sessions \{[^}]*hash \$http_x_session_id consistent;", conf)
    assert re.search(r"upstream furnace_any \{[^}]*least_conn;", conf)
    assert "map $http_x_session_id $furnace_upstream" in conf


def test_the_grace_period_covers_a_drain() -> None:
    hypercorn = tomllib.loads((ROOT / "hypercorn.toml").read_text())
    for deployment in furnace_deployments():
        spec = deployment["spec"]["template"]["spec"]
        (container,) = containers(deployment)
        env = env_of(container)
        drain_s = float(env.get("FURNACE_DRAIN_TIMEOUT_S") or ServerConfig().drain_timeout_s)
        pause_s = 0.0
        pre_stop = container.get("lifecycle", {}).get("preStop")
        if pre_stop is not None:
            command = pre_stop["exec"]["command"]
            assert command[0] == "sleep"
            pause_s = float(command[1])
        needed = pause_s + drain_s + CANCEL_GRACE_S + float(hypercorn["graceful_timeout"])
        assert spec["terminationGracePeriodSeconds"] >= needed
        # a draining pod answers 503 on /health: its liveness probe must outlast the drain
        live = container["livenessProbe"]
        assert live["periodSeconds"] * live["failureThreshold"] >= needed
        # and the startup probe waits as long as hypercorn lets the model load
        start = container["startupProbe"]
        assert start["periodSeconds"] * start["failureThreshold"] >= hypercorn["startup_timeout"]


def test_the_replicas_share_the_valkey_service() -> None:
    for deployment in furnace_deployments():
        (container,) = containers(deployment)
        env = env_of(container)
        store = env["FURNACE_SESSION_STORE"]
        assert store is not None
        match = re.fullmatch(r"redis://([\w-]+):(\d+)/\d+", store)
        assert match is not None, store
        service = named("Service", match[1])
        (valkey,) = selected_by(service)
        assert valkey["kind"] == "StatefulSet"
        (port,) = [p for p in service["spec"]["ports"] if p["port"] == int(match[2])]
        (server,) = containers(valkey)
        assert container_port(server, port["targetPort"]) == 6379


@pytest.mark.parametrize("deployment", furnace_deployments(), ids=lambda d: d["metadata"]["name"])
def test_nginx_accepts_the_bodies_the_replicas_accept(deployment: Doc) -> None:
    (container,) = containers(deployment)
    limit = env_of(container).get("FURNACE_MAX_BODY_BYTES")
    max_body = int(limit) if limit else ServerConfig().max_body_bytes
    (size,) = re.findall(r"client_max_body_size (\d+)([km]?);", nginx_conf())
    factor = {"": 1, "k": 1024, "m": 1024 * 1024}[size[1]]
    assert int(size[0]) * factor >= max_body
    # one GPU per replica
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
