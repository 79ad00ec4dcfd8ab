"""Prometheus metrics of the coordinator (`fedper-coordinator --metrics-port`, docs/operations.md).

The engine stays free of I/O and of this library: the service's loop copies the engine's public state
into an immutable snapshot after each iteration, and the HTTP thread only reads the latest one, so a
scrape never walks a dict the loop is changing; a closed round's figures come from its metrics.jsonl
record. Each instance has its own registry (tests run several).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fedper.coordinator.store import METRICS_FILE

if TYPE_CHECKING:
    from fedper.coordinator.durable import Coordinator

ROUND_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, float("inf"))  # a round: seconds to hours
FAST_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, float("inf"))  # a fold, aggregation, broadcast


@dataclass(frozen=True)
class _Snapshot:
    """The engine's public state after one loop iteration: what a scrape reports."""

    registered: int
    online: int
    invited: int
    accepted_devices: int
    round: int
    rounds_planned: int
    rounds_closed: int
    finished: bool
    min_clients: int
    accepted_total: int
    refusals: dict[str, int] = field(default_factory=dict)
    received_bytes: int = 0
    sent_bytes: int = 0
    accuracy: float | None = None
    dp_epsilon: float | None = None


class CoordinatorMetrics:
    """Call `observe` after each loop iteration (from one thread); `serve` starts the HTTP endpoint."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._snapshot: _Snapshot | None = None
        self._records_read = 0  # bytes of metrics.jsonl already read
        self._closed_bytes = 0  # bytes received in the rounds of those records
        self._accuracy: float | None = None  # mean reported accuracy of the last closed round
        self._folds_seen: tuple[int, float] | None = None  # (accepted updates, fold seconds) at the last call
        self._server: tuple[WSGIServer, threading.Thread] | None = None
        self.fold_seconds = Histogram("fedper_fold_seconds", "Seconds to fold one accepted update into the "
                                      "round's aggregate and checkpoint it.", buckets=FAST_BUCKETS,
                                      registry=self.registry)
        self.round_seconds = Histogram("fedper_round_seconds", "Seconds from a round's opening to its close "
                                       "(rounds closed by this process).", buckets=ROUND_BUCKETS,
                                       registry=self.registry)
        self.aggregate_seconds = Histogram("fedper_aggregate_seconds", "Seconds to turn a closing round's "
                                           "aggregate into the next model.", buckets=FAST_BUCKETS,
                                           registry=self.registry)
        self.broadcast_seconds = Histogram("fedper_broadcast_seconds", "Seconds until the broker acknowledged "
                                           "the model broadcast that opened a round.", buckets=FAST_BUCKETS,
                                           registry=self.registry)
        self.registry.register(_SnapshotCollector(self))

    @property
    def snapshot(self) -> _Snapshot | None:
        return self._snapshot

    def observe(self, coordinator: Coordinator) -> None:
        """Copy the engine's public state; read the records of rounds closed since the last call. O(1) per
        call but for the refusal codes (a handful) and a closed round's record."""
        closed = coordinator.round.number - (0 if coordinator.finished else 1)
        if self._snapshot is None or closed != self._snapshot.rounds_closed:
            self._read_records(coordinator, first=self._snapshot is None)
        counters = coordinator.counters
        self._observe_folds(counters["accepted"], coordinator.fold_seconds)
        self._snapshot = _Snapshot(
            registered=len(coordinator.registered),
            online=len(coordinator.online),
            invited=coordinator.invited_count,
            accepted_devices=len(coordinator.round.folded),
            round=coordinator.round.number,
            rounds_planned=coordinator.config.rounds.rounds,
            rounds_closed=closed,
            finished=coordinator.finished,
            min_clients=coordinator.config.rounds.min_clients,
            accepted_total=counters["accepted"],
            refusals={code: n for code, n in counters.items() if code != "accepted"},
            received_bytes=self._closed_bytes + coordinator.round.bytes_received,
            sent_bytes=coordinator.bytes_sent,
            accuracy=self._accuracy,
            dp_epsilon=coordinator.dp_epsilon,
        )

    def _observe_folds(self, accepted: int, fold_seconds: float) -> None:
        """One observation per update folded since the last call (their mean, should there be several: the
        service calls after each message, and a message completes at most one update)."""
        if self._folds_seen is not None:
            folded = accepted - self._folds_seen[0]
            for _ in range(folded):
                self.fold_seconds.observe((fold_seconds - self._folds_seen[1]) / folded)
        self._folds_seen = (accepted, fold_seconds)

    def _read_records(self, coordinator: Coordinator, first: bool) -> None:
        """Fold the metrics.jsonl records appended since the last read. The first read (a resumed run's
        history) sets the totals only; the histograms count the rounds this process closed."""
        path = coordinator.store.dir / METRICS_FILE
        if not path.exists():
            return
        with open(path, "rb") as f:
            f.seek(self._records_read)
            data = f.read()
        complete = data[:data.rfind(b"\n") + 1]  # the engine appends whole lines; never read half of one
        self._records_read += len(complete)
        for line in complete.splitlines():
            record: dict[str, Any] = json.loads(line)
            self._closed_bytes += record["bytes_received"]
            self._accuracy = record["accuracy_mean"]
            if not first:
                self.round_seconds.observe(record["collect_s"])
                self.aggregate_seconds.observe(record["aggregate_s"])
                self.broadcast_seconds.observe(record["broadcast_s"])

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics on host:port (0: a free port) in a daemon thread; the port it listens on."""
        self._server = start_http_server(port, addr=host, registry=self.registry)
        return self._server[0].server_port

    def close(self) -> None:
        if self._server is not None:
            server, thread = self._server
            server.shutdown()
            server.server_close()
            thread.join(5)
            self._server = None


class _SnapshotCollector(Collector):
    """Turns the latest snapshot into metric families at scrape time (in the HTTP server's thread)."""

    def __init__(self, metrics: CoordinatorMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        s = self._metrics.snapshot
        if s is None:
            return
        yield GaugeMetricFamily("fedper_devices_registered", "Devices registered with the coordinator.",
                                value=s.registered)
        yield GaugeMetricFamily("fedper_devices_online", "Registered or not, devices whose presence is online.",
                                value=s.online)
        yield GaugeMetricFamily("fedper_devices_invited", "Devices the open round waits for.", value=s.invited)
        yield GaugeMetricFamily("fedper_round_accepted_devices", "Devices whose update the open round accepted.",
                                value=s.accepted_devices)
        yield GaugeMetricFamily("fedper_round", "The open round (the last one once the run is finished).",
                                value=s.round)
        yield GaugeMetricFamily("fedper_rounds_planned", "Rounds the run is to have (--rounds).",
                                value=s.rounds_planned)
        yield GaugeMetricFamily("fedper_min_clients", "Updates a round needs before its deadline may close it.",
                                value=s.min_clients)
        yield GaugeMetricFamily("fedper_run_finished", "1 once the last round is closed.", value=int(s.finished))
        yield CounterMetricFamily("fedper_rounds_closed", "Rounds closed (across restarts).", value=s.rounds_closed)
        yield CounterMetricFamily("fedper_updates_accepted", "Updates accepted and folded (across restarts).",
                                  value=s.accepted_total)
        refusals = CounterMetricFamily("fedper_refusals", "Messages refused, by error code (across restarts).",
                                       labels=["code"])
        for code, n in sorted(s.refusals.items()):
            refusals.add_metric([code], n)
        yield refusals
        yield CounterMetricFamily("fedper_received_bytes", "Bytes of update messages received (closed rounds "
                                  "and the open one).", value=s.received_bytes)
        yield CounterMetricFamily("fedper_sent_bytes", "Payload bytes this coordinator process published (models, "
                                  "round and state messages, answers); starts at 0 when the process does.",
                                  value=s.sent_bytes)
        if s.accuracy is not None:
            yield GaugeMetricFamily("fedper_round_accuracy", "Mean accuracy the devices reported in the last "
                                    "closed round.", value=s.accuracy)
        if s.dp_epsilon is not None:
            yield GaugeMetricFamily("fedper_dp_epsilon", "Differential privacy spent by the rounds released so far: "
                                    "epsilon at --dp-delta (with --dp-noise-multiplier).", value=s.dp_epsilon)
