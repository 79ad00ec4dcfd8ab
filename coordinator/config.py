"""The coordinator's settings (docs/operations.md lists them as options of fedper-coordinator)."""

from __future__ import annotations

from dataclasses import dataclass

from fedper.privacy import DEFAULT_DELTA
from fedper.wire import DEFAULT_CHUNK_SIZE

DEFAULT_MAX_SAMPLES_PER_DEVICE = 1_000_000  # a registration claiming more is refused (too_many_samples)


@dataclass(frozen=True)
class Config:
    rounds: int
    min_clients: int
    round_timeout: float
    chunk_size: int = DEFAULT_CHUNK_SIZE
    aggregator: str = "mean"
    clip_norm: float | None = None
    max_samples_per_device: int = DEFAULT_MAX_SAMPLES_PER_DEVICE  # the cap on a device's claimed n_j
    max_open_blobs: int = 64  # partial update blobs of all devices together; a newcomer beyond is refused
    max_uploads_per_device: int = 2  # partial update blobs per device: its newer one displaces its oldest
    max_upload_bytes_per_device: int | None = None  # bytes held in them; None: two blobs of the model
    max_reassembly_bytes: int | None = None  # all devices' partial blobs; None: DEFAULT_REASSEMBLY_BYTES
    max_messages_per_second: float = 1000.0  # per device (coordinator/quota.py); more are dropped unread
    state_interval: float = 0.5  # at most one state message (and one invitation top-up) per this many seconds
    clients_per_round: int | None = None  # M: a round closes at M accepted updates; None: every registered device
    over_select: float = 1.0  # F: a round invites ceil(F * M) devices, to absorb those that drop out
    selection_seed: int = 0  # the seed of fedper.selection's ranking
    dp_noise_multiplier: float | None = None  # z: DP-FedAvg with noise std z * clip_norm on the sum; None: no DP
    dp_delta: float = DEFAULT_DELTA
    dp_target_epsilon: float | None = None  # the budget: no round opens whose projected epsilon exceeds it
    dp_budget_action: str = "stop"  # at the budget: "stop" or "warn"
    dp_adaptive_quantile: float | None = None  # adaptive clipping: the quantile of update norms C tracks
    secure_aggregation: bool = False  # SecAgg+ (coordinator/secure_round.py): only the sum is learned
    secagg_stage_timeout: float = 30.0  # seconds each of its stages 2-4 waits for the devices
    secagg_degree: int | None = None  # its neighbour degree k; None: fedper.secagg's default (O(log n))
