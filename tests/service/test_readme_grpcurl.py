"""README.md's grpcurl block, and the same check with `mtpdraft info`, run against a server
on loopback.

With grpcurl on PATH each line runs as written. Without it (it is packaged in neither
Debian nor PyPI, so CI has none) each line is carried out as grpcurl carries it out:
the service, the method and its message types found through the server's reflection
alone, `-d` parsed by the proto3 JSON mapping, the reply printed as JSON. Either way
the block's services, methods and fields are checked against the live server.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format, message_factory
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from servers import InProcessServer, small_engine

from mtpdraft.service import cli

README = Path(__file__).resolve().parents[2] / "README.md"


def bash_lines(command: str) -> list[str]:
    """The lines of README.md's bash blocks that run `command`."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    lines = [line for block in blocks for line in block.splitlines()]
    return [line for line in lines if line.startswith(f"{command} ")]


def grpcurl_lines() -> list[str]:
    return bash_lines("grpcurl")


def grpcurl_by_reflection(argv: list[str]) -> str:
    """What `grpcurl -plaintext [-d JSON] ADDRESS (list | SERVICE/METHOD)` prints."""
    data, positional = "{}", []
    words = iter(argv[1:])
    for word in words:
        if word == "-d":
            data = next(words)
        elif word != "-plaintext":
            assert not word.startswith("-"), f"this test knows no grpcurl flag {word}"
            positional.append(word)
    address, verb = positional
    with grpc.insecure_channel(address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        if verb == "list":
            return "\n".join(database.get_services())
        service, method_name = verb.rsplit("/", 1)
        method = DescriptorPool(database).FindServiceByName(service).FindMethodByName(method_name)
        request_type = message_factory.GetMessageClass(method.input_type)
        response_type = message_factory.GetMessageClass(method.output_type)
        call = channel.unary_unary(
            f"/{service}/{method_name}",
            request_serializer=request_type.SerializeToString,
            response_deserializer=response_type.FromString,
        )
        return json_format.MessageToJson(call(json_format.Parse(data, request_type()), timeout=30))


def run(line: str) -> str:
    argv = shlex.split(line)
    if shutil.which("grpcurl"):
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout
    return grpcurl_by_reflection(argv)


@pytest.fixture(scope="module")
def server(mimo_checkpoint):
    served = InProcessServer(small_engine(mimo_checkpoint))
    yield served
    served.stop()


def test_the_grpcurl_block_lists_calls_and_checks_health(server) -> None:
    lines = [line.replace("localhost:50051", server.address) for line in grpcurl_lines()]
    assert len(lines) == 3
    listed, info, health = (run(line) for line in lines)
    assert {"mtpdraft.v1.Drafter", "grpc.health.v1.Health"} <= set(listed.split())
    assert any(name.startswith("grpc.reflection.") for name in listed.split())
    info = json.loads(info)
    assert info["modelFamily"] == "mimo" and info["hiddenSize"] > 0
    assert json.loads(health) == {"status": "SERVING"}


def test_the_readme_says_where_grpcurl_comes_from() -> None:
    assert "go install github.com/fullstorydev/grpcurl/cmd/grpcurl@" in README.read_text()


def test_mtpdraft_info_makes_the_same_check(server, capsys) -> None:
    (line,) = bash_lines("mtpdraft info")
    argv = shlex.split(line.replace("localhost:50051", server.address))
    assert cli.main(argv[1:]) == 0
    health, *fields = capsys.readouterr().out.splitlines()
    assert health == "health: SERVING"
    assert "model_family: mimo" in fields and any(f.startswith("hidden_size: ") for f in fields)
