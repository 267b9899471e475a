"""Documents on their way into the token streams: where each one ends, and how a long one is
encoded (corpora nobody tuned for: odd unicode, a huge document)."""

from __future__ import annotations

import json
import random
import string
import unicodedata

import numpy as np
import pytest
from tokenizers import Tokenizer, pre_tokenizers

from fibctl.data import local_files, sources
from fibctl.data import prepare as prep
from fibctl.data.prepare import prepare
from fibctl.data.recipe import parse_recipe
from fibctl.data.streams import load_manifest
from fibctl.errors import FibctlError

# whitespace of every kind between words of every kind: the places a piece may end, and not
WORDS = ["word", "it's", "we'll", "漢字。漢字", "😀", "👨‍👩‍👧", "e\u0301", "123", "4.5", "<|endoftext|>",
         "\u001f", "--", "’s", "x", "עברית", "!!", '"quoted"', "(a)", "\u00a0", "\u3000", "\u0085", "\u2028",
         "\x00"]
SEPARATORS = [" ", " ", " ", "  ", "\t", "\n", "\n\n", "\r\n", "\u00a0", "\u3000", " \n", "\n ", "\x0b", "\x0c",
              "\r", "\u001f", ""]


def _odd_documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(WORDS) + rng.choice(SEPARATORS) for _ in range(rng.randint(1, 200)))
            for _ in range(n)]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    root = tmp_path_factory.mktemp("tok")
    (root / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in _odd_documents(300, 1)))
    recipe = parse_recipe({"vocab_size": 400, "train_tokens": 2000, "sources": [
        {"name": "a", "kind": "local", "format": "json", "files": [str(root / "a.jsonl")], "share": 1}]})
    tok = Tokenizer.from_file(str(prepare(recipe, root / "out").manifest.tokenizer_path))
    tok.encode_special_tokens = True  # as the streams are written
    return tok


def _adversarial(n: int = 40, seed: int = 2) -> list[str]:
    """Text a cut may break: whitespace runs of every kind, CRLF, Chinese without spaces, emoji,
    words and numbers longer than the pieces, base64, minified code, contractions after
    punctuation ('!!'s'), a character of each Unicode category from each block of the plane."""
    rng = random.Random(seed)
    samples, seen = [], set()
    for c in map(chr, range(0x30000)):
        if not 0xD800 <= ord(c) < 0xE000 and (unicodedata.category(c), ord(c) >> 8) not in seen:
            seen.add((unicodedata.category(c), ord(c) >> 8))
            samples.append(c)
    every = "".join(f"{c} {c}a{c}1{c}!{c}\n{c}'{c}  {c}\t{c}" for c in samples)
    han = "".join(chr(rng.randrange(0x4E00, 0x4E00 + 3000)) for _ in range(500))
    base64 = "".join(rng.choice(string.ascii_letters + string.digits + "+/") for _ in range(700))
    code = "function f(a,b){return a+b;};var x=f(1,2)+\"it's\"+'don''t'!!'s;" * 8
    fixed = [every, han, base64, code, "word" * 100 + " " + "7" * 90, "a\r\n\r\n b \r\n\t\n  c   \n\n\nd",
             "😀👨‍👩‍👧🇯🇵" * 30 + " 🏳️‍🌈" * 20, " " * 70 + "x" + "\n" * 70 + "y" + " \u3000\u00a0 " * 20 + "z ",
             "we'll they're I'm it's 'tis !!'s ''s '''ve x'" * 10]
    return fixed + _odd_documents(n, seed)


def _pretokens(text: str) -> list[str]:
    return [t for t, _ in pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(text)]


@pytest.mark.parametrize("size", [1, 2, 8, 24, 100])
def test_a_long_document_in_pieces_gives_the_whole_documents_ids(tokenizer, size):
    """A document is encoded in pieces (one 30 MB document took 4.7 GB whole), cut where the
    pre-tokenizer always ends a token. A stretch without such a place was cut at the piece
    size, which changed its ids; it now runs on to the next place. Every piece's pre-tokens
    are the whole text's, and so are its ids, however small the pieces."""
    for doc in _adversarial():
        pieces = list(prep._encode_pieces(doc, size))
        assert "".join(pieces) == doc and all(pieces)
        assert [t for p in pieces for t in _pretokens(p)] == _pretokens(doc)
        assert [i for p in pieces for i in tokenizer.encode(p).ids] == tokenizer.encode(doc).ids
        # a piece runs past `size` only where no place lies within it
        assert all(len(p) <= size or not any(m.start() <= size for m in prep._PIECE_END.finditer(p, 1, size + 2))
                   for p in pieces)


def _han(rng: random.Random, n: int) -> str:
    return "".join(chr(rng.randrange(0x4E00, 0x4E00 + 3000)) for _ in range(n))


def test_text_without_ascii_spaces_is_cut_where_the_pre_tokenizer_ends_a_token(tokenizer):
    """Chinese or Japanese without ASCII spaces or line breaks (punctuated with '。', spaced
    with U+3000) held no place to cut: a document of it was one piece however long, encoded
    whole (one of 30 MB took 4.7 GB). It is cut where the tokenizer's own pre-tokenizer ends a
    token, within the size, but not at the end of a run of whitespace ('\u3000\u3000|漢':
    the document splits the run there, a piece ending with it would not); the ids are the
    whole text's. Only one pre-token longer than the size is a piece longer than it."""
    rng = random.Random(4)
    marks = ["。", "、", "！", "\u3000", "\u3000\u3000", " \u3000", "\u00a0\u3000", "１２", "’s", "\u2028", "\u0301"]
    docs = ["".join(_han(rng, rng.randint(1, 3)) + rng.choice(marks) for _ in range(300)) for _ in range(4)]
    for doc in docs:
        for size in (1, 2, 4, 9, 30):
            pieces = list(prep._encode_pieces(doc, size))
            assert "".join(pieces) == doc and (size < 9 or max(map(len, pieces)) <= size)  # tokens of 4 at most
            assert [t for p in pieces for t in _pretokens(p)] == _pretokens(doc)
            assert [i for p in pieces for i in tokenizer.encode(p).ids] == tokenizer.encode(doc).ids
    word = _han(rng, 40)  # one pre-token: no place inside it
    doc = "。" + word + "\u3000\u3000" + word + "。"
    assert list(prep._encode_pieces(doc, 8)) == ["。", word, "\u3000", "\u3000" + word, "。"]


# more of what a cut may break: contractions with other apostrophes, digits of other scripts,
# marks, joiners, a byte-order mark, separators Python calls whitespace and the tokenizer not
TRICKY = WORDS + SEPARATORS + ["'s", "'re", "'ll", "'S", "'", "''", "ʼs", "＇s", "١٢", "０", "²", "Ⅻ", "\ufeff",
                               "\u200d", "\u0301", "\x1c", "ǅ", "\u2029", "\u205f", "\u180e", "a1", "_", "\U0010fffd"]


def _tricky(rng: random.Random, ascii_too: bool) -> str:
    """Tricky fragments and random characters; without ASCII but for a few (a space, 's), the
    pre-tokenizer's own places are where pieces end."""
    pool = TRICKY if ascii_too else [f for f in TRICKY if not f.isascii()] + ["'s", "'re", "1", "a", " "]
    parts = []
    for _ in range(rng.randint(1, 60)):
        c = chr(rng.choice([rng.randrange(0x80, 0xD800), rng.randrange(0xE000, 0x110000), rng.randrange(0x80)]))
        parts.append(rng.choice(pool) if rng.random() < 0.8 else c if ascii_too or not c.isascii() else "")
    return "".join(parts) or "x"


def test_pieces_of_tricky_text_give_the_whole_texts_ids(tokenizer):
    """A bounded fuzz (a campaign of 150,000 such texts found nothing more): text of tricky
    fragments and random characters, read in chunks of any length (a long text file's are
    READ_CHARS) and cut at any size, gives the pre-tokens and ids of the whole text. Cut at
    every end of a pre-token, it failed: a piece ending with a run of whitespace
    ('\u200a\u2029|a') keeps the run whole, which the document splits."""
    rng = random.Random(11)
    for case in range(1000):
        doc = _tricky(rng, ascii_too=case % 2 == 0)
        ends = sorted({0, len(doc), *(rng.randrange(len(doc) + 1) for _ in range(rng.randint(0, 12)))})
        chunks = [doc[a:b] for a, b in zip(ends, ends[1:])] + [""] * rng.randint(0, 1)
        pieces = list(prep._cut(chunks, rng.choice([1, 2, 3, 5, 8, 13, 30])))
        assert "".join(pieces) == doc and all(pieces)
        assert [t for p in pieces for t in _pretokens(p)] == _pretokens(doc), doc
        assert [i for p in pieces for i in tokenizer.encode(p).ids] == tokenizer.encode(doc).ids, doc


def test_pieces_stay_within_their_size_where_the_text_has_places(tokenizer, monkeypatch):
    """The bound: no piece handed to the encoder is longer than ENCODE_PIECE_CHARS (English,
    Chinese with punctuation, base64), and a call holds about ENCODE_CHARS, whatever the
    document's length; the ids are the whole document's."""
    rng = random.Random(3)
    docs = [" ".join(rng.choice(["sun", "moon's", "7.5", "漢字。", "(x)"]) for _ in range(3000)),
            "".join(rng.choice(string.ascii_letters + string.digits + "+/") for _ in range(9000))]
    calls = []
    encode_batch = tokenizer.encode_batch
    monkeypatch.setattr(prep, "ENCODE_CHARS", 400)
    monkeypatch.setattr(prep, "ENCODE_PIECE_CHARS", 40)
    wrapper = type("T", (), {"encode_batch": lambda self, b: calls.append(list(b)) or encode_batch(b)})()
    got = prep.encode(wrapper, docs, 0)
    assert [g.tolist() for g in got] == [tokenizer.encode(d).ids + [0] for d in docs]
    assert max(len(p) for call in calls for p in call) <= 40
    assert max(sum(map(len, call)) for call in calls) < 400 + 40


def _text_documents(tmp_path, files: dict[str, str]) -> list:
    for name, text in files.items():
        (tmp_path / name).write_bytes(text.encode())
    recipe = parse_recipe({"vocab_size": 300, "train_tokens": 100, "sources": [
        {"name": "a", "kind": "local", "format": "text", "files": [str(tmp_path / "*.txt")], "share": 1}]})
    return list(sources.documents(recipe, recipe.sources[0], tmp_path))


def test_a_long_text_file_is_read_in_pieces_as_it_is_read_whole(tmp_path, monkeypatch):
    """A text file's document was read whole (a 1 GB dump, twice its size in memory): one
    longer than LONG_TEXT_CHARS is read in pieces, each time its text is needed, and is the
    same document: its text stripped alike (byte-order marks and whitespace across the
    pieces' ends, CRLF), its key hashed alike; one of whitespace only is none."""
    files = {"a.txt": "\ufeff\ufeff \r\n\t  word  \r\nit's 漢字漢字\r\n😀  \n\n  \t\r\n  ",
             "b.txt": "\ufeff  \ufeff x\r\ry" + " " * 20, "c.txt": " \r\n" * 9, "d.txt": "x" * 40,
             "e.txt": "\n".join(_adversarial(3)), "f.txt": "\ufeff" * 9 + "z"}
    held = _text_documents(tmp_path, files)
    assert all(isinstance(d, str) for d in held) and len(held) == 5  # c.txt holds none
    monkeypatch.setattr(local_files, "LONG_TEXT_CHARS", 5)
    monkeypatch.setattr(local_files, "READ_CHARS", 3)
    long = _text_documents(tmp_path, files)
    assert [type(d) for d in long] == [local_files.LongText] * 5
    assert ["".join(prep._chunks(d)) for d in long] == held
    assert max(len(c) for d in long for c in d.chunks()) == 3
    assert [(len(d), d.key_hash) for d in long] == [(len(d), local_files.text_hash(d)) for d in held]


def test_a_giant_document_is_encoded_in_bounded_pieces_as_far_as_it_is_used(tmp_path, monkeypatch):
    """One 23 MB text file took 17 s and 0.46 GB to prepare 300,000 tokens of it: all of it
    was read into memory, and all of it encoded. Now it is read and encoded in pieces no
    longer than ENCODE_PIECE_CHARS, and only as far as the source's share takes it; the
    stream is the whole document's ids, cut there, as before."""
    rng = random.Random(5)
    text = "\r\n".join(" ".join(rng.choice(["sun", "moon's", "7.5", "漢字。", "(x)", "  "]) for _ in range(100))
                       for _ in range(400))
    (tmp_path / "big.txt").write_text(text)
    monkeypatch.setattr(local_files, "LONG_TEXT_CHARS", 1000)
    monkeypatch.setattr(local_files, "READ_CHARS", 700)
    monkeypatch.setattr(prep, "ENCODE_PIECE_CHARS", 300)
    monkeypatch.setattr(prep, "ENCODE_CHARS", 2000)
    pieces = []
    encode_long = prep._encode_long
    monkeypatch.setattr(prep, "_encode_long", lambda tok, ps: encode_long(tok, (pieces.append(p) or p for p in ps)))
    recipe = parse_recipe({"vocab_size": 300, "train_tokens": 3000, "tokenizer_sample_chars": 10_000, "sources": [
        {"name": "a", "kind": "local", "format": "text", "files": [str(tmp_path / "big.txt")], "share": 1}]})
    manifest = prepare(recipe, tmp_path / "out").manifest
    tok = Tokenizer.from_file(str(manifest.tokenizer_path))
    tok.encode_special_tokens = True
    whole = tok.encode(text.replace("\r\n", "\n").strip()).ids
    assert len(whole) > 10 * 3000
    assert np.asarray(manifest.stream("train")).tolist() == whole[:2999] + [manifest.eos_id]
    assert max(map(len, pieces)) <= 300 and sum(map(len, pieces)) < len(text) / 5


def test_the_tokenizer_sample_holds_a_long_document_in_pieces(tmp_path, monkeypatch):
    """Training on one 30 MB document took 2.7 GB: the trainer gets it in pieces (the same words)."""
    monkeypatch.setattr(prep, "ENCODE_PIECE_CHARS", 1000)
    doc = " ".join(["alpha beta gamma delta"] * 2000)  # 46,000 characters
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": doc}) + "\n")
    recipe = parse_recipe({"vocab_size": 300, "train_tokens": 100, "sources": [
        {"name": "a", "kind": "local", "format": "json", "files": [str(tmp_path / "a.jsonl")], "share": 1}]})
    from rich.progress import Progress

    progress = Progress(disable=True)
    sample = list(prep._sample(recipe, tmp_path, progress, progress.add_task("s", total=1)))
    assert "".join(sample) == doc and max(map(len, sample)) <= 1000


def _local_recipe(tmp_path, sources: dict[str, list[str]], train_tokens: int):
    shares = {name: round(1 / len(sources), 6) for name in sources}
    shares[next(iter(shares))] += 1 - sum(shares.values())
    for name, docs in sources.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return parse_recipe({"vocab_size": 300, "train_tokens": train_tokens, "tokenizer_sample_chars": 100_000,
                         "sources": [{"name": name, "kind": "local", "format": "json",
                                      "files": [str(tmp_path / f"{name}.jsonl")], "share": shares[name]}
                                     for name in sources]})


@pytest.mark.parametrize("train_tokens", [1000, 1001, 1002, 1003, 1777])
def test_every_document_ends_with_end_of_text_the_cut_ones_too(tmp_path, train_tokens):
    """The cut last document of each source had no end-of-text: its text ran into the next
    document unmarked. Now every piece of the stream is a document (or its start) then the id."""
    rng = random.Random(train_tokens)
    words = ["sun", "moon", "star", "sky"]
    sources = {name: [f"{name} " + " ".join(rng.choice(words) for _ in range(rng.randint(20, 60))) for _ in range(200)]
               for name in ("left", "right")}
    recipe = _local_recipe(tmp_path, sources, train_tokens)
    manifest = prepare(recipe, tmp_path / "out").manifest
    ids = np.asarray(manifest.stream("train"))
    assert ids[-1] == manifest.eos_id
    tok = Tokenizer.from_file(str(manifest.tokenizer_path))
    pieces = [tok.decode(p.tolist()) for p in np.split(ids, np.flatnonzero(ids == manifest.eos_id) + 1)[:-1]]
    assert all(pieces)  # no empty document
    every = {d for docs in sources.values() for d in docs}
    cut = [p for p in pieces if p not in every]
    assert len(cut) <= len(sources)
    for p in cut:  # the start of a document of one source, not two documents run together
        assert any(d.startswith(p) for d in every) and p.count(" ") < 70
    for name, target in zip(sources, recipe.train_targets()):
        s = manifest.sources[name]
        assert target - 1 <= s["train_tokens"] <= target and not s["exhausted"]
        assert s["train_documents"] == sum(p.startswith(name + " ") for p in pieces)
    assert len(ids) == manifest.tokens["train"] == sum(s["train_tokens"] for s in manifest.sources.values())


def test_a_source_left_one_token_of_room_stops_one_short(tmp_path, monkeypatch):
    """Cut to one token, a document would be its end-of-text alone: an empty document."""
    docs = ["one two three four five six seven eight nine ten"] * 50
    recipe = _local_recipe(tmp_path, {"a": docs}, 1000)
    manifest = prepare(recipe, tmp_path / "probe").manifest
    per_doc = manifest.sources["a"]["train_tokens"] // manifest.sources["a"]["train_documents"]
    recipe = _local_recipe(tmp_path, {"a": docs}, 3 * per_doc + 1)  # room for three, then one token
    manifest = prepare(recipe, tmp_path / "out").manifest
    ids = np.asarray(manifest.stream("train"))
    assert len(ids) == 3 * per_doc == manifest.sources["a"]["train_tokens"]
    assert manifest.sources["a"]["train_documents"] == 3 and not manifest.sources["a"]["exhausted"]
    assert ids[-1] == manifest.eos_id and (ids == manifest.eos_id).sum() == 3


def test_a_source_that_runs_out_is_exhausted(tmp_path):
    recipe = _local_recipe(tmp_path, {"a": ["a few words only"] * 3}, 1000)
    manifest = prepare(recipe, tmp_path / "out").manifest
    assert manifest.sources["a"]["exhausted"] and manifest.sources["a"]["train_documents"] == 3


HELD = "held out words 8"  # hashed below 0.1: the held-out set of a recipe's first source


def _recipe_toml(recipe) -> str:
    """A recipe of _local_recipe as a file, its first source holding HELD out (`prepare`
    refuses a recipe without a held-out set)."""
    return "vocab_size = 300\ntrain_tokens = 4000\n" + "".join(
        f'[[sources]]\nname = "{s.name}"\nkind = "local"\nformat = "json"\nfiles = ["{s.files[0]}"]\n'
        f"share = {s.share}\n" + (f'heldout = "{s.name}_val"\nheldout_fraction = 0.1\n' if n == 0 else "")
        for n, s in enumerate(recipe.sources))


def test_a_source_that_runs_out_is_said_with_the_mixture_it_leaves(tmp_path):
    """The note said only that the source ran out, not that the others kept their targets: the
    shares are then not the recipe's."""
    import subprocess
    import sys

    rng = random.Random(0)
    big = [" ".join(rng.choice(["sun", "moon", "star", "sky"]) for _ in range(40)) for _ in range(300)]
    recipe = _local_recipe(tmp_path, {"big": big + [HELD], "small": ["a few words only"] * 3}, 4000)
    (tmp_path / "r.toml").write_text(_recipe_toml(recipe))
    done = subprocess.run([sys.executable, "-m", "fibctl", "data", "prepare", "r.toml", "--data", "out", "--plain"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    manifest = load_manifest(tmp_path / "out")
    small = manifest.sources["small"]
    assert small["exhausted"] and small["train_tokens"] < small["target_tokens"] == 2000
    assert manifest.sources["big"]["train_tokens"] == 2000  # the others keep their targets
    share = small["train_tokens"] / manifest.tokens["train"]
    assert (f"note: source 'small' ran out at {small['train_tokens']:,} of its 2,000 training tokens; its share of "
            f"the training stream is {share:.1%}, not 50.0%") in " ".join(done.stderr.split())


def test_an_error_logged_from_prepare_is_one_line_alone(tmp_path):
    """With stderr a file (a log, a batch job), the stopped progress bars wrote a blank line
    before the error."""
    import subprocess
    import sys

    (tmp_path / "out").write_text("not a folder")
    (tmp_path / "r.toml").write_text('vocab_size = 300\ntrain_tokens = 100\n[[sources]]\nname = "g"\n'
                                     'kind = "generated"\nshare = 1\nheldout = "g_val"\n')
    done = subprocess.run([sys.executable, "-m", "fibctl", "data", "prepare", "r.toml", "--data", "out"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.startswith("error: out exists and is not a fibctl data folder")
    assert done.stderr.count("\n") == 1 and done.stdout == ""


@pytest.mark.parametrize("shares, train_tokens, source, tokens", [
    ({"a": 1.0}, 1, "a", "1 token"),  # said as "the sources gave no training documents"
    ({"a": 0.999, "b": 0.001}, 1000, "b", "1 token"),  # silently no token
    ({"a": 0.9996, "b": 0.0004}, 1000, "b", "no token"),
])
def test_a_source_whose_target_has_no_room_for_text_is_refused(tmp_path, shares, train_tokens, source, tokens):
    """A one-token target can hold only the end-of-text: the source gave nothing."""
    recipe = {"vocab_size": 300, "train_tokens": train_tokens, "sources": [
        {"name": name, "kind": "generated", "share": share} for name, share in shares.items()]}
    with pytest.raises(FibctlError, match=rf"^source '{source}': share .* of train_tokens={train_tokens} is {tokens} "
                                          r"once the shares are rounded; raise train_tokens or its share"):
        parse_recipe(recipe)


def test_a_corpus_held_out_whole_says_so(tmp_path):
    """A corpus whose one document hashes into the held-out set said 'the sources gave no
    training documents', as an empty one does: it now says the held-out hash took them all."""
    text = next(t for t in (f"held out text {i}" for i in range(1000)) if prep._hashed_below(t, 0.1))
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": text}) + "\n")
    recipe = parse_recipe({"vocab_size": 300, "train_tokens": 100, "sources": [
        {"name": "a", "kind": "local", "format": "json", "files": [str(tmp_path / "a.jsonl")], "share": 1,
         "heldout": "a_val", "heldout_fraction": 0.1}]})
    with pytest.raises(FibctlError, match=r"^recipe '[^']+': no training documents: the held-out hash held out all 1 "
                                          r"document\(s\) the sources gave \(each hashed below heldout_fraction 0\.1\); "
                                          r"give the sources more documents, or lower heldout_fraction$"):
        prepare(recipe, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_two_token_target_holds_a_token_of_text(tmp_path):
    recipe = _local_recipe(tmp_path, {"a": ["river stone lantern"] * 3}, 2)
    manifest = prepare(recipe, tmp_path / "out").manifest
    ids = np.asarray(manifest.stream("train"))
    assert len(ids) == 2 and ids[0] != manifest.eos_id and ids[1] == manifest.eos_id


def test_sources_that_run_out_in_proportion_are_noted_on_one_line_each(tmp_path):
    """The note said "its share of the training stream is 50.0%, not 50.0%", and notes and the
    summary wrapped at 80 columns in a log file."""
    import subprocess
    import sys

    recipe = _local_recipe(tmp_path, {"a": ["a few words only"] * 3 + [HELD], "b": ["a few other words"] * 3}, 4000)
    (tmp_path / "r.toml").write_text(_recipe_toml(recipe))
    out = tmp_path / ("a_long_data_folder_name_" * 3)
    done = subprocess.run([sys.executable, "-m", "fibctl", "data", "prepare", "r.toml", "--data", str(out), "--plain"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    taken = {name: s["train_tokens"] for name, s in load_manifest(out).sources.items()}
    assert done.stderr.splitlines() == [f"note: source {name!r} ran out at {tokens:,} of its 2,000 training tokens"
                                        for name, tokens in taken.items()]
    first = done.stdout.splitlines()[0]
    assert first.startswith(f"{out}: prepared recipe 'r' in ") and first.endswith(" s)")
