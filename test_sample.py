"""Tests of sample.py and experiments/, each against an independent computation: rows, bounds and
samples built by hand, closed forms, or a brute-force forward. CPU, tiny models, no downloads."""

import importlib.util
import json
import math
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import sample
import setdiff
from setdiff import Config, SetDiffusionLM, Tokenizer, elbo, generate, save_checkpoint

ROOT = Path(__file__).resolve().parent
# Tiny models gain nothing from intra-op threads; on a busy machine they only contend.
torch.set_num_threads(1)


def script(name: str):
    """experiments/<name>.py as a module, the way the tests call its functions."""
    spec = importlib.util.spec_from_file_location(
        f"experiments_{name}", ROOT / "experiments" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = script("bench")
compare = script("compare")
order_stats = script("order_stats")
plot = script("plot")

L, TOK, LETTERS = 24, Tokenizer.bytes(), "abcdefghijklmnopqrstuvwxyz"
VAL_TEXT = [f"the {w} sat on a mat." for w in ("cat", "dog", "fox", "owl", "hen", "ram")] * 3
VAL_TEXT += ["the end."]  # 18 lines fill 18 rows (L - 2 = 22 tokens a line): this one does not


def letters_model(order: str = "staggered", eos_first: bool = False, **kw) -> SetDiffusionLM:
    """A tiny random model (d=3, s=6) that writes lowercase letters only, so that given and
    generated text can be told apart: its head bias is +10 for letters and -10 for every other id
    (eos_first: +30 for EOS), far beyond the +-3 the random head weights add."""
    ids = dict(pad_id=TOK.pad_id, bos_id=TOK.bos_id, eos_id=TOK.eos_id, mask_id=TOK.mask_id)
    shape = dict(vocab_size=TOK.vocab_size, seq_len=L, n_layer=2, n_head=2, d_model=32, dropout=0.0)
    cfg = Config(order=order, set_size=3, **(shape | ids | kw))
    torch.manual_seed(0)
    model = SetDiffusionLM(cfg)
    bias = torch.tensor([10.0 if chr(i) in LETTERS else -10.0 for i in range(cfg.vocab_size)])
    if eos_first:
        bias[TOK.eos_id] = 30.0
    with torch.no_grad():
        for m in model.modules():  # a wide init: predictions depend on the context
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
                torch.nn.init.normal_(m.weight, std=3 / m.weight.shape[1] ** 0.5)
        torch.nn.init.normal_(model.head.weight, std=0.5)
        model.head.bias.copy_(bias)
    return model.eval()


def wrapped_by_hand(stream: list, bos, eos, pad=None) -> tuple:
    """Rows of L from a token stream: [BOS] + L-2 tokens + [EOS] (no BOS: L tokens); the rest in
    a last row padded with PAD where a PAD is given. -> (rows (n, L), tokens left over)."""
    body = L if bos is None else L - 2
    start = [] if bos is None else [bos]
    end = [] if bos is None else [eos]
    rows = [start + stream[k : k + body] + end for k in range(0, len(stream) - body + 1, body)]
    rest = stream[len(rows) * body :]
    if rest and pad is not None:
        rows.append(start + rest + [pad] * (L - len(start) - len(rest)))
        rest = []
    return torch.tensor(rows), rest


def released_folder(path: Path, model: SetDiffusionLM, vocab: list) -> Path:
    """A folder as the authors' push script writes a released SetDLM (config.json, the weights
    under their names in pytorch_model.bin, BERT's vocab.txt)."""
    cfg = model.cfg
    path.mkdir()
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    net = dict(_target_="backbone_dit.DIT", adaln=False, causal_attention=False, dropout=0.0)
    net |= dict(hidden_size=cfg.d_model, n_heads=cfg.n_head, num_layers=cfg.n_layer)
    noise = dict(desired_block_size=cfg.set_size, max_block_size=cfg.seq_len)
    spec = dict(architectures=["SetDLM"], backbone_config=net | dict(vocab_size=cfg.vocab_size))
    spec |= dict(noise_config=noise, length=cfg.seq_len, mask_token_id=cfg.mask_id)
    (path / "config.json").write_text(json.dumps(spec))
    theirs = {ours: name for name, ours in setdiff.RELEASED_NAMES.items()}
    state = {}
    for key, tensor in model.state_dict().items():
        key = "." + key
        for ours, name in theirs.items():
            key = key.replace(ours, name)
        state["backbone" + key] = tensor
    torch.save(state, path / "pytorch_model.bin")
    return path


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Checkpoints as train_small.py writes them (step, val_rows), and text files to score."""
    d = tmp_path_factory.mktemp("sample")
    (d / "val.txt").write_text("\n".join(VAL_TEXT) + "\n")
    (d / "short.txt").write_text("hello\n")
    (d / "empty.txt").write_text("")
    (d / "binary.txt").write_bytes(b"\xff\xfe\x00\x81 abc\n\x80\x80\xc3\n")
    stream = (np.arange(13 * (L - 2)) % 26 + ord("a")).reshape(13, L - 2)  # 13 rows by hand
    rows = np.concatenate([np.full((13, 1), TOK.bos_id), stream, np.full((13, 1), TOK.eos_id)], 1)
    rows.astype(np.uint16).tofile(d / "val.bin")
    val = {"path": str(d / "val.bin"), "rows": 13, "bytes_per_token": 1.0}
    other = {**val, "path": str(d / "val.txt")}  # other data than the judge's
    for name, rows in [
        ("st", val),
        ("ar", val),
        ("eos", val),
        ("gone", {**val, "path": "-"}),
        ("other", other),
    ]:
        model = letters_model("ar" if name == "ar" else "staggered", eos_first=name == "eos")
        save_checkpoint(d / f"{name}.pt", model, TOK, step=7, val_rows=rows)
    save_checkpoint(d / "noval.pt", letters_model(), TOK)
    save_checkpoint(d / "owt.pt", letters_model(bos_id=None, pad_id=None), TOK, val_rows=val)
    save_checkpoint(d / "l40.pt", letters_model(seq_len=40), TOK)
    (d / "cut.pt").write_bytes((d / "st.pt").read_bytes()[:2000])
    torch.save({"model": {}}, d / "foreign.pt")
    (d / "not-a-model").mkdir()
    return d


def run(capsys, *argv) -> tuple:
    try:
        code = sample.main([str(a) for a in argv])
    except SystemExit as e:  # argparse errors
        code = e.code
    return (code, *capsys.readouterr())


def ok(capsys, *argv) -> str:
    code, out, err = run(capsys, *argv)
    assert code == 0 and "error" not in err and "Traceback" not in err, err
    return out


def samples_of(out: str) -> list:  # [(header, text)] of every '--- sample i/n: ...' (one line)
    lines = out.splitlines()
    return [(line, lines[i + 1]) for i, line in enumerate(lines) if line.startswith("--- sample ")]


def calls_of(header: str) -> int:
    return int(re.search(r": (\d+) network calls, [\d.]+ tokens/call, [\d,]+ tokens/s$", header)[1])


# ---------------------------------------------------------------------------- sample.py: sampling
def test_sample_unconditional_and_prompt_with_speed_lines(ckpts, capsys):
    args = ("--ckpt", ckpts / "st.pt", "--num-samples", 3, "--batch-size", 2)
    out = ok(capsys, *args)
    assert re.search(r"^device: cpu \(.*\); float32 \(.*\); \d+ threads \(.*\)$", out, re.M)
    found = [t for h, t in samples_of(out) if calls_of(h) > 0]
    assert [h[:15] for h, _ in samples_of(out)] == [f"--- sample {i}/3:" for i in (1, 2, 3)]
    assert all(re.fullmatch(f"[a-z]{{{L - 1}}}", t) for t in found) and len(set(found)) == 3
    assert [t for _, t in samples_of(ok(capsys, *args))] == found  # --seed
    assert [t for _, t in samples_of(ok(capsys, *args, "--seed", 1))] != found
    out = ok(capsys, "--ckpt", ckpts / "st.pt", "--prompt", "Hi, you", "--max-new-tokens", 9)
    ((header, text),) = samples_of(out)
    assert re.fullmatch(r"Hi, you[a-z]{9}", text) and calls_of(header) == 9  # tau > 1: one a call


def test_sample_in_bounded_batches(ckpts, capsys, monkeypatch):
    """More samples than --batch-size: every sample, from calls of at most --batch-size rows, the
    same as drawing the batches by hand from one generator; without --batch-size, even 10^9
    samples start with a small batch."""
    out = ok(
        capsys, "--ckpt", ckpts / "st.pt", "--num-samples", 5, "--batch-size", 2, "--top-p", 0.9
    )
    g = torch.Generator().manual_seed(0)
    by_hand = []
    for B in (2, 2, 1):
        rows = generate(letters_model(), batch_size=B, window=3, top_p=0.9, generator=g).tokens
        by_hand += [TOK.decode(row) for row in rows]
    assert [t for _, t in samples_of(out)] == by_hand
    sizes = []

    def first_batch_only(model, batch_size, **kw):
        sizes.append(batch_size)
        raise KeyboardInterrupt  # stop after the first call

    monkeypatch.setattr(setdiff, "generate", first_batch_only)
    code, _, err = run(capsys, "--ckpt", ckpts / "st.pt", "--num-samples", 10**9)
    assert code == 130 and sizes == [16] and err == "interrupted\n"


def test_sample_ctrl_c_is_one_line_and_exit_130(ckpts, capsys, monkeypatch):
    def interrupted(*args, **kw):  # Ctrl-C while sampling: the signal itself, not a stand-in
        signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(setdiff, "generate", interrupted)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code, out, err = run(capsys, "--ckpt", ckpts / "st.pt")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert code == 130 and err == "interrupted\n" and "Traceback" not in out


@pytest.mark.parametrize(
    "template,pattern",
    [
        ("A [MASK]. B [MASK][MASK]!", r"A [a-z]\. B [a-z]{2}!"),
        ("X ___ Y", r"X [a-z]{3} Y"),
        ("___5 Z ___2", r"[a-z]{5} Z [a-z]{2}"),
    ],
)
def test_sample_infill_fills_only_the_holes(ckpts, capsys, template, pattern):
    args = ("--infill", template, "--span-len", 3, "--threshold", 0.5, "--num-samples", 2)
    texts = [t for _, t in samples_of(ok(capsys, "--ckpt", ckpts / "st.pt", *args))]
    assert len(texts) == 2 and all(re.fullmatch(pattern, t) for t in texts), texts


def test_sample_show_order_marks_every_set(ckpts, capsys):
    args = ("--prompt", "Go", "--threshold", 0.3, "--temperature", 0, "--window", 6, "--show-order")
    out = ok(capsys, "--ckpt", ckpts / "st.pt", *args)
    ((header, text),) = samples_of(out)
    picture, summary = out.split("--- decode order:\n")[1].splitlines()[:2]
    runs = [(t, int(s)) for t, s in re.findall(r"\[([a-z]+)\](\d+)", picture)]
    assert picture == "Go" + "".join(f"[{t}]{s}" for t, s in runs)
    assert "Go" + "".join(t for t, _ in runs) == text
    sizes = [sum(len(t) for t, s in runs if s == step) for step in range(calls_of(header))]
    assert min(sizes) >= 1 and max(sizes) > 1 and sum(sizes) == L - 3  # every call one set
    assert summary == "--- network calls revealed: " + ", ".join(
        f"{sizes.count(n)} x {n} token{'s' * (n > 1)}" for n in sorted(set(sizes))
    )
    ids = [TOK.bos_id, *b"abcde", TOK.eos_id, TOK.pad_id]
    steps = [-1, -1, -1, 1, 1, 0, 2, setdiff.ERASED]
    assert sample.decode_order(TOK, ids, steps).splitlines()[1:] == [
        "ab[cd]1[e]0[\\n]2",
        "--- network calls revealed: 2 x 1 token, 1 x 2 tokens",
    ]


def test_sample_stop_at_eos(ckpts, capsys):
    """EOS beats every letter: with --stop-at-eos the sample ends at its first generated EOS."""
    common = ("--ckpt", ckpts / "eos.pt", "--prompt", "Hi", "--temperature", 0)
    ((header, text),) = samples_of(ok(capsys, *common, "--stop-at-eos"))
    ((full, _),) = samples_of(ok(capsys, *common))
    assert text == "Hi" and calls_of(header) < calls_of(full) == L - 3


def test_sample_without_bos_and_from_a_released_folder(ckpts, capsys, tmp_path):
    """A model without BOS (as GPT-2/OWT) starts from EOS and takes the prompt as it is; a
    released model's folder samples, and has no validation rows of its own."""
    ((_, text),) = samples_of(
        ok(capsys, "--ckpt", ckpts / "owt.pt", "--prompt", "Hi", "--max-new-tokens", 5)
    )
    assert re.fullmatch("Hi[a-z]{5}", text)  # no BOS in front: nothing left out of the text
    out = ok(capsys, "--ckpt", ckpts / "owt.pt", "--max-new-tokens", 4)
    assert re.fullmatch("[a-z]{4}", samples_of(out)[0][1])  # after EOS, the start of a document
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", *LETTERS]
    ids = dict(pad_id=0, bos_id=2, eos_id=2, mask_id=4, vocab_size=len(vocab))
    model = letters_model(**ids)
    with torch.no_grad():  # words and letters only: no [PAD], no [CLS] (EOS, a line break)
        model.head.bias.copy_(torch.tensor([-10.0] * 5 + [10.0] * (len(vocab) - 5)))
    folder = released_folder(tmp_path / "lm1b-setdlm", model, vocab)
    out = ok(capsys, "--ckpt", folder, "--prompt", "the cat", "--max-new-tokens", 3)
    assert "(released model)" in out and re.fullmatch(r"the cat( \S+){3}", samples_of(out)[0][1])
    code, _, err = run(capsys, "--ckpt", folder, "--eval")
    assert code == 2 and "pass --eval FILE" in err


# ---------------------------------------------------------------------------- sample.py: --eval
def test_sample_eval_equals_the_bound_on_wrapped_rows(ckpts, capsys):
    """--eval FILE: the bound on rows built by hand, the text after the last whole row in a
    padded row; every byte of the text counted (ASCII: a byte a token, a newline per EOS)."""
    out = ok(capsys, "--ckpt", ckpts / "st.pt", "--eval", ckpts / "val.txt", "--num-orders", 2)
    stream = [i for line in VAL_TEXT for i in TOK.encode(line) + [TOK.eos_id]]
    rows, rest = wrapped_by_hand(stream, TOK.bos_id, TOK.eos_id, TOK.pad_id)
    assert rest == [] and (rows[-1] == TOK.pad_id).any()  # the tail is in a padded row
    res = elbo(letters_model(), rows, num_orders=2, generator=torch.Generator().manual_seed(0))
    assert f"val {res.line(len(stream))}" in out and "padded with PAD" in out
    out = ok(capsys, "--ckpt", ckpts / "st.pt", "--eval", ckpts / "short.txt")  # < one row
    row = torch.tensor([[TOK.bos_id, *b"hello", TOK.eos_id] + [TOK.pad_id] * (L - 7)])
    res = elbo(letters_model(), row, generator=torch.Generator().manual_seed(0))
    assert f"val {res.line(6)}" in out and res.tokens_scored == 6  # padding is never scored
    out = ok(
        capsys,
        "--ckpt",
        ckpts / "st.pt",
        "--eval",
        "--eval-rows",
        4,
        "--batch-size",
        2,
        "--seed",
        3,
    )
    val = np.fromfile(ckpts / "val.bin", dtype=np.uint16).astype(np.int64)
    val = torch.from_numpy(val).view(-1, L)
    res = elbo(letters_model(), val[:4], generator=torch.Generator().manual_seed(3))
    assert f"val {res.line(4 * (L - 2))}" in out and "validation split" in out  # no FILE


def test_sample_eval_without_pad_says_what_it_left_out(ckpts, capsys):
    """No PAD (as OWT): plain L-token rows, position 0 given; the tail cannot be scored and the
    output says how much of the text that is."""
    out = ok(capsys, "--ckpt", ckpts / "owt.pt", "--eval", ckpts / "val.txt")
    stream = [i for line in VAL_TEXT for i in TOK.encode(line) + [TOK.eos_id]]
    rows, rest = wrapped_by_hand(stream, None, None)
    model = letters_model(bos_id=None, pad_id=None)
    res = elbo(model, rows, generator=torch.Generator().manual_seed(0))
    assert f"val {res.line(len(rows) * (L - 1))}" in out and len(rest) > 0
    assert f"not scored: the text's last {len(rest)} tokens (~{len(rest)} bytes)" in out


# ---------------------------------------------------------------------------- experiments/bench.py
@torch.no_grad()
def test_plain_decoder_is_an_exact_kv_cached_causal_decoder():
    """The bench's peer, greedy: each token is the argmax of ONE cache-free causal forward over
    the finished rows."""
    model = letters_model()
    model.head.bias.zero_()  # greedy over letters alone soon repeats one: over all ids it varies
    prompt = torch.tensor([[TOK.bos_id, 104, 105], [TOK.bos_id, 120, 121]])  # prefilled in one call
    plain = bench.plain_decoder(model, prompt, L - 3, temperature=0, top_p=1)
    causal = torch.ones(1, L - 1, L - 1).tril().bool()
    h = model.run(plain.tokens[:, :-1], torch.arange(L - 1).expand(2, -1), causal)
    assert torch.equal(plain.tokens[:, :3], prompt)
    assert torch.equal(model.logits(h).argmax(-1)[:, 2:], plain.tokens[:, 3:])
    assert plain.tokens[:, 3:].unique().numel() > 3 and plain.nfe == L - 3
    assert plain.tokens_per_step == 1 and plain.reveal_step[1].tolist() == [-1] * 3 + list(
        range(L - 3)
    )


def test_bench_checks_the_cache_in_float64(monkeypatch):
    """The check runs on a float64 copy (the model itself stays float32), passes for the real
    cache, and fails for a cache that forgets what it stored."""
    model = letters_model()
    seen = []

    def spy(m, **kw):
        seen.append(next(m.parameters()).dtype)
        return generate(m, **kw)

    monkeypatch.setattr(setdiff, "generate", spy)
    assert bench.cache_is_exact(model, 3, window=4)
    assert seen == [torch.float64] * 2 and next(model.parameters()).dtype == torch.float32
    store = setdiff.KVCache.store

    def forgetful(cache, new_idx, new_valid):  # stores nothing after the first call
        if not cache.filled.any():
            store(cache, new_idx, new_valid)

    monkeypatch.setattr(setdiff.KVCache, "store", forgetful)
    assert not bench.cache_is_exact(model, 3, window=4)


def test_bench_concludes_only_when_the_repeats_agree():
    samplers = bench.variants(letters_model().cfg, dict(temperature=1.0, top_p=1.0))
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


def test_bench_and_order_stats_as_scripts(ckpts):
    argv = [
        "experiments/bench.py",
        "--ckpt",
        str(ckpts / "st.pt"),
        "--repeats",
        "1",
        "--batch-sizes",
        "1",
        "2",
    ]
    r = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "command: python " + " ".join(argv) in r.stdout and "warm-up round done" in r.stdout
    assert re.search(r"^device: cpu \(.+\); float32 \(.+\); \d+ threads \(.+\)$", r.stdout, re.M)
    row = r"^\| (plain|cached|cache-free|w=[ds]=\d)[^|]* \|( [\d.,]+ \|){4} [\d.]+x \|$"
    rows = re.findall(row, r.stdout, re.M)
    assert len(rows) == 15 and rows[0][0] == "plain"
    assert "cached = cache-free (greedy, float64, batch 2): yes" in r.stdout
    verdict = (
        r"^batch [12], (greedy|w=[ds]=[36]): the (KV cache|set sampler|plain decoder|repeats) "
    )
    assert len(re.findall(verdict, r.stdout, re.M)) == 6
    argv = ["experiments/order_stats.py", "--ckpt", str(ckpts / "l40.pt")]
    r = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    names = re.findall(r"^\| (.+?) \|", r.stdout, re.M)[1:]
    assert r.returncode == 0 and names == ["staggered d=3, s=6", "ar", "block d=3", "uniform"]
    assert "| ar | 1.000 | 1.000 | 0.00 | 0.00 |" in r.stdout and "positions 16..23)" in r.stdout
    r = subprocess.run(
        [sys.executable, "experiments/order_stats.py", "--ckpt", str(ckpts / "st.pt")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "L >= 33" in r.stderr


@pytest.mark.parametrize(
    "order,d,s,want",
    [
        ("staggered", 4, 8, (0.670, 0.432, 1.01, 0.87)),  # the authors' reference sampler; a pin
        (
            "block",
            4,
            None,
            (0.625, 25 / 48, 0.75, 0.75),
        ),  # 1/4 + 3/4 * 1/2, (1 + 1/2 + 1/3 + 1/4) / 4
        ("uniform", 128, 128, (0.5, 0.2, 8, 2)),  # 1/2, 1/5, 16/2, 4/2
    ],
)
def test_order_stats_closed_forms(order, d, s, want):
    """Through sample_order, the path training uses (L = 128, 4,000 orders, positions 16..111):
    P(left neighbour first), P(all 4 left neighbours first), E(still masked of the 16 to the
    left), E(revealed of the 4 to the right). Seeds 0-2 spread by 0.001 and 0.003."""
    got = order_stats.order_stats(Config(seq_len=128, order=order, set_size=d, max_set_size=s))
    assert got[:2] == pytest.approx(want[:2], abs=0.004)
    assert got[2:] == pytest.approx(want[2:], abs=0.015)


# ---------------------------------------------------------------------------- compare.py, plot.py
def test_compare_on_tiny_checkpoints_writes_the_figures_data(ckpts, tmp_path, capsys):
    argv = [ckpts / "ar.pt", ckpts / "st.pt", "--judge", ckpts / "ar.pt", "--samples", 3]
    assert compare.main([*argv, "--eval-rows", 4, "--json", tmp_path / "cmp.json"]) == 0
    out = capsys.readouterr().out
    assert len(re.findall(r"^\| staggered d=3, s=6 \| [36] \| (>1|0\.\d+) \|", out, re.M)) == 2 * 8
    assert re.search(
        r"^\| ar \| [\d.]+ \| [\d.]+ \+- [\d.]+ \| [\d.]+ \| 92 \|$", out, re.M
    )  # 4 x 23
    cmp = json.loads((tmp_path / "cmp.json").read_text())
    assert [b["num_orders"] for b in cmp["bounds"]] == [4, 4] and len(cmp["samples"]) == 1 + 16
    x = torch.from_numpy(np.fromfile(ckpts / "val.bin", dtype=np.uint16).astype(np.int64)).view(
        -1, L
    )
    res = elbo(letters_model(), x[:4], num_orders=4, generator=torch.Generator().manual_seed(0))
    assert cmp["bounds"][1]["nll_per_token"] == pytest.approx(res.nll_per_token, rel=1e-6)
    assert cmp["bounds"][1]["bits_per_byte"] == pytest.approx(res.nll / math.log(2) / (4 * (L - 2)))
    lines = plot.frontier(cmp)
    assert list(lines) == ["ar, w=1", "staggered d=3, s=6, w=3", "staggered d=3, s=6, w=6"]
    assert all(points == sorted(points) and points[0][0] >= 1 for points in lines.values())
    reach = plot.within(cmp)
    base = {
        (r["model"], r["window"]): r["judge_nll"] for r in cmp["samples"] if r["threshold"] is None
    }
    for name, value in reach.items():  # by hand: the most tokens per call within 1.1 x its base
        mine = [r for r in cmp["samples"] if f"{r['model']}, w={r['window']}" == name]
        close = [
            r["tokens_per_call"]
            for r in mine
            if r["judge_nll"] <= 1.1 * base[mine[0]["model"], mine[0]["window"]]
        ]
        assert value == max(close)


def test_compare_checks_before_the_work(ckpts, tmp_path, capsys):
    cases = [
        ([ckpts / "st.pt", "--judge", ckpts / "st.pt"], "--order ar"),
        ([ckpts / "other.pt", "--judge", ckpts / "ar.pt"], "not trained on the data"),
        (
            [ckpts / "st.pt", "--judge", ckpts / "ar.pt", "--json", tmp_path / "no/such/x.json"],
            "folder does not exist",
        ),
    ]
    for argv, message in cases:
        assert compare.main(argv) == 2
        out, err = capsys.readouterr()
        assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1
        assert "model:" not in out  # nothing scored before the error


def test_plot_prints_the_tables(tmp_path, capsys, monkeypatch):
    """The training-curve table of metrics.jsonl files, the 10% rule of a --json; the figures
    go to ASSETS (here a temporary folder), or a one-line error says matplotlib is missing."""
    records = [
        dict(kind="val", tokens=200, bits_per_byte=3.5),
        dict(kind="train", tokens=100, loss=1.0),
    ]
    records += [dict(kind="val", tokens=100, bits_per_byte=4.25)]
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "b.jsonl").write_text(
        json.dumps(dict(kind="val", tokens=100, bits_per_byte=5.0)) + "\n"
    )
    assert plot.training_curve(tmp_path / "a" / "metrics.jsonl") == [(100, 4.25), (200, 3.5)]
    samples = [dict(model="m", window=2, threshold=None, tokens_per_call=1.0, judge_nll=2.0)]
    samples += [
        dict(model="m", window=2, threshold=0.5, tokens_per_call=t, judge_nll=n)
        for t, n in ((1.5, 2.19), (3.0, 2.3))
    ]
    (tmp_path / "cmp.json").write_text(
        json.dumps(dict(samples=samples, validation=dict(judge_nll=1.0)))
    )
    monkeypatch.setattr(plot, "ASSETS", tmp_path)
    code = plot.main(
        [
            str(tmp_path / "a" / "metrics.jsonl"),
            str(tmp_path / "b.jsonl"),
            str(tmp_path / "cmp.json"),
        ]
    )
    out, err = capsys.readouterr()
    assert (
        "| training tokens | a | b |" in out
        and "| 100 | 4.250 | 5.000 |" in out
        and "| 200 | 3.500 | nan |" in out
    )
    assert "| m, w=2 | 1.50 |" in out  # 2.19 <= 1.1 x 2.0 < 2.3
    if importlib.util.find_spec("matplotlib"):
        assert (
            code == 0
            and (tmp_path / "training.png").exists()
            and (tmp_path / "frontier.png").exists()
        )
    else:
        assert code == 2 and err == "error: drawing needs matplotlib (pip install matplotlib)\n"
    assert (
        plot.main([str(tmp_path / "x.txt")]) == 2 and "at most one .json" in capsys.readouterr().err
    )


def test_text_statistics_closed_forms():
    judge = letters_model("ar")
    x = torch.tensor([[TOK.bos_id, *TOK.encode("the cat sat on the mat, it sat")[:23]]])
    logp = torch.log_softmax(judge(x, torch.arange(L)[None]).double(), -1)
    got = compare.text_stats(judge, x)
    assert got["judge_nll"] == pytest.approx(
        -logp[:, 1:].gather(-1, x[:, 1:, None]).mean().item(), rel=1e-5
    )
    p = torch.tensor([x[0, 1:].tolist().count(c) for c in set(x[0, 1:].tolist())]) / 23  # no BOS
    assert got["unigram_entropy"] == pytest.approx(-(p * p.log2()).sum().item())
    assert (
        got["distinct_4grams"] == len({tuple(x[0, i : i + 4].tolist()) for i in range(1, 21)}) / 20
    )
    same = torch.tensor([[TOK.bos_id] + [7] * 23] * 2)
    assert compare.text_stats(judge, same)["distinct_4grams"] == 1 / 40


# ---------------------------------------------------------------------------- sample.py: bad input
BAD_INPUT = [  # (arguments: {d} the checkpoint folder, {st} a good checkpoint; what stderr says)
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


@pytest.mark.parametrize("argv,message", BAD_INPUT)
def test_sample_bad_input(ckpts, capsys, argv, message):
    code, _, err = run(capsys, *argv.format(d=ckpts, st=f"--ckpt {ckpts}/st.pt").split())
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert message in err, err
