"""Images for the web agent's page as a phone's photo library hands them to the file picker (the browser test and
benchmarks/web.py; the page itself is served by fedper-coordinator --web-port)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from fedper.data import load_digits


def write_images(folder: Path, classes: tuple[int, ...], count: int, offset: int) -> None:
    """Digits as PNG files in class folders: the first `count` of `classes` from `offset`."""
    ds = load_digits(32).train
    idx = np.flatnonzero(np.isin(ds.y, classes))[offset : offset + count]
    for i in idx:
        (folder / str(ds.y[i])).mkdir(parents=True, exist_ok=True)
        Image.fromarray(ds.x[i]).save(folder / str(ds.y[i]) / f"digit-{i:04d}.png")
