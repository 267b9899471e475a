"""One short-hash helper: the 16 hex digits of SHA-256 that identify configs, recipes,
inputs and tokenizers in the database and in data manifests."""

from __future__ import annotations

import hashlib
import json


def short_hash(data: bytes | str | dict | list) -> str:
    """SHA-256, first 16 hex digits; dicts and lists hash their sorted-key JSON."""
    if isinstance(data, (dict, list)):
        data = json.dumps(data, sort_keys=True)
    if isinstance(data, str):
        data = data.encode()
    return hashlib.sha256(data).hexdigest()[:16]
