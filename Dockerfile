# Prefix Gateway: `prefix-gateway serve`, configured by GATEWAY_* environment variables.
#   docker build -t prefix-gateway .
#   docker run -p 8080:8080 -e GATEWAY_BACKENDS=http://vllm-0:8000,http://vllm-1:8000 prefix-gateway
# The same image runs an emulated replica: `docker run prefix-gateway emulate --host 0.0.0.0`.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
RUN python -m venv /opt/prefix-gateway
COPY pyproject.toml README.md LICENSE ./
COPY prefix_gateway ./prefix_gateway
# Runtime dependencies only: the `test` extra stays out of the image.
RUN /opt/prefix-gateway/bin/pip install --no-cache-dir .

FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="prefix-gateway" \
      org.opencontainers.image.description="Prefix-aware load-balancing gateway for LLM inference" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 gateway \
 && useradd --system --uid 10001 --gid gateway --no-create-home --home-dir /nonexistent \
    --shell /usr/sbin/nologin gateway
COPY --from=build /opt/prefix-gateway /opt/prefix-gateway
ENV PATH=/opt/prefix-gateway/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    GATEWAY_HOST=0.0.0.0 \
    GATEWAY_PORT=8080
USER 10001:10001
EXPOSE 8080
# No curl in a slim image: the probe is the interpreter the image already has.
HEALTHCHECK --interval=10s --timeout=3s --start-period=15s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('GATEWAY_PORT', '8080'), timeout=2)"]
ENTRYPOINT ["prefix-gateway"]
CMD ["serve"]
