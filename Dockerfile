# Base: python:3.11-slim (CPU), an NGC PyTorch image (CUDA) or an Ascend CANN/MindSpeed image (NPU).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
RUN (command -v make >/dev/null || (apt-get update && apt-get install -y --no-install-recommends make)) \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/mindspeed-proxy
COPY . .
# On accelerator images torch (and torch_npu) are preinstalled: reuse them instead of the CPU pin.
ARG REUSE_SYSTEM_TORCH=0
RUN if [ "$REUSE_SYSTEM_TORCH" = "1" ]; then \
        pip install --no-cache-dir megatron-core==0.16.1 && pip install --no-cache-dir -e '.[test,report,proxy]'; \
    else make setup; fi
CMD ["make", "demo"]
