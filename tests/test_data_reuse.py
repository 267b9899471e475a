"""`fibctl data prepare` reuses a folder only when its files still match its manifest; `data show`
and `train` refuse a manifest that does not describe its streams; a --data folder that cannot
be written is named, not the lock file beside it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from cli_helpers import refused
from fibctl.cli import app
import fibctl.data.prepare as prepare_module
from fibctl.data.prepare import prepare
from fibctl.data.recipe import load_recipe
from train_helpers import generated_recipe


def _recipe(root: Path) -> Path:
    return generated_recipe(root / "gen.toml")


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> dict[str, bytes]:
    """An untouched build of the recipe: its files' bytes."""
    root = tmp_path_factory.mktemp("whole")
    return _files(prepare(load_recipe(_recipe(root)), root / "d").manifest.data_dir)


def _past_the_vocabulary(d: Path) -> None:
    ids = np.fromfile(d / "train.bin", dtype=np.uint16)
    ids[7] = 9999  # the same size; `data show` and training refuse it
    ids.tofile(d / "train.bin")


def _shuffled(d: Path) -> None:
    ids = np.fromfile(d / "stories_val.bin", dtype=np.uint16)
    np.random.default_rng(0).shuffle(ids)  # the same size and ids: only its hash tells
    ids.tofile(d / "stories_val.bin")


def _tokenizer_replaced(d: Path) -> None:
    (d / "tokenizer.json").write_text((d / "tokenizer.json").read_text().replace("<|endoftext|>", "<|eot|>"))


def _no_hashes(d: Path) -> None:  # a manifest from before they were recorded: nothing to check against
    manifest = json.loads((d / "manifest.json").read_text())
    (d / "manifest.json").write_text(json.dumps({**manifest, "stream_hashes": {}}))


@pytest.mark.parametrize("damage, why", [
    (_past_the_vocabulary, "train.bin no longer matches the hash its manifest records"),
    (_shuffled, "stories_val.bin no longer matches the hash its manifest records"),
    (_tokenizer_replaced, "tokenizer.json no longer matches the hash its manifest records"),
    (lambda d: (d / "stories_val.bin").unlink(), "stories_val.bin is missing"),
    (lambda d: (d / "train.bin").write_bytes(b"\0\0"), "train.bin holds 2 bytes where its manifest records 6,000"),
    (_no_hashes, "its manifest records no stream hashes to check its files against (an older fibctl wrote it)"),
])
def test_a_folder_changed_since_it_was_prepared_is_rebuilt_not_reused(tmp_path, whole, damage, why):
    """Same recipe, same inputs, but the files are not the ones the manifest vouches for: they
    were reused (and trained and scored on) as long as each had the size recorded."""
    recipe, out = load_recipe(_recipe(tmp_path)), tmp_path / "d"
    prepare(recipe, out)
    damage(out)
    notes = []
    result = prepare(recipe, out, note=notes.append)
    assert not result.reused and not result.finished
    assert notes == [f"{out}: {why}; rebuilding it"]
    assert _files(out) == whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "gen.toml"]
    for split in result.manifest.splits:  # what `data show` and training check
        result.manifest.stream(split)
    again = []
    assert prepare(recipe, out, note=again.append).reused and again == []


def test_cli_says_in_one_line_why_it_rebuilds(tmp_path, whole):
    _recipe(tmp_path)
    runner = CliRunner()
    assert runner.invoke(app, ["data", "prepare", str(tmp_path / "gen.toml"), "--data", str(tmp_path / "d"),
                               "--plain"]).exit_code == 0
    _shuffled(tmp_path / "d")
    done = runner.invoke(app, ["data", "prepare", str(tmp_path / "gen.toml"), "--data", str(tmp_path / "d"),
                               "--plain"], env={"COLUMNS": "60"})
    assert done.exit_code == 0, done.output
    assert done.stderr.splitlines() == [f"note: {tmp_path / 'd'}: stories_val.bin no longer matches the hash "
                                        "its manifest records; rebuilding it"]
    assert "prepared recipe 'gen'" in done.stdout and "reused" not in done.stdout
    assert _files(tmp_path / "d") == whole


def test_data_show_refuses_a_folder_without_its_tokenizer_and_leaves_it_as_it_is(tmp_path, monkeypatch, capsys):
    out = tmp_path / "d"
    prepare(load_recipe(_recipe(tmp_path)), out)
    (out / "tokenizer.json").unlink()
    before = _snapshot(tmp_path)
    line = refused(monkeypatch, capsys, "data", "show", str(out))
    assert line == f"error: {out}: its tokenizer tokenizer.json is missing; prepare the data again\n"
    assert _snapshot(tmp_path) == before


def test_train_refuses_a_manifest_of_another_dtype(tmp_path, monkeypatch, capsys):
    """The streams are read as uint16 whatever the manifest says: training on them as such
    would train on other numbers than it names."""
    from train_helpers import micro_run, queued_db, write_data

    data = write_data(tmp_path / "data", train_tokens=1_000, heldout_tokens=100)
    manifest = json.loads((data / "manifest.json").read_text())
    (data / "manifest.json").write_text(json.dumps({**manifest, "dtype": "bogus"}))
    queued_db(tmp_path / "r.db", micro_run("run")).dispose()
    line = refused(monkeypatch, capsys, "train", "run", "--db", str(tmp_path / "r.db"), "--data", str(data),
                   "--runs-dir", str(tmp_path / "runs"), "--device", "cpu")
    assert f"{data / 'manifest.json'} is not a valid data manifest" in line
    assert "dtype 'bogus' is not uint16" in line


@pytest.mark.parametrize("data, line", [
    # the lock file beside the folder was named: `/proc/.x.lock: No such file or directory`
    ("/proc/x", "error: --data /proc/x: cannot create files in /proc, where it is built: No such file or directory"),
    ("{tmp}/afile/x", "error: --data {tmp}/afile/x: cannot create its parent folder {tmp}/afile: File exists"),
])
def test_a_data_folder_that_cannot_be_written_is_named(tmp_path, monkeypatch, capsys, data, line):
    if not Path("/proc").is_dir() and data.startswith("/proc"):
        pytest.skip("no /proc here")
    (tmp_path / "afile").write_text("a file, not a folder\n")
    data, line = data.format(tmp=tmp_path), line.format(tmp=tmp_path)
    assert refused(monkeypatch, capsys, "data", "prepare", str(_recipe(tmp_path)), "--data", data,
                   "--plain").strip() == line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "gen.toml"]


def test_a_data_folder_given_as_a_link_is_built_where_the_link_points(tmp_path, whole):
    """The build was renamed onto the link itself: a link to a folder became a folder (the
    target kept the old data, a hidden `.link.old-*` link was left), and a link to nothing
    failed with "Not a directory" once the whole build was done."""
    recipe = load_recipe(_recipe(tmp_path))
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    prepare(recipe, tmp_path / "link")
    assert (tmp_path / "link").is_symlink() and _files(tmp_path / "real") == whole
    (tmp_path / "dangling").symlink_to(tmp_path / "made" / "here")
    result = CliRunner().invoke(app, ["data", "prepare", str(_recipe(tmp_path)), "--data", str(tmp_path / "dangling"),
                                      "--plain"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "dangling").is_symlink() and _files(tmp_path / "made" / "here") == whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "gen.toml", "link", "made", "real"]


def test_a_data_folder_given_as_a_loop_of_links_is_refused_before_the_build(tmp_path, monkeypatch, capsys):
    """A loop (`--data o1`, o1 -> o2 -> o1) was built whole, then refused by the rename onto
    the link: `.o1.partial-PID: Not a directory`, after what takes hours for `paper`."""
    (tmp_path / "o1").symlink_to("o2")
    (tmp_path / "o2").symlink_to("o1")
    monkeypatch.setattr(prepare_module, "_inputs_hash", lambda recipe: pytest.fail("the build began"))
    line = refused(monkeypatch, capsys, "data", "prepare", str(_recipe(tmp_path)), "--data", str(tmp_path / "o1"),
                   "--plain")
    assert line.strip() == f"error: --data {tmp_path / 'o1'} is a symlink loop; name the data folder itself"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gen.toml", "o1", "o2"]


def test_a_recipe_without_a_held_out_set_is_refused_before_anything_is_built(tmp_path, monkeypatch, capsys):
    """A recipe without a held-out set was prepared (hours, for a corpus) into data that `train`
    and `eval` then refused, having nothing to evaluate on: `prepare` refuses it at once,
    naming the key to add, and builds nothing."""
    recipe = _recipe(tmp_path)
    recipe.write_text("\n".join(line for line in recipe.read_text().splitlines() if not line.startswith("heldout")))
    line = refused(monkeypatch, capsys, "data", "prepare", str(recipe), "--data", str(tmp_path / "d"), "--plain")
    assert line.strip() == ("error: recipe 'gen' has no held-out set, which fibctl train and eval need: add "
                            "heldout = \"NAME\" to a source (e.g. heldout = \"stories_val\" in source 'stories')")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gen.toml"]


def test_a_quoted_tilde_on_the_command_line_is_the_home_folder(tmp_path, monkeypatch):
    """A recipe's globs read `~/corpus/*.txt` as the home folder, `fibctl slurm` its folders
    too, but `--data '~/d'` (or FIBCTL_DATA="~/d", which no shell expands) made a folder named
    `~` in the current one, and the recipe `'~/gen.toml'` was not found."""
    _recipe(tmp_path)
    (tmp_path / "cwd").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path / "cwd")
    done = CliRunner().invoke(app, ["data", "prepare", "~/gen.toml", "--data", "~/d", "--plain"])
    assert done.exit_code == 0, done.output
    assert (tmp_path / "d" / "manifest.json").is_file() and not any((tmp_path / "cwd").iterdir())
    monkeypatch.setenv("FIBCTL_DATA", "~/d")
    done = CliRunner().invoke(app, ["data", "show"])
    assert done.exit_code == 0 and "gen" in done.output, done.output
