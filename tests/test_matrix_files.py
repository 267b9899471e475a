"""User-written matrix files: every field's type, the limits of what can train and be recorded,
odd files, names that collide, and text a terminal would obey."""

from __future__ import annotations

import os
import re
import sys
from importlib import resources

import pytest

from fibctl.config import ConfigError, RunConfig
from fibctl.errors import FibctlError
from fibctl.matrix import load_matrix, shipped_matrices
from fibctl.probe.cells import PROBE_MATRIX

MICRO = 'preset = "micro"'
RUN = '[[runs]]\nname = "a"\nschedule = "fixed"\nwindow = 4\n'


def write(tmp_path, text: str, name: str = "m.toml") -> str:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def refused(path: str, *words: str) -> str:
    with pytest.raises(FibctlError) as e:
        load_matrix(path)
    message = str(e.value)
    assert "\n" not in message and all(w in message for w in words), message
    return message


@pytest.mark.parametrize("head, run, field, kind", [
    ('preset = ["micro"]', "", "`preset`", "must be a string, not an array"),
    ("preset = { a = 1 }", "", "`preset`", "must be a string, not a table"),
    ("description = 5", "", "`description`", "must be a string, not an integer"),
    ("init_seed = true", "", "`init_seed`", "must be an integer, not a boolean"),
    ("init_seed = 4.0", "", "`init_seed`", "must be an integer, not a float"),
    ("", "seed = true", "`seed`", "must be an integer, not a boolean"),
    ("", 'seed = "42"', "`seed`", "must be an integer, not a string"),
    ("", "seed = 1979-05-27", "`seed`", "must be an integer, not a date"),
    ("", "init_seed = [1]", "`init_seed`", "must be an integer, not an array"),
    ("", "base = 1", "`base`", "must be a string, not an integer"),
    ("", "train = 5", "train", "must be a table"),
    ("", "train = { steps = true }", "train.steps = True", "must be an integer"),
    ("", "train = { steps = 10.0 }", "train.steps = 10.0", "must be an integer"),
    ("", "train = { lr = true }", "train.lr = True", "must be a finite number"),
    ("", 'train = { lr = "1e-3" }', "train.lr = '1e-3'", "must be a finite number"),
    ("", "train = { beta1 = [0.9] }", "train.beta1 = [0.9]", "must be a finite number"),
    ("", 'train = { optimizer = ["adamw"] }', "train.optimizer = ['adamw']", "must be a string"),
])
def test_every_field_of_a_matrix_file_is_type_checked(tmp_path, head, run, field, kind):
    path = write(tmp_path, f"[matrix]\n{head or MICRO}\n\n{RUN}{run}\n")
    refused(path, f"matrix file {path}: ", field, kind)


@pytest.mark.parametrize("body", [
    '[[runs]]\nname = 1\nschedule = "dense"\n', '[[runs]]\nname = "a"\nschedule = ["dense"]\n',
    '[[runs]]\nname = "a"\nschedule = "fixed"\nwindow = true\n',
    '[[runs]]\nname = "a"\nschedule = "fixed"\nwindow = 8.0\n',
])
def test_names_schedules_and_windows_of_the_wrong_type(tmp_path, body):
    path = write(tmp_path, body)
    refused(path, f"matrix file {path}: run 1", "must be a", ", not a")


@pytest.mark.parametrize("override, words", [
    ("batch_size = 1000000000000", "train.batch_size = 1000000000000 is too large: at most 2**31 - 1"),
    ("steps = 99999999999999999999999", "train.steps = 99999999999999999999999 is too large"),
    ("eval_tokens = 2147483648", "train.eval_tokens = 2147483648 is too large"),
    ("lr = 1e300", "train.lr = 1e+300 is too large: the model trains in float32"),
    ("weight_decay = 1e39", "train.weight_decay = 1e+39 is too large"),
    ("grad_clip = 1e39", "train.grad_clip = 1e+39 is too large"),
    ("lr = 1e-320", "train.lr = 1e-320 is too small: it is 0 in float32"),
    ("min_lr_ratio = 7.006492321624085e-46", "train.min_lr_ratio = 7.006492321624085e-46 is too small"),  # 2**-150
    # micro: T = 64; runs.tokens_trained is 64-bit
    ("steps = 2147483647, batch_size = 2147483647, grad_accum = 4",
     "x batch_size x grad_accum x T = 1,180,591,619,617,899,675,904 tokens is too large: at most 2**63 - 1"),
])
def test_numbers_too_large_to_train_or_record_are_refused(tmp_path, override, words):
    path = write(tmp_path, f'[matrix]\npreset = "micro"\n\n{RUN}train = {{ {override} }}\n')
    message = refused(path, f"matrix file {path}: run a: ", words)
    assert "must be an integer" not in message


def test_the_largest_numbers_that_fit_are_taken(tmp_path):
    # T = 64: W up to 62; steps to 2**31 - 1 (2**40 tokens: past 32 bits, recorded in 64);
    # the lr float32's largest, the weight decay a hair above what rounds to 0
    path = write(tmp_path, '[matrix]\npreset = "micro"\ninit_seed = 4294967295\n\n[[runs]]\nname = "a"\n'
                           'schedule = "stagger"\nwindow = 62\nseed = 4294967295\n'
                           'train = { steps = 2147483647, lr = 3.4e38, weight_decay = 7.006493e-46 }\n')
    (config,) = load_matrix(path).resolve()
    assert (config.model.window, config.train.steps, config.init_seed, config.seed) == (
        62, 2**31 - 1, 2**32 - 1, 2**32 - 1)


@pytest.mark.parametrize("where, value", [("[matrix]", "init_seed = 99999999999999999999"),
                                          ("run 1 (a)", "seed = 99999999999999999999"),
                                          ("run 1 (a)", "init_seed = 4294967296")])
def test_a_seed_too_large_says_so(tmp_path, where, value):
    head, run = (value, "") if where == "[matrix]" else ("", value)
    path = write(tmp_path, f'[matrix]\npreset = "micro"\n{head}\n\n{RUN}{run}\n')
    message = refused(path, f"{where}: `{value.split()[0]}` = {value.split()[-1]} is too large: at most 2**32 - 1")
    assert "must be an integer" not in message


@pytest.mark.parametrize("window", [63, 64, 9223372036854775807, 99999999999999999999])
def test_a_window_that_reaches_the_training_length_is_refused(tmp_path, window):
    """At T = 64 a window of W >= 63 attends to every distance: dense attention named fib fixed."""
    path = write(tmp_path, f'[matrix]\npreset = "micro"\n\n[[runs]]\nname = "a"\nschedule = "fixed"\n'
                           f"window = {window}\n")
    refused(path, f"run a: window W={window} is too large: at most T - 2 = 62", "T=64", "dense attention")


def test_a_window_is_checked_at_the_preset_a_matrix_is_queued_at(tmp_path):
    matrix = load_matrix(write(tmp_path, f'[matrix]\npreset = "tiny"\n\n{RUN.replace("4", "100")}'))  # T = 128
    assert matrix.resolve()[0].model.window == 100
    with pytest.raises(ConfigError, match=r"^run a: window W=100 is too large: at most T - 2 = 62"):
        matrix.resolve(preset="micro")
    with pytest.raises(FibctlError, match="^unknown preset 'huge'"):  # the preset's problem, no run's
        matrix.resolve(preset="huge")


def test_the_window_limit_is_the_runs_not_the_models():
    """A model is rebuilt at other lengths (evaluation, `fibctl model --length`): only a run's
    training length bounds its window, and dense runs carry none."""
    RunConfig.resolve("d", "m", "micro", schedule="dense", window=0)
    config = RunConfig.resolve("a", "m", "micro", schedule="fixed", window=62)
    assert config.model.with_length(8).validate().window == 62


def test_a_fifo_or_a_device_is_not_a_regular_file(tmp_path):
    os.mkfifo(tmp_path / "x.toml")  # nothing writes to it: reading it would wait forever
    (tmp_path / "z.toml").symlink_to("/dev/zero")
    for name in ("x.toml", "z.toml"):
        assert refused(str(tmp_path / name)) == f"{tmp_path / name} is not a regular file, not a matrix file"
    refused(str(tmp_path / "missing.toml"), "no matrix file")


@pytest.mark.parametrize("name", [*shipped_matrices(), PROBE_MATRIX])
def test_a_file_named_like_fibctls_own_matrix_is_refused(tmp_path, name):
    path = write(tmp_path, f'[matrix]\npreset = "micro"\n\n{RUN}', f"sub/{name}.toml")
    refused(path, f"matrix file {path}: '{name}' names a matrix of fibctl's own; rename the file")


def test_the_shipped_file_itself_may_be_named_by_its_path(tmp_path):
    shipped = str(resources.files("fibctl.matrices") / "demo.toml")
    (tmp_path / "demo.toml").symlink_to(shipped)
    for path in (shipped, str(tmp_path / "demo.toml")):
        assert [c.name for c in load_matrix(path).resolve()] == [c.name for c in load_matrix("demo").resolve()]


def test_run_names_that_differ_only_by_case_are_refused(tmp_path):
    path = write(tmp_path, RUN + RUN.replace('"a"', '"b"') + RUN.replace('"a"', '"A"'))
    refused(path, f"matrix file {path}: run names 'a' and 'A' differ only by case")


@pytest.mark.parametrize("description, shown", [
    ("\\u001b[31mred", "\\x1b"), ("\\u001b]0;title\\u0007", "\\x1b"), ("a\\rb", "\\r"),
    ("a\\nb", "\\n"), ("\\u202eevil", "\\u202e"), ("\\u009b31m", "\\x9b")])
def test_a_description_a_terminal_would_obey_is_refused(tmp_path, description, shown):
    path = write(tmp_path, f'[matrix]\npreset = "micro"\ndescription = "{description}"\n\n{RUN}')
    message = refused(path, f"matrix file {path}: [matrix]: `description` holds the control character {shown};")
    assert not re.search("[\x00-\x1f\x7f-\x9f]", message)


def test_matrix_show_of_a_bad_file_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    from fibctl.cli import main
    path = write(tmp_path, f'[matrix]\npreset = ["micro"]\ndescription = "\\u001b[31m"\n\n{RUN}')
    monkeypatch.setattr(sys, "argv", ["fibctl", "matrix", "show", path])
    with pytest.raises(SystemExit) as exit_:
        main()
    out = capsys.readouterr()
    assert exit_.value.code == 2 and out.out == "" and "\x1b" not in out.err
    assert out.err.strip().splitlines() == [f"error: matrix file {path}: [matrix]: `preset` must be a string, "
                                            "not an array"]
