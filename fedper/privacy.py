"""Differential privacy for the shared tensors: DP-FedAvg with an accountant, one implementation for the
coordinator and the emulator.

DP-FedAvg (McMahan et al., ICLR 2018, "Learning Differentially Private Recurrent Language Models") gives
user-level (device-level) central DP: each device's update delta (update - round model) is clipped to an
L2 norm C over all the tensors it privatizes, the clipped deltas are averaged with a fixed denominator,
and Gaussian noise of std z * C / (expected weight of a round) is added to the mean, so that whether any
one device took part changes the released model by at most what the noise hides. `DPFedAvg` is that
round's rule, with `add()`/`result()` like `fedper.aggregation.WeightedMean`; numpy arrays (the
coordinator) and torch tensors (the emulator, on any device) alike. `AdaptiveClipping` moves C toward a
quantile of the update norms (Andrew et al., NeurIPS 2021); `PrivacyAccountant` turns the rounds' (q, z)
into epsilon at a delta with Google's `dp-accounting` (the `privacy` extra).

What the guarantee covers. Only what is noised: the *trainable* shared tensors. BatchNorm running
statistics are shared but not trained; they are per-channel means and variances of a device's own
activations, not gradients, so clipping them with the weights would let their scale decide C, and noise
on a variance can make it negative. Under DP they are therefore not aggregated: `result()` returns the
round model's statistics unchanged (data-independent as long as the initial model is), so the released
model is wholly covered. Devices re-estimate the statistics from their own data while they train (and
keeping them local, FedBN style, also suits non-IID data).

Why uniform weights. FedPer's gamma_j = n_j / sum n_j gives one device up to the whole weight and makes
the denominator depend on the data: removing a device can move the mean by C, not C/m, whatever m is, so
noise z*C/m would hide nothing. DP-FedAvg's estimator fixes both: weights w_j = min(n_j / cap, 1) (1 for
every device without a cap, the paper's central setting) and a fixed denominator, the expected total
weight of a round (the expected number of devices with uniform weights). Each device then moves the sum by
at most C, and the noise on the sum is z*C. Any data-independent denominator keeps the guarantee (the
noise scales with it); the expected weight keeps the mean unbiased.

The head needs no noise, and that is FedPer's advantage here. The personalization layers never leave the
device, so no released quantity depends on them: the sensitivity that DP must hide is that of the base
alone, and the head trains on the device's full-precision local gradients, unclipped and noise-free. A
model that shares everything (FedAvg, K_P = 0) pays the noise on every layer, the classifier included,
while FedPer keeps the layers that matter most for a device's own classes exact.

Randomness. Noise is drawn in float64 from the numpy Generator passed in, in the reference's tensor
order, whatever the tensors' type (torch tensors get the same numbers, moved to their device), so a seed
reproduces a round in the coordinator and the emulator alike. `round_generator(secret, round)` derives a
round's generator, so a restarted coordinator draws the same noise without checkpointing generator
state. The secret must stay secret: whoever knows it can subtract the noise. numpy's generator is not a
cryptographic one, and floating-point Gaussian sampling has known side channels; this module targets
research and fleets whose coordinator is trusted (central DP), not a certified deployment.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Literal

import numpy as np

from fedper.aggregation import as_float64, check_layout, clip_factor, delta_norm, sample_weight
from fedper.manifest import Manifest

Tensor = Any  # numpy.ndarray or torch.Tensor
Accounting = Literal["rdp", "pld"]
Sampling = Literal["poisson", "fixed"]
BudgetAction = Literal["continue", "warn", "stop"]
DEFAULT_DELTA = 1e-5  # the delta epsilon is reported at by default; choose it below 1 / (number of devices)


def private_tensor_names(manifest: Manifest) -> list[str]:
    """The tensors DP clips and noises: the shared trainable ones (BatchNorm statistics excluded, see above)."""
    return [t.name for t in manifest.summed_tensors("trainable")]


def round_generator(secret: int, round_index: int) -> np.random.Generator:
    """The noise generator of one round, derived from the run's secret: a restart draws the same noise."""
    if secret < 0 or round_index < 0:
        raise ValueError(f"secret and round must be non-negative, got {secret}, {round_index}")
    return np.random.default_rng([secret, round_index])


def clip_delta(tensors: Mapping[str, Tensor], reference: Mapping[str, Tensor], clip_norm: float,
               names: Iterable[str]) -> dict[str, Tensor]:
    """(tensors - reference) over `names`, float64, scaled to an L2 norm of at most clip_norm."""
    names = list(names)
    scale = clip_factor(delta_norm(tensors, reference, names), clip_norm)
    return {n: (as_float64(tensors[n]) - as_float64(reference[n])) * scale for n in names}


def _gaussian_like(rng: np.random.Generator, like: Tensor, std: float) -> Tensor:
    """N(0, std^2) noise in float64 with `like`'s shape, as `like`'s kind of tensor and on its device."""
    noise = rng.standard_normal(tuple(like.shape)) * std
    if isinstance(like, np.ndarray):
        return noise
    import torch

    return torch.from_numpy(noise).to(like.device)


def _positive(name: str, value: float) -> float:
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value}")
    return value


class DPFedAvg:
    """One round of DP-FedAvg: clip each update's delta to `clip_norm`, sum w_j * clipped delta (float64),
    add N(0, (noise_multiplier * clip_norm)^2) to the sum, divide by `expected_weight`, add to the round model.

    `reference` is the round model as broadcast (every shared tensor); `private_names` the tensors that are
    clipped and noised (default: all of them; the coordinator passes `private_tensor_names(manifest)`), the
    others come back as the reference's. `expected_weight` is the fixed denominator: the expected number of
    devices whose update a round folds with uniform weights, `expected_weight(...)` with a `sample_cap`.
    With adaptive clipping, `noise_multiplier` is `AdaptiveClipping.update_noise_multiplier(z)`.
    The state (sums, count, weight, unclipped count) checkpoints through `sums()`/`meta()` and `resume`."""

    def __init__(self, reference: Mapping[str, Tensor], *, clip_norm: float, noise_multiplier: float,
                 expected_weight: float, rng: np.random.Generator, sample_cap: float | None = None,
                 private_names: Sequence[str] | None = None) -> None:
        self.clip_norm = _positive("clip_norm", clip_norm)
        if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
            raise ValueError(f"noise_multiplier must be >= 0 and finite, got {noise_multiplier}")
        self.noise_multiplier = float(noise_multiplier)
        self.expected_weight = _positive("expected_weight", expected_weight)
        self.sample_cap = None if sample_cap is None else _positive("sample_cap", sample_cap)
        self.private_names = list(reference) if private_names is None else list(private_names)
        if unknown := set(self.private_names) - set(reference):
            raise ValueError(f"private tensors missing from the reference: {sorted(unknown)[:3]}")
        self.reference = dict(reference)
        self.rng = rng
        self._shapes = {name: tuple(value.shape) for name, value in reference.items()}
        self._sum: dict[str, Tensor] = {}
        self.total_weight = 0.0
        self.count = 0
        self.unclipped = 0  # updates whose norm was within clip_norm: adaptive clipping's count

    def weight(self, n_samples: float) -> float:
        """w_j = min(n_j / cap, 1), or 1 without a cap: no claim can give a device more than one device's say."""
        n = sample_weight(n_samples, self.total_weight)
        return 1.0 if self.sample_cap is None else min(n / self.sample_cap, 1.0)

    def add(self, tensors: Mapping[str, Tensor], n_samples: float) -> float:
        """Fold one update in, all or nothing (a ValueError leaves the rule as it was); returns the delta's
        norm before clipping (for metrics and adaptive clipping's choice of a target)."""
        weight = self.weight(n_samples)
        check_layout(tensors, self._shapes)
        norm = delta_norm(tensors, self.reference, self.private_names)
        if not math.isfinite(norm):
            raise ValueError("an update with a non-finite delta norm (NaN or Inf) cannot be clipped")
        scale = weight * clip_factor(norm, self.clip_norm)
        for name in self.private_names:
            delta = (as_float64(tensors[name]) - as_float64(self.reference[name])) * scale
            if name in self._sum:
                self._sum[name] += delta
            else:
                self._sum[name] = delta
        self.total_weight += weight
        self.count += 1
        self.unclipped += int(norm <= self.clip_norm)
        return norm

    @property
    def noise_std(self) -> float:
        """Std of the noise on each coordinate of the mean: z * C / expected weight."""
        return self.noise_multiplier * self.clip_norm / self.expected_weight

    def result(self, dtype: Any = None) -> dict[str, Tensor]:
        """The noised model: reference + (sum + noise) / expected_weight on the private tensors, the
        reference on the others, each in its dtype (or numpy `dtype`). Draws the noise: call once."""
        if not self.count:
            raise ValueError("no update to aggregate")
        out: dict[str, Tensor] = {}
        for name, ref in self.reference.items():
            cast = dtype or ref.dtype
            if name not in self._sum:
                out[name] = ref.astype(cast) if isinstance(ref, np.ndarray) else ref.clone().to(cast)
                continue
            noisy = self._sum[name] + _gaussian_like(self.rng, self._sum[name], self.noise_multiplier * self.clip_norm)
            model = as_float64(ref) + noisy / self.expected_weight
            out[name] = model.astype(cast) if isinstance(model, np.ndarray) else model.to(cast)
        return out

    def sums(self) -> dict[str, Tensor]:
        """Σ w_j clip(Δ_j) per private tensor, float64: the rule's own arrays (do not modify them)."""
        return dict(self._sum)

    def meta(self) -> dict[str, Any]:
        """The rest of the state, JSON-serializable."""
        return {"clip_norm": self.clip_norm, "noise_multiplier": self.noise_multiplier,
                "expected_weight": self.expected_weight, "sample_cap": self.sample_cap,
                "private_names": self.private_names, "total_weight": self.total_weight,
                "count": self.count, "unclipped": self.unclipped}

    @classmethod
    def resume(cls, reference: Mapping[str, Tensor], sums: Mapping[str, Tensor], meta: Mapping[str, Any],
               rng: np.random.Generator) -> DPFedAvg:
        """The rule as `sums()` and `meta()` left it (the coordinator's restart)."""
        rule = cls(reference, clip_norm=meta["clip_norm"], noise_multiplier=meta["noise_multiplier"],
                   expected_weight=meta["expected_weight"], rng=rng, sample_cap=meta["sample_cap"],
                   private_names=meta["private_names"])
        count, unclipped = int(meta["count"]), int(meta["unclipped"])
        if set(sums) != (set(rule.private_names) if count else set()) or not 0 <= unclipped <= count:
            raise ValueError("resumed DP sums must name exactly the private tensors, with 0 <= unclipped <= count")
        for name, value in sums.items():
            if tuple(value.shape) != rule._shapes[name] or str(value.dtype) not in ("float64", "torch.float64"):
                raise ValueError(f"resumed DP sum {name!r} must be float64 of shape {rule._shapes[name]}")
        rule._sum = {name: value.copy() if isinstance(value, np.ndarray) else value.clone()
                     for name, value in sums.items()}
        rule.total_weight, rule.count, rule.unclipped = float(meta["total_weight"]), count, unclipped
        return rule


def expected_weight(sample_counts: Iterable[float], sampling_rate: float, sample_cap: float | None = None) -> float:
    """DP-FedAvg's fixed denominator q * Σ_k w_k over the N registered devices (w_k = min(n_k / cap, 1))."""
    weights = [1.0 if sample_cap is None else min(float(n) / sample_cap, 1.0) for n in sample_counts]
    return _positive("sampling_rate", sampling_rate) * sum(weights)


# ---------------------------------------------------------------- adaptive clipping


@dataclass
class AdaptiveClipping:
    """Geometric update of the clip norm toward the `target_quantile` of the update norms (Andrew et al.,
    NeurIPS 2021, Algorithm 1): C <- C * exp(-learning_rate * (b - target_quantile)), b the fraction of
    unclipped updates. That count is a second query on the devices' data, so each folded device counts
    +1/2 (unclipped) or -1/2 (clipped), as TF Privacy does: adding or removing one device then moves the
    count by 1/2, which is the sensitivity `update_noise_multiplier` splits z with (a 0/1 bit would move
    it by 1 and spend more than the accountant's z). The noisy sum gets N(0, count_noise_std^2), is
    divided by the expected number of devices m, shifted back by 1/2 and clamped to [0, 1]. The paper's
    defaults: learning_rate 0.2, target_quantile 0.5, count_noise_std = m / 20."""

    clip_norm: float
    target_quantile: float = 0.5
    learning_rate: float = 0.2
    count_noise_std: float = 1.0

    def __post_init__(self) -> None:
        _positive("clip_norm", self.clip_norm)
        _positive("count_noise_std", self.count_noise_std)
        if not (0 <= self.target_quantile <= 1 and math.isfinite(self.learning_rate) and self.learning_rate >= 0):
            raise ValueError(f"need 0 <= target_quantile <= 1 and learning_rate >= 0, got "
                             f"{self.target_quantile}, {self.learning_rate}")

    def update_noise_multiplier(self, noise_multiplier: float) -> float:
        """z_update = (z^-2 - (2 count_noise_std)^-2)^-1/2: the updates' share of a total z (`step` centres the
        count, so its sensitivity is 1/2 and its noise multiplier 2 count_noise_std). Needs count_noise_std
        > z / 2, or the count alone would spend more than the whole budget."""
        if noise_multiplier == 0:
            return 0.0
        rest = noise_multiplier ** -2 - (2 * self.count_noise_std) ** -2
        if rest <= 0:
            raise ValueError(f"count_noise_std {self.count_noise_std} must exceed noise_multiplier / 2 "
                             f"({noise_multiplier / 2}) for the updates to keep any budget")
        return rest ** -0.5

    def step(self, unclipped: int, folded: int, expected_devices: float, rng: np.random.Generator) -> float:
        """Move the clip norm after a round that folded `folded` updates, `unclipped` of them within it;
        returns the new one. The count is centred (sensitivity 1/2, see the class) before the noise is added."""
        if not 0 <= unclipped <= folded:
            raise ValueError(f"need 0 <= unclipped <= folded, got {unclipped} and {folded}")
        centred = unclipped - folded / 2 + rng.normal(0.0, self.count_noise_std)
        noisy_fraction = min(max(centred / _positive("expected_devices", expected_devices) + 0.5, 0.0), 1.0)
        self.clip_norm *= math.exp(-self.learning_rate * (noisy_fraction - self.target_quantile))
        return self.clip_norm

    def to_json(self) -> str:
        return json.dumps({"clip_norm": self.clip_norm, "target_quantile": self.target_quantile,
                           "learning_rate": self.learning_rate, "count_noise_std": self.count_noise_std})

    @classmethod
    def from_json(cls, text: str) -> AdaptiveClipping:
        body = json.loads(text)
        return cls(**{key: float(body[key]) for key in ("clip_norm", "target_quantile", "learning_rate",
                                                         "count_noise_std")})


def prepare_release(rule: DPFedAvg, expected_devices: float, noise_multiplier: float,
                    clipping: AdaptiveClipping | None = None) -> None:
    """Set what a closing round's noise depends on and an open round cannot know: the fixed denominator m (the
    devices the round expects to fold, not who came) and, with adaptive clipping, the split of z between the
    updates and the count of unclipped ones. The count's noise is the paper's m/20, raised to z where m/20 would
    leave the updates little budget (small fleets): the updates' multiplier then stays within 1.16 z."""
    rule.expected_weight = _positive("expected_devices", expected_devices)
    if clipping is not None:
        clipping.count_noise_std = max(expected_devices / 20, noise_multiplier)
        rule.noise_multiplier = clipping.update_noise_multiplier(noise_multiplier)


# ---------------------------------------------------------------- accounting


def dp_event(history: Sequence[tuple[int, float, float]], sampling: Sampling = "poisson") -> Any:
    """The dp-accounting event of a run: per (rounds, q, z) segment, `rounds` compositions of the Gaussian
    mechanism with noise multiplier z on a sample of the fleet at rate q.

    "poisson": every device takes part independently with probability q (add-or-remove-one neighbours; the
    clipped sum moves by at most C, so the event's multiplier is z). "fixed": a uniformly random set of
    q * N devices out of N, without replacement (replace-one neighbours, N public; replacing one device's
    data moves the clipped sum by up to 2C, so the event's multiplier is z / 2). q = 1 is every device."""
    import dp_accounting

    def one(q: float, z: float) -> Any:
        if sampling == "poisson":
            return dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
        gaussian = dp_accounting.GaussianDpEvent(z / 2)
        if q == 1:
            return gaussian
        share = Fraction(q).limit_denominator(1 << 32)  # only m / N enters the bound (Wang et al. 2019, Thm 27)
        return dp_accounting.SampledWithoutReplacementDpEvent(share.denominator, share.numerator, gaussian)

    return dp_accounting.ComposedDpEvent([dp_accounting.SelfComposedDpEvent(one(q, z), rounds)
                                          for rounds, q, z in history])


def _fresh_accountant(accounting: Accounting, sampling: Sampling) -> Any:
    """dp-accounting's accountant for the neighbouring relation `sampling` needs (see dp_event)."""
    try:
        from dp_accounting import NeighboringRelation, pld, rdp
    except ImportError as exc:
        raise ImportError("privacy accounting needs dp-accounting: pip install 'fedper-edge[privacy]'") from exc
    relation = NeighboringRelation.ADD_OR_REMOVE_ONE if sampling == "poisson" else NeighboringRelation.REPLACE_ONE
    return (rdp.RdpAccountant if accounting == "rdp" else pld.PLDAccountant)(neighboring_relation=relation)


@functools.lru_cache(maxsize=1024)
def _rdp_of_one_round(q: float, z: float, sampling: Sampling) -> np.ndarray:
    """The Rényi DP of one (q, z) round at dp-accounting's orders (DEFAULT_RDP_ORDERS). RDP composes by
    addition, so a run's is the sum of its segments' rounds x this: each distinct round is computed once per
    process (sampling without replacement took about a second a call, in the coordinator's engine thread)."""
    accountant = _fresh_accountant("rdp", sampling)
    accountant.compose(dp_event([(1, q, z)], sampling))
    curve = np.array(accountant._rdp, dtype=np.float64)  # the accountant's RDP: dp-accounting has no getter
    curve.setflags(write=False)
    return curve


def _rdp_orders() -> list[float]:
    from dp_accounting.rdp.rdp_privacy_accountant import DEFAULT_RDP_ORDERS

    return DEFAULT_RDP_ORDERS


def _rdp_of(history: Sequence[tuple[int, float, float]], sampling: Sampling) -> np.ndarray:
    """The Rényi DP of noisy rounds, at _rdp_orders()."""
    return sum((rounds * _rdp_of_one_round(q, z, sampling) for rounds, q, z in history), np.zeros(len(_rdp_orders())))


def _epsilon(history: Sequence[tuple[int, float, float]], delta: float, accounting: Accounting,
             sampling: Sampling = "poisson", rdp: np.ndarray | None = None) -> float:
    """`rdp`: the history's Rényi DP when already known (accounting "rdp")."""
    accountant = _fresh_accountant(accounting, sampling)
    if not history:
        return 0.0
    if any(z == 0 and q > 0 for _, q, z in history):
        return math.inf
    if accounting == "rdp":
        from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

        total = _rdp_of(history, sampling) if rdp is None else rdp
        return float(compute_epsilon(_rdp_orders(), total, delta)[0])
    accountant.compose(dp_event(history, sampling))
    return float(accountant.get_epsilon(delta))


@dataclass
class PrivacyAccountant:
    """The privacy a run has spent: epsilon at `delta` after its rounds, each the Gaussian mechanism with
    noise multiplier z on a sample of the fleet at rate q = M / N (M the devices invited, over-selection
    included: a device dropping out for reasons of its own only lowers the real rate).

    `sampling` must be the selection actually used (dp_event): "fixed" for fedper.selection's M devices out
    of N (a uniformly random set only while its seed is secret), "poisson" for independent coins or every
    device (q = 1). Subsampling discounts nothing for a device whose rounds are known: then the bound is that
    of its own rounds at q = 1. `accounting` "rdp" (Rényi DP, Mironov 2017, as TF Privacy and the DP-FedAvg
    paper) is fast whatever the number of rounds; "pld" (privacy loss distributions) is tighter and slower,
    and has no bound for "fixed". The state is the (rounds, q, z) history, delta and the sampling, JSON
    through `to_json`/`from_json` (the coordinator's checkpoint).

    `rdp` is the history's Rényi DP (accounting "rdp", every round noisy), kept up to date and checkpointed: a
    coordinator restarted on its state would otherwise compute each distinct (q, z) of its history again, up to
    a second each (q = M / N changes with every device that comes and goes), before it can close a round."""

    delta: float
    accounting: Accounting = "rdp"
    history: list[tuple[int, float, float]] = field(default_factory=list)
    sampling: Sampling = "poisson"
    rdp: tuple[float, ...] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {self.delta}")
        if self.accounting not in ("rdp", "pld"):
            raise ValueError(f"accounting must be 'rdp' or 'pld', got {self.accounting!r}")
        if self.sampling not in ("poisson", "fixed"):
            raise ValueError(f"sampling must be 'poisson' or 'fixed', got {self.sampling!r}")
        if self.sampling == "fixed" and self.accounting == "pld":
            raise ValueError("dp-accounting's PLD accountant has no bound for sampling without replacement: "
                             "use accounting 'rdp'")
        self.history = [_segment(*entry) for entry in self.history]
        if self.rdp is not None:
            self.rdp = tuple(float(v) for v in self.rdp)
            if (self.accounting != "rdp" or any(z == 0 for _, _, z in self.history)
                    or len(self.rdp) != len(_rdp_orders()) or not all(0 <= v < math.inf for v in self.rdp)):
                raise ValueError("rdp must be the Rényi DP of a history of noisy rounds at dp-accounting's "
                                 f"{len(_rdp_orders())} orders, each finite and >= 0")

    def _history_rdp(self) -> np.ndarray | None:
        """The history's Rényi DP, computed once (None where epsilon does not come from it)."""
        if self.accounting != "rdp" or not self.history or any(z == 0 for _, _, z in self.history):
            return None
        if self.rdp is None:
            self.rdp = tuple(_rdp_of(self.history, self.sampling).tolist())
        return np.array(self.rdp)

    @property
    def rounds(self) -> int:
        return sum(rounds for rounds, _, _ in self.history)

    def record(self, sampling_rate: float, noise_multiplier: float, rounds: int = 1) -> None:
        """Count `rounds` more released rounds (a run of equal (q, z) is one segment)."""
        rounds, q, z = _segment(rounds, sampling_rate, noise_multiplier)
        so_far = self._history_rdp() if z > 0 else None
        if self.history and self.history[-1][1:] == (q, z):
            self.history[-1] = (self.history[-1][0] + rounds, q, z)
        else:
            self.history.append((rounds, q, z))
        self.rdp = None if so_far is None else tuple((so_far + _rdp_of([(rounds, q, z)], self.sampling)).tolist())

    def epsilon(self) -> float:
        """Epsilon at `delta` after the recorded rounds (0 before any, inf if a round had no noise)."""
        return _epsilon(self.history, self.delta, self.accounting, self.sampling, self._history_rdp())

    def projected_epsilon(self, sampling_rate: float, noise_multiplier: float, rounds: int = 1) -> float:
        """Epsilon after `rounds` more (q, z) rounds, without recording them: ask before running a round."""
        more = _segment(rounds, sampling_rate, noise_multiplier)
        known = self._history_rdp() if more[2] > 0 else None
        return _epsilon([*self.history, more], self.delta, self.accounting, self.sampling,
                        None if known is None else known + _rdp_of([more], self.sampling))

    def _history_digest(self) -> str:
        """What `rdp` was computed for: a checkpoint whose history was edited must not keep a stale, smaller sum."""
        return hashlib.sha256(json.dumps([list(entry) for entry in self.history]).encode()).hexdigest()

    def to_json(self) -> str:
        rdp = {} if self.rdp is None else {"rdp": list(self.rdp), "rdp_of": self._history_digest()}
        return json.dumps({"delta": self.delta, "accounting": self.accounting, "sampling": self.sampling,
                           "history": [list(entry) for entry in self.history], **rdp})

    @classmethod
    def from_json(cls, text: str) -> PrivacyAccountant:
        body = json.loads(text)
        accountant = cls(delta=float(body["delta"]), accounting=body["accounting"],  # before "sampling": Poisson
                         history=[tuple(entry) for entry in body["history"]],
                         sampling=body.get("sampling", "poisson"), rdp=body.get("rdp"))
        if body.get("rdp_of") != accountant._history_digest():  # none (older state) or another history's
            accountant.rdp = None  # computed from the history at the first use
        return accountant


def noise_multiplier_for(target_epsilon: float, delta: float, sampling_rate: float, rounds: int,
                         accounting: Accounting = "rdp", sampling: Sampling = "poisson") -> float:
    """The smallest noise multiplier z whose `rounds` (q, z) rounds spend at most `target_epsilon` at `delta`
    (dp-accounting's calibration, to 1e-3 in z): plan a run from its budget instead of guessing z."""
    from dp_accounting import mechanism_calibration

    rounds, q, _ = _segment(rounds, sampling_rate, 1.0)
    PrivacyAccountant(delta, accounting, sampling=sampling)  # validates the pair
    z = mechanism_calibration.calibrate_dp_mechanism(
        lambda: _fresh_accountant(accounting, sampling), lambda z: dp_event([(rounds, q, z)], sampling),
        _positive("target_epsilon", target_epsilon), delta, tol=1e-3,
        bracket_interval=mechanism_calibration.LowerEndpointAndGuess(1e-3, 1.0))  # z = 0 has no WOR bound
    return float(z)


def _segment(rounds: int, sampling_rate: float, noise_multiplier: float) -> tuple[int, float, float]:
    """A validated (rounds, q, z)."""
    if isinstance(rounds, bool) or int(rounds) != rounds or rounds < 1:
        raise ValueError(f"rounds must be a positive integer, got {rounds}")
    q, z = float(sampling_rate), float(noise_multiplier)
    if not 0 < q <= 1:
        raise ValueError(f"sampling rate must be in (0, 1], got {q}")
    if not (math.isfinite(z) and z >= 0):
        raise ValueError(f"noise multiplier must be >= 0 and finite, got {z}")
    return int(rounds), q, z


def budget_action(epsilon: float, target_epsilon: float | None, on_exceed: Literal["stop", "warn"]) -> BudgetAction:
    """What a run does with `epsilon` spent (or projected) against its budget: "continue" within it (or with
    no budget), otherwise `on_exceed` ("stop": release no further round; "warn": log and go on)."""
    if on_exceed not in ("stop", "warn"):
        raise ValueError(f"on_exceed must be 'stop' or 'warn', got {on_exceed!r}")
    if target_epsilon is None or epsilon <= target_epsilon:
        return "continue"
    return on_exceed
