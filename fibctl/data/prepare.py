"""`fibctl data prepare`: recipe -> byte-level BPE tokenizer -> uint16 token streams + manifest.

Everything is built in a hidden sibling folder and renamed into place only when complete, so an
interrupted or failed run (an unreachable hub, say) leaves nothing a later run could mistake for
finished data. Same recipe and inputs -> same bytes; an up-to-date folder is reused as is,
once its files check against its manifest (sizes and hashes): one changed since is rebuilt.
A rebuild holds a lock beside the folder, so a second prepare into it refuses rather than
deleting the first one's work. Putting a build in place takes two renames (the old folder
away, the new one in): a prepare killed between them (or just before them) leaves its build
complete beside a missing folder, and the next prepare puts that build in place, once its
manifest and hashes check, instead of building it again (hours, for the paper recipe).

The training stream mixes the sources by tokens: the next document always comes from the source
furthest below its share, and each source stops at exactly its share of `train_tokens` (its last
document cut, the piece ending with end-of-text as every document does). Held-out documents are
chosen by a hash of their text (or of the fields a source's `heldout_by` names: a problem's
solutions go together), so a document (and any copy of it, in any source) is either held out or
trained on, never both; held-out documents are kept whole.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import itertools
import os
import re
import secrets
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.progress import Progress
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from fibctl.data import installed_docs, local_files, sources
from fibctl.data.local_files import LongText
from fibctl.data.recipe import file_identity, Recipe, Source
from fibctl.data.streams import EOS, MANIFEST, TOKENIZER, DataManifest, load_manifest
from fibctl.errors import FibctlError, shown_path
from fibctl.durable import fsync
from fibctl.hashes import file_hash, short_hash
from fibctl.names import refuse_foreign

ENCODE_BATCH = 256  # documents encoded per call (the tokenizer encodes a batch in parallel)
ENCODE_CHARS = 1 << 22  # and at most about this many characters: 256 books took over 10 GB
# a longer document is encoded in pieces of about this many characters: the encoder holds some
# 850 bytes per token, and one 30 MB document took 4.7 GB encoded whole
ENCODE_PIECE_CHARS = 1 << 18
FLUSH_TOKENS = 1 << 20
# the tokenizer's pre-tokenizer (GPT-2's split, no prefix space); long documents are also cut
# where it ends a token (_pretoken_ends)
PRE_TOKENIZER = pre_tokenizers.ByteLevel(add_prefix_space=False)


@dataclass(frozen=True)
class PrepareResult:
    manifest: DataManifest
    reused: bool  # the folder was already up to date, or `finished`
    seconds: dict[str, float]  # per phase: tokenizer, streams (empty when reused)
    finished: bool = False  # the complete build of a prepare killed while putting it in place was put there


def data_folder(out: str | Path) -> Path:
    """The folder `--data` names: a link's target, followed to its end. The build goes beside
    the folder and is renamed onto it: onto the link itself it replaced the link with a folder
    (the target keeping the old data) or, a link to nothing, failed once the build was done;
    a loop of links is refused now, not after the build (a rename onto it fails)."""
    out = Path(out)
    if not out.is_symlink():
        return out
    try:
        return Path(os.path.realpath(out, strict=True))
    except FileNotFoundError:  # a link to nothing: the folder is made where it points
        return Path(os.path.realpath(out))
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise FibctlError(f"--data {shown_path(out)} is a symlink loop; name the data folder itself") from None


def prepare(recipe: Recipe, out: str | Path, progress: Progress | None = None,
            note: Callable[[str], None] = lambda line: None) -> PrepareResult:
    """Build (or reuse) the data folder `out` for `recipe`. Progress bars go to `progress`;
    `note` gets a line saying why a folder of this recipe is rebuilt rather than reused."""
    out = data_folder(out)
    if out.name in ("", ".."):  # '.', '/', '..': its lock and work folder go beside it, under its own name
        raise FibctlError(f"--data {shown_path(out)}: name the data folder itself (e.g. --data data), not "
                          f"{shown_path(out)}")
    progress = progress or Progress(disable=True)
    _check_documents_alike(recipe)
    inputs_hash = _inputs_hash(recipe)
    existing = _existing(out)
    if existing and existing.inputs_hash == inputs_hash:
        # a stream changed since (a byte edited, a file copied over it) would be trained and
        # scored on: reuse only what still checks, as a leftover build must (_finished_build)
        mismatch = _mismatch(existing)
        if mismatch is None:
            _tidy(out)
            return PrepareResult(existing, True, {})
        note(f"{shown_path(out)}: {mismatch}; rebuilding it")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FibctlError(f"--data {shown_path(out)}: cannot create its parent folder {shown_path(out.parent)}: "
                          f"{e.strerror or e}") from None
    with _building(out):
        if out.is_dir():  # the rebuild replaces the folder whole: it would take anything else with it
            refuse_foreign(out, _OWN, "`fibctl data prepare`", "it would replace the folder whole: "
                           "move them, or choose another --data")
        built = _finished_build(out, inputs_hash)
        _remove_leftovers(out, keep=built)
        if built is not None:
            _swap_into_place(built, out)
            return PrepareResult(load_manifest(out), True, {}, finished=True)
        work = out.parent / f".{out.name}.partial-{os.getpid()}"
        work.mkdir()
        try:
            seconds = _build(recipe, inputs_hash, work, progress)
            _swap_into_place(work, out)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return PrepareResult(load_manifest(out), False, seconds)


def _build(recipe: Recipe, inputs_hash: str, work: Path, progress: Progress) -> dict[str, float]:
    scratch = work / "scratch"
    scratch.mkdir()
    t0 = time.perf_counter()
    tokenizer = train_tokenizer(recipe, scratch, progress)
    tokenizer.save(str(work / TOKENIZER))
    fsync(work / TOKENIZER)
    t1 = time.perf_counter()
    tokens, per_source, hashes = _write_streams(recipe, tokenizer, work, scratch, progress)
    t2 = time.perf_counter()
    shutil.rmtree(scratch)
    DataManifest(
        data_dir=work, recipe=recipe.name, recipe_hash=recipe.recipe_hash, inputs_hash=inputs_hash,
        vocab_size=recipe.vocab_size, tokenizer_vocab=tokenizer.get_vocab_size(),
        tokenizer_hash=short_hash((work / TOKENIZER).read_bytes()),
        eos_id=tokenizer.token_to_id(EOS), heldout=recipe.heldout, tokens=tokens, sources=per_source,
        stream_hashes=hashes,
    ).write()  # last, and synced: a folder with a manifest is a complete build
    return {"tokenizer": t1 - t0, "streams": t2 - t1}


# ---- tokenizer -------------------------------------------------------------------------------

def train_tokenizer(recipe: Recipe, scratch: Path, progress: Progress) -> Tokenizer:
    """Byte-level BPE trained on `tokenizer_sample_chars` of training text, split by share."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = PRE_TOKENIZER
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=recipe.vocab_size, special_tokens=[EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    task = progress.add_task("tokenizer sample", total=recipe.tokenizer_sample_chars, unit="chars")
    tokenizer.train_from_iterator(_sample(recipe, scratch, progress, task), trainer)
    sampled = next(t for t in progress.tasks if t.id == task).completed
    progress.update(task, total=sampled)  # the sources may hold less than the sample size
    return tokenizer


# BPE training slows with the square of a word's length in bytes, which it merges: a run of this
# many bytes without whitespace (base64, minified code, a DNA sequence, Chinese or Thai text
# without punctuation) is cut there for the tokenizer's sample. Cut at as many characters, 30 MB
# of such Chinese (3 bytes each) trained in 296 s; by bytes, 143 s (28 MB of base64: 82 s)
SAMPLE_WORD_BYTES = 4096
_LONG_RUN = re.compile(rf"\S{{{SAMPLE_WORD_BYTES // 4},}}")  # a run that may reach it: 4 bytes a character at most


def _sample(recipe: Recipe, scratch: Path, progress: Progress, task) -> Iterator[str]:
    """Each source's training documents until it has given its share of
    `tokenizer_sample_chars`, the last one whole."""
    cut = _training_cut(recipe)
    for source in recipe.sources:
        quota, taken = source.share * recipe.tokenizer_sample_chars, 0
        for doc in sources.documents(recipe, source, scratch, progress):
            if taken >= quota:
                break
            if not _below(doc, cut):
                taken += len(doc)
                progress.advance(task, len(doc))
                # in pieces: BPE training counts the same words in them, without holding a huge
                # document's words at once (30 MB took 2.7 GB). Cut as they always were (not
                # exact: the pieces' long runs are cut below anyway), so tokenizers trained
                # before are what they were
                for piece in _cut(_chunks(doc), ENCODE_PIECE_CHARS, exact=False):
                    yield from _pieces(piece)


def _pieces(doc: str) -> Iterator[str]:
    """`doc` in pieces that end after each SAMPLE_WORD_BYTES (UTF-8) of a run of non-space
    characters, or the last character that fits in them."""
    start = 0
    for m in _LONG_RUN.finditer(doc):
        run, at = m.group().encode("utf-8", "surrogatepass"), m.start()
        while len(run) >= SAMPLE_WORD_BYTES:
            end = SAMPLE_WORD_BYTES
            while end < len(run) and run[end] & 0xC0 == 0x80:  # inside a character: cut before it
                end -= 1
            at += len(run[:end].decode("utf-8", "surrogatepass"))
            yield doc[start:at]
            start, run = at, run[end:]
    yield doc[start:]


def _hashed_below(text: str, fraction: float) -> bool:
    """Whether a text's hash (a document's key) falls below `fraction` of the range: every
    copy of a text falls alike."""
    return local_files.text_hash(text) < fraction * 2**64


def _below(doc: sources.Document | LongText, fraction: float) -> bool:
    """_hashed_below for a document's key (a long one's hashed as it was read)."""
    return doc.key_hash < fraction * 2**64


def _training_cut(recipe: Recipe) -> float:
    """Documents whose key hashes below it are trained on by no source: the largest held-out
    fraction. A text (or a problem, keyed by heldout_by) one source holds out is then never
    trained on through another, whatever it reads (the same files, or a copy of the page in
    another corpus); each source's own held-out set is the part below its own fraction."""
    return max((s.heldout_fraction for s in recipe.sources if s.heldout), default=0.0)


def _check_documents_alike(recipe: Recipe) -> None:
    """Refuse two sources that read the same inputs, one of them holding documents out, yet cut
    them into different documents (other fields, paragraphs of a whole file) or key them
    otherwise (heldout_by): held-out text is kept out of training by the hash of a document's
    key, and a document built or keyed otherwise hashes other text, so the held-out text would
    be trained on through the other source."""
    inputs = {s.name: _inputs(recipe, s) for s in recipe.sources}
    for a, b in itertools.combinations(recipe.sources, 2):
        if not ((a.heldout or b.heldout) and inputs[a.name] & inputs[b.name]):
            continue
        rule_a, rule_b = _document_rule(a), _document_rule(b)
        differ = [f"{k} {rule_a[k]!r} against {rule_b[k]!r}" for k in rule_a if rule_a[k] != rule_b.get(k)]
        if differ:
            raise FibctlError(
                f"sources {a.name!r} and {b.name!r} read the same inputs but build other documents from them "
                f"({'; '.join(differ)}): a document held out by one would be trained on through the other; "
                "build them alike, or give them different inputs")


def _document_rule(source: Source) -> dict:
    """What decides the documents a source makes of its inputs, and their keys (installed-docs
    and generated sources make theirs alone)."""
    rule = {}
    if source.kind in ("hub", "local"):
        rule["text"] = list(source.text)
        # all its text fields, in order: the whole text, as without the key
        keyed = source.heldout_by and list(source.heldout_by) != list(source.text)
        rule["heldout_by"] = list(source.heldout_by) if keyed else None
    if source.kind == "local":
        rule["format"] = source.format
        if source.format == "text":
            rule["sample_by"] = source.sample_by
        if source.format == "csv":
            rule["delimiter"] = source.delimiter
        if source.format == "json":
            rule["records"] = source.records
    return rule


def _inputs(recipe: Recipe, source: Source) -> set:
    """What a source reads documents from, so that two sources reading the same can be told."""
    if source.kind == "local":
        return {("local", file_identity(p)) for p in recipe.local_files(source)}
    if source.kind == "hub":  # any split or revision: a dataset's splits may share documents
        return {("hub", source.dataset, config) for config in source.configs or (None,)}
    if source.kind == "installed-docs":
        return {("installed-docs", package) for package in source.packages or installed_docs.PACKAGES}
    return {(source.kind, source.seed)}


# ---- token streams ---------------------------------------------------------------------------

class _Writer:
    """Appends token ids to a uint16 file, buffered, hashing what it writes."""

    def __init__(self, path: Path):
        self.file, self.buffer, self.buffered, self.tokens, self.documents = open(path, "wb"), [], 0, 0, 0
        self.hash = hashlib.sha256()

    def write(self, ids: np.ndarray) -> None:
        self.buffer.append(ids)
        self.buffered += len(ids)
        self.tokens += len(ids)
        if self.buffered >= FLUSH_TOKENS:
            self.flush()

    def flush(self) -> None:
        for ids in self.buffer:
            ids.tofile(self.file)
            self.hash.update(ids.tobytes())
        self.buffer, self.buffered = [], 0

    def close(self) -> None:
        self.flush()
        self.file.flush()
        os.fsync(self.file.fileno())  # on disk before the manifest that vouches for it
        self.file.close()

    @property
    def digest(self) -> str:
        return self.hash.hexdigest()[:16]  # short_hash of the file's bytes


Doc = sources.Document | LongText


class _Feed:
    """One source while streams are written: its documents, routed and encoded a batch at a
    time; a long one alone (_long), and only as far as it is written."""

    def __init__(self, source: Source, docs: Iterator[Doc], tokenizer: Tokenizer, target: int, eos: int,
                 cut: float):
        self.source, self.docs, self.tokenizer, self.target, self.eos = source, docs, tokenizer, target, eos
        self.cut = cut  # documents whose key hashes below it are not trained on (_training_cut)
        self.queue: deque[tuple[str, Iterator[np.ndarray]]] = deque()
        self.ahead: Doc | None = None  # a long document read while batching the ones before it
        self.train = self.train_documents = self.read = 0
        self.held_out = 0  # documents read that hashed below the training cut: trained on by no source
        self.exhausted = False  # ran out of documents before its share was full

    def next(self) -> tuple[str, Iterator[np.ndarray]] | None:
        """(where it goes: 'heldout', 'train' or 'neither'; its text's token ids, in parts,
        without the end-of-text) of the next document; None when run out. A document going
        nowhere is not encoded, nor a long one's parts that are not taken."""
        if not self.queue:
            batch = self._batch()
            routes = [self._route(doc) for doc in batch]
            if len(batch) == 1 and _long(batch[0]):
                self.queue.append((routes[0], _encode_long(self.tokenizer, _cut(_chunks(batch[0]), ENCODE_PIECE_CHARS))))
            else:
                ids = iter(encode(self.tokenizer, [d for d, r in zip(batch, routes) if r != "neither"], self.eos))
                self.queue.extend((r, iter(()) if r == "neither" else iter([next(ids)[:-1]])) for r in routes)
        if not self.queue:
            self.exhausted = True
            return None
        self.read += 1
        return self.queue.popleft()

    def _batch(self) -> list[Doc]:
        """The next documents to encode together: ENCODE_BATCH of them, or fewer that reach
        ENCODE_CHARS (the encoder's memory grows with the characters it holds); a long one
        alone."""
        batch, chars = [], 0
        while len(batch) < ENCODE_BATCH and chars < ENCODE_CHARS:
            doc, self.ahead = self.ahead if self.ahead is not None else next(self.docs, None), None
            if doc is None:
                break
            if _long(doc):
                if batch:
                    self.ahead = doc
                    break
                return [doc]
            batch.append(doc)
            chars += len(doc)
        return batch

    def unread(self) -> bool:
        """Whether documents are left that were not read."""
        return bool(self.queue) or self.ahead is not None or next(self.docs, None) is not None

    def _route(self, doc: Doc) -> str:
        if self.source.heldout and _below(doc, self.source.heldout_fraction):
            return "heldout"
        return "neither" if _below(doc, self.cut) else "train"  # another source holds it out


def _long(doc: Doc) -> bool:
    """A document encoded alone, only as far as it is written: a text file's that is read in
    pieces, or one longer than the encoder takes at once (a share full a part of the way
    into it leaves the rest unencoded)."""
    return isinstance(doc, LongText) or len(doc) > ENCODE_CHARS


def _encode_long(tokenizer: Tokenizer, pieces: Iterator[str]) -> Iterator[np.ndarray]:
    """A long document's ids, its pieces encoded a group at a time as they are taken: groups
    of ENCODE_PIECE_CHARS characters at first, doubling up to ENCODE_CHARS, so that a document
    of which little is taken is encoded little beyond it, and one taken whole in parallel."""
    group, chars, limit = [], 0, ENCODE_PIECE_CHARS
    for piece in itertools.chain(pieces, [None]):
        if piece is not None:
            group.append(piece)
            chars += len(piece)
        if group and (piece is None or chars >= limit):
            yield from (np.asarray(e.ids, dtype=np.uint16) for e in tokenizer.encode_batch(group))
            group, chars, limit = [], 0, min(2 * limit, ENCODE_CHARS)


def _write_streams(recipe: Recipe, tokenizer: Tokenizer, work: Path, scratch: Path,
                   progress: Progress) -> tuple[dict[str, int], dict[str, dict], dict[str, str]]:
    eos = tokenizer.token_to_id(EOS)
    # a document's own "<|endoftext|>" (web text, model outputs) is its text, encoded byte by byte:
    # only a document's end is the end-of-text id (set after the tokenizer is saved: its file is as it was)
    tokenizer.encode_special_tokens = True
    cut = _training_cut(recipe)
    feeds = [_Feed(s, sources.documents(recipe, s, scratch, progress), tokenizer, target, eos, cut)
             for s, target in zip(recipe.sources, recipe.train_targets())]
    train = _Writer(work / "train.bin")
    heldout = {name: _Writer(work / f"{name}.bin") for name in recipe.heldout}
    end = np.array([eos], dtype=np.uint16)
    train_task = progress.add_task("train tokens", total=recipe.train_tokens, unit="tokens")
    heldout_tasks = {n: progress.add_task(f"{n} tokens", total=recipe.heldout_tokens, unit="tokens")
                     for n in heldout}
    active = list(feeds)
    while active:
        feed = min(active, key=lambda f: f.train / f.target)  # the source furthest below its share
        item = feed.next()
        if item is None:
            active.remove(feed)
            continue
        route, parts = item
        if route != "train":
            feed.held_out += 1
        if route == "heldout":
            writer = heldout[feed.source.heldout]
            if writer.tokens < recipe.heldout_tokens:  # full: the document is dropped, not trained on
                for ids in (*parts, end):
                    writer.write(ids)
                    progress.advance(heldout_tasks[feed.source.heldout], len(ids))
                writer.documents += 1
            continue
        if route == "neither":
            continue
        # as many of its ids as fit with the end-of-text, which ends every document: those past
        # `room` are not encoded (a long document's parts)
        room, text, written = feed.target - feed.train, 0, 0
        for ids in parts:
            text += len(ids)
            ids = ids[:room - 1 - written]
            train.write(ids)
            written += len(ids)
            progress.advance(train_task, len(ids))
            if text >= room:
                break
        if text + 1 >= room:  # the source's share is full with this document
            active.remove(feed)
        if text >= room and room == 1:  # cut to no token of its text: the source stops one token short
            continue
        train.write(end)
        progress.advance(train_task, 1)
        feed.train += written + 1
        feed.train_documents += 1
    for writer in (train, *heldout.values()):
        writer.close()
    for name, task in heldout_tasks.items():
        progress.update(task, total=heldout[name].tokens, completed=heldout[name].tokens)
    _check_nonempty(recipe, train, heldout, feeds)
    per_source = {
        f.source.name: {
            "kind": f.source.kind, "target_tokens": f.target, "train_tokens": f.train,
            "train_documents": f.train_documents, "exhausted": f.exhausted,
            "heldout": f.source.heldout,
            "heldout_tokens": heldout[f.source.heldout].tokens if f.source.heldout else 0,
            "heldout_documents": heldout[f.source.heldout].documents if f.source.heldout else 0,
        }
        for f in feeds
    }
    tokens = {"train": train.tokens, **{n: w.tokens for n, w in heldout.items()}}
    hashes = {"train": train.digest, **{n: w.digest for n, w in heldout.items()}}
    return tokens, per_source, hashes


def encode(tokenizer: Tokenizer, docs: list[str], eos: int) -> list[np.ndarray]:
    """Each document's token ids (uint16) followed by the end-of-text id. Long documents go to
    the encoder in pieces (_encode_pieces), at most about ENCODE_CHARS characters per call, so
    its memory stays bounded and one huge document is encoded in parallel; the ids are those
    of the whole document."""
    ids: list[list[np.ndarray]] = [[] for _ in docs]
    group: list[tuple[int, str]] = []
    chars = 0

    def flush() -> None:
        for (i, _), e in zip(group, tokenizer.encode_batch([piece for _, piece in group])):
            ids[i].append(np.asarray(e.ids, dtype=np.uint16))
        group.clear()

    for i, doc in enumerate(docs):
        for piece in _encode_pieces(doc, ENCODE_PIECE_CHARS):
            group.append((i, piece))
            chars += len(piece)
            if chars >= ENCODE_CHARS:
                flush()
                chars = 0
    flush()
    end = np.array([eos], dtype=np.uint16)
    return [np.concatenate([*parts, end]) for parts in ids]


# Places where the byte-level pre-tokenizer always ends a pre-token, whatever text lies on either
# side. Its pattern (GPT-2's) is 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|
# \s+(?!\S)|\s+, matched from where the last match ended, looking back at nothing: so a piece
# that starts where a pre-token starts, and ends where one ends, gives the ids of that stretch
# of the whole document. The places:
# - before an ASCII space, tab or line break that a non-space character follows: a run of
#   whitespace ends one character before a non-space (\s+(?!\S)), that last character going
#   with it (' x') or alone ('\n'), and no pre-token runs from a non-space into whitespace
#   (Python's \S is narrower than the tokenizer's: every character it calls whitespace is);
# - between ASCII letters, digits and punctuation where the class changes: \p{L}+, \p{N}+ and
#   [^\s\p{L}\p{N}]+ each stop there, except after an apostrophe, which may open a
#   contraction ('s). ASCII only: the class of other characters may differ between Python's
#   Unicode tables and the tokenizer's.
_ASCII_PUNCT = r"!-/:-@\[-`{-~"
_PIECE_END = re.compile(rf"(?=[ \t\n\r\f\v]\S)|(?<=[A-Za-z])(?=[0-9{_ASCII_PUNCT}])|(?<=[0-9])(?=[A-Za-z{_ASCII_PUNCT}])"
                        r"|(?<=[!-&(-/:-@\[-`{-~])(?=[A-Za-z0-9])")
_SPACE_END = re.compile(r"(?=[ \t\n\r\f\v]\S)")  # the first kind alone: the tokenizer's sample is cut there


def _chunks(doc: str | LongText, size: int | None = None) -> Iterator[str]:
    """A document's text, `size` (ENCODE_PIECE_CHARS) characters at a time (a long one's as
    it reads them)."""
    if isinstance(doc, LongText):
        return doc.chunks()
    size = size or ENCODE_PIECE_CHARS
    return (doc[i:i + size] for i in range(0, len(doc), size))


def _cut(chunks: Iterable[str], size: int, exact: bool = True) -> Iterator[str]:
    """The text of `chunks`, joined, in pieces of at most `size` characters, each cut at the
    last place in them where a pre-token always ends (_PIECE_END), so that their ids, encoded
    one by one, are the whole text's. Where `size` characters hold no such place (Chinese or
    Japanese without ASCII spaces), an exact piece is cut at the last end of a pre-token the
    pre-tokenizer itself finds in them (_pretoken_ends); where they hold none either (a run of
    Chinese without punctuation, longer than `size`: one pre-token), the piece runs on to the
    end of that pre-token: the ids stay the whole text's, only the encoder's memory grows, with
    that one pre-token. Not `exact` (the tokenizer's sample), pieces are cut at _SPACE_END's
    places, and where `size` characters hold none, at `size`: as they always were."""
    places = _PIECE_END if exact else _SPACE_END
    buffer, tried = "", 0  # the text not cut yet; its length when its first pre-token's end was looked for
    for chunk in itertools.chain(chunks, [None]):
        buffer += chunk or ""
        # a place at `size` is known once the characters after it are read (_pretoken_ends: 3)
        while len(buffer) > size and (chunk is None or len(buffer) >= size + 3):
            cut = max((m.start() for m in places.finditer(buffer, 1, size + 2) if m.start() <= size), default=None)
            if cut is None and not exact:
                cut = size
            if cut is None:
                rest = chunk is None and len(buffer) <= size + 3  # the window is the rest of the text
                cut = max((p for p in _pretoken_ends(buffer[:size + 3], rest) if p <= size), default=None)
            if cut is None:  # a pre-token longer than `size` lies across it: the piece ends after it
                if chunk is not None and len(buffer) < 2 * tried:  # looked at half as much: read on first
                    break
                tried = len(buffer)
                cut = next(_pretoken_ends(buffer, chunk is None), None)
                if cut is None and chunk is not None:  # read on: it ends further
                    break
                cut = cut or len(buffer)
            yield buffer[:cut]
            buffer, tried = buffer[cut:], 0
    if buffer:
        yield buffer


def _pretoken_ends(text: str, complete: bool) -> Iterator[int]:
    r"""The places in `text`, which starts where a pre-token starts, where a piece of the
    document may end (all of them where `text` is `complete`, the rest of the document), in
    order: where the pre-tokenizer ends a token whatever text follows `text`, but for the end of
    a run of whitespace (a piece ending '\t\t' before 'x' keeps the run whole, where the
    document splits it: '\t', '\t', 'x'). Which of the pattern's branches matches a token,
    and how far, depends on the text at most up to the character after the token ('ab|c') and
    the third from its start ("'re"): a place three characters or more before the end of
    `text` is one in the whole document. The tokenizer's own split, not Python's Unicode
    tables: those may class a character otherwise."""
    last = len(text) if complete else len(text) - 3
    for _, (start, _) in PRE_TOKENIZER.pre_tokenize_str(text)[1:]:
        if start > last:
            return
        if not _space(text[start - 1]) or _space(text[start]):
            yield start


@functools.lru_cache(maxsize=4096)
def _space(c: str) -> bool:
    r"""Whether the pre-tokenizer takes `c` for whitespace (\s): after a tab, it joins its run."""
    return len(PRE_TOKENIZER.pre_tokenize_str("\t" + c)) == 1


def _encode_pieces(doc: str, size: int) -> Iterator[str]:
    """`doc` in exact pieces of about `size` characters (_cut)."""
    return _cut(_chunks(doc, size), size)


def _check_nonempty(recipe: Recipe, train: _Writer, heldout: dict[str, _Writer], feeds: list[_Feed]) -> None:
    if train.tokens == 0:
        read = sum(f.read for f in feeds)
        if read and sum(f.held_out for f in feeds) == read:  # a corpus of a few documents: say why
            raise FibctlError(f"recipe {recipe.name!r}: no training documents: the held-out hash held out all "
                              f"{read:,} document(s) the sources gave (each hashed below heldout_fraction "
                              f"{_training_cut(recipe)}); give the sources more documents, or lower heldout_fraction")
        if not read:  # empty files, or rows whose text fields are all null or empty: say which
            raise FibctlError(f"recipe {recipe.name!r}: the sources gave no documents "
                              f"({'; '.join(_why_no_documents(f.source) for f in feeds)})")
        raise FibctlError(f"recipe {recipe.name!r}: the sources gave no training documents")
    for feed in feeds:
        s = feed.source
        if s.heldout and heldout[s.heldout].tokens == 0:
            raise FibctlError(f"held-out set {s.heldout!r} got no documents from source {s.name!r}: "
                              f"{_why_none_held_out(feed)}")


def _why_no_documents(source: Source) -> str:
    """What a source that gave no document read: empty files, or rows without text."""
    if source.format == "text":
        return f"{source.name}: its files are empty or whitespace"
    if source.kind in ("hub", "local"):
        return f"{source.name}: no row has text in {', '.join(source.text)}: each is null or empty"
    return f"{source.name}: none"


def _why_none_held_out(feed: _Feed) -> str:
    """Why a source's held-out set is empty, and what to change: a source is read until its
    training share is full (only the documents read by then can be held out), or until it runs
    out (its share full with its last document: looked for one more); one document can never be
    both trained on and held out."""
    s, fraction = feed.source, feed.source.heldout_fraction
    if feed.unread():  # documents not read: more training tokens read them
        return (f"none of the {feed.read:,} document(s) read before its training share was full hashed below its "
                f"heldout_fraction {fraction}; raise heldout_fraction, or train_tokens (more of its documents are "
                "read)")
    if feed.read == 1:
        how = (' (sample_by = "paragraph" or "line", or one file per document)'
               if s.format == "text" and s.sample_by == "document" else "")
        return f"its one document cannot be both trained on and held out; split its text into documents{how}"
    return (f"none of its {feed.read:,} documents hashed below its heldout_fraction {fraction} (about "
            f"{feed.read * fraction:.1f} would); give the source more documents, or raise heldout_fraction")


# ---- the output folder -----------------------------------------------------------------------

def _inputs_hash(recipe: Recipe) -> str:
    inputs = {"recipe": recipe.recipe_hash,
              "sources": {s.name: sources.fingerprint(recipe, s) for s in recipe.sources}}
    # a source whose training is cut by another's held-out fraction: a folder built before
    # sources cut each other's documents is rebuilt (a single source's hash is what it was)
    cut = _training_cut(recipe)
    shared = {s.name: cut for s in recipe.sources if cut != (s.heldout_fraction if s.heldout else 0.0)}
    if shared:
        inputs["training_cuts"] = shared
    return short_hash(inputs)


# what a data folder holds: its manifest, its tokenizer and one token stream per split
_OWN = re.compile(rf"{re.escape(MANIFEST)}|{re.escape(TOKENIZER)}|[A-Za-z0-9][A-Za-z0-9_.-]*\.bin")


def _existing(out: Path) -> DataManifest | None:
    """The folder's manifest; None if it is absent or empty; refuse a folder of something else."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return None
    if not (out / MANIFEST).is_file():
        raise FibctlError(f"{shown_path(out)} exists and is not a fibctl data folder (no {MANIFEST}); "
                          "choose another --data or remove it")
    try:
        return load_manifest(out)
    except FibctlError:
        return None  # an older or damaged manifest: rebuild


def _mismatch(manifest: DataManifest) -> str | None:
    """How the folder's files differ from what its manifest records (the tokenizer and each
    stream there, with its size and hash), in words; None when they match. Hashing reads each
    file once: under a second for the paper's streams, against hours to build them again
    (docs/benchmarks.md)."""
    if not manifest.tokenizer_path.is_file():
        return f"{TOKENIZER} is missing"
    for split in manifest.splits:
        path = manifest.split_path(split)
        if not path.is_file():
            return f"{path.name} is missing"
        size, recorded = path.stat().st_size, 2 * manifest.tokens[split]
        if size != recorded:
            return f"{path.name} holds {size:,} bytes where its manifest records {recorded:,}"
    if set(manifest.stream_hashes) != set(manifest.splits):  # a manifest from before they were recorded
        return "its manifest records no stream hashes to check its files against (an older fibctl wrote it)"
    if manifest.tokenizer_changed:
        return f"{TOKENIZER} no longer matches the hash its manifest records"
    for split in manifest.splits:
        if file_hash(manifest.split_path(split)) != manifest.stream_hashes[split]:
            return f"{manifest.split_path(split).name} no longer matches the hash its manifest records"
    return None


def lock_path(out: Path) -> Path:
    """The file a prepare holds locked (flock) while it rebuilds `out`. It lies beside `out`,
    never in it, and the kernel drops the lock when its holder dies: a killed prepare leaves
    the file, unlocked, for the next prepare to take over."""
    return out.parent / f".{out.name}.lock"


@contextlib.contextmanager
def _building(out: Path) -> Iterator[None]:
    """Hold `out`'s lock while rebuilding it; refuse at once if another prepare holds it."""
    path = lock_path(out)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:  # /proc, a read-only disk, another's folder: the lock is ours, the folder theirs
            raise FibctlError(f"--data {shown_path(out)}: cannot create files in {shown_path(out.parent)}, where it "
                              f"is built: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise FibctlError(f"{shown_path(out)}: another `fibctl data prepare` is building it now; "
                              "wait for it to finish, or choose another --data") from None
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                break
        os.close(fd)  # a finishing prepare removed the file we locked: lock the one at `path` now
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):  # removed by hand: the build still stands
            os.unlink(path)  # while still locked, so no one else can have locked the file at `path`
        os.close(fd)


def _leftovers(out: Path) -> list[Path]:
    """Folders an interrupted run (killed before it could clean up) left beside `out`: its
    build, whole or not, and the folder it had moved away to put its build in place."""
    return sorted(path for pattern in (f".{out.name}.partial-*", f".{out.name}.old-*")
                  for path in out.parent.glob(pattern))


def _remove_leftovers(out: Path, keep: Path | None = None) -> None:
    """Called holding `out`'s lock, so none is a running prepare's."""
    for path in _leftovers(out):
        if path != keep:
            shutil.rmtree(path, ignore_errors=True)


def _tidy(out: Path) -> None:
    """Remove what a killed prepare left beside an up-to-date `out` (killed after putting its
    build in place, before removing the old folder: a whole data folder's worth of disk),
    unless a prepare is building `out` now, whose work they may be."""
    if _leftovers(out):
        with contextlib.suppress(FibctlError), _building(out):
            _remove_leftovers(out)


def _finished_build(out: Path, inputs_hash: str) -> Path | None:
    """A complete build for `inputs_hash` that a killed prepare left beside `out`: its own (killed
    between its two renames, or just before them) or the folder it had moved away (the same
    recipe asked for again). Complete means its manifest loads, it holds exactly the files
    the manifest names, and each has the size and hash recorded (_mismatch): a half build has
    no manifest (that is written last), and a file that never reached the disk fails its hash."""
    for path in _leftovers(out):
        try:
            manifest = load_manifest(path)
        except FibctlError:  # no manifest yet: a half build
            continue
        files = {MANIFEST, TOKENIZER, *(manifest.split_path(s).name for s in manifest.splits)}
        if manifest.inputs_hash == inputs_hash and {p.name for p in path.iterdir()} == files \
                and _mismatch(manifest) is None:
            return path
    return None


def _swap_into_place(work: Path, out: Path) -> None:
    """Two renames: a kill between them leaves `out` missing and `work` complete beside it,
    which the next prepare puts in place (_finished_build)."""
    old = out.parent / f".{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}"  # never a leftover's name
    if out.exists():
        out.rename(old)
    work.rename(out)
    fsync(out.parent)  # the renames themselves on disk
    shutil.rmtree(old, ignore_errors=True)
