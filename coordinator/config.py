"""The coordinator's settings, declared once: groups that validate themselves, read by the engine and the
strategies, and turned into fedper-coordinator's options by coordinator/cli.py (docs/operations.md).

A field's metadata (`option`) is its command-line option: help, bounds, and a flag when the option's name is
not the field's (`--dp-noise-multiplier` for Privacy.noise_multiplier).
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar

from fedper.buffered import STALENESS_KINDS, BufferConfig, Staleness
from fedper.privacy import DEFAULT_DELTA
from fedper.schedule import lr_at, parse_milestones
from fedper.wire import DEFAULT_CHUNK_SIZE, MAX_SECAGG_NEIGHBOURS
from fedper.wire.messages import MAX_BATCH_SIZE, MAX_LOCAL_EPOCHS

DEFAULT_MAX_SAMPLES_PER_DEVICE = 1_000_000  # a registration claiming more is refused (too_many_samples)
DEFAULT_MAX_WEIGHT_RATIO = 10.0  # c: a device weighs at most c x the median registered n_samples in the mean
AGGREGATOR_NAMES = ("mean", "median", "trimmed-mean")  # coordinator/strategies/mean.py's rules


def option(default: Any = MISSING, help: str = "", *, flag: str | None = None, min: float | None = None,
           max: float | None = None, cli: bool = True, envvar: str | None = None, short: str | None = None) -> Any:
    """A setting and its command-line option (`cli=False`: a setting for tests and embedders only)."""
    metadata = {"help": help, "flag": flag, "min": min, "max": max, "cli": cli, "envvar": envvar, "short": short}
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class Group:
    """A group of settings: one panel of --help."""

    title: ClassVar[str]

    @classmethod
    def flag(cls, name: str) -> str:
        """The option of field `name`, as a keyword (`dp_noise_multiplier`)."""
        flag = next(f for f in fields(cls) if f.name == name).metadata.get("flag")
        return (flag or f"--{name}").removeprefix("--").replace("-", "_")


@dataclass(frozen=True)
class Rounds(Group):
    title = "Rounds"
    rounds: int = option(help="Number of rounds to run.", min=1)
    min_clients: int = option(1, "Updates a round needs before its deadline may close it.", min=1)
    round_timeout: float = option(60.0, "Seconds a round waits for its devices.", min=0.1)
    chunk_size: int = option(DEFAULT_CHUNK_SIZE, "Bytes of tensor data per MQTT message.", min=1)
    state_interval: float = option(0.5, "At most one state message (and invitation top-up) per this many seconds.",
                                   cli=False)

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.min_clients < 1:
            raise ValueError("rounds and min_clients must be >= 1")


@dataclass(frozen=True)
class Selection(Group):
    title = "Selection (docs/scaling.md)"
    clients_per_round: int | None = option(
        None, "M: a round closes at M accepted updates (or at its deadline with --min-clients) and takes updates "
              "only from the devices it invited (default: every registered device). With --mode async: the devices "
              "training at once.", min=1)
    over_select: float = option(1.0, "F: invite ceil(F * M) online devices per round, to absorb dropouts (with "
                                     "--clients-per-round).", min=1.0)
    selection_seed: int | None = option(
        None, "Seed of the invitations' ranking (fedper/selection.py); default: a secret drawn at start (a chosen "
              "one is public, refused under DP).", min=0)
    answer_timeout: float | None = option(
        None, "Seconds an invited device has to answer (its first update chunk, or its secure-aggregation keys) "
              "before the next online device in the ranking is invited in its place; one that keeps not answering "
              "sits out 1, 2, 4 ... 64 rounds (docs/scaling.md) (default: half of --round-timeout).", min=0.001)

    def __post_init__(self) -> None:
        if self.clients_per_round is None:
            given = [flag for flag, set_ in (("--over-select", self.over_select != 1.0),
                                             ("--answer-timeout", self.answer_timeout is not None)) if set_]
            if given:
                raise ValueError(f"{given[0]} needs --clients-per-round: without it every registered device takes "
                                 "part")
        if self.answer_timeout is not None and not self.answer_timeout > 0:
            raise ValueError(f"--answer-timeout must be > 0, got {self.answer_timeout}")


@dataclass(frozen=True)
class Aggregation(Group):
    title = "Aggregation"
    aggregator: str = option("mean", "mean (n_j-weighted, streaming), median or trimmed-mean.")
    clip_norm: float | None = option(None, "Clip each update's L2 distance to the model to this (with "
                                           "--dp-noise-multiplier: DP's clip norm C, required).", min=0.0)
    max_weight_ratio: float = option(
        DEFAULT_MAX_WEIGHT_RATIO, "c: in --aggregator mean a device weighs min(n_j, c x the median n_samples of the "
                                  "devices registered when the round (an async version) folds its first update); inf "
                                  "lifts the cap (docs/reliability.md).", min=1.0)

    def __post_init__(self) -> None:
        if self.aggregator not in AGGREGATOR_NAMES:
            raise ValueError(f"--aggregator {self.aggregator!r}: choose one of {', '.join(AGGREGATOR_NAMES)}")
        if not self.max_weight_ratio >= 1.0:  # NaN too
            raise ValueError(f"--max-weight-ratio must be >= 1 (inf: no cap), got {self.max_weight_ratio}")


@dataclass(frozen=True)
class Privacy(Group):
    title = "Differential privacy (docs/privacy.md)"
    noise_multiplier: float | None = option(
        None, "DP-FedAvg with Gaussian noise of std z * --clip-norm on the sum of the clipped updates (default: off).",
        flag="--dp-noise-multiplier", min=0.0)
    delta: float = option(DEFAULT_DELTA, "The delta epsilon is reported at (with --dp-noise-multiplier); keep it "
                                         "below 1 / (registered devices).", flag="--dp-delta", min=0.0, max=1.0)
    target_epsilon: float | None = option(
        None, "Privacy budget: before each round, the epsilon it would bring is checked against this (default: no "
              "budget, epsilon only reported).", flag="--dp-target-epsilon", min=0.0)
    budget_action: str = option("stop", "stop (finish the run with the last model released within budget) or warn "
                                        "(log and go on) at --dp-target-epsilon.", flag="--dp-budget-action")
    adaptive_quantile: float | None = option(
        None, "Adaptive clipping (Andrew et al. 2021): move the clip norm, starting at --clip-norm, toward this "
              "quantile of the update norms (e.g. 0.5; default: a fixed clip norm).", flag="--dp-adaptive-clipping",
        min=0.0, max=1.0)

    def __post_init__(self) -> None:
        z = self.noise_multiplier
        if z is None:
            if self.target_epsilon is not None or self.adaptive_quantile is not None:
                raise ValueError("--dp-target-epsilon and --dp-adaptive-clipping need --dp-noise-multiplier")
            return
        if not (math.isfinite(z) and z >= 0):
            raise ValueError(f"--dp-noise-multiplier must be >= 0, got {z}")
        if self.budget_action not in ("stop", "warn"):
            raise ValueError(f"--dp-budget-action must be stop or warn, got {self.budget_action!r}")


@dataclass(frozen=True)
class SecureAggregation(Group):
    title = "Secure aggregation (docs/privacy.md)"
    enabled: bool = option(
        False, "SecAgg+: the coordinator learns only the n_j-weighted sum of the devices' deltas, each clipped on "
               "its device to --clip-norm (required). The agents take part when RoundInfo asks; run them with "
               "--secure-aggregation to refuse clear updates. With --dp-noise-multiplier the devices add the noise "
               "(distributed DP).", flag="--secure-aggregation")
    stage_timeout: float = option(
        30.0, "Seconds each secure-aggregation stage after the keys waits for the devices; those that miss it have "
              "dropped out (the protocol recovers them).", flag="--secagg-stage-timeout", min=0.1)
    degree: int | None = option(
        None, "Neighbours k (even) per device in secure aggregation (default 2*ceil(1.5*log2 n)): raise it for heavy "
              "dropout (docs/privacy.md, 'Choosing k and t').", flag="--secagg-degree", min=2)
    identity_root: str | None = option(
        None, "The fleet's identity root public key (PEM, from deploy/provision-identity.sh), required with "
              "--secure-aggregation: every device's advertised keys must be signed by an identity it certifies.",
        flag="--secagg-identity-root")
    min_group: int = option(
        4, "Smallest group of devices whose sum the coordinator sees when it splits suspects of spoiling the sum "
           "in halves; a round too small for that leaves one suspect out at a time (docs/privacy.md, 'A device "
           "that lies').", flag="--secagg-min-group", min=2)

    def __post_init__(self) -> None:
        if self.degree is not None and (not 2 <= self.degree <= MAX_SECAGG_NEIGHBOURS or self.degree % 2):
            raise ValueError(f"--secagg-degree must be an even number in 2..{MAX_SECAGG_NEIGHBOURS}")
        if not self.stage_timeout > 0:
            raise ValueError("--secagg-stage-timeout must be > 0")
        if self.min_group < 2:
            raise ValueError("--secagg-min-group must be >= 2")
        if self.enabled and self.identity_root is None:
            raise ValueError("--secure-aggregation needs --secagg-identity-root: the fleet root's public key that "
                             "certifies the devices' identities (deploy/provision-identity.sh)")


@dataclass(frozen=True)
class Quotas(Group):
    title = "Per-device quotas (docs/reliability.md)"
    max_samples_per_device: int = option(
        DEFAULT_MAX_SAMPLES_PER_DEVICE, "Largest n_samples a device may register (its weight in the mean); a "
                                        "registration above is refused (too_many_samples).", min=1)
    max_uploads_per_device: int = option(
        2, "Partial uploads a device may have in flight; its newer one displaces its oldest.", min=1)
    max_uploads_per_round: int = option(
        16, "Update blobs a device may start in a round (an honest one starts one, and one per resend); beyond, "
            "its update messages are dropped unread until the next round or attempt (over_quota).", min=1)
    max_upload_bytes_per_device: int | None = option(
        None, "Bytes a device's partial uploads may hold (default: two updates of the model).", min=1)
    max_reassembly_bytes: int | None = option(
        None, "Bytes all partial uploads may hold; a newcomer beyond is refused (over_quota) (default: 1 GiB, or "
              "4 devices' quotas if more).", min=1)
    max_messages_per_second: float = option(
        1000.0, "Messages per device per second (bursts: 2 s' worth, or two updates' chunks); more are dropped "
                "unread and counted (rate_limited).", min=0.001)
    max_open_blobs: int = option(64, "Partial update blobs of all devices together; a newcomer beyond is refused.",
                                 cli=False)

    def __post_init__(self) -> None:
        if min(self.max_uploads_per_device, self.max_uploads_per_round, self.max_open_blobs) < 1:
            raise ValueError("--max-uploads-per-device, --max-uploads-per-round and max_open_blobs must be >= 1")


@dataclass(frozen=True)
class Asynchronous(Group):
    title = "Asynchronous rounds (FedBuff; docs/operations.md)"
    mode: str = option("sync", "sync: a round waits for its devices (M, everyone, or its deadline). async: devices "
                               "train at their own pace and a new model version is released every --buffer-size "
                               "updates, each weighted by its staleness (coordinator/strategies/buffered.py).",
                       flag="--mode")
    buffer_size: int = option(10, "K: updates folded into each released version (--mode async).", min=1)
    max_staleness: int = option(20, "Refuse an update trained on a version more than this many versions old "
                                    "(stale_update) (--mode async).", min=0)
    staleness: str = option("polynomial", "w(s), the weight of an update s versions old: polynomial (1+s)^-a, "
                                          "constant 1, or hinge (1 up to b, then 1/(a(s-b)+1)) (--mode async).")
    staleness_exponent: float = option(0.5, "a of --staleness (0.5: FedBuff's 1/sqrt(1+s)).", min=0.0)
    staleness_hinge: int = option(0, "b of --staleness hinge: versions of staleness at full weight.", min=0)
    server_lr: float = option(1.0, "Server step: version + server_lr x the buffered mean delta (--mode async).",
                              min=0.0)

    def __post_init__(self) -> None:
        if self.mode not in ("sync", "async"):
            raise ValueError(f"--mode {self.mode!r}: choose sync or async")
        if self.staleness not in STALENESS_KINDS:
            raise ValueError(f"--staleness {self.staleness!r}: choose one of {', '.join(STALENESS_KINDS)}")
        self.buffer_config(None)  # the kernel's checks of K, the bound, a, b and the server step

    @property
    def enabled(self) -> bool:
        return self.mode == "async"

    def buffer_config(self, clip_norm: float | None, aggregator: str = "mean",
                      statistics: tuple[str, ...] = ()) -> BufferConfig:
        """fedper.buffered's settings of the run (the buffer checks them)."""
        return BufferConfig(self.buffer_size, self.max_staleness, self.server_lr,
                            Staleness(self.staleness, self.staleness_exponent, self.staleness_hinge), aggregator,
                            clip_norm, statistics)


@dataclass(frozen=True)
class Training(Group):
    """The fleet's local training, decided here and sent with each round (RoundInfo), under fedper-emulate's
    option names; a setting left unset is each device's own flag."""

    title = "Local training, sent with each round (docs/protocol.md)"
    lr: float | None = option(None, "The devices' SGD learning rate, sent with each round (with --lr-milestones, "
                                    "its schedule) (default: each device's own --lr).", min=0.0)
    lr_milestones: str = option("", "Comma-separated rounds after which --lr is multiplied by --lr-decay (FedBABU: "
                                    "R/2,3R/4), as in fedper-emulate (default: a constant lr).")
    lr_decay: float = option(0.1, "The lr factor at each of --lr-milestones.", min=0.0)
    local_epochs: int | None = option(None, "Local epochs each device trains per round (default: each device's "
                                            "own --local-epochs).", min=1, max=MAX_LOCAL_EPOCHS)
    batch_size: int | None = option(None, "Local batch size of every device (default: each device's own "
                                          "--batch-size).", min=1, max=MAX_BATCH_SIZE)

    def __post_init__(self) -> None:
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if not (math.isfinite(self.lr_decay) and self.lr_decay > 0):
            raise ValueError(f"--lr-decay must be > 0, got {self.lr_decay}")
        if parse_milestones(self.lr_milestones) and self.lr is None:
            raise ValueError("--lr-milestones needs --lr: the schedule starts from the lr the coordinator sends")

    def round_fields(self, round_: int) -> dict[str, Any]:
        """What RoundInfo carries of round `round_`'s training: the settings the coordinator decides (the lr
        after its schedule's milestones), none of those it leaves to the devices."""
        lr = None if self.lr is None else lr_at(self.lr, round_, parse_milestones(self.lr_milestones), self.lr_decay)
        sent = {"lr": lr, "local_epochs": self.local_epochs, "batch_size": self.batch_size}
        return {name: value for name, value in sent.items() if value is not None}


GROUPS: dict[str, type[Group]] = {"rounds": Rounds, "selection": Selection, "aggregation": Aggregation,
                                  "privacy": Privacy, "secure": SecureAggregation, "quotas": Quotas,
                                  "asynchronous": Asynchronous, "training": Training}


@dataclass(frozen=True)
class Config:
    """The run's settings, one group each; `Config.of` builds it from option names."""

    rounds: Rounds
    selection: Selection = field(default_factory=Selection)
    aggregation: Aggregation = field(default_factory=Aggregation)
    privacy: Privacy = field(default_factory=Privacy)
    secure: SecureAggregation = field(default_factory=SecureAggregation)
    quotas: Quotas = field(default_factory=Quotas)
    asynchronous: Asynchronous = field(default_factory=Asynchronous)
    training: Training = field(default_factory=Training)

    def __post_init__(self) -> None:
        """What groups require of each other."""
        m, clip = self.selection.clients_per_round, self.aggregation.clip_norm
        if self.asynchronous.enabled:
            self._check_asynchronous()
        if m is not None and self.rounds.min_clients > m:
            raise ValueError(f"--min-clients {self.rounds.min_clients} is above --clients-per-round {m}: a round "
                             f"closes at --clients-per-round updates")
        if self.privacy.noise_multiplier is not None:
            if clip is None or not clip > 0:
                raise ValueError("--dp-noise-multiplier needs --clip-norm > 0: the bound each update is clipped to")
            if self.aggregation.aggregator != "mean":
                raise ValueError(f"--dp-noise-multiplier replaces the mean with DP-FedAvg; --aggregator "
                                 f"{self.aggregation.aggregator} cannot be combined with it")
        if not self.secure.enabled:
            return
        if clip is None or not (math.isfinite(clip) and clip > 0):
            raise ValueError("--secure-aggregation needs --clip-norm C > 0: each device clips its delta to L2 norm "
                             "C, and [-C, C] is the range its values are quantized in")
        if self.aggregation.aggregator != "mean":
            raise ValueError("--secure-aggregation sums the updates: it combines with --aggregator mean only")
        if self.privacy.adaptive_quantile is not None:
            raise ValueError("--dp-adaptive-clipping needs the count of unclipped updates, which secure aggregation "
                             "hides: use a fixed --clip-norm")

    def _check_asynchronous(self) -> None:
        """The combinations --mode async refuses, each with its reason (docs/privacy.md, docs/operations.md)."""
        if self.secure.enabled:
            raise ValueError("--mode async cannot run --secure-aggregation: a SecAgg+ session masks the inputs of "
                             "one set of devices through stages in lockstep, while a buffer's updates arrive one at "
                             "a time from different versions (FedBuff sums them in a trusted enclave)")
        if self.privacy.adaptive_quantile is not None:
            raise ValueError("--mode async uses a fixed --clip-norm under DP: --dp-adaptive-clipping is not "
                             "implemented for buffered rounds")
        if self.selection.over_select != 1.0:
            raise ValueError("--over-select has no meaning with --mode async: --clients-per-round devices train at "
                             "once, and one that drops out is replaced when its invitation lapses")

    @classmethod
    def of(cls, **options: Any) -> Config:
        """From option names as keywords (`rounds=3, dp_noise_multiplier=1.0`); an unknown one is a TypeError."""
        groups = {}
        for name, group in GROUPS.items():
            keys = {f.name: group.flag(f.name) for f in fields(group)}
            groups[name] = group(**{field_: options.pop(key) for field_, key in keys.items() if key in options})
        if options:
            raise TypeError(f"unknown settings: {', '.join(sorted(options))}")
        return cls(**groups)
