"""--data is read by what the path is (an .npz, an image folder, a CIFAR root), errors name the option; a data
set is named by what it is (an .npz of CIFAR-10 is CIFAR-10); the chance line; unreadable images skipped and
counted when asked, on the device agent too."""

from __future__ import annotations

import io
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedper.data import (
    DataError,
    UnreadableImage,
    chance_accuracy,
    dataset_name,
    load_image_folder,
    load_images,
    skipping_unreadable_images,
)
from fedper.data.sources import CIFAR10_CLASSES
from fedper.ports import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]
# ../shared beside the repository, or beside the folder of worktrees that holds it
CIFAR_JPEG = next((p for p in (REPO_ROOT.parent / "shared" / "data" / "cifar10-jpeg.npz",
                               REPO_ROOT.parent.parent / "shared" / "data" / "cifar10-jpeg.npz") if p.is_file()),
                  REPO_ROOT.parent / "shared" / "data" / "cifar10-jpeg.npz")


def _folder(root: Path, classes: list[str], n: int, size: int = 8) -> None:
    rng = np.random.default_rng(0)
    for name in classes:
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(root / name / f"{i}.png")


def test_the_path_decides_how_it_is_read(tmp_path: Path) -> None:
    x = np.random.default_rng(0).integers(0, 256, (20, 8, 8, 3), dtype=np.uint8)
    y = np.arange(20) % 10
    np.savez(tmp_path / "c.npz", x_train=x, y_train=y, classes=np.array(CIFAR10_CLASSES))
    from_npz = load_images(tmp_path / "c.npz", cifar="cifar10")
    _folder(tmp_path / "images" / "train", list(CIFAR10_CLASSES), 2)
    from_folder = load_images(tmp_path / "images", cifar="cifar10")
    assert len(from_npz.train) == len(from_folder.train) == 20
    assert from_npz.train.classes == from_folder.train.classes == list(CIFAR10_CLASSES)


@pytest.mark.parametrize(("make", "message"), [
    (lambda p: p / "missing", r"--data .*missing does not exist; give an \.npz, an image folder .* or a cifar10 root"),
    (lambda p: (p / "notes.txt").write_text("x") and p / "notes.txt", r"notes\.txt is a file but not an \.npz"),
    (lambda p: (p / "empty").mkdir() or p / "empty", r"--data .*empty holds no folders"),
    (lambda p: _folder(p / "three", ["a", "b", "c"], 1) or p / "three", r"holds 3 classes, not cifar10's 10"),
])
def test_a_wrong_data_path_names_the_option(tmp_path: Path, make, message: str) -> None:
    with pytest.raises(DataError, match=message) as error:
        load_images(make(tmp_path), cifar="cifar10")
    assert "download=" not in str(error.value) and "load_" not in str(error.value)


def test_an_image_folder_given_a_file_says_it_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "x.jpg").write_bytes(b"not a folder")
    with pytest.raises(DataError, match=r"x\.jpg is a file, not an image folder"):
        load_image_folder(tmp_path / "x.jpg")


def test_a_data_set_is_named_by_its_classes() -> None:
    assert dataset_name("npz", CIFAR10_CLASSES, "/data/x.npz") == "CIFAR-10"
    assert dataset_name("imagefolder", CIFAR10_CLASSES, "/data/imgs") == "CIFAR-10"
    assert dataset_name("cifar100", [str(i) for i in range(100)]) == "CIFAR-100"
    assert dataset_name("npz", ["a", "b"], "/data/mine.npz") == "mine.npz"
    assert dataset_name("digits", [str(i) for i in range(10)]) == "digits (scikit-learn)"


def test_chance_is_the_label_prior_by_hand() -> None:
    """Client 0 holds classes 0,0,0,1 and client 1 holds 1,2: a head per client answers its most frequent class
    (3/4 and 1/2); one model answers one class for all, class 1 being best on average ((1/4 + 1/2) / 2)."""
    tests = [np.array([0, 0, 0, 1]), np.array([1, 2])]
    assert chance_accuracy(tests, 3, personal=True) == pytest.approx((0.75 + 0.5) / 2)
    assert chance_accuracy(tests, 3, personal=False) == pytest.approx(max(0.75 / 2, (0.25 + 0.5) / 2, 0.5 / 2))
    with pytest.raises(DataError, match="no client has test samples"):
        chance_accuracy([np.array([], int)], 3, personal=True)


def _corrupt(root: Path) -> Path:
    _folder(root, ["a", "b"], 10)
    bad = root / "b" / "3.png"
    buf = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(buf, "PNG")
    bad.write_bytes(buf.getvalue()[:40])  # truncated
    return bad


def test_one_unreadable_image_is_skipped_and_counted_when_asked(tmp_path: Path) -> None:
    bad = _corrupt(tmp_path)
    with pytest.raises(UnreadableImage, match=r"b/3\.png"):
        load_image_folder(tmp_path)
    with skipping_unreadable_images() as skipped:
        splits = load_image_folder(tmp_path)
    assert skipped == [bad] and len(splits.train) == 19 and np.bincount(splits.train.y).tolist() == [10, 9]
    with pytest.raises(UnreadableImage):  # the setting ends with its block
        load_image_folder(tmp_path)
    for p in (tmp_path / "b").iterdir():
        p.write_bytes(b"garbage")
    with skipping_unreadable_images(), pytest.raises(DataError, match=r"none of its 10 images can be read"):
        load_image_folder(tmp_path)


def test_the_agent_offers_to_skip_an_unreadable_image(tmp_path: Path, tiny_artifacts: Path) -> None:
    """Without the option the agent stops in one line naming the file and the option; with it, it says how
    many it left out and goes on to connect (here to a port where nobody listens, so it is stopped)."""
    data = tmp_path / "images"
    _folder(data, ["0", "1"], 10, size=32)
    bad = data / "1" / "3.png"
    bad.write_bytes(b"not a png")
    common = [sys.executable, "-m", "fedper.cli", "agent", "--artifacts", str(tiny_artifacts), "--data", str(data),
              "--broker", f"mqtt://127.0.0.1:{free_port()}", "--fleet", "t", "--client-id", "d",
              "--state-dir", str(tmp_path / "state"), "--mqtt-version", "3.1.1"]
    stopped = subprocess.run(common, capture_output=True, text=True, timeout=120)
    assert stopped.returncode == 2, stopped.stderr
    assert "3.png" in stopped.stderr and "--skip-unreadable-images" in stopped.stderr
    assert "Traceback" not in stopped.stderr
    proc = subprocess.Popen([*common, "--skip-unreadable-images"], stderr=subprocess.PIPE, text=True)
    try:
        deadline, lines = time.monotonic() + 120, []
        while time.monotonic() < deadline and proc.stderr is not None:
            line = proc.stderr.readline()
            lines.append(line)
            if "unreadable" in line or not line:
                break
        assert any("left out 1 unreadable image(s)" in line and "1/3.png" in line for line in lines), lines
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(not CIFAR_JPEG.is_file(), reason=f"real CIFAR-10 images not present at {CIFAR_JPEG}")
def test_real_cifar10_as_an_npz_or_an_image_folder_is_named_cifar10(tmp_path: Path) -> None:
    from fedper.emulate.data import DataConfig, load_fleet_data

    arrays = {}
    with np.load(CIFAR_JPEG) as f:
        classes = [str(c) for c in f["classes"]]
        for split, per_class in (("train", 20), ("test", 5)):
            jpeg, offsets, labels = f[f"{split}_jpeg"], f[f"{split}_offsets"], f[f"{split}_labels"]
            keep = np.concatenate([np.flatnonzero(labels == c)[:per_class] for c in range(10)])
            arrays[f"x_{split}"] = np.stack([np.asarray(Image.open(io.BytesIO(
                jpeg[offsets[i] : offsets[i + 1]].tobytes())).convert("RGB")) for i in keep])
            arrays[f"y_{split}"] = labels[keep].astype(np.int64)
    np.savez(tmp_path / "c10.npz", classes=np.array(classes), **arrays)
    for split in ("train", "test"):
        for i, (x, y) in enumerate(zip(arrays[f"x_{split}"], arrays[f"y_{split}"], strict=True)):
            (tmp_path / "folder" / split / classes[y]).mkdir(parents=True, exist_ok=True)
            Image.fromarray(x).save(tmp_path / "folder" / split / classes[y] / f"{i}.png")
    for dataset, data in (("npz", "c10.npz"), ("cifar10", "c10.npz"), ("cifar10", "folder"), ("imagefolder", "folder")):
        fleet = load_fleet_data(DataConfig(dataset=dataset, data=str(tmp_path / data), clients=2, classes_per_client=2))
        assert fleet.name == "CIFAR-10" and fleet.classes == list(CIFAR10_CLASSES), (dataset, data)
        assert fleet.x.shape[1:] == (3, 32, 32) and len(fleet.y) == 250
