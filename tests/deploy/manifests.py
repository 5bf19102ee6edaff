"""deploy/'s manifests as the tests read them: the kustomization's documents, one by kind
and name, a workload's container and its ports; deploy/local.py as `local`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import yaml

from mtpdraft.client.messages import AFFINITY_HEADER

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
sys.path.insert(0, str(DEPLOY))
import local  # noqa: E402  (deploy/local.py, for the tests)

KUBERNETES_VERSION = "1.30.0"  # the oldest release the manifests are checked against
HEALTH_SERVICE = "mtpdraft.v1.Drafter"
NGINX_VARIABLE = "$http_" + AFFINITY_HEADER.replace("-", "_")


def kustomization() -> dict:
    return yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())


def documents() -> list[dict]:
    docs = []
    for resource in kustomization()["resources"]:
        docs += [d for d in yaml.safe_load_all((DEPLOY / resource).read_text()) if d]
    return docs


def one(kind: str, name: str | None = None) -> dict:
    found = [d for d in documents() if d["kind"] == kind]
    if name is not None:
        found = [d for d in found if d["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def container(workload: dict) -> dict:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


def port_named(c: dict, name_or_number) -> int:
    for p in c["ports"]:
        if name_or_number in (p.get("name"), p["containerPort"]):
            return p["containerPort"]
    raise AssertionError(f"{c['name']} has no port {name_or_number}")


def k8s_conf() -> str:
    return (DEPLOY / "nginx" / "k8s.conf").read_text()


def nginx() -> str:
    """nginx's path. Without nginx the test skips, or fails where MTPDRAFT_REQUIRE_NGINX is
    set (CI, whose .ci/run installs it)."""
    path = local.find_nginx()
    if path is None:
        why = "nginx is not installed (apt-get install nginx; .ci/run installs it)"
        if os.environ.get("MTPDRAFT_REQUIRE_NGINX"):
            pytest.fail(why)
        pytest.skip(why)
    return path
