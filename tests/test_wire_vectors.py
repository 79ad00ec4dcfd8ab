"""The committed test vectors decode as documented, and make_vectors.py reproduces them byte for byte."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from vectors import make_vectors

from fedper import wire
from fedper.manifest import Manifest
from fedper.payload import decode_shared
from fedper.wire import Reassembler, WireError, decode_chunk

VECTORS = Path(__file__).parent / "vectors"
EXPECTED = sorted(VECTORS.glob("*.expected.json"))


def load(path: Path) -> tuple[bytes, dict]:
    return path.with_name(path.name.replace(".expected.json", ".bin")).read_bytes(), json.loads(path.read_text())


def test_vectors_are_present_and_reproducible(tmp_path: Path) -> None:
    assert len(EXPECTED) >= 10
    make_vectors.write(tmp_path)
    for path in [*EXPECTED, VECTORS / "manifest.json"]:
        generated = tmp_path / path.name
        assert generated.read_bytes() == path.read_bytes(), f"{path.name} is stale: rerun make_vectors.py"


@pytest.mark.parametrize("path", EXPECTED, ids=lambda p: p.name.removesuffix(".expected.json"))
def test_vector_decodes_as_expected(path: Path) -> None:
    payload, expected = load(path)
    manifest = Manifest.load(VECTORS)
    kind = expected["kind"]
    if "error" in expected:
        with pytest.raises(WireError) as e:
            decode_chunk(payload) if kind == "chunk" else getattr(wire, kind).decode(payload)
        assert e.value.code == expected["error"]
    elif kind == "chunk":
        c = decode_chunk(payload)
        assert {**c.header(), "v": 1} == expected["header"] and c.data.hex() == expected["data_hex"]
    elif kind == "blob":
        r = Reassembler(1 << 20)
        done = [r.add("d", (VECTORS / name).read_bytes()) for name in reversed(expected["chunks"])]
        assert done[-1].data == payload and len(payload) == expected["size"]
        for name, t in decode_shared(manifest, payload).items():
            want = expected["tensors"][name]
            assert (str(t.dtype), list(t.shape)) == (want["dtype"], want["shape"])
            np.testing.assert_array_equal(t.ravel(), np.array(want["values"], dtype=t.dtype))
    else:
        msg = getattr(wire, kind).decode(payload)
        assert json.loads(msg.encode()) == expected["message"]
        if hasattr(msg, "base_digest"):
            assert msg.base_digest == manifest.base_digest
