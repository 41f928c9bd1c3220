# HAProxy from Debian's package, running docker/haproxy.cfg, for docker/compose.replicas.yaml.
# Built on the same base as the replicas (BASE_IMAGE: python:3.11-slim by default, or the
# registry-less stand-in from docker/make_base.sh), so a host that can build the replicas can
# build this too; the build context is docker/.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

RUN apt-get update \
    && apt-get install -y --no-install-recommends haproxy \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/*

COPY haproxy.cfg /etc/haproxy/mtplx.cfg

# The addresses docker/haproxy.cfg reads (compose sets the replicas' too).
ENV MTPLX_LB_BIND=:8000 \
    MTPLX_LB_STATS_BIND=:8404

USER haproxy
EXPOSE 8000 8404
# -W: master-worker (reloads with SIGUSR2); -db: stay in the foreground, log to stdout.
ENTRYPOINT ["haproxy", "-W", "-db", "-f", "/etc/haproxy/mtplx.cfg"]
