"""Gradient inversion as a curious coordinator runs it on what one FedPer device sends.

The attack is Geiping et al. 2020 ("Inverting Gradients - How easy is it to break privacy in federated
learning?", NeurIPS): dummy images are optimized with Adam on the signed gradient so that the update they would
produce matches the observed one in cosine similarity, with a total-variation prior and the images boxed to the
valid pixel range. For an update of several local steps (their multi-step "FedAvg" case) the attacker unrolls
the device's SGD on the dummies, differentiably, and matches the resulting base difference. Written from the
paper: the one packaged implementation found on PyPI (`breaching` 0.1.2) brings its own model zoo and configs.

What the attacker knows, and what it does not (FedPer's threat model, docs/privacy.md):
- it knows the base it sent (the round model), the architecture and K_P, the training settings it sent (lr, E,
  B), each device's registered sample count n_j, and the labels (Geiping's setting; with an unknown head a
  label is only a name the dummy head can remap);
- it never sees the head: each FedPer device draws its own head and trains it locally, so the attack treats the
  head's trainable tensors as unknowns too, optimized with the images from a head of its own random draw;
- it matches the trainable base tensors only (BatchNorm running statistics also travel and would leak batch
  means: a stronger attacker could use them).

The device's true update is computed by the project's own training path (fedper.training: plain SGD, BatchNorm in
train mode as the ORT graphs run it, batches of fedper.batches), so the attack meets what a device really sends.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn
from torch.func import functional_call

from fedper.batches import epoch_batches
from fedper.data import load_digits, to_float_nchw
from fedper.manifest import Manifest
from fedper.models import IMAGENET_MEAN, IMAGENET_STD, build_model, describe, exported_state
from fedper.training import load_tensors, ort_batchnorm, phase_optimizer, sgd_step

MEAN = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
STD = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)


@dataclass(frozen=True)
class Setup:
    """The fleet's model: `architecture` at `width`, cut at K_P, 10 classes, 32x32 inputs (CIFAR, small-input stem)."""

    width: float = 0.25
    kp: int = 2
    input_size: int = 32
    num_classes: int = 10
    architecture: str = "mobilenet_v1"

    def model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return build_model(self.architecture, self.num_classes, self.width, self.input_size)

    def manifest(self, model: nn.Module) -> Manifest:
        return describe(model, architecture=self.architecture, kp=self.kp, algorithm="fedper",
                        input_size=self.input_size, width=self.width)


@dataclass(frozen=True)
class Training:
    """What the coordinator sends with a round: E local epochs, batch B, SGD learning rate (the agent's defaults)."""

    epochs: int = 1
    batch_size: int = 32
    lr: float = 0.01
    # "train": BatchNorm normalizes with each batch's statistics, as every device's graph does (the protocol);
    # "eval": with the running statistics, which no device does: the attack's easiest case, to calibrate it
    batchnorm: str = "train"

    def batches(self, n: int, seed: int, epoch: int) -> list[np.ndarray]:
        return epoch_batches(n, self.batch_size, (seed, 1, 0, epoch))


@dataclass(frozen=True)
class Attack:
    """Geiping et al.'s settings, shortened: Adam on the signed gradient, lr decayed x0.1 at 3/8, 5/8, 7/8."""

    iterations: int = 300
    lr: float = 0.1
    tv: float = 1e-4
    head_lr: float = 0.01
    seed: int = 0


# ---------------------------------------------------------------- images


def cifar10_images(pack: Path, count: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """`count` test images (uint8 NHWC) and labels of a CIFAR-10 JPEG pack (.npz), a seeded draw."""
    with np.load(pack) as arrays:
        blob, offsets, labels = arrays["test_jpeg"], arrays["test_offsets"], arrays["test_labels"]
    chosen = np.random.default_rng(seed).choice(len(labels), count, replace=False)
    images = [np.asarray(Image.open(io.BytesIO(blob[offsets[i]:offsets[i + 1]].tobytes())).convert("RGB"))
              for i in chosen]
    return np.stack(images), labels[chosen].astype(np.int64)


def digits_images(count: int, size: int = 32, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits, upsampled to `size` and grey as RGB: real images without a download."""
    data = load_digits(size).train
    chosen = np.random.default_rng(seed).choice(len(data.y), count, replace=False)
    return data.x[chosen], data.y[chosen]


def normalized(images: np.ndarray) -> torch.Tensor:
    """uint8 NHWC -> the model's float NCHW input, as every device normalizes it."""
    return torch.from_numpy(to_float_nchw(images, IMAGENET_MEAN, IMAGENET_STD))


def pixels(x: torch.Tensor) -> np.ndarray:
    """The model's input back to [0, 1] NHWC float64, for scoring and pictures."""
    return (x.detach() * STD + MEAN).clamp(0, 1).permute(0, 2, 3, 1).double().numpy()


# ---------------------------------------------------------------- the device


def trainable_head(model: nn.Module, manifest: Manifest) -> dict[str, torch.Tensor]:
    head = set(manifest.names("head"))
    return {n: p.detach().clone() for n, p in model.named_parameters() if n in head}


def device_update(model: nn.Module, manifest: Manifest, base: Mapping[str, torch.Tensor],
                  head: Mapping[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, training: Training,
                  seed: int) -> dict[str, np.ndarray]:
    """The shared tensors a device sends after its local epochs: the project's SGD path, phase "all"."""
    load_tensors(model, base, head)
    with ort_batchnorm(model):
        optimizer = phase_optimizer(model, manifest, "all", lr=training.lr)
        model.train(training.batchnorm == "train")
        for epoch in range(training.epochs):
            for idx in training.batches(len(y), seed, epoch):
                sgd_step(model, optimizer, x[torch.from_numpy(idx)], y[torch.from_numpy(idx)])
    state = exported_state(model)
    return {n: state[n].detach().numpy().copy() for n in manifest.names(shared=True)}


# ---------------------------------------------------------------- the attack


def simulated_delta(model: nn.Module, params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor],
                    base_names: Sequence[str], x: torch.Tensor, y: torch.Tensor, training: Training) -> torch.Tensor:
    """The flat base difference that SGD on (x, y) would give, differentiable in x and the head. The device's
    batch order is unknown: within an epoch the dummies' order is theirs to take, so the attacker cuts them in
    order."""
    current, scratch = dict(params), {n: b.clone() for n, b in buffers.items()}  # BatchNorm moves its buffers
    names = list(current)
    for _ in range(training.epochs):
        for start in range(0, len(y), training.batch_size):
            part = slice(start, start + training.batch_size)
            loss = F.cross_entropy(functional_call(model, (current, scratch), (x[part],)), y[part])
            grads = torch.autograd.grad(loss, [current[n] for n in names], create_graph=True)
            current = {n: current[n] - training.lr * g for n, g in zip(names, grads, strict=True)}
    return torch.cat([(current[n] - params[n]).reshape(-1) for n in base_names])


def total_variation(x: torch.Tensor) -> torch.Tensor:
    return (x[..., 1:, :] - x[..., :-1, :]).abs().mean() + (x[..., :, 1:] - x[..., :, :-1]).abs().mean()


def invert(setup: Setup, model: nn.Module, manifest: Manifest, base: Mapping[str, torch.Tensor],
           observed: torch.Tensor, labels: Sequence[torch.Tensor], training: Training, attack: Attack,
           head: Sequence[Mapping[str, torch.Tensor]] | None = None) -> tuple[torch.Tensor, list[float]]:
    """(images at the model input's scale, the loss at each iteration) rebuilt from `observed`, the flat
    difference of the trainable base tensors (manifest order) summed over the devices whose `labels` are given
    (one tensor per device; one device for a clear update). `head`: the devices' heads when the attacker knows
    them (an upper bound); None: unknowns, optimized from a head of the attacker's own draw."""
    base_names = trainable_base(manifest)
    torch.manual_seed(attack.seed)
    shape = (setup.input_size, setup.input_size)
    dummies = [torch.randn(len(y), 3, *shape, requires_grad=True) for y in labels]
    unknown_head = head is None
    if unknown_head:
        head = [trainable_head(setup.model(attack.seed + 1 + i), manifest) for i in range(len(labels))]
        heads = [{n: t.clone().requires_grad_(True) for n, t in h.items()} for h in head]
    else:
        heads = [{n: t.detach().requires_grad_(True) for n, t in h.items()} for h in head]  # not optimized
    fixed = {n: base[n].detach().requires_grad_(True) for n in base_names}
    buffers = {n: b.detach() for n, b in model.named_buffers()}
    buffers.update({n: base[n].detach() for n in base if n in buffers})
    low, high = (0 - MEAN) / STD, (1 - MEAN) / STD
    groups = [{"params": dummies, "lr": attack.lr}]
    if unknown_head:
        groups.append({"params": [t for h in heads for t in h.values()], "lr": attack.head_lr})
    optimizer = torch.optim.Adam(groups)
    milestones = [int(attack.iterations * f) for f in (3 / 8, 5 / 8, 7 / 8)]
    schedule = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones, gamma=0.1)
    target = observed.detach().double()
    model.train(training.batchnorm == "train")
    losses: list[float] = []
    for _ in range(attack.iterations):
        optimizer.zero_grad(set_to_none=True)
        total = sum(simulated_delta(model, {**fixed, **h}, buffers, base_names, x, y, training)
                    for x, y, h in zip(dummies, labels, heads, strict=True))
        loss = 1 - F.cosine_similarity(total.double(), target, dim=0)
        loss = loss + attack.tv * sum(total_variation(x) for x in dummies)
        loss.backward()
        losses.append(float(loss.detach()))
        for x in dummies:
            x.grad.sign_()
        optimizer.step()
        schedule.step()
        with torch.no_grad():
            for x in dummies:
                x.copy_(torch.maximum(torch.minimum(x, high), low))
    return torch.cat([x.detach() for x in dummies]), losses


# ---------------------------------------------------------------- what the coordinator sees


def trainable_base(manifest: Manifest) -> list[str]:
    """The tensors the attack matches: the base's trainable ones, in manifest order."""
    return [n for n in manifest.names("base") if manifest.spec(n).trainable]


def flat_delta(manifest: Manifest, update: Mapping[str, np.ndarray], base: Mapping[str, torch.Tensor],
               names: Sequence[str]) -> torch.Tensor:
    return torch.cat([torch.from_numpy(np.asarray(update[n], np.float64) - base[n].double().numpy()).reshape(-1)
                      for n in names])


def through_codec(manifest: Manifest, update: Mapping[str, np.ndarray], codec: str) -> dict[str, np.ndarray]:
    """The update as the coordinator decodes it: the project's payload encoder and decoder under `codec`."""
    from fedper.payload import decode_shared, encode_shared

    return dict(decode_shared(manifest, encode_shared(manifest, update, codec), codec))


def with_dp(manifest: Manifest, update: Mapping[str, np.ndarray], base: Mapping[str, torch.Tensor],
            clip_norm: float, noise_multiplier: float, seed: int) -> dict[str, np.ndarray]:
    """DP-FedAvg's release with this device alone (fedper.privacy.DPFedAvg, expected weight 1): its delta
    clipped to C plus N(0, (zC)^2) per value, what anybody holding the released model can difference, and,
    for one device, the noise a distributed-DP sum carries. BatchNorm statistics are not released under DP."""
    from fedper.privacy import DPFedAvg, private_tensor_names

    reference = {n: base[n].numpy() for n in manifest.names(shared=True)}
    rule = DPFedAvg(reference, clip_norm=clip_norm, noise_multiplier=noise_multiplier, expected_weight=1.0,
                    rng=np.random.default_rng(seed), private_names=private_tensor_names(manifest))
    rule.add(update, 1)
    return rule.result(np.float64)


def secure_sum(manifest: Manifest, updates: Sequence[Mapping[str, np.ndarray]], base: Mapping[str, torch.Tensor],
               clip_norm: float) -> dict[str, np.ndarray]:
    """What the coordinator learns under --secure-aggregation: the unmasked sum of the devices' clipped deltas
    (equal weights), run through the project's SecAgg+ kernel (fedper.secagg, every stage, no dropout), as
    base + sum, over the shared tensors."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from fedper.privacy import clip_delta
    from fedper.secagg import Identity, SecAggClient, SecAggConfig, SecAggServer

    names = [t.name for t in manifest.summed_tensors("shared")]
    reference = {n: base[n].numpy() for n in names}
    vectors = []
    for update in updates:
        clipped = clip_delta(update, reference, clip_norm, names)
        vectors.append(np.concatenate([clipped[n].reshape(-1) for n in names]))
    root, fleet = Ed25519PrivateKey.generate(), "attack"
    roster = [f"d{i:03d}" for i in range(len(updates))]
    config = SecAggConfig.create(1, 1, roster, vectors[0].size, clip_norm)
    clients = [SecAggClient(config, u, Identity.issue(root, fleet, name)) for u, name in enumerate(roster)]
    server = SecAggServer(config, fleet, root.public_key())
    keys = server.neighbour_keys({c.device: c.advertise() for c in clients})
    inbox = server.relay_shares({u: clients[u].share_keys(m) for u, m in keys.items()})
    requests = server.mask_requests({u: clients[u].receive_shares(m) for u, m in inbox.items()})
    lists = server.survivor_lists([clients[u].masked_input(m, vectors[u]) for u, m in requests.items()])
    unmask = server.unmask_requests({u: clients[u].sign_survivors(m) for u, m in lists.items()})
    (group,) = server.aggregate({u: clients[u].unmask(m) for u, m in unmask.items()}).groups
    total, out, start = group.sum, {}, 0
    for n in names:
        size = reference[n].size
        out[n] = reference[n] + total[start:start + size].reshape(reference[n].shape)
        start += size
    return out


# ---------------------------------------------------------------- scoring


@dataclass(frozen=True)
class Score:
    psnr: float  # dB, mean over the device's images, each matched to its best reconstruction
    ssim: float
    pairs: tuple[tuple[int, int], ...]  # (true image, reconstruction) matched


def score(truth: np.ndarray, guesses: np.ndarray) -> Score:
    """PSNR and SSIM (scikit-image) of each true image against the reconstruction the best one-to-one matching
    (the permutation with the highest total PSNR, scipy's assignment solver) gives it; [0, 1] NHWC images."""
    from scipy.optimize import linear_sum_assignment
    from skimage.metrics import peak_signal_noise_ratio, structural_similarity

    table = np.array([[peak_signal_noise_ratio(t, g, data_range=1.0) for g in guesses] for t in truth])
    rows, cols = linear_sum_assignment(table, maximize=True)
    ssim = [structural_similarity(truth[r], guesses[c], channel_axis=-1, data_range=1.0)
            for r, c in zip(rows, cols, strict=True)]
    return Score(float(table[rows, cols].mean()), float(np.mean(ssim)),
                 tuple((int(r), int(c)) for r, c in zip(rows, cols, strict=True)))


def random_baseline(truth: np.ndarray, count: int, seed: int = 0) -> Score:
    """The same score for `count` images of uniform noise: what a guess that saw nothing of the update gets."""
    return score(truth, np.random.default_rng(seed).random((count, *truth.shape[1:])))


def grey_baseline(truth: np.ndarray) -> Score:
    """The score of a flat mid-grey image for each: the smooth guess that saw nothing of the update."""
    return score(truth, np.full_like(truth, 0.5))
