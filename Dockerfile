# kvd: the per-node KV-cache daemon, as the image of a sidecar beside a prefill or decode engine.
#
#   docker build -t kvd .                      # torch from the default index (its Linux wheels are CUDA builds)
#   docker build -t kvd:cpu --build-arg TORCH_PIP_ARGS="--index-url <PyTorch's CPU wheel index>" .
#                                              # CPU-only torch: shm arenas, Mooncake over TCP, no arena=cuda
#   docker run --rm --shm-size 1g kvd          # `kvd serve` with deploy/docker/kvd.yaml (`kvd serve --help` lists all)
#
# What the engine has to share with this container (kvd is useless alone):
#   * the Unix sockets: listen_unix (/run/kvd/kvd.sock here) and the peer socket beside it
#     (<listen_unix>.peer); with arena=cuda also the handle socket (<listen_unix>.handles), over
#     which the CUDA arena's chunk fds travel (SCM_RIGHTS). Mount one volume at /run/kvd in both.
#   * the shm arena: a file in arena_dir (/dev/shm) that the engine maps by path, so both must see
#     the same tmpfs (Kubernetes: one emptyDir of medium Memory mounted at /dev/shm in both
#     containers; docker: --ipc shareable here and --ipc container:<kvd> on the engine, or one
#     tmpfs volume mounted in both as arena_dir). The file is mode 0600 and sockets follow the
#     umask: run the engine as this image's user (uid 10001) or as root, or set group_access
#     (KVD_GROUP_ACCESS=true: the file 0660, the sockets group-writable) and give the engine
#     group 10001 (docker run --group-add 10001; Kubernetes: the pod's fsGroup).
#   * arena=cuda: both containers must see the same GPU (the engine imports the exported chunks on
#     that device) and share an IPC namespace, as CUDA IPC wants (a Kubernetes pod does).
#
# Ports (tests/deploy/test_deploy.py keeps EXPOSE equal to deploy/docker/kvd.yaml and the MC_* below): 50051 gRPC for
# engines and peer daemons (listen_tcp), 9470 Prometheus /metrics (metrics_port), 17000-17003
# Mooncake's handshake and data ports (MC_MIN_RPC_PORT..MC_MAX_RPC_PORT: the engine draws both
# there; it listens on every interface whatever transfer_host says). Peers on other hosts must
# be told this container's address: set KVD_ADVERTISE=<ip>:50051 and KVD_TRANSFER_HOST=<ip>.
# The control plane has no TLS: set KVD_PEER_TOKEN and keep 50051 off untrusted networks.

ARG PYTHON_IMAGE=python:3.12-slim

# ---- build: a virtual environment with torch, kvd and its Mooncake extra ---------------------
FROM ${PYTHON_IMAGE} AS build
# torch first, on its own, so its index options apply to it alone. The default resolves from the
# default index (CUDA builds on Linux); pin what production runs.
ARG TORCH_SPEC="torch==2.13.0"
# Extra pip options for the torch install: --index-url of a CPU wheel index, --find-links, ...
ARG TORCH_PIP_ARGS=""
# kvd's optional dependencies: "mooncake" (the CPU build of the Transfer Engine: shm arenas), "proxy"
# (aiohttp, for `kvd proxy`), or ""
ARG EXTRAS="mooncake,proxy"
# More packages, resolved with kvd. arena=cuda needs cuda-python, and with Mooncake its CUDA build
# instead of the extra: --build-arg EXTRAS= --build-arg EXTRA_PACKAGES="mooncake-transfer-engine cuda-python"
ARG EXTRA_PACKAGES=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/kvd/bin:$PATH
RUN python -m venv /opt/kvd \
 && pip install ${TORCH_PIP_ARGS} "${TORCH_SPEC}"
COPY pyproject.toml README.md /src/
COPY kvd /src/kvd
# The NIXL data plane (backend: nixl), installed without its dependencies (they pull a CUDA torch
# and the nvidia-* wheels); "" leaves it out. kvd sets UCX_MODULES=^ib itself on hosts without
# InfiniBand (UCX's ib module otherwise crashes the process at exit).
ARG NIXL_PACKAGES="nixl-cu12==1.5.1 nixl==1.5.1"
RUN pip install "/src${EXTRAS:+[${EXTRAS}]}" ${EXTRA_PACKAGES} \
 && if [ -n "${NIXL_PACKAGES}" ]; then pip install --no-deps ${NIXL_PACKAGES}; fi \
 && find /opt/kvd -name __pycache__ -prune -exec rm -rf {} + \
 && kvd serve --help >/dev/null

# ---- runtime: the venv, the system libraries Mooncake links, a non-root user -----------------
FROM ${PYTHON_IMAGE}
# libibverbs1 + ibverbs-providers: Mooncake links libibverbs even for TCP; the providers drive
# real RDMA NICs. libnuma1, libcurl4: also linked by Mooncake's engine.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libibverbs1 ibverbs-providers libnuma1 libcurl4 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 kvd \
 && useradd --system --uid 10001 --gid kvd --home-dir /run/kvd --shell /usr/sbin/nologin kvd \
 && install -d -o kvd -g kvd -m 0750 /run/kvd
COPY --from=build /opt/kvd /opt/kvd
COPY deploy/docker/kvd.yaml /etc/kvd/kvd.yaml
ENV PATH=/opt/kvd/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    KVD_CONFIG_FILE=/etc/kvd/kvd.yaml \
    MC_MIN_RPC_PORT=17000 \
    MC_MAX_RPC_PORT=17003
USER kvd
WORKDIR /run/kvd
EXPOSE 50051 9470 17000-17003
# The gRPC health service's answer for kvd.v1.Kvd (NOT_SERVING while a SIGTERM drains), asked on
# the Unix socket (TCP when listen_unix is off) that kvd's own loader reads from KVD_CONFIG_FILE
# and KVD_* (settings given as `kvd serve` flags instead are not seen here).
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 CMD ["python", "-c", "import sys, grpc\nfrom grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g\nfrom kvd.config import load_settings\ns = load_settings()\na = 'unix:' + s.listen_unix if s.listen_unix else '127.0.0.1:' + s.listen_tcp.rsplit(':', 1)[1]\nr = g.HealthStub(grpc.insecure_channel(a)).Check(h.HealthCheckRequest(service='kvd.v1.Kvd'), timeout=3)\nsys.exit(r.status != h.HealthCheckResponse.SERVING)"]
# SIGTERM: NOT_SERVING, drain in-flight calls for grace_s, release the arena (give the container
# grace_s plus a few seconds before SIGKILL: docker stop -t, terminationGracePeriodSeconds).
STOPSIGNAL SIGTERM
ENTRYPOINT ["kvd"]
CMD ["serve"]
