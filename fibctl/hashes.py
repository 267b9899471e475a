"""One short-hash helper: the 16 hex digits of SHA-256 that identify configs, recipes,
inputs and tokenizers in the database and in data manifests."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def short_hash(data: bytes | str | dict | list) -> str:
    """SHA-256, first 16 hex digits; dicts and lists hash their sorted-key JSON."""
    if isinstance(data, (dict, list)):
        data = json.dumps(data, sort_keys=True)
    if isinstance(data, str):
        data = data.encode()
    return hashlib.sha256(data).hexdigest()[:16]


def file_hash(path: Path) -> str:
    """short_hash of a file's bytes, read a piece at a time (a token stream can be gigabytes)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(1 << 24):
            digest.update(piece)
    return digest.hexdigest()[:16]
