# kvtune's engine and proxy image: `kvtune serve` (torch, CPU build) and `kvtune proxy` in front of vLLM or
# SGLang. Build from the repository root:
#   docker build -f deploy/docker/engine.Dockerfile -t REGISTRY/kvtune-engine:0.1.0 .
# TORCH_INDEX: where torch comes from (the CPU wheels by default; a CUDA index for GPU nodes).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

FROM python:3.11-slim AS build
ARG TORCH_INDEX
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvtune ./kvtune
RUN python -m venv /opt/kvtune \
 && /opt/kvtune/bin/pip install --no-cache-dir --upgrade pip \
 && /opt/kvtune/bin/pip install --no-cache-dir --index-url "$TORCH_INDEX" torch==2.13.0 \
 && /opt/kvtune/bin/pip install --no-cache-dir '.[engine]'

FROM python:3.11-slim
# The CPU attention kernel is compiled for the node's CPU on first start (kvtune/kernels/cpu_build.py):
# it needs g++ and OpenMP at run time.
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ libgomp1 \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /cache && chown 65532:65532 /cache \
 && echo 'kvtune:x:65532:65532::/cache:/usr/sbin/nologin' >> /etc/passwd \
 && echo 'kvtune:x:65532:' >> /etc/group
COPY --from=build /opt/kvtune /opt/kvtune
# The root filesystem may be read-only: the tiny checkpoint and the compiled kernel go to /cache (the
# chart mounts an emptyDir there).
ENV PATH=/opt/kvtune/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    XDG_CACHE_HOME=/cache \
    KVTUNE_CACHE_DIR=/cache/kvtune
USER 65532:65532
EXPOSE 8000
ENTRYPOINT ["kvtune"]
CMD ["serve", "--tiny", "--host", "0.0.0.0", "--port", "8000"]
