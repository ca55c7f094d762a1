# meshca's image: one `meshca` command for the CA (`meshca ca`) and the agent (`meshca agent`).
#   docker build -t ghcr.io/meshca/meshca:0.1.0 .
# The manifests under deploy/ run it as uid/gid 1337 with a read-only root filesystem.
#
# The install steps below (build the sdist and the wheel from it with `python -m build`, then
# `pip install` the wheel into a fresh virtualenv) are exactly those that
# tests/packaging/test_installed_package.py runs from a clean export of the tree and then checks
# (every product module shipped, every command starts from outside the checkout). No Docker engine
# runs in CI, so that test is what covers this file; keep the two in step.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY meshca ./meshca
COPY certs ./certs
COPY ca_server ./ca_server
COPY agent ./agent
COPY proto ./proto
RUN python -m pip install --no-cache-dir "build>=1.2" \
 && python -m build --outdir /dist /src \
 && python -m venv /opt/meshca \
 && /opt/meshca/bin/pip install --no-cache-dir /dist/meshca-*.whl

FROM python:3.11-slim
COPY --from=build /opt/meshca /opt/meshca
RUN groupadd --gid 1337 meshca \
 && useradd --uid 1337 --gid 1337 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin meshca
ENV PATH=/opt/meshca/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# The agent's defaults (./var/run/secrets/...) are relative, as in Istio: run from /.
WORKDIR /
USER 1337:1337
# 15012 CA gRPC (TLS), 15014 CA monitoring, 15020 agent status.
EXPOSE 15012 15014 15020
ENTRYPOINT ["meshca"]
CMD ["--help"]
