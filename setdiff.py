"""setdiff: set diffusion language models in one readable file.

Reference: "Set Diffusion: Interpolating Token Orderings Between Autoregression and Diffusion
for Fast and Flexible Decoding", Arriola & Kuleshov, ICML 2026 (arXiv 2607.01775). One network
and one loss cover autoregression, masked diffusion, block diffusion and everything between;
the sampler extends a KV cache after every step. README.md ("The method on one page") states
every formula used here, in this file's order (the banners below).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import re
import time
import unicodedata
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

ORDER_POLICIES = ("staggered", "ar", "uniform", "block")


# ---- Config ---------------------------------------------------------------------------------
@dataclass
class Config:
    """Everything needed to rebuild a model; saved in every checkpoint."""

    vocab_size: int = 260  # V, special tokens included
    seq_len: int = 128  # L, tokens per row; position 0 is always given, never predicted
    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # attention heads
    d_model: int = 256  # hidden width D
    dropout: float = 0.1  # on the two residual branches of every block
    order: str = "staggered"  # order policy pi: staggered | ar | uniform | block
    set_size: int = 4  # d, the target set size of the staggered and block policies
    max_set_size: int | None = None  # s, the staggered window; None: min(2d, L)
    mask_id: int = 259  # MASK: the input of every unrevealed position, never predicted
    bos_id: int | None = 257  # opens every row; None: position 0 holds any token (OWT rows)
    eos_id: int = 258  # ends a sentence or document; may equal bos_id (LM1B rows: [CLS])
    pad_id: int | None = 256  # fills rows after their end, never scored; None: no padding

    def __post_init__(self):
        if self.order == "staggered" and self.max_set_size is None:
            self.max_set_size = min(2 * self.set_size, self.seq_len)
        check_config(self)  # user errors: see Running, below


# ---- Order policies and the staggered schedule ----------------------------------------------
# An order policy draws the decode order sigma, a permutation of the L positions. The
# staggered schedule gives each position i its own masking curve m_i(t), t in [0, 1] (0 clean,
# 1 all masked). Position i is masked at its first hitting time T_i in the forward process,
# so generation (time running 1 -> 0) reveals positions by T DESCENDING. Nearby curves
# overlap: about d positions are revealed "at once", and a position can overtake only the
# earlier positions within its reach r.
class StaggeredSchedule:
    """m_i(t) = 1 - (1 - u_i)^k for u_i = (t - loc_i) / b in (0, 1); 0 before, 1 after.

    A = d / 2L is the masked area under each curve; loc_i = (1 - b)(L - 1 - i) / (L - 1)
    gives position 0 the LARGEST offset (masked last, revealed first). d = 1 is the identity
    (AR) order; d = s = L gives i.i.d. times, a uniform order (masked diffusion)."""

    def __init__(self, length: int, set_size: int, max_set_size: int | None = None):
        L, d = length, set_size
        s = min(2 * d, L) if max_set_size is None else max_set_size
        require(1 <= d <= s <= L, f"need 1 <= set size d={d} <= window s={s} <= length L={L}")
        self.L, self.d, self.s = L, d, s
        self.A = d / (2 * L)
        if d == 1 or d == s:  # straight curves (k = 1) of width 2A
            self.k = 1.0
            self.b = 2 * self.A
        else:  # the width b that makes the reach exactly s
            self.b = s / (L + s - 1)
            self.k = self.A / (self.b - self.A)
        # a curve of width b and exponent k covers the area k b / (k + 1), which must be A
        assert self.b <= 1 + 1e-12 and math.isclose(self.k * self.b / (self.k + 1), self.A)
        steps_from_end = L - 1 - torch.arange(L, dtype=torch.float64)
        self.loc = (1 - self.b) * steps_from_end / max(L - 1, 1)  # (L,)
        # Reach: T_i lies in [loc_i, loc_i + b) and neighbouring offsets are (1 - b)/(L - 1)
        # apart, so i can precede j < i only if i - j < r. The largest useful sampler window
        # is ceil(r), with a tolerance so that r = s gives s.
        self.reach = math.inf if self.b >= 1 else self.b * (L - 1) / (1 - self.b)
        self.window = L if math.isinf(self.reach) else min(L, math.ceil(self.reach - 1e-9))

    def mask_prob(self, t: torch.Tensor) -> torch.Tensor:
        """m_i(t) for times t (B,) -> (B, L), in float64; d = 1 is a hard step."""
        u = (t.to(torch.float64)[:, None] - self.loc[None, :]) / self.b  # (B, L)
        # 1 - (1-u)^k through log1p / expm1: accurate near u = 0 even when k < 1
        rising = -torch.expm1(self.k * torch.log1p(-u.clamp(0.0, 1.0 - 1e-16)))
        m = torch.where(u >= 1, 1.0, torch.where(u > 0, rising, 0.0))
        return (m > 0).double() if self.d == 1 else m

    def first_hitting_times(self, batch_size: int, generator=None) -> torch.Tensor:
        """T_i = loc_i + b (1 - exp(-E_i / k)), E_i ~ Exp(1), so that P(T_i <= t) = m_i(t)."""
        E = torch.empty(batch_size, self.L, dtype=torch.float64).exponential_(generator=generator)
        return self.loc[None, :] + self.b * -torch.expm1(-E / self.k)  # (B, L)


def order_schedule(cfg: Config) -> StaggeredSchedule:
    """AR (d = 1) and uniform (d = s = L) are settings of the staggered schedule."""
    if cfg.order == "ar":
        return StaggeredSchedule(cfg.seq_len, 1, 1)
    if cfg.order == "uniform":
        return StaggeredSchedule(cfg.seq_len, cfg.seq_len, cfg.seq_len)
    return StaggeredSchedule(cfg.seq_len, cfg.set_size, cfg.max_set_size)


def decode_times(cfg: Config, batch_size: int, generator=None) -> torch.Tensor:
    """A reveal time per position (B, L); the decode order is time DESCENDING. Block: blocks
    of d positions left to right, a uniform order inside each block."""
    if cfg.order != "block":
        return order_schedule(cfg).first_hitting_times(batch_size, generator)
    block = torch.arange(cfg.seq_len, dtype=torch.float64) // cfg.set_size  # (L,)
    U = torch.rand(batch_size, cfg.seq_len, dtype=torch.float64, generator=generator)
    return (block.max() - block) + U


def sample_order(cfg: Config, batch_size: int, generator=None, device=None, given=None, pad=None):
    """Decode orders sigma (B, L): the *given* positions first (`given`, (B, L) bool; position 0
    always), then the free ones by reveal time descending, padding (`pad`) last. One stable
    sort: given positions tie at -inf and padding at +inf, so both keep their position order.
    Drawn on the CPU from `generator`: the orders do not depend on the device."""
    T = decode_times(cfg, batch_size, generator)  # (B, L)
    first = torch.arange(cfg.seq_len) == 0  # (L,): position 0 is always given
    if given is not None:
        first = first | given.cpu()  # (B, L)
    key = torch.where(first, -math.inf, -T)
    if pad is not None:
        key = torch.where(pad.cpu(), math.inf, key)
    return torch.argsort(key, dim=1, stable=True).to(device)


def max_window(cfg: Config) -> int:
    """The largest sampler window a policy met in training (larger windows pose unseen
    queries): block d (block-aligned), else min(L, ceil(reach)): ar 1, uniform L. NOTE: for
    d = s the reach d (L - 1) / (L - d) is a little more than s, and so is this window."""
    if cfg.order == "block":
        return cfg.set_size
    return order_schedule(cfg).window


# ---- Set-causal masks: one predicate, many layouts ------------------------------------------
# Every token of a network call carries its rank (its step in the decode order), is_mask
# (a query of the mask stream, or a clean revealed token) and a unique slot (so a query finds
# its own key). The set-causal mask is three named terms OR-ed together; training (clean
# stream | mask stream) and the sampler (cache | new tokens | queries) feed it other vectors.
def set_causal_predicate(q_rank, q_is_mask, q_slot, k_rank, k_is_mask, k_slot):
    """True where a query may attend a key. Arguments broadcast."""
    clean_sees_earlier_or_same_clean = ~q_is_mask & ~k_is_mask & (k_rank <= q_rank)
    mask_sees_strictly_earlier_clean = q_is_mask & ~k_is_mask & (k_rank < q_rank)
    mask_sees_only_itself = q_is_mask & k_is_mask & (k_slot == q_slot)
    return (
        clean_sees_earlier_or_same_clean | mask_sees_strictly_earlier_clean | mask_sees_only_itself
    )


def set_causal_mask(L: int, device=None) -> torch.Tensor:
    """The (2L, 2L) training mask, slots in decode order: clean stream, then mask stream."""
    slot = torch.arange(2 * L, device=device)
    rank = slot % L  # clean slot i and mask slot i share step i
    is_mask = slot >= L
    q = (rank[:, None], is_mask[:, None], slot[:, None])  # queries down, keys (2L,) across
    return set_causal_predicate(*q, rank, is_mask, slot)


def no_empty_rows(mask: torch.Tensor) -> torch.Tensor:
    """A query that may attend nothing (padding, an unused batch slot) attends everything
    instead: softmax over an empty row is NaN on some backends, and such outputs are unused."""
    return mask | ~mask.any(dim=-1, keepdim=True)


# ---- Transformer: (tokens, positions, mask, cache) -> hidden states -> logits ---------------
# The authors' network (a DiT with its timestep modulation off): pre-LayerNorm blocks without
# LayerNorm biases, rotary embeddings looked up by position id, a tanh-GELU MLP of width 4D,
# dropout on the residual branches only, an untied zero-initialised output head with a bias.
# It knows nothing about diffusion: set-causality lives entirely in the mask it is given.
def rotary_table(length: int, head_dim: int) -> tuple:
    """cos, sin (length, hd/2) of the rotary angles pos / 10000^(2i/hd), built in float32 as
    the authors' network builds it: a float64 table moves log-probs by up to 8e-5 at L=1024."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angle = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq  # (L, hd/2)
    return angle.cos(), angle.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the feature pairs (i, i + hd/2) of x (..., T, hd) by their positions' angles.
    NOTE: in at least float32 under bf16 autocast, where late positions' angles lose bits."""
    x1, x2 = x.to(torch.promote_types(x.dtype, torch.float32)).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class Attention(nn.Module):
    """Multi-head attention whose only structure is the explicit mask it is given."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, h, angles, attn_mask, cache=None, layer=0):
        B, T, D = h.shape
        qkv = self.qkv(h).view(B, T, 3, self.n_head, D // self.n_head)
        qkv = qkv.permute(2, 0, 3, 1, 4)  # (3, B, H, T, hd)
        q, k = rotate(qkv[:2], *angles).unbind(0)  # at their ORIGINAL positions, in any order
        v = qkv[2]
        if cache is not None:  # the keys become [cached revealed tokens | this call's tokens]
            k, v = cache.extend(layer, k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask[:, None])  # all heads
        return self.proj(y.transpose(1, 2).reshape(B, T, D))  # (B, T, D)


class Block(nn.Module):
    """h + drop(Attn(LN(h))), then h + drop(MLP(LN(h)))."""

    def __init__(self, cfg: Config):
        super().__init__()
        D = cfg.d_model
        self.ln1 = nn.LayerNorm(D, bias=False)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(D, bias=False)
        gelu = nn.GELU(approximate="tanh")  # the authors' activation (not the exact GELU)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), gelu, nn.Linear(4 * D, D))
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, h, angles, attn_mask, cache=None, layer=0):
        h = h + self.drop(self.attn(self.ln1(h), angles, attn_mask, cache, layer))
        return h + self.drop(self.mlp(self.ln2(h)))


class SetDiffusionLM(nn.Module):
    """`run` and `logits` are the plain network; `forward(x, order)` and `loss` are the
    two-stream training forward and the set-factorized bound of the next section."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        D = cfg.d_model
        self.tok_emb = nn.Embedding(cfg.vocab_size, D)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(D, bias=False)
        self.head = nn.Linear(D, cfg.vocab_size)  # untied
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        nn.init.zeros_(self.head.weight)  # uniform predictions at step 0
        # a table over position ids: the ids arrive in decode order, not sorted
        cos, sin = rotary_table(cfg.seq_len, D // cfg.n_head)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def run(self, tokens, positions, attn_mask, cache: KVCache | None = None):
        """tokens, positions (B, T); attn_mask (B or 1, T, T_keys) bool -> hidden (B, T, D)."""
        h = self.tok_emb(tokens)  # (B, T, D)
        angles = (self.cos[positions][:, None], self.sin[positions][:, None])  # (B, 1, T, hd/2)
        for layer, block in enumerate(self.blocks):
            h = block(h, angles, attn_mask, cache, layer)
        return self.ln_f(h)

    def logits(self, h):
        """The LM head with the MASK logit at -inf: MASK never appears in data."""
        z = self.head(h)  # (B, T, V)
        return z.index_fill(-1, torch.tensor([self.cfg.mask_id], device=z.device), -math.inf)

    def forward(self, x, order):
        """logits[b, i] predicts x[b, i] from the tokens before position i in order[b]."""
        z, _ = two_stream_logits(self, x, order)  # (B, L, V) in decode order
        rank = torch.argsort(order, dim=1)  # (B, L): the step of each position
        return z.gather(1, rank[..., None].expand_as(z))  # in position order

    def loss(self, x, order=None, generator=None):
        return set_factorized_loss(self, x, order, generator)


# ---- Two-stream forward, set-factorized loss and the likelihood bound -----------------------
# Training feeds 2L tokens: the clean stream x[sigma_0..sigma_{L-1}] and a mask stream of L
# MASK tokens, both carrying the ORIGINAL positions sigma. Under the set-causal mask, mask
# slot i sees the clean slots j < i and itself, so it predicts x[sigma_i] from x[sigma_<i]:
# one pass scores all L conditionals of the order.
def padding(cfg: Config, x: torch.Tensor) -> torch.Tensor:  # (B, L): True at padding
    if cfg.pad_id is None:
        return torch.zeros_like(x, dtype=torch.bool)
    return x == cfg.pad_id


def two_stream_logits(model: SetDiffusionLM, x, order):
    """x, order (B, L) -> logits (B, L, V) and targets x[sigma_i] (B, L), in DECODE order."""
    cfg, L = model.cfg, x.shape[1]
    clean = x.gather(1, order)  # (B, L) x[sigma_0..sigma_{L-1}]
    tokens = torch.cat([clean, torch.full_like(clean, cfg.mask_id)], 1)  # (B, 2L) clean | mask
    positions = torch.cat([order, order], 1)  # (B, 2L) original positions
    attn = set_causal_mask(L, x.device)[None]  # (1, 2L, 2L)
    pad = padding(cfg, clean)  # padding is ordered last
    if pad.any():
        valid = torch.cat([~pad, ~pad], 1)  # (B, 2L)
        attn = no_empty_rows(attn & valid[:, :, None] & valid[:, None, :])
    h = model.run(tokens, positions, attn)  # (B, 2L, D)
    return model.logits(h[:, L:]), clean  # the head only on the mask stream


def set_factorized_loss(model: SetDiffusionLM, x, order=None, generator=None):
    """Per sequence the mean over non-pad tokens of -log p(x[sigma_i] | x[sigma_<i]), then
    the batch mean. NOTE: no time variable and no alpha'/(1 - alpha) weights: under the
    staggered schedule the continuous-time bound integrates exactly to this expectation over
    orders, so one sampled order is an unbiased one-sample estimate of the negative ELBO."""
    pad = padding(model.cfg, x)  # (B, L)
    if order is None:
        order = sample_order(model.cfg, x.shape[0], generator, x.device, pad=pad)
    z, target = two_stream_logits(model, x, order)  # (B, L, V), (B, L)
    nll = F.cross_entropy(z.flatten(0, 1).float(), target.flatten(), reduction="none")
    scored = (~padding(model.cfg, target)).float()  # the slot of position 0 too, in training
    per_row = (nll.view_as(target) * scored).sum(1) / scored.sum(1).clamp(min=1)
    return per_row.mean()


@dataclass
class Elbo:
    """The likelihood bound over some rows, with what a reported number must come with."""

    nll: float  # sum over rows of each row's NLL (nats), averaged over its K orders
    tokens_scored: int  # not given, not padding (a run's log says "tokens" for training tokens)
    num_orders: int  # K
    num_seqs: int  # rows
    se: float  # standard error of the per-token NLL across rows
    nll_per_token: float  # nll / tokens
    ppl: float  # exp(nll / tokens): an upper bound on the perplexity

    def bits_per_byte(self, num_bytes: int) -> float:
        return self.nll / math.log(2) / max(num_bytes, 1)

    def metrics(self, num_bytes: int) -> dict:
        """The numbers as a JSON-ready dict; `num_bytes` = bytes of source text scored."""
        return asdict(self) | {"bits_per_byte": self.bits_per_byte(num_bytes), "bytes": num_bytes}

    def line(self, num_bytes: int) -> str:
        """One line, as training validation and `sample.py --eval` print it."""
        orders = f"{self.num_orders} order" + "s" * (self.num_orders > 1)
        return (
            f"ppl <= {self.ppl:.3f}  ({self.nll_per_token:.4f} +- {self.se:.4f} nats/token, "
            f"{self.bits_per_byte(num_bytes):.4f} bits/byte; {self.num_seqs} rows, "
            f"{self.tokens_scored:,} tokens, {orders})"
        )


@torch.no_grad()
def elbo(model, x, num_orders=1, batch_size=32, generator=None, given=None, progress=False):
    """The bound exp(sum NLL / sum tokens) over rows x (N, L), K sampled orders per row, dropout
    off. `given` (N, L) bool marks context (an infill or prefix bound): it comes first in every
    order and is not scored; position 0 and padding are never scored either."""
    device = next(model.parameters()).device
    x = x.long().cpu()
    given = torch.zeros_like(x, dtype=torch.bool) if given is None else given.cpu().clone()
    given[:, 0] = True  # BOS, or the token that opens the row: given, not predicted
    pad = padding(model.cfg, x)
    scored = ~given & ~pad  # (N, L)
    row_nll = torch.zeros(len(x), dtype=torch.float64)  # on the CPU: MPS has no float64
    was_training = model.training
    model.eval()  # dropout off; restored below
    bar = tqdm(total=len(x) * num_orders, unit="row", desc="bound", disable=not progress)
    chunk_rows = 1024  # rows whose orders are drawn together: the bound ignores batch_size
    for start in range(0, len(x), chunk_rows):
        chunk = slice(start, start + chunk_rows)
        for _ in range(num_orders):
            n = len(x[chunk])
            orders = sample_order(model.cfg, n, generator, given=given[chunk], pad=pad[chunk])
            for b in range(0, n, batch_size):
                rows = slice(start + b, start + min(b + batch_size, n))
                xb = x[rows].to(device)  # (B, L)
                logp = F.log_softmax(model(xb, orders[b : b + batch_size].to(device)).float(), -1)
                nll = -logp.gather(-1, xb[..., None])[..., 0]  # (B, L) in position order
                row_nll[rows] += (nll * scored[rows].to(device)).sum(1).cpu().double()
                bar.update(len(xb))
    bar.close()
    model.train(was_training)
    row_nll /= num_orders
    tokens = scored.sum(1).double()  # (N,)
    # Standard error of the ratio sum(nll) / sum(tokens), rows as units (delta method); with
    # rows of equal length it is std(per-row NLL per token) / sqrt(N).
    resid = (row_nll - row_nll.sum() / tokens.sum() * tokens) / tokens.mean()
    se = float(resid.std() / math.sqrt(len(x))) if len(x) > 1 else math.nan
    nll, count = float(row_nll.sum()), int(tokens.sum())
    per_token = nll / max(count, 1)
    return Elbo(nll, count, num_orders, len(x), se, per_token, math.exp(per_token))


# ---- Sampler: window, candidates, commit rule -----------------------------------------------
# One step of the set sampler: (1) the window: the masked positions in [f, f + w) from the
# leftmost masked position f; (2) ONE network call predicting them; (3) a candidate token and
# its confidence per query; (4) the commit rule: reveal the most confident candidate plus
# every candidate with confidence >= tau. The revealed tokens form this step's set.
GIVEN = -1  # reveal step of a given token (BOS, prompt, infill context): never changed
ERASED = -2  # reveal step of a position set to PAD after a stopping EOS
MASKED = -3  # reveal step of a position not revealed yet (during generation only)


@dataclass
class Generation:
    tokens: torch.Tensor  # (B, T) final ids; PAD after a stopping EOS
    reveal_step: torch.Tensor  # (B, T) the step that revealed each position, GIVEN or ERASED
    nfe: int  # network calls (= steps: the prompt is written during step 0)
    steps: torch.Tensor  # (B,) steps each row took
    seconds: float  # wall time

    @property
    def new_tokens(self) -> torch.Tensor:
        """(B,) tokens each row revealed and kept (not those erased after a stopping EOS)."""
        return (self.reveal_step >= 0).sum(1)

    @property
    def tokens_per_step(self) -> float:
        return float((self.new_tokens / self.steps.clamp(min=1)).mean())


def window_queries(masked: torch.Tensor, window: int, block_size: int | None):
    """Active queries (B, T): masked positions in [f, f + w), f the leftmost masked one; for
    the block policy also inside f's block (its windows are block-aligned)."""
    pos = torch.arange(masked.shape[1], device=masked.device)[None, :]
    f = torch.argmax(masked.to(torch.uint8), dim=1, keepdim=True)  # (B, 1)
    active = masked & (pos >= f) & (pos < f + window)
    if block_size is None:
        return active
    return active & (pos < (f // block_size + 1) * block_size)


def draw_candidates(logits, temperature: float, top_p: float, generator=None):
    """A candidate and its confidence per query: logits (B, n, V) -> (cand, conf) (B, n).

    Confidence is the probability of the drawn token under the distribution it was drawn
    from (temperature-scaled, top-p truncated and renormalised; greedy: the plain softmax).
    Draws invert the CDF with uniforms from a CPU generator: independent of the device."""
    device = logits.device  # MPS has no float64; float64 stays float64 (tests)
    dtype = torch.promote_types(logits.dtype, torch.float32)
    logits = logits.to("cpu" if device.type == "mps" else device, dtype)
    if temperature == 0:
        conf, cand = F.softmax(logits, -1).max(-1)
        return cand.to(device), conf.to(device)
    # subtract the max BEFORE dividing: a tiny temperature then gives a one-hot, not inf - inf
    probs = F.softmax((logits - logits.max(-1, keepdim=True).values) / temperature, -1)
    p_sorted, vocab_idx = probs.sort(-1, descending=True)  # (B, n, V)
    if top_p < 1:  # the smallest set of tokens with mass >= p
        p_sorted = p_sorted * ((p_sorted.cumsum(-1) - p_sorted) < top_p)
        p_sorted = p_sorted / p_sorted.sum(-1, keepdim=True)
    # NOTE: the CDF is inverted in float64: in float32 a u just below the total mass can round
    # up to it, and the search would land on a zero-probability token such as MASK.
    cdf = p_sorted.double().cumsum(-1)
    u = torch.rand(cdf.shape[:-1], generator=generator, dtype=torch.float64).to(cdf.device)
    j = torch.searchsorted(cdf, (u * cdf[..., -1])[..., None], right=True)  # first cdf > u
    return vocab_idx.gather(-1, j)[..., 0].to(device), p_sorted.gather(-1, j)[..., 0].to(device)


def commit_rule(conf, valid, threshold: float):
    """The most confident candidate plus all with confidence >= tau: never zero tokens in a
    row that has queries. (Keeping the confident tokens = re-masking the others.)"""
    conf = conf.masked_fill(~valid, -1.0)
    top = F.one_hot(conf.argmax(1), conf.shape[1]).bool()
    return valid & ((conf >= threshold) | top)


def gather_sets(select: torch.Tensor, key: torch.Tensor | None = None) -> tuple:
    """Ragged per-row sets as padded index lists: select (B, T) bool -> idx (B, n), valid
    (B, n), the selected positions in position order, or sorted by `key` (B, T) with ties in
    position order. Padded entries hold position 0 and are masked wherever they are used."""
    count = select.sum(1, keepdim=True)
    n = int(count.max()) if select.numel() else 0
    key = torch.zeros_like(select, dtype=torch.long) if key is None else key
    last = torch.iinfo(torch.long).max  # not selected: after every selected position
    idx = torch.argsort(torch.where(select, key, last), dim=1, stable=True)[:, :n]
    valid = torch.arange(n, device=select.device)[None, :] < count
    return torch.where(valid, idx, 0), valid


# ---- Sampler: the KV cache beside the cached step, then generate ---------------------------
class KVCache:
    """Clean-stream keys/values of the revealed tokens, per layer, at their ORIGINAL positions.

    A position is revealed once, so "slot = position" gives every row a fixed-size buffer
    (no ragged appends across a batch), and the keys a query may see are just `filled`. Keys
    are stored after rotary: a position never moves. Per layer and row the buffer holds

        slots 0 .. T-1                    | slots T .. T+n+m-1
        revealed tokens (where `filled`)  | this call: n new tokens, then m queries

    In every layer `extend` places the call's keys behind the cache, and attention reads slots
    [0, T+n+m); after the call `store` copies the n new tokens' keys to their positions
    (queries are never cached). NOTE: one preallocated buffer, not a concatenation per layer:
    allocation-heavy steps were measured to halve batched CPU throughput."""

    def __init__(self, cfg: Config, batch_size: int, length: int, max_call: int, device):
        self.length = length
        head_dim = cfg.d_model // cfg.n_head
        self.shape = (cfg.n_layer, batch_size, cfg.n_head, length + max_call, head_dim)
        self.k = self.v = None  # allocated by the first call, in its compute dtype
        self.filled = torch.zeros(batch_size, length, dtype=torch.bool, device=device)

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple:
        """Place this call's keys/values (B, H, n+m, hd) behind the cache -> all of them."""
        if self.k is None:
            self.k = k.new_zeros(self.shape)
            self.v = v.new_zeros(self.shape)
        end = self.length + k.shape[2]
        self.k[layer, :, :, self.length : end] = k
        self.v[layer, :, :, self.length : end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def store(self, new_idx: torch.Tensor, new_valid: torch.Tensor) -> None:
        """After a call: the new tokens' keys/values, still behind the cache in every layer,
        move to their positions, which later calls then see."""
        b, j = new_valid.nonzero(as_tuple=True)  # (N,) row and call slot of each new token
        p = new_idx[b, j]  # (N,) its position
        self.k[:, b, :, p] = self.k[:, b, :, self.length + j]
        self.v[:, b, :, p] = self.v[:, b, :, self.length + j]
        self.filled[b, p] = True


def predict(model: SetDiffusionLM, x, new: tuple, queries: tuple, cache: KVCache | None = None):
    """ONE network call: [n new clean tokens] + [m MASK queries] -> the queries' logits (B, m, V).

    `new` and `queries` are (idx, valid) pairs (B, n) and (B, m) of positions of x (B, T). A
    new token sees the cache, the new tokens before it and itself; a query sees the cache, all
    new tokens and itself only: the training mask restricted to the rows that matter. Example,
    T = 25 with a cache, 2 tokens revealed last step (positions 5, 9), 3 queries (6, 7, 8):

        keys     25 cache slots | 2 new tokens | 3 queries     (the queries of this call are
        rank     0 0 ... 0      | 1 2          | 3 3 3          the last n + m = 5 columns)
        is_mask  F F ... F      | F F          | T T T
        slot     0 1 ... 24     | 25 26        | 27 28 29

    The cached step feeds the tokens revealed last step (in position order); the cache-free
    step, with no cache, feeds every revealed token in decode order; cached = cache-free is
    the cache's exactness."""
    new_idx, new_valid = new
    q_idx, q_valid = queries
    n, m = new_idx.shape[1], q_idx.shape[1]
    C = 0 if cache is None else cache.length  # cache slots
    # rank (step in the decode order): 0 for the cache, 1..n for new tokens, n + 1 for queries
    rank = torch.cat([torch.zeros(C), torch.arange(1, n + 1), torch.full((m,), n + 1)]).to(x.device)
    slot = torch.arange(C + n + m, device=x.device)
    is_mask = slot >= C + n
    query = (rank[C:, None], is_mask[C:, None], slot[C:, None])  # this call's n + m tokens
    attn = set_causal_predicate(*query, rank, is_mask, slot)  # (n+m, C+n+m)
    call_ok = torch.cat([new_valid, q_valid], 1)  # (B, n+m)
    key_ok = call_ok if cache is None else torch.cat([cache.filled, call_ok], 1)  # (B, C+n+m)
    attn = no_empty_rows(attn & call_ok[:, :, None] & key_ok[:, None, :])  # (B, n+m, C+n+m)
    tokens = torch.cat([x.gather(1, new_idx), torch.full_like(q_idx, model.cfg.mask_id)], 1)
    positions = torch.cat([new_idx, q_idx], 1)  # (B, n+m) original positions
    h = model.run(tokens, positions, attn, cache)  # (B, n+m, D)
    if cache is not None:
        cache.store(new_idx, new_valid)
    return model.logits(h[:, n:])  # (B, m, V)


@torch.inference_mode()  # like no_grad, minus autograd's per-op bookkeeping
def generate(
    model: SetDiffusionLM,
    prompt=None,
    infill=None,
    batch_size: int = 1,
    max_new_tokens: int | None = None,
    window: int | None = None,
    threshold: float = math.inf,
    temperature: float = 1.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    stop_at_eos: bool = False,
) -> Generation:
    """The set sampler, batched: every row has its own window and progress. `prompt` (T,) or
    (B, T) ids to continue, or `infill` with MASK where to fill (the other tokens are context
    and never change); both are checked in Running, below. The window w defaults to d for
    staggered generation, else the largest (infilling too); tau = `threshold` > 1 reveals one
    token per step; temperature 0 is greedy; top_p 1 draws from the model's own distribution
    (the authors' default). `use_cache=False` runs the cache-free reference step."""
    cfg = model.cfg
    device = next(model.parameters()).device
    w = sampler_window(cfg, window, threshold, temperature, top_p, infill is not None)
    x = canvas(cfg, prompt, infill, batch_size, max_new_tokens, device)  # (B, T)
    B, T = x.shape
    start = time.perf_counter()
    reveal_step = torch.where(x == cfg.mask_id, MASKED, GIVEN)  # (B, T)
    pending = x != cfg.mask_id  # revealed, not cached yet: the context, at step 0
    done = pending.all(1)
    steps = torch.zeros(B, dtype=torch.long, device=device)
    cache = KVCache(cfg, B, T, max_call=T + w, device=device) if use_cache else None
    block_size = cfg.set_size if cfg.order == "block" else None
    was_training = model.training
    model.eval()  # dropout off; restored below
    nfe = 0
    while not done.all():
        # 1. the window of each unfinished row
        masked = (x == cfg.mask_id) & ~done[:, None]
        queries = gather_sets(window_queries(masked, w, block_size))
        # 2. one network call (cached: it also writes last step's set into the cache)
        if use_cache:
            new = gather_sets(pending)
        else:  # the cache-free step: every revealed token, in decode order (step, position)
            new = gather_sets(reveal_step >= GIVEN, key=reveal_step)
        logits = predict(model, x, new, queries, cache)
        # 3. a candidate per query; 4. the commit rule picks this step's set
        cand, conf = draw_candidates(logits, temperature, top_p, generator)  # (B, m)
        q_idx, q_valid = queries
        reveal = commit_rule(conf, q_valid, threshold)  # (B, m)
        assert not (q_valid.any(1) & ~reveal.any(1)).any(), "a step revealed no token"
        b, j = reveal.nonzero(as_tuple=True)  # (N,) rows and queries revealed
        x[b, q_idx[b, j]] = cand[b, j]
        reveal_step[b, q_idx[b, j]] = nfe
        pending = reveal_step == nfe  # this step's set: the next call caches it
        steps += ~done
        nfe += 1
        done |= (x != cfg.mask_id).all(1)
        if stop_at_eos:
            done |= stop_at_first_eos(cfg, x, reveal_step)
    model.train(was_training)
    synchronize(device)
    with torch.inference_mode(False):  # plain tensors out: they may feed a training forward
        out = (x.clone(), reveal_step.clone(), nfe, steps.cpu().clone())
        return Generation(*out, time.perf_counter() - start)


def stop_at_first_eos(cfg: Config, x, reveal_step):
    """Rows whose first generated EOS has everything before it revealed are done; what follows
    it (generated or still masked) becomes PAD (EOS without PAD), step ERASED. Given tokens
    (infill context) never change. Updates x and reveal_step; returns the stopped rows."""
    pos = torch.arange(x.shape[1], device=x.device)[None, :]
    eos = (x == cfg.eos_id) & (reveal_step >= 0)  # generated, not given
    first = torch.where(eos, pos, x.shape[1]).min(1, keepdim=True).values  # (B, 1)
    gaps = ((x == cfg.mask_id) & (pos < first)).any(1)
    stop = (first[:, 0] < x.shape[1]) & ~gaps
    after = stop[:, None] & (pos > first) & (reveal_step != GIVEN)
    # NOTE: a model without PAD (OWT) fills the rest with EOS; reveal_step marks it ERASED
    x[after] = cfg.eos_id if cfg.pad_id is None else cfg.pad_id
    reveal_step[after] = ERASED
    return stop


# ---- Checkpoints: setdiff's own, and the authors' released SetDLM folders -------------------
CHECKPOINT_FORMAT = "setdiff-checkpoint-2"  # the layout of save_checkpoint, and the network


def save_checkpoint(path, model: SetDiffusionLM, tokenizer: Tokenizer, **extra):
    """Config, tokenizer, weights and extras, to a temporary file renamed to `path` (atomic)."""
    model = getattr(model, "_orig_mod", model)  # unwrap torch.compile
    head = {"format": CHECKPOINT_FORMAT, "config": asdict(model.cfg), "tokenizer": tokenizer.spec()}
    tmp = f"{os.fspath(path)}.tmp-{os.getpid()}"
    try:
        torch.save(head | {"model": model.state_dict()} | extra, tmp)
        os.replace(tmp, path)
    except RuntimeError as e:  # torch reports a full disk as a RuntimeError
        raise OSError(f"could not write {path}: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_checkpoint(path, device="cpu"):
    """(model, tokenizer, checkpoint dict) of save_checkpoint's file or a released model's folder."""
    if os.path.isdir(path):
        return load_released(path, device)
    require(os.path.exists(path), f"checkpoint {path} not found: train one with train_small.py")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:
        raise ValueError(f"{path} is not a readable checkpoint ({type(e).__name__})") from None
    fmt = ckpt.get("format") if isinstance(ckpt, dict) else None
    old = "its network differs (exact GELU, LayerNorm biases, no head bias): retrain it"
    require(fmt != "setdiff-checkpoint-1", f"{path} was written by an older setdiff; {old}")
    require(fmt == CHECKPOINT_FORMAT, f"{path} is not a setdiff checkpoint")
    try:  # an unknown config field or weight: another version
        model = SetDiffusionLM(Config(**ckpt["config"]))
        model.load_state_dict(ckpt["model"], strict=True)
    except (TypeError, RuntimeError, KeyError) as e:
        first = " ".join(str(e).split())[:300]  # a long message in one line
        raise ValueError(f"{path} does not match this setdiff.py: {first}") from None
    return model.to(device).eval(), Tokenizer.from_spec(ckpt["tokenizer"]), ckpt


# The released SetDLMs (lm1b-setdlm-smax{8,16,32}, owt-setdlm-smax{8,16,32}) are this model:
# the same blocks under other names, after a "backbone." prefix.
RELEASED_NAMES = {  # dotted on both sides, so that ".norm1." never matches ".norm10."
    ".vocab_embed.embedding": ".tok_emb.weight",
    ".norm1.": ".ln1.",
    ".norm2.": ".ln2.",
    ".attn_qkv.": ".attn.qkv.",
    ".attn_out.": ".attn.proj.",
    ".output_layer.norm_final.": ".ln_f.",
    ".output_layer.linear.": ".head.",
}
RELEASED_UNUSED = ("static_attention_mask", "backbone.rotary_emb.inv_freq")  # rebuilt here


def load_released(folder, device="cpu"):
    """A released SetDLM as a hub download gives it: config.json, pytorch_model.bin or
    model.safetensors, and vocab.txt (BERT, LM1B) or vocab.json + merges.txt (GPT-2, OWT)."""
    path = os.path.join(folder, "config.json")
    why = "give a checkpoint file, or a released model's folder"
    require(os.path.isfile(path), f"{folder} is a folder without a config.json: {why}")
    spec = read_json(path, "a released model's config.json")
    kind = released_kind(spec)
    require(kind is None, f"{folder} holds {kind}: setdiff runs the released SetDLM DiTs only")
    if os.path.isfile(os.path.join(folder, "vocab.txt")):  # BERT WordPiece (the LM1B models)
        tok = Tokenizer.from_vocab(os.path.join(folder, "vocab.txt"))
    else:  # GPT-2 byte-level BPE (the OWT models)
        tok = Tokenizer.from_bpe(*(os.path.join(folder, f) for f in ("vocab.json", "merges.txt")))
    try:
        cfg = released_config(spec, tok)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path} lacks a field a SetDLM's config.json has: {e}") from None
    match = cfg.vocab_size == tok.vocab_size and cfg.mask_id == tok.mask_id
    require(match, f"{folder}: its tokenizer files do not fit config.json (vocab size, MASK id)")
    weights = {}
    for name, tensor in released_weights(folder).items():
        if name in RELEASED_UNUSED:
            continue
        require(name.startswith("backbone."), f"{folder}: unknown weight {name!r}")
        key = "." + name.removeprefix("backbone.")
        for old, new in RELEASED_NAMES.items():
            key = key.replace(old, new)
        weights[key[1:]] = tensor
    model = SetDiffusionLM(cfg)
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as e:
        first = " ".join(str(e).split())[:300]
        raise ValueError(f"{folder}: the weights do not fit config.json: {first}") from None
    return model.to(device).eval(), tok, {"config": asdict(cfg), "released": os.fspath(folder)}


def released_config(spec: dict, tok: Tokenizer) -> Config:
    net, noise, L = spec["backbone_config"], spec["noise_config"], spec["length"]  # its parts
    d = noise["desired_block_size"]
    s = noise.get("max_block_size", L)
    # NOTE: config.json says max_block_size = block_size (= L), but the training-time schedule
    # ignored it and used s = min(2d, L); the authors' own evaluation loader maps it back so.
    if s == noise.get("block_size", L):
        s = min(2 * d, L)
    # NOTE: PAD comes from the tokenizer: OWT's config.json names EOS (50256) as its pad id,
    # but its rows have no padding, and EOS targets are scored (the authors' hub evaluation).
    shape = dict(n_layer=net["num_layers"], n_head=net["n_heads"], d_model=net["hidden_size"])
    ids = dict(mask_id=spec["mask_token_id"], bos_id=tok.bos_id, eos_id=tok.eos_id)
    rest = dict(dropout=net["dropout"], set_size=d, max_set_size=s, pad_id=tok.pad_id)
    return Config(net["vocab_size"], L, **shape, **ids, **rest)


def released_kind(spec) -> str | None:
    """None for a SetDLM on the authors' DiT, else what it is (their baselines share the format)."""
    require(isinstance(spec, dict), "config.json does not hold an object")
    net = spec.get("backbone_config") or {}
    target = str(net.get("_target_", ""))
    arch = (spec.get("architectures") or ["?"])[0]
    base = net.get("pretrained_model_name_or_path")
    kinds = [  # (is it, what it is): the first that holds
        ("AutoModel" in target or base, f"a Qwen3 backbone ({base}; the CNN/DM or GSM8K models)"),
        ("DITLegacy" in target, "a legacy DiT baseline (owt-ar or owt-mdlm)"),
        (arch == "AR" or net.get("causal_attention"), "an autoregressive model (a causal DiT)"),
        (arch == "MDLM", "an MDLM (masked diffusion: bidirectional attention, another bound)"),
        (arch == "BD3LM", f"a BD3-LM (block diffusion, block size {spec.get('block_size')})"),
        (arch != "SetDLM" or not target.endswith(".DIT"), f"an unknown model ({arch}, {target})"),
        (net.get("adaln"), "a SetDLM with timestep modulation (adaLN), unlike every release"),
    ]
    return next((what for holds, what in kinds if holds), None)


def read_json(path, what: str):
    try:
        return json.loads(read_text(path, what))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON ({e}): not {what}") from None


def released_weights(folder) -> dict:
    """pytorch_model.bin's state dict, or model.safetensors read without a dependency: an 8-byte
    little-endian header size, a JSON header {name: dtype, shape, data_offsets}, the raw bytes."""
    bin_path = os.path.join(folder, "pytorch_model.bin")
    if os.path.isfile(bin_path):
        try:
            return torch.load(bin_path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise ValueError(f"{bin_path} is not a state dict ({type(e).__name__})") from None
    path = os.path.join(folder, "model.safetensors")
    require(os.path.isfile(path), f"{folder} has no weights: pytorch_model.bin, model.safetensors")
    with open(path, "rb") as f:
        data = bytearray(f.read())
    n = int.from_bytes(data[:8], "little")
    try:
        header = json.loads(data[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(f"{path} is not a safetensors file (its header is not JSON)") from None
    header.pop("__metadata__", None)
    dtypes = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    dtypes |= {"I64": torch.int64, "BOOL": torch.bool}
    weights = {}
    for name, info in header.items():
        start, end = info["data_offsets"]
        dtype = dtypes.get(info["dtype"])
        require(dtype and end > start, f"{path}: setdiff does not read {name} ({info['dtype']})")
        raw = data[8 + n + start : 8 + n + end]
        weights[name] = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(info["shape"])
    return weights


# ---- Running: user errors, inputs, the mask printer, device, dtype ------------------------
def require(ok, message: str):
    """A user error: a ValueError whose message says what to do (scripts print it in one line)."""
    if not ok:
        raise ValueError(message)


def check_config(cfg: Config) -> None:
    """A Config's user errors, each with its own message (bad flags end up here)."""
    L, d = cfg.seq_len, cfg.set_size
    policies = ", ".join(ORDER_POLICIES)
    require(cfg.order in ORDER_POLICIES, f"unknown order policy {cfg.order!r}; use {policies}")
    require(L >= 2, f"the row length L must be at least 2, got {L}")
    if cfg.order in ("staggered", "block"):
        require(1 <= d <= L, f"the set size d must be in [1, L={L}], got {d}")
    if cfg.order == "staggered":
        s = cfg.max_set_size
        require(d <= s <= L, f"the window s (max set size) must be in [d={d}, L={L}], got {s}")
    require(cfg.d_model % cfg.n_head == 0, "d_model must be a multiple of n_head")
    require(cfg.d_model // cfg.n_head % 2 == 0, "d_model / n_head must be even (rotary pairs)")
    for i in (cfg.mask_id, cfg.bos_id, cfg.eos_id, cfg.pad_id):
        require(i is None or 0 <= i < cfg.vocab_size, f"the special id {i} is not in the vocab")
    others = (cfg.bos_id, cfg.eos_id, cfg.pad_id)
    require(cfg.mask_id not in others, "MASK must differ from BOS, EOS and PAD")
    pad_clash = cfg.pad_id is not None and cfg.pad_id in (cfg.bos_id, cfg.eos_id)
    require(not pad_clash, "PAD must differ from BOS and EOS (padding is never scored)")


def sampler_window(cfg: Config, window, threshold, temperature, top_p, infill=False) -> int:
    """Check `generate`'s sampling options -> the window: by default d for staggered generation,
    else the largest (so for infilling: holes with right context are easy to fill together)."""
    w_max = max_window(cfg)
    default = cfg.set_size if cfg.order == "staggered" and not infill else w_max
    w = default if window is None else int(window)
    require(math.isfinite(temperature) and temperature >= 0, "temperature must be >= 0 (0: greedy)")
    require(0 < top_p <= 1, f"top-p must be in (0, 1], got {top_p}")
    require(not math.isnan(threshold), "the threshold must be a number (> 1: one token a step)")
    seen = f"the {cfg.order} policy saw at most {w_max} queries a step in training"
    require(1 <= w <= w_max, f"the window must be in [1, {w_max}] ({seen}), got {w}")
    return w


def show_mask(mask: torch.Tensor) -> str:
    """A (2L, 2L) training mask as text; rows are queries, columns keys (c clean, m mask)."""
    L = mask.shape[0] // 2
    names = [f"c{i}" for i in range(L)] + [f"m{i}" for i in range(L)]
    w = max(len(n) for n in names)
    cells = []  # per line: the clean half | the mask half
    for values in [names] + [[str(int(v)) for v in row] for row in mask.tolist()]:
        values = [v.rjust(w) for v in values]
        cells.append(" ".join(values[:L]) + " | " + " ".join(values[L:]))
    lines = [" " * (w + 2) + cells[0]]  # the header: key names
    lines += [f"{name.rjust(w)} [{row} ]" for name, row in zip(names, cells[1:])]
    return "\n".join(lines)


def canvas(cfg: Config, prompt, infill, batch_size: int, max_new_tokens, device):
    """The starting rows, BOS (where the model has one) + prompt + MASK to generate, or the infill
    context with MASK to fill; ids (T,) (repeated batch_size times) or (B, T)."""
    require(prompt is None or infill is None, "give a prompt or an infill sequence, not both")
    if prompt is None and infill is None:  # BOS, or without one EOS: a new document
        prompt = [cfg.eos_id if cfg.bos_id is None else cfg.bos_id]
    src = torch.as_tensor(prompt if infill is None else infill, dtype=torch.long).to(device)
    src = src[None] if src.dim() == 1 else src
    require(src.dim() == 2, f"give token ids of shape (T,) or (B, T), got {tuple(src.shape)}")
    ok = len(src) == 1 or batch_size in (1, len(src))
    require(ok, f"{len(src)} rows of ids for batch_size {batch_size}: give 1 row or batch_size")
    in_vocab = not src.numel() or (0 <= src.min() and src.max() < cfg.vocab_size)
    require(in_vocab, f"token ids must lie in [0, {cfg.vocab_size}): from another tokenizer?")
    src = src.expand(max(batch_size, len(src)), -1).clone()
    starts = src[:, 0] == cfg.bos_id if src.shape[1] else torch.zeros(len(src), dtype=torch.bool)
    if cfg.bos_id is not None and not starts.all():
        require(not starts.any(), "some rows start with BOS, some do not")
        src = torch.cat([torch.full_like(src[:, :1], cfg.bos_id), src], 1)
    P, L = src.shape[1], cfg.seq_len
    if infill is not None:
        require((src == cfg.mask_id).any(1).all(), "infill needs a MASK to fill in every row")
        require((src[:, 0] != cfg.mask_id).all(), "position 0 is always given: it cannot be a MASK")
        require(P <= L, f"{P} infill tokens (with BOS) exceed L={L}")
        return src
    require(P > 0, "the prompt is empty and this model has no BOS to start from")
    require(not (src == cfg.mask_id).any(), "the prompt contains MASK: use infill= to fill holes")
    require(P < L, f"a prompt of {P} tokens (with BOS) leaves no room in the L={L} context")
    new = L - P if max_new_tokens is None else int(max_new_tokens)
    require(1 <= new <= L - P, f"max_new_tokens must be in [1, {L - P}] after {P} prompt tokens")
    return torch.cat([src, torch.full((len(src), new), cfg.mask_id, device=device)], 1)


def runtime(device=None, dtype="auto", threads=None, local_rank=0) -> tuple:
    """Where and how to run, each choice with its reason -> (device, dtype, a line saying so):
    the device given (checked) or the first of cuda, mps, cpu ("cuda" under torchrun: this
    process's GPU); the autocast dtype, bf16 on a GPU that has it; torch's threads, as given or
    the cores other processes leave idle. NOTE: torch's default, a thread per core, collapses
    beside other work (batch-1 sampling, 2 cores, 2 busy: 5-50 tokens/s, 264-282 with 1)."""
    have = {"cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    usable = [k for k in have if have[k]] + ["cpu"]
    name = device if device and device != "auto" else usable[0]
    kind = re.fullmatch(r"(cpu|cuda|mps)(:\d+)?", name)
    use = " or ".join(usable)
    require(kind and kind[1] in usable, f"--device {name!r} is not available here; use {use}")
    where = torch.device(f"cuda:{local_rank}" if name == "cuda" else name)
    why = "a GPU is available" if name != "cpu" else "no GPU found"
    why = "requested with --device" if device not in (None, "auto") else why
    if dtype != "auto":
        how, why_dtype = getattr(torch, dtype), "requested with --dtype"
    elif where.type == "cuda" and torch.cuda.is_bf16_supported():
        how, why_dtype = torch.bfloat16, "the GPU supports bf16 (the paper trains with bf16)"
    else:  # NOTE: measured 0.64x float32 on a 2-core Xeon, 1.3x on one with AMX, 1.5x on an EPYC
        how, why_dtype = torch.float32, "bf16 is not known to be faster: train_small.py --bench"
    cores = os.cpu_count() or 1
    busy = round(os.getloadavg()[0]) if hasattr(os, "getloadavg") else 0
    n = threads or min(cores, max(1, cores - busy))
    why_threads = "requested with --threads" if threads else f"{cores} cores, load {busy} elsewhere"
    torch.set_num_threads(n)
    line = f"device: {where} ({why}); {str(how)[6:]} ({why_dtype}); {n} threads ({why_threads})"
    return where, how, line


def autocast(device: torch.device, dtype: torch.dtype):
    """Mixed precision for forward passes: matmuls in `dtype`, weights stay float32."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so that wall-clock times measure the work itself."""
    if device.type in ("cuda", "mps"):
        getattr(torch, device.type).synchronize()


# ---- Appendix: the tokenizer shim ----------------------------------------------------------
# The method needs a vocabulary with named special ids: MASK (an unrevealed position), EOS (the
# end of a sentence or document) and, where the data has them, BOS (position 0) and PAD.
#   bytes:     UTF-8 bytes, no files needed; toy runs, and bits per byte for free.
#   wordpiece: BERT uncased WordPiece from a vocab.txt (the LM1B models). Standard library
#              only; the ids of HuggingFace's BertWordPieceTokenizer(lowercase=True).
#   bpe:       GPT-2 byte-level BPE from vocab.json + merges.txt (the OWT models), MASK appended.
class Tokenizer:
    """encode() adds no special tokens; decode() leaves out PAD, MASK and a BOS that is not also
    EOS, and writes EOS as a newline (GPT-2: <|endoftext|>)."""

    def __init__(self, kind: str, pieces=None, merges=None, source: str = "vocab"):
        require(kind in ("bytes", "wordpiece", "bpe"), f"unknown tokenizer kind {kind!r}")
        self.kind = kind
        self.pieces = list(pieces or [])  # id -> piece
        self.ids = {piece: i for i, piece in enumerate(self.pieces)}  # piece -> id
        self.memo = {}  # word -> ids: natural text repeats few words
        self.merges = [tuple(m) for m in merges or []]  # GPT-2's pair merges, best first
        self.ranks = {pair: rank for rank, pair in enumerate(self.merges)}
        self.unk_id = None
        if kind == "bytes":  # ids 0..255 are the bytes; the specials follow
            self.pad_id, self.bos_id, self.eos_id, self.mask_id = 256, 257, 258, 259
            self.vocab_size = 260
        elif kind == "wordpiece":
            self._check_vocab(_BERT_SPECIALS, source, "a BERT uncased model's vocab.txt")
            self.pad_id, self.unk_id, self.mask_id = map(self.ids.get, ("[PAD]", "[UNK]", "[MASK]"))
            # NOTE: [CLS] opens every row AND ends every sentence, as in the rows the authors'
            # LM1B models were trained on; [SEP] never occurs.
            self.bos_id = self.eos_id = self.ids["[CLS]"]
            self.vocab_size = len(self.pieces)
            self.longest = max(map(len, self.pieces))
        else:
            self._check_vocab((GPT2_EOS,), source, "GPT-2's vocab.json")
            self.pad_id = self.bos_id = None  # OWT rows: raw chunks of the document stream
            self.eos_id = self.ids[GPT2_EOS]
            self.mask_id = len(self.pieces)  # appended, as the authors add it (50257 for GPT-2)
            self.vocab_size = len(self.pieces) + 1
        self.silent = {self.pad_id, self.mask_id, self.bos_id} - {self.eos_id, None}

    def _check_vocab(self, specials, source: str, expected: str) -> None:
        missing = ", ".join(t for t in specials if t not in self.ids)
        require(not missing, f"{source} is not {expected}: it has no {missing}")
        require(len(self.ids) == len(self.pieces), f"{source}: a token appears twice")
        require(all(p.strip() for p in self.pieces), f"{source}: a blank token")

    @classmethod
    def bytes(cls) -> Tokenizer:
        return cls("bytes")

    @classmethod
    def from_vocab(cls, path) -> Tokenizer:
        """BERT uncased WordPiece from a vocab.txt: one token per line, id = line number."""
        # NOTE: split at "\n" only: str.splitlines() also splits at U+2028, U+0085, ...,
        # which may be (part of) tokens. A final newline is optional; CRLF is accepted.
        text = read_text(path, "the vocab.txt of a BERT uncased model")
        pieces = [s.removesuffix("\r") for s in text.removesuffix("\n").split("\n")]
        return cls("wordpiece", pieces, source=f"vocab file {path}")

    @classmethod
    def from_bpe(cls, vocab_json, merges_txt) -> Tokenizer:
        """GPT-2 byte-level BPE: vocab.json {piece: id}, merges.txt one "a b" pair per line."""
        vocab = read_json(vocab_json, "GPT-2's vocab.json")
        ok = isinstance(vocab, dict) and sorted(vocab.values()) == list(range(len(vocab)))
        require(ok, f"{vocab_json} is not GPT-2's vocab.json: ids must be 0..n-1")
        lines = read_text(merges_txt, "GPT-2's merges.txt").replace("\r", "").split("\n")
        merges = [line.split(" ") for line in lines if line and not line.startswith("#version")]
        bad = next((m for m in merges if len(m) != 2 or "".join(m) not in vocab), None)
        why = "two pieces that merge into a piece of vocab.json"
        require(bad is None, f"{merges_txt}: the merge {' '.join(bad or [])!r} is not {why}")
        return cls("bpe", sorted(vocab, key=vocab.get), merges, f"vocab file {vocab_json}")

    @classmethod
    def from_spec(cls, spec) -> Tokenizer:
        """Rebuild a tokenizer from spec() (stored in checkpoints)."""
        ok = isinstance(spec, dict) and spec.get("kind") in ("bytes", "wordpiece", "bpe")
        require(ok, f"not a tokenizer spec: {str(spec)[:80]!r}; expected one of Tokenizer.spec()")
        return cls(spec["kind"], spec.get("vocab"), spec.get("merges"), "tokenizer spec")

    def spec(self) -> dict:
        """JSON-ready; it carries the vocab (and merges), so no file is needed later."""
        return {"kind": self.kind, "vocab": self.pieces, "merges": self.merges}

    def encode(self, text: str) -> list:
        if self.kind == "bytes":
            return list(text.encode("utf-8"))
        bert = self.kind == "wordpiece"
        ids = []
        # Special-token strings are matched first, case-sensitively ("[cls]" is ordinary
        # text); the split's odd-numbered pieces are those tokens.
        for k, chunk in enumerate((_BERT_SPECIAL_RE if bert else _GPT2_SPECIAL_RE).split(text)):
            if k % 2:
                ids.append(self.ids[chunk])
                continue
            for word in _bert_words(chunk) if bert else _gpt2_words(chunk):
                if word not in self.memo:
                    self.memo[word] = self._wordpiece(word) if bert else self._bpe(word)
                ids += self.memo[word]
        return ids

    def _wordpiece(self, word: str) -> tuple:
        """Greedy longest-match-first: take the longest vocab piece that prefixes the rest of
        the word ("##" marks a continuation); a word with an unmatched rest is one [UNK]."""
        if len(word) > 100:  # HuggingFace's limit: longer words are [UNK]
            return (self.unk_id,)
        ids = []
        start = 0
        while start < len(word):
            for end in range(min(len(word), start + self.longest), start, -1):
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in self.ids:
                    ids.append(self.ids[piece])
                    start = end
                    break
            else:
                return (self.unk_id,)
        return tuple(ids)

    def _bpe(self, word: str) -> tuple:
        """Merge the best-ranked adjacent pair everywhere, left to right, until none is ranked."""
        parts = list(word)
        while len(parts) > 1:
            pairs = [p for p in zip(parts, parts[1:]) if p in self.ranks]
            if not pairs:
                break
            a, b = min(pairs, key=self.ranks.get)
            merged = []
            for part in parts:
                if merged and merged[-1] == a and part == b:
                    merged[-1] = a + b
                else:
                    merged.append(part)
            parts = merged
        return tuple(self.ids[p] for p in parts)

    def decode(self, ids) -> str:
        """Text of ids (list, tensor or array). WordPiece pieces are joined by spaces, except
        that a "##" piece continues the previous one; GPT-2 pieces are bytes."""
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        last = self.vocab_size - 1
        for i in ids:  # a negative id would silently index from the end of the vocab
            ok = isinstance(i, (int, np.integer)) and 0 <= i <= last
            require(ok, f"token id {i!r} is outside this tokenizer's vocab (0..{last})")
        ids = [i for i in ids if i not in self.silent]
        if self.kind == "bytes":
            return bytes(10 if i == self.eos_id else i for i in ids).decode("utf-8", "replace")
        if self.kind == "bpe":  # byte characters: join the bytes first (a character may span ids)
            data = bytes(_CHAR_BYTES[c] for i in ids for c in self.pieces[i])
            try:  # lone surrogates round-trip (see _gpt2_words)
                return data.decode("utf-8", "surrogatepass")
            except UnicodeDecodeError:  # ids that cut a character: U+FFFD
                return data.decode("utf-8", "replace")
        out = []
        for i in ids:
            piece = "\n" if i == self.eos_id else self.pieces[i]
            if piece.startswith("##"):
                piece = piece[2:]
            elif out and "\n" not in (piece, out[-1]):  # a space between words, not at a newline
                piece = " " + piece
            out.append(piece)
        return "".join(out)


def read_text(path, what: str) -> str:
    require(os.path.isfile(path), f"{path} does not exist or is not a file: pass {what}")
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 (byte {e.start}): not {what}") from None


_BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
_BERT_SPECIAL_RE = re.compile("(" + "|".join(map(re.escape, _BERT_SPECIALS)) + ")")
GPT2_EOS = "<|endoftext|>"
_GPT2_SPECIAL_RE = re.compile("(" + re.escape(GPT2_EOS) + ")")


def _bert_words(text: str) -> list:
    """BERT normalisation and pre-tokenisation, in the reference's order: clean the text and
    pad CJK ideographs, strip accents (NFD, drop Mn), lower-case, isolate punctuation, split
    at whitespace. Two str.translate tables fill themselves per character (fast, in C)."""
    if text.isascii():  # NFD is the identity on ASCII: one table
        return text.translate(_ASCII).split()
    return unicodedata.normalize("NFD", text.translate(_CLEAN)).translate(_FINISH).split()


class _CharMap(dict):
    """A str.translate table that computes each character's rule on first use."""

    def __init__(self, rule):  # no dict.__init__: the table starts empty
        self.rule = rule

    def __missing__(self, cp: int) -> str:
        return self.setdefault(cp, self.rule(chr(cp)))


def _clean_char(ch: str) -> str:
    """Tab/newline/CR -> space; control, format, private-use, surrogates, NUL and U+FFFD
    deleted; other White_Space -> space; a CJK ideograph becomes a word of its own.
    NOTE: unassigned code points (Cn) are kept, as in the reference."""
    if ch in "\t\n\r":
        return " "
    if ch in ("\x00", "\ufffd") or _category(ch) in ("Cc", "Cf", "Co", "Cs"):
        return ""  # before the whitespace test: U+000B, U+0085 are Cc
    if ch in _WHITESPACE:
        return " "
    return f" {ch} " if any(lo <= ord(ch) <= hi for lo, hi in _CJK) else ch


def _finish_char(ch: str) -> str:
    """After NFD: drop non-spacing marks (accents), lower-case this character alone, pad
    punctuation. NOTE: per character, so a final capital sigma becomes σ, not Python's ς."""
    if _category(ch) == "Mn":
        return ""
    return "".join(f" {c} " if _is_punctuation(c) else c for c in ch.lower())


def _is_punctuation(ch: str) -> bool:
    """BERT's punctuation: non-alphanumeric printable ASCII ($, +, <, ^, `, ~ too) and any P*."""
    return ("!" <= ch <= "~" and not ch.isalnum()) or _category(ch)[0] == "P"


def _category(ch: str) -> str:
    """The Unicode category as the reference sees it: it uses older tables than this Python,
    so characters whose class changed since (found by probing every code point) are pinned."""
    return _PINNED.get(ord(ch)) or unicodedata.category(ch)


def _spans(text: str) -> list:
    """ "0890-0891 0A76 ..." (hex, inclusive ranges) -> [(0x890, 0x891), (0xA76, 0xA76), ...]."""
    pairs = re.findall(r"([0-9A-Fa-f]+)(?:-([0-9A-Fa-f]+))?", text)
    return [(int(lo, 16), int(hi or lo, 16)) for lo, hi in pairs]


def _code_points(text: str) -> frozenset:
    return frozenset(cp for lo, hi in _spans(text) for cp in range(lo, hi + 1))


# The Unicode White_Space property: whitespace for BERT and GPT-2 alike (Python's isspace()
# and \s also accept U+001C..U+001F, which BERT deletes as control characters).
_WHITE_SPACE = "0009-000D 0020 0085 00A0 1680 2000-200A 2028 2029 202F 205F 3000"
_WHITESPACE = frozenset(map(chr, _code_points(_WHITE_SPACE)))
# CJK ideographs, each its own word. NOTE: the sixth range starts at 0x2B920, not Google
# BERT's 0x2B820, as in the HuggingFace reference; Extension G and later are not listed.
_CJK = _spans(
    "4E00-9FFF 3400-4DBF 20000-2A6DF 2A700-2B73F 2B740-2B81F 2B920-2CEAF F900-FAFF 2F800-2FA1F"
)
# Marks and punctuation added to Unicode after the reference's tables are letters there; two
# symbols were punctuation (166D, 111C9) and two spacing marks non-spacing (1734, 1171E).
_PINNED = {0x166D: "Po", 0x111C9: "Po", 0x1734: "Mn", 0x1171E: "Mn"} | dict.fromkeys(
    _code_points("""
    05C8-05C9 061D 07FD 0890-0891 0897-089F 08CA-08E2 09FD-09FE 0A76 0AFA-0AFF 0B53-0B55 0C04 0C3C 0C77 0C84
    0D00 0D3B-0D3C 0D81 0EBA 0ECE 180F 1885-1886 1ABF-1AF0 1B4E-1B4F 1B7D-1B7F 1DF6-1DFB 2E43-2E4F 2E52-2E5D
    2E60-2E63 A82C A8C5 A8FF A9BD 10D24-10D27 10D69-10D6E 10EAB-10EAD 10ECB-10ED0 10EF0-10EFF 10F46-10F50
    10F55-10F59 10F82-10F89 11070 11073-11074 110C2 110CD 111CF 1123E 11241 1133B 113BB-113C0 113CE 113D0 113D2
    113D4-113D5 113D7-113D8 113E1-113E2 11438-1143F 11442-11444 11446 1144B-1144F 1145A-1145B 1145D-1145E
    11660-1166C 116B9 1182F-11837 11839-1183B 1193B-1193C 1193E 11943-11946 119D4-119D7 119DA-119DB 119E0 119E2
    11A01-11A0A 11A33-11A38 11A3B-11A47 11A51-11A56 11A59-11A5B 11A8A-11A96 11A98-11A9C 11A9E-11AA2 11B00-11B09
    11B60 11B62-11B64 11B66 11BE1 11C30-11C36 11C38-11C3D 11C3F 11C41-11C45 11C70-11C71 11C92-11CA7 11CAA-11CB0
    11CB2-11CB3 11CB5-11CB6 11D31-11D36 11D3A 11D3C-11D3D 11D3F-11D45 11D47 11D90-11D91 11D95 11D97 11DF0
    11EF3-11EF4 11EF7-11EF8 11F00-11F01 11F36-11F3A 11F40 11F42-11F4F 11F5A 11FFF 12FF1-12FF2 13430-13440
    13447-13455 1611E-16129 1612D-1612F 16D6D-16D6F 16E97-16E9A 16F4F 16FE2 16FE4 1CF00-1CF2D 1CF30-1CF46
    1D127-1D128 1D25B-1D25C 1E000-1E006 1E008-1E018 1E01B-1E021 1E023-1E024 1E026-1E02A 1E08F 1E130-1E136 1E2AE
    1E2EC-1E2EF 1E4EC-1E4EF 1E5EE-1E5EF 1E5FF 1E6E3 1E6E6 1E6EE-1E6EF 1E6F5 1E944-1E94A 1E95E-1E95F
"""),
    "Lo",
)
_CLEAN, _FINISH = _CharMap(_clean_char), _CharMap(_finish_char)
_ASCII = {cp: _clean_char(chr(cp)).translate(_FINISH) for cp in range(128)}


# GPT-2's byte-level BPE runs on text in which every byte is a visible character: printable
# Latin-1 bytes stand for themselves, the other 68 bytes for chr(256), chr(257), ...
_KEPT = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
_MOVED = [b for b in range(256) if b not in _KEPT]
_BYTE_CHARS = {b: chr(b) for b in _KEPT} | {b: chr(256 + n) for n, b in enumerate(_MOVED)}
_CHAR_BYTES = {c: b for b, c in _BYTE_CHARS.items()}
# Letters (L) and numbers (N) that this Python's Unicode 14 tables call unassigned but the
# reference (HuggingFace tokenizers, Unicode 16) knows: found by comparing every code point.
_NEWER = {
    "L": """1c89-1c8a a7cb-a7cd a7da-a7dc 105c0-105f3 10d4a-10d65 10d6f-10d85 10ec2-10ec4 1123f-11240
    11380-11389 1138b 1138e 11390-113b5 113b7 113d1 113d3 11bc0-11be0 11f02 11f04-11f10 11f12-11f33
    1342f 13441-13446 13460-143fa 16100-1611d 16d40-16d6c 18cff 1b132 1b155 1df25-1df2a 1e030-1e06d
    1e4d0-1e4eb 1e5d0-1e5ed 1e5f0 2b739 2ebf0-2ee5d 31350-323af""",
    "N": """10d40-10d49 116d0-116e3 11bf0-11bf9 11f50-11f59 16130-16139 16d70-16d79 1ccf0-1ccf9
    1d2c0-1d2d3 1e4f0-1e4f9 1e5f1-1e5fa""",
}


@functools.cache
def _gpt2_pattern() -> re.Pattern:
    """GPT-2's pre-tokenizer 's|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+
    with its Unicode classes spelled out as ranges for Python's re (built once, ~0.2 s)."""
    kinds = [unicodedata.category(chr(cp))[0] for cp in range(0x110000)]
    spans = {"L": _spans(_NEWER["L"]), "N": _spans(_NEWER["N"])}
    for kind, run in itertools.groupby(range(0x110000), kinds.__getitem__):
        if kind in spans:
            run = list(run)
            spans[kind].append((run[0], run[-1]))
    spans["S"] = _spans(_WHITE_SPACE)
    # the insides of the character classes [...] of letters, numbers and whitespace
    L, N, S = ("".join(f"{chr(lo)}-{chr(hi)}" for lo, hi in spans[kind]) for kind in "LNS")
    words = f"'s|'t|'re|'ve|'m|'ll|'d| ?[{L}]+| ?[{N}]+| ?[^{S}{L}{N}]+"
    return re.compile(words + f"|[{S}]+(?![^{S}])|[{S}]+")


def _gpt2_words(text: str) -> list:
    """GPT-2's pre-tokens of `text`, as byte characters (surrogatepass: lone surrogates too)."""
    words = _gpt2_pattern().findall(text)
    return ["".join(_BYTE_CHARS[b] for b in w.encode("utf-8", "surrogatepass")) for w in words]
