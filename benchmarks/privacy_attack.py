"""Privacy measured by attack: gradient inversion by a curious coordinator on one device's FedPer update.

    python benchmarks/privacy_attack.py [--quick] [--out runs/bench] [--iterations 200] [--figure PNG]
                                        [--architecture resnet34] [--ladder]

The attack (benchmarks/inversion.py) is Geiping et al. 2020's, run on what the coordinator receives from one
device: one SGD step on one image, one step on a batch, and the protocol's real update (E = 1 local epoch,
B = 32, lr 0.01: the agent's defaults), each through the codecs fp32, fp16 and int8 (the project's payload
encoder and decoder), then on the one-image update with DP-FedAvg's clipping and noise (fedper.privacy) at a
few z, and under secure aggregation (the sum of several devices' updates, through fedper.secagg's kernel).
The device's head never leaves it: the attacker optimizes a head of its own draw with the images. A last row
calibrates the attack where it is easiest: BatchNorm on running statistics (which no device does) and the
head known. `--ladder` runs only the one-image update, with and without each of the attacker's handicaps (the
head unknown, BatchNorm on the batch's statistics), to find what stops the attack;
`--architecture resnet34` attacks the project's other model. Every reconstruction is scored against the
device's true images (scikit-image's PSNR and SSIM, best one-to-one match) next to images of uniform noise
matched the same way, and a flat mid-grey image. Writes privacy_attack.json and privacy_attack.md under --out,
and the figure of the best and worst reconstructions.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import inversion as inv
import numpy as np
import torch
import torch.nn.functional as F
from common import machine, table

from fedper.models import ARCHITECTURES

REPO = Path(__file__).resolve().parents[1]
PACK: Path | None = None  # --cifar10: a CIFAR-10 JPEG pack (.npz); without it, scikit-learn's bundled digits


@dataclass(frozen=True)
class Case:
    scenario: str  # what the device did
    images: int  # its training images
    training: inv.Training
    codec: str = "fp32"
    defence: str = "none"
    noise: float | None = None  # DP's z (clip at the update's own norm); None: no DP
    devices: int = 1  # > 1: secure aggregation's sum of this many devices
    known_head: bool = False  # the calibration row only
    iterations: int = 0


def cases(iterations: int, quick: bool) -> list[Case]:
    one = inv.Training(batch_size=1)
    batch = 4
    real = 40  # 40 images, B = 32: two SGD steps in the epoch
    rows = []
    for codec in ("fp32", "fp16", "int8"):
        rows += [Case("1 image, 1 step", 1, one, codec, iterations=iterations),
                 Case(f"batch of {batch}, 1 step", batch, inv.Training(batch_size=batch), codec,
                      iterations=max(iterations // 2, 1)),
                 Case(f"real update: {real} images, E=1, B=32", real, inv.Training(), codec,
                      iterations=max(iterations // 10, 1))]
    for z in (0.0, 0.1) if quick else (0.0, 0.01, 0.1, 1.0):
        rows.append(Case("1 image, 1 step", 1, one, defence=f"DP: clip to C = its norm, z={z:g}", noise=z,
                         iterations=iterations))
    for devices in (4,) if quick else (4, 16):
        rows.append(Case("1 image, 1 step", 1, one, defence=f"secure aggregation, sum of {devices}",
                         devices=devices, iterations=max(iterations // devices, 1)))
    rows.append(Case("1 image, 1 step", 1, replace(one, batchnorm="eval"),
                     defence="calibration: BatchNorm eval, head known", known_head=True, iterations=iterations))
    return rows


def ladder(iterations: int) -> list[Case]:
    """One image, one step, fp32, with and without each of the attacker's two handicaps (the head it must guess,
    BatchNorm on the batch's own statistics): where the attack starts to work tells what stopped it."""
    one, running = inv.Training(batch_size=1), inv.Training(batch_size=1, batchnorm="eval")
    return [Case("1 image, 1 step", 1, one, iterations=iterations),
            Case("1 image, 1 step", 1, one, defence="head known", known_head=True, iterations=iterations),
            Case("1 image, 1 step", 1, running, defence="BatchNorm eval", iterations=iterations),
            Case("1 image, 1 step", 1, running, defence="calibration: BatchNorm eval, head known", known_head=True,
                 iterations=iterations)]


def load_images(count: int, seed: int) -> tuple[np.ndarray, np.ndarray, str]:
    if PACK is not None:
        return (*inv.cifar10_images(PACK, count, seed), "CIFAR-10 (test split)")
    return (*inv.digits_images(count, seed=seed), "scikit-learn digits, upsampled to 32x32 (no --cifar10 pack given)")


def pretrained(setup: inv.Setup, steps: int, seed: int) -> torch.nn.Module:
    """A base as a later round sees it: `steps` SGD steps of B = 32 on other CIFAR-10 images (random init: 0)."""
    model = setup.model(seed)
    if steps:
        x, y, _ = load_images(1000, seed + 1000)
        data, labels = inv.normalized(x), torch.from_numpy(y)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        generator = torch.Generator().manual_seed(seed)
        model.train()
        for _ in range(steps):
            idx = torch.randint(0, len(labels), (32,), generator=generator)
            loss = F.cross_entropy(model(data[idx]), labels[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model


def attack_case(case: Case, setup: inv.Setup, model: torch.nn.Module, attack: inv.Attack,
                images: np.ndarray, labels: np.ndarray) -> dict:
    manifest = setup.manifest(model)
    state = inv.exported_state(model)
    base = {n: state[n].detach().clone() for n in manifest.names("base")}
    names = inv.trainable_base(manifest)
    # each device: its own images and its own head (FedPer draws every device's head apart)
    devices = []
    for d in range(case.devices):
        part = slice(d * case.images, (d + 1) * case.images)
        head = inv.trainable_head(setup.model(100 + d), manifest) if not case.known_head else \
            inv.trainable_head(model, manifest)
        x, y = inv.normalized(images[part]), torch.from_numpy(labels[part])
        update = inv.device_update(model, manifest, base, head, x, y, case.training, seed=d)
        devices.append((x, y, head, update))
    victim_x, _, _, victim_update = devices[0]
    if case.devices > 1:
        norms = [float(inv.flat_delta(manifest, u, base, manifest.names(shared=True)).norm()) for *_, u in devices]
        seen = inv.secure_sum(manifest, [u for *_, u in devices], base, clip_norm=2 * max(norms))
    elif case.noise is not None:
        clip = float(inv.flat_delta(manifest, victim_update, base, names).norm())
        seen = inv.with_dp(manifest, victim_update, base, clip, case.noise, seed=0)
    else:
        seen = inv.through_codec(manifest, victim_update, case.codec)
    observed = inv.flat_delta(manifest, seen, base, names)
    true_delta = inv.flat_delta(manifest, victim_update, base, names)
    start = time.perf_counter()
    rebuilt, losses = inv.invert(setup, model, manifest, base, observed, [y for _, y, _, _ in devices],
                                 case.training, replace(attack, iterations=case.iterations),
                                 head=[h for _, _, h, _ in devices] if case.known_head else None)
    seconds = time.perf_counter() - start
    truth, guesses = inv.pixels(victim_x), inv.pixels(rebuilt)
    found, baseline = inv.score(truth, guesses), inv.random_baseline(truth, len(guesses))
    grey = inv.grey_baseline(truth)
    return {"case": {**asdict(case), "training": asdict(case.training)},
            "signal_cosine": float(F.cosine_similarity(observed, true_delta, dim=0)),
            "final_loss": losses[-1], "first_loss": losses[0], "seconds": round(seconds, 1),
            "psnr": found.psnr, "ssim": found.ssim, "baseline_psnr": baseline.psnr, "baseline_ssim": baseline.ssim,
            "grey_psnr": grey.psnr,
            "pairs": found.pairs, "truth": truth, "guesses": guesses}


def figure(results: list[dict], path: Path, shown: int = 4) -> None:
    """The `shown` best and worst reconstructions by PSNR (one per row of the table), truth above each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from skimage.metrics import peak_signal_noise_ratio

    ranked = sorted(results, key=lambda r: r["psnr"], reverse=True)
    every = len(ranked) <= 2 * shown  # then every row, best first, named by its row alone
    picked = ranked if every else ranked[:shown] + ranked[-shown:]
    fig, axes = plt.subplots(2, len(picked), figsize=(1.9 * len(picked), 4.6), squeeze=False)
    for column, result in enumerate(picked):
        truth, guesses = result["truth"], result["guesses"]
        t, g = max(result["pairs"], key=lambda p: peak_signal_noise_ratio(truth[p[0]], guesses[p[1]], data_range=1.0))
        case = result["case"]
        label = f"{case['scenario']}\n{case['codec']}, {case['defence']}".replace(", none", "")
        axes[0, column].imshow(truth[t])
        rank = "" if every else ("best" if column < shown else "worst") + "\n"
        axes[0, column].set_title(rank + label, fontsize=5.5)
        axes[1, column].imshow(guesses[g])
        axes[1, column].set_title(f"{peak_signal_noise_ratio(truth[t], guesses[g], data_range=1.0):.1f} dB", fontsize=7)
        for row in (0, 1):
            axes[row, column].axis("off")
    fig.text(0.01, 0.72, "truth", rotation=90, fontsize=8)
    fig.text(0.01, 0.25, "rebuilt", rotation=90, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def run(out: Path, quick: bool, iterations: int | None = None, pretrain_steps: int | None = None,
        figure_path: Path | None = None, architecture: str = "mobilenet_v1", only_ladder: bool = False) -> str:
    torch.set_num_threads(1)
    iterations = iterations or (10 if quick else 40)
    pretrain_steps = (20 if quick else 100) if pretrain_steps is None else pretrain_steps
    setup = inv.Setup(architecture=architecture)
    model = pretrained(setup, pretrain_steps, seed=0)
    rows = ladder(iterations) if only_ladder else cases(iterations, quick)
    need = max(c.images * c.devices for c in rows)
    images, labels, source = load_images(need, seed=1)
    results = []
    for case in rows:
        results.append(attack_case(case, setup, model, inv.Attack(), images, labels))
        r = results[-1]
        print(f"{case.scenario} | {case.codec} | {case.defence}: PSNR {r['psnr']:.1f} dB "
              f"(noise {r['baseline_psnr']:.1f}), {r['seconds']:.0f} s", flush=True)
    header = ["scenario", "codec", "defence", "iterations", "signal cos", "attack 1 - cos (first -> last)",
              "PSNR dB", "SSIM", "noise PSNR dB", "noise SSIM", "grey PSNR dB"]
    body = [[r["case"]["scenario"], r["case"]["codec"], r["case"]["defence"], r["case"]["iterations"],
             round(r["signal_cosine"], 3), f"{r['first_loss']:.2f} -> {r['final_loss']:.2f}", round(r["psnr"], 1),
             round(r["ssim"], 3), round(r["baseline_psnr"], 1), round(r["baseline_ssim"], 3), round(r["grey_psnr"], 1)]
            for r in results]
    text = (f"images: {source}; model: {architecture} width {setup.width}, K_P={setup.kp}, base after "
            f"{pretrain_steps} pretraining steps; {machine()}\n\n" + table(header, body))
    out.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine(), "images": source, "architecture": architecture, "width": setup.width,
               "kp": setup.kp,
               "pretrain_steps": pretrain_steps, "attack": asdict(inv.Attack()),
               "rows": [{k: v for k, v in r.items() if k not in ("truth", "guesses")} for r in results]}
    (out / "privacy_attack.json").write_text(json.dumps(payload, indent=2) + "\n")
    (out / "privacy_attack.md").write_text(text + "\n")
    figure(results, figure_path or out / "privacy_attack.png")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cifar10", type=Path, default=None, help="a CIFAR-10 pack of JPEGs (.npz with test_jpeg, "
                        "test_offsets, test_labels) to attack; default: scikit-learn's bundled digits")
    parser.add_argument("--out", type=Path, default=Path("runs/bench"), help="folder for the table (JSON, markdown) "
                        "and, without --figure, the figure")
    parser.add_argument("--quick", action="store_true", help="10 attack iterations, 20 pretraining steps, fewer "
                        "defences: a smoke run of a minute or two")
    parser.add_argument("--iterations", type=int, default=None,
                        help="attack iterations on a one-image update (default 40; a batch gets half, the real "
                        "update a tenth, a secure sum of k devices 1/k): the scale of the run")
    parser.add_argument("--pretrain-steps", type=int, default=None,
                        help="SGD steps on other images before the attacked round (default 100; 0: round 1)")
    parser.add_argument("--figure", type=Path, default=None, help="where the PNG goes (default OUT/privacy_attack.png)")
    parser.add_argument("--architecture", choices=ARCHITECTURES, default="mobilenet_v1",
                        help="the fleet's model, at width 0.25 with the 32x32 stem (default mobilenet_v1)")
    parser.add_argument("--ladder", action="store_true", help="only the one-image update, fp32, four rows: as the "
                        "protocol runs, with the head known, with BatchNorm on running statistics, with both")
    args = parser.parse_args()
    if (args.iterations is not None and args.iterations < 1) or (args.pretrain_steps or 0) < 0:
        parser.error("--iterations must be >= 1 and --pretrain-steps >= 0")
    global PACK
    if args.cifar10 is not None and not args.cifar10.is_file():
        parser.error(f"--cifar10 {args.cifar10}: no such file")
    PACK = args.cifar10
    print(run(args.out, args.quick, args.iterations, args.pretrain_steps, args.figure, args.architecture,
              args.ladder))


if __name__ == "__main__":
    main()
