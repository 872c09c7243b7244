# syntax=docker/dockerfile:1
# vLLM generator image: the official vLLM image plus refit-plane, which brings
#   - the weight-transfer engine, registered with vLLM through the `vllm.general_plugins`
#     entry point `refitplane` (selected by --weight-transfer-config '{"backend": "refitplane"}'),
#   - the `refit-sidecar` command, which drives vLLM's pause / weight-update / resume verbs.
# One image serves both containers of a generator pod (vLLM and the sidecar).
#
#   docker build -f deploy/docker/generator.Dockerfile -t refit-generator:0.1.0 .
#
# vLLM >= 0.26 is supported; keep VLLM_IMAGE on a release tag (or a digest).
ARG VLLM_IMAGE=docker.io/vllm/vllm-openai:v0.26.0

FROM ${VLLM_IMAGE}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG REFIT_EXTRAS=nccl
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/refit-src
COPY pyproject.toml README.md LICENSE MANIFEST.in ./
COPY refitplane ./refitplane
COPY services/generator ./services/generator
# The image's CUDA builds of torch and vLLM must survive: pin what is installed as
# constraints, so a conflicting requirement fails the build instead of replacing them.
# Then check that vLLM will find the plugin.
RUN python3 -m pip freeze | grep -iE '^(torch|vllm|transformers|triton|numpy)==' > /tmp/keep.txt \
    && python3 -m pip install --no-cache-dir --constraint /tmp/keep.txt . "./services/generator[${REFIT_EXTRAS}]" \
    && rm -rf /opt/refit-src /tmp/keep.txt \
    && python3 -c "from importlib.metadata import entry_points as e; assert 'refitplane' in e(group='vllm.general_plugins').names"

# vLLM writes caches (Hugging Face, torch.compile, Triton) under $HOME: give the non-root
# user a home; pods mount an emptyDir or a volume there.
RUN groupadd --system --gid 10001 refit \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/refit \
       --shell /usr/sbin/nologin refit
ENV HOME=/home/refit \
    HF_HOME=/home/refit/.cache/huggingface
USER 10001:10001
WORKDIR /home/refit
# The ENTRYPOINT stays vLLM's own. Pods set VLLM_SERVER_DEV_MODE=1 themselves (it opens the
# weight-update HTTP verbs, so it is visible in the pod spec, not hidden in the image), and
# the sidecar container runs `refit-sidecar` (see deploy/examples/generator-vllm.yaml).
