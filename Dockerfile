# The `tidal` image deploy/k8s/deployment.yaml runs (image: tidal:latest):
#
#   docker build -t tidal .                                   # CPU: the torch CPU wheel
#   docker build -t tidal:cuda --build-arg DEVICE=cu126 .     # CUDA: torch's cu126 wheel
#   docker build -t tidal:ray --build-arg EXTRAS=ray .        # with Ray Serve (deploy/ray/)
#
# The bundled model (Gemma 3 270M Q4_K_M) is a package dependency, so the image serves with no
# download at run time; mount another checkpoint and point model.path at it to serve that.
ARG PYTHON=3.11
FROM python:${PYTHON}-slim

# cpu, or a CUDA tag of download.pytorch.org's wheel indexes (cu126, cu128, ...). The CUDA
# wheels carry their own CUDA libraries; the host needs the NVIDIA driver and container toolkit.
ARG DEVICE=cpu
# Optional extras of the tidal package: "ray" for the Ray Serve application.
ARG EXTRAS=""

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A C compiler: tidal builds its native kernels at first use (tidal/kernels/build.py).
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# The same uid/gid as the pod's securityContext (runAsUser / runAsGroup 1000).
RUN groupadd --gid 1000 tidal && useradd --uid 1000 --gid 1000 --create-home tidal

WORKDIR /opt/tidal
COPY pyproject.toml constraints.txt README.md ./
COPY tidal ./tidal
# constraints.txt pins torch's version; the index picks its CPU or CUDA build.
RUN pip install --index-url "https://download.pytorch.org/whl/${DEVICE}" \
        --extra-index-url https://pypi.org/simple -c constraints.txt ".${EXTRAS:+[$EXTRAS]}"

USER 1000:1000
# Kernel builds and the bundled model's assembled file are cached here (TIDAL_CACHE_DIR).
ENV TIDAL_CACHE_DIR=/home/tidal/.cache/tidal
EXPOSE 8000
CMD ["tidal", "serve", "--host", "0.0.0.0", "--port", "8000"]
