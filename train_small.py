"""Train a set diffusion language model, from a laptop CPU to LM1B on one GPU.

    python train_small.py                            # CPU demo on the built-in corpus (~7 min)
    python train_small.py --preset lm1b --tokenizer vocab.txt --data 'news.en-*'
    torchrun --nproc_per_node 2 train_small.py       # the same run on N processes (DDP)
    python train_small.py --resume --out out         # continue a stopped run exactly
    python train_small.py --init-from DIR --out ft   # fine-tune a setdiff or released model
    python train_small.py --bench                    # step time: set diffusion against plain AR

Validation rows are TRAINING lines held out by content hash; an LM1B test score is the bound
on all 50 news.en.heldout-* shards (sample.py --eval). Exit codes: 0 done, 2 a user error
(one line on stderr), 130 stopped by Ctrl-C or SIGTERM (ckpt.pt saved).
"""

import argparse
import ast
import contextlib
import copy
import datetime
import functools
import glob
import hashlib
import itertools
import json
import multiprocessing
import os
import re
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import setdiff
from setdiff import Config, SetDiffusionLM, Tokenizer, require

# ---- Presets: every hyperparameter of a run, in one table; a flag given wins ----------------
# cpu (the default) learns visibly in ~7 min on 2 CPU cores; lm1b is the paper's recipe (132M
# parameters, global batch 512 by accumulation, bf16); lm1b-small (56M) fits one GPU in 10 GB.
PRESET_NAMES = ("cpu", "lm1b", "lm1b-small")
PRESET_TABLE = {  # flag: (help, cpu, lm1b, lm1b-small)
    "tokenizer": ("'bytes', BERT's vocab.txt, or GPT-2's vocab.json", "bytes", None, None),
    "seq_len": ("L: tokens per row, BOS and EOS included", 128, 128, 128),
    "n_layer": ("transformer blocks", 4, 12, 8),  # the paper: 12 x 768, 12 heads
    "n_head": ("attention heads", 4, 12, 8),
    "d_model": ("hidden width", 256, 768, 512),
    "dropout": ("residual dropout", 0.0, 0.1, 0.1),  # NOTE: cpu: < 1 epoch, nothing to regularise
    "order": ("policy: set, AR, masked or block diffusion", "staggered", "staggered", "staggered"),
    "set_size": ("d: the target set size (staggered, block)", 4, 4, 4),
    "max_set_size": ("s: the staggered window (None: min(2d, L))", None, None, None),
    "val_fraction": ("share of the lines held out for validation", 0.02, 0.0005, 0.0005),
    "batch_size": ("rows per forward pass of one process", 16, 64, 64),
    "global_batch": ("rows per step, all processes (None: --batch-size)", None, 512, 256),
    "max_steps": ("optimizer steps", 500, 1_000_000, 200_000),
    "lr": ("AdamW learning rate (betas 0.9, 0.999)", 1e-3, 3e-4, 3e-4),
    "warmup_steps": ("linear warm-up steps, then constant", 100, 2500, 2500),
    "weight_decay": ("AdamW weight decay", 0.0, 0.0, 0.0),  # none in the paper
    "grad_clip": ("gradient norm clipping (0: off)", 1.0, 1.0, 1.0),
    "ema": ("EMA decay of the saved weights", 0.995, 0.9999, 0.9999),  # NOTE: 0.9999 outlasts cpu
    "eval_every": ("steps between validations (and ckpt.pt saves)", 100, 10_000, 5000),
    "eval_rows": ("validation rows scored (0: all)", 256, 2048, 2048),
}
PRESETS = {n: {k: v[1 + i] for k, v in PRESET_TABLE.items()} for i, n in enumerate(PRESET_NAMES)}
# What a model brings with --init-from, instead of these flags.
SHAPE = ("seq_len", "n_layer", "n_head", "d_model", "order", "set_size", "max_set_size")
# Flags a resumed run may change; it takes every other setting from its checkpoint.
MAY_CHANGE = {"out", "resume", "force", "device", "dtype", "compile", "threads", "workers"}
MAY_CHANGE |= {"cache_dir", "log_every", "max_steps", "eval_every", "eval_rows"}


# ---- Built-in corpus: prose sentences from the docstrings of Python, numpy and torch -------
# Every machine that runs this has these files: no download. A deterministic rule: a sorted
# walk, docstrings read with `ast` (never imported), unindented paragraphs, mostly words.
CORPUS_RULE = 2  # bump when the rule below changes: it renames the cached corpus
CODE_LIKE = re.compile(r"[`{}\[\]<>=_\\|#@$^~*]|://|\.\.|\w\.\w|\w\(")  # names, markup, URLs
PARAGRAPH_END = re.compile(r"\n\s*\n|\n[-=~^]{3,}\n")  # a blank line or a section underline
ROLE = re.compile(r"(:\w+)*:`~?([^`<]*?)\s*(<[^>]*>)?`")  # :func:`f` -> f
NOT_PROSE = (">>>", "..", "-", "*", ":")  # doctests, directives, lists, field lists
DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef)
SKIPPED = ("test", "tests", "__pycache__", "site-packages")  # folders the walk leaves out


def prose_sentences(path) -> list:
    """Docstring sentences of 6-40 words, capitalised, ASCII, 85% letters, nothing code-like."""
    try:
        tree = ast.parse(Path(path).read_bytes())
    except (SyntaxError, ValueError, RecursionError):
        return []  # e.g. Python 2 fixtures inside the standard library
    out = []
    for node in ast.walk(tree):
        docstring = ast.get_docstring(node) if isinstance(node, DOCUMENTED) else None
        for paragraph in PARAGRAPH_END.split(docstring or ""):
            lines = paragraph.strip("\n").split("\n")
            if any(line[:1].isspace() or line.startswith(NOT_PROSE) for line in lines):
                continue  # code, doctests, directives, lists, parameter tables
            text = re.sub(r"``([^`]+)``", r"\1", ROLE.sub(r"\2", " ".join(lines)))  # ``x`` -> x
            for s in re.split(r"(?<=\.)\s+(?=[A-Z])", text):
                words = 6 <= len(s.split()) <= 40 and s[:1].isupper() and s.endswith(".")
                letters = sum(c.isalpha() or c == " " for c in s) >= 0.85 * len(s)
                if words and letters and s.isascii() and not CODE_LIKE.search(s):
                    out.append(s)
    return out


def builtin_corpus(cache_dir, roots=None, out=None) -> Path:
    """The prose of the .py files under `roots` (default: Python's, numpy's, torch's), one
    sentence per line, first occurrences only; cached."""
    versions = f"python{sys.version.split()[0]}-numpy{np.__version__}-torch{torch.__version__}"
    out = Path(out or Path(cache_dir) / f"builtin-corpus-v{CORPUS_RULE}-{versions}.txt")
    if out.exists():
        return out
    files = []
    for root in roots or [os.path.dirname(m.__file__) for m in (os, np, torch)]:
        for folder, dirs, names in os.walk(root):  # sorted: os.walk's order is the OS's
            dirs[:] = sorted(d for d in dirs if d not in SKIPPED)
            files += [Path(folder) / n for n in sorted(names) if n.endswith(".py")]
    sentences = {}  # a dict keeps each sentence's first place
    for f in tqdm(files, desc="built-in corpus", unit="file", delay=1):
        sentences.update(dict.fromkeys(prose_sentences(f)))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")  # renamed when whole: never half a file
    tmp.write_text("".join(s + "\n" for s in sentences), encoding="utf-8")
    os.replace(tmp, out)
    return out


# ---- Text -> ids -> rows, as the authors build them -----------------------------------------
# LM1B (BERT WordPiece): a line is detokenized, tokenized and followed by [CLS], which is both
# EOS and BOS; the stream is cut into chunks of L-2 tokens, each row [CLS] + chunk + [CLS].
# OWT (GPT-2 BPE, no BOS): a line is a document followed by <|endoftext|>; rows are raw
# L-token chunks. Bytes: [BOS] + chunk + [EOS], EOS standing for the newline.
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


def line_ids(tok: Tokenizer, line: str) -> list:
    """A line's ids, then EOS; a WordPiece (LM1B) line is detokenized first, as the authors do."""
    if tok.kind == "wordpiece":
        line = lm1b_detokenize(line)
    return tok.encode(line) + [tok.eos_id]


def wrap_rows(stream, seq_len: int, bos, eos):
    """A stream of ids -> (rows (n, L) uint16, the leftover for the next call; no padding).
    With a BOS: rows [BOS] + L-2 tokens + [EOS]; with bos None: plain chunks of L tokens."""
    stream = np.asarray(stream, dtype=np.uint16)  # ids < 2^16: half the disk of int32
    body = seq_len if bos is None else seq_len - 2  # stream tokens per row
    n = len(stream) // body
    rows = np.empty((n, seq_len), dtype=np.uint16)  # (n, L)
    if bos is None:
        rows[:] = stream[: n * body].reshape(n, body)
    else:
        rows[:, 0] = bos
        rows[:, 1:-1] = stream[: n * body].reshape(n, body)
        rows[:, -1] = eos
    return rows, stream[n * body :].copy()


# ---- Text files -> rows in a uint16 memmap, cached ------------------------------------------
# Workers tokenize ~1 MB chunks of lines; the main process wraps their ids in file order into
# a row file, so memory stays bounded and the rows do not depend on the number of workers.
# A line is held out for validation by a hash of its content, so that identical lines (LM1B
# has many) land on one side. meta.json records what the rows were made from, for reuse.
CHUNK_BYTES = 1 << 20
ROWS_RULE = 2  # bump when the rows change (2: [CLS] ends LM1B sentences; GPT-2 rows)
SIDES = ("train", "val")
_TOK = None  # the tokenizer of a worker process


def set_tokenizer(spec: dict) -> None:
    global _TOK  # built once per worker, from its spec: tokenizers are not pickled
    _TOK = Tokenizer.from_spec(spec)


def tokenize_chunk(task) -> tuple:
    """-> (file index, bytes read, bad lines, {side: [ids, lines, text bytes]}). Blank lines
    are not sentences; lines that are not UTF-8 or hold NUL bytes are skipped and counted."""
    index, data, fraction = task
    out = {side: [[], 0, 0] for side in SIDES}
    bad = 0
    for raw in data.split(b"\n"):
        raw = raw.strip()  # also the \r of Windows line ends
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = "\0"  # marks the line bad, as a NUL byte does
        if "\0" in text:  # not UTF-8, or UTF-8 from a binary file
            bad += 1
        elif text:
            h = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")
            o = out["val" if h < fraction * 2**64 else "train"]
            o[0] += line_ids(_TOK, text)
            o[1] += 1
            o[2] += len(raw) + 1  # + the newline that EOS stands for
    for o in out.values():
        o[0] = np.array(o[0], np.uint16)
    return index, len(data), bad, out


def tokenized_chunks(files, tok: Tokenizer, fraction: float, workers: int):
    """tokenize_chunk of ~CHUNK_BYTES of whole lines at a time, file after file, in order."""

    def chunks():
        for i, path in enumerate(files):
            with open(path, "rb") as f:
                while data := f.read(CHUNK_BYTES) + f.readline():  # a long line stays whole
                    yield i, data, fraction

    set_tokenizer(tok.spec())  # the serial path is a worker too
    if workers == 1:
        yield from map(tokenize_chunk, chunks())
        return
    # spawned, not forked: forking after torch started its threads can hang
    with multiprocessing.get_context("spawn").Pool(workers, set_tokenizer, (tok.spec(),)) as pool:
        tasks = chunks()  # a few chunks per worker at a time: bounded memory, the same rows
        while batch := list(itertools.islice(tasks, 4 * workers)):
            yield from pool.imap(tokenize_chunk, batch)


def prepare_rows(files, tok, seq_len, cache_dir, val_fraction, workers=1, verbose=True):
    """Rows of the text `files` -> ({"train" | "val": np.memmap (N, L) uint16}, meta). The
    settings name the cache folder; the files' sizes and mtimes say whether it is fresh."""
    require(tok.vocab_size <= 2**16, f"--tokenizer: {tok.vocab_size:,} ids overflow uint16 rows")
    key = json.dumps([ROWS_RULE, tok.spec(), seq_len, val_fraction, [str(f) for f in files]])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]  # other settings: another folder
    folder = Path(cache_dir) / f"rows-{tok.kind}-L{seq_len}-{digest}"
    sources = [dict(path=str(f), size=f.stat().st_size, mtime=f.stat().st_mtime_ns) for f in files]
    meta = {}
    with contextlib.suppress(OSError, ValueError):
        meta = json.loads((folder / "meta.json").read_text())
    if meta.get("sources") != sources:
        meta = build_rows(folder, files, sources, tok, seq_len, val_fraction, workers, verbose)
    elif verbose:
        print(f"data: reusing {folder}")
    shapes = {side: (n["rows"], seq_len) for side, n in meta["splits"].items()}
    rows = {s: np.memmap(folder / f"{s}.bin", np.uint16, "r", shape=shapes[s]) for s in shapes}
    return rows, meta  # memmaps: read from disk on demand


def build_rows(folder, files, sources, tok, seq_len, val_fraction, workers, verbose) -> dict:
    """Tokenize, wrap into rows in file order, check the counts, then commit: the row files
    first, meta.json last (a half-built cache must never look valid)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "meta.json").unlink(missing_ok=True)  # stale until the rows are whole
    tmp = {side: folder / f"{side}.bin.tmp-{os.getpid()}" for side in SIDES}
    counts = {side: np.zeros(4, np.int64) for side in SIDES}  # rows, lines, tokens, text bytes
    carry = {side: np.empty(0, np.uint16) for side in SIDES}  # tokens waiting for a row
    per_file = np.zeros((len(files), 2), np.int64)  # good and bad lines
    total = sum(s["size"] for s in sources)
    workers = workers if total > 2 * CHUNK_BYTES else 1  # small: workers would cost, not save
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", disable=not verbose)
    outs = {side: open(tmp[side], "wb") for side in SIDES}
    try:
        for i, size, bad, out in tokenized_chunks(files, tok, val_fraction, workers):
            for side, (ids, lines, text_bytes) in out.items():
                stream = np.concatenate([carry[side], ids])  # a row may span two chunks
                rows, carry[side] = wrap_rows(stream, seq_len, tok.bos_id, tok.eos_id)
                outs[side].write(rows.tobytes())
                counts[side] += (len(rows), lines, len(ids), text_bytes)
            per_file[i] += (out["train"][1] + out["val"][1], bad)
            bar.update(size)
        bar.close()
        for path, (good, bad) in zip(files, per_file.tolist()):
            require(good or bad, f"{path} is empty: give text files, one sentence a line")
            # a few bad lines are skipped (LM1B has some); a file of mostly bad ones is not text
            require(bad <= good, f"{path} does not look like text: {bad:,} lines are not UTF-8")
        body = seq_len if tok.bos_id is None else seq_len - 2  # stream tokens per row
        for side in SIDES:
            need = f"the {side} text has {counts[side][2]:,} tokens; a row of --seq-len {seq_len}"
            fix = "give more text, a smaller --seq-len or another --val-fraction"
            require(counts[side][0], f"{need} needs {body}: {fix}")
            outs[side].close()
            os.replace(tmp[side], folder / f"{side}.bin")
    finally:
        for side in SIDES:
            outs[side].close()
            tmp[side].unlink(missing_ok=True)
    names = ("rows", "lines", "tokens", "text_bytes")
    splits = {side: dict(zip(names, counts[side].tolist())) for side in SIDES}
    meta = dict(rule=ROWS_RULE, sources=sources, bad_lines=int(per_file[:, 1].sum()), splits=splits)
    (folder / "meta.json").write_text(json.dumps(meta, indent=1))  # a cut one reads as stale
    return meta


# ---- Batches: the rows and the randomness of step n are pure functions of (seed, n) --------
# So a resumed run, on any number of processes, reads the uninterrupted run's rows and draws
# its orders and dropout, with no data position to save.
@functools.lru_cache(maxsize=2)
def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def batch_rows(seed: int, step: int, size: int, n: int) -> np.ndarray:
    """Row ids of step `step`: positions [step*size, (step+1)*size) of the concatenated
    epochs, each epoch a seeded permutation of the n rows (every row once per epoch)."""
    pos = np.arange(step * size, (step + 1) * size)  # positions in the endless stream
    epochs = np.unique(pos // n)
    return np.concatenate([epoch_permutation(seed, e, n)[pos[pos // n == e] % n] for e in epochs])


def step_seed(seed: int, step: int, stream: int) -> int:
    """The seed of one stream of a step's randomness: 0 the decode orders, 1 + rank dropout."""
    return int(np.random.SeedSequence([seed, step, stream]).generate_state(1)[0])


# ---- Flags ---------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """Every flag; a hyperparameter's from its PRESET_TABLE row, None meaning "the preset's"."""
    p = argparse.ArgumentParser(description="Train a set diffusion LM; no flags: the CPU demo.")

    def error(message):  # a usage error is one line too: main() prints it, exits with 2
        raise ValueError(f"{message} (see --help)")

    p.error = error  # argparse would print usage and exit
    cache = os.environ.get("SETDIFF_CACHE") or os.path.expanduser("~/.cache/setdiff")
    add = p.add_argument  # one flag a line
    add("--preset", choices=PRESET_NAMES, default="cpu", help="the values marked (cpu ...)")
    for key, (help, *values) in PRESET_TABLE.items():
        kind = type(next((v for v in values if v is not None), 0))  # max_set_size: int
        choices = setdiff.ORDER_POLICIES if key == "order" else None
        shown = ", ".join(f"{name} {v}" for name, v in zip(PRESET_NAMES, values))
        add("--" + key.replace("_", "-"), type=kind, choices=choices, help=f"{help} ({shown})")
    add("--data", nargs="+", help="text files, a sentence (GPT-2: a document) a line")
    add("--cache-dir", default=cache, help="prepared rows, the built-in corpus (%(default)s)")
    add("--workers", type=int, default=min(os.cpu_count() or 1, 16), help="tokenizing processes")
    add("--init-from", help="fine-tune a ckpt/model folder: its config, tokenizer win over flags")
    add("--log-every", type=int, default=10, help="steps between loss lines (%(default)s)")
    add("--out", default="out", help="run folder: ckpt.pt, best.pt, metrics.jsonl (%(default)s)")
    add("--resume", action="store_true", help="continue the run in --out exactly")
    add("--force", action="store_true", help="overwrite a different run in --out")
    add("--device", help="cuda, cuda:N, mps or cpu (default: the first of them available)")
    add("--dtype", choices=["auto", "float32", "bfloat16"], default="auto", help="autocast")
    add("--compile", action="store_true", help="torch.compile the training step")
    add("--threads", type=int, help="CPU threads (default: the cores other work leaves idle)")
    add("--seed", type=int, default=0, help="of weights, batches, orders, dropout (%(default)s)")
    add("--bench", action="store_true", help="time steps of set diffusion against plain AR")
    add("--bench-steps", type=int, default=5, help="steps per timed run (%(default)s)")
    add("--bench-repeats", type=int, default=3, help="timed runs, interleaved (%(default)s)")
    return p


# The smallest value of each integer flag (None, where allowed, means "not set").
AT_LEAST = dict(max_steps=1, batch_size=1, global_batch=1, eval_every=1, log_every=1, eval_rows=0)
AT_LEAST |= dict(warmup_steps=0, workers=1, seed=0, bench_steps=1, bench_repeats=1, threads=1)
AT_LEAST |= dict(seq_len=3, n_layer=1, n_head=1, d_model=2)


def parse_args(argv=None) -> tuple:
    """-> (all settings, the flags the user set: a resumed run checks them)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    given = {key for key, value in vars(args).items() if value != parser.get_default(key)}
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:  # not given: the preset's value
            setattr(args, key, value)
    if args.data:  # absolute: they name the cache, and a resumed run may start elsewhere
        args.data = [os.path.abspath(f) for f in args.data]
    for key, low in AT_LEAST.items():
        value = getattr(args, key)
        flag = "--" + key.replace("_", "-")
        require(value is None or value >= low, f"{flag} must be at least {low}, got {value}")
    require(0 < args.val_fraction < 1, f"--val-fraction must be in (0, 1), got {args.val_fraction}")
    require(0 <= args.ema < 1, f"--ema must be in [0, 1), got {args.ema}")
    return args, given


def load_tokenizer(spec) -> Tokenizer:
    """--tokenizer: 'bytes', a BERT vocab.txt, or a GPT-2 vocab.json with merges.txt beside it."""
    require(spec, "this --preset needs --tokenizer PATH: the vocab.txt of bert-base-uncased")
    if spec == "bytes":
        return Tokenizer.bytes()
    try:
        if spec.endswith(".json"):
            merges = Path(spec).with_name("merges.txt")  # as a hub download lays them out
            require(merges.is_file(), f"{spec}: GPT-2's vocab.json needs merges.txt beside it")
            return Tokenizer.from_bpe(spec, merges)
        return Tokenizer.from_vocab(spec)
    except ValueError as e:
        raise ValueError(f"--tokenizer: {e}") from None


def model_config(args, tok: Tokenizer) -> Config:
    """The Config of the flags; its own checks' messages get the flags' names."""
    shape = {key: getattr(args, key) for key in SHAPE}
    ids = dict(mask_id=tok.mask_id, bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id)
    try:
        return Config(tok.vocab_size, **shape, dropout=args.dropout, **ids)
    except ValueError as e:  # Config says d, s, L, ...: name the flags
        flags = ", ".join("--" + key.replace("_", "-") for key in SHAPE)
        raise ValueError(f"{e} (set by {flags})") from None


# ---- Before the work: the run folder, the settings, the data -------------------------------
def resumed_args(args, given) -> tuple:
    """-> (the saved settings with the flags that may change, the checkpoint). Another flag
    set to a different value is an error, not a new run."""
    path = Path(args.out) / "ckpt.pt"
    require(path.is_file(), f"--resume: no checkpoint {path} to continue from")
    ckpt = setdiff.load_checkpoint(path)[2]  # refuses files of other versions
    ok = {"args", "step", "optimizer", "train_model"} <= ckpt.keys()
    require(ok, f"--resume: {path} has no training state (not from this train_small.py)")
    saved = ckpt["args"]
    for key in sorted(given - MAY_CHANGE):
        mine = f"--{key.replace('_', '-')} {getattr(args, key)}"
        ok = saved.get(key) == getattr(args, key)
        require(ok, f"{mine} differs from the resumed run's {saved.get(key)}: it keeps those")
    changed = {key: getattr(args, key) for key in given & MAY_CHANGE}
    return argparse.Namespace(**(saved | changed | {"out": args.out, "resume": True})), ckpt


def init_from(args, given) -> tuple:
    """--init-from -> (model, tokenizer); its shape replaces the shape flags (a flag the user
    set to another value is an error, not silently overridden)."""
    require("tokenizer" not in given, "--tokenizer: --init-from brings its own tokenizer")
    try:
        model, tok, _ = setdiff.load_checkpoint(args.init_from)
    except ValueError as e:
        raise ValueError(f"--init-from: {e}") from None
    for key in SHAPE:
        value = getattr(model.cfg, key)
        mine = f"--{key.replace('_', '-')} {getattr(args, key)}"
        ok = key not in given or getattr(args, key) == value
        require(ok, f"{mine} disagrees with the --init-from model's {value}: leave it out")
        setattr(args, key, value)  # saved with the run: a resume needs no source
    args.tokenizer = None  # the model's, saved in every checkpoint of the run
    model.cfg.dropout = args.dropout  # a training choice, not the model's
    return model, tok


def prepare(args, given, master: bool) -> argparse.Namespace:
    """Everything the user's input can fail, before any file is written: --out first (a typo
    should cost a second, not an hour of tokenizing), the settings, tokenizer, Config, data."""
    out = Path(args.out)
    existing = next(p for p in (out.absolute(), *out.absolute().parents) if p.exists())
    require(existing.is_dir(), f"--out {out}: {existing} is a file, not a folder")
    require(os.access(existing, os.W_OK | os.X_OK), f"--out {out}: {existing} is not writable")
    held = any((out / f).exists() for f in ("ckpt.pt", "best.pt", "metrics.jsonl"))
    why = "continue it with --resume, overwrite it with --force, or choose another --out"
    require(not held or args.resume or args.force, f"--out {out} already holds a run: {why}")
    run = argparse.Namespace(args=args, ckpt=None, source=None)  # grows as the run is set up
    if args.resume:
        run.args, run.ckpt = resumed_args(args, given)
        run.tok = Tokenizer.from_spec(run.ckpt["tokenizer"])  # no vocab file needed to resume
        run.cfg = Config(**run.ckpt["config"])
    elif args.init_from:
        run.source, run.tok = init_from(args, given)
        run.cfg = run.source.cfg  # shape, order, d, s, special ids
    else:
        run.tok = load_tokenizer(args.tokenizer)
        run.cfg = model_config(args, run.tok)
    args = run.args
    files = []
    for pattern in args.data or ():  # a glob (news.en-*) stands for its files, sorted
        found = sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]
        require(found and all(map(os.path.isfile, found)), f"--data {pattern}: no such file")
        files += [Path(f) for f in found]
    files = files or [builtin_corpus(args.cache_dir)]  # no --data: the demo corpus
    run.rows, meta = prepare_rows(
        files, run.tok, run.cfg.seq_len, args.cache_dir, args.val_fraction, args.workers, master
    )
    for side, n in meta["splits"].items():
        if master:
            print(f"data: {side} {n['rows']:,} rows of {run.cfg.seq_len} ({n['lines']:,} lines)")
    if master and meta["bad_lines"]:
        print(f"data: skipped {meta['bad_lines']:,} lines that are not UTF-8 text", file=sys.stderr)
    val = meta["splits"]["val"]  # what sample.py scores when given no file
    run.val_rows = dict(path=os.path.abspath(run.rows["val"].filename), rows=val["rows"])
    run.val_rows["bytes_per_token"] = val["text_bytes"] / val["tokens"]
    return run


# ---- Training ------------------------------------------------------------------------------
class TrainStep(torch.nn.Module):
    """The loss as a module's forward, so DDP (which hooks forward) and torch.compile see it."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, order):
        return self.model.loss(x, order)


def setup(args, given) -> argparse.Namespace:
    """Processes, device, data, model, optimizer, run folder -> the run. Under torchrun, rank 0
    prepares the data, then the others open its cache (or meet the same error in the input)."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # before any tensor work (threads):
    device, dtype, how = setdiff.runtime(args.device, args.dtype, args.threads, local_rank)
    if world > 1:  # a long timeout: rank 0 may take a while to tokenize a large corpus
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(hours=2))
    if rank > 0:
        dist.barrier()
    try:
        run = prepare(args, given, master=rank == 0)
    finally:
        if rank == 0 and world > 1:
            dist.barrier()
    args = run.args
    if args.resume:  # the resumed run's --device, --dtype and --threads, unless given again
        device, dtype, how = setdiff.runtime(args.device, args.dtype, args.threads, local_rank)
    # The global batch G is what the optimizer sees on any number of processes: each runs
    # micro-batches of `micro` rows, `accum` times, then DDP averages the gradients.
    G = args.global_batch or args.batch_size
    micro = min(args.batch_size, G // world)
    ok = micro >= 1 and G % (micro * world) == 0
    require(ok, f"--global-batch {G} must be a multiple of --batch-size times {world} processes")
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed)  # the same initial weights on every process
    model = SetDiffusionLM(run.cfg).to(device)
    if run.source is not None:  # --init-from: its weights, and the EMA starts from them too
        model.load_state_dict(run.source.state_dict())
    ema = copy.deepcopy(model).requires_grad_(False) if args.ema > 0 else model
    opt = torch.optim.AdamW(model.parameters(), args.lr, weight_decay=args.weight_decay, fused=cuda)
    if run.ckpt:
        model.load_state_dict(run.ckpt["train_model"])
        ema.load_state_dict(run.ckpt["model"])
        opt.load_state_dict(run.ckpt["optimizer"])
    net = TrainStep(model)  # DDP and compile wrap this, not the model
    if world > 1:
        net = torch.nn.parallel.DistributedDataParallel(net, [device] if cuda else None)
    accum = G // (micro * world)  # micro-batches per process per step
    if rank == 0:
        print(how)
        print(f"model: {model.num_params() / 1e6:.2f}M parameters, order {run.cfg.order}")
        print(f"batch: {G} rows/step = {micro} per forward x {accum} accumulation x {world} proc")
    saved = run.ckpt or {}
    run.state = {k: saved.get(k, v) for k, v in (("step", 0), ("tokens", 0), ("best", None))}
    run.net = torch.compile(net) if args.compile else net
    vars(run).update(rank=rank, world=world, device=device, dtype=dtype, G=G, micro=micro)
    vars(run).update(accum=accum, model=model, ema=ema, opt=opt, out=Path(args.out))
    if rank > 0:
        return run
    # The run folder. A resumed run keeps the lines of metrics.jsonl up to its step (not one
    # a crash cut off); a new one (--force) removes an old run's checkpoints.
    run.out.mkdir(parents=True, exist_ok=True)
    metrics = run.out / "metrics.jsonl"
    kept = []
    if args.resume and metrics.exists():
        for line in metrics.read_text(errors="replace").splitlines():
            if line.endswith("}") and json.loads(line)["step"] <= run.state["step"]:
                kept.append(line + "\n")
    if not args.resume:
        (run.out / "ckpt.pt").unlink(missing_ok=True)
        (run.out / "best.pt").unlink(missing_ok=True)
    metrics.write_text("".join(kept))
    print(f"run: {run.out}, from step {run.state['step']:,}")
    return run


def train_step(run, step: int) -> torch.Tensor:
    """One optimizer step on the global batch of `step`; returns its loss (on the device)."""
    args = run.args
    torch.manual_seed(step_seed(args.seed, step, 1 + run.rank))  # this step's dropout
    for group in run.opt.param_groups:  # linear warm-up, then constant (the paper's schedule)
        group["lr"] = args.lr * min(1.0, (step + 1) / max(args.warmup_steps, 1))
    # the global batch and its orders, as a 1-process run draws them; this process's share
    ids = batch_rows(args.seed, step, run.G, len(run.rows["train"]))
    ids = ids.reshape(run.accum, run.world, run.micro)
    generator = torch.Generator().manual_seed(step_seed(args.seed, step, 0))
    orders = setdiff.sample_order(run.cfg, run.G, generator)
    orders = orders.reshape(run.accum, run.world, run.micro, -1)  # (A, W, B, L)
    total = 0.0  # the step's loss, summed on the device
    for a in range(run.accum):
        x = torch.from_numpy(run.rows["train"][ids[a, run.rank]].astype(np.int64))  # (B, L)
        # DDP all-reduces the gradients in every backward unless told not to: once is enough
        sync = run.world == 1 or a == run.accum - 1
        with contextlib.nullcontext() if sync else run.net.no_sync():
            with setdiff.autocast(run.device, run.dtype):
                loss = run.net(x.to(run.device), orders[a, run.rank].to(run.device)) / run.accum
            loss.backward()
        total = total + loss.detach()
    if args.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), args.grad_clip)
    run.opt.step()  # weights and optimizer state stay float32
    run.opt.zero_grad(set_to_none=True)
    if run.ema is not run.model:  # --ema 0: the raw weights are evaluated
        # NOTE: the decay ramps up as (1+t)/(10+t), so a short run's EMA is not its init
        decay = min(args.ema, (1 + step) / (10 + step))
        for e, p in zip(run.ema.parameters(), run.model.parameters()):
            e.lerp_(p.detach(), 1 - decay)
    return total


def save(path, run, resumable=False) -> None:
    """The EMA weights as "model" (evaluated, sampled); if `resumable`, also the raw weights
    and the optimizer (not in best.pt: only ckpt.pt is resumed)."""
    extra = dict(args=vars(run.args), val_rows=run.val_rows, **run.state)
    if resumable:
        extra |= {"train_model": run.model.state_dict(), "optimizer": run.opt.state_dict()}
    setdiff.save_checkpoint(path, run.ema, run.tok, **extra)  # atomic: a failure keeps the last


def evaluate(run, step: int) -> None:
    """The bound of the EMA weights on the first --eval-rows validation rows, one order a row
    from a fixed seed (so evaluations compare); then ckpt.pt, and best.pt if the best."""
    x = torch.from_numpy(np.asarray(run.rows["val"][: run.args.eval_rows or None], np.int64))
    with setdiff.autocast(run.device, run.dtype):
        orders = torch.Generator().manual_seed(run.args.seed)
        res = setdiff.elbo(run.ema, x, 1, 2 * run.micro, orders)
    # bits per byte: the scored tokens that are text (not position 0, not wrap_rows' EOS)
    text_tokens = x.shape[1] - 1 if run.cfg.bos_id is None else x.shape[1] - 2
    num_bytes = round(len(x) * text_tokens * run.val_rows["bytes_per_token"])
    best = run.state["best"] is None or res.nll_per_token < run.state["best"]["nll_per_token"]
    if best:
        run.state["best"] = {"step": step, **res.metrics(num_bytes), "line": res.line(num_bytes)}
    record = dict(step=step, kind="val", tokens=run.state["tokens"], **res.metrics(num_bytes))
    with open(run.out / "metrics.jsonl", "a") as f:  # a line at a time: a crash loses one
        print(json.dumps(record), file=f)
    tqdm.write(f"step {step:,}: val {res.line(num_bytes)}{'  (best)' * best}")
    save(run.out / "ckpt.pt", run, resumable=True)
    if best:
        save(run.out / "best.pt", run)


def train(args, given) -> int:
    """Set up, then the loop: steps, loss lines, validations with ckpt.pt. Ctrl-C or SIGTERM (a
    job scheduler's) stops it between two steps and saves ckpt.pt. -> 0 done, 130 stopped."""
    run = setup(args, given)
    args = run.args
    master = run.rank == 0
    step0 = run.state["step"]  # > 0 for a resumed run
    start = time.perf_counter()
    window = [start, 0]  # the loss line's window: its start time and steps
    loss_sum = torch.zeros((), device=run.device)  # on the device: reading it syncs a GPU
    bar = tqdm(total=args.max_steps, initial=step0, disable=not master, unit="step")
    signals = []  # a handler only notes the signal: the loop stops between steps, never in one

    def note_signal(signum, frame):
        signals.append(signal.Signals(signum).name)

    handlers = {sig: signal.signal(sig, note_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    stopped = False
    try:
        for step in range(step0, args.max_steps):
            loss_sum += train_step(run, step)
            run.state["step"] = step + 1
            run.state["tokens"] += run.G * run.cfg.seq_len
            window[1] += 1
            bar.update(1)
            last = step + 1 == args.max_steps  # the last step always logs and evaluates
            if (step + 1) % args.log_every == 0 or last:
                log_loss(run, bar, step, loss_sum, window)
            if master and ((step + 1) % args.eval_every == 0 or last):
                evaluate(run, step + 1)
                window[0] = time.perf_counter()  # validation is not training speed
            stopped = bool(signals)
            if run.world > 1:  # the processes agree, or one would wait for the others forever
                flag = torch.tensor(float(stopped), device=run.device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                stopped = bool(flag.item())
            if stopped:
                break
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        bar.close()
    if stopped and master:  # the state is the last whole step: --resume repeats nothing
        save(run.out / "ckpt.pt", run, resumable=True)
        why = signals[0] if signals else "another process's signal"
        where = f"at step {run.state['step']:,}: saved {run.out / 'ckpt.pt'}"
        print(f"\ninterrupted ({why}) {where}; continue: --resume --out {run.out}", file=sys.stderr)
    if stopped or not master:
        return 130 if stopped else 0
    # the summary, and a sample of the EMA weights (generate's defaults: top-p 1 and so on)
    speed = (run.state["step"] - step0) * run.G * run.cfg.seq_len / (time.perf_counter() - start)
    print(f"done: {run.state['step']:,} steps, {run.state['tokens']:,} tokens; {speed:,.0f}/s")
    if run.state["best"]:
        print(f"best validation (step {run.state['best']['step']:,}): {run.state['best']['line']}")
    g = setdiff.generate(run.ema, generator=torch.Generator().manual_seed(args.seed))
    text = run.tok.decode(g.tokens[0].tolist()).strip().replace("\n", " | ")
    print(f"sample ({g.nfe} network calls, {g.tokens_per_step:.2f} tokens/call): {text}")
    return 0


def log_loss(run, bar, step: int, loss_sum: torch.Tensor, window: list) -> None:
    """The window's mean loss over all processes, on the bar and in the log; a new window."""
    if run.world > 1:
        dist.all_reduce(loss_sum)
    loss = loss_sum.item() / run.world / window[1]  # per step, averaged over processes
    lr = run.opt.param_groups[0]["lr"]
    tok_s = window[1] * run.G * run.cfg.seq_len / (time.perf_counter() - window[0])
    bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tok_s:,.0f}", lr=f"{lr:.2e}")
    if run.rank == 0:
        record = dict(step=step + 1, kind="train", loss=loss, lr=lr, tokens_per_s=tok_s)
        with open(run.out / "metrics.jsonl", "a") as f:
            print(json.dumps(record), file=f)
    window[:] = [time.perf_counter(), 0]
    loss_sum.zero_()


# ---- Benchmark (--bench): what the two-stream set-causal step costs against plain AR -------
# The same modules on the same batch: set diffusion feeds 2L tokens (clean | mask stream)
# with the set-causal mask, AR feeds L tokens with a causal mask: a floor of about 2x.
def ar_loss(model: SetDiffusionLM, x: torch.Tensor) -> torch.Tensor:
    """Next-token loss of a plain causal transformer made of the model's modules."""
    B, L = x.shape
    positions = torch.arange(L, device=x.device).expand(B, L)  # (B, L)
    causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()[None]  # (1, L, L)
    logits = model.logits(model.run(x, positions, causal)[:, :-1])  # (B, L-1, V)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())


def bench(args) -> int:
    """Median time of an optimizer step of each, fp32 and bf16; the repeats of the two are
    interleaved, so that both meet the same machine noise."""
    device, _, how = setdiff.runtime(args.device, "float32", args.threads)  # fp32 and bf16 below
    cfg = model_config(args, load_tokenizer(args.tokenizer))
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randint(0, cfg.mask_id, (args.batch_size, cfg.seq_len), generator=g).to(device)
    if cfg.pad_id is not None:  # a row with PAD would take the padded-mask path
        x[x == cfg.pad_id] = cfg.eos_id
    order = setdiff.sample_order(cfg, args.batch_size, g, device)
    print(f"bench: {how}; batch {args.batch_size} x L={cfg.seq_len}")
    print("| dtype | variant | ms/step (median) | tokens/s | vs AR |\n|---|---|---|---|---|")
    for dtype in [torch.float32] if device.type == "mps" else [torch.float32, torch.bfloat16]:
        torch.manual_seed(args.seed)
        model = SetDiffusionLM(cfg).to(device)  # one model for both: the step time does not care
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)  # the optimizer step is timed too
        variants = {"set diffusion (2L, set-causal)": (model.loss, x, order)}
        variants["AR (L, causal)"] = (ar_loss, model, x)
        times = {name: [] for name in variants}
        for repeat in range(args.bench_repeats + 1):  # repeat 0 warms up
            for name, (fn, *inputs) in variants.items():
                n = args.bench_steps if repeat else 1
                setdiff.synchronize(device)
                t0 = time.perf_counter()
                for _ in range(n):
                    with setdiff.autocast(device, dtype):
                        loss = fn(*inputs)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                setdiff.synchronize(device)
                times[name].append((time.perf_counter() - t0) / n)
        median = {name: float(np.median(t[1:])) for name, t in times.items()}  # not the warm-up
        for name, t in median.items():
            ratio = t / median["AR (L, causal)"]
            speed = f"{t * 1e3:.1f} | {args.batch_size * cfg.seq_len / t:,.0f}"
            print(f"| {str(dtype)[6:]} | {name} | {speed} | {ratio:.2f}x |")
    return 0


# ---- Main: user errors become one line on stderr and exit code 2 ---------------------------
def main(argv=None) -> int:
    """Command-line entry point; returns the exit code (0 done, 2 user error, 130 stopped)."""
    try:
        args, given = parse_args(argv)
        return bench(args) if args.bench else train(args, given)
    except (ValueError, OSError) as e:
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {e}".replace("\n", " "), file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:  # outside the training steps: the data work or the sample
        print("\ninterrupted (outside the training steps: nothing new to save)", file=sys.stderr)
        return 130
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
