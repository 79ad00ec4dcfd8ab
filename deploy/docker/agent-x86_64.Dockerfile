# An x86-64 edge agent: docker build -f deploy/docker/agent-x86_64.Dockerfile -t fedper-agent .
FROM python:3.11-slim
WORKDIR /opt/fedper
COPY . .
# The base install is the device install: onnxruntime-training-cpu, no coordinator or emulator extras.
# Point PIP_EXTRA_INDEX_URL at a CPU-only torch index to keep the image small.
ARG PIP_EXTRA_INDEX_URL=
RUN pip install --no-cache-dir .
VOLUME ["/var/lib/fedper"]
ENTRYPOINT ["fedper-agent", "--artifacts", "/var/lib/fedper/artifacts", "--data", "/var/lib/fedper/data", \
            "--state-dir", "/var/lib/fedper/agent"]
