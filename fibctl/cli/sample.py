"""`fibctl sample`: text from a trained run, as nanoGPT's sample.py prints it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.rule import Rule
from rich.text import Text

from fibctl.cli import app
from fibctl.cli.common import DEFAULT_DB, DbOption, console, err_console, folder_value, plain, seed_value
from fibctl.cli.train import DEFAULT_DATA, CheckpointsDirOption, DataOption, DeviceOption, ThreadsOption
from fibctl.errors import FibctlError, shown_path


# far past any context's worth of text (MAX_LENGTH tokens): /dev/zero read whole was a MemoryError
PROMPT_FILE_MAX = 64 * 2**20


def _prompt(text: str | None, file: Path | None) -> str | None:
    if text is not None and file is not None:
        raise FibctlError("give --prompt or --prompt-file, not both")
    if file is None:
        if text is not None:
            _check_utf8(text)
        return text
    with open(file, "rb") as f:  # bytes: a \r\n stays, as the help says "as it is"
        raw = f.read(PROMPT_FILE_MAX + 1)
    if len(raw) > PROMPT_FILE_MAX:
        raise FibctlError(f"--prompt-file {shown_path(file)} holds more than {PROMPT_FILE_MAX // 2**20} MiB; "
                          "give the prompt's end (the samples see only its last --context tokens)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FibctlError(f"--prompt-file {shown_path(file)} is not UTF-8 text (byte {e.start:,})") from None


def _check_utf8(text: str) -> None:
    """Bytes not UTF-8 in the command line reach Python as lone surrogates, which the
    tokenizer refused with a traceback."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        at = len(text[:e.start].encode("utf-8", "surrogateescape"))  # in the command line's bytes
        raise FibctlError(f"--prompt is not UTF-8 text (byte {at:,})") from None


@app.command("sample")
def sample_cmd(
    name: Annotated[str, typer.Argument(help="The run, as `fibctl queue ls` shows it.", show_default=False)],
    prompt: Annotated[Optional[str], typer.Option(
        "--prompt", help="Text the samples continue (default: the start of a document, after the tokenizer's "
        "end-of-text).")] = None,
    prompt_file: Annotated[Optional[Path], typer.Option(
        "--prompt-file", metavar="<path>", parser=folder_value("--prompt-file", "a file holding the prompt"),
        help="Read the prompt from this UTF-8 file, as it is.")] = None,
    tokens: Annotated[int, typer.Option("--tokens", help="New tokens per sample.")] = 100,
    temperature: Annotated[float, typer.Option(
        "--temperature", help="Divides the logits before the draw; 0 takes the most likely token (greedy).")] = 0.8,
    top_k: Annotated[Optional[int], typer.Option(
        "--top-k", help="Draw among the k most likely tokens only, as nanoGPT does (1 is greedy; a k of the "
        "vocabulary's size or more draws among all).")] = 200,
    seed: Annotated[int, typer.Option("--seed", callback=seed_value,
                                      help="Seeds the draws: the same seed gives the same text.")] = 1337,
    samples: Annotated[int, typer.Option("--samples", help="How many samples, drawn one after another.")] = 1,
    context: Annotated[Optional[int], typer.Option(
        "--context", help="Tokens the model sees (default: the run's training length); longer rebuilds it at "
        "that length, as fibctl eval does.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead, for scripts.")] = False,
    db: DbOption = DEFAULT_DB,
    data: DataOption = DEFAULT_DATA,
    runs_dir: CheckpointsDirOption = None,
    device: DeviceOption = None,
    threads: ThreadsOption = None,
) -> None:
    """Text from a trained run, as nanoGPT's sample.py writes it.

    The run's final checkpoint (the one fibctl eval measures) in its model rebuilt at the
    context length, decoded by its tokenizer. Prints the prompt (dim) and what the model wrote
    after it, each sample under a rule. Reads the database, the checkpoint and the data folder;
    writes nothing.

    Example: fibctl sample fib_stagger_w8 --prompt "Once upon a time" --tokens 50 --context 512"""
    from fibctl.db.engine import connect_readonly
    from fibctl.device import setup_process
    from fibctl.flows.sampling import check_options, sample

    check_options(tokens, temperature, top_k, samples, context)  # before the database is opened
    text = _prompt(prompt, prompt_file)
    setup_process(device, threads)
    note = lambda line: err_console.print(plain(f"note: {line}"), soft_wrap=True)  # noqa: E731
    progress = Progress(TextColumn("sampling"), BarColumn(bar_width=20), MofNCompleteColumn(),
                        TimeElapsedColumn(), TimeRemainingColumn(), console=err_console, transient=True,
                        disable=not err_console.is_terminal)
    with progress:
        task = progress.add_task("", total=tokens * samples)
        out = sample(connect_readonly(db), name, data_dir=data, prompt=text, tokens=tokens,
                     temperature=temperature, top_k=top_k, seed=seed, samples=samples, context=context,
                     device=device, runs_dir=runs_dir, on_note=note,
                     on_token=lambda _: progress.advance(task))
    if json_out:
        from fibctl.cli.db import print_json

        return print_json({
            "run": out.run, "step": out.step, "status": out.status, "context": out.context,
            "temperature": temperature, "top_k": top_k, "seed": seed,
            "prompt": {"text": out.prompt_text, "ids": out.prompt_ids, "dropped_tokens": out.prompt_dropped},
            "samples": [{"text": s.text, "ids": s.ids} for s in out.samples]})
    draw = "greedy" if temperature == 0 else f"temperature {temperature:g}" + (
        f", top-k {top_k}" if top_k is not None else "") + f", seed {seed}"
    console.print(plain(f"{out.run} at step {out.step:,}, context {out.context:,} tokens: {draw}"))
    console.print(Text("prompt: ") + plain(out.prompt_text or "(none)", style="dim"))
    for k, s in enumerate(out.samples, 1):
        console.print(Rule(f"sample {k} of {len(out.samples)}", style="dim"))
        console.print(plain(out.prompt_text, style="dim") + plain(s.text))
