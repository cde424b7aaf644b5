# pagedserve on Ray, the image the Helm chart's pods run (helm/pagedserve). Two variants:
#   docker build -t ghcr.io/pagedserve/pagedserve:0.1.0-cpu .                        # CPU nodes
#   docker build -t ghcr.io/pagedserve/pagedserve:0.1.0-cuda --build-arg VARIANT=cuda .  # GPU nodes
# The base is Ray's own image at the Ray version pinned in constraints.txt: KubeRay's rayVersion,
# the head and every worker must run the same Ray.
ARG RAY_VERSION=2.60.0
ARG VARIANT=cpu

FROM rayproject/ray:${RAY_VERSION}-py311-cpu AS base-cpu
# g++ builds pagedserve's C++ CPU attention kernel on each node at first use (-march=native, so
# it is built where it runs, not here); without it the engine keeps its slower pure-torch path.
USER root
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
USER 1000:100
# PyPI's torch for Linux is the CUDA build (GBs of CUDA libraries); the CPU nodes get the CPU
# build of the same pinned version from PyTorch's index first, so the install below keeps it.
COPY --chown=ray:users constraints.txt /tmp/constraints.txt
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu \
        "$(grep '^torch==' /tmp/constraints.txt)"

FROM rayproject/ray:${RAY_VERSION}-py311-gpu AS base-cuda

FROM base-${VARIANT}
# Ray's image lets its user become root through sudo, with no password; ours has no sudo. The
# pods run as this user (uid 1000, gid 100: the chart's podSecurityContext) with no privileges.
USER root
RUN apt-get purge -y sudo && rm -rf /etc/sudoers.d
USER 1000:100
WORKDIR /home/ray/pagedserve
COPY --chown=ray:users pyproject.toml constraints.txt README.md ./
COPY --chown=ray:users pagedserve ./pagedserve
RUN pip install --no-cache-dir -c constraints.txt .
# No model hub is reached: checkpoints come from the chart's model volume.
ENV HF_HUB_OFFLINE=1
