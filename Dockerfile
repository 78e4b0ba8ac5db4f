# One image for every kubegpu role: `kubegpu node`, `kubegpu scheduler`, `kubegpu webhook`.
#
# - The base is pinned to an exact release (override PYTHON_IMAGE with a digest, python@sha256:…, to pin
#   the bytes); every Python dependency to the exact version in constraints.txt, the file CI installs with.
# - Only the runtime dependencies are installed: no matplotlib or scipy (`kubegpu[sim]`), no jsonpatch
#   (`kubegpu[demo]`), and the demo and the test stand-ins are removed from the installed package.
# - It runs as the unprivileged user 65532; the node DaemonSet alone runs as root (it serves sockets in the
#   kubelet's root-owned device-plugin directory and writes CDI specs to /var/run/cdi), set in its manifest.
# - NVML comes from the host driver: like NVIDIA's device-plugin image, the image asks the NVIDIA container
#   runtime for every GPU with the compute and utility capabilities (the extender and webhook Deployments
#   set NVIDIA_VISIBLE_DEVICES=void, they need no GPU).
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY src ./src
# `kubegpu --version` names the build: the image has no .git, so the commit and date are baked in
# (docker build --build-arg KUBEGPU_COMMIT=$(git rev-parse HEAD) .; the date defaults to the build's).
ARG KUBEGPU_COMMIT=unknown
ARG KUBEGPU_BUILD_DATE=
RUN printf 'COMMIT = "%s"\nDATE = "%s"\n' "$KUBEGPU_COMMIT" "${KUBEGPU_BUILD_DATE:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}" \
        > src/kubegpu/cli/_build_info.py
RUN python -m venv /opt/kubegpu \
    && /opt/kubegpu/bin/pip install -c constraints.txt . \
    && site=$(/opt/kubegpu/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") \
    && rm -rf "$site/kubegpu_standins" "$site/kubegpu/demo" \
    && /opt/kubegpu/bin/python -c "import kubegpu.cli.main, kubegpu.node.daemon, kubegpu.scheduler.app, kubegpu.webhook" \
    && ! /opt/kubegpu/bin/python -c "import matplotlib" 2>/dev/null \
    && ! /opt/kubegpu/bin/python -c "import kubegpu_standins" 2>/dev/null

FROM ${PYTHON_IMAGE}
COPY --from=build /opt/kubegpu /opt/kubegpu
ENV PATH=/opt/kubegpu/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    NVIDIA_DISABLE_REQUIRE=true
RUN useradd --uid 65532 --no-create-home --shell /usr/sbin/nologin kubegpu
USER 65532:65532
ENTRYPOINT ["kubegpu"]
CMD ["--help"]
