"""Tests of setdiff.py in the file's order, then of train_small.py, sample.py and experiments/.
Each test checks one behaviour against an independent computation: a brute-force loop, a closed
form, a worked example, rows built by hand, the cache-free path, or a forward written here from
the authors' description. CPU, tiny models, float32 unless exactness needs float64, no downloads.
Cases sit in tables {test id: case}; `table` turns one into pytest.mark.parametrize."""

import ast
import contextlib
import copy
import dataclasses
import errno
import functools
import hashlib
import importlib
import importlib.util
import inspect
import io
import itertools
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import time
import types
import warnings
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
import torch._inductor.config
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import sample
import setdiff
import train_small
from setdiff import Config, SetDiffusionLM, Tokenizer, elbo, generate, load_checkpoint, sample_order

BYTES = Tokenizer.bytes()
# Tiny models gain nothing from intra-op threads, and the threads' contention slows them down.
torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def one_thread():
    yield
    torch.set_num_threads(1)  # a training run may pick another count (--threads)


def table(names: str, cases: dict):
    """pytest.mark.parametrize over {test id: case}."""
    return pytest.mark.parametrize(names, list(cases.values()), ids=list(cases))


# The numerical tests that a GPU can run take a device: "on_cpu" always, "on_cuda" where torch
# sees a CUDA GPU (skipped elsewhere, never failed); experiments/gpu_check.py runs them by id.
CUDA = torch.cuda.is_available()
no_gpu = pytest.mark.skipif(not CUDA, reason="no CUDA GPU here")
DEVICES = [pytest.param("cpu", id="on_cpu"), pytest.param("cuda", id="on_cuda", marks=no_gpu)]
on_devices = pytest.mark.parametrize("device", DEVICES)


# Operations that bring a result to the host: on a GPU each waits for all queued work. A
# tensor's `if` is __bool__; a boolean mask's indexing reads the count of its True entries.
HOST_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero"}
HOST_READS |= {"cpu", "numpy", "equal", "masked_select", "unique"}


class HostReads(TorchFunctionMode):
    """Counts the host reads of HOST_READS on a CPU, where none waits for anything."""

    def __init__(self, reads):
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        index = args[1] if name in ("__getitem__", "__setitem__") else None
        bool_index = torch.is_tensor(index) and index.dtype == torch.bool
        if name in HOST_READS or bool_index:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def host_reads(device):
    """-> a list of the host reads in the block: CUDA's own sync check on a GPU (a warning for
    each operation that waits for the GPU), HostReads on a CPU."""
    reads = []
    if device == "cpu":
        with HostReads(reads):
            yield reads
        return
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield reads
        finally:
            torch.cuda.set_sync_debug_mode("default")
    messages = [str(w.message) for w in caught]
    reads += [m for m in messages if "synchroniz" in m]


def gen(seed):
    return torch.Generator().manual_seed(seed)


def on_device(inputs, device):
    """generate()'s keyword arguments with their tensors moved to `device`."""
    moved = {}
    for key, value in inputs.items():
        if torch.is_tensor(value):
            value = value.to(device)
        moved[key] = value
    return moved


NO_BOS = dict(bos_id=None, pad_id=None)  # OWT-style rows: no BOS, and no PAD (EOS pads)


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


def position_nll(model, x, order):
    """-log p(x_i | x before i in order) at every position i: (B, L) float64."""
    logits = setdiff.position_logits(model, x, order)
    logp = torch.log_softmax(logits.double(), -1)
    return -logp.gather(-1, x[..., None])[..., 0]


def nll_of(model, x, order, scored):
    """Sum over scored positions of -log p(x_i | x before i in order), per row (float64)."""
    nll = position_nll(model, x, order)
    scored = torch.as_tensor(scored)
    return torch.where(scored, nll, 0.0).sum(1).tolist()


def causal_logits(model, tokens, positions):
    """A causal forward: each slot sees itself and the slots before it -> logits (B, T, V)."""
    T = tokens.shape[1]
    ones = torch.ones(T, T, dtype=torch.bool, device=tokens.device)
    causal = ones.tril()[None]
    return model(tokens, positions, causal)


def one_query_logits(model, x, revealed, target):
    """Logits (V,) for x[0, target] from a forward of just the revealed tokens (causal among
    themselves, in the order given) and ONE mask query that sees all of them and itself."""
    mask = torch.tensor([model.cfg.mask_id], device=x.device)
    tokens = torch.cat([x[0, revealed], mask])[None]
    positions = torch.tensor([revealed + [target]], device=x.device)
    return causal_logits(model, tokens, positions)[0, -1]


def log_p(model, row, revealed, target):
    """log p(. | x_revealed) at `target`, from one query after the revealed tokens."""
    logits = one_query_logits(model, row[None], revealed, target)
    return torch.log_softmax(logits.double(), -1)


def chain_nll(model, row, revealed, span):
    """Sum over the span of -log p(x_t | all revealed before t), left to right."""
    nll = 0.0
    for k, t in enumerate(span):
        logp = log_p(model, row, revealed + span[:k], t)
        nll -= logp[row[t]].item()
    return nll


# ---- config, order policies, schedule -------------------------------------------------------
@table(
    "kw,match",
    {
        "unknown-order": (dict(order="random"), "unknown order policy"),
        "d-over-L": (dict(set_size=25), "set size d"),
        "s-under-d": (dict(set_size=3, max_set_size=2), "largest set size s"),
        "L-1": (dict(seq_len=1, set_size=1), "at least 2"),
        "D-not-split-by-heads": (dict(d_model=30, n_head=4), "multiple of n_head"),
        "odd-head-size": (dict(d_model=6, n_head=2), "even"),
        "mask-is-eos": (dict(mask_id=258), "MASK must differ"),
        "pad-is-bos": (dict(pad_id=257), "PAD must differ"),
        "bos-outside-vocab": (dict(bos_id=300), "not in the vocab"),
        "no-heads": (dict(n_head=0), r"n_head must be in \[1, 2\*\*20\], got 0"),
        "L-past-2-16": (dict(seq_len=2**16 + 1), "at most 65536"),
        "float-width": (dict(d_model=32.0), "d_model must be an integer, got 32.0"),
        "string-set-size": (dict(set_size="3"), "set_size must be an integer, got '3'"),
        "dropout-1": (dict(dropout=1), r"dropout must be in \[0, 1\), got 1"),
    },
)
def test_config_rejects_a_bad_setting(kw, match):
    with pytest.raises(ValueError, match=match):
        tiny_cfg(**kw)


def test_config_checks_only_what_the_policy_uses():
    ar = Config(order="ar", seq_len=3)  # d = 4 > L is unused by AR
    uniform = Config(order="uniform", seq_len=3, set_size=99)
    assert ar.max_set_size is None
    assert uniform.order == "uniform"


def right_to_left(cfg):
    """A made-up policy's fields: position L - 1 first, then leftwards (0 stays given first)."""
    L = cfg.seq_len
    times = torch.arange(L, dtype=torch.float64)  # the later a position, the earlier revealed

    def reveal_times(batch_size, generator=None):
        return times.expand(batch_size, L)

    key = L - 1 - torch.arange(L)  # the sampler's window opens at the rightmost masked position
    windows = dict(max_window=1, set_size=1, block_size=None)
    return dict(reveal_times=reveal_times, sampler_key=key) | windows


def add_policy(monkeypatch, omit=None, **change):
    """The made-up policy "r2l", its one entry in ORDER_POLICIES, a field left out or changed
    -> a tiny model of it."""

    def r2l(cfg):
        fields = right_to_left(cfg) | change
        fields.pop(omit, None)
        return setdiff.OrderPolicy(**fields)

    monkeypatch.setitem(setdiff.ORDER_POLICIES, "r2l", r2l)
    return tiny_model(order="r2l")


FIELDS = [f.name for f in dataclasses.fields(setdiff.OrderPolicy)]
OMITTED = {f"without-{name}": name for name in FIELDS}


@table("field", OMITTED)
def test_a_policy_that_leaves_out_a_field_is_refused(monkeypatch, field):
    missing = f"missing 1 required positional argument: '{field}'"
    with pytest.raises(TypeError, match=missing):
        add_policy(monkeypatch, omit=field)


@table(
    "key",
    {
        "a-list": list(range(24)),
        "too-short": torch.arange(23),
        "a-repeated-position": torch.arange(24) // 2,
        "from-1": torch.arange(1, 25),
    },
)
def test_a_policy_whose_sampler_key_is_not_an_order_is_refused(monkeypatch, key):
    with pytest.raises(ValueError, match="'r2l': sampler_key must hold each of 0..23 once"):
        add_policy(monkeypatch, sampler_key=key)


R2L = list(range(23, 0, -1))  # the made-up policy's order after position 0


def test_a_new_policy_trains_on_its_own_orders(monkeypatch):
    """The loss of one entry's policy is its chain rule right to left, slot 0 (predicted from
    nothing) included, by one-query forwards."""
    model = add_policy(monkeypatch)
    x = random_rows(model.cfg, 2, seed=3)
    chains = [chain_nll(model, row, [], [0, *R2L]) / 24 for row in x]
    loss = setdiff.set_factorized_loss(model, x, generator=gen(0))
    assert math.isclose(loss.item(), sum(chains) / 2, rel_tol=1e-5)


def test_a_new_policy_is_scored_in_its_own_order(monkeypatch):
    model = add_policy(monkeypatch)
    x = random_rows(model.cfg, 2, seed=3)
    chains = [chain_nll(model, row, [0], R2L) for row in x]
    bound = setdiff.elbo(model, x, generator=gen(0))
    assert math.isclose(bound.nll, sum(chains), rel_tol=1e-5)


@table("ancestral", {"default-sampler": False, "ancestral-sampler": True})
@table("start", {"unconditional": dict(batch_size=2), "prompt": dict(prompt=[[65, 66]] * 2)})
def test_a_new_policy_samples_in_its_own_order(monkeypatch, ancestral, start):
    """Each call reveals the next position leftwards, from the row's end to the context."""
    model = add_policy(monkeypatch)
    out = generate(model, **start, ancestral=ancestral, generator=gen(1))
    P = 24 - out.calls  # BOS (and the prompt): given
    right_to_left = torch.arange(out.calls - 1, -1, -1)
    assert torch.equal(out.reveal_call[:, P:], right_to_left.expand(2, -1))


def readme_code(heading):
    """The first ```python block of README.md after `heading`."""
    after = (ROOT / "README.md").read_text().split(heading, 1)[1]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_readmes_new_policy_runs_as_written_and_says_what_it_prints(monkeypatch, capsys):
    """The README's right-to-left entry, run as written, prints the reveal order its comment
    shows (the entry it adds is undone after the test)."""
    monkeypatch.setattr(setdiff, "ORDER_POLICIES", dict(setdiff.ORDER_POLICIES))
    code = readme_code("### Adding an order policy")
    exec(code, {})
    comment = re.search(r"^print\(.*\)  # (\[[-\d, ]*\])", code, re.M)
    said = comment[1]
    assert capsys.readouterr().out == said + "\n"
    assert said == str([setdiff.GIVEN, *range(6, -1, -1)])


EVERY_POLICY = pytest.mark.parametrize("order", list(setdiff.ORDER_POLICIES))  # new ones too


@EVERY_POLICY
def test_every_policy_draws_permutations_with_position_0_first(order):
    cfg = tiny_cfg(order=order)
    orders = sample_order(cfg, 16, gen(0))
    assert torch.equal(orders.sort(1).values, torch.arange(24).expand(16, -1))
    assert (orders[:, 0] == 0).all()


@EVERY_POLICY
def test_every_policy_orders_stay_in_its_window(order):
    """Each position its orders reveal lies within max_window of the leftmost one not yet
    revealed (and, with block edges, in its block): the windows the sampler may open."""
    cfg = tiny_cfg(order=order)
    policy = setdiff.order_policy(cfg)
    for row in sample_order(cfg, 16, gen(1)).tolist():
        left = set(range(24))
        for p in row:
            f = min(left)
            assert p - f < policy.max_window
            if policy.block_size:
                assert p // policy.block_size == f // policy.block_size
            left.remove(p)


@EVERY_POLICY
def test_every_policy_trains_with_a_finite_loss_and_gradient(order):
    model = tiny_model(order=order).train()
    loss = setdiff.set_factorized_loss(model, random_rows(model.cfg, 4), generator=gen(2))
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert math.isfinite(loss.item())
    assert all(torch.isfinite(g).all() for g in grads)


@EVERY_POLICY
@table("threshold", {"one-a-call": 1.5, "tau-0.3": 0.3})
def test_every_policy_samples_every_position(order, threshold):
    model = tiny_model(order=order)
    out = generate(model, batch_size=2, threshold=threshold, generator=gen(3))
    assert not (out.tokens == model.cfg.mask_id).any()
    assert (out.reveal_call[:, 1:] >= 0).all()  # all but position 0 revealed by a call


# the paper's L = 128 values, and the authors' StaggeredNoise(L, d, 2d) of the OWT models
PAPER_SCHEDULES = {
    "L128-d4": (128, 4, 0.059259, 0.358090),
    "L128-d8": (128, 8, 0.111888, 0.387534),
    "L128-d16": (128, 16, 0.201258, 0.450425),
    "L1024-d4": (1024, 4, 0.007759, 0.336378),
    "L1024-d16": (1024, 16, 0.030332, 0.346925),
}


@table("L,d,b,k", PAPER_SCHEDULES)
def test_schedule_b_and_k_are_the_papers_closed_forms(L, d, b, k):
    s = setdiff.StaggeredSchedule(L, d)
    assert round(s.b, 6) == b
    assert round(s.k, 6) == k
    assert math.isclose(s.b, 2 * d / (L + 2 * d - 1))
    assert math.isclose(s.b * s.k / (s.k + 1), d / (2 * L))  # the masked area A


@table("L,d,b,k", PAPER_SCHEDULES)
def test_schedule_reach_is_s(L, d, b, k):
    s = setdiff.StaggeredSchedule(L, d)
    assert math.isclose(s.reach, 2 * d)  # r = s exactly
    assert s.ceil_reach == 2 * d


@table("L,d,b,k", PAPER_SCHEDULES)
def test_schedule_offsets_run_from_1_minus_b_to_0(L, d, b, k):
    s = setdiff.StaggeredSchedule(L, d)
    assert math.isclose(s.loc[0].item(), 1 - s.b)  # position 0: the largest offset
    assert s.loc[-1].item() == 0.0


def test_schedule_with_d_equal_s_has_straight_curves_and_a_reach_just_over_d():
    s = setdiff.StaggeredSchedule(128, 4, 4)
    assert s.k == 1
    assert math.isclose(s.b, 4 / 128)
    assert math.isclose(s.reach, 4 * 127 / 124)
    assert s.ceil_reach == 5


def test_uniform_schedule_has_width_1_and_every_offset_0():
    u = setdiff.StaggeredSchedule(10, 10, 10)
    assert u.b == 1
    assert torch.all(u.loc == 0)
    assert u.ceil_reach == 10


@table(
    "args",
    {
        "d-over-L": (8, 9),  # L, d
        "s-under-d": (8, 4, 3),  # L, d, s
        "d-0": (8, 0),
    },
)
def test_schedule_rejects_bad_sizes(args):
    with pytest.raises(ValueError):
        setdiff.StaggeredSchedule(*args)


@table(
    "kw,window",
    {
        "ar": (dict(order="ar"), 1),
        "uniform": (dict(order="uniform"), 24),
        "block": (dict(order="block", set_size=4), 4),
        "staggered": (dict(set_size=4), 8),
        "staggered-d-equals-s": (dict(set_size=4, max_set_size=4), math.ceil(4 * 23 / 20)),
    },
)
def test_max_window_of_each_policy(kw, window):
    assert setdiff.max_window(tiny_cfg(**kw)) == window


def test_schedule_with_d_1_gives_the_identity_order():
    T = setdiff.StaggeredSchedule(32, 1).first_hitting_times(500, gen(3))
    order = torch.argsort(-T, 1)
    assert torch.equal(order, torch.arange(32).expand(500, -1))


@table(
    "kw",
    {
        "uniform": dict(order="uniform"),
        "no-bos": NO_BOS,  # OWT rows: position 0 holds any token
    },
)
def test_orders_pin_position_0_first(kw):
    order = sample_order(tiny_cfg(**kw), 200, gen(4))
    assert torch.all(order[:, 0] == 0)


def test_uniform_orders_fill_each_slot_uniformly():
    N = 12000
    cfg = tiny_cfg(seq_len=6, order="uniform", set_size=6)
    order = sample_order(cfg, N, gen(4))
    freq = F.one_hot(order[:, 1:], 6).double().mean(0)[:, 1:]  # (slot, position), both 1..5
    sigma = math.sqrt(0.2 * 0.8 / N)
    assert torch.all((freq - 0.2).abs() < 5 * sigma)


def block_orders():
    """Block orders of 12 positions, blocks of 4; positions 1, 7, 8 given, 10 and 11 padding."""
    cfg = tiny_cfg(seq_len=12, order="block", set_size=4)
    pad = (torch.arange(12) >= 10).expand(200, -1)
    given = torch.zeros(200, 12, dtype=torch.bool)
    given[:, [1, 7, 8]] = True  # any set of positions, not only a prefix
    return sample_order(cfg, 200, gen(5), given=given, pad=pad).tolist()


def test_orders_are_permutations():
    for row in block_orders():
        assert sorted(row) == list(range(12))


def test_given_positions_come_first_in_position_order():
    for row in block_orders():
        assert row[:4] == [0, 1, 7, 8]


def test_padding_comes_last():
    for row in block_orders():
        assert row[-2:] == [10, 11]


def test_block_orders_visit_the_blocks_left_to_right():
    for row in block_orders():
        blocks = [p // 4 for p in row[4:10]]
        assert blocks == sorted(blocks)


def test_block_orders_are_random_inside_a_block():
    firsts = {tuple(row[4:6]) for row in block_orders()}  # block 0's free positions
    assert len(firsts) > 1


def test_staggered_orders_put_a_given_suffix_first():
    given = torch.arange(24)[None] >= 20
    order = sample_order(tiny_cfg(), 1, gen(6), given=given)
    assert order[0, :5].tolist() == [0, 20, 21, 22, 23]


CURVES = {  # L, d, s
    "d3-s6": (16, 3, 6),  # s = 2d, k < 1
    "d-equals-s": (16, 4, 4),  # k = 1: straight curves
    "d2-s7": (12, 2, 7),  # s > 2d
}
TIMES = torch.linspace(0, 1, 41, dtype=torch.float64)  # the times t the curves are read at


def masking_curves(sched, t):
    """m_i(t) = 1 - (1 - u)^k, u = (t - loc_i) / b clamped to [0, 1]: (T, L) float64."""
    u = (t[:, None] - sched.loc[None, :]) / sched.b
    return 1 - (1 - u.clamp(0, 1)) ** sched.k


@table("L,d,s", CURVES)
def test_mask_prob_is_the_closed_form(L, d, s):
    sched = setdiff.StaggeredSchedule(L, d, s)
    want = masking_curves(sched, TIMES)
    assert torch.allclose(sched.mask_prob(TIMES), want, atol=1e-12)


@table("L,d,s", CURVES)
def test_first_hitting_times_follow_the_masking_curves(L, d, s):
    """P(T_i <= t) = m_i(t): the empirical CDF within 5 standard errors."""
    sched = setdiff.StaggeredSchedule(L, d, s)
    m = masking_curves(sched, TIMES)  # (41, L)
    N = 20000
    T = sched.first_hitting_times(N, gen(1))  # (N, L)
    empirical = (T[None] <= TIMES[:, None, None]).double().mean(1)
    slack = 5 * torch.sqrt(m * (1 - m) / N) + 2e-3
    assert torch.all((empirical - m).abs() <= slack)


def test_masking_curve_of_d_1_is_a_step():
    hard = setdiff.StaggeredSchedule(9, 1).mask_prob(TIMES)
    assert set(hard.unique().tolist()) == {0.0, 1.0}
    assert torch.all(hard.diff(dim=0) >= 0)


def farthest_reveal(sched, n):
    """Replaying n orders: the farthest revealed token beyond the leftmost unrevealed one."""
    L = sched.L
    worst = 0
    times = sched.first_hitting_times(n, gen(2))
    for order in torch.argsort(-times, 1).tolist():
        revealed = [False] * L
        f = 0
        for p in order:
            revealed[p] = True
            while f < L and revealed[f]:
                f += 1
            if f < L:
                last = max(i for i in range(L) if revealed[i])
                worst = max(worst, last - f)
    return worst


@table(
    "d,s",
    {
        "d4-s8": (4, 8),  # s = 2d: r = s
        "d3-s5": (3, 5),  # s < 2d
        "d4-s4": (4, 4),  # d = s: r a bit over d
        "d6-s6": (6, 6),
    },
)
def test_reveals_reach_ahead_at_most_ceil_reach(d, s):
    """Ahead by d - 1 at least (the policy does reach ahead), by less than ceil(r) at most."""
    sched = setdiff.StaggeredSchedule(40, d, s)
    r = sched.b * 39 / (1 - sched.b)
    limit = math.ceil(r - 1e-9)
    assert d - 1 <= farthest_reveal(sched, 400) < limit


# ---- set-causal masks, transformer ----------------------------------------------------------
def test_set_causal_mask_is_the_worked_example():
    """Clean slot i sees clean j <= i, no mask slot; mask slot i sees clean j < i, and itself."""
    rows = ["1000 0000", "1100 0000", "1110 0000", "1111 0000"]  # clean slots c0..c3
    rows += ["0000 1000", "1000 0100", "1100 0010", "1110 0001"]  # mask slots m0..m3
    want = torch.tensor([[c == "1" for c in r if c != " "] for r in rows])
    assert torch.equal(setdiff.set_causal_mask(4), want)


def test_show_mask_prints_the_worked_example():
    shown = setdiff.show_mask(setdiff.set_causal_mask(4))
    assert "m3 [ 1  1  1  0 |  0  0  0  1 ]" in shown


def test_show_call_prints_the_readmes_example():
    """The call after one that revealed 2 and 4 (0, 1 cached; w = 3), by the rules: a new token
    sees the cache, the new tokens up to itself; a query the cache, every new token, itself."""
    shown = setdiff.show_call(6, [0, 1], [2, 4], [3, 5])
    assert shown.splitlines() == [
        "    p0 p1 p2 p3 p4 p5 | n2 n4 | q3 q5",
        "n2 [ 1  1  0  0  0  0 |  1  0 |  0  0 ]",
        "n4 [ 1  1  0  0  0  0 |  1  1 |  0  0 ]",
        "q3 [ 1  1  0  0  0  0 |  1  1 |  1  0 ]",
        "q5 [ 1  1  0  0  0  0 |  1  1 |  0  1 ]",
    ]
    assert shown in (ROOT / "README.md").read_text()


@table("L", {f"L{L}": L for L in (1, 2, 3, 5, 8, 13)})
def test_set_causal_mask_follows_the_rules_slot_by_slot(L):
    mask = setdiff.set_causal_mask(L)
    for q in range(2 * L):
        for k in range(2 * L):
            i = q % L
            j = k % L
            if q < L:  # a clean query: earlier and own clean slots
                want = k < L and j <= i
            else:  # a mask query: earlier clean slots, and its own slot
                want = j < i if k < L else i == j
            assert bool(mask[q, k]) == want, (q, k)


def random_call():
    """A model and a call: 10 tokens, shuffled positions, a random mask with the diagonal."""
    model = tiny_model()
    tokens = random_rows(model.cfg, 1)[:, :10]
    positions = torch.randperm(10, generator=gen(2))[None]
    attn = torch.rand(1, 10, 10, generator=gen(0)) < 0.5
    attn |= torch.eye(10, dtype=torch.bool)
    return model, tokens, positions, attn


def test_permuting_the_slots_permutes_the_logits():
    model, tokens, positions, attn = random_call()
    p = torch.randperm(10, generator=gen(1))
    z = model(tokens, positions, attn)
    attn_p = attn[:, p][:, :, p]  # its rows and its columns permuted
    permuted = model(tokens[:, p], positions[:, p], attn_p)
    assert torch.allclose(permuted, z[:, p], atol=1e-4)


def test_rotary_sees_only_relative_positions():
    model, tokens, positions, attn = random_call()
    z = model(tokens, positions, attn)
    shifted = model(tokens, positions + 13, attn)
    assert torch.allclose(shifted, z, atol=1e-4)


# the authors' pieces: dropout on residual branches only, the rotary table in float32 as
# pos * 1 / 10000^(2i/hd). The tanh GELU, LayerNorm without bias and the head's bias are
# checked by the released models' forward (test_a_released_model_matches_the_authors_forward).
def test_head_starts_like_every_linear_not_at_zero():
    """N(0, 0.02) weights, not the authors' zeros (their plateau: experiments/README.md)."""
    head = SetDiffusionLM(tiny_cfg()).head
    assert not head.bias.any()
    assert head.weight.std().item() == pytest.approx(0.02, rel=0.05)  # 8,320: SE 0.8%


def test_dropout_sits_on_residual_branches_only():
    model = SetDiffusionLM(tiny_cfg(dropout=0.5))
    drops = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout)]
    assert drops == ["blocks.0.drop", "blocks.1.drop"]  # neither on embeddings nor attention


def test_rotary_table_is_the_authors_float32_recipe():
    """Angles position / 10000^(2i/hd), equal to the authors' float32 table."""
    model = SetDiffusionLM(tiny_cfg())
    authors = torch.outer(torch.arange(24).float(), authors_inv_freq(16))
    assert torch.equal(model.sin, authors.sin())
    assert torch.equal(model.cos, authors.cos())


# ---- two-stream forward, loss, bound --------------------------------------------------------
def test_position_logits_depend_only_on_earlier_tokens_in_the_order():
    model = tiny_model()
    x = random_rows(model.cfg, 1)
    order = sample_order(model.cfg, 1, gen(6))
    base = setdiff.position_logits(model, x, order)[0]  # (L, V)
    slot_of = torch.argsort(order[0])
    for j in range(1, 24):  # position 0 kept
        y = x.clone()
        y[0, j] = (x[0, j] + 1) % 256
        z = setdiff.position_logits(model, y, order)[0]
        changed = ~torch.isclose(z, base, atol=1e-6).all(-1)  # (L,)
        assert torch.equal(changed, slot_of[j] < slot_of), j


@on_devices
def test_position_logits_equal_one_query_forwards(device):
    """x[sigma_<r] alone (causal) and ONE mask query at sigma_r give logits[sigma_r]."""
    model = tiny_model().to(device)
    x = random_rows(model.cfg, 1).to(device)
    order = sample_order(model.cfg, 1, gen(6), device)
    base = setdiff.position_logits(model, x, order)[0]
    sigma = order[0].tolist()
    for r in range(24):
        z = one_query_logits(model, x, sigma[:r], sigma[r])
        assert torch.allclose(z, base[sigma[r]], atol=1e-5), r


def padded_rows(cfg):
    """Three rows: whole, padded after 15 tokens, padded after 5 -> (rows, an order each)."""
    x = random_rows(cfg, 3)
    x[1, 15:] = cfg.pad_id
    x[2, 5:] = cfg.pad_id
    order = sample_order(cfg, 3, gen(7), pad=x == cfg.pad_id)
    return x, order


def test_loss_is_the_mean_nll_over_real_tokens_by_hand():
    model = tiny_model()
    x, order = padded_rows(model.cfg)
    real = x != model.cfg.pad_id  # the slot of position 0 is scored in training
    per_row = torch.tensor(nll_of(model, x, order, real)) / real.sum(1)
    loss = setdiff.set_factorized_loss(model, x, order)
    assert abs(loss.item() - per_row.mean().item()) < 1e-4


def test_a_padded_row_predicts_like_the_row_without_padding():
    model = tiny_model()
    x, order = padded_rows(model.cfg)
    padded = setdiff.position_logits(model, x, order)[2, :5]
    alone = setdiff.position_logits(model, x[2:3, :5], order[2:3, :5])[0]
    assert torch.allclose(padded, alone, atol=1e-5)


def test_no_empty_rows_lets_an_empty_row_attend_everything():
    m = torch.tensor([[True, False], [False, False]])
    want = torch.tensor([[True, False], [True, True]])
    assert torch.equal(setdiff.no_empty_rows(m), want)


def test_padded_training_step_attends_something_in_every_row():
    model = tiny_model().train()
    model.forward = mock.Mock(wraps=model.forward)
    x, _ = padded_rows(model.cfg)
    setdiff.set_factorized_loss(model, x, generator=gen(0))  # orders of its own
    attn = model.forward.call_args.args[2]
    assert attn.any(-1).all()  # no query row attends nothing


def test_padded_training_step_has_finite_gradients():
    model = tiny_model().train()
    x, _ = padded_rows(model.cfg)
    loss = setdiff.set_factorized_loss(model, x, generator=gen(0))
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert all(torch.isfinite(g).all() for g in grads)


NOT_FIRST = torch.arange(24) > 0  # the positions a bound scores in rows of 24 (no padding)


def ar_bound():
    """The AR bound of 5 rows (one padded after 20 tokens), and its left-to-right NLL sum."""
    model = tiny_model(order="ar")
    x = random_rows(model.cfg, 5)
    x[4, 20:] = model.cfg.pad_id
    res = elbo(model, x, num_orders=3, batch_size=2)
    scored = (x != model.cfg.pad_id) & NOT_FIRST
    left_to_right = torch.arange(24).expand(5, -1)
    return res, sum(nll_of(model, x, left_to_right, scored))


def test_ar_bound_counts_rows_orders_and_scored_tokens():
    res, _ = ar_bound()
    assert res.tokens_scored == 4 * 23 + 19  # neither position 0 nor padding
    assert res.num_orders == 3
    assert res.num_seqs == 5


def test_ar_bound_and_perplexity_are_the_left_to_right_nll():
    res, total = ar_bound()
    ppl = math.exp(total / res.tokens_scored)
    assert abs(res.nll - total) < 1e-3
    assert math.isclose(res.ppl, ppl, rel_tol=1e-3)


def by_hand_bound():
    """3 ln 2 nats a token over 10 tokens: perplexity 8; 30 bits over 15 bytes: 2 bits/byte."""
    ln2 = math.log(2)
    return setdiff.Elbo(30 * ln2, 10, 2, 3, 0.05, 3 * ln2, 8.0)


def test_bound_metrics_by_hand():
    m = by_hand_bound().metrics(num_bytes=15)
    assert math.isclose(m["ppl"], 8)
    assert math.isclose(m["bits_per_byte"], 2)
    assert m["se"] == 0.05
    counts = (m["num_orders"], m["tokens_scored"], m["num_seqs"], m["bytes"])
    assert counts == (2, 10, 3, 15)


LINE_PARTS = (
    "8.000",  # perplexity
    "2.0794",  # nats a token
    "0.0500",  # standard error
    "2.0000",  # bits per byte
    "3 rows",
    "10 tokens",
    "2 orders",
)


@pytest.mark.parametrize("part", LINE_PARTS)
def test_bound_line_prints_the_metrics(part):
    assert part in by_hand_bound().line(15)


def test_a_bound_of_one_row_says_it_has_no_standard_error():
    """A spread across rows needs two: the line says so, rather than "+- nan"."""
    model = tiny_model()
    one_row = random_rows(model.cfg, 1)
    line = elbo(model, one_row, generator=gen(0)).line(10)
    assert " nats/token, no standard error from one row, " in line
    assert "nan" not in line


def uniform_replay():
    """Uniform policy, 4 rows (two padded), K = 4 orders drawn for all rows together: each
    row's NLL is the mean over the replayed orders -> (model, rows, NLL per row, tokens per row)."""
    model = tiny_model(order="uniform")
    cfg = model.cfg
    x = random_rows(cfg, 4)
    x[2, 10:] = cfg.pad_id
    x[3, 17:] = cfg.pad_id
    scored = (x != cfg.pad_id) & NOT_FIRST
    g = gen(3)  # the generator elbo is given below
    nll = torch.zeros(4, dtype=torch.float64)
    for _ in range(4):
        order = sample_order(cfg, 4, g, pad=x == cfg.pad_id)
        nll += torch.tensor(nll_of(model, x, order, scored)) / 4
    n = torch.tensor([23, 23, 9, 16], dtype=torch.float64)
    return model, x, nll, n


@table(
    "batch_size",
    {
        "batch-1": 1,  # a row a forward
        "batch-3": 3,  # a short last batch
        "batch-4": 4,  # all rows in one
    },
)
def test_bound_of_k_orders_is_the_mean_over_replayed_orders(batch_size):
    """The orders are drawn for all rows together: the batch size cannot change them."""
    model, x, nll, n = uniform_replay()
    res = elbo(model, x, num_orders=4, batch_size=batch_size, generator=gen(3))
    assert res.tokens_scored == n.sum()
    assert abs(res.nll - nll.sum()) < 1e-3


def test_bound_does_not_depend_on_the_batch_size():
    model, x, _, _ = uniform_replay()
    nll = [elbo(model, x, 4, b, gen(3)).nll for b in (1, 3, 4)]
    assert max(nll) - min(nll) < 1e-9


def test_a_diverged_bound_reads_ppl_inf_not_an_overflow():
    model = tiny_model()
    torch.nn.init.normal_(model.head.weight, std=1e5)  # NLL far above 709 nats a token
    res = elbo(model, random_rows(model.cfg, 2))
    assert res.nll_per_token > 709
    assert res.line(10).startswith("ppl <= inf ")


def test_bound_standard_error_is_that_of_the_pooled_rate():
    """The standard error of sum(NLL) / sum(tokens) across rows (a ratio estimator)."""
    model, x, nll, n = uniform_replay()
    res = elbo(model, x, num_orders=4, generator=gen(3))
    rate = nll.sum() / n.sum()
    resid = (nll - rate * n) / n.mean()
    se = resid.std() / 2  # the sample standard deviation (n - 1) over sqrt(4 rows)
    assert abs(res.se - se) < 1e-6


@torch.no_grad()
def time_integral_bound(model, x, sched, n=4096):
    """The continuous-time bound of one row x (1, L), position 0 given, integrated over t:

        int_0^1 E_{z_t} sum_{i masked in z_t} (m_i'(t) / m_i(t)) (-log p(x_i | x_0, x_U)) dt,

    U the unmasked positions of z_t (MDLM's weight -a'/(1 - a) per position, a_i = 1 - m_i).
    P(i masked) = m_i(t) cancels the 1 / m_i; the others are independent, so at t the pair
    (i, U) weighs m_i'(t) prod_{j in U} (1 - m_j(t)) prod_{j not in U} m_j(t). The time axis
    is cut into n cells with int m_i' over each exact (m_i' is infinite where k < 1 tops out).
    With ONE layer a query sees the set U, not its reveal order: the sets U are all it takes."""
    L = x.shape[1]
    edges = torch.linspace(0, 1, n + 1, dtype=torch.float64)
    middles = (edges[1:] + edges[:-1]) / 2
    m = masking_curves(sched, middles)  # (n, L)
    hit = masking_curves(sched, edges).diff(dim=0)  # (n, L): int of m_i'(t) over each cell
    total = 0.0
    for i in range(1, L):
        others = [j for j in range(1, L) if j != i]
        for bits in range(2 ** (L - 2)):
            U = [j for k, j in enumerate(others) if bits >> k & 1]
            rest = [j for j in others if j not in U]
            order = [0, *U, i, *rest]
            order = torch.tensor([order])
            scored = torch.arange(L) == i
            nll = setdiff.order_nll(model, x, order, scored)  # -log p(x_i | x_0, x_U)
            unmasked = (1 - m[:, U]).prod(1)
            masked = m[:, rest].prod(1)
            weight = hit[:, i] * unmasked * masked
            total += float(nll) * float(weight.sum())
    return total


@table(
    "kw,sizes",
    {  # cfg, (L, d, s)
        "staggered-d2-s4": (dict(set_size=2), (6, 2, 4)),  # k < 1
        "uniform": (dict(order="uniform"), (6, 6, 6)),  # masked diffusion: m(t) = t, weight 1 / t
    },
)
def test_the_mean_over_sampled_orders_is_the_continuous_time_bound(kw, sizes):
    """One sampled order is an unbiased estimate of the bound: 10,000 orders within 4 SE."""
    model = tiny_model(dtype=torch.float64, n_layer=1, seq_len=6, **kw)
    x = random_rows(model.cfg, 1)  # BOS + 5 scored tokens, no padding
    N = 10000
    rows = x.expand(N, -1)
    res = elbo(model, rows, batch_size=1024, generator=gen(0))
    sched = setdiff.StaggeredSchedule(*sizes)
    want = time_integral_bound(model, x, sched)
    se = res.se * 5  # of a row's NLL: res.se is per token
    assert abs(res.nll / N - want) < 4 * se


def span_bound():
    """The bound of the span 10..11 given the rest, 400 one-order draws of one row (float64)."""
    N = 400
    model = tiny_model(order="uniform", dtype=torch.float64)
    x = random_rows(model.cfg, 1, seed=9)
    outside = (torch.arange(24) < 10) | (torch.arange(24) > 11)
    given = outside.expand(N, -1)  # in every draw
    res = elbo(model, x.expand(N, -1), batch_size=N, generator=gen(4), given=given)
    order = sample_order(model.cfg, N, gen(4), given=given)  # the same draws
    return model, x, res, order


def test_infill_bound_scores_only_the_span():
    _, _, res, _ = span_bound()
    assert res.tokens_scored == 2 * 400


def test_infill_bound_mixes_both_chain_rule_orders():
    """The bound is the mix, in the proportions drawn, of both chains p(first | context)
    p(second | context, first), each term a one-query forward."""
    model, x, res, order = span_bound()
    context = [p for p in range(24) if p not in (10, 11)]
    first_10 = chain_nll(model, x[0], context, [10, 11])
    first_11 = chain_nll(model, x[0], context, [11, 10])
    share = (order[:, 22] == 10).double().mean().item()
    assert 0.4 < share < 0.6  # both orders occur
    mix = share * first_10 + (1 - share) * first_11
    assert res.nll / 400 == pytest.approx(mix, abs=1e-5)


# ---- sampler --------------------------------------------------------------------------------
P4 = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
ROOTS = P4.sqrt() / P4.sqrt().sum()  # temperature 2
DRAWS = {  # temperature, top-p -> draw frequencies, confidence of each token
    "top-p-0.7-keeps-two": (1.0, 0.7, [0.625, 0.375, 0, 0], [0.625, 0.375, 0, 0]),
    "top-p-0.5-keeps-one": (1.0, 0.5, [1, 0, 0, 0], [1, 0, 0, 0]),
    "greedy": (0.0, 1.0, [1, 0, 0, 0], [0.5, 0, 0, 0]),  # confidence: the plain softmax
    "greedy-top-p-0.7": (0.0, 0.7, [1, 0, 0, 0], [0.625, 0, 0, 0]),  # renormalised: the authors'
    "temperature-2": (2.0, 1.0, ROOTS, ROOTS),
}


def draws(temperature, top_p):
    """generate's arguments: no uniforms when greedy, top_p None when 1."""
    logits = P4.log().expand(1, 20000, 4)
    u = torch.rand(1, 20000, generator=gen(0), dtype=torch.float64)
    if temperature == 0:
        u = None
    if top_p == 1:
        top_p = None
    return setdiff.draw_candidates(logits, temperature, top_p, u)


@table("temperature,top_p,freq,conf", DRAWS)
def test_draws_follow_the_tempered_top_p_distribution(temperature, top_p, freq, conf):
    cand, _ = draws(temperature, top_p)
    counts = torch.bincount(cand.flatten(), minlength=4)
    seen = counts.double() / cand.numel()
    want = torch.as_tensor(freq, dtype=torch.float64)
    assert torch.equal(seen > 0, want > 0)  # top-p: {0, 1} as 0.5 < 0.7 <= 0.8
    assert torch.allclose(seen, want, atol=0.02)


@table("temperature,top_p,freq,conf", DRAWS)
def test_confidence_is_the_probability_drawn_from(temperature, top_p, freq, conf):
    cand, got = draws(temperature, top_p)
    want = torch.as_tensor(conf, dtype=torch.float64)[cand]
    assert torch.allclose(got, want)


def almost_one(shape, **kw):
    return torch.full(shape, 1 - 2**-53, dtype=torch.float64)


@table(
    "top_p",
    {
        "top-p-off": None,  # the plain inverse CDF
        "top-p-0.9": 0.9,  # the truncated one
    },
)
def test_a_draw_never_rounds_up_onto_mask(top_p):
    """u just below the total mass must not land on MASK, the last id."""
    logits = torch.randn(2, 3, 260, generator=gen(0))
    logits[..., 259] = -math.inf
    cand, conf = setdiff.draw_candidates(logits, 1.0, top_p, almost_one((2, 3)))
    assert not (cand == 259).any()
    assert torch.all(conf > 0)


def test_a_tiny_temperature_is_greedy():
    logits = torch.randn(2, 3, 260, generator=gen(0))
    u = torch.rand(2, 3, generator=gen(1), dtype=torch.float64)
    cand, conf = setdiff.draw_candidates(logits, 1e-30, None, u)
    assert torch.equal(cand, logits.argmax(-1))
    assert torch.all(conf == 1)


def brute_commit(conf, valid, threshold):
    """The commit rule by a loop: a row reveals its most confident valid query (the first of
    tied ones) and every valid query at least tau confident -> (B, m) lists of bools."""
    rows = []
    for c, ok in zip(conf.tolist(), valid.tolist()):
        best = None
        for j in range(len(c)):
            if ok[j] and (best is None or c[j] > c[best]):
                best = j
        chosen = [ok[j] and (c[j] >= threshold or j == best) for j in range(len(c))]
        rows.append(chosen)
    return rows


def random_conf(seed, shape=(6, 5)):
    """Confidences uniform in [0, 1), B rows of m queries."""
    return torch.rand(shape, generator=gen(seed))


FIRST_INVALID = [[False, True, True]]  # a row's valid queries: all but the first
COMMITS = {  # confidences (B, m), valid queries (None: all), tau
    "random-tau-above-1": (random_conf(0), None, 1.5),
    "random-tau-0.5": (random_conf(1), None, 0.5),
    "random-some-invalid": (random_conf(2), "random", 0.6),
    "tie-at-the-top": (torch.tensor([[0.2, 0.4, 0.1, 0.4]]), None, 1.5),
    "all-tied": (torch.full((2, 4), 0.25), None, 0.5),
    "tau-met-exactly": (torch.tensor([[0.3, 0.5, 0.2]]), None, 0.3),
    "best-is-invalid": (torch.tensor([[0.9, 0.2, 0.3]]), FIRST_INVALID, 1.5),
    "row-without-queries": (torch.tensor([[0.9, 0.2], [0.1, 0.8]]), [[0, 0], [1, 1]], 1.5),
    "tau-0": (random_conf(3, (3, 4)), None, 0.0),
    "zero-confidence": (torch.tensor([[0.5, 0.0, 0.0]]), FIRST_INVALID, 1.5),
}


@table("conf,valid,threshold", COMMITS)
def test_commit_rule_reveals_the_most_confident_and_every_one_over_tau(conf, valid, threshold):
    if valid is None:
        valid = torch.ones_like(conf, dtype=torch.bool)
    elif valid == "random":
        valid = torch.rand(conf.shape, generator=gen(4)) < 0.6
    valid = torch.as_tensor(valid, dtype=torch.bool)
    got = setdiff.commit_rule(conf, valid, threshold)
    assert got.tolist() == brute_commit(conf, valid, threshold)


def test_zero_head_predicts_uniformly_over_all_but_mask():
    cfg = tiny_cfg()
    fresh = SetDiffusionLM(cfg)
    fresh.head.weight.data.zero_()
    loss = setdiff.set_factorized_loss(fresh, random_rows(cfg, 2), generator=gen(0))
    assert math.isclose(loss.item(), math.log(cfg.vocab_size - 1), rel_tol=1e-6)


@on_devices
@table("compute", {"float32": torch.float32, "bfloat16": torch.bfloat16})
def test_generation_never_emits_mask(compute, device):
    """Its logit is -inf, in bf16 too, however much the network prefers it."""
    model = biased_model({BYTES.mask_id: 50.0}).to(device)
    with setdiff.autocast(torch.device(device), compute):
        out = generate(model, batch_size=2, generator=gen(0))
    assert not (out.tokens == model.cfg.mask_id).any()


@on_devices
def test_bf16_autocast_keeps_the_mask_logit_at_minus_inf_and_the_loss_finite(device):
    model = tiny_model().to(device)
    x = random_rows(model.cfg, 2).to(device)
    order = sample_order(model.cfg, 2, gen(2), device)
    with setdiff.autocast(torch.device(device), torch.bfloat16):
        z = setdiff.position_logits(model, x, order)
        loss = setdiff.set_factorized_loss(model, x, order)
    loss.backward()
    assert z.dtype == torch.bfloat16
    assert (z[..., BYTES.mask_id] == -math.inf).all()
    assert z[..., : BYTES.mask_id].isfinite().all()
    assert all(p.grad.isfinite().all() for p in model.parameters())


STATE_INPUTS = {
    "unconditional": dict(batch_size=2),
    "infill": dict(infill=holes_in(tiny_cfg(), [(0, 3, 10), (1, 12, 20)], seed=6)[2]),
}
PRECISIONS = {  # the weights' dtype, autocast's (float32: none), and the logits' tolerance
    "float64": (torch.float64, torch.float32, 1e-10),
    "float32": (torch.float32, torch.float32, 1e-4),
    # bf16 keeps 8 bits: logits of 16-32 (this model's) round in steps of 0.125; two steps
    "bfloat16": (torch.float32, torch.bfloat16, 0.25),
}


@on_devices
@table("precision", PRECISIONS)
@table("inputs", STATE_INPUTS)
def test_cached_and_cache_free_predictions_agree_on_every_state(inputs, precision, device):
    """Replays a generation call by call: the cache holds the earlier calls' sets, the
    cache-free step feeds every revealed token in decode order."""
    dtype, compute, atol = precision
    model = tiny_model(dtype=dtype).to(device)
    inputs = on_device(inputs, device)
    with setdiff.autocast(torch.device(device), compute):
        replay_states(model, inputs, atol)


def replay_states(model, inputs, atol):
    cfg = model.cfg
    device = next(model.parameters()).device
    out = generate(model, window=3, threshold=0.3, temperature=0.0, **inputs)
    calls = out.reveal_call
    cache = setdiff.KVCache(cfg, 2, 24, max_call=27, device=device)
    for n in range(out.calls):
        # before call n: revealed = calls < n; call n-1's set (or the context) not cached
        canvas = torch.where(calls < n, out.tokens, cfg.mask_id)
        masked = canvas == cfg.mask_id
        active = setdiff.window_queries(masked, torch.arange(24), 3, None)
        queries = setdiff.gather_sets(active)
        new = setdiff.gather_sets(calls == n - 1)
        cached = setdiff.predict(model, canvas, new, queries, cache)
        revealed = setdiff.gather_sets(calls < n, key=calls)  # in decode order
        cache_free = setdiff.predict(model, canvas, revealed, queries)
        valid = queries[1]
        assert torch.allclose(cached[valid], cache_free[valid], atol=atol, rtol=0)


POLICIES = {  # order, window, threshold, ancestral
    "staggered-w3": ("staggered", 3, math.inf, False),
    "staggered-w6-tau0.05": ("staggered", 6, 0.05, False),
    "block-w3-tau0.1": ("block", 3, 0.1, False),
    "uniform-w24-tau0.2": ("uniform", 24, 0.2, False),
    "ar": ("ar", 1, math.inf, False),
    "staggered-ancestral": ("staggered", 1, math.inf, True),
}


def start_rows(cfg, start):
    """Three rows to start from -> (generate's inputs, given positions, their tokens)."""
    before = torch.arange(24).expand(3, -1)
    if start == "unconditional":
        return dict(batch_size=3), before < 1, torch.full((3, 24), cfg.bos_id)
    if start == "prompt":
        prompt = torch.arange(5, 14).view(3, 3)
        context = F.pad(prompt, (1, 20), value=cfg.bos_id)
        return dict(prompt=prompt), before < 4, context
    spans = [(0, 2, 7), (0, 15, 18), (1, 20, 24), (2, 8, 16)]
    rows, holes, infill = holes_in(cfg, spans, seed=5)
    return dict(infill=infill), ~holes, rows


TEMPERATURES = {"greedy": 0.0, "sampled": 1.0}


@functools.cache  # the tests on the grid share the runs (none changes them)
def generated(policy, decoding, start, use_cache=True, device="cpu"):
    """Sampled decoding runs in float64 (a float32 rounding difference between the cached
    and cache-free paths may, rarely, flip a draw), greedy in float32. -> (out, given, context),
    all on the CPU"""
    order, window, threshold, ancestral = POLICIES[policy]
    temperature = TEMPERATURES[decoding]
    dtype = torch.float64 if temperature else torch.float32
    model = tiny_model(dtype=dtype, order=order).to(device)
    inputs, given, context = start_rows(model.cfg, start)
    inputs = on_device(inputs, device)
    out = generate(
        model,
        **inputs,
        window=window,
        threshold=threshold,
        temperature=temperature,
        top_p=0.9,
        generator=gen(8),
        use_cache=use_cache,
        ancestral=ancestral,
    )
    out.tokens = out.tokens.cpu()
    out.reveal_call = out.reveal_call.cpu()
    return out, given, context


STARTS = ("unconditional", "prompt", "infill")
GRID = [(p, t, s) for p in POLICIES for t in TEMPERATURES for s in STARTS]
on_grid = table("policy,decoding,start", {"-".join(c): c for c in GRID})


@on_devices
@on_grid
def test_cached_generation_equals_cache_free(policy, decoding, start, device):
    a, _, _ = generated(policy, decoding, start, device=device)
    b, _, _ = generated(policy, decoding, start, False, device)
    same_generation(a, b)
    assert a.calls == b.calls


@on_grid
def test_generation_fills_every_mask(policy, decoding, start):
    out, _, _ = generated(policy, decoding, start)
    assert not (out.tokens == BYTES.mask_id).any()


@on_grid
def test_generation_takes_the_calls_of_the_slowest_row(policy, decoding, start):
    out, _, _ = generated(policy, decoding, start)
    assert out.calls == int(out.row_calls.max())


@on_devices
@on_grid
def test_generation_keeps_the_given_tokens(policy, decoding, start, device):
    out, given, context = generated(policy, decoding, start, device=device)
    assert torch.equal(out.reveal_call == setdiff.GIVEN, given)
    assert torch.equal(out.tokens[given], context[given])


def decode_order(reveal_call):
    """The full decode order by brute force: positions sorted by (call, position)."""
    rows = []
    for row in reveal_call.tolist():
        pairs = sorted((c, p) for p, c in enumerate(row))
        rows.append([p for _, p in pairs])
    return torch.tensor(rows)


def same_generation(a, b):
    """Two generations wrote the same tokens in the same calls."""
    assert torch.equal(a.tokens, b.tokens)
    assert torch.equal(a.reveal_call, b.reveal_call)


@table(
    "order,window,set_size,use_cache",
    {
        "staggered": ("staggered", 4, 3, True),
        "staggered-cache-free": ("staggered", 4, 3, False),
        "block": ("block", 3, 3, True),
        "uniform": ("uniform", 5, 24, True),
    },
)
def test_each_draw_is_the_training_forward_given_the_final_order(
    order, window, set_size, use_cache, monkeypatch
):
    """Sampled after a prompt, one token a call (float64): every call draws from the training
    forward's distribution there, given the final sequence and its reveal order."""
    model = tiny_model(dtype=torch.float64, order=order, set_size=set_size)
    spy = mock.Mock(wraps=setdiff.draw_candidates)  # records every draw's logits
    monkeypatch.setattr(setdiff, "draw_candidates", spy)
    out = generate(
        model, [65, 66], batch_size=2, window=window, generator=gen(15), use_cache=use_cache
    )
    seen = [call.args[0] for call in spy.call_args_list]
    assert len(seen) == out.calls == 21
    assert torch.equal(out.row_calls, out.new_tokens)  # one token a call
    sigma = decode_order(out.reveal_call)
    ref = torch.log_softmax(setdiff.position_logits(model, out.tokens, sigma), -1)
    block = set_size if order == "block" else None
    for call, logits in enumerate(seen):
        masked = out.reveal_call >= call  # masked before this call
        q = setdiff.window_queries(masked, torch.arange(24), window, block)
        for b in range(2):
            pos = int((out.reveal_call[b] == call).nonzero())
            slot = int(q[b, :pos].sum())  # queries are in position order
            got = torch.log_softmax(logits[b, slot], -1)
            assert torch.allclose(got, ref[b, pos], atol=1e-9)


# The bound's model enumerated: rows of L = 4 whose positions 1-3 take the tokens 0-3 (EOS 2,
# BOS 3; MASK 4 never), 64 rows in all, each's probability summed over pi's orders.
ORACLE = dict(seq_len=4, vocab_size=5, mask_id=4, bos_id=3, eos_id=2, pad_id=None)
ORACLE_POLICIES = {"ar": ("ar", 1), "uniform": ("uniform", 4)}  # order, d (default window)
ORACLE_POLICIES |= {"block-d2": ("block", 2), "staggered-d2-s4": ("staggered", 2)}
FREE_TOKENS = itertools.product(range(4), repeat=3)  # positions 1-3
EVERY_ROW = torch.tensor([[3, *xs] for xs in FREE_TOKENS])  # (64, 4)


def order_probabilities(cfg):
    """pi's orders of positions 1-3 (0 is given) -> probability. Block d = 2: 1, then 2 and 3
    either way. A schedule: P(T_a > T_b > T_c) = int (1 - F_a) F_c dF_b, F_i = m_i the CDF of
    T_i, by the midpoint rule (ar: 1 for 1, 2, 3; uniform, d = s = L: 1/6 each)."""
    if cfg.order == "block":
        return {(1, 2, 3): 0.5, (1, 3, 2): 0.5}
    sizes = {"ar": (1, 1), "uniform": (4, 4)}
    d, s = sizes.get(cfg.order, (cfg.set_size, cfg.max_set_size))
    t = torch.linspace(0, 1, 100001, dtype=torch.float64)
    cdf = masking_curves(setdiff.StaggeredSchedule(4, d, s), t)  # (T, 4)
    mid = (cdf[1:] + cdf[:-1]) / 2
    rise = cdf.diff(dim=0)
    probs = {}
    for a, b, c in itertools.permutations((1, 2, 3)):
        a_after_b_after_c = (1 - mid[:, a]) * mid[:, c] * rise[:, b]
        probs[a, b, c] = float(a_after_b_after_c.sum())
    return probs


@functools.cache
@torch.no_grad()
def bound_model(policy):
    """A tiny model of `policy` -> (model, p (64,)): every row's probability under the bound's
    model, sum over orders sigma of pi(sigma) prod_n p(x[sigma_n] | x[sigma_<n])."""
    order, d = ORACLE_POLICIES[policy]
    model = tiny_model(order=order, set_size=d, **ORACLE)
    model.head.weight.data *= 0.3  # flatter: no row is out of reach of 8,000 draws
    p = torch.zeros(64, dtype=torch.float64)
    for sigma, prob in order_probabilities(model.cfg).items():
        order = torch.tensor([0, *sigma]).expand(64, -1)
        nll = position_nll(model, EVERY_ROW, order)[:, 1:].sum(1)
        p += prob * torch.exp(-nll)
    assert math.isclose(float(p.sum()), 1, abs_tol=1e-6)
    return model, p


def distance_to_the_bounds_model(policy, ancestral, N=8000):
    """The total variation between N samples' frequencies and p, and the noise it stays under
    with probability 1 - 1e-6: E TV <= sum sqrt(p (1 - p) / N) / 2, and one sample moves TV by
    1/N at most, so (McDiarmid) TV passes that by eps with probability exp(-2 N eps^2) at most."""
    model, p = bound_model(policy)
    out = generate(model, batch_size=N, ancestral=ancestral, generator=gen(0))
    row = out.tokens[:, 1:] @ torch.tensor([16, 4, 1])  # EVERY_ROW's index
    count = torch.bincount(row, minlength=64)
    freq = count.double() / N
    tv = (freq - p).abs().sum() / 2
    mean_bound = (p * (1 - p) / N).sqrt().sum() / 2
    eps = math.sqrt(math.log(1e6) / (2 * N))
    return tv, mean_bound + eps


@table("policy", {name: name for name in ORACLE_POLICIES})
def test_ancestral_samples_follow_the_bounds_model(policy):
    tv, noise = distance_to_the_bounds_model(policy, ancestral=True)
    assert tv < noise


@table("policy,differs", {name: (name, name != "ar") for name in ORACLE_POLICIES})
def test_the_default_sampler_draws_another_distribution_except_for_ar(policy, differs):
    """Its window opens at the leftmost masked position, and a call reveals its most confident
    query (uniform: of all masked ones), not the next of an order drawn from pi."""
    tv, noise = distance_to_the_bounds_model(policy, ancestral=False)
    assert (tv > noise) == differs


def block_reveals():
    """The call that revealed each position, sampled with blocks of 4 (rows of 24)."""
    model = tiny_model(order="block", set_size=4)
    out = generate(model, batch_size=3, window=4, threshold=0.05, generator=gen(14))
    return out.reveal_call.tolist()


def test_block_sampler_finishes_a_block_before_the_next():
    for row in block_reveals():
        for blk in range(5):
            here = [c for c in row[4 * blk : 4 * blk + 4] if c >= 0]  # position 0 is given
            after = row[4 * blk + 4 : 4 * blk + 8]
            assert max(here) < min(after)


def test_block_sampler_reveals_one_block_a_call():
    for row in block_reveals():
        for call in set(row) - {setdiff.GIVEN}:
            blocks = {p // 4 for p, c in enumerate(row) if c == call}
            assert len(blocks) == 1


def test_block_sampler_with_threshold_0_takes_a_call_per_block():
    model = tiny_model(order="block", set_size=4)
    out = generate(model, window=4, threshold=0.0, temperature=0.0)
    assert out.calls == 24 // 4


def window_by_hand(masked, key, window, block_size):
    """The window rule a position at a time: masked, its key in [k_f, k_f + w) from the least
    key k_f of a masked position, and (with blocks) in k_f's block of keys."""
    rows = []
    for row_masked, row_key in zip(masked.tolist(), key.tolist()):
        keys = [k for m, k in zip(row_masked, row_key) if m]
        k_f = min(keys, default=0)
        row = []
        for m, k in zip(row_masked, row_key):
            inside = m and k_f <= k < k_f + window
            if block_size is not None:
                inside = inside and k // block_size == k_f // block_size
            row.append(inside)
        rows.append(row)
    return torch.tensor(rows)


WINDOW_KEYS = {  # a key for each of 64 rows of 12 positions
    "left-to-right": torch.arange(12).expand(64, -1),
    "right-to-left": torch.arange(11, -1, -1).expand(64, -1),
    "ranks-a-row": torch.argsort(torch.rand(64, 12, generator=gen(2)), 1),
}


@table("key", WINDOW_KEYS)
@table(
    "window,block_size",
    {"w1": (1, None), "w3": (3, None), "w3-blocks-4": (3, 4), "w6-blocks-4": (6, 4)},
)
def test_a_window_spans_w_keys_from_the_least_masked_one(key, window, block_size):
    masked = torch.rand(64, 12, generator=gen(1)) < 0.5
    masked[0] = False  # a finished row: no query
    got = setdiff.window_queries(masked, key, window, block_size)
    assert torch.equal(got, window_by_hand(masked, key, window, block_size))


def holey_rows(model, rows=slice(None)):
    """Greedy infilling of three rows whose holes end apart."""
    spans = [(0, 2, 20), (1, 12, 14), (2, 5, 24)]
    infill = holes_in(model.cfg, spans, seed=4)[2][rows]
    infill = infill.to(next(model.parameters()).device)
    return generate(model, infill=infill, window=5, threshold=0.3, temperature=0.0)


@table(
    "row",
    {
        "row-0": 0,  # a long hole
        "row-1": 1,  # a short hole: done first
        "row-2": 2,  # a hole to the end of the row
    },
)
@on_devices
def test_a_batched_row_generates_as_it_would_alone(row, device):
    model = tiny_model().to(device)
    batched = holey_rows(model)
    alone = holey_rows(model, slice(row, row + 1))
    assert torch.equal(alone.tokens[0], batched.tokens[row])
    assert torch.equal(alone.reveal_call[0], batched.reveal_call[row])
    assert alone.calls == batched.row_calls[row]


def greedy_rows(threshold, device="cpu"):
    """Two greedy rows of 23 new tokens, window 3."""
    model = tiny_model().to(device)
    return generate(model, batch_size=2, window=3, threshold=threshold, temperature=0.0)


@on_devices
def test_threshold_over_1_reveals_one_token_a_call(device):
    one = greedy_rows(1.5, device)
    assert torch.equal(one.row_calls, one.new_tokens)
    assert one.calls == 23
    assert one.tokens_per_call == 1


def test_threshold_0_reveals_the_whole_window():
    whole = greedy_rows(0.0)
    assert whole.calls == math.ceil(23 / 3)
    assert math.isclose(whole.tokens_per_call, 23 / 8)


def test_a_middle_threshold_takes_calls_between_the_extremes():
    some = greedy_rows(0.2)
    assert greedy_rows(0.0).calls <= some.calls <= greedy_rows(1.5).calls


class FixedConfidence(torch.nn.Module):
    """A network whose query at position p proposes the letter 65 + p % 26 with probability
    conf[b, p] (the rest spread evenly over the other tokens but MASK). It runs the wrapped
    network first, so a KV cache fills as it would; only the logits are replaced."""

    def __init__(self, net, conf):
        super().__init__()
        self.net = net
        self.cfg = net.cfg
        self.conf = conf  # (B, L)

    def forward(self, tokens, positions, attn_mask, cache=None, queries=None):
        self.net(tokens, positions, attn_mask, cache, queries)
        q = positions[:, positions.shape[1] - queries :]  # (B, m) the queries' positions
        p = self.conf.gather(1, q)[..., None]  # (B, m, 1)
        V = self.cfg.vocab_size
        rest = (1 - p) / (V - 2)  # each other token but MASK
        probs = rest.expand(*q.shape, V).clone()
        probs.scatter_(2, 65 + q[..., None] % 26, p)
        probs[..., self.cfg.mask_id] = 0.0
        return probs.log()


def brute_reveals(conf, window, threshold):
    """The calls that reveal each position of a row (position 0 given): a loop of the window
    from the leftmost masked position, its most confident query and those >= tau."""
    masked = list(range(1, len(conf)))
    call_of = [setdiff.GIVEN] * len(conf)
    call = 0
    while masked:
        queries = [p for p in masked if p < masked[0] + window]
        best = max(queries, key=lambda p: (conf[p], -p))  # the first of tied ones
        chosen = [p for p in queries if conf[p] >= threshold or p == best]
        for p in chosen:
            call_of[p] = call
            masked.remove(p)
        call += 1
    return call_of


@table("threshold", {"one-a-call": 1.5, "tau-0.7": 0.7})
@table("use_cache", {"cached": True, "cache-free": False})
def test_a_sampler_reveals_in_the_order_the_confidences_dictate(threshold, use_cache):
    """Confidences set by hand, distinct multiples of 1/64 (no rounding ties), greedy."""
    levels = torch.randperm(24, generator=gen(7)) + 40  # 40..63: the best over (1 - p) / 258
    conf = torch.stack([levels, levels.flip(0)]) / 64  # (2, 24): a row each way
    model = FixedConfidence(tiny_model(), conf)
    out = generate(model, batch_size=2, window=5, threshold=threshold, temperature=0.0)
    want = [brute_reveals(row, 5, threshold) for row in conf.tolist()]
    assert out.reveal_call.tolist() == want


@on_devices
@table("stop_at_eos", {"to-the-end": False, "stop-at-eos": True})
@table("decoding", {"greedy": 0.0, "sampled": 1.0})
def test_a_sampler_call_reads_the_device_once(decoding, stop_at_eos, device):
    """Whether every row is done (and no output NaN): the loop's one read. 6 more calls, 6
    more reads; the checks before the loop read a fixed number."""
    model = tiny_model().to(device)
    reads = []
    for new in (5, 5, 11):  # one token a call; the first run warms up (a GPU's first uses)
        with host_reads(device) as read:
            sampler = dict(window=3, temperature=decoding, stop_at_eos=stop_at_eos)
            sampler |= dict(generator=gen(0))
            generate(model, max_new_tokens=new, **sampler)
        reads.append(len(read))
    assert reads[2] - reads[1] == 11 - 5


def test_every_call_reveals_a_token_in_every_row():
    some = greedy_rows(0.2)
    for row, n in zip(some.reveal_call.tolist(), some.row_calls.tolist()):
        assert {c for c in row if c >= 0} == set(range(n))


def largest_sets(out):
    """The most tokens a row revealed in each call of out, read from its reveal calls."""
    calls = torch.arange(out.calls)[:, None, None]
    return (out.reveal_call == calls).sum(2).amax(1)  # (calls,)


def fed_sizes(monkeypatch):
    """-> the list that every later predict() appends its n (new tokens fed) to."""
    fed = []
    predict = setdiff.predict

    def spy(model, x, new, queries, cache=None):
        fed.append(new[0].shape[1])
        return predict(model, x, new, queries, cache)

    monkeypatch.setattr(setdiff, "predict", spy)
    return fed


@table("threshold", {"tau-0.3": 0.3, "tau-0": 0.0, "one-a-call": math.inf})
def test_every_call_after_the_first_feeds_the_last_calls_set(threshold, monkeypatch):
    """n of call c = the most tokens a row revealed in call c - 1, not the window: the set
    sizes read from the reveal calls; the first call feeds the given tokens (BOS + 2)."""
    fed = fed_sizes(monkeypatch)
    out = generate(tiny_model(), prompt=[65, 66], batch_size=3, window=4, threshold=threshold)
    sets = largest_sets(out)
    assert fed == [3] + sets[:-1].tolist()


def test_the_cache_has_slots_for_the_longest_call_of_its_shape(monkeypatch):
    """L = 24, so C = 24: a first call may feed up to 23 given tokens and a later one 6 + 6 at
    the largest window (6 here), so every run of the shape fits C + 6 slots beside the C."""
    spy = mock.Mock(wraps=setdiff.KVCache)
    monkeypatch.setattr(setdiff, "KVCache", spy)
    model = tiny_model()
    generate(model, prompt=[65] * 22, window=6)  # 23 given tokens, then 6 queries
    assert setdiff.max_window(model.cfg) == 6
    assert spy.call_args.args[3] == 24 + 6


def biased_model(logits):
    """Every query's logits are `logits` {id: logit}, -10 elsewhere: the head's bias alone."""
    model = tiny_model()
    with torch.no_grad():
        model.head.weight.zero_()
        model.head.bias.fill_(-10.0)
        for i, logit in logits.items():
            model.head.bias[i] = logit
    return model


REPEATS = {  # greedy, one token a call, penalty 2 -> the text after BOS
    "prompt-divides": (dict(prompt=[65], max_new_tokens=4), {65: 3.0, 66: 2.0}, "AABAA"),
    "infill-multiplies": (dict(infill=[257, 259, 259, 259, 65]), {65: -1.0, 66: -1.5}, "BAAA"),
}


@table("kw,logits,text", REPEATS)
def test_repetition_penalty_steers_greedy_decoding_as_by_hand(kw, logits, text):
    """By hand. After a prompt only generated tokens count: A (3) first, then B (2) above A's
    1.5, then A's 1.5 above B's 1 (once per id). Infilling counts the given right context:
    A's -1 falls to -2 below B's -1.5 at once, then B's to -3."""
    model = biased_model(logits)
    out = generate(model, window=1, temperature=0.0, repetition_penalty=2.0, **kw)
    assert bytes(out.tokens[0, 1:].tolist()).decode() == text


def test_generate_refuses_a_model_whose_outputs_are_nan():
    model = tiny_model()
    torch.nn.init.constant_(model.head.bias, math.nan)  # finite-looking load, NaN out
    with pytest.raises(ValueError, match="outputs are NaN"):
        generate(model, generator=gen(0))


@table(
    "kw,match",  # staggered d = 3, s = 6: the largest window is 6
    {
        "window-over-s": (dict(window=7), r"--window must be in \[1, 6\]"),
        "prompt-over-L": (dict(prompt=torch.arange(30)), "--prompt is 31 tokens"),
        "prompt-fills-L": (dict(prompt=torch.arange(23)), "is 24 tokens .* L=24: shorten it"),
        "too-many-new": (dict(prompt=torch.arange(10), max_new_tokens=20), "--max-new-tokens"),
        "infill-without-mask": (dict(infill=torch.arange(10)), "--infill has no MASK"),
        "prompt-with-mask": (dict(prompt=[1, 259]), "contains MASK"),
        "prompt-and-infill": (dict(prompt=[1], infill=[259]), "both"),
        "negative-id": (dict(prompt=[-1]), "ids must lie in"),  # it would index from the end
        "temperature-nan": (dict(temperature=math.nan), "--temperature"),
        "temperature-negative": (dict(temperature=-1.0), "--temperature must be >= 0"),
        "top-p-0": (dict(top_p=0.0), "--top-p must be in"),
        "threshold-nan": (dict(threshold=math.nan), "--threshold must be a number"),
        "penalty-0": (dict(repetition_penalty=0.0), "--repetition-penalty must be > 0"),
        "rows-for-batch": (dict(prompt=[[1, 1]] * 3, batch_size=2), "--batch-size"),
        "bos-in-some-rows": (dict(prompt=[[257, 5], [5, 5]], batch_size=2), "some rows start"),
        "compile-cache-free": (dict(compile=True, use_cache=False), "use_cache=True"),
        "empty-prompt-without-bos": (dict(model=NO_BOS, prompt=[]), "--prompt is empty and"),
        "ancestral-window-3": (dict(ancestral=True, window=3), "--ancestral reveals one"),
    },
)
def test_generate_rejects_a_bad_argument(kw, match):
    """kw: generate's arguments, and "model": tiny_model's (its config)."""
    kw = dict(kw)
    model = tiny_model(**kw.pop("model", {}))
    with pytest.raises(ValueError, match=match):
        generate(model, **kw)


def test_generate_writes_one_token_when_asked_for_one():
    out = generate(tiny_model(), prompt=[5, 6], max_new_tokens=1, generator=gen(0))
    assert out.reveal_call.tolist() == [[setdiff.GIVEN] * 3 + [0]]  # BOS, prompt, one token


def bound_of(model):
    return elbo(model, random_rows(model.cfg, 2), generator=gen(0))


def sample_of(model):
    return generate(model, batch_size=2, generator=gen(0))


@table("run", {"elbo": bound_of, "generate": sample_of})
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_scoring_and_sampling_leave_the_mode_as_they_found_it(run, training):
    """A training run that scores validation keeps its dropout; a loaded model stays in eval."""
    model = tiny_model(dropout=0.5).train(training)
    run(model)
    assert {m.training for m in model.modules()} == {training}


def eos_model():
    """Every query predicts EOS with probability ~1."""
    return biased_model({BYTES.eos_id: 30.0})


def eos_after_prompt():
    """Greedy, stopping at EOS, after a prompt that holds an EOS."""
    prompt = [BYTES.eos_id, 70, 71]
    return generate(eos_model(), prompt=prompt, temperature=0.0, stop_at_eos=True)


def test_the_first_generated_eos_stops_the_row():
    """The EOS in the prompt does not stop; the first generated one (position 4) does."""
    out = eos_after_prompt()
    assert out.tokens[0, 4] == BYTES.eos_id
    assert out.calls == 1


def test_a_stopped_row_is_padded_and_marked_erased():
    out = eos_after_prompt()
    assert torch.all(out.tokens[0, 5:] == BYTES.pad_id)
    assert torch.all(out.reveal_call[0, 5:] == setdiff.ERASED)


def test_tokens_per_call_counts_only_the_kept_tokens():
    """One call revealed a whole window of EOS in each row but keeps 1: 1 token a call."""
    whole_window = dict(batch_size=2, window=6, threshold=0.0)
    out = generate(eos_model(), temperature=0.0, stop_at_eos=True, **whole_window)
    assert out.new_tokens.tolist() == [1, 1]
    assert out.tokens_per_call == 1.0


def eos_infill(use_cache=True):
    """Greedy infilling with EOS everywhere -> (rows, holes, generation)."""
    spans = [(0, 3, 6), (1, 10, 20)]
    rows, holes, infill = holes_in(tiny_cfg(), spans, seed=7)
    out = generate(
        eos_model(), infill=infill, window=3, temperature=0.0, use_cache=use_cache, stop_at_eos=True
    )
    return rows, holes, out


def test_stopping_at_eos_cached_equals_cache_free():
    _, _, a = eos_infill()
    _, _, b = eos_infill(use_cache=False)
    same_generation(a, b)


def test_stopping_at_eos_keeps_the_right_context():
    rows, holes, out = eos_infill()
    assert torch.equal(out.tokens[~holes], rows[~holes])


def test_stopping_at_eos_pads_the_rest_of_the_hole():
    _, _, out = eos_infill()
    assert out.tokens[0, 3] == BYTES.eos_id
    assert torch.all(out.tokens[0, 4:6] == BYTES.pad_id)
    assert out.new_tokens[0] == 1


SYMBOLS = {
    "B": BYTES.bos_id,
    "E": BYTES.eos_id,
    "M": BYTES.mask_id,
    "P": BYTES.pad_id,
    "G": setdiff.GIVEN,
    "X": setdiff.MASKED,
    "R": setdiff.ERASED,
}


def hand_row(row):
    """A row by hand: B, E, M, P for BOS, EOS, MASK, PAD; reveal calls G given, X masked,
    R erased; numbers as they are."""
    return [SYMBOLS[s] if s in SYMBOLS else int(s) for s in row.split()]


EOS_ROWS = [
    "B 65 M 66 E 67 M 68",  # masked before the EOS: go on
    "B 65 66 E 67 M 68 69",  # stop: 67, M -> PAD; 68 is given
    "B E 65 M M M M M",  # a given EOS never stops
]
EOS_CALLS = ["G 0 X 1 2 2 X G", "G 0 1 2 2 X G 3", "G G 0 X X X X X"]


def stop_eos_rows(**kw):
    """stop_at_first_eos on the rows above (L = 8) -> (stopped rows, rows, reveal calls)."""
    x = torch.tensor([hand_row(row) for row in EOS_ROWS])
    calls = torch.tensor([hand_row(row) for row in EOS_CALLS])
    stop = setdiff.stop_at_first_eos(tiny_cfg(seq_len=8, **kw), x, calls)
    return stop.tolist(), x.tolist(), calls.tolist()


def test_stop_at_first_eos_needs_everything_before_a_generated_eos():
    stop, _, _ = stop_eos_rows()
    assert stop == [False, True, False]


def test_stop_at_first_eos_pads_after_it_but_keeps_given_tokens():
    _, x, calls = stop_eos_rows()
    assert x[1] == hand_row("B 65 66 E P P 68 P")
    assert calls[1] == hand_row("G 0 1 2 R R G R")


def test_stop_at_first_eos_leaves_the_other_rows_alone():
    _, x, calls = stop_eos_rows()
    assert x[::2] == [hand_row(row) for row in EOS_ROWS[::2]]
    assert calls[::2] == [hand_row(row) for row in EOS_CALLS[::2]]


def test_stop_at_first_eos_without_pad_fills_with_eos():
    _, x, _ = stop_eos_rows(**NO_BOS)
    assert x[1] == hand_row("B 65 66 E E E 68 E")


def test_without_bos_sampling_starts_a_document():
    model = tiny_model(**NO_BOS)
    out = generate(model, batch_size=2, temperature=0.0)
    assert torch.all(out.tokens[:, 0] == model.cfg.eos_id)  # like the authors' OWT samples


def test_without_bos_a_prompt_starts_the_row():
    model = tiny_model(**NO_BOS)
    out = generate(model, prompt=[65, 66], temperature=0.0, max_new_tokens=3)
    assert out.tokens[0, :2].tolist() == [65, 66]
    assert out.tokens.shape == (1, 5)


# ---- checkpoints ----------------------------------------------------------------------------
@contextlib.contextmanager
def full_disk(path, mode="r"):
    """open() on a full disk (patch setdiff.open): reads work; a write stops at ENOSPC."""
    with io.open(path, mode) as f:
        if "r" in mode:
            yield f
            return
        f.write(b"partial")
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def saved(tmp_path):
    """A tiny model saved at step 7 -> (model, path)."""
    model = tiny_model()
    path = tmp_path / "ckpt.pt"
    setdiff.save_checkpoint(path, model, BYTES, step=7)
    return model, path


def load_refused(path, match):
    """load_checkpoint(path) raises our ValueError, its message matching `match`."""
    with pytest.raises(ValueError, match=match):
        load_checkpoint(path)


def test_checkpoint_round_trips_config_tokenizer_weights_and_extras(tmp_path):
    model, path = saved(tmp_path)
    loaded, tok, ckpt = load_checkpoint(path)
    assert loaded.cfg == model.cfg
    assert tok.spec() == BYTES.spec()
    assert ckpt["step"] == 7
    for name, w in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], w)


@on_devices
def test_a_checkpoint_saved_on_a_device_loads_on_the_cpu(tmp_path, device):
    model = tiny_model().to(device)
    setdiff.save_checkpoint(tmp_path / "ckpt.pt", model, BYTES, step=7)
    loaded = load_checkpoint(tmp_path / "ckpt.pt", "cpu")[0]
    for name, w in loaded.state_dict().items():
        assert w.device.type == "cpu"
        assert torch.equal(w, model.state_dict()[name].cpu())


def test_a_failed_save_keeps_the_old_file(tmp_path, monkeypatch):
    model, path = saved(tmp_path)
    before = path.read_bytes()
    monkeypatch.setattr(setdiff, "open", full_disk, raising=False)
    with pytest.raises(OSError, match=f"could not write {path}: the disk is full"):
        setdiff.save_checkpoint(path, model, BYTES, step=8)
    assert path.read_bytes() == before
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left


BAD_CHECKPOINTS = {
    "cut.pt": "damaged",
    "damaged.pt": "damaged",  # 4 KB of random bytes in the middle
    "junk.pt": "not a setdiff checkpoint",
    "weights-only.pt": "not a setdiff checkpoint, or an older setdiff's",
    "older.pt": "not a setdiff checkpoint, or an older setdiff's",
    "edited.pt": "damaged \\(its sha256 digest differs\\)",
    "newer.pt": "does not match",
    "non-finite.pt": "weight head.bias is not finite",
    "missing.pt": "not found",
    # written with a new digest (anyone can recompute one): the weights' container is checked
    "no-model.pt": "no-model.pt: its field 'model' is not a state dict",
    "model-a-list.pt": "model-a-list.pt: its field 'model' is not a state dict",
    "model-of-numbers.pt": "model-of-numbers.pt: its field 'model' is not a state dict",
    "edited-vocab.pt": "damaged \\(its sha256 digest differs\\)",  # two pieces swapped, old digest
}


@pytest.mark.parametrize("name", BAD_CHECKPOINTS)
def test_load_refuses_a_bad_checkpoint(tmp_path, name):
    _, path = saved(tmp_path)
    good = path.read_bytes()
    ckpt = load_checkpoint(path)[2]
    half = len(good) // 2
    (tmp_path / "cut.pt").write_bytes(good[:half])
    noise = random.Random(0).randbytes(4096)
    damaged = good[:half] + noise + good[half + 4096 :]
    (tmp_path / "damaged.pt").write_bytes(damaged)
    (tmp_path / "junk.pt").write_bytes(b"hello")
    torch.save(ckpt["model"], tmp_path / "weights-only.pt")  # a plain state dict
    torch.save(ckpt | {"format": "setdiff-checkpoint-3"}, tmp_path / "older.pt")
    edited = ckpt["model"] | {"head.bias": ckpt["model"]["head.bias"] + 1}
    torch.save(ckpt | {"model": edited}, tmp_path / "edited.pt")  # the old digest kept

    def rewritten(name, **fields):
        """ckpt with fields changed, written with a new digest -> its path."""
        setdiff.write_checkpoint(tmp_path / name, ckpt | fields)
        return tmp_path / name

    rewritten("newer.pt", config=ckpt["config"] | {"flash": True})
    weights = ckpt["model"] | {"head.bias": ckpt["model"]["head.bias"] / 0}
    rewritten("non-finite.pt", model=weights)
    setdiff.write_checkpoint(tmp_path / "no-model.pt", set_field(ckpt.copy(), ["model"], DELETE))
    rewritten("model-a-list.pt", model=[1.0])
    rewritten("model-of-numbers.pt", model=dict.fromkeys(ckpt["model"], 1.0))
    words = rewritten("edited-vocab.pt", tokenizer=WORDPIECE.spec())
    signed = torch.load(words, weights_only=True)  # its digest kept below
    vocab = signed["tokenizer"]["vocab"]
    vocab[5], vocab[6] = vocab[6], vocab[5]  # other ids for two words
    torch.save(signed, words)
    load_refused(tmp_path / name, BAD_CHECKPOINTS[name])


DISAGREE = r"in the file, .* by the config; the weights do not fit the config: use"


@table(
    "field,value,match",
    {  # an edited config, written with a new digest -> the refusal (before any allocation)
        "no-heads": (
            "n_head",
            0,
            r"ckpt.pt: its config does not match this setdiff.py: n_head must be in \[1, 2\*\*20\], got 0",
        ),
        "huge-width": ("d_model", 2**20, r"proj.weight: \(32, 32\) in the file, \(1048576,"),
        "million-blocks": ("n_layer", 10**6, "n_layer 1000000: more blocks than weights"),
        "more-blocks": ("n_layer", 3, r"weight blocks\.2\.\S+: missing in the file"),
        "fewer-blocks": ("n_layer", 1, r"weight blocks\.1\.\S+: \(.*\) in the file, none by"),
        "other-vocab": ("vocab_size", 300, DISAGREE),
    },
)
def test_load_refuses_a_checkpoint_whose_config_was_edited(tmp_path, field, value, match):
    _, path = saved(tmp_path)
    ckpt = load_checkpoint(path)[2]
    setdiff.write_checkpoint(path, ckpt | {"config": ckpt["config"] | {field: value}})
    load_refused(path, match)


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
    net = {
        "_target_": "backbone_dit.DIT",
        "length": L,
        "causal_attention": False,
        "adaln": False,
        "hidden_size": D,
        "cond_dim": 128,
        "n_heads": H,
        "num_layers": N,
        "dropout": 0.1,
        "tie_word_embeddings": True,
        "attn_backend": "sdpa",
        "vocab_size": V,
        "block_size": L,
        "pretrained_model_name_or_path": None,
    }
    noise = {
        "_target_": "noise_schedule_noise_schedules.StaggeredNoise",
        "eps": 0.001,
        "block_size": L,
        "desired_block_size": d,
        "max_block_size": L,
        "length": L,
    }
    tokens = {"vocab_size": V, "mask_token_id": mask_id, "pad_token_id": 0, "bos_token_id": None}
    return {
        "architectures": ["SetDLM"],
        "model_type": "bd3lm",
        "auto_map": {"AutoConfig": "bd3lm.BD3LMConfig", "AutoModelForMaskedLM": "setdlm.SetDLM"},
        "attn_backend": "sdpa",
        "backbone_config": net | backbone,
        "noise_config": noise,
        "length": L,
        "block_size": L,
        "eval_block_size": L,
        "keep_clean_bos": True,
        "eval_nll": False,
        "train_on_context": False,
        "setdlm_eos_last_in_target_order": False,
        "setdlm_fht_cache_order": False,
        "tokenization_config": tokens,
        "vocab_size": V,
        "pad_token_id": 0,
        "mask_token_id": mask_id,
        "torch_dtype": "float32",
        "transformers_version": "4.52.4",
    }


def authors_inv_freq(hd):
    """The authors' rotary frequencies, in float32: 1 / 10000^(2i/hd)."""
    return 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))


def authors_weights(V, L, D, N, seed=0):
    """A random state dict under the authors' names and shapes (the Denoiser's, `backbone.`)."""
    g = gen(seed)

    def w(*shape, scale=0.3):
        return torch.randn(*shape, generator=g) * scale

    hd = D // 2
    sd = {"backbone.vocab_embed.embedding": w(V, D, scale=1.0)}
    sd["backbone.rotary_emb.inv_freq"] = authors_inv_freq(hd)
    for i in range(N):
        p = f"backbone.blocks.{i}."
        sd[p + "norm1.weight"] = 1 + w(D)
        sd[p + "attn_qkv.weight"] = w(3 * D, D)
        sd[p + "attn_out.weight"] = w(D, D)
        sd[p + "norm2.weight"] = 1 + w(D)
        sd[p + "mlp.0.weight"] = w(4 * D, D)
        sd[p + "mlp.0.bias"] = w(4 * D)
        sd[p + "mlp.2.weight"] = w(D, 4 * D)
        sd[p + "mlp.2.bias"] = w(D)
    sd["backbone.output_layer.norm_final.weight"] = 1 + w(D)
    sd["backbone.output_layer.linear.weight"] = w(V, D)
    sd["backbone.output_layer.linear.bias"] = w(V)
    sd["static_attention_mask"] = torch.ones(2 * L, 2 * L, dtype=torch.bool)  # ignored on load
    return sd


def authors_mask(L):
    """The authors' additive mask over slots [clean | mask stream], rank = slot mod L."""
    slot = torch.arange(2 * L)
    rank = slot % L
    in_mask = slot >= L
    rq = rank[:, None]
    rk = rank[None]
    mq = in_mask[:, None]
    mk = in_mask[None]
    clean_sees_clean = ~mq & ~mk & (rk <= rq)
    mask_sees_clean = mq & ~mk & (rk < rq)
    itself = slot[:, None] == slot[None]
    allowed = clean_sees_clean | mask_sees_clean | itself
    return torch.where(allowed, 0.0, torch.finfo(torch.float32).min)


def authors_nll(sd, H, x, order, mask_id):
    """-log p(x[sigma_i] | x[sigma_<i]) per slot (B, L), as the authors compute it: tokens
    [x[sigma] | MASK...] at positions [sigma | sigma]; clean slots see clean slots of lower or
    equal rank, mask slots see clean slots of lower rank, every slot sees itself; an additive
    float mask; LayerNorm without bias; rotate-half rotary from a float32 table; tanh GELU;
    a head with a bias; MASK's logit -1e12; the loss read from the mask stream."""
    B, L = x.shape
    D = sd["backbone.vocab_embed.embedding"].shape[1]
    hd = D // H
    freqs = torch.outer(torch.arange(L).float(), authors_inv_freq(hd))
    emb = torch.cat([freqs, freqs], -1)  # (L, hd)
    pos = torch.cat([order, order], 1)  # (B, 2L)
    cos = emb.cos()[pos][:, None]  # (B, 1, 2L, hd)
    sin = emb.sin()[pos][:, None]
    clean = x.gather(1, order)  # (B, L) decode order
    tokens = torch.cat([clean, torch.full_like(x, mask_id)], 1)
    bias = authors_mask(L)

    def rot(t):
        t1, t2 = t.chunk(2, -1)
        return t * cos + torch.cat([-t2, t1], -1) * sin

    h = sd["backbone.vocab_embed.embedding"][tokens]
    N = sum(k.endswith("norm1.weight") for k in sd)  # layers
    for i in range(N):
        p = f"backbone.blocks.{i}."
        a = F.layer_norm(h, [D], sd[p + "norm1.weight"])
        qkv = (a @ sd[p + "attn_qkv.weight"].T).view(B, 2 * L, 3, H, hd)
        q, k, v = qkv.transpose(1, 3).unbind(2)  # (B, H, 2L, hd)
        att = F.scaled_dot_product_attention(rot(q), rot(k), v, attn_mask=bias)  # as theirs
        att = att.transpose(1, 2).reshape(B, 2 * L, D)
        h = h + att @ sd[p + "attn_out.weight"].T
        m = F.layer_norm(h, [D], sd[p + "norm2.weight"])
        m = m @ sd[p + "mlp.0.weight"].T + sd[p + "mlp.0.bias"]
        m = F.gelu(m, approximate="tanh")
        h = h + m @ sd[p + "mlp.2.weight"].T + sd[p + "mlp.2.bias"]
    h = F.layer_norm(h, [D], sd["backbone.output_layer.norm_final.weight"])
    head = "backbone.output_layer.linear."
    logits = h @ sd[head + "weight"].T + sd[head + "bias"]
    logits[..., mask_id] = -1e12
    logp = torch.log_softmax(logits[:, L:], -1)  # the mask stream, decode order
    return -logp.gather(-1, clean[..., None])[..., 0]


def safetensors_parts(path):
    """-> (the JSON header, the data after it) of a safetensors file."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


NESTED = "(50,000 nested arrays)"  # a JSON value json.dumps cannot nest so deep itself


def json_text(tree) -> str:
    """json.dumps, with NESTED written as "[" * 50000: past any recursion limit of a parser."""
    return json.dumps(tree).replace(json.dumps(NESTED), "[" * 50000)


def write_header(path, header, data):
    text = json_text(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def write_safetensors(path, tensors):
    """The safetensors layout by hand: an 8-byte little-endian header size, a JSON header, bytes."""
    names = {torch.float32: "F32", torch.bool: "BOOL"}
    header = {"__metadata__": {"format": "pt"}}
    blobs = []
    offset = 0
    for name, t in tensors.items():
        blob = t.contiguous().numpy().tobytes()
        end = offset + len(blob)
        offsets = [offset, end]
        header[name] = dict(dtype=names[t.dtype], shape=list(t.shape), data_offsets=offsets)
        blobs.append(blob)
        offset = end
    write_header(path, header, b"".join(blobs))


def lm1b_folder(tmp_path, weights="bin", L=16, d=4, changes=None, noise=None, **backbone):
    """A released LM1B folder (V = 24, D = 16, 2 heads, 2 layers) -> (folder, weights), with
    `changes` to config.json, `noise` to its noise_config, `backbone` to its backbone_config."""
    V = len(VOCAB)
    folder = tmp_path / f"lm1b-{weights}"
    folder.mkdir(exist_ok=True)
    spec = authors_config(V, L, 16, 2, 2, d, VOCAB.index("[MASK]"), **backbone)
    spec |= changes or {}
    spec["noise_config"] |= noise or {}
    (folder / "config.json").write_text(json.dumps(spec, indent=2))
    write_vocab(folder / "vocab.txt")
    sd = authors_weights(V, L, 16, 2)
    if weights == "bin":
        torch.save(sd, folder / "pytorch_model.bin")
    else:
        write_safetensors(folder / "model.safetensors", sd)
    return folder, sd


@pytest.fixture(params=["bin", "safetensors"])
def released(tmp_path, request):
    """A released LM1B folder, its weights as pytorch_model.bin or model.safetensors."""
    return lm1b_folder(tmp_path, request.param)


def vocab_rows(L=24):
    x = torch.randint(5, len(VOCAB), (3, L), generator=gen(0))
    x[:, [0, 9]] = 2  # [CLS]: BOS, and a sentence end
    return x


def assert_authors_nll(model, sd, x):
    """setdiff's NLL of rows x over VOCAB, slot by slot in a sampled order, is the authors'
    forward's of the weights sd (2 heads, [MASK] 4)."""
    order = sample_order(model.cfg, len(x), gen(1))
    want = authors_nll(sd, 2, x, order, 4)  # (B, L) per slot, decode order
    got = position_nll(model, x, order).float()  # position order
    assert torch.allclose(got.gather(1, order), want, atol=2e-5)


def test_a_released_folder_is_recorded_as_such(released):
    folder, _ = released
    assert load_checkpoint(folder)[2]["released"] == str(folder)


def test_a_released_folder_takes_its_shape_from_config_json(released):
    cfg = load_checkpoint(released[0])[0].cfg
    assert (cfg.seq_len, cfg.d_model, cfg.n_layer) == (16, 16, 2)
    assert (cfg.set_size, cfg.max_set_size) == (4, 8)  # max_block_size = L: s = min(2d, L)


def test_a_released_lm1b_model_uses_cls_as_bos_and_eos(released):
    cfg = load_checkpoint(released[0])[0].cfg
    assert cfg.bos_id == cfg.eos_id == 2
    assert (cfg.pad_id, cfg.mask_id) == (0, 4)


def test_a_released_model_matches_the_authors_forward(released):
    folder, sd = released
    model = load_checkpoint(folder)[0].eval()
    assert_authors_nll(model, sd, vocab_rows(16))


def test_a_released_bound_drops_slot_0_as_the_authors_do(released):
    folder, sd = released
    model = load_checkpoint(folder)[0]
    x = vocab_rows(16)
    want = authors_nll(sd, 2, x, sample_order(model.cfg, 3, gen(1)), 4)
    res = elbo(model, x, generator=gen(1))
    assert res.tokens_scored == 3 * 15  # the [CLS] ending a sentence is a target, slot 0 not
    scored = want[:, 1:].sum().item()
    assert res.nll == pytest.approx(scored, abs=1e-3)


@table(
    "given,s",
    {
        "explicit": (6, 6),  # an eval override: kept
        "L": (32, 8),  # max_block_size = L: s = min(2d, L)
    },
)
def test_a_released_max_block_size_sets_s(tmp_path, given, s):
    folder, _ = lm1b_folder(tmp_path, L=32, noise=dict(max_block_size=given))
    assert load_checkpoint(folder)[0].cfg.max_set_size == s


QWEN = {
    "_target_": "backbone_automodel.AutoModelFromPreTrained",
    "pretrained_model_name_or_path": "Qwen/Qwen3-1.7B-Base",
}
OTHER_MODELS = {  # config.json changes, backbone_config changes, the refusal
    "ar": ({"architectures": ["AR"]}, {}, "autoregressive"),
    "causal-dit": ({}, {"causal_attention": True}, "autoregressive"),
    "mdlm": ({"architectures": ["MDLM"], "model_type": "mdlm"}, {}, "an MDLM"),
    "bd3lm": ({"architectures": ["BD3LM"], "block_size": 4}, {}, "a BD3-LM .*block size 4"),
    "qwen3": ({}, QWEN, "Qwen3"),
    "legacy-dit": ({}, {"_target_": "backbone_dit_legacy.DITLegacy"}, "legacy"),
    "adaln": ({}, {"adaln": True}, "adaLN"),
    "llama": ({"architectures": ["Llama"]}, {}, "unknown model"),
}


@table("changes,net,match", OTHER_MODELS)
def test_load_refuses_a_folder_of_another_model(tmp_path, changes, net, match):
    folder, _ = lm1b_folder(tmp_path, changes=changes, **net)
    load_refused(folder, match)


@table(
    "extra,match",
    {
        "extra-backbone-weight": ({"backbone.extra.weight": torch.zeros(2)}, "do not fit"),
        "weight-outside-backbone": ({"sigma_map.weight": torch.zeros(2)}, "unknown weight"),
        "non-finite": ({"backbone.output_layer.norm_final.weight": torch.ones(16) / 0}, "ln_f"),
        "other-shape": (
            {"backbone.vocab_embed.embedding": torch.zeros(24, 8)},
            r"tok_emb.weight: \(24, 8\) in the file, \(24, 16\) by the config",
        ),
        "a-number": ({"backbone.blocks.0.norm1.weight": 1.0}, "not a state dict"),
        "a-name-not-text": ({7: torch.zeros(2)}, "not a state dict"),
    },
)
def test_load_refuses_weights_that_do_not_fit(tmp_path, extra, match):
    folder, sd = lm1b_folder(tmp_path)
    torch.save(sd | extra, folder / "pytorch_model.bin")
    load_refused(folder, match)


@table(
    "name,content,match",
    {
        "no-weights": ("pytorch_model.bin", None, "has no weights"),
        "config-not-json": ("config.json", "{not json", "not JSON"),
        "no-tokenizer-files": ("vocab.txt", None, "no vocab.txt .BERT. nor vocab.json"),
    },
)
def test_load_refuses_a_broken_released_folder(tmp_path, name, content, match):
    folder, _ = lm1b_folder(tmp_path)
    (folder / name).unlink()
    if content:
        (folder / name).write_text(content)
    load_refused(folder, match)


@pytest.mark.parametrize("key", ["k", "b"])
def test_a_released_schedule_shape_k_or_b_is_refused(tmp_path, key):
    """The authors' schedule takes k (or b) from noise_config; setdiff derives them from d, s."""
    folder, _ = lm1b_folder(tmp_path, noise={"k": None, "b": None, key: 0.5})
    load_refused(folder, f"noise_config sets {key}:")


def test_load_refuses_a_folder_without_config_json(tmp_path):
    load_refused(tmp_path, "folder without a config.json")


DELETE = "(the field deleted)"


def set_field(tree, keys, value):
    """tree with tree[k0][k1]... = value (DELETE: removed); no keys: value replaces tree."""
    if not keys:
        return value
    inner = tree
    for key in keys[:-1]:
        inner = inner[key]
    if value == DELETE:
        del inner[keys[-1]]
    else:
        inner[keys[-1]] = value
    return tree


@pytest.fixture
def safetensors_only(exported):
    """The exported folder without its .bin, so model.safetensors is read -> (folder, that file)."""
    folder = exported[1]
    (folder / "pytorch_model.bin").unlink()
    return folder, folder / "model.safetensors"


E = "backbone.vocab_embed.embedding"  # export_model's (24, 32) float32: bytes [0, 3072)
# 0 bytes, so data_offsets [0, 0] fit them; 2**63 overflows torch's sizes (int64), 2**62 not
ZERO_BESIDE_HUGE = {"dtype": "F32", "shape": [0, 2**63], "data_offsets": [0, 0]}
ZERO_BESIDE_2_62 = ZERO_BESIDE_HUGE | {"shape": [0, 2**62]}
PAST = "data_offsets overlaps another tensor or ends past the"


@table(
    "keys,value,match",
    {  # a field of model.safetensors's header -> the refusal
        "header-a-list": ((), [E], "safetensors: header: not a JSON object"),
        "entry-a-number": ((E,), 7, f"tensor {E}: dtype None"),
        "no-dtype": ((E, "dtype"), DELETE, "dtype None: setdiff reads F32, F16, BF16, I64, BOOL"),
        "unknown-dtype": ((E, "dtype"), "F64", "dtype 'F64'"),
        "shape-a-string": ((E, "shape"), "24x32", "shape '24x32': not a list of sizes"),
        "negative-shape": ((E, "shape"), [-24, -32], "shape"),
        "zero-beside-huge": ((E,), ZERO_BESIDE_HUGE, r"shape .*: more than the 2\*\*63 - 1"),
        "zero-beside-2-62": ((E,), ZERO_BESIDE_2_62, r"\(0, 4611686018427387904\) in the file"),
        "nested-shape": ((E, "shape"), NESTED, "safetensors: header: not a JSON object"),
        "shape-not-the-bytes": ((E, "shape"), [3, 3], r"\[0, 3072\]: not \[start, start \+ 36\]"),
        "no-offsets": ((E, "data_offsets"), DELETE, "data_offsets None"),
        "one-offset": ((E, "data_offsets"), [3072], r"data_offsets \[3072\]"),
        "negative-offsets": ((E, "data_offsets"), [-8, 3064], r"data_offsets \[-8, 3064\]"),
        "offsets-past-the-end": ((E, "data_offsets"), [10**9, 10**9 + 3072], PAST),
        "offsets-overlapping": ((E, "data_offsets"), [4, 3076], PAST),
        "shape-of-another-model": ((E, "shape"), [32, 24], r"\(32, 24\) in the file, \(24, 32\)"),
    },
)
def test_load_refuses_a_malformed_safetensors_field(safetensors_only, keys, value, match):
    folder, path = safetensors_only
    header, data = safetensors_parts(path)
    write_header(path, set_field(header, keys, value), data)
    load_refused(folder, match)


@table(
    "data,match",
    {  # the bytes of model.safetensors -> the refusal
        "empty": (b"", "header size 0: past the end of the file"),
        "header-past-the-end": (struct.pack("<Q", 99) + b"{}", "header size 99: past the end"),
        "header-not-json": (struct.pack("<Q", 2) + b"{x", "header: not a JSON object"),
        "header-not-utf-8": (struct.pack("<Q", 2) + b"\xff\xfe", "header: not a JSON object"),
    },
)
def test_load_refuses_a_malformed_safetensors_file(safetensors_only, data, match):
    folder, path = safetensors_only
    path.write_bytes(data)
    load_refused(folder, match)


@table(
    "keys,value,match",
    {  # a config.json field -> the refusal, naming the field as the file does
        "no-heads": (("backbone_config", "n_heads"), 0, r"n_head must be in \[1, 2\*\*20\], got 0"),
        "huge-width": (("backbone_config", "hidden_size"), 2**20, DISAGREE),
        "million-blocks": (("backbone_config", "num_layers"), 10**6, "n_layer 1000000: more"),
        "huge-length": (("length",), 10**9, "L must be at most 65536"),
        "dropout-2": (("backbone_config", "dropout"), 2.0, "dropout must be in"),
        "no-mask-id": (("mask_token_id",), DELETE, "lacks a field .*'mask_token_id'"),
        "d-0": (("noise_config", "desired_block_size"), 0, "the set size d must be in"),
        "noise-config-a-list": (("noise_config",), [], "noise_config: missing or not an object"),
        "not-an-object": ((), [], "config.json: not a JSON object"),
        "other-vocab": (("backbone_config", "vocab_size"), 25, "tokenizer files do not fit"),
        "architectures-a-number": (("architectures",), 5, r"an unknown model \(\?"),
        "nested": (("backbone_config",), NESTED, "config.json is not JSON .*recursion"),
    },
)
def test_load_refuses_a_malformed_config_json(exported, keys, value, match):
    spec = set_field(config_of(exported[1]), keys, value)
    (exported[1] / "config.json").write_text(json_text(spec))
    load_refused(exported[1], match)


REPLACEMENTS = [DELETE, "x", [], {}, None, True, 2.5, math.inf]
REPLACEMENTS += [0, -1, -(10**9), 10**12, 10**30]  # integers past any sensible field
REPLACEMENTS += [NESTED]  # in a checkpoint (not JSON), a plain string
SIZES = [0, 1, 7, 2**31, 2**63, 10**30]  # a shape's: beside a 0, any size gives 0 bytes


def json_slots(tree, keys=()):
    """The key path of every value inside a JSON tree of dicts and lists."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    for key, value in items:
        yield (*keys, key)
        if isinstance(value, (dict, list)):
            yield from json_slots(value, (*keys, key))


def mutate_json(tree, rng):
    """A copy of tree with one random value deleted, retyped, or made huge, negative or 0."""
    keys = rng.choice(list(json_slots(tree)))
    return set_field(copy.deepcopy(tree), keys, rng.choice(REPLACEMENTS))


def mutate_shape(header, rng):
    """header with one tensor's shape 1 to 3 random SIZES, its data_offsets spanning the bytes
    those count (so that the byte count, checked first, passes)."""
    name = rng.choice([key for key in header if key != "__metadata__"])
    entry = header[name]
    shape = rng.choices(SIZES, k=rng.randint(1, 3))
    itemsize = setdiff.SAFETENSORS_DTYPES[entry["dtype"]].itemsize
    start = entry["data_offsets"][0]
    entry |= {"shape": shape, "data_offsets": [start, start + math.prod(shape) * itemsize]}
    return header


def flip_bytes(path, rng):
    data = bytearray(path.read_bytes())
    for _ in range(rng.randint(1, 4)):
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    path.write_bytes(data)


def fuzz_folder(tmp_path):
    """A released folder of ~1,300 weights (no .bin: its safetensors file is read), and its
    mutation: a config.json field, a safetensors header field or shape, or a few bits."""
    folder = tmp_path / "tiny"
    model = export_model(seq_len=8, set_size=2, n_layer=1, d_model=8)
    setdiff.save_released(model, WORDPIECE, folder)
    (folder / "pytorch_model.bin").unlink()

    def mutate(rng):
        kind = rng.randrange(4)
        header, data = safetensors_parts(folder / "model.safetensors")
        if kind == 0:
            spec = mutate_json(config_of(folder), rng)
            (folder / "config.json").write_text(json_text(spec))
        elif kind == 1:
            write_header(folder / "model.safetensors", mutate_json(header, rng), data)
        elif kind == 2:
            write_header(folder / "model.safetensors", mutate_shape(header, rng), data)
        else:
            flip_bytes(rng.choice(sorted(folder.iterdir())), rng)

    return folder, mutate


def fuzz_checkpoint(tmp_path):
    """A checkpoint, and its mutation: any field, the weights' container too (written with a
    new digest: anyone can recompute one), or bits."""
    path = tmp_path / "tiny.pt"
    setdiff.save_checkpoint(path, tiny_model(n_layer=1, d_model=8), BYTES)
    ckpt = load_checkpoint(path)[2]

    def mutate(rng):
        if rng.randrange(2):
            flip_bytes(path, rng)
        else:
            setdiff.write_checkpoint(path, mutate_json(ckpt, rng))

    return path, mutate


@table("make", {"released-folder": fuzz_folder, "checkpoint": fuzz_checkpoint})
def test_fuzzed_files_load_or_are_refused_in_one_line(tmp_path, make):
    """300 seeded mutations: each loads with finite weights or raises our one-line ValueError;
    any other exception (or a config whose sizes allocate past the file) fails the test."""
    path, mutate = make(tmp_path)
    files = {p: p.read_bytes() for p in [path, *path.glob("*")] if p.is_file()}
    rng = random.Random(0)
    refused = 0
    for _ in range(300):
        for p, data in files.items():
            p.write_bytes(data)
        mutate(rng)
        try:
            weights = load_checkpoint(path)[0].state_dict()
        except ValueError as e:
            assert "\n" not in str(e), str(e)
            refused += 1
            continue
        assert all(w.isfinite().all() for w in weights.values())
    assert 0 < refused < 300  # both outcomes met


# Export: a model trained here written as a released folder (save_released), then read back by
# load_checkpoint, by hand (the safetensors layout) and by the authors' forward above.
WORDPIECE = Tokenizer("wordpiece", VOCAB)


def export_model(**kw):
    """A tiny_model over VOCAB (L = 24, D = 32, 2 heads, 2 layers, d = 3, s = 6) whose special
    ids are WORDPIECE's: [MASK] 4, [CLS] BOS and EOS, [PAD] 0."""
    specials = dict(vocab_size=len(VOCAB), mask_id=4, pad_id=0)
    specials |= dict(bos_id=2, eos_id=2)  # [CLS], as LM1B's
    model = tiny_model(**(specials | kw))
    with torch.no_grad():
        for w in model.parameters():  # every weight its own: LayerNorm's off 1, biases off 0
            w.add_(torch.randn_like(w) * 0.3)
    return model


@pytest.fixture
def exported(tmp_path):
    """export_model() saved into an existing empty folder -> (model, folder, files written)."""
    folder = tmp_path / "export"
    folder.mkdir()  # an empty folder is taken
    model = export_model()
    return model, folder, setdiff.save_released(model, WORDPIECE, folder)


def config_of(folder):
    return json.loads((folder / "config.json").read_text())


def test_an_export_writes_the_released_files(exported):
    names = ["config.json", "model.safetensors", "pytorch_model.bin", "vocab.txt"]
    assert sorted(exported[2]) == names
    assert sorted(os.listdir(exported[1])) == names  # no temporary file left


def test_an_export_loads_back_with_identical_logits(exported):
    model, folder, _ = exported
    loaded = load_checkpoint(folder)[0]
    x = vocab_rows()
    order = sample_order(model.cfg, 3, gen(1))
    want = setdiff.position_logits(model, x, order)
    assert torch.equal(setdiff.position_logits(loaded, x, order), want)


def test_an_export_loads_back_with_its_config_and_vocab(exported):
    model, folder, _ = exported
    loaded, tok, _ = load_checkpoint(folder)
    cfg = loaded.cfg
    assert (cfg.seq_len, cfg.set_size, cfg.max_set_size) == (24, 3, 6)
    ids = (cfg.vocab_size, cfg.mask_id, cfg.bos_id, cfg.eos_id, cfg.pad_id)
    assert ids == (24, 4, 2, 2, 0)  # [MASK], [CLS] twice, [PAD]
    assert cfg == model.cfg
    assert tok.pieces == VOCAB


def test_exported_weights_give_the_authors_forward_setdiffs_nll(exported):
    """The authors' names, read by their forward (not by setdiff's loader): the same NLL."""
    model, folder, _ = exported
    sd = torch.load(folder / "pytorch_model.bin", weights_only=True)
    assert_authors_nll(model, sd, vocab_rows())


def test_an_export_carries_the_authors_rotary_and_mask_buffers(exported):
    sd = torch.load(exported[1] / "pytorch_model.bin", weights_only=True)
    assert torch.equal(sd["backbone.rotary_emb.inv_freq"], authors_inv_freq(16))
    assert torch.equal(sd["static_attention_mask"], authors_mask(24) == 0)


def read_safetensors(path):
    """A safetensors file by hand -> ({name: tensor}, header size, metadata, unclaimed bytes)."""
    header, body = safetensors_parts(path)
    n = path.stat().st_size - 8 - len(body)
    meta = header.pop("__metadata__")
    dtypes = {"F32": "<f4", "BOOL": "?"}
    tensors = {}
    for name, info in header.items():
        start, end = info["data_offsets"]
        array = np.frombuffer(body[start:end], dtype=dtypes[info["dtype"]])
        tensor = torch.from_numpy(array.copy())
        tensors[name] = tensor.reshape(info["shape"])
    ends = max(info["data_offsets"][1] for info in header.values())
    return tensors, n, meta, len(body) - ends


def test_the_exported_safetensors_hold_the_bins_tensors(exported):
    folder = exported[1]
    tensors, n, meta, unclaimed = read_safetensors(folder / "model.safetensors")
    sd = torch.load(folder / "pytorch_model.bin", weights_only=True)
    assert n % 8 == 0
    assert (meta, unclaimed) == ({"format": "pt"}, 0)
    assert tensors.keys() == sd.keys()
    for name, tensor in sd.items():
        assert tensors[name].dtype == tensor.dtype
        assert torch.equal(tensors[name], tensor), name


def test_an_exported_config_json_is_the_authors(exported):
    """authors_config with the model's d, s = 6 and dropout, BOS and EOS unset as in LM1B's; no
    auto_map (it names code files that the export does not write)."""
    spec = config_of(exported[1])
    want = authors_config(len(VOCAB), 24, 32, 2, 2, 3, 4, dropout=0.0)
    del want["auto_map"]
    want["noise_config"]["max_block_size"] = 6
    ids = {"eos_token_id": None, "pad_vocab_size_multiple": 1}  # LM1B's: BOS, EOS unset
    want["tokenization_config"] |= ids
    want |= {"tokenizer_name": "bert-base-uncased", "pad_vocab_size_multiple": 1}
    assert spec == want


@table(
    "d,s,written",
    {
        "s-below-L": (3, 6, 6),
        "s-is-L-with-2d-equal-L": (12, 24, 24),  # read back as min(2d, L) = L
    },
)
def test_an_export_writes_max_block_size_as_s_and_reads_it_back(tmp_path, d, s, written):
    model = export_model(set_size=d, max_set_size=s)
    setdiff.save_released(model, WORDPIECE, tmp_path / "out")
    spec = config_of(tmp_path / "out")
    assert spec["noise_config"]["max_block_size"] == written
    assert load_checkpoint(tmp_path / "out")[0].cfg.max_set_size == s


BPE_IDS = NO_BOS | dict(vocab_size=20, eos_id=18, mask_id=19)  # the bpe fixture's


def gpt2_export(bpe, folder):
    """A tiny OWT-style model over the bpe fixture (no BOS, no PAD), exported -> the model."""
    model = tiny_model(**BPE_IDS)
    setdiff.save_released(model, bpe, folder)
    return model


def test_a_gpt2_export_writes_vocab_json_without_mask_and_merges_txt(bpe, tmp_path):
    """TINY_BPE's files as written (MASK appended on load, as the authors' OWT files); no PAD is
    written as EOS, as in the authors' OWT config.json."""
    gpt2_export(bpe, tmp_path / "owt")
    vocab = json.loads((tmp_path / "owt" / "vocab.json").read_text())
    assert vocab == {piece: i for i, piece in enumerate(TINY_BPE + ["<|endoftext|>"])}
    assert (tmp_path / "owt" / "merges.txt").read_text() == TINY_MERGES
    spec = config_of(tmp_path / "owt")
    assert (spec["tokenizer_name"], spec["pad_token_id"]) == ("gpt2", 18)


def test_a_gpt2_export_loads_back_with_its_tokenizer_and_config(bpe, tmp_path):
    model = gpt2_export(bpe, tmp_path / "owt")
    loaded, tok, _ = load_checkpoint(tmp_path / "owt")
    assert tok.spec() == bpe.spec()
    assert loaded.cfg == model.cfg


BYTE_IDS = dict(vocab_size=260, mask_id=259, pad_id=256)
BYTE_IDS |= dict(bos_id=257, eos_id=258)


@table(
    "kw,tok,match",
    {  # export_model's changes, the tokenizer, the refusal
        "ar": (dict(order="ar"), WORDPIECE, "order 'ar': the authors' SetDLM is staggered only"),
        "block": (dict(order="block"), WORDPIECE, "order 'block'"),
        "uniform": (dict(order="uniform"), WORDPIECE, "order 'uniform'"),
        "s-is-L-with-2d-below-L": (
            dict(set_size=4, max_set_size=24),
            WORDPIECE,
            r"s = L = 24 with d = 4: .* as s = min\(2d, L\) = 8",
        ),
        "bytes-tokenizer": (BYTE_IDS, BYTES, "cannot export the bytes tokenizer"),
        "ids-not-the-tokenizers": (dict(mask_id=3), WORDPIECE, "ids are not its tokenizer's"),
    },
)
def test_export_refuses_what_the_format_cannot_express(tmp_path, kw, tok, match):
    with pytest.raises(ValueError, match=match):
        setdiff.save_released(export_model(**kw), tok, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_refuses_a_weight_the_authors_layout_has_no_name_for(tmp_path):
    model = export_model()
    model.ln_f = torch.nn.LayerNorm(32)  # with a bias, which the authors' DiT has not
    with pytest.raises(ValueError, match="weight ln_f.bias: the authors' layout has no name"):
        setdiff.save_released(model, WORDPIECE, tmp_path / "out")


@table("name", {"non-empty-folder": "out/notes.txt", "a-file": "out"})
def test_export_refuses_a_path_that_holds_something_and_keeps_it(tmp_path, name):
    mine = tmp_path / name  # "out" itself for a file
    mine.parent.mkdir(exist_ok=True)
    mine.write_text("mine")
    with pytest.raises(ValueError, match="out exists and is not an empty folder"):
        setdiff.save_released(export_model(), WORDPIECE, tmp_path / "out")
    assert mine.read_text() == "mine"


def stops_at_the_second_file(error):
    """open() for setdiff: the first file is written, the second stops part-way with `error`."""
    opened = []

    def fake_open(path, mode="r"):
        opened.append(path)
        f = io.open(path, mode)
        if len(opened) == 2:
            f.write(b"partial")
            f.close()
            raise error
        return f

    return fake_open


@table("error", {"disk-full": OSError(errno.ENOSPC, "full"), "ctrl-c": KeyboardInterrupt()})
@pytest.mark.parametrize("empty_before", [False, True], ids=["new", "empty"])
def test_an_export_stopped_part_way_leaves_the_folder_as_it_was(
    tmp_path, monkeypatch, empty_before, error
):
    folder = tmp_path / "out"
    if empty_before:
        folder.mkdir()
    monkeypatch.setattr(setdiff, "open", stops_at_the_second_file(error), raising=False)
    with pytest.raises(type(error)):  # ENOSPC: "could not write ...: the disk is full"
        setdiff.save_released(export_model(), WORDPIECE, folder)
    assert os.listdir(tmp_path) == ["out"] * empty_before  # no temporary folder beside it
    assert not empty_before or os.listdir(folder) == []


# ---- running: the compiled sampler, its static state and graphs -----------------------------
# torch.compile with inductor costs 15-30 s a capture on a CPU: two cases (three captures)
# cover greedy and sampled, prompt and infill, one row and three, sets of one and of two.
COMPILED = {  # temperature, start, rows, window, tau
    "greedy-prompt-batch-1": (0.0, "prompt", 1, 3, math.inf),
    "sampled-infill-batch-3-w2-tau-0.3": (1.0, "infill", 3, 2, 0.3),
}


@on_devices
@table("temperature,start,rows,window,threshold", COMPILED)
def test_a_compiled_sampler_draws_the_eager_tokens(
    temperature, start, rows, window, threshold, device
):
    """On a GPU too: there each compiled call is a CUDA graph, replayed."""
    model = tiny_model().to(device)
    inputs, _, _ = start_rows(model.cfg, start)
    inputs = on_device({k: v[:rows] for k, v in inputs.items()}, device)
    kw = dict(window=window, threshold=threshold, temperature=temperature)
    eager = generate(model, **inputs, **kw, generator=gen(3))
    graphs = dynamo_graphs()
    compiled = generate(model, **inputs, **kw, generator=gen(3), compile=True)
    assert dynamo_graphs() > graphs  # compiled, not eager against eager
    same_generation(compiled, eager)


def dynamo_graphs():
    """Graphs dynamo compiled so far in this process."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def dynamo_run(model, seed=0, **kw):
    """A run compiled by dynamo alone (backend "eager": no code generation, fast on a CPU)."""
    return generate(model, generator=gen(seed), compile="eager", **kw)


SETS = dict(batch_size=2, window=3, threshold=0.3)  # sets of 1 to 3 tokens


# a second run of the same switches: new values of every number a run takes, a new seed
NEW_VALUES = dict(threshold=2.0, temperature=0.5, top_p=0.8, repetition_penalty=1.3)


def test_a_compiled_run_compiles_a_graph_a_set_size():
    """One graph for each set size that a later call feeds, read from an eager run's reveal
    calls (the same draws): the largest set of a call is the next call's n."""
    out = generate(tiny_model(), **SETS, generator=gen(0))
    graphs = dynamo_graphs()
    dynamo_run(tiny_model(), **SETS)
    sets = largest_sets(out)
    assert dynamo_graphs() - graphs == len(set(sets[:-1].tolist())) > 1


def test_a_second_run_of_the_same_switches_compiles_nothing():
    """One token a call (tau > 1) in every run, so that each feeds the same set size."""
    model = tiny_model()
    first = dict(threshold=math.inf, temperature=1.0, top_p=0.9, repetition_penalty=1.1)
    dynamo_run(model, **SETS | first)
    with torch.compiler.set_stance("fail_on_recompile"):
        dynamo_run(model, seed=1, **SETS | NEW_VALUES)
        dynamo_run(model, seed=2, **SETS | first)


def state_addresses(model):
    """data_ptr of every tensor of the model's sampler states, KV cache included."""
    addresses = {}
    for shape, run in setdiff.SAMPLER_RUNS[model].items():
        for holder in (run, run.cache):
            for name, t in vars(holder).items():
                if torch.is_tensor(t):
                    addresses[shape, name] = t.data_ptr()
    return addresses


def test_a_shapes_state_keeps_its_addresses_across_runs():
    """Runs of one shape (B = 2, C = 24) with a new prompt, seed and settings each."""
    model = tiny_model()
    dynamo_run(model, prompt=[65, 66], **SETS)
    addresses = state_addresses(model)
    dynamo_run(model, seed=1, prompt=[67] * 9, **SETS | NEW_VALUES)
    dynamo_run(model, seed=2, prompt=[68] * 4, **SETS, temperature=0)
    assert state_addresses(model) == addresses
    names = {name for _, name in addresses}
    assert {"x", "uniforms", "threshold", "k", "v"} <= names  # the cache's, allocated late


def test_a_compiled_call_asks_inductor_for_cuda_graphs_and_counts_its_own_graphs(monkeypatch):
    """Inductor alone takes "reduce-overhead" (CUDA graphs); every compile keeps its own count
    of graphs, up to the limit given (a CPU cannot capture: the arguments are the proof)."""
    spy = mock.Mock()
    monkeypatch.setattr(torch, "compile", spy)
    for backend in ("inductor", "eager"):
        setdiff.compiled(setdiff.sampler_call, backend, 12)
    modes = [call.kwargs.get("mode") for call in spy.call_args_list]
    assert modes == ["reduce-overhead", None]
    for call in spy.call_args_list:
        assert call.kwargs["isolate_recompiles"] and call.kwargs["recompile_limit"] == 12


def test_a_runs_settings_are_its_numbers_exactly():
    """tau, temperature, top-p and penalty as 0-d tensors: the same numbers as the floats."""
    model = tiny_model(dtype=torch.float64)
    kw = dict(threshold=0.3, temperature=0.7, top_p=0.9, repetition_penalty=1.1)
    generate(model, **kw)
    (run,) = setdiff.SAMPLER_RUNS[model].values()
    settings = [run.threshold, run.temperature, run.top_p, run.penalty]
    assert [t.item() for t in settings] == list(kw.values())


def test_a_model_keeps_the_state_of_its_last_8_shapes():
    """Batch sizes 1 to 9 (9 shapes): the first one's state goes, the others are kept."""
    model = tiny_model()
    for B in range(1, 10):
        generate(model, batch_size=B, max_new_tokens=2)
    kept = [shape[0] for shape in setdiff.SAMPLER_RUNS[model]]
    assert kept == list(range(2, 10))


VARIED = [(B, new, w) for B in (1, 3) for new in (6, 23) for w in (1, 2)]  # 4 shapes


def test_200_varied_compiled_runs_draw_the_eager_tokens():
    """One process, one model (one layer: dynamo traces it faster): batch sizes, lengths,
    windows, tau, temperatures and top-p drawn; at most 4 shapes x 3 set sizes x greedy or not
    graphs, compiled by the first runs."""
    model = tiny_model(n_layer=1)
    draw = random.Random(0)
    for seed in range(200):
        B, new, w = draw.choice(VARIED)
        tau = draw.choice([0.0, 0.2, 0.5, math.inf])
        kw = dict(batch_size=B, max_new_tokens=new, window=w, threshold=tau)
        kw |= dict(temperature=draw.choice([0.0, 0.7, 1.0]), top_p=draw.uniform(0.5, 1))
        eager = generate(model, generator=gen(seed), **kw)
        same_generation(dynamo_run(model, seed, **kw), eager)


def test_past_its_graph_limit_a_compiled_run_goes_eager_saying_so_once(monkeypatch, capsys):
    """With no switch counted, window 2 allows 2 graphs: a greedy run of sets of 2, a sampled
    one, then one with top-p needs a third: it and later runs run eager, said once."""
    monkeypatch.setattr(setdiff, "SWITCHES", 0)
    model = tiny_model()
    runs = [dict(temperature=0.0), dict(temperature=1.0), dict(top_p=0.9)]
    runs.append(dict(temperature=0.7, top_p=0.8))
    for kw in runs:
        kw |= dict(batch_size=2, window=2, threshold=0.0)
        eager = generate(model, generator=gen(1), **kw)
        same_generation(dynamo_run(model, 1, **kw), eager)
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("--compile: dynamo's graph limit (2 a shape")


@no_gpu
def test_a_second_compiled_run_on_cuda_replays_every_call_and_records_nothing(monkeypatch):
    """CUDA graphs (inductor's "reduce-overhead"), counted as gpu_check counts them: one token
    a call, so one set size (n = 1), one graph recorded by run 1 (its call 2; call 1 warms up);
    run 2, new draws, compiles and records none and replays every compiled call; no graph
    skipped or split (cudagraph_or_error: a skip would raise)."""
    monkeypatch.setattr(torch._inductor.config.triton, "cudagraph_or_error", True)
    model = tiny_model().to("cuda")
    kw = dict(batch_size=2, window=3, threshold=math.inf, top_p=0.9, compile=True)
    counts = gpu_check.graph_counts(functools.partial(generate, model, **kw))
    assert counts["captures_run1"] == 1
    assert counts["captures_run2"] == counts["graphs_run2"] == 0
    assert counts["replays_run2"] == counts["calls_run2"] - 1  # the first call runs eager
    for name in ("cudagraph_skips", "cudagraph_partitions"):
        assert counts[f"{name}_run1"] == counts[f"{name}_run2"] == 0


# ---- text -> rows ---------------------------------------------------------------------------
DOC = b"def f():\r\n    return 1\n\n<|endoftext|>\n\n  x = f()\n"


@table(
    "kind,data,docs,lines,bad",
    {
        "lines": ("bytes", b" hello world\r\n \nnext", ["hello world", "next"], 2, 0),
        "not-utf-8-or-nul": ("bytes", b"caf\xe9\na\x00b\nok\n", ["ok"], 1, 2),
        "bpe-documents": ("bpe", DOC, ["def f():\n    return 1\n", "\n  x = f()"], 4, 0),
        "bpe-skips-a-bad-line": ("bpe", b"a\n\xff\nb\n", ["a\nb"], 2, 1),
        "bpe-blank-document": ("bpe", b" \n<|endoftext|>\n", [], 1, 0),
    },
)
def test_documents_of_a_file(tokenizers, kind, data, docs, lines, bad):
    assert setdiff.documents(tokenizers[kind], data) == (docs, lines, bad)


@table(
    "kw,n",
    {
        "bos": (dict(), 22),  # [BOS] + L-2 tokens + [EOS]
        "no-bos": (NO_BOS, 23),  # L tokens, position 0 given
    },
)
def test_text_per_row_leaves_out_bos_and_the_closing_eos(kw, n):
    """With BOS a row is [BOS] + L-2 tokens + [EOS]; without, position 0 is given, not scored."""
    assert setdiff.text_per_row(tiny_cfg(**kw)) == n


# ---- appendix: tokenizer shim ---------------------------------------------------------------
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


@table(
    "text,pieces",
    {
        "lower-case-punctuation": ("Hello, World!", "hello , world !"),
        "dollar-is-punctuation": ("the$5", "the $ 5"),  # ASCII non-alphanumeric
        "apostrophe": ("the's", "the ' s"),
        "hyphen": ("x-y", "x - y"),
        "continuation": ("xy", "x ##y"),
        "accent": ("Café", "cafe"),  # accents go
        "combining-accent": ("cafe\u0301", "cafe"),
        "diaeresis": ("NAÏVE", "naive"),
        "two-accents": ("Résumé", "resume"),
        "longest-match-first": ("unaffable", "un ##aff ##able"),  # not "##a ##ff"
        "suffix": ("playing", "play ##ing"),
        "greedy-bb": ("abbb", "a ##bb ##b"),
        "suffix-s": ("plays", "play ##s"),
        "no-match-is-unk": ("zebra", "[UNK]"),
        "partial-match-is-unk": ("playx", "[UNK]"),
        "unk-word": ("the zebra", "the [UNK]"),
        "100-characters": ("a" + "b" * 99, "a" + " ##bb" * 49 + " ##b"),
        "over-100-characters": ("a" + "b" * 100, "[UNK]"),
        "cjk-ideographs": ("日本", "日 本"),  # each CJK ideograph is a word
        "cjk-between-words": ("the日本the", "the 日 本 the"),
        "nul-deleted": ("hel\x00lo", "hello"),  # control and format characters are deleted
        "bell-deleted": ("he\x07llo", "hello"),
        "zero-width-space": ("x\u200by", "x ##y"),
        "bom": ("x\ufeffy", "x ##y"),
        "next-line": ("x\x85y", "x ##y"),
        "replacement-char": ("x\ufffdy", "x ##y"),
        # The reference's older Unicode tables, by hand: newer marks and punctuation are letters
        # there (a word goes on through them), U+166D was punctuation, U+1734 a non-spacing mark.
        "newer-punctuation-is-a-letter": ("x\u2e52y", "[UNK]"),  # this Python's Po
        "newer-mark-is-a-letter": ("x\u0898", "[UNK]"),  # this Python's Mn: dropped
        "symbol-once-punctuation": ("x\u166dy", "x [UNK] y"),  # this Python's So
        "spacing-mark-once-non-spacing": ("x\u1734y", "x ##y"),  # this Python's Mc: kept
        "whitespace": (
            "hello\tworld\nthe\r\nx\u00a0y\u3000the\u2003the  ",
            "hello world the x y the the",
        ),
        "only-spaces": ("   ", ""),
        "empty": ("", ""),
        "final-sigma": ("ΣΣ", "σ ##σ"),  # per-character lower case: σ, not ς
        "specials": ("[CLS] [SEP] [MASK] [PAD] [UNK]", "[CLS] [SEP] [MASK] [PAD] [UNK]"),
        "special-inside-word": ("x[SEP]y", "x [SEP] y"),
        "special-then-punctuation": ("[MASK].", "[MASK] ."),
        "special-exact-case": ("[cls]", "[ [UNK] ]"),
        "special-in-brackets": ("[[SEP]]", "[ [SEP] ]"),
    },
)
def test_wordpiece_encode(tok, text, pieces):
    ids = [TINY_VOCAB.index(p) for p in pieces.split()]  # a token's id is its line in the file
    assert tok.encode(text) == ids
    assert tok.encode(text + " " + text) == ids + ids  # the repeat comes from the word memo


@table(
    "text",
    {
        "empty": "",
        "ascii": "hello world",
        "accent": "café",
        "cjk": "日本語",
        "emoji": "emoji 😀👍🏽",
        "controls": "a\tb\nc\x00",
    },
)
def test_bytes_encode_utf_8_and_round_trip(text):
    assert BYTES.encode(text) == list(text.encode("utf-8"))
    assert BYTES.decode(BYTES.encode(text)) == text


# GPT-2 byte-level BPE: a hand-made vocab and merges, each list worked out by hand (and confirmed
# offline with HuggingFace's BPE). Ġ is a space, Ċ a newline, "Ã©" the two UTF-8 bytes of é.
TINY_BPE = "a b c ' s S 1 2 Ġ Ã © bc ab Ġa 's 11 Ã© Ċ".split()
TINY_MERGES = "#version: 0.2\nb c\na b\nĠ a\n' s\n1 1\nÃ ©\n"


def write_bpe(folder, vocab, merges):
    (folder / "vocab.json").write_text(vocab)
    (folder / "merges.txt").write_text(merges)
    return Tokenizer.from_bpe(folder / "vocab.json", folder / "merges.txt")


BPE_VOCAB = json.dumps({p: i for i, p in enumerate(TINY_BPE + ["<|endoftext|>"])})


@pytest.fixture
def bpe(tmp_path):
    return write_bpe(tmp_path, BPE_VOCAB, TINY_MERGES)


@pytest.fixture
def tokenizers(tok, bpe):
    return {"bytes": BYTES, "wordpiece": tok, "bpe": bpe}


SPECIAL_IDS = {  # V, PAD, BOS, EOS, MASK, UNK
    "bytes": (260, 256, 257, 258, 259, None),
    "wordpiece": (41, 0, 2, 2, 4, 1),  # [CLS]: BOS and EOS
    "bpe": (20, None, None, 18, 19, None),  # MASK appended: V + 1
}


@pytest.mark.parametrize("kind", SPECIAL_IDS)
def test_tokenizer_size_and_special_ids(tokenizers, kind):
    t = tokenizers[kind]
    assert t.kind == kind
    ids = (t.vocab_size, t.pad_id, t.bos_id, t.eos_id, t.mask_id, t.unk_id)
    assert ids == SPECIAL_IDS[kind]


@table(
    "kind,ids,text",
    {
        "bytes-specials": ("bytes", [257, 104, 105, 259, 258, 33, 256], "hi\n!"),  # EOS: \n
        "bytes-cut-character": ("bytes", [0xC3], "\ufffd"),
        "wordpiece-words": ("wordpiece", [17, 12, 18, 14], "hello , world !"),
        "wordpiece-joins-pieces": ("wordpiece", [7, 8, 9], "unaffable"),
        "wordpiece-mask-pad-vanish": ("wordpiece", [30, 31, 2, 5, 4, 0, 0], "playing\nthe"),
        "wordpiece-sep-kept": ("wordpiece", [17, 2, 18, 3], "hello\nworld [SEP]"),
        "wordpiece-unk": ("wordpiece", [5, 1], "the [UNK]"),
        "bpe-mask-vanishes": ("bpe", [0, 19, 1], "ab"),
    },
)
def test_decode(tokenizers, kind, ids, text):
    assert tokenizers[kind].decode(ids) == text


@table(
    "kind,bad",
    {
        "bytes-negative": ("bytes", -1),
        "bytes-V": ("bytes", 260),
        "bytes-float": ("bytes", 3.0),
        "wordpiece-V": ("wordpiece", 41),
    },
)
def test_decode_refuses_an_id_outside_the_vocab(tokenizers, kind, bad):
    with pytest.raises(ValueError, match="outside"):
        tokenizers[kind].decode([bad])


def vocab_without(special):
    """A vocab file that lacks one special token, and the refusal."""
    content = vocab_bytes([t for t in TINY_VOCAB if t != special])
    return content, "it has no " + re.escape(special)


BAD_VOCABS = {  # the vocab file's bytes (None: no file) -> the refusal
    "missing": (None, "does not exist"),
    "a-folder": ("dir", "is not a file"),
    "empty": (b"", r"no \[PAD\], \[UNK\]"),
    "not-utf-8": (vocab_bytes(TINY_VOCAB) + b"\xff\xfeoops\n", "not UTF-8"),
    **{"no-" + s: vocab_without(s) for s in TINY_VOCAB[:5]},
    "token-twice": (vocab_bytes(TINY_VOCAB + ["the"]), "twice"),
}


@table("content,match", BAD_VOCABS)
def test_from_vocab_refuses_a_bad_file(tmp_path, content, match):
    path = tmp_path / "bad.txt"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=match):
        Tokenizer.from_vocab(path)


def test_from_vocab_reads_crlf_without_a_final_newline(tmp_path):
    path = tmp_path / "crlf.txt"
    path.write_bytes("\r\n".join(TINY_VOCAB).encode("utf-8"))
    assert Tokenizer.from_vocab(path).encode("Hello!") == [17, 14]


@pytest.fixture
def owt_folder(bpe, tmp_path):
    """An OWT SetDLM folder: GPT-2 BPE files (no MASK in them: it is appended), no BOS, no PAD,
    flex attention (so no static_attention_mask), safetensors -> (folder, weights)."""
    V = bpe.vocab_size
    spec = authors_config(V, 16, 16, 2, 2, 8, V - 1, attn_backend="flex_attention")
    spec["tokenization_config"] = None
    (tmp_path / "config.json").write_text(json.dumps(spec))
    sd = authors_weights(V, 16, 16, 2)
    del sd["static_attention_mask"]
    write_safetensors(tmp_path / "model.safetensors", sd)
    return tmp_path, sd


def test_an_owt_folder_has_no_bos_and_no_pad(owt_folder):
    cfg = load_checkpoint(owt_folder[0])[0].cfg
    assert cfg.bos_id is None
    assert cfg.pad_id is None
    assert (cfg.eos_id, cfg.mask_id, cfg.max_set_size) == (18, 19, 16)


def test_an_owt_bound_matches_the_authors_forward(owt_folder):
    """No BOS, no PAD: position 0 holds any token, comes first and is not scored."""
    folder, sd = owt_folder
    model = load_checkpoint(folder)[0].eval()
    x = torch.randint(0, 19, (2, 16), generator=gen(3))  # EOS (18) may fall anywhere
    want = authors_nll(sd, 2, x, sample_order(model.cfg, 2, gen(4)), 19)
    res = elbo(model, x, generator=gen(4))
    assert res.tokens_scored == 2 * 15
    scored = want[:, 1:].sum().item()  # slot 0 (BOS) is given, not scored
    assert res.nll == pytest.approx(scored, abs=1e-3)


def test_bpe_reads_crlf_merges(bpe, tmp_path):
    merges = tmp_path / "merges.txt"
    merges.write_text(TINY_MERGES.replace("\n", "\r\n"))
    crlf = Tokenizer.from_bpe(tmp_path / "vocab.json", merges)
    assert crlf.encode(" abc") == [13, 11]  # as with LF (test_bpe_encode_and_round_trip)


ONE_PIECE = json.dumps({"a": 0, "<|endoftext|>": 1})


@table(
    "vocab,merges,match",
    {
        "no-endoftext": ('{"a": 0}', "", "has no <\\|endoftext\\|>"),
        "gap-in-ids": ('{"a": 0, "<|endoftext|>": 2}', TINY_MERGES, "ids must be 0..n-1"),
        "a-list": ("[1, 2]", TINY_MERGES, "ids must be 0..n-1"),
        "not-json": ("{not json", TINY_MERGES, "not JSON"),
        "three-pieces": (ONE_PIECE, "a b c\n", "not two pieces"),
        "unknown-result": (ONE_PIECE, "a a\n", "merge 'a a' is not two pieces"),
        "no-merges": (BPE_VOCAB, "#version: 0.2\n", "merges.txt: no merge makes 6 of the pieces"),
        "a-merge-cut": (BPE_VOCAB, TINY_MERGES[:-4], r"no merge makes 1 of the pieces .*\['Ã©'\]"),
    },
)
def test_from_bpe_refuses_bad_files(tmp_path, vocab, merges, match):
    with pytest.raises(ValueError, match=match):
        write_bpe(tmp_path, vocab, merges)


SPEC_TEXTS = {
    "bytes": "Hello, 日本!",
    "wordpiece": "Hello, unaffable [MASK] 日本!",
    "bpe": " abc a's 11",
}


@pytest.mark.parametrize("kind", SPEC_TEXTS)
def test_tokenizer_spec_round_trips(tokenizers, kind):
    t = tokenizers[kind]
    t2 = Tokenizer.from_spec(json.loads(json.dumps(t.spec())))
    assert t2.spec() == t.spec()
    assert t2.mask_id == t.mask_id
    assert t2.encode(SPEC_TEXTS[kind]) == t.encode(SPEC_TEXTS[kind])


WP = {"kind": "wordpiece"}


@table(
    "spec",
    {
        "none": None,
        "a-string": "bytes",
        "empty": {},
        "unknown-kind": {"kind": "x"},
        "no-vocab": WP,
        "vocab-not-a-list": WP | {"vocab": "?"},
        "vocab-without-specials": WP | {"vocab": ["x"]},
        "vocab-a-number": WP | {"vocab": -7},
        "merges-not-pairs": {"kind": "bpe", "vocab": ["<|endoftext|>"], "merges": [[[]]]},
    },
)
def test_from_spec_refuses_a_bad_spec(spec):
    with pytest.raises(ValueError):
        Tokenizer.from_spec(spec)


@table(
    "text,ids",
    {
        "merge-rank-wins": ("abc", [0, 11]),  # b c (rank 0) before a b; else [12, 2]
        "one-merge": ("ab", [12]),
        "leading-space": (" abc", [13, 11]),  # Ġ: bc first, then Ġa
        "contraction": ("a's", [0, 14]),  # the 's contraction is a pre-token
        "contraction-case": ("a'S", [0, 3, 5]),  # contractions are case-sensitive
        "digit-run": ("1112", [15, 6, 7]),  # one pre-token; 1 1 merges left to right
        "every-occurrence": ("11112", [15, 15, 7]),  # every occurrence merges in one pass
        "letters-digits-split": ("a1", [0, 6]),
        "utf-8-bytes": ("é", [16]),  # bytes C3 A9
        "letter-then-accent": ("aé", [0, 16]),
        "spaces": ("a  b", [0, 8, 8, 1]),  # \s+(?!\S) leaves the last space to the word
        "newline": ("a\n", [0, 17]),
        "endoftext": ("a<|endoftext|>b", [0, 18, 1]),  # the special string is matched first
    },
)
def test_bpe_encode_and_round_trip(bpe, text, ids):
    assert bpe.encode(text) == ids
    assert bpe.decode(ids) == text


def test_bpe_of_a_20000_letter_word_is_not_quadratic():
    """~2,600 merges that rebuild 400 random 16-letter words by halves; a word of their tails.
    A scan of the word per rank takes seconds."""
    rng = random.Random(0)
    words = ["".join(rng.choices("abcdefgh", k=16)) for _ in range(400)]
    merges = []
    for h in (1, 2, 4, 8):
        for w in words:
            merges += [(w[i : i + h], w[i + h : i + 2 * h]) for i in range(0, 16, 2 * h)]
    merges = list(dict.fromkeys(merges))
    pieces = list("abcdefgh") + ["".join(m) for m in merges] + ["<|endoftext|>"]
    tok = Tokenizer("bpe", pieces, merges)
    tok.encode("a")  # the pre-tokenizer's pattern is built on first use
    word = "".join(rng.choice(words)[rng.randrange(16) :] for _ in range(2500))
    start = time.perf_counter()
    tok.encode(word[:20000])
    assert time.perf_counter() - start < 1.5


def test_the_word_memo_is_bounded(bpe, monkeypatch):
    monkeypatch.setattr(setdiff, "WORD_MEMO", 10)
    tok = Tokenizer.from_spec(bpe.spec())
    tok.encode(" ".join(f"{n:b}".replace("0", "2") for n in range(100)))  # 100 words
    assert tok.word_ids.cache_info().currsize == 10


# ---- text -> rows: the LM1B detokenizer, line ids, row wrapping ----------------------------
BOS = BYTES.bos_id
EOS = BYTES.eos_id
PAD = BYTES.pad_id


@table(
    "text,expected",
    {  # worked out by hand from MDLM's rules, in their order
        "period-joins-a-word": ("a . b . c .", "a . b. c."),  # the first "a" has no space
        "period-after-no-word": ("( approx ) .", "(approx) ."),  # ")" is no word: " ." stays
        "quote-then-no-word": ("I ' m", "I ' m"),  # "' m" is no word after the quote
        "url": ("see http : / / x.org now", "see http://x.org now"),
        "quotes-and-marks": ('he said , " yes " ; then left !', 'he said, "yes"; then left!'),
        "contraction-and-dollar": ("it 's 5 $ 3 ? no", "it's 5 $3? no"),
        "question-at-the-end": ("what ?", "what?"),
        "brackets-colon-slash": ("[ note ] x : y / z", "[note] x: y/z"),
        "pound": ("costs £ 5 .", "costs £5."),
        "single-quotes": ("so ' quoted ' words", "so 'quoted' words"),
    },
)
def test_lm1b_detokenize_by_hand(text, expected):
    assert setdiff.lm1b_detokenize(text) == expected


def ids_of(pieces):
    """WordPiece ids by hand: a piece's id is its line in VOCAB."""
    return [VOCAB.index(piece) for piece in pieces.split()]


def test_document_ids_detokenize_a_wordpiece_line(tmp_path):
    tok = Tokenizer.from_vocab(write_vocab(tmp_path / "vocab.txt"))
    # "£ 5" detokenized is "£5": "£" is no BERT punctuation, so "5" continues the word (##5)
    assert setdiff.document_ids(tok, "It costs £ 5 .") == ids_of("it costs £ ##5 . [CLS]")
    assert tok.encode("It costs £ 5 .") == ids_of("it costs £ 5 .")  # encode does not


def test_document_ids_keep_a_byte_line_as_it_is():
    assert setdiff.document_ids(BYTES, "a , b") == [*b"a , b", EOS]


B_, E_ = 1000, 1001  # BOS and EOS of the wrap_rows cases


SENTENCES = [1, 2, E_, 3, 4, 5, E_, 6, E_, 7, 8, 9, 10, E_]  # each + EOS ($)
WRAPPED = [[B_, 1, 2, E_, 3, E_], [B_, 4, 5, E_, 6, E_], [B_, E_, 7, 8, 9, E_]]  # 12$3 45$6 $789
CLS_ROWS = [[101, 5, 6, 101], [101, 101, 7, 101], [101, 101, 8, 101]]  # 5 6 | $ 7 | $ 8
PLAIN_ROWS = [[1, 2, 3], [4, 5, 6]]  # no BOS, no EOS: chunks of L


@table(
    "stream,seq_len,bos,eos,rows,left",
    {
        "bos-chunk-eos": (SENTENCES, 6, B_, E_, WRAPPED, [10, E_]),  # chunks of L - 2 = 4
        "short-stream": ([1, 2], 6, B_, E_, [], [1, 2]),
        "cls-as-bos-and-eos": ([5, 6, 101, 7, 101, 8], 4, 101, 101, CLS_ROWS, []),
        "no-bos-plain-chunks": ([1, 2, 3, 4, 5, 6, 7], 3, None, 9, PLAIN_ROWS, [7]),
    },
)
def test_wrap_rows(stream, seq_len, bos, eos, rows, left):
    wrapped, rest = setdiff.wrap_rows(stream, seq_len, bos, eos)
    assert wrapped.dtype == np.uint16
    assert wrapped.tolist() == rows
    assert rest.tolist() == left


# ---- train_small.py: prepared rows ---------------------------------------------------------
SHAPE = "--n-layer 1 --n-head 2 --d-model 32 --seq-len 32".split()
TRAIN = "--batch-size 8 --lr 3e-3 --warmup-steps 4 --eval-rows 8 --workers 1 --log-every 4"
# float32 on every CPU (--dtype auto picks bf16 for training where the CPU has it natively)
TRAIN = (TRAIN + " --val-fraction 0.1 --dtype float32 --threads 1").split()


def side(line, fraction):
    """The split of a line (bytes) by its content hash, as the data pipeline defines it."""
    digest = hashlib.blake2b(line, digest_size=8).digest()
    h = int.from_bytes(digest, "little")
    return "val" if h < fraction * 2**64 else "train"


def sides(lines, fraction=0.5):
    return [side(line.encode(), fraction) for line in lines]


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def write_corpus(path, lines=600, seed=0):
    """Short sentences that a tiny model learns in a few steps."""
    rng = random.Random(seed)
    words = "the cat sat on a mat and a dog ran to the big red house under blue sky".split()
    text = ""
    for _ in range(lines):
        n = rng.randint(4, 10)
        sentence = " ".join(rng.choice(words) for _ in range(n))
        text += sentence.capitalize() + ".\n"
    path.write_text(text)
    return path


def prepare(path, tok, L, fraction=0.5):
    """train_small's rows of one text file -> (rows, meta); the cache beside the file."""
    cache = path.parent / "c"
    return train_small.prepare_rows([path], tok, L, cache, fraction)


def rows_meta(cache):
    """meta.json of the one row folder in `cache`."""
    path = next(Path(cache).glob("rows-*/meta.json"))
    return json.loads(path.read_text())


@pytest.fixture
def byte_rows(tmp_path):
    """Rows of L=6 of 6 lines (a blank one, CRLF, spaces), half held out -> (rows, meta)."""
    f = tmp_path / "t.txt"
    f.write_bytes(b"ab\n\ncde\r\n  f  \nklm\nghij\nrs\n")
    lines = ["ab", "cde", "f", "ghij", "klm", "rs"]
    assert sides(lines) == ["train"] * 4 + ["val"] * 2
    return prepare(f, BYTES, 6)


def test_prepared_byte_rows_are_bos_chunk_eos(byte_rows):
    """EOS after each line (a blank one is no sentence; CRLF and spaces go), [BOS] + L-2 tokens
    + [EOS], a stream per side: train a b $ c d e $ f $ g h i j $, val k l m $ r s $."""
    rows, _ = byte_rows
    assert rows["train"].tolist() == [
        [BOS, *b"ab", EOS, *b"c", EOS],
        [BOS, *b"de", EOS, *b"f", EOS],
        [BOS, EOS, *b"ghi", EOS],  # [j $] left over
    ]
    assert rows["val"].tolist() == [[BOS, *b"klm", EOS, EOS]]  # [r s $] left over
    assert rows["train"].dtype == np.uint16


def test_prepared_rows_count_rows_documents_tokens_and_bytes(byte_rows):
    _, meta = byte_rows
    train = {"rows": 3, "documents": 4, "tokens": 14, "text_bytes": 14}
    val = {"rows": 1, "documents": 2, "tokens": 7, "text_bytes": 7}
    assert meta["splits"] == {"train": train, "val": val}


def test_prepared_wordpiece_rows_are_cls_chunk_cls(tmp_path):
    """The authors' LM1B rows: [CLS] + L-2 + [CLS], [CLS] also after every sentence."""
    tok = Tokenizer.from_vocab(write_vocab(tmp_path / "vocab.txt"))
    lines = ["the cat sat .", "a cat ran .", "the cat , the dog .", "the dog ran ."]
    assert sides(lines) == ["val", "train", "train", "val"]
    rows, _ = prepare(write_lines(tmp_path / "lm1b.txt", lines), tok, 6)
    # train: a cat ran . [CLS] the cat , the dog . [CLS] -> 3 rows of 4, nothing left over
    train = ["a cat ran .", "[CLS] the cat ,", "the dog . [CLS]"]
    assert rows["train"].tolist() == [ids_of(f"[CLS] {r} [CLS]") for r in train]
    # val: the cat sat . [CLS] the dog ran . [CLS] -> 2 rows, [. [CLS]] left over
    val = ["the cat sat .", "[CLS] the dog ran"]
    assert rows["val"].tolist() == [ids_of(f"[CLS] {r} [CLS]") for r in val]


@pytest.fixture
def gpt2_vocab(tmp_path):
    vocab = {"a": 0, "b": 1, "Ġ": 2, "ab": 3, "Ġab": 4, "<|endoftext|>": 5}  # Ġ: a space
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\nĠ ab\n")
    return str(tmp_path / "vocab.json")


def test_a_gpt2_tokenizer_has_eos_and_mask_only(gpt2_vocab):
    tok = train_small.load_tokenizer(gpt2_vocab)
    assert tok.kind == "bpe"
    assert (tok.bos_id, tok.eos_id, tok.mask_id) == (None, 5, 6)


@table("chunk_bytes", {"one-chunk": 1 << 20, "a-chunk-a-document": 1})
def test_prepared_gpt2_rows_are_documents_in_plain_chunks(bpe, tmp_path, monkeypatch, chunk_bytes):
    """An <|endoftext|> line ends a document; its newlines and indentation are text: TINY_BPE's
    ids ab 12, Ċ 17, Ġ 8, c 2, b 1, a 0, EOS 18 only after a document. L = 3."""
    monkeypatch.setattr(train_small, "CHUNK_BYTES", chunk_bytes)
    docs = ["ab\n\n c", "ba"]
    assert sides(docs) == ["train", "val"]
    path = tmp_path / "owt.txt"
    path.write_text(f"{docs[0]}\n<|endoftext|>\n{docs[1]}\n")
    rows, _ = prepare(path, bpe, 3)
    assert rows["train"].tolist() == [[12, 17, 17], [8, 2, 18]]
    assert rows["val"].tolist() == [[1, 0, 18]]


LONG_LINE = b"x" * 300_000  # a long line stays whole
GOOD_LINES = [b"ok one", LONG_LINE, b"ok two", b"klm", b"rs"]


@pytest.fixture
def mixed_rows(tmp_path):
    """Rows of L=8 of GOOD_LINES and two bad lines: not UTF-8, a NUL byte -> (rows, meta)."""
    bad = b"\xff\xfe broken\nnul \x00 byte\n"
    data = b"ok one\r\n" + bad + LONG_LINE + b"\nok two\nklm\nrs\n"
    (tmp_path / "bad.txt").write_bytes(data)
    return prepare(tmp_path / "bad.txt", BYTES, 8)


@pytest.mark.parametrize("part", ["train", "val"])
def test_prepared_rows_skip_bad_lines(mixed_rows, part):
    rows, _ = mixed_rows
    kept = [line for line in GOOD_LINES if side(line, 0.5) == part]
    text = b"".join(line + b"\n" for line in kept)
    stream = np.frombuffer(text, np.uint8).astype(np.uint16)
    stream = np.where(stream == ord("\n"), EOS, stream)
    n = len(stream) // 6
    body = stream[: n * 6].reshape(n, 6)
    got = np.asarray(rows[part])
    np.testing.assert_array_equal(got[:, 1:-1], body)


def test_prepared_rows_count_the_bad_lines(mixed_rows):
    _, meta = mixed_rows
    assert meta["bad_lines"] == 2
    lines = [meta["splits"][part]["documents"] for part in ("train", "val")]
    assert sum(lines) == len(GOOD_LINES)


@pytest.fixture(scope="module")
def big_rows(tmp_path_factory):
    """Rows of L=32 of a 3,000-line corpus, 10% held out -> (corpus, rows, meta)."""
    d = tmp_path_factory.mktemp("rows")
    corpus = write_corpus(d / "corpus.txt", lines=3000)
    rows, meta = prepare(corpus, BYTES, 32, 0.1)
    return corpus, rows, meta


@pytest.mark.parametrize("part", ["train", "val"])
def test_lines_are_held_out_by_their_hash_in_order(big_rows, part):
    """Each side's rows are its lines in file order, [BOS] ... [EOS], the tail cut."""
    corpus, rows, meta = big_rows
    lines = corpus.read_bytes().splitlines()
    expected = [line for line in lines if side(line, 0.1) == part]
    r = np.asarray(rows[part])
    assert (r[:, 0] == BOS).all()
    assert (r[:, -1] == EOS).all()
    body = r[:, 1:-1]
    body = np.where(body == EOS, ord("\n"), body)
    stream = bytes(body.astype(np.uint8).ravel())
    text = b"".join(line + b"\n" for line in expected)
    assert text.startswith(stream)
    assert len(text) - len(stream) < 30
    assert meta["splits"][part]["documents"] == len(expected)


def test_workers_give_the_rows_of_one_process(big_rows, tmp_path, monkeypatch):
    corpus, rows, _ = big_rows
    monkeypatch.setattr(train_small, "CHUNK_BYTES", 4096)  # ~30 chunks over 2 spawned workers
    get_context = mock.Mock(wraps=train_small.multiprocessing.get_context)
    monkeypatch.setattr(train_small.multiprocessing, "get_context", get_context)
    parallel, _ = train_small.prepare_rows([corpus], BYTES, 32, tmp_path, 0.1, 2, False)
    assert get_context.call_args_list == [mock.call("spawn")]  # the workers started
    for part in ("train", "val"):
        assert len(rows[part]) > 10
        np.testing.assert_array_equal(rows[part], parallel[part])


def test_the_row_cache_is_reused(big_rows, capsys):
    corpus, rows, meta = big_rows
    built = Path(rows["train"].filename)
    stamp = built.stat().st_mtime_ns
    capsys.readouterr()
    assert prepare(corpus, BYTES, 32, 0.1)[1] == meta
    assert "reusing" in capsys.readouterr().out
    assert built.stat().st_mtime_ns == stamp


def test_the_row_cache_is_rebuilt_when_the_text_changes(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus.txt")
    meta = prepare(corpus, BYTES, 32, 0.1)[1]
    new_line = "A brand new sentence that was not there before."
    with open(corpus, "a") as f:
        f.write(f"{new_line}\n" * 20)
    capsys.readouterr()
    rebuilt = prepare(corpus, BYTES, 32, 0.1)[1]
    assert "reusing" not in capsys.readouterr().out
    new = 20 * sides([new_line], 0.1).count("train")
    lines = meta["splits"]["train"]["documents"]
    assert rebuilt["splits"]["train"]["documents"] == lines + new
    assert rebuilt["sources"][0]["size"] == corpus.stat().st_size
    assert not list(tmp_path.rglob("*.tmp-*"))


MODULE_A = '''"""The first module has a sentence that is long enough. Too short.
Parameters
----------
x : int
    An indented description that is never kept in the corpus.

>>> f(1)  # a doctest line is dropped as well, whatever it says.
"""
class C:
    """Returns a :class:`Tensor` with ``x`` values in every row. Calls f(x) in its code here.

    Uses numpy.sum inside a sentence that is otherwise fine."""'''
MODULE_C = '''def f():
    """The first module has a sentence that is long enough."""
def g():
    """A third file adds one more sentence of plain prose."""
'''


@pytest.fixture
def docs(tmp_path):
    """A package of docstrings: prose, code-like sentences, a test folder, a broken file."""
    pkg = tmp_path / "pkg"
    (pkg / "tests").mkdir(parents=True)  # test folders are skipped
    (pkg / "tests" / "t.py").write_text('"""Tests are skipped entirely by the walk."""')
    (pkg / "b.py").write_text('"""A file that does not parse is skipped."""\nprint "x"')
    (pkg / "c.py").write_text(MODULE_C)
    (pkg / "a.py").write_text(MODULE_A)
    return pkg


def test_builtin_corpus_keeps_the_prose_sentences_once(docs, tmp_path):
    corpus = train_small.builtin_corpus(tmp_path, roots=[docs])
    assert corpus.read_text().splitlines() == [
        "The first module has a sentence that is long enough.",
        "Returns a Tensor with x values in every row.",
        "A third file adds one more sentence of plain prose.",
    ]


def test_builtin_corpus_is_deterministic_and_named_by_the_versions(docs, tmp_path):
    a = train_small.builtin_corpus(tmp_path, roots=[docs])
    assert np.__version__ in a.name
    assert torch.__version__ in a.name
    b = train_small.builtin_corpus(tmp_path, roots=[docs], out=tmp_path / "b.txt")
    assert b.read_bytes() == a.read_bytes()


# ---- train_small.py: runs ------------------------------------------------------------------
def run_argv(folder, out="run", *extra, shape=SHAPE, train=TRAIN):
    """A run in folder/out on folder/corpus.txt, the row cache in folder/cache."""
    data = ["--data", str(folder / "corpus.txt")]
    cache = ["--cache-dir", str(folder / "cache")]
    return [*data, *cache, "--out", str(folder / out), *shape, *train, *extra]


def resume_argv(folder, out, steps):
    cache = ["--cache-dir", str(folder / "cache")]
    out = ["--out", str(folder / out)]
    return ["--resume", *out, *cache, "--max-steps", str(steps)]


def logged(out, kind):
    lines = (out / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return [r for r in records if r["kind"] == kind]


def losses(out):
    return [r["loss"] for r in logged(out, "train")]


def ckpt_of(out, name="ckpt.pt"):
    return load_checkpoint(out / name)[2]


def python(*argv, **kw):
    """`python argv...` in the repository, its output captured."""
    cmd = [sys.executable, *argv]
    kw = {"timeout": 300} | kw
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, **kw)


def same_weights(a, b):
    same = [torch.equal(a[k], b[k]) for k in a]
    return a.keys() == b.keys() and all(same)


def close_weights(a, b, atol):
    close = [torch.allclose(a[k], b[k], atol=atol) for k in a]
    return a.keys() == b.keys() and all(close)


def same_run(a, b):
    """Two checkpoints hold the same raw and the same EMA weights."""
    raw = same_weights(a["train_model"], b["train_model"])
    return raw and same_weights(a["model"], b["model"])


def train_ok(argv):
    assert train_small.main(argv) == 0


def train_refused(capsys, argv, needle):
    """train_small.py exits with 2 and ONE line 'error: ...' (progress bars aside) that says
    `needle`, no traceback -> stderr."""
    assert train_small.main(argv) == 2
    err = capsys.readouterr().err
    lines = err.replace("\r", "\n").splitlines()
    assert "Traceback" not in err, err
    errors = [line for line in lines if line.startswith("error")]
    assert len(errors) == 1 and needle in errors[0], err
    others = [line for line in lines if line not in errors]
    assert all("%|" in line or not line.strip() for line in others), err
    return err


EVERY_8 = ["--eval-every", "8", "--max-steps"]


@pytest.fixture(scope="module")
def train_dir(tmp_path_factory):
    """A corpus and its row cache, shared by the runs of this module."""
    d = tmp_path_factory.mktemp("train")
    write_corpus(d / "corpus.txt")
    return d


@pytest.fixture(scope="module")
def run4(train_dir):
    """A 4-step run, validated at 4 -> its folder."""
    argv = run_argv(train_dir, "run", "--max-steps", "4", "--eval-every", "4")
    train_ok(argv)
    return train_dir / "run"


@pytest.fixture(scope="module")
def straight(train_dir):
    """A 16-step run, validated at 8 and 16 -> its folder."""
    train_ok(run_argv(train_dir, "straight", *EVERY_8, "16"))
    return train_dir / "straight"


def test_a_run_learns(straight):
    loss = losses(straight)
    assert len(loss) == 4
    assert loss[-1] < loss[0] - 0.5


def test_a_run_validates_every_eval_every_steps_on_its_bytes(straight):
    val = logged(straight, "val")
    assert [v["step"] for v in val] == [8, 16]
    assert all(v["bytes"] == v["num_seqs"] * 30 for v in val)  # L - 2 bytes a row


def test_a_checkpoint_records_the_run(straight):
    ref = ckpt_of(straight)
    assert ref["step"] == 16
    assert ref["tokens"] == 16 * 8 * 32
    assert ref["args"]["n_layer"] == 1
    assert ref["val_rows"]["bytes_per_token"] == 1.0


def recorded_rows(val_rows, L):
    """The validation rows a checkpoint records: uint16 (n, L) on disk."""
    rows = np.memmap(val_rows["path"], np.uint16, "r")
    return rows.reshape(-1, L)


def test_a_checkpoint_points_at_its_validation_rows(straight):
    val_rows = ckpt_of(straight)["val_rows"]
    rows = recorded_rows(val_rows, 32)
    assert len(rows) == val_rows["rows"]
    assert (rows[:, 0] == BOS).all()


def test_best_pt_holds_no_optimizer(straight):
    assert "optimizer" not in ckpt_of(straight, "best.pt")


@pytest.mark.parametrize("name", ["ckpt.pt", "best.pt"])
def test_plain_torch_load_opens_a_runs_checkpoint(straight, name):
    """nanoGPT's convention: a dict that torch.load(weights_only=True) opens, no setdiff."""
    ckpt = torch.load(straight / name, weights_only=True)
    model, tok, _ = load_checkpoint(straight / name)
    assert setdiff.Config(**ckpt["config"]) == model.cfg
    assert ckpt["tokenizer"] == tok.spec()
    for key, w in model.state_dict().items():
        assert torch.equal(ckpt["model"][key], w)


@pytest.fixture(scope="module")
def split_output(train_dir):
    """Run "split": 8 steps, then resumed to 16 -> what the resumed run printed."""
    train_ok(run_argv(train_dir, "split", *EVERY_8, "8"))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train_ok(resume_argv(train_dir, "split", 16))
    return out.getvalue()


@pytest.fixture
def deterministic(monkeypatch):
    """CUDA's deterministic kernels (its fastest ones may sum in any order), as a user who needs
    repeatable GPU runs turns them on; nothing changes on a CPU."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


@on_devices
def test_a_resumed_run_ends_with_the_uninterrupted_weights(train_dir, device, deterministic):
    """6 steps, and 3 resumed to 6, on one device: the same raw and EMA weights."""
    flags = ["--device", device, "--eval-every", "3", "--max-steps"]
    train_ok(run_argv(train_dir, f"whole-{device}", *flags, "6"))
    train_ok(run_argv(train_dir, f"half-{device}", *flags, "3"))
    train_ok(resume_argv(train_dir, f"half-{device}", 6))
    whole = ckpt_of(train_dir / f"whole-{device}")
    assert same_run(whole, ckpt_of(train_dir / f"half-{device}"))


def test_a_resumed_run_keeps_its_threads(split_output):
    assert "; 1 thread (" in split_output  # the run's --threads 1, not the default


def test_a_resumed_run_logs_each_step_once(train_dir, straight, split_output):
    assert losses(train_dir / "split") == losses(straight)


SIGNALS = [signal.SIGINT, signal.SIGTERM]


@pytest.fixture(scope="module", params=SIGNALS, ids=["INT", "TERM"])
def stopped(request, train_dir):
    """A 16-step run that a real signal hits in the middle of step 5 -> what it did."""
    sig = request.param
    real = train_small.train_step
    sent = []

    def signal_in_step_5(run, step):
        if step == 5 and not sent:
            sent.append(os.kill(os.getpid(), sig))
        return real(run, step)

    handler = signal.getsignal(sig)
    out = train_dir / f"cut-{sig.name}"
    argv = run_argv(train_dir, out.name, *EVERY_8, "16")
    err = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stderr(err):
        mp.setattr(train_small, "train_step", signal_in_step_5)
        code = train_small.main(argv)
    stopped = dict(sig=sig, code=code, out=out)
    stopped["err"] = err.getvalue()
    stopped["step"] = ckpt_of(out)["step"]
    stopped["restored"] = signal.getsignal(sig) == handler
    return stopped


def test_a_signal_stops_the_run_after_its_step_with_exit_130(stopped):
    assert stopped["code"] == 130
    assert f"interrupted ({stopped['sig'].name}) at step 6" in stopped["err"]
    assert stopped["step"] == 6


def test_a_signal_handler_is_restored_after_the_run(stopped):
    assert stopped["restored"]


def test_a_run_stopped_by_a_signal_resumes_exactly(stopped, straight, train_dir):
    argv = resume_argv(train_dir, stopped["out"].name, 16)
    train_ok(argv)
    assert same_run(ckpt_of(straight), ckpt_of(stopped["out"]))


def init_argv(train_dir, run4, out, *extra, shape=()):
    """A fine-tune of run4, validated every 4 steps; no shape flags unless given."""
    init = ["--init-from", str(run4 / "ckpt.pt"), "--eval-every", "4"]
    return run_argv(train_dir, out, *init, *extra, shape=list(shape))


def test_init_from_takes_the_source_config_and_weights(train_dir, run4):
    """No shape flags: the cpu preset's 4 x 256 would apply, but the source's 1 x 32 wins."""
    src = ckpt_of(run4)
    train_ok(init_argv(train_dir, run4, "ft0", "--max-steps", "1", "--lr", "0"))
    ft = ckpt_of(train_dir / "ft0")
    assert ft["step"] == 1
    assert ft["config"] == src["config"] | {"dropout": 0.0}
    assert same_weights(ft["train_model"], src["model"])  # lr 0: the source's (EMA) weights
    assert same_weights(ft["model"], src["model"])  # and the EMA starts from them


def test_init_from_accepts_a_shape_flag_equal_to_the_source(train_dir, run4):
    flags = ["--max-steps", "1", "--n-layer", "1"]
    train_ok(init_argv(train_dir, run4, "ft1", *flags, shape=SHAPE))


def test_init_from_refuses_a_shape_flag_that_disagrees(train_dir, run4, capsys):
    flags = ["--max-steps", "1", "--n-layer", "2"]
    argv = init_argv(train_dir, run4, "ft2", *flags, shape=SHAPE)
    train_refused(capsys, argv, "--n-layer 2 disagrees with the --init-from model's 1")


def test_a_resumed_fine_tune_equals_the_uninterrupted_one(train_dir, run4):
    train_ok(init_argv(train_dir, run4, "ft8", "--max-steps", "8"))
    train_ok(init_argv(train_dir, run4, "ft4", "--max-steps", "4"))
    train_ok(resume_argv(train_dir, "ft4", 8))
    a = ckpt_of(train_dir / "ft8")
    b = ckpt_of(train_dir / "ft4")
    assert a["step"] == b["step"] == 8
    assert not same_weights(a["train_model"], ckpt_of(run4)["model"])  # it trained
    assert same_run(a, b)


def training_run(folder, out, *flags):
    """train_small's run of run_argv's flags, set up, no step taken."""
    args, given = train_small.parse_args(run_argv(folder, out, *flags))
    return train_small.setup(args, given)


@on_devices
def test_a_training_step_reads_nothing_from_the_device(train_dir, device):
    """The loop reads each step's loss (and the signals) once; the step itself reads nothing,
    so a GPU never waits for the host. AdamW fused, as train_small makes it on a GPU."""
    run = training_run(train_dir, f"reads-{device}", "--device", device)
    run.opt = torch.optim.AdamW(run.model.parameters(), fused=True)
    train_small.train_step(run, 0)  # first uses: the caching allocators fill
    with host_reads(device) as reads:
        train_small.train_step(run, 1)
    assert reads == []


@on_devices
def test_a_compiled_training_step_compiles_once(train_dir, device, monkeypatch):
    """A backend that counts the graphs dynamo gives it: the first step's, then none."""
    graphs = []

    def counting(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=counting))
    torch._dynamo.reset()
    run = training_run(train_dir, f"compiled-once-{device}", "--device", device, "--compile")
    train_small.train_step(run, 0)
    first = len(graphs)
    for step in (1, 2, 3):
        train_small.train_step(run, step)
    assert first > 0
    assert len(graphs) == first


def test_compile_compiles_the_loss_and_keeps_the_weights(train_dir, run4, monkeypatch):
    """--compile with dynamo's eager backend (inductor takes a minute on a CPU)."""
    eager = functools.partial(torch.compile, backend="eager")
    compile_eagerly = mock.Mock(wraps=eager)
    monkeypatch.setattr(torch, "compile", compile_eagerly)
    flags = ["--max-steps", "4", "--eval-every", "4", "--compile"]
    train_ok(run_argv(train_dir, "compiled", *flags))
    calls = compile_eagerly.call_args_list
    compiled_modules = [type(call.args[0]).__name__ for call in calls]
    assert compiled_modules == ["TrainStep"]  # the loss, as DDP and compile see it
    plain = ckpt_of(run4)["train_model"]
    compiled = ckpt_of(train_dir / "compiled")["train_model"]
    assert close_weights(plain, compiled, 1e-6)


def copy_of(run4, name):
    """A copy of run4's folder beside it (its cache folder is the same)."""
    return Path(shutil.copytree(run4, run4.parent / name))


def test_resume_refuses_a_changed_flag(train_dir, run4, capsys):
    copy_of(run4, "changed")
    argv = resume_argv(train_dir, "changed", 8)
    train_refused(capsys, [*argv, "--n-layer", "2"], "--n-layer 2 differs from the resumed run's 1")


def test_resume_drops_log_records_after_the_checkpoint(train_dir, run4):
    out = copy_of(run4, "late-records")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "kind": "train"}\n{"step": 1')  # after the checkpoint; cut off
    train_ok([*resume_argv(train_dir, "late-records", 6), "--log-every", "2"])
    assert [m["step"] for m in logged(out, "train")] == [4, 6]


def test_a_full_disk_keeps_the_last_checkpoint(train_dir, run4, monkeypatch, capsys):
    out = copy_of(run4, "full-disk")
    before = (out / "ckpt.pt").read_bytes()
    monkeypatch.setattr(setdiff, "open", full_disk, raising=False)
    train_refused(capsys, resume_argv(train_dir, "full-disk", 8), "the disk is full")
    assert (out / "ckpt.pt").read_bytes() == before
    names = sorted(p.name for p in out.iterdir())
    assert names == ["best.pt", "ckpt.pt", "metrics.jsonl"]


def test_a_nonfinite_loss_stops_the_run_and_keeps_ckpt_pt(train_dir, run4, monkeypatch, capsys):
    out = copy_of(run4, "diverged")
    before = (out / "ckpt.pt").read_bytes()
    real = train_small.train_step

    def nan_at_step_6(run, step):
        return real(run, step) * (math.nan if step == 5 else 1)

    monkeypatch.setattr(train_small, "train_step", nan_at_step_6)
    argv = resume_argv(train_dir, "diverged", 8)
    train_refused(capsys, argv, "step 6: the loss is nan: the run diverged; lower --lr")
    assert (out / "ckpt.pt").read_bytes() == before


def test_a_nonfinite_bound_stops_the_run_before_saving(train_dir, monkeypatch, capsys):
    real = setdiff.elbo

    def nan_bound(*args):
        res = real(*args)
        res.nll_per_token = math.nan
        return res

    monkeypatch.setattr(setdiff, "elbo", nan_bound)
    argv = run_argv(train_dir, "nan-bound", "--max-steps", "4", "--eval-every", "4")
    train_refused(capsys, argv, "step 4: the bound is nan: diverged; lower --lr")
    assert not list((train_dir / "nan-bound").glob("*.pt"))


def test_resume_refuses_a_damaged_ckpt_pt_and_keeps_it(train_dir, run4, capsys):
    ckpt = copy_of(run4, "damaged") / "ckpt.pt"
    data = bytearray(ckpt.read_bytes())
    data[20000:24096] = random.Random(0).randbytes(4096)  # 4 KB of garbage inside it
    ckpt.write_bytes(data)
    train_refused(capsys, resume_argv(train_dir, "damaged", 8), f"{ckpt} is not a readable")
    assert ckpt.read_bytes() == data


def test_force_removes_the_old_checkpoints_at_once(train_dir, run4, monkeypatch):
    out = copy_of(run4, "forced")
    broken_step = mock.Mock(side_effect=OSError("the disk went away"))
    monkeypatch.setattr(train_small, "train_step", broken_step)
    assert train_small.main(run_argv(train_dir, "forced", "--max-steps", "4", "--force")) == 2
    assert broken_step.called
    assert [p.name for p in out.iterdir()] == ["metrics.jsonl"]
    assert (out / "metrics.jsonl").read_text() == ""


@pytest.mark.parametrize("preset", ["lm1b", "lm1b-small"])
def test_the_lm1b_presets_validate_on_held_out_training_lines(preset):
    """The bug: the recipe validated on heldout-00000, the shard then reported as the test
    score. The presets hold out training lines instead."""
    args, _ = train_small.parse_args(["--preset", preset, "--tokenizer", "vocab.txt"])
    assert 0 < args.val_fraction <= 0.001


def test_no_flag_or_doc_points_at_a_heldout_shard():
    texts = train_small.build_parser().format_help() + train_small.__doc__
    assert "--val-data" not in texts
    assert "heldout-00000" not in texts


AUTHORS_NAMES = {  # setdiff's weight names -> the authors'
    "tok_emb.weight": "vocab_embed.embedding",
    ".ln1.": ".norm1.",
    ".ln2.": ".norm2.",
    ".attn.qkv.": ".attn_qkv.",
    ".attn.proj.": ".attn_out.",
    "ln_f.": "output_layer.norm_final.",
    "head.": "output_layer.linear.",
}


def write_released(folder, model, vocab):
    """A released folder of `model`: config.json, vocab.txt, the authors' weight names by hand."""
    cfg = model.cfg
    folder.mkdir()
    write_vocab(folder / "vocab.txt", vocab)
    shape = (cfg.vocab_size, cfg.seq_len, cfg.d_model, cfg.n_head, cfg.n_layer, cfg.set_size)
    spec = authors_config(*shape, cfg.mask_id)
    (folder / "config.json").write_text(json.dumps(spec))
    state = {}
    for name, tensor in model.state_dict().items():
        for ours, theirs in AUTHORS_NAMES.items():
            name = name.replace(ours, theirs)
        state["backbone." + name] = tensor
    torch.save(state, folder / "pytorch_model.bin")
    return folder


LM1B_LINES = [f"the {w} sat on a {v} ." for w in WORDS[:5] for v in WORDS[8:] for _ in range(3)]


@pytest.fixture(scope="module")
def released_ft(tmp_path_factory):
    """A fine-tune (1 step, lr 0) of a released folder on LM1B_LINES -> (its folder, model)."""
    d = tmp_path_factory.mktemp("released")
    specials = dict(mask_id=4, bos_id=2, eos_id=2, pad_id=0)  # [MASK]; [CLS] twice; [PAD]
    shape = dict(seq_len=16, n_layer=1, set_size=4)
    model = tiny_model(1, vocab_size=len(VOCAB), **shape, **specials)
    folder = write_released(d / "lm1b-setdlm-tiny", model, VOCAB)
    write_lines(d / "corpus.txt", LM1B_LINES)
    flags = ["--init-from", str(folder), "--max-steps", "1", "--lr", "0"]
    argv = run_argv(d, "ft", *flags, "--val-fraction", "0.3", shape=[])
    train_ok(argv)
    return d, model


def test_init_from_a_released_folder_sets_s_to_min_2d_l(released_ft):
    d, model = released_ft
    want = setdiff.asdict(model.cfg) | dict(max_set_size=8)  # although config.json says L
    assert ckpt_of(d / "ft")["config"] == want


def test_init_from_a_released_folder_takes_its_weights_and_vocab(released_ft):
    d, model = released_ft
    ft = ckpt_of(d / "ft")
    assert same_weights(ft["train_model"], model.state_dict())
    assert Tokenizer.from_spec(ft["tokenizer"]).pieces == VOCAB


def test_a_fine_tune_validates_on_held_out_training_lines(released_ft):
    d, _ = released_ft
    val_rows = ckpt_of(d / "ft")["val_rows"]
    rows = recorded_rows(val_rows, 16)
    assert (rows[:, 0] == 2).all()  # [CLS]
    assert (rows[:, -1] == 2).all()
    val_lines = sides(LM1B_LINES, 0.3).count("val")
    assert rows_meta(d / "cache")["splits"]["val"]["documents"] == val_lines > 0


SET_BY = "got 2 (set by --seq-len, --n-layer, --n-head, --d-model, --order"


@pytest.fixture
def bad_inputs(tmp_path, monkeypatch):
    """Files to name wrongly, and an older run in run/ -> the arguments of a run here."""
    monkeypatch.chdir(write_corpus(tmp_path / "corpus.txt").parent)
    (tmp_path / "empty.txt").write_text("\n  \n")
    (tmp_path / "blob.bin").write_bytes(bytes(range(128, 256)) * 40)  # no line is UTF-8
    (tmp_path / "small.txt").write_text("Only a few words.\n")
    (tmp_path / "vocab.txt").write_text("[PAD]\n[CLS]\n")
    (tmp_path / "vocab.json").write_text("{}")
    (tmp_path / "cache").mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "ckpt.pt").write_bytes(b"an older run")
    data = ["--data", "corpus.txt", "--cache-dir", "cache", "--out", "run"]
    return [*data, *SHAPE, *TRAIN, "--max-steps", "2"]


def assert_the_older_run_is_kept():
    assert os.listdir("run") == ["ckpt.pt"]
    assert Path("run/ckpt.pt").read_bytes() == b"an older run"
    assert not list(Path("cache").glob("rows-*"))  # a failed data build leaves no folder


@table(
    "flags,needle",
    {  # flags -> what the one error line says
        "missing-data": (["--data", "nope.txt"], "nope.txt: no such file"),
        "data-folder": (["--data", "cache"], "cache: no such file"),
        "empty-glob": (["--data", "nope-*.txt"], "nope-*.txt: no such file"),
        "empty-file": (["--data", "corpus.txt", "empty.txt"], "empty.txt holds no text"),
        "binary": (["--data", "blob.bin"], "not look like text"),
        "too-little-text": (["--data", "small.txt"], "too few for a row of --seq-len 32"),
        "not-bert-vocab": (["--tokenizer", "vocab.txt"], "not a BERT uncased model's vocab.txt"),
        "missing-vocab": (["--tokenizer", "none.txt"], "--tokenizer: none.txt does not exist"),
        "no-merges": (["--tokenizer", "vocab.json"], "merges.txt does not exist"),
        "missing-init": (["--init-from", "none.pt"], "--init-from: checkpoint"),
        "unknown-flag": (["--no-such"], "unrecognized"),
        "nothing-to-resume": (["--resume", "--out", "elsewhere"], "--resume: no checkpoint"),
        "set-size": (
            ["--set-size", "99"],
            "set size d must be in [1, L=32], got 99 (set by --seq-len",
        ),
        "max-set-size": (["--max-set-size", "2"], SET_BY),
        "d-model": (["--d-model", "33"], "d_model must be a multiple of n_head (set by"),
        "eval-every": (["--eval-every", "0"], "--eval-every: must be at least 1"),
        "val-fraction": (["--val-fraction", "1.5"], "--val-fraction"),
        "device": (["--device", "nonsense"], "--device 'nonsense'"),
        "cache-dir": (["--cache-dir", "corpus.txt"], "--cache-dir corpus.txt: "),
        "negative-lr": (["--lr", "-1"], "--lr: must be at least 0"),
        "max-set-size-of-block": (["--order", "block", "--max-set-size", "8"], "--max-set-size"),
        "threads-100000": (["--threads", "100000"], "--threads 100000: must be in [1, "),
        "seed-past-2-64": (["--seed", str(2**64)], "--seed: must be in [0, 18446744073709551616)"),
    },
)
def test_train_bad_input_is_one_line_and_exit_2(bad_inputs, capsys, flags, needle):
    train_refused(capsys, [*bad_inputs, "--force", *flags], needle)
    assert_the_older_run_is_kept()


def test_a_new_run_refuses_an_out_that_holds_a_run(bad_inputs, capsys):
    train_refused(capsys, bad_inputs, "already holds a run")
    assert_the_older_run_is_kept()


@table(
    "out,needle",
    {
        "a-file": ("file", "file is not a writable folder"),
        "under-a-file": ("file/run", "file is not a writable folder"),
        "read-only": ("locked/run", "locked is not a writable folder"),
    },
)
def test_a_bad_out_is_refused_before_the_data_work(tmp_path, monkeypatch, capsys, out, needle):
    write_corpus(tmp_path / "corpus.txt")
    (tmp_path / "file").write_text("not a folder")
    (tmp_path / "locked").mkdir()
    real_access = os.access

    def access(path, mode):  # a read-only folder (as root, chmod would not stop a write)
        return Path(path).name != "locked" and real_access(path, mode)

    monkeypatch.setattr(os, "access", access)
    argv = run_argv(tmp_path, out, "--max-steps", "1")
    err = train_refused(capsys, argv, f"--out {tmp_path / out}")
    assert needle in err
    assert not (tmp_path / "cache").exists()  # no data work was done
    assert list((tmp_path / "locked").iterdir()) == []


def test_ctrl_c_while_workers_tokenize_exits_130_and_leaves_no_rows(tmp_path):
    """Ctrl-C as a terminal sends it (SIGINT to the process group) while 2 workers tokenize."""
    write_lines(tmp_path / "corpus.txt", [f"line {i} of a corpus" for i in range(400_000)])
    cmd = [sys.executable, "train_small.py", *run_argv(tmp_path, "run", "--workers", "2")]
    # SIGINT at its default, as under a terminal (a shell's `&` job would pass it on ignored)
    default = functools.partial(signal.signal, signal.SIGINT, signal.SIG_DFL)
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=default
    )
    cache = tmp_path / "cache"
    while proc.poll() is None and not sum(f.stat().st_size for f in cache.glob("*/*.tmp-*")):
        time.sleep(0.05)  # until the workers' first rows are written
    os.killpg(proc.pid, signal.SIGINT)
    err = proc.communicate(timeout=60)[1]
    lines = err.replace("\r", "\n").splitlines()
    said = [line for line in lines if line.strip() and "%|" not in line]  # not the bars
    assert said == ["interrupted (outside the training steps: nothing new to save)"], err
    assert proc.returncode == 130
    assert not list(cache.glob("rows-*"))


def test_a_data_glob_reads_its_files_sorted(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.txt").read_text().splitlines(keepends=True)
    (tmp_path / "part-2.txt").write_text("".join(corpus[300:]))
    (tmp_path / "part-1.txt").write_text("".join(corpus[:300]))
    argv = run_argv(tmp_path, "glob", "--max-steps", "1")
    argv[1] = str(tmp_path / "part-*.txt")  # quoted: the glob itself, not the shell's
    train_ok(argv)
    assert ckpt_of(tmp_path / "glob")["args"]["data"] == argv[1:2]
    sources = rows_meta(tmp_path / "cache")["sources"]
    names = [Path(source["path"]).name for source in sources]
    assert names == ["part-1.txt", "part-2.txt"]


def test_threads_default_to_the_idle_cores_with_the_reason(train_dir, capsys):
    train_ok(run_argv(train_dir, "auto", "--max-steps", "1", train=TRAIN[:-2]))  # no --threads
    out = capsys.readouterr().out
    found = re.search(r"; (\d+) threads? \((\d+) cores, load (\d+) elsewhere", out)
    threads, cores, load = map(int, found.groups())
    assert cores == os.cpu_count()
    auto = max(1, cores - load)
    assert threads == torch.get_num_threads() == auto


MOST_THREADS = 4 * (os.cpu_count() or 1)  # 4 a core: a --threads runtime still takes


@table(
    "kw,said",
    {  # runtime's arguments, as the flags give them -> the reason its line gives
        "device": (dict(device="cpu"), "device: cpu (requested with --device); "),
        "dtype": (dict(device="cpu", dtype="bfloat16"), "; bfloat16 (requested with --dtype); "),
        "threads": (dict(threads=2), "; 2 threads (requested with --threads)"),
        "most-threads": (dict(threads=MOST_THREADS), f"; {MOST_THREADS} threads (requested"),
    },
)
def test_runtime_names_the_flag_behind_each_choice(kw, said):
    assert said in setdiff.runtime(**kw)[2]


def test_threads_flag_sets_the_count_that_every_bound_names(train_dir, capsys):
    """The device line, each validation and the best name it: it changes the rounding."""
    train_ok(run_argv(train_dir, "two", "--max-steps", "1", "--threads", "2"))
    out = capsys.readouterr().out
    assert "; 2 threads (requested with --threads)" in out
    assert torch.get_num_threads() == 2
    bounds = [x for x in out.splitlines() if "ppl <=" in x]
    assert len(bounds) == 2 and all("; threads: 2" in x for x in bounds)  # step 1, the best


PROGRESS = {  # train_small's flags -> the steps of its plain lines (validations at 3 and 6)
    "plain": ([], [3, 6]),
    "quiet": (["--quiet"], []),
}


@pytest.mark.parametrize("flags, steps", PROGRESS.values(), ids=PROGRESS)
def test_training_into_a_pipe_prints_plain_lines_not_a_bar(train_dir, flags, steps):
    """A log file holds no bar redraws (carriage returns); a line at each validation says the
    step, the mean loss of the steps since the last line (metrics.jsonl's) and tokens/s."""
    out = f"pipe-{len(flags)}"
    every = ["--max-steps", "6", "--eval-every", "3", "--log-every", "1"]
    r = python("train_small.py", *run_argv(train_dir, out, *every, *flags))
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stdout + r.stderr
    line = r"^step (\d): loss ([\d.]+) \(the mean of 3 steps\); ([\d,]+) tokens/s; lr \S+$"
    found = re.findall(line, r.stdout, re.M)
    assert [int(step) for step, _, _ in found] == steps
    records = logged(train_dir / out, "train")  # a record a step: --log-every 1
    for step, loss, tok_s in found:
        last3 = records[int(step) - 3 : int(step)]
        mean = sum(r["loss"] for r in last3) / 3
        assert float(loss) == pytest.approx(mean, abs=1e-4)
        seconds = sum(1 / r["tokens_per_s"] for r in last3)  # a step's, over its tokens
        assert int(tok_s.replace(",", "")) == pytest.approx(3 / seconds, abs=1)


AMD = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 avx512f avx512_bf16 vaes\n"
SAPPHIRE = "vendor_id\t: GenuineIntel\nflags\t\t: avx512f amx_tile amx_bf16 amx_int8\n"
CPUINFO = {  # /proc/cpuinfo texts -> the bf16 flag named, or ""
    "epyc-avx512-bf16": (AMD, "avx512_bf16"),
    "xeon-amx": (SAPPHIRE, "amx_bf16"),
    "xeon-without": ("vendor_id\t: GenuineIntel\nflags\t\t: avx2 avx512f avx512bw\n", ""),
    "a-longer-name": ("flags\t\t: avx512_bf16x amx_bf16_future\n", ""),
    "named-outside-flags": ("model name\t: avx512_bf16\nflags\t\t: sse2\n", ""),
    "first-processor": ("flags\t\t: sse2\n\nflags\t\t: sse2 avx512_bf16\n", ""),
    "arm-features": ("Features\t: fp asimd bf16 i8mm\n", ""),
    "not-linux": ("", ""),
}


@pytest.mark.parametrize("cpuinfo, flag", CPUINFO.values(), ids=CPUINFO)
def test_native_bf16_is_read_from_the_cpu_flags(cpuinfo, flag):
    assert setdiff.native_bf16(cpuinfo) == flag


def test_cpu_info_is_the_machines_own_description():
    """/proc/cpuinfo's text where the system has one (Linux), "" elsewhere: never an error."""
    path = Path("/proc/cpuinfo")
    want = path.read_text() if path.exists() else ""
    assert setdiff.cpu_info() == want


BF16_DEFAULT = {  # the CPU's flags line, --dtype -> the dtype training picks and its reason
    "native": (AMD, "auto", "bfloat16 (training on a CPU with native bf16: avx512_bf16)"),
    "emulated": ("flags\t\t: avx2\n", "auto", "float32 (bf16 is not known to be faster"),
    "asked": (AMD, "float32", "float32 (requested with --dtype)"),
}


@pytest.mark.parametrize("cpuinfo, dtype, said", BF16_DEFAULT.values(), ids=BF16_DEFAULT)
def test_training_on_a_cpu_picks_bf16_where_it_is_native(
    train_dir, capsys, monkeypatch, cpuinfo, dtype, said
):
    monkeypatch.setattr(setdiff, "cpu_info", lambda: cpuinfo)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)  # a GPU beside: no matter
    run = training_run(train_dir, "bf16", "--device", "cpu", "--dtype", dtype, "--force")
    assert f"device: cpu (requested with --device); {said}" in capsys.readouterr().out
    assert str(run.dtype) == "torch." + said.split()[0]


def test_sampling_on_a_cpu_stays_float32_where_bf16_is_native(monkeypatch):
    """Sampling keeps its tokens: bf16 is for training steps only."""
    monkeypatch.setattr(setdiff, "cpu_info", lambda: AMD)
    _, dtype, line = setdiff.runtime("cpu", "auto", 1)
    assert dtype == torch.float32
    assert "; float32 (outside training: bf16 (avx512_bf16) changes outputs, no faster)" in line


TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def test_torchrun_two_processes_match_one(tmp_path):
    """Two gloo processes, 4 rows each, train as one process on 8 rows."""
    write_corpus(tmp_path / "corpus.txt")
    steps = ["--max-steps", "6", "--eval-every", "6", "--log-every", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    one_argv = run_argv(tmp_path, "one", "--global-batch", "8", *steps)
    one = python("train_small.py", *one_argv, env=env)
    two_argv = run_argv(tmp_path, "two", "--global-batch", "8", *steps)
    two = python(*TORCHRUN, "train_small.py", *two_argv, env=env)
    # NOTE: one retry, for one cause only, outside setdiff: after all the run's work, gloo's
    # worker thread may still be releasing the last all-reduce's tensor while Python shuts down
    # (the process group outlives destroy_process_group); that tensor's release takes the GIL,
    # which exits the thread inside C++: SIGABRT, "terminate called without an active exception"
    # (core dump: pt_gloo_runloop in take_gil under Py_FinalizeEx). A 10-line gloo script does
    # it too, about 1 run in 20 with both cores busy; rank 1 exits first, so it is rank 1.
    if "terminate called without an active exception" in two.stderr:
        shutil.rmtree(tmp_path / "two")
        two = python(*TORCHRUN, "train_small.py", *two_argv, env=env)
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    assert "4 per forward x 1 accumulation x 2 proc" in two.stdout
    assert two.stdout.count("done:") == 1
    one_loss = losses(tmp_path / "one")
    two_loss = losses(tmp_path / "two")
    np.testing.assert_allclose(two_loss, one_loss, rtol=1e-4)
    w1 = ckpt_of(tmp_path / "one")["train_model"]
    w2 = ckpt_of(tmp_path / "two")["train_model"]
    assert close_weights(w1, w2, 1e-5)


FAILING_RANK = """
import sys
import train_small
step = train_small.train_step
def failing(run, n):  # rank 1 alone fails at step 2, as one GPU out of memory would
    if run.rank == 1 and n == 2:
        raise ValueError("rank 1 has failed")
    return step(run, n)
train_small.train_step = failing
sys.exit(train_small.main())
"""


def test_torchrun_stops_every_process_when_one_fails(tmp_path):
    """No process waits for the failed one: the run ends at once (a hang would time out), the
    failed process says why, the other one line, no traceback."""
    write_corpus(tmp_path / "corpus.txt")
    (tmp_path / "failing.py").write_text(FAILING_RANK)
    argv = run_argv(tmp_path, "two", "--global-batch", "8", "--max-steps", "6")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    start = time.perf_counter()
    out = python(*TORCHRUN, str(tmp_path / "failing.py"), *argv, env=env, timeout=120)
    assert time.perf_counter() - start < 60
    assert out.returncode != 0
    errors = [line for line in out.stderr.splitlines() if "error: " in line]
    assert errors[0].endswith("error: rank 1: rank 1 has failed")
    assert errors[1].startswith("error: another process stopped, so this one did")
    assert "[rank0]: Traceback" not in out.stderr


# ---- experiments/train_bench.py ------------------------------------------------------------
# experiments/*.py as modules, the way the tests call their functions (frontier.py imports bench)
sys.path.insert(0, str(ROOT / "experiments"))
bench = importlib.import_module("bench")
compare = importlib.import_module("compare")
frontier = importlib.import_module("frontier")
infill = importlib.import_module("infill")
order_stats = importlib.import_module("order_stats")
plot = importlib.import_module("plot")
train_bench = importlib.import_module("train_bench")


@pytest.fixture(scope="module")
def bench_table():
    """train_bench.py's table for a 1-layer model, one timed step a run, one run -> its rows
    [dtype, variant, ms, tokens/s, vs AR]."""
    argv = [*SHAPE[:6], "--batch-size", "8", "--threads", "1"]  # no --seq-len
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.setattr(train_bench, "STEPS", 1)
        mp.setattr(train_bench, "REPEATS", 1)
        assert train_bench.main(argv) == 0
    lines = out.getvalue().splitlines()
    rows = [line for line in lines if line.startswith("| ") and "x |" in line]
    return [row.split("|")[1:-1] for row in rows]


def test_train_bench_times_each_variant_in_float32_and_bfloat16(bench_table):
    dtypes = [row[0].strip() for row in bench_table]
    assert dtypes == ["float32", "float32", "bfloat16", "bfloat16"]


@table(
    "argv,message",
    {  # a flag -> what the one error line says, before any timing
        "threads-negative": ("--threads -3", "--threads -3: must be in [1, "),
        "heads-not-dividing": ("--n-head 3", "d_model must be a multiple of n_head"),
    },
)
def test_train_bench_bad_flag_is_one_line_and_exit_2(capsys, argv, message):
    assert train_bench.main(argv.split()) == 2
    out, err = capsys.readouterr()
    one_error_line(err, message)
    assert out == ""


def test_train_bench_ratio_is_the_set_diffusion_time_over_ar(bench_table):
    for set_row, ar_row in (bench_table[0:2], bench_table[2:4]):
        ms_set = float(set_row[2])  # printed to 0.1 ms, the ratio to 0.01
        ms_ar = float(ar_row[2])
        rounding = 0.05 * (1 / ms_set + 1 / ms_ar)  # 0.05 ms in either time
        tol = 0.006 + rounding * ms_set / ms_ar
        ratio = float(set_row[4].strip()[:-1])
        assert ratio == pytest.approx(ms_set / ms_ar, abs=tol)


def test_train_bench_ar_baseline_is_the_prefix_by_prefix_loss():
    """The AR baseline is a true causal LM: each prefix alone predicts its next token."""
    model = tiny_model(seq_len=10)
    x = random_rows(model.cfg, 2)
    nll = []
    for b in range(2):
        for i in range(1, 10):
            positions = torch.arange(i)[None]
            logits = causal_logits(model, x[b : b + 1, :i], positions)
            logp = torch.log_softmax(logits[0, -1], -1)
            nll.append(-logp[x[b, i]])
    want = torch.stack(nll).mean()
    assert torch.allclose(train_bench.ar_loss(model, x), want, atol=1e-5)


# ---- sample.py -----------------------------------------------------------------------------
L = 24  # tiny_cfg's seq_len
LETTERS = "abcdefghijklmnopqrstuvwxyz"
VAL_TEXT = [f"the {w} sat on a mat." for w in ("cat", "dog", "fox", "owl", "hen", "ram")] * 3
VAL_TEXT += ["the end."]  # 18 lines fill 18 rows (L - 2 = 22 tokens a line): this one does not


def letters_model(order="staggered", eos_first=False, **kw):
    """A tiny_model (d=3, s=6) writing lowercase letters only, so given and generated text differ:
    head bias +10 for letters, -10 else (eos_first: +30 for EOS), beyond the +-3 of its weights."""
    model = tiny_model(order=order, **kw)
    V = model.cfg.vocab_size
    letter = torch.tensor([chr(i) in LETTERS for i in range(V)])
    bias = torch.where(letter, 10.0, -10.0)
    if eos_first:
        bias[EOS] = 30.0
    with torch.no_grad():
        for m in model.modules():  # a wide init: predictions depend on the context
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
                std = 3 / m.weight.shape[1] ** 0.5
                torch.nn.init.normal_(m.weight, std=std)
        torch.nn.init.normal_(model.head.weight, std=0.5)
        model.head.bias.copy_(bias)
    return model


def wrapped_by_hand(stream, bos, eos, pad=None):
    """Rows of L from a token stream: [BOS] + L-2 tokens + [EOS] (no BOS: L tokens); the rest in
    a last row padded with PAD where a PAD is given. -> (rows (n, L), tokens left over)."""
    start = [] if bos is None else [bos]
    end = [] if bos is None else [eos]
    body = L - len(start) - len(end)
    starts = range(0, len(stream) - body + 1, body)
    rows = [start + stream[k : k + body] + end for k in starts]
    rest = stream[len(rows) * body :]
    if rest and pad is not None:
        padding = [pad] * (L - len(start) - len(rest))
        rows.append(start + rest + padding)
        rest = []
    return torch.tensor(rows), rest


def write_val_bin(d):
    """13 rows by hand: [BOS] + 22 letters + [EOS] -> what train_small.py records of them."""
    letters = np.arange(13 * (L - 2)) % 26 + ord("a")
    rows = np.empty((13, L), np.uint16)
    rows[:, 0] = BOS
    rows[:, 1:-1] = letters.reshape(13, L - 2)
    rows[:, -1] = EOS
    rows.tofile(d / "val.bin")
    return {"path": str(d / "val.bin"), "rows": 13, "bytes_per_token": 1.0}


def val_rows_of(ckpts, n):
    """The first n rows of val.bin."""
    ids = np.fromfile(ckpts / "val.bin", dtype=np.uint16).astype(np.int64)
    return torch.from_numpy(ids).view(-1, L)[:n]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Checkpoints as train_small.py writes them (step, val_rows), and text files to score."""
    d = tmp_path_factory.mktemp("sample")
    write_lines(d / "val.txt", VAL_TEXT)
    (d / "short.txt").write_text("hello\n")
    (d / "empty.txt").write_text("")
    (d / "binary.txt").write_bytes(b"\x7fELF\x02\x00\n\xff\xfe\nlibc.so.6\n")  # a program
    val = write_val_bin(d)
    other = val | {"path": str(d / "val.txt")}  # other data than the judge's
    (d / "copy").mkdir()  # the judge's rows in another cache folder: the same data
    shutil.copy(d / "val.bin", d / "copy" / "val.bin")
    copy = val | {"path": str(d / "copy" / "val.bin")}
    gone = val | {"path": "-"}
    runs = dict(st=val, ar=val, eos=val, gone=gone)
    runs |= dict(other=other, copy=copy)
    for name, rows in runs.items():
        order = "ar" if name == "ar" else "staggered"
        model = letters_model(order, eos_first=name == "eos")
        setdiff.save_checkpoint(d / f"{name}.pt", model, BYTES, step=7, val_rows=rows)
    setdiff.save_checkpoint(d / "noval.pt", letters_model(), BYTES)
    owt = letters_model(**NO_BOS)
    setdiff.save_checkpoint(d / "owt.pt", owt, BYTES, val_rows=val)
    setdiff.save_checkpoint(d / "l40.pt", letters_model(seq_len=40), BYTES)
    return d


def one_error_line(err, needle):
    """stderr is ONE line 'error: ...' that says `needle`, no traceback."""
    assert err.startswith("error: "), err
    assert len(err.splitlines()) == 1, err
    assert needle in err, err


def run_sample(capsys, *argv):
    try:
        code = sample.main([str(a) for a in argv])
    except SystemExit as e:  # argparse errors
        code = e.code
    return (code, *capsys.readouterr())


def sample_ok(capsys, *argv):
    code, out, err = run_sample(capsys, *argv)
    assert code == 0 and "error" not in err and "Traceback" not in err, err
    return out


def samples_of(out):
    """[(header, text)] of every '--- sample i/n: ...' header and its (one) line."""
    lines = out.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("--- sample ")]
    return [(lines[i], lines[i + 1]) for i in starts]


def texts_of(out):
    return [text for _, text in samples_of(out)]


def calls_of(header):
    found = re.search(r": (\d+) calls, [\d.]+ tokens/call, [\d,]+ tokens/s$", header)
    return int(found[1])


def test_sampling_defaults_of_the_library_and_the_script_agree():
    """The same distribution by default: the model's own (top-p 1, temperature 1), not 0.9."""
    params = inspect.signature(generate).parameters
    script = sample.build_parser().parse_args(["--ckpt", "x"])
    assert params["top_p"].default == script.top_p == 1.0
    assert params["temperature"].default == script.temperature
    assert params["repetition_penalty"].default == script.repetition_penalty == 1.0


FORWARDED = {  # generate()'s arguments that are sample.py flags -> a value not their default
    "window": 1,  # the one window --ancestral takes
    "threshold": 0.4,
    "temperature": 0.5,
    "top_p": 0.9,
    "repetition_penalty": 1.1,
    "max_new_tokens": 7,
    "stop_at_eos": True,
    "compile": True,
    "ancestral": True,
}
MADE_BY_SAMPLE = {"prompt", "infill", "batch_size"}  # text -> ids, rows a batch: tested apart


def test_every_generate_argument_with_a_flag_reaches_generate(ckpts, capsys, monkeypatch):
    """Passed on by name, no list in sample.py: a new argument of generate with a flag fails
    here until FORWARDED gives it a value, then must arrive with that value."""
    parser = sample.build_parser()
    flags = {action.dest for action in parser._actions}
    params = inspect.signature(generate).parameters
    assert flags & params.keys() - MADE_BY_SAMPLE == FORWARDED.keys()
    seen = []
    real = setdiff.generate

    @functools.wraps(real)
    def spy(model, **kw):
        seen.append(kw)
        return real(model, **kw | {"compile": False})  # compiling would take 15-30 s

    monkeypatch.setattr(setdiff, "generate", spy)
    argv = ["--ckpt", ckpts / "st.pt"]
    for name, value in FORWARDED.items():
        argv.append("--" + name.replace("_", "-"))
        argv += [] if value is True else [value]
    sample_ok(capsys, *argv)
    assert [{name: kw[name] for name in FORWARDED} for kw in seen] == [FORWARDED]


def test_no_sample_flag_is_parsed_and_ignored():
    """A flag is an argument of generate (passed on by its name) or read by sample.py."""
    source = Path(sample.__file__).read_text()
    params = inspect.signature(generate).parameters
    for action in sample.build_parser()._actions:
        used = action.dest in params or f"args.{action.dest}" in source
        assert used or action.dest == "help", action.dest


def test_samples_are_printed_with_their_calls(ckpts, capsys):
    out = sample_ok(capsys, "--ckpt", ckpts / "st.pt", "--num-samples", 3, "--batch-size", 2)
    headers = [h[:15] for h, _ in samples_of(out)]
    assert headers == [f"--- sample {i}/3:" for i in (1, 2, 3)]
    texts = [t for h, t in samples_of(out) if calls_of(h) > 0]
    assert all(re.fullmatch(f"[a-z]{{{L - 1}}}", t) for t in texts)
    assert len(set(texts)) == 3


def test_a_prompt_is_continued_one_token_a_call(ckpts, capsys):
    args = ("--prompt", "Hi, you", "--max-new-tokens", 9)
    out = sample_ok(capsys, "--ckpt", ckpts / "st.pt", *args)
    ((header, text),) = samples_of(out)
    assert re.fullmatch(r"Hi, you[a-z]{9}", text)
    assert calls_of(header) == 9  # tau > 1: one token a call


@table(
    "template,pattern",
    {
        "mask-tokens": ("A [MASK]. B [MASK][MASK]!", r"A [a-z]\. B [a-z]{2}!"),
        "bare-span": ("X ___ Y", r"X [a-z]{3} Y"),  # --span-len 3
        "sized-spans": ("___5 Z ___2", r"[a-z]{5} Z [a-z]{2}"),
    },
)
def test_infill_fills_only_the_holes(ckpts, capsys, template, pattern):
    args = ("--infill", template, "--span-len", 3, "--threshold", 0.5, "--num-samples", 2)
    texts = texts_of(sample_ok(capsys, "--ckpt", ckpts / "st.pt", *args))
    assert len(texts) == 2
    assert all(re.fullmatch(pattern, t) for t in texts), texts


def test_batches_are_drawn_in_turn_from_one_generator_of_the_seed(ckpts, capsys):
    """More samples than --batch-size: the batches drawn by hand from one generator of --seed,
    with the sampling flags (--repetition-penalty too)."""
    args = ("--num-samples", 5, "--batch-size", 2, "--seed", 3, "--top-p", 0.9)
    out = sample_ok(capsys, "--ckpt", ckpts / "st.pt", *args, "--repetition-penalty", 2)
    sampler = dict(window=3, top_p=0.9, repetition_penalty=2.0, generator=gen(3))
    by_hand = []
    for B in (2, 2, 1):
        out_b = generate(letters_model(), batch_size=B, **sampler)
        by_hand += [BYTES.decode(row) for row in out_b.tokens]
    assert texts_of(out) == by_hand


def test_the_ancestral_flag_draws_generates_ancestral_samples(ckpts, capsys):
    argv = ("--ckpt", ckpts / "st.pt", "--num-samples", 2, "--seed", 4, "--ancestral")
    by_hand = generate(letters_model(), batch_size=2, ancestral=True, generator=gen(4))
    texts = [BYTES.decode(row) for row in by_hand.tokens]
    assert texts_of(sample_ok(capsys, *argv)) == texts


def test_many_samples_start_with_a_small_batch(ckpts, capsys, monkeypatch):
    """Without --batch-size, even 10^9 samples start with a batch of 16 (bounded memory)."""
    first_batch_only = mock.Mock(side_effect=KeyboardInterrupt)  # stop after the first call
    monkeypatch.setattr(setdiff, "generate", first_batch_only)
    code, _, _ = run_sample(capsys, "--ckpt", ckpts / "st.pt", "--num-samples", 10**9)
    assert code == 130
    assert first_batch_only.call_count == 1
    assert first_batch_only.call_args.kwargs["batch_size"] == 16


def test_a_closed_pipe_ends_sampling_quietly(ckpts):
    """`sample.py ... | head -1` stops as a Unix tool does: exit 0 or 141 (SIGPIPE), no error.
    The samples (~180 KB) overflow the pipe's buffer, so a write meets the closed pipe."""
    argv = f"--ckpt {ckpts}/st.pt --num-samples 2000 --batch-size 500"
    pipeline = f"set -o pipefail; {sys.executable} sample.py {argv} | head -1"
    cmd = ["bash", "-c", pipeline]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.stderr == ""
    assert r.returncode in (0, 141)


@table(
    "stage,argv",
    {  # the function Ctrl-C interrupts -> the flags
        "sampling": ("generate", []),
        "scoring": ("order_nll", ["--eval"]),  # inside the bound, its progress bar drawn
    },
)
def test_ctrl_c_is_one_line_and_exit_130(ckpts, capsys, monkeypatch, stage, argv):
    """One line "interrupted", on a line of its own: --eval's progress bar ends its line first."""

    def interrupted(*args, **kw):  # the signal itself, not a stand-in
        signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(setdiff, stage, interrupted)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code, _, err = run_sample(capsys, "--ckpt", ckpts / "st.pt", *argv)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert code == 130
    assert re.fullmatch(r"(\rbound:[^\n]*\n)?interrupted\n", err), err  # nothing else


@pytest.fixture
def shown_order(ckpts, capsys):
    """A greedy sample with --show-order -> (its calls, text, the runs [(text, call)], summary)."""
    args = ("--prompt", "Go", "--threshold", 0.3, "--temperature", 0, "--window", 6)
    out = sample_ok(capsys, "--ckpt", ckpts / "st.pt", *args, "--show-order")
    ((header, text),) = samples_of(out)
    picture, summary = out.split("--- decode order:\n")[1].splitlines()[:2]
    found = re.findall(r"\[([a-z]+)\](\d+)", picture)
    runs = [(t, int(c)) for t, c in found]
    marked = "".join(f"[{t}]{c}" for t, c in runs)
    assert picture == "Go" + marked  # the given text, then only marked runs
    return calls_of(header), text, runs, summary


def test_show_order_marks_the_runs_of_the_sample(shown_order):
    _, text, runs, _ = shown_order
    assert "Go" + "".join(t for t, _ in runs) == text


def test_show_order_counts_the_set_of_each_call(shown_order):
    calls, _, runs, summary = shown_order
    sizes = [0] * calls  # tokens each call revealed
    for t, c in runs:
        sizes[c] += len(t)
    assert min(sizes) >= 1  # every call one set
    assert max(sizes) > 1
    assert sum(sizes) == L - 3
    counts = [f"{sizes.count(n)} x {n} token{'s' * (n > 1)}" for n in sorted(set(sizes))]
    assert summary == "--- calls revealed: " + ", ".join(counts)


def test_decode_order_by_hand():
    """Given text plain, a run of one call [text]N, EOS as \\n, an erased PAD nothing."""
    ids = [BOS, *b"abcde", EOS, PAD]
    calls = [-1, -1, -1, 1, 1, 0, 2, setdiff.ERASED]
    shown = sample.decode_order(BYTES, ids, calls)
    picture, summary = shown.splitlines()[1:]
    assert picture == "ab[cd]1[e]0[\\n]2"
    assert summary == "--- calls revealed: 2 x 1 token, 1 x 2 tokens"


def test_stop_at_eos_ends_the_sample_at_its_first_eos(ckpts, capsys):
    """EOS beats every letter: the sample ends at its first generated EOS."""
    common = ("--ckpt", ckpts / "eos.pt", "--prompt", "Hi", "--temperature", 0)
    ((header, text),) = samples_of(sample_ok(capsys, *common, "--stop-at-eos"))
    ((full, _),) = samples_of(sample_ok(capsys, *common))
    assert text == "Hi"
    assert calls_of(header) < calls_of(full) == L - 3


@table(
    "args,pattern",
    {  # a model without BOS (as OWT) starts from EOS, the prompt as it is
        "prompt": (["--prompt", "Hi", "--max-new-tokens", 5], "Hi[a-z]{5}"),  # nothing left out
        "unconditional": (["--max-new-tokens", 4], "[a-z]{4}"),  # after EOS: a document starts
    },
)
def test_a_model_without_bos_samples_the_text_as_it_is(ckpts, capsys, args, pattern):
    out = sample_ok(capsys, "--ckpt", ckpts / "owt.pt", *args)
    assert re.fullmatch(pattern, texts_of(out)[0])


@pytest.fixture
def letters_folder(tmp_path):
    """A released LM1B-style folder of a letters_model over a small WordPiece vocab."""
    vocab = [*VOCAB[:5], "the", "cat", "sat", *LETTERS]  # the specials, words, letters
    specials = dict(pad_id=0, bos_id=2, eos_id=2, mask_id=4)
    model = letters_model(vocab_size=len(vocab), **specials)
    bias = torch.full((len(vocab),), 10.0)
    bias[:5] = -10.0  # words and letters only: no [PAD], no [CLS] (EOS, a line break)
    with torch.no_grad():
        model.head.bias.copy_(bias)
    return write_released(tmp_path / "lm1b-setdlm", model, vocab)


def test_a_released_folder_samples_words(letters_folder, capsys):
    args = ("--prompt", "the cat", "--max-new-tokens", 3)
    out = sample_ok(capsys, "--ckpt", letters_folder, *args)
    assert "(released model)" in out
    assert re.fullmatch(r"the cat( \S+){3}", texts_of(out)[0])


def test_export_writes_a_folder_that_samples_as_its_checkpoint(tmp_path, capsys):
    ckpt = tmp_path / "wp.pt"
    setdiff.save_checkpoint(ckpt, export_model(), WORDPIECE, step=3)
    out = sample_ok(capsys, "--ckpt", ckpt, "--export", tmp_path / "dir")
    files = "vocab.txt, model.safetensors, pytorch_model.bin, config.json"
    assert out == f"exported {ckpt} to {tmp_path / 'dir'} as a released SetDLM folder: {files}\n"
    args = ("--prompt", "the cat", "--max-new-tokens", 3, "--num-samples", 2)
    from_dir = sample_ok(capsys, "--ckpt", tmp_path / "dir", *args)
    assert "(released model)" in from_dir
    from_ckpt = sample_ok(capsys, "--ckpt", ckpt, *args)
    assert texts_of(from_dir) == texts_of(from_ckpt)


@table(
    "script,said",
    {
        "sample": ("sample.py", "interrupted\n"),
        "train_small": (
            "train_small.py",
            "\ninterrupted (outside the training steps: nothing new to save)\n",
        ),
    },
)
def test_ctrl_c_while_torch_loads_is_one_line_and_exit_130(script, said, tmp_path):
    """Ctrl-C inside `import torch` (a second before main) ends the script as a later Ctrl-C
    does. Python turns SIGINT into a KeyboardInterrupt where it is: a `torch` found first on
    the path raises one there, every time (a real signal's timing depends on the load)."""
    (tmp_path / "torch.py").write_text("raise KeyboardInterrupt\n")
    env = os.environ | {"PYTHONPATH": str(tmp_path)}
    cmd = [sys.executable, script, "--help"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (130, said)


VAL_STREAM = [i for line in VAL_TEXT for i in BYTES.encode(line) + [EOS]]


def test_eval_of_a_file_is_the_bound_on_rows_built_by_hand(ckpts, capsys):
    """A byte a token, a newline per EOS: every byte counted; the tail in a padded row."""
    argv = ("--ckpt", ckpts / "st.pt", "--eval", ckpts / "val.txt", "--num-orders", 2)
    out = sample_ok(capsys, *argv)
    rows, rest = wrapped_by_hand(VAL_STREAM, BOS, EOS, PAD)
    assert rest == []
    assert (rows[-1] == PAD).any()
    res = elbo(letters_model(), rows, num_orders=2, generator=gen(0))
    assert f"val {res.line(len(VAL_STREAM))}" in out
    assert "padded with PAD" in out


def test_eval_of_a_text_shorter_than_a_row_scores_its_tokens_only(ckpts, capsys):
    out = sample_ok(capsys, "--ckpt", ckpts / "st.pt", "--eval", ckpts / "short.txt")
    padding = [PAD] * (L - 7)
    row = torch.tensor([[BOS, *b"hello", EOS, *padding]])
    res = elbo(letters_model(), row, generator=gen(0))
    assert f"val {res.line(6)}" in out
    assert res.tokens_scored == 6  # padding is never scored


def test_eval_without_a_file_scores_the_validation_rows(ckpts, capsys):
    argv = ("--ckpt", ckpts / "st.pt", "--eval", "--eval-rows", 4, "--batch-size", 2)
    out = sample_ok(capsys, *argv, "--seed", 3)
    res = elbo(letters_model(), val_rows_of(ckpts, 4), generator=gen(3))
    assert f"val {res.line(4 * (L - 2))}" in out
    assert "validation split" in out


def test_eval_without_pad_leaves_the_tail_out_and_says_so(ckpts, capsys):
    """No PAD (as OWT): L-token rows, position 0 given; the tail is in no row."""
    out = sample_ok(capsys, "--ckpt", ckpts / "owt.pt", "--eval", ckpts / "val.txt")
    rows, rest = wrapped_by_hand(VAL_STREAM, None, None)
    model = letters_model(**NO_BOS)
    res = elbo(model, rows, generator=gen(0))
    assert f"val {res.line(len(rows) * (L - 1))}" in out
    assert len(rest) > 0
    assert f"not scored: the text's last {len(rest)} tokens (~{len(rest)} bytes)" in out


def gpt2_letters(bpe, tmp_path):
    """A letters_model over the bpe fixture's ids, saved -> (model, its checkpoint)."""
    model = letters_model(**BPE_IDS)
    setdiff.save_checkpoint(tmp_path / "owt.pt", model, bpe)
    return model, tmp_path / "owt.pt"


def test_eval_reads_a_gpt2_file_as_documents(bpe, tmp_path, capsys):
    """GPT-2 BPE: line breaks, blank lines and indentation are text; EOS ends each document."""
    docs = ["ab\n  ba\n\nbc 11 ab", "cab's\n S 2 ab ab c ab's"]
    text = tmp_path / "docs.txt"
    text.write_text(f"{docs[0]}\n<|endoftext|>\n{docs[1]}\n")
    model, owt = gpt2_letters(bpe, tmp_path)
    out = sample_ok(capsys, "--ckpt", owt, "--eval", text)
    stream = [i for doc in docs for i in bpe.encode(doc) + [18]]
    rows, _ = wrapped_by_hand(stream, None, None)
    res = elbo(model, rows, generator=gen(0))
    assert f"val ppl <= {res.ppl:.3f} " in out


def test_eval_of_a_gpt2_file_without_documents_is_one_line(bpe, tmp_path, capsys):
    (tmp_path / "sep.txt").write_text("<|endoftext|>\n<|endoftext|>\n")
    _, owt = gpt2_letters(bpe, tmp_path)
    code, _, err = run_sample(capsys, "--ckpt", owt, "--eval", tmp_path / "sep.txt")
    assert code == 2
    one_error_line(err, "--eval: 0 tokens of text fill no row")


def test_compile_without_a_compiler_is_one_line_naming_the_flag(ckpts, capsys):
    argv = ["--ckpt", ckpts / "st.pt", "--compile", "--max-new-tokens", 3]
    with torch._inductor.config.patch({"cpp.cxx": ("/no/such/c++",)}):
        code, _, err = run_sample(capsys, *argv)
    assert code == 2
    assert err.startswith("error: --compile: torch.compile fails here (InvalidCxxCompiler")
    assert len(err.strip().splitlines()) == 1, err


@table(
    "argv,message",
    {  # arguments ({d}: the checkpoint folder, {st}: a good checkpoint) -> what stderr says
        "missing-ckpt": ("--ckpt {d}/missing.pt", "not found"),
        "no-ckpt": ("--prompt hello", "--ckpt"),
        "long-prompt": ("{st} --prompt " + "x" * L, f"--prompt is {L + 1} tokens (with BOS)"),
        # generate()'s checks (test_generate_rejects_a_bad_argument) reach the user as one line
        "window": ("{st} --window 7", "--window must be in [1, 6]"),  # s = 6
        "top-p-0": ("{st} --top-p 0", "--top-p must be in (0, 1]"),
        "no-holes": ("{st} --infill no-holes", "nothing to fill"),
        "empty-span": ("{st} --infill ___0", "___0"),
        "huge-span": ("{st} --infill 'a ___1000000000000 b'", "--infill: a hole of 10000000"),
        "span-past-l": ("{st} --infill 'abcdefghij ___14'", "hole of 14 positions after 11 tokens"),
        "span-to-l": ("{st} --infill 'abcdefghij ___13'", "--infill is 25 tokens (with BOS)"),
        "huge-span-len": ("{st} --infill 'ab ___' --span-len 1000000000000", "--span-len: a hole"),
        "long-infill": ("{st} --infill " + "[MASK]" * L, f"--infill is {L + 1} tokens"),
        "infill-max-new-tokens": ("{st} --infill [MASK] --max-new-tokens 3", "--max-new-tokens"),
        "prompt-and-infill": ("{st} --prompt a --infill [MASK]", "not allowed"),
        "missing-text": ("{st} --eval {d}/missing.txt", "not a file"),
        "empty-text": ("{st} --eval {d}/empty.txt", "holds no text"),
        "binary-text": ("{st} --eval {d}/binary.txt", "look like text: 2 lines are not UTF-8"),
        "no-row-no-pad": ("--ckpt {d}/owt.pt --eval {d}/short.txt", "fill no row"),
        "no-val-rows": ("--ckpt {d}/noval.pt --eval", "pass --eval FILE"),
        "val-rows-gone": ("--ckpt {d}/gone.pt --eval", "pass --eval FILE"),
        "num-samples": ("{st} --num-samples 0", "must be at least 1"),
        "unknown-flag": ("{st} --no-such-flag", "unrecognized"),
        "export-bytes": ("{st} --export {d}/exported", "cannot export the bytes tokenizer"),
        "export-into-a-full-folder": ("{st} --export {d}", "exists and is not an empty folder"),
        "export-and-eval": ("{st} --export {d}/exported --eval", "not allowed"),
        "threads-100000": ("{st} --threads 100000", "--threads 100000: must be in [1, "),
        "seed-past-2-64": ("{st} --seed " + "9" * 23, "--seed: must be below 18446744073709551616"),
        "negative-seed": ("{st} --seed -1", "--seed: must be at least 0"),
        "export-no-name": ("{st} --export ''", "--export '': give the name of the folder"),
    },
)
def test_sample_bad_input_is_one_line_and_exit_2(ckpts, capsys, argv, message):
    st = f"--ckpt {ckpts}/st.pt"
    args = shlex.split(argv.format(d=ckpts, st=st))
    code, _, err = run_sample(capsys, *args)
    assert code == 2
    one_error_line(err, message)


# ---- experiments/ --------------------------------------------------------------------------
@torch.no_grad()
def greedy_plain():
    """Two prompts decoded greedily by bench's plain decoder -> (model, prompt, generation)."""
    model = letters_model()
    model.head.bias.zero_()  # greedy over letters alone soon repeats one: over all ids it varies
    prompt = torch.tensor([[BOS, 104, 105], [BOS, 120, 121]])  # one call
    plain = bench.plain_decoder(model, prompt, L - 3, temperature=0, top_p=1)
    return model, prompt, plain


@torch.no_grad()
def test_plain_decoder_takes_the_argmax_of_one_causal_forward_a_token():
    model, prompt, plain = greedy_plain()
    positions = torch.arange(L - 1).expand(2, -1)
    logits = causal_logits(model, plain.tokens[:, :-1], positions)  # (2, L - 1, V)
    greedy = logits.argmax(-1)
    assert torch.equal(plain.tokens[:, :3], prompt)
    assert torch.equal(greedy[:, 2:], plain.tokens[:, 3:])
    assert plain.tokens[:, 3:].unique().numel() > 3


def test_a_compiled_plain_decoder_draws_the_eager_tokens():
    model = tiny_model()
    prompt = torch.tensor([[1, 2], [3, 4]])
    eager = bench.plain_decoder(model, prompt, 22, temperature=1.0, generator=gen(3))
    kw = dict(temperature=1.0, generator=gen(3), compile=True)
    compiled = bench.plain_decoder(model, prompt, 22, **kw)
    assert torch.equal(compiled.tokens, eager.tokens)


def test_plain_decoder_counts_one_call_a_token():
    _, _, plain = greedy_plain()
    assert plain.calls == L - 3
    assert plain.tokens_per_call == 1
    given = [setdiff.GIVEN] * 3
    calls = list(range(L - 3))
    assert plain.reveal_call[1].tolist() == given + calls


def test_cache_check_runs_on_a_float64_copy(monkeypatch):
    model = letters_model()
    spy = mock.Mock(wraps=generate)
    monkeypatch.setattr(setdiff, "generate", spy)
    assert bench.cache_is_exact(model, 3, window=4)
    models = [call.args[0] for call in spy.call_args_list]
    assert [next(m.parameters()).dtype for m in models] == [torch.float64] * 2
    assert next(model.parameters()).dtype == torch.float32  # the model stays float32


def test_cache_check_fails_a_forgetful_cache(monkeypatch):
    store = setdiff.KVCache.store

    def forgetful(cache, new_idx, new_valid):  # stores nothing after the first call
        if not cache.filled.any():
            store(cache, new_idx, new_valid)

    monkeypatch.setattr(setdiff.KVCache, "store", forgetful)
    assert not bench.cache_is_exact(letters_model(), 3, window=4)


@pytest.fixture
def samplers():
    """bench's samplers of a letters_model (d=3, s=6)."""
    return bench.variants(letters_model().cfg, dict(temperature=1.0, top_p=1.0))


@pytest.fixture
def timings(samplers):
    """(name, batch 1) -> (tokens/call, tokens/s, slowest/fastest): the set sampler faster from
    tau=0.3 at w=d, never at w=s; the cache at 2.4x the cache-free speed."""
    speed = {"w=d=3, tau=0.3": 150.0, "w=d=3, tau=0.1": 300.0, "w=s=6, tau=0.1": 90.0}
    timings = {}
    for name in [bench.PLAIN, *samplers]:
        timings[name, 1] = (1.0, speed.get(name, 50.0), 1.2)
    timings["cached, w=4", 1] = (1.0, 120.0, 1.0)
    timings[bench.PLAIN, 1] = (1.0, 100.0, 1.1)
    timings["w=d=3, tau=0.3", 1] = (1.25, 150.0, 1.3)
    return timings


def test_bench_samplers_are_greedy_then_each_window_and_threshold(samplers):
    assert list(samplers)[:3] == ["cached, w=4", "cache-free, w=4", "w=d=3, tau=1.01"]


def test_bench_conclusions_of_the_timings(samplers, timings):
    overtakes = "overtakes the plain decoder at tau=0.3, 1.25 tokens/call (1.50x)"
    assert bench.conclusions(1, samplers, timings) == [
        "batch 1, greedy: the KV cache runs at 2.40x the cache-free speed",  # 120 / 50
        f"batch 1, w=d=3: the set sampler {overtakes}",
        "batch 1, w=s=6: the plain decoder is faster at every threshold",
    ]


def test_bench_concludes_nothing_from_repeats_that_disagree(samplers, timings):
    timings["w=s=6, tau=0.5", 1] = (1.0, 50.0, 1.6)  # one run of one sampler 1.6x another
    lines = bench.conclusions(1, samplers, timings)
    assert "2.40x" in lines[0]  # the lines that rest on other samplers stand
    assert "overtakes" in lines[1]
    assert lines[2].startswith("batch 1, w=s=6: the repeats disagree (slowest/fastest 1.60 > 1.5)")


def test_bench_script_prints_the_table_the_cache_check_and_verdicts(ckpts):
    argv = ["experiments/bench.py", "--ckpt", str(ckpts / "st.pt"), "--repeats", "1"]
    argv += ["--batch-sizes", "1", "2"]
    r = python(*argv)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert "command: python " + " ".join(argv) in r.stdout
    assert "warm-up round done" in r.stdout
    device = r"^device: cpu \(.+\); float32 \(.+\); \d+ threads? \(.+\)$"
    assert re.search(device, r.stdout, re.M)
    row = r"^\| (plain|cached|cache-free|w=[ds]=\d)[^|]* \|( [\d.,]+ \|){4} [\d.]+x \|$"
    rows = re.findall(row, r.stdout, re.M)
    assert len(rows) == 15
    assert rows[0][0] == "plain"
    assert "cached = cache-free (greedy, float64, batch 2): yes" in r.stdout
    verdict = r"^batch [12], (greedy|w=[ds]=[36]): "
    verdict += r"the (KV cache|set sampler|plain decoder|repeats) "
    assert len(re.findall(verdict, r.stdout, re.M)) == 6


def test_order_stats_script_prints_each_policy(ckpts):
    r = python("experiments/order_stats.py", "--ckpt", str(ckpts / "l40.pt"))
    assert r.returncode == 0
    names = re.findall(r"^\| (.+?) \|", r.stdout, re.M)[1:]
    assert names == ["staggered d=3, s=6", "ar", "block d=3", "uniform"]
    assert "| ar | 1.000 | 1.000 | 0.00 | 0.00 |" in r.stdout
    assert "positions 16..23)" in r.stdout


def test_order_stats_script_needs_a_long_context(ckpts):
    r = python("experiments/order_stats.py", "--ckpt", str(ckpts / "st.pt"))
    assert r.returncode == 2
    assert r.stderr.startswith("error: ")
    assert "L >= 33" in r.stderr


@table(
    "order,d,s,want",
    {  # P(left neighbour first), P(4 left ones first), E(masked of 16 left), E(revealed of 4
        # right) over 4,000 orders of L = 128, positions 16..111; seeds spread 0.003
        "staggered": ("staggered", 4, 8, (0.670, 0.432, 1.01, 0.87)),  # the authors'; a pin
        "block": ("block", 4, None, (0.625, 25 / 48, 0.75, 0.75)),  # 1/4 + 3/4 * 1/2, ...
        "uniform": ("uniform", 128, 128, (0.5, 0.2, 8, 2)),  # 1/2, 1/5, 16/2, 4/2
    },
)
def test_order_stats_match_closed_forms(order, d, s, want):
    cfg = Config(seq_len=128, order=order, set_size=d, max_set_size=s)
    got = order_stats.order_stats(cfg)
    assert got[:2] == pytest.approx(want[:2], abs=0.004)
    assert got[2:] == pytest.approx(want[2:], abs=0.015)


def write_records(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture
def plot_inputs(tmp_path, monkeypatch):
    """Runs' metrics.jsonl files, a comparison's --json and a checkpoint; plot.py draws into
    tmp_path."""
    monkeypatch.setattr(plot, "ASSETS", tmp_path)
    a = [dict(kind="val", tokens=200, bits_per_byte=3.5)]
    a += [dict(kind="train", tokens=100, loss=1.0)]
    a += [dict(kind="val", tokens=100, bits_per_byte=4.25)]
    (tmp_path / "a").mkdir()
    row = dict(model="m", window=2, threshold=0.5, distinct_4grams=0.5)
    samples = [dict(row, threshold=None, tokens_per_call=1.0, judge_nll=2.0)]
    samples += [dict(row, tokens_per_call=1.5, judge_nll=2.19)]  # <= 1.1 x 2.0
    samples += [dict(row, tokens_per_call=3.0, judge_nll=2.3)]  # > 1.1 x 2.0
    cmp = dict(samples=samples, validation=dict(judge_nll=1.0, distinct_4grams=0.5))
    (tmp_path / "frontier-m-s0.json").write_text(json.dumps(cmp))
    files = [write_records(tmp_path / "a" / "metrics.jsonl", a)]
    for seed, bits in enumerate([5.0, 6.0]):  # b's two seeds
        b = [dict(kind="val", tokens=100, bits_per_byte=bits)]
        files += [write_records(tmp_path / f"b-s{seed}.jsonl", b)]
    setdiff.save_checkpoint(tmp_path / "ar.pt", tiny_model(order="ar"), BYTES)
    return [*files, str(tmp_path / "frontier-m-s0.json"), str(tmp_path / "ar.pt")]


def test_plot_prints_the_curves_and_the_10_percent_rule(plot_inputs, capsys):
    """The validation records by tokens (a's train record left out), b's two seeds as their
    mean +- standard deviation, and within 1.1x."""
    plot.main(plot_inputs)
    out = capsys.readouterr().out
    assert "| training tokens | a | b |" in out
    assert "| 100 | 4.250 +- nan | 5.500 +- 0.707 |" in out  # (6 - 5) / sqrt(2)
    assert "| 200 | 3.500 +- nan | nan +- nan |" in out
    assert "| m, w=2 | 1.50 +- nan (1.50) | 3.00 +- nan (3.00) |" in out  # 2.19 <= 2.2 < 2.3


def test_plot_draws_the_figures_or_says_what_it_needs(plot_inputs, tmp_path, capsys):
    code = plot.main(plot_inputs)
    err = capsys.readouterr().err
    if not importlib.util.find_spec("matplotlib"):
        assert code == 2
        assert err == "error: drawing needs matplotlib (pip install matplotlib)\n"
        return
    assert code == 0
    drawn = {p.name for p in tmp_path.glob("*.png")}
    assert drawn == {"training.png", "frontier.png", "orders.png"}


def test_plot_decode_orders_of_an_ar_model_run_left_to_right(plot_inputs):
    """ar: the training order puts position i in slot i, and a greedy sample reveals it at
    call i - 1 (position 0, BOS, is given)."""
    orders = plot.decode_orders(plot_inputs[-1:], first=9)
    ((training, sample),) = orders.values()
    assert [t.tolist() for t in training] == [list(range(9))] * 2  # (slots, positions)
    revealed = [t.tolist() for t in sample]  # (calls, positions)
    assert revealed == [list(range(8)), list(range(1, 9))]


def test_plot_refuses_other_files(tmp_path, capsys):
    assert plot.main([str(tmp_path / "x.txt")]) == 2
    assert "infill.py .json or .pt files" in capsys.readouterr().err


@pytest.fixture(scope="module")
def comparison(ckpts, tmp_path_factory):
    """compare.py on ar.pt and copy.pt, judged by ar.pt -> (printed tables, its --json)."""
    path = tmp_path_factory.mktemp("compare") / "cmp.json"
    argv = [ckpts / "ar.pt", ckpts / "copy.pt", "--judge", ckpts / "ar.pt", "--samples", 3]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert compare.main([*argv, "--eval-rows", 4, "--json", path]) == 0
    return out.getvalue(), json.loads(path.read_text())


def test_compare_prints_a_row_per_window_and_threshold(comparison):
    out, _ = comparison
    row = r"^\| staggered d=3, s=6 \| [36] \| (>1|0\.\d+) \|"
    assert len(re.findall(row, out, re.M)) == 2 * 8
    ar_row = r"^\| ar \| [\d.]+ \| [\d.]+ \+- [\d.]+ \| [\d.]+ \| 92 \|$"  # 4 x 23 tokens
    assert re.search(ar_row, out, re.M)


def test_compare_bound_is_the_elbo_of_the_validation_rows(ckpts, comparison):
    _, cmp = comparison
    assert len(cmp["samples"]) == 1 + 16
    rows = val_rows_of(ckpts, 4)
    res = elbo(letters_model(), rows, num_orders=4, generator=gen(0))
    bound = cmp["bounds"][1]
    assert bound["nll_per_token"] == pytest.approx(res.nll_per_token, rel=1e-6)
    bits = res.nll / math.log(2) / (4 * (L - 2))
    assert bound["bits_per_byte"] == pytest.approx(bits)


def test_plot_groups_the_seeds_of_a_setting():
    first = [
        dict(model="m", window=2, threshold=None, x=0),
        dict(model="m", window=2, threshold=0.5, x=1),
    ]
    second = [dict(model="m", window=2, threshold=0.5, x=2)]
    runs = {"m-s0": dict(samples=first), "m-s1": dict(samples=second)}
    got = {}
    for setting, seeds in plot.by_setting(runs, "samples").items():
        got[setting] = [r["x"] for r in seeds]
    assert got == {("m", 2, None): [0], ("m", 2, 0.5): [1, 2]}


@table("key", {"judged-nll": "judge_nll", "distinct-4grams": "distinct_4grams"})
def test_plot_within_is_the_most_tokens_per_call_within_10_percent(comparison, key):
    samples = comparison[1]["samples"]
    reach = plot.within(samples, key)
    assert list(reach) == ["ar, w=1", "staggered d=3, s=6, w=3", "staggered d=3, s=6, w=6"]
    for name, value in reach.items():  # by hand
        mine = [r for r in samples if f"{r['model']}, w={r['window']}" == name]
        base = [r[key] for r in mine if r["threshold"] is None][0]
        low = 0 if key == "judge_nll" else 0.9 * base - 1e-12
        high = 1.1 * base + 1e-12
        kept = [r["tokens_per_call"] for r in mine if low <= r[key] <= high]
        assert value == max(kept)


SPEEDS = {"1": (1.0, 90.0), "2": (2.0, 40.0), "3.5": (3.5, 0.0), "5": (5.0, math.nan)}


@table("speed,best", SPEEDS)
def test_plot_best_accuracy_is_the_best_at_or_above_the_speed(speed, best):
    rows = []
    settings = [(1, 90), (2, 40), (2.6, 10), (4, 0)]  # (tokens per call, accuracy)
    for calls, accuracy in settings:
        rows.append(dict(tokens_per_call=calls, accuracy=accuracy))
    assert plot.best_at(rows, speed) == pytest.approx(best, nan_ok=True)


def test_plot_spread_gives_mean_std_and_each_seed():
    assert plot.spread([1.0, 2.0, 3.0], 1) == "2.0 +- 1.0 (1.0, 2.0, 3.0)"


@table(
    "argv,message",
    {  # arguments ({d}: the checkpoint folder) -> what the one error line says
        "set-judge": ("{d}/st.pt --judge {d}/st.pt", "--order ar"),
        "other-data": ("{d}/other.pt --judge {d}/ar.pt", "not trained on the data"),
        "no-folder": ("{d}/st.pt --judge {d}/ar.pt --json {d}/no/x.json", "folder does not exist"),
        "threads-negative": ("{d}/st.pt --judge {d}/ar.pt --threads -3", "--threads -3: must be"),
    },
)
@pytest.mark.parametrize("script", [compare, infill], ids=["compare", "infill"])
def test_judged_scripts_check_their_input_before_scoring(ckpts, capsys, argv, message, script):
    assert script.main(argv.format(d=ckpts).split()) == 2
    out, err = capsys.readouterr()
    one_error_line(err, message)
    assert "model:" not in out  # nothing scored before the error


JUDGED = BYTES.encode("the cat sat on the mat, it sat")[:23]  # the text of one row, after BOS


@pytest.fixture
def text_stats():
    """compare's statistics of JUDGED under an AR judge -> (judge, x, statistics)."""
    judge = letters_model("ar")
    x = torch.tensor([[BOS, *JUDGED]])
    return judge, x, compare.text_stats(judge, x)


def test_judge_nll_is_the_ar_bound_of_the_text(text_stats):
    judge, x, got = text_stats
    left_to_right = torch.arange(L)[None]
    nll = position_nll(judge, x, left_to_right)[0, 1:].mean()  # no BOS
    assert got["judge_nll"] == pytest.approx(nll.item(), rel=1e-5)


def test_unigram_entropy_of_the_text(text_stats):
    _, _, got = text_stats
    counts = [JUDGED.count(c) for c in set(JUDGED)]
    p = torch.tensor(counts) / 23
    entropy = -(p * p.log2()).sum()
    assert got["unigram_entropy"] == pytest.approx(entropy.item())


def test_distinct_4grams_of_the_text(text_stats):
    _, _, got = text_stats
    grams = {tuple(JUDGED[i : i + 4]) for i in range(20)}
    assert got["distinct_4grams"] == len(grams) / 20


def test_distinct_4grams_count_over_all_rows():
    same = torch.tensor([[BOS] + [7] * 23] * 2)
    assert compare.text_stats(letters_model("ar"), same)["distinct_4grams"] == 1 / 40


@pytest.fixture(scope="module")
def infill_spans():
    """Rows of 72 with spans away from EOS at 56..59 in turn -> (AR model, x, starts, rows)."""
    rng = np.random.default_rng(0)
    rows = rng.integers(97, 123, (12, 72)).astype(np.uint16)
    rows[:, 0] = BOS
    rows[1, 60] = EOS  # a sentence break in row 1's span: skipped
    x, starts = infill.pick_spans(rows, 6, EOS)
    model = tiny_model(order="ar", seq_len=72, n_layer=1)
    return model, x, starts, rows


def test_infill_picks_spans_without_a_sentence_break(infill_spans):
    _, x, starts, rows = infill_spans
    assert starts.tolist() == [56, 57, 58, 59, 56, 57]
    assert x[1].tolist() == rows[2].tolist()


def test_infill_bounds_of_an_ar_model_are_its_chain_rule(infill_spans):
    """Left side: the left context; both sides: all context, then the span left to right."""
    model, x, starts, _ = infill_spans
    res = infill.span_bounds(model, x, starts, mock.Mock(num_orders=2, seed=0))
    left = 0.0
    both = 0.0
    for row, a in zip(x, starts.tolist()):
        span = list(range(a, a + infill.SPAN))
        left += chain_nll(model, row, list(range(a)), span)
        context = [p for p in range(72) if p not in span]
        both += chain_nll(model, row, context, span)
    assert res["left"] == pytest.approx(left / 48, abs=1e-4)
    assert res["both"] == pytest.approx(both / 48, abs=1e-4)
    assert res["gain"] == res["left"] - res["both"]


def test_infill_fill_of_an_ar_model_is_its_greedy_chain(infill_spans):
    model, x, starts, _ = infill_spans
    fills = infill.fill(model, x, starts, 1.0)
    for row, a, fill in zip(x, starts.tolist(), fills):
        chosen = row.clone()
        for t in range(a, a + infill.SPAN):
            chosen[t] = log_p(model, chosen, list(range(t)), t).argmax()
        assert fill.tolist() == chosen[a : a + infill.SPAN].tolist()


def test_infill_fills_with_the_repetition_penalty(infill_spans, monkeypatch):
    model, x, starts, _ = infill_spans
    spy = mock.Mock(wraps=generate)
    monkeypatch.setattr(setdiff, "generate", spy)
    infill.fill(model, x, starts, 1.2)
    assert {c.kwargs["repetition_penalty"] for c in spy.call_args_list} == {1.2}


def test_infill_repeats_are_the_span_tokens_equal_to_the_one_before(infill_spans):
    _, x, starts, _ = infill_spans
    fill = [97, 97, 98, 98, 97, 98, 32, 32]  # "aabbab  "
    fills = torch.tensor([fill] * len(x))
    same = 0
    for row, a, fill in zip(x, starts.tolist(), fills):
        filled = row.clone()
        filled[a : a + infill.SPAN] = fill
        for t in range(a, a + infill.SPAN):
            same += int(filled[t] == filled[t - 1])
    assert infill.repeats(x, starts, fills) == same / fills.numel()


def test_infill_writes_a_row_per_model_and_penalty(ckpts, tmp_path, monkeypatch):
    monkeypatch.setattr(infill, "FIRST", 4)  # spans inside these rows of 24
    out = tmp_path / "infill.json"
    argv = [f"{ckpts}/st.pt", "--judge", f"{ckpts}/ar.pt", "--rows", "2", "--num-orders", "1"]
    assert infill.main([*argv, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["models"]
    assert [r["repetition_penalty"] for r in rows] == [1.0, 1.2]  # the default: both
    assert rows[0]["gain"] == rows[1]["gain"]  # one bound a model


def test_infill_refuses_a_model_without_pad_in_one_line(ckpts, capsys):
    """owt.pt has no PAD (as GPT-2 models): the left-side bound cannot cut its rows."""
    assert infill.main([f"{ckpts}/owt.pt", "--judge", f"{ckpts}/ar.pt", "--rows", "2"]) == 2
    why = "has no PAD, which infill.py needs to cut a row after its span"
    assert capsys.readouterr().err == f"error: {ckpts}/owt.pt {why}\n"


def test_frontier_task_is_deterministic(tmp_path):
    frontier.write_task(tmp_path / "a", train=300, test=8)
    frontier.write_task(tmp_path / "b", train=300, test=8)
    a = (tmp_path / "a" / "train.txt").read_text()
    assert a == (tmp_path / "b" / "train.txt").read_text()
    assert len(a.splitlines()) == 300


def test_frontier_task_answers_are_right(tmp_path):
    frontier.write_task(tmp_path, train=300, test=8)
    mirror = "9876543210"  # r: the digit at the mirrored place
    for line in (tmp_path / "train.txt").read_text().splitlines():
        m = re.fullmatch(r"Q:(\d)([+r]{8}) A:(\d{8})", line)
        value = int(m[1])
        values = ""
        for step in m[2]:
            value = (value + 1) % 10 if step == "+" else int(mirror[value])
            values += str(value)
        assert m[3] == values


@pytest.fixture(scope="module")
def frontier_run(tmp_path_factory):
    """evaluate() on an AR and a staggered tiny model -> (its results, the test pairs, paths)."""
    d = tmp_path_factory.mktemp("frontier")
    frontier.write_task(d, train=300, test=8)
    pairs = frontier.read_test(d / "test.txt")
    paths = [d / "ar.pt", d / "st.pt"]
    for path, order in zip(paths, ("ar", "staggered")):
        model = tiny_model(order=order, seq_len=64, n_layer=1, set_size=4)
        setdiff.save_checkpoint(path, model, BYTES)
    return frontier.evaluate(paths, pairs, "cpu"), pairs, paths


def test_frontier_rows_are_each_model_window_and_threshold(frontier_run):
    rows = frontier_run[0]["frontier"]
    taus = [None, 0.9, 0.7, 0.5, 0.3, 0.2, 0.1, 0.05]
    want = [("plain causal decoder", 1, None), ("ar", 1, None)]
    want += [("staggered d=4, s=8", w, t) for w in (4, 8) for t in taus]
    assert [(r["model"], r["window"], r["threshold"]) for r in rows] == want
    assert rows[0]["accuracy"] is None  # the plain decoder gives a speed, not an accuracy
    assert all(r["tokens_per_s"] > 0 for r in rows)


@pytest.fixture(scope="module")
def decoded_here(frontier_run):
    """The staggered model's answers at w=8, tau=0.3, decoded here -> (frontier's row for
    them, the Generation, which answers are right)."""
    res, pairs, paths = frontier_run
    shots = pairs[-1:] + pairs[:-1]  # each problem after another one, solved
    prompt = []
    for (s, a), (q, _) in zip(shots, pairs):
        shot = BYTES.encode(s + a) + [EOS]
        prompt.append([BOS, *shot, *BYTES.encode(q)])
    prompt = torch.tensor(prompt)
    model = load_checkpoint(paths[1])[0]
    sampler = dict(max_new_tokens=8, temperature=0, window=8, threshold=0.3)
    out = generate(model, prompt=prompt, **sampler)
    new = out.tokens[:, prompt.shape[1] :]
    right = []
    for row, (_, answer) in zip(new, pairs):
        right.append(BYTES.decode(row) == answer)
    row = res["frontier"][2 + 8 + 4]  # staggered, w=8, tau=0.3
    assert (row["window"], row["threshold"]) == (8, 0.3)
    return row, out, right


def test_frontier_accuracy_is_the_share_of_right_answers(decoded_here):
    row, _, right = decoded_here
    assert row["accuracy"] == 100 * sum(right) / 8


def test_frontier_tokens_per_call_are_the_samplers(decoded_here):
    row, out, _ = decoded_here
    assert row["tokens_per_call"] == out.tokens_per_call


def test_frontier_infill_hides_the_middle_four_steps(frontier_run):
    pairs = frontier_run[1]
    ids, hidden = frontier.infill_rows(BYTES, pairs)
    for row, holes, (question, answer) in zip(ids, hidden, pairs):
        assert BYTES.decode(row[holes]) == question[5:9]  # "Q:" x, then steps 3-6 of 8
        assert BYTES.decode(row[-8:]) == answer  # the answer given


@table(
    "fill,right",
    {
        "the-steps": ("rrrr", True),
        "from-4-both-steps-give-5": ("+rrr", True),  # 4 + = 5 and 4 r = 5
        "a-wrong-step": ("r+rr", False),
        "not-a-step": ("rrrx", False),
        "too-short": ("rrr", False),
    },
)
def test_frontier_a_fill_is_right_when_its_steps_walk_to_the_answer(fill, right):
    pairs = [("Q:6r+rrrrrr A:", "34545454")]  # 6 r 3 + 4 r 5 r 4 r 5 r 4 r 5 r 4
    assert frontier.right_fills(pairs, [fill]) == [right]


def test_frontier_infill_scores_the_hidden_columns(frontier_run, monkeypatch):
    """A generate that writes each question's own steps into the holes (AR: after the left
    side) scores 100%: the fills are read from the hidden columns."""
    _, pairs, paths = frontier_run
    ids, hidden = frontier.infill_rows(BYTES, pairs)

    def truth(model, prompt=None, infill=None, max_new_tokens=None, **kw):
        rows = ids if prompt is None else ids[:, : prompt.shape[1] + max_new_tokens]
        return mock.Mock(tokens=rows.clone())

    monkeypatch.setattr(setdiff, "generate", truth)
    for path in paths:  # ar, then staggered
        model = load_checkpoint(path)[0]
        rows = frontier.infill(model, BYTES, pairs)
        assert [(r["accuracy"], r["exact_steps"]) for r in rows] == [(100.0, 100.0)] * 2


def test_frontier_infill_rows_are_each_model_and_penalty(frontier_run):
    rows = frontier_run[0]["infill"]
    got = []
    for r in rows:
        got.append((r["model"], r["window"], r["repetition_penalty"]))
    ar = [("ar", 1, p) for p in (1.0, 1.2)]
    assert got == ar + [("staggered d=4, s=8", 8, p) for p in (1.0, 1.2)]
    assert all(0 <= r["exact_steps"] <= r["accuracy"] <= 100 for r in rows)


def test_plot_draws_the_task_of_a_json(frontier_run, tmp_path):
    res = frontier_run[0]
    (tmp_path / "task-x-s0.json").write_text(json.dumps(res))
    with mock.patch.object(plot, "draw") as draw:  # the figure's data reaches the drawing
        assert plot.main([str(tmp_path / "task-x-s0.json")]) == 0
    assert draw.call_args.args[1]["task"] == {"x-s0": res}


def test_pip_installs_setdiff_and_the_two_scripts():
    """pip install . / pip wheel .: the flat layout names its modules and the entry points."""
    import tomllib  # Python 3.11+, as CI

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    modules = meta["tool"]["setuptools"]["py-modules"]
    assert sorted(modules) == ["sample", "setdiff", "train_small"]
    for entry in meta["project"]["scripts"].values():
        module, name = entry.split(":")
        assert callable(getattr(importlib.import_module(module), name))


def test_the_quick_tier_is_every_test_of_the_method_sections():
    """`pytest -m method` (conftest.py) collects each test defined before the checkpoint tests,
    and none after: here read from the file's syntax tree."""
    source = Path(__file__).read_text()
    banner = source.index("\n# ---- checkpoints")
    end = source.count("\n", 0, banner) + 1  # the banner's line, 1-based
    defs = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)]
    tests = [n for n in defs if n.name.startswith("test_")]
    want = {n.name for n in tests if n.lineno < end}
    r = python("-m", "pytest", "--collect-only", "-q", "-m", "method", "test_setdiff.py")
    ids = [line for line in r.stdout.splitlines() if "::" in line]
    assert {i.split("::")[1].split("[")[0] for i in ids} == want


# ---- experiments/gpu_check.py --------------------------------------------------------------
# No test id here holds "on_cpu" or "on_cuda": the script runs `pytest -k` with them itself.
gpu_check = importlib.import_module("gpu_check")


def test_gpu_check_forward_flops_of_lm1b_are_the_readmes():
    """README.md's projection for --preset lm1b (a forward of 26.6 TFLOP a step: blocks 22.3,
    head 3.1, attention 1.2; a training step 79.7), from a block's own weights."""
    preset = train_small.LM1B
    keys = ("seq_len", "n_layer", "n_head", "d_model")
    shape = {key: preset[key] for key in keys}
    ids = dict(mask_id=103, bos_id=101, eos_id=101, pad_id=0)  # BERT's
    cfg = Config(30522, **shape, **ids)
    rows = preset["global_batch"]
    L = cfg.seq_len
    block = setdiff.Block(cfg)  # 12 of them
    matrices = [p.numel() for p in block.parameters() if p.dim() == 2]
    weights = cfg.n_layer * sum(matrices)
    blocks = 2 * weights * rows * 2 * L  # the clean and the mask stream
    head = 2 * cfg.d_model * cfg.vocab_size * rows * L  # the mask stream only
    pairs = rows * cfg.n_layer * (2 * L) ** 2
    attention = 2 * pairs * cfg.d_model * 2  # q.k, then the sum of v: a multiply-add each
    flops = gpu_check.forward_flops(cfg, rows)
    assert flops == dict(blocks=blocks, head=head, attention=attention)
    tflop = [round(n / 1e12, 1) for n in flops.values()]
    assert tflop == [22.3, 3.1, 1.2]
    forward = sum(flops.values()) / 1e12
    assert round(forward, 1) == 26.6
    assert round(3 * forward, 1) == 79.7


def test_gpu_check_bytes_a_call_are_the_weights_and_a_real_caches_slots():
    """Against a KV cache as a bf16 call fills it: keys and values over its L position slots."""
    model = tiny_model()
    L = model.cfg.seq_len
    cache = setdiff.KVCache(model.cfg, 3, L, 2, "cpu")
    keys = torch.zeros(3, 2, 2, 16, dtype=torch.bfloat16)  # (B, H, n, hd)
    cache.extend(0, keys, keys)
    kv = sum(t[..., :L, :].numel() * t.element_size() for t in (cache.k, cache.v))
    weights = sum(2 * p.numel() for p in model.parameters())
    assert gpu_check.bytes_a_call(model, 3, torch.bfloat16) == weights + kv


@table(
    "name, peak",
    {
        "h100-sxm": ("NVIDIA H100 80GB HBM3", 989e12),
        "h100-pcie": ("NVIDIA H100 PCIe", 756e12),
        "h200": ("NVIDIA H200", 989e12),
        "a100": ("NVIDIA A100-SXM4-80GB", 312e12),
    },
)
def test_gpu_check_peak_flops_by_device_name(name, peak):
    assert gpu_check.peak_flops(name) == peak


def test_gpu_check_unknown_device_has_no_mfu():
    assert math.isnan(gpu_check.peak_flops("Tesla T4"))


def test_gpu_check_a_failing_part_becomes_an_error_row():
    def broken(n):
        raise RuntimeError(f"CUDA error: {n}\n  out of memory")

    rows = gpu_check.run_part("train", broken, 7)
    error = "RuntimeError: CUDA error: 7 out of memory"
    assert rows == [dict(part="train", variant="error", error=error)]


def test_gpu_check_without_a_gpu_exits_2_pointing_to_the_dry_run(tmp_path, capsys):
    path = tmp_path / "c.json"
    with mock.patch.object(torch.cuda, "is_available", return_value=False):
        assert gpu_check.main(["--json", path]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--dry-run" in err
    assert not path.exists()


def test_gpu_check_refuses_an_unwritable_json_folder_before_the_work(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    path = tmp_path / "file" / "c.json"
    with mock.patch.object(gpu_check, "measure") as measure:
        assert gpu_check.main(["--dry-run", "--json", path]) == 2
    measure.assert_not_called()
    assert "--json" in capsys.readouterr().err


@pytest.fixture(scope="module")
def gpu_check_rows(tmp_path_factory):
    """`experiments/gpu_check.py --dry-run` as a user runs it -> its JSON's rows by part."""
    path = tmp_path_factory.mktemp("gpu-check") / "check.json"
    r = python("experiments/gpu_check.py", "--dry-run", "--json", path)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {}
    for row in json.loads(path.read_text())["rows"]:
        rows.setdefault(row["part"], []).append(row)
    return rows


def test_gpu_check_dry_run_measures_every_part_without_an_error(gpu_check_rows):
    assert list(gpu_check_rows) == ["tests", "train", "loader", "sampler", "cache", "profile"]
    for rows in gpu_check_rows.values():
        assert all(row["variant"] != "error" for row in rows)


def test_gpu_check_dry_run_counts_the_cpu_tests(gpu_check_rows):
    (tests,) = gpu_check_rows["tests"]
    assert tests["variant"] == "-k on_cpu"  # the CPU twins of the GPU run's tests
    for word in ("passed", "failed", "skipped"):
        assert isinstance(tests[word], int)


def test_gpu_check_dry_run_times_the_training_step_eager_and_compiled(gpu_check_rows):
    train = gpu_check_rows["train"]
    assert [row["variant"] for row in train] == ["eager", "compiled (eager)"]
    for row in train:
        assert math.isfinite(row["seconds"])
        assert row["tokens_per_s"] > 0


def compiled_rows(gpu_check_rows):
    """The sampler rows of gpu_check's compiled variants."""
    sampler = gpu_check_rows["sampler"]
    return [row for row in sampler if row["variant"].startswith("compiled (eager) ")]


def test_gpu_check_dry_run_times_the_loader_and_the_samplers(gpu_check_rows):
    loader = gpu_check_rows["loader"]
    assert [row["variant"] for row in loader] == ["rows", "orders"]
    assert all(0 < row["seconds"] < math.inf for row in loader)
    sampler = gpu_check_rows["sampler"]
    assert len(sampler) == 2 * 3 * 2  # eager, compiled x plain, tau > 1, tau 0.1 x batch 1, 4
    assert all(row["tokens_per_s"] > 0 for row in sampler)
    compiled = compiled_rows(gpu_check_rows)
    assert len(compiled) == 6 and all(row["compile_s"] > 0 for row in compiled)


def test_gpu_check_dry_run_counts_what_two_compiled_runs_compile_and_record(gpu_check_rows):
    """The CPU's share of the GPU's rows: graphs compiled by the first run only (a graph a set
    size, so at least one), none recorded as a CUDA graph, the same calls in both runs."""
    for row in compiled_rows(gpu_check_rows):
        assert row["graphs_run1"] >= 1 and row["graphs_run2"] == 0
        assert row["captures_run1"] == row["captures_run2"] == row["replays_run2"] == 0
        assert row["cudagraph_skips_run2"] == row["cudagraph_partitions_run2"] == 0
        assert row["calls_run1"] == row["calls_run2"] > 1


def profiled(key, device_type, seconds, annotation=False):
    """A profiler event as key_averages() gives it, with its own time on the host and device."""
    micro = seconds * 1e6
    kind = getattr(torch.autograd.DeviceType, device_type)
    times = dict(self_cpu_time_total=micro, self_device_time_total=micro)
    return types.SimpleNamespace(key=key, device_type=kind, is_user_annotation=annotation, **times)


def test_gpu_check_counts_each_kernel_once():
    """A GPU's profile: an operator (its device time is its kernel's), the kernel, and a user
    annotation around them: only the kernel's 2 ms, as on the device's timeline."""
    events = [profiled("aten::mm", "CPU", 0.002), profiled("gemm_kernel", "CUDA", 0.002)]
    events.append(profiled("## forward ##", "CUDA", 0.003, annotation=True))
    assert gpu_check.busy_seconds(events, cuda=True) == {"gemm_kernel": 0.002}
    assert sum(gpu_check.busy_seconds(events, cuda=False).values()) == 0.007  # the CPU's own


def test_gpu_check_dry_run_profiles_the_compiled_step(gpu_check_rows):
    (profile,) = gpu_check_rows["profile"]
    shares = profile["top_kernels"].values()
    assert 0 < profile["kernel_s"] and len(shares) == 8 and 0 < sum(shares) <= 1 + 1e-9


def test_gpu_check_dry_run_finds_the_cache_exact(gpu_check_rows):
    (cache,) = gpu_check_rows["cache"]
    assert cache["exact"] is True
