"""setdiff: set diffusion language models in one readable file.

Reference: "Set Diffusion: Interpolating Token Orderings Between Autoregression and Diffusion
for Fast and Flexible Decoding", Arriola & Kuleshov, ICML 2026 (arXiv 2607.01775). One network
and one loss cover autoregression, masked diffusion, block diffusion and everything between;
the sampler extends a KV cache after every step. README.md ("The method on one page") states
every formula used here, in this file's order (the banners below).
"""

from __future__ import annotations

import errno
import functools
import hashlib
import heapq
import io
import itertools
import json
import math
import os
import re
import shutil
import sys
import time
import unicodedata
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm


def require(ok, message):
    """A user error: a ValueError whose message says what to do (scripts print it in one line)."""
    if not ok:
        raise ValueError(message)


def upload(t: torch.Tensor, device) -> torch.Tensor:
    """A CPU tensor to `device` without waiting: on a GPU a plain copy from pageable memory
    waits for all queued GPU work (a host sync), a copy from pinned memory does not."""
    device = torch.device(device or "cpu")
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


# ---- Config ---------------------------------------------------------------------------------
@dataclass
class Config:
    """Everything needed to rebuild a model; saved in every checkpoint."""

    vocab_size: int = 260  # V, special tokens included
    seq_len: int = 128  # L, tokens per row; position 0 is given when sampling and in the bound
    # (the training loss scores its slot too, predicted from nothing)
    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # attention heads
    d_model: int = 256  # hidden width D
    dropout: float = 0.1  # on the two residual branches of every block
    order: str = "staggered"  # order policy pi, a name in ORDER_POLICIES
    set_size: int = 4  # d, the target set size of the staggered and block policies
    max_set_size: int | None = None  # s, the largest set size (smax); None: min(2d, L)
    mask_id: int = 259  # MASK: the input of every unrevealed position, never predicted
    bos_id: int | None = 257  # opens every row; None: position 0 holds any token (OWT rows)
    eos_id: int = 258  # ends a sentence or document; may equal bos_id (LM1B rows: [CLS])
    pad_id: int | None = 256  # fills rows after their end, never scored; None: no padding

    def __post_init__(self):
        check_config(self)
        if self.order == "staggered" and self.max_set_size is None:
            self.max_set_size = min(2 * self.set_size, self.seq_len)  # in [d, L]: checked


def check_config(cfg):
    """A Config's user errors, each with its own message (bad flags and edited files end up
    here): types first, so that every later check compares numbers."""
    for name, value in vars(cfg).items():
        optional = value is None and name in ("max_set_size", "bos_id", "pad_id")
        if name not in ("dropout", "order"):
            require(type(value) is int or optional, f"{name} must be an integer, got {value!r}")
    # NOTE: the upper bounds stop edited files, past any model this code can run: a million for
    # the sizes; for L, a row's set-causal mask of (2L)^2 booleans (16 GiB)
    for name in ("vocab_size", "n_layer", "n_head", "d_model"):
        size = getattr(cfg, name)
        require(1 <= size <= 2**20, f"{name} must be in [1, 2**20], got {size}")
    p = cfg.dropout
    require(type(p) in (int, float) and 0 <= p < 1, f"dropout must be in [0, 1), got {p!r}")
    L = cfg.seq_len
    d = cfg.set_size
    policies = ", ".join(ORDER_POLICIES)
    known = cfg.order in ORDER_POLICIES
    require(known, f"unknown order policy {cfg.order!r}; use {policies}")
    require(L >= 2, f"the row length L must be at least 2, got {L}")
    require(L <= 2**16, f"the row length L must be at most {2**16}, got {L}")
    if cfg.order in ("staggered", "block"):
        require(1 <= d <= L, f"the set size d must be in [1, L={L}], got {d}")
    s = cfg.max_set_size
    if cfg.order == "staggered" and s is not None:
        bounds = f"[d={d}, L={L}]"
        require(d <= s <= L, f"the largest set size s must be in {bounds}, got {s}")
    check_policy(cfg)  # a policy must say its training order and how the sampler follows it
    head_dim = cfg.d_model // cfg.n_head
    require(cfg.d_model % cfg.n_head == 0, "d_model must be a multiple of n_head")
    require(head_dim % 2 == 0, "d_model / n_head must be even (rotary pairs)")
    others = (cfg.bos_id, cfg.eos_id, cfg.pad_id)
    for i in (cfg.mask_id, *others):
        in_vocab = i is None or 0 <= i < cfg.vocab_size
        require(in_vocab, f"the special id {i} is not in the vocab")
    require(cfg.mask_id not in others, "MASK must differ from BOS, EOS and PAD")
    if cfg.pad_id is not None:
        pad_clash = cfg.pad_id in others[:2]
        require(not pad_clash, "PAD must differ from BOS and EOS (padding is never scored)")


# ---- Order policies and the staggered schedule ----------------------------------------------
# An order policy draws the decode order sigma, a permutation of the L positions. The
# staggered schedule gives each position i its own masking curve m_i(t), t in [0, 1] (0 clean,
# 1 all masked). Position i is masked at its first hitting time T_i in the forward process,
# so generation (time running 1 -> 0) reveals positions by T DESCENDING. Nearby curves
# overlap: about d positions are revealed "at once", and a position can overtake only the
# earlier positions within its reach r. Each policy has one home, its entry in ORDER_POLICIES,
# which must say the orders training draws and everything the sampler needs to follow them
# (OrderPolicy has no defaults); a name not there is refused, never run as another policy.
def policy_name(cfg):
    """The policy as tables print it: "staggered d=4, s=8", "block d=4", "ar", "uniform"."""
    if cfg.order == "staggered":
        return f"staggered d={cfg.set_size}, s={cfg.max_set_size}"
    if cfg.order == "block":
        return f"block d={cfg.set_size}"
    return cfg.order


@dataclass
class OrderPolicy:
    """An order policy pi, whole: the orders training draws, and how the sampler follows them.
    The sampler's window opens at the masked position of least sampler key k_f and spans the
    keys [k_f, k_f + w): the key says where the policy's orders start and which way they run
    (left to right: the position; right to left: L - 1 - position). Every field must be given:
    an entry that leaves one out is refused, never run as left to right."""

    reveal_times: Callable  # (B, generator) -> (B, L) float64; the order is time DESCENDING
    sampler_key: torch.Tensor  # (L,) each of 0..L-1 once: the window opens at the least masked
    max_window: int  # the largest window w training met: no revealed key lies further from k_f
    set_size: int  # d: generation's window by default (infilling takes max_window)
    block_size: int | None  # block edges, in key order: a window stays in k_f's block; None: none


class StaggeredSchedule:
    """m_i(t) = 1 - (1 - u_i)^k for u_i = (t - loc_i) / b in (0, 1); 0 before, 1 after.

    A = d / 2L is the area under m_i(t) while it rises, t in [loc_i, loc_i + b): that of a
    straight ramp of width d / L, block diffusion's ramp over d positions. loc_i = (1 - b)
    (L - 1 - i) / (L - 1) gives position 0 the LARGEST offset (masked last, revealed first).
    d = 1 is the identity (AR) order; d = s = L gives i.i.d. times, a uniform order (MDLM)."""

    def __init__(self, length, set_size, max_set_size=None):
        L = length
        d = set_size
        s = min(2 * d, L) if max_set_size is None else max_set_size
        sizes = f"set size d={d} <= largest set size s={s} <= length L={L}"
        require(1 <= d <= s <= L, f"need 1 <= {sizes}")
        self.L = L
        self.d = d
        self.s = s
        self.A = d / (2 * L)
        if d == 1 or d == s:  # straight curves (k = 1) of width 2A
            self.k = 1.0
            self.b = 2 * self.A
        else:  # the width b that makes the reach exactly s
            self.b = s / (L + s - 1)
            self.k = self.A / (self.b - self.A)
        # a curve of width b and exponent k covers the area k b / (k + 1), which must be A
        area = self.k * self.b / (self.k + 1)
        assert math.isclose(area, self.A)
        assert self.b <= 1 + 1e-12
        steps_from_end = L - 1 - torch.arange(L, dtype=torch.float64)
        gaps = max(L - 1, 1)
        self.loc = (1 - self.b) * steps_from_end / gaps  # (L,)
        # Reach: T_i lies in [loc_i, loc_i + b) and neighbouring offsets are (1 - b)/(L - 1)
        # apart, so i can precede j < i only if i - j < r: at most ceil(r) positions can be
        # revealed together (a tolerance makes r = s give s; r is infinite for b = 1).
        self.reach = math.inf
        self.ceil_reach = L
        if self.b < 1:
            self.reach = self.b * (L - 1) / (1 - self.b)
            self.ceil_reach = min(L, math.ceil(self.reach - 1e-9))

    def mask_prob(self, t):
        """m_i(t) for times t (B,) -> (B, L), in float64; d = 1 is a hard step."""
        t = t.to(torch.float64)[:, None]
        u = (t - self.loc[None, :]) / self.b  # (B, L)
        # 1 - (1-u)^k through log1p / expm1: accurate near u = 0 even when k < 1
        inside = u.clamp(0.0, 1.0 - 1e-16)
        rising = -torch.expm1(self.k * torch.log1p(-inside))
        m = torch.where(u > 0, rising, 0.0)
        m = torch.where(u >= 1, 1.0, m)
        if self.d == 1:
            return (m > 0).double()
        return m

    def first_hitting_times(self, batch_size, generator=None):
        """T_i = loc_i + b (1 - exp(-E_i / k)), E_i ~ Exp(1), so that P(T_i <= t) = m_i(t)."""
        E = torch.empty(batch_size, self.L, dtype=torch.float64)
        E = E.exponential_(generator=generator)
        rise = -torch.expm1(-E / self.k)
        return self.loc[None, :] + self.b * rise  # (B, L)


def schedule_policy(cfg, d, s):
    """A staggered schedule's policy: its first hitting times; windows up to its reach ceil(r).
    NOTE: for d = s the reach d (L - 1) / (L - d) is a little more than s, and so is the window."""
    sched = StaggeredSchedule(cfg.seq_len, d, s)
    left_to_right = torch.arange(cfg.seq_len)  # the sampler key: the position
    return OrderPolicy(sched.first_hitting_times, left_to_right, sched.ceil_reach, d, None)


def block_policy(cfg):
    """Block diffusion: blocks of d positions left to right, a uniform order inside each block;
    windows block-aligned (block edges), at most one block."""
    d = cfg.set_size
    block = torch.arange(cfg.seq_len, dtype=torch.float64) // d  # (L,)
    ahead = block.max() - block  # block 0 the latest times: revealed first

    def reveal_times(batch_size, generator=None):
        U = torch.rand(batch_size, cfg.seq_len, dtype=torch.float64, generator=generator)
        return ahead + U  # (B, L)

    left_to_right = torch.arange(cfg.seq_len)  # the sampler key: the position
    return OrderPolicy(reveal_times, left_to_right, d, d, d)


ORDER_POLICIES = {  # --order: cfg -> its OrderPolicy. A new policy is one entry here.
    "staggered": lambda cfg: schedule_policy(cfg, cfg.set_size, cfg.max_set_size),
    "ar": lambda cfg: schedule_policy(cfg, 1, 1),  # d = s = 1: the identity order
    "uniform": lambda cfg: schedule_policy(cfg, cfg.seq_len, cfg.seq_len),  # i.i.d. times
    "block": block_policy,
}


def order_policy(cfg):
    """cfg.order's OrderPolicy, built for cfg. OrderPolicy has no defaults: an entry that does
    not say every field (training order, sampler key and windows) fails here, at Config time."""
    return ORDER_POLICIES[cfg.order](cfg)


def check_policy(cfg):
    """A policy's entry, checked once at Config time: every field given (a TypeError naming the
    missing one), and a sampler key that orders the L positions, each of 0..L-1 once."""
    key = order_policy(cfg).sampler_key
    L = cfg.seq_len
    ranks = torch.is_tensor(key) and sorted(key.tolist()) == list(range(L))
    require(ranks, f"order policy {cfg.order!r}: sampler_key must hold each of 0..{L - 1} once")


def sample_order(cfg, batch_size, generator=None, device=None, given=None, pad=None):
    """Decode orders sigma (B, L): the *given* positions first (`given`, (B, L) bool; position 0
    always), then the free ones by reveal time descending, padding (`pad`) last. One stable
    sort: given positions tie at -inf and padding at +inf, so both keep their position order.
    Drawn on the CPU from `generator`: the orders do not depend on the device."""
    times = order_policy(cfg).reveal_times(batch_size, generator)  # (B, L)
    first = torch.arange(cfg.seq_len) == 0  # (L,): position 0 is always given
    if given is not None:
        first = first | given.cpu()  # (B, L)
    key = torch.where(first, -math.inf, -times)
    if pad is not None:
        key = torch.where(pad.cpu(), math.inf, key)
    order = torch.argsort(key, dim=1, stable=True)
    return upload(order, device)


def max_window(cfg):
    """The largest sampler window a policy met in training (larger windows pose unseen
    queries): ar 1, block d, uniform L, staggered ceil(r)."""
    return order_policy(cfg).max_window


def default_window(cfg, infill=False):
    """The sampler's window w when none is given: the policy's set size d for generation (the
    paper's w = d), the largest for infilling (holes with context on both sides are easy to fill
    together). d is the largest for ar (1), uniform (L: cfg.set_size does not change it) and
    block (d) alike."""
    policy = order_policy(cfg)
    return policy.max_window if infill else policy.set_size


# ---- Set-causal masks: one predicate, many layouts ------------------------------------------
# Every token of a network call carries its rank (its step in the decode order), is_mask
# (a query of the mask stream, or a clean revealed token) and a unique slot (so a query finds
# its own key). The set-causal mask is three named terms OR-ed together; training (clean
# stream | mask stream) and the sampler (cache | new tokens | queries) feed it other vectors.
def set_causal_predicate(q_rank, q_is_mask, q_slot, k_rank, k_is_mask, k_slot):
    """True where a query may attend a key. Arguments broadcast."""
    q_clean = ~q_is_mask
    k_clean = ~k_is_mask
    clean_sees_earlier_or_same_clean = q_clean & k_clean & (k_rank <= q_rank)
    mask_sees_strictly_earlier_clean = q_is_mask & k_clean & (k_rank < q_rank)
    mask_sees_only_itself = q_is_mask & k_is_mask & (k_slot == q_slot)
    sees_clean = clean_sees_earlier_or_same_clean | mask_sees_strictly_earlier_clean
    return sees_clean | mask_sees_only_itself


def set_causal_mask(L, device=None):
    """The (2L, 2L) training mask, slots in decode order: clean stream, then mask stream."""
    slot = torch.arange(2 * L, device=device)
    rank = slot % L  # clean slot i and mask slot i share step i
    is_mask = slot >= L
    q = (rank[:, None], is_mask[:, None], slot[:, None])  # queries down
    k = (rank, is_mask, slot)  # keys across
    return set_causal_predicate(*q, *k)


def show_mask(mask, groups=None):
    """A mask as text; rows are queries, columns keys, named in `groups` split by |, the rows
    named as the last keys. Default: the (2L, 2L) training mask (c clean, m mask stream)."""
    if groups is None:
        L = mask.shape[0] // 2
        groups = [[f"c{i}" for i in range(L)], [f"m{i}" for i in range(L)]]
    keys = sum(groups, [])
    w = max(len(n) for n in keys)

    def line(cells):  # the cells of a row, group by group
        cells = iter(cells)
        spans = [" ".join(next(cells).rjust(w) for _ in g) for g in groups]
        return " | ".join(spans)

    lines = [" " * (w + 2) + line(keys)]  # the header: key names
    rows = keys[len(keys) - len(mask) :]
    for name, row in zip(rows, mask.tolist()):
        lines.append(f"{name.rjust(w)} [{line(str(int(v)) for v in row)} ]")
    return "\n".join(lines)


def no_empty_rows(mask):
    """A query that may attend nothing (padding, an unused batch slot) attends everything
    instead: softmax over an empty row is NaN on some backends, and such outputs are unused."""
    return mask | ~mask.any(dim=-1, keepdim=True)


# ---- Transformer: (tokens, positions, mask, cache) -> logits ---------------------------------
# The authors' network (a DiT with its timestep modulation off): pre-LayerNorm blocks without
# LayerNorm biases, rotary embeddings looked up by position id, a tanh-GELU MLP of width 4D,
# dropout on the residual branches only, an untied output head with a bias.
# It knows nothing about diffusion: set-causality lives entirely in the mask it is given.
def rotary_frequencies(head_dim):
    """1 / 10000^(2i/hd) for i < hd/2 in float32: the authors' rotary_emb.inv_freq."""
    pair = torch.arange(0, head_dim, 2, dtype=torch.float32)
    return 1.0 / (10000 ** (pair / head_dim))


def rotary_table(length, head_dim):
    """cos, sin (length, hd/2) of the rotary angles pos / 10000^(2i/hd), built in float32 as
    the authors' network builds it: a float64 table moves log-probs by up to 8e-5 at L=1024."""
    pos = torch.arange(length, dtype=torch.float32)
    angle = pos[:, None] * rotary_frequencies(head_dim)  # (L, hd/2)
    return angle.cos(), angle.sin()


def rotate(x, cos, sin):
    """Rotate the feature pairs (i, i + hd/2) of x (..., T, hd) by their positions' angles.
    NOTE: in at least float32 under bf16 autocast, where late positions' angles lose bits."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    x1, x2 = x.to(dtype).chunk(2, dim=-1)
    first = x1 * cos - x2 * sin
    second = x1 * sin + x2 * cos
    y = torch.cat([first, second], dim=-1)
    return y.to(x.dtype)


class Attention(nn.Module):
    """Multi-head attention whose only structure is the explicit mask it is given."""

    def __init__(self, cfg):
        super().__init__()
        D = cfg.d_model
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.proj = nn.Linear(D, D, bias=False)

    def forward(self, h, angles, attn_mask, cache=None, layer=0):
        B, T, D = h.shape
        H = self.n_head
        qkv = self.qkv(h).view(B, T, 3, H, -1)
        qkv = qkv.permute(2, 0, 3, 1, 4)  # (3, B, H, T, hd)
        # q and k at their ORIGINAL positions, whatever order the tokens come in
        q, k = rotate(qkv[:2], *angles).unbind(0)
        v = qkv[2]
        if cache is not None:  # the keys become [cached revealed tokens | this call's tokens]
            k, v = cache.extend(layer, k, v)
        mask = attn_mask[:, None]  # the same for all heads
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = y.transpose(1, 2).reshape(B, T, D)
        return self.proj(y)  # (B, T, D)


class Block(nn.Module):
    """h + drop(Attn(LN(h))), then h + drop(MLP(LN(h)))."""

    def __init__(self, cfg):
        super().__init__()
        D = cfg.d_model
        self.ln1 = nn.LayerNorm(D, bias=False)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(D, bias=False)
        gelu = nn.GELU(approximate="tanh")  # the authors' activation (not the exact GELU)
        up = nn.Linear(D, 4 * D)
        down = nn.Linear(4 * D, D)
        self.mlp = nn.Sequential(up, gelu, down)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, h, angles, attn_mask, cache=None, layer=0):
        a = self.attn(self.ln1(h), angles, attn_mask, cache, layer)
        h = h + self.drop(a)
        m = self.mlp(self.ln2(h))
        return h + self.drop(m)


class SetDiffusionLM(nn.Module):
    """The plain network: (tokens, positions, attention mask, cache) -> logits. The method
    (which tokens, which mask) lives in the functions of the next sections."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        D = cfg.d_model
        self.tok_emb = nn.Embedding(cfg.vocab_size, D)
        blocks = [Block(cfg) for _ in range(cfg.n_layer)]
        self.blocks = nn.ModuleList(blocks)
        self.ln_f = nn.LayerNorm(D, bias=False)
        self.head = nn.Linear(D, cfg.vocab_size)  # untied
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        # NOTE: the head weight is drawn like every other Linear, where the authors zero it. A
        # zero head passes the rest no gradient at first and little until it has grown: at the
        # CPU preset's scale, a plateau at the unigram level for 100-300 steps, whose length
        # depends on the seed and the machine (experiments/README.md, "The plateau"). Trained
        # weights (released folders, --init-from) replace it: they load unchanged.
        # a table over position ids: the ids arrive in decode order, not sorted
        cos, sin = rotary_table(cfg.seq_len, D // cfg.n_head)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def forward(self, tokens, positions, attn_mask, cache=None, queries=None):
        """tokens, positions (B, T); attn_mask (B or 1, T, T_keys) bool -> the logits (B, m, V)
        of the last m = `queries` tokens (all T if None). The MASK logit is -inf: MASK never
        appears in data."""
        h = self.tok_emb(tokens)  # (B, T, D)
        cos = self.cos[positions][:, None]  # (B, 1, T, hd/2)
        sin = self.sin[positions][:, None]
        for layer, block in enumerate(self.blocks):
            h = block(h, (cos, sin), attn_mask, cache, layer)
        if queries is not None:  # the head only where it is read
            h = h[:, h.shape[1] - queries :]
        z = self.head(self.ln_f(h))  # (B, m, V)
        z[..., self.cfg.mask_id] = -math.inf
        return z


# ---- Two-stream forward, set-factorized loss and the likelihood bound -----------------------
# Training feeds 2L tokens: the clean stream x[sigma_0..sigma_{L-1}] and a mask stream of L
# MASK tokens, both carrying the ORIGINAL positions sigma. Under the set-causal mask, mask
# slot i sees the clean slots j < i and itself, so it predicts x[sigma_i] from x[sigma_<i]:
# one pass scores all L conditionals of the order.
def padding(cfg, x):
    """(B, L): True at padding."""
    if cfg.pad_id is None:
        return torch.zeros_like(x, dtype=torch.bool)
    return x == cfg.pad_id


def two_stream_logits(model, x, order):
    """x, order (B, L) -> logits (B, L, V) and targets x[sigma_i] (B, L), in DECODE order."""
    L = x.shape[1]
    clean = x.gather(1, order)  # (B, L) x[sigma_0..sigma_{L-1}]
    masks = torch.full_like(clean, model.cfg.mask_id)
    tokens = torch.cat([clean, masks], 1)  # (B, 2L) clean | mask
    positions = torch.cat([order, order], 1)  # (B, 2L) original positions
    attn = set_causal_mask(L, x.device)[None]  # (1, 2L, 2L)
    if model.cfg.pad_id is not None:  # padding is ordered last; never a tensor's `if` (a sync)
        pad = padding(model.cfg, clean)
        valid = torch.cat([~pad, ~pad], 1)  # (B, 2L)
        attn = attn & valid[:, :, None]  # no query at padding
        attn = attn & valid[:, None, :]  # no key at padding
        attn = no_empty_rows(attn)
    z = model(tokens, positions, attn, queries=L)  # (B, L, V): the mask stream's
    return z, clean


def position_logits(model, x, order):
    """logits[b, i] predicts x[b, i] from the tokens before position i in order[b]."""
    z, _ = two_stream_logits(model, x, order)  # (B, L, V) in decode order
    rank = torch.argsort(order, dim=1)  # (B, L): the step of each position
    index = rank[..., None].expand_as(z)
    return z.gather(1, index)  # in position order


def set_factorized_loss(model, x, order=None, generator=None):
    """Per sequence the mean over non-pad tokens of -log p(x[sigma_i] | x[sigma_<i]), then
    the batch mean. NOTE: no time variable and no alpha'/(1 - alpha) weights: the continuous-time
    bound integrates exactly to the expectation of this sum over orders (derived below), so one
    sampled order is an unbiased one-sample estimate of the negative ELBO.

    Where the sets are: training draws a total order (continuous first hitting times never tie),
    so each conditional here is one position given all earlier ones. Sets appear in the sampler:
    one call reveals several window positions, each predicted from the same revealed context and
    independently of the others, which is the family's prod_{i in sigma_n} p(x_i | x_{sigma_<n})."""
    # The bound, derived. With a_i(t) = 1 - m_i(t), MDLM's weight -a_i'/(1 - a_i) is m_i'/m_i;
    # P(i masked at t) = m_i(t) cancels the 1/m_i; the T_i are independent, so the others'
    # states at t do not depend on T_i, whose density is m_i'(t):
    #   int_0^1 E_{z_t} sum_{i masked} (m_i'(t) / m_i(t)) (-log p(x_i | revealed at t)) dt
    #     = sum_i int_0^1 m_i'(t) E[-log p(x_i | revealed at t) | T_i = t] dt
    #     = E_T sum_i -log p(x_i | x_{j: T_j > T_i})
    #     = E_sigma sum_n -log p(x[sigma_n] | x[sigma_<n])
    # The last step holds because the network never sees t: the integrand depends on the T's
    # only through the order sigma they induce (T descending; given positions are never masked
    # and come first). "Revealed at t" means the revealed tokens in their reveal order, as the
    # set-causal clean stream sees them (a revealed token's keys see only those before it): the
    # loss at time t depends on the order in which they were revealed, not only on which they
    # are, so the integral is an expectation over orders, not over revealed sets.
    # NOTE: the loss divides a row's sum by its token count, position 0's slot (predicted from
    # nothing) included, then averages rows; `elbo` leaves position 0 out (given when sampling)
    # and pools tokens over rows. They are different numbers: with BOS, whose slot soon costs
    # nothing, the loss reads a little lower than the bound's nats/token.
    cfg = model.cfg
    if order is None:
        pad = padding(cfg, x)  # (B, L)
        order = sample_order(cfg, x.shape[0], generator, x.device, pad=pad)
    z, target = two_stream_logits(model, x, order)  # (B, L, V), (B, L)
    z = z.flatten(0, 1).float()
    nll = F.cross_entropy(z, target.flatten(), reduction="none")
    nll = nll.view_as(target)  # (B, L)
    scored = ~padding(cfg, target)  # position 0 too (step 0, predicted from nothing)
    total = (nll * scored).sum(1)
    count = scored.sum(1).clamp(min=1)
    return (total / count).mean()


@dataclass
class Elbo:
    """The likelihood bound over some rows, with what a reported number must come with."""

    nll: float  # sum over rows of each row's NLL (nats), averaged over its K orders
    tokens_scored: int  # not given, not padding (a run's log says "tokens" for training tokens)
    num_orders: int  # K
    num_seqs: int  # rows
    se: float  # standard error of the per-token NLL across rows: which rows, far more than orders
    nll_per_token: float  # nll / tokens
    ppl: float  # exp(nll / tokens): an upper bound on the perplexity

    def bits_per_byte(self, num_bytes):
        return self.nll / math.log(2) / max(num_bytes, 1)

    def metrics(self, num_bytes):
        """The numbers as a JSON-ready dict; `num_bytes` = bytes of source text scored."""
        bpb = self.bits_per_byte(num_bytes)
        return asdict(self) | {"bits_per_byte": bpb, "bytes": num_bytes}

    def line(self, num_bytes):
        """One line, as training validation and `sample.py --eval` print it."""
        K = self.num_orders
        orders = f"{K} order" + "s" * (K > 1)
        nats = f"{self.nll_per_token:.4f} +- {self.se:.4f} nats/token"
        if self.num_seqs < 2:  # a spread across rows needs two (se is NaN)
            nats = f"{self.nll_per_token:.4f} nats/token, no standard error from one row"
        bpb = f"{self.bits_per_byte(num_bytes):.4f} bits/byte"
        rows = f"{self.num_seqs} rows, {self.tokens_scored:,} tokens, {orders}"
        return f"ppl <= {self.ppl:.3f}  ({nats}, {bpb}; {rows})"


@torch.no_grad()
def elbo(model, x, num_orders=1, batch_size=32, generator=None, given=None, progress=False):
    """The bound exp(sum NLL / sum tokens) over rows x (N, L), K sampled orders per row, dropout
    off. `given` (N, L) bool marks context (an infill or prefix bound): it comes first in every
    order and is not scored; position 0 and padding are never scored either.

    "ppl <=" bounds the perplexity of the bound's model: one position revealed at a time in an
    order sigma drawn from pi, p(x) = sum_sigma pi(sigma) prod_n p(x[sigma_n] | x[sigma_<n]),
    which generate(ancestral=True) samples. generate's default samples another distribution
    (its window opens at the first masked position, the most confident queries first); the two
    agree for ar only. The standard error ("+-") takes rows as units: it measures which rows
    were drawn far more than which orders (K orders a row shrink only the orders' part)."""
    x = x.long().cpu()
    N = len(x)
    if given is None:
        given = torch.zeros_like(x, dtype=torch.bool)
    given = given.cpu().clone()
    given[:, 0] = True  # BOS, or the token that opens the row: given, not predicted
    pad = padding(model.cfg, x)
    scored = ~given & ~pad  # (N, L)
    row_nll = torch.zeros(N, dtype=torch.float64)  # on the CPU: MPS has no float64
    was_training = model.training
    model.eval()  # dropout off; restored below
    total = N * num_orders
    chunk_rows = 1024  # rows whose orders are drawn together: the bound ignores batch_size
    # a `with`: the bar ends its line even when Ctrl-C stops the loop
    with tqdm(total=total, unit="row", desc="bound", disable=not progress) as bar:
        for start in range(0, N, chunk_rows):
            chunk = slice(start, start + chunk_rows)
            n = len(x[chunk])
            for _ in range(num_orders):
                known = given[chunk]
                orders = sample_order(model.cfg, n, generator, given=known, pad=pad[chunk])
                for b in range(0, n, batch_size):
                    rows = slice(start + b, start + min(b + batch_size, n))
                    order = orders[b : b + batch_size]
                    row_nll[rows] += order_nll(model, x[rows], order, scored[rows])
                    bar.update(len(order))
    model.train(was_training)
    row_nll /= num_orders
    tokens = scored.sum(1).double()  # (N,)
    # Standard error of the ratio sum(nll) / sum(tokens), rows as units (delta method); with
    # rows of equal length it is std(per-row NLL per token) / sqrt(N).
    ratio = row_nll.sum() / tokens.sum()
    resid = (row_nll - ratio * tokens) / tokens.mean()
    se = math.nan
    if N > 1:
        se = float(resid.std()) / N**0.5
    nll = float(row_nll.sum())
    count = int(tokens.sum())
    per_token = nll / max(count, 1)
    ppl = math.exp(per_token) if per_token < 709 else math.inf  # exp(710) overflows a float
    return Elbo(nll, count, num_orders, N, se, per_token, ppl)


def order_nll(model, x, order, scored):
    """Per row (B,), float64 on the CPU: the NLL of the scored positions of x under order."""
    device = next(model.parameters()).device
    x = x.to(device)  # (B, L)
    z = position_logits(model, x, order.to(device))
    logp = F.log_softmax(z.float(), -1)
    nll = -logp.gather(-1, x[..., None])  # (B, L, 1) in position order
    nll = nll[..., 0] * scored.to(device)
    return nll.sum(1).cpu().double()


# ---- Sampler: window, candidates, commit rule -----------------------------------------------
# One step of the set sampler: (1) the window: the masked positions whose sampler keys lie in
# [k_f, k_f + w) from the least masked key k_f (left to right: the positions [f, f + w) from the
# leftmost masked position f); (2) ONE network call predicting them; (3) a candidate token and
# its confidence per query; (4) the commit rule: reveal the most confident candidate plus
# every candidate with confidence >= tau. The revealed tokens form this call's set.
# Shapes: B rows of C positions (the canvas, and the KV cache's slots), n new tokens, m queries.
GIVEN = -1  # reveal call of a given token (BOS, prompt, infill context): never changed
ERASED = -2  # reveal call of a position set to PAD after a stopping EOS
MASKED = -3  # reveal call of a position not revealed yet (during generation only)


@dataclass
class Generation:
    tokens: torch.Tensor  # (B, C) final ids; PAD after a stopping EOS
    reveal_call: torch.Tensor  # (B, C) the call that revealed each position, GIVEN or ERASED
    calls: int  # network calls of the batch (the prompt is cached by the first)
    row_calls: torch.Tensor  # (B,) calls each row took part in
    seconds: float  # wall time

    @property
    def new_tokens(self):
        """(B,) tokens each row revealed and kept (not those erased after a stopping EOS), on the
        CPU as row_calls."""
        return (self.reveal_call >= 0).sum(1).cpu()

    @property
    def tokens_per_call(self):
        calls = self.row_calls.clamp(min=1)
        return float((self.new_tokens / calls).mean())


def window_queries(masked, key, window, block_size):
    """Active queries, (B, C) bool as `masked`: the window w spans the keys [k_f, k_f + w) from
    the least key k_f of a masked position, and a call predicts the masked positions in it; with
    block edges (block_size, else None) only those inside k_f's block of keys [j d, (j + 1) d)
    too. key (B, C): the policy's sampler key (left to right, the position: the window is then
    [f, f + w) from the leftmost masked position f), or the ancestral sampler's ranks."""
    past_every_key = torch.iinfo(torch.long).max // 2  # an unmasked position's: never the least
    k = torch.where(masked, key, past_every_key)
    k_f = k.min(1, keepdim=True).values  # (B, 1); every masked key is >= k_f
    active = masked & (key < k_f + window)
    if block_size is None:
        return active
    block_end = (k_f // block_size + 1) * block_size
    return active & (key < block_end)


def ancestral_key(cfg, x, generator=None):
    """The ancestral sampler's key (B, C): each position's step in an order sigma drawn from pi
    (sample_order), the canvas x's given tokens first, positions past its C last. With it and
    w = 1 a call reveals sigma's next position, drawn from p(x_i | x_{sigma_<n}): sigma and
    these draws are the bound's model, p(x) = sum_sigma pi(sigma) prod_n p(x[sigma_n] | ...)."""
    B, C = x.shape
    L = cfg.seq_len
    given = F.pad(x != cfg.mask_id, (0, L - C))  # (B, L)
    beyond = torch.arange(L, device=x.device) >= C  # (L,)
    order = sample_order(cfg, B, generator, x.device, given, beyond.expand(B, L))
    rank = torch.argsort(order, dim=1)  # (B, L); those past C are the last L - C
    return rank[:, :C]


def draw_candidates(logits, temperature, top_p=None, u=None):
    """A candidate and its confidence per query: logits (B, n, V) -> (cand, conf) (B, n).

    Confidence is the probability of the drawn token under the distribution it was drawn
    from (temperature-scaled, top-p truncated and renormalised; top_p None: not truncated).
    Without uniforms u (greedy) the most probable token (the first, by id, of tied ones),
    its confidence from the plain softmax's nucleus, renormalised as the authors do. A draw
    inverts the CDF, in id order, at the uniforms u (B, n) (float64, drawn by the caller: the
    same tokens on every device). temperature and top_p are numbers or 0-d tensors: no branch
    reads their values, so one compiled graph serves them all."""
    device = logits.device  # MPS has no float64; float64 stays float64 (tests)
    dtype = torch.promote_types(logits.dtype, torch.float32)
    work = "cpu" if device.type == "mps" else device
    logits = logits.to(work, dtype)
    # subtract the max BEFORE dividing: a tiny temperature then gives a one-hot, not inf - inf
    top = logits.max(-1, keepdim=True).values
    scale = 1.0 if u is None else temperature
    probs = F.softmax((logits - top) / scale, -1)  # (B, n, V)
    if top_p is not None:  # the smallest set of tokens with mass >= p: the only sort
        p_sorted, vocab_idx = probs.sort(dim=-1, descending=True, stable=True)
        before = p_sorted.cumsum(-1) - p_sorted
        nucleus = torch.zeros_like(probs, dtype=torch.bool)
        nucleus.scatter_(-1, vocab_idx, before < top_p)
        probs = probs * nucleus
        probs = probs / probs.sum(-1, keepdim=True)
    if u is None:  # greedy: argmax returns the first of tied tokens
        cand = probs.argmax(-1, keepdim=True)
    else:
        # NOTE: the CDF is inverted in float64: in float32 a u just below the total mass can
        # round up to it, and the search would land on a zero-probability token such as MASK.
        cdf = probs.double().cumsum(-1)
        u = u.to(work)[..., None] * cdf[..., -1:]
        cand = torch.searchsorted(cdf, u, right=True)  # (B, n, 1): the first cdf > u
        cand = cand.clamp(max=cdf.shape[-1] - 1)  # NaN logits: generate refuses them
    conf = probs.gather(-1, cand)
    return cand[..., 0].to(device), conf[..., 0].to(device)


def penalize_repeats(logits, x, seen, penalty):
    """The authors' repetition penalty (HF's RepetitionPenaltyLogitsProcessor), before the
    draw: the logit of every id at a `seen` position of x (B, C) is divided by `penalty` where
    positive and multiplied where negative, once however often it occurs. (B, m, V) -> same.
    generate's `seen` is the context the authors take: after a prompt the generated tokens
    (not the prompt); when infilling every visible token, the given right context included
    (their ROCStories table); PAD never."""
    count = torch.zeros_like(logits[:, 0], dtype=torch.float)  # (B, V) occurrences
    count.scatter_add_(1, x, seen.float())
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(count[:, None] > 0, penalized, logits)


def commit_rule(conf, valid, threshold):
    """The most confident candidate plus all with confidence >= tau: never zero tokens in a
    row that has queries. Of equally confident candidates the first query (the leftmost) is
    the most confident. (Keeping the confident tokens = re-masking the others.)"""
    conf = conf.masked_fill(~valid, -1.0)
    best = conf.argmax(1, keepdim=True)  # (B, 1)
    j = torch.arange(conf.shape[1], device=conf.device)  # a query's index in the window
    top = j == best  # not one_hot, which checks its input's range on the host
    return valid & ((conf >= threshold) | top)


def gather_sets(select, key=None, n=None):
    """Ragged per-row sets as padded index lists: select (B, C) bool -> idx (B, n), valid
    (B, n), the selected positions in position order, or sorted by `key` (B, C) with ties in
    position order. Padded entries hold position 0 and are masked wherever they are used. n:
    the most any row selects, or None to read it from the device (a host sync)."""
    count = select.sum(1, keepdim=True)  # (B, 1)
    if n is None:
        n = int(count.max()) if select.numel() else 0
    if key is None:
        key = torch.zeros_like(select, dtype=torch.long)
    last = torch.iinfo(torch.long).max  # not selected: after every selected position
    key = torch.where(select, key, last)
    idx = torch.argsort(key, dim=1, stable=True)
    entry = torch.arange(n, device=select.device)  # an entry of the padded list
    valid = entry[None, :] < count  # (B, n)
    idx = torch.where(valid, idx[:, :n], 0)
    return idx, valid


# ---- Sampler: the KV cache beside the cached step, then generate ---------------------------
class KVCache:
    """Clean-stream keys/values of the revealed tokens, per layer, at their ORIGINAL positions.

    A position is revealed once, so "slot = position" gives every row a fixed-size buffer
    (no ragged appends across a batch), and the keys a query may see are just `filled`. Keys
    are stored after rotary: a position never moves. Per layer and row the buffer holds

        slots 0 .. C-1                    | slots C .. C+n+m-1
        revealed tokens (where `filled`)  | this call: n new tokens, then m queries

    In every layer `extend` places the call's keys behind the cache, and attention reads slots
    [0, C+n+m); after the call `store` copies the n new tokens' keys to their positions
    (queries are never cached). NOTE: one preallocated buffer, not a concatenation per layer:
    a concatenation per call allocates in every layer, which slows batched sampling."""

    def __init__(self, cfg, batch_size, length, max_call, device):
        self.length = length
        H = cfg.n_head
        slots = length + max_call
        self.shape = (cfg.n_layer, batch_size, H, slots, cfg.d_model // H)
        self.k = None  # allocated by the first call, in its compute dtype
        self.v = None
        self.filled = torch.zeros(batch_size, length, dtype=torch.bool, device=device)

    def extend(self, layer, k, v):
        """Place this call's keys/values (B, H, n+m, hd) behind the cache -> all of them."""
        if self.k is None:
            self.k = k.new_zeros(self.shape)
            self.v = v.new_zeros(self.shape)
        keys = self.k[layer]  # (B, H, slots, hd)
        values = self.v[layer]
        C = self.length
        end = C + k.shape[2]
        keys[:, :, C:end] = k
        values[:, :, C:end] = v
        return keys[:, :, :end], values[:, :, :end]

    def store(self, new_idx, new_valid):
        """After a call: the new tokens' keys/values, still behind the cache in every layer,
        move to their positions, which later calls then see. Indexed by all (row, slot) pairs,
        not by the valid ones: their count is on the device, and reading it would wait."""
        C = self.length
        n = new_idx.shape[1]
        on = new_idx.device
        rows = torch.arange(len(new_idx), device=on)[:, None]  # (B, 1)
        # a padded entry goes to slot C + n, this call's first query's, written before it is read
        dest = torch.where(new_valid, new_idx, C + n)  # (B, n)
        slot = C + torch.arange(n, device=on)  # (n,)
        for buffer in (self.k, self.v):
            buffer[:, rows, :, dest] = buffer[:, rows, :, slot]
        at = new_idx[..., None] == torch.arange(C, device=on)  # (B, n, C): where each goes
        self.filled |= (at & new_valid[..., None]).any(1)


def call_mask(filled, new_valid, q_valid):
    """A call's set-causal mask (B, n+m, C+n+m): its n new tokens and m queries (valid where
    not padding) against the cache's C slots (those `filled`) and themselves."""
    C = filled.shape[1]
    n = new_valid.shape[1]
    m = q_valid.shape[1]
    # made on the device: a CPU tensor moved to a GPU would wait for its queued work
    slot = torch.arange(C + n + m, device=filled.device)
    # rank (step in the decode order): 0 for the cache, 1..n for new tokens, n + 1 for queries
    rank = (slot - C + 1).clamp(0, n + 1)
    is_mask = slot >= C + n
    call = slice(C, None)  # this call's n + m tokens are the queries of the mask
    query = (rank[call, None], is_mask[call, None], slot[call, None])
    attn = set_causal_predicate(*query, rank, is_mask, slot)  # (n+m, C+n+m)
    call_ok = torch.cat([new_valid, q_valid], 1)  # (B, n+m)
    key_ok = torch.cat([filled, call_ok], 1)  # (B, C+n+m)
    attn = attn & call_ok[:, :, None]
    return attn & key_ok[:, None, :]


def show_call(length, cached, new, queries):
    """One sampler call's mask as text, for a row of `length` positions: keys are the cache's
    slots p0.. (filled at the `cached` positions), the `new` tokens n.., then the queries q..;
    rows the call's tokens. E.g. show_call(6, [0, 1, 2], [3], [4, 5])."""
    filled = torch.zeros(1, length, dtype=torch.bool)
    filled[0, cached] = True
    valid = torch.ones(1, len(new) + len(queries), dtype=torch.bool)
    mask = call_mask(filled, valid[:, : len(new)], valid[:, len(new) :])
    cache = [f"p{p}" for p in range(length)]
    return show_mask(mask[0], [cache, [f"n{p}" for p in new], [f"q{p}" for p in queries]])


def predict(model, x, new, queries, cache=None):
    """ONE network call: [n new clean tokens] + [m MASK queries] -> the queries' logits (B, m, V).

    `new` and `queries` are (idx, valid) pairs (B, n) and (B, m) of positions of x (B, C). A
    new token sees the cache, the new tokens before it in the call (the order of `new`: position
    order for a set) and itself; a query sees the cache, all new tokens and itself only: the
    training mask restricted to the rows that matter. Example, C = 25 with a cache, 2 tokens
    revealed last call (positions 5, 9), 3 queries (6, 7, 8):

        keys     25 cache slots | 2 new tokens | 3 queries     (the queries of this call are
        rank     0 0 ... 0      | 1 2          | 3 3 3          the last n + m = 5 columns)
        is_mask  F F ... F      | F F          | T T T
        slot     0 1 ... 24     | 25 26        | 27 28 29

    The cached step feeds the tokens revealed last call in position order; the cache-free step,
    with no cache, feeds every revealed token in decode order, (call, position): a set enters in
    position order in both, which is what makes cached = cache-free (the cache's exactness)."""
    new_idx, new_valid = new
    q_idx, q_valid = queries
    filled = new_valid[:, :0] if cache is None else cache.filled  # (B, C): C cache slots
    attn = call_mask(filled, new_valid, q_valid)  # (B, n+m, C+n+m)
    clean = x.gather(1, new_idx)  # (B, n)
    masks = torch.full_like(q_idx, model.cfg.mask_id)
    tokens = torch.cat([clean, masks], 1)
    positions = torch.cat([new_idx, q_idx], 1)  # (B, n+m) original positions
    # the padded entries (their row had fewer new tokens or queries) keep the call's shape fixed:
    # they may see nothing, so they attend everything, and their outputs are never read
    attn = no_empty_rows(attn)
    logits = model(tokens, positions, attn, cache, queries=q_idx.shape[1])  # (B, m, V)
    if cache is not None:
        cache.store(new_idx, new_valid)
    return logits


@torch.inference_mode()  # like no_grad, minus autograd's per-op bookkeeping
def generate(
    model,
    prompt=None,
    infill=None,
    batch_size=1,
    max_new_tokens=None,
    window=None,
    threshold=math.inf,
    temperature=1.0,
    top_p=1.0,
    repetition_penalty=1.0,
    generator=None,
    use_cache=True,
    stop_at_eos=False,
    compile=False,
    ancestral=False,
):
    """The set sampler, batched (each row has its own window and progress): `prompt` (P,) or
    (B, C) ids to continue, or `infill` with MASK where to fill (the rest is never changed);
    sampler_window and canvas check the arguments. tau = `threshold` > 1 reveals one token a
    call; temperature 0 is greedy; top_p 1 samples the model's own distribution (the authors'
    default). `use_cache=False` runs the cache-free reference step; `compile=True` (or a
    torch.compile backend's name) runs every call after the first as one compiled function (a
    CUDA graph on a GPU), with the same tokens as without: one graph per set size met (exact
    sizes, not one call padded to w: experiments/README.md says why), times the switches
    greedy, top-p, penalty and stop-at-EOS, so at most 16 min(w, C) per shape (B, C) and
    window, compiled by the shape's first runs and reused by the later ones (new values of
    tau, temperature, top-p or penalty make none). Past that bound, or past dynamo's 256 a
    process, the rest runs eager, said in one line on stderr. -> a Generation.

    By default the sampler draws no order from pi: its window opens at the masked position of
    least sampler key (left to right: the leftmost, as the authors' sampler) and a call reveals
    its most confident queries. That is another distribution than the model the likelihood
    bound is about (they agree for ar only). `ancestral=True` samples that model: an order sigma
    drawn from pi (given positions first), one position a call (w = 1), each token drawn from
    p(x[sigma_n] | x[sigma_<n]), through the same calls, cache and candidates."""
    cfg = model.cfg
    device = next(model.parameters()).device
    infilling = infill is not None
    w = sampler_window(
        cfg, window, threshold, temperature, top_p, repetition_penalty, infilling, ancestral
    )
    require(use_cache or not compile, "compile=True runs the cached sampler: use_cache=True")
    x = canvas(cfg, prompt, infill, batch_size, max_new_tokens, device)  # (B, C)
    B, C = x.shape
    start = time.perf_counter()
    m = min(w, C)  # the most queries a call (a call's own count is read with its set size)
    run = sampler_run(model, B, C)  # this shape's tensors, reused by every run
    if temperature > 0:  # all of the run's draws at once: at most C calls of B x m
        u = torch.rand(C, B, m, generator=generator, dtype=torch.float64)
        run.uniforms[..., :m].copy_(upload(u, run.uniforms.device))
    run.start(x, w, m, threshold, temperature, top_p, repetition_penalty)
    if ancestral:  # the key: each row's ranks in an order drawn from pi (w = 1: one a call)
        run.key.copy_(ancestral_key(cfg, x, generator))
    run.first_seen.fill_(0 if infill is None else GIVEN)  # see penalize_repeats
    run.stop_at_eos = stop_at_eos
    run.use_cache = use_cache
    was_training = model.training
    model.eval()  # dropout off; restored below
    # the first call feeds the given tokens, later ones a set (<= w new tokens) + m queries
    P = int(run.pending.sum(1).max())
    n, m = next_call(sampler_call(model, run, P, m))
    step = compiled_call(run, compile) if compile else sampler_call
    try:
        while n:  # n: the set size of the last call, the new tokens of the next
            n, m = next_call(step(model, run, n, m))
    finally:
        model.train(was_training)
    synchronize(device)
    seconds = time.perf_counter() - start
    with torch.inference_mode(False):  # plain tensors out: they may feed a training forward
        tokens = run.x.clone()
        reveal_call = run.reveal_call.clone()
        row_calls = run.row_calls.cpu().clone()
    return Generation(tokens, reveal_call, int(run.call), row_calls, seconds)


def sampler_call(model, run, n, m):
    """One step of the set sampler, feeding n new tokens and m queries -> what the host reads
    after it: (every row done, an output NaN, the most tokens a row revealed, the most
    queries a row's next window holds)."""
    cfg = model.cfg
    x = run.x
    cache = run.cache if run.use_cache else None
    # 1. the window of each unfinished row
    queries = gather_sets(window_of(cfg, run), n=m)
    # 2. one network call (cached: it also writes the last call's set into the cache)
    if cache is not None:
        new = gather_sets(run.pending, n=n)
    else:  # the cache-free step: every revealed token, in decode order (call, position)
        new = gather_sets(run.reveal_call >= GIVEN, key=run.reveal_call)
    logits = predict(model, x, new, queries, cache)
    run.diverged |= logits.isnan().any()
    if run.penalized:
        seen = (run.reveal_call >= run.first_seen) & ~padding(cfg, x)
        logits = penalize_repeats(logits, x, seen, run.penalty)
    # 3. a candidate per query; 4. the commit rule picks this call's set
    u = None
    if not run.greedy:
        call = run.call.to(run.uniforms.device)  # MPS: uniforms on the CPU (no float64)
        u = run.uniforms[call][0, :, :m]  # (B, m); a tensor index: no host read
    top_p = run.top_p if run.nucleus else None
    cand, conf = draw_candidates(logits, run.temperature, top_p, u)  # (B, m)
    q_idx, q_valid = queries
    reveal = commit_rule(conf, q_valid, run.threshold)  # (B, m)
    write_where(x, q_idx, reveal, cand)
    write_where(run.reveal_call, q_idx, reveal, run.call)
    run.pending.copy_(run.reveal_call == run.call)  # this call's set: the next call caches it
    run.row_calls += ~run.done
    run.call += 1
    run.done |= (x != cfg.mask_id).all(1)
    if run.stop_at_eos:
        run.done |= stop_at_first_eos(cfg, x, run.reveal_call)
    set_size = reveal.sum(1).max()
    next_queries = window_of(cfg, run).sum(1).max()
    return torch.stack([run.done.all(), run.diverged[0], set_size, next_queries])


def window_of(cfg, run):
    """The queries of the next call: the masked positions in each unfinished row's window."""
    masked = (run.x == cfg.mask_id) & ~run.done[:, None]
    return window_queries(masked, run.key, run.w, run.block_size)  # (B, C)


def next_call(read) -> tuple:
    """A sampler call's one read of the device -> the next call's n new tokens (the last call's
    set size; 0 when every row is done) and m queries. NaN outputs (weights that diverged) are
    refused here, a call late, not by a read of their own."""
    finished, nan, set_size, queries = read.tolist()
    require(not nan, "the model's outputs are NaN: its weights diverged")
    n = 0 if finished else set_size
    return n, queries


def write_where(t, idx, chosen, values):
    """t[b, idx[b, j]] = values[b, j] where chosen[b, j], by a scatter of every entry (no host
    read of how many): one not chosen, or padded (at the given position 0), writes back t."""
    kept = t.gather(1, idx)
    t.scatter_(1, idx, torch.where(chosen, values, kept))


def stop_at_first_eos(cfg, x, reveal_call):
    """Rows whose first generated EOS has everything before it revealed are done; what follows
    it (generated or still masked) becomes PAD (EOS without PAD), call ERASED. Given tokens
    (infill context) never change. Updates x and reveal_call; returns the stopped rows."""
    C = x.shape[1]
    pos = torch.arange(C, device=x.device)[None, :]
    eos = (x == cfg.eos_id) & (reveal_call >= 0)  # generated, not given
    eos_pos = torch.where(eos, pos, C)
    first = eos_pos.min(1, keepdim=True).values  # (B, 1)
    masked = x == cfg.mask_id
    gaps = (masked & (pos < first)).any(1)
    stop = (first[:, 0] < C) & ~gaps
    after = stop[:, None] & (pos > first)
    after &= reveal_call != GIVEN
    # NOTE: a model without PAD (OWT) fills the rest with EOS; reveal_call marks it ERASED.
    # masked_fill_, not x[after] = ...: a boolean index reads its count from the device.
    x.masked_fill_(after, cfg.eos_id if cfg.pad_id is None else cfg.pad_id)
    reveal_call.masked_fill_(after, ERASED)
    return stop


# -- generate's argument checks (a first reading can skip them) -----------------------------
def sampler_window(
    cfg,
    window,
    threshold,
    temperature,
    top_p,
    repetition_penalty=1.0,
    infill=False,
    ancestral=False,
):
    """Check `generate`'s sampling arguments -> the window w. Messages name each argument as
    sample.py's flag of the same name does."""
    greedy_ok = math.isfinite(temperature) and temperature >= 0
    require(greedy_ok, f"--temperature must be >= 0 (0: greedy), got {temperature}")
    require(0 < top_p <= 1, f"--top-p must be in (0, 1] (1: off), got {top_p}")
    penalty = f"--repetition-penalty must be > 0 (1: off), got {repetition_penalty}"
    require(0 < repetition_penalty < math.inf, penalty)
    is_number = not math.isnan(threshold)
    require(is_number, "--threshold must be a number (> 1: one token a call)")
    if ancestral:
        one = f"--ancestral reveals one position a call: give --window 1 or none, got {window}"
        require(window in (None, 1), one)
        return 1
    if window is None:
        return default_window(cfg, infill)
    w_max = max_window(cfg)
    seen = f"the {cfg.order} policy met windows of at most {w_max} positions in training"
    require(1 <= window <= w_max, f"--window must be in [1, {w_max}] ({seen}), got {window}")
    return int(window)


def canvas(cfg, prompt, infill, batch_size, max_new_tokens, device):
    """The starting rows: BOS (where the model has one) + prompt + MASK to generate, or the
    infill context with MASK to fill; ids (P,) (repeated batch_size times) or (B, C)."""
    require(prompt is None or infill is None, "give --prompt or --infill, not both")
    require(batch_size >= 1, f"--batch-size must be at least 1, got {batch_size}")
    flag = "--prompt" if infill is None else "--infill"
    if prompt is None and infill is None:  # BOS, or without one EOS: a new document
        prompt = [cfg.eos_id if cfg.bos_id is None else cfg.bos_id]
    ids = prompt if infill is None else infill
    src = torch.as_tensor(ids, dtype=torch.long).to(device)
    if src.dim() == 1:
        src = src[None]
    rows = len(src)
    fits = rows == 1 or batch_size in (1, rows)
    require(fits, f"{flag}: {rows} rows of ids for --batch-size {batch_size}: give 1 or B")
    V = cfg.vocab_size
    in_vocab = ((src >= 0) & (src < V)).all()
    require(in_vocab, f"{flag}: ids must lie in [0, {V}): from another tokenizer?")
    B = max(batch_size, rows)
    src = src.expand(B, -1).clone()
    if cfg.bos_id is not None:
        src = with_bos(src, cfg.bos_id, flag)
    P = src.shape[1]
    L = cfg.seq_len
    bos_note = " (with BOS)" if cfg.bos_id is not None else ""
    too_long = f"{flag} is {P} tokens{bos_note} and the model's context is L={L}: shorten it"
    holes = src == cfg.mask_id
    if infill is not None:
        require(max_new_tokens is None, "--max-new-tokens: the holes of --infill set it")
        require(holes.any(1).all(), "--infill has no MASK to fill in some row")
        no_bos = "this model has no BOS: begin with given text"
        require(not holes[:, 0].any(), f"--infill: position 0 is always given ({no_bos})")
        require(P <= L, too_long)
        return src
    require(P > 0, "--prompt is empty and this model has no BOS: give text")
    require(not holes.any(), "--prompt contains MASK: use --infill to fill holes")
    require(P < L, too_long)
    new = L - P if max_new_tokens is None else int(max_new_tokens)
    span = f"[1, {L - P}] after {P} prompt tokens"
    require(1 <= new <= L - P, f"--max-new-tokens must be in {span}, got {new}")
    masks = torch.full((B, new), cfg.mask_id, device=device)
    return torch.cat([src, masks], 1)


def with_bos(src, bos_id, flag):
    """Rows (B, C) that start with BOS, adding it where none does; all or none must."""
    starts = (src[:, :1] == bos_id).any(1)  # (B,); False for an empty row
    if starts.all():
        return src
    require(not starts.any(), f"{flag}: some rows start with BOS, some do not")
    bos = torch.full((len(src), 1), bos_id, device=src.device)
    return torch.cat([bos, src], 1)


# ---- Checkpoints: setdiff's own, and the authors' released SetDLM folders -------------------
# A checkpoint is torch.save's file of a plain dict, as nanoGPT's: torch.load(path,
# weights_only=True) opens it anywhere. torch.load does not check the CRCs of its zip, so damaged
# bytes would load as other weights: the dict carries a sha256 digest of everything else in it,
# checked on load. The bytes are made in memory and written by a plain write, so that a full
# disk is the system's own error (ENOSPC), not an error inside torch.
CHECKPOINT_FORMAT = "setdiff-checkpoint-4"  # the layout of write_checkpoint, and the network


def save_checkpoint(path, model: SetDiffusionLM, tokenizer: Tokenizer, **extra):
    """Config, tokenizer, weights and extras, written by write_checkpoint."""
    model = getattr(model, "_orig_mod", model)  # unwrap torch.compile
    ckpt = {"config": asdict(model.cfg), "tokenizer": tokenizer.spec()}
    ckpt["model"] = model.state_dict()
    write_checkpoint(path, ckpt | extra)


def content_digest(value, h=None):
    """A sha256 over a checkpoint's contents: every tensor's dtype, shape and bytes, every other
    value's repr, dicts in key order. -> the hashlib object."""
    h = h or hashlib.sha256()
    if isinstance(value, torch.Tensor):
        h.update(f"{value.dtype}{tuple(value.shape)}".encode())
        raw = value.detach().cpu().contiguous().view(-1).view(torch.uint8)
        h.update(raw.numpy().tobytes())
    elif isinstance(value, dict):
        for key in sorted(value, key=repr):
            h.update(repr(key).encode())
            content_digest(value[key], h)
    elif isinstance(value, (list, tuple)):
        h.update(f"{type(value).__name__}{len(value)}".encode())
        for item in value:
            content_digest(item, h)
    else:
        h.update(repr(value).encode())
    return h


def write_checkpoint(path, ckpt: dict):
    """The dict with its format and digest, written by write_file."""
    body = {k: v for k, v in ckpt.items() if k != "digest"}  # a loaded dict carries one
    body["format"] = CHECKPOINT_FORMAT
    ckpt = body | {"digest": content_digest(body).hexdigest()}
    buffer = io.BytesIO()
    torch.save(ckpt, buffer)
    write_file(path, buffer.getbuffer())


def write_file(path, data):
    """`data` (bytes, or {name: bytes} for a folder) written under a temporary name renamed to
    `path` last (atomic): a reader never sees half a file or folder, and a failure or Ctrl-C at
    any moment leaves `path` as it was (the rename replaces a file, or an empty folder)."""
    tmp = f"{os.path.normpath(path)}.tmp-{os.getpid()}"  # beside `path`, after a "/" too
    try:
        if isinstance(data, dict):
            os.makedirs(tmp)
            for name, blob in data.items():
                with open(os.path.join(tmp, name), "wb") as f:
                    f.write(blob)
        else:
            with open(tmp, "wb") as f:
                f.write(data)
        os.replace(tmp, path)
    except OSError as e:
        why = (e.strerror or str(e)).lower()
        if e.errno == errno.ENOSPC:
            why = "the disk is full"
        raise OSError(f"could not write {path}: {why}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # a folder's; gone after the rename
        if os.path.exists(tmp):
            os.remove(tmp)


def read_checkpoint(path, device="cpu") -> dict:
    """write_checkpoint's dict, its format and digest checked."""
    require(os.path.exists(path), f"checkpoint {path} not found: train one with train_small.py")
    other = f"{path} is not a setdiff checkpoint, or an older setdiff's: retrain it"
    damaged = f"{path} is not a readable checkpoint: it is damaged"
    with open(path, "rb") as f:
        is_zip = f.read(4) == b"PK\x03\x04"  # torch.save's files are zip archives
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except Exception:
        raise ValueError(damaged if is_zip else other) from None
    ours = isinstance(ckpt, dict) and ckpt.get("format") == CHECKPOINT_FORMAT
    require(ours, other)
    body = {k: v for k, v in ckpt.items() if k != "digest"}
    digest = content_digest(body).hexdigest()
    require(ckpt.get("digest") == digest, f"{damaged} (its sha256 digest differs)")
    return ckpt


def load_checkpoint(path, device="cpu"):
    """(model, tokenizer, checkpoint dict) of save_checkpoint's file or a released model's folder."""
    if os.path.isdir(path):
        return load_released(path, device)
    ckpt = read_checkpoint(path, device)
    try:  # an unknown config field (another version), or Config's checks (an edited file)
        cfg = Config(**ckpt["config"])
    except (TypeError, KeyError, ValueError) as e:
        why = one_line(e)
        raise ValueError(f"{path}: its config does not match this setdiff.py: {why}") from None
    weights = ckpt.get("model")
    require_state_dict(weights, f"{path}: its field 'model'", "retrain it")
    model = model_of(cfg, weights, path)
    tok = Tokenizer.from_spec(ckpt.get("tokenizer"))
    return model.to(device).eval(), tok, ckpt


def model_of(cfg: Config, weights, where) -> SetDiffusionLM:
    """SetDiffusionLM(cfg) holding `weights`, whose names, shapes and values are checked before
    the model is built: a config whose sizes disagree with its weights (d_model = 10**9 beside a
    small file) is refused before any weight is allocated."""
    fix = "the weights do not fit the config: use a config and weights saved together"
    n = cfg.n_layer  # each block holds weights: a bound before the blocks are made
    require(n <= len(weights), f"{where}: n_layer {n}: more blocks than weights; {fix}")
    with torch.device("meta"):  # shapes only: nothing is allocated
        want = {k: tuple(w.shape) for k, w in SetDiffusionLM(cfg).state_dict().items()}
    got = {k: tuple(w.shape) for k, w in weights.items()}
    name = min(want.items() ^ got.items(), key=str, default=[None])[0]  # a name they differ at
    shapes = f"{got.get(name, 'missing')} in the file, {want.get(name, 'none')} by the config"
    require(name is None, f"{where}: weight {name}: {shapes}; {fix}")
    require_finite(weights, where)
    model = SetDiffusionLM(cfg)
    model.load_state_dict(weights)
    return model


def require_state_dict(state, where, fix):
    """Refuse weights that are not {name: tensor}: a file's digest is a checksum anyone can
    recompute, so an edited checkpoint may hold anything there."""
    tensors = isinstance(state, dict) and all(map(torch.is_tensor, state.values()))
    names = tensors and all(isinstance(k, str) for k in state)
    require(names, f"{where} is not a state dict (names of tensors); {fix}")


def require_finite(weights: dict, where):
    """Refuse NaN and inf weights: the run that wrote them diverged, and every output would be
    NaN or garbage."""
    for name, w in weights.items():
        finite = bool(w.isfinite().all())
        require(finite, f"{where}: weight {name} is not finite (NaN or inf): a diverged run's")


def one_line(error: Exception) -> str:
    """An error's message in one line of at most 300 characters (torch's span many lines)."""
    return " ".join(str(error).split())[:300]


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
    require(isinstance(spec, dict), f"{path}: not a JSON object; {RELEASED_FIX}")
    for key in ("backbone_config", "noise_config"):
        has = isinstance(spec.get(key), dict)
        require(has, f"{path}: {key}: missing or not an object; {RELEASED_FIX}")
    kind = released_kind(spec)
    require(kind is None, f"{folder} holds {kind}: setdiff runs the released SetDLM DiTs only")
    vocab = os.path.join(folder, "vocab.txt")
    if os.path.isfile(vocab):  # BERT WordPiece (the LM1B models)
        tok = Tokenizer.from_vocab(vocab)
    else:  # GPT-2 byte-level BPE (the OWT models)
        vocab_json = os.path.join(folder, "vocab.json")
        merges = os.path.join(folder, "merges.txt")
        no_files = f"{folder} has no vocab.txt (BERT) nor vocab.json + merges.txt (GPT-2)"
        require(os.path.isfile(vocab_json), no_files)
        tok = Tokenizer.from_bpe(vocab_json, merges)
    cfg = released_config(spec, tok, path)
    # NOTE: the authors' schedule takes k or b as given where noise_config sets them; setdiff
    # derives both from d and s only, so such a config is refused rather than run differently.
    for key in ("k", "b"):
        shape = f"{path}: noise_config sets {key}: setdiff derives k and b from d and s only"
        require(spec["noise_config"].get(key) is None, shape)
    fits = (cfg.vocab_size, cfg.mask_id) == (tok.vocab_size, tok.mask_id)
    require(fits, f"{folder}: its tokenizer files do not fit config.json (vocab size, MASK id)")
    weights = {}
    for name, tensor in released_weights(folder).items():
        if name in RELEASED_UNUSED:
            continue
        require(name.startswith("backbone."), f"{folder}: unknown weight {name!r}")
        key = "." + name.removeprefix("backbone.")
        for old, new in RELEASED_NAMES.items():
            key = key.replace(old, new)
        weights[key[1:]] = tensor
    model = model_of(cfg, weights, folder)
    info = {"config": asdict(cfg), "released": os.fspath(folder)}
    return model.to(device).eval(), tok, info


RELEASED_FIX = "download the folder again, or export it again"


def released_config(spec: dict, tok: Tokenizer, path) -> Config:
    """The Config of a config.json (backbone_config and noise_config: objects, checked)."""
    net = spec["backbone_config"]
    noise = spec["noise_config"]
    L = spec.get("length")
    s = noise.get("max_block_size")
    # NOTE: config.json says max_block_size = block_size (= L), but the training-time schedule
    # ignored it and used s = min(2d, L) (Config's default); the authors' own evaluation loader
    # maps it back so.
    if s == noise.get("block_size", L):
        s = None
    # NOTE: PAD comes from the tokenizer: OWT's config.json names EOS (50256) as its pad id,
    # but its rows have no padding, and EOS targets are scored (the authors' hub evaluation).
    try:
        return Config(
            vocab_size=net["vocab_size"],
            seq_len=spec["length"],
            n_layer=net["num_layers"],
            n_head=net["n_heads"],
            d_model=net["hidden_size"],
            dropout=net["dropout"],
            set_size=noise["desired_block_size"],
            max_set_size=s,
            mask_id=spec["mask_token_id"],
            bos_id=tok.bos_id,
            eos_id=tok.eos_id,
            pad_id=tok.pad_id,
        )
    except KeyError as e:
        raise ValueError(f"{path} lacks a field a SetDLM's config.json has: {e}") from None
    except ValueError as e:  # Config's checks
        raise ValueError(f"{path}: {e}") from None


def released_kind(spec) -> str | None:
    """None for a SetDLM on the authors' DiT, else what it is (their baselines share the format)."""
    net = spec["backbone_config"]
    target = str(net.get("_target_", ""))
    archs = spec.get("architectures")
    arch = "?"
    if isinstance(archs, list) and archs:
        arch = archs[0]
    base = net.get("pretrained_model_name_or_path")
    # the first test that holds says what it is
    if "AutoModel" in target or base:
        return f"a Qwen3 backbone ({base}; the CNN/DM or GSM8K models)"
    if "DITLegacy" in target:
        return "a legacy DiT baseline (owt-ar or owt-mdlm)"
    if arch == "AR" or net.get("causal_attention"):
        return "an autoregressive model (a causal DiT)"
    if arch == "MDLM":
        return "an MDLM (masked diffusion: bidirectional attention, another bound)"
    if arch == "BD3LM":
        return f"a BD3-LM (block diffusion, block size {spec.get('block_size')})"
    if arch != "SetDLM" or not target.endswith(".DIT"):
        return f"an unknown model ({arch}, {target})"
    if net.get("adaln"):
        return "a SetDLM with timestep modulation (adaLN), unlike every release"
    return None


def read_json(path, what: str):
    text = read_text(path, what)
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:  # not JSON, 4,300+ digits, or "[" * 50000
        raise ValueError(f"{path} is not JSON ({e}): not {what}") from None


SAFETENSORS_DTYPES = {  # the dtypes of a safetensors header that setdiff reads
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "BOOL": torch.bool,
}


def released_weights(folder) -> dict:
    """pytorch_model.bin's state dict, or model.safetensors's tensors."""
    bin_path = os.path.join(folder, "pytorch_model.bin")
    if os.path.isfile(bin_path):
        try:
            state = torch.load(bin_path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise ValueError(f"{bin_path} is not a state dict ({type(e).__name__})") from None
        require_state_dict(state, bin_path, RELEASED_FIX)
        return state
    path = os.path.join(folder, "model.safetensors")
    require(os.path.isfile(path), f"{folder} has no weights: pytorch_model.bin, model.safetensors")
    return read_safetensors(path)


def read_safetensors(path) -> dict:
    """A safetensors file read without a dependency, every field checked before a tensor is
    made: an 8-byte little-endian header size n, a JSON header {name: {dtype, shape,
    data_offsets}}, then the data, each tensor's bytes [start, end) its own."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    n = int.from_bytes(data[:8], "little")
    body = 8 + n  # where the data begins
    size = len(data) - body  # bytes of data
    require(size >= 0, f"{path}: header size {n}: past the end of the file; {RELEASED_FIX}")
    try:
        header = json.loads(data[8:body])
    except (ValueError, RecursionError):  # not UTF-8, not JSON, or nested past Python's stack
        header = None
    require(isinstance(header, dict), f"{path}: header: not a JSON object; {RELEASED_FIX}")
    header.pop("__metadata__", None)
    spans = []
    for name, info in header.items():
        info = info if isinstance(info, dict) else {}
        kind = info.get("dtype")
        dtype = SAFETENSORS_DTYPES.get(str(kind))
        known = ", ".join(SAFETENSORS_DTYPES)
        require(dtype, f"{path}: tensor {name}: dtype {kind!r}: setdiff reads {known} only")
        shape = info.get("shape")
        sizes = f"{path}: tensor {name}: shape {shape!r}: not a list of sizes"
        require(natural_numbers(shape), sizes)
        # Every size bounded, and their product, before torch sees them: beside a 0 the byte
        # count is 0 whatever the other sizes ([0, 2**63] passes it, then overflows torch).
        elements = math.prod(i or 1 for i in shape)  # the zeros left out
        huge = f"{shape!r}: more than the 2**63 - 1 elements torch counts"
        require(elements < 2**63, f"{path}: tensor {name}: shape {huge}")
        span = info.get("data_offsets")
        count = math.prod(shape) * dtype.itemsize  # its bytes
        fits = natural_numbers(span) and len(span) == 2 and span[1] - span[0] == count
        bounds = f"not [start, start + {count}]: the bytes of its shape and dtype"
        require(fits, f"{path}: tensor {name}: data_offsets {span!r}: {bounds}")
        spans.append((*span, name, dtype, shape))
    raw = torch.frombuffer(data, dtype=torch.uint8)
    weights = {}
    last = 0  # the end of the tensor before, in the file's order
    for start, end, name, dtype, shape in sorted(spans):
        where = f"overlaps another tensor or ends past the {size} bytes of data"
        require(last <= start and end <= size, f"{path}: tensor {name}: data_offsets {where}")
        last = end
        tensor = raw[body + start : body + end].clone()  # aligned for its dtype
        weights[name] = tensor.view(dtype).reshape(shape)
    return weights


def natural_numbers(value) -> bool:
    return isinstance(value, list) and all(type(i) is int and i >= 0 for i in value)


# Export: a model trained here as the authors' released SetDLM folders (what load_released reads),
# for their evaluation tools or for publishing beside their models.
RELEASED_LAYOUT = re.compile(  # the authors' weight names (a DiT without timestep modulation)
    r"backbone\.(vocab_embed\.embedding|output_layer\.(norm_final\.weight|linear\.(weight|bias))"
    r"|blocks\.\d+\.(norm[12]\.weight|attn_(qkv|out)\.weight|mlp\.[02]\.(weight|bias)))"
)
RELEASED_TOKENIZERS = {"wordpiece": "bert-base-uncased", "bpe": "gpt2"}  # their tokenizer_name
SPECIAL_IDS = ("vocab_size", "mask_id", "bos_id", "eos_id", "pad_id")  # Config's and Tokenizer's


def save_released(model: SetDiffusionLM, tokenizer: Tokenizer, folder) -> list:
    """The model as a released SetDLM folder, in a new or empty `folder`: config.json, the
    weights under the authors' names (model.safetensors and pytorch_model.bin) and the
    tokenizer's files, written by write_file as one folder: a failure leaves `folder` as it was.
    What that format cannot express is refused. -> the names of the files written."""
    model = getattr(model, "_orig_mod", model)  # unwrap torch.compile
    cfg = model.cfg
    if os.path.exists(folder):
        empty = os.path.isdir(folder) and not os.listdir(folder)
        require(empty, f"{folder} exists and is not an empty folder: export to a new one")
    why = "the authors' SetDLM is staggered only (their AR, BD3-LM and MDLM are other models)"
    require(cfg.order == "staggered", f"cannot export order {cfg.order!r}: {why}")
    L = cfg.seq_len
    d = cfg.set_size
    # NOTE: config.json gets max_block_size = s, but the authors' loader (and released_config)
    # reads max_block_size = L as min(2d, L), so s = L is expressible only where 2d >= L.
    trap = f"the authors' loader reads max_block_size = L as s = min(2d, L) = {2 * d}"
    require(cfg.max_set_size < L or 2 * d >= L, f"cannot export s = L = {L} with d = {d}: {trap}")
    fits = all(getattr(cfg, k) == getattr(tokenizer, k) for k in SPECIAL_IDS)
    ids = "cannot export: the model's vocab size or special ids are not its tokenizer's"
    require(fits, f"{ids} (a released folder takes them from its tokenizer files)")
    require_finite(model.state_dict(), "the model")
    files = released_tokenizer_files(tokenizer)
    state = released_state(model)
    files["model.safetensors"] = safetensors_bytes(state)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    files["pytorch_model.bin"] = buffer.getvalue()
    spec = released_spec(cfg, tokenizer.kind)
    files["config.json"] = json.dumps(spec, indent=2).encode()
    write_file(folder, files)
    return list(files)


def released_spec(cfg: Config, kind: str) -> dict:
    """config.json as the authors' BD3LMConfig writes it for a SetDLM on their DiT (sdpa)."""
    L = cfg.seq_len
    net = {
        "_target_": "backbone_dit.DIT",
        "length": L,
        "causal_attention": False,
        "adaln": False,
        "hidden_size": cfg.d_model,
        "cond_dim": 128,
        "n_heads": cfg.n_head,
        "num_layers": cfg.n_layer,
        "dropout": cfg.dropout,
        "tie_word_embeddings": True,  # NOTE: their flag; nothing is tied in their DiT either
        "attn_backend": "sdpa",
        "vocab_size": cfg.vocab_size,
        "block_size": L,
        "pretrained_model_name_or_path": None,
    }
    noise = {
        "_target_": "noise_schedule_noise_schedules.StaggeredNoise",
        "eps": 0.001,
        "block_size": L,
        "desired_block_size": cfg.set_size,
        "max_block_size": cfg.max_set_size,
        "length": L,
    }
    # NOTE: without PAD (GPT-2), PAD is written as EOS, as in the authors' OWT config.json;
    # setdiff takes PAD from the tokenizer files, so it reads back as none.
    pad = cfg.eos_id if cfg.pad_id is None else cfg.pad_id
    ids = {"vocab_size": cfg.vocab_size, "mask_token_id": cfg.mask_id, "pad_token_id": pad}
    # NOTE: their LM1B configs leave BOS and EOS unset ([CLS] is both in the data); their OWT
    # configs name <|endoftext|> for both
    end = None if kind == "wordpiece" else cfg.eos_id
    ends = {"bos_token_id": end, "eos_token_id": end, "pad_vocab_size_multiple": 1}
    # NOTE: no auto_map: it names code files that the authors' upload adds and no loader needs
    return {
        "architectures": ["SetDLM"],
        "model_type": "bd3lm",
        "attn_backend": "sdpa",
        "backbone_config": net,
        "noise_config": noise,
        "length": L,
        "block_size": L,
        "eval_block_size": L,
        "keep_clean_bos": True,  # position 0 comes first and is not scored, as in setdiff
        "eval_nll": False,
        "train_on_context": False,
        "setdlm_eos_last_in_target_order": False,
        "setdlm_fht_cache_order": False,
        "tokenization_config": ids | ends,
        "tokenizer_name": RELEASED_TOKENIZERS[kind],  # the files in the folder are what count
        **ids,
        "pad_vocab_size_multiple": 1,
        "torch_dtype": "float32",
        "transformers_version": "4.52.4",
    }


def released_state(model: SetDiffusionLM) -> dict:
    """The float32 weights under the authors' names (RELEASED_NAMES backwards, "backbone."
    first), with the two buffers their files carry and load_released ignores."""
    state = {}
    for name, tensor in model.state_dict().items():
        key = "backbone." + name  # RELEASED_NAMES's dots match after the prefix
        for theirs, ours in RELEASED_NAMES.items():
            key = key.replace(ours, theirs)
        # setdiff's LayerNorms have no bias, as theirs: a weight outside their names is refused
        unnamed = f"cannot export weight {name}: the authors' layout has no name for it"
        require(RELEASED_LAYOUT.fullmatch(key), unnamed)
        state[key] = tensor.detach().cpu().float().contiguous()
    cfg = model.cfg
    head_dim = cfg.d_model // cfg.n_head
    state["backbone.rotary_emb.inv_freq"] = rotary_frequencies(head_dim)
    state["static_attention_mask"] = set_causal_mask(cfg.seq_len)  # their sdpa mask, (2L, 2L)
    return state


def safetensors_bytes(tensors: dict) -> bytes:
    """The layout released_weights reads: the header size (8 bytes, little-endian), a JSON header
    padded with spaces to a multiple of 8 (with {"format": "pt"}, as transformers writes it),
    then the tensors' raw bytes in header order."""
    dtype_names = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
    header = {"__metadata__": {"format": "pt"}}
    blobs = []
    offset = 0
    for name, tensor in tensors.items():
        blob = tensor.numpy().tobytes()  # in C order
        end = offset + len(blob)
        header[name] = {
            "dtype": dtype_names[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, end],
        }
        blobs.append(blob)
        offset = end
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + b"".join(blobs)


def released_tokenizer_files(tok: Tokenizer) -> dict:
    """{name: bytes} of the files load_released reads: vocab.txt (BERT WordPiece, a piece a
    line) or vocab.json + merges.txt (GPT-2 BPE, without the appended MASK, as theirs)."""
    files = "a released folder holds BERT WordPiece or GPT-2 BPE tokenizer files only"
    require(tok.kind != "bytes", f"cannot export the bytes tokenizer: {files}")
    if tok.kind == "wordpiece":
        lines = "\n".join(tok.pieces) + "\n"
        return {"vocab.txt": lines.encode()}
    vocab = {piece: i for i, piece in enumerate(tok.pieces)}
    rules = ["#version: 0.2", *map(" ".join, tok.merges)]
    merges = "\n".join(rules) + "\n"
    vocab_json = json.dumps(vocab, ensure_ascii=False)
    return {"vocab.json": vocab_json.encode(), "merges.txt": merges.encode()}


# ---- Running: device, dtype, threads, compile ---------------------------------------------------
BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # x86 CPU flags of bf16 arithmetic in hardware


def native_bf16(cpuinfo: str) -> str:
    """The first of BF16_FLAGS among a CPU's flags (the first "flags" line of Linux's
    /proc/cpuinfo text), or "" where there is none: another CPU, or not Linux's text."""
    found = re.search(r"^flags\s*:(.*)$", cpuinfo, re.M)
    flags = found[1].split() if found else []
    named = [flag for flag in BF16_FLAGS if flag in flags]
    return named[0] if named else ""


def cpu_info() -> str:
    """/proc/cpuinfo on Linux; "" elsewhere (macOS, Windows), where no bf16 is assumed."""
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def autocast_dtype(where: torch.device, dtype="auto", training=False) -> tuple:
    """-> (the autocast dtype, why): `dtype` unless "auto"; bf16 on a GPU that has it (the
    paper trains with bf16), and for training on a CPU whose flags name native bf16; otherwise
    float32. NOTE: a CPU without native bf16 emulates it, and a training step gets slower;
    sampling on a CPU stays float32, as bf16 is not known to be faster there and would change
    the tokens (experiments/README.md, "Machines")."""
    if dtype != "auto":
        return getattr(torch, dtype), "requested with --dtype"
    if where.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16, "the GPU supports bf16 (the paper trains with bf16)"
    flag = native_bf16(cpu_info()) if where.type == "cpu" else ""
    if flag and training:
        return torch.bfloat16, f"training on a CPU with native bf16: {flag}"
    if flag:  # sample.py, --eval, the benches: their own reason
        return torch.float32, f"outside training: bf16 ({flag}) changes outputs, no faster"
    return torch.float32, "bf16 is not known to be faster: experiments/train_bench.py"


def runtime(device=None, dtype="auto", threads=None, local_rank=0, training=False) -> tuple:
    """Where and how to run, each choice with its reason -> (device, dtype, a line saying so):
    the device given (checked) or the first of cuda, mps, cpu ("cuda" under torchrun: this
    process's GPU); the autocast dtype (autocast_dtype); torch's threads, as given or
    the cores other processes leave idle. NOTE: torch's default, a thread per core, collapses
    beside other work (experiments/README.md, "Machines")."""
    usable = []
    if torch.cuda.is_available():
        usable.append("cuda")
    if torch.backends.mps.is_available():
        usable.append("mps")
    usable.append("cpu")
    asked = device not in (None, "", "auto")
    name = device if asked else usable[0]
    kind = re.fullmatch(r"(cpu|cuda|mps)(:\d+)?", name)
    use = " or ".join(usable)
    require(kind and kind[1] in usable, f"--device {name!r} is not available here; use {use}")
    why = "no GPU found"
    if name != "cpu":
        why = "a GPU is available"
    if asked:
        why = "requested with --device"
    if name == "cuda":
        name = f"cuda:{local_rank}"  # this process's GPU under torchrun
    where = torch.device(name)
    how, why_dtype = autocast_dtype(where, dtype, training)
    cores = os.cpu_count() or 1
    # NOTE: bounded: torch crawls at thousands of threads and crashes at 10^5; checked here,
    # not by each script's parser, so every script that takes --threads refuses the same
    most = 4 * cores
    bounds = f"--threads {threads}: must be in [1, {most}] (4 x the {cores} cores; more only wait)"
    require(threads is None or 1 <= threads <= most, bounds)
    busy = 0
    if hasattr(os, "getloadavg"):  # not on Windows
        busy = round(os.getloadavg()[0])
    n = threads or max(1, cores - busy)
    why_threads = f"{cores} cores, load {busy} elsewhere"
    if threads:
        why_threads = "requested with --threads"
    torch.set_num_threads(n)
    dtype_name = str(how).removeprefix("torch.")
    plural = "" if n == 1 else "s"
    threads_used = f"{n} thread{plural} ({why_threads})"
    line = f"device: {where} ({why}); {dtype_name} ({why_dtype}); {threads_used}"
    return where, how, line


def autocast(device: torch.device, dtype: torch.dtype):
    """Mixed precision for forward passes: matmuls in `dtype`, weights stay float32."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


# The sampler's state, one per shape, and its compiled calls. Graphs a compiled call needs, per
# shape (B, C, device, compute dtype) and window w: one per set size n in 1..min(w, C) and per
# setting of the four switches of SamplerRun: at most 16 min(w, C), its recompile_limit. Past
# it, or past dynamo's cap of 256 graphs for sampler_call in a process (a uniform-order model's
# w = L can reach it), that shape and window run eager, with the same tokens, said in one line.
# NOTE: one generate() at a time per model: two threads sampling one model at once would share a
# shape's tensors (a server samples from one thread, or from a copy of the model per thread)
SAMPLER_RUNS = weakref.WeakKeyDictionary()  # model -> {shape: SamplerRun}
SHAPES_KEPT = 8  # shapes a model keeps state for: the oldest goes (a long-running server)
SWITCHES = 4  # greedy, top-p, penalty, stop at EOS: Python values a compiled graph reads


class SamplerRun:
    """The tensors a sampler call reads and writes, for B rows of C positions: allocated once
    per shape (sampler_run) and reused by every later run, which `start` copies its inputs
    into. The settings that are numbers are 0-d tensors: a new value is a copy, not a new
    compiled graph; only the window and four switches (greedy, top-p, penalty, stop at EOS)
    are Python values. At fixed addresses, a compiled call is a CUDA graph recorded once."""

    def __init__(self, cfg, B, C, device):
        m = min(max_window(cfg), C)  # the most queries a call
        self.mask_id = cfg.mask_id
        policy = order_policy(cfg)
        self.block_size = policy.block_size  # a window stays inside k_f's block of keys
        self.x = torch.zeros(B, C, dtype=torch.long, device=device)  # the canvas
        self.sampler_key = upload(policy.sampler_key[:C], device)  # (C,)
        self.key = torch.zeros_like(self.x)  # (B, C) the window opens at the least masked key
        self.reveal_call = torch.zeros_like(self.x)  # (B, C)
        self.pending = torch.zeros_like(self.x, dtype=torch.bool)  # revealed, not cached yet
        self.done = torch.zeros_like(self.pending[:, 0])  # (B,)
        self.row_calls = torch.zeros_like(self.x[:, 0])  # (B,)
        self.call = torch.zeros(1, dtype=torch.long, device=device)  # calls so far
        self.diverged = torch.zeros(1, dtype=torch.bool, device=device)
        # call c draws with uniforms[c] (float64: MPS has none, so they stay on its CPU)
        mps = torch.device(device).type == "mps"
        on = "cpu" if mps else device
        self.uniforms = torch.zeros(C, B, m, dtype=torch.float64, device=on)
        real = torch.float32 if mps else torch.float64  # a setting as exact as a Python float
        number = torch.zeros((), dtype=real, device=device)  # tau, temperature, top-p, penalty
        self.threshold = number.clone()
        self.temperature = number.clone()
        self.top_p = number.clone()
        self.penalty = number.clone()
        self.first_seen = torch.zeros((), dtype=torch.long, device=device)
        # NOTE: slots for a call of C + m tokens (the given tokens can fill a row): a cache
        # about twice the row's size, so that every run of this shape uses the same one
        self.cache = KVCache(cfg, B, C, C + m, device)
        self.steps = {}  # the compiled calls, by window and backend (compiled_call)

    def start(self, x, w, m, threshold, temperature, top_p, penalty):
        """A new run on the canvas x (B, C): copies, never a new tensor."""
        self.w = w  # the window
        self.m = m  # queries a call
        self.greedy = temperature == 0
        self.nucleus = top_p < 1
        self.penalized = penalty != 1
        self.x.copy_(x)
        self.key.copy_(self.sampler_key.expand_as(x))  # the ancestral sampler's: generate
        masked = x == self.mask_id
        self.reveal_call.copy_(torch.where(masked, MASKED, GIVEN))
        self.pending.copy_(~masked)  # the context, at first
        self.done.copy_(self.pending.all(1))
        for t in (self.row_calls, self.call, self.diverged, self.cache.filled):
            t.zero_()
        self.threshold.fill_(threshold)
        self.temperature.fill_(temperature)
        self.top_p.fill_(top_p)
        self.penalty.fill_(penalty)
        if self.cache.k is not None:  # stale keys are masked, but a NaN would leak through
            self.cache.k.zero_()
            self.cache.v.zero_()


def sampler_run(model, B, C) -> SamplerRun:
    """The SamplerRun of this model for B rows of C positions on its device, in the dtype
    its calls compute in: made by the first run of the shape, reused by the later ones."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    if torch.is_autocast_enabled(device.type):
        dtype = torch.get_autocast_dtype(device.type)
    runs = SAMPLER_RUNS.setdefault(model, {})
    key = (B, C, device, dtype)
    if key not in runs and len(runs) == SHAPES_KEPT:
        runs.pop(next(iter(runs)))
    if key not in runs:
        runs[key] = SamplerRun(model.cfg, B, C, device)
    return runs[key]


def compiled_call(run, backend):
    """sampler_call compiled for `run`'s shape and window (backend True: inductor, or a
    torch.compile backend's name), its tensors at fixed addresses; a failure to compile is
    one line naming --compile; past the graphs it may make, eager calls (one line says so)."""
    key = (run.w, backend)
    limit = 2**SWITCHES * run.m
    if key not in run.steps:
        fixed_addresses(run, run.cache)
        name = "inductor" if backend is True else backend
        run.steps[key] = compiled(sampler_call, name, limit)

    def call(model, run, n, m):  # m queries: a compiled call feeds min(w, C), its graphs n only
        try:
            return run.steps[key](model, run, n, run.m)
        # NOTE: caught here, not set_stance("eager_on_recompile"): a stance is the whole
        # process's, and would change the user's own compiled functions too
        except torch._dynamo.exc.FailOnRecompileLimitHit:  # an Exception, not dynamo's error
            shape = f"batch {len(run.x)}, {run.x.shape[1]} positions, window {run.w}"
            why = f"dynamo's graph limit ({limit} a shape, 256 a process) is reached"
            print(f"--compile: {why}: {shape} runs eager", file=sys.stderr)
            run.steps[key] = sampler_call
            return sampler_call(model, run, n, m)
        except torch._dynamo.exc.TorchDynamoException as e:  # no C++ compiler, say
            why = str(e).split("\n")[0]
            raise ValueError(
                f"--compile: torch.compile fails here ({why}): run without it"
            ) from None

    return call


def compiled(function, backend, limit):
    """`function` (a sampler call) compiled whole, without graph breaks, one capture per set of
    shapes (n new tokens): "reduce-overhead" replays each as a CUDA graph on a GPU. Its graphs
    are counted apart from other compiles of `function`, at most `limit` (then it raises)."""
    options = dict(fullgraph=True, dynamic=False, recompile_limit=limit)
    if backend == "inductor":  # the others take no mode
        options["mode"] = "reduce-overhead"
    return torch.compile(function, backend=backend, isolate_recompiles=True, **options)


def fixed_addresses(*holders):
    """Mark every tensor attribute of `holders` a static address: a compiled call's CUDA graph
    then updates them in place (it skips the graph for other inputs that a call changes)."""
    for holder in holders:
        for t in vars(holder).values():
            if torch.is_tensor(t):
                torch._dynamo.mark_static_address(t)


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so that wall-clock times measure the work itself."""
    if device.type in ("cuda", "mps"):
        getattr(torch, device.type).synchronize()


# ---- Text -> rows, as the authors build them ----------------------------------------------
# A file is read as documents, each followed by EOS. Lines that are not UTF-8 text (or hold a
# NUL byte) are skipped and counted; a file mostly of them is binary, and refused.
#   Bytes and LM1B (BERT WordPiece): a document is a line, stripped (a sentence; a blank line
#   is none). WordPiece: the line is detokenized, tokenized and followed by [CLS], which is
#   both EOS and BOS; the stream is cut into chunks of L-2 tokens, each row [CLS] + chunk +
#   [CLS]. Bytes: [BOS] + chunk + [EOS], EOS standing for the newline.
#   OWT (GPT-2 BPE, no BOS): a document is text as it is, as the OWT models saw it: newlines,
#   blank lines and indentation are ordinary tokens (CRLF and CR line ends read as LF). Documents
#   end at a line that holds only <|endoftext|> and at the end of a file: a file is one
#   document, or several separated by such lines. EOS comes only between documents; rows are
#   raw L-token chunks.
LM1B_DETOKENIZER = [  # MDLM's lm1b_detokenizer, in its order; a literal rule is escaped
    (r"http : / / ", "http://"),
    (r"https : / / ", "https://"),
    (r" '(\w+)", r"'\1"),
    (r" (\w+) \. ", r" \1. "),  # a sentence-inner period joins its word
    (r" (\w+) \.$", r" \1."),
    (r" \? ", "? "),
    (r" \?$", "?"),
    (r" ! ", "! "),
    (r" \!$", "!"),
    (r" , ", ", "),
    (r" : ", ": "),
    (r" ; ", "; "),
    (r" / ", "/"),
    (r'" ([^"]+) "', r'"\1"'),
    (r"' ([^']+) '", r"'\1'"),  # quotes hug what they quote
    (r"\( ([^\(\)]+) \)", r"(\1)"),
    (r"\[ ([^\[\]]+) \]", r"[\1]"),
    (r"\$ ", "$"),  # currency signs join their amount
    (r"£ ", "£"),
]
LM1B_RULES = [(re.compile(pattern), replacement) for pattern, replacement in LM1B_DETOKENIZER]


def lm1b_detokenize(text: str) -> str:
    """Undo LM1B's tokenized spacing: `he said , " yes " .` -> `he said, "yes".`"""
    for pattern, replacement in LM1B_RULES:
        text = pattern.sub(replacement, text)
    return text


def documents(tok: Tokenizer, data: bytes) -> tuple:
    """A file's bytes (or a chunk of whole documents) -> (its documents, its lines of text that
    are not blank, the lines skipped as not text). Blank documents are left out."""
    docs = []
    doc = []  # the lines of the document being read
    lines = 0
    bad = 0
    for raw in data.splitlines():  # at LF, CRLF or CR
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = "\0"  # not text, as a NUL byte (a binary file) says
        if "\0" in text:
            bad += 1
            continue
        lines += bool(text.strip())
        if tok.kind != "bpe":
            docs.append(text.strip())
        elif document_end(tok, raw):
            docs.append("\n".join(doc))
            doc = []
        else:
            doc.append(text)
    docs.append("\n".join(doc))
    return [d for d in docs if d.strip()], lines, bad


def document_end(tok: Tokenizer, raw: bytes) -> bool:
    """Whether a raw line of a file ends a document: every line, or GPT-2's separator line."""
    return tok.kind != "bpe" or raw.strip() == GPT2_EOS.encode()


def document_ids(tok: Tokenizer, doc: str) -> list:
    """A document's ids, then EOS; a WordPiece (LM1B) line is detokenized first, as the authors
    do."""
    if tok.kind == "wordpiece":
        doc = lm1b_detokenize(doc)
    return tok.encode(doc) + [tok.eos_id]


def check_text(flag: str, path, lines: int, bad: int) -> None:
    """Refuse a file without text, and a binary one: a few bad lines are skipped (LM1B has
    some), but not more than there are lines of text."""
    require(lines or bad, f"{flag} {path} holds no text")
    require(bad <= lines, f"{flag} {path} does not look like text: {bad:,} lines are not UTF-8")


def wrap_rows(stream, seq_len: int, bos, eos):
    """A stream of ids -> (rows (n, L) uint16, the leftover for the next call; no padding).
    With a BOS: rows [BOS] + L-2 tokens + [EOS]; with bos None: plain chunks of L tokens."""
    stream = np.asarray(stream, dtype=np.uint16)  # ids < 2^16: half the disk of int32
    body = seq_len if bos is None else seq_len - 2  # stream tokens per row
    n = len(stream) // body
    used = n * body
    chunks = stream[:used].reshape(n, body)  # (n, body)
    leftover = stream[used:].copy()
    if bos is None:
        return chunks.copy(), leftover
    rows = np.empty((n, seq_len), dtype=np.uint16)  # (n, L)
    rows[:, 0] = bos
    rows[:, 1:-1] = chunks
    rows[:, -1] = eos
    return rows, leftover


def text_per_row(cfg: Config) -> int:
    """Source-text tokens a whole row scores: with BOS, [BOS] + L-2 tokens + [EOS] (BOS and the
    row's closing EOS are no text); without BOS, L tokens, of which position 0 is given."""
    if cfg.bos_id is None:
        return cfg.seq_len - 1
    return cfg.seq_len - 2


# ---- Appendix: the tokenizer shim ----------------------------------------------------------
# The method needs a vocabulary with named special ids: MASK (an unrevealed position), EOS (the
# end of a sentence or document) and, where the data has them, BOS (position 0) and PAD.
#   bytes:     UTF-8 bytes, no files needed; toy runs, and bits per byte for free.
#   wordpiece: BERT uncased WordPiece from a vocab.txt (the LM1B models). Standard library
#              only; the ids of HuggingFace's BertWordPieceTokenizer(lowercase=True).
#   bpe:       GPT-2 byte-level BPE from vocab.json + merges.txt (the OWT models), MASK appended.
TOKENIZER_KINDS = ("bytes", "wordpiece", "bpe")
WORD_MEMO = 1 << 16  # the words whose ids a tokenizer remembers


class Tokenizer:
    """encode() adds no special tokens; decode() leaves out PAD, MASK and a BOS that is not also
    EOS, and writes EOS as a newline (GPT-2: <|endoftext|>)."""

    def __init__(self, kind: str, pieces=None, merges=None, source: str = "vocab"):
        require(kind in TOKENIZER_KINDS, f"unknown tokenizer kind {kind!r}")
        self.kind = kind
        self.pieces = list(pieces or [])  # id -> piece
        self.ids = {piece: i for i, piece in enumerate(self.pieces)}  # piece -> id
        # word -> ids, remembered: natural text repeats few words; bounded, for endless text
        split = self._bpe if kind == "bpe" else self._wordpiece
        self.word_ids = functools.lru_cache(maxsize=WORD_MEMO)(split)
        self.merges = [tuple(m) for m in merges or []]  # GPT-2's pair merges, best first
        self.ranks = {pair: rank for rank, pair in enumerate(self.merges)}
        self.unk_id = None
        if kind == "bytes":  # ids 0..255 are the bytes; the specials follow
            self.pad_id = 256
            self.bos_id = 257
            self.eos_id = 258
            self.mask_id = 259
            self.vocab_size = 260
        elif kind == "wordpiece":
            self._check_vocab(_BERT_SPECIALS, source, "a BERT uncased model's vocab.txt")
            self.pad_id = self.ids["[PAD]"]
            self.unk_id = self.ids["[UNK]"]
            self.mask_id = self.ids["[MASK]"]
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
        silent = {self.pad_id, self.mask_id, self.bos_id}
        self.silent = silent - {self.eos_id, None}  # ids decode() leaves out

    def _check_vocab(self, specials, source: str, expected: str) -> None:
        absent = [t for t in specials if t not in self.ids]
        missing = ", ".join(absent)
        require(not missing, f"{source} is not {expected}: it has no {missing}")
        unique = len(self.ids) == len(self.pieces)
        require(unique, f"{source}: a token appears twice")
        filled = all(p.strip() for p in self.pieces)
        require(filled, f"{source}: a blank token")

    @classmethod
    def bytes(cls) -> Tokenizer:
        return cls("bytes")

    @classmethod
    def from_vocab(cls, path) -> Tokenizer:
        """BERT uncased WordPiece from a vocab.txt: one token per line, id = line number."""
        # NOTE: split at "\n" only: str.splitlines() also splits at U+2028, U+0085, ...,
        # which may be (part of) tokens. A final newline is optional; CRLF is accepted.
        text = read_text(path, "the vocab.txt of a BERT uncased model")
        lines = text.removesuffix("\n").split("\n")
        pieces = [s.removesuffix("\r") for s in lines]
        return cls("wordpiece", pieces, source=f"vocab file {path}")

    @classmethod
    def from_bpe(cls, vocab_json, merges_txt) -> Tokenizer:
        """GPT-2 byte-level BPE: vocab.json {piece: id}, merges.txt one "a b" pair per line."""
        vocab = read_json(vocab_json, "GPT-2's vocab.json")
        not_gpt2 = f"{vocab_json} is not GPT-2's vocab.json: ids must be 0..n-1"
        require(isinstance(vocab, dict) and natural_numbers([*vocab.values()]), not_gpt2)
        ids = sorted(vocab.values())
        require(ids == list(range(len(ids))), not_gpt2)
        text = read_text(merges_txt, "GPT-2's merges.txt")
        lines = text.replace("\r", "").split("\n")
        rules = [line for line in lines if line and not line.startswith("#version")]
        merges = [rule.split(" ") for rule in rules]
        why = "two pieces that merge into a piece of vocab.json"
        for merge in merges:
            if len(merge) != 2 or "".join(merge) not in vocab:
                pair = " ".join(merge)
                raise ValueError(f"{merges_txt}: the merge {pair!r} is not {why}")
        # In GPT-2's files every piece but the 256 bytes and <|endoftext|> is made by one
        # merge: a piece that none makes could never be encoded (merges.txt cut or emptied).
        made = {"".join(merge) for merge in merges} | _CHAR_BYTES.keys() | {GPT2_EOS}
        unmade = [piece for piece in vocab if piece not in made]
        count = f"{len(unmade):,} of the pieces of {vocab_json}"
        reach = f"no merge makes {count} (as {unmade[:1]}): it cannot reach the vocabulary"
        require(not unmade, f"{merges_txt}: {reach}; use the merges.txt of that vocab.json")
        pieces = sorted(vocab, key=vocab.get)  # in id order
        return cls("bpe", pieces, merges, f"vocab file {vocab_json}")

    @classmethod
    def from_spec(cls, spec) -> Tokenizer:
        """Rebuild a tokenizer from spec() (stored in checkpoints)."""
        ok = isinstance(spec, dict) and spec.get("kind") in TOKENIZER_KINDS
        shown = str(spec)[:80]
        require(ok, f"not a tokenizer spec: {shown!r}; expected one of Tokenizer.spec()")
        # checked: a checkpoint's digest is anyone's to recompute, so it may hold anything
        vocab = spec.get("vocab") or []
        texts = isinstance(vocab, list) and all(map(is_text, vocab))
        require(texts, "tokenizer spec: vocab: not a list of pieces (texts)")
        merges = spec.get("merges") or []
        pairs = isinstance(merges, list) and all(map(text_pair, merges))
        require(pairs, "tokenizer spec: merges: not a list of pairs of pieces")
        return cls(spec["kind"], vocab, merges, "tokenizer spec")

    def spec(self) -> dict:
        """JSON-ready; it carries the vocab (and merges), so no file is needed later."""
        return {"kind": self.kind, "vocab": self.pieces, "merges": self.merges}

    def encode(self, text: str) -> list:
        if self.kind == "bytes":
            return list(text.encode("utf-8"))
        bert = self.kind == "wordpiece"
        specials = _BERT_SPECIAL_RE if bert else _GPT2_SPECIAL_RE
        words_of = _bert_words if bert else _gpt2_words
        ids = []
        # Special-token strings are matched first, case-sensitively ("[cls]" is ordinary
        # text); the split's odd-numbered pieces are those tokens.
        for k, chunk in enumerate(specials.split(text)):
            if k % 2:
                ids.append(self.ids[chunk])
                continue
            for word in words_of(chunk):
                ids += self.word_ids(word)
        return ids

    def _wordpiece(self, word: str) -> tuple:
        """Greedy longest-match-first: take the longest vocab piece that prefixes the rest of
        the word ("##" marks a continuation); a word with an unmatched rest is one [UNK]."""
        if len(word) > 100:  # HuggingFace's limit: longer words are [UNK]
            return (self.unk_id,)
        ids = []
        start = 0
        while start < len(word):
            longest = min(len(word), start + self.longest)
            for end in range(longest, start, -1):
                piece = word[start:end]
                if start:
                    piece = "##" + piece
                if piece in self.ids:
                    ids.append(self.ids[piece])
                    start = end
                    break
            else:
                return (self.unk_id,)
        return tuple(ids)

    def _bpe(self, word: str) -> tuple:
        """Merge the best-ranked adjacent pair everywhere, left to right, until none is ranked.
        The parts are a linked list and the ranked pairs a heap of (rank, start): O(n log n).
        Pairs that a round's merges make wait for the round's end, as if every occurrence of
        the best pair merged at once (this matters where a merge outranks one it needs)."""
        n = len(word)
        # parts[i]: the part that starts at letter i, None once merged away; parts[n] = None
        # ends the list at both sides (parts[-1]), so a pair at an end is never ranked
        parts = [*word, None]
        after = [*range(1, n + 1), n]  # where the next part starts
        before = list(range(-1, n))
        heap = sorted(self._ranked(parts, after, range(n)))  # a sorted list is a heap
        while heap:
            rank = heap[0][0]
            made = []  # parts whose pair with the next part is new
            while heap and heap[0][0] == rank:  # the best pair's occurrences, left to right
                i = heapq.heappop(heap)[1]
                j = after[i]
                if self.ranks.get((parts[i], parts[j])) != rank:
                    continue  # merged away, or overlapping the previous occurrence
                parts[i] += parts[j]
                parts[j] = None
                after[i] = after[j]
                before[after[i]] = i
                made += [before[i], i]
            for entry in self._ranked(parts, after, made):
                heapq.heappush(heap, entry)
        return tuple(self.ids[p] for p in parts if p)

    def _ranked(self, parts: list, after: list, starts) -> list:
        """(rank, start) of the ranked pairs that begin at `starts`."""
        pairs = [((parts[i], parts[after[i]]), i) for i in starts]
        return [(self.ranks[pair], i) for pair, i in pairs if pair in self.ranks]

    def decode(self, ids) -> str:
        """Text of ids (list, tensor or array). WordPiece pieces are joined by spaces, except
        that a "##" piece continues the previous one; GPT-2 pieces are bytes."""
        if hasattr(ids, "tolist"):  # a tensor or an array
            ids = ids.tolist()
        ids = list(ids)
        last = self.vocab_size - 1
        for i in ids:  # a negative id would silently index from the end of the vocab
            is_int = isinstance(i, (int, np.integer))
            outside = f"token id {i!r} is outside this tokenizer's vocab (0..{last})"
            require(is_int and 0 <= i <= last, outside)
        ids = [i for i in ids if i not in self.silent]
        if self.kind == "bytes":
            data = bytes(10 if i == self.eos_id else i for i in ids)  # EOS: a newline
            return data.decode("utf-8", "replace")
        if self.kind == "bpe":  # byte characters: join the bytes first (a character may span ids)
            chars = "".join(self.pieces[i] for i in ids)
            data = bytes(_CHAR_BYTES[c] for c in chars)
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


def text_pair(value) -> bool:
    """A merge as spec() keeps it: two pieces."""
    return isinstance(value, (list, tuple)) and len(value) == 2 and all(map(is_text, value))


def is_text(value) -> bool:
    return isinstance(value, str)


def read_text(path, what: str) -> str:
    require(os.path.isfile(path), f"{path} does not exist or is not a file: pass {what}")
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 (byte {e.start}): not {what}") from None


_BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
# the special tokens' strings, in a group: split() keeps them
_BERT_SPECIAL_RE = re.compile(r"(\[PAD\]|\[UNK\]|\[CLS\]|\[SEP\]|\[MASK\])")
GPT2_EOS = "<|endoftext|>"
_GPT2_SPECIAL_RE = re.compile(r"(<\|endoftext\|>)")


def _bert_words(text: str) -> list:
    """BERT normalisation and pre-tokenisation, in the reference's order: clean the text and
    pad CJK ideographs, strip accents (NFD, drop Mn), lower-case, isolate punctuation, split
    at whitespace. Two str.translate tables fill themselves per character (fast, in C)."""
    if text.isascii():  # NFD is the identity on ASCII: one table
        return text.translate(_ASCII).split()
    cleaned = text.translate(_CLEAN)
    decomposed = unicodedata.normalize("NFD", cleaned)
    return decomposed.translate(_FINISH).split()


class _CharMap(dict):
    """A str.translate table that computes each character's rule on first use."""

    def __init__(self, rule):  # no dict.__init__: the table starts empty
        self.rule = rule

    def __missing__(self, cp: int) -> str:
        out = self.rule(chr(cp))
        self[cp] = out
        return out


def _clean_char(ch: str) -> str:
    """Tab/newline/CR -> space; control, format, private-use, surrogates, NUL and U+FFFD
    deleted; other White_Space -> space; a CJK ideograph becomes a word of its own.
    NOTE: unassigned code points (Cn) are kept, as in the reference."""
    if ch in "\t\n\r":
        return " "
    invisible = _category(ch) in ("Cc", "Cf", "Co", "Cs")
    if invisible or ch in ("\x00", "\ufffd"):
        return ""  # before the whitespace test: U+000B, U+0085 are Cc
    if ch in _WHITESPACE:
        return " "
    cjk = any(lo <= ord(ch) <= hi for lo, hi in _CJK)
    return f" {ch} " if cjk else ch


def _finish_char(ch: str) -> str:
    """After NFD: drop non-spacing marks (accents), lower-case this character alone, pad
    punctuation. NOTE: per character, so a final capital sigma becomes σ, not Python's ς."""
    if _category(ch) == "Mn":
        return ""
    return "".join(f" {c} " if _is_punctuation(c) else c for c in ch.lower())


def _is_punctuation(ch: str) -> bool:
    """BERT's punctuation: non-alphanumeric printable ASCII ($, +, <, ^, `, ~ too) and any P*."""
    ascii_symbol = "!" <= ch <= "~" and not ch.isalnum()
    return ascii_symbol or _category(ch)[0] == "P"


def _category(ch: str) -> str:
    """The Unicode category as the reference sees it: it uses older tables than this Python,
    so characters whose class changed since (found by probing every code point) are pinned."""
    return _PINNED.get(ord(ch)) or unicodedata.category(ch)


def _spans(text: str) -> list:
    """ "0890-0891 0A76 ..." (hex, inclusive ranges) -> [(0x890, 0x891), (0xA76, 0xA76), ...]."""
    spans = []
    for span in text.split():
        lo, _, hi = span.partition("-")
        first = int(lo, 16)
        last = int(hi or lo, 16)
        spans.append((first, last))
    return spans


def _code_points(text: str) -> set:
    points = set()
    for lo, hi in _spans(text):
        points.update(range(lo, hi + 1))
    return points


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
_NEWER_MARKS = """
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
"""
_PINNED = dict.fromkeys(_code_points(_NEWER_MARKS), "Lo")
_PINNED[0x166D] = "Po"
_PINNED[0x111C9] = "Po"
_PINNED[0x1734] = "Mn"
_PINNED[0x1171E] = "Mn"
_CLEAN = _CharMap(_clean_char)
_FINISH = _CharMap(_finish_char)
_ASCII = {cp: _CLEAN[cp].translate(_FINISH) for cp in range(128)}  # both tables at once


# GPT-2's byte-level BPE runs on text in which every byte is a visible character: printable
# Latin-1 bytes stand for themselves, the other 68 bytes for chr(256), chr(257), ...
_KEPT = list(range(0x21, 0x7F))  # printable ASCII
_KEPT += range(0xA1, 0xAD)  # printable Latin-1, the soft hyphen (0xAD) aside
_KEPT += range(0xAE, 0x100)
_MOVED = [b for b in range(256) if b not in _KEPT]
_BYTE_CHARS = {b: chr(b) for b in _KEPT}
_BYTE_CHARS |= {b: chr(256 + n) for n, b in enumerate(_MOVED)}
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
    with its Unicode classes spelled out as ranges for Python's re (built once, on first use)."""
    spans = {kind: _spans(text) for kind, text in _NEWER.items()}  # letters L, numbers N
    points = range(0x110000)
    kinds = [unicodedata.category(chr(cp))[0] for cp in points]
    for kind, run in itertools.groupby(points, kinds.__getitem__):
        if kind in spans:
            run = list(run)
            spans[kind].append((run[0], run[-1]))
    # the insides of the character classes [...] of letters, numbers and whitespace
    L = _char_class(spans["L"])
    N = _char_class(spans["N"])
    S = _char_class(_spans(_WHITE_SPACE))
    words = f"'s|'t|'re|'ve|'m|'ll|'d| ?[{L}]+| ?[{N}]+| ?[^{S}{L}{N}]+"
    return re.compile(words + f"|[{S}]+(?![^{S}])|[{S}]+")


def _gpt2_words(text: str) -> list:
    """GPT-2's pre-tokens of `text`, as byte characters (surrogatepass: lone surrogates too)."""
    words = _gpt2_pattern().findall(text)
    encoded = [w.encode("utf-8", "surrogatepass") for w in words]
    # a byte's Latin-1 character is chr(byte): the table maps it to the byte's BPE character
    return [data.decode("latin-1").translate(_BYTE_CHARS) for data in encoded]


def _char_class(spans) -> str:
    """The inside of a regex character class [...] that matches the code points of `spans`."""
    return "".join(f"{chr(lo)}-{chr(hi)}" for lo, hi in spans)
