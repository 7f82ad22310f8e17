# kvscope engine: `kvscope serve` on a CUDA GPU (the Triton kernels are the default backend there).
# Build from the repository root:  docker build -f docker/engine.Dockerfile -t kvscope-engine .
FROM nvidia/cuda:12.9.1-runtime-ubuntu22.04

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
# Python 3.11 (the project's version) from the deadsnakes PPA; Ubuntu 22.04 ships 3.10
RUN apt-get update \
    && apt-get install -y --no-install-recommends software-properties-common ca-certificates curl \
    && add-apt-repository -y ppa:deadsnakes/ppa \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev build-essential \
    && rm -rf /var/lib/apt/lists/*
RUN python3.11 -m venv /opt/kvscope
ENV PATH=/opt/kvscope/bin:$PATH

WORKDIR /src
COPY pyproject.toml README.md ./
COPY engine engine
COPY kernels kernels
COPY agent agent
COPY alerts alerts
COPY dashboard dashboard
COPY kvscope kvscope
# The same pins as pyproject.toml: torch's CUDA build from PyPI, the Triton that matches it
RUN pip install --upgrade pip && pip install torch==2.13.0 triton==3.7.1 && pip install .

EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s CMD curl -fsS http://127.0.0.1:8000/health || exit 1
ENTRYPOINT ["kvscope", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD ["--model", "kvscope_hybrid-small", "--agent", "http://agent:9400"]
