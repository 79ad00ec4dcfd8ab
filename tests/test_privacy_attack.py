"""The gradient-inversion benchmark's pieces (benchmarks/inversion.py) on real images, tiny sizes.

What the attack inverts must be what a device sends: the attacker's differentiable replay of local training is
checked against the device's real update (the project's training path), and what each defence leaves of the
device's update is checked against a derivation of its own (the quantization grid's error, the DP noise's
norm, the secure sum against numpy's). The scoring is checked against PSNR written out in float64. The
reconstruction itself is run on a DP-noised update and on an update of pure noise: with the noise at z = 1 the
attack does no better than when it is fed nothing of the device.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import inversion as inv  # benchmarks/ is not a package: imported from its folder

pytest.importorskip("skimage", reason="scikit-image scores the reconstructions (the `attack` extra)")
PACK = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "cifar10-jpeg.npz"
SIZE = 24  # fewer pixels than CIFAR's 32 keep the tests fast (the last block still sees 2x2 maps, which
# BatchNorm in train mode needs for one image); the benchmark runs at 32
SETUP = inv.Setup(width=0.25, kp=2, input_size=SIZE)


def real_images(count: int) -> tuple[np.ndarray, np.ndarray]:
    """CIFAR-10 where the shared pack is present (resized), else scikit-learn's bundled digits (upsampled)."""
    if not PACK.is_file():
        return inv.digits_images(count, size=SIZE, seed=3)
    images, labels = inv.cifar10_images(PACK, count, seed=3)
    resized = [np.asarray(Image.fromarray(im).resize((SIZE, SIZE), Image.Resampling.BILINEAR)) for im in images]
    return np.stack(resized), labels


@pytest.fixture(scope="module")
def fleet():
    torch.manual_seed(0)
    model = SETUP.model(0)
    manifest = SETUP.manifest(model)
    state = inv.exported_state(model)
    base = {n: state[n].detach().clone() for n in manifest.names("base")}
    return model, manifest, base


@pytest.mark.parametrize("architecture", ["mobilenet_v1", "resnet34"])
def test_the_attackers_replay_of_local_training_is_the_devices_real_update(architecture: str) -> None:
    """40 images, B = 32, E = 1 (two SGD steps, the device's own seeded batch order): replayed on the true
    images in that order with the true head, the attacker's functional SGD gives the update the project's
    trainer produced, so the attack inverts the right function (BatchNorm in train mode, as on devices), on
    either model. In float64: BatchNorm in train mode on the last blocks' 2x2 maps magnifies rounding, and in
    float32 the two paths parted by 1 % on one thread (they agreed to 1e-4 on two)."""
    setup = replace(SETUP, architecture=architecture)
    model = setup.model(0).double()
    manifest = setup.manifest(model)
    state = inv.exported_state(model)
    base = {n: state[n].detach().clone() for n in manifest.names("base")}
    images, labels = real_images(40)
    x, y = inv.normalized(images).double(), torch.from_numpy(labels)
    head = {n: t.double() for n, t in inv.trainable_head(setup.model(7), manifest).items()}
    training = inv.Training()
    update = inv.device_update(model, manifest, base, head, x, y, training, seed=5)
    names = inv.trainable_base(manifest)
    true_delta = inv.flat_delta(manifest, update, base, names)
    order = torch.from_numpy(np.concatenate(training.batches(len(labels), 5, 0)))
    assert not torch.equal(order, torch.arange(len(labels)))  # the device shuffled: the replay must follow it
    params = {n: base[n].detach().requires_grad_(True) for n in names}
    params.update({n: t.detach().requires_grad_(True) for n, t in head.items()})
    buffers = {n: b.detach() for n, b in model.named_buffers()}
    buffers.update({n: base[n] for n in base if n in buffers})
    model.train()
    replay = inv.simulated_delta(model, params, buffers, names, x[order], y[order], training).detach().double()
    assert float((replay - true_delta).norm() / true_delta.norm()) < 1e-4
    shuffled = inv.simulated_delta(model, params, buffers, names, x, y, training).detach().double()
    assert float(F.cosine_similarity(shuffled, true_delta, dim=0)) < 0.999  # the order matters when n > B


def test_what_each_defence_leaves_of_the_update_is_what_its_noise_predicts(fleet) -> None:
    """cos(observed delta, true delta): fp16 keeps it; int8's per-tensor grid on the weights adds an error of
    variance step^2 / 12 per value (step = range / 255), predicted from the tensors alone; DP with C = |delta|
    adds noise of norm z C sqrt(d), so cos = 1 / sqrt(1 + z^2 d); the secure sum is numpy's sum of the clipped
    deltas within SecAgg's quantization."""
    model, manifest, base = fleet
    images, labels = real_images(5)
    names = inv.trainable_base(manifest)
    updates = [inv.device_update(model, manifest, base, inv.trainable_head(SETUP.model(10 + i), manifest),
                                 inv.normalized(images[i:i + 1]), torch.from_numpy(labels[i:i + 1]),
                                 inv.Training(batch_size=1), seed=i) for i in range(5)]
    update = updates[0]
    delta = inv.flat_delta(manifest, update, base, names)

    def cosine(seen: dict[str, np.ndarray]) -> float:
        return float(F.cosine_similarity(inv.flat_delta(manifest, seen, base, names), delta, dim=0))

    assert cosine(inv.through_codec(manifest, update, "fp32")) == pytest.approx(1.0, abs=1e-12)
    assert cosine(inv.through_codec(manifest, update, "fp16")) > 0.999
    # a step of lr 0.0002 (the coordinator's to choose) is small against the weights' grid, as a trained base's is
    small = inv.device_update(model, manifest, base, inv.trainable_head(SETUP.model(10), manifest),
                              inv.normalized(images[:1]), torch.from_numpy(labels[:1]), inv.Training(batch_size=1,
                              lr=0.0002), seed=0)
    step = inv.flat_delta(manifest, small, base, names)
    error = sum(small[n].size * ((float(small[n].max()) - float(small[n].min())) / 255) ** 2 / 12 for n in names)
    predicted = float(step.norm()) / np.sqrt(float(step.norm()) ** 2 + error)
    quantized = inv.flat_delta(manifest, inv.through_codec(manifest, small, "int8"), base, names)
    assert predicted < 0.95  # the grid does blur this step, so the check below is not vacuous
    assert float(F.cosine_similarity(quantized, step, dim=0)) == pytest.approx(predicted, abs=0.05)

    d = delta.numel()
    for z in (0.003, 0.01, 1.0):
        seen = inv.with_dp(manifest, update, base, float(delta.norm()), z, seed=1)
        assert cosine(seen) == pytest.approx(1 / np.sqrt(1 + z * z * d), abs=0.03)

    every = manifest.names(shared=True)
    clip = 2 * max(float(inv.flat_delta(manifest, u, base, every).norm()) for u in updates)
    summed = inv.secure_sum(manifest, updates, base, clip)
    plain = sum(inv.flat_delta(manifest, u, base, names) for u in updates)
    assert float((inv.flat_delta(manifest, summed, base, names) - plain).abs().max()) < 1e-6 * clip
    assert cosine(summed) < 0.9  # the victim's step is one of five in what the coordinator sees


def test_scores_take_the_best_match_and_agree_with_psnr_written_out() -> None:
    truth = real_images(4)[0].astype(np.float64) / 255
    rng = np.random.default_rng(0)
    permutation = np.array([2, 0, 3, 1])
    guesses = np.clip(truth[permutation] + rng.normal(0, 0.05, truth.shape), 0, 1)
    found = inv.score(truth, guesses)
    assert dict(found.pairs) == {int(p): i for i, p in enumerate(permutation)}
    expected = np.mean([10 * np.log10(1 / np.mean((truth[p] - guesses[i]) ** 2)) for i, p in enumerate(permutation)])
    assert found.psnr == pytest.approx(expected, rel=1e-9)
    assert found.ssim > 0.5
    assert inv.random_baseline(truth, 4).psnr < found.psnr - 10
    grey = np.mean([10 * np.log10(1 / np.mean((t - 0.5) ** 2)) for t in truth])
    assert inv.grey_baseline(truth).psnr == pytest.approx(grey, rel=1e-9)


def test_under_large_dp_noise_the_attack_does_no_better_than_fed_pure_noise(fleet) -> None:
    """One image, one step, C = |delta|, z = 1: the reconstruction scores within 1.5 dB of the same attack
    fed a random vector of the same norm (what an update that carries nothing of the device gives)."""
    model, manifest, base = fleet
    images, labels = real_images(1)
    x, y = inv.normalized(images), torch.from_numpy(labels)
    training = inv.Training(batch_size=1)
    update = inv.device_update(model, manifest, base, inv.trainable_head(SETUP.model(20), manifest), x, y,
                               training, seed=0)
    names = inv.trainable_base(manifest)
    delta = inv.flat_delta(manifest, update, base, names)
    attack = inv.Attack(iterations=8)
    noisy = inv.flat_delta(manifest, inv.with_dp(manifest, update, base, float(delta.norm()), 1.0, seed=2), base,
                           names)
    nothing = torch.from_numpy(np.random.default_rng(3).standard_normal(delta.numel())) * float(delta.norm())
    truth = inv.pixels(x)
    scores = [inv.score(truth, inv.pixels(inv.invert(SETUP, model, manifest, base, seen, [y], training, attack)[0]))
              for seen in (noisy, nothing)]
    assert abs(scores[0].psnr - scores[1].psnr) < 1.5
