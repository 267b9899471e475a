"""`fibctl data prepare`: recipes -> tokenizer -> token streams, offline on files the tests write."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from fibctl.data import generated, installed_docs
from fibctl.data.prepare import prepare
from fibctl.data.recipe import load_recipe, parse_recipe
from fibctl.data.streams import load_manifest, token_stream
from fibctl.errors import FibctlError

WORDS = ("river stone lantern quiet number table window garden letter engine paper orbit signal "
         "winter market bridge forest cable story method").split()


def _text(rng: np.random.Generator, marker: str) -> str:
    words = rng.choice(WORDS, size=int(rng.integers(40, 160)))
    return f"{marker} " + " ".join(words) + "."


def _write_corpora(root: Path) -> None:
    """Two local corpora whose documents start with a marker word, so a test can tell them apart.

    Each has some exact duplicates, which must land on one side of the held-out split.
    """
    rng = np.random.default_rng(0)
    (root / "news").mkdir()
    for shard in range(2):
        docs = [_text(rng, "alpha") for _ in range(900)]
        docs += docs[:30]  # duplicates
        with open(root / "news" / f"part{shard}.jsonl", "w") as f:
            for d in docs:
                f.write(json.dumps({"body": d, "id": 1}) + "\n")
    (root / "books").mkdir()
    for shard in range(12):  # one paragraph per document
        paragraphs = [_text(rng, "omega") if i % 50 else "omega duplicate book." for i in range(100)]
        (root / "books" / f"b{shard:02d}.txt").write_text("\n\n".join(paragraphs) + "\n")


MIXTURE = """
name = "mixture"
vocab_size = 512
train_tokens = {train_tokens}
heldout_tokens = 40000
tokenizer_sample_chars = 300000

[[sources]]
name = "news"
kind = "local"
format = "json"
files = ["news/*.jsonl"]
text = ["body"]
share = 0.5
heldout = "news_val"
heldout_fraction = 0.1

[[sources]]
name = "books"
kind = "local"
format = "text"
files = ["books/*.txt"]
sample_by = "paragraph"
share = 0.3
heldout = "books_val"
heldout_fraction = 0.1

[[sources]]
name = "stories"
kind = "generated"
seed = 7
share = 0.2
"""


def _recipe_file(root: Path, train_tokens: int = 300_000) -> Path:
    path = root / "mixture.toml"
    path.write_text(MIXTURE.format(train_tokens=train_tokens))
    return path


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpora")
    _write_corpora(root)
    return root


@pytest.fixture(scope="module")
def built(corpora) -> Path:
    out = corpora / "out"
    prepare(load_recipe(_recipe_file(corpora)), out)
    return out


def _documents(data_dir: Path, split: str) -> list[tuple[str, int]]:
    """(text, token count) of each document of a split, cut at the end-of-text token."""
    manifest = load_manifest(data_dir)
    tokenizer = Tokenizer.from_file(str(manifest.tokenizer_path))
    ids = np.asarray(token_stream(data_dir, split))
    cuts = np.flatnonzero(ids == manifest.eos_id)
    pieces = np.split(ids, cuts + 1)
    return [(tokenizer.decode(p[p != manifest.eos_id].tolist()), len(p)) for p in pieces if len(p)]


def _source_of(text: str) -> str:
    return "news" if text.startswith("alpha") else "books" if text.startswith("omega") else "stories"


def test_mixture_shares_by_tokens(built):
    """Count tokens per source from the stream itself (documents carry a marker word)."""
    counts: Counter[str] = Counter()
    for text, n in _documents(built, "train"):
        counts[_source_of(text)] += n
    total = sum(counts.values())
    assert total == 300_000 == load_manifest(built).tokens["train"]
    for name, share in (("news", 0.5), ("books", 0.3), ("stories", 0.2)):
        assert abs(counts[name] / total - share) < 0.01, (name, counts)


def test_mixture_is_interleaved_not_concatenated(built):
    """Any stretch of the training stream mixes the sources, so a window sample sees them all."""
    docs = _documents(built, "train")
    assert {_source_of(t) for t, _ in docs[: len(docs) // 20]} == {"news", "books", "stories"}


def test_heldout_is_disjoint_from_training_and_whole_documents(built, corpora):
    train = {t for t, _ in _documents(built, "train")}
    for split, marker in (("news_val", "alpha"), ("books_val", "omega")):
        held = [t for t, _ in _documents(built, split)]
        assert held and all(t.startswith(marker) for t in held)
        assert not set(held) & train
    # whole documents: every held-out document is a document of the source files
    news = {json.loads(line)["body"] for p in (corpora / "news").glob("*.jsonl") for line in open(p)}
    assert {t for t, _ in _documents(built, "news_val")} <= news
    books = {para.strip() for p in (corpora / "books").glob("*.txt") for para in p.read_text().split("\n\n")}
    assert {t for t, _ in _documents(built, "books_val")} <= books


def test_manifest_and_reader_api(built):
    m = load_manifest(built)
    assert m.vocab_size == 512 and m.tokenizer_vocab <= 512
    assert m.train_split == "train" and m.heldout == ["news_val", "books_val"]
    assert m.tokenizer_path.is_file() and len(m.recipe_hash) == len(m.tokenizer_hash) == 16
    stream = token_stream(built, "news_val")
    assert stream.dtype == np.uint16 and stream.ndim == 1 and len(stream) == m.tokens["news_val"]
    assert int(np.asarray(token_stream(built, "train")).max()) < m.tokenizer_vocab
    assert m.sources["news"]["train_tokens"] == 150_000 and not m.sources["news"]["exhausted"]
    with pytest.raises(FibctlError, match="no split 'val'.*train, news_val, books_val"):
        token_stream(built, "val")


def test_missing_manifest_names_the_folder(tmp_path):
    with pytest.raises(FibctlError, match=f"no data manifest in {tmp_path}; run `fibctl data prepare"):
        load_manifest(tmp_path)


@pytest.mark.parametrize("change, words", [
    ({"tokenizer_vocab": "big"}, "tokenizer_vocab 'big' is not a count"),
    ({"eos_id": -1}, "eos_id -1 is not a count"),
    ({"eos_id": 9999}, "eos_id 9999 is beyond the tokenizer's vocabulary of 512"),
    ({"tokenizer_vocab": 513}, "tokenizer_vocab 513 is beyond vocab_size 512"),
    ({"dtype": "bogus"}, "dtype 'bogus' is not uint16"),
    ({"recipe": 5}, "recipe 5 is not text"),
    ({"heldout": ["train"]}, "repeat a name"),
    ({"sources": {"s": {"kind": "local", "target_tokens": "x", "train_tokens": 1, "train_documents": 1,
                        "exhausted": False, "heldout": None, "heldout_tokens": 0, "heldout_documents": 0}}},
     "sources['s']: counts must be whole numbers"),
    (None, "nests its values too deeply"),
])
def test_a_damaged_manifest_is_one_clear_error(tmp_path, monkeypatch, capsys, change, words):
    """A manifest edited by hand or damaged: a wrong type that `fibctl data show` printed with a
    traceback (or nesting too deep for the parser) is refused as not a valid manifest."""
    from cli_helpers import refused
    from train_helpers import write_data

    data = write_data(tmp_path / "data", train_tokens=1_000, heldout_tokens=100)
    manifest = json.loads((data / "manifest.json").read_text())
    text = "[" * 100_000 + "]" * 100_000 if change is None else json.dumps({**manifest, **change})
    (data / "manifest.json").write_text(text)
    with pytest.raises(FibctlError, match="is not a valid data manifest"):
        load_manifest(data)
    assert words in refused(monkeypatch, capsys, "data", "show", str(data))


def test_data_show_prints_a_recipe_name_s_control_codes_escaped(tmp_path, capsys):
    from fibctl.cli.data import show_cmd
    from train_helpers import write_data

    data = write_data(tmp_path / "data", train_tokens=1_000, heldout_tokens=100)
    (data / "tokenizer.json").write_text("{}")  # `data show` refuses a folder without one
    manifest = json.loads((data / "manifest.json").read_text())
    (data / "manifest.json").write_text(json.dumps({**manifest, "recipe": "\u001b[2Jmine"}))
    show_cmd(data)
    out = capsys.readouterr().out
    assert "\x1b" not in out and "recipe \\x1b[2Jmine (" in out


def test_same_recipe_same_bytes(built, corpora):
    again = corpora / "again"
    prepare(load_recipe(_recipe_file(corpora)), again)
    for name in ("train.bin", "news_val.bin", "books_val.bin", "tokenizer.json", "manifest.json"):
        assert (again / name).read_bytes() == (built / name).read_bytes(), name


def test_rerun_reuses_and_changed_recipe_rebuilds(corpora, tmp_path):
    out = tmp_path / "data"
    first = prepare(load_recipe(_recipe_file(corpora, 60_000)), out)
    assert not first.reused
    mtime = (out / "train.bin").stat().st_mtime_ns
    start = time.perf_counter()
    second = prepare(load_recipe(_recipe_file(corpora, 60_000)), out)
    assert second.reused and time.perf_counter() - start < 1.0
    assert (out / "train.bin").stat().st_mtime_ns == mtime
    third = prepare(load_recipe(_recipe_file(corpora, 50_000)), out)
    assert not third.reused and third.manifest.tokens["train"] == 50_000
    assert third.manifest.recipe_hash != first.manifest.recipe_hash
    # a damaged stream is not mistaken for finished data
    (out / "train.bin").write_bytes(b"\0\0")
    assert not prepare(load_recipe(_recipe_file(corpora, 50_000)), out).reused
    assert [p.name for p in tmp_path.iterdir()] == ["data"]  # no leftovers beside it


def test_changed_local_file_rebuilds(tmp_path):
    rng = np.random.default_rng(1)
    corpus = tmp_path / "a.jsonl"
    corpus.write_text("".join(json.dumps({"text": _text(rng, "alpha")}) + "\n" for _ in range(100)))
    recipe = parse_recipe({"vocab_size": 300, "train_tokens": 2000, "tokenizer_sample_chars": 20000,
                           "sources": [{"name": "a", "kind": "local", "format": "json",
                                        "files": [str(corpus)], "share": 1}]})
    assert not prepare(recipe, tmp_path / "out").reused
    assert prepare(recipe, tmp_path / "out").reused
    with open(corpus, "a") as f:
        f.write(json.dumps({"text": "alpha new document."}) + "\n")
    assert not prepare(recipe, tmp_path / "out").reused


def test_refuses_a_folder_of_something_else(corpora, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FibctlError, match="not a fibctl data folder"):
        prepare(load_recipe(_recipe_file(corpora)), tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


@pytest.mark.parametrize("manifest", ['{"name": "app"}', None])
def test_a_rebuild_never_takes_files_it_did_not_write(corpora, tmp_path, manifest):
    """Another program's manifest.json, or a real data folder the user added to: a rebuild
    would replace the folder whole, so it is refused and the folder left as it was."""
    out = tmp_path / "d"
    if manifest is None:  # a fibctl data folder, then a file of the user's, then another recipe
        prepare(load_recipe(_recipe_file(corpora, 20_000)), out)
    else:
        out.mkdir()
        (out / "manifest.json").write_text(manifest)
    (out / "src").mkdir()
    (out / "src" / "important.txt").write_text("mine")
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    with pytest.raises(FibctlError, match=f"{out} holds 1 file\\(s\\) `fibctl data prepare` did not write there \\('src'\\)"):
        prepare(load_recipe(_recipe_file(corpora, 30_000)), out)
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


HUB = """
name = "hubmix"
vocab_size = 512
train_tokens = 10000
tokenizer_sample_chars = 20000

[[sources]]
name = "local"
kind = "generated"
share = 0.5
heldout = "local_val"

[[sources]]
name = "stories"
kind = "hub"
dataset = "roneneldan/TinyStories"
share = 0.5
"""


def test_unreachable_hub_leaves_nothing_behind(tmp_path, monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'roneneldan/TinyStories' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    (tmp_path / "hub.toml").write_text(HUB)
    with pytest.raises(FibctlError, match="'roneneldan/TinyStories'.*kind = \"local\""):
        prepare(load_recipe(tmp_path / "hub.toml"), tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hub.toml"]


def test_cli_unreachable_hub_exits_2_with_one_line(tmp_path):
    (tmp_path / "hub.toml").write_text(HUB)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "fibctl", "data", "prepare", "hub.toml", "--out", "out", "-q"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    error = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "roneneldan/TinyStories" in error[0] and "local" in error[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hub.toml"]


def test_cli_prepare_show_and_recipes(corpora, tmp_path):
    from typer.testing import CliRunner

    from fibctl.cli import app

    runner = CliRunner()
    recipe = _recipe_file(corpora, 20_000)
    result = runner.invoke(app, ["data", "prepare", str(recipe), "--out", str(tmp_path / "d"), "--quiet"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["data", "show", str(tmp_path / "d")])
    assert result.exit_code == 0 and "news_val" in result.output and "20,000" in result.output
    # FIBCTL_DATA names the folder, as it does for every other command ("Missing argument")
    assert runner.invoke(app, ["data", "show"], env={"FIBCTL_DATA": str(tmp_path / "d")}).output == result.output
    result = runner.invoke(app, ["data", "recipes"])
    assert result.exit_code == 0 and all(n in result.output for n in ("demo", "paper", "quick"))
    # a split file cut short is said, as a worker would say it, not summarised as fine
    split = tmp_path / "d" / "news_val.bin"
    split.write_bytes(split.read_bytes()[:-2])
    result = runner.invoke(app, ["data", "show", str(tmp_path / "d")])
    assert result.exit_code == 1 and "news_val.bin is missing or not the size its manifest says" in str(result.exception)


@pytest.mark.parametrize("change, message", [
    ({"vocab_size": 70000}, "uint16"),
    ({"vocab_size": 257}, "from 258 \\(the 256 bytes, the end-of-text token and one merge\\)"),
    ({"shards": 3}, "unknown key.*shards"),
    ({"train_tokens": "many"}, "must be an integer"),
])
def test_bad_recipe_is_one_clear_error(change, message):
    data = {"vocab_size": 512, "train_tokens": 1000, "sources": [{"name": "g", "kind": "generated", "share": 1}]}
    with pytest.raises(FibctlError, match=message):
        parse_recipe({**data, **change})


def test_a_recipe_nested_too_deeply_is_one_clear_error(tmp_path):
    path = tmp_path / "deep.toml"
    path.write_text("vocab_size = 512\nx = " + "[" * 50_000 + "]" * 50_000 + "\n")  # the parser's RecursionError
    with pytest.raises(FibctlError, match=f"cannot read recipe {path}: it nests its values too deeply"):
        load_recipe(str(path))


def test_a_recipe_holding_an_integer_of_thousands_of_digits_is_one_clear_error(tmp_path):
    path = tmp_path / "long.toml"
    path.write_text("vocab_size = " + "9" * 5000 + "\n")  # int()'s ValueError past 4,300 digits
    with pytest.raises(FibctlError, match=f"cannot read recipe {path}: it holds an integer of too many digits"):
        load_recipe(str(path))


def test_bad_sources_are_named():
    base = {"vocab_size": 512, "train_tokens": 1000}
    with pytest.raises(FibctlError, match="shares sum to 0.8"):
        parse_recipe({**base, "sources": [{"name": "g", "kind": "generated", "share": 0.8}]})
    with pytest.raises(FibctlError, match="source 'x': kind 'ftp'"):
        parse_recipe({**base, "sources": [{"name": "x", "kind": "ftp", "share": 1}]})
    with pytest.raises(FibctlError, match="no recipe 'nope'.*demo"):
        load_recipe("nope")


@pytest.mark.parametrize("sources, message", [
    # six shares of 0.15 round up: the last source was left -2 tokens (train.bin held 198), or
    # at 12 tokens none, a ZeroDivisionError
    ([{"share": 0.15}] * 6 + [{"share": 0.1}], "source 's6': share 0.1 of train_tokens=10 is -2 tokens once the "
                                               "shares are rounded; raise train_tokens"),
    ([{"share": 1, "kind": "hub", "dataset": "o/d", "text": []}], r"source 's0': text \[\] must name one field or more"),
    ([{"share": 1, "heldout": "TRAIN"}], "a held-out set may not be named 'TRAIN': its file would be the training"),
    ([{"share": 0.5, "heldout": "val"}, {"share": 0.5, "heldout": "Val"}], "may not differ only by case: val, Val"),
])
def test_a_recipe_that_cannot_be_built_as_asked_is_refused(sources, message):
    data = {"vocab_size": 512, "train_tokens": 10, "sources": [
        {"name": f"s{i}", "kind": "generated", **s} for i, s in enumerate(sources)]}
    with pytest.raises(FibctlError, match=message):
        parse_recipe(data)


def test_missing_text_field_is_named(corpora, tmp_path):
    recipe = parse_recipe({"vocab_size": 512, "train_tokens": 1000, "sources": [
        {"name": "news", "kind": "local", "format": "json", "files": [str(corpora / "news" / "*.jsonl")],
         "share": 1}]})
    with pytest.raises(FibctlError, match="no row has field text; fields: body, id"):
        prepare(recipe, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_paper_recipe_is_the_spec():
    r = load_recipe("paper")
    assert r.vocab_size == 32768 and r.train_tokens == 426_000_000
    assert r.heldout == ["fineweb_edu_val", "wikipedia_val", "tinystories_val", "math_val"]
    shares = {s.name: s.share for s in r.sources}
    assert shares["fineweb_edu"] == 0.35 and shares["wikipedia"] == 0.22 and shares["tinystories"] == 0.20
    assert abs(shares["math"] + shares["openmathinstruct2"] - 0.23) < 1e-9
    assert {s.dataset for s in r.sources} >= {"HuggingFaceFW/fineweb-edu", "nvidia/OpenMathInstruct-2"}


def test_generated_is_deterministic():
    assert list(generated.documents(3, 50)) == list(generated.documents(3, 50))
    assert list(generated.documents(3, 50)) != list(generated.documents(4, 50))


def test_installed_docs_are_real_documents(tmp_path):
    """A bounded sample (the language reference and sqlalchemy): real prose, no tests, no repeats."""
    path = tmp_path / "docs.jsonl"
    installed_docs.harvest(path, ("pydoc_data", "sqlalchemy"))
    docs = list(installed_docs.read(path))
    titles = [d.split("\n\n", 1)[0] for d in docs]
    assert len(docs) > 500 and sum(map(len, docs)) > 1_000_000
    assert any(t == "Python language reference: for" for t in titles)
    assert any(t.startswith("sqlalchemy.orm.") for t in titles)
    assert not [t for t in titles if ".testing." in t or ".tests." in t]
    assert sum(" the " in d for d in docs) > 0.8 * len(docs)
    assert len({d.split("\n\n", 1)[1] for d in docs}) == len(docs)
    assert " at 0x" not in "".join(docs)  # no memory addresses: same corpus on every run
    again = tmp_path / "again.jsonl"
    installed_docs.harvest(again, ("pydoc_data", "sqlalchemy"))
    assert again.read_bytes() == path.read_bytes()


def test_quick_recipe_prepares_offline(tmp_path):
    """The recipe `fibctl demo --quick` uses: vocab 512 for the `micro` preset, a docs_val split."""
    result = prepare(load_recipe("quick"), tmp_path / "quick")
    m = result.manifest
    assert m.vocab_size == 512 and m.heldout == ["docs_val"]
    assert m.tokens["train"] == 300_000 and m.tokens["docs_val"] > 10_000
    tokenizer = Tokenizer.from_file(str(m.tokenizer_path))
    text = tokenizer.decode(np.asarray(token_stream(tmp_path / "quick", "docs_val"))[:400].tolist())
    assert " the " in text


def test_demo_recipe_fits_the_tiny_preset():
    from fibctl.config import get_preset

    r = load_recipe("demo")
    assert r.vocab_size == get_preset("tiny").model.vocab_size
    assert load_recipe("quick").vocab_size == get_preset("micro").model.vocab_size
    assert [s.kind for s in r.sources] == ["installed-docs"] and r.heldout == ["docs_val"]


def test_cli_unreachable_hub_is_one_line_at_once_without_retries(tmp_path):
    """Online mode with a hub that does not answer (nothing listens on port 9): one probe with
    a short timeout, one error line, no retries and no warnings, nothing left behind."""
    import time

    (tmp_path / "hub.toml").write_text(HUB)
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_ETAG_TIMEOUT="3")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "fibctl", "data", "prepare", "hub.toml", "--data", "out"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert time.monotonic() - start < 15  # the hub's own retries took 25 s
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("error: cannot reach the Hugging Face hub at http://127.0.0.1:9")
    assert "roneneldan/TinyStories" in line and 'kind = "local"' in line and "Retry" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hub.toml"]


def test_a_documents_own_end_of_text_marker_is_its_text(tmp_path):
    # GPT-era corpora hold the marker literally; as the end-of-text id it would cut one document in two
    docs = [f"story {i} 東京 مرحبا 👩‍👩‍👧 <|endoftext|> and after it, part two." for i in range(40)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    recipe = parse_recipe({"vocab_size": 300, "train_tokens": 100_000, "sources": [
        {"name": "a", "kind": "local", "format": "json", "files": [str(tmp_path / "a.jsonl")], "share": 1}]})
    manifest = prepare(recipe, tmp_path / "out").manifest
    assert [text for text, _ in _documents(tmp_path / "out", "train")] == docs
    assert manifest.sources["a"]["train_documents"] == len(docs)


def test_the_same_corpus_prepared_elsewhere_is_the_same_data(corpora, built, tmp_path):
    """The corpus copied to another disk and touched prepares again (its inputs hash, of paths
    and times, changed) into the same streams: the data's hash, which runs and checkpoints
    record and `eval` and a resume check, is the same, so the runs trained on it stay usable."""
    import os
    import shutil

    moved = tmp_path / "moved"
    shutil.copytree(corpora, moved, ignore=shutil.ignore_patterns("out"))
    os.utime(moved / "books" / "b00.txt")
    again = load_manifest(prepare(load_recipe(_recipe_file(moved)), moved / "out").manifest.data_dir)
    first = load_manifest(built)
    assert again.inputs_hash != first.inputs_hash
    assert again.data_hash == first.data_hash and again.holds(first.data_hash)
    assert (again.data_dir / "train.bin").read_bytes() == (built / "train.bin").read_bytes()


@pytest.mark.parametrize("body, said", [
    ('name = "r"\n', "recipe has no [[sources]]"),
    ('train_tokens = 1000\n[[sources]]\nname = "web"\nkind = "nope"\n', "source 'web': kind 'nope' is not one of"),
    ('train_tokens = 1000\n[[sources]]\nkind = "local"\n', "source 1 has no name"),
    ('train_tokens = 1000\n[[sources]]\nname = "web"\n', "source 'web' has no kind: give kind = one of hub,"),
])
def test_a_recipe_file_s_error_names_the_file(tmp_path, body, said):
    """`fibctl data prepare sub/r.toml` said "recipe has no [[sources]]" without naming which
    file, though a recipe may be named folders away or among several."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "r.toml").write_text(body)
    done = subprocess.run([sys.executable, "-m", "fibctl", "data", "prepare", "sub/r.toml", "--data", "out"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith(f"error: sub/r.toml: {said}"), done.stderr
    assert len(done.stderr.splitlines()) == 1 and not (tmp_path / "out").exists()
