# The drafter's image: `mtpdraft serve` on a CUDA GPU, as deploy/k8s/drafter.yaml runs it.
#
#   make image                                  # docker build -t <kustomization's image> .
#   docker run --gpus all -p 50051:50051 mtpdraft:0.1.0 [--model=/models/DIR ...]
#
# The arguments after the image are `mtpdraft serve`'s flags (they replace CMD's: keep
# --host=0.0.0.0). torch's wheels bring their own CUDA libraries; the base image brings the
# NVIDIA container runtime's settings, the driver is the host's. Triton compiles its launcher
# with gcc and Python's headers the first time it runs on a GPU: both stay in the image.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG TORCH_VERSION=2.13.0
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/mtpdraft
ENV PATH=/opt/mtpdraft/bin:$PATH
RUN pip install torch==${TORCH_VERSION}

# The package last: a change of the source rebuilds this layer only (.dockerignore: the
# package's folders alone are sent).
COPY . /src
RUN pip install /src && rm -rf /src

# A user of its own, never root: numeric, so that Kubernetes' runAsNonRoot can check it.
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin mtpdraft
USER 10001
WORKDIR /home/mtpdraft

EXPOSE 50051
# As the Kubernetes probes ask it: grpc.health.v1 for mtpdraft.v1.Drafter, SERVING or not
# (a draining server is not). The start period covers loading and graph capture, as the
# startupProbe's 120 x 5 s do. A server with TLS needs the --tls-* flags here too.
HEALTHCHECK --interval=10s --timeout=5s --start-period=600s --retries=3 \
    CMD ["mtpdraft", "info", "--target", "127.0.0.1:50051", "--service", "mtpdraft.v1.Drafter", "--health-only"]
# The exec form: mtpdraft is PID 1 and gets SIGTERM itself, which drains it (the
# StatefulSet's preStop signals PID 1).
ENTRYPOINT ["mtpdraft", "serve"]
CMD ["--host=0.0.0.0", "--port=50051"]
