"""setdiff: set diffusion language models in one readable file.

Reference: "Set Diffusion: Interpolating Token Orderings Between Autoregression and Diffusion
for Fast and Flexible Decoding", Arriola & Kuleshov, ICML 2026 (arXiv 2607.01775).

A set diffusion LM writes a sequence as a series of *sets* of positions; every token of a set
is predicted at once from the tokens revealed in earlier sets. One network and one loss cover
autoregression (sets of one position, left to right), masked diffusion (a uniformly random
order), block diffusion and everything between. A prediction only ever sees revealed tokens,
so their keys/values never change and the sampler extends a KV cache after every step.
README.md ("The method on one page") states every formula used here. The file follows the
method: config -> order policies, staggered schedule -> set-causal masks -> transformer ->
two-stream forward, loss, bound -> sampler -> checkpoints -> appendix: the tokenizer shim.
"""

from __future__ import annotations

import contextlib
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

ORDER_POLICIES = ("staggered", "ar", "uniform", "block")

def require(ok, message: str):
    """Errors a user can cause are ValueErrors whose message says what to do; the scripts
    print them in one line."""
    if not ok:
        raise ValueError(message)

# ---- Config ------------------------------------------------------------------------
@dataclass
class Config:
    """Everything needed to rebuild a model; saved in every checkpoint."""
    vocab_size: int = 260          # V, including the four special tokens
    seq_len: int = 128             # L, tokens per row (BOS ... EOS)
    n_layer: int = 4               # transformer blocks
    n_head: int = 4                # attention heads
    d_model: int = 256             # hidden width
    dropout: float = 0.1           # on embeddings, attention and residual branches
    order: str = "staggered"       # order policy pi: staggered | ar | uniform | block
    set_size: int = 4              # d, target set size of the staggered / block policy
    max_set_size: int | None = None  # s, the staggered window; None -> min(2d, L)
    pad_id: int = 256              # padding: never scored, decoded last
    bos_id: int = 257              # first token of every row, pinned first in every order
    eos_id: int = 258              # end of a sentence (rows are wrapped sentences)
    mask_id: int = 259             # MASK: input of the mask stream, never predicted

    def __post_init__(self):
        L, d, s = self.seq_len, self.set_size, self.max_set_size
        s = self.max_set_size = min(2 * d, L) if s is None else s
        ids, hd = (self.pad_id, self.bos_id, self.eos_id, self.mask_id), self.d_model // self.n_head
        require(self.order in ORDER_POLICIES, f"unknown order policy {self.order!r}; use one of {', '.join(ORDER_POLICIES)}")
        require(2 <= L and 1 <= d <= s <= L, f"need seq_len L >= 2 and 1 <= set_size d <= max_set_size s <= L, "
                f"got L={L} d={d} s={s}")
        require(hd * self.n_head == self.d_model and hd % 2 == 0, "d_model must split into heads of even size")
        require(len(set(ids)) == 4 and 0 <= min(ids) and max(ids) < self.vocab_size,
                f"special ids {ids} must be distinct and in [0, vocab_size)")

# ---- Order policies and the staggered schedule ---------------------------------------
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
        require(1 <= d <= s <= L, f"need 1 <= set_size d={d} <= max_set_size s={s} <= length L={L}")
        self.L, self.d, self.s, self.A = L, d, s, d / (2 * L)
        if d == 1 or d == s:                   # straight curves (k = 1) of width 2A
            self.k, self.b = 1.0, 2 * self.A
        else:                                  # width b chosen so that the reach is exactly s
            self.b = s / (L + s - 1)
            self.k = self.A / (self.b - self.A)
        # a curve of width b and exponent k covers the area k b / (k + 1), which must be A
        require(self.b <= 1 + 1e-12 and math.isclose(self.k * self.b / (self.k + 1), self.A, rel_tol=1e-9),
                f"inconsistent schedule: b={self.b}, k={self.k}, A={self.A}")
        self.loc = (1 - self.b) * (L - 1 - torch.arange(L, dtype=torch.float64)) / max(L - 1, 1)  # (L,)
        # Reach: T_i lies in [loc_i, loc_i + b) and neighbouring offsets are (1 - b)/(L - 1)
        # apart, so i can precede j < i only if i - j < r. The largest useful sampler window
        # is ceil(r), with a tolerance so that r = s gives s.
        self.reach = math.inf if self.b >= 1 else self.b * (L - 1) / (1 - self.b)
        self.window = L if math.isinf(self.reach) else min(L, math.ceil(self.reach - 1e-9))

    def mask_prob(self, t: torch.Tensor) -> torch.Tensor:
        """m_i(t) for t (B,) -> (B, L) float64."""
        u = (t.to(torch.float64)[:, None] - self.loc[None, :]) / self.b      # (B, L)
        # 1 - (1-u)^k through log1p / expm1: accurate near u = 0 even when k < 1
        rising = -torch.expm1(self.k * torch.log1p(-u.clamp(0.0, 1.0 - 1e-16)))
        m = torch.where(u >= 1, 1.0, torch.where(u > 0, rising, 0.0))
        return (m > 0).double() if self.d == 1 else m                         # d = 1: a hard step

    def first_hitting_times(self, batch_size: int, generator=None) -> torch.Tensor:
        """T_i = loc_i + b (1 - exp(-E_i / k)), E_i ~ Exp(1), so that P(T_i <= t) = m_i(t). (B, L)"""
        E = torch.empty(batch_size, self.L, dtype=torch.float64).exponential_(generator=generator)
        return self.loc[None, :] + self.b * -torch.expm1(-E / self.k)

def order_schedule(cfg: Config) -> StaggeredSchedule | None:
    """AR (d = 1) and uniform (d = s = L) are settings of the staggered schedule; block is not."""
    L, d, s = cfg.seq_len, cfg.set_size, cfg.max_set_size
    return None if cfg.order == "block" else \
        StaggeredSchedule(L, *{"ar": (1, 1), "uniform": (L, L), "staggered": (d, s)}[cfg.order])

def decode_times(cfg: Config, batch_size: int, generator=None) -> torch.Tensor:
    """A reveal time per position (B, L); the decode order is time DESCENDING. Block: blocks
    of d positions left to right, a uniform order inside each block."""
    if cfg.order != "block":
        return order_schedule(cfg).first_hitting_times(batch_size, generator)
    block = torch.arange(cfg.seq_len, dtype=torch.float64) // cfg.set_size
    return (block.max() - block) + torch.rand(batch_size, cfg.seq_len, dtype=torch.float64, generator=generator)

def sample_order(cfg: Config, batch_size: int, generator=None, device=None, prefix_len=0, pad_mask=None):
    """Decode orders sigma (B, L) with pinned positions: BOS (position 0) and the first
    `prefix_len` positions first, in position order; then the free positions by reveal time
    descending; padding last (each tier kept by a stable sort). Drawn on the CPU from
    `generator`, so orders do not depend on the device."""
    L = cfg.seq_len
    T, pos = decode_times(cfg, batch_size, generator), torch.arange(L)        # (B, L), (L,)
    prefix = torch.as_tensor(prefix_len).cpu().reshape(-1, 1).clamp(min=1)  # BOS is always pinned
    pad = torch.zeros(batch_size, L, dtype=torch.bool) if pad_mask is None else pad_mask.cpu()
    tier = torch.where(pos < prefix, 0, torch.where(pad, 2, 1))              # (B, L)
    order = torch.argsort(torch.where(tier == 1, -T, pos.double()), dim=1, stable=True)
    return order.gather(1, torch.argsort(tier.gather(1, order), dim=1, stable=True)).to(device)

def max_window(cfg: Config) -> int:
    """The largest sampler window a policy met in training (larger windows pose unseen
    queries): ar 1, block d (block-aligned), uniform L, staggered min(L, ceil(reach))."""
    return {"ar": 1, "block": cfg.set_size}.get(cfg.order) or order_schedule(cfg).window

# ---- Set-causal masks: one predicate, many layouts -----------------------------------
# Every token of a network call carries its rank (its step in the decode order), is_mask
# (a query of the mask stream, or a clean revealed token) and a unique slot (so a query finds
# its own key). The set-causal mask is three named terms OR-ed together; training (clean
# stream | mask stream) and the sampler (cache | new tokens | queries) feed it other vectors.
def set_causal_predicate(q_rank, q_is_mask, q_slot, k_rank, k_is_mask, k_slot):
    """True where a query may attend a key. Arguments broadcast."""
    clean_sees_earlier_or_same_clean = ~q_is_mask & ~k_is_mask & (k_rank <= q_rank)
    mask_sees_strictly_earlier_clean = q_is_mask & ~k_is_mask & (k_rank < q_rank)
    mask_sees_only_itself = q_is_mask & k_is_mask & (k_slot == q_slot)
    return clean_sees_earlier_or_same_clean | mask_sees_strictly_earlier_clean | mask_sees_only_itself

def set_causal_mask(L: int, device=None) -> torch.Tensor:
    """The (2L, 2L) training mask, slots in decode order: clean stream, then mask stream."""
    slot = torch.arange(2 * L, device=device)
    rank, is_mask = slot % L, slot >= L        # clean slot i and mask slot i share step i
    return set_causal_predicate(rank[:, None], is_mask[:, None], slot[:, None],
                                rank[None, :], is_mask[None, :], slot[None, :])

def no_empty_rows(mask: torch.Tensor) -> torch.Tensor:
    """A query that may attend nothing (padding, an unused batch slot) attends everything
    instead: softmax over an empty row is NaN on some backends, and such outputs are unused."""
    return mask | ~mask.any(dim=-1, keepdim=True)

def show_mask(mask: torch.Tensor) -> str:
    """A (2L, 2L) training mask as text; rows are queries, columns keys (c clean, m mask)."""
    L = mask.shape[0] // 2
    names = [f"c{i}" for i in range(L)] + [f"m{i}" for i in range(L)]
    w = max(map(len, names))
    row = lambda cells: " ".join(c.rjust(w) for c in cells[:L]) + " | " + " ".join(c.rjust(w) for c in cells[L:])
    return "\n".join([" " * (w + 2) + row(names)] + [f"{n.rjust(w)} [{row([str(int(v)) for v in r])} ]"
                                                    for n, r in zip(names, mask.tolist())])

# ---- Transformer: (tokens, positions, mask, cache) -> hidden states -> logits ----------
# Pre-LayerNorm blocks, rotary position embeddings looked up by position id, a GELU MLP of
# width 4D, an untied zero-initialised output head, no timestep input. The network knows
# nothing about diffusion: set-causality lives entirely in the boolean mask it is given.
def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding: rotate the feature pairs of x (..., T, hd) by their positions' angles.
    NOTE: in at least float32 under bf16 autocast, where late positions' angles lose bits."""
    x1, x2 = x.to(torch.promote_types(x.dtype, torch.float32)).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)

class Attention(nn.Module):
    """Multi-head attention whose only structure is the explicit mask it is given."""
    def __init__(self, cfg: Config):
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, h, angles, attn_mask, cache=None, layer=0):
        B, T, D = h.shape
        qkv = self.qkv(h).view(B, T, 3, self.n_head, D // self.n_head).permute(2, 0, 3, 1, 4)  # (3, B, H, T, hd)
        q, k = rotate(qkv[:2], *angles).unbind(0)            # ORIGINAL positions, in any order
        v = qkv[2]
        # with a cache, the keys are [cached revealed tokens | this call's tokens]
        k_all, v_all = (k, v) if cache is None else cache.attend(layer, k, v)
        y = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=attn_mask[:, None],  # all heads
                                           dropout_p=self.dropout if self.training else 0.0)
        if cache is not None:       # only now may new clean tokens join the cache: this layer
            cache.write(layer, k, v)  # had to see them as call tokens, causal among themselves
        return self.proj(y.transpose(1, 2).reshape(B, T, D))  # (B, T, D)

class Block(nn.Module):
    """h + Attn(LN(h)), then h + MLP(LN(h))."""
    def __init__(self, cfg: Config):
        super().__init__()
        D = cfg.d_model
        self.ln1, self.ln2, self.attn = nn.LayerNorm(D), nn.LayerNorm(D), Attention(cfg)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, h, angles, attn_mask, cache=None, layer=0):
        h = h + self.drop(self.attn(self.ln1(h), angles, attn_mask, cache, layer))
        return h + self.drop(self.mlp(self.ln2(h)))

class SetDiffusionLM(nn.Module):
    """`run` and `logits` are the plain network; `forward(x, order)` and `loss` are the
    two-stream training forward and the set-factorized bound of the next section."""
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg, D, hd = cfg, cfg.d_model, cfg.d_model // cfg.n_head
        self.tok_emb, self.drop = nn.Embedding(cfg.vocab_size, D), nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, cfg.vocab_size, bias=False)  # untied head
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        nn.init.zeros_(self.head.weight)           # uniform predictions at step 0
        # Rotary angles as a table over position ids: ids arrive in decode order, not sorted.
        inv_freq = 10000.0 ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        angle = torch.arange(cfg.seq_len, dtype=torch.float64)[:, None] * inv_freq  # (L, hd/2)
        self.register_buffer("cos", angle.cos().float(), persistent=False)
        self.register_buffer("sin", angle.sin().float(), persistent=False)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def run(self, tokens, positions, attn_mask, cache: KVCache | None = None):
        """tokens, positions (B, T); attn_mask (B or 1, T, T_keys) bool -> hidden (B, T, D)."""
        h = self.drop(self.tok_emb(tokens))                   # (B, T, D)
        angles = self.cos[positions][:, None], self.sin[positions][:, None]  # (B, 1, T, hd/2), once
        for layer, block in enumerate(self.blocks):
            h = block(h, angles, attn_mask, cache, layer)
        return self.ln_f(h)

    def logits(self, h):
        """The LM head with the MASK logit at -inf: MASK never appears in data."""
        z = self.head(h)                                      # (B, T, V)
        return z.index_fill(-1, torch.tensor([self.cfg.mask_id], device=z.device), float("-inf"))

    def forward(self, x, order):
        """logits[b, i] predicts x[b, i] from the tokens before position i in order[b]."""
        z, _ = two_stream_logits(self, x, order)              # (B, L, V) in decode order
        return z.gather(1, torch.argsort(order, dim=1)[..., None].expand_as(z))  # in position order

    def loss(self, x, order=None, generator=None):
        return set_factorized_loss(self, x, order, generator)

# ---- Two-stream forward, set-factorized loss and the likelihood bound ----------------
# Training feeds 2L tokens: the clean stream x[sigma_0..sigma_{L-1}] and a mask stream of L
# MASK tokens, both carrying the ORIGINAL positions sigma. Under the set-causal mask, mask
# slot i sees the clean slots j < i and itself, so it predicts x[sigma_i] from x[sigma_<i]:
# one pass scores all L conditionals of the order.
def two_stream_logits(model: SetDiffusionLM, x, order):
    """x, order (B, L) -> logits (B, L, V) and targets x[sigma_i] (B, L), in DECODE order."""
    cfg, L = model.cfg, x.shape[1]
    clean = x.gather(1, order)                                   # (B, L) x[sigma_0..sigma_{L-1}]
    tokens = torch.cat([clean, torch.full_like(clean, cfg.mask_id)], 1)  # (B, 2L) clean | mask
    positions = torch.cat([order, order], 1)                     # (B, 2L) original positions
    attn = set_causal_mask(L, x.device)[None]                    # (1, 2L, 2L)
    pad = clean == cfg.pad_id                                    # padding is ordered last
    if pad.any():
        valid = torch.cat([~pad, ~pad], 1)                       # (B, 2L)
        attn = no_empty_rows(attn & valid[:, :, None] & valid[:, None, :])
    h = model.run(tokens, positions, attn)                       # (B, 2L, D)
    return model.logits(h[:, L:]), clean                         # the head only on the mask stream

def set_factorized_loss(model: SetDiffusionLM, x, order=None, generator=None):
    """Per sequence the mean over non-pad tokens of -log p(x[sigma_i] | x[sigma_<i]), then
    the batch mean. NOTE: no time variable and no alpha'/(1 - alpha) weights: under the
    staggered schedule the continuous-time bound integrates exactly to this expectation over
    orders, so one sampled order is an unbiased one-sample estimate of the negative ELBO."""
    pad = x == model.cfg.pad_id                                  # (B, L)
    if order is None:
        order = sample_order(model.cfg, x.shape[0], generator, x.device, pad_mask=pad)
    z, target = two_stream_logits(model, x, order)               # (B, L, V), (B, L)
    nll = F.cross_entropy(z.flatten(0, 1).float(), target.flatten(), reduction="none").view_as(target)
    scored = (target != model.cfg.pad_id).float()                # the BOS slot too, in training
    return ((nll * scored).sum(1) / scored.sum(1).clamp(min=1)).mean()

@dataclass
class Elbo:
    """The likelihood bound over some rows, with what a reported number must come with."""
    nll: float            # sum over rows of each row's NLL (nats), averaged over its K orders
    tokens: int           # tokens scored (not BOS, not padding)
    num_orders: int       # K
    num_seqs: int
    se: float             # standard error of the per-token NLL across rows
    nll_per_token = property(lambda self: self.nll / max(self.tokens, 1))
    ppl = property(lambda self: math.exp(self.nll_per_token))   # an upper bound on perplexity
    bits_per_byte = lambda self, num_bytes: self.nll / math.log(2) / max(num_bytes, 1)

    def metrics(self, num_bytes: int) -> dict:
        """The numbers as a JSON-ready dict; `num_bytes` = bytes of source text scored."""
        return {"ppl_bound": self.ppl, "nll_per_token": self.nll_per_token, "se": self.se,
                "bits_per_byte": self.bits_per_byte(num_bytes), "num_orders": self.num_orders,
                "tokens_scored": self.tokens, "rows": self.num_seqs, "bytes": num_bytes}

    def line(self, num_bytes: int) -> str:
        """One line, as training validation and `sample.py --eval` print it."""
        return (f"ppl <= {self.ppl:.3f}  ({self.nll_per_token:.4f} +- {self.se:.4f} nats/token, "
                f"{self.bits_per_byte(num_bytes):.4f} bits/byte; {self.num_seqs} rows, "
                f"{self.tokens:,} tokens, {self.num_orders} order{'s' * (self.num_orders > 1)})")

@torch.no_grad()
def elbo(model: SetDiffusionLM, x: torch.Tensor, num_orders: int = 1, batch_size: int = 32, generator=None) -> Elbo:
    """Bound exp(sum NLL / sum tokens) over rows x (N, L): K sampled orders per row, dropout
    off, the BOS slot and padding not scored."""
    cfg, device, was_training = model.cfg, next(model.parameters()).device, model.training
    seq_nll, seq_tokens = [], []
    model.eval()                                                 # dropout off; restored below
    for xb in x.split(batch_size):
        xb = xb.to(device).long()                            # (B, L)
        pad = xb == cfg.pad_id
        scored = ~pad
        scored[:, 0] &= xb[:, 0] != cfg.bos_id               # BOS is given, not predicted
        total = torch.zeros(len(xb), dtype=torch.float64)    # on the CPU: MPS has no float64
        for _ in range(num_orders):
            order = sample_order(cfg, len(xb), generator, device, pad_mask=pad)
            logp = F.log_softmax(model(xb, order).float(), -1)  # (B, L, V) in position order
            total += (-logp.gather(-1, xb[..., None])[..., 0] * scored).sum(1).cpu().double()
        seq_nll.append(total / num_orders)
        seq_tokens.append(scored.sum(1).cpu().double())
    model.train(was_training)
    nll, tokens = torch.cat(seq_nll), torch.cat(seq_tokens)     # (N,) each
    # Standard error of the ratio sum(nll) / sum(tokens), rows as units (delta method); with
    # rows of equal length it is std(per-row NLL per token) / sqrt(N).
    resid = (nll - nll.sum() / tokens.sum() * tokens) / tokens.mean()
    se = float(resid.std() / math.sqrt(len(nll))) if len(nll) > 1 else float("nan")
    return Elbo(float(nll.sum()), int(tokens.sum()), num_orders, len(nll), se)

# ---- Sampler: window, candidates, commit rule; the cache-free step' input ------------
# One step of the set sampler: (1) the window: the masked positions in [f, f + w) from the
# leftmost masked position f; (2) ONE network call predicting them; (3) a candidate token and
# its confidence per query; (4) the commit rule: reveal the most confident candidate plus
# every candidate with confidence >= tau. The revealed tokens form this step's set.
@dataclass
class Generation:
    tokens: torch.Tensor        # (B, T) final ids; PAD after a stopping EOS
    reveal_step: torch.Tensor   # (B, T) the step that revealed each position; -1 given, -2 padding
    nfe: int                    # network calls (= steps: the prompt is written during step 0)
    steps: torch.Tensor         # (B,) steps each row needed
    new_tokens: torch.Tensor    # (B,) tokens each row revealed
    seconds: float              # wall time
    tokens_per_step = property(lambda self: float((self.new_tokens.double() / self.steps.clamp(min=1)).mean()))

def window_queries(masked: torch.Tensor, window: int, block_size: int | None):
    """Active queries (B, T): masked positions in [f, f + w), f the leftmost masked one; for
    the block policy also inside f's block (its windows are block-aligned)."""
    pos = torch.arange(masked.shape[1], device=masked.device)[None, :]
    f = torch.argmax(masked.to(torch.uint8), dim=1, keepdim=True)     # (B, 1)
    active = masked & (pos >= f) & (pos < f + window)
    return active if block_size is None else active & (pos < (f // block_size + 1) * block_size)

def draw_candidates(logits, temperature: float, top_p: float, generator=None):
    """A candidate and its confidence per query: logits (B, n, V) -> (cand, conf) (B, n).

    Confidence is the probability of the drawn token under the distribution it was drawn
    from (temperature-scaled, top-p truncated and renormalised; greedy: the plain softmax).
    Draws invert the CDF with uniforms from a CPU generator: independent of the device."""
    device = logits.device                     # MPS has no float64; float64 stays float64 (tests)
    logits = logits.to("cpu" if device.type == "mps" else device, torch.promote_types(logits.dtype, torch.float32))
    if temperature == 0:
        conf, cand = F.softmax(logits, -1).max(-1)
        return cand.to(device), conf.to(device)
    # subtract the max BEFORE dividing: a tiny temperature then gives a one-hot, not inf - inf
    probs = F.softmax((logits - logits.max(-1, keepdim=True).values) / temperature, -1)
    p_sorted, vocab_idx = probs.sort(-1, descending=True)             # (B, n, V)
    if top_p < 1:
        p_sorted = p_sorted * ((p_sorted.cumsum(-1) - p_sorted) < top_p)  # smallest set with mass >= p
        p_sorted = p_sorted / p_sorted.sum(-1, keepdim=True)
    # NOTE: the CDF is inverted in float64: in float32 a u just below the total mass can round
    # up to it, and the search would land on a zero-probability token such as MASK.
    cdf = p_sorted.double().cumsum(-1)
    u = torch.rand(cdf.shape[:-1], generator=generator, dtype=torch.float64).to(cdf.device)
    j = torch.searchsorted(cdf, (u * cdf[..., -1])[..., None], right=True)  # first cdf > u: mass > 0
    return vocab_idx.gather(-1, j)[..., 0].to(device), p_sorted.gather(-1, j)[..., 0].to(device)

def commit_rule(conf, valid, threshold: float):
    """The most confident candidate plus all with confidence >= tau: never zero tokens in a
    row that has queries. (Keeping the confident tokens = re-masking the others.)"""
    conf = conf.masked_fill(~valid, -1.0)
    return valid & ((conf >= threshold) | F.one_hot(conf.argmax(1), conf.shape[1]).bool())

def gather_sets(select: torch.Tensor, trash: int):
    """Ragged per-row sets -> padded index lists in position order: select (B, T) bool ->
    idx (B, n), valid (B, n); padded entries point at column `trash`."""
    count = select.sum(1, keepdim=True)
    n = int(count.max()) if select.numel() else 0
    idx = torch.argsort((~select).to(torch.uint8), dim=1, stable=True)[:, :n]  # selected first
    valid = torch.arange(n, device=select.device)[None, :] < count
    return torch.where(valid, idx, trash), valid

def revealed_in_decode_order(reveal_step, T):
    """The cache-free reference step feeds ALL revealed tokens, in decode order: reveal step,
    then position (given tokens have step -1). -> idx (B, n), valid (B, n)."""
    revealed = reveal_step[:, :T] != -3                                # (B, T)
    pos = torch.arange(T, device=reveal_step.device)
    n = int(revealed.sum(1).max())
    idx = torch.argsort(torch.where(revealed, reveal_step[:, :T] * (T + 1) + pos, 2**62), dim=1, stable=True)
    return idx[:, :n], pos[:n] < revealed.sum(1, keepdim=True)


# ---- Sampler: the KV cache beside the cached step (one network call per step) --------
class KVCache:
    """Clean-stream keys/values of revealed tokens, stored at their ORIGINAL positions.

    A position is revealed once, so "slot = position" gives every row a fixed-size buffer
    (no ragged appends across a batch) and the mask over the cache is just `filled`. Keys are
    cached after rotary, since a position never moves; slot `length` is a trash slot for padded
    writes. Room after the cache holds the current call's keys, so a step attends over one
    preallocated view instead of concatenating per layer (allocation-heavy steps were measured
    to halve batched CPU throughput)."""
    def __init__(self, cfg: Config, batch_size: int, length: int, max_call: int, device):
        self.length, self.k, self.v, self.write_pos = length, None, None, None  # k, v: on first use
        self.shape = (cfg.n_layer, batch_size, cfg.n_head, length + 1 + max_call, cfg.d_model // cfg.n_head)
        self.filled = torch.zeros(batch_size, length + 1, dtype=torch.bool, device=device)

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Place this call's keys after the cache; return (cache + call) keys and values."""
        if self.k is None:                     # in the compute dtype of the first call
            self.k, self.v = (torch.zeros(self.shape, dtype=t.dtype, device=t.device) for t in (k, v))
        s, T = self.length + 1, k.shape[2]
        self.k[layer, :, :, s:s + T], self.v[layer, :, :, s:s + T] = k, v
        return self.k[layer, :, :, :s + T], self.v[layer, :, :, :s + T]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """After attention: copy the clean tokens' keys/values to their positions."""
        idx = self.write_pos[:, None, :, None].expand_as(k)             # (B, H, T, hd)
        self.k[layer].scatter_(2, idx, k)
        self.v[layer].scatter_(2, idx, v)

    def commit(self):
        """Mark this call's written positions as cached (after all layers ran)."""
        self.filled.scatter_(1, self.write_pos, True)
        self.filled[:, self.length] = False

def predict(model, xs, new_idx, new_valid, active, T, cache: KVCache | None = None):
    """ONE network call: [new clean tokens, ranks 1..n in the given order] + [a MASK query per
    active position] -> the queries' logits (B, m, V), their positions q_idx and q_valid (B, m).

    A new token sees the cache (rank 0), the new tokens before it and itself, and with a cache
    its keys/values are then cached; a query sees the cache, all new tokens and itself only:
    the training mask restricted to the rows that matter. The cached step feeds the tokens
    revealed last step (in position order); the cache-free step, with no cache, feeds every
    revealed token in decode order, so that cached = cache-free is the cache's exactness."""
    q_idx, q_valid = gather_sets(active, trash=T)                      # (B, m)
    n, m, dev = new_idx.shape[1], q_idx.shape[1], xs.device
    C = 0 if cache is None else T + 1                                  # cache slots, with the trash slot
    rank = torch.cat([torch.zeros(C, dtype=torch.long), torch.arange(1, n + 1), torch.full((m,), n + 1)]).to(dev)
    is_mask, slot = torch.arange(C + n + m, device=dev) >= C + n, torch.arange(C + n + m, device=dev)
    attn = set_causal_predicate(rank[C:, None], is_mask[C:, None], slot[C:, None], rank, is_mask, slot)
    ok = torch.cat([new_valid, q_valid], 1)                            # (B, n + m)
    keys_ok = ok if cache is None else torch.cat([cache.filled, ok], 1)
    attn = no_empty_rows(attn & ok[:, :, None] & keys_ok[:, None, :])  # (B, n + m, C + n + m)
    tokens = torch.cat([xs.gather(1, new_idx), torch.full_like(q_idx, model.cfg.mask_id)], 1)
    positions = torch.cat([torch.where(new_valid, new_idx, 0), torch.where(q_valid, q_idx, 0)], 1)
    if cache is not None:
        cache.write_pos = torch.cat([new_idx, torch.full_like(q_idx, T)], 1)  # queries are never cached
    h = model.run(tokens, positions, attn, cache)
    if cache is not None:
        cache.commit()
    return model.logits(h[:, n:]), q_idx, q_valid


# ---- Sampler: generate ---------------------------------------------------------------
def _prepare_canvas(cfg: Config, prompt, infill, batch_size: int, max_new_tokens, device):
    """Check the inputs; build the starting sequence (B, T) with MASK where to generate."""
    L, bos, mask = cfg.seq_len, cfg.bos_id, cfg.mask_id
    require(prompt is None or infill is None, "give either a prompt or an infill sequence, not both")
    src = infill if infill is not None else [bos] if prompt is None else prompt
    src = torch.as_tensor(src, dtype=torch.long).to(device)
    src = src[None] if src.dim() == 1 else src
    require(src.dim() == 2 and len(src) > 0 and (batch_size in (1, len(src)) or len(src) == 1),
            f"prompt/infill of shape {tuple(src.shape)} with batch_size={batch_size}: give (T,) or (B, T) "
            "ids, with one row (repeated) or batch_size rows")
    src = src.expand(max(batch_size, len(src)), -1)
    require(not src.numel() or 0 <= src.min() and src.max() < cfg.vocab_size,
            f"token ids must lie in [0, {cfg.vocab_size}); is the input from another tokenizer?")
    if src.shape[1] == 0 or (src[:, 0] != bos).all():                # a row always starts with BOS
        src = torch.cat([torch.full((len(src), 1), bos, device=device), src], 1)
    require((src[:, 0] == bos).all(), "some rows start with BOS and some do not: make them agree")
    P, new = src.shape[1], L - src.shape[1] if max_new_tokens is None else int(max_new_tokens)
    if infill is not None:
        require((src == mask).any(1).all() and max_new_tokens is None and P <= L, "infill needs a MASK in "
                f"every row, no max_new_tokens, and at most L={L} tokens with BOS (it has {P})")
        return src.clone()
    require(not (src == mask).any(), "the prompt contains MASK tokens: use infill= to fill positions")
    require(1 <= new <= L - P, f"prompt of {P} tokens (with BOS) plus max_new_tokens={new} leaves no room "
            f"in the context L={L}: shorten it")
    return torch.cat([src, torch.full((len(src), new), mask, device=device)], 1)

@torch.inference_mode()        # like no_grad, minus autograd's per-op bookkeeping
def generate(model: SetDiffusionLM, prompt=None, infill=None, batch_size: int = 1,
             max_new_tokens: int | None = None, window: int | None = None,
             threshold: float = float("inf"), temperature: float = 1.0, top_p: float = 1.0,
             generator: torch.Generator | None = None, use_cache: bool = True,
             stop_at_eos: bool = False) -> Generation:
    """The set sampler, batched: every row has its own window and progress.

    `prompt` (T,) or (B, T) ids to continue, or `infill` with MASK where to fill (the other
    tokens are context and never change). The window w defaults to d for the staggered policy
    and to the largest window otherwise; tau = `threshold` > 1 reveals one token per step;
    temperature 0 is greedy. `use_cache=False` runs the cache-free reference step."""
    cfg, device, w_max = model.cfg, next(model.parameters()).device, max_window(model.cfg)
    w = (cfg.set_size if cfg.order == "staggered" else w_max) if window is None else int(window)
    require(math.isfinite(temperature) and temperature >= 0, f"temperature must be >= 0 (0 = greedy), got {temperature}")
    require(0 < top_p <= 1, f"top_p must be in (0, 1], got {top_p}")
    require(not math.isnan(threshold), "threshold must be a number (> 1 reveals one token per step)")
    require(1 <= w <= w_max, f"window must be in [1, {w_max}] for the {cfg.order} policy (larger windows "
            f"pose queries the model never saw in training), got {w}")
    x = _prepare_canvas(cfg, prompt, infill, batch_size, max_new_tokens, device)
    (B, T), start, nfe = x.shape, time.perf_counter(), 0
    # xs and step_of carry a trash column T, so padded scatters never touch real positions.
    xs = torch.cat([x, torch.full((B, 1), cfg.pad_id, device=device)], 1)     # (B, T+1)
    step_of = torch.cat([torch.where(x != cfg.mask_id, -1, -3),               # -1 given, -3 masked
                         torch.full((B, 1), -3, device=device)], 1)
    pending = x != cfg.mask_id            # revealed, not cached yet: the context, at step 0
    done = ~(x == cfg.mask_id).any(1)
    steps, new_tokens = torch.zeros(B, dtype=torch.long, device=device), torch.zeros(B, dtype=torch.long, device=device)
    cache = KVCache(cfg, B, T, max_call=T + w, device=device) if use_cache else None
    was_training = model.training
    model.eval()                          # dropout off; restored below
    while not done.all():
        # 1. the window of each unfinished row
        active = window_queries((xs[:, :T] == cfg.mask_id) & ~done[:, None], w,
                                cfg.set_size if cfg.order == "block" else None)
        # 2. one network call (cached: it also writes last step's set into the cache)
        new_idx, new_valid = gather_sets(pending, T) if use_cache else revealed_in_decode_order(step_of, T)
        logits, q_idx, q_valid = predict(model, xs, new_idx, new_valid, active, T, cache)
        # 3. a candidate per query; 4. the commit rule picks this step's set
        cand, conf = draw_candidates(logits, temperature, top_p, generator)  # (B, m)
        reveal = commit_rule(conf, q_valid, threshold)                      # (B, m)
        require(not (q_valid.any(1) & ~reveal.any(1)).any(), "a step revealed no token")  # never loop forever
        xs.scatter_(1, q_idx, torch.where(reveal, cand, xs.gather(1, q_idx)))
        step_of.scatter_(1, q_idx, torch.where(reveal, nfe, step_of.gather(1, q_idx)))
        pending = torch.zeros_like(xs, dtype=torch.bool).scatter_(1, q_idx, reveal)[:, :T]
        steps, new_tokens, nfe = steps + ~done, new_tokens + reveal.sum(1), nfe + 1
        done |= ~(xs[:, :T] == cfg.mask_id).any(1)
        if stop_at_eos:
            done |= _stop_at_eos(cfg, xs, step_of, T)
    model.train(was_training)
    synchronize(device)
    with torch.inference_mode(False):     # plain tensors out: they may feed a training forward
        return Generation(xs[:, :T].clone(), step_of[:, :T].clamp(min=-2), nfe, steps.cpu().clone(),
                          new_tokens.cpu().clone(), time.perf_counter() - start)

def _stop_at_eos(cfg: Config, xs, step_of, T):
    """Rows whose first generated EOS has everything before it revealed are done; what follows
    it (generated or still masked) becomes PAD with step -2. Given tokens (infill context)
    never change. Updates xs and step_of in place; returns the stopped rows."""
    pos = torch.arange(T, device=xs.device)[None, :]
    eos = (xs[:, :T] == cfg.eos_id) & (step_of[:, :T] >= 0)           # generated, not given
    first = torch.where(eos, pos, T).min(1, keepdim=True).values       # (B, 1)
    stop = (first[:, 0] < T) & ~((xs[:, :T] == cfg.mask_id) & (pos < first)).any(1)
    after = stop[:, None] & (pos > first) & (step_of[:, :T] != -1)
    xs[:, :T] = torch.where(after, cfg.pad_id, xs[:, :T])
    step_of[:, :T] = torch.where(after, -2, step_of[:, :T])
    return stop

# ---- Checkpoints and running: device, dtype, wrapped rows ----------------------------
CHECKPOINT_FORMAT = "setdiff-checkpoint-1"

def atomic_save(obj, path):
    """torch.save to a temporary file beside `path`, then rename: a crash or a full disk
    leaves the previous file intact."""
    tmp = f"{os.fspath(path)}.tmp-{os.getpid()}"
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except RuntimeError as e:                  # torch reports a full disk as a RuntimeError
        raise OSError(f"could not write {path}: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)

def save_checkpoint(path, model: SetDiffusionLM, tokenizer: Tokenizer, **extra):
    """Config, tokenizer spec and weights, plus any extras (optimizer, step, ...)."""
    model = getattr(model, "_orig_mod", model)                  # unwrap torch.compile
    atomic_save({"format": CHECKPOINT_FORMAT, "config": asdict(model.cfg),
                 "tokenizer": tokenizer.spec(), "model": model.state_dict(), **extra}, path)

def load_checkpoint(path, device="cpu"):
    """-> (model, tokenizer, checkpoint dict). A missing, damaged or foreign file: ValueError."""
    require(os.path.isfile(path), f"checkpoint {path} not found: train one with train_small.py or check the path")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:
        raise ValueError(f"{path} is not a readable checkpoint (truncated or corrupt?): {type(e).__name__}") from None
    require(isinstance(ckpt, dict) and ckpt.get("format") == CHECKPOINT_FORMAT,
            f"{path} is not a setdiff checkpoint (format {CHECKPOINT_FORMAT} expected)")
    try:                                       # an unknown config field or weight: another version
        model, tok = SetDiffusionLM(Config(**ckpt["config"])), Tokenizer.from_spec(ckpt["tokenizer"])
        model.load_state_dict(ckpt["model"], strict=True)
    except (TypeError, RuntimeError) as e:
        raise ValueError(f"{path}: config or weights do not match this setdiff.py: {str(e).splitlines()[0]}") from None
    return model.to(device), tok, ckpt

def pick_device(name: str | None = None, local_rank: int = 0) -> tuple[torch.device, str]:
    """`name` if given (checked), else the first of cuda -> mps -> cpu; and why. A bare
    "cuda" is this process's GPU under torchrun (`local_rank`)."""
    have = {"cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available(), "cpu": True}
    why = {"cuda": "a CUDA GPU is available", "mps": "an Apple GPU (MPS) is available", "cpu": "no GPU found"}
    name, why = (name, "requested with --device") if name and name != "auto" else next((k, why[k]) for k in have if have[k])
    kind = re.fullmatch(r"(cpu|cuda|mps)(:\d+)?", name)
    require(kind and have[kind[1]], f"--device {name!r} is not available here; use {' or '.join(k for k in have if have[k])}")
    return torch.device(f"cuda:{local_rank}" if name == "cuda" else name), why

def pick_dtype(device: torch.device, name: str = "auto") -> tuple[torch.dtype, str]:
    """Autocast dtype and why. Weights, optimizer state and EMA always stay float32."""
    if name != "auto":
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name], "requested with --dtype"
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16, "the GPU supports bf16 (the paper trains with bf16 autocast)"
    # NOTE: bf16 autocast on a CPU depends on the chip (measured 0.64x float32 on a 2-core
    # Xeon, 1.5x on an AVX512-BF16 EPYC): measure with `train_small.py --bench`.
    return torch.float32, f"bf16 autocast on this {device.type} is not known to be faster (check with --bench)"

def autocast(device: torch.device, dtype: torch.dtype):
    """Mixed precision for forward passes: matmuls in `dtype`, weights stay float32."""
    return contextlib.nullcontext() if dtype == torch.float32 else torch.autocast(device.type, dtype=dtype)

def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so that wall-clock times measure the work itself."""
    if device.type in ("cuda", "mps"):
        getattr(torch, device.type).synchronize()

def wrap_rows(stream, seq_len: int, bos: int, eos: int):
    """LM1B "wrapped" rows: a stream of sentences, each followed by EOS, cut into chunks of
    L-2 tokens, each chunk becoming the row [BOS] + chunk + [EOS]; no padding.
    stream (N,) ints -> (rows (n, L) uint16, the leftover < L-2 tokens for the next call)."""
    stream, body = np.asarray(stream, dtype=np.uint16), seq_len - 2
    n = len(stream) // body
    rows = np.empty((n, seq_len), dtype=np.uint16)
    rows[:, 0], rows[:, -1] = bos, eos
    rows[:, 1:-1] = stream[:n * body].reshape(n, body)
    return rows, stream[n * body:].copy()

# ---- Appendix: the tokenizer shim ----------------------------------------------------
# The method needs a vocabulary with four named special ids: PAD (after the end), BOS (the
# first position, always given), EOS (end of a sentence) and MASK (an unrevealed position).
#   bytes:     UTF-8 bytes, no files needed; toy runs, and bits per byte for free.
#   wordpiece: BERT uncased WordPiece from a vocab.txt, the tokenizer of the LM1B baselines,
#              so perplexities are comparable. Standard library only; it gives the ids of
#              HuggingFace's BertWordPieceTokenizer(lowercase=True) without special tokens.
class Tokenizer:
    """Text <-> ids with named special ids. Tokenizer.bytes() or Tokenizer.from_vocab(path);
    encode() adds no special tokens; decode() drops PAD/MASK/BOS and turns EOS into a newline."""
    def __init__(self, kind: str, vocab: list | None = None, source: str = "vocab"):
        require(kind in ("bytes", "wordpiece"), f"unknown tokenizer kind {kind!r}; use 'bytes' or 'wordpiece'")
        self.kind, self._pieces = kind, list(vocab or [])                 # id -> piece
        if kind == "bytes":                    # ids 0..255 are the bytes; the specials follow
            self.vocab_size, self.unk_id, self.pad_id, self.bos_id, self.eos_id, self.mask_id = 260, None, 256, 257, 258, 259
        else:
            self._ids = {piece: i for i, piece in enumerate(self._pieces)}  # piece -> id
            missing = ", ".join(t for t in _BERT_SPECIALS if t not in self._ids)
            why = f"it has no {missing}" if missing else "a token appears twice" if len(self._ids) < len(self._pieces) \
                else "a blank line" if not all(map(str.strip, self._pieces)) else ""
            require(not why, f"{source} is not a BERT vocab ({why}): pass the vocab.txt of a BERT uncased model")
            # BERT's [CLS] starts and [SEP] ends a sentence: they serve as BOS and EOS.
            self.pad_id, self.unk_id, self.bos_id, self.eos_id, self.mask_id = (self._ids[t] for t in _BERT_SPECIALS)
            self.vocab_size, self._longest = len(self._pieces), max(map(len, self._pieces))
            self._memo = {}                    # word -> ids: natural text repeats few words
        self._silent = {self.pad_id, self.mask_id, self.bos_id}  # what decode() leaves out

    @classmethod
    def bytes(cls) -> "Tokenizer":
        return cls("bytes")

    @classmethod
    def from_vocab(cls, path) -> "Tokenizer":
        """BERT uncased WordPiece from a vocab.txt: one token per line, id = line number."""
        source = f"vocab file {os.fspath(path)!r}"
        require(os.path.isfile(path), f"{source} does not exist or is not a file; pass the vocab.txt of a BERT uncased model")
        try:
            with open(path, "rb") as f:
                text = f.read().decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{source} is not UTF-8 text (bad byte at offset {e.start}): not a BERT vocab.txt") from None
        # NOTE: split at "\n" only: str.splitlines() also splits at U+2028, U+0085, ...,
        # which may be (part of) tokens. A final newline is optional; CRLF is accepted.
        lines = text.split("\n")
        lines = lines[:-1] if lines[-1] == "" else lines
        return cls("wordpiece", [s[:-1] if s.endswith("\r") else s for s in lines], source)

    @classmethod
    def from_spec(cls, spec) -> "Tokenizer":
        """Rebuild a tokenizer from spec() (stored in checkpoints)."""
        require(isinstance(spec, dict) and spec.get("kind") in ("bytes", "wordpiece"),
                f"not a tokenizer spec: {str(spec)[:80]!r}; expected a dict written by Tokenizer.spec()")
        return cls(spec["kind"], spec.get("vocab"), "tokenizer spec")

    def spec(self) -> dict:
        """JSON-ready description; the wordpiece one carries the vocab (no file needed later)."""
        return {"kind": "bytes"} if self.kind == "bytes" else {"kind": "wordpiece", "vocab": list(self._pieces)}

    def encode(self, text: str) -> list:
        if self.kind == "bytes":
            return list(text.encode("utf-8"))
        ids = []
        # Special-token strings in the text are matched first, case-sensitively ("[cls]" is
        # ordinary text); the split's odd-numbered pieces are those tokens.
        for k, chunk in enumerate(_SPECIAL_RE.split(text) if "[" in text else (text,)):
            if k % 2:
                ids.append(self._ids[chunk])
                continue
            for word in _bert_words(chunk):
                if word not in self._memo:
                    self._memo[word] = self._wordpiece(word)
                ids += self._memo[word]
        return ids

    def _wordpiece(self, word: str) -> tuple:
        """Greedy longest-match-first: take the longest vocab piece that prefixes the rest of
        the word ("##" marks a continuation); a word with an unmatched rest is one [UNK]."""
        if len(word) > 100:                    # HuggingFace's limit: longer words are [UNK]
            return (self.unk_id,)
        ids, start = [], 0
        while start < len(word):
            for end in range(min(len(word), start + self._longest), start, -1):
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in self._ids:
                    ids.append(self._ids[piece])
                    start = end
                    break
            else:
                return (self.unk_id,)
        return tuple(ids)

    def decode(self, ids) -> str:
        """Text of ids (list, tensor or array). WordPiece pieces are joined by spaces, except
        that a "##" piece continues the previous one."""
        ids = [self._check_id(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]
        if self.kind == "bytes":
            data = bytes(10 if i == self.eos_id else i for i in ids if i not in self._silent)
            return data.decode("utf-8", errors="replace")
        out = []
        for i in (i for i in ids if i not in self._silent):
            piece = "\n" if i == self.eos_id else self._pieces[i]
            glue = piece == "\n" or piece.startswith("##") or not out or out[-1] == "\n"
            out.append(piece[2:] if piece.startswith("##") else piece if glue else " " + piece)
        return "".join(out)

    def _check_id(self, i) -> int:
        # a negative id would silently index from the end of the vocab
        require(isinstance(i, (int, np.integer)) and 0 <= i < self.vocab_size,
                f"token id {i!r} is outside this tokenizer's vocab (0..{self.vocab_size - 1})")
        return i

_BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")   # PAD, UNK, BOS, EOS, MASK
_SPECIAL_RE = re.compile("(" + "|".join(map(re.escape, _BERT_SPECIALS)) + ")")

def _bert_words(text: str) -> list:
    """BERT normalisation and pre-tokenisation, in the reference's order: clean the text and
    pad CJK ideographs, strip accents (NFD, drop Mn), lower-case, isolate punctuation, split
    at whitespace. Two str.translate tables fill themselves per character (fast, in C)."""
    if text.isascii():                         # NFD is the identity on ASCII: one table
        return text.translate(_ASCII).split()
    return unicodedata.normalize("NFD", text.translate(_CLEAN)).translate(_FINISH).split()

class _CharMap(dict):
    """A str.translate table that computes each character's rule on first use."""
    def __init__(self, rule):
        super().__init__()
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
        return ""                              # before the whitespace test: U+000B, U+0085 are Cc
    if ch in _WHITESPACE:
        return " "
    return f" {ch} " if any(lo <= ord(ch) <= hi for lo, hi in _CJK_RANGES) else ch

def _finish_char(ch: str) -> str:
    """After NFD: drop non-spacing marks (accents), lower-case this character alone, pad
    punctuation. NOTE: per character, so a final capital sigma becomes σ, not Python's ς."""
    if _category(ch) == "Mn":
        return ""
    return "".join(f" {c} " if _is_punctuation(c) else c for c in ch.lower())

def _is_punctuation(ch: str) -> bool:
    """BERT's punctuation: all non-alphanumeric printable ASCII ($, +, <, ^, `, ~ too) and
    every Unicode P* character."""
    cp = ord(ch)
    return 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126 or _category(ch)[0] == "P"

def _category(ch: str) -> str:
    """The Unicode category as the reference sees it: it uses older tables than this Python,
    so characters whose class changed since (found by probing every code point) are pinned."""
    return _PINNED.get(ord(ch)) or unicodedata.category(ch)

def _code_points(ranges: str) -> frozenset:
    """"0890-0891 0A76 ..." (hex, inclusive ranges) -> a set of code points."""
    return frozenset(cp for lo, hi in re.findall(r"([0-9A-F]+)(?:-([0-9A-F]+))?", ranges)
                     for cp in range(int(lo, 16), int(hi or lo, 16) + 1))

# Whitespace as BERT sees it: the White_Space property (Python's isspace() also accepts
# U+001C..U+001F, which BERT deletes as control characters).
_WHITESPACE = frozenset("\t\n\r\x0b\x0c \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000"
                        + "".join(map(chr, range(0x2000, 0x200B))))
# CJK ideographs, each its own word. NOTE: the sixth range starts at 0x2B920, not Google
# BERT's 0x2B820, as in the HuggingFace reference; Extension G and later are not listed.
_CJK_RANGES = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
               (0x2B740, 0x2B81F), (0x2B920, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))
# Marks and punctuation added to Unicode after the reference's tables are letters there; two
# symbols were punctuation (166D, 111C9) and two spacing marks non-spacing (1734, 1171E).
_PINNED = {0x166D: "Po", 0x111C9: "Po", 0x1734: "Mn", 0x1171E: "Mn"} | dict.fromkeys(_code_points("""
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
"""), "Lo")
_CLEAN, _FINISH = _CharMap(_clean_char), _CharMap(_finish_char)
_ASCII = {cp: _clean_char(chr(cp)).translate(_FINISH) for cp in range(128)}
