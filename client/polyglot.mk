# The Node.js, Go and C++ clients and their conformance runners (client/node, client/go,
# client/cpp). Included by the Makefile; also works alone: `make -f client/polyglot.mk`.
# Run from the repository root. Needs Debian's Go, gRPC and cmake packages (.ci/polyglot.sh
# installs them) and Node.js 20. Builds go to client/{go,cpp}/build (ignored). Each client is
# also used from a program of its own: examples/clients/{go,node}, client/cpp/examples.
#
#   make polyglot                          build all three clients, runners and examples
#   make polyglot-conformance ADDRESS=h:p  replay tests/conformance/vector.json with each
#   make polyglot-sampling                 check each client's accept against
#                                          tests/conformance/sampling_vector.json (no server)
#   make polyglot-clean

PG_PROTO_DIR := protos
PG_PROTO := $(PG_PROTO_DIR)/mtpdraft/v1/drafter.proto
PG_VECTOR := tests/conformance/vector.json
PG_SAMPLING_VECTOR := tests/conformance/sampling_vector.json

# Node.js: the package mtpdraft-client (client/node/package.json), and a program of its own
# that installs it (examples/clients/node).
PG_NODE_EXAMPLE_DIR := examples/clients/node

# Go: the module github.com/mtpdraft/mtpdraft/client/go (client/go, its go.mod), with its
# protobuf package gen/mtpdraftv1 committed (`make -f client/polyglot.mk polyglot-go-gen` after
# changing the proto; every build checks that it is current). Built offline, in module mode,
# from Debian's sources in /usr/share/gocode (no module proxy): client/go/gomod-debian.sh writes
# a copy of a go.mod that takes every dependency from there, for the module itself (its runners
# and tests) and for the example (examples/clients/go, a module of its own that requires it by a
# replace directive).
PG_GO_DIR := client/go
PG_GO_MODULE_PATH := github.com/mtpdraft/mtpdraft/client/go
PG_GO_BUILD := $(PG_GO_DIR)/build
PG_GO_GEN := $(PG_GO_DIR)/gen/mtpdraftv1
PG_GO_BIN := $(PG_GO_BUILD)/bin/mtpdraft-conformance
# The verifier's acceptance rule (drafter.Accept) against the sampling vector.
PG_GO_SAMPLING := $(PG_GO_BUILD)/bin/mtpdraft-sampling
# A Go verifier's view of the hot path (bench/bench_service.py --go-hotpath runs it).
PG_GO_HOTPATH := $(PG_GO_BUILD)/bin/mtpdraft-hotpath
PG_GO_EXAMPLE_DIR := examples/clients/go
PG_GO_EXAMPLE := $(PG_GO_BUILD)/bin/drafter-example
PG_GO_SRCS := $(wildcard $(PG_GO_DIR)/go.mod $(PG_GO_DIR)/*/*.go $(PG_GO_DIR)/cmd/*/*.go \
	$(PG_GO_GEN)/*.go)
PG_GO_MOD_ENV = GO111MODULE=on GOFLAGS=-mod=readonly GOPROXY=off GOSUMDB=off \
	GOCACHE=$(abspath $(PG_GO_BUILD)/cache) GOPATH=$(abspath $(PG_GO_BUILD)/modpath)
# The module's go.mod, offline; `go` runs in the module's folder with it.
PG_GO_MODFILE := $(PG_GO_BUILD)/gomod/mtpdraft.mod
PG_GO = cd $(PG_GO_DIR) && $(PG_GO_MOD_ENV) go
PG_GO_MODFLAG = -modfile=$(abspath $(PG_GO_MODFILE))
# protoc writes gen/mtpdraftv1 under $(1) (the module's path taken off the go_package).
PG_GO_PROTOC = protoc -I$(PG_PROTO_DIR) --go_out=$(1) --go_opt=module=$(PG_GO_MODULE_PATH) \
	--go-grpc_out=$(1) --go-grpc_opt=module=$(PG_GO_MODULE_PATH) $(PG_PROTO)

# C++: client/cpp/CMakeLists.txt, the CMake package mtpdraft_client (the library
# mtpdraft::client), built with the conformance runner and installed into
# client/cpp/build/install; the example (client/cpp/examples, a project of its own) built twice:
# finding the installed package, and with the client's source folder (add_subdirectory).
# Debian's cmake, libgrpc++-dev (gRPC's CMake package) and protobuf.
PG_CPP_DIR := client/cpp
PG_CPP_BUILD := $(PG_CPP_DIR)/build
PG_CPP_BIN := $(PG_CPP_BUILD)/mtpdraft-conformance
PG_CPP_SAMPLING := $(PG_CPP_BUILD)/mtpdraft-sampling
# The client's own tests (a fake server in the test process).
PG_CPP_TEST := $(PG_CPP_BUILD)/mtpdraft-client-test
PG_CPP_PREFIX := $(abspath $(PG_CPP_BUILD)/install)
PG_CPP_EXAMPLES := $(PG_CPP_BUILD)/example/drafter-example $(PG_CPP_BUILD)/example-subdir/drafter-example
PG_CPP_SRCS := $(PG_PROTO) $(wildcard $(PG_CPP_DIR)/CMakeLists.txt $(PG_CPP_DIR)/cmake/* \
	$(PG_CPP_DIR)/include/mtpdraft/*.h $(PG_CPP_DIR)/src/*.cc $(PG_CPP_DIR)/conformance/*.cc \
	$(PG_CPP_DIR)/tests/*.cc)
PG_CPP_EXAMPLE_SRCS := $(wildcard $(PG_CPP_DIR)/examples/CMakeLists.txt $(PG_CPP_DIR)/examples/*.cc)
# google/rpc/{status,error_details}.proto (an error's reason and field), as the Python
# package googleapis-common-protos ships them (a dependency of the service's own).
PYTHON ?= python3
PG_RPC_PROTO_DIR = $(shell $(PYTHON) -c 'import pathlib, google.rpc.status_pb2 as m; \
	print(pathlib.Path(m.__file__).parents[2])')
PG_CXXFLAGS ?= -O1 -g0 -Wall
PG_CMAKE = cmake --log-level=WARNING -DCMAKE_BUILD_TYPE= "-DCMAKE_CXX_FLAGS=$(PG_CXXFLAGS)"
PG_CMAKE_CLIENT = $(PG_CMAKE) -DMTPDRAFT_GOOGLEAPIS_PROTO_DIR=$(PG_RPC_PROTO_DIR)

.PHONY: polyglot polyglot-node polyglot-go polyglot-go-test polyglot-go-gen polyglot-cpp polyglot-conformance polyglot-sampling polyglot-clean

polyglot: polyglot-node polyglot-go polyglot-cpp

polyglot-node: client/node/node_modules/.package-lock.json $(PG_NODE_EXAMPLE_DIR)/node_modules/.package-lock.json

client/node/node_modules/.package-lock.json: client/node/package.json client/node/package-lock.json
	cd client/node && npm ci --no-audit --no-fund

# The example installs the client as a package from its folder (a copy: the files package.json
# lists, the proto included) and is type-checked against the package's index.d.ts. After the
# client's own install: both run the client's prepare script.
$(PG_NODE_EXAMPLE_DIR)/node_modules/.package-lock.json: $(PG_NODE_EXAMPLE_DIR)/package.json \
		$(PG_NODE_EXAMPLE_DIR)/package-lock.json $(PG_NODE_EXAMPLE_DIR)/main.js \
		client/node/node_modules/.package-lock.json client/node/index.js client/node/index.d.ts $(PG_PROTO)
	cd $(PG_NODE_EXAMPLE_DIR) && npm ci --no-audit --no-fund && npm run -s typecheck

polyglot-go: $(PG_GO_BIN) $(PG_GO_SAMPLING) $(PG_GO_HOTPATH) $(PG_GO_EXAMPLE)

# The Go client's unit tests (a fake server in the test process).
polyglot-go-test: $(PG_GO_MODFILE)
	$(PG_GO) test $(PG_GO_MODFLAG) ./drafter

# Regenerates the committed protobuf package from the proto.
polyglot-go-gen:
	$(call PG_GO_PROTOC,$(PG_GO_DIR))

# The committed protobuf package must be what the proto generates (into _gen: a folder the go
# tool leaves out of the module's packages).
$(PG_GO_BUILD)/gen.stamp: $(PG_PROTO) $(wildcard $(PG_GO_GEN)/*.go)
	rm -rf $(PG_GO_BUILD)/_gen && mkdir -p $(PG_GO_BUILD)/_gen
	$(call PG_GO_PROTOC,$(PG_GO_BUILD)/_gen)
	@diff -r $(PG_GO_BUILD)/_gen/gen/mtpdraftv1 $(PG_GO_GEN) >/dev/null || { \
		echo "$(PG_GO_GEN) is not what $(PG_PROTO) generates:" \
			"run make -f client/polyglot.mk polyglot-go-gen and commit it"; exit 1; }
	touch $@

# The module, offline: every dependency from Debian's sources; then vetted (tests included).
$(PG_GO_MODFILE): $(PG_GO_BUILD)/gen.stamp $(PG_GO_SRCS) $(PG_GO_DIR)/gomod-debian.sh
	$(PG_GO_MOD_ENV) bash $(PG_GO_DIR)/gomod-debian.sh $(PG_GO_DIR) $@
	$(PG_GO) vet $(PG_GO_MODFLAG) ./...

$(PG_GO_BIN): $(PG_GO_MODFILE)
	$(PG_GO) build $(PG_GO_MODFLAG) -o $(abspath $@) ./cmd/mtpdraft-conformance

$(PG_GO_SAMPLING): $(PG_GO_MODFILE)
	$(PG_GO) build $(PG_GO_MODFLAG) -o $(abspath $@) ./cmd/mtpdraft-sampling

# Static (no cgo), so that it runs on a machine without Go or gRPC installed.
$(PG_GO_HOTPATH): $(PG_GO_MODFILE)
	cd $(PG_GO_DIR) && $(PG_GO_MOD_ENV) CGO_ENABLED=0 go build $(PG_GO_MODFLAG) -o $(abspath $@) \
		./cmd/mtpdraft-hotpath

# The example, a module of its own requiring the client's path (a replace directive).
$(PG_GO_EXAMPLE): $(PG_GO_MODFILE) $(PG_GO_EXAMPLE_DIR)/go.mod $(wildcard $(PG_GO_EXAMPLE_DIR)/*.go)
	$(PG_GO_MOD_ENV) bash $(PG_GO_DIR)/gomod-debian.sh $(PG_GO_EXAMPLE_DIR) $(PG_GO_BUILD)/gomod/example.mod
	cd $(PG_GO_EXAMPLE_DIR) && $(PG_GO_MOD_ENV) go vet -modfile=$(abspath $(PG_GO_BUILD)/gomod/example.mod) . && \
		$(PG_GO_MOD_ENV) go build -modfile=$(abspath $(PG_GO_BUILD)/gomod/example.mod) -o $(abspath $@) .

polyglot-cpp: $(PG_CPP_BIN) $(PG_CPP_SAMPLING) $(PG_CPP_TEST) $(PG_CPP_EXAMPLES)

# (A recipe line starting with + shares make's job slots with the build that cmake runs.)
$(PG_CPP_BIN): $(PG_CPP_SRCS)
	$(PG_CMAKE_CLIENT) -S $(PG_CPP_DIR) -B $(PG_CPP_BUILD)/cmake -DMTPDRAFT_CLIENT_CONFORMANCE=ON
	+cmake --build $(PG_CPP_BUILD)/cmake
	cmake --install $(PG_CPP_BUILD)/cmake --prefix $(PG_CPP_PREFIX) >/dev/null
	cp $(PG_CPP_BUILD)/cmake/mtpdraft-conformance $@

# Built with the conformance runner (MTPDRAFT_CLIENT_CONFORMANCE).
$(PG_CPP_SAMPLING): $(PG_CPP_BIN)
	cp $(PG_CPP_BUILD)/cmake/mtpdraft-sampling $@

$(PG_CPP_TEST): $(PG_CPP_BIN)
	cp $(PG_CPP_BUILD)/cmake/mtpdraft-client-test $@

$(PG_CPP_BUILD)/example/drafter-example: $(PG_CPP_BIN) $(PG_CPP_EXAMPLE_SRCS)
	$(PG_CMAKE) -S $(PG_CPP_DIR)/examples -B $(PG_CPP_BUILD)/example -DCMAKE_PREFIX_PATH=$(PG_CPP_PREFIX)
	+cmake --build $(PG_CPP_BUILD)/example
	touch $@

$(PG_CPP_BUILD)/example-subdir/drafter-example: $(PG_CPP_SRCS) $(PG_CPP_EXAMPLE_SRCS)
	$(PG_CMAKE_CLIENT) -S $(PG_CPP_DIR)/examples -B $(PG_CPP_BUILD)/example-subdir \
		-DMTPDRAFT_CLIENT_SOURCE_DIR=$(abspath $(PG_CPP_DIR))
	+cmake --build $(PG_CPP_BUILD)/example-subdir
	touch $@

# Replays the vector with the three runners against a live server (ADDRESS=host:port).
polyglot-conformance: polyglot
	@test -n "$(ADDRESS)" || { echo "give ADDRESS=host:port of a running server"; exit 2; }
	node client/node/conformance.js --address $(ADDRESS) --vector $(PG_VECTOR)
	$(PG_GO_BIN) -address $(ADDRESS) -vector $(PG_VECTOR)
	$(PG_CPP_BIN) --address $(ADDRESS) --vector $(PG_VECTOR)

# Checks each client's accept against the sampling vector (no server).
polyglot-sampling: polyglot
	node client/node/sampling_conformance.js --vector $(PG_SAMPLING_VECTOR)
	$(PG_GO_SAMPLING) -vector $(PG_SAMPLING_VECTOR)
	$(PG_CPP_SAMPLING) --vector $(PG_SAMPLING_VECTOR)

polyglot-clean:
	rm -rf $(PG_GO_BUILD) $(PG_CPP_BUILD) client/node/node_modules client/node/proto \
		$(PG_NODE_EXAMPLE_DIR)/node_modules
