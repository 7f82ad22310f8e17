# kvscope agent and dashboard (no GPU): `kvscope agent` or `kvscope dashboard` on a slim Python.
# Build from the repository root:  docker build -f docker/agent.Dockerfile -t kvscope-agent .
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN apt-get update && apt-get install -y --no-install-recommends curl && rm -rf /var/lib/apt/lists/*

WORKDIR /src
COPY pyproject.toml README.md ./
COPY engine engine
COPY kernels kernels
COPY agent agent
COPY alerts alerts
COPY dashboard dashboard
COPY kvscope kvscope
# The same pins as pyproject.toml; torch's CPU build (the agent never runs a model, the package
# depends on it), so the image stays small
RUN pip install --upgrade pip \
    && pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
    && pip install triton==3.7.1 \
    && pip install .

RUN useradd --create-home kvscope && mkdir -p /data && chown kvscope /data
USER kvscope
EXPOSE 9400 8501
ENTRYPOINT ["kvscope"]
CMD ["agent", "--host", "0.0.0.0", "--port", "9400", "--data-dir", "/data"]
