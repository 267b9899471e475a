"""Documents on their way into the token streams: where each one ends, and how a long one is
encoded (corpora nobody tuned for: odd unicode, a huge document)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from tokenizers import Tokenizer

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


def test_a_long_document_is_encoded_in_pieces_with_the_whole_documents_ids(tokenizer, monkeypatch):
    """One 30 MB document took 4.7 GB to encode whole: the encoder sees pieces, a bounded number
    of characters per call, cut where the pre-tokenizer ends a token (the slow reference: each
    document encoded whole)."""
    docs = _odd_documents(200)
    whole = [np.array(tokenizer.encode(d).ids + [0], dtype=np.uint16) for d in docs]
    calls = []
    encode_batch = tokenizer.encode_batch
    monkeypatch.setattr(prep, "ENCODE_CHARS", 400)
    for size in (24, 40, 100):
        monkeypatch.setattr(prep, "ENCODE_PIECE_CHARS", size)
        pieces = [p for d in docs for p in prep._encode_pieces(d, size)]
        assert max(map(len, pieces)) <= size and len(pieces) > 2 * len(docs)
        # where no place to cut lies within `size` characters, a hard cut may change the ids:
        # compare the documents cut only at those places
        soft = [all(prep._PIECE_END.match(d, c)
                    for c in np.cumsum([len(p) for p in prep._encode_pieces(d, size)])[:-1]) for d in docs]
        assert sum(soft) > len(docs) // 3
        wrapper = type("T", (), {"encode_batch": lambda self, b: calls.append(sum(map(len, b))) or encode_batch(b)})()
        got = prep.encode(wrapper, docs, 0)
        assert [g.dtype for g in got] == [np.uint16] * len(docs)
        for g, w, ok in zip(got, whole, soft):
            if ok:
                assert g.tolist() == w.tolist()
            assert g[-1] == 0 and (g[:-1] != 0).all()  # one end-of-text, the document's end
        assert max(calls) < 400 + size
        calls.clear()


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


def test_a_source_that_runs_out_is_said_with_the_mixture_it_leaves(tmp_path):
    """The note said only that the source ran out, not that the others kept their targets: the
    shares are then not the recipe's."""
    import subprocess
    import sys

    rng = random.Random(0)
    big = [" ".join(rng.choice(["sun", "moon", "star", "sky"]) for _ in range(40)) for _ in range(300)]
    recipe = _local_recipe(tmp_path, {"big": big, "small": ["a few words only"] * 3}, 4000)
    (tmp_path / "r.toml").write_text(
        "vocab_size = 300\ntrain_tokens = 4000\n" + "".join(
            f'[[sources]]\nname = "{s.name}"\nkind = "local"\nformat = "json"\nfiles = ["{s.files[0]}"]\n'
            f"share = {s.share}\n" for s in recipe.sources))
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
                                     'kind = "generated"\nshare = 1\n')
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

    recipe = _local_recipe(tmp_path, {"a": ["a few words only"] * 3, "b": ["a few other words"] * 3}, 4000)
    (tmp_path / "r.toml").write_text(
        "vocab_size = 300\ntrain_tokens = 4000\n" + "".join(
            f'[[sources]]\nname = "{s.name}"\nkind = "local"\nformat = "json"\nfiles = ["{s.files[0]}"]\n'
            f"share = {s.share}\n" for s in recipe.sources))
    out = tmp_path / ("a_long_data_folder_name_" * 3)
    done = subprocess.run([sys.executable, "-m", "fibctl", "data", "prepare", "r.toml", "--data", str(out), "--plain"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    taken = {name: s["train_tokens"] for name, s in load_manifest(out).sources.items()}
    assert done.stderr.splitlines() == [f"note: source {name!r} ran out at {tokens:,} of its 2,000 training tokens"
                                        for name, tokens in taken.items()]
    first = done.stdout.splitlines()[0]
    assert first.startswith(f"{out}: prepared recipe 'r' in ") and first.endswith(" s)")
