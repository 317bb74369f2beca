"""Tests for setdiff: every invariant of SPEC.md checked against an independent computation
(a brute-force loop, a closed form, or the cache-free path). CPU, fp32 unless stated."""

import json
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import setdiff
import train_small
from setdiff import (Config, SetDiffusionLM, StaggeredSchedule, Tokenizer, elbo, generate,
                     load_checkpoint, max_window, sample_order, save_checkpoint, set_causal_mask)

BYTES = Tokenizer.bytes()


def tiny_cfg(**kw):
    base = dict(vocab_size=BYTES.vocab_size, seq_len=24, n_layer=2, n_head=2, d_model=32, dropout=0.0,
                order="staggered", set_size=3, pad_id=BYTES.pad_id, bos_id=BYTES.bos_id,
                eos_id=BYTES.eos_id, mask_id=BYTES.mask_id)
    base.update(kw)
    return Config(**base)


def tiny_model(seed=0, dtype=torch.float32, **kw):
    """A small random model whose head is NOT zero, so predictions depend on the input."""
    torch.manual_seed(seed)
    model = SetDiffusionLM(tiny_cfg(**kw))
    torch.nn.init.normal_(model.head.weight, std=1.0)
    return model.to(dtype).eval()


def random_rows(cfg, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, cfg.seq_len), generator=g)
    x[:, 0] = cfg.bos_id
    return x


def decode_order_from_steps(reveal_step):
    """Full decode order from reveal steps: by (step, position); given tokens have step -1."""
    T = reveal_step.shape[1]
    key = reveal_step * (T + 1) + torch.arange(T)
    return torch.argsort(key, dim=1, stable=True)


# ---------------------------------------------------------------------------- masks (SPEC §3)

SPEC_L4 = """
1 0 0 0 0 0 0 0
1 1 0 0 0 0 0 0
1 1 1 0 0 0 0 0
1 1 1 1 0 0 0 0
0 0 0 0 1 0 0 0
1 0 0 0 0 1 0 0
1 1 0 0 0 0 1 0
1 1 1 0 0 0 0 1
"""


def test_mask_equals_spec_worked_example():
    expected = torch.tensor([[int(v) for v in row.split()] for row in SPEC_L4.strip().splitlines()]).bool()
    assert torch.equal(set_causal_mask(4), expected)
    assert "m3 [ 1  1  1  0 |  0  0  0  1 ]" in setdiff.show_mask(set_causal_mask(4))


@pytest.mark.parametrize("L", [1, 2, 3, 5, 8, 13])
def test_mask_equals_brute_force_definition(L):
    mask = set_causal_mask(L)
    for q in range(2 * L):
        for k in range(2 * L):
            qc, kc, i, j = q < L, k < L, q % L, k % L
            if qc and kc:
                want = j <= i          # clean sees earlier-or-same clean
            elif qc:
                want = False           # clean never sees the mask stream
            elif kc:
                want = j < i           # mask sees strictly earlier clean
            else:
                want = i == j          # mask sees only itself
            assert bool(mask[q, k]) == want, (L, q, k)


def test_ar_order_is_next_token_prediction():
    """With the identity order, mask slot i sees exactly clean positions 0..i-1."""
    L = 7
    mask = set_causal_mask(L)
    assert torch.equal(mask[L:, :L], torch.ones(L, L).tril(-1).bool())
    cfg = tiny_cfg(order="ar")
    order = sample_order(cfg, 3)
    assert torch.equal(order, torch.arange(cfg.seq_len).expand(3, -1))


# ---------------------------------------------------------------------------- schedule (SPEC §2)

@pytest.mark.parametrize("d,b,k", [(4, 0.059259, 0.358090), (8, 0.111888, 0.387534), (16, 0.201258, 0.450425)])
def test_schedule_constants_match_spec(d, b, k):
    s = StaggeredSchedule(128, d)
    assert s.s == 2 * d
    assert round(s.b, 6) == b and round(s.k, 6) == k
    assert math.isclose(s.b * s.k / (s.k + 1), d / 256, rel_tol=1e-12)
    # closed forms, written out independently
    assert math.isclose(s.b, 2 * d / (128 + 2 * d - 1))
    assert math.isclose(s.reach, 2 * d) and s.window == 2 * d       # r = s exactly
    assert math.isclose(s.loc[0].item(), 1 - s.b) and s.loc[-1].item() == 0.0


def test_schedule_special_cases():
    s = StaggeredSchedule(128, 4, 4)                        # d == s: k = 1, b = d / L
    assert s.k == 1 and math.isclose(s.b, 4 / 128)
    assert math.isclose(s.reach, 4 * 127 / 124) and s.window == 5
    u = StaggeredSchedule(10, 10, 10)                       # uniform: b = 1, every loc 0
    assert u.b == 1 and torch.all(u.loc == 0) and u.window == 10
    with pytest.raises(ValueError, match="set_size"):
        StaggeredSchedule(8, 9)
    with pytest.raises(ValueError):
        StaggeredSchedule(8, 4, 3)


@pytest.mark.parametrize("L,d,s", [(16, 3, 6), (16, 4, 4), (12, 2, 7), (9, 1, None)])
def test_mask_prob_closed_form_and_first_hitting_times(L, d, s):
    sched = StaggeredSchedule(L, d, s)
    t = torch.linspace(0, 1, 41, dtype=torch.float64)
    m = sched.mask_prob(t)
    # closed form, scalar by scalar
    for a in range(0, 41, 4):
        for i in range(L):
            u = (t[a].item() - sched.loc[i].item()) / sched.b
            want = 0.0 if u <= 0 else 1.0 if u >= 1 else 1 - (1 - u) ** sched.k
            if d == 1 and want > 0:
                want = 1.0
            assert abs(m[a, i].item() - want) < 1e-12
    # P(T_i <= t) = m_i(t): empirical CDF of the first hitting times
    N = 20000
    T = sched.first_hitting_times(N, torch.Generator().manual_seed(1))
    emp = (T[None, :, :] <= t[:, None, None]).double().mean(1)       # (41, L)
    if d == 1:
        return          # a hard step: m is an indicator, T is continuous; checked by the order test
    tol = 5 * torch.sqrt(m * (1 - m) / N) + 2e-3
    assert torch.all((emp - m).abs() <= tol)


@pytest.mark.parametrize("d,s", [(4, 8), (3, 5), (4, 4), (6, 6)])
def test_reach_bounds_revealed_tokens(d, s):
    """Replay sampled orders: every revealed token stays within ceil(r) of the leftmost
    unrevealed position (SPEC §2, including the d = s case)."""
    L = 40
    sched = StaggeredSchedule(L, d, s)
    r = sched.b * (L - 1) / (1 - sched.b)
    limit = math.ceil(r - 1e-9)
    orders = torch.argsort(-sched.first_hitting_times(400, torch.Generator().manual_seed(2)), 1)
    worst = 0
    for order in orders.tolist():
        revealed = [False] * L
        f = 0
        for p in order:
            revealed[p] = True
            while f < L and revealed[f]:
                f += 1
            if f < L:
                far = max(i for i in range(L) if revealed[i]) if any(revealed) else -1
                worst = max(worst, far - f)
                assert far - f < limit, (order, p)
    assert worst >= d - 1            # the policy really does reach ahead (not the identity)


def test_d1_gives_identity_and_uniform_gives_uniform_orders():
    T = StaggeredSchedule(32, 1).first_hitting_times(500, torch.Generator().manual_seed(3))
    assert torch.equal(torch.argsort(-T, 1), torch.arange(32).expand(500, -1))
    cfg = tiny_cfg(seq_len=6, order="uniform", set_size=6)
    N = 12000
    order = sample_order(cfg, N, torch.Generator().manual_seed(4))
    assert torch.all(order[:, 0] == 0)                       # BOS pinned first
    counts = torch.zeros(6, 6)
    for slot in range(1, 6):
        counts[slot] = torch.bincount(order[:, slot], minlength=6).float()
    freq = counts[1:, 1:] / N                                # positions 1..5 at slots 1..5
    assert torch.all((freq - 0.2).abs() < 5 * math.sqrt(0.2 * 0.8 / N))


def test_block_order_and_pinning():
    cfg = tiny_cfg(seq_len=12, order="block", set_size=4)
    pad = torch.zeros(200, 12, dtype=torch.bool)
    pad[:, 10:] = True
    order = sample_order(cfg, 200, torch.Generator().manual_seed(5), prefix_len=2, pad_mask=pad)
    for row in order.tolist():
        assert row[:2] == [0, 1]                             # BOS + prefix, in order
        assert row[-2:] == [10, 11]                          # padding last, in order
        assert sorted(row) == list(range(12))
        blocks = [p // 4 for p in row[2:10]]
        assert blocks == sorted(blocks)                      # blocks left to right
    firsts = {tuple(r[2:4]) for r in order.tolist()}         # randomness inside block 0
    assert len(firsts) > 1
    with pytest.raises(ValueError, match="unknown order policy"):
        tiny_cfg(order="random")
    with pytest.raises(ValueError, match="set_size"):
        tiny_cfg(set_size=25)


# ---------------------------------------------------------------------------- training forward and loss

def test_training_forward_is_set_causal():
    """logits[i] depends on the tokens before i in the order, and on nothing else (x[i] included)."""
    model = tiny_model()
    cfg = model.cfg
    x = random_rows(cfg, 1)
    order = sample_order(cfg, 1, torch.Generator().manual_seed(6))
    base = model(x, order)
    slot_of = torch.argsort(order[0])
    for i in range(1, cfg.seq_len):
        for j in range(cfg.seq_len):
            if j == 0:
                continue                                         # keep BOS
            y = x.clone()
            y[0, j] = (y[0, j] + 1) % 256
            changed = not torch.allclose(model(y, order)[0, i], base[0, i], atol=1e-6)
            assert changed == bool(slot_of[j] < slot_of[i]), (i, j)


def test_training_forward_equals_one_query_at_a_time():
    """Independent path for every slot r: feed only x[sigma_<r] (causal among themselves) and
    ONE mask query at position sigma_r; its logit must equal the two-stream forward's."""
    model = tiny_model()
    cfg = model.cfg
    x = random_rows(cfg, 1, seed=5)
    order = sample_order(cfg, 1, torch.Generator().manual_seed(13))
    full = model(x, order)[0]                                        # (L, V) position order
    for r in range(cfg.seq_len):
        prefix = order[0, :r]
        tokens = torch.cat([x[0, prefix], torch.tensor([cfg.mask_id])])[None]
        positions = torch.cat([prefix, order[0, r:r + 1]])[None]
        attn = torch.ones(r + 1, r + 1).tril().bool()                # query row sees all + itself
        z = model.logits(model.run(tokens, positions, attn[None]))[0, -1]
        assert torch.allclose(z, full[order[0, r]], atol=1e-5), r


def test_no_empty_rows_and_padded_gradients_are_finite():
    m = torch.tensor([[True, False], [False, False]])
    assert torch.equal(setdiff.no_empty_rows(m), torch.tensor([[True, False], [True, True]]))
    model = tiny_model()
    x = random_rows(model.cfg, 2)
    x[1, 4:] = model.cfg.pad_id
    run = model.run

    def checked_run(tokens, positions, attn, cache=None):
        assert attn.any(-1).all()                          # no query row attends nothing
        return run(tokens, positions, attn, cache)
    model.run = checked_run
    model.train()
    model.loss(x, generator=torch.Generator().manual_seed(0)).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_mask_token_gets_zero_probability():
    model = tiny_model()
    with torch.no_grad():
        model.head.weight[model.cfg.mask_id] = 50.0             # push hard towards MASK
    x = random_rows(model.cfg, 2)
    p = F.softmax(model(x, sample_order(model.cfg, 2)), -1)
    assert torch.all(p[..., model.cfg.mask_id] == 0)
    out = generate(model, batch_size=2, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert not (out.tokens == model.cfg.mask_id).any()


def test_loss_equals_hand_computation_with_padding():
    model = tiny_model()
    cfg = model.cfg
    x = random_rows(cfg, 3)
    x[1, 15:] = cfg.pad_id
    x[2, 5:] = cfg.pad_id
    pad = x == cfg.pad_id
    order = sample_order(cfg, 3, torch.Generator().manual_seed(7), pad_mask=pad)
    logp = torch.log_softmax(model(x, order).double(), -1)
    want = 0.0
    for b in range(3):
        terms = [-logp[b, i, x[b, i]].item() for i in range(cfg.seq_len) if x[b, i] != cfg.pad_id]
        want += sum(terms) / len(terms)                           # BOS slot is scored in training
    want /= 3
    assert math.isfinite(want)
    assert abs(model.loss(x, order).item() - want) < 1e-4
    # a padded row predicts its real positions exactly as the same row without padding
    assert sorted(order[2, :5].tolist()) == list(range(5))                # padding sorted last
    short = model(x[2:3, :5], order[2:3, :5])
    assert torch.allclose(model(x, order)[2, :5], short[0], atol=1e-5)


def test_elbo_ar_equals_left_to_right_sum():
    model = tiny_model(order="ar")
    cfg = model.cfg
    x = random_rows(cfg, 5)
    x[4, 20:] = cfg.pad_id
    res = elbo(model, x, num_orders=3, batch_size=2)
    identity = torch.arange(cfg.seq_len).expand(5, -1)
    logp = torch.log_softmax(model(x, identity).double(), -1)
    per_seq, counts = [], []
    for b in range(5):
        terms = [-logp[b, i, x[b, i]].item() for i in range(1, cfg.seq_len) if x[b, i] != cfg.pad_id]
        per_seq.append(sum(terms))
        counts.append(len(terms))
    assert res.tokens == sum(counts) and res.num_orders == 3 and res.num_seqs == 5
    assert abs(res.nll - sum(per_seq)) < 1e-3
    assert abs(res.ppl - math.exp(sum(per_seq) / sum(counts))) < 1e-3 * res.ppl
    # delta-method standard error of sum(nll) / sum(tokens), sequences as units
    rate = sum(per_seq) / sum(counts)
    mean_n = sum(counts) / 5
    resid = [(a - rate * n) / mean_n for a, n in zip(per_seq, counts)]
    mu = sum(resid) / 5
    want_se = math.sqrt(sum((r - mu) ** 2 for r in resid) / 4) / math.sqrt(5)
    assert abs(res.se - want_se) < 1e-6


def test_elbo_averages_k_random_orders():
    """Uniform policy: each row's NLL is the mean over K orders; BOS and padding unscored."""
    model = tiny_model(order="uniform", set_size=24)
    cfg = model.cfg
    x = random_rows(cfg, 3)
    x[2, 10:] = cfg.pad_id
    res = elbo(model, x, num_orders=4, batch_size=3, generator=torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(3)                    # replay the same order draws
    want = 0.0
    for _ in range(4):
        order = sample_order(cfg, 3, g, pad_mask=x == cfg.pad_id)
        logp = torch.log_softmax(model(x, order).double(), -1)
        for b in range(3):
            want += sum(-logp[b, i, x[b, i]].item() for i in range(1, cfg.seq_len) if x[b, i] != cfg.pad_id) / 4
    assert res.tokens == 23 + 23 + 9 and abs(res.nll - want) < 1e-3


def test_tiny_model_overfits_short_text():
    text = "set diffusion decodes text in flexible sets of positions. " * 4
    cfg = tiny_cfg(seq_len=32, d_model=64, n_layer=2, n_head=4, set_size=4)
    ids = BYTES.encode(text)
    rows = torch.tensor([[cfg.bos_id] + ids[i:i + 31] for i in range(0, 64, 8)])
    torch.manual_seed(0)
    model = SetDiffusionLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    first = model.loss(rows, generator=g).item()
    assert abs(first - math.log(cfg.vocab_size - 1)) < 1e-3       # zero head: uniform over non-MASK
    for _ in range(150):
        loss = model.loss(rows, generator=g)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * math.log(cfg.vocab_size)


# ---------------------------------------------------------------------------- sampler (SPEC §5)

SAMPLER_CASES = [
    dict(order="staggered", window=3, threshold=float("inf")),
    dict(order="staggered", window=6, threshold=0.05),
    dict(order="block", window=3, threshold=0.1),
    dict(order="uniform", window=24, threshold=0.2, set_size=24),
    dict(order="ar", window=1, threshold=float("inf")),
]


@pytest.mark.parametrize("case", SAMPLER_CASES)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cached_equals_cache_free(case, temperature):
    """Sampled decoding is compared in float64 (SPEC §5: float32 rounding may flip a draw)."""
    case = dict(case)
    window, threshold = case.pop("window"), case.pop("threshold")
    dtype = torch.float64 if temperature else torch.float32
    model = tiny_model(dtype=dtype, **case)
    kw = dict(batch_size=3, window=window, threshold=threshold, temperature=temperature, top_p=0.9)
    a = generate(model, generator=torch.Generator().manual_seed(8), **kw)
    b = generate(model, generator=torch.Generator().manual_seed(8), use_cache=False, **kw)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.reveal_step, b.reveal_step)
    assert a.nfe == b.nfe == int(a.steps.max())
    # a prompt and an infill canvas as well
    prompt = torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13]])
    a = generate(model, prompt=prompt, generator=torch.Generator().manual_seed(9), **kw)
    b = generate(model, prompt=prompt, generator=torch.Generator().manual_seed(9), use_cache=False, **kw)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.reveal_step, b.reveal_step)
    canvas = random_rows(model.cfg, 3, seed=5)
    holes = torch.zeros_like(canvas, dtype=torch.bool)
    holes[0, 2:7] = holes[0, 15:18] = holes[1, 20:] = holes[2, 8:16] = True   # right context too
    infill = torch.where(holes, model.cfg.mask_id, canvas)
    kw.pop("batch_size")
    a = generate(model, infill=infill, generator=torch.Generator().manual_seed(10), **kw)
    b = generate(model, infill=infill, generator=torch.Generator().manual_seed(10), use_cache=False, **kw)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.reveal_step, b.reveal_step)
    assert torch.equal(a.tokens[~holes], canvas[~holes])


@pytest.mark.parametrize("with_infill", [False, True])
def test_cached_logits_equal_cache_free_logits_step_by_step(with_infill):
    """The two prediction paths give the same logits on the same state (float64)."""
    model = tiny_model(dtype=torch.float64)
    cfg = model.cfg
    T = cfg.seq_len
    if with_infill:
        infill = random_rows(cfg, 2, seed=6)
        infill[0, 3:10] = infill[1, 12:20] = cfg.mask_id
        out = generate(model, infill=infill, window=3, threshold=0.3, temperature=0.0)
    else:
        out = generate(model, batch_size=2, window=3, threshold=0.3, temperature=0.0)
    cache = setdiff.KVCache(cfg, 2, T, max_call=T + 3, device="cpu")
    steps = out.reveal_step
    xs = torch.cat([out.tokens, torch.full((2, 1), cfg.pad_id)], 1)
    for n in range(out.nfe):
        # state before step n: revealed = steps < n; tokens revealed at step n-1 are pending
        state_steps = torch.where(steps < n, steps, -3)
        canvas = xs.clone()
        canvas[:, :T] = torch.where(steps < n, out.tokens, cfg.mask_id)
        masked = canvas[:, :T] == cfg.mask_id
        active = setdiff.window_queries(masked, 3, None)
        pending = (steps == n - 1) if n else (steps == -1)
        z1, q1, v1 = setdiff.predict_cached(model, canvas, pending, active, cache, T)
        step_col = torch.cat([state_steps, torch.full((2, 1), -3)], 1)
        z2, q2, v2 = setdiff.predict_cache_free(model, canvas, step_col, active, T)
        assert torch.equal(q1, q2) and torch.equal(v1, v2)
        assert torch.allclose(z1[v1], z2[v2], atol=1e-10)


@pytest.mark.parametrize("order,window,set_size", [("staggered", 4, 3), ("block", 3, 3), ("uniform", 5, 24)])
def test_one_token_per_step_matches_training_forward(order, window, set_size):
    """Feed the generated sequence and its reveal order through model(x, order): the greedy
    choice at every generated position is the training forward's argmax there."""
    model = tiny_model(order=order, set_size=set_size)
    out = generate(model, batch_size=2, window=window, temperature=0.0, prompt=torch.tensor([65, 66]))
    assert torch.all(out.steps == out.new_tokens)                     # one token per step
    order_ = decode_order_from_steps(out.reveal_step)
    greedy = model(out.tokens, order_).argmax(-1)
    gen = out.reveal_step >= 0
    assert torch.equal(greedy[gen], out.tokens[gen])


@pytest.mark.parametrize("use_cache", [True, False])
def test_sampler_distributions_equal_training_forward(use_cache, monkeypatch):
    """Sampled decoding, one token per step (float64): at every step the distribution the
    sampler drew from equals the training forward's at that position, given the final
    sequence and its reveal order (SPEC §5)."""
    model = tiny_model(dtype=torch.float64)
    seen = []                                               # (position, logits) of each draw
    draw = setdiff.draw_candidates

    def spy(logits, temperature, top_p, generator=None):
        cand, conf = draw(logits, temperature, top_p, generator)
        seen.append(logits.clone())
        return cand, conf
    monkeypatch.setattr(setdiff, "draw_candidates", spy)
    out = generate(model, window=4, temperature=1.0, generator=torch.Generator().manual_seed(15),
                   use_cache=use_cache)
    order = decode_order_from_steps(out.reveal_step)
    ref = torch.log_softmax(model(out.tokens, order), -1)[0]            # (L, V)
    for step, logits in enumerate(seen):
        pos = int((out.reveal_step[0] == step).nonzero())
        masked = out.reveal_step[:1] >= step                             # state before this step
        q = setdiff.window_queries(masked, 4, None)[0]
        slot = int(q[:pos].sum())                                       # queries are in position order
        assert torch.allclose(torch.log_softmax(logits[0, slot], -1), ref[pos], atol=1e-9)


def test_top_p_truncates_and_confidence_is_the_drawn_probability():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    logits = p.log().expand(1, 20000, 4)
    g = torch.Generator().manual_seed(0)
    cand, conf = setdiff.draw_candidates(logits, 1.0, 0.7, g)          # keeps {0, 1}: 0.5 < 0.7 <= 0.8
    freq = torch.bincount(cand.flatten(), minlength=4).double() / cand.numel()
    assert freq[2] == freq[3] == 0 and abs(freq[0] - 0.625) < 0.02
    assert torch.allclose(conf, torch.where(cand == 0, 0.625, 0.375).double())
    cand, conf = setdiff.draw_candidates(logits, 1.0, 0.5, g)          # mass 0.5 reached by token 0 alone
    assert torch.all(cand == 0) and torch.all(conf == 1)
    cand, conf = setdiff.draw_candidates(logits, 0.0, 1.0, g)          # greedy: plain softmax prob
    assert torch.all(cand == 0) and torch.allclose(conf, torch.full_like(conf, 0.5))
    cand, _ = setdiff.draw_candidates(logits, 2.0, 1.0, g)             # temperature flattens
    freq = torch.bincount(cand.flatten(), minlength=4).double() / cand.numel()
    want = p.sqrt() / p.sqrt().sum()
    assert torch.allclose(freq, want, atol=0.02)


def test_sampling_never_draws_zero_probability_tokens(monkeypatch):
    """u just below the total mass must not round up onto MASK (float32 logits, the last
    entry of the sorted distribution)."""
    logits = torch.randn(2, 3, 260)
    logits[..., 259] = float("-inf")
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.full(a[0], 1 - 2**-53, dtype=torch.float64))
    for top_p in (1.0, 0.9):
        cand, conf = setdiff.draw_candidates(logits, 1.0, top_p)
        assert not (cand == 259).any() and torch.all(conf > 0)
    monkeypatch.undo()
    cand, conf = setdiff.draw_candidates(logits, 1e-30, 1.0)          # tiny temperature ~ greedy
    assert torch.equal(cand, logits.argmax(-1)) and torch.all(conf == 1)


def test_block_windows_never_cross_block_boundaries():
    model = tiny_model(order="block", set_size=4)
    out = generate(model, batch_size=3, window=4, threshold=0.05, temperature=1.0,
                   generator=torch.Generator().manual_seed(14))
    for row in out.reveal_step.tolist():
        for blk in range(0, 5):
            here, nxt = row[4 * blk:4 * blk + 4], row[4 * blk + 4:4 * blk + 8]
            here = [s for s in here if s >= 0]                        # BOS is given
            assert max(here) < min(nxt)              # block j done before block j+1 starts
        for step in set(row) - {-1}:
            assert len({p // 4 for p, s in enumerate(row) if s == step}) == 1   # one block per step
    a = generate(model, window=4, threshold=0.0, temperature=0.0)  # whole block per step
    assert a.nfe == 24 // 4                                       # one step per block (BOS + 3 in block 0)


def test_prompt_and_infill_context_never_change():
    model = tiny_model()
    cfg = model.cfg
    prompt = torch.tensor([72, 101, 108, 108, 111])
    out = generate(model, prompt=prompt, batch_size=2, temperature=1.0, threshold=0.1,
                   generator=torch.Generator().manual_seed(10))
    assert torch.all(out.tokens[:, 0] == cfg.bos_id) and torch.all(out.tokens[:, 1:6] == prompt)
    assert torch.all(out.reveal_step[:, :6] == -1) and out.tokens.shape[1] == cfg.seq_len
    canvas = random_rows(cfg, 2, seed=3)
    holes = torch.zeros_like(canvas, dtype=torch.bool)
    holes[0, 3:9] = holes[0, 15:17] = holes[1, 10:22] = True
    infill = torch.where(holes, cfg.mask_id, canvas)
    out = generate(model, infill=infill, window=6, temperature=1.0, generator=torch.Generator().manual_seed(11))
    assert torch.equal(out.tokens[~holes], canvas[~holes])
    assert torch.all(out.reveal_step[~holes] == -1) and torch.all(out.reveal_step[holes] >= 0)
    assert not (out.tokens == cfg.mask_id).any()


def test_batched_equals_row_by_row():
    model = tiny_model()
    cfg = model.cfg
    canvas = random_rows(cfg, 3, seed=4)
    holes = torch.zeros_like(canvas, dtype=torch.bool)
    holes[0, 2:20] = holes[1, 12:14] = holes[2, 5:24] = True             # rows finish at different steps
    infill = torch.where(holes, cfg.mask_id, canvas)
    kw = dict(window=5, threshold=0.3, temperature=0.0)
    batched = generate(model, infill=infill, **kw)
    for b in range(3):
        single = generate(model, infill=infill[b:b + 1], **kw)
        assert torch.equal(single.tokens[0], batched.tokens[b])
        assert torch.equal(single.reveal_step[0], batched.reveal_step[b])
        assert single.nfe == batched.steps[b]
    assert batched.nfe == int(batched.steps.max())


def test_threshold_controls_tokens_per_step():
    model = tiny_model()
    one = generate(model, batch_size=2, window=3, threshold=1.5, temperature=0.0)
    assert torch.all(one.steps == one.new_tokens) and one.nfe == model.cfg.seq_len - 1
    all_of_window = generate(model, batch_size=2, window=3, threshold=0.0, temperature=0.0)
    assert all_of_window.nfe == math.ceil((model.cfg.seq_len - 1) / 3)   # whole window every step
    some = generate(model, batch_size=2, window=3, threshold=0.2, temperature=0.0)
    assert all_of_window.nfe <= some.nfe <= one.nfe
    for row, n in zip(some.reveal_step.tolist(), some.steps.tolist()):
        assert {s for s in row if s >= 0} == set(range(n))               # never zero per step, per row


def eos_model():
    """Every query predicts EOS with probability ~1, equally at every position."""
    model = tiny_model()
    with torch.no_grad():
        model.ln_f.weight.zero_()
        model.ln_f.bias.zero_()
        model.ln_f.bias[0] = 1.0
        model.head.weight.zero_()
        model.head.weight[model.cfg.eos_id, 0] = 30.0
    return model


def test_stop_at_eos_pads_the_rest():
    model = eos_model()
    cfg = model.cfg
    out = generate(model, prompt=torch.tensor([cfg.eos_id, 70, 71]), temperature=0.0, stop_at_eos=True)
    # the EOS in the prompt does not stop; the first generated one (leftmost, at position 4) does
    assert out.tokens[0, 4] == cfg.eos_id and out.nfe == 1
    assert torch.all(out.tokens[0, 5:] == cfg.pad_id) and torch.all(out.reveal_step[0, 5:] == -2)
    full = generate(model, prompt=torch.tensor([70]), temperature=0.0)
    assert not (full.tokens == cfg.pad_id).any() and full.nfe == cfg.seq_len - 2
    # infill: the right context survives; batched, cached == cache-free
    infill = random_rows(cfg, 2, seed=7)
    infill[0, 3:6] = infill[1, 10:20] = cfg.mask_id
    a = generate(model, infill=infill, temperature=0.0, window=3, stop_at_eos=True)
    b = generate(model, infill=infill, temperature=0.0, window=3, stop_at_eos=True, use_cache=False)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.reveal_step, b.reveal_step)
    known = infill != cfg.mask_id
    assert torch.equal(a.tokens[known], infill[known])
    assert a.tokens[0, 3] == cfg.eos_id and torch.all(a.tokens[0, 4:6] == cfg.pad_id)


def test_stop_at_eos_rule_by_hand():
    cfg = tiny_cfg(seq_len=8)
    M, E, P = cfg.mask_id, cfg.eos_id, cfg.pad_id
    xs = torch.tensor([[cfg.bos_id, 65, M, 66, E, 67, M, 68, P],     # masked before the EOS: go on
                       [cfg.bos_id, 65, 66, E, 67, M, 68, 69, P],    # stop: 67, M -> PAD; 68 given
                       [cfg.bos_id, E, 65, M, M, M, M, M, P]])       # EOS given: not a stop
    step = torch.tensor([[-1, 0, -3, 1, 2, 2, -3, -1, -3],
                         [-1, 0, 1, 2, 2, -3, -1, 3, -3],
                         [-1, -1, 0, -3, -3, -3, -3, -3, -3]])
    stop = setdiff._stop_at_eos(cfg, xs, step, 8)
    assert stop.tolist() == [False, True, False]
    assert xs[1, :8].tolist() == [cfg.bos_id, 65, 66, E, P, P, 68, P]
    assert step[1, :8].tolist() == [-1, 0, 1, 2, -2, -2, -1, -2]
    assert xs[0, 5] == 67 and xs[2, 2] == 65


# ---------------------------------------------------------------------------- checkpoints

def test_checkpoint_round_trip_and_corrupt_files(tmp_path):
    model = tiny_model()
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, model, BYTES, step=7)
    loaded, tok, ckpt = load_checkpoint(path)
    assert ckpt["step"] == 7 and tok.spec() == BYTES.spec() and loaded.cfg == model.cfg
    x = random_rows(model.cfg, 2)
    order = sample_order(model.cfg, 2, torch.Generator().manual_seed(12))
    assert torch.equal(loaded.eval()(x, order), model(x, order))
    assert list(tmp_path.iterdir()) == [path]                        # no temp files left behind
    data = path.read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        load_checkpoint(tmp_path / "cut.pt")
    (tmp_path / "junk.pt").write_bytes(b"hello")
    with pytest.raises(ValueError, match="not a readable checkpoint"):
        load_checkpoint(tmp_path / "junk.pt")
    torch.save({"weights": 1}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a setdiff checkpoint"):
        load_checkpoint(tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not found"):
        load_checkpoint(tmp_path / "missing.pt")


def test_failed_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    model = tiny_model()
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, model, BYTES, step=1)
    before = path.read_bytes()

    def full_disk(obj, f, *a, **k):
        open(f, "wb").write(b"partial")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError):
        save_checkpoint(path, model, BYTES, step=2)
    assert path.read_bytes() == before and list(tmp_path.iterdir()) == [path]


# ---------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("kwargs,match", [
    (dict(window=0), "window must be in"),
    (dict(window=7), "window must be in"),
    (dict(prompt=torch.arange(30)), "leaves no room"),
    (dict(prompt=torch.arange(10), max_new_tokens=20), "max_new_tokens"),
    (dict(infill=torch.arange(10)), "MASK"),
    (dict(prompt=torch.tensor([1, 2]), infill=torch.tensor([259])), "not both"),
    (dict(prompt=torch.tensor([1, 999])), "token ids"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(prompt=torch.ones(3, 2, dtype=torch.long), batch_size=2), "rows"),
])
def test_generate_rejects_bad_input(kwargs, match):
    model = tiny_model()                     # staggered d=3, s=6: largest window 6
    with pytest.raises(ValueError, match=match):
        generate(model, **kwargs)


def test_max_window_per_policy():
    assert max_window(tiny_cfg(order="ar")) == 1
    assert max_window(tiny_cfg(order="uniform")) == 24
    assert max_window(tiny_cfg(order="block", set_size=4)) == 4
    assert max_window(tiny_cfg(order="staggered", set_size=4)) == 8
    assert max_window(tiny_cfg(order="staggered", set_size=4, max_set_size=4)) == math.ceil(4 * 23 / 20)


# ---------------------------------------------------------------------------- tokenizer shim
# id: token. Chosen so that each rule of BERT's pipeline changes the answer.
TINY_VOCAB = [
    "[PAD]",   # 0
    "[UNK]",   # 1
    "[CLS]",   # 2
    "[SEP]",   # 3
    "[MASK]",  # 4
    "the",     # 5
    "cafe",    # 6
    "un",      # 7
    "##aff",   # 8
    "##able",  # 9
    "##a",     # 10
    "##ff",    # 11
    ",",       # 12
    ".",       # 13
    "!",       # 14
    "'",       # 15
    "s",       # 16
    "hello",   # 17
    "world",   # 18
    "日",      # 19
    "本",      # 20
    "##s",     # 21
    "$",       # 22
    "5",       # 23
    "naive",   # 24
    "a",       # 25
    "##b",     # 26
    "##bb",    # 27
    "-",       # 28
    "resume",  # 29
    "play",    # 30
    "##ing",   # 31
    "##in",    # 32
    "##g",     # 33
    "x",       # 34
    "##y",     # 35
    "y",       # 36
    "[",       # 37
    "]",       # 38
    "σ",       # 39
    "##σ",     # 40
]


def write_vocab(tmp_path, lines, name="vocab.txt"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def tok(tmp_path):
    return Tokenizer.from_vocab(write_vocab(tmp_path, TINY_VOCAB))


# ---- bytes ---------------------------------------------------------------------------

def test_bytes_special_ids_and_size():
    t = Tokenizer.bytes()
    assert t.kind == "bytes" and t.vocab_size == 260
    assert (t.pad_id, t.bos_id, t.eos_id, t.mask_id) == (256, 257, 258, 259)
    specials = {t.pad_id, t.bos_id, t.eos_id, t.mask_id}
    assert len(specials) == 4 and all(i > 255 for i in specials)


@pytest.mark.parametrize("text", ["", "hello world", "café", "日本語", "emoji 😀👍🏽",
                                  "a\tb\nc\x00"])
def test_bytes_round_trip(text):
    t = Tokenizer.bytes()
    ids = t.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert t.decode(ids) == text
    assert t.byte_length(ids) == len(text.encode("utf-8"))


def test_bytes_encode_values():
    t = Tokenizer.bytes()
    assert t.encode("é") == [0xC3, 0xA9]
    assert t.encode("日") == [0xE6, 0x97, 0xA5]
    assert t.encode("😀") == [0xF0, 0x9F, 0x98, 0x80]


def test_bytes_decode_specials_and_bad_bytes():
    t = Tokenizer.bytes()
    ids = [t.bos_id, 104, 105, t.mask_id, t.eos_id, 33, t.pad_id, t.pad_id]
    assert t.decode(ids) == "hi\n!"
    assert t.byte_length(ids) == 4
    assert t.decode([0xC3]) == "\ufffd"          # a cut multi-byte character is replaced
    assert t.decode(t.encode("é") + [t.eos_id]) == "é\n"


def test_bytes_token_str():
    t = Tokenizer.bytes()
    assert t.token_str(65) == "A"
    assert t.token_str(10) == "<0x0A>"
    assert t.token_str(0xC3) == "<0xC3>"
    assert [t.token_str(i) for i in (t.pad_id, t.bos_id, t.eos_id, t.mask_id)] == [
        "[PAD]", "[BOS]", "[EOS]", "[MASK]"]


def test_ids_outside_vocab_are_refused():
    t = Tokenizer.bytes()
    for bad in (-1, 260):
        with pytest.raises(ValueError, match="outside"):
            t.decode([bad])
        with pytest.raises(ValueError, match="outside"):
            t.token_str(bad)


# ---- wordpiece: special ids ------------------------------------------------------------

def test_wordpiece_special_ids(tok):
    assert tok.kind == "wordpiece" and tok.vocab_size == len(TINY_VOCAB)
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.mask_id, tok.unk_id) == (0, 2, 3, 4, 1)
    assert "wordpiece" in repr(tok) and str(len(TINY_VOCAB)) in repr(tok)


# ---- wordpiece: encode ------------------------------------------------------------------

@pytest.mark.parametrize("text, ids", [
    # lower-casing and punctuation isolated as its own word
    ("Hello, World!", [17, 12, 18, 14]),
    ("the$5", [5, 22, 23]),              # $ is punctuation for BERT (ASCII non-alnum)
    ("the's", [5, 15, 16]),
    ("x-y", [34, 28, 36]),
    ("xy", [34, 35]),                    # same letters without the hyphen: x + ##y
    # accents stripped (NFD, then combining marks dropped)
    ("Café", [6]),
    ("cafe\u0301", [6]),                 # already decomposed
    ("NAÏVE", [24]),
    ("Résumé", [29]),
    # greedy longest-match-first with ## continuations
    ("unaffable", [7, 8, 9]),            # un + ##aff (not ##a + ##ff) + ##able
    ("playing", [30, 31]),               # ##ing beats ##in + ##g
    ("abbb", [25, 27, 26]),              # a + ##bb + ##b
    ("plays", [30, 21]),
    # unknown words: no piece matches somewhere -> the whole word is one [UNK]
    ("zebra", [1]),
    ("playx", [1]),                      # "play" matches, "##x" does not
    ("the zebra", [5, 1]),
    # words longer than 100 characters are [UNK]; exactly 100 is still split
    ("a" + "b" * 99, [25] + [27] * 49 + [26]),
    ("a" + "b" * 100, [1]),
    # CJK ideographs are one word each ("##本" is not in the vocab)
    ("日本", [19, 20]),
    ("the日本the", [5, 19, 20, 5]),
    # control and format characters are deleted, not turned into spaces
    ("hel\x00lo", [17]),
    ("he\x07llo", [17]),
    ("x\u200by", [34, 35]),              # zero-width space (Cf)
    ("x\ufeffy", [34, 35]),              # byte-order mark (Cf)
    ("x\x85y", [34, 35]),                # NEL is a control character for BERT
    ("x\ufffdy", [34, 35]),              # replacement character
    # every kind of whitespace separates words
    ("hello\tworld\nthe\r\nx\u00a0y\u3000the\u2003the  ", [17, 18, 5, 34, 36, 5, 5]),
    ("   ", []),
    ("", []),
    # lower-casing is per character: a final capital sigma becomes σ, not ς
    ("ΣΣ", [39, 40]),
    # special-token strings in the raw text map to their ids; matching is case-sensitive
    ("[CLS] [SEP] [MASK] [PAD] [UNK]", [2, 3, 4, 0, 1]),
    ("x[SEP]y", [34, 3, 36]),
    ("[MASK].", [4, 13]),
    ("[cls]", [37, 1, 38]),              # lower case: plain text "[", "cls" (unknown), "]"
    ("[[SEP]]", [37, 3, 38]),
])
def test_wordpiece_encode(tok, text, ids):
    assert tok.encode(text) == ids
    assert tok.encode(text) == ids       # second call is served by the word memo


def test_wordpiece_encode_rejects_non_text(tok):
    with pytest.raises(TypeError):
        tok.encode(b"hello")


# ---- wordpiece: decode ------------------------------------------------------------------

def test_wordpiece_decode(tok):
    assert tok.decode([17, 12, 18, 14]) == "hello , world !"
    assert tok.decode([7, 8, 9]) == "unaffable"
    # BOS, MASK and PAD vanish; EOS is a line break with no spaces around it
    assert tok.decode([2, 30, 31, 3, 5, 4, 0, 0]) == "playing\nthe"
    assert tok.decode([2, 17, 3, 18, 3]) == "hello\nworld\n"
    assert tok.decode([5, 1]) == "the [UNK]"
    assert tok.decode([]) == ""
    assert tok.byte_length([2, 17, 3, 18, 3]) == len("hello\nworld\n")
    assert tok.byte_length([19, 20]) == len("日 本".encode("utf-8"))


def test_wordpiece_token_str(tok):
    assert tok.token_str(8) == "##aff"
    assert tok.token_str(tok.mask_id) == "[MASK]"
    with pytest.raises(ValueError, match="outside"):
        tok.token_str(len(TINY_VOCAB))


# ---- spec round trip ------------------------------------------------------------------------

def test_spec_round_trip_bytes():
    t = Tokenizer.bytes()
    spec = json.loads(json.dumps(t.spec()))
    t2 = Tokenizer.from_spec(spec)
    assert t2.kind == "bytes" and t2.spec() == t.spec()
    assert t2.encode("日本") == t.encode("日本")


def test_spec_round_trip_wordpiece_without_file(tmp_path):
    path = write_vocab(tmp_path, TINY_VOCAB)
    t = Tokenizer.from_vocab(path)
    spec = json.loads(json.dumps(t.spec()))
    path.unlink()                        # the spec alone must be enough
    t2 = Tokenizer.from_spec(spec)
    assert t2.spec() == t.spec()
    assert (t2.vocab_size, t2.pad_id, t2.bos_id, t2.eos_id, t2.mask_id) == (
        t.vocab_size, t.pad_id, t.bos_id, t.eos_id, t.mask_id)
    text = "Hello, unaffable [MASK] 日本!"
    assert t2.encode(text) == t.encode(text) == [17, 12, 7, 8, 9, 4, 19, 20, 14]


@pytest.mark.parametrize("spec", [
    None, "bytes", {}, {"kind": "sentencepiece"}, {"kind": "wordpiece"},
    {"kind": "wordpiece", "vocab": "not a list"},
    {"kind": "wordpiece", "vocab": ["[PAD]", "[UNK]", "the"]},
])
def test_from_spec_rejects_bad_specs(spec):
    with pytest.raises(ValueError):
        Tokenizer.from_spec(spec)


# ---- from_vocab validation ------------------------------------------------------------------

def test_from_vocab_missing_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist.*vocab.txt"):
        Tokenizer.from_vocab(tmp_path / "nope.txt")


def test_from_vocab_directory(tmp_path):
    with pytest.raises(ValueError, match="is not a file"):
        Tokenizer.from_vocab(tmp_path)


def test_from_vocab_empty_file(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        Tokenizer.from_vocab(path)


def test_from_vocab_not_utf8(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_bytes("\n".join(TINY_VOCAB).encode("utf-8") + b"\n\xff\xfeoops\n")
    with pytest.raises(ValueError, match="not UTF-8"):
        Tokenizer.from_vocab(path)


@pytest.mark.parametrize("missing", ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
def test_from_vocab_missing_special(tmp_path, missing):
    path = write_vocab(tmp_path, [t for t in TINY_VOCAB if t != missing])
    pattern = r"lacks the special token\(s\) " + re.escape(missing)
    with pytest.raises(ValueError, match=pattern):
        Tokenizer.from_vocab(path)


def test_from_vocab_duplicate(tmp_path):
    path = write_vocab(tmp_path, TINY_VOCAB + ["the"])
    with pytest.raises(ValueError, match=r"'the' twice \(lines 6 and 42\)"):
        Tokenizer.from_vocab(path)


def test_from_vocab_blank_line(tmp_path):
    path = write_vocab(tmp_path, TINY_VOCAB[:5] + [""] + TINY_VOCAB[5:])
    with pytest.raises(ValueError, match="blank token on line 6"):
        Tokenizer.from_vocab(path)


def test_from_vocab_crlf_and_no_final_newline(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_bytes("\r\n".join(TINY_VOCAB).encode("utf-8"))
    t = Tokenizer.from_vocab(path)
    assert t.vocab_size == len(TINY_VOCAB) and t.encode("Hello!") == [17, 14]


# ----------------------------------------------------------------------------------------
# train_small.py: data preparation, training, resume and bad input
#
# Tiny models on tiny corpora written into tmp_path; every run is CPU float32, no
# downloads. The 2-process DDP test takes ~15 s.

REPO = Path(train_small.__file__).resolve().parent
TINY_MODEL = ["--n-layer", "1", "--n-head", "2", "--d-model", "32", "--seq-len", "32",
              "--batch-size", "8", "--lr", "3e-3", "--warmup-steps", "5", "--eval-rows", "8",
              "--dtype", "float32", "--workers", "1", "--log-every", "5", "--val-fraction", "0.1"]


def write_corpus(path: Path, lines: int = 600, seed: int = 0) -> Path:
    """Short sentences over a small vocabulary: a tiny model learns them in a few steps."""
    rng = random.Random(seed)
    words = "the cat sat on a mat and a dog ran to the big red house under blue sky".split()
    text = "".join(" ".join(rng.choice(words) for _ in range(rng.randint(4, 10))).capitalize()
                   + ".\n" for _ in range(lines))
    path.write_text(text)
    return path


def run_script(*args, cwd=REPO, timeout=300, module=None):
    """Run train_small.py (or `python -m module ...`) as a user would."""
    cmd = [sys.executable] + (["-m", module] if module else []) + [*args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def train_args(tmp_path: Path, out: str = "run", *extra) -> list:
    return ["--data", str(tmp_path / "corpus.txt"), "--cache-dir", str(tmp_path / "cache"),
            "--out", str(tmp_path / out), *TINY_MODEL, *extra]


def metrics(out: Path, kind: str) -> list:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == kind]


def assert_one_line_error(capsys_or_result, needle: str, after_progress: bool = False):
    """Exactly one stderr line, 'error: ...', no traceback. `after_progress`: errors raised
    mid-training may follow the progress bar's own lines; the error is still one line."""
    err = capsys_or_result.stderr if hasattr(capsys_or_result, "stderr") else capsys_or_result
    lines = [l for l in err.replace("\r", "\n").splitlines() if l.strip()]
    assert "Traceback" not in err, err
    if after_progress:
        lines = [l for l in lines if "error" in l]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and needle in lines[0], lines[0]


def test_wrapped_rows_match_hand_built(tmp_path):
    """SPEC §6: EOS after each sentence, chunks of L-2, [BOS] + chunk + [EOS], tail dropped."""
    f = tmp_path / "t.txt"
    f.write_bytes(b"ab\n\ncde\r\n  f  \nghij\n")       # blank lines and \r\n are not sentences
    tok = Tokenizer.bytes()
    rows, meta = train_small.prepare_rows([(f, "train")], tok, 6, tmp_path / "cache", verbose=False)
    B, E = tok.bos_id, tok.eos_id
    a, b, c, d, e, f_, g, h, i = (ord(ch) for ch in "abcdefghi")
    # stream: a b E c d e E f E g h i j E -> [a b E c] [d e E f] [E g h i] + tail [j E]
    expected = np.array([[B, a, b, E, c, E], [B, d, e, E, f_, E], [B, E, g, h, i, E]], np.uint16)
    assert rows["train"].dtype == np.uint16
    np.testing.assert_array_equal(rows["train"], expected)
    split = meta["splits"]["train"]
    assert (split["rows"], split["lines"], split["tokens"], split["dropped_tail_tokens"]) == (3, 4, 14, 2)
    assert meta["seq_len"] == 6 and meta["tokenizer"]["kind"] == "bytes" and meta["bad_lines"] == 0


def test_wrapped_rows_every_row_bos_eos(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.txt")
    tok = Tokenizer.bytes()
    rows, meta = train_small.prepare_rows([(corpus, "hash")], tok, 32, tmp_path / "cache",
                                          val_fraction=0.1, verbose=False)
    for side in ("train", "val"):
        r = np.asarray(rows[side])
        assert r.shape[1] == 32 and len(r) == meta["splits"][side]["rows"] > 0
        assert (r[:, 0] == tok.bos_id).all() and (r[:, -1] == tok.eos_id).all()
        # one EOS per sentence inside the rows: the stream is the sentences, EOS-separated
        body = r[:, 1:-1].ravel()
        text = bytes(np.where(body == tok.eos_id, ord("\n"), body).astype(np.uint8)).decode()
        assert all(s.endswith(".") for s in text.split("\n")[:-1])
    # the held-out slice is chosen per line content: no sentence is on both sides
    lines = corpus.read_bytes().splitlines()
    val = {l for l in lines if train_small.held_out(l, 0.1)}
    assert meta["splits"]["val"]["lines"] == sum(l in val for l in lines)
    assert 0 < len(val) < len(set(lines))


def test_row_cache_reused_and_rebuilt(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus.txt")
    tok, cache = Tokenizer.bytes(), tmp_path / "cache"
    rows1, meta1 = train_small.prepare_rows([(corpus, "train")], tok, 32, cache)
    folder = Path(rows1["train"].filename).parent
    stamp = (folder / "train.bin").stat().st_mtime_ns
    capsys.readouterr()
    rows2, meta2 = train_small.prepare_rows([(corpus, "train")], tok, 32, cache)
    assert "reusing" in capsys.readouterr().out
    assert (folder / "train.bin").stat().st_mtime_ns == stamp and meta2 == meta1
    np.testing.assert_array_equal(rows1["train"], rows2["train"])
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["sources"][0]["size"] == corpus.stat().st_size and "mtime_ns" in meta["sources"][0]
    # a changed file rebuilds the same cache entry; a different L is another entry
    with open(corpus, "a") as f:
        f.write("A brand new sentence that was not there before.\n" * 20)
    rows3, meta3 = train_small.prepare_rows([(corpus, "train")], tok, 32, cache)
    assert "reusing" not in capsys.readouterr().out
    assert meta3["splits"]["train"]["lines"] == meta1["splits"]["train"]["lines"] + 20
    assert Path(rows3["train"].filename).parent == folder
    rows4, _ = train_small.prepare_rows([(corpus, "train")], tok, 16, cache, verbose=False)
    assert Path(rows4["train"].filename).parent != folder and rows4["train"].shape[1] == 16
    assert not list(cache.rglob("*.tmp-*"))


def test_row_cache_parallel_equals_serial(tmp_path, monkeypatch):
    """Worker processes give exactly the rows of the in-process path, in file order."""
    corpus = write_corpus(tmp_path / "corpus.txt", lines=3000)
    tok = Tokenizer.bytes()
    serial, _ = train_small.prepare_rows([(corpus, "hash")], tok, 32, tmp_path / "a",
                                         val_fraction=0.1, workers=1, verbose=False)
    monkeypatch.setattr(train_small, "CHUNK_BYTES", 4096)  # many byte ranges, 2 workers
    parallel, _ = train_small.prepare_rows([(corpus, "hash")], tok, 32, tmp_path / "b",
                                           val_fraction=0.1, workers=2, verbose=False)
    for side in ("train", "val"):
        np.testing.assert_array_equal(serial[side], parallel[side])


def test_wordpiece_rows_and_bad_utf8_lines_are_counted(tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat",
                                "sat", ".", "dog"]) + "\n")
    tok = train_small.load_tokenizer(str(vocab))
    f = tmp_path / "t.txt"
    f.write_bytes(b"The cat sat.\n\xff\xfe broken\nthe dog sat.\n" * 4)
    rows, meta = train_small.prepare_rows([(f, "train")], tok, 8, tmp_path / "cache", verbose=False)
    assert meta["bad_lines"] == 4 and meta["splits"]["train"]["lines"] == 8
    assert meta["tokenizer"]["kind"] == "wordpiece"
    ids = [5, 6, 7, 8, tok.eos_id, 5, 9, 7, 8, tok.eos_id] * 4
    expected = [[tok.bos_id, *ids[k:k + 6], tok.eos_id] for k in range(0, 36, 6)]
    np.testing.assert_array_equal(rows["train"], np.array(expected, np.uint16))


def test_builtin_corpus_is_deterministic_prose(tmp_path):
    """A few real source files (the full corpus takes ~20 s): same bytes twice, prose only."""
    roots = dict(train_small.builtin_corpus_sources())
    files = [roots["python"] / "json" / "__init__.py", roots["python"] / "textwrap.py",
             roots["numpy"] / "lib" / "_function_base_impl.py", roots["torch"] / "_torch_docs.py"]
    a = train_small.builtin_corpus(tmp_path, workers=1, files=files, out=tmp_path / "a.txt")
    b = train_small.builtin_corpus(tmp_path, workers=1, files=files, out=tmp_path / "b.txt")
    assert a.read_bytes() == b.read_bytes()
    lines = a.read_text().splitlines()
    assert len(lines) > 300 and len(set(lines)) == len(lines)
    for line in lines:
        assert train_small.is_prose(line), line
        assert not any(bad in line for bad in (">>>", "://", "``", ":func:", "Parameters"))
    name = train_small.builtin_corpus_path(tmp_path).name
    assert np.__version__ in name and torch.__version__ in name


def test_builtin_corpus_cleaning_rules(tmp_path):
    src = tmp_path / "m.py"
    src.write_text('''
def f(x):
    """Compute the thing from :func:`numpy.sum` and ``x`` values.

    This sentence is kept because it is plain prose. See https://example.com for more.

    Parameters
    ----------
    x : array_like
        The input array that is described here.

    Examples
    --------
    >>> f(1)
    2

    .. note::
        A directive body is dropped entirely.

    Notes
    -----
    The notes section is prose and stays in the corpus.
    """
''')
    assert train_small.corpus_sentences(src) == [
        "Compute the thing from numpy.sum and x values.",
        "This sentence is kept because it is plain prose.",
        "The notes section is prose and stays in the corpus."]


# -- training, end to end -----------------------------------------------------------------

def test_train_end_to_end_resume_is_exact(tmp_path):
    write_corpus(tmp_path / "corpus.txt")
    r = run_script("train_small.py", *train_args(tmp_path, "run", "--max-steps", "30",
                                                 "--eval-every", "15"))
    assert r.returncode == 0, r.stderr
    out = tmp_path / "run"
    assert (out / "ckpt.pt").is_file() and (out / "best.pt").is_file()
    train = metrics(out, "train")
    assert train[-1]["loss"] < train[0]["loss"] - 1.0          # it learns
    val = metrics(out, "val")
    assert [v["step"] for v in val] == [15, 30]
    for v in val:  # SPEC §4 report: bound, bits per byte, orders, tokens, standard error
        assert v["num_orders"] == 1 and v["tokens_scored"] == v["rows"] * 31 and v["se"] > 0
        assert v["bytes"] == v["rows"] * 30                    # L-2 bytes of text per row (bytes tok.)
        nats = v["nll_per_token"] * v["tokens_scored"]
        assert v["bits_per_byte"] == pytest.approx(nats / np.log(2) / v["bytes"])
    assert "sample (" in r.stdout and "best validation" in r.stdout
    model, tok, ckpt = load_checkpoint(out / "ckpt.pt")
    assert ckpt["state"]["step"] == 30 and ckpt["state"]["tokens"] == 30 * 8 * 32
    assert "optimizer" in ckpt and "train_model" in ckpt and ckpt["args"]["n_layer"] == 1

    # --resume continues the step count, and equals one uninterrupted 45-step run
    r = run_script("train_small.py", "--resume", "--out", str(out), "--max-steps", "45",
                   "--cache-dir", str(tmp_path / "cache"), "--workers", "1", "--log-every", "5")
    assert r.returncode == 0, r.stderr
    assert "resuming" in r.stdout
    assert [m["step"] for m in metrics(out, "train")] == list(range(5, 50, 5))
    r = run_script("train_small.py", *train_args(tmp_path, "straight", "--max-steps", "45",
                                                 "--eval-every", "15"))
    assert r.returncode == 0, r.stderr
    resumed = load_checkpoint(out / "ckpt.pt")[2]
    straight = load_checkpoint(tmp_path / "straight" / "ckpt.pt")[2]
    assert resumed["state"]["step"] == straight["state"]["step"] == 45
    assert resumed["state"]["data"] == straight["state"]["data"]
    for k, v in straight["train_model"].items():
        assert torch.equal(v, resumed["train_model"][k]), k
    for k, v in straight["model"].items():                      # EMA weights too
        assert torch.equal(v, resumed["model"][k]), k


def test_ctrl_c_saves_and_resume_continues(tmp_path, monkeypatch, capsys):
    write_corpus(tmp_path / "corpus.txt")
    real = train_small.learning_rate

    def interrupt_at_step_7(args, step):
        if step == 7:
            raise KeyboardInterrupt
        return real(args, step)

    monkeypatch.setattr(train_small, "learning_rate", interrupt_at_step_7)
    assert train_small.main(train_args(tmp_path, "run", "--max-steps", "20", "--eval-every", "50")) == 130
    assert "interrupted at step 7" in capsys.readouterr().err
    assert load_checkpoint(tmp_path / "run" / "ckpt.pt")[2]["state"]["step"] == 7
    monkeypatch.setattr(train_small, "learning_rate", real)
    assert train_small.main(["--resume", "--out", str(tmp_path / "run"), "--max-steps", "10",
                             "--cache-dir", str(tmp_path / "cache"), "--workers", "1"]) == 0
    assert load_checkpoint(tmp_path / "run" / "ckpt.pt")[2]["state"]["step"] == 10


def test_train_failed_save_keeps_previous_checkpoint(tmp_path, monkeypatch, capsys):
    write_corpus(tmp_path / "corpus.txt")
    args = train_args(tmp_path, "run", "--max-steps", "5", "--eval-every", "5")
    assert train_small.main(args) == 0
    ckpt = tmp_path / "run" / "ckpt.pt"
    before = ckpt.read_bytes()
    capsys.readouterr()

    def disk_full(obj, f, *a, **k):                   # what torch.save raises on a full disk
        open(f, "wb").write(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc] . PytorchStreamWriter failed "
                           "writing file data/0: file write failed (No space left on device)")

    monkeypatch.setattr(torch, "save", disk_full)
    code = train_small.main(["--resume", "--out", str(tmp_path / "run"), "--max-steps", "10",
                             "--cache-dir", str(tmp_path / "cache"), "--workers", "1"])
    assert code == 2
    assert_one_line_error(capsys.readouterr().err, "No space left on device", after_progress=True)
    assert ckpt.read_bytes() == before
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["best.pt", "ckpt.pt", "metrics.jsonl"]


# -- bad input: one line on stderr, exit code 2, nothing overwritten ----------------------

@pytest.mark.parametrize("case", ["missing", "glob", "empty", "binary", "too_small",
                                  "bad_vocab", "missing_vocab", "resume_nothing", "bad_set_size"])
def test_bad_input_one_line_exit_2(tmp_path, capsys, case):
    cache, out = tmp_path / "cache", tmp_path / "run"
    out.mkdir()
    (out / "ckpt.pt").write_bytes(b"an older run")          # --force: still nothing overwritten
    (out / "metrics.jsonl").write_text("{}\n")
    data = tmp_path / "corpus.txt"
    write_corpus(data)
    flags = ["--data", str(data)]
    needle = {"missing": "no such file", "glob": "matches no file", "empty": "is empty",
              "binary": "does not look like text", "too_small": "needs 30",
              "bad_vocab": "lacks the special token", "missing_vocab": "no such file",
              "resume_nothing": "no checkpoint", "bad_set_size": "set_size"}[case]
    if case == "missing":
        flags = ["--data", str(tmp_path / "nope.txt")]
    elif case == "glob":
        flags = ["--data", str(tmp_path / "nope-*.txt")]
    elif case == "empty":
        (tmp_path / "empty.txt").write_text("\n  \n")
        flags += [str(tmp_path / "empty.txt")]
    elif case == "binary":
        (tmp_path / "blob.bin").write_bytes(bytes(random.Random(0).randrange(128, 256) for _ in range(5000)))
        flags = ["--data", str(tmp_path / "blob.bin")]
    elif case == "too_small":
        (tmp_path / "small.txt").write_text("Only a few words.\n")
        flags = ["--data", str(tmp_path / "small.txt")]
    elif case == "bad_vocab":
        (tmp_path / "vocab.txt").write_text("hello\nworld\n")
        flags += ["--tokenizer", str(tmp_path / "vocab.txt")]
    elif case == "missing_vocab":
        flags += ["--tokenizer", str(tmp_path / "no-vocab.txt")]
    elif case == "resume_nothing":
        flags += ["--resume", "--out", str(tmp_path / "elsewhere")]
    elif case == "bad_set_size":
        flags += ["--set-size", "100"]
    argv = ["--cache-dir", str(cache), "--out", str(out), *TINY_MODEL, "--max-steps", "2",
            "--force", *flags]
    assert train_small.main(argv) == 2
    assert_one_line_error(capsys.readouterr().err, needle)
    assert (out / "ckpt.pt").read_bytes() == b"an older run"
    assert (out / "metrics.jsonl").read_text() == "{}\n"
    assert not list(cache.rglob("*.bin")) or case in ("bad_set_size", "resume_nothing")


def test_out_dir_holding_another_run_is_refused(tmp_path):
    """Through the real command line: exit 2, one line, no traceback, the run untouched."""
    write_corpus(tmp_path / "corpus.txt")
    out = tmp_path / "run"
    out.mkdir()
    (out / "ckpt.pt").write_bytes(b"somebody's run")
    r = run_script("train_small.py", *train_args(tmp_path, "run", "--max-steps", "2"))
    assert r.returncode == 2
    assert_one_line_error(r, "already holds a run")
    assert "--resume" in r.stderr and "--force" in r.stderr
    assert (out / "ckpt.pt").read_bytes() == b"somebody's run"
    r = run_script("train_small.py", "--data", str(tmp_path / "missing.txt"), "--out", str(out))
    assert r.returncode == 2
    assert_one_line_error(r, "")


def test_resume_refuses_changed_settings(tmp_path, capsys):
    write_corpus(tmp_path / "corpus.txt")
    assert train_small.main(train_args(tmp_path, "run", "--max-steps", "3", "--eval-every", "3")) == 0
    capsys.readouterr()
    code = train_small.main(["--resume", "--out", str(tmp_path / "run"), "--n-layer", "2",
                             "--cache-dir", str(tmp_path / "cache")])
    assert code == 2
    assert_one_line_error(capsys.readouterr().err, "--n-layer 2 differs")


def test_ddp_two_processes_match_one_process(tmp_path):
    """torchrun with 2 gloo CPU processes: each takes half of every global batch, and the
    loss trajectory equals the 1-process run with the same global batch."""
    write_corpus(tmp_path / "corpus.txt")
    common = ["--global-batch", "8", "--max-steps", "10", "--eval-every", "10", "--log-every", "1"]
    one = run_script("train_small.py", *train_args(tmp_path, "one", *common))
    assert one.returncode == 0, one.stderr
    two = run_script("--standalone", "--nproc_per_node", "2", "train_small.py",
                     *train_args(tmp_path, "two", *common), module="torch.distributed.run")
    assert two.returncode == 0, two.stderr
    assert "4 per forward x 1 accumulation x 2 processes" in two.stdout
    assert two.stdout.count("best validation") == 1          # only rank 0 prints
    l1 = [m["loss"] for m in metrics(tmp_path / "one", "train")]
    l2 = [m["loss"] for m in metrics(tmp_path / "two", "train")]
    assert len(l1) == len(l2) == 10
    np.testing.assert_allclose(l2, l1, rtol=1e-4)
    assert l2[-1] < l2[0]


# ----------------------------------------------------------------------------------------
# sample.py: every mode on a tiny checkpoint, run as a user would (a subprocess), and the
# bad inputs (one line on stderr, exit code 2, no traceback). CPU, float32, no downloads.
#
# The checkpoint is built here with setdiff.save_checkpoint, not by train_small.py. Its
# random model is rigged to write only lowercase letters (a large logit offset on the
# letter ids), so known text and generated text can be told apart exactly.

SAMPLE_REPO = Path(setdiff.__file__).resolve().parent
SAMPLE_L = 24                               # context of the tiny checkpoint
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def letters_model(seed: int = 0) -> SetDiffusionLM:
    """Tiny random staggered model (d=3, s=6) whose predictions are lowercase letters only.

    Weights get a fan-in scaled random init (x3) so that predictions depend on the context
    and differ between positions (the default init gives one letter everywhere and
    saturated, tied confidences). ln_f's bias puts +10 on hidden unit 0, which the head
    maps to +3 for letters and -3 for every other id: a logit gap of ~60."""
    tok = Tokenizer.bytes()
    cfg = Config(vocab_size=tok.vocab_size, seq_len=SAMPLE_L, n_layer=2, n_head=2, d_model=32,
                 dropout=0.0, order="staggered", set_size=3, pad_id=tok.pad_id, bos_id=tok.bos_id,
                 eos_id=tok.eos_id, mask_id=tok.mask_id)
    torch.manual_seed(seed)
    model = SetDiffusionLM(cfg)
    letters = torch.tensor([ord(c) for c in LETTERS])
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                torch.nn.init.normal_(m.weight, std=3.0 / m.in_features ** 0.5)
            elif isinstance(m, torch.nn.Embedding):
                torch.nn.init.normal_(m.weight, std=1.0)
        torch.nn.init.normal_(model.head.weight, std=0.5)
        model.ln_f.bias[0] = 10.0
        model.head.weight[:, 0] = -3.0
        model.head.weight[letters, 0] = 3.0
    return model.eval()


@pytest.fixture(scope="module")
def sample_ckpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sample") / "tiny.pt"
    save_checkpoint(path, letters_model(), Tokenizer.bytes())
    return path


def run_sample(*args, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("NO_COLOR", None)
    return subprocess.run([sys.executable, "sample.py", *map(str, args)], cwd=SAMPLE_REPO,
                          capture_output=True, text=True, timeout=timeout, env=env)


def samples_of(stdout: str) -> list:
    """[(header, text)] for every '--- sample i/n: ...' block of sample.py's output."""
    lines = stdout.splitlines()
    return [(line, lines[i + 1]) for i, line in enumerate(lines) if line.startswith("--- sample ")]


def sample_ok(result) -> str:
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    return result.stdout


def test_sample_unconditional_batches_and_speed_lines(sample_ckpt):
    out = sample_ok(run_sample("--ckpt", sample_ckpt, "--num-samples", 3, "--batch-size", 2))
    found = samples_of(out)
    assert [h.split(":")[0] for h, _ in found] == [f"--- sample {i}/3" for i in (1, 2, 3)]
    for header, text in found:
        assert re.search(r"\d+ network calls, [\d.]+ tokens/call, [\d,]+ tokens/s", header)
        assert re.fullmatch(f"[a-z]{{{SAMPLE_L - 1}}}", text)       # the whole context filled
    assert "=== batch of 2:" in out
    assert len({t for _, t in found}) == 3                          # sampled rows differ
    again = samples_of(sample_ok(run_sample("--ckpt", sample_ckpt, "--num-samples", 3, "--batch-size", 2)))
    assert [t for _, t in again] == [t for _, t in found]          # --seed fixes the samples


def test_sample_prompt_is_kept_and_continued(sample_ckpt):
    out = sample_ok(run_sample("--ckpt", sample_ckpt, "--prompt", "Hi, you", "--max-new-tokens", 9))
    (header, text), = samples_of(out)
    assert re.fullmatch(r"Hi, you[a-z]{9}", text)
    assert header.split(": ")[1].startswith("9 network calls")    # tau > 1: one token per call


@pytest.mark.parametrize("template,pattern", [
    ("A [MASK]. B [MASK][MASK]!", r"A [a-z]\. B [a-z]{2}!"),          # [MASK] = one position (a MASK id)
    ("X ___ Y", r"X [a-z]{3} Y"),                                       # bare span: --span-len
    ("___5 Z ___2", r"[a-z]{5} Z [a-z]{2}"),                            # ___N: N positions
])
def test_sample_infill_fills_only_the_holes(sample_ckpt, template, pattern):
    out = sample_ok(run_sample("--ckpt", sample_ckpt, "--infill", template, "--span-len", 3,
                               "--threshold", 0.5, "--num-samples", 2))      # default window: s
    texts = [t for _, t in samples_of(out)]
    assert len(texts) == 2 and all(re.fullmatch(pattern, t) for t in texts), texts


def test_sample_show_order_marks_every_set(sample_ckpt):
    out = sample_ok(run_sample("--ckpt", sample_ckpt, "--prompt", "Go", "--threshold", 0.3,
                               "--temperature", 0, "--window", 6, "--show-order"))
    lines = out.splitlines()
    (header, text), = samples_of(out)
    calls = int(re.search(r"(\d+) network calls", header).group(1))
    picture = lines[lines.index("--- decode order:") + 1]
    runs = re.findall(r"\[([a-z]+)\](\d+)", picture)
    assert picture.startswith("Go[") and "".join(f"[{t}]{s}" for t, s in runs) == picture[2:]
    assert "Go" + "".join(t for t, _ in runs) == text                  # the picture is the text
    sizes = {}
    for t, s in runs:
        sizes[int(s)] = sizes.get(int(s), 0) + len(t)
    assert sorted(sizes) == list(range(calls)) and calls < SAMPLE_L - 3   # some calls revealed sets
    assert any(n > 1 for n in sizes.values())
    assert lines[lines.index("--- decode order:") + 2].startswith("--- network calls revealed:")


def test_sample_stop_at_eos(tmp_path):
    """A model that puts EOS first everywhere: with --stop-at-eos the sample ends at the
    first generated EOS, one call after the prompt; without it the context is filled."""
    model = letters_model()
    with torch.no_grad():
        model.head.weight[model.cfg.eos_id, 0] = 5.0                   # EOS beats every letter
    save_checkpoint(tmp_path / "eos.pt", model, Tokenizer.bytes())
    common = ("--ckpt", tmp_path / "eos.pt", "--prompt", "Hi", "--temperature", 0)
    (header, text), = samples_of(sample_ok(run_sample(*common, "--stop-at-eos")))
    assert text == "Hi" and ": 1 network calls" in header
    (header, _), = samples_of(sample_ok(run_sample(*common)))
    assert f": {SAMPLE_L - 3} network calls" in header


def test_order_picture_plain_and_colour():
    sys.path.insert(0, str(SAMPLE_REPO))
    import sample
    tok = Tokenizer.bytes()
    ids = [tok.bos_id] + list(b"ab") + list(b"cde") + [tok.eos_id, tok.pad_id]
    steps = [-1, -1, -1, 1, 1, 0, 2, -2]
    assert sample.order_picture(tok, ids, steps, colour=False) == "ab[cd]1[e]0[\\n]2"   # EOS shown
    coloured = sample.order_picture(tok, ids, steps, colour=True)
    assert re.sub(r"\033\[[\d;]*m", "", coloured) == "abcd1e0\\n2" and "\033[" in coloured
    assert sample.set_summary([-1, 0, 1, 0, 2]) == \
        "network calls revealed: 2 x 1 token, 1 x 2 tokens; 1 set(s) not contiguous"


def test_sample_no_cache_gives_the_same_output(sample_ckpt):
    common = ("--ckpt", sample_ckpt, "--temperature", 0, "--threshold", 0.4, "--window", 6,
              "--num-samples", 2, "--prompt", "Q")
    cached = samples_of(sample_ok(run_sample(*common)))
    free = samples_of(sample_ok(run_sample(*common, "--no-cache")))
    assert [t for _, t in cached] == [t for _, t in free]
    calls = [re.search(r"(\d+) network calls", h).group(1) for h, _ in cached + free]
    assert calls[:2] == calls[2:]


def test_sample_eval_matches_the_bound_on_wrapped_rows(sample_ckpt, tmp_path):
    lines = [f"the {w} sat on a mat." for w in ("cat", "dog", "fox", "owl", "hen", "ram")] * 3
    (tmp_path / "val.txt").write_text("\n".join(lines) + "\n")
    out = sample_ok(run_sample("--ckpt", sample_ckpt, "--eval", tmp_path / "val.txt", "--num-orders", 2,
                        "--cache-dir", tmp_path / "cache"))
    # independent computation: SPEC §6 wrapped rows, then setdiff.elbo with seed 0
    tok = Tokenizer.bytes()
    stream = [i for line in lines for i in tok.encode(line) + [tok.eos_id]]
    body = SAMPLE_L - 2
    rows = torch.tensor([[tok.bos_id] + stream[k:k + body] + [tok.eos_id]
                         for k in range(0, len(stream) - body + 1, body)])
    res = elbo(letters_model(), rows, num_orders=2, generator=torch.Generator().manual_seed(0))
    num_bytes = len(rows) * body                  # source bytes the rows cover: L-2 per row (bytes tok.)
    assert f"perplexity bound   {res.ppl:.4f}" in out
    assert f"bits per byte      {res.bits_per_byte(num_bytes):.4f}" in out
    assert f"tokens scored      {res.tokens:,}" in out and f"+- {res.se:.4f}" in out
    assert "orders per row     2" in out


def test_sample_bench_tiny(sample_ckpt):
    for extra in ((), ("--ckpt", sample_ckpt)):
        out = sample_ok(run_sample("--bench", "--bench-tiny", *extra))
        for title in ("## Cached vs cache-free", "## Threshold sweep", "## Batch scaling"):
            assert title in out
        assert "machine:" in out and "python sample.py --bench --bench-tiny" in out
        cache_rows = re.findall(r"^\| [12] \| \d+ \| [\d,]+ \| [\d,]+ \| [\d.]+x \| (\w+) \|$", out, re.M)
        assert cache_rows == ["yes", "yes"]
        assert len(re.findall(r"^\| [12] \| [ds] = \d+ \| [\d.]+ \|", out, re.M)) == 16


@pytest.mark.parametrize("case,message", [
    ("missing checkpoint", "not found"),
    ("truncated checkpoint", "truncated or corrupt"),
    ("prompt longer than the context", "leaves no room"),
    ("window above the largest", "window must be in"),
    ("infill without a hole", "nothing to fill"),
    ("missing text file", "no such file"),
    ("empty text file", "is empty"),
    ("binary text file", "not UTF-8"),
    ("no checkpoint", "--ckpt"),
    ("prompt and infill", "not allowed with"),
])
def test_sample_bad_input(sample_ckpt, tmp_path, case, message):
    cut = tmp_path / "cut.pt"
    cut.write_bytes(sample_ckpt.read_bytes()[:2000])
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00\x81 abc\n\x80\x80\xc3\n")
    ckpt, cache = ("--ckpt", sample_ckpt), ("--cache-dir", tmp_path / "cache")
    args = {
        "missing checkpoint": ("--ckpt", tmp_path / "missing.pt"),
        "truncated checkpoint": ("--ckpt", cut),
        "prompt longer than the context": (*ckpt, "--prompt", "x" * SAMPLE_L),
        "window above the largest": (*ckpt, "--window", 7),          # d=3, s=6: largest window 6
        "infill without a hole": (*ckpt, "--infill", "no holes here"),
        "missing text file": (*ckpt, "--eval", tmp_path / "missing.txt", *cache),
        "empty text file": (*ckpt, "--eval", tmp_path / "empty.txt", *cache),
        "binary text file": (*ckpt, "--eval", tmp_path / "binary.txt", *cache),
        "no checkpoint": ("--prompt", "hello"),
        "prompt and infill": (*ckpt, "--prompt", "a", "--infill", "[MASK]"),
    }[case]
    r = run_sample(*args)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert message in r.stderr, r.stderr


# ----------------------------------------------------------------------------------------
# Benchmarks and the comparison table: CI-sized smoke runs (the numbers are not asserted,
# only that the tables come out with their columns and sane ratios)

def test_train_bench_tiny_prints_the_table():
    r = run_script("train_small.py", "--bench", "--n-layer", "1", "--n-head", "2", "--d-model", "32",
                   "--seq-len", "32", "--batch-size", "4", "--bench-steps", "1", "--bench-repeats", "1")
    assert r.returncode == 0, r.stderr
    rows = [l for l in r.stdout.splitlines() if l.startswith("| float32") or l.startswith("| bfloat16")]
    assert len(rows) == 4 and all(l.count("|") == 7 for l in rows)
    assert rows[1].split("|")[5].strip() == "1.00x"                   # AR is the reference


def test_compare_smoke(tmp_path):
    """Train a tiny AR judge and a tiny staggered model, then build the results table."""
    write_corpus(tmp_path / "corpus.txt")
    for order in ("ar", "staggered"):
        r = run_script("train_small.py", *train_args(tmp_path, order, "--order", order, "--max-steps", "6",
                                                     "--eval-every", "6"))
        assert r.returncode == 0, r.stderr
    r = run_sample("--compare", tmp_path / "ar" / "best.pt", tmp_path / "staggered" / "best.pt",
                   "--judge", tmp_path / "ar" / "best.pt", "--compare-samples", 2, "--eval-rows", 4,
                   "--num-orders", 2, "--cache-dir", tmp_path / "cache")
    assert r.returncode == 0, r.stderr
    table = [l for l in r.stdout.splitlines() if l.startswith("| staggered d=4 |")]
    assert len(table) == 1 + 5 + 1                    # bound, five thresholds, infill
    assert sum(l.startswith("| ar |") for l in r.stdout.splitlines()) == 1 + 1 + 1  # AR: one threshold
    # --eval without files: the run's own validation split, the numbers its log shows
    r = run_sample("--ckpt", tmp_path / "ar" / "best.pt", "--eval", "--eval-rows", 8, "--batch-size", 16,
                   "--cache-dir", tmp_path / "cache")
    assert r.returncode == 0, r.stderr
    logged = metrics(tmp_path / "ar", "val")[-1]
    assert f"ppl <= {logged['ppl_bound']:.3f}" in r.stdout and "validation split" in r.stdout
    r = run_sample("--compare", tmp_path / "staggered" / "best.pt", "--judge", tmp_path / "staggered" / "best.pt",
                   "--cache-dir", tmp_path / "cache")
    assert r.returncode == 2 and "not ar" in r.stderr and "Traceback" not in r.stderr


def test_train_flag_errors_are_one_line(tmp_path, capsys):
    write_corpus(tmp_path / "corpus.txt")
    for extra, needle in ((["--eval-every", "0"], "--eval-every must be at least 1"),
                          (["--device", "nonsense"], "is not a device"),
                          (["--no-such-flag"], "unrecognized arguments")):
        with pytest.raises(SystemExit) if extra[0] == "--no-such-flag" else contextlib_null():
            code = train_small.main(train_args(tmp_path, "run", *extra))
            assert code == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "run").exists()                   # nothing written


def contextlib_null():
    import contextlib
    return contextlib.nullcontext()


def test_metrics_log_survives_a_cut_off_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 5, "kind": "train"}\n{"step": 10, "kind": "train"}\n{"step": 1')
    train_small.MetricsLog(path, resume_step=5)
    assert path.read_text() == '{"step": 5, "kind": "train"}\n'


def test_bench_ar_loss_equals_prefix_by_prefix_next_token_loss():
    """The benchmark's AR baseline is a true causal LM: brute force over prefixes, each fed
    alone (later tokens physically absent), gives the same next-token loss."""
    model = tiny_model()
    x = random_rows(model.cfg, 2)[:, :10]
    nll = []
    for b in range(2):
        for i in range(9):
            prefix = x[b:b + 1, :i + 1]
            causal = torch.ones(i + 1, i + 1, dtype=torch.bool).tril()[None]
            h = model.run(prefix, torch.arange(i + 1)[None], causal)
            nll.append(-torch.log_softmax(model.logits(h)[0, -1], -1)[x[b, i + 1]])
    assert torch.allclose(train_small.ar_loss(model, x), torch.stack(nll).mean(), atol=1e-5)


def test_compare_statistics_closed_forms():
    import sample
    tok = Tokenizer.bytes()
    rows = torch.tensor([[tok.bos_id, 1, 2, 3, 4], [tok.bos_id, 4, 3, 2, 1]])  # 4 tokens, equally often
    assert sample.unigram_entropy(rows, tok) == pytest.approx(2.0)                # BOS left out
    assert sample.unigram_entropy(torch.tensor([[tok.bos_id, 7, 7, 7]]), tok) == 0.0
    judge = tiny_model(order="ar")
    x = random_rows(judge.cfg, 3)
    logp = torch.log_softmax(judge(x, torch.arange(judge.cfg.seq_len).expand(3, -1)).double(), -1)
    nll = -logp[:, 1:].gather(-1, x[:, 1:, None]).sum()
    assert sample.judge_ppl(judge, x) == pytest.approx(math.exp(nll.item() / (3 * 23)), rel=1e-5)
    assert train_small.describe_policy(tiny_cfg(order="block", set_size=4)) == "block (d=4)"
    assert train_small.describe_policy(tiny_cfg(set_size=3)) == "staggered (d=3, s=6)"
