"""Writes tests/vectors/web/: what the Python side computes, for the web agent to reproduce (web/test/vectors.test.mjs).

- rng.json: numpy's default_rng(seed).permutation, fedper.batches.epoch_batches and
  fedper.data.split_train_test, for seeds of one and several words;
- images.json: Pillow's bilinear resize of small random RGB images to other sizes, and fedper.data.to_float_nchw;
- codecs.json: tensors (a reference and a trained copy) and fedper.compression.encode's arrays and parameters for
  every codec, plus float32 -> float16 conversions at the edges (ties, subnormals, the largest half).

tests/test_web.py checks that this script reproduces the files.

    python tests/vectors/make_web_vectors.py [OUT_DIR]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from fedper import compression
from fedper.batches import epoch_batches
from fedper.data import split_train_test, to_float_nchw


def rng_vectors() -> dict:
    seeds = [0, 7, 2**32 + 5, 2**52 + 3, [3, 1, 0, 0], [123456789, 2, 1000, 4], [4294967295, 0]]
    permutations = [{"seed": s, "n": n, "perm": np.random.default_rng(s).permutation(n).tolist()}
                    for s in seeds for n in (1, 2, 10, 257)]
    cases = [(9, 4, [3, 1, 0, 0]), (33, 16, [3, 1, 0, 0]), (17, 8, [5, 2, 1000, 1]), (64, 32, [0, 1, 0, 0])]
    batches = [{"n": n, "batch_size": b, "seed": s, "batches": [x.tolist() for x in epoch_batches(n, b, s)]}
               for n, b, s in cases]
    rng = np.random.default_rng(0)
    splits = []
    for n, classes, seed in [(14, 4, 7), (80, 4, 3), (25, 10, 0), (5, 3, 1), (120, 3, 9)]:
        labels = rng.integers(0, classes, n)
        [(train, test)] = split_train_test([np.arange(n)], labels, test_fraction=0.2, seed=seed)
        splits.append({"labels": labels.tolist(), "seed": seed, "train": train.tolist(), "test": test.tolist()})
    return {"permutations": permutations, "batches": batches, "splits": splits}


def image_vectors() -> dict:
    rng = np.random.default_rng(1)
    resizes = []
    for width, height, out_w, out_h in [(40, 27, 32, 32), (70, 45, 32, 32), (7, 5, 32, 32), (32, 48, 32, 32),
                                        (64, 32, 16, 16), (33, 33, 32, 32), (32, 32, 32, 32)]:
        image = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        resized = np.asarray(Image.fromarray(image).resize((out_w, out_h), Image.Resampling.BILINEAR))
        resizes.append({"width": width, "height": height, "out_width": out_w, "out_height": out_h,
                        "pixels": image.ravel().tolist(), "resized": resized.ravel().tolist()})
    images = rng.integers(0, 256, (2, 3, 4, 3), dtype=np.uint8)
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    normalized = to_float_nchw(images, mean, std)
    return {"resizes": resizes, "normalize": {"shape": list(images.shape), "pixels": images.ravel().tolist(),
                                              "mean": mean, "std": std, "values": normalized.ravel().tolist()}}


def codec_vectors() -> dict:
    rng = np.random.default_rng(2)
    reference = {
        "conv.weight": rng.standard_normal((8, 4, 3, 3)).astype(np.float32) * 0.1,  # 36 values a channel: not rotated
        "dense.weight": rng.standard_normal((5, 64)).astype(np.float32),  # 64: rotated
        "bn.weight": rng.standard_normal(16).astype(np.float32),  # one channel of 16: rotated
        "bn.running_var": rng.uniform(0.1, 9e4, 16).astype(np.float32),  # sent exact; beyond float16
        "still.weight": np.full((3, 4), 0.25, np.float32),  # does not change: scale 0
        "wide.bias": rng.standard_normal(6).astype(np.float32) * 7e4,  # beyond float16: stays float32 under fp16
    }
    trained = {name: (x + rng.standard_normal(x.shape).astype(np.float32) * 0.01 * (name != "still.weight"))
               .astype(np.float32) for name, x in reference.items()}
    trained["dense.weight"][1, 7] += 0.5  # a heavy tail in one channel
    exact = ["bn.running_var"]
    encodings = {}
    for codec in compression.CODECS:
        arrays, metadata = compression.encode(trained, codec, exact=exact, reference=reference)
        encodings[codec] = {"metadata": metadata, "arrays": {
            name: {"dtype": str(a.dtype), "shape": list(a.shape),
                   "values": (a.view(np.uint16) if a.dtype == np.float16 else a).ravel().tolist()}
            for name, a in arrays.items()}}
    edges = np.array([0.0, -0.0, 1.0, 65504.0, -65504.0, 65519.99, 1e-8, 6e-8, 3e-8, 2.98e-8, 5.96e-8, 6.1e-5,
                      1.0009765625, 1.00048828125, 1.00146484375, 2049.0, 2051.0, 0.1, -0.3, 3.14159265, 1e-3],
                     np.float32)
    edges = np.concatenate([edges, rng.standard_normal(200).astype(np.float32) * 10.0 ** rng.integers(-7, 5, 200)])
    edges = edges[np.abs(edges) <= 65504].astype(np.float32)
    return {"reference": {n: x.ravel().tolist() for n, x in reference.items()},
            "trained": {n: x.ravel().tolist() for n, x in trained.items()},
            "shapes": {n: list(x.shape) for n, x in reference.items()}, "exact": exact, "encodings": encodings,
            "float16": {"float32": edges.tolist(), "bits": edges.astype(np.float16).view(np.uint16).tolist()}}


def write(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, body in (("rng", rng_vectors()), ("images", image_vectors()), ("codecs", codec_vectors())):
        (directory / f"{name}.json").write_text(json.dumps(body, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "web")
