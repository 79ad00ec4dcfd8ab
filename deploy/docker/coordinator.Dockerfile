# The coordinator and its embedded broker: docker build -f deploy/docker/coordinator.Dockerfile -t fedper-coordinator .
FROM python:3.11-slim
WORKDIR /opt/fedper
COPY . .
# The coordinator never runs a model: point PIP_EXTRA_INDEX_URL at a CPU-only torch index to keep the image small.
ARG PIP_EXTRA_INDEX_URL=
RUN pip install --no-cache-dir '.[coordinator]'
VOLUME ["/var/lib/fedper"]
ENTRYPOINT ["fedper-coordinator", "--state-dir", "/var/lib/fedper/coordinator"]
