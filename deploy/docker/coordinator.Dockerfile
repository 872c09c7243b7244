# syntax=docker/dockerfile:1
# Coordinator image: the core (refit-plane, no extras) and the coordinator's distribution
# (services/coordinator). The coordinator never touches tensors, so no torch, no CUDA: a
# slim Python image, a virtualenv, a non-root user.
#
#   docker build -f deploy/docker/coordinator.Dockerfile -t refit-coordinator:0.1.0 .
#
# (run from the repository root; .dockerignore keeps the context to the package sources)
ARG PYTHON_IMAGE=docker.io/library/python:3.11.13-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/refit
WORKDIR /src
COPY pyproject.toml README.md LICENSE MANIFEST.in ./
COPY refitplane ./refitplane
COPY services/coordinator ./services/coordinator
# Fail the build, not the pod, when the console script or the service package is missing.
RUN /opt/refit/bin/pip install --no-cache-dir . ./services/coordinator \
    && /opt/refit/bin/python -c "import refitplane.coordinator" \
    && test -x /opt/refit/bin/refit-coordinator \
    && test -x /opt/refit/bin/refitctl

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="refit-coordinator" \
      org.opencontainers.image.description="refitplane weight-refit coordinator (gRPC 50051, control lane 50052, HTTP 8080)" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 refit \
    && useradd --system --uid 10001 --gid 10001 --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin refit
# The venv's python links to this stage's identical /usr/local/bin/python3.11.
COPY --from=build /opt/refit /opt/refit
ENV PATH=/opt/refit/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# Numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
USER 10001:10001
WORKDIR /tmp
EXPOSE 50051 50052 8080
# SIGTERM starts the coordinator's graceful stop (drain calls, close streams, flush state).
STOPSIGNAL SIGTERM
ENTRYPOINT ["refit-coordinator"]
