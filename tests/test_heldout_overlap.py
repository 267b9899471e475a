"""Held-out sets stay out of training when sources share inputs, and a corpus with a long run
of text without whitespace does not stall the tokenizer (corpora nobody tuned for)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from fibctl.data import prepare as prep
from fibctl.data.prepare import prepare
from fibctl.data.recipe import load_recipe
from test_data import _documents

OVERLAP = """
name = "overlap"
vocab_size = 512
train_tokens = 60000
heldout_tokens = 20000
tokenizer_sample_chars = 200000

[[sources]]
name = "a"
kind = "local"
format = "text"
files = ["docs/*.txt"]
share = 0.5
heldout = "a_val"
heldout_fraction = 0.3

[[sources]]
name = "b"
kind = "local"
format = "text"
files = ["docs/0*.txt"]
share = 0.5
{b_heldout}
"""


def _corpus(root, n: int = 200) -> None:
    rng = np.random.default_rng(0)
    words = ["river", "stone", "light", "paper", "cloud", "seven", "under", "north", "glass", "amber"]
    (root / "docs").mkdir()
    for i in range(n):
        (root / "docs" / f"{i % 2}{i:04d}.txt").write_text(" ".join(rng.choice(words, 60)) + f" doc{i}\n")


@pytest.mark.parametrize("b_heldout", ["", 'heldout = "b_val"\nheldout_fraction = 0.05'])
def test_a_document_held_out_by_one_source_is_not_trained_on_through_another(tmp_path, b_heldout):
    """Source b reads half of a's files: it trained on 48 of the 63 documents a held out."""
    _corpus(tmp_path)
    (tmp_path / "r.toml").write_text(OVERLAP.format(b_heldout=b_heldout))
    prepare(load_recipe(tmp_path / "r.toml"), tmp_path / "out")
    train = {t for t, _ in _documents(tmp_path / "out", "train")}
    held = [t for t, _ in _documents(tmp_path / "out", "a_val")]
    assert held and not set(held) & train
    if b_heldout:  # b's own set is a's too: its fraction is below a's
        assert not {t for t, _ in _documents(tmp_path / "out", "b_val")} & train


def test_a_copy_of_a_held_out_document_in_another_corpus_is_not_trained_on(tmp_path):
    """b reads other files holding copies of a's documents (a page in two corpora): 43 of a's
    96 held-out documents were trained on through b."""
    _corpus(tmp_path)
    (tmp_path / "copies").mkdir()
    for f in (tmp_path / "docs").glob("0*.txt"):
        (tmp_path / "copies" / f.name).write_text(f.read_text())
    (tmp_path / "r.toml").write_text(OVERLAP.format(b_heldout="").replace('files = ["docs/0*.txt"]',
                                                                         'files = ["copies/*.txt"]'))
    prepare(load_recipe(tmp_path / "r.toml"), tmp_path / "out")
    train = {t for t, _ in _documents(tmp_path / "out", "train")}
    held = {t for t, _ in _documents(tmp_path / "out", "a_val")}
    assert held and not held & train


SOLUTIONS = """
name = "solutions"
vocab_size = 512
train_tokens = 200000
heldout_tokens = 200000
tokenizer_sample_chars = 100000

[[sources]]
name = "generated"
kind = "local"
format = "json"
files = ["generated.jsonl"]
text = ["problem", "solution"]
{heldout_by}
share = {share}
heldout = "math_val"
heldout_fraction = 0.3
"""

REFERENCE = """
[[sources]]
name = "reference"
kind = "local"
format = "json"
files = ["reference.jsonl"]
text = ["problem", "solution"]
{heldout_by}
share = 0.5
"""


def _problems(root) -> None:
    """60 problems with 5 generated solutions each (OpenMathInstruct-2), and one reference
    solution each (MATH)."""
    with open(root / "generated.jsonl", "w") as f, open(root / "reference.jsonl", "w") as g:
        for i in range(60):
            problem = f"Problem {i}: what is {i} times seven?"
            for j in range(5):
                f.write(json.dumps({"problem": problem, "solution": f"Generated solution {j}: {7 * i}."}) + "\n")
            g.write(json.dumps({"problem": problem, "solution": f"Reference solution: {i} times 7 is {7 * i}."})
                    + "\n")


def _problems_of(data_dir, split: str, marker: str) -> set[str]:
    """The problems of a split's documents whose solution starts with `marker` (one source's)."""
    documents = [t.split("\n\n") for t, _ in _documents(data_dir, split)]
    return {problem for problem, solution in documents if solution.startswith(marker)}


@pytest.mark.parametrize("heldout_by", ['heldout_by = ["problem"]', ""])
def test_a_problems_solutions_are_held_out_together(tmp_path, heldout_by):
    """Held out by the hash of each document's whole text, all 54 problems with a solution in
    math_val had others in train.bin: math_val was not disjoint from training by problem."""
    _problems(tmp_path)
    (tmp_path / "r.toml").write_text(SOLUTIONS.format(heldout_by=heldout_by, share=1.0))
    prepare(load_recipe(tmp_path / "r.toml"), tmp_path / "out")
    held, train = ([t.split("\n\n")[0] for t, _ in _documents(tmp_path / "out", split)]
                   for split in ("math_val", "train"))
    assert len(held) + len(train) == 300  # every document was read
    if heldout_by:
        assert held and not set(held) & set(train)
        assert all(held.count(problem) == 5 for problem in held)  # each with all its solutions
    else:
        assert set(held) & set(train)


@pytest.mark.parametrize("heldout_by", ['heldout_by = ["problem"]', ""])
def test_a_held_out_problem_is_not_trained_on_through_another_source(tmp_path, heldout_by):
    """A second source holds the same problems with other solutions (MATH beside
    OpenMathInstruct-2) and no held-out set: keyed by problem it trains on none of math_val's
    problems; keyed by its whole text it trained on 14 of the 21."""
    _problems(tmp_path)
    (tmp_path / "r.toml").write_text(SOLUTIONS.format(heldout_by='heldout_by = ["problem"]', share=0.5)
                                     + REFERENCE.format(heldout_by=heldout_by))
    prepare(load_recipe(tmp_path / "r.toml"), tmp_path / "out")
    held = _problems_of(tmp_path / "out", "math_val", "Generated")
    reference = _problems_of(tmp_path / "out", "train", "Reference")
    assert held and reference and not held & _problems_of(tmp_path / "out", "train", "Generated")
    if heldout_by:
        assert not held & reference and len(held | reference) == 60
    else:
        assert held & reference


@pytest.mark.parametrize("recipe", ["demo", "quick"])
def test_a_single_source_cuts_only_its_own_held_out_documents(recipe):
    """One source: the cut is its own fraction, so the demo's data (and their hash) are what they were."""
    r = load_recipe(recipe)
    [source] = r.sources
    assert prep._training_cut(r) == source.heldout_fraction


@pytest.mark.parametrize("a,b,words", [
    ('format = "json"\nfiles = ["notes.jsonl"]\ntext = ["title", "body"]',
     'format = "json"\nfiles = ["notes.jsonl"]\ntext = ["body"]', "text ['title', 'body'] against ['body']"),
    ('format = "text"\nfiles = ["docs/*.txt"]', 'format = "text"\nfiles = ["docs/0*.txt"]\nsample_by = "paragraph"',
     "sample_by 'document' against 'paragraph'"),
    ('format = "json"\nfiles = ["notes.jsonl"]\ntext = ["title", "body"]\nheldout_by = ["title"]',
     'format = "json"\nfiles = ["notes.jsonl"]\ntext = ["title", "body"]', "heldout_by ['title'] against None"),
    ('format = "json"\nfiles = ["notes.jsonl"]\ntext = ["title", "body"]\nrecords = "data"',
     'format = "json"\nfiles = ["notes.jsonl"]\ntext = ["title", "body"]', "records 'data' against None"),
])
def test_sources_that_cut_the_same_files_otherwise_are_refused(a, b, words, tmp_path):
    """a holds out "title + body" documents, b trains on the bodies of the same rows (73 of a's
    91 held-out bodies were in train.bin), or b reads a's files by paragraph (170 of 228
    paragraphs of held-out files were trained on), or a holds out by title and b keys the
    same documents by their whole text. Refused in one line, nothing written."""
    from fibctl.errors import FibctlError

    _corpus(tmp_path)
    (tmp_path / "notes.jsonl").write_text("".join(f'{{"title": "t{i}", "body": "body {i}"}}\n' for i in range(50)))
    recipe = OVERLAP.format(b_heldout="").replace('format = "text"\nfiles = ["docs/*.txt"]', a)
    (tmp_path / "r.toml").write_text(recipe.replace('format = "text"\nfiles = ["docs/0*.txt"]', b))
    with pytest.raises(FibctlError, match=re.escape(f"sources 'a' and 'b' read the same inputs but build other "
                                                    f"documents from them ({words})")):
        prepare(load_recipe(tmp_path / "r.toml"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_key_of_all_the_text_fields_in_order_is_the_whole_text():
    """Keyed by every text field in order, a document's key is its text: a source reading the
    same files without the key cuts and keys them alike, and is not refused."""
    from fibctl.data.recipe import parse_recipe

    r = parse_recipe({"vocab_size": 512, "train_tokens": 1000, "sources": [
        {"name": name, "kind": "local", "format": "json", "files": ["/x/notes.jsonl"], "text": ["title", "body"],
         "share": 0.25 if name == "c" else 0.375, **extra}
        for name, extra in (("a", {"heldout_by": ["title", "body"], "heldout": "a_val"}), ("b", {}),
                            ("c", {"heldout_by": ["body", "title"]}))]})
    a, b, c = r.sources
    assert prep._document_rule(a) == prep._document_rule(b) != prep._document_rule(c)


def test_the_tokenizer_sample_cuts_long_runs_without_whitespace():
    doc = "intro text " + "acgt" * 5000 + " middle " + "x" * 9000 + " end"
    pieces = list(prep._pieces(doc))
    assert "".join(pieces) == doc and len(pieces) == 7  # 4 + 2 runs of 4096, and the rest
    assert max(len(w) for p in pieces for w in re.findall(r"\S+", p)) <= prep.SAMPLE_WORD_BYTES
    assert list(prep._pieces("short words only")) == ["short words only"]


def test_the_tokenizer_sample_cuts_a_run_of_cjk_by_its_bytes():
    """Cut at 4,096 characters, a run of Chinese without punctuation was a word of 12 KB that
    BPE merges byte by byte: 30 MB trained in 296 s, 143 s cut by bytes. A piece ends at the
    last whole character within 4,096 bytes."""
    run = "中文" * 3000 + "😀" * 1000  # 3 bytes a character, then 4
    pieces = list(prep._pieces("start " + run + " end"))
    assert "".join(pieces) == "start " + run + " end"
    words = [w.encode() for p in pieces for w in re.findall(r"\S+", p)]
    assert max(map(len, words)) <= prep.SAMPLE_WORD_BYTES
    # 1,365 characters (4,095 bytes) a piece; the fifth ends the Chinese and fills 4,096 with emoji
    assert [len(p.encode()) for p in pieces] == [6 + 4095, 4095, 4095, 4095, 1620 + 2476, 1524 + 4]


def test_a_corpus_with_a_huge_word_prepares(tmp_path):
    """A 12 MB base64-like document stalled BPE training for over 5 minutes; the training
    stream keeps it as it is (only the tokenizer's sample is cut)."""
    _corpus(tmp_path, 40)
    rng = np.random.default_rng(1)
    (tmp_path / "docs" / "0huge.txt").write_text("".join(rng.choice(list("abcdefghij"), 400_000)))
    (tmp_path / "r.toml").write_text(OVERLAP.split("[[sources]]")[0].replace("60000", "20000")
                                     + '[[sources]]\nname = "a"\nkind = "local"\nformat = "text"\n'
                                       'files = ["docs/*.txt"]\nshare = 1.0\n')
    prepare(load_recipe(tmp_path / "r.toml"), tmp_path / "out")
    assert sum(n for _, n in _documents(tmp_path / "out", "train")) == 20000


def _kept_in_training(texts: list[str], fraction: float) -> list[str]:
    return [t for t in texts if not prep._hashed_below(t, fraction)]


ONE_DOCUMENT = re.escape("its one document cannot be both trained on and held out; split its text into documents "
                         '(sample_by = "paragraph" or "line", or one file per document)') + "$"


@pytest.mark.parametrize("documents, train_tokens, words", [
    # the one document ran out before the share was full, or filled it: no more to read either way
    (1, 100_000, ONE_DOCUMENT),
    (1, 50, ONE_DOCUMENT),  # said "read before its training share was full ... give the source more documents"
    # all read (it said "before its training share was full"): more documents would help
    (3, 100_000, r"none of its 3 documents hashed below its heldout_fraction 0\.1 \(about 0\.3 would\); give "
                 r"the source more documents, or raise heldout_fraction$"),
    # full while documents are left unread: more documents would not be read, more tokens would
    (40, 50, r"none of the 1 document\(s\) read before its training share was full hashed below its "
             r"heldout_fraction 0\.1; raise heldout_fraction, or train_tokens \(more of its documents are read\)$"),
])
def test_an_empty_held_out_set_says_what_to_change(tmp_path, documents, train_tokens, words):
    """An empty held-out set said "give the source more documents, or raise heldout_fraction"
    whatever the corpus: to a one-document corpus (where neither helps), and to a source whose
    share was full before its documents were all read (where more are not read)."""
    from fibctl.errors import FibctlError

    (tmp_path / "docs").mkdir()
    texts = _kept_in_training([f"document {i} of plain words " * 20 for i in range(200)], 0.1)[:documents]
    for i, text in enumerate(texts):
        (tmp_path / "docs" / f"{i:03d}.txt").write_text(text)
    (tmp_path / "r.toml").write_text(OVERLAP.split("[[sources]]")[0].replace("60000", str(train_tokens))
                                     + '[[sources]]\nname = "a"\nkind = "local"\nformat = "text"\n'
                                       'files = ["docs/*.txt"]\nshare = 1.0\nheldout = "a_val"\n'
                                       'heldout_fraction = 0.1\n')
    with pytest.raises(FibctlError, match=r"^held-out set 'a_val' got no documents from source 'a': " + words):
        prepare(load_recipe(tmp_path / "r.toml"), tmp_path / "out")


def test_sources_that_give_no_document_name_their_text_fields(tmp_path):
    """Empty files, or rows whose text is null: it said only "the sources gave no training
    documents"."""
    from fibctl.errors import FibctlError

    (tmp_path / "rows.jsonl").write_text('{"body": null}\n{"body": "  "}\n')
    (tmp_path / "r.toml").write_text(OVERLAP.split("[[sources]]")[0] + '[[sources]]\nname = "a"\nkind = "local"\n'
                                     'format = "json"\nfiles = ["rows.jsonl"]\ntext = ["body"]\nshare = 1.0\n')
    with pytest.raises(FibctlError, match=r"^recipe 'overlap': the sources gave no documents \(a: no row has text "
                                          r"in body: each is null or empty\)$"):
        prepare(load_recipe(tmp_path / "r.toml"), tmp_path / "out")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "0blank.txt").write_text(" \n\n")
    (tmp_path / "r.toml").write_text(OVERLAP.format(b_heldout=""))
    with pytest.raises(FibctlError, match=r"^recipe 'overlap': the sources gave no documents \(a: its files are "
                                          r"empty or whitespace; b: its files are empty or whitespace\)$"):
        prepare(load_recipe(tmp_path / "r.toml"), tmp_path / "out")


def test_documents_are_encoded_in_batches_bounded_in_characters(monkeypatch):
    """256 documents of 100 kB at a time took 2.9 GB to encode 10,000 tokens: a batch stops at
    ENCODE_CHARS too, and every document comes once, whole, in order."""
    monkeypatch.setattr(prep, "ENCODE_CHARS", 100)
    given = ["x" * 60] * 5 + ["y"] * 600

    def batches(docs: list[str]) -> list[list[str]]:
        feed, found = prep._Feed(None, iter(docs), None, 1, 0, 0.0), []
        while batch := feed._batch():
            found.append(batch)
        return found

    assert [len(b) for b in batches(given)] == [2, 2, 41, 100, 100, 100, 100, 100, 60]
    assert [d for b in batches(given) for d in b] == given
    # a document longer than ENCODE_CHARS comes alone, encoded only as far as it is written
    assert batches(["y", "x" * 101, "y"]) == [["y"], ["x" * 101], ["y"]]
    monkeypatch.setattr(prep, "ENCODE_CHARS", 10**9)
    assert len(batches(given)[0]) == prep.ENCODE_BATCH


def test_the_held_out_hash_is_the_one_docs_data_md_states(tmp_path):
    """docs/data.md states the hash so that a researcher can check a split from the streams."""
    import hashlib

    _corpus(tmp_path, 60)
    (tmp_path / "r.toml").write_text(OVERLAP.split("[[sources]]")[0] + '[[sources]]\nname = "a"\nkind = "local"\n'
                                     'format = "text"\nfiles = ["docs/*.txt"]\nshare = 1.0\nheldout = "a_val"\n'
                                     'heldout_fraction = 0.3\n')
    prepare(load_recipe(tmp_path / "r.toml"), tmp_path / "out")

    def fraction(text: str) -> float:
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") / 2**64

    held, train = (_documents(tmp_path / "out", split) for split in ("a_val", "train"))
    assert held and all(fraction(t) < 0.3 for t, _ in held)
    assert all(fraction(t) >= 0.3 for t, _ in train)
