"""The decoder-only transformer of the study (docs/method.md, "The model"), top to bottom.

Pre-norm RMSNorm blocks with grouped-query attention (dense or scaled-Fibonacci sparse)
and a SwiGLU FFN; RoPE; embedding tied to the output head; no biases, no dropout.
Nothing length-dependent is saved: RoPE tables and attended columns are rebuilt for
whatever length the input has, so weights trained at one length load at any other. An
input longer than `cfg.seq_len` is read as by a model rebuilt at its length (pow2 gains
rungs); a shorter one as by the model built at `cfg.seq_len` (its prefix).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from fibctl.attention import Columns, check_impl, dense_attention, sparse_attention
from fibctl.config import ModelConfig
from fibctl.device import autocast, constant
from fibctl.errors import FibctlError
from fibctl.probe.blur import blur_attention
from fibctl.schedules import (
    ALPHA_MIN, ALPHA_RANGE, attended_distances, blur_rungs, built_base, fractional_rungs, layer_alphas,
    window_distances,
)

LOSS_TOKENS = 8192  # tokens per chunk when computing per-token losses: logits never exist in full


def rope_tables(T: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (T, D), float32, computed on the CPU and then moved, as the study built
    them: a GPU's cos and sin may differ in the last bit, and the tables are then the same
    on every device."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(T, dtype=torch.float32), inv_freq)  # (T, D/2)
    angles = torch.cat([angles, angles], -1)  # rotate-half convention: (T, D)
    return angles.cos().to(device), angles.sin().to(device)


def widened(x: torch.Tensor) -> torch.Tensor:
    """x in float32 at least: bf16 widened, as the study's float32 tables and its autocast's
    float32 cross-entropy widened it; a float64 model's (the float64 tests) kept float64, as
    the study's code computed it in float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x rotated, in float32 whatever x's dtype: the study's float32 tables promoted its bf16
    queries and keys, so under autocast they are rounded once, where they are scored (or,
    in a learned layer, never: Attention.forward)."""
    x = widened(x)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class NonFiniteAlpha(FibctlError):
    """A learned layer whose alpha is not finite (an update made its theta NaN): it has no rungs
    to place, floor(nan) no row. The trainers end the run as diverged, as for a loss of NaN."""

    def __init__(self, layer: int, alpha: float):
        self.layer, self.alpha = layer, alpha
        super().__init__(f"layer {layer}'s learned alpha is {alpha}: its rungs cannot be placed")

    @property
    def reading(self) -> str:
        """What the step read, completing "step N gave ..." (fibctl.train.trainer)."""
        return f"an alpha of {self.alpha} in layer {self.layer}"


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, impl: str = "gather"):
        super().__init__()
        self.cfg, self.layer, self.impl = cfg, layer, check_impl(impl)
        D = cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * D, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * D, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * D, bias=False)
        self.wo = nn.Linear(cfg.n_heads * D, cfg.d_model, bias=False)
        if cfg.schedule == "learned":
            self.theta = nn.Parameter(torch.zeros(()))  # the only parameter sparsity adds
        # Static layers keep alpha as a Python float, never a tensor: round(alpha * b_k) must
        # see the float64 product the study rounded (5/6 * 21 is 17.5 -> 18 there, but 17 from
        # a float32 alpha). Nothing is saved, so weights stay schedule-agnostic.
        self.alpha0 = layer_alphas(cfg.schedule, cfg.n_layers)[layer]
        self._static_cols: dict[int, Columns] = {}
        self._rungs_read: tuple[tuple, list[tuple[int, int]]] | None = None  # (theta's state, its kept rungs)
        self.blur_width: float | None = None  # set (FibLM.set_blur_width): the probe's blur rungs

    @property
    def alpha(self) -> torch.Tensor | float:
        if self.cfg.schedule == "learned":
            return ALPHA_MIN + ALPHA_RANGE * torch.sigmoid(self.theta)
        return self.alpha0

    def columns(self, T: int) -> Columns:
        cfg = self.cfg
        if cfg.schedule != "learned":
            if T not in self._static_cols:
                per_layer = attended_distances(cfg.base, cfg.schedule, cfg.window, cfg.n_layers, T, cfg.n_rungs,
                                               built_at=cfg.seq_len)
                self._static_cols[T] = Columns(per_layer[self.layer], [])
            return self._static_cols[T]
        # One product t_k = alpha * b_k in the parameter's dtype gives both the rung's row
        # (lo = floor(t_k)) and its interpolation weight (t_k - lo), as in the study.
        targets, kept = self._rungs(T)
        lo = [lo for _, lo in kept]
        dev = targets.device
        frac = targets[constant([k for k, _ in kept], torch.long, dev)] - constant(lo, targets.dtype, dev)
        return Columns(window_distances(cfg.window, T), lo, frac)

    def blur_columns(self, T: int) -> tuple[list[int], torch.Tensor]:
        """The probe's rungs at this length: rounded centres c_k and exact centres alpha * b_k."""
        centres, kept = self._rungs(T, blur=True)
        return [c for _, c in kept], centres[constant([k for k, _ in kept], torch.long, centres.device)]

    def _rungs(self, T: int, blur: bool = False) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """The products alpha * b_k (on the device, carrying alpha's gradient) and the rungs kept
        of them (fractional_rungs, or blur_rungs for the probe) read on the host: (k, row) of
        each. The host read happens once per value
        of theta (an optimizer step or a load changes its version or storage; optimizers that
        write without a version bump get one from fibctl.train.optim.marks_writes): on CUDA
        each read waits for the GPU, and a step's micro-batches all see the same theta."""
        alpha, cfg = self.alpha, self.cfg
        base = built_base(cfg.base, T, cfg.seq_len, cfg.n_rungs)
        products = alpha * constant(base, alpha.dtype, alpha.device)
        theta = self.theta
        key = (T, blur, theta._version, theta.data_ptr(), theta.dtype, theta.device)
        if self._rungs_read is None or self._rungs_read[0] != key:
            read = products.detach().tolist()
            if not all(map(math.isfinite, read)):  # theta is NaN: no row to floor or round to
                raise NonFiniteAlpha(self.layer, float(alpha.detach()))
            kept = blur_rungs(base, read, cfg.window, T) if blur else fractional_rungs(read, cfg.window, T)
            self._rungs_read = (key, kept)
        return products, self._rungs_read[1]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        cfg, D = self.cfg, self.cfg.head_dim
        q = self.wq(x).view(B, T, cfg.n_heads, D).transpose(1, 2)  # (B, H, T, D)
        k = self.wk(x).view(B, T, cfg.n_kv_heads, D).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.wv(x).view(B, T, cfg.n_kv_heads, D).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # float32
        if cfg.schedule == "learned":
            y = self._learned_attention(q, k, v)
        else:  # rounded to the values' dtype (bf16 under autocast) as the study's autocast did
            q, k = q.to(v.dtype), k.to(v.dtype)
            y = dense_attention(q, k, v, self.impl) if cfg.schedule == "dense" else \
                sparse_attention(q, k, v, self.columns(T), self.impl)
        return self.wo(y.transpose(1, 2).reshape(B, T, cfg.n_heads * D))

    # Kept out of torch.compile's trace (FibLM.prepare): see there.
    def _learned_attention(self, q, k, v) -> torch.Tensor:
        """A learned layer attends in float32, autocast or not, as the study's did: its keys
        (float32 from RoPE) interpolated and every score computed in float32. The values are
        read in float32 too (docs/method.md, "Where fibctl differs")."""
        T = q.shape[2]
        with torch.autocast(q.device.type, enabled=False):
            v = v.to(q.dtype)
            if self.blur_width is not None:  # the probe's blur rungs
                c, centres = self.blur_columns(T)
                return blur_attention(q, k, v, window_distances(self.cfg.window, T), c, centres, self.blur_width,
                                      "reference" if self.impl == "reference" else "fast")
            return sparse_attention(q, k, v, self.columns(T), self.impl)


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h = cfg.ffn_hidden
        self.w1 = nn.Linear(cfg.d_model, h, bias=False)  # gate
        self.w3 = nn.Linear(cfg.d_model, h, bias=False)  # up
        self.w2 = nn.Linear(h, cfg.d_model, bias=False)  # down

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, impl: str):
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg, layer, impl)
        self.norm2 = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.ffn = SwiGLU(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.ffn(self.norm2(x))


class FibLM(nn.Module):
    """The language model. `cfg.seq_len` is the length it is built at; any length works."""

    def __init__(self, cfg: ModelConfig, impl: str = "gather"):
        super().__init__()
        self.cfg = cfg.validate()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, l, impl) for l in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self._rope: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._init_weights()

    def _init_weights(self) -> None:
        """normal(0, d ** -0.5), the residual outputs divided by sqrt(2 L), drawn as the study's
        code drew them, so that the same generator state gives the same weights bit for bit:
        its constructor also initialised an output layer (torch's default) that tying then
        replaced, and it drew the embedding first and, as the tied head, again last."""
        cfg = self.cfg
        std = cfg.d_model**-0.5
        nn.init.kaiming_uniform_(torch.empty(cfg.vocab_size, cfg.d_model), a=math.sqrt(5))  # the untied head
        nn.init.normal_(self.embed.weight, 0.0, std)  # drawn over below: the study's first draw of it
        for name, p in self.named_parameters():
            if p.dim() == 2 and p is not self.embed.weight:
                residual_out = name.endswith("attn.wo.weight") or name.endswith("ffn.w2.weight")
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * cfg.n_layers) if residual_out else std)
        nn.init.normal_(self.embed.weight, 0.0, std)  # the tied head's draw, the embedding's for good

    def rope(self, T: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (T, str(device))
        if key not in self._rope:
            self._rope[key] = rope_tables(T, self.cfg.head_dim, self.cfg.rope_theta, device)
        return self._rope[key]

    def choose_paths(self, batch_size: int, T: int, device) -> None:
        """Let every `auto` layer measure its path now, eagerly, at the training shapes: one
        forward and backward on random tokens under the device's autocast, its gradients
        dropped (no weight changes, the global RNG untouched). Traced by torch.compile, a
        layer cannot measure and takes `gather`, the slowest integer path on a GPU."""
        # dense: SDPA, nothing to choose; learned: its attention runs outside the trace, and
        # measures at its first call
        if self.blocks[0].attn.impl != "auto" or self.cfg.schedule in ("dense", "learned"):
            return
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, self.cfg.vocab_size, (batch_size, T + 1), generator=g).to(device)
        with autocast(torch.device(device)):
            loss = self(x[:, :-1], x[:, 1:])
        loss.backward()
        self.zero_grad(set_to_none=True)

    def prepare(self, T: int, device) -> None:
        """Ready the model for torch.compile. The tables of length T are built now (RoPE, the
        static layers' attended columns), so that it traces caches that no longer change and
        compiles the model once. A learned layer's attention stays out of the trace: traced,
        the rungs it reads on the host (.tolist()) would be guarded on as constants, and every
        optimizer step moves alpha, so each step would recompile. That is said here rather than
        by a decorator because importing torch's compiler adds seconds to every command's start."""
        self.rope(T, device)
        for block in self.blocks:
            attn = block.attn
            if self.cfg.schedule == "learned":
                if "_learned_attention" not in vars(attn):  # once, however often prepared
                    attn._learned_attention = torch.compiler.disable(attn._learned_attention)
            elif self.cfg.schedule != "dense":
                attn.columns(T)

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        """Final normed hidden states, (B, T, d_model)."""
        cos, sin = self.rope(idx.shape[1], idx.device)
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V) without targets; with targets, the mean next-token loss."""
        logits = self.hidden(idx) @ self.embed.weight.T  # tied head
        if targets is None:
            return logits
        return F.cross_entropy(widened(logits).flatten(0, 1), targets.flatten())

    def token_losses(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-position cross-entropy (B, T), the head applied to about LOSS_TOKENS tokens at a time."""
        h = self.hidden(idx)
        chunk = max(1, LOSS_TOKENS // h.shape[0])  # positions per chunk
        out = []
        for s in range(0, h.shape[1], chunk):
            logits = widened(h[:, s:s + chunk] @ self.embed.weight.T)
            out.append(F.cross_entropy(logits.transpose(1, 2), targets[:, s:s + chunk], reduction="none"))
        return torch.cat(out, 1)

    def set_blur_width(self, width: float | None) -> None:
        """Learned layers attend through blur rungs of this width (the probe), or, with None,
        through their fractional rungs."""
        if width is not None and self.cfg.schedule != "learned":
            raise ValueError(f"blur rungs need learned alphas, not schedule {self.cfg.schedule}")
        for block in self.blocks:
            block.attn.blur_width = width

    def attended(self, T: int) -> list[list[int]]:
        """The distances each layer scores at length T, at its alpha now (a learned layer: its
        window and the lower row of each kept rung, the row its interpolated copy stands for)."""
        cfg = self.cfg
        if cfg.schedule == "dense":
            return attended_distances(cfg.base, "dense", cfg.window, cfg.n_layers, T)
        if cfg.schedule == "learned":
            return [window_distances(cfg.window, T) + [lo for _, lo in b.attn._rungs(T)[1]] for b in self.blocks]
        return [b.attn.columns(T).dist for b in self.blocks]

    def alphas(self) -> list[float]:
        return [float(b.attn.alpha.detach()) if torch.is_tensor(b.attn.alpha) else b.attn.alpha
                for b in self.blocks]

    def finite_alphas(self) -> list[float]:
        """alphas(), or NonFiniteAlpha naming the first layer whose alpha is not finite (a value
        nothing can record: the database refuses NaN)."""
        alphas = self.alphas()
        for layer, alpha in enumerate(alphas):
            if not math.isfinite(alpha):
                raise NonFiniteAlpha(layer, alpha)
        return alphas

    def study_order(self) -> list[nn.Parameter]:
        """Every parameter once, in the order the study's model registered them: the
        embedding (its tied head is the same tensor), then each layer's two norms before its
        attention (theta, then q, k, v, o) and FFN (gate, up, down), then the final norm.
        clip_grad_norm_ sums the per-tensor norms in list order, so this order gives the
        study's total norm to the bit. fibctl's blocks register norm2 after the attention,
        and keep doing so: checkpointed optimizer state is matched to parameters by position."""
        order = [self.embed.weight]
        for b in self.blocks:
            order += [b.norm1.weight, b.norm2.weight, *b.attn.parameters(), *b.ffn.parameters()]
        return order + [self.norm.weight]

    def param_counts(self) -> dict[str, int]:
        total = sum(p.numel() for p in self.parameters())
        embedding = self.embed.weight.numel()
        return {"total": total, "embedding": embedding, "non_embedding": total - embedding}
