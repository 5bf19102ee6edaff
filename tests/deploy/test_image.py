"""The Dockerfile against the manifests and the commands, without building it (no Docker
engine runs where the tests do): its entrypoint, port, health check and user agree with
deploy/k8s/drafter.yaml and parse as `mtpdraft serve`'s and `mtpdraft info`'s own flags; the
kustomization names the image `make image` builds; the build context holds the package."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import subprocess
import sys

import pytest
import yaml
from dockerfile_parse import DockerfileParser
from manifests import (
    HEALTH_SERVICE,
    KUBERNETES_VERSION,
    ROOT,
    container,
    kustomization,
    one,
    port_named,
)

from mtpdraft.client.info import add_info_parser
from mtpdraft.service.cli import parse_serve


def dockerfile() -> DockerfileParser:
    return DockerfileParser(str(ROOT / "Dockerfile"))


def instruction(name: str) -> str:
    """The value of the Dockerfile's one `name` instruction."""
    (value,) = [i["value"] for i in dockerfile().structure if i["instruction"] == name]
    return value


def exec_form(value: str) -> list[str]:
    """A JSON-array instruction's argv (the exec form: no shell between)."""
    argv = json.loads(value)
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv), value
    return argv


def exposed_port() -> int:
    (port,) = instruction("EXPOSE").split()
    return int(port)


def drafter() -> dict:
    return container(one("StatefulSet"))


def test_the_entrypoint_is_mtpdraft_serve_with_flags_the_manifest_and_serve_agree_on() -> None:
    # Exec form: mtpdraft is PID 1 and gets the SIGTERM that drains it (preStop: kill 1).
    assert exec_form(instruction("ENTRYPOINT")) == ["mtpdraft", "serve"]
    assert "kill -TERM 1" in " ".join(drafter()["lifecycle"]["preStop"]["exec"]["command"])
    port = exposed_port()
    default = parse_serve(exec_form(instruction("CMD")))  # `mtpdraft serve`'s own parser
    assert (default.host, default.port) == ("0.0.0.0", port)
    c = drafter()
    assert "command" not in c  # the manifest runs the entrypoint, with its own flags
    configured = parse_serve(c["args"])
    assert (configured.host, configured.port) == ("0.0.0.0", port)
    assert port_named(c, "grpc") == port


def test_the_health_check_asks_what_the_probes_ask() -> None:
    options, _, command = instruction("HEALTHCHECK").partition(" CMD ")
    argv = exec_form(command.strip())
    assert argv[:2] == ["mtpdraft", "info"]
    parser = argparse.ArgumentParser(prog="mtpdraft")
    add_info_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv[1:])  # `mtpdraft info`'s own parser
    assert args.health_only  # health needs no token: a server with --auth-token-file passes
    host, _, port = args.target.rpartition(":")
    assert host == "127.0.0.1" and int(port) == exposed_port()
    c = drafter()
    for probe in ("startupProbe", "readinessProbe"):
        grpc = c[probe]["grpc"]
        assert (grpc["port"], grpc["service"]) == (exposed_port(), args.service), probe
    assert args.service == HEALTH_SERVICE
    # Not unhealthy while it loads: the start period is the startup probe's.
    flags = dict(re.findall(r"--([\w-]+)=(\d+)s", options))
    startup = c["startupProbe"]
    assert int(flags["start-period"]) >= startup["periodSeconds"] * startup["failureThreshold"]


def test_the_image_runs_as_a_numeric_user_that_is_not_root() -> None:
    user = instruction("USER")
    assert user.isdigit() and int(user) != 0  # numeric: runAsNonRoot can check it
    assert drafter()["securityContext"]["runAsNonRoot"] is True


def test_the_base_is_cuda_runtime_and_torch_is_the_readmes() -> None:
    image = dockerfile()
    assert re.fullmatch(r"nvidia/cuda:[\d.]+-runtime-ubuntu[\d.]+", image.baseimage)
    pins = set(re.findall(r"torch==([\d.]+)", (ROOT / "README.md").read_text()))
    pins |= set(re.findall(r"torch==([\d.]+)", (ROOT / ".ci" / "run").read_text()))
    assert pins == {image.args["TORCH_VERSION"]}
    assert any("pip install /src" in i["value"] for i in image.structure)


def _matches(path: str, pattern: str) -> bool:
    """Whether .dockerignore's `pattern` matches `path` as Docker reads it (Go's
    filepath.Match, and `**`): `*` and `?` stop at a `/`, where fnmatch's do not."""
    parts = re.split(r"(\*\*|\*|\?)", pattern)
    wild = {"**": ".*", "*": "[^/]*", "?": "[^/]"}
    return re.fullmatch("".join(wild.get(p) or re.escape(p) for p in parts), path) is not None


def _sent(path: str, patterns: list[str]) -> bool:
    """Whether the build context holds `path`, by .dockerignore's rules: the last pattern
    matching the path or a folder above it decides; `!` keeps."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    sent = True
    for pattern in patterns:
        keep = pattern.startswith("!")
        if any(_matches(p, pattern.removeprefix("!")) for p in prefixes):
            sent = keep
    return sent


def test_the_build_context_holds_the_package_and_nothing_else() -> None:
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11 or later reads pyproject.toml")
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dirs = setuptools["package-dir"]

    def folder(package: str) -> str:
        """A package's folder, by package-dir (the longest prefix that names one)."""
        parent = max((p for p in package_dirs if f"{package}.".startswith(f"{p}.")), key=len)
        return "/".join([package_dirs[parent], *package[len(parent) + 1 :].split(".")]).strip("/")

    needed = ["pyproject.toml", "README.md"]
    for package in setuptools["packages"]:
        files = sorted((ROOT / folder(package)).glob("*.py"))
        for data in setuptools["package-data"].get(package, []):
            files += sorted((ROOT / folder(package)).glob(data))
        assert files, package
        needed += [str(f.relative_to(ROOT)) for f in files]
    for path in needed:
        assert _sent(path, patterns), path
    for path in (
        "tests/conftest.py",
        "bench/bench_step.py",
        "client/node/index.js",
        "client/go/drafter/batch.go",
        ".git",
    ):
        assert not _sent(path, patterns), path


def test_make_image_tags_it_as_the_kustomization_names_it() -> None:
    (image,) = kustomization()["images"]
    assert drafter()["image"] == image["name"]
    done = subprocess.run(
        ["make", "-n", "-s", "image", f"PYTHON={sys.executable}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert shlex.split(done.stdout) == [
        "docker", "build", "-t", f"{image['newName']}:{image['newTag']}", "."
    ]  # fmt: skip


def test_the_rendered_kustomization_runs_the_image_and_matches_the_schemas() -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[dev]'")
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (make deploy-check validates the files)")
    rendered = subprocess.run(
        [kubectl, "kustomize", str(ROOT / "deploy")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    for doc in docs:
        kv.validate(doc, KUBERNETES_VERSION, strict=True)
    (image,) = kustomization()["images"]
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet"]
    assert container(sts)["image"] == f"{image['newName']}:{image['newTag']}"


def test_make_deploy_validate_checks_the_manifests_offline(tmp_path) -> None:
    def validate(*manifests: str) -> subprocess.CompletedProcess:
        argv = ["make", "-s", "deploy-validate", f"PYTHON={sys.executable}"]
        if manifests:
            argv.append(f"DEPLOY_MANIFESTS={' '.join(manifests)}")
        return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)

    assert validate().returncode == 0
    broken = tmp_path / "service.yaml"
    broken.write_text("apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {portz: []}\n")
    done = validate(str(broken))
    assert done.returncode != 0 and "'portz' was unexpected" in done.stdout + done.stderr
