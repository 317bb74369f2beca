"""Tests of setdiff.py in the file's order, then of train_small.py, sample.py and experiments/,
each against an independent computation: a brute-force loop, a closed form, a worked example, rows
built by hand, an uninterrupted run, the slow reference path, or a forward written here from the
authors' description. CPU, tiny models, float32 unless exactness needs float64, no downloads."""

import functools
import hashlib
import importlib.util
import inspect
import json
import math
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import sample
import setdiff
import train_small
from setdiff import Config, SetDiffusionLM, Tokenizer, elbo, generate, load_checkpoint, sample_order

BYTES = Tokenizer.bytes()
# Tiny models gain nothing from intra-op threads, and on a busy 2-core machine the threads'
# contention made the tests 2-10x slower (measured): one thread keeps them at a few seconds.
torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def one_thread():
    yield
    torch.set_num_threads(1)  # a training run may pick another count (--threads)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def tiny_cfg(**kw):
    base = dict(seq_len=24, n_layer=2, n_head=2, d_model=32, dropout=0.0, set_size=3)
    return Config(**(base | kw))


def tiny_model(seed=0, dtype=torch.float32, **kw):
    """A small random model whose head is NOT zero, so predictions depend on the input."""
    torch.manual_seed(seed)
    model = SetDiffusionLM(tiny_cfg(**kw))
    torch.nn.init.normal_(model.head.weight, std=1.0)
    torch.nn.init.normal_(model.head.bias, std=0.5)
    return model.to(dtype).eval()


def random_rows(cfg, n, seed=0):
    x = torch.randint(0, 256, (n, cfg.seq_len), generator=gen(seed))
    x[:, 0] = cfg.bos_id
    return x


def holes_in(cfg, spans, seed=0):
    """Random rows with MASK over `spans` [(row, start, end), ...] -> (rows, holes, infill)."""
    rows = random_rows(cfg, 1 + max(r for r, _, _ in spans), seed)
    holes = torch.zeros_like(rows, dtype=torch.bool)
    for r, a, b in spans:
        holes[r, a:b] = True
    return rows, holes, torch.where(holes, cfg.mask_id, rows)


def nll_of(model, x, order, scored):
    """Sum over scored positions of -log p(x_i | x before i in order), per row (float64)."""
    logp = torch.log_softmax(model(x, order).double(), -1)
    B, T = x.shape
    return [sum(-logp[b, i, x[b, i]].item() for i in range(T) if scored[b][i]) for b in range(B)]


# ---------------------------------------------------------------------------- config, order policies, schedule
def test_config_round_trips_rejects_bad_settings_and_checks_only_what_the_policy_uses():
    cfg = tiny_cfg()
    assert Config(**json.loads(json.dumps(setdiff.asdict(cfg)))) == cfg  # as a checkpoint stores it
    cases = [
        (dict(order="random"), "unknown order policy"),
        (dict(set_size=25), "set size d"),
        (dict(set_size=3, max_set_size=2), "window s"),
        (dict(seq_len=1, set_size=1), "at least 2"),
        (dict(d_model=30, n_head=4), "multiple of n_head"),
        (dict(d_model=6, n_head=2), "even"),
        (dict(mask_id=258), "MASK must differ"),
        (dict(pad_id=257), "PAD must differ"),
        (dict(bos_id=300), "not in the vocab"),
    ]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            tiny_cfg(**kw)
    assert Config(order="ar", seq_len=3).max_set_size is None  # d = 4 > L is unused by AR
    assert Config(order="uniform", seq_len=3, set_size=99).order == "uniform"
    lm1b = Config(vocab_size=30522, mask_id=103, bos_id=101, eos_id=101, pad_id=0)  # [CLS] twice
    owt = Config(vocab_size=50258, mask_id=50257, bos_id=None, eos_id=50256, pad_id=None)
    assert lm1b.eos_id == lm1b.bos_id and owt.pad_id is None and owt.max_set_size == 8


def test_schedule_constants_special_cases_max_window_and_the_orders_of_each_policy():
    cases = [
        (128, 4, 0.059259, 0.358090),  # the paper's L = 128 values
        (128, 8, 0.111888, 0.387534),
        (128, 16, 0.201258, 0.450425),
        (1024, 4, 0.007759, 0.336378),  # the authors' StaggeredNoise(L, d, 2d) of the OWT models
        (1024, 16, 0.030332, 0.346925),
    ]
    for L, d, b, k in cases:  # the closed forms
        s = setdiff.StaggeredSchedule(L, d)
        assert round(s.b, 6) == b and round(s.k, 6) == k, (L, d)
        assert math.isclose(s.b, 2 * d / (L + 2 * d - 1))
        assert math.isclose(s.b * s.k / (s.k + 1), d / (2 * L))
        assert math.isclose(s.reach, 2 * d) and s.window == 2 * d  # r = s exactly
        assert math.isclose(s.loc[0].item(), 1 - s.b) and s.loc[-1].item() == 0.0
    s = setdiff.StaggeredSchedule(128, 4, 4)  # d == s: k = 1, b = d / L
    assert s.k == 1 and math.isclose(s.b, 4 / 128) and math.isclose(s.reach, 4 * 127 / 124)
    assert s.window == 5
    u = setdiff.StaggeredSchedule(10, 10, 10)  # uniform: b = 1, every loc 0
    assert u.b == 1 and torch.all(u.loc == 0) and u.window == 10
    for args in [(8, 9), (8, 4, 3), (8, 0)]:
        with pytest.raises(ValueError):
            setdiff.StaggeredSchedule(*args)
    cases = [
        (dict(order="ar"), 1),
        (dict(order="uniform"), 24),
        (dict(order="block", set_size=4), 4),
        (dict(set_size=4), 8),
        (dict(set_size=4, max_set_size=4), math.ceil(4 * 23 / 20)),
    ]
    for kw, window in cases:  # the largest window of each policy
        assert setdiff.max_window(tiny_cfg(**kw)) == window
    # d = 1 gives the identity and uniform gives uniform orders
    T = setdiff.StaggeredSchedule(32, 1).first_hitting_times(500, gen(3))
    assert torch.equal(torch.argsort(-T, 1), torch.arange(32).expand(500, -1))
    ar = sample_order(tiny_cfg(order="ar"), 3, gen(3))
    assert torch.equal(ar, torch.arange(24).expand(3, -1))
    N, cfg = 12000, tiny_cfg(seq_len=6, order="uniform", set_size=6)
    order = sample_order(cfg, N, gen(4))
    assert torch.all(order[:, 0] == 0)  # position 0 pinned first
    counts = [torch.bincount(order[:, slot], minlength=6)[1:] for slot in range(1, 6)]
    freq = torch.stack(counts) / N
    assert torch.all((freq - 0.2).abs() < 5 * math.sqrt(0.2 * 0.8 / N))
    # given positions come first in position order, and padding last
    cfg = tiny_cfg(seq_len=12, order="block", set_size=4)
    pad = (torch.arange(12) >= 10).expand(200, -1)
    given = torch.zeros(200, 12, dtype=torch.bool)
    given[:, [1, 7, 8]] = True  # any set of positions, not only a prefix
    order = sample_order(cfg, 200, gen(5), given=given, pad=pad)
    for row in order.tolist():
        assert row[:4] == [0, 1, 7, 8] and row[-2:] == [10, 11]
        free = row[4:10]
        assert sorted(row) == list(range(12))
        assert [p // 4 for p in free] == sorted(p // 4 for p in free)
    assert len({tuple(r[4:6]) for r in order.tolist()}) > 1  # random inside block 0
    staggered = sample_order(tiny_cfg(), 1, gen(6), given=torch.arange(24)[None] >= 20)
    assert staggered[0, :5].tolist() == [0, 20, 21, 22, 23]


def test_first_hitting_times_follow_the_masking_curves_and_the_reach_bounds_them():
    """P(T_i <= t) = 1 - (1 - u)^k, u = (t - loc_i) / b, the closed form; in replayed orders every
    revealed token stays within ceil(r) of the leftmost unrevealed one (d = s: r a bit over d)."""
    for L, d, s in [(16, 3, 6), (16, 4, 4), (12, 2, 7)]:
        sched = setdiff.StaggeredSchedule(L, d, s)
        t = torch.linspace(0, 1, 41, dtype=torch.float64)
        u = ((t[:, None] - sched.loc[None, :]) / sched.b).clamp(0, 1)
        m = 1 - (1 - u) ** sched.k  # (41, L)
        assert torch.allclose(sched.mask_prob(t), m, atol=1e-12)  # the code's, in float64
        N = 20000  # the empirical CDF of the first hitting times
        emp = (sched.first_hitting_times(N, gen(1))[None] <= t[:, None, None]).double().mean(1)
        assert torch.all((emp - m).abs() <= 5 * torch.sqrt(m * (1 - m) / N) + 2e-3), (L, d, s)
    hard = setdiff.StaggeredSchedule(9, 1).mask_prob(torch.linspace(0, 1, 41))  # d = 1: a step
    assert set(hard.unique().tolist()) == {0.0, 1.0} and torch.all(hard.diff(dim=0) >= 0)
    for d, s in [(4, 8), (3, 5), (4, 4), (6, 6)]:
        L, sched = 40, setdiff.StaggeredSchedule(40, d, s)
        limit = math.ceil(sched.b * (L - 1) / (1 - sched.b) - 1e-9)
        worst = 0
        for order in torch.argsort(-sched.first_hitting_times(400, gen(2)), 1).tolist():
            revealed, f = [False] * L, 0
            for p in order:
                revealed[p] = True
                while f < L and revealed[f]:
                    f += 1
                if f < L:  # the farthest revealed token beyond the leftmost unrevealed one
                    worst = max(worst, max(i for i in range(L) if revealed[i]) - f)
        assert d - 1 <= worst < limit, (d, s)  # and the policy really does reach ahead


# ---------------------------------------------------------------------------- set-causal masks, transformer
def test_mask_is_the_worked_example_and_the_network_sees_positions_only_through_ids():
    """Clean slot i sees clean j <= i, no mask slot; mask slot i sees clean j < i, and itself."""
    rows = ["1000 0000", "1100 0000", "1110 0000", "1111 0000"]  # clean slots c0..c3
    rows += ["0000 1000", "1000 0100", "1100 0010", "1110 0001"]  # mask slots m0..m3
    want = torch.tensor([[c == "1" for c in r if c != " "] for r in rows])
    assert torch.equal(setdiff.set_causal_mask(4), want)
    assert "m3 [ 1  1  1  0 |  0  0  0  1 ]" in setdiff.show_mask(setdiff.set_causal_mask(4))
    for L in (1, 2, 3, 5, 8, 13):
        mask = setdiff.set_causal_mask(L)
        for q in range(2 * L):
            for k in range(2 * L):
                i, j, k_clean = q % L, k % L, k < L
                want = (k_clean and j <= i) if q < L else (j < i if k_clean else i == j)
                assert bool(mask[q, k]) == want, (L, q, k)
    # permuting the slots (tokens, positions, mask) permutes the output; rotary is relative
    model, p = tiny_model(), torch.randperm(10, generator=gen(1))
    tokens = random_rows(model.cfg, 1)[:, :10]
    positions = torch.tensor([[0, 7, 3, 2, 9, 1, 5, 4, 8, 6]])
    attn = (torch.rand(1, 10, 10, generator=gen(0)) < 0.5) | torch.eye(10, dtype=torch.bool)
    h = model.run(tokens, positions, attn)
    permuted = model.run(tokens[:, p], positions[:, p], attn[:, p][:, :, p])
    assert torch.allclose(permuted, h[:, p], atol=1e-5)
    assert torch.allclose(model.run(tokens, positions + 13, attn), h, atol=1e-4)
    # the authors' pieces: tanh GELU, LayerNorm without bias, a head with a bias, dropout on
    # residual branches only, the rotary table in float32 as pos * 1 / 10000^(2i/hd)
    model = SetDiffusionLM(tiny_cfg(dropout=0.5))
    names = dict(model.named_parameters())
    assert "head.bias" in names
    assert not any(n.endswith("ln1.bias") or n == "ln_f.bias" for n in names)
    assert torch.all(names["head.bias"] == 0) and torch.all(names["head.weight"] == 0)
    assert model.blocks[0].mlp[1].approximate == "tanh"
    drops = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout)]
    assert drops == ["blocks.0.drop", "blocks.1.drop"]  # neither on embeddings nor attention
    exponent = torch.arange(0, 16, 2) / 16
    angle = torch.arange(24.0, dtype=torch.float64)[:, None] / 10000**exponent
    assert torch.allclose(model.cos.double(), angle.cos(), atol=1e-6)  # the angles, in float32
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))  # the authors' recipe
    assert torch.equal(model.sin, torch.outer(torch.arange(24).float(), inv_freq).sin())


# ---------------------------------------------------------------------------- two-stream forward, loss, bound
def test_training_forward_loss_and_the_ar_bound_equal_hand_computations(monkeypatch):
    """logits[i] depends on the tokens before i in the order and on nothing else (x[i] included):
    x[sigma_<r] alone (causal) and ONE mask query at sigma_r give the same logits, for every r."""
    model = tiny_model()
    x, order = random_rows(model.cfg, 1), sample_order(model.cfg, 1, gen(6))
    base, slot_of = model(x, order), torch.argsort(order[0])  # (1, L, V) position order
    for j in range(1, model.cfg.seq_len):  # position 0 kept
        y = torch.where(torch.arange(24) == j, (x + 1) % 256, x)
        changed = ~torch.isclose(model(y, order)[0], base[0], atol=1e-6).all(-1)  # (L,)
        assert torch.equal(changed, slot_of[j] < slot_of), j
    for r in range(model.cfg.seq_len):
        tokens = torch.cat([x[0, order[0, :r]], torch.tensor([model.cfg.mask_id])])[None]
        attn = torch.ones(r + 1, r + 1).tril().bool()[None]  # the query sees all + itself
        z = model.logits(model.run(tokens, order[:, : r + 1], attn))[0, -1]
        assert torch.allclose(z, base[0, order[0, r]], atol=1e-5), r
    # the loss with padding, by hand
    model, cfg = tiny_model(), tiny_cfg()
    x = random_rows(cfg, 3)
    x[1, 15:] = cfg.pad_id
    x[2, 5:] = cfg.pad_id
    order = sample_order(cfg, 3, gen(7), pad=x == cfg.pad_id)
    real = (x != cfg.pad_id).tolist()  # the slot of position 0 is scored in training
    want = sum(n / sum(r) for n, r in zip(nll_of(model, x, order, real), real)) / 3
    assert abs(model.loss(x, order).item() - want) < 1e-4
    # padding is sorted last, and a padded row predicts its real positions as the row without it
    assert sorted(order[2, :5].tolist()) == list(range(5))
    assert torch.allclose(model(x, order)[2, :5], model(x[2:3, :5], order[2:3, :5])[0], atol=1e-5)
    m = torch.tensor([[True, False], [False, False]])
    assert torch.equal(setdiff.no_empty_rows(m), torch.tensor([[True, False], [True, True]]))
    run = SetDiffusionLM.run

    def checked_run(self, tokens, positions, attn, cache=None):
        assert attn.any(-1).all()  # no query row attends nothing
        return run(self, tokens, positions, attn, cache)

    monkeypatch.setattr(SetDiffusionLM, "run", checked_run)
    model.train().loss(x, generator=gen(0)).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    # the AR bound is the left-to-right sum; its metrics and line by hand
    model, cfg = tiny_model(order="ar"), tiny_cfg(order="ar")
    x = random_rows(cfg, 5)
    x[4, 20:] = cfg.pad_id
    res = elbo(model, x, num_orders=3, batch_size=2)
    scored = [[0 < i and x[b, i] != cfg.pad_id for i in range(24)] for b in range(5)]
    total = sum(nll_of(model, x, torch.arange(24).expand(5, -1), scored))
    assert res.tokens_scored == 4 * 23 + 19 and res.num_orders == 3 and res.num_seqs == 5
    assert abs(res.nll - total) < 1e-3
    assert math.isclose(res.ppl, math.exp(total / res.tokens_scored), rel_tol=1e-3)
    e = setdiff.Elbo(30 * math.log(2), 10, 2, 3, 0.05, 3 * math.log(2), 8.0)  # by hand:
    m = e.metrics(num_bytes=15)  # 3 ln 2 nats/token; 30 bits / 15 bytes
    assert math.isclose(m["ppl"], 8) and math.isclose(m["bits_per_byte"], 2) and m["se"] == 0.05
    assert (m["num_orders"], m["tokens_scored"], m["num_seqs"], m["bytes"]) == (2, 10, 3, 15)
    for part in ("8.000", "2.0794", "0.0500", "2.0000", "3 rows", "10 tokens", "2 orders"):
        assert part in e.line(15), (part, e.line(15))


def test_elbo_of_k_orders_never_scores_position_0_and_infill_is_the_chain_rule():
    """Uniform policy: each row's NLL is the mean over K orders, drawn for all rows together (the
    batch size cannot change them); the standard error is that of sum(NLL) / sum(tokens)."""
    model, cfg = tiny_model(order="uniform"), tiny_cfg(order="uniform")
    x = random_rows(cfg, 4)
    x[2, 10:] = cfg.pad_id
    x[3, 17:] = cfg.pad_id
    runs = [elbo(model, x, num_orders=4, batch_size=b, generator=gen(3)) for b in (1, 3, 4)]
    g, nll, n = gen(3), [0.0] * 4, [23, 23, 9, 16]  # replay the same order draws
    scored = [[0 < i and x[b, i] != cfg.pad_id for i in range(24)] for b in range(4)]
    for _ in range(4):
        order = sample_order(cfg, 4, g, pad=x == cfg.pad_id)
        nll = [a + c / 4 for a, c in zip(nll, nll_of(model, x, order, scored))]
    rate, mean_n = sum(nll) / sum(n), sum(n) / 4
    resid = [(a - rate * c) / mean_n for a, c in zip(nll, n)]
    se = math.sqrt(sum((r - sum(resid) / 4) ** 2 for r in resid) / 3) / 2
    for res in runs:
        assert res.tokens_scored == sum(n) and abs(res.nll - sum(nll)) < 1e-3
        assert abs(res.se - se) < 1e-6
    assert runs[0].nll == pytest.approx(runs[1].nll, abs=1e-9) == runs[2].nll
    # OWT rows: no BOS, no PAD; position 0 holds any token, comes first, and is not scored.
    # LM1B rows: [CLS] both opens the row and ends sentences, and those EOS targets are scored.
    owt = tiny_model(bos_id=None, pad_id=None, eos_id=258)
    x = torch.randint(0, 256, (3, 24), generator=gen(8))
    x[:, 7] = 258
    res = elbo(owt, x, num_orders=2, generator=gen(1))
    g, want = gen(1), 0.0
    for _ in range(2):
        order = sample_order(owt.cfg, 3, g)
        assert torch.all(order[:, 0] == 0)
        want += sum(nll_of(owt, x, order, [[i > 0 for i in range(24)]] * 3)) / 2
    assert res.tokens_scored == 3 * 23 and abs(res.nll - want) < 1e-3
    lm1b = tiny_model(eos_id=257)  # BOS = EOS
    y = random_rows(lm1b.cfg, 2)
    y[:, [9, 23]] = 257
    res = elbo(lm1b, y, generator=gen(2))
    assert res.tokens_scored == 2 * 23  # the sentence ends are targets, position 0 is not
    want = sum(nll_of(lm1b, y, sample_order(lm1b.cfg, 2, gen(2)), [[i > 0 for i in range(24)]] * 2))
    assert abs(res.nll - want) < 1e-3
    # infill: the bound of a 2-position span given the rest is the mix, in the proportions drawn,
    # of both chains p(first | context) p(second | context, first), each a one-query forward
    model = tiny_model(order="uniform", dtype=torch.float64)
    cfg, N = model.cfg, 400
    x = random_rows(cfg, 1, seed=9)
    a, b = 10, 11
    given = (torch.arange(24) != a) & (torch.arange(24) != b)
    context = [p for p in range(24) if given[p]]

    def cond(revealed, target):  # -log p(x_target | x_revealed), one query after them
        n = len(revealed)
        attn = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        attn[:n, :n] = torch.ones(n, n, dtype=torch.bool).tril()  # clean: causal among themselves
        attn[n, :] = True  # the query: every revealed token and itself
        tokens = torch.cat([x[0, revealed], torch.tensor([cfg.mask_id])])[None]
        z = model.logits(model.run(tokens, torch.tensor([revealed + [target]]), attn[None]))
        return -torch.log_softmax(z, -1)[0, -1, x[0, target]].item()

    ab = cond(context, a) + cond(context + [a], b)
    ba = cond(context, b) + cond(context + [b], a)
    res = elbo(model, x.expand(N, -1), batch_size=N, generator=gen(4), given=given.expand(N, -1))
    order = sample_order(cfg, N, gen(4), given=given.expand(N, -1))  # the same draws
    assert torch.equal(order[:, :22], torch.tensor(context).expand(N, -1))  # context first
    share = (order[:, 22] == a).double().mean().item()
    assert 0.4 < share < 0.6 and res.tokens_scored == 2 * N  # both orders; only the span scored
    assert res.nll / N == pytest.approx(share * ab + (1 - share) * ba, abs=1e-5)  # float32 logp


# ---------------------------------------------------------------------------- sampler
def test_top_p_confidence_mask_zero_probability_and_cached_logits(monkeypatch):
    def almost_one(shape, **kw):
        return torch.full(shape, 1 - 2**-53, dtype=torch.float64)

    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    logits, g = p.log().expand(1, 20000, 4), gen(0)
    cand, conf = setdiff.draw_candidates(logits, 1.0, 0.7, g)  # keeps {0, 1}: 0.5 < 0.7 <= 0.8
    freq = torch.bincount(cand.flatten(), minlength=4).double() / cand.numel()
    assert freq[2] == freq[3] == 0 and abs(freq[0] - 0.625) < 0.02
    assert torch.allclose(conf, torch.where(cand == 0, 0.625, 0.375).double())
    cand, conf = setdiff.draw_candidates(logits, 1.0, 0.5, g)  # mass 0.5 reached by token 0 alone
    assert torch.all(cand == 0) and torch.all(conf == 1)
    cand, conf = setdiff.draw_candidates(logits, 0.0, 1.0, g)  # greedy: the plain softmax prob
    assert torch.all(cand == 0) and torch.allclose(conf, torch.full_like(conf, 0.5))
    cand, _ = setdiff.draw_candidates(logits, 2.0, 1.0, g)  # temperature flattens
    freq = torch.bincount(cand.flatten(), minlength=4).double() / cand.numel()
    assert torch.allclose(freq, p.sqrt() / p.sqrt().sum(), atol=0.02)
    # u just below the total mass must not round up onto MASK, the last of the sorted distribution
    logits = torch.randn(2, 3, 260, generator=gen(0))
    logits[..., 259] = float("-inf")
    with monkeypatch.context() as mp:
        mp.setattr(torch, "rand", almost_one)
        for top_p in (1.0, 0.9):
            cand, conf = setdiff.draw_candidates(logits, 1.0, top_p)
            assert not (cand == 259).any() and torch.all(conf > 0)
    cand, conf = setdiff.draw_candidates(logits, 1e-30, 1.0)  # tiny temperature ~ greedy
    assert torch.equal(cand, logits.argmax(-1)) and torch.all(conf == 1)
    model, cfg = tiny_model(), tiny_cfg()  # the model gives MASK zero probability
    x, fresh = random_rows(cfg, 2), SetDiffusionLM(cfg)  # zero head: uniform over all but MASK
    uniform = fresh.loss(x, generator=gen(0)).item()
    assert math.isclose(uniform, math.log(cfg.vocab_size - 1), rel_tol=1e-6)
    with torch.no_grad():
        model.head.bias[cfg.mask_id] = 50.0  # push hard towards MASK
    assert torch.all(F.softmax(model(x, sample_order(cfg, 2, gen(0))), -1)[..., cfg.mask_id] == 0)
    assert not (generate(model, batch_size=2, generator=gen(0)).tokens == cfg.mask_id).any()
    # the cached and the cache-free prediction paths give the same logits on every state (float64)
    model, cfg, T = tiny_model(dtype=torch.float64), tiny_cfg(), 24
    for inputs in [{}, dict(infill=holes_in(cfg, [(0, 3, 10), (1, 12, 20)], seed=6)[2])]:
        out = generate(model, batch_size=2, window=3, threshold=0.3, temperature=0.0, **inputs)
        cache, steps = setdiff.KVCache(cfg, 2, T, max_call=T + 3, device="cpu"), out.reveal_step
        for n in range(out.nfe):
            # the state before step n: revealed = steps < n; step n-1 (or the context) not cached
            canvas = torch.where(steps < n, out.tokens, cfg.mask_id)
            queries = setdiff.gather_sets(setdiff.window_queries(canvas == cfg.mask_id, 3, None))
            new = setdiff.gather_sets(steps == n - 1)
            z1 = setdiff.predict(model, canvas, new, queries, cache)
            revealed = setdiff.gather_sets(steps < n, key=steps)  # all revealed, decode order
            z2 = setdiff.predict(model, canvas, revealed, queries)
            valid = queries[1]
            assert torch.allclose(z1[valid], z2[valid], atol=1e-10)


@pytest.mark.parametrize(
    "order,window,threshold",
    [
        ("staggered", 3, math.inf),
        ("staggered", 6, 0.05),
        ("block", 3, 0.1),
        ("uniform", 24, 0.2),
        ("ar", 1, math.inf),
    ],
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cached_generation_equals_cache_free(order, window, threshold, temperature):
    """Unconditional, prompted and infill generation; sampled decoding in float64 (a float32
    rounding difference may, rarely, flip a draw), greedy in float32. The context never changes."""
    kw = dict(window=window, threshold=threshold, temperature=temperature, top_p=0.9)
    model = tiny_model(dtype=torch.float64 if temperature else torch.float32, order=order)
    spans = [(0, 2, 7), (0, 15, 18), (1, 20, 24), (2, 8, 16)]
    rows, holes, infill = holes_in(model.cfg, spans, seed=5)
    prompt, bos = torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13]]), model.cfg.bos_id
    pos = torch.arange(24).expand(3, -1)
    cases = [
        (8, dict(batch_size=3), pos < 1, torch.full((3, 24), bos)),
        (9, dict(prompt=prompt), pos < 4, F.pad(prompt, (1, 20), value=bos)),
        (10, dict(infill=infill), ~holes, rows),
    ]
    for seed, inputs, given, context in cases:
        a = generate(model, generator=gen(seed), **inputs, **kw)
        b = generate(model, generator=gen(seed), use_cache=False, **inputs, **kw)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.reveal_step, b.reveal_step)
        assert a.nfe == b.nfe == int(a.steps.max()) and not (a.tokens == model.cfg.mask_id).any()
        assert torch.equal(a.reveal_step == setdiff.GIVEN, given)
        assert torch.equal(a.tokens[given], context[given])


@pytest.mark.parametrize(
    "order,window,set_size,use_cache",
    [
        ("staggered", 4, 3, True),
        ("staggered", 4, 3, False),
        ("block", 3, 3, True),
        ("uniform", 5, 24, True),
    ],
)
def test_sampler_draws_from_the_training_forward(order, window, set_size, use_cache, monkeypatch):
    """Sampled after a prompt, one token per step (float64): every step draws from the training
    forward's distribution there, given the final sequence and its reveal order."""
    model = tiny_model(dtype=torch.float64, order=order, set_size=set_size)
    seen, draw = [], setdiff.draw_candidates

    def spy(z, *args, **kw):  # record the logits of every draw, then draw as usual
        seen.append(z.clone())
        return draw(z, *args, **kw)

    monkeypatch.setattr(setdiff, "draw_candidates", spy)
    kw = dict(batch_size=2, window=window, generator=gen(15), use_cache=use_cache)
    out = generate(model, prompt=torch.tensor([65, 66]), **kw)
    steps = out.reveal_step.tolist()  # the full decode order, by brute force: (step, pos) sorted
    sigma = torch.tensor([[p for _, p in sorted((s, p) for p, s in enumerate(r))] for r in steps])
    ref = torch.log_softmax(model(out.tokens, sigma), -1)
    assert len(seen) == out.nfe == 21 and torch.all(out.steps == out.new_tokens)
    block = set_size if order == "block" else None
    for step, logits in enumerate(seen):
        q = setdiff.window_queries(out.reveal_step >= step, window, block)  # masked before it
        for b in range(2):
            pos = int((out.reveal_step[b] == step).nonzero())
            slot = int(q[b, :pos].sum())  # queries are in position order
            assert torch.allclose(torch.log_softmax(logits[b, slot], -1), ref[b, pos], atol=1e-9)


def test_block_windows_batched_rows_the_threshold_and_bad_input():
    model = tiny_model(order="block", set_size=4)
    out = generate(model, batch_size=3, window=4, threshold=0.05, generator=gen(14))  # sampled
    for row in out.reveal_step.tolist():
        for blk in range(5):
            here = [s for s in row[4 * blk : 4 * blk + 4] if s >= 0]  # position 0 is given
            assert max(here) < min(row[4 * blk + 4 : 4 * blk + 8])  # block j done before j+1
        for step in set(row) - {setdiff.GIVEN}:
            assert len({p // 4 for p, s in enumerate(row) if s == step}) == 1  # one block a step
    assert generate(model, window=4, threshold=0.0, temperature=0.0).nfe == 24 // 4
    model = tiny_model()  # batched equals row by row; the threshold sets the tokens per step
    infill = holes_in(model.cfg, [(0, 2, 20), (1, 12, 14), (2, 5, 24)], seed=4)[2]  # rows end apart
    kw = dict(window=5, threshold=0.3, temperature=0.0)
    batched = generate(model, infill=infill, **kw)
    for b in range(3):
        single = generate(model, infill=infill[b : b + 1], **kw)
        assert torch.equal(single.tokens[0], batched.tokens[b])
        assert torch.equal(single.reveal_step[0], batched.reveal_step[b])
        assert single.nfe == batched.steps[b]
    assert batched.nfe == int(batched.steps.max())
    one = generate(model, batch_size=2, window=3, threshold=1.5, temperature=0.0)
    assert torch.all(one.steps == one.new_tokens) and one.nfe == 23 and one.tokens_per_step == 1
    whole = generate(model, batch_size=2, window=3, threshold=0.0, temperature=0.0)
    assert whole.nfe == math.ceil(23 / 3) and math.isclose(whole.tokens_per_step, 23 / 8)
    some = generate(model, batch_size=2, window=3, threshold=0.2, temperature=0.0)
    assert whole.nfe <= some.nfe <= one.nfe
    for row, n in zip(some.reveal_step.tolist(), some.steps.tolist()):
        assert {s for s in row if s >= 0} == set(range(n))  # never zero per step, per row
    cases = [  # bad input: staggered d=3, s=6, so the largest window is 6
        (dict(window=0), "window must be in"),
        (dict(window=7), "window must be in"),
        (dict(prompt=torch.arange(30)), "no room"),
        (dict(prompt=torch.arange(10), max_new_tokens=20), "max_new_tokens"),
        (dict(infill=torch.arange(10)), "MASK"),
        (dict(prompt=torch.tensor([1, 259])), "MASK"),
        (dict(prompt=torch.tensor([1, 2]), infill=torch.tensor([259])), "not both"),
        (dict(prompt=torch.tensor([1, 999])), "token ids"),
        (dict(prompt=torch.tensor([-1])), "token ids"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top-p"),
        (dict(top_p=1.5), "top-p"),
        (dict(threshold=float("nan")), "threshold"),
        (dict(prompt=torch.ones(3, 2, dtype=torch.long), batch_size=2), "rows of ids"),
        (dict(prompt=torch.tensor([[257, 5], [5, 5]]), batch_size=2), "some rows start with BOS"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            generate(model, **kwargs)


def test_stop_at_eos_pads_the_rest_and_counts_only_what_is_kept():
    model = tiny_model()
    cfg = model.cfg
    with torch.no_grad():  # every query predicts EOS with probability ~1 (the head's bias)
        model.head.weight.zero_()
        model.head.bias.zero_()
        model.head.bias[cfg.eos_id] = 30.0
    prompt = torch.tensor([cfg.eos_id, 70, 71])
    out = generate(model, prompt=prompt, temperature=0.0, stop_at_eos=True)
    # the EOS in the prompt does not stop; the first generated one (position 4) does
    assert out.tokens[0, 4] == cfg.eos_id and out.nfe == 1
    assert torch.all(out.tokens[0, 5:] == cfg.pad_id)
    assert torch.all(out.reveal_step[0, 5:] == setdiff.ERASED)
    # one call revealed the whole window (3 EOS) but keeps 1: 1 token per call, not 3
    assert out.new_tokens.tolist() == [1] and out.tokens_per_step == 1.0
    wide = generate(model, batch_size=2, window=6, threshold=0.0, temperature=0.0, stop_at_eos=True)
    assert wide.new_tokens.tolist() == [1, 1] and wide.tokens_per_step == 1.0  # 6 revealed, 1 kept
    rows, holes, infill = holes_in(cfg, [(0, 3, 6), (1, 10, 20)], seed=7)  # right context survives
    a = generate(model, infill=infill, temperature=0.0, window=3, stop_at_eos=True)
    b = generate(model, infill=infill, temperature=0.0, window=3, stop_at_eos=True, use_cache=False)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.reveal_step, b.reveal_step)
    assert torch.equal(a.tokens[~holes], rows[~holes]) and a.tokens[0, 3] == cfg.eos_id
    assert torch.all(a.tokens[0, 4:6] == cfg.pad_id) and a.new_tokens[0] == 1
    cfg = tiny_cfg(seq_len=8)  # the rule by hand
    B, M, E, P = cfg.bos_id, cfg.mask_id, cfg.eos_id, cfg.pad_id
    G, X = setdiff.GIVEN, setdiff.MASKED
    x = torch.tensor(
        [
            [B, 65, M, 66, E, 67, M, 68],  # masked before the EOS: go on
            [B, 65, 66, E, 67, M, 68, 69],  # stop: 67, M -> PAD; 68 is given
            [B, E, 65, M, M, M, M, M],  # a given EOS never stops
        ]
    )
    step = torch.tensor(
        [[G, 0, X, 1, 2, 2, X, G], [G, 0, 1, 2, 2, X, G, 3], [G, G, 0, X, X, X, X, X]]
    )
    before = x.clone()
    assert setdiff.stop_at_first_eos(cfg, x, step).tolist() == [False, True, False]
    assert x[1].tolist() == [B, 65, 66, E, P, P, 68, P]
    assert step[1].tolist() == [G, 0, 1, 2, -2, -2, G, -2]
    assert torch.equal(x[[0, 2]], before[[0, 2]])
    owt = tiny_cfg(seq_len=8, bos_id=None, pad_id=None)  # no PAD: the rest becomes EOS
    y = torch.tensor([[5, 65, 66, E, 67, M, 68, 69]])
    setdiff.stop_at_first_eos(owt, y, step[1:2].clone())
    assert y[0].tolist() == [5, 65, 66, E, E, E, 68, E]
    model = tiny_model(bos_id=None, pad_id=None)  # without BOS, sampling starts a document
    out = generate(model, batch_size=2, temperature=0.0)
    assert torch.all(out.tokens[:, 0] == model.cfg.eos_id)  # like the authors' OWT samples
    prompt = generate(model, prompt=torch.tensor([65, 66]), temperature=0.0, max_new_tokens=3)
    assert prompt.tokens[0, :2].tolist() == [65, 66] and prompt.tokens.shape == (1, 5)


# ---------------------------------------------------------------------------- checkpoints
def full_disk(obj, f, *args, **kwargs):
    """torch.save on a full disk: part of the file written, then a RuntimeError."""
    open(f, "wb").write(b"partial")
    raise RuntimeError("PytorchStreamWriter failed writing file data/0: (No space left on device)")


# Released models: folders written here as the authors' code writes them, and their log-probs
# from a forward written here from the authors' description (a DiT with its timestep modulation
# off; the two-stream SetDLM input). A tiny BERT-style WordPiece vocab, ids 0-4 the specials:
WORDS = "the cat sat . , £ 5 ##5 it costs dog ran a on mat to big red house".split()
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]


def write_vocab(path, pieces=VOCAB):
    path.write_text("\n".join(pieces) + "\n")
    return path


def authors_config(V, L, D, H, N, d, mask_id, **backbone):
    """config.json as transformers writes it for the authors' SetDLM (BD3LMConfig)."""
    net = dict(_target_="backbone_dit.DIT", length=L, causal_attention=False, adaln=False)
    net |= dict(hidden_size=D, cond_dim=128, n_heads=H, num_layers=N, dropout=0.1)
    net |= dict(tie_word_embeddings=True, attn_backend="sdpa", vocab_size=V, block_size=L)
    net |= dict(pretrained_model_name_or_path=None) | backbone
    noise = dict(_target_="noise_schedule_noise_schedules.StaggeredNoise", eps=0.001, block_size=L)
    noise |= dict(desired_block_size=d, max_block_size=L, length=L)
    tokens = dict(vocab_size=V, mask_token_id=mask_id, pad_token_id=0, bos_token_id=None)
    auto = dict(AutoConfig="bd3lm.BD3LMConfig", AutoModelForMaskedLM="setdlm.SetDLM")
    spec = dict(architectures=["SetDLM"], model_type="bd3lm", auto_map=auto, attn_backend="sdpa")
    spec |= dict(backbone_config=net, noise_config=noise, length=L, block_size=L, eval_block_size=L)
    spec |= dict(keep_clean_bos=True, tokenization_config=tokens, vocab_size=V, pad_token_id=0)
    return spec | dict(mask_token_id=mask_id, torch_dtype="float32", transformers_version="4.52.4")


def write_released(folder, model, vocab):
    """A released folder of `model`: config.json, vocab.txt, the authors' weight names by hand."""
    cfg = model.cfg
    folder.mkdir()
    write_vocab(folder / "vocab.txt", vocab)
    shape = (cfg.vocab_size, cfg.seq_len, cfg.d_model, cfg.n_head, cfg.n_layer, cfg.set_size)
    (folder / "config.json").write_text(json.dumps(authors_config(*shape, cfg.mask_id)))
    state = {}
    for name, tensor in model.state_dict().items():
        name = name.replace("tok_emb.weight", "vocab_embed.embedding")
        name = name.replace(".ln1.", ".norm1.").replace(".ln2.", ".norm2.")
        name = name.replace(".attn.qkv.", ".attn_qkv.").replace(".attn.proj.", ".attn_out.")
        name = name.replace("ln_f.", "output_layer.norm_final.")
        state["backbone." + name.replace("head.", "output_layer.linear.")] = tensor
    torch.save(state, folder / "pytorch_model.bin")
    return folder


def authors_weights(V, L, D, N, seed=0):
    """A random state dict under the authors' names and shapes (the Denoiser's, `backbone.`)."""
    g = gen(seed)

    def w(*shape, scale=0.3):
        return torch.randn(*shape, generator=g) * scale

    sd = {"backbone.vocab_embed.embedding": w(V, D, scale=1.0)}
    hd = D // 2
    sd["backbone.rotary_emb.inv_freq"] = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    for i in range(N):
        p = f"backbone.blocks.{i}."
        sd |= {p + "norm1.weight": 1 + w(D), p + "attn_qkv.weight": w(3 * D, D)}
        sd |= {p + "attn_out.weight": w(D, D), p + "norm2.weight": 1 + w(D)}
        sd |= {p + "mlp.0.weight": w(4 * D, D), p + "mlp.0.bias": w(4 * D)}
        sd |= {p + "mlp.2.weight": w(D, 4 * D), p + "mlp.2.bias": w(D)}
    sd["backbone.output_layer.norm_final.weight"] = 1 + w(D)
    sd["backbone.output_layer.linear.weight"] = w(V, D)
    sd["backbone.output_layer.linear.bias"] = w(V)
    sd["static_attention_mask"] = torch.ones(2 * L, 2 * L, dtype=torch.bool)  # ignored on load
    return sd


def authors_nll(sd, H, x, order, mask_id):
    """-log p(x[sigma_i] | x[sigma_<i]) per slot (B, L), as the authors compute it: tokens
    [x[sigma] | MASK...] at positions [sigma | sigma]; clean slots see clean slots of lower or
    equal rank, mask slots see clean slots of lower rank, every slot sees itself; an additive
    float mask; LayerNorm without bias; rotate-half rotary from a float32 table; tanh GELU;
    a head with a bias; MASK's logit -1e12; the loss read from the mask stream."""
    B, L = x.shape
    D = sd["backbone.vocab_embed.embedding"].shape[1]
    hd = D // H
    inv_freq = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    freqs = torch.einsum("i,j->ij", torch.arange(L).float(), inv_freq)
    emb = torch.cat([freqs, freqs], -1)  # (L, hd)
    pos = torch.cat([order, order], 1)  # (B, 2L)
    cos, sin = emb.cos()[pos][:, None], emb.sin()[pos][:, None]  # (B, 1, 2L, hd)
    tokens = torch.cat([x.gather(1, order), torch.full_like(x, mask_id)], 1)
    slot = torch.arange(2 * L)
    rank, in_mask = slot % L, slot >= L
    rq, rk, mq, mk = rank[:, None], rank[None], in_mask[:, None], in_mask[None]
    allowed = (~mq & ~mk & (rk <= rq)) | (mq & ~mk & (rk < rq)) | (slot[:, None] == slot[None])
    bias = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)

    def rot(t):
        t1, t2 = t.chunk(2, -1)
        return t * cos + torch.cat([-t2, t1], -1) * sin

    h = sd["backbone.vocab_embed.embedding"][tokens]
    n_layers = len({k.split(".")[2] for k in sd if k.startswith("backbone.blocks.")})
    for i in range(n_layers):
        p = f"backbone.blocks.{i}."
        a = F.layer_norm(h, [D], sd[p + "norm1.weight"])
        q, k, v = (a @ sd[p + "attn_qkv.weight"].T).view(B, 2 * L, 3, H, hd).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, 2L, hd)
        att = torch.softmax(rot(q) @ rot(k).transpose(-1, -2) / math.sqrt(hd) + bias, -1) @ v
        h = h + att.transpose(1, 2).reshape(B, 2 * L, D) @ sd[p + "attn_out.weight"].T
        m = F.layer_norm(h, [D], sd[p + "norm2.weight"])
        m = F.gelu(m @ sd[p + "mlp.0.weight"].T + sd[p + "mlp.0.bias"], approximate="tanh")
        h = h + m @ sd[p + "mlp.2.weight"].T + sd[p + "mlp.2.bias"]
    h = F.layer_norm(h, [D], sd["backbone.output_layer.norm_final.weight"])
    head = "backbone.output_layer.linear."
    logits = h @ sd[head + "weight"].T + sd[head + "bias"]
    logits[..., mask_id] = -1e12
    logp = torch.log_softmax(logits[:, L:], -1)  # the mask stream, decode order
    return -logp.gather(-1, x.gather(1, order)[..., None])[..., 0]


def write_safetensors(path, tensors):
    """The safetensors layout by hand: an 8-byte little-endian header size, a JSON header, bytes."""
    names = {torch.float32: "F32", torch.bool: "BOOL"}
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, t in tensors.items():
        blob = t.contiguous().numpy().tobytes()
        end = offset + len(blob)
        header[name] = dict(dtype=names[t.dtype], shape=list(t.shape), data_offsets=[offset, end])
        blobs.append(blob)
        offset = end
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def lm1b_folder(tmp_path, weights="bin", L=16, d=4):
    V, D, N = len(VOCAB), 16, 2
    folder = tmp_path / f"lm1b-{weights}"
    folder.mkdir(exist_ok=True)
    spec = authors_config(V, L, D, 2, N, d, VOCAB.index("[MASK]"))
    (folder / "config.json").write_text(json.dumps(spec, indent=2))
    write_vocab(folder / "vocab.txt")
    sd = authors_weights(V, L, D, N)
    if weights == "bin":
        torch.save(sd, folder / "pytorch_model.bin")
    else:
        write_safetensors(folder / "model.safetensors", sd)
    return folder, sd


@pytest.mark.parametrize("weights", ["bin", "safetensors"])
def test_released_folder_loads_matches_the_authors_forward_keeps_its_window(tmp_path, weights):
    folder, sd = lm1b_folder(tmp_path, weights)
    model, tok, ckpt = load_checkpoint(folder)
    cfg = model.cfg
    assert ckpt["released"] == str(folder)
    assert (cfg.seq_len, cfg.d_model, cfg.n_layer) == (16, 16, 2)
    assert (cfg.set_size, cfg.max_set_size) == (4, 8)  # max_block_size = L means s = min(2d, L)
    assert cfg.bos_id == cfg.eos_id == 2 and (cfg.pad_id, cfg.mask_id) == (0, 4)  # [CLS] twice
    x = torch.randint(5, len(VOCAB), (3, 16), generator=gen(0))
    x[:, [0, 9]] = 2  # [CLS]: BOS, and a sentence end
    order = sample_order(cfg, 3, gen(1))
    want = authors_nll(sd, 2, x, order, 4)  # (B, L) per slot, decode order
    got = -torch.log_softmax(model.eval()(x, order), -1).gather(-1, x[..., None])[..., 0]
    assert torch.allclose(got.gather(1, order), want, atol=2e-5)
    res = elbo(model, x, generator=gen(1))  # position 0 unscored: slot 0 dropped, as theirs
    assert res.tokens_scored == 3 * 15
    assert res.nll == pytest.approx(want[:, 1:].sum().item(), abs=1e-3)
    folder, _ = lm1b_folder(tmp_path, L=32, d=4)
    spec = json.loads((folder / "config.json").read_text())
    for given, want in [(6, 6), (32, 8)]:  # explicit (an eval override): kept; = L: min(2d, L)
        spec["noise_config"]["max_block_size"] = given
        (folder / "config.json").write_text(json.dumps(spec))
        assert load_checkpoint(folder)[0].cfg.max_set_size == want


def test_checkpoint_round_trip_failed_save_and_the_files_refused(tmp_path, monkeypatch):
    """A checkpoint round-trips, a failed save keeps the old file; corrupt files are refused."""
    model, path = tiny_model(), tmp_path / "ckpt.pt"
    setdiff.save_checkpoint(path, model, BYTES, step=7)
    before = path.read_bytes()
    with monkeypatch.context() as mp, pytest.raises(OSError, match="No space left on device"):
        mp.setattr(torch, "save", full_disk)
        setdiff.save_checkpoint(path, model, BYTES, step=8)
    assert path.read_bytes() == before and list(tmp_path.iterdir()) == [path]  # no temp file left
    loaded, tok, ckpt = load_checkpoint(path)
    assert ckpt["step"] == 7 and tok.spec() == BYTES.spec() and loaded.cfg == model.cfg
    x, order = random_rows(model.cfg, 2), sample_order(model.cfg, 2, gen(12))
    assert torch.equal(loaded.eval()(x, order), model(x, order))
    (tmp_path / "cut.pt").write_bytes(before[: len(before) // 2])
    (tmp_path / "junk.pt").write_bytes(b"hello")
    torch.save({"weights": 1}, tmp_path / "other.pt")
    torch.save(ckpt | {"config": ckpt["config"] | {"flash": True}}, tmp_path / "newer.pt")
    torch.save(ckpt | {"format": "setdiff-checkpoint-1"}, tmp_path / "old.pt")  # the old network
    cases = [
        ("cut.pt", "not a readable checkpoint"),
        ("junk.pt", "not a readable checkpoint"),
        ("other.pt", "not a setdiff checkpoint"),
        ("newer.pt", "does not match"),
        ("old.pt", "older setdiff; its network differs"),
        ("missing.pt", "not found"),
    ]
    for name, match in cases:
        with pytest.raises(ValueError, match=match):
            load_checkpoint(tmp_path / name)
    folder, sd = lm1b_folder(tmp_path)  # folders of other models are refused
    base = json.loads((folder / "config.json").read_text())
    net = base["backbone_config"]
    qwen = net | {"_target_": "backbone_automodel.AutoModelFromPreTrained"}
    qwen |= {"pretrained_model_name_or_path": "Qwen/Qwen3-1.7B-Base"}
    cases = [
        (base | {"architectures": ["AR"]}, "autoregressive"),
        (base | {"backbone_config": net | {"causal_attention": True}}, "autoregressive"),
        (base | {"architectures": ["MDLM"], "model_type": "mdlm"}, "an MDLM"),
        (base | {"architectures": ["BD3LM"], "block_size": 4}, "a BD3-LM .*block size 4"),
        (base | {"backbone_config": qwen}, "Qwen3"),
        (base | {"backbone_config": net | {"_target_": "backbone_dit_legacy.DITLegacy"}}, "legacy"),
        (base | {"backbone_config": net | {"adaln": True}}, "adaLN"),
        (base | {"architectures": ["Llama"]}, "unknown model"),
    ]
    for spec, match in cases:
        (folder / "config.json").write_text(json.dumps(spec))
        with pytest.raises(ValueError, match=match):
            load_checkpoint(folder)
    (folder / "config.json").write_text(json.dumps(base))
    torch.save(sd | {"backbone.extra.weight": torch.zeros(2)}, folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match="do not fit"):
        load_checkpoint(folder)
    torch.save(sd | {"sigma_map.weight": torch.zeros(2)}, folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match="unknown weight"):
        load_checkpoint(folder)
    (folder / "pytorch_model.bin").unlink()
    with pytest.raises(ValueError, match="has no weights"):
        load_checkpoint(folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        load_checkpoint(folder)
    with pytest.raises(ValueError, match="folder without a config.json"):
        load_checkpoint(tmp_path)


# ---------------------------------------------------------------------------- appendix: tokenizer shim

# WordPiece: a hand-written vocab, chosen so that each rule of BERT's pipeline changes the
# answer. Ten tokens a line: the id of a token is 10 * its line + its column.
TINY_VOCAB = """[PAD] [UNK] [CLS] [SEP] [MASK] the cafe un ##aff ##able
                ##a ##ff , . ! ' s hello world 日
                本 ##s $ 5 naive a ##b ##bb - resume
                play ##ing ##in ##g x ##y y [ ] σ
                ##σ""".split()


def vocab_bytes(tokens):
    return ("\n".join(tokens) + "\n").encode("utf-8")


@pytest.fixture
def tok(tmp_path):
    (tmp_path / "vocab.txt").write_bytes(vocab_bytes(TINY_VOCAB))
    return Tokenizer.from_vocab(tmp_path / "vocab.txt")


@pytest.mark.parametrize(
    "text,pieces",
    [
        ("Hello, World!", "hello , world !"),  # lower-case; punctuation is a word of its own
        ("the$5", "the $ 5"),  # $: ASCII non-alphanumeric is punctuation
        ("the's", "the ' s"),
        ("x-y", "x - y"),
        ("xy", "x ##y"),
        ("Café", "cafe"),  # accents go
        ("cafe\u0301", "cafe"),
        ("NAÏVE", "naive"),
        ("Résumé", "resume"),
        ("unaffable", "un ##aff ##able"),  # greedy longest match first, not "##a ##ff"
        ("playing", "play ##ing"),
        ("abbb", "a ##bb ##b"),
        ("plays", "play ##s"),
        ("zebra", "[UNK]"),  # no match somewhere: [UNK]
        ("playx", "[UNK]"),
        ("the zebra", "the [UNK]"),
        ("a" + "b" * 99, "a" + " ##bb" * 49 + " ##b"),
        ("a" + "b" * 100, "[UNK]"),  # over 100 characters: [UNK]
        ("日本", "日 本"),  # each CJK ideograph is a word
        ("the日本the", "the 日 本 the"),
        ("hel\x00lo", "hello"),  # control and format characters are deleted
        ("he\x07llo", "hello"),
        ("x\u200by", "x ##y"),
        ("x\ufeffy", "x ##y"),
        ("x\x85y", "x ##y"),
        ("x\ufffdy", "x ##y"),
        ("hello\tworld\nthe\r\nx\u00a0y\u3000the\u2003the  ", "hello world the x y the the"),
        ("   ", ""),
        ("", ""),
        ("ΣΣ", "σ ##σ"),  # per-character lower case: the final Σ is σ, not ς
        ("[CLS] [SEP] [MASK] [PAD] [UNK]", "[CLS] [SEP] [MASK] [PAD] [UNK]"),  # exact case
        ("x[SEP]y", "x [SEP] y"),
        ("[MASK].", "[MASK] ."),
        ("[cls]", "[ [UNK] ]"),
        ("[[SEP]]", "[ [SEP] ]"),
    ],
)
def test_wordpiece_encode(tok, text, pieces):
    ids = [TINY_VOCAB.index(p) for p in pieces.split()]  # a token's id is its line in the file
    assert tok.encode(text) == ids
    assert tok.encode(text + " " + text) == ids + ids  # the repeat comes from the word memo


def test_bytes_round_trip_special_ids_decode_and_bad_vocab_files(tok, tmp_path):
    for text in ["", "hello world", "café", "日本語", "emoji 😀👍🏽", "a\tb\nc\x00"]:
        assert BYTES.encode(text) == list(text.encode("utf-8"))
        assert BYTES.decode(BYTES.encode(text)) == text
    t = BYTES
    assert (t.kind, t.vocab_size) == ("bytes", 260)
    assert (t.pad_id, t.bos_id, t.eos_id, t.mask_id) == (256, 257, 258, 259)
    assert t.decode([t.bos_id, 104, 105, t.mask_id, t.eos_id, 33, t.pad_id]) == "hi\n!"  # EOS: \n
    assert t.decode([0xC3]) == "\ufffd"  # a cut multi-byte character is replaced
    for bad in (-1, 260, 3.0):
        with pytest.raises(ValueError, match="outside"):
            t.decode([bad])
    ids = (tok.kind, tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id, tok.mask_id, tok.unk_id)
    assert ids == ("wordpiece", 41, 0, 2, 2, 4, 1)  # [CLS] is BOS and EOS (LM1B rows)
    assert tok.decode([17, 12, 18, 14]) == "hello , world !"
    assert tok.decode([7, 8, 9]) == "unaffable"
    assert tok.decode([30, 31, 2, 5, 4, 0, 0]) == "playing\nthe"  # MASK, PAD vanish
    assert tok.decode([17, 2, 18, 3]) == "hello\nworld [SEP]" and tok.decode([5, 1]) == "the [UNK]"
    with pytest.raises(ValueError, match="outside"):
        tok.decode([41])
    cases = [  # bad vocab files
        (None, "does not exist"),
        ("dir", "is not a file"),
        (b"", r"no \[PAD\], \[UNK\]"),
        (vocab_bytes(TINY_VOCAB) + b"\xff\xfeoops\n", "not UTF-8"),
        *[
            (vocab_bytes([t for t in TINY_VOCAB if t != s]), "it has no " + re.escape(s))
            for s in TINY_VOCAB[:5]
        ],
        (vocab_bytes(TINY_VOCAB + ["the"]), "twice"),
    ]
    for i, (content, match) in enumerate(cases):
        path = tmp_path / f"bad-{i}.txt"
        if content == "dir":
            path.mkdir()
        elif content is not None:
            path.write_bytes(content)
        with pytest.raises(ValueError, match=match):
            Tokenizer.from_vocab(path)


# GPT-2 byte-level BPE: a hand-made vocab and merges, each list worked out by hand (and confirmed
# offline with HuggingFace's BPE). Ġ is a space, Ċ a newline, "Ã©" the two UTF-8 bytes of é.
TINY_BPE = "a b c ' s S 1 2 Ġ Ã © bc ab Ġa 's 11 Ã© Ċ".split()
TINY_MERGES = "#version: 0.2\nb c\na b\nĠ a\n' s\n1 1\nÃ ©\n"


@pytest.fixture
def bpe(tmp_path):
    vocab = {p: i for i, p in enumerate(TINY_BPE + ["<|endoftext|>"])}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (tmp_path / "merges.txt").write_text(TINY_MERGES)
    return Tokenizer.from_bpe(tmp_path / "vocab.json", tmp_path / "merges.txt")


def test_bpe_encode_owt_folder_special_ids_crlf_bad_files_and_specs(bpe, tok, tmp_path):
    """An OWT SetDLM folder: GPT-2 BPE files (no MASK in them: it is appended), no BOS, no PAD."""
    folder, V, L = tmp_path, bpe.vocab_size, 16  # vocab.json and merges.txt written by `bpe`
    (tmp_path / "vocab.txt").unlink()  # `tok`'s, which the loader would take for the vocab
    spec = authors_config(V, L, 16, 2, 2, 8, V - 1, attn_backend="flex_attention")
    spec["tokenization_config"] = None
    (folder / "config.json").write_text(json.dumps(spec))
    sd = authors_weights(V, L, 16, 2)
    del sd["static_attention_mask"]  # flex-attention models do not store it
    write_safetensors(folder / "model.safetensors", sd)
    model, owt_tok, _ = load_checkpoint(folder)
    cfg = model.cfg
    assert cfg.bos_id is None and cfg.pad_id is None
    assert (cfg.eos_id, cfg.mask_id, cfg.max_set_size) == (18, 19, 16)
    x = torch.randint(0, 19, (2, L), generator=gen(3))  # position 0: any token, not BOS
    order = sample_order(cfg, 2, gen(4))
    want = authors_nll(sd, 2, x, order, 19)
    res = elbo(model.eval(), x, generator=gen(4))
    assert res.nll == pytest.approx(want[:, 1:].sum().item(), abs=1e-3)
    out = generate(model, batch_size=2, temperature=0.0)
    assert torch.all(out.tokens[:, 0] == 18)
    assert owt_tok.decode(out.tokens[0]).startswith("<|endoftext|>")
    assert (bpe.kind, bpe.vocab_size, bpe.eos_id, bpe.mask_id) == ("bpe", 20, 18, 19)  # MASK: +1
    assert bpe.bos_id is None and bpe.pad_id is None and bpe.decode([0, 19, 1]) == "ab"
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    merges.write_text(TINY_MERGES.replace("\n", "\r\n"))
    assert Tokenizer.from_bpe(vocab, merges).encode(" abc") == bpe.encode(" abc") == [13, 11]
    cases = [
        ('{"a": 0}', "", "has no <\\|endoftext\\|>"),
        ('{"a": 0, "<|endoftext|>": 2}', TINY_MERGES, "ids must be 0..n-1"),
        ("[1, 2]", TINY_MERGES, "ids must be 0..n-1"),
        ("{not json", TINY_MERGES, "not JSON"),
        (json.dumps({"a": 0, "<|endoftext|>": 1}), "a b c\n", "not two pieces"),
        (json.dumps({"a": 0, "<|endoftext|>": 1}), "a a\n", "merge 'a a' is not two pieces"),
    ]
    for v, m, match in cases:
        vocab.write_text(v)
        merges.write_text(m)
        with pytest.raises(ValueError, match=match):
            Tokenizer.from_bpe(vocab, merges)
    cases = [(BYTES, "Hello, 日本!"), (tok, "Hello, unaffable [MASK] 日本!"), (bpe, " abc a's 11")]
    for t, text in cases:
        t2 = Tokenizer.from_spec(json.loads(json.dumps(t.spec())))
        assert t2.spec() == t.spec() and t2.mask_id == t.mask_id
        assert t2.encode(text) == t.encode(text)
    (tmp_path / "crlf.txt").write_bytes("\r\n".join(TINY_VOCAB).encode("utf-8"))  # no final newline
    assert Tokenizer.from_vocab(tmp_path / "crlf.txt").encode("Hello!") == [17, 14]
    wp = {"kind": "wordpiece"}
    for bad in (None, "bytes", {}, {"kind": "x"}, wp, wp | {"vocab": "?"}, wp | {"vocab": ["x"]}):
        with pytest.raises(ValueError):
            Tokenizer.from_spec(bad)
    cases = [  # encode and round trip
        ("abc", [0, 11]),  # b c (rank 0) wins over a b; the other order would give [12, 2]
        ("ab", [12]),
        (" abc", [13, 11]),  # a leading space is Ġ: bc first, then Ġa
        ("a's", [0, 14]),  # the 's contraction is a pre-token
        ("a'S", [0, 3, 5]),  # contractions are case-sensitive
        ("1112", [15, 6, 7]),  # a digit run is one pre-token; 1 1 merges left to right
        ("11112", [15, 15, 7]),  # every occurrence of a pair merges in one pass
        ("a1", [0, 6]),  # letters and digits split apart
        ("é", [16]),  # bytes C3 A9
        ("aé", [0, 16]),
        ("a  b", [0, 8, 8, 1]),  # \s+(?!\S) leaves the last space to the next word
        ("a\n", [0, 17]),
        ("a<|endoftext|>b", [0, 18, 1]),  # the special string is matched first
    ]
    for text, ids in cases:
        assert bpe.encode(text) == ids and bpe.decode(ids) == text, text


# ---------------------------------------------------------------------------- train_small.py: text -> rows
SHAPE = "--n-layer 1 --n-head 2 --d-model 32 --seq-len 32".split()
TRAIN = "--batch-size 8 --lr 3e-3 --warmup-steps 4 --eval-rows 8 --workers 1 --log-every 4"
TRAIN = (TRAIN + " --val-fraction 0.1 --threads 1").split()
LM1B_LINES = [f"the {w} sat on a {v} ." for w in WORDS[:5] for v in WORDS[8:] for _ in range(3)]


def side(line: bytes, fraction: float) -> str:
    """The split by content hash, as the data pipeline defines it."""
    h = int.from_bytes(hashlib.blake2b(line, digest_size=8).digest(), "little")
    return "val" if h < fraction * 2**64 else "train"


def write_corpus(path, lines=600, seed=0):
    """Short sentences that a tiny model learns in a few steps."""
    rng = random.Random(seed)
    words = "the cat sat on a mat and a dog ran to the big red house under blue sky".split()
    text = ""
    for _ in range(lines):
        text += " ".join(rng.choice(words) for _ in range(rng.randint(4, 10))).capitalize() + ".\n"
    path.write_text(text)
    return path


def ids_of(pieces: str) -> list:
    """WordPiece ids by hand: a piece's id is its line in VOCAB."""
    return [VOCAB.index(piece) for piece in pieces.split()]


def run_argv(tmp_path, out="run", *extra, shape=SHAPE):
    data = ["--data", str(tmp_path / "corpus.txt"), "--cache-dir", str(tmp_path / "cache")]
    return [*data, "--out", str(tmp_path / out), *shape, *TRAIN, *extra]


def resume_argv(tmp_path, out, steps):
    cache = ["--cache-dir", str(tmp_path / "cache")]
    return ["--resume", "--out", str(tmp_path / out), *cache, "--max-steps", str(steps)]


def logged(out, kind):
    records = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return [r for r in records if r["kind"] == kind]


def python(*argv, **kw):
    """`python argv...` in the repository, its output captured."""
    cmd = [sys.executable, *argv]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, **kw)


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def assert_one_error_line(err, needle):
    """One 'error: ...' line on stderr (progress bars aside), no traceback."""
    lines = err.replace("\r", "\n").splitlines()
    assert "Traceback" not in err, err
    errors = [line for line in lines if line.startswith("error")]
    assert len(errors) == 1 and needle in errors[0], err
    assert all("%|" in line or not line.strip() for line in lines if line not in errors), err


def test_lm1b_detokenize_line_ids_and_wrap_rows_by_hand(tmp_path):
    cases = {  # worked out by hand from MDLM's rules, in their order
        "a . b . c .": "a . b. c.",  # a word before " . " joins it; the first "a" has no space
        "( approx ) .": "(approx) .",  # ")" is no word, so " ." stays
        "I ' m": "I ' m",  # "' m" is no word after the quote
        "see http : / / x.org now": "see http://x.org now",
        'he said , " yes " ; then left !': 'he said, "yes"; then left!',
        "it 's 5 $ 3 ? no": "it's 5 $3? no",
        "what ?": "what?",
        "[ note ] x : y / z": "[note] x: y/z",
        "costs £ 5 .": "costs £5.",
        "so ' quoted ' words": "so 'quoted' words",
    }
    for text, expected in cases.items():
        assert train_small.lm1b_detokenize(text) == expected, text
    tok = Tokenizer.from_vocab(write_vocab(tmp_path / "vocab.txt"))  # line_ids detokenizes
    # "£ 5" detokenized is "£5": "£" is no BERT punctuation, so "5" continues the word (##5)
    assert train_small.line_ids(tok, "It costs £ 5 .") == ids_of("it costs £ ##5 . [CLS]")
    assert tok.encode("It costs £ 5 .") == ids_of("it costs £ 5 .")  # not detokenized
    assert train_small.line_ids(BYTES, "a , b") == [*b"a , b", BYTES.eos_id]  # bytes: as it is
    B, E = 1000, 1001  # sentences 1 2 | 3 4 5 | 6 | 7 8 9 10, each + EOS; chunks of 4
    rows, left = train_small.wrap_rows([1, 2, E, 3, 4, 5, E, 6, E, 7, 8, 9, 10, E], 6, B, E)
    assert rows.dtype == np.uint16 and left.tolist() == [10, E]
    assert rows.tolist() == [[B, 1, 2, E, 3, E], [B, 4, 5, E, 6, E], [B, E, 7, 8, 9, E]]
    rows, left = train_small.wrap_rows(np.concatenate([left, [11, E]]), 6, B, E)  # it carries on
    assert rows.tolist() == [[B, 10, E, 11, E, E]] and left.tolist() == []
    assert train_small.wrap_rows([1, 2], 6, B, E)[0].shape == (0, 6)
    C = 101  # [CLS], both BOS and EOS: after every sentence, and around every row
    rows, left = train_small.wrap_rows([5, 6, C, 7, C, 8], 4, C, C)
    assert rows.tolist() == [[C, 5, 6, C], [C, C, 7, C], [C, C, 8, C]] and left.tolist() == []
    rows, left = train_small.wrap_rows([1, 2, 3, 4, 5, 6, 7], 3, None, 9)  # no BOS: plain chunks
    assert rows.tolist() == [[1, 2, 3], [4, 5, 6]] and left.tolist() == [7]


def test_prepared_rows_equal_hand_built_rows_and_bad_lines_are_counted(tmp_path):
    """Bytes: EOS after each line, [BOS] + L-2 tokens + [EOS], a stream per side; WordPiece (the
    authors' LM1B rows): [CLS] + L-2 + [CLS]; GPT-2: plain chunks. Bad lines: skipped, counted."""
    f = tmp_path / "t.txt"
    f.write_bytes(b"ab\n\ncde\r\n  f  \nklm\nghij\nrs\n")  # blank: no sentence; CRLF, spaces go
    assert [side(x, 0.5) for x in (b"ab", b"cde", b"f", b"ghij")] == ["train"] * 4
    assert [side(x, 0.5) for x in (b"klm", b"rs")] == ["val"] * 2
    rows, meta = train_small.prepare_rows([f], BYTES, 6, tmp_path / "c", 0.5, verbose=False)
    # train: a b $ c d e $ f $ g h i j $ -> [a b $ c] [d e $ f] [$ g h i], [j $] left over
    B, E = BYTES.bos_id, BYTES.eos_id
    train = [[B, *b"ab", E, *b"c", E], [B, *b"de", E, *b"f", E], [B, E, *b"ghi", E]]
    assert rows["train"].tolist() == train
    assert rows["val"].tolist() == [[B, *b"klm", E, E]]  # k l m $, then [r s $] left over
    assert rows["train"].dtype == np.uint16
    assert meta["splits"]["train"] == {"rows": 3, "lines": 4, "tokens": 14, "text_bytes": 14}
    assert meta["splits"]["val"] == {"rows": 1, "lines": 2, "tokens": 7, "text_bytes": 7}
    tok = Tokenizer.from_vocab(write_vocab(tmp_path / "vocab.txt"))
    lines = ["the cat sat .", "a cat ran .", "the cat , the dog .", "the dog ran ."]
    (tmp_path / "lm1b.txt").write_text("\n".join(lines) + "\n")
    assert [side(x.encode(), 0.5) for x in lines] == ["val", "train", "train", "val"]
    rows, _ = train_small.prepare_rows([tmp_path / "lm1b.txt"], tok, 6, tmp_path / "c2", 0.5)
    # train: a cat ran . [CLS] the cat , the dog . [CLS] -> 3 rows of 4, nothing left over
    train = ["a cat ran .", "[CLS] the cat ,", "the dog . [CLS]"]
    assert rows["train"].tolist() == [ids_of(f"[CLS] {r} [CLS]") for r in train]
    # val: the cat sat . [CLS] the dog ran . [CLS] -> 2 rows, [. [CLS]] left over
    val = ["the cat sat .", "[CLS] the dog ran"]
    assert rows["val"].tolist() == [ids_of(f"[CLS] {r} [CLS]") for r in val]
    vocab = {"a": 0, "b": 1, "Ġ": 2, "ab": 3, "Ġab": 4, "<|endoftext|>": 5}  # Ġ: a space
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\nĠ ab\n")
    tok = train_small.load_tokenizer(str(tmp_path / "vocab.json"))
    assert (tok.kind, tok.bos_id, tok.eos_id, tok.mask_id) == ("bpe", None, 5, 6)
    lines = ["ab", "ba ab", "ab ab", "ba"]
    (tmp_path / "owt.txt").write_text("\n".join(lines) + "\n")
    assert [side(x.encode(), 0.5) for x in lines] == ["train", "train", "val", "val"]
    rows, _ = train_small.prepare_rows([tmp_path / "owt.txt"], tok, 4, tmp_path / "c3", 0.5)
    # train: ab E | b a Ġab E -> [3 5 1 0], [4 5] left over; val: ab Ġab E | b a E
    assert rows["train"].tolist() == [[3, 5, 1, 0]] and rows["val"].tolist() == [[3, 4, 5, 1]]
    long_line = b"x" * 300_000  # longer than a chunk: it stays whole
    data = b"ok one\r\n\xff\xfe broken\nnul \x00 byte\n" + long_line + b"\nok two\nklm\nrs\n"
    (tmp_path / "bad.txt").write_bytes(data)
    rows, meta = train_small.prepare_rows([tmp_path / "bad.txt"], BYTES, 8, tmp_path / "c4", 0.5)
    good = [b"ok one", long_line, b"ok two", b"klm", b"rs"]
    for part in ("train", "val"):
        text = b"".join(x + b"\n" for x in good if side(x, 0.5) == part)
        stream = np.frombuffer(text, np.uint8).astype(np.uint16)
        body = np.where(stream == ord("\n"), BYTES.eos_id, stream)[: len(stream) // 6 * 6]
        np.testing.assert_array_equal(np.asarray(rows[part])[:, 1:-1], body.reshape(-1, 6))
    assert meta["bad_lines"] == 2
    assert meta["splits"]["train"]["lines"] + meta["splits"]["val"]["lines"] == 5


def test_held_out_lines_row_cache_workers_and_builtin_corpus(tmp_path, monkeypatch, capsys):
    """Lines held out by hash, rows [BOS] ... [EOS]; the cache reused, rebuilt on a change."""
    corpus = write_corpus(tmp_path / "corpus.txt", lines=3000)
    cache = tmp_path / "c"
    rows, meta = train_small.prepare_rows([corpus], BYTES, 32, cache, 0.1)
    lines = corpus.read_bytes().splitlines()
    held = [line for line in lines if side(line, 0.1) == "val"]
    for part, expected in (("val", held), ("train", [x for x in lines if x not in held])):
        r = np.asarray(rows[part])
        assert (r[:, 0] == BYTES.bos_id).all() and (r[:, -1] == BYTES.eos_id).all()
        body = np.where(r[:, 1:-1] == BYTES.eos_id, ord("\n"), r[:, 1:-1])
        stream = bytes(body.astype(np.uint8).ravel())
        text = b"".join(line + b"\n" for line in expected)
        assert text.startswith(stream) and len(text) - len(stream) < 30  # in order, tail cut
        assert meta["splits"][part]["lines"] == len(expected)
    monkeypatch.setattr(train_small, "CHUNK_BYTES", 4096)  # ~30 chunks over 2 spawned workers
    get_context = mock.Mock(wraps=train_small.multiprocessing.get_context)  # the workers start
    monkeypatch.setattr(train_small.multiprocessing, "get_context", get_context)
    parallel, _ = train_small.prepare_rows([corpus], BYTES, 32, tmp_path / "b", 0.1, 2, False)
    assert get_context.call_args_list == [mock.call("spawn")]
    for part in ("train", "val"):
        assert len(rows[part]) > 10
        np.testing.assert_array_equal(rows[part], parallel[part])
    built = Path(rows["train"].filename)
    stamp = built.stat().st_mtime_ns
    capsys.readouterr()
    assert train_small.prepare_rows([corpus], BYTES, 32, cache, 0.1)[1] == meta
    assert "reusing" in capsys.readouterr().out and built.stat().st_mtime_ns == stamp
    with open(corpus, "a") as f:
        f.write("A brand new sentence that was not there before.\n" * 20)
    meta3 = train_small.prepare_rows([corpus], BYTES, 32, cache, 0.1)[1]
    assert "reusing" not in capsys.readouterr().out
    new = 20 * (side(b"A brand new sentence that was not there before.", 0.1) == "train")
    assert meta3["splits"]["train"]["lines"] == meta["splits"]["train"]["lines"] + new
    assert meta3["sources"][0]["size"] == corpus.stat().st_size and not list(cache.rglob("*.tmp-*"))
    # the built-in corpus is deterministic prose
    pkg = tmp_path / "pkg"
    (pkg / "tests").mkdir(parents=True)  # test folders are skipped
    (pkg / "tests" / "t.py").write_text('"""Tests are skipped entirely by the walk."""')
    (pkg / "b.py").write_text('"""A file that does not parse is skipped."""\nprint "x"')
    (pkg / "c.py").write_text(
        'def f():\n    """The first module has a sentence that is long enough."""\n'
        'def g():\n    """A third file adds one more sentence of plain prose."""\n'
    )
    (pkg / "a.py").write_text('''"""The first module has a sentence that is long enough. Too short.
Parameters
----------
x : int
    An indented description that is never kept in the corpus.

>>> f(1)  # a doctest line is dropped as well, whatever it says.
"""
class C:
    """Returns a :class:`Tensor` with ``x`` values in every row. Calls f(x) in its code here.

    Uses numpy.sum inside a sentence that is otherwise fine."""''')
    a = train_small.builtin_corpus(tmp_path, roots=[pkg])
    assert a.read_text().splitlines() == [
        "The first module has a sentence that is long enough.",
        "Returns a Tensor with x values in every row.",
        "A third file adds one more sentence of plain prose.",
    ]
    assert np.__version__ in a.name and torch.__version__ in a.name  # versions name the cache
    b = train_small.builtin_corpus(tmp_path, roots=[pkg], out=tmp_path / "b.txt")
    assert b.read_bytes() == a.read_bytes()


# ---------------------------------------------------------------------------- train_small.py: runs, --init-from, --bench
@pytest.fixture(scope="module")
def run4(tmp_path_factory):
    """run4/run: a 4-step run (validated at 4), its corpus and cache beside it; add runs there."""
    d = tmp_path_factory.mktemp("train")
    write_corpus(d / "corpus.txt")
    assert train_small.main(run_argv(d, "run", "--max-steps", "4", "--eval-every", "4")) == 0
    return d


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_train_resume_and_a_signal_are_exact(tmp_path, monkeypatch, capsys, sig):
    """A run cut at step 8 and resumed, and one stopped by Ctrl-C / SIGTERM in the middle of
    step 5 and resumed, end with the weights of the uninterrupted run, bit for bit."""
    write_corpus(tmp_path / "corpus.txt")
    steps = ["--eval-every", "8", "--max-steps"]
    assert train_small.main(run_argv(tmp_path, "straight", *steps, "16")) == 0
    straight = tmp_path / "straight"
    loss = [m["loss"] for m in logged(straight, "train")]
    assert len(loss) == 4 and loss[-1] < loss[0] - 0.5  # it learns
    val = logged(straight, "val")
    assert [v["step"] for v in val] == [8, 16]
    assert all(v["bytes"] == v["num_seqs"] * 30 for v in val)
    assert train_small.main(run_argv(tmp_path, "split", *steps, "8")) == 0
    capsys.readouterr()
    assert train_small.main(resume_argv(tmp_path, "split", 16)) == 0
    assert "; 1 threads" in capsys.readouterr().out  # the run's --threads 1, not the default
    assert [m["loss"] for m in logged(tmp_path / "split", "train")] == loss  # no duplicates
    real = train_small.train_step
    sent = []

    def signal_in_step_5(run, step):  # a real signal, in the middle of step 5
        if step == 5 and not sent:
            sent.append(os.kill(os.getpid(), sig))
        return real(run, step)

    monkeypatch.setattr(train_small, "train_step", signal_in_step_5)
    handler = signal.getsignal(sig)
    capsys.readouterr()
    assert train_small.main(run_argv(tmp_path, "cut", *steps, "16")) == 130
    assert f"interrupted ({signal.Signals(sig).name}) at step 6" in capsys.readouterr().err
    assert load_checkpoint(tmp_path / "cut" / "ckpt.pt")[2]["step"] == 6
    monkeypatch.setattr(train_small, "train_step", real)
    assert signal.getsignal(sig) == handler  # restored
    assert train_small.main(resume_argv(tmp_path, "cut", 16)) == 0
    ref = load_checkpoint(straight / "ckpt.pt")[2]
    assert ref["step"] == 16 and ref["tokens"] == 16 * 8 * 32 and ref["args"]["n_layer"] == 1
    assert ref["val_rows"]["bytes_per_token"] == 1.0
    val_file = np.memmap(ref["val_rows"]["path"], np.uint16, "r").reshape(-1, 32)
    assert len(val_file) == ref["val_rows"]["rows"] and (val_file[:, 0] == BYTES.bos_id).all()
    for name in ("split", "cut"):
        other = load_checkpoint(tmp_path / name / "ckpt.pt")[2]
        assert same_weights(ref["train_model"], other["train_model"]), name  # raw weights
        assert same_weights(ref["model"], other["model"]), name  # EMA weights
    assert "optimizer" not in load_checkpoint(straight / "best.pt")[2]


def test_init_from_a_checkpoint_compile_and_resume_refusals(run4, monkeypatch, capsys):
    """--init-from: the source's config wins, a resumed fine-tune is exact; --compile: the same
    weights. A copy of run4 resumed: a changed flag refused, records after the checkpoint and a cut
    line dropped, a full disk keeps the last checkpoint; --force removes the old ones at once."""
    src = load_checkpoint(run4 / "run" / "ckpt.pt")[2]
    init = ["--init-from", str(run4 / "run" / "ckpt.pt"), "--eval-every", "4"]
    # no shape flags: the cpu preset's 4 x 256 would apply, but the source's 1 x 32 wins
    ft0 = run_argv(run4, "ft0", *init, "--max-steps", "1", "--lr", "0", shape=[])
    assert train_small.main(ft0) == 0
    ft = load_checkpoint(run4 / "ft0" / "ckpt.pt")[2]
    assert ft["step"] == 1 and ft["config"] == src["config"] | {"dropout": 0.0}
    assert same_weights(ft["train_model"], src["model"])  # lr 0: the source's (EMA) weights
    assert same_weights(ft["model"], src["model"])  # and the EMA starts from them
    one_step = [*init, "--max-steps", "1", "--n-layer"]
    assert train_small.main(run_argv(run4, "ft1", *one_step, "1")) == 0
    capsys.readouterr()
    assert train_small.main(run_argv(run4, "ft2", *one_step, "2")) == 2
    err = capsys.readouterr().err
    assert_one_error_line(err, "--n-layer 2 disagrees with the --init-from model's 1")
    assert train_small.main(run_argv(run4, "straight", *init, "--max-steps", "8", shape=[])) == 0
    assert train_small.main(run_argv(run4, "half", *init, "--max-steps", "4", shape=[])) == 0
    assert train_small.main(resume_argv(run4, "half", 8)) == 0
    a = load_checkpoint(run4 / "straight" / "ckpt.pt")[2]
    b = load_checkpoint(run4 / "half" / "ckpt.pt")[2]
    assert a["step"] == b["step"] == 8 and not same_weights(a["train_model"], src["model"])
    assert same_weights(a["train_model"], b["train_model"]) and same_weights(a["model"], b["model"])
    # --compile (dynamo; the eager backend: inductor takes a minute on a CPU) gives run4's weights
    compile_eagerly = mock.Mock(wraps=functools.partial(torch.compile, backend="eager"))
    monkeypatch.setattr(torch, "compile", compile_eagerly)
    argv = run_argv(run4, "compiled", "--max-steps", "4", "--eval-every", "4", "--compile")
    assert train_small.main(argv) == 0
    compiled_modules = [type(call.args[0]).__name__ for call in compile_eagerly.call_args_list]
    assert compiled_modules == ["TrainStep"]  # the loss, as DDP and compile see it
    plain = load_checkpoint(run4 / "run" / "ckpt.pt")[2]["train_model"]
    compiled = load_checkpoint(run4 / "compiled" / "ckpt.pt")[2]["train_model"]
    assert all(torch.allclose(plain[k], compiled[k], atol=1e-6) for k in plain)
    shutil.copytree(run4 / "run", run4 / "resumed")
    out = run4 / "resumed"
    capsys.readouterr()
    assert train_small.main([*resume_argv(run4, "resumed", 8), "--n-layer", "2"]) == 2
    assert_one_error_line(capsys.readouterr().err, "--n-layer 2 differs from the resumed run's 1")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "kind": "train"}\n{"step": 1')  # after the checkpoint; cut off
    assert train_small.main([*resume_argv(run4, "resumed", 6), "--log-every", "2"]) == 0
    assert [m["step"] for m in logged(out, "train")] == [4, 6]
    before = (out / "ckpt.pt").read_bytes()
    capsys.readouterr()
    with monkeypatch.context() as mp:
        mp.setattr(torch, "save", full_disk)
        assert train_small.main(resume_argv(run4, "resumed", 8)) == 2
    assert_one_error_line(capsys.readouterr().err, "No space left on device")
    assert (out / "ckpt.pt").read_bytes() == before
    assert sorted(p.name for p in out.iterdir()) == ["best.pt", "ckpt.pt", "metrics.jsonl"]
    broken_step = mock.Mock(side_effect=OSError("the disk went away"))
    monkeypatch.setattr(train_small, "train_step", broken_step)
    assert train_small.main(run_argv(run4, "resumed", "--max-steps", "4", "--force")) == 2
    assert broken_step.called and sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]
    assert (out / "metrics.jsonl").read_text() == ""


def test_init_from_a_released_folder_lm1b_presets_and_bench(tmp_path, capsys):
    """The bug: the recipe validated on heldout-00000, the shard then reported as the test
    score. Now the presets hold out training lines, and nothing points at a heldout shard."""
    for preset in ("lm1b", "lm1b-small"):
        args, _ = train_small.parse_args(["--preset", preset, "--tokenizer", "vocab.txt"])
        assert 0 < args.val_fraction <= 0.001
    texts = train_small.build_parser().format_help() + train_small.__doc__
    assert "--val-data" not in texts and "heldout-00000" not in texts
    specials = dict(mask_id=4, bos_id=2, eos_id=2, pad_id=0)  # [MASK]; [CLS] twice; [PAD]
    model = tiny_model(1, vocab_size=len(VOCAB), seq_len=16, n_layer=1, set_size=4, **specials)
    folder = write_released(tmp_path / "lm1b-setdlm-tiny", model, VOCAB)
    (tmp_path / "corpus.txt").write_text("\n".join(LM1B_LINES) + "\n")
    flags = ["--init-from", str(folder), "--max-steps", "1", "--lr", "0", "--val-fraction", "0.3"]
    assert train_small.main(run_argv(tmp_path, "ft", *flags, shape=[])) == 0
    ft = load_checkpoint(tmp_path / "ft" / "ckpt.pt")[2]
    want = Config(**(setdiff.asdict(model.cfg) | dict(max_set_size=8)))
    assert Config(**ft["config"]) == want  # s = min(2d, L) = 8, although config.json says L
    assert same_weights(ft["train_model"], model.state_dict())
    assert Tokenizer.from_spec(ft["tokenizer"]).pieces == VOCAB
    rows = np.memmap(ft["val_rows"]["path"], np.uint16, "r").reshape(-1, 16)
    assert (rows[:, 0] == 2).all() and (rows[:, -1] == 2).all()  # [CLS]
    meta = json.loads(next((tmp_path / "cache").glob("rows-*/meta.json")).read_text())
    val_lines = [x for x in LM1B_LINES if side(x.encode(), 0.3) == "val"]
    assert meta["splits"]["val"]["lines"] == len(val_lines) > 0  # validation: training lines
    # --bench prints the table; its AR baseline loss is the prefix-by-prefix loss
    argv = ["--bench", *SHAPE, "--batch-size", "8", "--bench-steps", "1", "--bench-repeats", "1"]
    assert train_small.main([*argv, "--threads", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split("|")[1:-1] for line in lines if line.startswith("| ") and "x |" in line]
    assert [r[0].strip() for r in rows] == ["float32", "float32", "bfloat16", "bfloat16"]
    for set_row, ar_row in (rows[0:2], rows[2:4]):
        ms_set, ms_ar = float(set_row[2]), float(ar_row[2])  # printed to 0.1 ms, the ratio to 0.01
        tol = 0.006 + 0.05 * (1 / ms_set + 1 / ms_ar) * ms_set / ms_ar
        assert float(set_row[4].strip()[:-1]) == pytest.approx(ms_set / ms_ar, abs=tol)
    model = tiny_model(seq_len=10)  # the AR baseline is a true causal LM: each prefix alone
    x = random_rows(model.cfg, 2)
    nll = []
    for b in range(2):
        for i in range(9):
            causal = torch.ones(i + 1, i + 1, dtype=torch.bool).tril()[None]
            h = model.run(x[b : b + 1, : i + 1], torch.arange(i + 1)[None], causal)
            nll.append(-torch.log_softmax(model.logits(h)[0, -1], -1)[x[b, i + 1]])
    assert torch.allclose(train_small.ar_loss(model, x), torch.stack(nll).mean(), atol=1e-5)


TRAIN_BAD_INPUT = [  # (flags, what the one error line says)
    (["--data", "nope.txt"], "nope.txt: no such file"),
    (["--data", "cache"], "cache: no such file"),  # a folder
    (["--data", "nope-*.txt"], "nope-*.txt: no such file"),  # a glob that matches nothing
    (["--data", "corpus.txt", "empty.txt"], "is empty"),
    (["--data", "blob.bin"], "not look like text"),
    (["--data", "small.txt"], "needs 30"),
    (["--tokenizer", "vocab.txt"], "not a BERT uncased model's vocab.txt"),
    (["--tokenizer", "none.txt"], "--tokenizer: none.txt does not exist"),
    (["--tokenizer", "vocab.json"], "needs merges.txt beside it"),
    (["--init-from", "none.pt"], "--init-from: checkpoint"),
    (["--no-such"], "unrecognized"),
    (["--resume", "--out", "elsewhere"], "--resume: no checkpoint"),
    (["--set-size", "99"], "set size d must be in [1, L=32], got 99 (set by --seq-len"),
    (["--max-set-size", "2"], "got 2 (set by --seq-len, --n-layer, --n-head, --d-model, --order"),
    (["--d-model", "33"], "d_model must be a multiple of n_head (set by"),
    (["--eval-every", "0"], "--eval-every must be at least 1"),
    (["--val-fraction", "1.5"], "--val-fraction"),
    (["--device", "nonsense"], "--device 'nonsense'"),
    (["--no-force"], "already holds a run"),
]


@pytest.mark.parametrize("flags,needle", TRAIN_BAD_INPUT)
def test_train_bad_input_one_line_exit_2(tmp_path, monkeypatch, capsys, flags, needle):
    monkeypatch.chdir(write_corpus(tmp_path / "corpus.txt").parent)
    (tmp_path / "empty.txt").write_text("\n  \n")
    blob = bytes(random.Random(0).randrange(128, 256) for _ in range(5000))
    (tmp_path / "blob.bin").write_bytes(blob)
    (tmp_path / "small.txt").write_text("Only a few words.\n")
    (tmp_path / "vocab.txt").write_text("[PAD]\n[CLS]\n")
    (tmp_path / "vocab.json").write_text("{}")
    (tmp_path / "cache").mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "ckpt.pt").write_bytes(b"an older run")
    force = [] if flags == ["--no-force"] else ["--force"]
    argv = ["--data", "corpus.txt", "--cache-dir", "cache", "--out", "run", *SHAPE, *TRAIN]
    argv += ["--max-steps", "2", *force, *[f for f in flags if f != "--no-force"]]
    assert train_small.main(argv) == 2
    assert_one_error_line(capsys.readouterr().err, needle)
    assert sorted(os.listdir(tmp_path / "run")) == ["ckpt.pt"]
    assert (tmp_path / "run" / "ckpt.pt").read_bytes() == b"an older run"


def test_out_checked_first_data_glob_threads_and_torchrun(tmp_path, monkeypatch, capsys):
    """--out is checked before the data work; --data 'part-*.txt' reads its files sorted;
    --threads sets the count, else the cores less the load elsewhere, printed with the reason."""
    corpus = write_corpus(tmp_path / "corpus.txt").read_text().splitlines(keepends=True)
    (tmp_path / "file").write_text("not a folder")
    (tmp_path / "locked").mkdir()
    real_access = os.access

    def access(path, mode):  # a read-only folder (as root, chmod would not stop a write)
        return Path(path).name != "locked" and real_access(path, mode)

    monkeypatch.setattr(os, "access", access)
    cases = [("file", "is a file"), ("file/run", "is a file"), ("locked/run", "not writable")]
    for out, needle in cases:
        assert train_small.main(run_argv(tmp_path, out, "--max-steps", "1")) == 2
        err = capsys.readouterr().err
        assert_one_error_line(err, f"--out {tmp_path / out}")
        assert needle in err
    assert not (tmp_path / "cache").exists()  # no data work was done
    assert list((tmp_path / "locked").iterdir()) == []
    (tmp_path / "part-2.txt").write_text("".join(corpus[300:]))
    (tmp_path / "part-1.txt").write_text("".join(corpus[:300]))
    glob_argv = run_argv(tmp_path, "glob", "--max-steps", "1")
    glob_argv[1] = str(tmp_path / "part-*.txt")  # quoted: the glob itself, not the shell's
    capsys.readouterr()
    assert train_small.main(glob_argv[: glob_argv.index("--threads")]) == 0  # TRAIN ends with it
    out = capsys.readouterr().out
    found = re.search(r"; (\d+) threads \((\d+) cores, load (\d+) elsewhere", out)
    assert found and int(found[2]) == os.cpu_count()
    auto = max(1, min(os.cpu_count(), int(found[2]) - int(found[3])))
    assert int(found[1]) == torch.get_num_threads() == auto
    assert load_checkpoint(tmp_path / "glob" / "ckpt.pt")[2]["args"]["data"] == glob_argv[1:2]
    meta = json.loads(next((tmp_path / "cache").glob("rows-*/meta.json")).read_text())
    assert [Path(source["path"]).name for source in meta["sources"]] == ["part-1.txt", "part-2.txt"]
    argv = run_argv(tmp_path, "threads", "--max-steps", "1", "--threads", "2")
    assert train_small.main(argv) == 0
    assert "; 2 threads (requested with --threads)" in capsys.readouterr().out
    assert torch.get_num_threads() == 2
    # torchrun: two gloo processes match one process (corpus.txt as written above)
    common = ["--global-batch", "8", "--max-steps", "6", "--eval-every", "6", "--log-every", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    one = python("train_small.py", *run_argv(tmp_path, "one", *common), env=env)
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    two = python(*torchrun, "train_small.py", *run_argv(tmp_path, "two", *common), env=env)
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    assert "4 per forward x 1 accumulation x 2 proc" in two.stdout
    assert two.stdout.count("done:") == 1
    loss_one = [m["loss"] for m in logged(tmp_path / "one", "train")]
    loss_two = [m["loss"] for m in logged(tmp_path / "two", "train")]
    np.testing.assert_allclose(loss_two, loss_one, rtol=1e-4)
    w1, w2 = (load_checkpoint(tmp_path / o / "ckpt.pt")[2]["train_model"] for o in ("one", "two"))
    assert all(torch.allclose(w1[k], w2[k], atol=1e-5) for k in w1)


# ---------------------------------------------------------------------------- sample.py
L, LETTERS = 24, "abcdefghijklmnopqrstuvwxyz"  # L: tiny_cfg's seq_len
VAL_TEXT = [f"the {w} sat on a mat." for w in ("cat", "dog", "fox", "owl", "hen", "ram")] * 3
VAL_TEXT += ["the end."]  # 18 lines fill 18 rows (L - 2 = 22 tokens a line): this one does not


def letters_model(order="staggered", eos_first=False, **kw):
    """A tiny_model (d=3, s=6) writing lowercase letters only, so given and generated text differ:
    head bias +10 for letters, -10 else (eos_first: +30 for EOS), beyond the +-3 of its weights."""
    model = tiny_model(order=order, **kw)
    bias = torch.tensor([10.0 if chr(i) in LETTERS else -10.0 for i in range(model.cfg.vocab_size)])
    if eos_first:
        bias[BYTES.eos_id] = 30.0
    with torch.no_grad():
        for m in model.modules():  # a wide init: predictions depend on the context
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
                torch.nn.init.normal_(m.weight, std=3 / m.weight.shape[1] ** 0.5)
        torch.nn.init.normal_(model.head.weight, std=0.5)
        model.head.bias.copy_(bias)
    return model


def wrapped_by_hand(stream: list, bos, eos, pad=None) -> tuple:
    """Rows of L from a token stream: [BOS] + L-2 tokens + [EOS] (no BOS: L tokens); the rest in
    a last row padded with PAD where a PAD is given. -> (rows (n, L), tokens left over)."""
    start, end = ([], []) if bos is None else ([bos], [eos])
    body = L - len(start) - len(end)
    rows = [start + stream[k : k + body] + end for k in range(0, len(stream) - body + 1, body)]
    rest = stream[len(rows) * body :]
    if rest and pad is not None:
        rows.append(start + rest + [pad] * (L - len(start) - len(rest)))
        rest = []
    return torch.tensor(rows), rest


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Checkpoints as train_small.py writes them (step, val_rows), and text files to score."""
    d = tmp_path_factory.mktemp("sample")
    (d / "val.txt").write_text("\n".join(VAL_TEXT) + "\n")
    (d / "short.txt").write_text("hello\n")
    (d / "empty.txt").write_text("")
    (d / "binary.txt").write_bytes(b"\xff\xfe\x00\x81 abc\n\x80\x80\xc3\n")
    stream = (np.arange(13 * (L - 2)) % 26 + ord("a")).reshape(13, L - 2)  # 13 rows by hand
    rows = [np.full((13, 1), BYTES.bos_id), stream, np.full((13, 1), BYTES.eos_id)]
    np.concatenate(rows, 1).astype(np.uint16).tofile(d / "val.bin")
    val = {"path": str(d / "val.bin"), "rows": 13, "bytes_per_token": 1.0}
    other = {**val, "path": str(d / "val.txt")}  # other data than the judge's
    (d / "copy").mkdir()  # the judge's rows in another cache folder: the same data
    (d / "copy" / "val.bin").write_bytes((d / "val.bin").read_bytes())
    copy = {**val, "path": str(d / "copy" / "val.bin")}
    runs = dict(st=val, ar=val, eos=val, gone={**val, "path": "-"}, other=other, copy=copy)
    for name, rows in runs.items():
        model = letters_model("ar" if name == "ar" else "staggered", eos_first=name == "eos")
        setdiff.save_checkpoint(d / f"{name}.pt", model, BYTES, step=7, val_rows=rows)
    setdiff.save_checkpoint(d / "noval.pt", letters_model(), BYTES)
    owt = letters_model(bos_id=None, pad_id=None)
    setdiff.save_checkpoint(d / "owt.pt", owt, BYTES, val_rows=val)
    setdiff.save_checkpoint(d / "l40.pt", letters_model(seq_len=40), BYTES)
    (d / "cut.pt").write_bytes((d / "st.pt").read_bytes()[:2000])
    torch.save({"model": {}}, d / "foreign.pt")
    (d / "not-a-model").mkdir()
    return d


def run_sample(capsys, *argv) -> tuple:
    try:
        code = sample.main([str(a) for a in argv])
    except SystemExit as e:  # argparse errors
        code = e.code
    return (code, *capsys.readouterr())


def sample_ok(capsys, *argv) -> str:
    code, out, err = run_sample(capsys, *argv)
    assert code == 0 and "error" not in err and "Traceback" not in err, err
    return out


def samples_of(out: str) -> list:  # [(header, text)] of every '--- sample i/n: ...' (one line)
    lines = out.splitlines()
    return [(line, lines[i + 1]) for i, line in enumerate(lines) if line.startswith("--- sample ")]


def calls_of(header: str) -> int:
    return int(re.search(r": (\d+) network calls, [\d.]+ tokens/call, [\d,]+ tokens/s$", header)[1])


def test_sampling_defaults_of_the_library_and_the_script_agree():
    """The same distribution by default: the model's own (top-p 1, temperature 1), not 0.9."""
    library = {k: p.default for k, p in inspect.signature(generate).parameters.items()}
    script = sample.build_parser().parse_args([])
    assert library["top_p"] == script.top_p == 1.0 and library["temperature"] == script.temperature


def test_sample_prompt_infill_bounded_batches_and_ctrl_c(ckpts, capsys, monkeypatch):
    def interrupted(*args, **kw):  # Ctrl-C while sampling: the signal itself, not a stand-in
        signal.raise_signal(signal.SIGINT)

    args = ("--ckpt", ckpts / "st.pt", "--num-samples", 3, "--batch-size", 2)
    out = sample_ok(capsys, *args)
    assert re.search(r"^device: cpu \(.*\); float32 \(.*\); \d+ threads \(.*\)$", out, re.M)
    found = [t for h, t in samples_of(out) if calls_of(h) > 0]
    assert [h[:15] for h, _ in samples_of(out)] == [f"--- sample {i}/3:" for i in (1, 2, 3)]
    assert all(re.fullmatch(f"[a-z]{{{L - 1}}}", t) for t in found) and len(set(found)) == 3
    assert [t for _, t in samples_of(sample_ok(capsys, *args))] == found  # --seed
    assert [t for _, t in samples_of(sample_ok(capsys, *args, "--seed", 1))] != found
    out = sample_ok(capsys, "--ckpt", ckpts / "st.pt", "--prompt", "Hi, you", "--max-new-tokens", 9)
    ((header, text),) = samples_of(out)
    assert re.fullmatch(r"Hi, you[a-z]{9}", text) and calls_of(header) == 9  # tau > 1: one a call
    cases = [  # --infill fills only the holes
        ("A [MASK]. B [MASK][MASK]!", r"A [a-z]\. B [a-z]{2}!"),
        ("X ___ Y", r"X [a-z]{3} Y"),
        ("___5 Z ___2", r"[a-z]{5} Z [a-z]{2}"),
    ]
    for template, pattern in cases:
        args = ("--infill", template, "--span-len", 3, "--threshold", 0.5, "--num-samples", 2)
        texts = [t for _, t in samples_of(sample_ok(capsys, "--ckpt", ckpts / "st.pt", *args))]
        assert len(texts) == 2 and all(re.fullmatch(pattern, t) for t in texts), texts
    # more samples than --batch-size: the batches drawn by hand from one generator, in turn
    argv = ("--ckpt", ckpts / "st.pt", "--num-samples", 5, "--batch-size", 2, "--top-p", 0.9)
    out = sample_ok(capsys, *argv)
    g = torch.Generator().manual_seed(0)
    by_hand = []
    for B in (2, 2, 1):
        rows = generate(letters_model(), batch_size=B, window=3, top_p=0.9, generator=g).tokens
        by_hand += [BYTES.decode(row) for row in rows]
    assert [t for _, t in samples_of(out)] == by_hand
    # without --batch-size, even 10^9 samples start with a small batch; Ctrl-C: one line, exit 130
    first_batch_only = mock.Mock(side_effect=KeyboardInterrupt)  # stop after the first call
    monkeypatch.setattr(setdiff, "generate", first_batch_only)
    code, _, err = run_sample(capsys, "--ckpt", ckpts / "st.pt", "--num-samples", 10**9)
    assert code == 130 and err == "interrupted\n" and first_batch_only.call_count == 1
    assert first_batch_only.call_args.kwargs["batch_size"] == 16
    monkeypatch.setattr(setdiff, "generate", interrupted)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code, out, err = run_sample(capsys, "--ckpt", ckpts / "st.pt")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert code == 130 and err == "interrupted\n" and "Traceback" not in out


def test_sample_show_order_stop_at_eos_no_bos_released_folder_and_eval(ckpts, capsys, tmp_path):
    args = ("--prompt", "Go", "--threshold", 0.3, "--temperature", 0, "--window", 6, "--show-order")
    out = sample_ok(capsys, "--ckpt", ckpts / "st.pt", *args)
    ((header, text),) = samples_of(out)
    picture, summary = out.split("--- decode order:\n")[1].splitlines()[:2]
    runs = [(t, int(s)) for t, s in re.findall(r"\[([a-z]+)\](\d+)", picture)]
    assert picture == "Go" + "".join(f"[{t}]{s}" for t, s in runs)
    assert "Go" + "".join(t for t, _ in runs) == text
    sizes = [sum(len(t) for t, s in runs if s == step) for step in range(calls_of(header))]
    assert min(sizes) >= 1 and max(sizes) > 1 and sum(sizes) == L - 3  # every call one set
    counts = ", ".join(f"{sizes.count(n)} x {n} token{'s' * (n > 1)}" for n in sorted(set(sizes)))
    assert summary == "--- network calls revealed: " + counts
    ids = [BYTES.bos_id, *b"abcde", BYTES.eos_id, BYTES.pad_id]
    steps = [-1, -1, -1, 1, 1, 0, 2, setdiff.ERASED]
    picture, summary = sample.decode_order(BYTES, ids, steps).splitlines()[1:]
    assert picture == "ab[cd]1[e]0[\\n]2"
    assert summary == "--- network calls revealed: 2 x 1 token, 1 x 2 tokens"
    # EOS beats every letter: with --stop-at-eos the sample ends at its first generated EOS
    common = ("--ckpt", ckpts / "eos.pt", "--prompt", "Hi", "--temperature", 0)
    ((header, text),) = samples_of(sample_ok(capsys, *common, "--stop-at-eos"))
    ((full, _),) = samples_of(sample_ok(capsys, *common))
    assert text == "Hi" and calls_of(header) < calls_of(full) == L - 3
    # no BOS (as OWT): start from EOS, the prompt as it is; a released folder has no val rows
    out = sample_ok(capsys, "--ckpt", ckpts / "owt.pt", "--prompt", "Hi", "--max-new-tokens", 5)
    assert re.fullmatch("Hi[a-z]{5}", samples_of(out)[0][1])  # no BOS in front: nothing left out
    out = sample_ok(capsys, "--ckpt", ckpts / "owt.pt", "--max-new-tokens", 4)
    assert re.fullmatch("[a-z]{4}", samples_of(out)[0][1])  # after EOS, the start of a document
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", *LETTERS]
    model = letters_model(pad_id=0, bos_id=2, eos_id=2, mask_id=4, vocab_size=len(vocab))
    with torch.no_grad():  # words and letters only: no [PAD], no [CLS] (EOS, a line break)
        model.head.bias.copy_(torch.tensor([-10.0] * 5 + [10.0] * (len(vocab) - 5)))
    folder = write_released(tmp_path / "lm1b-setdlm", model, vocab)
    out = sample_ok(capsys, "--ckpt", folder, "--prompt", "the cat", "--max-new-tokens", 3)
    assert "(released model)" in out and re.fullmatch(r"the cat( \S+){3}", samples_of(out)[0][1])
    code, _, err = run_sample(capsys, "--ckpt", folder, "--eval")
    assert code == 2 and "pass --eval FILE" in err
    # --eval FILE: the bound on rows built by hand, the tail in a padded row, every byte counted
    # (a byte a token, a newline per EOS); no PAD (as OWT): L-token rows, the tail left out, said
    st = ("--ckpt", ckpts / "st.pt", "--eval")
    out = sample_ok(capsys, *st, ckpts / "val.txt", "--num-orders", 2)
    stream = [i for line in VAL_TEXT for i in BYTES.encode(line) + [BYTES.eos_id]]
    rows, rest = wrapped_by_hand(stream, BYTES.bos_id, BYTES.eos_id, BYTES.pad_id)
    assert rest == [] and (rows[-1] == BYTES.pad_id).any()  # the tail is in a padded row
    res = elbo(letters_model(), rows, num_orders=2, generator=gen(0))
    assert f"val {res.line(len(stream))}" in out and "padded with PAD" in out
    out = sample_ok(capsys, *st, ckpts / "short.txt")  # < one row
    row = torch.tensor([[BYTES.bos_id, *b"hello", BYTES.eos_id] + [BYTES.pad_id] * (L - 7)])
    res = elbo(letters_model(), row, generator=gen(0))
    assert f"val {res.line(6)}" in out and res.tokens_scored == 6  # padding is never scored
    out = sample_ok(capsys, *st, "--eval-rows", 4, "--batch-size", 2, "--seed", 3)
    val = torch.from_numpy(np.fromfile(ckpts / "val.bin", dtype=np.uint16).astype(np.int64))
    res = elbo(letters_model(), val.view(-1, L)[:4], generator=gen(3))
    assert f"val {res.line(4 * (L - 2))}" in out and "validation split" in out  # no FILE
    out = sample_ok(capsys, "--ckpt", ckpts / "owt.pt", "--eval", ckpts / "val.txt")
    rows, rest = wrapped_by_hand(stream, None, None)
    res = elbo(letters_model(bos_id=None, pad_id=None), rows, generator=gen(0))
    assert f"val {res.line(len(rows) * (L - 1))}" in out and len(rest) > 0
    assert f"not scored: the text's last {len(rest)} tokens (~{len(rest)} bytes)" in out


SAMPLE_BAD_INPUT = [  # (arguments: {d} the checkpoint folder, {st} a good checkpoint; what stderr says)
    ("--ckpt {d}/missing.pt", "not found"),
    ("--ckpt {d}/not-a-model", "is a folder without config.json"),
    ("--ckpt {d}/cut.pt", "not a readable checkpoint"),
    ("--ckpt {d}/foreign.pt", "not a setdiff checkpoint"),
    ("--prompt hello", "--ckpt"),
    ("{st} --prompt " + "x" * L, f"--prompt is {L + 1} tokens (with BOS)"),
    ("{st} --prompt hi --max-new-tokens 30", "--max-new-tokens must be at most 21"),
    ("{st} --window 7", "--window must be in [1, 6]"),  # s = 6
    ("{st} --top-p 0", "--top-p must be in (0, 1]"),
    ("{st} --top-p 1.5", "--top-p must be in (0, 1]"),
    ("{st} --temperature -1", "--temperature must be >= 0"),
    ("{st} --threshold nan", "--threshold must be a number"),
    ("{st} --infill no-holes", "nothing to fill"),
    ("{st} --infill ___0", "___0"),
    ("{st} --infill " + "[MASK]" * L, f"--infill is {L + 1} tokens"),
    ("{st} --infill [MASK] --max-new-tokens 3", "--max-new-tokens"),
    ("{st} --prompt a --infill [MASK]", "not allowed"),
    ("{st} --eval {d}/missing.txt", "not a file"),
    ("{st} --eval {d}/empty.txt", "is empty"),
    ("{st} --eval {d}/binary.txt", "UTF-8"),
    ("--ckpt {d}/owt.pt --eval {d}/short.txt", "fill no row"),
    ("--ckpt {d}/noval.pt --eval", "pass --eval FILE"),
    ("--ckpt {d}/gone.pt --eval", "pass --eval FILE"),
    ("{st} --num-samples 0", "must be at least 1"),
    ("{st} --threads 0", "must be at least 1"),
    ("{st} --span-len two", "invalid integer"),
    ("{st} --device nonsense", "--device"),
    ("{st} --no-such-flag", "unrecognized"),
]


@pytest.mark.parametrize("argv,message", SAMPLE_BAD_INPUT)
def test_sample_bad_input(ckpts, capsys, argv, message):
    code, _, err = run_sample(capsys, *argv.format(d=ckpts, st=f"--ckpt {ckpts}/st.pt").split())
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert message in err, err


# ---------------------------------------------------------------------------- experiments/
# experiments/*.py as modules, the way the tests call their functions (frontier.py imports bench)
sys.path.insert(0, str(ROOT / "experiments"))
names = ["bench", "compare", "order_stats", "plot", "infill", "frontier"]
bench, compare, order_stats, plot, infill, frontier = map(importlib.import_module, names)


@torch.no_grad()
def test_bench_plain_decoder_cache_check_and_conclusions(monkeypatch):
    """The peer: each greedy token is the argmax of ONE cache-free causal forward; conclusions."""
    model = letters_model()
    model.head.bias.zero_()  # greedy over letters alone soon repeats one: over all ids it varies
    prompt = torch.tensor([[BYTES.bos_id, 104, 105], [BYTES.bos_id, 120, 121]])  # one call
    plain = bench.plain_decoder(model, prompt, L - 3, temperature=0, top_p=1)
    causal = torch.ones(1, L - 1, L - 1).tril().bool()
    h = model.run(plain.tokens[:, :-1], torch.arange(L - 1).expand(2, -1), causal)
    assert torch.equal(plain.tokens[:, :3], prompt)
    assert torch.equal(model.logits(h).argmax(-1)[:, 2:], plain.tokens[:, 3:])
    assert plain.tokens[:, 3:].unique().numel() > 3 and plain.nfe == L - 3
    assert plain.tokens_per_step == 1
    assert plain.reveal_step[1].tolist() == [-1] * 3 + list(range(L - 3))
    # the cache check: on a float64 copy (the model stays float32); it fails a forgetful cache
    model = letters_model()
    spy = mock.Mock(wraps=generate)
    store = setdiff.KVCache.store

    def forgetful(cache, new_idx, new_valid):  # stores nothing after the first call
        if not cache.filled.any():
            store(cache, new_idx, new_valid)

    monkeypatch.setattr(setdiff, "generate", spy)
    assert bench.cache_is_exact(model, 3, window=4)
    seen = [next(call.args[0].parameters()).dtype for call in spy.call_args_list]
    assert seen == [torch.float64] * 2 and next(model.parameters()).dtype == torch.float32
    monkeypatch.setattr(setdiff.KVCache, "store", forgetful)
    assert not bench.cache_is_exact(model, 3, window=4)
    samplers = bench.variants(model.cfg, dict(temperature=1.0, top_p=1.0))  # the conclusions:
    assert list(samplers)[:3] == ["cached, w=4", "cache-free, w=4", "w=d=3, tau=1.01"]
    speed = {"w=d=3, tau=0.3": 150.0, "w=d=3, tau=0.1": 300.0, "w=s=6, tau=0.1": 90.0}
    timings = {(name, 1): (1.0, speed.get(name, 50.0), 1.2) for name in [bench.PLAIN, *samplers]}
    timings["cached, w=4", 1] = (1.0, 120.0, 1.0)
    timings[bench.PLAIN, 1] = (1.0, 100.0, 1.1)
    timings["w=d=3, tau=0.3", 1] = (1.25, 150.0, 1.3)
    assert bench.conclusions(1, samplers, timings) == [
        "batch 1, greedy: the KV cache runs at 2.40x the cache-free speed",  # 120 / 50
        "batch 1, w=d=3: the set sampler overtakes the plain decoder at tau=0.3, 1.25 tokens/call (1.50x)",
        "batch 1, w=s=6: the plain decoder is faster at every threshold",
    ]
    timings["w=s=6, tau=0.5", 1] = (1.0, 50.0, 1.6)  # one run of one sampler 1.6x another
    lines = bench.conclusions(1, samplers, timings)
    assert "2.40x" in lines[0] and "overtakes" in lines[1]  # those lines rest on other samplers
    assert lines[2].startswith("batch 1, w=s=6: the repeats disagree (slowest/fastest 1.60 > 1.5)")


def test_bench_order_stats_and_plot_scripts(ckpts, tmp_path, capsys, monkeypatch):
    argv = ["experiments/bench.py", "--ckpt", str(ckpts / "st.pt"), "--repeats", "1"]
    r = python(*argv, "--batch-sizes", "1", "2")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "command: python " + " ".join([*argv, "--batch-sizes", "1", "2"]) in r.stdout
    assert "warm-up round done" in r.stdout
    assert re.search(r"^device: cpu \(.+\); float32 \(.+\); \d+ threads \(.+\)$", r.stdout, re.M)
    row = r"^\| (plain|cached|cache-free|w=[ds]=\d)[^|]* \|( [\d.,]+ \|){4} [\d.]+x \|$"
    rows = re.findall(row, r.stdout, re.M)
    assert len(rows) == 15 and rows[0][0] == "plain"
    assert "cached = cache-free (greedy, float64, batch 2): yes" in r.stdout
    verdict = r"^batch [12], (greedy|w=[ds]=[36]): "
    verdict += r"the (KV cache|set sampler|plain decoder|repeats) "
    assert len(re.findall(verdict, r.stdout, re.M)) == 6
    r = python("experiments/order_stats.py", "--ckpt", str(ckpts / "l40.pt"))
    names = re.findall(r"^\| (.+?) \|", r.stdout, re.M)[1:]
    assert r.returncode == 0 and names == ["staggered d=3, s=6", "ar", "block d=3", "uniform"]
    assert "| ar | 1.000 | 1.000 | 0.00 | 0.00 |" in r.stdout and "positions 16..23)" in r.stdout
    r = python("experiments/order_stats.py", "--ckpt", str(ckpts / "st.pt"))
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "L >= 33" in r.stderr
    # order_stats via sample_order (L = 128, 4,000 orders, positions 16..111): P(left neighbour
    # first), P(4 left ones first), E(masked of 16 left), E(revealed of 4 right); seeds spread 0.003
    cases = [
        ("staggered", 4, 8, (0.670, 0.432, 1.01, 0.87)),  # the authors' reference sampler; a pin
        ("block", 4, None, (0.625, 25 / 48, 0.75, 0.75)),  # 1/4 + 3/4 * 1/2, (1 + ... + 1/4) / 4
        ("uniform", 128, 128, (0.5, 0.2, 8, 2)),  # 1/2, 1/5, 16/2, 4/2
    ]
    for order, d, s, want in cases:
        got = order_stats.order_stats(Config(seq_len=128, order=order, set_size=d, max_set_size=s))
        assert got[:2] == pytest.approx(want[:2], abs=0.004), order
        assert got[2:] == pytest.approx(want[2:], abs=0.015), order
    # plot.py: the curves of metrics.jsonl, the 10% rule of a --json; figures in ASSETS, or one line
    records = [dict(kind="val", tokens=200, bits_per_byte=3.5)]
    records += [dict(kind="train", tokens=100, loss=1.0)]
    records += [dict(kind="val", tokens=100, bits_per_byte=4.25)]
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    b = dict(kind="val", tokens=100, bits_per_byte=5.0)
    (tmp_path / "b.jsonl").write_text(json.dumps(b) + "\n")
    assert plot.training_curve(tmp_path / "a" / "metrics.jsonl") == [(100, 4.25), (200, 3.5)]
    samples = [dict(model="m", window=2, threshold=None, tokens_per_call=1.0, judge_nll=2.0)]
    for t, n in ((1.5, 2.19), (3.0, 2.3)):
        samples += [dict(model="m", window=2, threshold=0.5, tokens_per_call=t, judge_nll=n)]
    cmp = dict(samples=samples, validation=dict(judge_nll=1.0))
    (tmp_path / "cmp.json").write_text(json.dumps(cmp))
    monkeypatch.setattr(plot, "ASSETS", tmp_path)
    code = plot.main([str(tmp_path / name) for name in ("a/metrics.jsonl", "b.jsonl", "cmp.json")])
    out, err = capsys.readouterr()
    assert "| training tokens | a | b |" in out and "| 100 | 4.250 | 5.000 |" in out
    assert "| 200 | 3.500 | nan |" in out and "| m, w=2 | 1.50 |" in out  # 2.19 <= 1.1 x 2.0 < 2.3
    if importlib.util.find_spec("matplotlib"):
        assert code == 0 and (tmp_path / "training.png").exists()
        assert (tmp_path / "frontier.png").exists()
    else:
        assert code == 2 and err == "error: drawing needs matplotlib (pip install matplotlib)\n"
    assert plot.main([str(tmp_path / "x.txt")]) == 2
    assert "give metrics.jsonl files" in capsys.readouterr().err


def test_compare_writes_the_figures_data_checks_first_and_text_stats(ckpts, tmp_path, capsys):
    argv = [ckpts / "ar.pt", ckpts / "copy.pt", "--judge", ckpts / "ar.pt", "--samples", 3]
    assert compare.main([*argv, "--eval-rows", 4, "--json", tmp_path / "cmp.json"]) == 0
    out = capsys.readouterr().out
    assert len(re.findall(r"^\| staggered d=3, s=6 \| [36] \| (>1|0\.\d+) \|", out, re.M)) == 2 * 8
    ar_row = r"^\| ar \| [\d.]+ \| [\d.]+ \+- [\d.]+ \| [\d.]+ \| 92 \|$"  # 4 x 23 tokens
    assert re.search(ar_row, out, re.M)
    cmp = json.loads((tmp_path / "cmp.json").read_text())
    assert [b["num_orders"] for b in cmp["bounds"]] == [4, 4] and len(cmp["samples"]) == 1 + 16
    x = torch.from_numpy(np.fromfile(ckpts / "val.bin", dtype=np.uint16).astype(np.int64))
    res = elbo(letters_model(), x.view(-1, L)[:4], num_orders=4, generator=gen(0))
    assert cmp["bounds"][1]["nll_per_token"] == pytest.approx(res.nll_per_token, rel=1e-6)
    assert cmp["bounds"][1]["bits_per_byte"] == pytest.approx(res.nll / math.log(2) / (4 * (L - 2)))
    lines = plot.frontier(cmp)
    assert list(lines) == ["ar, w=1", "staggered d=3, s=6, w=3", "staggered d=3, s=6, w=6"]
    assert all(points == sorted(points) and points[0][0] >= 1 for points in lines.values())
    samples = cmp["samples"]
    base = {(r["model"], r["window"]): r["judge_nll"] for r in samples if r["threshold"] is None}
    for name, value in plot.within(cmp).items():  # by hand: the most tokens per call within 1.1x
        mine = [r for r in samples if f"{r['model']}, w={r['window']}" == name]
        limit = 1.1 * base[mine[0]["model"], mine[0]["window"]]
        assert value == max(r["tokens_per_call"] for r in mine if r["judge_nll"] <= limit)
    no_folder = ["--json", tmp_path / "no/such/x.json"]
    cases = [
        ([ckpts / "st.pt", "--judge", ckpts / "st.pt"], "--order ar"),
        ([ckpts / "other.pt", "--judge", ckpts / "ar.pt"], "not trained on the data"),
        ([ckpts / "st.pt", "--judge", ckpts / "ar.pt", *no_folder], "folder does not exist"),
    ]
    for argv, message in cases:
        assert compare.main(argv) == 2
        out, err = capsys.readouterr()
        assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1
        assert "model:" not in out  # nothing scored before the error
    judge = letters_model("ar")  # the text statistics, by their closed forms
    x = torch.tensor([[BYTES.bos_id, *BYTES.encode("the cat sat on the mat, it sat")[:23]]])
    logp = torch.log_softmax(judge(x, torch.arange(L)[None]).double(), -1)
    got = compare.text_stats(judge, x)
    nll = -logp[:, 1:].gather(-1, x[:, 1:, None]).mean().item()
    assert got["judge_nll"] == pytest.approx(nll, rel=1e-5)
    p = torch.tensor([x[0, 1:].tolist().count(c) for c in set(x[0, 1:].tolist())]) / 23  # no BOS
    assert got["unigram_entropy"] == pytest.approx(-(p * p.log2()).sum().item())
    grams = {tuple(x[0, i : i + 4].tolist()) for i in range(1, 21)}
    assert got["distinct_4grams"] == len(grams) / 20
    same = torch.tensor([[BYTES.bos_id] + [7] * 23] * 2)
    assert compare.text_stats(judge, same)["distinct_4grams"] == 1 / 40


def test_infill_spans_bounds_and_fills_against_the_chain_rule():
    """Spans away from EOS at 56..59 in turn; an AR model's bounds are its chain rule, a query
    forward at a time (left side: the left context; both sides: all context, then the span
    left to right); its fill is the greedy chain from the left side; G = left - both."""
    rows = np.random.default_rng(0).integers(97, 123, (12, 72)).astype(np.uint16)
    rows[:, 0] = BYTES.bos_id
    rows[1, 60] = BYTES.eos_id  # a sentence break in row 1's span: skipped
    x, starts = infill.pick_spans(rows, 6, BYTES.eos_id)
    assert starts.tolist() == [56, 57, 58, 59, 56, 57] and x[1].tolist() == rows[2].tolist()
    model = tiny_model(order="ar", seq_len=72, n_layer=1)

    def query(row, revealed, target):  # log p(. | x_revealed) at `target`, one query after them
        n = len(revealed)
        attn = torch.ones(n + 1, n + 1, dtype=torch.bool).tril()
        attn[n] = True
        tokens = torch.cat([row[revealed], torch.tensor([model.cfg.mask_id])])[None]
        z = model.logits(model.run(tokens, torch.tensor([revealed + [target]]), attn[None]))
        return torch.log_softmax(z.double(), -1)[0, -1]

    def chain(row, revealed, span):  # sum of -log p(x_t | all revealed before t)
        return -sum(query(row, revealed + span[:k], t)[row[t]].item() for k, t in enumerate(span))

    res = infill.span_bounds(model, x, starts, mock.Mock(num_orders=2, seed=0))
    left = both = 0.0
    for row, a in zip(x, starts.tolist()):
        span = list(range(a, a + infill.SPAN))
        left += chain(row, list(range(a)), span)
        both += chain(row, [p for p in range(72) if p not in span], span)
    assert res["left"] == pytest.approx(left / 48, abs=1e-4)
    assert res["both"] == pytest.approx(both / 48, abs=1e-4)
    assert res["gain"] == res["left"] - res["both"]
    for row, a, fill in zip(x, starts.tolist(), infill.fill(model, x, starts)):
        chosen = row.clone()
        for t in range(a, a + infill.SPAN):
            chosen[t] = query(chosen, list(range(t)), t).argmax()
        assert fill.tolist() == chosen[a : a + infill.SPAN].tolist()


def test_frontier_task_metric_and_a_run_on_two_tiny_models(tmp_path, capsys):
    frontier.write_task(tmp_path / "a", train=300, test=8)
    frontier.write_task(tmp_path / "b", train=300, test=8)
    lines = (tmp_path / "a" / "train.txt").read_text().splitlines()
    assert lines == (tmp_path / "b" / "train.txt").read_text().splitlines() and len(lines) == 300
    for line in lines:  # the chain evaluated independently, with Python's own arithmetic
        m = re.fullmatch(r"Q:(\d)((?:[+-]1){8}) A:((?:\d ){8})#(\d)", line)
        value, values = int(m[1]), []
        for step in re.findall(r"[+-]\d", m[2]):
            value = eval(f"({value} {step}) % 10")
            values.append(str(value))
        assert m[3].split() == values and m[4] == values[-1]
    assert [frontier.final_answer(t) for t in ("2 8 #5", "2 8 #", "2 8", "#1 #7 ")] == [
        "5",
        "",
        "",
        "7",
    ]
    pairs = frontier.read_test(tmp_path / "a" / "test.txt")
    paths = [tmp_path / "ar.pt", tmp_path / "st.pt"]
    for path, order in zip(paths, ("ar", "staggered")):
        setdiff.save_checkpoint(
            path, tiny_model(order=order, seq_len=96, n_layer=1, set_size=4), BYTES
        )
    rows = frontier.frontier(paths, pairs, "cpu")
    taus = [None, 0.9, 0.7, 0.5, 0.3, 0.2, 0.1, 0.05]
    want = [("plain causal decoder", 1, None), ("ar", 1, None)]
    assert [(r["model"], r["window"], r["threshold"]) for r in rows] == want + [
        ("staggered d=4", w, t) for w in (4, 8) for t in taus
    ]
    assert rows[0]["accuracy"] is None  # the plain decoder gives a speed, not an accuracy
    shots = pairs[-1:] + pairs[:-1]  # accuracy by hand, from answers decoded here
    prompt = [
        [BYTES.bos_id] + BYTES.encode(s + a) + [BYTES.eos_id] + BYTES.encode(q)
        for (s, a), (q, _) in zip(shots, pairs)
    ]
    prompt = torch.tensor(prompt)
    out = generate(
        load_checkpoint(paths[1])[0],
        prompt=prompt,
        max_new_tokens=18,
        temperature=0,
        window=8,
        threshold=0.3,
    )
    finals = [BYTES.decode(row[prompt.shape[1] :]).rsplit("#", 1)[-1].strip() for row in out.tokens]
    row = next(
        r
        for r in rows
        if r["model"] == "staggered d=4" and r["threshold"] == 0.3 and r["window"] == 8
    )
    assert row["accuracy"] == 100 * sum(f == a[-1] for f, (_, a) in zip(finals, pairs)) / 8
    assert row["tokens_per_call"] == out.tokens_per_step and all(
        r["tokens_per_s"] > 0 for r in rows
    )
    (tmp_path / "r.json").write_text(json.dumps(dict(frontier=rows)))
    with mock.patch.object(plot, "draw") as draw:  # the figure's data reaches the drawing
        assert plot.main([str(tmp_path / "r.json")]) == 0
    assert draw.call_args.args[2]["frontier"] == rows
