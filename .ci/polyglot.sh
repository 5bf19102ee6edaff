#!/usr/bin/env bash
# Polyglot conformance: the Python, Node.js, Go and C++ clients replay one vector
# (tests/conformance/vector.json) against ONE live server of the embedded default model.
# For a fresh Debian machine, as root, after `pip install -e '.[dev]'`: installs the
# Debian packages it needs, builds client/{node,go,cpp} and their examples (make -f
# client/polyglot.mk), starts `python3 -m mtpdraft serve --port 0 --device cpu`, runs the four
# runners, the Node, Go and C++ unit tests and each client's example program, stops the server.
# Each client's verifier-side accept is checked against tests/conformance/sampling_vector.json
# (no server). Exits non-zero if any of them failed. The Python run (tests/conformance) also
# replays the vector on servers of its own (float32; other CPUs' kernels), checks its drafts
# against the float64 oracle, checks the sampling vector against its exact reference and the
# Python client's accept, and checks that all built runners refuse malformed vectors.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
start=$SECONDS

packages=(
    g++ make cmake pkg-config protobuf-compiler
    golang-go golang-google-grpc-dev golang-google-protobuf-dev
    golang-github-golang-protobuf-1-5-dev protoc-gen-go protoc-gen-go-grpc
    libgrpc++-dev libprotobuf-dev protobuf-compiler-grpc nlohmann-json3-dev
)
command -v node >/dev/null && command -v npm >/dev/null || packages+=(nodejs npm)
if ! dpkg -s "${packages[@]}" >/dev/null 2>&1; then
    echo "polyglot: apt-get install ${packages[*]}"
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
fi
echo "polyglot: packages ready ($((SECONDS - start)) s); node $(node --version), $(go version)"

# The server loads while the clients build.
log=$(mktemp)
python3 -m mtpdraft serve --port 0 --device cpu --grace-period 2 >"$log" 2>&1 &
server=$!
stop_server() {
    if kill -0 "$server" 2>/dev/null; then
        kill -TERM "$server"
        wait "$server" || true
    fi
}
trap stop_server EXIT

make -j2 -f client/polyglot.mk polyglot
echo "polyglot: clients built ($((SECONDS - start)) s)"

port=""
for _ in $(seq 240); do
    port=$(sed -n 's/.*listening on [^ ]*:\([0-9][0-9]*\).*/\1/p' "$log" | head -n1)
    [[ -n $port ]] && break
    kill -0 "$server" 2>/dev/null || break
    sleep 0.5
done
if [[ -z $port ]]; then
    echo "polyglot: the server did not start:"
    cat "$log"
    exit 1
fi
export MTPDRAFT_CONFORMANCE_ADDRESS=127.0.0.1:$port
echo "polyglot: server at $MTPDRAFT_CONFORMANCE_ADDRESS"

vector=tests/conformance/vector.json
sampling_vector=tests/conformance/sampling_vector.json
passed=0
failed=()
run() { # NAME SECONDS COMMAND...: one runner, at most SECONDS
    local name=$1 limit=$2
    shift 2
    echo "polyglot: --- $name"
    if timeout "$limit" "$@"; then
        passed=$((passed + 1))
    else
        failed+=("$name")
    fi
}
run python 300 python3 -m pytest -q -p no:cacheprovider tests/conformance
run node 120 node client/node/conformance.js --address "$MTPDRAFT_CONFORMANCE_ADDRESS" --vector "$vector"
run go 120 client/go/build/bin/mtpdraft-conformance -address "$MTPDRAFT_CONFORMANCE_ADDRESS" -vector "$vector"
run cpp 120 client/cpp/build/mtpdraft-conformance --address "$MTPDRAFT_CONFORMANCE_ADDRESS" --vector "$vector"
# The verifier's acceptance rule, each client's accept against the sampling vector.
run node-sampling 60 node client/node/sampling_conformance.js --vector "$sampling_vector"
run go-sampling 60 client/go/build/bin/mtpdraft-sampling -vector "$sampling_vector"
run cpp-sampling 60 client/cpp/build/mtpdraft-sampling --vector "$sampling_vector"
# The clients' own unit tests (a fake server in the test process).
run node-unit 120 npm --prefix client/node test
run go-unit 300 make -s -f client/polyglot.mk polyglot-go-test
run cpp-unit 60 client/cpp/build/mtpdraft-client-test
# Each client used from a program of its own (examples/clients, client/cpp/examples).
run node-example 60 node examples/clients/node/main.js --address "$MTPDRAFT_CONFORMANCE_ADDRESS"
run go-example 60 client/go/build/bin/drafter-example -address "$MTPDRAFT_CONFORMANCE_ADDRESS"
run cpp-example 60 client/cpp/build/example/drafter-example "$MTPDRAFT_CONFORMANCE_ADDRESS"
run cpp-example-subdir 60 client/cpp/build/example-subdir/drafter-example "$MTPDRAFT_CONFORMANCE_ADDRESS"

stop_server
trap - EXIT
if ((${#failed[@]})); then
    echo "polyglot: failed: ${failed[*]}; server log:"
    cat "$log"
fi
rm -f "$log"
echo "polyglot: done in $((SECONDS - start)) s"
echo "polyglot: $passed passed, ${#failed[@]} failed"
((${#failed[@]} == 0))
