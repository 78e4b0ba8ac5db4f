# One image for every kubegpu role: `kubegpu node`, `kubegpu scheduler`, `kubegpu webhook`.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
# NVML comes from the host driver (mounted by the NVIDIA container runtime); nothing GPU-specific is baked in.
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels \
    && useradd --uid 65532 --no-create-home --shell /usr/sbin/nologin kubegpu
# The node daemon needs root for the kubelet's device-plugin directory; the DaemonSet runs it as root,
# the scheduler extender and the webhook run as 65532 (set in their manifests).
ENTRYPOINT ["kubegpu"]
CMD ["--help"]
