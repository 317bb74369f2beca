"""Tests of train_small.py, each against an independent computation: rows built by hand, the
split recomputed from the hash, an uninterrupted run, one process. CPU, a few seconds each."""

import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import train_small
from setdiff import Config, SetDiffusionLM, Tokenizer, load_checkpoint

BYTES = Tokenizer.bytes()
# Tiny models gain nothing from intra-op threads, and contention on a busy machine slows them.
torch.set_num_threads(1)

SHAPE = "--n-layer 1 --n-head 2 --d-model 32 --seq-len 32".split()
TRAIN = "--batch-size 8 --lr 3e-3 --warmup-steps 4 --eval-rows 8 --workers 1 --log-every 4"
TRAIN = (TRAIN + " --val-fraction 0.1 --threads 1").split()
# The vocab of a tiny BERT-style WordPiece tokenizer: ids 0-4 are the specials.
WORDS = "the cat sat . , £ 5 ##5 it costs dog ran a on mat to big red house".split()
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]


@pytest.fixture(autouse=True)
def one_thread():
    yield
    torch.set_num_threads(1)  # a run may pick another count (--threads)


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


def byte_row(text: str) -> list:
    """A bytes row written as text: ^ is BOS, $ is EOS."""
    special = {"^": BYTES.bos_id, "$": BYTES.eos_id}
    return [special.get(ch, ord(ch)) for ch in text]


def write_vocab(path):
    path.write_text("\n".join(VOCAB) + "\n")
    return path


def run_argv(tmp_path, out="run", *extra, shape=SHAPE):
    data = ["--data", str(tmp_path / "corpus.txt"), "--cache-dir", str(tmp_path / "cache")]
    return [*data, "--out", str(tmp_path / out), *shape, *TRAIN, *extra]


def resume_argv(tmp_path, out, steps):
    cache = ["--cache-dir", str(tmp_path / "cache")]
    return ["--resume", "--out", str(tmp_path / out), *cache, "--max-steps", str(steps)]


def logged(out, kind):
    records = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return [r for r in records if r["kind"] == kind]


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def assert_one_error_line(err, needle):
    """One 'error: ...' line on stderr (progress bars aside), no traceback."""
    lines = err.replace("\r", "\n").splitlines()
    assert "Traceback" not in err, err
    errors = [line for line in lines if line.startswith("error")]
    assert len(errors) == 1 and needle in errors[0], err
    assert all("%|" in line or not line.strip() for line in lines if line not in errors), err


# ---------------------------------------------------------------------------- text -> rows
def test_lm1b_detokenize_rules_by_hand():
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


def test_line_ids_detokenize_wordpiece_lines(tmp_path):
    tok = Tokenizer.from_vocab(write_vocab(tmp_path / "vocab.txt"))
    # "£ 5" detokenized is "£5": "£" is no BERT punctuation, so "5" continues the word (##5)
    assert train_small.line_ids(tok, "It costs £ 5 .") == ids_of("it costs £ ##5 . [CLS]")
    assert tok.encode("It costs £ 5 .") == ids_of("it costs £ 5 .")  # not detokenized
    assert train_small.line_ids(BYTES, "a , b") == [*b"a , b", BYTES.eos_id]  # bytes: as it is


def test_wrap_rows_by_hand():
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


def test_wrapped_rows_equal_hand_built_rows(tmp_path):
    """EOS after each line, chunks of L-2, [BOS] + chunk + [EOS], each side its own stream."""
    f = tmp_path / "t.txt"
    f.write_bytes(b"ab\n\ncde\r\n  f  \nklm\nghij\nrs\n")  # blank: no sentence; CRLF, spaces go
    assert [side(x, 0.5) for x in (b"ab", b"cde", b"f", b"ghij")] == ["train"] * 4
    assert [side(x, 0.5) for x in (b"klm", b"rs")] == ["val"] * 2
    rows, meta = train_small.prepare_rows([f], BYTES, 6, tmp_path / "c", 0.5, verbose=False)
    # train: a b $ c d e $ f $ g h i j $ -> [a b $ c] [d e $ f] [$ g h i], [j $] left over
    assert rows["train"].tolist() == [byte_row("^ab$c$"), byte_row("^de$f$"), byte_row("^$ghi$")]
    assert rows["val"].tolist() == [byte_row("^klm$$")]  # k l m $, then [r s $] left over
    assert rows["train"].dtype == np.uint16
    assert meta["splits"]["train"] == {"rows": 3, "lines": 4, "tokens": 14, "text_bytes": 14}
    assert meta["splits"]["val"] == {"rows": 1, "lines": 2, "tokens": 7, "text_bytes": 7}


def test_wordpiece_rows_put_cls_after_every_sentence(tmp_path):
    """LM1B rows as the authors' models were trained on: [CLS] + L-2 tokens + [CLS]."""
    tok = Tokenizer.from_vocab(write_vocab(tmp_path / "vocab.txt"))
    lines = ["the cat sat .", "a cat ran .", "the cat , the dog .", "the dog ran ."]
    (tmp_path / "lm1b.txt").write_text("\n".join(lines) + "\n")
    assert [side(x.encode(), 0.5) for x in lines] == ["val", "train", "train", "val"]
    rows, _ = train_small.prepare_rows([tmp_path / "lm1b.txt"], tok, 6, tmp_path / "c", 0.5)
    # train: a cat ran . [CLS] the cat , the dog . [CLS] -> 3 rows of 4, nothing left over
    train = ["a cat ran .", "[CLS] the cat ,", "the dog . [CLS]"]
    assert rows["train"].tolist() == [ids_of(f"[CLS] {r} [CLS]") for r in train]
    # val: the cat sat . [CLS] the dog ran . [CLS] -> 2 rows, [. [CLS]] left over
    val = ["the cat sat .", "[CLS] the dog ran"]
    assert rows["val"].tolist() == [ids_of(f"[CLS] {r} [CLS]") for r in val]


def test_gpt2_rows_are_plain_chunks_of_the_document_stream(tmp_path):
    vocab = {"a": 0, "b": 1, "Ġ": 2, "ab": 3, "Ġab": 4, "<|endoftext|>": 5}  # Ġ: a space
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\nĠ ab\n")
    tok = train_small.load_tokenizer(str(tmp_path / "vocab.json"))
    assert (tok.kind, tok.bos_id, tok.eos_id, tok.mask_id) == ("bpe", None, 5, 6)
    lines = ["ab", "ba ab", "ab ab", "ba"]
    (tmp_path / "owt.txt").write_text("\n".join(lines) + "\n")
    assert [side(x.encode(), 0.5) for x in lines] == ["train", "train", "val", "val"]
    rows, _ = train_small.prepare_rows([tmp_path / "owt.txt"], tok, 4, tmp_path / "c", 0.5)
    # train: ab E | b a Ġab E -> [3 5 1 0], [4 5] left over; val: ab Ġab E | b a E
    assert rows["train"].tolist() == [[3, 5, 1, 0]]
    assert rows["val"].tolist() == [[3, 4, 5, 1]]


def test_held_out_lines_by_content_hash_and_every_row_bos_eos(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.txt")
    rows, meta = train_small.prepare_rows([corpus], BYTES, 32, tmp_path / "c", 0.1, verbose=False)
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


def test_row_cache_reused_and_rebuilt_on_changed_input(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus.txt")
    cache = tmp_path / "c"
    rows1, meta1 = train_small.prepare_rows([corpus], BYTES, 32, cache, 0.1)
    built = Path(rows1["train"].filename)
    stamp = built.stat().st_mtime_ns
    capsys.readouterr()
    rows2, meta2 = train_small.prepare_rows([corpus], BYTES, 32, cache, 0.1)
    assert "reusing" in capsys.readouterr().out and built.stat().st_mtime_ns == stamp
    assert meta2 == meta1
    with open(corpus, "a") as f:
        f.write("A brand new sentence that was not there before.\n" * 20)
    rows3, meta3 = train_small.prepare_rows([corpus], BYTES, 32, cache, 0.1)
    assert "reusing" not in capsys.readouterr().out
    new = 20 * (side(b"A brand new sentence that was not there before.", 0.1) == "train")
    assert meta3["splits"]["train"]["lines"] == meta1["splits"]["train"]["lines"] + new
    assert meta3["sources"][0]["size"] == corpus.stat().st_size
    assert not list(cache.rglob("*.tmp-*"))


def test_parallel_tokenization_equals_serial(tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "corpus.txt", lines=3000)
    serial, _ = train_small.prepare_rows([corpus], BYTES, 32, tmp_path / "a", 0.1, 1, False)
    monkeypatch.setattr(train_small, "CHUNK_BYTES", 4096)  # ~30 chunks over 2 spawned workers
    contexts = []
    real_context = train_small.multiprocessing.get_context

    def get_context(method):  # the workers really start
        contexts.append(method)
        return real_context(method)

    monkeypatch.setattr(train_small.multiprocessing, "get_context", get_context)
    parallel, _ = train_small.prepare_rows([corpus], BYTES, 32, tmp_path / "b", 0.1, 2, False)
    assert contexts == ["spawn"]
    for part in ("train", "val"):
        assert len(serial[part]) > 10
        np.testing.assert_array_equal(serial[part], parallel[part])


def test_bad_lines_are_skipped_and_counted(tmp_path):
    f = tmp_path / "t.txt"
    long_line = b"x" * 300_000  # longer than a chunk: it stays whole
    f.write_bytes(
        b"ok one\r\n\xff\xfe broken\nnul \x00 byte\n" + long_line + b"\nok two\nklm\nrs\n"
    )
    rows, meta = train_small.prepare_rows([f], BYTES, 8, tmp_path / "c", 0.5, verbose=False)
    good = [b"ok one", long_line, b"ok two", b"klm", b"rs"]
    for part in ("train", "val"):
        text = b"".join(x + b"\n" for x in good if side(x, 0.5) == part)
        stream = np.frombuffer(text, np.uint8).astype(np.uint16)
        body = np.where(stream == ord("\n"), BYTES.eos_id, stream)[: len(stream) // 6 * 6]
        np.testing.assert_array_equal(np.asarray(rows[part])[:, 1:-1], body.reshape(-1, 6))
    assert meta["bad_lines"] == 2
    assert meta["splits"]["train"]["lines"] + meta["splits"]["val"]["lines"] == 5


def test_builtin_corpus_is_deterministic_prose(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "tests").mkdir(parents=True)  # test folders are skipped
    (pkg / "tests" / "t.py").write_text(
        '"""Tests are skipped entirely by the walk over the tree."""\n'
    )
    (pkg / "b.py").write_text(
        '"""A file that does not parse is skipped, whatever it says."""\nprint "x"\n'
    )
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


# ---------------------------------------------------------------------------- training runs
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
    assert [v["step"] for v in val] == [8, 16] and all(
        v["bytes"] == v["num_seqs"] * 30 for v in val
    )
    assert train_small.main(run_argv(tmp_path, "split", *steps, "8")) == 0
    assert train_small.main(resume_argv(tmp_path, "split", 16)) == 0
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


def test_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, capsys):
    write_corpus(tmp_path / "corpus.txt")
    assert train_small.main(run_argv(tmp_path, "run", "--max-steps", "4", "--eval-every", "4")) == 0
    before = (tmp_path / "run" / "ckpt.pt").read_bytes()
    capsys.readouterr()

    def disk_full(obj, f, *args, **kwargs):  # what torch.save raises on a full disk, part-way
        open(f, "wb").write(b"partial")
        raise RuntimeError(
            "PytorchStreamWriter failed writing file data/0: (No space left on device)"
        )

    monkeypatch.setattr(torch, "save", disk_full)
    assert train_small.main(resume_argv(tmp_path, "run", 8)) == 2
    assert_one_error_line(capsys.readouterr().err, "No space left on device")
    assert (tmp_path / "run" / "ckpt.pt").read_bytes() == before
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [
        "best.pt",
        "ckpt.pt",
        "metrics.jsonl",
    ]


BAD_INPUT = [  # (flags, what the one error line says)
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


@pytest.mark.parametrize("flags,needle", BAD_INPUT)
def test_bad_input_one_line_exit_2_nothing_touched(tmp_path, monkeypatch, capsys, flags, needle):
    monkeypatch.chdir(write_corpus(tmp_path / "corpus.txt").parent)
    (tmp_path / "empty.txt").write_text("\n  \n")
    (tmp_path / "blob.bin").write_bytes(
        bytes(random.Random(0).randrange(128, 256) for _ in range(5000))
    )
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


def test_compile_gives_the_uncompiled_run(tmp_path, monkeypatch):
    """--compile traces the step with dynamo; the eager backend keeps the test fast (inductor
    takes about a minute on a CPU) and must give the same weights as no --compile."""
    write_corpus(tmp_path / "corpus.txt")
    steps = ["--max-steps", "4", "--eval-every", "4"]
    assert train_small.main(run_argv(tmp_path, "plain", *steps)) == 0
    real_compile = torch.compile
    compiled_modules = []

    def compile_eagerly(module):
        compiled_modules.append(type(module).__name__)
        return real_compile(module, backend="eager")

    monkeypatch.setattr(torch, "compile", compile_eagerly)
    assert train_small.main(run_argv(tmp_path, "compiled", *steps, "--compile")) == 0
    assert compiled_modules == ["TrainStep"]  # the loss, as DDP and compile see it
    plain = load_checkpoint(tmp_path / "plain" / "ckpt.pt")[2]["train_model"]
    compiled = load_checkpoint(tmp_path / "compiled" / "ckpt.pt")[2]["train_model"]
    assert all(torch.allclose(plain[k], compiled[k], atol=1e-6) for k in plain)


def test_a_data_glob_stands_for_its_files_sorted(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.txt").read_text().splitlines(keepends=True)
    (tmp_path / "part-2.txt").write_text("".join(corpus[300:]))
    (tmp_path / "part-1.txt").write_text("".join(corpus[:300]))
    glob_argv = run_argv(tmp_path, "glob", "--max-steps", "1")
    glob_argv[1] = str(tmp_path / "part-*.txt")  # quoted: the glob itself, not the shell's
    assert train_small.main(glob_argv) == 0
    assert load_checkpoint(tmp_path / "glob" / "ckpt.pt")[2]["args"]["data"] == glob_argv[1:2]
    meta = json.loads(next((tmp_path / "cache").glob("rows-*/meta.json")).read_text())
    files = [Path(source["path"]).name for source in meta["sources"]]
    assert files == ["part-1.txt", "part-2.txt"]


def test_out_is_checked_before_the_data_work(tmp_path, monkeypatch, capsys):
    write_corpus(tmp_path / "corpus.txt")
    (tmp_path / "file").write_text("not a folder")
    (tmp_path / "locked").mkdir()
    real_access = os.access

    def access(path, mode):  # a read-only folder (as root, chmod would not stop a write)
        return Path(path).name != "locked" and real_access(path, mode)

    monkeypatch.setattr(os, "access", access)
    for out, needle in [
        ("file", "is a file"),
        ("file/run", "is a file"),
        ("locked/run", "not writable"),
    ]:
        assert train_small.main(run_argv(tmp_path, out, "--max-steps", "1")) == 2
        err = capsys.readouterr().err
        assert_one_error_line(err, f"--out {tmp_path / out}")
        assert needle in err
    assert not (tmp_path / "cache").exists()  # no data work was done
    assert list((tmp_path / "locked").iterdir()) == []


def broken_step(run, step):
    raise OSError("the disk went away")


def test_resume_refuses_changed_settings_and_a_cut_off_log_line(tmp_path, monkeypatch, capsys):
    write_corpus(tmp_path / "corpus.txt")
    assert train_small.main(run_argv(tmp_path, "run", "--max-steps", "4", "--eval-every", "4")) == 0
    capsys.readouterr()
    assert train_small.main([*resume_argv(tmp_path, "run", 8), "--n-layer", "2"]) == 2
    assert_one_error_line(capsys.readouterr().err, "--n-layer 2 differs from the resumed run's 1")
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "kind": "train"}\n{"step": 1')  # after the checkpoint; cut off
    assert train_small.main([*resume_argv(tmp_path, "run", 6), "--log-every", "2"]) == 0
    assert [m["step"] for m in logged(tmp_path / "run", "train")] == [4, 6]
    # --force starts over: the old run's checkpoints go at once, not at the new run's first save
    monkeypatch.setattr(train_small, "train_step", broken_step)
    assert train_small.main(run_argv(tmp_path, "run", "--max-steps", "4", "--force")) == 2
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["metrics.jsonl"]
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == ""


def test_threads_flag_and_the_default_with_its_reason(tmp_path, capsys):
    write_corpus(tmp_path / "corpus.txt")
    assert train_small.main(run_argv(tmp_path, "one", "--max-steps", "1", "--threads", "2")) == 0
    assert "; 2 threads (requested with --threads)" in capsys.readouterr().out
    assert torch.get_num_threads() == 2
    argv = run_argv(tmp_path, "auto", "--max-steps", "1")
    assert train_small.main(argv[: argv.index("--threads")]) == 0  # TRAIN ends with --threads 1
    found = re.search(
        r"; (\d+) threads \((\d+) cores, load (\d+) elsewhere", capsys.readouterr().out
    )
    assert found and int(found[2]) == os.cpu_count()
    assert (
        int(found[1])
        == torch.get_num_threads()
        == max(1, min(os.cpu_count(), int(found[2]) - int(found[3])))
    )


def test_torchrun_two_gloo_processes_match_one_process(tmp_path):
    write_corpus(tmp_path / "corpus.txt")
    common = ["--global-batch", "8", "--max-steps", "6", "--eval-every", "6", "--log-every", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    here = Path(train_small.__file__).parent

    def run(*cmd):
        return subprocess.run(
            [sys.executable, *cmd], cwd=here, env=env, capture_output=True, text=True, timeout=300
        )

    one = run("train_small.py", *run_argv(tmp_path, "one", *common))
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    two = run(*torchrun, "train_small.py", *run_argv(tmp_path, "two", *common))
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    assert (
        "4 per forward x 1 accumulation x 2 proc" in two.stdout and two.stdout.count("done:") == 1
    )
    loss_one = [m["loss"] for m in logged(tmp_path / "one", "train")]
    np.testing.assert_allclose(
        [m["loss"] for m in logged(tmp_path / "two", "train")], loss_one, rtol=1e-4
    )
    w1, w2 = (load_checkpoint(tmp_path / o / "ckpt.pt")[2]["train_model"] for o in ("one", "two"))
    assert all(torch.allclose(w1[k], w2[k], atol=1e-5) for k in w1)


def test_lm1b_presets_validate_on_held_out_training_lines(tmp_path):
    """The bug: the recipe validated on heldout-00000, the shard then reported as the test
    score. Now the presets hold out training lines, and nothing points at a heldout shard."""
    for preset in ("lm1b", "lm1b-small"):
        args, _ = train_small.parse_args(["--preset", preset, "--tokenizer", "vocab.txt"])
        assert 0 < args.val_fraction <= 0.001
    texts = train_small.build_parser().format_help() + train_small.__doc__
    assert "--val-data" not in texts and "heldout-00000" not in texts
    tok = Tokenizer.from_vocab(write_vocab(tmp_path / "vocab.txt"))
    lines = [f"the {w} sat on a {v} ." for w in WORDS[:5] for v in WORDS[8:] for _ in range(3)]
    (tmp_path / "train.txt").write_text("\n".join(lines) + "\n")
    rows, meta = train_small.prepare_rows([tmp_path / "train.txt"], tok, 8, tmp_path / "c", 0.3)
    val_lines = [x for x in lines if side(x.encode(), 0.3) == "val"]
    assert meta["splits"]["val"]["lines"] == len(val_lines) > 0  # validation: training lines


# ---------------------------------------------------------------------------- --init-from
def test_init_from_a_checkpoint_its_config_wins_and_resume_is_exact(tmp_path, capsys):
    write_corpus(tmp_path / "corpus.txt")
    assert train_small.main(run_argv(tmp_path, "src", "--max-steps", "4", "--eval-every", "4")) == 0
    src = load_checkpoint(tmp_path / "src" / "ckpt.pt")[2]
    init = ["--init-from", str(tmp_path / "src" / "ckpt.pt"), "--eval-every", "4"]
    # no shape flags: the cpu preset's 4 x 256 would apply, but the source's 1 x 32 wins
    assert (
        train_small.main(
            run_argv(tmp_path, "ft0", *init, "--max-steps", "1", "--lr", "0", shape=[])
        )
        == 0
    )
    ft = load_checkpoint(tmp_path / "ft0" / "ckpt.pt")[2]
    assert ft["step"] == 1 and ft["config"] == src["config"] | {"dropout": 0.0}
    assert same_weights(ft["train_model"], src["model"])  # lr 0: the source's (EMA) weights
    assert same_weights(ft["model"], src["model"])  # and the EMA starts from them
    assert (
        train_small.main(run_argv(tmp_path, "ft1", *init, "--max-steps", "1", "--n-layer", "1"))
        == 0
    )
    capsys.readouterr()
    assert (
        train_small.main(run_argv(tmp_path, "ft2", *init, "--max-steps", "1", "--n-layer", "2"))
        == 2
    )
    assert_one_error_line(
        capsys.readouterr().err, "--n-layer 2 disagrees with the --init-from model's 1"
    )
    assert (
        train_small.main(run_argv(tmp_path, "straight", *init, "--max-steps", "8", shape=[])) == 0
    )
    assert train_small.main(run_argv(tmp_path, "half", *init, "--max-steps", "4", shape=[])) == 0
    assert train_small.main(resume_argv(tmp_path, "half", 8)) == 0
    a = load_checkpoint(tmp_path / "straight" / "ckpt.pt")[2]
    b = load_checkpoint(tmp_path / "half" / "ckpt.pt")[2]
    assert a["step"] == b["step"] == 8 and not same_weights(a["train_model"], src["model"])
    assert same_weights(a["train_model"], b["train_model"]) and same_weights(a["model"], b["model"])


def released_names(state: dict) -> dict:
    """setdiff's weight names -> the authors' (a released folder's pytorch_model.bin)."""
    out = {}
    for name, tensor in state.items():
        name = name.replace("tok_emb.weight", "vocab_embed.embedding")
        name = name.replace(".ln1.", ".norm1.").replace(".ln2.", ".norm2.")
        name = name.replace(".attn.qkv.", ".attn_qkv.").replace(".attn.proj.", ".attn_out.")
        name = name.replace("ln_f.", "output_layer.norm_final.").replace(
            "head.", "output_layer.linear."
        )
        out["backbone." + name] = tensor
    return out


def test_init_from_a_released_folder(tmp_path):
    L, D, H, N, V = 16, 32, 2, 1, len(VOCAB)
    ids = {piece: i for i, piece in enumerate(VOCAB)}
    shape = dict(vocab_size=V, seq_len=L, n_layer=N, n_head=H, d_model=D, dropout=0.0, set_size=4)
    specials = dict(
        mask_id=ids["[MASK]"], bos_id=ids["[CLS]"], eos_id=ids["[CLS]"], pad_id=ids["[PAD]"]
    )
    cfg = Config(**shape, max_set_size=8, **specials)
    torch.manual_seed(1)
    model = SetDiffusionLM(cfg)
    torch.nn.init.normal_(model.head.weight, std=0.5)  # not the zero init
    folder = tmp_path / "lm1b-setdlm-tiny"
    folder.mkdir()
    torch.save(released_names(model.state_dict()), folder / "pytorch_model.bin")
    write_vocab(folder / "vocab.txt")
    net = dict(
        _target_="backbone_dit.DIT", length=L, causal_attention=False, adaln=False, hidden_size=D
    )
    net |= dict(cond_dim=128, n_heads=H, num_layers=N, dropout=0.1, vocab_size=V, block_size=L)
    noise = dict(_target_="noise_schedule_noise_schedules.StaggeredNoise", block_size=L)
    noise |= dict(desired_block_size=4, max_block_size=L, length=L)
    spec = dict(architectures=["SetDLM"], model_type="bd3lm", length=L, block_size=L, vocab_size=V)
    spec |= dict(backbone_config=net | {"pretrained_model_name_or_path": None}, noise_config=noise)
    (folder / "config.json").write_text(json.dumps(spec | {"mask_token_id": ids["[MASK]"]}))
    lines = [f"the {w} sat on a {v} ." for w in WORDS[:5] for v in WORDS[8:] for _ in range(3)]
    (tmp_path / "corpus.txt").write_text("\n".join(lines) + "\n")
    flags = ["--init-from", str(folder), "--max-steps", "1", "--lr", "0", "--val-fraction", "0.3"]
    assert train_small.main(run_argv(tmp_path, "ft", *flags, shape=[])) == 0
    ft = load_checkpoint(tmp_path / "ft" / "ckpt.pt")[2]
    assert Config(**ft["config"]) == cfg  # s = min(2d, L) = 8, although config.json says L
    assert same_weights(ft["train_model"], model.state_dict())
    assert Tokenizer.from_spec(ft["tokenizer"]).pieces == VOCAB
    rows = np.memmap(ft["val_rows"]["path"], np.uint16, "r").reshape(-1, L)
    assert (rows[:, 0] == ids["[CLS]"]).all() and (rows[:, -1] == ids["[CLS]"]).all()


# ---------------------------------------------------------------------------- --bench
def test_bench_prints_the_table(capsys):
    argv = ["--bench", *SHAPE, "--batch-size", "8", "--bench-steps", "1", "--bench-repeats", "1"]
    assert train_small.main([*argv, "--threads", "1"]) == 0
    out = capsys.readouterr().out
    rows = [
        line.split("|")[1:-1]
        for line in out.splitlines()
        if line.startswith("| ") and "x |" in line
    ]
    assert [r[0].strip() for r in rows] == ["float32", "float32", "bfloat16", "bfloat16"]
    for set_row, ar_row in (rows[0:2], rows[2:4]):
        ms_set, ms_ar = float(set_row[2]), float(ar_row[2])  # printed to 0.1 ms, the ratio to 0.01
        tol = 0.006 + 0.05 * (1 / ms_set + 1 / ms_ar) * ms_set / ms_ar
        assert float(set_row[4].strip()[:-1]) == pytest.approx(ms_set / ms_ar, abs=tol)


def test_bench_ar_loss_equals_prefix_by_prefix_next_token_loss():
    """The AR baseline is a true causal LM: each prefix fed alone gives the same loss."""
    torch.manual_seed(0)
    model = SetDiffusionLM(Config(seq_len=10, n_layer=2, n_head=2, d_model=32, dropout=0.0))
    torch.nn.init.normal_(model.head.weight)  # not the zero init
    x = torch.cat([torch.full((2, 1), BYTES.bos_id), torch.randint(0, 256, (2, 9))], 1)
    nll = []
    for b in range(2):
        for i in range(9):
            causal = torch.ones(i + 1, i + 1, dtype=torch.bool).tril()[None]
            h = model.run(x[b : b + 1, : i + 1], torch.arange(i + 1)[None], causal)
            nll.append(-torch.log_softmax(model.logits(h)[0, -1], -1)[x[b, i + 1]])
    assert torch.allclose(train_small.ar_loss(model, x), torch.stack(nll).mean(), atol=1e-5)
