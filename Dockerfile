# syntax=docker/dockerfile:1
# One image for the three servers; the pod picks one with its args:
#   docker run IMAGE orchestrator | draft_service | target_service   (ENTRYPOINT python -m)
#
# CPU image, bundled models baked in (kind/minikube, deploy/overlays/cpu):
#   docker build -t specdec:0.1.0-cpu .
# GPU image, models from the cluster's model volume (deploy/overlays/gpu):
#   docker build -t specdec:0.1.0-cu128 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#     --build-arg BUNDLE_MODELS=no .
ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm
# yes: copy models/draft and models/target into /app/models; no: leave them out.
ARG BUNDLE_MODELS=yes

# ---- dependencies, in a virtualenv that is copied whole into the runtime stage ----
FROM ${PYTHON_IMAGE} AS deps
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from the PyTorch index of the chosen build (cpu, cu128, ...): the
# requirements pin the same version, which is then already satisfied.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY requirements.txt /tmp/requirements.txt
# Runtime dependencies only: the deploy/test tooling (deploy/requirements.txt) stays out.
RUN sed -e '/^-r .*deploy\/requirements\.txt/d' /tmp/requirements.txt > /tmp/requirements.runtime.txt \
 && pip install -r /tmp/requirements.runtime.txt \
 && rm /tmp/requirements*.txt
# specdec's CPU kernels (specdec/native: 16-bit weight products, packed attention), compiled
# here with the build stage's g++ for any x86-64 CPU (each kernel picks AVX-512, AVX2 or
# plain C++ when it loads), so that the slim runtime image needs no compiler.
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends g++ >/dev/null \
 && rm -rf /var/lib/apt/lists/*
COPY specdec/__init__.py /build/specdec/__init__.py
COPY specdec/native /build/specdec/native
RUN cd /build && python -m specdec.native --cache /opt/specdec-kernels \
 && rm -rf /opt/specdec-kernels/*/*.o /opt/specdec-kernels/*/.ninja* /build

# ---- the bundled model pair, or nothing ----
FROM ${PYTHON_IMAGE} AS models-yes
COPY models/draft /models/draft
COPY models/target /models/target

FROM ${PYTHON_IMAGE} AS models-no
RUN mkdir /models

FROM models-${BUNDLE_MODELS} AS models

# ---- runtime ----
FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="specdec" \
      org.opencontainers.image.description="Distributed speculative decoding: orchestrator, draft and target servers"
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    HF_HOME=/tmp/huggingface \
    HF_HUB_OFFLINE=1 \
    HF_HUB_DISABLE_TELEMETRY=1 \
    TORCHINDUCTOR_CACHE_DIR=/tmp/torchinductor \
    SPECDEC_KERNEL_CACHE=/opt/specdec-kernels \
    LD_LIBRARY_PATH=/usr/local/nvidia/lib64:/usr/local/nvidia/lib
# LD_LIBRARY_PATH above: where GKE's GPU device plugin mounts the driver's libraries
# (libcuda.so.1), as the nvidia/cuda images set it; without it a GPU replica there finds no
# CUDA and refuses to start. Elsewhere the NVIDIA container runtime puts them on the linker's
# own path and the entry is an empty directory's.
RUN groupadd --system --gid 10001 specdec \
 && useradd --system --uid 10001 --gid 10001 --home-dir /nonexistent --no-create-home \
      --shell /usr/sbin/nologin specdec
COPY --from=deps /opt/venv /opt/venv
COPY --from=deps /opt/specdec-kernels /opt/specdec-kernels
WORKDIR /app
# Largest and least often changed first: models, then code.
COPY --from=models /models /app/models
COPY specdec /app/specdec
COPY orchestrator /app/orchestrator
COPY draft_service /app/draft_service
COPY target_service /app/target_service
# Bytecode at build time: the root filesystem is read-only in the pods.
RUN python -m compileall -q /app/specdec /app/orchestrator /app/draft_service /app/target_service
USER 10001:10001
EXPOSE 50051 50061 50071 9090
ENTRYPOINT ["python", "-m"]
CMD ["orchestrator"]
