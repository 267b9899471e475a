"""`fibctl sample`: text from a run's checkpoint, the one `fibctl eval` would measure, loaded
into the model rebuilt at the context length as eval rebuilds it (fibctl.flows.evaluation),
its ids drawn by fibctl.sampling and decoded by the run's tokenizer (the data folder's, which
its data hash names). It only reads: the database, the checkpoint and the data folder."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from sqlalchemy.engine import Engine

from fibctl.config import MAX_LENGTH
from fibctl.data.prepare import encode
from fibctl.data.streams import EOS, load_manifest
from fibctl.device import out_of_memory, resolve_device
from fibctl.errors import FibctlError
from fibctl.flows.evaluation import check_vocab, checked_checkpoint, find_runs, model_at
from fibctl.sampling import generate

TOKENS_MAX = 1_000_000  # new tokens per sample: a full forward pass each


@dataclass
class Sample:
    ids: list[int]
    text: str  # the new tokens' text


@dataclass
class Sampled:
    run: str
    step: int
    status: str  # the run's: a run not done is sampled at its newest checkpoint
    context: int
    prompt_ids: list[int]  # what the samples continue: the prompt's last `context` tokens
    prompt_text: str
    prompt_dropped: int  # the prompt's tokens before those, which no sample sees
    samples: list[Sample] = field(default_factory=list)


def check_options(tokens: int, temperature: float, top_k: int | None, samples: int,
                  context: int | None) -> None:
    """Every number refused before the database or a checkpoint is read."""
    if not 1 <= tokens <= TOKENS_MAX:
        raise FibctlError(f"--tokens {tokens} must be from 1 to {TOKENS_MAX:,}: the new tokens of each sample")
    if not (math.isfinite(temperature) and temperature >= 0):  # also refuses nan and inf
        raise FibctlError(f"--temperature {temperature:g} must be 0 (greedy) or more")
    if top_k is not None and top_k < 1:
        raise FibctlError(f"--top-k {top_k} must be at least 1 (1 is greedy)")
    if not 1 <= samples <= 1_000:
        raise FibctlError(f"--samples {samples} must be from 1 to 1,000")
    if context is not None and not 1 <= context <= MAX_LENGTH:
        raise FibctlError(f"--context {context} must be from 1 to {MAX_LENGTH:,} tokens")


def sample(engine: Engine, name: str, *, data_dir: Path, prompt: str | None = None, tokens: int = 100,
           temperature: float = 1.0, top_k: int | None = None, seed: int = 1337, samples: int = 1,
           context: int | None = None, device: str | None = None, runs_dir: Path | None = None,
           on_note: Callable[[str], None] | None = None,
           on_token: Callable[[int], None] | None = None) -> Sampled:
    """`samples` texts of `tokens` new tokens each after `prompt` (None or empty: the
    tokenizer's end-of-text, where a document starts), from run `name`'s checkpoint rebuilt at
    `context` tokens (default its training length). One generator, seeded once, draws every
    sample in turn, so a seed gives the same texts. `on_note` hears of a run not finished and
    of a prompt cut to the context; `on_token(id)` of each token drawn, sample after sample."""
    check_options(tokens, temperature, top_k, samples, context)
    target = find_runs(engine, [name], False, runs_dir, reads="fibctl sample writes text, with a text model")[0]
    manifest = load_manifest(data_dir)
    check_vocab(target, manifest)
    tokenizer = manifest.load_tokenizer()
    context = context or target.config.model.seq_len
    if prompt:  # in exact pieces, as prepare encodes a document: a 13 MB prompt encoded whole took 4.9 GB
        ids = encode(tokenizer, [prompt], 0)[0][:-1].tolist()  # its end-of-text id left off
    else:  # where every document of the training stream starts: after the one before it ended
        eos = tokenizer.token_to_id(EOS)
        if eos is None:
            raise FibctlError(f"{manifest.tokenizer_path.name} has no {EOS} token to start a sample from; "
                              "give a prompt (--prompt or --prompt-file)")
        ids = [eos]
    dropped = max(0, len(ids) - context)
    ckpt = checked_checkpoint(target, manifest, "its ids would be decoded by another tokenizer")
    if target.run.status != "done" and on_note:  # as eval says it: not the run's trained model
        on_note(f"run {name!r} is not finished (status {target.run.status}): sampling its checkpoint at step "
                f"{ckpt['step']:,} of {target.config.train.steps:,}")
    if dropped and on_note:
        on_note(f"the prompt is {len(ids):,} tokens, more than the context of {context:,}: the samples continue "
                f"its last {context:,}")
    ids = ids[dropped:]
    dev = resolve_device(device)
    model = model_at(target, ckpt["model"], context, dev)
    out = Sampled(name, ckpt["step"], target.run.status, context, ids,
                  tokenizer.decode(ids, skip_special_tokens=False), dropped)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(samples):
        try:
            new = generate(model, ids, tokens, context, dev, temperature=temperature, top_k=top_k,
                           vocab=manifest.tokenizer_vocab, generator=generator, on_token=on_token)
        except (torch.OutOfMemoryError, RuntimeError) as e:  # one sequence: nothing to halve, as eval does
            if not out_of_memory(e):
                raise
            raise FibctlError(f"a context of {context:,} tokens is out of reach on {dev}: out of memory") from None
        out.samples.append(Sample(new, _continuation(tokenizer, ids, new)))
    return out


def _continuation(tokenizer, prompt: list[int], new: list[int]) -> str:
    """The new tokens' text as it reads after the prompt's: a character whose bytes the
    byte-level tokens split between prompt and sample is decoded whole, with the sample."""
    whole = tokenizer.decode(prompt + new, skip_special_tokens=False)
    head = tokenizer.decode(prompt, skip_special_tokens=False)
    if not whole.startswith(head):  # a character cut short; not before: a prompt ending in a real U+FFFD lost it
        head = head.rstrip("\ufffd")
    return whole[len(head):] if whole.startswith(head) else tokenizer.decode(new, skip_special_tokens=False)
