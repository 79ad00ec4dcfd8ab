"""What the coordinator announces: the round's model as retained chunks, RoundInfo, invitations.

The model is encoded and hashed once per blob id (a round's, or "final"), not per announcement, and the
previous blob's retained chunks are cleared when the blob changes (docs/protocol.md, sections 5 and 6).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from fedper.manifest import Manifest
from fedper.payload import encode_shared
from fedper.wire import Invitation, Outgoing, RoundInfo, Topics, chunk, decode_chunk


class Announcements:
    """The retained messages a device joins from; remembers which model chunks it published."""

    def __init__(self, manifest: Manifest, topics: Topics, chunk_size: int) -> None:
        self.manifest, self.topics, self.chunk_size = manifest, topics, chunk_size
        self._blob: tuple[str, bytes, list[bytes], str] | None = None  # id, blob, frames, sha256
        self._published: tuple[str, int] | None = None  # retained chunks to clear when the model changes

    def model(self, blob_id: str, number: int, model: Mapping[str, np.ndarray]) -> list[Outgoing]:
        """The model's chunks under `blob_id` (after clearing the previous blob's)."""
        if self._blob is None or self._blob[0] != blob_id:
            blob = encode_shared(self.manifest, model)
            frames = chunk(blob, self.chunk_size, blob_id, {"round": number})
            # the digest its frames carry: the model is hashed once per round (by chunk), not per announcement
            self._blob = (blob_id, blob, frames, decode_chunk(frames[0]).sha256)
        out = []
        if self._published and self._published[0] != blob_id:  # clear the old round's retained chunks
            old_id, old_count = self._published
            out += [Outgoing(self.topics.model(old_id, i), b"", retain=True) for i in range(old_count)]
        frames = self._blob[2]
        self._published = (blob_id, len(frames))
        out += [Outgoing(self.topics.model(blob_id, i), f, retain=True, broadcast=True) for i, f in enumerate(frames)]
        return out

    def forget_model(self) -> None:
        """A round closed: its model changed, the next announcement encodes it again."""
        self._blob = None

    def round_info(self, number: int, rounds: int, finished: bool, deadline: float, selected: bool,
                   fields: Mapping[str, Any]) -> Outgoing:
        """RoundInfo for the model last announced (`fields`: the strategy's own)."""
        blob_id, blob, frames, digest = self._blob or (None, b"", [], hashlib.sha256(b"").hexdigest())
        info = RoundInfo(
            round=number, rounds=rounds, state="finished" if finished else "open", deadline=deadline,
            blob_id=str(blob_id), size=len(blob), sha256=digest, count=len(frames),
            base_digest=self.manifest.base_digest,
            **({"selection": "invited", "next_selection_at": deadline} if selected else {}), **fields,
        )
        return Outgoing(self.topics.round, info.encode(), retain=True)

    def invitation(self, device: str, round_: int) -> Outgoing:
        return Outgoing(self.topics.invite(device), Invitation(round_).encode(), retain=True)

    def cleared(self, devices: list[str]) -> list[Outgoing]:
        """The retained invitations of devices a closed round invited and the next does not."""
        return [Outgoing(self.topics.invite(device), b"", retain=True) for device in devices]
