"""The emulated fleet: one training loop for every model and algorithm, FedJAX style.

`Fleet(config, data).init() -> state` and `fleet.run_round(state) -> (state, metrics)`. A client is
its index arrays into the resident data plus its local tensors (manifest `shared == False`), drawn
at random for each client (FedPer's Algorithm 1; `random_local_init`) unless the algorithm or
`local_init="broadcast"` starts every client from the initial model's; the
server state is the shared tensors and the round, and the round index seeds every random draw,
so a saved state resumes bit-for-bit. Nothing here branches on an algorithm's name: the manifest
says which tensors are shared, the algorithm's phases say what is trained when.

Per round (paper, Algorithms 1-2): the round's clients are selected (all of them by default; with
`clients_per_round` M, the M of fedper.selection's seeded ranking, the coordinator's rule, with
the run's seed and client j's id str(j)); each selected client loads the shared tensors and its own
local ones, trains its phases, and sends its shared tensors with n_j (training samples); the server
takes the n_j-weighted mean over them (fedper.aggregation.WeightedMean, as the coordinator does).
A client not selected keeps its local tensors as they were. Then every client, selected or not
(FedBABU's Algorithm 2), is evaluated as it would serve: the NEW shared tensors + its own local ones, BatchNorm in eval
mode, on its own test split (FedAvg: the global model); the vmap engine on CUDA evaluates every client in one
vmapped pass per chunk of test samples (batched.evaluate_clients_batched: the same accuracies). With
`fine_tune_head_at_eval` (FedBABU, Algorithm 2 of Oh et al.) a copy is fine-tuned on the client's train data
first and discarded.
BatchNorm buffers are tensors like any other: shared ones averaged, local ones kept; the BatchNorm
policy (`bn`) is the manifest's: "local" keeps every BatchNorm tensor local (FedBN), "batch"
evaluates with the statistics of each batch of fedper.batches.EVAL_BATCH test samples (the agents'
too), as FedBABU does.

Privacy (`dp_noise_multiplier`, docs/privacy.md): the server's step is fedper.privacy's DPFedAvg, the
coordinator's rule and code (clipped deltas, uniform weights, noise z*C on the sum, the expected number
of updates M as the denominator, shared BatchNorm statistics not aggregated), with its accountant
and its budget check. The accountant matches the selection: M clients out of N without replacement
(q = M/N, sampling "fixed"), or every client (q = 1, "poisson"). Round k's noise is drawn from
round_generator(noise_secret(seed), k), so the seed and the round in a saved state fix it; the
accountant's history and the adaptive clip norm are saved with the state. `clip_norm` alone clips
each update's distance to the round model, as the coordinator's --clip-norm does.
"""

from __future__ import annotations

import hashlib
import logging
import math
import statistics
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from fedper import checkpoint
from fedper.aggregation import WeightedMean
from fedper.algorithms import ALGORITHMS, Algorithm, Phase, Trained, check_kp, get_algorithm
from fedper.batches import PURPOSE_FINETUNE, PURPOSE_TRAIN, client_seed
from fedper.emulate.batched import evaluate_clients_batched, train_clients_batched
from fedper.emulate.data import FleetData
from fedper.emulate.distributed import as_float64, combine, gather
from fedper.emulate.train import OnStep, client_generator, epoch_steps, train_client
from fedper.emulate.variants import build
from fedper.manifest import Manifest
from fedper.models import describe, exported_state
from fedper.privacy import (
    DEFAULT_DELTA,
    AdaptiveClipping,
    DPFedAvg,
    PrivacyAccountant,
    budget_action,
    clip_delta,
    prepare_release,
    private_tensor_names,
    round_generator,
)
from fedper.schedule import lr_at
from fedper.selection import select
from fedper.training import evaluate, load_tensors

ENGINES = ("auto", "sequential", "vmap")
PRECISIONS = ("float32", "bf16")
LOCAL_INITS = ("random", "broadcast")
Tensors = dict[str, torch.Tensor]

log = logging.getLogger("fedper.emulate")


@dataclass(frozen=True)
class FleetConfig:
    model: str = "mobilenet_v1"
    width: float = 1.0
    algorithm: str = "fedper"
    kp: int = 2
    local_epochs: int = 4
    batch_size: int = 128
    lr: float = 0.01
    momentum: float = 0.0
    seed: int = 0
    eval_finetune_epochs: int = 1
    eval_finetune: Trained = "all"  # what FedBABU-style evaluation fine-tunes: "all" (their paper) or "head"
    # FedBABU's Algorithm 2 for every algorithm: each is fine-tuned before its evaluation, not only FedBABU
    eval_finetune_every_algorithm: bool = False
    eval_finetune_interval: int = 1  # fine-tune at evaluation in the rounds that are multiples of this
    lr_milestones: tuple[int, ...] = ()  # the lr is multiplied by lr_decay after each of these rounds
    lr_decay: float = 0.1
    engine: str = "auto"
    channels_last: bool = True  # batches in NHWC order on the CPU (train.train_client): faster, same values
    # "bf16": forward and backward under autocast to bfloat16; weights, SGD and BatchNorm statistics stay float32
    precision: str = "float32"
    cuda_channels_last: bool = False  # batches in NHWC order on CUDA too (both engines): opt-in, not yet measured
    clients_per_round: int | None = None  # None: every client trains in every round
    bn: str = "shared"  # the BatchNorm policy (fedper.manifest.BN_POLICIES): shared | local (FedBN) | batch (FedBABU)
    # "random": each client's local tensors are its own random draw keyed by (seed, client), where the
    # algorithm says so (Algorithm.independent_local_init); "broadcast": the initial model's, on every
    # client, as a fleet of agents started from one export has them
    local_init: str = "random"
    # privacy, as the coordinator's options of the same names (docs/privacy.md)
    clip_norm: float | None = None  # clip each update's L2 distance to the round model; under DP the clip norm C
    dp_noise_multiplier: float | None = None  # z: DP-FedAvg with noise std z * clip_norm on the sum; None: no DP
    dp_delta: float = DEFAULT_DELTA  # the delta epsilon is reported at
    dp_target_epsilon: float | None = None  # the budget: no round runs whose projected epsilon exceeds it
    dp_budget_action: str = "stop"  # at the budget: "stop" or "warn"
    dp_adaptive_quantile: float | None = None  # adaptive clipping: the quantile of update norms C tracks

    def __post_init__(self) -> None:
        object.__setattr__(self, "lr_milestones", tuple(self.lr_milestones))  # config.json holds a list

    def lr_at(self, round_: int) -> float:
        """The learning rate of round `round_` (1-based): lr, times lr_decay for each milestone it comes after.
        A function of the round alone, so a resumed run follows the schedule its config.json records."""
        return lr_at(self.lr, round_, self.lr_milestones, self.lr_decay)


@dataclass
class PrivacyState:
    """What DP carries from round to round: the accountant's (rounds, q, z) history and, with adaptive
    clipping, the clip norm it has moved to. The noise needs no state (see noise_secret)."""

    accountant: PrivacyAccountant
    clipping: AdaptiveClipping | None = None

    def to_json(self) -> dict[str, str | None]:
        return {"accountant": self.accountant.to_json(),
                "clipping": None if self.clipping is None else self.clipping.to_json()}

    @classmethod
    def from_json(cls, body: dict[str, str | None]) -> PrivacyState:
        clipping = body["clipping"]
        return cls(PrivacyAccountant.from_json(str(body["accountant"])),
                   None if clipping is None else AdaptiveClipping.from_json(clipping))


def noise_secret(seed: int) -> int:
    """DP's noise secret, derived from the run's seed: an emulated fleet has nobody to hide the noise from,
    and the seed then reproduces a run, noise included (the coordinator draws its secret with `secrets`)."""
    return int.from_bytes(hashlib.sha256(f"fedper-emulate/dp-noise/{seed}".encode()).digest()[:16], "big")


@dataclass
class FleetState:
    round: int  # rounds completed; with the run's seed it is the whole RNG state
    shared: Tensors
    local: list[Tensors]
    seed: int = 0
    privacy: PrivacyState | None = None  # with dp_noise_multiplier


def _describe(model: torch.nn.Module, cfg: FleetConfig, algorithm: Algorithm, input_size: int) -> Manifest:
    """The manifest of the split. Shared flags depend only on the algorithm's shared_role, and
    describe() validates K_P against the registry, so an Algorithm that is not registered as such
    (a test's FedPer at K_P=0) is described under a registered one with the same shared_role."""
    check_kp(algorithm, cfg.kp)
    registered = sorted(ALGORITHMS.values(), key=lambda a: a.name != algorithm.name)  # its own name first
    name = next(
        a.name for a in registered if a.shared_role == algorithm.shared_role and a.requires_kp0 == (cfg.kp == 0)
    )
    return describe(model, architecture=cfg.model, kp=cfg.kp, algorithm=name, input_size=input_size,
                    width=cfg.width, bn=cfg.bn)


def resolve_device(device: str) -> torch.device:
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)


class Fleet:
    def __init__(
        self, config: FleetConfig, data: FleetData, algorithm: Algorithm | None = None,
        members: Sequence[int] | None = None,
    ) -> None:
        """`members`: the clients this process trains and evaluates (all by default; a share of them
        per rank under torch.distributed, where the aggregate and the metrics are all-reduced)."""
        if config.engine not in ENGINES:
            raise ValueError(f"unknown engine {config.engine!r}; choose one of {', '.join(ENGINES)}")
        if config.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {config.precision!r}; choose one of {', '.join(PRECISIONS)}")
        if config.local_init not in LOCAL_INITS:
            raise ValueError(f"unknown local init {config.local_init!r}; choose one of {', '.join(LOCAL_INITS)}")
        self.config, self.data = config, data
        self.members = list(range(len(data.clients))) if members is None else list(members)
        self.algorithm = algorithm or get_algorithm(config.algorithm)
        self.device = data.x.device
        torch.manual_seed(config.seed)
        self.model = build(config.model, len(data.classes), config.width, data.input_size, config.kp).to(self.device)
        self.manifest = _describe(self.model, config, self.algorithm, data.input_size)
        if self.finetunes_at_eval and not self.manifest.trained_names(config.eval_finetune):
            raise ValueError(f"--eval-finetune {config.eval_finetune}: {self.algorithm.name} at K_P={config.kp} has no "
                             f"such tensors to fine-tune; choose --eval-finetune all")
        self.initial = {k: v.detach().clone() for k, v in exported_state(self.model).items()}
        self.shared_names = self.manifest.names(shared=True)
        self.local_names = self.manifest.names(shared=False)
        if config.clients_per_round is not None and config.clients_per_round < 1:
            raise ValueError(f"clients per round must be >= 1, got {config.clients_per_round}")
        if config.eval_finetune_interval < 1:
            raise ValueError(f"the fine-tuning interval must be >= 1 round, got {config.eval_finetune_interval}")
        batched = config.engine == "vmap" or (config.engine == "auto" and self.device.type == "cuda")
        self.engine = "vmap" if batched else "sequential"
        # NHWC batches: the CPU's default (oneDNN); on CUDA opt-in (cuDNN's own choice stays unless asked)
        self.channels_last = config.channels_last if self.device.type == "cpu" else config.cuda_channels_last
        self.dp = config.dp_noise_multiplier is not None
        self.private_names = private_tensor_names(self.manifest)
        self.expected_participants = min(config.clients_per_round or len(data.clients), len(data.clients))
        self.sampling_rate = self.expected_participants / len(data.clients)  # q = M / N, for the accountant
        self._check_privacy()

    @contextmanager
    def compute(self) -> Iterator[None]:
        """Where training and evaluation run: with --precision bf16, autocast to bfloat16 (the model's tensors,
        their gradients and SGD stay float32) and every BatchNorm layer normalizing, and updating its running
        statistics, in float32 (vmap's BatchNorm takes no bfloat16 input with float32 statistics); else as it is."""
        if self.config.precision != "bf16":
            yield
            return
        handles = [m.register_forward_pre_hook(_float_input) for m in self.model.modules()
                   if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        try:
            # no cache of bfloat16 weight copies: it lives as long as the context, over steps that change the weights
            with torch.autocast(self.device.type, dtype=torch.bfloat16, cache_enabled=False):
                yield
        finally:
            for handle in handles:
                handle.remove()

    def _check_privacy(self) -> None:
        """The coordinator's rules for the privacy options, and a budget that round 1 alone would exceed."""
        cfg = self.config
        if cfg.clip_norm is not None and not (math.isfinite(cfg.clip_norm) and cfg.clip_norm > 0):
            raise ValueError(f"--clip-norm must be a positive number, got {cfg.clip_norm}")
        z = cfg.dp_noise_multiplier
        if z is None:
            if cfg.dp_target_epsilon is not None or cfg.dp_adaptive_quantile is not None:
                raise ValueError("--dp-target-epsilon and --dp-adaptive-clipping need --dp-noise-multiplier")
            return
        if not (math.isfinite(z) and z >= 0):
            raise ValueError(f"--dp-noise-multiplier must be >= 0, got {z}")
        if cfg.clip_norm is None:
            raise ValueError("--dp-noise-multiplier needs --clip-norm > 0: the bound each update is clipped to")
        if cfg.dp_budget_action not in ("stop", "warn"):
            raise ValueError(f"--dp-budget-action must be stop or warn, got {cfg.dp_budget_action!r}")
        if len(self.members) < len(self.data.clients):
            raise ValueError("--dp-noise-multiplier runs in one process (the noise is drawn once, on the whole "
                             "sum): drop --world-size (or torchrun)")
        fresh = self._fresh_privacy()  # checks delta and the quantile
        if cfg.dp_delta * len(self.data.clients) >= 1:
            log.warning("--dp-delta %g is not below 1/N for N = %d clients: epsilon means little",
                        cfg.dp_delta, len(self.data.clients))
        try:
            first = fresh.accountant.projected_epsilon(self.sampling_rate, z)
        except ImportError as e:
            raise ValueError(str(e)) from None
        if budget_action(first, cfg.dp_target_epsilon, cfg.dp_budget_action) == "stop":
            raise ValueError(f"--dp-target-epsilon {cfg.dp_target_epsilon}: one round at q {self.sampling_rate:.4g} "
                             f"and noise multiplier {z} already spends more (epsilon {first:.4g} at delta "
                             f"{cfg.dp_delta})")

    def _fresh_privacy(self) -> PrivacyState:
        cfg = self.config
        clipping = None
        if cfg.dp_adaptive_quantile is not None:
            clipping = AdaptiveClipping(float(cfg.clip_norm or 0), target_quantile=cfg.dp_adaptive_quantile)
        sampling = "fixed" if self.sampling_rate < 1 else "poisson"  # select() draws M of N without replacement
        return PrivacyState(PrivacyAccountant(cfg.dp_delta, sampling=sampling), clipping)

    def init(self) -> FleetState:
        """Every client starts from the server's broadcast shared tensors; its local ones are its own
        random draw (random_local_init, keyed by the run's seed and the client) or the broadcast's."""
        seed = self.config.seed
        if self.config.local_init == "random" and self.algorithm.independent_local_init:
            local = [random_local_init(self.model, self.local_names, client_seed(seed, j))
                     for j in range(len(self.data.clients))]
            load_tensors(self.model, self.initial, {})
        else:
            local = [{n: self.initial[n].clone() for n in self.local_names} for _ in self.data.clients]
        return FleetState(round=0, shared={n: self.initial[n].clone() for n in self.shared_names}, local=local,
                          seed=seed, privacy=self._fresh_privacy() if self.dp else None)

    def selected(self, round_: int, seed: int) -> list[int]:
        """The clients that train in round `round_` (1-based, as the coordinator counts), in client order:
        fedper.selection.select over the ids "0".."N-1", seeded with the run's seed."""
        everyone = range(len(self.data.clients))
        if self.config.clients_per_round is None:
            return list(everyone)
        return sorted(int(j) for j in select(map(str, everyone), self.config.clients_per_round, seed=seed,
                                             round_=round_))

    def round_steps(self, state: FleetState) -> int:
        """The client-batches this process trains in the round after `state` (its members' local training,
        and their fine-tuning at evaluation when the round has it): the unit of run_round's `on_step`."""
        c, n_train = self.config, self.data.n_train
        chosen = set(self.selected(state.round + 1, state.seed))
        epochs = sum(phase.epochs or c.local_epochs for phase in self.algorithm.phases)
        steps = sum(epochs * epoch_steps(n_train[j], c.batch_size) for j in self.members if j in chosen)
        if self.finetunes_at_eval and (state.round + 1) % c.eval_finetune_interval == 0:
            steps += sum(c.eval_finetune_epochs * epoch_steps(n_train[j], c.batch_size) for j in self.members)
        return steps

    def trainees(self, state: FleetState) -> list[int]:
        """The members of this process that train in the round after `state`, in client order."""
        chosen = set(self.selected(state.round + 1, state.seed))
        return [j for j in self.members if j in chosen]

    def run_round(self, state: FleetState, on_step: OnStep | None = None) -> tuple[FleetState, dict]:
        """One round; `on_step` hears of every training step, in the units of round_steps."""
        start = time.perf_counter()
        trainees = self.trainees(state)
        return self.finish_round(state, zip(trainees, self._train(state, trainees, on_step), strict=True),
                                 start, on_step)

    def finish_round(self, state: FleetState, trained: Iterable[tuple[int, tuple[Tensors, Tensors]]], start: float,
                     on_step: OnStep | None = None) -> tuple[FleetState, dict]:
        """The rest of the round after `state` from its trainees' (client, (shared, local)) tensors, however they
        were trained (this fleet, or emulate/stacked.py with other runs): the aggregate and every member's
        evaluation; `start`: when the round began, for wall_s."""
        private = state.privacy is not None
        aggregate = self._dp_rule(state) if private else WeightedMean()
        local = list(state.local)
        selected = self.selected(state.round + 1, state.seed)
        for j, (shared, own) in trained:
            aggregate.add(as_float64(shared) if private else self.update(shared, state.shared), self.data.n_train[j])
            local[j] = own
        privacy, figures = state.privacy, None
        if isinstance(aggregate, DPFedAvg):
            shared, privacy, figures = self._release(aggregate, state)
        else:
            shared = combine(aggregate, state.shared)
        new = FleetState(round=state.round + 1, shared=shared, local=local, seed=state.seed, privacy=privacy)
        finetune = self.finetunes_at_eval and new.round % self.config.eval_finetune_interval == 0
        if self.batched_evaluation and not finetune:
            scores = self.evaluate_clients(self.members, new.shared, new.local)
            evaluated = {j: (score, score) for j, score in zip(self.members, scores, strict=True)}
        else:
            evaluated = {j: self._evaluate(new, j, finetune, on_step) for j in self.members}
        results = gather({j: after for j, (_, after) in evaluated.items()})
        accuracy = [a for a, _ in results]
        fine_tuning = {}
        if self.finetunes_at_eval:  # FedBABU's tables: the initial (untuned) and the fine-tuned accuracy
            initial = gather({j: before for j, (before, _) in evaluated.items()})
            fine_tuning = {"finetuned": finetune, "initial_accuracy": [a for a, _ in initial],
                           "initial_loss": [loss for _, loss in initial],
                           "mean_initial_accuracy": statistics.fmean(a for a, _ in initial)}
        metrics = {
            "round": new.round,
            "selected": selected,
            "lr": self.config.lr_at(new.round),
            "accuracy": accuracy,
            "loss": [loss for _, loss in results],
            "mean_accuracy": statistics.fmean(accuracy),
            "std_accuracy": statistics.pstdev(accuracy),
            "mean_loss": statistics.fmean(loss for _, loss in results),
            "wall_s": time.perf_counter() - start,
            **({"dp": figures} if figures is not None else {}),
            **fine_tuning,
        }
        return new, metrics

    def update(self, trained: Tensors, round_model: Tensors) -> Tensors:
        """A client's shared tensors as the server folds them without DP, in float64 (the rules sum in it):
        clipped to clip_norm around `round_model` when it is set (under DP the rule clips: see finish_round)."""
        if self.config.clip_norm is None:
            return as_float64(trained)
        deltas = clip_delta(trained, round_model, self.config.clip_norm, self.shared_names)
        return {n: round_model[n].double() + deltas[n] for n in self.shared_names}

    def _dp_rule(self, state: FleetState) -> DPFedAvg:
        """The round's DP-FedAvg: the round model as reference, the clip norm of now, round k's noise generator."""
        assert state.privacy is not None
        clipping = state.privacy.clipping
        return DPFedAvg(state.shared, clip_norm=clipping.clip_norm if clipping else float(self.config.clip_norm or 0),
                        noise_multiplier=float(self.config.dp_noise_multiplier or 0), expected_weight=1.0,
                        rng=round_generator(noise_secret(state.seed), state.round + 1),
                        private_names=self.private_names)

    def _release(self, rule: DPFedAvg, state: FleetState) -> tuple[Tensors, PrivacyState, dict]:
        """The noised model, the privacy state after it, and the round's DP figures for metrics.jsonl (the
        coordinator's keys). As the coordinator: the denominator is the expected number of updates M, the
        accountant records (q, z), and adaptive clipping's count is drawn after the model's noise."""
        assert state.privacy is not None
        privacy = PrivacyState.from_json(state.privacy.to_json())  # the given state stays as it was
        z = float(self.config.dp_noise_multiplier or 0)
        prepare_release(rule, self.expected_participants, z, privacy.clipping)
        shared = rule.result()
        privacy.accountant.record(self.sampling_rate, z)
        epsilon = privacy.accountant.epsilon()
        figures = {"epsilon": epsilon if math.isfinite(epsilon) else None, "delta": self.config.dp_delta,
                   "sampling_rate": self.sampling_rate, "noise_multiplier": z, "clip_norm": rule.clip_norm,
                   "noise_std": rule.noise_std, "expected_participants": rule.expected_weight,
                   "unclipped": rule.unclipped}
        if privacy.clipping is not None:
            figures["next_clip_norm"] = privacy.clipping.step(rule.unclipped, rule.count, rule.expected_weight,
                                                                rule.rng)
        return shared, privacy, figures

    def budget_stops(self, state: FleetState) -> bool:
        """Whether --dp-target-epsilon forbids the round after `state`: its projected epsilon is over the budget
        and the action is stop (with warn it logs the coordinator's line and returns False)."""
        cfg = self.config
        if state.privacy is None or cfg.dp_target_epsilon is None:
            return False
        projected = state.privacy.accountant.projected_epsilon(self.sampling_rate, float(cfg.dp_noise_multiplier or 0))
        action = budget_action(projected, cfg.dp_target_epsilon, "warn" if cfg.dp_budget_action == "warn" else "stop")
        if action != "continue":
            log.warning("privacy budget: round %d would bring epsilon to %.4g, above --dp-target-epsilon %g "
                        "(delta %g)%s", state.round + 1, projected, cfg.dp_target_epsilon, cfg.dp_delta,
                        f": run stopped, the final model is round {state.round}'s" if action == "stop"
                        else ": going on (--dp-budget-action warn)")
        return action == "stop"

    def train_settings(self, round_: int) -> dict:
        """Local training's settings in round `round_` (1-based): the lr is the schedule's (FleetConfig.lr_at)."""
        c = self.config
        return {"local_epochs": c.local_epochs, "batch_size": c.batch_size, "lr": c.lr_at(round_),
                "momentum": c.momentum}

    def _train(self, state: FleetState, members: list[int],
               on_step: OnStep | None = None) -> Iterator[tuple[Tensors, Tensors]]:
        """run_round's training of `members` from `state` (a subclass may wrap it, as benchmarks/wire.py does)."""
        return self.train_clients(state.shared, state.local, members, state.round, state.seed, on_step)

    def train_clients(self, shared: Tensors, local: Sequence[Tensors], members: Sequence[int], round_: int, seed: int,
                      on_step: OnStep | None = None) -> Iterator[tuple[Tensors, Tensors]]:
        """Each of `members`' (shared, local) tensors after its local training from `shared` and its own
        `local[j]`, in their order: client j's batches those of round index `round_` (the rounds done before;
        a clocked device's trainings) under `seed`, at the lr of round `round_` + 1."""
        d, phases = self.data, self.algorithm.phases
        if self.engine == "sequential":
            for j in members:
                load_tensors(self.model, shared, local[j])
                with self.compute():
                    train_client(self.model, self.manifest, phases, d.x, d.y, d.clients[j][0],
                                 generator=client_generator(seed, round_, j, PURPOSE_TRAIN),
                                 channels_last=self.channels_last, on_step=on_step,
                                 **self.train_settings(round_ + 1))
                trained = exported_state(self.model)
                yield ({n: trained[n].detach().clone() for n in self.shared_names},
                       {n: trained[n].detach().clone() for n in self.local_names})
            return
        stacked = self.stack(shared, local, members)
        generators = [client_generator(seed, round_, j, PURPOSE_TRAIN) for j in members]
        with self.compute():
            train_clients_batched(self.model, self.manifest, phases, d.x, d.y, [d.clients[j][0] for j in members],
                                  stacked, generators=generators, on_step=on_step,
                                  channels_last=self.batched_channels_last, **self.train_settings(round_ + 1))
        for row in range(len(members)):
            yield ({n: stacked[n][row] for n in self.shared_names},
                   {n: stacked[n][row].clone() for n in self.local_names})

    @property
    def batched_evaluation(self) -> bool:
        """Whether rounds evaluate every client in one vmapped pass: the vmap engine on CUDA, with running BatchNorm
        statistics (on a CPU the grouped convolutions it becomes were no faster than one client at a time)."""
        return self.engine == "vmap" and self.device.type == "cuda" and self.manifest.bn != "batch"

    @property
    def batched_channels_last(self) -> bool:
        """The vmap engine's batches in NHWC order: on CUDA when asked (on a CPU its float32 path stays NCHW)."""
        return self.device.type == "cuda" and self.config.cuda_channels_last

    def stack(self, shared: Tensors, local: Sequence[Tensors], members: Sequence[int]) -> Tensors:
        """`members`' tensors along a leading client axis: `shared` repeated, each one's own `local[j]`."""
        stacked = {n: torch.stack([shared[n]] * len(members)) for n in self.shared_names}
        return stacked | {n: torch.stack([local[j][n] for j in members]) for n in self.local_names}

    @property
    def finetunes_at_eval(self) -> bool:
        """Whether evaluation fine-tunes a copy first: FedBABU always (its Algorithm 2), every algorithm
        with eval_finetune_every_algorithm (that Algorithm 2 as FedBABU's paper evaluates the others)."""
        c = self.config
        return (self.algorithm.fine_tune_head_at_eval or c.eval_finetune_every_algorithm) and c.eval_finetune_epochs > 0

    def evaluate_client(self, j: int, shared: Tensors, local: Tensors) -> tuple[float, float]:
        """Client j's (accuracy, loss) as it would serve: `shared` and its own `local` tensors, on its test split."""
        load_tensors(self.model, shared, local)
        with self.compute():
            return evaluate(self.model, self.data.x, self.data.y, self.data.clients[j][1],
                            batch_statistics=self.manifest.bn == "batch")

    def evaluate_clients(self, members: Sequence[int], shared: Tensors,
                         local: Sequence[Tensors]) -> list[tuple[float, float]]:
        """evaluate_client of each of `members`, all in vmapped forward passes (the vmap engine's evaluation;
        running BatchNorm statistics only: batch statistics would see the padding of shorter test splits)."""
        with self.compute():
            return evaluate_clients_batched(self.model, self.data.x, self.data.y,
                                            [self.data.clients[j][1] for j in members],
                                            self.stack(shared, local, members))

    def _evaluate(self, state: FleetState, j: int, finetune: bool,
                  on_step: OnStep | None = None) -> tuple[tuple[float, float], tuple[float, float]]:
        """Client j's (accuracy, loss) before and after fine-tuning a copy (`finetune`: the same pair twice
        without it) at the lr the next round trains with (FedBABU's scripts fine-tune after the round's lr
        decay); the state keeps the untuned tensors."""
        initial = self.evaluate_client(j, state.shared, state.local[j])
        if not finetune:
            return initial, initial
        train_idx, test_idx = self.data.clients[j]
        phase = Phase(self.config.eval_finetune, self.config.eval_finetune_epochs)
        with self.compute():  # the model holds client j's tensors still
            train_client(self.model, self.manifest, (phase,), self.data.x, self.data.y, train_idx,
                         generator=client_generator(state.seed, state.round, j, PURPOSE_FINETUNE),
                         channels_last=self.channels_last, on_step=on_step, **self.train_settings(state.round + 1))
            return initial, evaluate(self.model, self.data.x, self.data.y, test_idx,
                                     batch_statistics=self.manifest.bn == "batch")


def _float_input(_module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """A BatchNorm forward pre-hook: its input in float32 (under bf16 autocast a convolution gives bfloat16)."""
    return (inputs[0].float(), *inputs[1:])


def random_local_init(model: torch.nn.Module, local_names: Sequence[str], seed: int) -> Tensors:
    """Fresh values of the `local_names` tensors, as the model's constructor draws them, from
    torch.manual_seed(`seed`) on one device type: every module whose own tensors are all local is reset
    (reset_parameters), in module order.
    The global RNG is left as it was; `model` keeps the new values."""
    local = set(local_names)
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        for prefix, module in model.named_modules():
            tensors = (*module.named_parameters(prefix, recurse=False), *module.named_buffers(prefix, recurse=False))
            own = [n for n, _ in tensors if not n.endswith("num_batches_tracked")]
            if own and local.issuperset(own) and hasattr(module, "reset_parameters"):
                module.reset_parameters()
    state = exported_state(model)
    return {n: state[n].detach().clone() for n in local_names}


def save_state(state: FleetState, path: str | Path) -> None:
    """One checkpoint (fedper.checkpoint: atomic, safetensors + JSON): the shared tensors as
    "shared/NAME", client j's local ones as "local/j/NAME", the names in order in the metadata."""
    tensors = {f"shared/{n}": t for n, t in state.shared.items()}
    for j, own in enumerate(state.local):
        tensors |= {f"local/{j}/{n}": t for n, t in own.items()}
    meta = {"round": state.round, "seed": state.seed, "shared": list(state.shared),
            "local": [list(own) for own in state.local],
            "privacy": None if state.privacy is None else state.privacy.to_json()}
    checkpoint.write_checkpoint(Path(path), {k: t.detach().cpu().numpy() for k, t in tensors.items()}, meta)


def load_state(path: str | Path, device: torch.device | str = "cpu") -> FleetState:
    arrays, meta = checkpoint.read_checkpoint(Path(path))

    def tensor(key: str) -> torch.Tensor:
        return torch.from_numpy(arrays[key]).to(device)

    return FleetState(round=meta["round"], shared={n: tensor(f"shared/{n}") for n in meta["shared"]},
                      local=[{n: tensor(f"local/{j}/{n}") for n in names} for j, names in enumerate(meta["local"])],
                      seed=meta["seed"],
                      privacy=PrivacyState.from_json(meta["privacy"]) if meta.get("privacy") else None)
