"""The C++ client's build, short of a package it needs, stops naming the Debian packages to
install (those .ci/polyglot.sh installs), not CMake's list of config files."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEBIAN = "cmake g++ libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc"


def _configure(build: Path, *flags: str) -> str:
    cmake = shutil.which("cmake")
    if cmake is None or not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("cmake and a C++ compiler are not installed (.ci/polyglot.sh installs them)")
    done = subprocess.run(
        [cmake, "-S", str(ROOT / "client" / "cpp"), "-B", str(build), *flags],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0, done.stdout
    return " ".join(done.stderr.split())


@pytest.mark.parametrize("package", ["gRPC", "Protobuf"])
def test_cmake_short_of_a_package_names_the_debian_packages(tmp_path: Path, package: str) -> None:
    message = _configure(tmp_path, f"-DCMAKE_DISABLE_FIND_PACKAGE_{package}=ON")
    # Protobuf is looked for first: on a host without it, that is the one named.
    assert re.search(
        rf"(gRPC|Protobuf) not found: on Debian or Ubuntu, apt-get install {re.escape(DEBIAN)};",
        message,
    ), message
    assert "Traceback" not in message
    # What the message names is what CI installs.
    polyglot = (ROOT / ".ci" / "polyglot.sh").read_text()
    for name in DEBIAN.split():
        assert re.search(rf"(^|\s){re.escape(name)}(\s|$)", polyglot, re.M), name
