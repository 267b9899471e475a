"""`fibctl sample`: text from a trained run's checkpoint, decoded by its tokenizer; greedy is
the model's argmax step by step, a seed its draws; it changes no file; bad input is one line."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from typer.testing import CliRunner

from fibctl.cli import app
from fibctl.data.prepare import prepare
from fibctl.data.recipe import load_recipe
from fibctl.data.streams import load_manifest
from fibctl.flows.worker import WorkerOptions, work
from fibctl.hashes import short_hash
from fibctl.model import FibLM
from train_helpers import Quiet, micro_run, queued_db

torch.set_num_threads(1)

# the `generated` source's stories and sums, tokenized as `micro` embeds them (vocab 512)
RECIPE = """name = "gen"
vocab_size = 512
train_tokens = 20000
heldout_tokens = 4000
tokenizer_sample_chars = 20000

[[sources]]
name = "stories"
kind = "generated"
documents = 2000
share = 1
heldout = "stories_val"
heldout_fraction = 0.1
"""
PROMPT = "Once upon a time, Iris"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A prepared data folder with a real tokenizer, a `micro` run per schedule that matters here
    (fixed, learned, dense: 20 steps of T=64) and one never trained."""
    root = tmp_path_factory.mktemp("sample")
    (root / "gen.toml").write_text(RECIPE)
    data = prepare(load_recipe(root / "gen.toml"), root / "data").manifest.data_dir
    short = dict(steps=20, eval_interval=20, checkpoint_interval=20)
    engine = queued_db(root / "r.db", *(micro_run(s, s, **short) for s in ("fixed", "learned", "dense")))
    work(engine, WorkerOptions(data_dir=data, runs_dir=root / "runs"), Quiet())
    queued_db(root / "r.db", micro_run("untrained", **short)).dispose()
    engine.dispose()
    return root


def fibctl(root: Path, *args: str, columns: int = 80):
    result = CliRunner().invoke(app, ["sample", *args, "--db", str(root / "r.db"), "--data", str(root / "data")],
                                env={"COLUMNS": str(columns)})
    return result


def sampled(root: Path, *args: str) -> dict:
    result = fibctl(root, *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def by_hand(root: Path, run: str, prompt: list[int], tokens: int, context: int) -> list[int]:
    """Greedy decoding computed here: the run's checkpoint in a model built at `context`, the
    argmax of its last logits over the last `context` tokens, one token at a time."""
    ckpt = torch.load(sorted((root / "runs" / run).glob("step_*.pt"))[-1], weights_only=True)
    model = FibLM(micro_run(run, run).model.with_length(context))
    model.load_state_dict(ckpt["model"])
    model.eval()
    vocab = load_manifest(root / "data").tokenizer_vocab
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(tokens):
            logits = model(torch.tensor([ids[-context:]]))[0, -1, :vocab]
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def tokenizer(root: Path) -> Tokenizer:
    return Tokenizer.from_file(str(root / "data" / "tokenizer.json"))


@pytest.mark.parametrize("run, context", [("fixed", 64), ("fixed", 8), ("fixed", 256), ("learned", 200),
                                          ("dense", 16)])
def test_greedy_is_the_argmax_of_the_models_logits_step_by_step(trained, run, context):
    """At the training length, in a window shorter than prompt and sample (the oldest tokens
    slide out), and rebuilt past the training length as eval rebuilds it."""
    out = sampled(trained, run, "--prompt", PROMPT, "--temperature", "0", "--tokens", "24",
                  "--context", str(context))
    prompt = tokenizer(trained).encode(PROMPT, add_special_tokens=False).ids
    assert out["prompt"]["ids"] == prompt[-context:] and out["context"] == context
    expected = by_hand(trained, run, prompt[-context:], 24, context)
    assert out["samples"][0]["ids"] == expected
    whole = tokenizer(trained).decode(prompt[-context:] + expected, skip_special_tokens=False)
    assert out["prompt"]["text"] + out["samples"][0]["text"] == whole


def test_the_same_seed_gives_the_same_text_and_another_seed_other_text(trained):
    draw = ("fixed", "--prompt", PROMPT, "--temperature", "1", "--top-k", "512", "--tokens", "40")
    first = sampled(trained, *draw, "--seed", "1")
    assert sampled(trained, *draw, "--seed", "1") == first
    other = sampled(trained, *draw, "--seed", "2")
    assert other["samples"][0]["ids"] != first["samples"][0]["ids"]
    # one generator draws the samples in turn: the first of two is the sample alone
    two = sampled(trained, *draw, "--seed", "1", "--samples", "2")
    assert two["samples"][0] == first["samples"][0] and two["samples"][1] != two["samples"][0]


def test_top_k_1_is_greedy_at_any_temperature(trained):
    greedy = sampled(trained, "fixed", "--prompt", PROMPT, "--temperature", "0", "--tokens", "30")
    for temperature in ("0.5", "3"):
        top1 = sampled(trained, "fixed", "--prompt", PROMPT, "--temperature", temperature, "--top-k", "1",
                       "--tokens", "30", "--seed", "7")
        assert top1["samples"] == greedy["samples"]


def test_json_shape(trained):
    out = sampled(trained, "fixed", "--tokens", "5", "--samples", "3", "--seed", "3")
    eos = load_manifest(trained / "data").eos_id
    assert set(out) == {"run", "step", "status", "context", "temperature", "top_k", "seed", "prompt", "samples"}
    assert (out["run"], out["step"], out["status"], out["context"]) == ("fixed", 20, "done", 64)  # T of micro
    assert (out["temperature"], out["top_k"], out["seed"]) == (0.8, 200, 3)
    # no prompt: a document's start, after the tokenizer's end-of-text
    assert out["prompt"] == {"text": "<|endoftext|>", "ids": [eos], "dropped_tokens": 0}
    assert len(out["samples"]) == 3
    for s in out["samples"]:
        assert set(s) == {"text", "ids"} and len(s["ids"]) == 5 and isinstance(s["text"], str)
        whole = tokenizer(trained).decode([eos] + s["ids"], skip_special_tokens=False)
        assert s["text"] == whole.removeprefix("<|endoftext|>")
    assert sampled(trained, "fixed", "--prompt", "", "--tokens", "1")["prompt"]["ids"] == [eos]


def test_a_prompt_longer_than_the_context_keeps_its_last_tokens_and_says_so(trained):
    ids = tokenizer(trained).encode(PROMPT, add_special_tokens=False).ids
    result = fibctl(trained, "fixed", "--prompt", PROMPT, "--context", "3", "--tokens", "2", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["prompt"]["ids"] == ids[-3:] and out["prompt"]["dropped_tokens"] == len(ids) - 3
    assert f"note: the prompt is {len(ids)} tokens, more than the context of 3: the samples continue its last 3" \
        in " ".join(result.stderr.split())


def test_the_prompt_comes_from_a_file_as_it_is(trained, tmp_path, monkeypatch):
    """Its line breaks as they are (\\r\\n was read as \\n), and a quoted `~` opening the
    path is the home folder, as in every path option (it was looked for in a folder named `~`)."""
    (tmp_path / "p.txt").write_bytes(f"{PROMPT}\r\nand\n".encode())
    monkeypatch.setenv("HOME", str(tmp_path))
    for path in (str(tmp_path / "p.txt"), "~/p.txt"):
        out = sampled(trained, "fixed", "--prompt-file", path, "--tokens", "3")
        assert out["prompt"]["text"] == PROMPT + "\r\nand\n"


def test_text_output_shows_the_prompt_then_each_sample_under_a_rule_within_80_columns(trained):
    result = fibctl(trained, "fixed", "--prompt", PROMPT, "--tokens", "60", "--samples", "2", "--seed", "5")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == "fixed at step 20, context 64 tokens: temperature 0.8, top-k 200, seed 5"
    assert lines[1] == f"prompt: {PROMPT}"
    rules = [i for i, line in enumerate(lines) if "sample 1 of 2" in line or "sample 2 of 2" in line]
    assert len(rules) == 2 and all(lines[i + 1].startswith(PROMPT) for i in rules)
    assert max(len(line) for line in lines) <= 80
    greedy = fibctl(trained, "fixed", "--temperature", "0", "--tokens", "3").stdout.splitlines()
    assert greedy[0] == "fixed at step 20, context 64 tokens: greedy"


def _digests(root: Path, readers: bool = False) -> dict[str, str]:
    """Every file's checksum; with `readers`, but for SQLite's shared-memory index and an empty
    write-ahead log, which a connection in this process leaves until the test ends."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not (readers and (
                p.name.endswith("-shm") or (p.name.endswith("-wal") and p.stat().st_size == 0)))}


def test_sampling_changes_no_file(trained):
    """The database, its folder (no -wal or -shm left), the checkpoints and the data: as they were,
    after samples and after refusals, by the real entry point."""
    before = _digests(trained)
    for args in (["fixed", "--tokens", "3"], ["learned", "--tokens", "2", "--context", "100", "--json"],
                 ["untrained"], ["nope"]):
        subprocess.run([sys.executable, "-m", "fibctl", "sample", *args, "--db", "r.db", "--data", "data"],
                       cwd=trained, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "COLUMNS": "80"})
    assert _digests(trained) == before


@pytest.fixture(scope="module")
def no_eos(trained):
    """A copy of the data folder whose tokenizer has no end-of-text token (its manifest's hash
    of it updated: the tokenizer is whole, it has nothing to start a document with)."""
    data = trained / "data_no_eos"
    shutil.copytree(trained / "data", data)
    text = (data / "tokenizer.json").read_text().replace("<|endoftext|>", "<|eot|>")
    (data / "tokenizer.json").write_text(text)
    manifest = json.loads((data / "manifest.json").read_text())
    (data / "manifest.json").write_text(json.dumps({**manifest, "tokenizer_hash": short_hash(text.encode())}))
    return data


@pytest.mark.parametrize("args, words", [
    (["nope"], "no run named 'nope' in the database"),
    (["fixd"], "did you mean 'fixed'?"),
    (["untrained"], "run 'untrained' has no checkpoint yet (status queued); train it first"),
    (["fixed", "--tokens", "0"], "--tokens 0 must be from 1 to 1,000,000"),
    (["fixed", "--tokens", "-3"], "--tokens -3 must be from 1"),
    (["fixed", "--temperature", "-0.5"], "--temperature -0.5 must be 0 (greedy) or more"),
    (["fixed", "--temperature", "nan"], "--temperature nan must be 0 (greedy) or more"),
    (["fixed", "--top-k", "0"], "--top-k 0 must be at least 1"),
    (["fixed", "--context", "0"], "--context 0 must be from 1 to 1,048,576 tokens"),
    (["fixed", "--samples", "0"], "--samples 0 must be from 1 to 1,000"),
    (["fixed", "--seed", "-1"], "--seed = -1 must be an integer from 0 to 2**32 - 1"),
    (["fixed", "--prompt", "a", "--prompt-file", "p.txt"], "give --prompt or --prompt-file, not both"),
    (["fixed", "--prompt-file", "{bad}"], "is not UTF-8 text (byte 1)"),
    (["fixed", "--prompt-file", "{missing}"], "No such file or directory"),
    (["fixed", "--prompt", "ab\udcffc"], "--prompt is not UTF-8 text (byte 2)"),  # $'ab\xffc': was a traceback
    (["fixed", "--prompt-file", "{huge}"], "holds more than 64 MiB; give the prompt's end"),  # was read whole
    (["fixed", "--prompt-file", "/dev/zero"], "holds more than 64 MiB"),  # was a MemoryError
    (["fixed", "--prompt-file", ""], "--prompt-file is empty; name a file holding the prompt"),
    (["fixed", "--data", "{no_eos}"], "tokenizer.json has no <|endoftext|> token to start a sample from; give a "
                                      "prompt (--prompt or --prompt-file)"),
    (["fixed", "--data", "{no_eos}", "--prompt", "Once"], "was trained on data"),  # another tokenizer
    (["fixed", "--runs-dir", "{nowhere}"], "does not exist; give the --runs-dir it was trained in"),
    (["fixed", "--device", "tpu"], "unknown device 'tpu'"),
])
def test_bad_input_is_one_line_exit_2_and_changes_nothing(trained, no_eos, tmp_path, args, words, capsys,
                                                           monkeypatch):
    from fibctl.cli import main

    (tmp_path / "bad.txt").write_bytes(b"a\xff")
    with open(tmp_path / "huge.txt", "wb") as f:  # sparse: 64 MiB and a byte of NULs, written in no time
        f.truncate(64 * 2**20 + 1)
    paths = {"bad": str(tmp_path / "bad.txt"), "missing": str(tmp_path / "missing.txt"), "no_eos": str(no_eos),
             "huge": str(tmp_path / "huge.txt"),
             "nowhere": str(tmp_path / "runs")}
    before = _digests(trained, readers=True)
    monkeypatch.chdir(trained)
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setattr(sys, "argv", ["fibctl", "sample", *(a.format(**paths) for a in args),
                                      *([] if "--data" in args else ["--data", "data"]), "--db", "r.db"])
    with pytest.raises(SystemExit) as exit_:  # the entry point in this process: no new Python to start
        main()
    out = capsys.readouterr()
    assert exit_.value.code == 2, out
    assert "Traceback" not in out.err and out.out == ""
    assert len(out.err.strip().splitlines()) == 1 and words in out.err, out.err
    assert _digests(trained, readers=True) == before


class _Fixed(torch.nn.Module):
    """A stand-in model whose next-token logits are `logits` at every position."""

    def __init__(self, logits):
        super().__init__()
        self.logits = torch.tensor(logits)
        self.seen = []

    def forward(self, x):
        self.seen.append(x.shape[1])
        return self.logits.expand(x.shape[0], x.shape[1], -1)


def test_draws_keep_to_the_top_k_and_the_tokenizers_ids_and_the_context():
    """Ids at or past `vocab` (embedded, but the tokenizer has none) are never drawn; top-k
    keeps the k likeliest; temperature 0 takes the argmax; each pass sees the last `context`."""
    from fibctl.sampling import generate

    model = _Fixed([0.0, 1.0, 2.0, 3.0, 9.0])  # id 4: likeliest, but past a tokenizer of 4 ids
    g = torch.Generator().manual_seed(0)
    drawn = generate(model, [0, 1, 2], 200, 4, torch.device("cpu"), temperature=5.0, vocab=4, generator=g)
    assert set(drawn) == {0, 1, 2, 3} and model.seen[:3] == [3, 4, 4]
    assert set(generate(model, [0], 100, 4, torch.device("cpu"), temperature=5.0, top_k=2, vocab=4,
                        generator=g)) == {2, 3}
    assert generate(model, [0], 3, 4, torch.device("cpu"), temperature=0.0, vocab=4) == [3, 3, 3]
    assert generate(model, [0], 3, 4, torch.device("cpu"), temperature=0.0) == [4, 4, 4]


def test_an_imported_run_is_said_to_have_no_weights_not_to_need_training(trained, tmp_path):
    """A run import-study recorded (its source the study's file, no checkpoint) was told "train
    it first", which it cannot be: it was trained elsewhere."""
    db = tmp_path / "r.db"
    shutil.copy(trained / "r.db", db)
    with sqlite3.connect(db) as con:
        con.execute("UPDATE runs SET checkpoint_path = NULL, source = 'fib.db' WHERE name = 'fixed'")
    con.close()
    result = CliRunner().invoke(app, ["sample", "fixed", "--db", str(db), "--data", str(trained / "data")])
    assert str(result.exception) == ("run 'fixed' was imported from 'fib.db', its numbers without its weights: "
                                     "it has no checkpoint"), result.output  # main says it in one line, exit 2


def test_a_prompt_ending_in_a_replacement_character_keeps_it_out_of_the_samples(trained):
    """The prompt's text and a sample's read as the decoded ids: a prompt ending in a real
    U+FFFD gave it to each sample's text as well (taken for a character cut short)."""
    for prompt in ("Once upon a time", "Iris \ufffd", "\ufffd\ufffd"):
        out = sampled(trained, "fixed", "--prompt", prompt, "--tokens", "4", "--temperature", "0")
        assert out["prompt"]["text"] == prompt
        for s in out["samples"]:
            whole = tokenizer(trained).decode(out["prompt"]["ids"] + s["ids"], skip_special_tokens=False)
            assert out["prompt"]["text"] + s["text"] == whole


def test_a_long_prompt_is_encoded_in_pieces_as_prepare_encodes_a_document(trained, monkeypatch):
    """Only its last --context tokens are used, but a prompt is encoded whole-text exact: in
    data prepare's pieces, the encoder's memory bounded (a 13 MB prompt encoded at once took
    4.9 GB); its ids are the whole text's."""
    import fibctl.data.prepare as prep
    from fibctl.data.streams import DataManifest

    texts = []

    class Recording:  # the tokenizer, noting each text it is given
        def __init__(self, tokenizer):
            self.tokenizer = tokenizer

        def __getattr__(self, name):
            return getattr(self.tokenizer, name)

        def encode(self, text, *args, **kwargs):
            texts.append(text)
            return self.tokenizer.encode(text, *args, **kwargs)

        def encode_batch(self, batch, *args, **kwargs):
            texts.extend(batch)
            return self.tokenizer.encode_batch(batch, *args, **kwargs)

    load = DataManifest.load_tokenizer
    monkeypatch.setattr(DataManifest, "load_tokenizer", lambda self: Recording(load(self)))
    monkeypatch.setattr(prep, "ENCODE_PIECE_CHARS", 40)
    monkeypatch.setattr(prep, "ENCODE_CHARS", 400)
    prompt = " ".join(f"{PROMPT} said {k}." for k in range(60))
    out = sampled(trained, "fixed", "--prompt", prompt, "--tokens", "2", "--context", "1000")
    assert max(map(len, texts)) <= 40
    ids = tokenizer(trained).encode(prompt).ids
    assert len(ids) < 1000 and out["prompt"]["ids"] == ids


def test_a_probe_run_is_refused_in_samples_words(tmp_path):
    """A probe run has no tokenizer nor text: refused, naming sample (it named eval)."""
    db = str(tmp_path / "p.db")
    assert CliRunner().invoke(app, ["probe", "--quick", "--db", db]).exit_code == 0
    result = CliRunner().invoke(app, ["sample", "probe_d2_uniform_s0_200steps", "--db", db])
    assert str(result.exception) == ("run 'probe_d2_uniform_s0_200steps' is a probe run: its worker scored it on "
                                     "the probe's task (fibctl report table2); fibctl sample writes text, with a "
                                     "text model")


def test_a_tiny_temperature_draws_the_likeliest_token():
    """Logits divided by 1e-300 overflowed to inf, softmax gave nan and multinomial raised (a
    traceback from `fibctl sample --temperature 1e-300`); the likeliest token is drawn instead."""
    from fibctl.sampling import generate

    model = _Fixed([0.0, 1.0, 2.0, 3.0, 9.0])
    for temperature in (1e-300, 5e-324, 1e-30):
        for top_k in (None, 2):
            assert generate(model, [0], 3, 4, torch.device("cpu"), temperature=temperature, top_k=top_k) == [4] * 3


def test_a_run_not_finished_is_sampled_at_its_newest_checkpoint_with_evals_note(trained, tmp_path):
    db = tmp_path / "r.db"
    shutil.copy(trained / "r.db", db)
    with sqlite3.connect(db) as con:
        con.execute("UPDATE runs SET status = 'queued' WHERE name = 'fixed'")
    con.close()
    result = CliRunner().invoke(app, ["sample", "fixed", "--tokens", "2", "--json", "--db", str(db),
                                      "--data", str(trained / "data")])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["status"] == "queued"
    assert "note: run 'fixed' is not finished (status queued): sampling its checkpoint at step 20 of 20" \
        in " ".join(result.stderr.split())
