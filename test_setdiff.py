"""Tests for setdiff.py in the file's order, each against an independent computation: a brute-force loop, a closed
form, a worked example, or the slow reference path. CPU, float32 unless exactness needs float64."""

import json
import math
import re
from dataclasses import asdict

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import setdiff
from setdiff import (Config, Elbo, SetDiffusionLM, StaggeredSchedule, Tokenizer, elbo, generate,
                     load_checkpoint, max_window, sample_order, save_checkpoint, set_causal_mask)

BYTES = Tokenizer.bytes()
# Tiny models gain nothing from intra-op threads, and on a busy 2-core machine the threads'
# contention made this file 2-10x slower (measured): one thread keeps it at a few seconds.
torch.set_num_threads(1)

def gen(seed):
    return torch.Generator().manual_seed(seed)

def tiny_cfg(**kw):
    base = dict(vocab_size=260, seq_len=24, n_layer=2, n_head=2, d_model=32, dropout=0.0, order="staggered",
                set_size=3, pad_id=BYTES.pad_id, bos_id=BYTES.bos_id, eos_id=BYTES.eos_id, mask_id=BYTES.mask_id)
    return Config(**{**base, **kw})

def tiny_model(seed=0, dtype=torch.float32, **kw):
    """A small random model whose head is NOT zero, so predictions depend on the input."""
    torch.manual_seed(seed)
    model = SetDiffusionLM(tiny_cfg(**kw))
    torch.nn.init.normal_(model.head.weight, std=1.0)
    return model.to(dtype).eval()

def random_rows(cfg, n, seed=0):
    x = torch.randint(0, 256, (n, cfg.seq_len), generator=gen(seed))
    x[:, 0] = cfg.bos_id
    return x

def infill_canvas(cfg, spans, seed=0):
    """Random rows with MASK over `spans` [(row, start, end), ...] -> (rows, holes, infill)."""
    rows = random_rows(cfg, 1 + max(r for r, _, _ in spans), seed)
    holes = torch.zeros_like(rows, dtype=torch.bool)
    for r, a, b in spans:
        holes[r, a:b] = True
    return rows, holes, torch.where(holes, cfg.mask_id, rows)

def decode_order_from_steps(reveal_step):
    """Full decode order from reveal steps: by (step, position); given tokens have step -1."""
    T = reveal_step.shape[1]
    return torch.argsort(reveal_step * (T + 1) + torch.arange(T), dim=1, stable=True)

# ---------------------------------------------------------------------------- config

@pytest.mark.parametrize("kw,match", [
    (dict(order="random"), "unknown order policy"), (dict(set_size=25), "set_size"),
    (dict(set_size=3, max_set_size=2), "max_set_size"), (dict(seq_len=1, set_size=1), "seq_len"),
    (dict(d_model=30, n_head=4), "heads"), (dict(pad_id=257), "distinct")])
def test_config_rejects_bad_settings(kw, match):
    cfg = tiny_cfg()
    assert Config(**json.loads(json.dumps(asdict(cfg)))) == cfg      # as a checkpoint stores it
    with pytest.raises(ValueError, match=match):
        Config(**{**asdict(cfg), **kw})

# ---------------------------------------------------------------------------- order policies, staggered schedule

@pytest.mark.parametrize("d,b,k", [(4, 0.059259, 0.358090), (8, 0.111888, 0.387534), (16, 0.201258, 0.450425)])
def test_schedule_constants_closed_form(d, b, k):
    s = StaggeredSchedule(128, d)
    assert round(s.b, 6) == b and round(s.k, 6) == k      # the paper's L = 128 values
    assert math.isclose(s.b, 2 * d / (128 + 2 * d - 1)) and math.isclose(s.b * s.k / (s.k + 1), d / 256)
    assert math.isclose(s.reach, 2 * d) and s.window == 2 * d               # r = s exactly
    assert math.isclose(s.loc[0].item(), 1 - s.b) and s.loc[-1].item() == 0.0

def test_schedule_special_cases():
    s = StaggeredSchedule(128, 4, 4)                        # d == s: k = 1, b = d / L
    assert s.k == 1 and math.isclose(s.b, 4 / 128) and math.isclose(s.reach, 4 * 127 / 124) and s.window == 5
    u = StaggeredSchedule(10, 10, 10)                       # uniform: b = 1, every loc 0
    assert u.b == 1 and torch.all(u.loc == 0) and u.window == 10
    for args in [(8, 9), (8, 4, 3), (8, 0)]:
        with pytest.raises(ValueError):
            StaggeredSchedule(*args)

@pytest.mark.parametrize("L,d,s", [(16, 3, 6), (16, 4, 4), (12, 2, 7), (9, 1, None)])
def test_mask_prob_closed_form_and_first_hitting_times(L, d, s):
    sched = StaggeredSchedule(L, d, s)
    t = torch.linspace(0, 1, 41, dtype=torch.float64)
    m = sched.mask_prob(t)
    for a in range(0, 41, 4):                               # closed form, scalar by scalar
        for i in range(L):
            u = (t[a].item() - sched.loc[i].item()) / sched.b
            want = 0.0 if u <= 0 else 1.0 if u >= 1 else 1 - (1 - u) ** sched.k
            assert abs(m[a, i].item() - (float(want > 0) if d == 1 else want)) < 1e-12
    if d > 1:       # d = 1 is a hard step (m an indicator, T continuous): its order is checked below
        N = 20000   # P(T_i <= t) = m_i(t): the empirical CDF of the first hitting times
        emp = (sched.first_hitting_times(N, gen(1))[None] <= t[:, None, None]).double().mean(1)  # (41, L)
        assert torch.all((emp - m).abs() <= 5 * torch.sqrt(m * (1 - m) / N) + 2e-3)

@pytest.mark.parametrize("d,s", [(4, 8), (3, 5), (4, 4), (6, 6)])
def test_reach_bounds_revealed_tokens(d, s):
    """Replay sampled orders: every revealed token stays within ceil(r) of the leftmost
    unrevealed position, including the d = s case where r is slightly more than d."""
    L, sched = 40, StaggeredSchedule(40, d, s)
    limit, worst = math.ceil(sched.b * (L - 1) / (1 - sched.b) - 1e-9), 0
    for order in torch.argsort(-sched.first_hitting_times(400, gen(2)), 1).tolist():
        revealed, f = [False] * L, 0
        for p in order:
            revealed[p] = True
            while f < L and revealed[f]:
                f += 1
            if f < L:                # farthest revealed token beyond the leftmost unrevealed one
                worst = max(worst, max(i for i in range(L) if revealed[i]) - f)
    assert d - 1 <= worst < limit    # and the policy really does reach ahead (not the identity)

def test_d1_gives_identity_and_uniform_gives_uniform_orders():
    T = StaggeredSchedule(32, 1).first_hitting_times(500, gen(3))
    assert torch.equal(torch.argsort(-T, 1), torch.arange(32).expand(500, -1))
    assert torch.equal(sample_order(tiny_cfg(order="ar"), 3, gen(3)), torch.arange(24).expand(3, -1))
    N, cfg = 12000, tiny_cfg(seq_len=6, order="uniform", set_size=6)
    order = sample_order(cfg, N, gen(4))
    assert torch.all(order[:, 0] == 0)                       # BOS pinned first
    freq = torch.stack([torch.bincount(order[:, slot], minlength=6)[1:] for slot in range(1, 6)]) / N
    assert torch.all((freq - 0.2).abs() < 5 * math.sqrt(0.2 * 0.8 / N))   # positions 1..5 at slots 1..5

def test_block_order_and_pinning():
    pad, cfg = (torch.arange(12) >= 10).expand(200, -1), tiny_cfg(seq_len=12, order="block", set_size=4)
    order = sample_order(cfg, 200, gen(5), prefix_len=2, pad_mask=pad)
    for row in order.tolist():
        assert row[:2] == [0, 1] and row[-2:] == [10, 11]    # BOS + prefix first, padding last, in order
        blocks = [p // 4 for p in row[2:10]]
        assert sorted(row) == list(range(12)) and blocks == sorted(blocks)   # blocks left to right
    assert len({tuple(r[2:4]) for r in order.tolist()}) > 1  # random inside block 0

@pytest.mark.parametrize("order,d,s,p_left,p_all4", [
    ("staggered", 4, 8, 0.670, 0.432),   # the authors' reference sampler
    ("block", 4, None, 0.625, 25 / 48),  # exact: 1/4 + 3/4 * 1/2 and (1 + 1/2 + 1/3 + 1/4) / 4
    ("uniform", 128, 128, 0.5, 0.2)])    # exact: 1/2 and 1/5
def test_left_neighbours_revealed_first(order, d, s, p_left, p_all4):
    """Through sample_order, the path training uses (L = 128, positions 16..111 away from the ends): how
    often position i's left neighbour, and all four left neighbours, precede i. Rows are independent, a row's
    positions are not: 5 standard errors of the mean of 4000 per-row frequencies, plus 3-decimal rounding."""
    cfg = Config(seq_len=128, order=order, set_size=d, max_set_size=s)
    slot = torch.argsort(sample_order(cfg, 4000, gen(0)), 1)              # (N, L) slot of each position
    i = torch.arange(16, 112)
    before = torch.stack([slot[:, i - j] < slot[:, i] for j in range(1, 5)])   # (4, N, 96)
    for event, want in ((before[0], p_left), (before.all(0), p_all4)):
        per_row = event.double().mean(1)                                   # (N,) independent
        se = per_row.std().item() / math.sqrt(len(per_row))
        assert abs(per_row.mean().item() - want) <= 5 * se + 5e-4, (per_row.mean(), want)

@pytest.mark.parametrize("kw,want", [
    (dict(order="ar"), 1), (dict(order="uniform"), 24), (dict(order="block", set_size=4), 4),
    (dict(set_size=4), 8), (dict(set_size=4, max_set_size=4), math.ceil(4 * 23 / 20))])
def test_max_window_per_policy(kw, want):
    assert max_window(tiny_cfg(**kw)) == want

# ---------------------------------------------------------------------------- set-causal masks

def test_mask_equals_worked_example():
    rows = ["1000 0000", "1100 0000", "1110 0000", "1111 0000",     # clean slots c0..c3
            "0000 1000", "1000 0100", "1100 0010", "1110 0001"]     # mask slots m0..m3
    assert torch.equal(set_causal_mask(4), torch.tensor([[c == "1" for c in r if c != " "] for r in rows]))
    assert "m3 [ 1  1  1  0 |  0  0  0  1 ]" in setdiff.show_mask(set_causal_mask(4))

@pytest.mark.parametrize("L", [1, 2, 3, 5, 8, 13])
def test_mask_equals_brute_force_definition(L):
    """Clean slot i sees clean j <= i, no mask slot; mask slot i sees clean j < i, and itself."""
    mask = set_causal_mask(L)
    for q in range(2 * L):
        for k in range(2 * L):
            i, j, k_clean = q % L, k % L, k < L
            want = (k_clean and j <= i) if q < L else (j < i if k_clean else i == j)
            assert bool(mask[q, k]) == want, (L, q, k)

# ---------------------------------------------------------------------------- transformer

def test_network_sees_positions_only_through_ids():
    """Permuting the slots (tokens, positions and mask together) permutes the output, and
    shifting every position id by a constant changes nothing: rotary is relative."""
    model, p = tiny_model(), torch.randperm(10, generator=gen(1))
    tokens, positions = random_rows(model.cfg, 1)[:, :10], torch.tensor([[0, 7, 3, 2, 9, 1, 5, 4, 8, 6]])
    attn = (torch.rand(1, 10, 10, generator=gen(0)) < 0.5) | torch.eye(10, dtype=torch.bool)
    h = model.run(tokens, positions, attn)
    assert torch.allclose(model.run(tokens[:, p], positions[:, p], attn[:, p][:, :, p]), h[:, p], atol=1e-5)
    assert torch.allclose(model.run(tokens, positions + 13, attn), h, atol=1e-4)

# ---------------------------------------------------------------------------- two-stream forward, loss, bound

def test_training_forward_is_set_causal():
    """logits[i] depends on the tokens before i in the order, and on nothing else (x[i] included)."""
    model = tiny_model()
    x, order = random_rows(model.cfg, 1), sample_order(model.cfg, 1, gen(6))
    base, slot_of = model(x, order), torch.argsort(order[0])
    for j in range(1, model.cfg.seq_len):                   # BOS (j = 0) kept
        y = torch.where(torch.arange(24) == j, (x + 1) % 256, x)
        changed = ~torch.isclose(model(y, order)[0], base[0], atol=1e-6).all(-1)   # (L,)
        assert torch.equal(changed, slot_of[j] < slot_of), j

def test_training_forward_equals_one_query_at_a_time():
    """For every slot r feed only x[sigma_<r] (causal among themselves) and ONE mask query at
    position sigma_r: its logits must equal the two-stream forward's."""
    model = tiny_model()
    x, order = random_rows(model.cfg, 1, seed=5), sample_order(model.cfg, 1, gen(13))[0]
    full = model(x, order[None])[0]                                  # (L, V) position order
    for r in range(model.cfg.seq_len):
        tokens = torch.cat([x[0, order[:r]], torch.tensor([model.cfg.mask_id])])[None]
        attn = torch.ones(r + 1, r + 1).tril().bool()[None]          # the query sees all + itself
        z = model.logits(model.run(tokens, order[None, :r + 1], attn))[0, -1]
        assert torch.allclose(z, full[order[r]], atol=1e-5), r

def test_no_empty_rows_and_padded_gradients_are_finite(monkeypatch):
    m = torch.tensor([[True, False], [False, False]])
    assert torch.equal(setdiff.no_empty_rows(m), torch.tensor([[True, False], [True, True]]))
    model, run = tiny_model().train(), SetDiffusionLM.run
    x = random_rows(model.cfg, 2)
    x[1, 4:] = model.cfg.pad_id

    def checked_run(self, tokens, positions, attn, cache=None):
        assert attn.any(-1).all()                          # no query row attends nothing
        return run(self, tokens, positions, attn, cache)
    monkeypatch.setattr(SetDiffusionLM, "run", checked_run)
    model.loss(x, generator=gen(0)).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)

def test_mask_token_gets_zero_probability():
    model, cfg = tiny_model(), tiny_cfg()
    x, fresh = random_rows(cfg, 2), SetDiffusionLM(cfg)     # zero head: uniform over all but MASK
    assert math.isclose(fresh.loss(x, generator=gen(0)).item(), math.log(cfg.vocab_size - 1), rel_tol=1e-6)
    with torch.no_grad():
        model.head.weight[cfg.mask_id] = 50.0               # push hard towards MASK
    assert torch.all(F.softmax(model(x, sample_order(cfg, 2, gen(0))), -1)[..., cfg.mask_id] == 0)
    assert not (generate(model, batch_size=2, generator=gen(0)).tokens == cfg.mask_id).any()

def test_loss_equals_hand_computation_with_padding():
    model, cfg = tiny_model(), tiny_cfg()
    x = random_rows(cfg, 3)
    x[1, 15:] = x[2, 5:] = cfg.pad_id
    order = sample_order(cfg, 3, gen(7), pad_mask=x == cfg.pad_id)
    logp, want = torch.log_softmax(model(x, order).double(), -1), 0.0
    for b in range(3):                                      # the BOS slot is scored in training
        terms = [-logp[b, i, x[b, i]].item() for i in range(cfg.seq_len) if x[b, i] != cfg.pad_id]
        want += sum(terms) / len(terms) / 3
    assert abs(model.loss(x, order).item() - want) < 1e-4
    # padding is sorted last, and a padded row predicts its real positions as the row without padding
    assert sorted(order[2, :5].tolist()) == list(range(5))
    assert torch.allclose(model(x, order)[2, :5], model(x[2:3, :5], order[2:3, :5])[0], atol=1e-5)

def test_elbo_ar_equals_left_to_right_sum():
    model, cfg = tiny_model(order="ar"), tiny_cfg(order="ar")
    x = random_rows(cfg, 5)
    x[4, 20:] = cfg.pad_id
    res = elbo(model, x, num_orders=3, batch_size=2)
    logp = torch.log_softmax(model(x, torch.arange(24).expand(5, -1)).double(), -1)
    total = sum(-logp[b, i, x[b, i]].item() for b in range(5) for i in range(1, 24) if x[b, i] != cfg.pad_id)
    assert res.tokens == 4 * 23 + 19 and res.num_orders == 3 and res.num_seqs == 5
    assert abs(res.nll - total) < 1e-3 and math.isclose(res.ppl, math.exp(total / res.tokens), rel_tol=1e-3)

def test_elbo_averages_k_orders_with_standard_error():
    """Uniform policy: each row's NLL is the mean over K orders; BOS and padding unscored; the
    standard error is that of sum(NLL) / sum(tokens) with rows as units (delta method)."""
    model, cfg = tiny_model(order="uniform", set_size=24), tiny_cfg(order="uniform", set_size=24)
    x = random_rows(cfg, 4)
    x[2, 10:] = x[3, 17:] = cfg.pad_id
    res = elbo(model, x, num_orders=4, batch_size=4, generator=gen(3))
    g, nll, n = gen(3), [0.0] * 4, [23, 23, 9, 16]          # replay the same order draws
    for _ in range(4):
        logp = torch.log_softmax(model(x, sample_order(cfg, 4, g, pad_mask=x == cfg.pad_id)).double(), -1)
        for b in range(4):
            nll[b] += sum(-logp[b, i, x[b, i]].item() for i in range(1, 24) if x[b, i] != cfg.pad_id) / 4
    rate, mean_n = sum(nll) / sum(n), sum(n) / 4
    resid = [(a - rate * c) / mean_n for a, c in zip(nll, n)]
    se = math.sqrt(sum((r - sum(resid) / 4) ** 2 for r in resid) / 3) / 2
    assert res.tokens == sum(n) and abs(res.nll - sum(nll)) < 1e-3 and abs(res.se - se) < 1e-6

def test_elbo_metrics_and_line_by_hand():
    e = Elbo(nll=30 * math.log(2), tokens=10, num_orders=2, num_seqs=3, se=0.05)
    m = e.metrics(num_bytes=15)                             # 3 ln 2 nats/token; 30 bits / 15 bytes
    assert math.isclose(m["ppl_bound"], 8) and math.isclose(m["nll_per_token"], 3 * math.log(2))
    assert math.isclose(m["bits_per_byte"], 2) and m["se"] == 0.05
    assert (m["num_orders"], m["tokens_scored"], m["rows"], m["bytes"]) == (2, 10, 3, 15)
    for part in ("8.000", "2.0794", "0.0500", "2.0000", "3 rows", "10 tokens", "2 orders"):
        assert part in e.line(15), (part, e.line(15))

# ---------------------------------------------------------------------------- sampler

def test_top_p_truncates_and_confidence_is_the_drawn_probability():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    logits, g = p.log().expand(1, 20000, 4), gen(0)
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
    assert torch.allclose(freq, p.sqrt() / p.sqrt().sum(), atol=0.02)

def test_sampling_never_draws_zero_probability_tokens(monkeypatch):
    """u just below the total mass must not round up onto MASK, the last of the sorted distribution."""
    logits = torch.randn(2, 3, 260, generator=gen(0))
    logits[..., 259] = float("-inf")
    with monkeypatch.context() as mp:
        mp.setattr(torch, "rand", lambda *a, **k: torch.full(a[0], 1 - 2**-53, dtype=torch.float64))
        for top_p in (1.0, 0.9):
            cand, conf = setdiff.draw_candidates(logits, 1.0, top_p)
            assert not (cand == 259).any() and torch.all(conf > 0)
    cand, conf = setdiff.draw_candidates(logits, 1e-30, 1.0)          # tiny temperature ~ greedy
    assert torch.equal(cand, logits.argmax(-1)) and torch.all(conf == 1)

@pytest.mark.parametrize("with_infill", [False, True])
def test_cached_logits_equal_cache_free_logits_step_by_step(with_infill):
    """The two prediction paths give the same logits on every intermediate state (float64)."""
    model, cfg, T = tiny_model(dtype=torch.float64), tiny_cfg(), 24
    inputs = dict(infill=infill_canvas(cfg, [(0, 3, 10), (1, 12, 20)], seed=6)[2]) if with_infill else {}
    out = generate(model, batch_size=2, window=3, threshold=0.3, temperature=0.0, **inputs)
    cache, steps = setdiff.KVCache(cfg, 2, T, max_call=T + 3, device="cpu"), out.reveal_step
    for n in range(out.nfe):
        # state before step n: revealed = steps < n; the tokens of step n-1 (or the given ones) are pending
        canvas = torch.cat([torch.where(steps < n, out.tokens, cfg.mask_id), torch.full((2, 1), cfg.pad_id)], 1)
        active = setdiff.window_queries(canvas[:, :T] == cfg.mask_id, 3, None)
        z1, q1, v1 = setdiff.predict(model, canvas, *setdiff.gather_sets(steps == n - 1, T), active, T, cache)
        step_col = torch.cat([torch.where(steps < n, steps, -3), torch.full((2, 1), -3)], 1)
        z2, q2, v2 = setdiff.predict(model, canvas, *setdiff.revealed_in_decode_order(step_col, T), active, T)
        assert torch.equal(q1, q2) and torch.equal(v1, v2) and torch.allclose(z1[v1], z2[v2], atol=1e-10)

@pytest.mark.parametrize("case", [
    dict(order="staggered", window=3, threshold=float("inf")), dict(order="staggered", window=6, threshold=0.05),
    dict(order="block", window=3, threshold=0.1), dict(order="uniform", window=24, threshold=0.2, set_size=24),
    dict(order="ar", window=1, threshold=float("inf"))])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cached_generation_equals_cache_free(case, temperature):
    """Unconditional, prompted and infill generation; sampled decoding in float64 (a float32
    rounding difference may, rarely, flip a draw), greedy in float32. The context never changes."""
    case = dict(case)
    kw = dict(window=case.pop("window"), threshold=case.pop("threshold"), temperature=temperature, top_p=0.9)
    model = tiny_model(dtype=torch.float64 if temperature else torch.float32, **case)
    rows, holes, infill = infill_canvas(model.cfg, [(0, 2, 7), (0, 15, 18), (1, 20, 24), (2, 8, 16)], seed=5)
    prompt, bos = torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13]]), model.cfg.bos_id
    pos = torch.arange(24).expand(3, -1)
    for seed, inputs, given, context in [(8, dict(batch_size=3), pos < 1, torch.full((3, 24), bos)),
                                         (9, dict(prompt=prompt), pos < 4, F.pad(prompt, (1, 20), value=bos)),
                                         (10, dict(infill=infill), ~holes, rows)]:
        a = generate(model, generator=gen(seed), **inputs, **kw)
        b = generate(model, generator=gen(seed), use_cache=False, **inputs, **kw)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.reveal_step, b.reveal_step)
        assert a.nfe == b.nfe == int(a.steps.max()) and not (a.tokens == model.cfg.mask_id).any()
        assert torch.equal(a.reveal_step == -1, given) and torch.equal(a.tokens[given], context[given])

@pytest.mark.parametrize("order,window,set_size", [("staggered", 4, 3), ("block", 3, 3), ("uniform", 5, 24)])
def test_one_token_per_step_matches_training_forward(order, window, set_size):
    """Feed the generated sequence and its reveal order through model(x, order): the greedy
    choice at every generated position is the training forward's argmax there."""
    model = tiny_model(order=order, set_size=set_size)
    out = generate(model, batch_size=2, window=window, temperature=0.0, prompt=torch.tensor([65, 66]))
    assert torch.all(out.steps == out.new_tokens)                     # one token per step
    greedy, new = model(out.tokens, decode_order_from_steps(out.reveal_step)).argmax(-1), out.reveal_step >= 0
    assert torch.equal(greedy[new], out.tokens[new])

@pytest.mark.parametrize("use_cache", [True, False])
def test_sampler_distributions_equal_training_forward(use_cache, monkeypatch):
    """Sampled, one token per step (float64): the distribution drawn from at every step equals
    the training forward's at that position, given the final sequence and its reveal order."""
    model, seen, draw = tiny_model(dtype=torch.float64), [], setdiff.draw_candidates
    # a spy: record the logits of every draw, then draw as usual
    monkeypatch.setattr(setdiff, "draw_candidates", lambda z, *a, **k: seen.append(z.clone()) or draw(z, *a, **k))
    out = generate(model, window=4, temperature=1.0, generator=gen(15), use_cache=use_cache)
    ref = torch.log_softmax(model(out.tokens, decode_order_from_steps(out.reveal_step)), -1)[0]   # (L, V)
    assert len(seen) == out.nfe == 23
    for step, logits in enumerate(seen):
        pos = int((out.reveal_step[0] == step).nonzero())
        q = setdiff.window_queries(out.reveal_step[:1] >= step, 4, None)[0]   # masked before this step
        slot = int(q[:pos].sum())                                       # queries are in position order
        assert torch.allclose(torch.log_softmax(logits[0, slot], -1), ref[pos], atol=1e-9)

def test_block_windows_never_cross_block_boundaries():
    model = tiny_model(order="block", set_size=4)
    out = generate(model, batch_size=3, window=4, threshold=0.05, temperature=1.0, generator=gen(14))
    for row in out.reveal_step.tolist():
        for blk in range(5):
            here = [s for s in row[4 * blk:4 * blk + 4] if s >= 0]   # BOS is given
            assert max(here) < min(row[4 * blk + 4:4 * blk + 8])   # block j done before j+1 starts
        for step in set(row) - {-1}:
            assert len({p // 4 for p, s in enumerate(row) if s == step}) == 1   # one block per step
    assert generate(model, window=4, threshold=0.0, temperature=0.0).nfe == 24 // 4   # a block per step

def test_batched_equals_row_by_row():
    model = tiny_model()
    infill = infill_canvas(model.cfg, [(0, 2, 20), (1, 12, 14), (2, 5, 24)], seed=4)[2]   # rows end apart
    kw = dict(window=5, threshold=0.3, temperature=0.0)
    batched = generate(model, infill=infill, **kw)
    for b in range(3):
        single = generate(model, infill=infill[b:b + 1], **kw)
        assert torch.equal(single.tokens[0], batched.tokens[b])
        assert torch.equal(single.reveal_step[0], batched.reveal_step[b]) and single.nfe == batched.steps[b]
    assert batched.nfe == int(batched.steps.max())

def test_threshold_controls_tokens_per_step():
    model = tiny_model()
    one = generate(model, batch_size=2, window=3, threshold=1.5, temperature=0.0)
    assert torch.all(one.steps == one.new_tokens) and one.nfe == 23 and one.tokens_per_step == 1
    whole = generate(model, batch_size=2, window=3, threshold=0.0, temperature=0.0)
    assert whole.nfe == math.ceil(23 / 3) and math.isclose(whole.tokens_per_step, 23 / 8)   # whole window
    some = generate(model, batch_size=2, window=3, threshold=0.2, temperature=0.0)
    assert whole.nfe <= some.nfe <= one.nfe
    for row, n in zip(some.reveal_step.tolist(), some.steps.tolist()):
        assert {s for s in row if s >= 0} == set(range(n))               # never zero per step, per row

def test_stop_at_eos_pads_the_rest():
    model, cfg = tiny_model(), tiny_cfg()
    with torch.no_grad():                  # every query predicts EOS with probability ~1
        model.ln_f.weight.zero_()
        model.ln_f.bias.copy_(F.one_hot(torch.tensor(0), cfg.d_model).float())
        model.head.weight.zero_()
        model.head.weight[cfg.eos_id, 0] = 30.0
    out = generate(model, prompt=torch.tensor([cfg.eos_id, 70, 71]), temperature=0.0, stop_at_eos=True)
    # the EOS in the prompt does not stop; the first generated one (leftmost, at position 4) does
    assert out.tokens[0, 4] == cfg.eos_id and out.nfe == 1
    assert torch.all(out.tokens[0, 5:] == cfg.pad_id) and torch.all(out.reveal_step[0, 5:] == -2)
    rows, holes, infill = infill_canvas(cfg, [(0, 3, 6), (1, 10, 20)], seed=7)   # right context survives
    a = generate(model, infill=infill, temperature=0.0, window=3, stop_at_eos=True)
    b = generate(model, infill=infill, temperature=0.0, window=3, stop_at_eos=True, use_cache=False)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.reveal_step, b.reveal_step)
    assert torch.equal(a.tokens[~holes], rows[~holes]) and a.tokens[0, 3] == cfg.eos_id
    assert torch.all(a.tokens[0, 4:6] == cfg.pad_id) and torch.all(a.reveal_step[0, 4:6] == -2)

def test_stop_at_eos_rule_by_hand():
    cfg = tiny_cfg(seq_len=8)
    B, M, E, P = cfg.bos_id, cfg.mask_id, cfg.eos_id, cfg.pad_id
    xs = torch.tensor([[B, 65, M, 66, E, 67, M, 68, P],          # masked before the EOS: go on
                       [B, 65, 66, E, 67, M, 68, 69, P],         # stop: 67, M -> PAD; 68 is given
                       [B, E, 65, M, M, M, M, M, P]])            # a given EOS never stops
    step = torch.tensor([[-1, 0, -3, 1, 2, 2, -3, -1, -3],
                         [-1, 0, 1, 2, 2, -3, -1, 3, -3],
                         [-1, -1, 0, -3, -3, -3, -3, -3, -3]])
    before = xs.clone()
    assert setdiff._stop_at_eos(cfg, xs, step, 8).tolist() == [False, True, False]
    assert xs[1, :8].tolist() == [B, 65, 66, E, P, P, 68, P]
    assert step[1, :8].tolist() == [-1, 0, 1, 2, -2, -2, -1, -2] and torch.equal(xs[[0, 2]], before[[0, 2]])

@pytest.mark.parametrize("kwargs,match", [
    (dict(window=0), "window must be in"), (dict(window=7), "window must be in"),
    (dict(prompt=torch.arange(30)), "no room"), (dict(prompt=torch.arange(10), max_new_tokens=20), "max_new"),
    (dict(infill=torch.arange(10)), "MASK"), (dict(prompt=torch.tensor([1, 259])), "MASK"),
    (dict(prompt=torch.tensor([1, 2]), infill=torch.tensor([259])), "not both"),
    (dict(prompt=torch.tensor([1, 999])), "token ids"), (dict(prompt=torch.tensor([-1])), "token ids"),
    (dict(temperature=float("nan")), "temperature"), (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(threshold=float("nan")), "threshold"),
    (dict(prompt=torch.ones(3, 2, dtype=torch.long), batch_size=2), "batch_size")])
def test_generate_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate(tiny_model(), **kwargs)                 # staggered d=3, s=6: largest window 6

# ---------------------------------------------------------------------------- checkpoints, device, dtype, rows

def test_checkpoint_round_trip_failed_save_and_corrupt_files(tmp_path, monkeypatch):
    model, path = tiny_model(), tmp_path / "ckpt.pt"
    save_checkpoint(path, model, BYTES, step=7)
    before = path.read_bytes()

    def full_disk(obj, f, *a, **k):
        open(f, "wb").write(b"partial")
        raise OSError(28, "No space left on device")
    with monkeypatch.context() as mp, pytest.raises(OSError):
        mp.setattr(torch, "save", full_disk)
        save_checkpoint(path, model, BYTES, step=8)
    assert path.read_bytes() == before and list(tmp_path.iterdir()) == [path]   # intact, no temp file left
    loaded, tok, ckpt = load_checkpoint(path)
    assert ckpt["step"] == 7 and tok.spec() == BYTES.spec() and loaded.cfg == model.cfg
    x, order = random_rows(model.cfg, 2), sample_order(model.cfg, 2, gen(12))
    assert torch.equal(loaded.eval()(x, order), model(x, order))
    (tmp_path / "cut.pt").write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])
    (tmp_path / "junk.pt").write_bytes(b"hello")
    torch.save({"weights": 1}, tmp_path / "other.pt")
    torch.save({**ckpt, "config": {**ckpt["config"], "flash": True}}, tmp_path / "newer.pt")   # another version
    for name, match in [("cut.pt", "truncated or corrupt"), ("junk.pt", "not a readable checkpoint"),
                        ("other.pt", "not a setdiff checkpoint"), ("newer.pt", "do not match"),
                        ("missing.pt", "not found")]:
        with pytest.raises(ValueError, match=match):
            load_checkpoint(tmp_path / name)

def test_pick_device_dtype_and_autocast():
    cpu, reason = setdiff.pick_device("cpu")
    assert cpu == torch.device("cpu") and reason
    auto = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    assert setdiff.pick_device()[0].type == auto
    for bad in ("gpu", "meta", "cuda:x"):
        with pytest.raises(ValueError, match="device"):
            setdiff.pick_device(bad)
    assert [setdiff.pick_dtype(cpu, n)[0] for n in ("auto", "bfloat16")] == [torch.float32, torch.bfloat16]
    for dtype in (torch.float32, torch.bfloat16):           # matmuls in the autocast dtype
        with setdiff.autocast(cpu, dtype):
            assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == dtype

def test_wrap_rows_by_hand():
    B, E = 1000, 1001                         # sentences 1 2 | 3 4 5 | 6 | 7 8 9 10, each + EOS
    rows, left = setdiff.wrap_rows([1, 2, E, 3, 4, 5, E, 6, E, 7, 8, 9, 10, E], 6, B, E)   # chunks of 4
    assert rows.dtype == np.uint16 and left.tolist() == [10, E]
    assert rows.tolist() == [[B, 1, 2, E, 3, E], [B, 4, 5, E, 6, E], [B, E, 7, 8, 9, E]]
    rows, left = setdiff.wrap_rows(np.concatenate([left, [11, E]]), 6, B, E)   # the leftover carries on
    assert rows.tolist() == [[B, 10, E, 11, E, E]] and left.tolist() == []
    assert setdiff.wrap_rows([1, 2], 6, B, E)[0].shape == (0, 6)

# ---------------------------------------------------------------------------- appendix: tokenizer shim

@pytest.mark.parametrize("text", ["", "hello world", "café", "日本語", "emoji 😀👍🏽", "a\tb\nc\x00"])
def test_bytes_round_trip(text):
    assert BYTES.encode(text) == list(text.encode("utf-8")) and BYTES.decode(BYTES.encode(text)) == text

def test_bytes_special_ids_decode_and_bad_ids():
    t = BYTES
    assert (t.kind, t.vocab_size, t.pad_id, t.bos_id, t.eos_id, t.mask_id) == ("bytes", 260, 256, 257, 258, 259)
    assert t.decode([t.bos_id, 104, 105, t.mask_id, t.eos_id, 33, t.pad_id]) == "hi\n!"   # EOS: line break
    assert t.decode([0xC3]) == "\ufffd"                     # a cut multi-byte character is replaced
    for bad in (-1, 260, 3.0):
        with pytest.raises(ValueError, match="outside"):
            t.decode([bad])

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

@pytest.mark.parametrize("text,pieces", [
    ("Hello, World!", "hello , world !"),       # lower-case; punctuation is a word of its own
    ("the$5", "the $ 5"), ("the's", "the ' s"), ("x-y", "x - y"), ("xy", "x ##y"),   # $: ASCII non-alnum
    ("Café", "cafe"), ("cafe\u0301", "cafe"), ("NAÏVE", "naive"), ("Résumé", "resume"),   # accents go
    ("unaffable", "un ##aff ##able"), ("playing", "play ##ing"), ("abbb", "a ##bb ##b"), ("plays", "play ##s"),
    ("zebra", "[UNK]"), ("playx", "[UNK]"), ("the zebra", "the [UNK]"),   # no match somewhere: [UNK]
    ("a" + "b" * 99, "a" + " ##bb" * 49 + " ##b"), ("a" + "b" * 100, "[UNK]"),   # over 100 chars: [UNK]
    ("日本", "日 本"), ("the日本the", "the 日 本 the"),   # each CJK ideograph is a word
    ("hel\x00lo", "hello"), ("he\x07llo", "hello"),      # control and format characters are deleted
    ("x\u200by", "x ##y"), ("x\ufeffy", "x ##y"), ("x\x85y", "x ##y"), ("x\ufffdy", "x ##y"),
    ("hello\tworld\nthe\r\nx\u00a0y\u3000the\u2003the  ", "hello world the x y the the"), ("   ", ""), ("", ""),
    ("ΣΣ", "σ ##σ"),                            # per-character lower case: final Σ is σ, not ς
    ("[CLS] [SEP] [MASK] [PAD] [UNK]", "[CLS] [SEP] [MASK] [PAD] [UNK]"),   # special strings, exact case
    ("x[SEP]y", "x [SEP] y"), ("[MASK].", "[MASK] ."), ("[cls]", "[ [UNK] ]"), ("[[SEP]]", "[ [SEP] ]")])
def test_wordpiece_encode(tok, text, pieces):
    """Greedy longest match first ("un ##aff ##able", not "##a ##ff"), BERT's normalisation rules."""
    ids = [TINY_VOCAB.index(p) for p in pieces.split()]     # a token's id is its line in the file
    assert tok.encode(text) == ids
    assert tok.encode(text + " " + text) == ids + ids        # the repeat comes from the word memo

def test_wordpiece_ids_and_decode(tok):
    assert (tok.kind, tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id, tok.mask_id, tok.unk_id) == (
        "wordpiece", 41, 0, 2, 3, 4, 1)
    assert tok.decode([17, 12, 18, 14]) == "hello , world !" and tok.decode([7, 8, 9]) == "unaffable"
    assert tok.decode([2, 30, 31, 3, 5, 4, 0, 0]) == "playing\nthe"     # BOS, MASK, PAD vanish
    assert tok.decode([2, 17, 3, 18, 3]) == "hello\nworld\n" and tok.decode([5, 1]) == "the [UNK]"
    with pytest.raises(ValueError, match="outside"):
        tok.decode([41])

def test_spec_round_trip_without_the_vocab_file(tmp_path, tok):
    text = "Hello, unaffable [MASK] 日本!"
    for t in (BYTES, tok):
        spec = json.loads(json.dumps(t.spec()))
        (tmp_path / "vocab.txt").unlink(missing_ok=True)     # the spec alone must be enough
        t2 = Tokenizer.from_spec(spec)
        assert t2.spec() == t.spec() and t2.encode(text) == t.encode(text) and t2.mask_id == t.mask_id
    assert t2.encode(text) == [17, 12, 7, 8, 9, 4, 19, 20, 14]
    (tmp_path / "crlf.txt").write_bytes("\r\n".join(TINY_VOCAB).encode("utf-8"))   # no final newline
    assert Tokenizer.from_vocab(tmp_path / "crlf.txt").encode("Hello!") == [17, 14]
    for bad in (None, "bytes", {}, {"kind": "sentencepiece"}, {"kind": "wordpiece"},
                {"kind": "wordpiece", "vocab": "not a list"}, {"kind": "wordpiece", "vocab": ["[PAD]", "the"]}):
        with pytest.raises(ValueError):
            Tokenizer.from_spec(bad)

@pytest.mark.parametrize("content,match", [
    (None, "does not exist.*vocab.txt"), ("dir", "is not a file"), (b"", r"no \[PAD\], \[UNK\]"),
    (vocab_bytes(TINY_VOCAB) + b"\xff\xfeoops\n", "not UTF-8"),
    *[(vocab_bytes([t for t in TINY_VOCAB if t != s]), "it has no " + re.escape(s)) for s in TINY_VOCAB[:5]],
    (vocab_bytes(TINY_VOCAB + ["the"]), "twice")])
def test_from_vocab_rejects_bad_files(tmp_path, content, match):
    path = tmp_path / "vocab.txt"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=match):
        Tokenizer.from_vocab(path)
