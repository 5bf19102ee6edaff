"""deploy/: the Kubernetes manifests against the Kubernetes API's schemas (offline, by
kubernetes-validate) and against each other (selectors, ports, probes, the proxy's
upstream servers, the grace periods, the server's own flags), and the nginx configs
(the local one by nginx itself)."""

from __future__ import annotations

import base64
import re
import socket
import subprocess
from pathlib import Path

import pytest
from google.rpc import error_details_pb2, status_pb2
from manifests import (
    DEPLOY,
    HEALTH_SERVICE,
    KUBERNETES_VERSION,
    NGINX_VARIABLE,
    container,
    documents,
    k8s_conf,
    kustomization,
    local,
    nginx,
    one,
    port_named,
    selects,
)

from mtpdraft.client import DrafterClient, InvalidArgument
from mtpdraft.service.cli import parse_serve

# What a drain takes past --grace-period: 5 s answering the queued calls, 1 s stopping
# (DrafterServer.drain).
DRAIN_AFTER_GRACE_S = 6


def test_every_manifest_matches_the_kubernetes_schema() -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[dev]'")
    docs = documents()
    assert {d["kind"] for d in docs} == {
        "Namespace",
        "Service",
        "StatefulSet",
        "PodDisruptionBudget",
        "Deployment",
    }
    for doc in docs:
        kv.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_kustomization_finds_its_files() -> None:
    k = kustomization()
    for resource in k["resources"]:
        assert (DEPLOY / resource).is_file(), resource
    (generator,) = k["configMapGenerator"]
    files = dict(f.split("=", 1) for f in generator["files"])
    assert set(files) == {"nginx.conf", "routes.conf"}
    for path in files.values():
        assert (DEPLOY / path).is_file(), path
    assert one("Namespace")["metadata"]["name"] == k["namespace"]


def test_the_replicas_selectors_ports_probes_gpus_and_drain() -> None:
    sts = one("StatefulSet")
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert selects(sts["spec"]["selector"]["matchLabels"], labels)
    svc = one("Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None"  # headless: a DNS name per ready replica
    assert selects(svc["spec"]["selector"], labels)
    assert selects(one("PodDisruptionBudget")["spec"]["selector"]["matchLabels"], labels)
    c = container(sts)
    assert "command" not in c  # the image's entrypoint, `mtpdraft serve` (test_image.py)
    config = parse_serve(c["args"])  # the flags as `mtpdraft serve` reads them
    grpc_port = port_named(c, "grpc")
    assert config.port == grpc_port and config.host == "0.0.0.0"
    (service_port,) = svc["spec"]["ports"]
    assert port_named(c, service_port["targetPort"]) == grpc_port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        grpc = c[probe]["grpc"]
        assert (grpc["port"], grpc["service"]) == (grpc_port, HEALTH_SERVICE), probe
    for kind in ("requests", "limits"):
        assert int(c["resources"][kind]["nvidia.com/gpu"]) == 1
    grace = sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= config.grace_period + DRAIN_AFTER_GRACE_S
    pre_stop = " ".join(c["lifecycle"]["preStop"]["exec"]["command"])
    assert "kill -TERM 1" in pre_stop


def test_each_replica_keeps_an_address_while_it_drains() -> None:
    """The ring's names follow readiness, so a draining replica's goes; move_state and
    GetInfo reach it by its own Service, which publishes its pod ready or not."""
    sts = one("StatefulSet")
    ring = one("Service", sts["spec"]["serviceName"])
    assert not ring["spec"].get("publishNotReadyAddresses")  # the ring drops a draining one
    labels = sts["spec"]["template"]["metadata"]["labels"]
    name, c = sts["metadata"]["name"], container(sts)
    for i in range(sts["spec"]["replicas"]):
        direct = one("Service", f"{name}-{i}")["spec"]
        assert direct["publishNotReadyAddresses"] is True and direct["clusterIP"] == "None"
        # The StatefulSet names each pod's label so: the selector picks that pod alone.
        pod_labels = {**labels, "statefulset.kubernetes.io/pod-name": f"{name}-{i}"}
        assert direct["selector"] == {"statefulset.kubernetes.io/pod-name": f"{name}-{i}"}
        assert selects(direct["selector"], pod_labels)
        (port,) = direct["ports"]
        assert port_named(c, port["targetPort"]) == port["port"] == port_named(c, "grpc")
    names = {d["metadata"]["name"] for d in documents() if d["kind"] == "Service"}
    directs = {n for n in names if re.fullmatch(rf"{name}-\d+", n)}
    assert len(directs) == sts["spec"]["replicas"]  # scaled with the StatefulSet


def test_probes_tolerate_a_slow_answer_and_liveness_outlasts_a_drain() -> None:
    sts = one("StatefulSet")
    c = container(sts)
    config = parse_serve(c["args"])
    ready = c["readinessProbe"]
    # A health answer slower than 1 s, or one missed probe, keeps the replica on the ring.
    assert ready.get("timeoutSeconds", 1) >= 2 and ready["failureThreshold"] >= 2
    live = c["livenessProbe"]
    # Liveness asks health, which the engine watchdog backs (on: a stall timeout > 0) ...
    assert config.engine_stall_timeout > 0
    # ... and a drain, NOT_SERVING from its start, ends before the failures needed to
    # restart it can add up (the first may come at once).
    failing_s = (live["failureThreshold"] - 1) * live["periodSeconds"]
    assert failing_s > config.grace_period + DRAIN_AFTER_GRACE_S
    assert live.get("timeoutSeconds", 1) >= 2


def test_the_pods_go_to_gpu_nodes_and_spread_over_nodes() -> None:
    spec = one("StatefulSet")["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
        "tolerations"
    ]
    for workload in (one("StatefulSet"), one("Deployment")):
        template = workload["spec"]["template"]
        (spread,) = template["spec"]["topologySpreadConstraints"]
        assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["maxSkew"] == 1
        assert selects(spread["labelSelector"]["matchLabels"], template["metadata"]["labels"])


def test_the_metrics_port_is_served_and_annotated_for_scraping() -> None:
    sts = one("StatefulSet")
    c = container(sts)
    annotations = sts["spec"]["template"]["metadata"]["annotations"]
    port = parse_serve(c["args"]).metrics_port  # --metrics-port, as the server reads it
    assert port == port_named(c, "metrics") == int(annotations["prometheus.io/port"])
    # The path `mtpdraft serve` prints for its metrics (service/cli.py).
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"


def test_nginx_moves_a_replicas_keys_only_after_several_failures() -> None:
    parameters = re.findall(r"^\s*server \S+ resolve (.+);$", k8s_conf(), re.M)
    assert set(parameters) == {local.SERVER_FAILURES}  # as the local config's
    assert "server 127.0.0.1:1 " + local.SERVER_FAILURES in local.render_config(
        ["127.0.0.1:1"], "127.0.0.1:2", Path("/tmp")
    )
    max_fails = int(re.search(r"max_fails=(\d+)", local.SERVER_FAILURES).group(1))
    assert max_fails >= 2  # tests/replicas: one refused connection moves no key


def test_the_proxys_workers_are_bounded_by_its_cpu_request() -> None:
    (workers,) = re.findall(r"^worker_processes (\S+);$", k8s_conf(), re.M)
    cpu = container(one("Deployment"))["resources"]["requests"]["cpu"]
    assert workers.isdigit() and 1 <= int(workers) <= int(cpu)  # not `auto`: a node's cores


def test_the_proxy_routes_to_every_replica_by_its_dns_name() -> None:
    sts, namespace = one("StatefulSet"), kustomization()["namespace"]
    svc = one("Service", sts["spec"]["serviceName"])
    port = svc["spec"]["ports"][0]["port"]
    conf = k8s_conf()
    servers = re.findall(r"^\s*server (\S+) resolve", conf, re.M)
    name, headless = sts["metadata"]["name"], svc["metadata"]["name"]
    assert servers == [
        f"{name}-{i}.{headless}.{namespace}.svc.cluster.local:{port}"
        for i in range(sts["spec"]["replicas"])
    ]
    assert f"hash {NGINX_VARIABLE} consistent;" in conf
    assert re.search(r"^\s*zone \S+ \d+k;", conf, re.M) and "resolver " in conf


def test_the_proxy_deployment_mounts_its_config_and_serves_its_ports() -> None:
    proxy = one("Deployment")
    labels = proxy["spec"]["template"]["metadata"]["labels"]
    assert selects(proxy["spec"]["selector"]["matchLabels"], labels)
    svc = next(
        d
        for d in documents()
        if d["kind"] == "Service" and selects(d["spec"].get("selector", {}), labels)
    )
    c = container(proxy)
    version = tuple(int(x) for x in c["image"].split(":")[1].split("."))
    assert version >= (1, 27, 3)  # re-resolvable upstream servers
    conf = k8s_conf()
    listens = [int(p) for p in re.findall(r"^\s*listen (\d+);", conf, re.M)]
    assert port_named(c, svc["spec"]["ports"][0]["targetPort"]) == listens[0]
    assert port_named(c, c["readinessProbe"]["httpGet"]["port"]) == listens[1]
    (volume,) = proxy["spec"]["template"]["spec"]["volumes"]
    assert volume["configMap"]["name"] == kustomization()["configMapGenerator"][0]["name"]
    mounts = {m["subPath"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["nginx.conf"] == "/etc/nginx/nginx.conf"
    assert f"include {mounts['routes.conf']};" in conf


def test_a_call_without_a_key_gets_the_clients_error_details() -> None:
    routes = (DEPLOY / "nginx" / "routes.conf").read_text()
    assert f'if ({NGINX_VARIABLE} = "")' in routes
    message = re.search(r'add_header grpc-message "([^"]+)"', routes).group(1)
    details = re.search(r'add_header grpc-status-details-bin "([^"]+)"', routes).group(1)
    status = status_pb2.Status.FromString(base64.b64decode(details + "=" * (-len(details) % 4)))
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    assert (status.code, status.message) == (3, message)
    assert (info.reason, info.domain) == ("AFFINITY_KEY_MISSING", "mtpdraft.v1")


def nginx_test(render, prefix: Path) -> tuple[str, subprocess.CompletedProcess]:
    """`render`'s config for two replicas, and `nginx -t` on it."""
    (prefix / "temp").mkdir()
    conf = prefix / "nginx.conf"
    conf.write_text(render(["127.0.0.1:1", "127.0.0.1:2"], "127.0.0.1:3", prefix))
    done = subprocess.run(
        [nginx(), "-t", "-p", str(prefix), "-c", str(conf), "-e", str(prefix / "error.log")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return conf.read_text(), done


def test_nginx_accepts_the_local_config(tmp_path: Path) -> None:
    _, done = nginx_test(local.render_config, tmp_path)
    assert done.returncode == 0, done.stderr


# What render_k8s_config replaces in k8s.conf: what only a cluster has (DNS names and its
# resolver, the image's paths and ports), and `http2 on` where nginx predates it.
CLUSTER_ONLY = re.compile(
    r"server \S+ resolve |resolver |error_log |pid |include |listen \d+;|http2 on;"
)


def test_nginx_runs_the_kubernetes_config_with_only_the_clusters_parts_replaced(
    tmp_path: Path,
) -> None:
    """Debian 12's nginx (1.22, what CI installs) lacks `resolve` (1.27.3) and `http2 on`
    (1.25.1) and cannot reach kube-dns: every other line is checked as written."""
    rendered, done = nginx_test(local.render_k8s_config, tmp_path)
    assert done.returncode == 0, done.stderr
    lines = set(rendered.splitlines())
    kept = [line for line in k8s_conf().splitlines() if not CLUSTER_ONLY.search(line)]
    assert [line for line in kept if line not in lines] == []
    assert "server 127.0.0.1:1 " in rendered and "server 127.0.0.1:2 " in rendered
    raw = tmp_path / "raw.conf"
    raw.write_text(k8s_conf())
    unrendered = subprocess.run(
        [nginx(), "-t", "-p", str(tmp_path), "-c", str(raw), "-e", str(tmp_path / "error.log")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert unrendered.returncode != 0  # as written, it needs the cluster (and 1.27.3)


def test_the_kubernetes_proxy_serves_its_status_and_its_routes(tmp_path: Path) -> None:
    nginx()
    proxy = local.start_proxy(["127.0.0.1:1"], tmp_path, render=local.render_k8s_config)
    try:
        with socket.socket(socket.AF_UNIX) as status:
            status.connect(str(tmp_path / "status.sock"))
            status.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
            answer = b"".join(iter(lambda: status.recv(4096), b""))
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"\r\n\r\nok\n")
        with DrafterClient(proxy.address, timeout=30) as c, pytest.raises(InvalidArgument) as err:
            c.alloc_state()
        assert err.value.reason == "AFFINITY_KEY_MISSING"
    finally:
        proxy.stop()
