"""Train a set diffusion language model, from a laptop CPU to LM1B on one GPU.

    python train_small.py                          # CPU demo on the built-in corpus (~7 min)
    python train_small.py --order ar --out runs/ar # a baseline with the same budget
    python train_small.py --preset lm1b --tokenizer vocab.txt --data 'news.en-*' --val-data heldout.txt
    torchrun --nproc_per_node 2 train_small.py     # the same run on N processes (DDP)
    python train_small.py --resume --out out       # continue a stopped run exactly
    python train_small.py --bench                  # step time: set diffusion against plain AR

The method lives in setdiff.py; this script feeds it data and runs the optimisation loop.
Exit codes: 0 done, 2 a user error (one line on stderr), 130 interrupted (checkpoint saved).
"""

import argparse, ast, contextlib, copy, datetime, functools, glob, hashlib, importlib.util, itertools, json
import multiprocessing, os, platform, re, signal, sys, sysconfig, time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from setdiff import (ORDER_POLICIES, Config, SetDiffusionLM, Tokenizer, autocast, elbo, generate, load_checkpoint,
                     pick_device, pick_dtype, require, sample_order, save_checkpoint, synchronize, wrap_rows)

def write_atomic(path, text: str) -> None:
    """Write a temp file beside `path`, then rename it: a crash never leaves half a file."""
    tmp = Path(f"{path}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)

# ---- Built-in corpus: prose sentences from the docstrings of Python, numpy and torch ----
# Every machine that runs this script has these files: the demo needs no download. A simple,
# deterministic rule: sorted file walk, docstrings read with `ast` (never imported), paragraphs
# without indentation, sentences that are mostly words. The cache name carries the versions.

CORPUS_RULE = 2  # bump when the rule below changes: it renames the cached corpus
CODE_LIKE = re.compile(r"[`{}\[\]<>=_\\|#@$^~*]|://|\.\.|\w\.\w|\w\(")  # names, markup, URLs

def prose_sentences(path) -> list:
    """The sentences of one source file's docstrings that read as English prose."""
    try:
        tree = ast.parse(Path(path).read_bytes())
    except (SyntaxError, ValueError, RecursionError):
        return []  # e.g. Python 2 fixtures inside the standard library
    out = []
    for node in (n for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))):
        # blank lines and section underlines ("Notes\n-----") end a paragraph
        for para in re.split(r"\n\s*\n|\n[-=~^]{3,}\n", ast.get_docstring(node) or ""):
            lines = para.strip("\n").split("\n")
            if any(l[:1].isspace() or l.startswith((">>>", "..", "-", "*", ":")) for l in lines):
                continue  # code, doctests, directives, lists, parameter tables
            text = re.sub(r"(:\w+)*:`~?([^`<]*?)\s*(<[^>]*>)?`", r"\2", " ".join(lines))  # :func:`f`
            text = re.sub(r"``([^`]+)``", r"\1", text)                                    # ``x``
            out += [s for s in re.split(r"(?<=\.)\s+(?=[A-Z])", text)
                    if 6 <= len(s.split()) <= 40 and s[0].isupper() and s.endswith(".") and s.isascii()
                    and not CODE_LIKE.search(s) and sum(c.isalpha() or c == " " for c in s) >= 0.85 * len(s)]
    return out

def builtin_corpus(cache_dir, roots=None, out=None) -> Path:
    """The prose of the .py files under `roots` (default: the standard library, numpy and
    torch; tests skipped), one sentence per line, first occurrences only; cached."""
    versions = f"python{platform.python_version()}-numpy{np.__version__}-torch{torch.__version__}"
    out = Path(out or Path(cache_dir) / f"builtin-corpus-v{CORPUS_RULE}-{versions}.txt")
    if not out.exists():
        files, sentences = [], {}  # a dict keeps each sentence's first place
        for root in roots or [sysconfig.get_paths()["stdlib"], *(os.path.dirname(importlib.util.find_spec(n).origin)
                                                                 for n in ("numpy", "torch"))]:
            for folder, dirs, names in os.walk(root):  # sorted: os.walk's order is the OS's
                dirs[:] = sorted(d for d in dirs if d not in ("test", "tests", "__pycache__", "site-packages"))
                files += [Path(folder) / n for n in sorted(names) if n.endswith(".py")]
        for f in tqdm(files, desc="built-in corpus", unit="file", delay=1):
            sentences.update(dict.fromkeys(prose_sentences(f)))
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out, "".join(s + "\n" for s in sentences))
    return out

# ---- Text files -> LM1B-style wrapped rows in a uint16 memmap, cached ------------------
# Each sentence is tokenized and followed by EOS; the stream is cut into rows [BOS] + L-2
# tokens + [EOS] (setdiff.wrap_rows). Workers tokenize ~1 MB chunks of lines; the main
# process wraps their ids in file order into a row file, so memory stays bounded. meta.json
# beside the rows records what they were made from; the same inputs reuse them.

CHUNK_BYTES = 1 << 20
_TOK = None  # the tokenizer of a worker process

def expand(patterns, flag: str) -> list:
    """Files and globs in the order given (each glob sorted), each checked to be a file."""
    paths = []
    for pat in patterns:
        found = [p for p in sorted(glob.glob(pat)) if os.path.isfile(p)] if any(c in pat for c in "*?[") else [pat]
        require(found and os.path.isfile(found[0]), f"{flag}: no such file: {pat}" if found else
                f"{flag} {pat!r} matches no file")
        paths += [Path(p).resolve() for p in found]
    return list(dict.fromkeys(paths))

def set_tokenizer(spec: dict) -> None:
    global _TOK  # built once per worker, from its spec: tokenizers are not pickled
    _TOK = Tokenizer.from_spec(spec)

def read_chunks(plan, fraction: float):
    """(file index, ~CHUNK_BYTES of whole lines, split, fraction), file after file."""
    for i, (path, split) in enumerate(plan):
        with open(path, "rb") as f:
            while data := f.read(CHUNK_BYTES) + f.readline():  # a long line stays whole
                yield i, data, split, fraction

def tokenize_chunk(task) -> tuple:
    """Ids of a chunk's sentences, each followed by EOS, and counts, per split. Blank lines
    are not sentences; lines that are not UTF-8 or hold NUL bytes are skipped and counted."""
    index, data, split, fraction = task
    out, bad = {side: [[], 0, 0] for side in ("train", "val")}, 0  # ids, lines, text bytes
    for raw in data.split(b"\n"):
        raw = raw.strip()  # also the \r of Windows line ends
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = "\0"
        if "\0" in text:  # not UTF-8, or UTF-8 from a binary file
            bad += 1
        elif text:  # held out by a hash of the content: identical lines (LM1B has many) go together
            h = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")
            o = out[split if split != "hash" else "val" if h < fraction * 2**64 else "train"]
            o[0].extend(_TOK.encode(text) + [_TOK.eos_id])
            o[1], o[2] = o[1] + 1, o[2] + len(raw) + 1  # + the newline that EOS stands for
    return index, len(data), bad, {side: (np.array(o[0], np.uint16), o[1], o[2]) for side, o in out.items()}

def prepare_rows(plan, tok: Tokenizer, seq_len: int, cache_dir, val_fraction=0.0, workers=1, verbose=True):
    """Wrapped rows of `plan` [(path, split)], split "train", "val" or "hash" (a content hash
    sends `val_fraction` of the lines to "val") -> ({split: np.memmap (N, L) uint16}, meta).
    The settings name the cache folder; the files' sizes and mtimes say if it is fresh."""
    require(tok.vocab_size <= 2**16, f"a vocab of {tok.vocab_size:,} tokens does not fit in uint16 rows")
    key = json.dumps([tok.spec(), seq_len, val_fraction, [[str(p), s] for p, s in plan]])
    folder = Path(cache_dir) / f"rows-{tok.kind}-L{seq_len}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    sources = [dict(path=str(p), split=s, size=p.stat().st_size, mtime_ns=p.stat().st_mtime_ns) for p, s in plan]
    meta = {}
    with contextlib.suppress(OSError, ValueError):
        meta = json.loads((folder / "meta.json").read_text())
    if meta.get("sources") != sources:
        meta = build_rows(folder, plan, sources, tok, seq_len, val_fraction, workers, verbose)
    elif verbose:
        print(f"data: reusing {folder}")
    return {side: np.memmap(folder / f"{side}.bin", np.uint16, "r", shape=(s["rows"], seq_len))
            for side, s in meta["splits"].items()}, meta  # read from disk on demand

def build_rows(folder, plan, sources, tok, seq_len, val_fraction, workers, verbose) -> dict:
    """Tokenize (in worker processes if the input is large), wrap into rows in file order,
    check the counts, then commit: the row files first, meta.json last."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "meta.json").unlink(missing_ok=True)  # a half-built cache must never look valid
    sides = sorted({side for _, s in plan for side in (("train", "val") if s == "hash" else (s,))})
    tmp = {side: folder / f"{side}.bin.tmp-{os.getpid()}" for side in sides}
    stats = {side: np.zeros(4, np.int64) for side in sides}   # rows, lines, tokens, text bytes
    carry = {side: np.empty(0, np.uint16) for side in sides}  # < L-2 tokens waiting for a row
    per_file = np.zeros((len(plan), 2), np.int64)             # good and bad lines
    total = sum(s["size"] for s in sources)
    workers = 1 if total <= 2 * CHUNK_BYTES else workers      # small input: start-up > gain
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", disable=not verbose, delay=1)
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: [p.unlink(missing_ok=True) for p in tmp.values()])
        files = {side: stack.enter_context(open(tmp[side], "wb")) for side in sides}
        set_tokenizer(tok.spec())  # spawn, not fork: forking after torch started threads can hang
        pool = workers > 1 and stack.enter_context(
            multiprocessing.get_context("spawn").Pool(workers, set_tokenizer, (tok.spec(),)))
        chunks = read_chunks(plan, val_fraction)
        # a few chunks per worker at a time, results in order: bounded memory, the same rows
        while batch := list(itertools.islice(chunks, 4 * workers)):
            for i, size, bad, out in (pool.imap if pool else map)(tokenize_chunk, batch):
                for side in sides:
                    ids, lines, nbytes = out[side]
                    rows, carry[side] = wrap_rows(np.concatenate([carry[side], ids]), seq_len, tok.bos_id, tok.eos_id)
                    files[side].write(rows.tobytes())
                    stats[side] += (len(rows), lines, len(ids), nbytes)
                per_file[i] += (out["train"][1] + out["val"][1], bad)
                bar.update(size)
        bar.close()
        for (path, _), (good, bad) in zip(plan, per_file.tolist()):
            require(good or bad, f"{path} is empty: give text files with one sentence per line")
            # a few bad lines are skipped (LM1B has some); a file of mostly bad ones is not text
            require(bad <= good, f"{path} does not look like text: {bad:,} of its {good + bad:,} lines "
                                 f"are not UTF-8 (give UTF-8 text, one sentence per line)")
        for side in sides:  # no padding: a row needs L-2 tokens
            require(stats[side][0], f"the {side} text has {stats[side][2]:,} tokens, but one row of --seq-len "
                                    f"{seq_len} needs {seq_len - 2:,}: give more text or a smaller --seq-len"
                                    + " (or --val-data, or a larger --val-fraction)" * (side == "val"))
            files[side].close()
            os.replace(tmp[side], folder / f"{side}.bin")
    if per_file[:, 1].sum() and verbose:
        print(f"data: skipped {per_file[:, 1].sum():,} lines that are not UTF-8 text", file=sys.stderr)
    splits = {side: dict(zip(("rows", "lines", "tokens", "text_bytes"), stats[side].tolist())) for side in sides}
    meta = {"tokenizer": tok.kind, "seq_len": seq_len, "sources": sources, "bad_lines": int(per_file[:, 1].sum()),
            "splits": splits}
    write_atomic(folder / "meta.json", json.dumps(meta, indent=1))
    return meta

# ---- Batches: the rows and the randomness of step n are pure functions of (seed, n) ----
# So a resumed run reads the rows, and draws the orders and dropout, that the
# uninterrupted run would have, with no data position to save, on any number of processes.

@functools.lru_cache(maxsize=2)
def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)

def batch_rows(seed: int, step: int, size: int, n: int) -> np.ndarray:
    """Row ids of step `step`: positions [step*size, (step+1)*size) of the concatenated
    epochs, each epoch a seeded permutation of the n rows (every row once per epoch)."""
    pos = np.arange(step * size, (step + 1) * size)
    return np.concatenate([epoch_permutation(seed, e, n)[pos[pos // n == e] % n] for e in np.unique(pos // n)])

# ---- Flags and presets -----------------------------------------------------------------
# A preset fills the flags the user did not give: `cpu` (default) learns visibly in ~7 min
# on 2 CPU cores, `lm1b` is the paper's recipe, `lm1b-small` fits one GPU.

LM1B = dict(tokenizer=None, seq_len=128, dropout=0.1, batch_size=64, lr=3e-4, warmup_steps=2500,
            weight_decay=0.0, grad_clip=1.0, ema=0.9999, eval_rows=2048, eval_orders=1)
PRESETS = {
    "cpu": dict(tokenizer="bytes", seq_len=128, n_layer=4, n_head=4, d_model=256,
                # NOTE: no dropout: the demo sees less than one epoch, nothing to regularise
                dropout=0.0, batch_size=16, global_batch=None, max_steps=500, lr=1e-3,
                warmup_steps=100, weight_decay=0.0, grad_clip=1.0,
                # NOTE: an EMA shorter than the paper's 0.9999, which would outlast the demo
                ema=0.995, eval_every=100, eval_rows=256, eval_orders=1),
    # the paper: 132M parameters with the BERT vocab, global batch 512 by accumulation, bf16
    "lm1b": dict(LM1B, n_layer=12, n_head=12, d_model=768, global_batch=512, max_steps=1_000_000, eval_every=10_000),
    # 56M parameters: bf16 micro-batches of 64 fit in ~10 GB
    "lm1b-small": dict(LM1B, n_layer=8, n_head=8, d_model=512, global_batch=256, max_steps=200_000, eval_every=5000),
}
DEFAULTS = dict(preset="cpu", data=None, val_data=None, val_fraction=0.02, workers=min(os.cpu_count() or 1, 16),
                cache_dir=os.environ.get("SETDIFF_CACHE") or os.path.expanduser("~/.cache/setdiff"), prepare_only=False,
                order="staggered", set_size=4, max_set_size=None, log_every=10, out="out", resume=False, force=False,
                device=None, dtype="auto", compile=False, seed=0, bench=False, bench_steps=5, bench_repeats=3)
# Flags a resumed run may change; it takes every other flag from its checkpoint.
MAY_CHANGE = {"out", "resume", "force", "device", "dtype", "compile", "workers", "cache_dir", "log_every",
              "prepare_only", "bench", "bench_steps", "bench_repeats", "max_steps", "eval_every", "eval_rows",
              "eval_orders"}

def parse_args(argv) -> tuple:
    """-> (all settings, the flags the user typed). No flag has an argparse default, so the
    parse yields exactly the typed ones; the preset and DEFAULTS fill in the rest."""
    p = argparse.ArgumentParser(description="Train a set diffusion LM (setdiff.py); without flags, the CPU demo on "
                                "the built-in corpus.", argument_default=argparse.SUPPRESS)
    p.error = lambda message: require(False, f"{message} (see --help)")  # a usage error is one line too
    def add(flag, help, **kw):  # the help shows the default, or every preset's value
        key = flag[2:].replace("-", "_")
        default = DEFAULTS[key] if key in DEFAULTS else ", ".join(f"{n} {v[key]}" for n, v in PRESETS.items())
        shown = f" (default: {default})" if default not in (None, False) else ""
        p.add_argument(flag, help=(help + shown).replace("%", "%%"), **kw)
    add("--preset", "the defaults of the flags marked 'cpu ..., lm1b ...'", choices=list(PRESETS))
    add("--data", "text, a sentence a line (LM1B's news.en-*); None: the built-in corpus", nargs="+", metavar="FILE")
    add("--val-data", "validation text; None: a held-out slice of the training lines", nargs="+", metavar="FILE")
    add("--val-fraction", "share of the training lines held out, by a hash of their content", type=float)
    add("--tokenizer", "'bytes' or the path of a BERT vocab.txt (bert-base-uncased)")
    add("--cache-dir", "where prepared rows and the built-in corpus are cached ($SETDIFF_CACHE)")
    add("--workers", "tokenizing processes", type=int)
    add("--prepare-only", "tokenize and cache the data, then exit", action="store_true")
    add("--order", "order policy: set diffusion, or AR / masked / block diffusion", choices=list(ORDER_POLICIES))
    add("--set-size", "d: target set size (staggered, block)", type=int)
    add("--max-set-size", "s: staggered window; None: min(2d, L)", type=int)
    add("--seq-len", "L: tokens per row, BOS and EOS included", type=int)
    add("--n-layer", "transformer blocks", type=int)
    add("--n-head", "attention heads", type=int)
    add("--d-model", "hidden width", type=int)
    add("--dropout", "dropout probability", type=float)
    add("--batch-size", "rows per forward pass of one process", type=int)
    add("--global-batch", "rows per optimizer step over all processes (gradient accumulation)", type=int)
    add("--max-steps", "optimizer steps", type=int)
    add("--lr", "AdamW learning rate (betas 0.9, 0.999)", type=float)
    add("--warmup-steps", "linear warm-up steps, then constant", type=int)
    add("--weight-decay", "AdamW weight decay", type=float)
    add("--grad-clip", "gradient norm clipping (0: off)", type=float)
    add("--ema", "EMA decay of the evaluated and saved weights (0: off)", type=float)
    add("--eval-every", "steps between validations (and ckpt.pt saves)", type=int)
    add("--eval-rows", "validation rows scored (0: all)", type=int)
    add("--eval-orders", "K: decode orders sampled per validation row", type=int)
    add("--log-every", "steps between loss log lines", type=int)
    add("--out", "run directory: ckpt.pt (latest), best.pt (best validation), metrics.jsonl")
    add("--resume", "continue the run in --out exactly where it stopped", action="store_true")
    add("--force", "overwrite a different run in --out", action="store_true")
    add("--device", "cuda, cuda:N, mps or cpu; None: the first available of cuda, mps, cpu")
    add("--dtype", "autocast dtype", choices=["auto", "float32", "bfloat16"])
    add("--compile", "torch.compile the training step", action="store_true")
    add("--seed", "seed of the weights, batches, decode orders and dropout", type=int)
    add("--bench", "time training steps of set diffusion against plain AR of the same size", action="store_true")
    add("--bench-steps", "optimizer steps per timed run of --bench", type=int)
    add("--bench-repeats", "timed runs per variant of --bench (interleaved; median)", type=int)
    given = vars(p.parse_args(argv))
    args = argparse.Namespace(**{**DEFAULTS, **PRESETS[given.get("preset", "cpu")], **given})
    # absolute paths: a resumed run may start in another directory
    args.data, args.val_data = ([os.path.abspath(f) for f in v] if v else None for v in (args.data, args.val_data))
    args.tokenizer = args.tokenizer if args.tokenizer in (None, "bytes") else os.path.abspath(args.tokenizer)
    for key, low in (("max_steps", 1), ("batch_size", 1), ("global_batch", 1), ("eval_every", 1), ("log_every", 1),
                     ("eval_rows", 0), ("eval_orders", 1), ("warmup_steps", 0), ("workers", 1), ("seed", 0),
                     ("bench_steps", 1), ("bench_repeats", 1), ("seq_len", 3), ("n_layer", 1)):
        require(getattr(args, key) is None or getattr(args, key) >= low, f"--{key.replace('_', '-')} must be "
                f"at least {low}, got {getattr(args, key)}")
    require(0 < args.val_fraction < 1, f"--val-fraction must be between 0 and 1, got {args.val_fraction}")
    return args, set(given)

def load_tokenizer(args) -> Tokenizer:
    require(args.tokenizer, f"--preset {args.preset} needs --tokenizer PATH/vocab.txt (bert-base-uncased)")
    return Tokenizer.bytes() if args.tokenizer == "bytes" else Tokenizer.from_vocab(args.tokenizer)

def model_config(args, tok: Tokenizer) -> Config:
    """Config checks its own invariants (d <= L, ...): a violation is a flag error."""
    shape = {k: getattr(args, k) for k in ("seq_len", "n_layer", "n_head", "d_model", "dropout", "order",
                                           "set_size", "max_set_size")}
    return Config(tok.vocab_size, **shape, pad_id=tok.pad_id, bos_id=tok.bos_id, eos_id=tok.eos_id, mask_id=tok.mask_id)

# ---- The run directory: ckpt.pt (latest), best.pt (best validation), metrics.jsonl -----

RUN_FILES = ("ckpt.pt", "best.pt", "metrics.jsonl")

def prepare(args, given, master: bool) -> tuple:
    """Everything the user's input can fail, before any file is written. A resumed run takes its settings from
    the checkpoint plus the flags that may change; another flag that differs is an error, not a new run."""
    say, ckpt, out = print if master else (lambda *a: None), None, Path(args.out)
    if args.resume:
        require((out / "ckpt.pt").is_file(), f"--resume: no checkpoint {out / 'ckpt.pt'} to continue from")
        ckpt = load_checkpoint(out / "ckpt.pt")[2]
        require({"args", "step", "optimizer", "train_model"} <= ckpt.keys(),
                f"--resume: {out / 'ckpt.pt'} has no training state (not from this train_small.py)")
        for key in sorted(given - MAY_CHANGE):
            require(ckpt["args"].get(key) == getattr(args, key), f"--{key.replace('_', '-')} {getattr(args, key)} "
                    f"differs from the resumed run's {ckpt['args'].get(key)}: a resumed run keeps its settings")
        args = argparse.Namespace(**{**ckpt["args"], **{k: getattr(args, k) for k in given & MAY_CHANGE},
                                     "out": args.out, "resume": True})
    elif not args.prepare_only and not args.force:
        require(not any((out / f).exists() for f in RUN_FILES), f"--out {out} already holds a run: continue "
                f"it with --resume, overwrite it with --force, or choose another --out")
    tok = Tokenizer.from_spec(ckpt["tokenizer"]) if ckpt else load_tokenizer(args)  # no vocab file to resume
    if not args.data:
        say("data: built-in corpus (docstrings of the installed Python, numpy and torch)")
    train_files = expand(args.data, "--data") if args.data else [builtin_corpus(args.cache_dir)]
    plan = [(f, "hash") for f in train_files] if not args.val_data else \
        [(f, "train") for f in train_files] + [(f, "val") for f in expand(args.val_data, "--val-data")]
    rows, meta = prepare_rows(plan, tok, args.seq_len, args.cache_dir,
                              0.0 if args.val_data else args.val_fraction, args.workers, master)
    for side, s in meta["splits"].items():
        say(f"data: {side} {s['rows']:,} rows of {args.seq_len} ({s['lines']:,} lines, {s['tokens']:,} tokens)")
    val = meta["splits"]["val"]  # what sample.py scores when given no file
    val_rows = {"path": os.path.abspath(rows["val"].filename), "rows": val["rows"],
                "bytes_per_token": val["text_bytes"] / val["tokens"]}
    return args, ckpt, tok, rows, val_rows

def log(path: Path, **record) -> None:
    with open(path, "a") as f:  # a line at a time: a crash loses at most that line
        f.write(json.dumps(record) + "\n")

def save(path, run, resumable=False) -> None:
    """The EMA weights as "model" (what is evaluated and sampled); if `resumable`, also the
    raw weights and the optimizer (best.pt leaves them out: only ckpt.pt is resumed)."""
    extra = {"train_model": run.model.state_dict(), "optimizer": run.opt.state_dict()} if resumable else {}
    try:
        save_checkpoint(path, run.ema, run.tok, args=vars(run.args), val_rows=run.val_rows, **run.state, **extra)
    except OSError as e:
        raise OSError(f"could not save {path}: {e} (the previous checkpoint is intact)") from None

# ---- Training --------------------------------------------------------------------------

class TrainStep(torch.nn.Module):
    """The loss as a module's forward, so DDP (which hooks forward) and torch.compile see it."""
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, order):
        return self.model.loss(x, order)

def setup(args, given):
    """Processes, device, data, model, optimizer. Under torchrun (RANK, WORLD_SIZE, LOCAL_RANK) rank 0
    prepares the data, then the others open its cache (or meet the same error in the same input)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device, why_device = pick_device(args.device, int(os.environ.get("LOCAL_RANK", 0)))
    if world > 1:  # a long timeout: rank 0 may take a while to tokenize a large corpus
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(hours=2))
    if rank > 0:
        dist.barrier()
    try:
        args, ckpt, tok, rows, val_rows = prepare(args, given, master=rank == 0)
    finally:
        if rank == 0 and world > 1:
            dist.barrier()
    if args.prepare_only:
        return print(f"data ready in {args.cache_dir}") if rank == 0 else None
    # The global batch G is what the optimizer sees on any number of processes: each runs
    # micro-batches of `micro` rows, `accum` times, then DDP averages the gradients.
    G = args.global_batch or args.batch_size
    micro = min(args.batch_size, G // world)
    require(micro >= 1 and G % (micro * world) == 0, f"--global-batch {G} must be a multiple of --batch-size "
            f"{args.batch_size} times the {world} processes (or of the processes, if smaller)")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    dtype, why_dtype = pick_dtype(device, args.dtype)
    torch.manual_seed(args.seed)  # the same initial weights on every process
    model = SetDiffusionLM(model_config(args, tok)).to(device)
    ema = copy.deepcopy(model).requires_grad_(False) if args.ema > 0 else model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999),
                            weight_decay=args.weight_decay, fused=device.type == "cuda")
    for key, obj in (("train_model", model), ("model", ema), ("optimizer", opt)) if ckpt else ():
        obj.load_state_dict(ckpt[key])
    net = TrainStep(model)
    if world > 1:
        net = torch.nn.parallel.DistributedDataParallel(net, [device] if device.type == "cuda" else None)
    if rank == 0:
        print(f"device: {device} ({why_device}); autocast {str(dtype)[6:]} ({why_dtype})\n"
              f"model: {model.num_params() / 1e6:.2f}M parameters, order {args.order}; batch: {G} rows/step = "
              f"{micro} per forward x {G // (micro * world)} accumulation x {world} process(es)")
    return SimpleNamespace(rank=rank, world=world, device=device, dtype=dtype, args=args, tok=tok, rows=rows,
                           val_rows=val_rows, G=G, micro=micro, accum=G // (micro * world), model=model, ema=ema,
                           opt=opt, net=torch.compile(net) if args.compile else net, out=Path(args.out),
                           state={k: ckpt[k] if ckpt else v for k, v in (("step", 0), ("tokens", 0), ("best", None))})

def learning_rate(args, step: int) -> float:
    """Linear warm-up, then constant (the paper's schedule)."""
    return args.lr * min(1.0, (step + 1) / max(args.warmup_steps, 1))

def train_step(run, step: int) -> torch.Tensor:
    """One optimizer step on the global batch of `step`; returns its loss (on the device)."""
    args, total = run.args, 0.0
    seed = lambda stream: int(np.random.SeedSequence([args.seed, step, stream]).generate_state(1)[0])
    torch.manual_seed(seed(1 + run.rank))  # this step's dropout; stream 0 draws its decode orders
    for group in run.opt.param_groups:
        group["lr"] = learning_rate(args, step)
    # the global batch and its orders, as a 1-process run draws them; this process's share
    ids = batch_rows(args.seed, step, run.G, len(run.rows["train"])).reshape(run.accum, run.world, run.micro)
    orders = sample_order(run.model.cfg, run.G, torch.Generator().manual_seed(seed(0)))
    orders = orders.reshape(run.accum, run.world, run.micro, -1)                      # (A, W, B, L)
    for a in range(run.accum):
        x = torch.from_numpy(run.rows["train"][ids[a, run.rank]].astype(np.int64))  # (B, L)
        # DDP all-reduces the gradients in every backward unless told not to: once is enough
        sync = run.world == 1 or a == run.accum - 1
        with contextlib.nullcontext() if sync else run.net.no_sync(), autocast(run.device, run.dtype):
            loss = run.net(x.to(run.device), orders[a, run.rank].to(run.device)) / run.accum
        loss.backward()
        total = total + loss.detach()
    if args.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), args.grad_clip)
    run.opt.step()
    run.opt.zero_grad(set_to_none=True)
    if run.ema is not run.model:
        # NOTE: the decay ramps up as (1+t)/(10+t), so a short run's EMA is not its init
        d = min(args.ema, (1 + step) / (10 + step))
        for e, p in zip(run.ema.parameters(), run.model.parameters()):
            e.lerp_(p.detach(), 1 - d)
    return total

def evaluate(run, step: int) -> None:
    """Bound of the EMA weights on the first --eval-rows validation rows, orders from a fixed seed
    (comparable evaluations); bits per byte count L-2 text tokens per row (not BOS, final EOS)."""
    args, state = run.args, run.state
    x = torch.from_numpy(np.asarray(run.rows["val"][:args.eval_rows or None], dtype=np.int64))  # (n, L)
    with autocast(run.device, run.dtype):
        res = elbo(run.ema, x, args.eval_orders, 2 * run.micro, torch.Generator().manual_seed(args.seed))
    num_bytes = round(len(x) * (x.shape[1] - 2) * run.val_rows["bytes_per_token"])
    best = state["best"] is None or res.nll_per_token < state["best"]["nll_per_token"]
    if best:
        state["best"] = {"step": step, **res.metrics(num_bytes), "line": res.line(num_bytes)}
    log(run.out / "metrics.jsonl", step=step, kind="val", tokens=state["tokens"], **res.metrics(num_bytes))
    tqdm.write(f"step {step:,}: val {res.line(num_bytes)}{'  (best)' * best}")
    save(run.out / "ckpt.pt", run, resumable=True)
    if best:
        save(run.out / "best.pt", run)

def train(args, given) -> None:
    if (run := setup(args, given)) is None:
        return
    args, state, out, master = run.args, run.state, run.out, run.rank == 0
    if master:  # metrics.jsonl: a resumed run keeps the lines up to its step (not a cut-off one)
        out.mkdir(parents=True, exist_ok=True)
        for f in RUN_FILES[:2] if not args.resume else ():  # --force: the old run's checkpoints go
            (out / f).unlink(missing_ok=True)
        kept = (out / "metrics.jsonl").read_text(errors="replace").splitlines() if args.resume else []
        kept = [line + "\n" for line in kept if line.endswith("}") and json.loads(line)["step"] <= state["step"]]
        write_atomic(out / "metrics.jsonl", "".join(kept))
        print(f"resuming {out / 'ckpt.pt'} at step {state['step']:,}" if args.resume else f"run: {out}")
    start = window_start = time.perf_counter()
    step0, window_steps, running = state["step"], 0, torch.zeros((), device=run.device)
    bar = tqdm(total=args.max_steps, initial=step0, disable=not master, unit="step", dynamic_ncols=True)
    interrupted = []  # Ctrl-C only raises this flag, acted on between steps: no half steps
    previous = signal.signal(signal.SIGINT, lambda *_: interrupted.append(1))
    try:
        for step in range(step0, args.max_steps):
            running += train_step(run, step)
            state.update(step=step + 1, tokens=state["tokens"] + run.G * args.seq_len)
            window_steps += 1
            bar.update(1)
            if (step + 1) % args.log_every == 0 or step + 1 == args.max_steps:
                if run.world > 1:  # reading the loss syncs a GPU: it is summed, then read here
                    dist.all_reduce(running)
                loss, lr, now = running.item() / run.world / window_steps, learning_rate(args, step), time.perf_counter()
                tok_s = window_steps * run.G * args.seq_len / (now - window_start)
                bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tok_s:,.0f}", lr=f"{lr:.2e}")
                if master:
                    log(out / "metrics.jsonl", step=step + 1, kind="train", loss=loss, lr=lr,
                        tokens=state["tokens"], tokens_per_s=tok_s)
                window_start, window_steps = now, 0
                running.zero_()
            if master and ((step + 1) % args.eval_every == 0 or step + 1 == args.max_steps):
                evaluate(run, step + 1)
                window_start = time.perf_counter()  # validation is not training speed
            if interrupted:
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        bar.close()
        if master:  # `state` is the last whole step: --resume repeats nothing, skips nothing
            save(out / "ckpt.pt", run, resumable=True)
            print(f"\ninterrupted at step {state['step']:,}: saved {out / 'ckpt.pt'}; continue with "
                  f"--resume --out {out}", file=sys.stderr, flush=True)
        raise
    finally:
        signal.signal(signal.SIGINT, previous)
        bar.close()
    if master:  # the summary, and one sample from BOS with the default window
        minutes = (time.perf_counter() - start) / 60
        print(f"done: {state['step']:,} steps, {state['tokens']:,} tokens seen; {minutes:.1f} min this session "
              f"({(state['step'] - step0) * run.G * args.seq_len / minutes / 60:,.0f} tokens/s incl. validation)")
        if state["best"]:
            print(f"best validation (step {state['best']['step']:,}): {state['best']['line']}")
        g = generate(run.ema, temperature=1.0, top_p=0.9, generator=torch.Generator().manual_seed(args.seed))
        text = run.tok.decode(g.tokens[0].tolist()).strip().replace("\n", " | ")
        print(f"checkpoints: {out}/ckpt.pt (latest), {out}/best.pt (best)\n"
              f"sample ({g.nfe} network calls, {g.tokens_per_step:.2f} tokens/call): {text}")

# ---- Benchmark (--bench): what the two-stream set-causal step costs against plain AR ----
# The same modules on the same batch: set diffusion feeds 2L tokens (clean | mask stream)
# with the set-causal mask, AR feeds L tokens with a causal mask: a floor of about 2x.

def ar_loss(model: SetDiffusionLM, x: torch.Tensor) -> torch.Tensor:
    """Next-token loss of a plain causal transformer made of the model's modules."""
    B, L = x.shape
    positions = torch.arange(L, device=x.device).expand(B, L)                 # (B, L)
    causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()[None]  # (1, L, L)
    logits = model.logits(model.run(x, positions, causal)[:, :-1])            # (B, L-1, V)
    return F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())

def bench(args) -> None:
    """Median time of an optimizer step of each, fp32 and bf16, repeats interleaved (same noise)."""
    device, why = pick_device(args.device)
    tok, g = load_tokenizer(args), torch.Generator().manual_seed(args.seed)
    cfg = model_config(args, tok)
    # ordinary tokens only: a row with PAD would take the padded-mask path
    low, high = (0, 256) if tok.kind == "bytes" else (tok.mask_id + 1, tok.vocab_size)
    x = torch.randint(low, high, (args.batch_size, cfg.seq_len), generator=g)
    x[:, 0] = tok.bos_id
    x, order = x.to(device), sample_order(cfg, args.batch_size, g, device)
    print(f"bench: {device} ({why}), {torch.get_num_threads()} threads, batch {args.batch_size} x L={cfg.seq_len}, "
          f"{cfg.n_layer} layers x {cfg.d_model}, {args.bench_steps} steps x {args.bench_repeats} repeats\n\n"
          f"| dtype | variant | ms/step (median) | tokens/s | vs AR |\n|---|---|---|---|---|")
    for dtype in [torch.float32] + [torch.bfloat16] * (device.type != "mps"):
        torch.manual_seed(args.seed)
        model = SetDiffusionLM(cfg).to(device)  # one model for both: the step time does not care
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        fns = {"set diffusion (2L, set-causal)": lambda: model.loss(x, order),
               "AR (L, causal)": lambda: ar_loss(model, x)}
        fns, times = {k: torch.compile(f) if args.compile else f for k, f in fns.items()}, {k: [] for k in fns}
        for repeat in range(args.bench_repeats + 1):  # repeat 0 warms up (and compiles)
            for name, fn in fns.items():
                synchronize(device)
                t0 = time.perf_counter()
                for _ in range(args.bench_steps if repeat else 1):
                    with autocast(device, dtype):
                        loss = fn()
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                synchronize(device)
                times[name] += [(time.perf_counter() - t0) / args.bench_steps] if repeat else []
        med = {name: float(np.median(t)) for name, t in times.items()}
        for name, t in med.items():
            print(f"| {str(dtype)[6:]} | {name} | {t * 1e3:.1f} | {args.batch_size * cfg.seq_len / t:,.0f} "
                  f"| {t / med['AR (L, causal)']:.2f}x |")

# ---- Main: user errors become one line on stderr and exit code 2 -----------------------

def main(argv=None) -> int:
    """Command-line entry point; returns the exit code (0 done, 2 user error, 130 Ctrl-C)."""
    try:
        args, given = parse_args(argv)
        bench(args) if args.bench else train(args, given)
    except (ValueError, OSError) as e:
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {e}".replace("\n", " "), file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:  # the checkpoint is saved
        return 130
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0

if __name__ == "__main__":
    sys.exit(main())
