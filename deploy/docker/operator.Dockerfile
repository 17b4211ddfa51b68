# The operator's image: `kvtune operator` (and `kvtune doctor`), the operator extra only: no torch, no web
# server. Build from the repository root:
#   docker build -f deploy/docker/operator.Dockerfile -t REGISTRY/kvtune-operator:0.1.0 .
# Without Docker: scripts/build_image.sh operator.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvtune ./kvtune
RUN python -m venv /opt/kvtune \
 && /opt/kvtune/bin/pip install --no-cache-dir --upgrade pip \
 && /opt/kvtune/bin/pip install --no-cache-dir '.[operator]'

FROM python:3.11-slim
COPY --from=build /opt/kvtune /opt/kvtune
ENV PATH=/opt/kvtune/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
# A numeric non-root user, so that Kubernetes' runAsNonRoot can check it without a passwd lookup, with a
# passwd entry all the same: kopf (and getpass) look the user's name up and fail on a uid with none.
RUN echo 'kvtune:x:65532:65532::/tmp:/usr/sbin/nologin' >> /etc/passwd \
 && echo 'kvtune:x:65532:' >> /etc/group
USER 65532:65532
ENTRYPOINT ["kvtune"]
CMD ["operator"]
