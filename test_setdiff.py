"""Tests for setdiff.py in the file's order, each against an independent computation: a brute-force loop, a closed
form, a worked example, or the slow reference path. CPU, float32 unless exactness needs float64."""

import hashlib, json, math, os, random, re, runpy, signal, subprocess, sys
from dataclasses import asdict
from pathlib import Path

import numpy as np, pytest, torch
import torch.nn.functional as F

import sample, setdiff, train_small
from setdiff import (Config, Elbo, SetDiffusionLM, StaggeredSchedule, Tokenizer, elbo, generate,
                     load_checkpoint, max_window, sample_order, save_checkpoint, set_causal_mask, wrap_rows)

BYTES = Tokenizer.bytes()
# Tiny models gain nothing from intra-op threads, and on a busy 2-core machine the threads'
# contention made this file 2-10x slower (measured): one thread keeps it at a few seconds.
torch.set_num_threads(1)

def gen(seed):
    return torch.Generator().manual_seed(seed)

def all_raise(match, fn, cases):   # fn(case) raises a ValueError that matches, for every case
    for case in cases:
        with pytest.raises(ValueError, match=match):
            fn(case)

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

# helpers of the train_small.py tests

TINY_RUN = ("--n-layer 1 --n-head 2 --d-model 32 --seq-len 32 --batch-size 8 --lr 3e-3 --warmup-steps 4 "
            "--eval-rows 8 --workers 1 --log-every 4 --val-fraction 0.1").split()

def write_corpus(path, lines=600, seed=0):  # short sentences that a tiny model learns in a few steps
    rng, words = random.Random(seed), "the cat sat on a mat and a dog ran to the big red house under blue sky".split()
    path.write_text("".join(" ".join(rng.choice(words) for _ in range(rng.randint(4, 10))).capitalize() + ".\n"
                            for _ in range(lines)))
    return path

def run_argv(tmp_path, out="run", *extra):
    return ["--data", str(tmp_path / "corpus.txt"), "--cache-dir", str(tmp_path / "cache"),
            "--out", str(tmp_path / out), *TINY_RUN, *extra]

def logged(out, kind):
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]

def assert_one_error_line(err, needle):
    """One 'error: ...' line on stderr (progress bars aside), no traceback."""
    assert "Traceback" not in err, err
    errors = [l for l in err.replace("\r", "\n").splitlines() if l.startswith("error")]
    assert len(errors) == 1 and needle in errors[0], err
    assert all("error" in l or "%|" in l or not l.strip() for l in err.replace("\r", "\n").splitlines()), err

# helpers of the sample.py tests

SAMPLE_L, TOK, LETTERS = 24, Tokenizer.bytes(), "abcdefghijklmnopqrstuvwxyz"

VAL_TEXT = [f"the {w} sat on a mat." for w in ("cat", "dog", "fox", "owl", "hen", "ram")] * 3

def letters_model(order: str = "staggered", eos_first: bool = False) -> SetDiffusionLM:
    """A tiny random model (d=3, s=6) that writes lowercase letters only, so that given and
    generated text can be told apart: the last LayerNorm puts +10 on hidden unit 0, which the
    head maps to +3 for letters and -3 for every other id (eos_first: +5 for EOS)."""
    cfg = Config(vocab_size=TOK.vocab_size, seq_len=SAMPLE_L, n_layer=2, n_head=2, d_model=32, dropout=0.0,
                 order=order, set_size=3, pad_id=TOK.pad_id, bos_id=TOK.bos_id, eos_id=TOK.eos_id, mask_id=TOK.mask_id)
    torch.manual_seed(0)
    model = SetDiffusionLM(cfg)
    with torch.no_grad():
        for m in model.modules():           # a wide init: predictions depend on the context
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
                torch.nn.init.normal_(m.weight, std=3 / m.weight.shape[1] ** 0.5)
        [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)][-1].bias[0] = 10.0
        torch.nn.init.normal_(model.head.weight, std=0.5)
        model.head.weight[:, 0] = torch.tensor([3.0 if chr(i) in LETTERS else 5.0 if i == TOK.eos_id and eos_first
                                                else -3.0 for i in range(TOK.vocab_size)])
    return model.eval()

@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Checkpoints as train_small.py writes them (step, val_rows), and text files to score."""
    d = tmp_path_factory.mktemp("sample")
    (d / "val.txt").write_text("\n".join(VAL_TEXT) + "\n")
    (d / "empty.txt").write_text("")
    (d / "binary.txt").write_bytes(b"\xff\xfe\x00\x81 abc\n\x80\x80\xc3\n")
    wrap_rows(np.arange(300) % 26 + ord("a"), SAMPLE_L, TOK.bos_id, TOK.eos_id)[0].tofile(d / "val.bin")
    val = {"path": str(d / "val.bin"), "rows": 13, "bytes_per_token": 1.0}
    for name, rows in [("st", val), ("ar", val), ("eos", val), ("gone", {**val, "path": "-"}),
                       ("other", {**val, "path": str(d / "val.txt")})]:        # other data than the judge's
        model = letters_model("ar" if name == "ar" else "staggered", eos_first=name == "eos")
        save_checkpoint(d / f"{name}.pt", model, TOK, step=7, val_rows=rows)
    save_checkpoint(d / "noval.pt", letters_model(), TOK)
    (d / "cut.pt").write_bytes((d / "st.pt").read_bytes()[:2000])
    torch.save({"model": {}}, d / "foreign.pt")
    return d

def run(capsys, *argv) -> tuple:
    try:
        code = sample.main([str(a) for a in argv])
    except SystemExit as e:                                   # argparse errors
        code = e.code
    return (code, *capsys.readouterr())

def ok(capsys, *argv) -> str:
    code, out, err = run(capsys, *argv)
    assert code == 0 and err == "", err
    return out

def samples_of(out: str) -> list:   # [(header, text)] of every '--- sample i/n: ...' (one line of text here)
    lines = out.splitlines()
    return [(line, lines[i + 1]) for i, line in enumerate(lines) if line.startswith("--- sample ")]

def calls_of(header: str) -> int:
    return int(re.search(r": (\d+) network calls, [\d.]+ tokens/call, [\d,]+ tokens/s$", header).group(1))

BAD_INPUT = [  # (arguments: {d} the checkpoint folder, {st} a good checkpoint; what stderr says)
    ("--ckpt {d}/missing.pt", "not found"), ("--ckpt {d}/cut.pt", "truncated or corrupt"),
    ("--ckpt {d}/foreign.pt", "not a setdiff checkpoint"), ("--prompt hello", "--ckpt"),
    ("{st} --prompt " + "x" * SAMPLE_L, "leaves no room"), ("{st} --window 7", "window must be in"),  # s = 6
    ("{st} --infill no-holes", "nothing to fill"), ("{st} --prompt a --infill [MASK]", "not allowed"),
    ("{st} --eval {d}/missing.txt", "not a file"), ("{st} --eval {d}/empty.txt", "is empty"),
    ("{st} --eval {d}/binary.txt", "UTF-8"), ("--ckpt {d}/noval.pt --eval", "pass --eval FILE"),
    ("--ckpt {d}/gone.pt --eval", "pass --eval FILE"), ("{st} --num-samples 0", "must be at least 1"),
    ("{st} --span-len two", "invalid integer"), ("{st} --temperature -1", "temperature"),
    ("{st} --device nonsense", "--device"), ("{st} --no-such-flag", "unrecognized"),
    ("--compare {d}/st.pt --judge {d}/st.pt", "--order ar"),
    ("--compare {d}/other.pt --judge {d}/ar.pt", "not trained on the data"), ("{st} --order-stats", "L >= 33"),
]

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
    all_raise(None, lambda args: StaggeredSchedule(*args), [(8, 9), (8, 4, 3), (8, 0)])

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

@pytest.mark.parametrize("order,d,s,want", [
    ("staggered", 4, 8, (0.670, 0.432, 1.01, 0.87)),   # the authors' reference sampler; a pin of this code
    ("block", 4, None, (0.625, 25 / 48, 0.75, 0.75)),  # 1/4 + 3/4 * 1/2, (1 + 1/2 + 1/3 + 1/4) / 4, mean of j/2
    ("uniform", 128, 128, (0.5, 0.2, 8, 2))])          # 1/2, 1/5, 16/2, 4/2
def test_order_stats_closed_forms(order, d, s, want):
    """sample.order_stats through sample_order, the path training uses (L = 128, 4,000 orders, positions
    16..111): P(left neighbour first), P(all 4 left neighbours first), E(still masked of the 16 to the left),
    E(revealed of the 4 to the right). Seeds 0-2 spread by 0.001 and 0.003: tolerances 4x that plus rounding."""
    got = sample.order_stats(Config(seq_len=128, order=order, set_size=d, max_set_size=s))
    assert got[:2] == pytest.approx(want[:2], abs=0.004) and got[2:] == pytest.approx(want[2:], abs=0.015)

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
    all_raise("device", setdiff.pick_device, ("gpu", "meta", "cuda:x"))
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
    all_raise("outside", lambda bad: t.decode([bad]), (-1, 260, 3.0))

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
    wp = {"kind": "wordpiece"}
    all_raise(None, Tokenizer.from_spec, (None, "bytes", {}, {"kind": "x"}, wp, {**wp, "vocab": "?"}, {**wp, "vocab": ["x"]}))

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

# ---------------------------------------------------------------------------- train_small.py

def test_wrapped_rows_equal_hand_built_rows(tmp_path):
    """EOS after each sentence, chunks of L-2, [BOS] + chunk + [EOS], the tail dropped."""
    f = tmp_path / "t.txt"
    f.write_bytes(b"ab\n\ncde\r\n  f  \nghij\n")   # a blank line is no sentence; CRLF and spaces go
    rows, meta = train_small.prepare_rows([(f, "train")], Tokenizer.bytes(), 6, tmp_path / "c", verbose=False)
    B, E = Tokenizer.bytes().bos_id, Tokenizer.bytes().eos_id
    a, b, c, d, e, f_, g, h, i = map(ord, "abcdefghi")
    # stream a b E c d e E f E g h i j E -> [a b E c] [d e E f] [E g h i], tail [j E] dropped
    np.testing.assert_array_equal(rows["train"], [[B, a, b, E, c, E], [B, d, e, E, f_, E], [B, E, g, h, i, E]])
    assert rows["train"].dtype == np.uint16
    assert meta["splits"]["train"] == {"rows": 3, "lines": 4, "tokens": 14, "text_bytes": 14}

def test_held_out_lines_by_content_hash_and_every_row_bos_eos(tmp_path):
    corpus, tok = write_corpus(tmp_path / "corpus.txt"), Tokenizer.bytes()
    rows, meta = train_small.prepare_rows([(corpus, "hash")], tok, 32, tmp_path / "c", 0.1, verbose=False)
    lines = corpus.read_bytes().splitlines()
    held = [l for l in lines if int.from_bytes(hashlib.blake2b(l, digest_size=8).digest(), "little") < 0.1 * 2**64]
    for side, expected in (("val", held), ("train", [l for l in lines if l not in held])):
        r = np.asarray(rows[side])
        assert (r[:, 0] == tok.bos_id).all() and (r[:, -1] == tok.eos_id).all()
        stream = bytes(np.where(r[:, 1:-1] == tok.eos_id, ord("\n"), r[:, 1:-1]).astype(np.uint8).ravel())
        assert b"".join(l + b"\n" for l in expected).startswith(stream)   # in file order, only the tail cut
        assert meta["splits"][side]["lines"] == len(expected) and sum(len(l) + 1 for l in expected) - len(stream) < 30

def test_row_cache_reused_and_rebuilt_on_changed_input(tmp_path, capsys):
    corpus, tok, cache = write_corpus(tmp_path / "corpus.txt"), Tokenizer.bytes(), tmp_path / "c"
    rows1, meta1 = train_small.prepare_rows([(corpus, "train")], tok, 32, cache)
    built, _ = Path(rows1["train"].filename), capsys.readouterr()
    stamp = built.stat().st_mtime_ns
    rows2, meta2 = train_small.prepare_rows([(corpus, "train")], tok, 32, cache)
    assert "reusing" in capsys.readouterr().out and built.stat().st_mtime_ns == stamp and meta2 == meta1
    with open(corpus, "a") as f:
        f.write("A brand new sentence that was not there before.\n" * 20)
    rows3, meta3 = train_small.prepare_rows([(corpus, "train")], tok, 32, cache)
    assert "reusing" not in capsys.readouterr().out
    assert meta3["splits"]["train"]["lines"] == meta1["splits"]["train"]["lines"] + 20
    assert meta3["sources"][0]["size"] == corpus.stat().st_size and len(rows3["train"]) > len(rows1["train"])
    assert not list(cache.rglob("*.tmp-*"))

def test_parallel_tokenization_equals_serial(tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "corpus.txt", lines=3000)
    serial, _ = train_small.prepare_rows([(corpus, "hash")], Tokenizer.bytes(), 32, tmp_path / "a", 0.1, 1, False)
    monkeypatch.setattr(train_small, "CHUNK_BYTES", 4096)   # ~30 chunks over 2 spawned workers
    parallel, _ = train_small.prepare_rows([(corpus, "hash")], Tokenizer.bytes(), 32, tmp_path / "b", 0.1, 2, False)
    for side in ("train", "val"):
        np.testing.assert_array_equal(serial[side], parallel[side])

def test_bad_lines_are_skipped_and_counted(tmp_path):
    f, long_line = tmp_path / "t.txt", b"x" * 300_000
    f.write_bytes(b"ok one\r\n\xff\xfe broken\nnul \x00 byte\n" + long_line + b"\nok two\n")
    rows, meta = train_small.prepare_rows([(f, "train")], Tokenizer.bytes(), 8, tmp_path / "c", verbose=False)
    stream = np.frombuffer(b"ok one\n" + long_line + b"\nok two\n", np.uint8).astype(np.uint16)
    body = np.where(stream == ord("\n"), Tokenizer.bytes().eos_id, stream)[: len(stream) // 6 * 6].reshape(-1, 6)
    np.testing.assert_array_equal(np.asarray(rows["train"])[:, 1:-1], body)
    assert meta["bad_lines"] == 2 and meta["splits"]["train"]["lines"] == 3

def test_builtin_corpus_is_deterministic_prose(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "tests").mkdir(parents=True)  # test folders are skipped
    (pkg / "tests" / "t.py").write_text('"""Tests are skipped entirely by the walk over the tree."""\n')
    (pkg / "b.py").write_text('"""A file that does not parse is skipped, whatever it says."""\nprint "x"\n')
    (pkg / "c.py").write_text('def f():\n    """The first module has a sentence that is long enough."""\n'
                              'def g():\n    """A third file adds one more sentence of plain prose."""\n')
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
    assert a.read_text().splitlines() == ["The first module has a sentence that is long enough.",
                                          "Returns a Tensor with x values in every row.",
                                          "A third file adds one more sentence of plain prose."]
    assert np.__version__ in a.name and torch.__version__ in a.name       # versions name the cache
    b = train_small.builtin_corpus(tmp_path, roots=[pkg], out=tmp_path / "b.txt")
    assert b.read_bytes() == a.read_bytes()

def test_train_resume_and_ctrl_c_are_exact(tmp_path, monkeypatch, capsys):
    write_corpus(tmp_path / "corpus.txt")
    steps = ["--eval-every", "8", "--max-steps"]
    assert train_small.main(run_argv(tmp_path, "straight", *steps, "16")) == 0
    straight = tmp_path / "straight"
    loss = [m["loss"] for m in logged(straight, "train")]
    assert len(loss) == 4 and loss[-1] < loss[0] - 0.5                       # it learns
    val = logged(straight, "val")
    assert [v["step"] for v in val] == [8, 16] and all(v["bytes"] == v["rows"] * 30 for v in val)
    assert train_small.main(run_argv(tmp_path, "split", *steps, "8")) == 0
    resume = ["--resume", "--cache-dir", str(tmp_path / "cache"), "--max-steps", "16", "--out"]
    assert train_small.main([*resume, str(tmp_path / "split")]) == 0
    assert [m["loss"] for m in logged(tmp_path / "split", "train")] == loss   # same losses, no duplicates
    real, sent = train_small.learning_rate, []
    def ctrl_c_at_step_5(args, step):  # a real SIGINT in the middle of step 5
        if step == 5 and not sent:
            sent.append(os.kill(os.getpid(), signal.SIGINT))
        return real(args, step)
    monkeypatch.setattr(train_small, "learning_rate", ctrl_c_at_step_5)
    assert train_small.main(run_argv(tmp_path, "cut", *steps, "16")) == 130
    assert "interrupted at step 6" in capsys.readouterr().err
    assert load_checkpoint(tmp_path / "cut" / "ckpt.pt")[2]["step"] == 6
    assert train_small.main([*resume, str(tmp_path / "cut")]) == 0
    ref = load_checkpoint(straight / "ckpt.pt")[2]
    assert ref["step"] == 16 and ref["tokens"] == 16 * 8 * 32 and ref["args"]["n_layer"] == 1
    assert ref["val_rows"]["bytes_per_token"] == 1.0
    val_file = np.memmap(ref["val_rows"]["path"], np.uint16, "r").reshape(-1, 32)
    assert len(val_file) == ref["val_rows"]["rows"] and (val_file[:, 0] == Tokenizer.bytes().bos_id).all()
    for run in ("split", "cut"):
        other = load_checkpoint(tmp_path / run / "ckpt.pt")[2]
        for key in ("train_model", "model"):                                    # raw and EMA weights
            assert all(torch.equal(v, other[key][k]) for k, v in ref[key].items()), (run, key)
    assert "optimizer" not in load_checkpoint(straight / "best.pt")[2]

def test_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, capsys):
    write_corpus(tmp_path / "corpus.txt")
    assert train_small.main(run_argv(tmp_path, "run", "--max-steps", "4", "--eval-every", "4")) == 0
    before, _ = (tmp_path / "run" / "ckpt.pt").read_bytes(), capsys.readouterr()
    def disk_full(obj, f, *a, **k):  # what torch.save raises on a full disk, after a partial write
        open(f, "wb").write(b"partial")
        raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed (No space left on device)")
    monkeypatch.setattr(torch, "save", disk_full)
    assert train_small.main(["--resume", "--out", str(tmp_path / "run"), "--max-steps", "8",
                             "--cache-dir", str(tmp_path / "cache")]) == 2
    assert_one_error_line(capsys.readouterr().err, "No space left on device")
    assert (tmp_path / "run" / "ckpt.pt").read_bytes() == before
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["best.pt", "ckpt.pt", "metrics.jsonl"]

@pytest.mark.parametrize("case,flags,needle", [
    ("missing", ["--data", "nope.txt"], "no such file"), ("glob", ["--data", "nope-*.txt"], "matches no file"),
    ("empty", ["--data", "corpus.txt", "empty.txt"], "is empty"), ("binary", ["--data", "blob.bin"], "not look like text"),
    ("too small", ["--data", "small.txt"], "needs 30"), ("bad vocab", ["--tokenizer", "vocab.txt"], "not a BERT vocab"),
    ("missing vocab", ["--tokenizer", "none.txt"], "does not exist"), ("unknown flag", ["--no-such"], "unrecognized"),
    ("resume nothing", ["--resume", "--out", "elsewhere"], "no checkpoint"), ("set size", ["--set-size", "99"], "set_size"),
    ("eval every", ["--eval-every", "0"], "at least 1"), ("device", ["--device", "nonsense"], "--device 'nonsense'"),
    ("held run", ["--no-force"], "already holds a run")])
def test_bad_input_one_line_exit_2_nothing_touched(tmp_path, monkeypatch, capsys, case, flags, needle):
    monkeypatch.chdir(write_corpus(tmp_path / "corpus.txt").parent), (tmp_path / "empty.txt").write_text("\n  \n")
    (tmp_path / "blob.bin").write_bytes(bytes(random.Random(0).randrange(128, 256) for _ in range(5000)))
    (tmp_path / "small.txt").write_text("Only a few words.\n"), (tmp_path / "vocab.txt").write_text("[PAD]\n[CLS]\n")
    (tmp_path / "run").mkdir(), (tmp_path / "run" / "ckpt.pt").write_bytes(b"an older run")
    force = [] if flags == ["--no-force"] else ["--force"]
    argv = ["--data", "corpus.txt", "--cache-dir", "cache", "--out", "run", *TINY_RUN, "--max-steps", "2",
            *force, *[f for f in flags if f != "--no-force"]]
    assert train_small.main(argv) == 2
    assert_one_error_line(capsys.readouterr().err, needle)
    assert sorted(os.listdir(tmp_path / "run")) == ["ckpt.pt"]
    assert (tmp_path / "run" / "ckpt.pt").read_bytes() == b"an older run"

def test_resume_refuses_changed_settings_and_a_cut_off_log_line(tmp_path, capsys):
    write_corpus(tmp_path / "corpus.txt")
    assert train_small.main(run_argv(tmp_path, "run", "--max-steps", "4", "--eval-every", "4")) == 0
    capsys.readouterr()
    resume = ["--resume", "--out", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "cache")]
    assert train_small.main([*resume, "--n-layer", "2"]) == 2
    assert_one_error_line(capsys.readouterr().err, "--n-layer 2 differs from the resumed run's 1")
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "kind": "train"}\n{"step": 1')                   # after the checkpoint; cut off
    assert train_small.main([*resume, "--max-steps", "6", "--log-every", "2"]) == 0
    assert [m["step"] for m in logged(tmp_path / "run", "train")] == [4, 6]

def test_torchrun_two_gloo_processes_match_one_process(tmp_path):
    write_corpus(tmp_path / "corpus.txt")
    common = ["--global-batch", "8", "--max-steps", "6", "--eval-every", "6", "--log-every", "1"]
    run = lambda *cmd: subprocess.run([sys.executable, *cmd], cwd=Path(train_small.__file__).parent, text=True,
                                      env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, timeout=300)
    one = run("train_small.py", *run_argv(tmp_path, "one", *common))
    two = run("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "train_small.py",
              *run_argv(tmp_path, "two", *common))
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    assert "4 per forward x 1 accumulation x 2 process" in two.stdout and two.stdout.count("done:") == 1
    np.testing.assert_allclose([m["loss"] for m in logged(tmp_path / "two", "train")],
                               [m["loss"] for m in logged(tmp_path / "one", "train")], rtol=1e-4)
    w1, w2 = (load_checkpoint(tmp_path / o / "ckpt.pt")[2]["train_model"] for o in ("one", "two"))
    assert all(torch.allclose(w1[k], w2[k], atol=1e-5) for k in w1)

def test_bench_prints_the_table(capsys):
    assert train_small.main(["--bench", *TINY_RUN[:10], "--bench-steps", "1", "--bench-repeats", "1"]) == 0
    rows = [l.split("|")[1:-1] for l in capsys.readouterr().out.splitlines() if l.startswith("| ") and "x |" in l]
    assert [r[0].strip() for r in rows] == ["float32", "float32", "bfloat16", "bfloat16"]
    for set_row, ar_row in (rows[0:2], rows[2:4]):
        ms_set, ms_ar = float(set_row[2]), float(ar_row[2])   # printed to 0.1 ms, the ratio to 0.01
        tol = 0.006 + 0.05 * (1 / ms_set + 1 / ms_ar) * ms_set / ms_ar
        assert float(set_row[4].strip()[:-1]) == pytest.approx(ms_set / ms_ar, abs=tol)

def test_bench_ar_loss_equals_prefix_by_prefix_next_token_loss():
    """The AR baseline is a true causal LM: each prefix fed alone gives the same loss."""
    torch.manual_seed(0)
    model = SetDiffusionLM(Config(seq_len=10, n_layer=2, n_head=2, d_model=32, dropout=0.0))
    torch.nn.init.normal_(model.head.weight)                                  # not the zero init
    x = torch.cat([torch.full((2, 1), Tokenizer.bytes().bos_id), torch.randint(0, 256, (2, 9))], 1)
    nll = [-torch.log_softmax(model.logits(model.run(x[b:b + 1, :i + 1], torch.arange(i + 1)[None],
                                                     torch.ones(i + 1, i + 1, dtype=torch.bool).tril()[None]))[0, -1],
                              -1)[x[b, i + 1]] for b in range(2) for i in range(9)]
    assert torch.allclose(train_small.ar_loss(model, x), torch.stack(nll).mean(), atol=1e-5)

# ---------------------------------------------------------------------------- sample.py

def test_sample_unconditional_and_prompt_with_speed_lines(ckpts, capsys):
    args = ("--ckpt", ckpts / "st.pt", "--num-samples", 3, "--batch-size", 2)
    out = ok(capsys, *args)
    found = [t for h, t in samples_of(out) if calls_of(h) > 0]
    assert [h[:15] for h, _ in samples_of(out)] == [f"--- sample {i}/3:" for i in (1, 2, 3)]
    assert all(re.fullmatch(f"[a-z]{{{SAMPLE_L - 1}}}", t) for t in found) and len(set(found)) == 3
    assert [t for _, t in samples_of(ok(capsys, *args))] == found                               # --seed
    assert [t for _, t in samples_of(ok(capsys, *args, "--seed", 1))] != found
    (header, text), = samples_of(ok(capsys, "--ckpt", ckpts / "st.pt", "--prompt", "Hi, you", "--max-new-tokens", 9))
    assert re.fullmatch(r"Hi, you[a-z]{9}", text) and calls_of(header) == 9    # tau > 1: one token a call

@pytest.mark.parametrize("template,pattern", [("A [MASK]. B [MASK][MASK]!", r"A [a-z]\. B [a-z]{2}!"),
                                              ("X ___ Y", r"X [a-z]{3} Y"), ("___5 Z ___2", r"[a-z]{5} Z [a-z]{2}")])
def test_sample_infill_fills_only_the_holes(ckpts, capsys, template, pattern):
    out = ok(capsys, "--ckpt", ckpts / "st.pt", "--infill", template, "--span-len", 3, "--threshold", 0.5,
             "--num-samples", 2)
    texts = [t for _, t in samples_of(out)]
    assert len(texts) == 2 and all(re.fullmatch(pattern, t) for t in texts), texts

def test_sample_show_order_marks_every_set(ckpts, capsys):
    out = ok(capsys, "--ckpt", ckpts / "st.pt", "--prompt", "Go", "--threshold", 0.3, "--temperature", 0,
             "--window", 6, "--show-order")
    (header, text), = samples_of(out)
    picture, summary = out.split("--- decode order:\n")[1].splitlines()[:2]
    runs = [(t, int(s)) for t, s in re.findall(r"\[([a-z]+)\](\d+)", picture)]
    assert picture == "Go" + "".join(f"[{t}]{s}" for t, s in runs) and "Go" + "".join(t for t, _ in runs) == text
    sizes = [sum(len(t) for t, s in runs if s == step) for step in range(calls_of(header))]
    assert min(sizes) >= 1 and max(sizes) > 1 and sum(sizes) == SAMPLE_L - 3       # every call one set
    assert summary == "--- network calls revealed: " + ", ".join(
        f"{sizes.count(n)} x {n} token{'s' * (n > 1)}" for n in sorted(set(sizes)))
    ids, steps = [TOK.bos_id, *b"abcde", TOK.eos_id, TOK.pad_id], [-1, -1, -1, 1, 1, 0, 2, -2]
    assert sample.decode_order(TOK, ids, steps).splitlines()[1:] == [
        "ab[cd]1[e]0[\\n]2", "--- network calls revealed: 2 x 1 token, 1 x 2 tokens"]

def test_sample_stop_at_eos(ckpts, capsys):
    """EOS beats every letter: with --stop-at-eos the sample ends at its first generated EOS."""
    common = ("--ckpt", ckpts / "eos.pt", "--prompt", "Hi", "--temperature", 0)
    (header, text), = samples_of(ok(capsys, *common, "--stop-at-eos"))
    (full, _), = samples_of(ok(capsys, *common))
    assert text == "Hi" and calls_of(header) < calls_of(full) == SAMPLE_L - 3

def test_sample_eval_equals_the_bound_on_wrapped_rows(ckpts, capsys):
    out = ok(capsys, "--ckpt", ckpts / "st.pt", "--eval", ckpts / "val.txt", "--num-orders", 2)
    stream, body = [i for line in VAL_TEXT for i in TOK.encode(line) + [TOK.eos_id]], SAMPLE_L - 2   # by hand
    rows = torch.tensor([[TOK.bos_id, *stream[k:k + body], TOK.eos_id] for k in range(0, len(stream) - body + 1, body)])
    res = elbo(letters_model(), rows, num_orders=2, generator=torch.Generator().manual_seed(0))
    assert f"val {res.line(len(rows) * body)}" in out        # bytes tokenizer: L-2 source bytes a row
    out = ok(capsys, "--ckpt", ckpts / "st.pt", "--eval", "--eval-rows", 4, "--batch-size", 2, "--seed", 3)
    val = torch.from_numpy(np.fromfile(ckpts / "val.bin", dtype=np.uint16).astype(np.int64)).view(-1, SAMPLE_L)
    res = elbo(letters_model(), val[:4], num_orders=1, generator=torch.Generator().manual_seed(3))
    assert f"val {res.line(4 * body)}" in out and "validation split" in out   # no FILE: the run's val_rows

@torch.no_grad()
def test_plain_decoder_is_an_exact_kv_cached_causal_decoder():
    """The bench's peer (timing only: a set model predicts from MASK queries, not from the last token),
    greedy: each token is the argmax of ONE cache-free causal forward over the finished rows."""
    model, L = letters_model(), SAMPLE_L
    plain = sample.plain_decoder(model, 2, temperature=0, top_p=1, generator=None)
    h = model.run(plain.tokens[:, :-1], torch.arange(L - 1).expand(2, -1), torch.ones(1, L - 1, L - 1).tril().bool())
    assert torch.equal(model.logits(h).argmax(-1), plain.tokens[:, 1:]) and plain.tokens[:, 1:].unique().numel() > 3
    assert plain.nfe == L - 1 and plain.tokens_per_step == 1 and plain.reveal_step[1].tolist() == list(range(-1, L - 1))

def test_sample_bench_and_order_stats_as_scripts(ckpts, tmp_path, capsys):
    argv = f"sample.py --bench --ckpt {ckpts / 'st.pt'} --bench-repeats 1 --bench-batch-sizes 1 2".split()
    r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=os.path.dirname(sample.__file__),
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert r.returncode == 0 and "Traceback" not in r.stderr and "command: python " + " ".join(argv) in r.stdout, r.stderr
    rows = re.findall(r"^\| (plain|cached|cache-free|w=[ds]=\d)[^|]* \|( [\d.,]+ \|){4} [\d.]+x \|$", r.stdout, re.M)
    assert len(rows) == 15 and rows[0][0] == "plain" and r.stdout.count("identical outputs: yes") == 2
    assert len(re.findall(r"^batch [12], w=[ds]=[36]: the (set sampler overtakes|plain decoder is) ", r.stdout, re.M)) == 4
    save_checkpoint(tmp_path / "l40.pt", SetDiffusionLM(tiny_cfg(seq_len=40)), BYTES)
    out = ok(capsys, "--ckpt", tmp_path / "l40.pt", "--order-stats")
    assert re.findall(r"^\| (.+?) \|", out, re.M)[1:] == ["staggered d=3, s=6", "ar", "block d=3", "uniform"]
    assert "| ar | 1.000 | 1.000 | 0.00 | 0.00 |" in out and "positions 16..23)" in out

def test_compare_on_tiny_runs_writes_the_figures_data(tmp_path, capsys):
    """Two tiny training runs, the comparison with --json, and the data assets/plot.py draws (no matplotlib)."""
    write_corpus(tmp_path / "corpus.txt")
    for o in ("ar", "staggered"):
        assert train_small.main(run_argv(tmp_path, o, *f"--order {o} --set-size 2 --max-steps 8 --eval-every 4".split())) == 0
    capsys.readouterr()
    out = ok(capsys, "--compare", tmp_path / "ar/ckpt.pt", tmp_path / "staggered/ckpt.pt", "--judge", tmp_path /
             "ar/ckpt.pt", "--compare-samples", 3, "--eval-rows", 4, "--json", tmp_path / "cmp.json")
    assert len(re.findall(r"^\| staggered d=2, s=4 \| [24] \| (>1|0\.\d+) \|", out, re.M)) == 2 * 8    # windows d, s
    assert re.search(r"^\| ar \| [\d.]+ \| [\d.]+ \+- [\d.]+ \| [\d.]+ \| 124 \|$", out, re.M)     # 4 rows x 31
    plot = runpy.run_path(str(Path(sample.__file__).parent / "assets" / "plot.py"))   # its functions, no matplotlib
    cmp = json.loads((tmp_path / "cmp.json").read_text())
    assert [b["num_orders"] for b in cmp["bounds"]] == [4, 4] and len(cmp["samples"]) == 1 + 16
    val = [(r["tokens"], r["bits_per_byte"]) for r in logged(tmp_path / "ar", "val")]
    assert plot["training_curve"](tmp_path / "ar/metrics.jsonl") == val and len(val) == 2
    lines, reach = plot["frontier"](cmp), plot["within"](cmp)
    assert list(lines) == ["ar, w=1", "staggered d=2, s=4, w=2", "staggered d=2, s=4, w=4"] and len(lines["ar, w=1"]) == 1
    assert all(points == sorted(points) and points[0][0] >= 1 for points in lines.values())
    base = {(r["model"], r["window"]): r["judge_nll"] for r in cmp["samples"] if r["threshold"] is None}
    for r in cmp["samples"]:   # by hand: every sample within 1.1 x the NLL at tau > 1 is at most the reach ...
        key = (r["model"], r["window"])
        assert r["tokens_per_call"] <= reach[f"{key[0]}, w={key[1]}"] or r["judge_nll"] > 1.1 * base[key]
    assert all(any(r["tokens_per_call"] == v and r["judge_nll"] <= 1.1 * base[r["model"], r["window"]]   # ... one is it
                   and name == f"{r['model']}, w={r['window']}" for r in cmp["samples"]) for name, v in reach.items())

def test_text_statistics_closed_forms():
    judge, x = letters_model("ar"), torch.tensor([[TOK.bos_id, *TOK.encode("the cat sat on the mat, it sat")[:23]]])
    logp, got = torch.log_softmax(judge(x, torch.arange(SAMPLE_L)[None]).double(), -1), sample.text_stats(judge, x)
    assert got["judge_nll"] == pytest.approx(-logp[:, 1:].gather(-1, x[:, 1:, None]).mean().item(), rel=1e-5)
    p = torch.tensor([x[0, 1:].tolist().count(c) for c in set(x[0, 1:].tolist())]) / 23     # BOS left out
    assert got["unigram_entropy"] == pytest.approx(-(p * p.log2()).sum().item())
    assert got["distinct_4grams"] == len({tuple(x[0, i:i + 4].tolist()) for i in range(1, 21)}) / 20
    assert sample.text_stats(judge, torch.tensor([[TOK.bos_id] + [7] * 23] * 2))["distinct_4grams"] == 1 / 40

@pytest.mark.parametrize("argv,message", BAD_INPUT)
def test_sample_bad_input(ckpts, capsys, argv, message):
    code, _, err = run(capsys, *argv.format(d=ckpts, st=f"--ckpt {ckpts}/st.pt").split())
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1 and message in err, err
