"""Train a set diffusion language model, from a laptop CPU to LM1B on one GPU.

    python train_small.py                            # CPU demo on the built-in corpus
    python train_small.py --preset lm1b --tokenizer vocab.txt --data 'news.en-*'
    torchrun --nproc_per_node 2 train_small.py       # the same run on N processes (DDP)
    python train_small.py --resume --out out         # continue a stopped run exactly
    python train_small.py --init-from DIR --out ft   # fine-tune a setdiff or released model

Validation rows are TRAINING lines held out by content hash; an LM1B test score is the bound
on all 50 news.en.heldout-* shards (sample.py --eval). Exit codes: 0 done, 2 a user error
(one line on stderr), 130 stopped by Ctrl-C or SIGTERM (ckpt.pt saved). The time of a step
against plain AR: experiments/train_bench.py.
"""

import sys

# Ctrl-C before main (torch loads for a second or more): the line main prints, and exit 130
STOPPED = "interrupted (outside the training steps: nothing new to save)"
try:
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
    import math
    import multiprocessing
    import os
    import re
    import signal
    import time
    from dataclasses import dataclass
    from pathlib import Path

    import numpy as np
    import torch
    import torch.distributed as dist
    from tqdm import tqdm

    import setdiff
    from setdiff import Config, SetDiffusionLM, Tokenizer, require
except KeyboardInterrupt:
    print(f"\n{STOPPED}", file=sys.stderr)
    sys.exit(130)

# ---- Presets: every hyperparameter of a run; a flag given wins ------------------------------
# cpu (the default) learns visibly on a laptop's CPU; lm1b is the paper's recipe (132M
# parameters, global batch 512 by accumulation, bf16); lm1b-small (56M) for a smaller GPU.
CPU = dict(
    tokenizer="bytes",
    seq_len=128,
    n_layer=4,
    n_head=4,
    d_model=256,
    dropout=0.0,  # NOTE: the demo trains less than an epoch: nothing to regularise
    order="staggered",
    set_size=4,
    max_set_size=None,
    val_fraction=0.02,
    batch_size=16,
    global_batch=None,
    max_steps=500,
    lr=1e-3,
    warmup_steps=100,
    weight_decay=0.0,  # none in the paper
    grad_clip=1.0,
    ema=0.995,  # NOTE: the paper's 0.9999 would outlast the demo's 500 steps
    eval_every=100,
    eval_rows=256,
)
LM1B = CPU | dict(
    tokenizer=None,  # BERT's vocab.txt: the user gives its path
    n_layer=12,  # the paper: 12 x 768, 12 heads
    n_head=12,
    d_model=768,
    dropout=0.1,
    val_fraction=0.0005,
    batch_size=64,
    global_batch=512,
    max_steps=1_000_000,
    lr=3e-4,
    warmup_steps=2500,
    ema=0.9999,
    eval_every=10_000,
    eval_rows=2048,
)
LM1B_SMALL = LM1B | dict(
    n_layer=8, n_head=8, d_model=512, global_batch=256, max_steps=200_000, eval_every=5000
)
PRESETS = {"cpu": CPU, "lm1b": LM1B, "lm1b-small": LM1B_SMALL}
# The model's shape: what --init-from brings, instead of these flags.
SHAPE = ("seq_len", "n_layer", "n_head", "d_model", "order", "set_size", "max_set_size")
# Flags a resumed run may change; it takes every other setting from its checkpoint.
MAY_CHANGE = {"out", "resume", "force", "device", "dtype", "compile", "threads", "workers"}
MAY_CHANGE |= {"cache_dir", "log_every", "max_steps", "eval_every", "eval_rows", "lr", "quiet"}


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


def is_prose(s: str) -> bool:
    """6-40 words, capitalised, a period at the end, ASCII, 85% letters, nothing code-like."""
    words = len(s.split())
    letters = sum(c.isalpha() or c == " " for c in s)
    shaped = 6 <= words <= 40 and s[:1].isupper() and s.endswith(".")
    wordy = letters >= 0.85 * len(s) and s.isascii()
    return shaped and wordy and not CODE_LIKE.search(s)


def prose_sentences(path) -> list:
    """The prose sentences of a .py file's docstrings."""
    try:
        tree = ast.parse(Path(path).read_bytes())
    except (SyntaxError, ValueError, RecursionError):
        return []  # e.g. Python 2 fixtures inside the standard library
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, DOCUMENTED):
            continue
        for paragraph in PARAGRAPH_END.split(ast.get_docstring(node) or ""):
            lines = paragraph.strip("\n").split("\n")
            if any(line[:1].isspace() or line.startswith(NOT_PROSE) for line in lines):
                continue  # code, doctests, directives, lists, parameter tables
            text = ROLE.sub(r"\2", " ".join(lines))
            text = re.sub(r"``([^`]+)``", r"\1", text)  # ``x`` -> x
            sentences = re.split(r"(?<=\.)\s+(?=[A-Z])", text)
            out += [s for s in sentences if is_prose(s)]
    return out


def builtin_corpus(cache_dir, roots=None, out=None) -> Path:
    """The prose of the .py files under `roots` (default: Python's, numpy's, torch's), one
    sentence per line, first occurrences only; cached."""
    python = sys.version.split()[0]
    versions = f"python{python}-numpy{np.__version__}-torch{torch.__version__}"
    name = f"builtin-corpus-v{CORPUS_RULE}-{versions}.txt"
    out = Path(out or Path(cache_dir) / name)
    if out.exists():
        return out
    roots = roots or [os.path.dirname(m.__file__) for m in (os, np, torch)]
    files = []
    for root in roots:
        for folder, dirs, names in os.walk(root):  # sorted: os.walk's order is the OS's
            dirs[:] = sorted(d for d in dirs if d not in SKIPPED)
            files += [Path(folder) / n for n in sorted(names) if n.endswith(".py")]
    sentences = {}  # a dict keeps each sentence's first place
    # disable=None: no bar where stderr is not a terminal (a log file would hold its redraws)
    for f in tqdm(files, desc="built-in corpus", unit="file", delay=1, disable=None):
        sentences.update(dict.fromkeys(prose_sentences(f)))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")  # renamed when whole: never half a file
    tmp.write_text("".join(s + "\n" for s in sentences), encoding="utf-8")
    os.replace(tmp, out)
    return out


# ---- Text files -> rows in a uint16 memmap, cached ------------------------------------------
# setdiff's "Text -> rows" section says what a document is (a sentence a line; GPT-2: a text
# whose documents end at an <|endoftext|> line), how it becomes ids and ids become rows.
# Workers tokenize ~1 MB chunks of whole documents; the main process wraps their ids in file
# order into a row file, so memory stays bounded and the rows do not depend on the number of
# workers. A document is held out for validation by a hash of its content, so that identical
# lines (LM1B has many) land on one side. meta.json records what the rows were made from.
CHUNK_BYTES = 1 << 20
ROWS_RULE = 3  # bump when the rows change: it renames the cache
SIDES = ("train", "val")
_TOK = None  # the tokenizer of a worker process


def set_tokenizer(spec: dict) -> None:
    global _TOK  # built once per worker, from its spec: tokenizers are not pickled
    _TOK = Tokenizer.from_spec(spec)


def tokenize_chunk(task) -> tuple:
    """-> (file index, bytes read, [lines of text, lines skipped as not text], {side:
    dict(ids, documents, text_bytes)})."""
    index, data, fraction = task
    out = {side: dict(ids=[], documents=0, text_bytes=0) for side in SIDES}
    docs, lines, bad = setdiff.documents(_TOK, data)
    for doc in docs:
        text = doc.encode()
        digest = hashlib.blake2b(text, digest_size=8).digest()
        held_out = int.from_bytes(digest, "little") < fraction * 2**64
        part = out["val" if held_out else "train"]
        part["ids"] += setdiff.document_ids(_TOK, doc)
        part["documents"] += 1
        part["text_bytes"] += len(text) + 1  # + the newline that EOS stands for
    for part in out.values():
        part["ids"] = np.array(part["ids"], np.uint16)
    return index, len(data), [lines, bad], out


def tokenized_chunks(files, tok: Tokenizer, fraction: float, workers: int):
    """tokenize_chunk of ~CHUNK_BYTES of whole documents at a time, file after file, in order."""

    def chunks():
        for i, path in enumerate(files):
            with open(path, "rb") as f:
                data = bytearray()
                for line in f:
                    data += line
                    if len(data) >= CHUNK_BYTES and setdiff.document_end(tok, line):
                        yield i, bytes(data), fraction
                        data.clear()
                yield i, bytes(data), fraction

    spec = tok.spec()
    set_tokenizer(spec)  # the serial path is a worker too
    if workers == 1:
        yield from map(tokenize_chunk, chunks())
        return
    # Spawned, not forked: forking after torch started its threads can hang. Born ignoring
    # Ctrl-C, the workers leave it to this process, which terminates them (a worker that died of
    # it would print a traceback, and its task would never come back).
    ctrl_c = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        pool = multiprocessing.get_context("spawn").Pool(workers, set_tokenizer, (spec,))
    finally:
        signal.signal(signal.SIGINT, ctrl_c)
    with pool:
        tasks = chunks()  # a few chunks per worker at a time: bounded memory, the same rows
        while batch := list(itertools.islice(tasks, 4 * workers)):
            yield from pool.imap(tokenize_chunk, batch)


def prepare_rows(files, tok, seq_len, cache_dir, val_fraction, workers=1, verbose=True):
    """Rows of the text `files` -> ({"train" | "val": np.memmap (N, L) uint16}, meta). The
    settings name the cache folder; the files' sizes and mtimes say whether it is fresh."""
    require(tok.vocab_size <= 2**16, f"--tokenizer: {tok.vocab_size:,} ids overflow uint16 rows")
    key = json.dumps([ROWS_RULE, tok.spec(), seq_len, val_fraction, *map(str, files)])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]  # other settings: another folder
    folder = Path(cache_dir) / f"rows-{tok.kind}-L{seq_len}-{digest}"
    sources = []
    for f in files:
        stat = f.stat()
        sources.append(dict(path=str(f), size=stat.st_size, mtime=stat.st_mtime_ns))
    meta = {}
    with contextlib.suppress(OSError, ValueError):
        meta = json.loads((folder / "meta.json").read_text())
    if meta.get("sources") != sources:
        meta = build_rows(folder, files, sources, tok, seq_len, val_fraction, workers, verbose)
    elif verbose:
        print(f"data: reusing {folder}")
    rows = {}  # memmaps: read from disk on demand
    for side, count in meta["splits"].items():
        rows[side] = np.memmap(
            folder / f"{side}.bin", np.uint16, "r", shape=(count["rows"], seq_len)
        )
    return rows, meta


def build_rows(folder, files, sources, tok, seq_len, val_fraction, workers, verbose) -> dict:
    """Tokenize, wrap into rows in file order, check the counts, then commit: the row files
    first, meta.json last (a half-built cache must never look valid)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "meta.json").unlink(missing_ok=True)  # stale until the rows are whole
    total = sum(source["size"] for source in sources)
    if total <= 2 * CHUNK_BYTES:
        workers = 1  # small: workers would cost, not save
    shown = None if verbose else True  # None: a bar on a terminal only
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", disable=shown)
    counts = {side: dict(rows=0, documents=0, tokens=0, text_bytes=0) for side in SIDES}
    carry = {side: np.empty(0, np.uint16) for side in SIDES}  # tokens waiting for a row
    lines = np.zeros((len(files), 2), np.int64)  # a file's lines of text, and bad lines
    tmp = {side: folder / f"{side}.bin.tmp-{os.getpid()}" for side in SIDES}
    outs = {side: open(tmp[side], "wb") for side in SIDES}
    try:
        for i, size, read, out in tokenized_chunks(files, tok, val_fraction, workers):
            for side, part in out.items():
                stream = np.concatenate([carry[side], part["ids"]])  # a row may span two chunks
                rows, carry[side] = setdiff.wrap_rows(stream, seq_len, tok.bos_id, tok.eos_id)
                outs[side].write(rows.tobytes())
                count = counts[side]
                count["rows"] += len(rows)
                count["documents"] += part["documents"]
                count["tokens"] += len(part["ids"])
                count["text_bytes"] += part["text_bytes"]
            lines[i] += read
            bar.update(size)
        bar.close()
        check_rows(files, lines, counts, seq_len)
        for side in SIDES:
            outs[side].close()
            os.replace(tmp[side], folder / f"{side}.bin")
    finally:
        for side in SIDES:
            outs[side].close()
            tmp[side].unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # a failed build leaves no empty folder behind
            folder.rmdir()
    meta = dict(sources=sources, bad_lines=int(lines[:, 1].sum()), splits=counts)
    (folder / "meta.json").write_text(json.dumps(meta, indent=1))  # a cut one reads as stale
    return meta


def check_rows(files, lines, counts: dict, seq_len: int) -> None:
    """Refuse a file that is empty or not text, and a side without one whole row."""
    for path, read in zip(files, lines.tolist()):
        setdiff.check_text("--data", path, *read)
    for side, count in counts.items():
        require(
            count["rows"],
            f"the {side} text has {count['tokens']:,} tokens, too few for a row of --seq-len "
            f"{seq_len}: give more text, a smaller --seq-len or another --val-fraction",
        )


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
    epochs = pos // n
    ids = [epoch_permutation(seed, e, n)[pos[epochs == e] % n] for e in np.unique(epochs)]
    return np.concatenate(ids)


def step_seed(seed: int, step: int, stream: int) -> int:
    """The seed of one stream of a step's randomness: 0 the decode orders, 1 + rank dropout."""
    state = np.random.SeedSequence([seed, step, stream]).generate_state(1)
    return int(state[0])


# ---- Flags ---------------------------------------------------------------------------------
class Parser(argparse.ArgumentParser):
    def error(self, message):  # a usage error is one line and exit code 2, like any bad input
        self.exit(2, f"error: {message} (see --help)\n")


def within(low, high=math.inf, kind=float):
    """An argparse type: a number in [low, high)."""

    def number(text: str):  # argparse names the type after this function
        value = kind(text)
        if not low <= value < high:  # NaN too
            bounds = f"at least {low}" if high == math.inf else f"in [{low}, {high})"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {text}")
        return value

    return number


def flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def build_parser() -> Parser:
    """Every flag. A preset's flag defaults to None, which parse_args replaces by the value of
    --preset; its help lists each preset's value."""
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)

    def preset(option: str, help: str, **kw):  # a flag whose default is the --preset's
        key = option[2:].replace("-", "_")
        shown = ", ".join(f"{name} {values[key]}" for name, values in PRESETS.items())
        p.add_argument(option, help=f"{help} ({shown})", **kw)

    cache = os.environ.get("SETDIFF_CACHE") or os.path.expanduser("~/.cache/setdiff")
    positive = within(1, kind=int)
    natural = within(0, kind=int)
    non_negative = within(0)
    fraction = within(0, 1)
    add = p.add_argument
    add("--preset", choices=PRESETS, default="cpu", help="the values marked (cpu ...)")
    preset("--tokenizer", "'bytes', BERT's vocab.txt, or GPT-2's vocab.json")
    preset("--seq-len", "L: tokens per row, BOS and EOS included", type=within(3, kind=int))
    preset("--n-layer", "transformer blocks", type=positive)
    preset("--n-head", "attention heads", type=positive)
    preset("--d-model", "hidden width", type=within(2, kind=int))
    preset("--dropout", "residual dropout", type=float)
    preset("--order", "policy: set, AR, masked or block diffusion", choices=setdiff.ORDER_POLICIES)
    preset("--set-size", "d: the target set size (staggered, block)", type=int)
    preset(
        "--max-set-size", "s: the largest set size (the authors' smax; None: min(2d, L))", type=int
    )
    preset("--val-fraction", "share of the lines held out for validation", type=fraction)
    preset("--batch-size", "rows per forward pass of one process", type=positive)
    preset("--global-batch", "rows per step, all processes (None: --batch-size)", type=positive)
    preset("--max-steps", "optimizer steps", type=positive)
    preset("--lr", "AdamW learning rate (betas 0.9, 0.999)", type=non_negative)
    preset("--warmup-steps", "linear warm-up steps, then constant", type=natural)
    preset("--weight-decay", "AdamW weight decay", type=non_negative)
    preset("--grad-clip", "gradient norm clipping (0: off)", type=float)
    preset("--ema", "EMA decay of the saved weights", type=fraction)
    preset("--eval-every", "steps between validations (and ckpt.pt saves)", type=positive)
    preset("--eval-rows", "validation rows scored (0: all)", type=natural)
    add("--data", nargs="+", help="text: a sentence a line (GPT-2: <|endoftext|> lines end texts)")
    add("--cache-dir", default=cache, help="prepared rows, the built-in corpus (%(default)s)")
    add(
        "--workers",
        type=positive,
        default=min(os.cpu_count() or 1, 16),
        help="tokenizing processes (%(default)s)",
    )
    add("--init-from", help="fine-tune a ckpt/model folder: its config, tokenizer win over flags")
    add("--log-every", type=positive, default=10, help="steps between loss lines (%(default)s)")
    add(
        "--quiet",
        action="store_true",
        help="no progress: no bar, nor plain lines where not a terminal",
    )
    add("--out", default="out", help="run folder: ckpt.pt, best.pt, metrics.jsonl (%(default)s)")
    add("--resume", action="store_true", help="continue the run in --out exactly")
    add("--force", action="store_true", help="overwrite a different run in --out")
    add("--device", help="cuda, cuda:N, mps or cpu (default: the first of them available)")
    dtypes = ["auto", "float32", "bfloat16"]
    bf16 = "auto: bf16 on a GPU that has it or a CPU with native bf16"
    add("--dtype", choices=dtypes, default="auto", help=f"autocast ({bf16})")
    add("--compile", action="store_true", help="torch.compile the training step")
    add("--threads", type=positive, help="CPU threads (default: the cores other work leaves)")
    seeds = within(0, 2**64, kind=int)  # torch.manual_seed's
    add("--seed", type=seeds, default=0, help="of weights, batches, orders, dropout (%(default)s)")
    return p


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
    return args, given


def load_tokenizer(spec) -> Tokenizer:
    """--tokenizer: 'bytes', a BERT vocab.txt, or a GPT-2 vocab.json with merges.txt beside it."""
    require(spec, "this --preset needs --tokenizer PATH: the vocab.txt of bert-base-uncased")
    if spec == "bytes":
        return Tokenizer.bytes()
    try:
        if not spec.endswith(".json"):
            return Tokenizer.from_vocab(spec)
        merges = Path(spec).with_name("merges.txt")  # as a hub download lays them out
        return Tokenizer.from_bpe(spec, merges)
    except ValueError as e:
        raise ValueError(f"--tokenizer: {e}") from None


def model_config(args, tok: Tokenizer) -> Config:
    """The Config of the flags; its own checks' messages get the flags' names."""
    require(
        args.max_set_size is None or args.order == "staggered",
        f"--max-set-size sets s of --order staggered, not of {args.order}",
    )
    shape = {key: getattr(args, key) for key in SHAPE}
    try:
        return Config(
            tok.vocab_size,
            **shape,
            dropout=args.dropout,
            mask_id=tok.mask_id,
            bos_id=tok.bos_id,
            eos_id=tok.eos_id,
            pad_id=tok.pad_id,
        )
    except ValueError as e:  # Config says d, s, L, ...: name the flags
        flags = ", ".join(map(flag, SHAPE))
        raise ValueError(f"{e} (set by {flags})") from None


# ---- Before the work: the run folder, the settings, the data -------------------------------
def check_folder(option: str, folder) -> None:
    """A folder to write in (made if missing), checked before the work that fills it."""
    here = Path(folder).absolute()
    existing = next(p for p in (here, *here.parents) if p.exists())
    writable = existing.is_dir() and os.access(existing, os.W_OK | os.X_OK)
    require(writable, f"{option} {folder}: {existing} is not a writable folder")


def check_out(args) -> None:
    """--out first: a typo should cost a second, not an hour of tokenizing."""
    check_folder("--out", args.out)
    out = Path(args.out)
    held = any((out / f).exists() for f in ("ckpt.pt", "best.pt", "metrics.jsonl"))
    require(
        not held or args.resume or args.force,
        f"--out {out} already holds a run: continue it with --resume, overwrite it with "
        "--force, or choose another --out",
    )


def resumed(args, given) -> tuple:
    """--resume -> settings(): the saved settings with the flags that may change (another flag
    set to a different value is an error, not a new run), the checkpoint's tokenizer, Config."""
    path = Path(args.out) / "ckpt.pt"
    require(path.is_file(), f"--resume: no checkpoint {path} to continue from")
    model, tok, ckpt = setdiff.load_checkpoint(path)  # refuses files of other versions
    trained = {"args", "step", "optimizer", "train_model"} <= ckpt.keys()
    require(trained, f"--resume: {path} has no training state (not from this train_small.py)")
    saved = ckpt["args"]
    for key in sorted(given - MAY_CHANGE):
        mine = getattr(args, key)
        theirs = saved.get(key)
        require(
            mine == theirs,
            f"{flag(key)} {mine} differs from the resumed run's {theirs}: it keeps those",
        )
    changed = {key: getattr(args, key) for key in given & MAY_CHANGE}
    # --quiet is this invocation's display, never the saved run's
    here = {"out": args.out, "resume": True, "quiet": args.quiet}
    settings = saved | changed | here
    return argparse.Namespace(**settings), tok, model.cfg, ckpt, None


def init_from(args, given) -> tuple:
    """--init-from -> settings(): the model's shape replaces the shape flags (a flag the user
    set to another value is an error, not silently overridden); its tokenizer, Config, weights."""
    require("tokenizer" not in given, "--tokenizer: --init-from brings its own tokenizer")
    try:
        model, tok, _ = setdiff.load_checkpoint(args.init_from)
    except ValueError as e:
        raise ValueError(f"--init-from: {e}") from None
    for key in SHAPE:
        value = getattr(model.cfg, key)
        mine = getattr(args, key)
        require(
            key not in given or mine == value,
            f"{flag(key)} {mine} disagrees with the --init-from model's {value}: leave it out",
        )
        setattr(args, key, value)  # saved with the run: a resume needs no source
    args.tokenizer = None  # the model's, saved in every checkpoint of the run
    model.cfg.dropout = args.dropout  # a training choice, not the model's
    return args, tok, model.cfg, None, model


def settings(args, given) -> tuple:
    """-> (settings, tokenizer, Config, the checkpoint resumed, the model fine-tuned): from
    the checkpoint (--resume), the --init-from model, or the flags."""
    check_out(args)
    if args.resume:
        return resumed(args, given)  # no vocab file needed to resume
    if args.init_from:
        return init_from(args, given)  # shape, order, d, s, special ids: the model's
    tok = load_tokenizer(args.tokenizer)
    return args, tok, model_config(args, tok), None, None


def load_data(args, tok: Tokenizer, cfg: Config, master: bool) -> tuple:
    """The rows of --data (no --data: the built-in corpus) -> (rows, the validation rows as
    sample.py --eval finds them: path, rows, bytes_per_token)."""
    check_folder("--cache-dir", args.cache_dir)
    files = []
    for pattern in args.data or ():  # a glob (news.en-*) stands for its files, sorted
        found = sorted(glob.glob(pattern))  # a plain path: itself, if it exists
        require(found and all(map(os.path.isfile, found)), f"--data {pattern}: no such file")
        files += [Path(f) for f in found]
    files = files or [builtin_corpus(args.cache_dir)]  # no --data: the demo corpus
    rows, meta = prepare_rows(
        files, tok, cfg.seq_len, args.cache_dir, args.val_fraction, args.workers, master
    )
    if master:
        for side, n in meta["splits"].items():
            print(
                f"data: {side} rows of {cfg.seq_len}: {n['rows']:,}; documents: {n['documents']:,}"
            )
    if master and meta["bad_lines"]:
        print(f"data: lines skipped as not UTF-8 text: {meta['bad_lines']:,}", file=sys.stderr)
    val = meta["splits"]["val"]
    path = os.path.abspath(rows["val"].filename)
    return rows, dict(
        path=path, rows=val["rows"], bytes_per_token=val["text_bytes"] / val["tokens"]
    )


# ---- Training ------------------------------------------------------------------------------
@dataclass
class Run:
    """One training run: settings, data, model and progress; setup() builds it."""

    args: argparse.Namespace  # the settings (a resumed run's: its checkpoint's)
    cfg: Config
    tok: Tokenizer
    rows: dict  # "train" | "val" -> np.memmap (N, L) uint16
    val_rows: dict  # what sample.py --eval scores: path, rows, bytes_per_token
    device: torch.device
    dtype: torch.dtype  # of autocast; the weights stay float32
    rank: int  # this process, of `world`
    world: int
    G: int  # rows per optimizer step, all processes together
    micro: int  # rows per forward pass
    accum: int  # micro-batches per process per step
    model: SetDiffusionLM  # the weights trained
    ema: SetDiffusionLM  # their moving average, evaluated and saved (--ema 0: the model)
    opt: torch.optim.Optimizer
    net: torch.nn.Module  # TrainStep(model), wrapped by DDP and torch.compile
    out: Path  # the run folder
    step: int = 0  # optimizer steps done
    best: dict | None = None  # the best validation: its step, metrics and line

    @property
    def tokens(self) -> int:  # trained on: the global batch is fixed for the run
        return self.step * self.G * self.cfg.seq_len


class TrainStep(torch.nn.Module):
    """The loss as a module's forward, so DDP (which hooks forward) and torch.compile see it."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, order):
        return setdiff.set_factorized_loss(self.model, x, order)


def build_model(args, cfg: Config, device, source, ckpt) -> tuple:
    """-> (model, its EMA, AdamW): new, from the --init-from model, or as ckpt left them."""
    torch.manual_seed(args.seed)  # the same initial weights on every process
    model = SetDiffusionLM(cfg).to(device)
    if source is not None:  # --init-from: its weights, and the EMA starts from them too
        model.load_state_dict(source.state_dict())
    ema = model
    if args.ema > 0:
        ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.AdamW(
        model.parameters(), args.lr, weight_decay=args.weight_decay, fused=device.type == "cuda"
    )
    if ckpt:
        model.load_state_dict(ckpt["train_model"])
        ema.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
    return model, ema, opt


def setup(args, given) -> Run:
    """Settings, processes, device, data, model, optimizer, run folder -> the run. Under
    torchrun, rank 0 prepares the data, then the others open its cache (or meet the same error
    in the input)."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    # the settings first: a resumed run's --device, --dtype and --threads, unless given again
    args, tok, cfg, ckpt, source = settings(args, given)
    device, dtype, how = setdiff.runtime(
        args.device, args.dtype, args.threads, local_rank, training=True
    )
    if world > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        # a long timeout: rank 0 may take a while to tokenize a large corpus
        dist.init_process_group(backend, timeout=datetime.timedelta(hours=2))
    if rank > 0:
        dist.barrier()
    try:
        rows, val_rows = load_data(args, tok, cfg, master=rank == 0)
    finally:
        if rank == 0 and world > 1:
            dist.barrier()
    # The global batch G is what the optimizer sees on any number of processes: each runs
    # micro-batches of `micro` rows, `accum` times, then DDP averages the gradients.
    G = args.global_batch or args.batch_size
    micro = min(args.batch_size, G // world)
    require(
        micro >= 1 and G % (micro * world) == 0,
        f"--global-batch {G} must be a multiple of --batch-size times {world} processes",
    )
    accum = G // (micro * world)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    model, ema, opt = build_model(args, cfg, device, source, ckpt)
    net = TrainStep(model)  # DDP and compile wrap this, not the model
    if world > 1:
        # no buffer broadcast each forward: the rotary tables are the only buffers, constant
        ddp = torch.nn.parallel.DistributedDataParallel
        net = ddp(net, [device] if cuda else None, forward_sync_buffers=False)
    if args.compile:
        net = torch.compile(net)
    if rank == 0:
        print(how)
        print(f"model: {model.num_params() / 1e6:.2f}M parameters, order {cfg.order}")
        print(f"batch: {G} rows/step = {micro} per forward x {accum} accumulation x {world} proc")
    run = Run(
        args=args,
        cfg=cfg,
        tok=tok,
        rows=rows,
        val_rows=val_rows,
        device=device,
        dtype=dtype,
        rank=rank,
        world=world,
        G=G,
        micro=micro,
        accum=accum,
        model=model,
        ema=ema,
        opt=opt,
        net=net,
        out=Path(args.out),
    )
    if ckpt:
        run.step = ckpt["step"]
        run.best = ckpt.get("best")
    if rank == 0:
        open_run_folder(run)
    return run


def open_run_folder(run: Run) -> None:
    """A resumed run keeps the lines of metrics.jsonl up to its step (not one a crash cut off);
    a new one (--force) removes an old run's checkpoints."""
    run.out.mkdir(parents=True, exist_ok=True)
    metrics = run.out / "metrics.jsonl"
    kept = []
    if run.args.resume and metrics.exists():
        for line in metrics.read_text(errors="replace").splitlines():
            if line.endswith("}") and json.loads(line)["step"] <= run.step:
                kept.append(line + "\n")
    if not run.args.resume:
        (run.out / "ckpt.pt").unlink(missing_ok=True)
        (run.out / "best.pt").unlink(missing_ok=True)
    metrics.write_text("".join(kept))
    print(f"run: {run.out}, from step {run.step:,}")


def train_step(run: Run, step: int) -> torch.Tensor:
    """One optimizer step on the global batch of `step` -> this process's share of its loss,
    on the device."""
    args = run.args
    torch.manual_seed(step_seed(args.seed, step, 1 + run.rank))  # this step's dropout
    warmup = min(1.0, (step + 1) / max(args.warmup_steps, 1))
    for group in run.opt.param_groups:  # linear warm-up, then constant (the paper's schedule)
        group["lr"] = args.lr * warmup
    # the global batch and its orders, as a 1-process run draws them; this process's share
    ids = batch_rows(args.seed, step, run.G, len(run.rows["train"]))
    ids = ids.reshape(run.accum, run.world, run.micro)[:, run.rank]  # (A, B)
    generator = torch.Generator().manual_seed(step_seed(args.seed, step, 0))
    orders = setdiff.sample_order(run.cfg, run.G, generator)
    orders = orders.reshape(run.accum, run.world, run.micro, -1)[:, run.rank]  # (A, B, L)
    total = 0.0  # this process's share of the step's loss, summed on the device
    for a in range(run.accum):
        x = torch.from_numpy(run.rows["train"][ids[a]].astype(np.int64))  # (B, L)
        x = setdiff.upload(x, run.device)  # no wait for the GPU: it keeps its queue
        order = setdiff.upload(orders[a], run.device)
        # DDP all-reduces the gradients in every backward unless told not to: once is enough
        sync = run.world == 1 or a == run.accum - 1
        with contextlib.nullcontext() if sync else run.net.no_sync():
            with setdiff.autocast(run.device, run.dtype):
                loss = run.net(x, order) / run.accum
            loss.backward()
        total = total + loss.detach()
    if args.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), args.grad_clip)
    run.opt.step()  # weights and optimizer state stay float32
    run.opt.zero_grad(set_to_none=True)
    if run.ema is not run.model:  # --ema 0: the raw weights are evaluated
        # NOTE: the decay ramps up as (1+t)/(10+t), so a short run's EMA is not its init
        decay = min(args.ema, (1 + step) / (10 + step))
        ema = list(run.ema.parameters())
        weights = [p.detach() for p in run.model.parameters()]
        torch._foreach_lerp_(ema, weights, 1 - decay)  # one kernel for all, not one a tensor
    return total


def save(path, run: Run, resumable=False) -> None:
    """The EMA weights as "model" (evaluated, sampled); if `resumable`, also the raw weights
    and the optimizer (not in best.pt: only ckpt.pt is resumed)."""
    extra = dict(
        args=vars(run.args), val_rows=run.val_rows, step=run.step, tokens=run.tokens, best=run.best
    )
    if resumable:
        extra["train_model"] = run.model.state_dict()
        extra["optimizer"] = run.opt.state_dict()
    setdiff.save_checkpoint(path, run.ema, run.tok, **extra)  # atomic: a failure keeps the last


def log_metrics(run: Run, record: dict) -> None:
    """A line of metrics.jsonl; written at once, so a crash loses one line at most."""
    with open(run.out / "metrics.jsonl", "a") as f:
        print(json.dumps(record), file=f)


def evaluate(run: Run, step: int) -> None:
    """The bound of the EMA weights on the first --eval-rows validation rows, one order a row
    from a fixed seed (so evaluations compare); then ckpt.pt, and best.pt if the best."""
    val = run.rows["val"][: run.args.eval_rows or None]
    x = torch.from_numpy(np.asarray(val, np.int64))  # (N, L)
    orders = torch.Generator().manual_seed(run.args.seed)
    with setdiff.autocast(run.device, run.dtype):
        res = setdiff.elbo(run.ema, x, 1, 2 * run.micro, orders)
    # bits per byte: the scored tokens that are text (not position 0, not wrap_rows' EOS)
    text_tokens = len(x) * setdiff.text_per_row(run.cfg)
    num_bytes = round(text_tokens * run.val_rows["bytes_per_token"])
    metrics = res.metrics(num_bytes)
    # the thread count beside the bound: it changes the rounding, which training amplifies
    line = f"{res.line(num_bytes)}; threads: {torch.get_num_threads()}"
    nll = res.nll_per_token
    require(math.isfinite(nll), f"step {step:,}: the bound is {nll}: diverged; lower --lr")
    best = run.best is None or nll < run.best["nll_per_token"]
    if best:
        run.best = {"step": step, **metrics, "line": line}
    log_metrics(run, dict(step=step, kind="val", tokens=run.tokens, **metrics))
    mark = "  (best)" if best else ""
    tqdm.write(f"step {step:,}: val {line}{mark}")
    save(run.out / "ckpt.pt", run, resumable=True)
    if best:
        save(run.out / "best.pt", run)


class Window:
    """The training steps since a mark: their mean loss and tokens/s. Each step is timed on its
    own, so validations and saves between steps do not count as training time."""

    def __init__(self, tokens_a_step: int):
        self.tokens_a_step = tokens_a_step
        self.reset()

    def reset(self) -> None:
        self.loss_sum = 0.0
        self.steps = 0
        self.seconds = 0.0

    def add(self, loss: float, seconds: float) -> None:
        self.loss_sum += loss
        self.steps += 1
        self.seconds += seconds

    def loss(self) -> float:
        return self.loss_sum / self.steps

    def tokens_per_s(self) -> float:
        return self.steps * self.tokens_a_step / self.seconds


def log_loss(run: Run, bar, window: Window) -> None:
    """The loss line, the mean since the last: the bar's postfix and metrics.jsonl's record."""
    loss = window.loss()
    lr = run.opt.param_groups[0]["lr"]
    tok_s = window.tokens_per_s()
    bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tok_s:,.0f}", lr=f"{lr:.2e}")
    if run.rank == 0:
        record = dict(step=run.step, kind="train", loss=loss, lr=lr, tokens_per_s=tok_s)
        log_metrics(run, record)
    window.reset()


def print_progress(run: Run, window: Window) -> None:
    """The plain line printed instead of the bar where the output is not a terminal (a cluster
    job's log file, a pipe), at each validation: the steps since the last line."""
    loss = window.loss()
    mean = f"the mean of {window.steps:,} steps"
    tok_s = window.tokens_per_s()
    lr = run.opt.param_groups[0]["lr"]
    print(f"step {run.step:,}: loss {loss:.4f} ({mean}); {tok_s:,.0f} tokens/s; lr {lr:.2e}")
    sys.stdout.flush()  # a log file shows the line now, not when a buffer fills
    window.reset()


def summary(run: Run, tokens0: int, start: float) -> None:
    """Speed, the best validation, and a sample of the EMA weights (generate's defaults)."""
    speed = (run.tokens - tokens0) / (time.perf_counter() - start)
    print(f"done: step {run.step:,}, {run.tokens:,} tokens; {speed:,.0f}/s")
    if run.best:
        print(f"best validation (step {run.best['step']:,}): {run.best['line']}")
    generator = torch.Generator().manual_seed(run.args.seed)
    g = setdiff.generate(run.ema, generator=generator)
    text = run.tok.decode(g.tokens[0].tolist()).strip().replace("\n", " | ")
    print(f"sample ({g.calls} calls, {g.tokens_per_call:.2f} tokens/call): {text}")


def train(args, given) -> int:
    """Set up, then the loop: steps, loss lines, validations with ckpt.pt. Progress: a bar on a
    terminal; where stderr is not one (a log file, a pipe), whose redraws would fill it, a plain
    line at each validation instead; --quiet, neither. Ctrl-C or SIGTERM (a job scheduler's)
    stops it between two steps and saves ckpt.pt. -> 0 done, 130 stopped."""
    run = setup(args, given)
    args = run.args
    master = run.rank == 0
    step0 = run.step  # > 0 for a resumed run
    tokens0 = run.tokens
    start = time.perf_counter()
    shown = master and not args.quiet
    terminal = sys.stderr.isatty()
    bar = tqdm(total=args.max_steps, initial=step0, disable=not (shown and terminal), unit="step")
    plain = shown and not terminal  # plain lines instead of the bar
    tokens_a_step = run.G * run.cfg.seq_len
    logged = Window(tokens_a_step)  # since the last loss line
    printed = Window(tokens_a_step)  # since the last plain line
    signals = []  # a handler only notes the signal: the loop stops between steps, never in one

    def note_signal(signum, frame):
        signals.append(signal.Signals(signum).name)

    handlers = {sig: signal.signal(sig, note_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for step in range(step0, args.max_steps):
            began = time.perf_counter()
            loss = train_step(run, step)
            # One all-reduce a step: the loss, and whether a process was signalled (they stop
            # together, or one would wait for the others forever). Reading it syncs the device.
            state = torch.stack([loss / run.world, loss.new_tensor(len(signals))])
            if run.world > 1:
                dist.all_reduce(state)  # the mean loss over the processes; signals
            loss, stop = state.tolist()
            run.step = step + 1
            require(  # never saved: ckpt.pt keeps the last good weights
                math.isfinite(loss),
                f"step {run.step:,}: the loss is {loss}: the run diverged; lower --lr",
            )
            seconds = time.perf_counter() - began  # the loss's read waited for the step
            logged.add(loss, seconds)
            printed.add(loss, seconds)
            bar.update(1)
            last = run.step == args.max_steps  # the last step always logs and evaluates
            if run.step % args.log_every == 0 or last:
                log_loss(run, bar, logged)
            if master and (run.step % args.eval_every == 0 or last):
                if plain:
                    print_progress(run, printed)
                evaluate(run, run.step)
            if stop:
                break
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        bar.close()
    ckpt = run.out / "ckpt.pt"
    stopped = run.step < args.max_steps
    if stopped and master:  # the state is the last whole step: --resume repeats nothing
        save(ckpt, run, resumable=True)
        why = signals[0] if signals else "another process's signal"
        print(
            f"\ninterrupted ({why}) at step {run.step:,}: saved {ckpt}; "
            f"continue: --resume --out {run.out}",
            file=sys.stderr,
        )
    if stopped:
        return 130
    if master:
        summary(run, tokens0, start)
    return 0


# ---- Main: user errors become one line on stderr and exit code 2 ---------------------------
def main(argv=None) -> int:
    """Command-line entry point; returns the exit code (0 done, 2 user error, 130 stopped)."""
    try:
        args, given = parse_args(argv)
        return train(args, given)
    except SystemExit as e:  # the parser printed its one line (or --help)
        return e.code
    except (ValueError, OSError) as e:
        # every process says why it stopped: an error of one process alone (its GPU, its
        # data) would otherwise be lost; torchrun then stops the others
        rank = int(os.environ.get("RANK", 0))
        who = f"rank {rank}: " if rank else ""
        print(f"error: {who}{e}".replace("\n", " "), file=sys.stderr, flush=True)
        return 2
    except RuntimeError as e:  # a collective whose peer stopped: the peer printed why
        if not dist.is_initialized() or "peer" not in str(e):
            raise
        why = setdiff.one_line(e)
        print(f"error: another process stopped, so this one did ({why})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # outside the training steps: the data work or the sample
        print(f"\n{STOPPED}", file=sys.stderr)
        return 130
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
