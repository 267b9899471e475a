"""The reader API over a prepared data directory: its manifest and its token streams.

    DIR/manifest.json     what was built: vocab, tokens per split and source, hashes
    DIR/tokenizer.json    the byte-level BPE tokenizer (`tokenizers.Tokenizer.from_file`)
    DIR/train.bin         uint16 token ids, each document (a cut one too) ending with end-of-text
    DIR/<heldout>.bin     one stream per held-out set, e.g. docs_val.bin
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fibctl.errors import FibctlError, shell_word, shown_path
from fibctl.hashes import file_hash, short_hash
from fibctl.names import check_name

MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
FORMAT_VERSION = 1
DTYPE = "uint16"  # of every stream: the only one fibctl writes, and the one it reads them as
TRAIN_SPLIT = "train"
EOS = "<|endoftext|>"


@dataclass(frozen=True)
class DataManifest:
    data_dir: Path
    recipe: str  # the recipe's name
    recipe_hash: str
    inputs_hash: str  # recipe hash plus what the sources depend on (files, package versions)
    vocab_size: int  # the recipe's vocab: the model's embedding size
    tokenizer_vocab: int  # tokens the trained tokenizer has (<= vocab_size on a small corpus)
    tokenizer_hash: str
    eos_id: int
    heldout: list[str]  # held-out set names, recipe order
    tokens: dict[str, int]  # per split
    sources: dict[str, dict] = field(default_factory=dict)  # per source: train/heldout tokens, docs
    # per split: short_hash of its .bin file, by which a build a killed prepare left is checked
    # before it is put in place (absent from folders built before they were recorded)
    stream_hashes: dict[str, str] = field(default_factory=dict)
    train_split: str = TRAIN_SPLIT
    _streams: dict = field(default_factory=dict, compare=False, repr=False)  # split -> checked memmap

    @property
    def data_hash(self) -> str:
        """What a run trains and is evaluated on, by content: the tokenizer and every split's
        stream. A copy of the folder, or one prepared again from the same text (the corpus
        copied elsewhere, or touched), has the same hash, though its inputs hash (paths and
        times) differs; a folder prepared before its streams were hashed has its inputs hash."""
        if set(self.stream_hashes) != set(self.splits):
            return self.inputs_hash
        return short_hash({"tokenizer": self.tokenizer_hash, "streams": self.stream_hashes,
                           "vocab_size": self.vocab_size, "train_split": self.train_split})

    @property
    def no_heldout(self) -> str:
        """Why a folder without held-out sets cannot be trained or evaluated on, and what to do:
        preparing the same recipe again makes none."""
        return (f"{shown_path(self.data_dir)} has no held-out set (its manifest lists only "
                f"{self.train_split!r}): give a source of recipe {self.recipe!r} one (heldout = \"NAME\") "
                "and prepare it again")

    def holds(self, data_hash: str) -> bool:
        """Whether a run recorded as trained on `data_hash` (a checkpoint's, written before
        runs recorded the content hash: an inputs hash) was trained on this folder's data."""
        return data_hash in (self.data_hash, self.inputs_hash)

    @property
    def tokenizer_path(self) -> Path:
        return self.data_dir / TOKENIZER

    @property
    def splits(self) -> list[str]:
        return [self.train_split, *self.heldout]

    def split_path(self, split: str) -> Path:
        if split not in self.splits:
            raise FibctlError(f"no split {split!r} in {shown_path(self.data_dir)}; splits: {', '.join(self.splits)}")
        return self.data_dir / f"{split}.bin"

    def stream(self, split: str) -> np.memmap:
        """The split's token ids, uint16, 1-D, read-only and memory-mapped; checked (size, ids
        within the vocabulary, the hash its manifest records) the first time this manifest
        opens it."""
        if split not in self._streams:
            self._streams[split] = self._open(split)
        return self._streams[split]

    def _open(self, split: str) -> np.memmap:
        path = self.split_path(split)
        if not path.is_file() or path.stat().st_size != 2 * self.tokens[split]:
            raise FibctlError(f"{shown_path(path)} is missing or not the size its manifest says; "
                              "prepare the data again")
        if self.tokens[split] == 0:
            raise FibctlError(f"{shown_path(path)} holds no tokens; prepare the data again")
        stream = np.memmap(path, dtype=DTYPE, mode="r")
        # an id past the vocabulary would index outside the embedding table mid-run
        top = int(stream.max())
        if top >= self.vocab_size:
            raise FibctlError(f"{shown_path(path)} holds token id {top}, beyond the vocabulary of {self.vocab_size:,}; "
                              "prepare the data again")
        # one of the same size, edited or copied over (by a co-user of a shared data folder, say),
        # was trained and scored on as the data its runs record (`data_hash`: the manifest's)
        recorded = self.stream_hashes.get(split)
        if recorded is not None and file_hash(path) != recorded:
            raise FibctlError(f"{shown_path(path)} no longer matches the hash its manifest records (changed since it was "
                              "prepared); prepare the data again")
        return stream

    def check_tokenizer(self) -> None:
        """Refuse a folder without its tokenizer: training reads only the streams, but the ids
        mean nothing without it (decoding a sample, tokenizing new text)."""
        if not self.tokenizer_path.is_file():
            raise FibctlError(f"{shown_path(self.data_dir)}: its tokenizer {TOKENIZER} is missing; "
                              "prepare the data again")

    @property
    def tokenizer_changed(self) -> bool:
        """Whether the tokenizer file is no longer the one its manifest records (its hash)."""
        return short_hash(self.tokenizer_path.read_bytes()) != self.tokenizer_hash

    def load_tokenizer(self):
        """The folder's tokenizer (`tokenizers.Tokenizer`), refused where it is missing, changed
        since it was prepared (it would decode the streams' ids as other text) or unreadable.
        It encodes a text's own "<|endoftext|>" byte by byte, as prepare encoded documents."""
        from tokenizers import Tokenizer  # its import only where a command reads or writes text

        self.check_tokenizer()
        if self.tokenizer_changed:
            raise FibctlError(f"{shown_path(self.tokenizer_path)} no longer matches the hash its manifest records "
                              "(changed since it was prepared); prepare the data again")
        try:
            tokenizer = Tokenizer.from_file(str(self.tokenizer_path))
        except Exception as e:  # tokenizers raises its own Exception for a file it cannot parse
            raise FibctlError(f"{shown_path(self.tokenizer_path)} is not a tokenizer file ({str(e)[:120]}); "
                              "prepare the data again") from None
        tokenizer.encode_special_tokens = True
        return tokenizer

    def to_dict(self) -> dict:
        return {
            "format": FORMAT_VERSION, "recipe": self.recipe, "recipe_hash": self.recipe_hash,
            "inputs_hash": self.inputs_hash, "vocab_size": self.vocab_size,
            "tokenizer": TOKENIZER, "tokenizer_vocab": self.tokenizer_vocab,
            "tokenizer_hash": self.tokenizer_hash, "eos_id": self.eos_id, "dtype": DTYPE,
            "train_split": self.train_split, "heldout": self.heldout, "tokens": self.tokens,
            "sources": self.sources, "stream_hashes": self.stream_hashes,
        }

    def write(self) -> None:
        """Written and synced to disk: the build is renamed into place next, and after a power
        loss a manifest must not stand beside streams that never reached the disk."""
        with open(self.data_dir / MANIFEST, "w") as f:
            f.write(json.dumps(self.to_dict(), indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())


def load_manifest(data_dir: str | Path) -> DataManifest:
    data_dir = Path(data_dir)
    path = data_dir / MANIFEST
    if data_dir.exists() and not data_dir.is_dir():  # the hint below, `--data` it, would be refused in turn
        recipe = f"; a recipe is prepared with `fibctl data prepare {shell_word(data_dir)} --data FOLDER`" \
            if data_dir.suffix == ".toml" else ""
        kind = "a file" if data_dir.is_file() else "a device or a pipe"
        raise FibctlError(f"{shown_path(data_dir)} is {kind}, not a data folder (one `fibctl data prepare` wrote)"
                          f"{recipe}")
    if not path.is_file():
        raise FibctlError(f"no data manifest in {shown_path(data_dir)}; run `fibctl data prepare RECIPE --data "
                          f"{shell_word(data_dir)}`")
    try:
        d = json.loads(path.read_text())
        if not isinstance(d, dict):
            raise TypeError(f"it holds a {type(d).__name__}, not an object")
        if d.get("format") != FORMAT_VERSION:
            raise FibctlError(f"{shown_path(path)} has format {d.get('format')!r}; this fibctl reads {FORMAT_VERSION}; "
                              "prepare the data again")
        manifest = DataManifest(
            data_dir=data_dir, recipe=d["recipe"], recipe_hash=d["recipe_hash"],
            inputs_hash=d["inputs_hash"], vocab_size=d["vocab_size"], tokenizer_vocab=d["tokenizer_vocab"],
            tokenizer_hash=d["tokenizer_hash"], eos_id=d["eos_id"], heldout=list(d["heldout"]),
            tokens=dict(d["tokens"]), sources=dict(d["sources"]), train_split=d["train_split"],
            stream_hashes=dict(d.get("stream_hashes", {})),
        )
        if d.get("dtype") != DTYPE:  # the streams are read as uint16 whatever it says: refuse, not misread
            raise ValueError(f"dtype {d.get('dtype')!r} is not {DTYPE}, the only type of stream fibctl reads")
        _check(manifest)
        return manifest
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:
        raise FibctlError(f"{shown_path(path)} is not a valid data manifest ({type(e).__name__}: {e})") from None
    except RecursionError:  # the parser recurses once per level of nesting
        raise FibctlError(f"{shown_path(path)} is not a valid data manifest (it nests its values "
                          "too deeply to read)") from None


SOURCE_COUNTS = ("target_tokens", "train_tokens", "train_documents", "heldout_tokens", "heldout_documents")
SOURCE_KEYS = ("kind", *SOURCE_COUNTS[:3], "exhausted", "heldout", *SOURCE_COUNTS[3:])


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check(m: DataManifest) -> None:
    """Types the readers rely on (and `fibctl data show` prints); split names become file
    names, so they must be names, and a held-out set is never the training stream."""
    if not isinstance(m.vocab_size, int) or isinstance(m.vocab_size, bool) or not 0 < m.vocab_size <= 65536:
        raise ValueError(f"vocab_size {m.vocab_size!r} is not an integer from 1 to 65536")
    for key in ("tokenizer_vocab", "eos_id"):
        if not _count(getattr(m, key)):
            raise ValueError(f"{key} {getattr(m, key)!r} is not a count")
    # the streams' ids are the tokenizer's, and the model embeds vocab_size of them
    if m.tokenizer_vocab > m.vocab_size:
        raise ValueError(f"tokenizer_vocab {m.tokenizer_vocab:,} is beyond vocab_size {m.vocab_size:,}")
    if m.eos_id >= m.tokenizer_vocab:
        raise ValueError(f"eos_id {m.eos_id} is beyond the tokenizer's vocabulary of {m.tokenizer_vocab:,}")
    for key in ("recipe", "recipe_hash", "inputs_hash", "tokenizer_hash"):
        if not isinstance(getattr(m, key), str):
            raise TypeError(f"{key} {getattr(m, key)!r} is not text")
    if len(set(m.splits)) < len(m.splits):
        raise ValueError(f"splits {', '.join(m.splits)} repeat a name (a held-out set named like the training split?)")
    for split in m.splits:
        check_name("split", split)
        if not isinstance(m.tokens.get(split), int):
            raise KeyError(f"tokens[{split!r}]")
    for split, digest in m.stream_hashes.items():
        if split not in m.splits or not isinstance(digest, str):
            raise ValueError(f"stream_hashes[{split!r}] is not the hash of one of its splits")
    for name, source in m.sources.items():
        if not isinstance(source, dict) or any(k not in source for k in SOURCE_KEYS):
            raise KeyError(f"sources[{name!r}] needs {', '.join(SOURCE_KEYS)}")
        if not all(_count(source[k]) for k in SOURCE_COUNTS) or not isinstance(source["kind"], str) \
                or not isinstance(source["heldout"], (str, type(None))):
            raise TypeError(f"sources[{name!r}]: counts must be whole numbers, kind and heldout text")


def token_stream(data_dir: str | Path, split: str) -> np.memmap:
    """One split of a data folder, for a one-off read; code that reads several splits loads
    the manifest once and calls its `stream`."""
    return load_manifest(data_dir).stream(split)
