"""Tests of setdiff.py in the file's order, each against an independent computation: a brute-force
loop, a closed form, a worked example, the slow reference path, or a forward written here from the
authors' description. CPU, float32 unless exactness needs float64."""

import json
import math
import re
import struct

import pytest
import torch
import torch.nn.functional as F

import setdiff
from setdiff import (
    Config,
    Elbo,
    SetDiffusionLM,
    StaggeredSchedule,
    Tokenizer,
    elbo,
    generate,
    load_checkpoint,
    max_window,
    sample_order,
    save_checkpoint,
    set_causal_mask,
)

BYTES = Tokenizer.bytes()
# Tiny models gain nothing from intra-op threads, and on a busy 2-core machine the threads'
# contention made the tests 2-10x slower (measured): one thread keeps them at a few seconds.
torch.set_num_threads(1)


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


def decode_order_from_steps(reveal_step):
    """The full decode order from reveal steps, by brute force: (step, position) pairs sorted."""
    return torch.tensor(
        [[p for _, p in sorted((s, p) for p, s in enumerate(row))] for row in reveal_step.tolist()]
    )


def nll_of(model, x, order, scored):
    """Sum over scored positions of -log p(x_i | x before i in order), per row (float64)."""
    logp = torch.log_softmax(model(x, order).double(), -1)
    return [
        sum(-logp[b, i, x[b, i]].item() for i in range(x.shape[1]) if scored[b][i])
        for b in range(len(x))
    ]


# ---------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(order="random"), "unknown order policy"),
        (dict(set_size=25), "set size d"),
        (dict(set_size=3, max_set_size=2), "window s"),
        (dict(seq_len=1, set_size=1), "at least 2"),
        (dict(d_model=30, n_head=4), "multiple of n_head"),
        (dict(d_model=6, n_head=2), "even"),
        (dict(mask_id=258), "MASK must differ"),
        (dict(pad_id=257), "PAD must differ"),
        (dict(bos_id=300), "not in the vocab"),
    ],
)
def test_config_rejects_bad_settings(kw, match):
    cfg = tiny_cfg()
    assert Config(**json.loads(json.dumps(setdiff.asdict(cfg)))) == cfg  # as a checkpoint stores it
    with pytest.raises(ValueError, match=match):
        tiny_cfg(**kw)


def test_config_checks_only_what_the_policy_uses_and_allows_the_released_ids():
    assert Config(order="ar", seq_len=3).max_set_size is None  # d = 4 > L is unused by AR
    assert Config(order="uniform", seq_len=3, set_size=99).order == "uniform"
    lm1b = Config(vocab_size=30522, mask_id=103, bos_id=101, eos_id=101, pad_id=0)  # [CLS] twice
    owt = Config(vocab_size=50258, mask_id=50257, bos_id=None, eos_id=50256, pad_id=None)
    assert lm1b.eos_id == lm1b.bos_id and owt.pad_id is None and owt.max_set_size == 8


# ---------------------------------------------------------------------------- order policies, schedule


@pytest.mark.parametrize(
    "d,b,k", [(4, 0.059259, 0.358090), (8, 0.111888, 0.387534), (16, 0.201258, 0.450425)]
)
def test_schedule_constants_closed_form(d, b, k):
    s = StaggeredSchedule(128, d)
    assert round(s.b, 6) == b and round(s.k, 6) == k  # the paper's L = 128 values
    assert math.isclose(s.b, 2 * d / (128 + 2 * d - 1)) and math.isclose(
        s.b * s.k / (s.k + 1), d / 256
    )
    assert math.isclose(s.reach, 2 * d) and s.window == 2 * d  # r = s exactly
    assert math.isclose(s.loc[0].item(), 1 - s.b) and s.loc[-1].item() == 0.0


@pytest.mark.parametrize("L,d,b,k", [(1024, 4, 0.007759, 0.336378), (1024, 16, 0.030332, 0.346925)])
def test_schedule_constants_of_the_owt_models(L, d, b, k):
    s = StaggeredSchedule(L, d)  # the values of the authors' StaggeredNoise(L, d, 2d)
    assert round(s.b, 6) == b and round(s.k, 6) == k


def test_schedule_special_cases():
    s = StaggeredSchedule(128, 4, 4)  # d == s: k = 1, b = d / L
    assert s.k == 1 and math.isclose(s.b, 4 / 128) and math.isclose(s.reach, 4 * 127 / 124)
    assert s.window == 5
    u = StaggeredSchedule(10, 10, 10)  # uniform: b = 1, every loc 0
    assert u.b == 1 and torch.all(u.loc == 0) and u.window == 10
    for args in [(8, 9), (8, 4, 3), (8, 0)]:
        with pytest.raises(ValueError):
            StaggeredSchedule(*args)


@pytest.mark.parametrize("L,d,s", [(16, 3, 6), (16, 4, 4), (12, 2, 7)])
def test_first_hitting_times_follow_the_masking_curves(L, d, s):
    """P(T_i <= t) = m_i(t) = 1 - (1 - u)^k, u = (t - loc_i) / b, the closed form written here."""
    sched = StaggeredSchedule(L, d, s)
    t = torch.linspace(0, 1, 41, dtype=torch.float64)
    u = ((t[:, None] - sched.loc[None, :]) / sched.b).clamp(0, 1)
    m = 1 - (1 - u) ** sched.k  # (41, L)
    N = 20000  # the empirical CDF of the first hitting times
    emp = (sched.first_hitting_times(N, gen(1))[None] <= t[:, None, None]).double().mean(1)
    assert torch.all((emp - m).abs() <= 5 * torch.sqrt(m * (1 - m) / N) + 2e-3)


@pytest.mark.parametrize("d,s", [(4, 8), (3, 5), (4, 4), (6, 6)])
def test_reach_bounds_revealed_tokens(d, s):
    """Replay sampled orders: every revealed token stays within ceil(r) of the leftmost
    unrevealed position, including the d = s case where r is slightly more than d."""
    L, sched = 40, StaggeredSchedule(40, d, s)
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
    assert d - 1 <= worst < limit  # and the policy really does reach ahead


def test_d1_gives_identity_and_uniform_gives_uniform_orders():
    T = StaggeredSchedule(32, 1).first_hitting_times(500, gen(3))
    assert torch.equal(torch.argsort(-T, 1), torch.arange(32).expand(500, -1))
    assert torch.equal(
        sample_order(tiny_cfg(order="ar"), 3, gen(3)), torch.arange(24).expand(3, -1)
    )
    N, cfg = 12000, tiny_cfg(seq_len=6, order="uniform", set_size=6)
    order = sample_order(cfg, N, gen(4))
    assert torch.all(order[:, 0] == 0)  # position 0 pinned first
    freq = (
        torch.stack([torch.bincount(order[:, slot], minlength=6)[1:] for slot in range(1, 6)]) / N
    )
    assert torch.all((freq - 0.2).abs() < 5 * math.sqrt(0.2 * 0.8 / N))


def test_given_positions_come_first_in_position_order_and_padding_last():
    cfg = tiny_cfg(seq_len=12, order="block", set_size=4)
    pad = (torch.arange(12) >= 10).expand(200, -1)
    given = torch.zeros(200, 12, dtype=torch.bool)
    given[:, [1, 7, 8]] = True  # any set of positions, not only a prefix
    order = sample_order(cfg, 200, gen(5), given=given, pad=pad)
    for row in order.tolist():
        assert row[:4] == [0, 1, 7, 8] and row[-2:] == [10, 11]
        free = row[4:10]
        assert sorted(row) == list(range(12)) and [p // 4 for p in free] == sorted(
            p // 4 for p in free
        )
    assert len({tuple(r[4:6]) for r in order.tolist()}) > 1  # random inside block 0
    staggered = sample_order(tiny_cfg(), 1, gen(6), given=torch.arange(24)[None] >= 20)
    assert staggered[0, :5].tolist() == [0, 20, 21, 22, 23]


@pytest.mark.parametrize(
    "kw,want",
    [
        (dict(order="ar"), 1),
        (dict(order="uniform"), 24),
        (dict(order="block", set_size=4), 4),
        (dict(set_size=4), 8),
        (dict(set_size=4, max_set_size=4), math.ceil(4 * 23 / 20)),
    ],
)
def test_max_window_per_policy(kw, want):
    assert max_window(tiny_cfg(**kw)) == want


# ---------------------------------------------------------------------------- set-causal masks


def test_mask_equals_worked_example():
    rows = ["1000 0000", "1100 0000", "1110 0000", "1111 0000"]  # clean slots c0..c3
    rows += ["0000 1000", "1000 0100", "1100 0010", "1110 0001"]  # mask slots m0..m3
    want = torch.tensor([[c == "1" for c in r if c != " "] for r in rows])
    assert torch.equal(set_causal_mask(4), want)
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
    tokens = random_rows(model.cfg, 1)[:, :10]
    positions = torch.tensor([[0, 7, 3, 2, 9, 1, 5, 4, 8, 6]])
    attn = (torch.rand(1, 10, 10, generator=gen(0)) < 0.5) | torch.eye(10, dtype=torch.bool)
    h = model.run(tokens, positions, attn)
    permuted = model.run(tokens[:, p], positions[:, p], attn[:, p][:, :, p])
    assert torch.allclose(permuted, h[:, p], atol=1e-5)
    assert torch.allclose(model.run(tokens, positions + 13, attn), h, atol=1e-4)


def test_the_authors_network_pieces():
    """tanh GELU, LayerNorm without bias, a head with a bias, dropout on residual branches only,
    the rotary table in float32 as pos * 1 / 10000^(2i/hd)."""
    model = SetDiffusionLM(tiny_cfg(dropout=0.5))
    names = dict(model.named_parameters())
    assert "head.bias" in names and not any(
        n.endswith("ln1.bias") or n == "ln_f.bias" for n in names
    )
    assert torch.all(names["head.bias"] == 0) and torch.all(names["head.weight"] == 0)
    assert model.blocks[0].mlp[1].approximate == "tanh"
    drops = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout)]
    assert drops == ["blocks.0.drop", "blocks.1.drop"]  # neither on embeddings nor attention
    exact = torch.arange(24.0, dtype=torch.float64)[:, None] / 10000 ** (
        torch.arange(0, 16, 2) / 16
    )
    assert torch.allclose(model.cos.double(), exact.cos(), atol=1e-6)  # the angles, in float32
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))  # the authors' recipe
    assert torch.equal(model.sin, torch.outer(torch.arange(24).float(), inv_freq).sin())


# ---------------------------------------------------------------------------- two-stream forward, loss, bound


def test_training_forward_is_set_causal():
    """logits[i] depends on the tokens before i in the order, and on nothing else (x[i] included)."""
    model = tiny_model()
    x, order = random_rows(model.cfg, 1), sample_order(model.cfg, 1, gen(6))
    base, slot_of = model(x, order), torch.argsort(order[0])
    for j in range(1, model.cfg.seq_len):  # position 0 kept
        y = torch.where(torch.arange(24) == j, (x + 1) % 256, x)
        changed = ~torch.isclose(model(y, order)[0], base[0], atol=1e-6).all(-1)  # (L,)
        assert torch.equal(changed, slot_of[j] < slot_of), j


def test_training_forward_equals_one_query_at_a_time():
    """For every slot r feed only x[sigma_<r] (causal among themselves) and ONE mask query at
    position sigma_r: its logits must equal the two-stream forward's."""
    model = tiny_model()
    x, order = random_rows(model.cfg, 1, seed=5), sample_order(model.cfg, 1, gen(13))[0]
    full = model(x, order[None])[0]  # (L, V) position order
    for r in range(model.cfg.seq_len):
        tokens = torch.cat([x[0, order[:r]], torch.tensor([model.cfg.mask_id])])[None]
        attn = torch.ones(r + 1, r + 1).tril().bool()[None]  # the query sees all + itself
        z = model.logits(model.run(tokens, order[None, : r + 1], attn))[0, -1]
        assert torch.allclose(z, full[order[r]], atol=1e-5), r


def test_no_empty_rows_and_padded_gradients_are_finite(monkeypatch):
    m = torch.tensor([[True, False], [False, False]])
    assert torch.equal(setdiff.no_empty_rows(m), torch.tensor([[True, False], [True, True]]))
    model, run = tiny_model().train(), SetDiffusionLM.run
    x = random_rows(model.cfg, 2)
    x[1, 4:] = model.cfg.pad_id

    def checked_run(self, tokens, positions, attn, cache=None):
        assert attn.any(-1).all()  # no query row attends nothing
        return run(self, tokens, positions, attn, cache)

    monkeypatch.setattr(SetDiffusionLM, "run", checked_run)
    model.loss(x, generator=gen(0)).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_mask_token_gets_zero_probability():
    model, cfg = tiny_model(), tiny_cfg()
    x, fresh = random_rows(cfg, 2), SetDiffusionLM(cfg)  # zero head: uniform over all but MASK
    assert math.isclose(
        fresh.loss(x, generator=gen(0)).item(), math.log(cfg.vocab_size - 1), rel_tol=1e-6
    )
    with torch.no_grad():
        model.head.bias[cfg.mask_id] = 50.0  # push hard towards MASK
    assert torch.all(F.softmax(model(x, sample_order(cfg, 2, gen(0))), -1)[..., cfg.mask_id] == 0)
    assert not (generate(model, batch_size=2, generator=gen(0)).tokens == cfg.mask_id).any()


def test_loss_equals_hand_computation_with_padding():
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


def test_elbo_ar_equals_left_to_right_sum():
    model, cfg = tiny_model(order="ar"), tiny_cfg(order="ar")
    x = random_rows(cfg, 5)
    x[4, 20:] = cfg.pad_id
    res = elbo(model, x, num_orders=3, batch_size=2)
    scored = [[0 < i and x[b, i] != cfg.pad_id for i in range(24)] for b in range(5)]
    total = sum(nll_of(model, x, torch.arange(24).expand(5, -1), scored))
    assert res.tokens_scored == 4 * 23 + 19 and res.num_orders == 3 and res.num_seqs == 5
    assert abs(res.nll - total) < 1e-3 and math.isclose(
        res.ppl, math.exp(total / res.tokens_scored), rel_tol=1e-3
    )


def test_elbo_averages_k_orders_with_standard_error_whatever_the_batch_size():
    """Uniform policy: each row's NLL is the mean over K orders (drawn for all rows together, so
    the batch size cannot change them); position 0 and padding unscored; the standard error is
    that of sum(NLL) / sum(tokens) with rows as units (delta method)."""
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
        assert (
            res.tokens_scored == sum(n)
            and abs(res.nll - sum(nll)) < 1e-3
            and abs(res.se - se) < 1e-6
        )
    assert runs[0].nll == pytest.approx(runs[1].nll, abs=1e-9) == runs[2].nll


def test_position_0_is_never_scored_even_without_bos():
    """OWT rows: no BOS, no PAD; position 0 holds any token, comes first, and is not scored.
    LM1B rows: [CLS] both opens the row and ends sentences, and those EOS targets are scored."""
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


def test_infill_bound_equals_the_chain_rule_over_span_orders():
    """The bound of a 2-position span given everything else, brute force: each order of the span
    is the chain p(first | context) p(second | context, first), each conditional from its own
    one-query forward; the bound is their mix in the proportions the policy drew them."""
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
    assert torch.equal(
        order[:, :22], torch.tensor(context).expand(N, -1)
    )  # context first, in order
    share = (order[:, 22] == a).double().mean().item()
    assert (
        0.4 < share < 0.6 and res.tokens_scored == 2 * N
    )  # both orders occur; only the span scored
    assert res.nll / N == pytest.approx(share * ab + (1 - share) * ba, abs=1e-5)  # float32 logp


def test_elbo_metrics_and_line_by_hand():
    e = Elbo(30 * math.log(2), 10, 2, 3, 0.05, 3 * math.log(2), 8.0)
    m = e.metrics(num_bytes=15)  # 3 ln 2 nats/token; 30 bits / 15 bytes
    assert math.isclose(m["ppl"], 8) and math.isclose(m["bits_per_byte"], 2) and m["se"] == 0.05
    assert (m["num_orders"], m["tokens_scored"], m["num_seqs"], m["bytes"]) == (2, 10, 3, 15)
    for part in ("8.000", "2.0794", "0.0500", "2.0000", "3 rows", "10 tokens", "2 orders"):
        assert part in e.line(15), (part, e.line(15))


# ---------------------------------------------------------------------------- sampler


def test_top_p_truncates_and_confidence_is_the_drawn_probability():
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


def test_sampling_never_draws_zero_probability_tokens(monkeypatch):
    """u just below the total mass must not round up onto MASK, the last of the sorted distribution."""
    logits = torch.randn(2, 3, 260, generator=gen(0))
    logits[..., 259] = float("-inf")

    def almost_one(shape, **kw):
        return torch.full(shape, 1 - 2**-53, dtype=torch.float64)

    with monkeypatch.context() as mp:
        mp.setattr(torch, "rand", almost_one)
        for top_p in (1.0, 0.9):
            cand, conf = setdiff.draw_candidates(logits, 1.0, top_p)
            assert not (cand == 259).any() and torch.all(conf > 0)
    cand, conf = setdiff.draw_candidates(logits, 1e-30, 1.0)  # tiny temperature ~ greedy
    assert torch.equal(cand, logits.argmax(-1)) and torch.all(conf == 1)


@pytest.mark.parametrize("with_infill", [False, True])
def test_cached_logits_equal_cache_free_logits_step_by_step(with_infill):
    """The two prediction paths give the same logits on every intermediate state (float64)."""
    model, cfg, T = tiny_model(dtype=torch.float64), tiny_cfg(), 24
    inputs = dict(infill=holes_in(cfg, [(0, 3, 10), (1, 12, 20)], seed=6)[2]) if with_infill else {}
    out = generate(model, batch_size=2, window=3, threshold=0.3, temperature=0.0, **inputs)
    cache, steps = setdiff.KVCache(cfg, 2, T, max_call=T + 3, device="cpu"), out.reveal_step
    for n in range(out.nfe):
        # the state before step n: revealed = steps < n; step n-1 (or the context) not cached yet
        canvas = torch.where(steps < n, out.tokens, cfg.mask_id)
        queries = setdiff.gather_sets(setdiff.window_queries(canvas == cfg.mask_id, 3, None))
        z1 = setdiff.predict(model, canvas, setdiff.gather_sets(steps == n - 1), queries, cache)
        revealed = setdiff.gather_sets(steps < n, key=steps)  # every revealed token, decode order
        z2 = setdiff.predict(model, canvas, revealed, queries)
        valid = queries[1]
        assert torch.allclose(z1[valid], z2[valid], atol=1e-10)


@pytest.mark.parametrize(
    "case",
    [
        dict(order="staggered", window=3, threshold=math.inf),
        dict(order="staggered", window=6, threshold=0.05),
        dict(order="block", window=3, threshold=0.1),
        dict(order="uniform", window=24, threshold=0.2),
        dict(order="ar", window=1, threshold=math.inf),
    ],
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cached_generation_equals_cache_free(case, temperature):
    """Unconditional, prompted and infill generation; sampled decoding in float64 (a float32
    rounding difference may, rarely, flip a draw), greedy in float32. The context never changes."""
    case = dict(case)
    kw = dict(
        window=case.pop("window"),
        threshold=case.pop("threshold"),
        temperature=temperature,
        top_p=0.9,
    )
    model = tiny_model(dtype=torch.float64 if temperature else torch.float32, **case)
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
    "order,window,set_size", [("staggered", 4, 3), ("block", 3, 3), ("uniform", 5, 24)]
)
def test_one_token_per_step_matches_training_forward(order, window, set_size):
    """Feed the generated sequence and its reveal order through model(x, order): the greedy
    choice at every generated position is the training forward's argmax there."""
    model = tiny_model(order=order, set_size=set_size)
    out = generate(
        model, batch_size=2, window=window, temperature=0.0, prompt=torch.tensor([65, 66])
    )
    assert torch.all(out.steps == out.new_tokens)  # one token per step
    greedy = model(out.tokens, decode_order_from_steps(out.reveal_step)).argmax(-1)
    new = out.reveal_step >= 0
    assert torch.equal(greedy[new], out.tokens[new])


@pytest.mark.parametrize("use_cache", [True, False])
def test_sampler_distributions_equal_training_forward(use_cache, monkeypatch):
    """Sampled, one token per step (float64): the distribution drawn from at every step equals
    the training forward's at that position, given the final sequence and its reveal order."""
    model, seen, draw = tiny_model(dtype=torch.float64), [], setdiff.draw_candidates

    def spy(z, *args, **kw):  # record the logits of every draw, then draw as usual
        seen.append(z.clone())
        return draw(z, *args, **kw)

    monkeypatch.setattr(setdiff, "draw_candidates", spy)
    out = generate(model, window=4, temperature=1.0, generator=gen(15), use_cache=use_cache)
    ref = torch.log_softmax(model(out.tokens, decode_order_from_steps(out.reveal_step)), -1)[0]
    assert len(seen) == out.nfe == 23
    for step, logits in enumerate(seen):
        pos = int((out.reveal_step[0] == step).nonzero())
        q = setdiff.window_queries(out.reveal_step[:1] >= step, 4, None)[0]  # masked before it
        slot = int(q[:pos].sum())  # queries are in position order
        assert torch.allclose(torch.log_softmax(logits[0, slot], -1), ref[pos], atol=1e-9)


def test_block_windows_never_cross_block_boundaries():
    model = tiny_model(order="block", set_size=4)
    out = generate(
        model, batch_size=3, window=4, threshold=0.05, temperature=1.0, generator=gen(14)
    )
    for row in out.reveal_step.tolist():
        for blk in range(5):
            here = [s for s in row[4 * blk : 4 * blk + 4] if s >= 0]  # position 0 is given
            assert max(here) < min(row[4 * blk + 4 : 4 * blk + 8])  # block j done before j+1
        for step in set(row) - {setdiff.GIVEN}:
            assert len({p // 4 for p, s in enumerate(row) if s == step}) == 1  # one block a step
    assert generate(model, window=4, threshold=0.0, temperature=0.0).nfe == 24 // 4


def test_batched_equals_row_by_row():
    model = tiny_model()
    infill = holes_in(model.cfg, [(0, 2, 20), (1, 12, 14), (2, 5, 24)], seed=4)[2]  # rows end apart
    kw = dict(window=5, threshold=0.3, temperature=0.0)
    batched = generate(model, infill=infill, **kw)
    for b in range(3):
        single = generate(model, infill=infill[b : b + 1], **kw)
        assert torch.equal(single.tokens[0], batched.tokens[b])
        assert torch.equal(single.reveal_step[0], batched.reveal_step[b])
        assert single.nfe == batched.steps[b]
    assert batched.nfe == int(batched.steps.max())


def test_threshold_controls_tokens_per_step():
    model = tiny_model()
    one = generate(model, batch_size=2, window=3, threshold=1.5, temperature=0.0)
    assert torch.all(one.steps == one.new_tokens) and one.nfe == 23 and one.tokens_per_step == 1
    whole = generate(model, batch_size=2, window=3, threshold=0.0, temperature=0.0)
    assert whole.nfe == math.ceil(23 / 3) and math.isclose(whole.tokens_per_step, 23 / 8)
    some = generate(model, batch_size=2, window=3, threshold=0.2, temperature=0.0)
    assert whole.nfe <= some.nfe <= one.nfe
    for row, n in zip(some.reveal_step.tolist(), some.steps.tolist()):
        assert {s for s in row if s >= 0} == set(range(n))  # never zero per step, per row


def eos_model(cfg_kw=None):
    """Every query predicts EOS with probability ~1 (the head's bias)."""
    model = tiny_model(**(cfg_kw or {}))
    with torch.no_grad():
        model.head.weight.zero_()
        model.head.bias.zero_()
        model.head.bias[model.cfg.eos_id] = 30.0
    return model


def test_stop_at_eos_pads_the_rest_and_counts_only_what_is_kept():
    model = eos_model()
    cfg = model.cfg
    out = generate(
        model, prompt=torch.tensor([cfg.eos_id, 70, 71]), temperature=0.0, stop_at_eos=True
    )
    # the EOS in the prompt does not stop; the first generated one (position 4) does
    assert out.tokens[0, 4] == cfg.eos_id and out.nfe == 1
    assert torch.all(out.tokens[0, 5:] == cfg.pad_id) and torch.all(
        out.reveal_step[0, 5:] == setdiff.ERASED
    )
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


def test_stop_at_eos_rule_by_hand():
    cfg = tiny_cfg(seq_len=8)
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
    assert step[1].tolist() == [G, 0, 1, 2, -2, -2, G, -2] and torch.equal(
        x[[0, 2]], before[[0, 2]]
    )
    owt = tiny_cfg(seq_len=8, bos_id=None, pad_id=None)  # no PAD: the rest becomes EOS
    y = torch.tensor([[5, 65, 66, E, 67, M, 68, 69]])
    setdiff.stop_at_first_eos(owt, y, step[1:2].clone())
    assert y[0].tolist() == [5, 65, 66, E, E, E, 68, E]


def test_sampling_from_a_model_without_bos_starts_a_document():
    model = tiny_model(bos_id=None, pad_id=None)
    out = generate(model, batch_size=2, temperature=0.0)
    assert torch.all(out.tokens[:, 0] == model.cfg.eos_id)  # like the authors' OWT samples
    prompt = generate(model, prompt=torch.tensor([65, 66]), temperature=0.0, max_new_tokens=3)
    assert prompt.tokens[0, :2].tolist() == [65, 66] and prompt.tokens.shape == (1, 5)


@pytest.mark.parametrize(
    "kwargs,match",
    [
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
    ],
)
def test_generate_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate(tiny_model(), **kwargs)  # staggered d=3, s=6: the largest window is 6


# ---------------------------------------------------------------------------- checkpoints


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


# Released models: folders written in the test exactly as the authors' code writes them, and
# their log-probs from a forward written here from the authors' description (a DiT with its
# timestep modulation off; the two-stream SetDLM input), not through setdiff's modules.
BERT_WORDS = "[PAD] [UNK] [CLS] [SEP] [MASK] the cat sat on a mat . , ! dog ##s run".split()


def authors_config(V, L, D, H, N, d, mask_id, arch="SetDLM", **backbone):
    """config.json as transformers writes it for the authors' SetDLM (BD3LMConfig)."""
    net = dict(_target_="backbone_dit.DIT", length=L, causal_attention=False, adaln=False)
    net |= dict(hidden_size=D, cond_dim=128, n_heads=H, num_layers=N, dropout=0.1)
    net |= dict(tie_word_embeddings=True, attn_backend="sdpa", vocab_size=V, block_size=L)
    noise = dict(_target_="noise_schedule_noise_schedules.StaggeredNoise", eps=0.001, block_size=L)
    noise |= dict(desired_block_size=d, max_block_size=L, length=L)
    tokens = dict(vocab_size=V, mask_token_id=mask_id, pad_token_id=0, bos_token_id=None)
    return {
        "architectures": [arch],
        "model_type": "bd3lm",
        "auto_map": {"AutoConfig": "bd3lm.BD3LMConfig", "AutoModelForMaskedLM": "setdlm.SetDLM"},
        "attn_backend": "sdpa",
        "backbone_config": net | dict(pretrained_model_name_or_path=None) | backbone,
        "noise_config": noise,
        "length": L,
        "block_size": L,
        "eval_block_size": L,
        "keep_clean_bos": True,
        "tokenization_config": tokens,
        "vocab_size": V,
        "mask_token_id": mask_id,
        "pad_token_id": 0,
        "torch_dtype": "float32",
        "transformers_version": "4.52.4",
    }


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
    logits = (
        h @ sd["backbone.output_layer.linear.weight"].T + sd["backbone.output_layer.linear.bias"]
    )
    logits[..., mask_id] = -1e12
    logp = torch.log_softmax(logits[:, L:], -1)  # the mask stream, decode order
    return -logp.gather(-1, x.gather(1, order)[..., None])[..., 0]


def write_safetensors(path, tensors):
    """The safetensors layout by hand: an 8-byte little-endian header size, a JSON header, bytes."""
    names = {torch.float32: "F32", torch.bool: "BOOL"}
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, t in tensors.items():
        blob = t.contiguous().numpy().tobytes()
        header[name] = {
            "dtype": names[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def lm1b_folder(tmp_path, weights="bin", L=16, d=4, **config):
    V, D, N = len(BERT_WORDS), 16, 2
    folder = tmp_path / f"lm1b-{weights}"
    folder.mkdir(exist_ok=True)
    spec = authors_config(V, L, D, 2, N, d, BERT_WORDS.index("[MASK]"))
    (folder / "config.json").write_text(json.dumps(spec | config, indent=2))
    (folder / "vocab.txt").write_text("\n".join(BERT_WORDS) + "\n")
    sd = authors_weights(V, L, D, N)
    if weights == "bin":
        torch.save(sd, folder / "pytorch_model.bin")
    else:
        write_safetensors(folder / "model.safetensors", sd)
    return folder, sd


@pytest.mark.parametrize("weights", ["bin", "safetensors"])
def test_released_folder_loads_and_matches_the_authors_forward(tmp_path, weights):
    folder, sd = lm1b_folder(tmp_path, weights)
    model, tok, ckpt = load_checkpoint(folder)
    cfg = model.cfg
    assert ckpt["released"] == str(folder) and (cfg.seq_len, cfg.d_model, cfg.n_layer) == (
        16,
        16,
        2,
    )
    assert (cfg.set_size, cfg.max_set_size) == (4, 8)  # max_block_size = L means s = min(2d, L)
    assert cfg.bos_id == cfg.eos_id == 2 and (cfg.pad_id, cfg.mask_id) == (0, 4)  # [CLS] twice
    x = torch.randint(5, len(BERT_WORDS), (3, 16), generator=gen(0))
    x[:, 0] = 2
    x[:, 9] = 2  # a sentence end
    order = sample_order(cfg, 3, gen(1))
    want = authors_nll(sd, 2, x, order, 4)  # (B, L) per slot, decode order
    got = -torch.log_softmax(model.eval()(x, order), -1).gather(-1, x[..., None])[..., 0]
    assert torch.allclose(got.gather(1, order), want, atol=2e-5)
    res = elbo(model, x, generator=gen(1))  # position 0 unscored: slot 0 dropped, as theirs
    assert res.tokens_scored == 3 * 15 and res.nll == pytest.approx(
        want[:, 1:].sum().item(), abs=1e-3
    )


def test_released_schedule_keeps_an_explicit_window(tmp_path):
    folder, _ = lm1b_folder(tmp_path, L=32, d=4, noise_config=None)
    spec = json.loads((folder / "config.json").read_text())
    spec["noise_config"] = (
        spec["noise_config"] or authors_config(18, 32, 16, 2, 2, 4, 4)["noise_config"]
    )
    spec["noise_config"]["max_block_size"] = 6  # given explicitly (an eval override): kept
    (folder / "config.json").write_text(json.dumps(spec))
    assert load_checkpoint(folder)[0].cfg.max_set_size == 6
    spec["noise_config"]["max_block_size"] = 32  # = L: the training-time rule min(2d, L)
    (folder / "config.json").write_text(json.dumps(spec))
    assert load_checkpoint(folder)[0].cfg.max_set_size == 8


def test_released_folders_of_other_models_are_refused(tmp_path):
    folder, sd = lm1b_folder(tmp_path)
    base = json.loads((folder / "config.json").read_text())
    net = base["backbone_config"]
    qwen = net | {"_target_": "backbone_automodel.AutoModelFromPreTrained"}
    cases = [
        (base | {"architectures": ["AR"]}, "autoregressive"),
        (base | {"backbone_config": net | {"causal_attention": True}}, "autoregressive"),
        (base | {"architectures": ["MDLM"], "model_type": "mdlm"}, "an MDLM"),
        (base | {"architectures": ["BD3LM"], "block_size": 4}, "a BD3-LM .*block size 4"),
        (
            base
            | {"backbone_config": qwen | {"pretrained_model_name_or_path": "Qwen/Qwen3-1.7B-Base"}},
            "Qwen3",
        ),
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


@pytest.mark.parametrize(
    "text", ["", "hello world", "café", "日本語", "emoji 😀👍🏽", "a\tb\nc\x00"]
)
def test_bytes_round_trip(text):
    assert (
        BYTES.encode(text) == list(text.encode("utf-8"))
        and BYTES.decode(BYTES.encode(text)) == text
    )


def test_bytes_special_ids_decode_and_bad_ids():
    t = BYTES
    assert (t.kind, t.vocab_size, t.pad_id, t.bos_id, t.eos_id, t.mask_id) == (
        "bytes",
        260,
        256,
        257,
        258,
        259,
    )
    assert (
        t.decode([t.bos_id, 104, 105, t.mask_id, t.eos_id, 33, t.pad_id]) == "hi\n!"
    )  # EOS: a line break
    assert t.decode([0xC3]) == "\ufffd"  # a cut multi-byte character is replaced
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


def test_wordpiece_ids_and_decode(tok):
    ids = (tok.kind, tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id, tok.mask_id, tok.unk_id)
    assert ids == ("wordpiece", 41, 0, 2, 2, 4, 1)  # [CLS] is BOS and EOS (LM1B rows)
    assert (
        tok.decode([17, 12, 18, 14]) == "hello , world !" and tok.decode([7, 8, 9]) == "unaffable"
    )
    assert tok.decode([30, 31, 2, 5, 4, 0, 0]) == "playing\nthe"  # MASK, PAD vanish
    assert tok.decode([17, 2, 18, 3]) == "hello\nworld [SEP]" and tok.decode([5, 1]) == "the [UNK]"
    with pytest.raises(ValueError, match="outside"):
        tok.decode([41])


# GPT-2 byte-level BPE: a hand-made vocab and merges, each expected list worked out by hand (and
# confirmed offline with HuggingFace's BPE on the same files). Byte characters: Ġ is a space,
# Ċ a newline, "Ã©" the two UTF-8 bytes of é.
TINY_BPE = [
    "a",
    "b",
    "c",
    "'",
    "s",
    "S",
    "1",
    "2",
    "Ġ",
    "Ã",
    "©",
    "bc",
    "ab",
    "Ġa",
    "'s",
    "11",
    "Ã©",
    "Ċ",
]
TINY_MERGES = "#version: 0.2\nb c\na b\nĠ a\n' s\n1 1\nÃ ©\n"


@pytest.fixture
def bpe(tmp_path):
    vocab = {p: i for i, p in enumerate(TINY_BPE + ["<|endoftext|>"])}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (tmp_path / "merges.txt").write_text(TINY_MERGES)
    return Tokenizer.from_bpe(tmp_path / "vocab.json", tmp_path / "merges.txt")


@pytest.mark.parametrize(
    "text,ids",
    [
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
    ],
)
def test_bpe_encode_and_round_trip(bpe, text, ids):
    assert bpe.encode(text) == ids and bpe.decode(ids) == text


def test_bpe_merges_with_windows_line_ends(bpe, tmp_path):
    (tmp_path / "merges.txt").write_text(TINY_MERGES.replace("\n", "\r\n"))
    crlf = Tokenizer.from_bpe(tmp_path / "vocab.json", tmp_path / "merges.txt")
    assert crlf.encode(" abc") == bpe.encode(" abc") == [13, 11]


def test_bpe_special_ids_and_bad_files(bpe, tmp_path):
    assert (bpe.kind, bpe.vocab_size, bpe.eos_id, bpe.mask_id) == (
        "bpe",
        20,
        18,
        19,
    )  # MASK appended
    assert bpe.bos_id is None and bpe.pad_id is None and bpe.decode([0, 19, 1]) == "ab"
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
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


def test_spec_round_trip_without_the_vocab_files(tmp_path, tok, bpe):
    for t, text in [
        (BYTES, "Hello, 日本!"),
        (tok, "Hello, unaffable [MASK] 日本!"),
        (bpe, " abc a's 11"),
    ]:
        t2 = Tokenizer.from_spec(json.loads(json.dumps(t.spec())))
        assert (
            t2.spec() == t.spec() and t2.encode(text) == t.encode(text) and t2.mask_id == t.mask_id
        )
    (tmp_path / "crlf.txt").write_bytes("\r\n".join(TINY_VOCAB).encode("utf-8"))  # no final newline
    assert Tokenizer.from_vocab(tmp_path / "crlf.txt").encode("Hello!") == [17, 14]
    wp = {"kind": "wordpiece"}
    for bad in (None, "bytes", {}, {"kind": "x"}, wp, wp | {"vocab": "?"}, wp | {"vocab": ["x"]}):
        with pytest.raises(ValueError):
            Tokenizer.from_spec(bad)


@pytest.mark.parametrize(
    "content,match",
    [
        (None, "does not exist"),
        ("dir", "is not a file"),
        (b"", r"no \[PAD\], \[UNK\]"),
        (vocab_bytes(TINY_VOCAB) + b"\xff\xfeoops\n", "not UTF-8"),
        *[
            (vocab_bytes([t for t in TINY_VOCAB if t != s]), "it has no " + re.escape(s))
            for s in TINY_VOCAB[:5]
        ],
        (vocab_bytes(TINY_VOCAB + ["the"]), "twice"),
    ],
)
def test_from_vocab_rejects_bad_files(tmp_path, content, match):
    path = tmp_path / "vocab.txt"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=match):
        Tokenizer.from_vocab(path)


def test_released_owt_folder_with_gpt2_files(tmp_path):
    """An OWT SetDLM: GPT-2 BPE files (no MASK in them: it is appended), no BOS, no PAD."""
    folder = tmp_path / "owt"
    folder.mkdir()
    vocab = {p: i for i, p in enumerate(TINY_BPE + ["<|endoftext|>"])}
    V, L = len(vocab) + 1, 16
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (folder / "merges.txt").write_text(TINY_MERGES)
    spec = authors_config(V, L, 16, 2, 2, 8, V - 1, attn_backend="flex_attention")
    spec["tokenization_config"] = None
    (folder / "config.json").write_text(json.dumps(spec))
    sd = authors_weights(V, L, 16, 2)
    del sd["static_attention_mask"]  # flex-attention models do not store it
    write_safetensors(folder / "model.safetensors", sd)
    model, tok, _ = load_checkpoint(folder)
    cfg = model.cfg
    assert (cfg.bos_id, cfg.pad_id, cfg.eos_id, cfg.mask_id, cfg.max_set_size) == (
        None,
        None,
        18,
        19,
        16,
    )
    x = torch.randint(0, 19, (2, L), generator=gen(3))  # position 0: any token, not BOS
    order = sample_order(cfg, 2, gen(4))
    want = authors_nll(sd, 2, x, order, 19)
    assert elbo(model.eval(), x, generator=gen(4)).nll == pytest.approx(
        want[:, 1:].sum().item(), abs=1e-3
    )
    out = generate(model, batch_size=2, temperature=0.0)
    assert torch.all(out.tokens[:, 0] == 18) and tok.decode(out.tokens[0]).startswith(
        "<|endoftext|>"
    )
