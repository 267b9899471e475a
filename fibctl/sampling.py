"""Text from a trained model, token by token, as nanoGPT's sample.py draws it: the logits of
the last position divided by a temperature, cut to the top k, and one token drawn from their
softmax (temperature 0: the most likely token, greedy).

The model is the one `fibctl eval` measures (fibctl.metrics.load_model, rebuilt at the
context length L); each new token takes a full forward pass over the last L tokens. There is
no KV cache: a cache would be a second attention path beside the one whose attended set
fibctl.schedules decides, and a model built at L and fed fewer tokens gives the prefix of its
output on more (fibctl.schedules.attended_distances), so a short prompt reads as eval's
windows do. Nothing here knows of SQL: the runner is `fibctl.flows.sampling`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fibctl.device import autocast
from fibctl.model import FibLM


def next_token(logits: torch.Tensor, temperature: float, top_k: int | None,
               generator: torch.Generator) -> int:
    """One token from the last position's logits (V,): the argmax at temperature 0, else a draw
    from softmax(logits / temperature) over the `top_k` largest (all when None)."""
    logits = logits.float().cpu()  # drawn on the CPU: the same seed gives the same text on any device
    if temperature == 0:
        return int(torch.argmax(logits))
    # the likeliest at 0 before dividing, and a temperature float32 can hold: a tiny one
    # (1e-300) sent the logits to +-inf (or 0/0) and softmax to nan, a traceback from
    # multinomial; now the others go to -inf, as greedy
    logits = (logits - logits.max()) / max(temperature, torch.finfo(logits.dtype).tiny)
    if top_k is not None and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))


def generate(model: FibLM, prompt: list[int], new_tokens: int, context: int, device: torch.device, *,
             temperature: float = 1.0, top_k: int | None = None, vocab: int | None = None,
             generator: torch.Generator | None = None,
             on_token: Callable[[int], None] | None = None) -> list[int]:
    """`new_tokens` ids after `prompt` (not empty), each from the model's logits over the last
    `context` tokens. `vocab`: only ids below it are drawn (a tokenizer that trained fewer
    tokens than the model embeds cannot decode the rest). `on_token(id)` hears of each."""
    if not prompt:
        raise ValueError("generation needs at least one token to start from")
    generator = generator or torch.Generator().manual_seed(0)
    ids, out = list(prompt), []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast(device):
            for _ in range(new_tokens):
                x = torch.tensor([ids[-context:]], dtype=torch.long, device=device)
                logits = model(x)[0, -1, :vocab]  # the last position's: its next token
                token = next_token(logits, temperature, top_k, generator)
                ids.append(token)
                out.append(token)
                if on_token:
                    on_token(token)
    finally:
        model.train(was_training)
    return out
