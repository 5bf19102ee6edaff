# Developer entry points. `make proto` regenerates the wire code; never edit it.
PYTHON ?= python3
PROTO_DIR := protos
PROTOS := $(wildcard $(PROTO_DIR)/mtpdraft/v1/*.proto)

.PHONY: install proto test test-gpu lint serve bench bench-service bench-precision bench-sampling \
	loadtest image deploy-validate deploy-check

install:
	$(PYTHON) -m pip install -e '.[dev]'

proto:
	$(PYTHON) -m grpc_tools.protoc -I$(PROTO_DIR) \
		--python_out=$(PROTO_DIR) --pyi_out=$(PROTO_DIR) --grpc_python_out=$(PROTO_DIR) \
		$(PROTOS)
	touch $(PROTO_DIR)/mtpdraft/v1/__init__.py

test:
	$(PYTHON) -m pytest -q

# On a machine with a CUDA GPU: the kernels and the served path at real shapes.
test-gpu:
	$(PYTHON) -m pytest -q -m gpu

# On a machine with a CUDA GPU: writes bench/results/step.{json,md} (MiMo-7B), moe_kernel,
# families.{json,md} (GLM-4.5-Air, Qwen3-Next-80B, DeepSeek-V3) and gemv.{json,md}.
bench:
	$(PYTHON) bench/bench_step.py --out-dir bench/results
	$(PYTHON) bench/bench_moe_kernel.py --out-dir bench/results
	$(PYTHON) bench/bench_families.py --out-dir bench/results
	$(PYTHON) bench/bench_gemv.py --out-dir bench/results

# On a machine with a CUDA GPU: sampled chains beside greedy ones (bench/results/sampling.{json,md})
# and a sampled draft's draw kernel by kernel (draw.{json,md}).
bench-sampling:
	$(PYTHON) bench/bench_sampling.py --out bench/results
	$(PYTHON) bench/bench_draw.py --out-dir bench/results

# On a machine with a CUDA GPU: bf16 drafts against float32 at the published shapes
# (bench/results/precision.{json,md}), and against float64 on the tiny checkpoints, each
# disagreement set beside the routing flip that caused it (precision_routing.{json,md}).
bench-precision:
	$(PYTHON) bench/bench_precision.py --out-dir bench/results
	$(PYTHON) bench/precision_routing.py --out-dir bench/results

# On a machine with a CUDA GPU: a verifier's step served (V verifiers x S states; the
# kernel-only chain, the in-process engine, the canned-reply floor, a Unix socket, tracing:
# bench/results/verifier.{json,md}), then one-state streams (bench/results/service.{json,md};
# with a Go verifier's figures too where client/go/build/bin/mtpdraft-hotpath is built, make
# polyglot-go; 64 streams on three starts of the server: one start can be 25% off another),
# and where one served step of 64 states goes, hop by hop (bench/results/profile/timeline_stream_64.*).
bench-service:
	$(PYTHON) bench/bench_verifier.py --out-dir bench/results
	$(PYTHON) bench/timeline_served_step.py --out-dir bench/results/profile
	$(PYTHON) bench/bench_service.py --repeats 3 --out-dir bench/results

# Against a server already running on localhost:50051 (`make serve`).
loadtest:
	mtpdraft loadtest --target 127.0.0.1:50051 --verifiers 16 --duration 10 \
		--out loadtest.json --plot loadtest.png

# The drafter's image, from the Dockerfile, tagged with the name deploy/kustomization.yaml
# gives it (its images: entry, the one place to name a registry). Needs a Docker engine (with
# the NVIDIA container toolkit to run it).
IMAGE = $(shell $(PYTHON) -c 'import yaml; (i,) = yaml.safe_load(open("deploy/kustomization.yaml"))["images"]; print(i["newName"], i["newTag"], sep=":")')
image:
	docker build -t $(IMAGE) .

# The Kubernetes manifests checked offline, no cluster or kubectl needed: each document against
# the API's schemas (kubernetes-validate, strict), then tests/deploy's cross-checks (selectors,
# ports, probes, the image and its Dockerfile, the proxy's upstreams, `mtpdraft serve`'s flags;
# the kustomization as rendered, where kubectl is installed).
K8S_VERSION ?= 1.30.0
DEPLOY_MANIFESTS ?= $(wildcard deploy/k8s/*.yaml)
deploy-validate:
	$(PYTHON) -m kubernetes_validate --strict --quiet -k $(K8S_VERSION) $(DEPLOY_MANIFESTS)

deploy-check: deploy-validate
	$(PYTHON) -m pytest -q -p no:cacheprovider tests/deploy

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

serve:
	mtpdraft serve --port 50051

include client/polyglot.mk
