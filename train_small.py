"""Train a set diffusion language model, from a laptop CPU to LM1B on one GPU.

    python train_small.py                       # CPU demo on the built-in corpus (~10 min)
    python train_small.py --order ar            # the same budget for a baseline (SPEC §1)
    python train_small.py --preset lm1b --tokenizer vocab.txt \
        --data 'news.en-*' --val-data 'news.en.heldout-00000-of-00050'    # the paper (SPEC §6)
    torchrun --nproc_per_node 2 train_small.py  # any run on N processes (DDP)
    python train_small.py --resume --out out    # continue a stopped run exactly

The method (order policies, loss, likelihood bound, sampler, checkpoints) lives in
setdiff.py; this file only feeds it data and runs the optimisation loop. It is cut by
`# ----` banners: data (built-in corpus; text files -> wrapped rows in a memmap cache),
batches, presets and flags, device and processes, validation, run directory, training,
main. sample.py reuses `load_tokenizer`, `text_rows`, `validation_bound` and `UserError`.
Exit codes: 0 done, 2 a user error (one line on stderr), 130 interrupted (checkpoint saved).
"""

import argparse
import ast
import collections
import contextlib
import copy
import datetime
import glob
import hashlib
import importlib.util
import inspect
import json
import multiprocessing
import os
import platform
import re
import signal
import sys
import sysconfig
import time
from array import array
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from setdiff import (Config, SetDiffusionLM, Tokenizer, elbo, generate, load_checkpoint,
                     sample_order, save_checkpoint, synchronize)


class UserError(Exception):
    """A problem with the user's input (files, flags, output directory).

    main() prints its message as one line on stderr and exits with code 2, without a
    traceback: these are not bugs, and the message says what to do.
    """


def default_cache_dir() -> Path:
    """Where prepared data lives: $SETDIFF_CACHE, else the user's cache directory."""
    if os.environ.get("SETDIFF_CACHE"):
        return Path(os.environ["SETDIFF_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "setdiff"


def default_workers() -> int:
    """Worker processes for data preparation: all cores, but not absurdly many."""
    return max(1, min(os.cpu_count() or 1, 16))


def _replace_atomically(tmp: Path, final: Path) -> None:
    """Rename a finished temp file over its final name (atomic on POSIX and Windows).

    Everything this script writes (corpus, rows, meta, metrics) goes to a temp file in the
    same directory first, so a crash or a full disk never leaves a half-written file
    under a name that later runs would trust."""
    os.replace(tmp, final)


# ----------------------------------------------------------------------------------------
# Built-in corpus: the docstrings of the Python standard library, numpy and torch
#
# Every machine that can run this script has these files, so the CPU demo needs no
# download. The text is technical English, and it depends on the installed versions,
# which is why the cache file name carries them. We read the *source files* with `ast`
# (never importing the modules: importing all of torch's submodules is slow and has side
# effects) in a sorted order, so the same versions always give the same corpus.

CORPUS_VERSION = 1  # bump when the extraction or cleaning rules change (renames the cache)
_SKIP_DIRS = {"test", "tests", "testing", "idle_test", "__pycache__", "site-packages"}
# numpydoc sections that hold tables of names and types rather than prose
_TABLE_SECTIONS = {"parameters", "other parameters", "returns", "yields", "receives", "raises",
                   "warns", "see also", "examples", "example", "attributes", "methods",
                   "references", "keyword arguments"}
# Google-style headers ("Args:", "Example::") whose indented block is a table or code
_BLOCK_HEADER = re.compile(
    r"(args|arguments|parameters|params|keyword args|kwargs|returns?|return type|yields?|"
    r"raises|attributes|shape|inputs?|outputs?|examples?|variables|type|rtype)\s*::?",
    re.IGNORECASE)
_ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "vs.", "cf.", "al.", "approx.", "resp.", "Dr.",
                  "Mr.", "No.", "no.", "Fig.", "eq.", "Eq.")
_WORD = re.compile(r"[(\"']?[A-Za-z]+(?:['-][A-Za-z]+)*[\"')]?[.,;:!?]?[\"')]?")


def builtin_corpus_sources() -> list[tuple[str, Path]]:
    """(label, source root) of the standard library, numpy and torch, found without import."""
    roots = [("python", Path(sysconfig.get_paths()["stdlib"]))]
    for name in ("numpy", "torch"):
        # find_spec of a top-level package locates it without executing its __init__
        roots.append((name, Path(importlib.util.find_spec(name).origin).parent))
    return roots


def builtin_corpus_files(root: Path) -> list[Path]:
    """All .py files under `root` in a sorted, machine-independent order, tests excluded."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        files += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _string_value(node: ast.AST) -> str | None:
    """The text of a string literal, of `"...".format(...)` and of `"..." + "..."`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format":
        return _string_value(node.func.value)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _string_value(node.left), _string_value(node.right)
        return None if left is None or right is None else left + right
    return None


def _docstrings(source: bytes) -> list[str]:
    """Docstrings of a module in source order: module/class/function docstrings, `__doc__ =`
    assignments and the string arguments of torch's `add_docstr(fn, r\"\"\"...\"\"\")` calls
    (where most of torch's documentation lives)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError):
        return []  # e.g. Python 2 test fixtures inside the standard library
    found = []
    for node in ast.walk(tree):
        texts = []
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            texts = [ast.get_docstring(node, clean=False)]
        elif isinstance(node, ast.Assign) and any(getattr(t, "id", getattr(t, "attr", "")) == "__doc__"
                                                  for t in node.targets):
            texts = [_string_value(node.value)]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) \
                in ("add_docstr", "_add_docstr", "add_docstr_all"):
            texts = [_string_value(arg) for arg in node.args[1:]]
        found += [(getattr(node, "lineno", 0), inspect.cleandoc(t)) for t in texts if t]
    return [doc for _, doc in sorted(found, key=lambda x: x[0])]


def _prose_paragraphs(doc: str) -> list[str]:
    """Drop everything in a docstring that is not running text (doctests, parameter tables,
    reST directives and literal blocks, section headers) and join the rest into paragraphs."""
    # A line-by-line state machine, because reST structure is carried by indentation and
    # by the line *after* a header (its underline), which a regex over the text cannot see.
    lines = doc.splitlines()
    paragraphs, current = [], []
    skip_indent = None      # skip lines indented deeper than this (a dropped block)
    in_table_section = False  # inside "Parameters\n----------" and friends
    i = 0
    while i < len(lines):
        line, i = lines[i], i + 1
        text = line.strip()
        indent = len(line) - len(line.lstrip())
        if skip_indent is not None:
            if not text or indent > skip_indent:
                continue
            skip_indent = None
        nxt = lines[i].strip() if i < len(lines) else ""
        boundary = (not text or text.startswith((">>>", "..", "- ", "* ", "+ "))
                    or re.match(r"\d+[.)] ", text) or (len(nxt) >= 3 and set(nxt) <= set("-=~^*")))
        if boundary and current:  # a paragraph ends at a blank line, list item or header
            paragraphs.append(" ".join(current))
            current = []
        if not text:
            continue
        if len(nxt) >= 3 and set(nxt) <= set("-=~^*"):  # numpydoc header + underline
            in_table_section = text.lower() in _TABLE_SECTIONS
            i += 1
            continue
        if in_table_section or set(text) <= set("-=~^*+| "):  # (or a table border)
            continue
        if text.startswith(">>>"):  # doctest: drop it and its output, up to a blank line
            while i < len(lines) and lines[i].strip():
                i += 1
            continue
        if text.startswith("..") or _BLOCK_HEADER.fullmatch(text):
            skip_indent = indent  # directive or "Args:" with its indented body
            continue
        if text.endswith("::"):  # "For example::" introduces an indented literal block
            skip_indent = indent
            text = text[:-1]
        current.append(re.sub(r"^([-*+]|\d+[.)]) ", "", text))  # a list item's text is prose
    if current:
        paragraphs.append(" ".join(current))
    return paragraphs


def _strip_markup(text: str) -> str:
    """Reduce reST inline markup to its plain text."""
    text = re.sub(r":[\w:.+-]+:`~?([^`<]*?)\s*(<[^>]*>)?`", lambda m: m.group(1).split(".")[-1]
                  if m.group(0).count("~") else m.group(1), text)     # :class:`~torch.Tensor`
    text = re.sub(r"`([^`<]+?)\s*<[^>]*>`__?", r"\1", text)           # `text <link>`_
    text = re.sub(r"``([^`]+)``", r"\1", text)                         # ``literal``
    text = re.sub(r"\*\*?([^*]+)\*\*?", r"\1", text)                   # *emphasis*
    text = re.sub(r"\\(\W)", r"\1", text)                              # escaped \*args
    return re.sub(r"\s+", " ", text).strip()


def _sentences(paragraph: str) -> list[str]:
    """Split at '. ', '! ', '? ' before a capital letter, except after abbreviations."""
    # Good enough for documentation English, which rarely has quotes or dialogue; "e.g."
    # and initials ("J. W. Tukey") would otherwise end sentences.
    pieces = re.split(r"(?<=[.!?])\s+(?=[A-Z])", paragraph)
    out = []
    for piece in pieces:
        if out and (out[-1].endswith(_ABBREVIATIONS) or re.search(r"\b[A-Z]\.$", out[-1])):
            out[-1] += " " + piece
        else:
            out.append(piece)
    return out


def is_prose(sentence: str) -> bool:
    """A sentence worth keeping: sensible length, capitalised, punctuated, and mostly words
    (identifiers, numbers, code and markup are the opposite of what we want to model)."""
    # shorter: headings and fragments ("Default: 1."); longer: run-on lists of options
    if not 24 <= len(sentence) <= 320 or not sentence.isprintable():
        return False
    if not (sentence[0].isupper() and sentence[0].isalpha() and sentence[-1] in ".!?"):
        return False
    # characters that (almost) only occur in code, markup, formulas and URLs
    if re.search(r"[`{}\[\]<>=_\\|#@$^~]|://|www\.", sentence):
        return False
    # "mostly words": letters with optional hyphen/apostrophe and surrounding punctuation;
    # a few numbers or dotted names (numpy.sum) are fine, a signature is not
    tokens = sentence.split()
    return len(tokens) >= 5 and sum(bool(_WORD.fullmatch(t)) for t in tokens) >= 0.85 * len(tokens)


def corpus_sentences(path: Path) -> list[str]:
    """The prose sentences of one source file (a worker task of `builtin_corpus`)."""
    out = []
    for doc in _docstrings(path.read_bytes()):
        for paragraph in _prose_paragraphs(doc):
            out += [s for s in _sentences(_strip_markup(paragraph)) if is_prose(s)]
    return out


def builtin_corpus_path(cache_dir: Path) -> Path:
    """The cache file of the built-in corpus: its name carries the library versions."""
    versions = f"python{platform.python_version()}-numpy{np.__version__}-torch{torch.__version__}"
    return Path(cache_dir) / f"builtin-corpus-v{CORPUS_VERSION}-{versions}.txt"


def builtin_corpus(cache_dir: Path, workers: int | None = None, files: list[Path] | None = None,
                   out: Path | None = None) -> Path:
    """Extract the built-in corpus once (cached; one sentence per line) and return its path.

    `files`/`out` select a subset and an explicit output path (for tests); by default every
    source file of `builtin_corpus_sources()` goes into `builtin_corpus_path(cache_dir)`.
    """
    out = out or builtin_corpus_path(cache_dir)
    if out.exists():
        return out
    if files is None:
        files = [f for _, root in builtin_corpus_sources() for f in builtin_corpus_files(root)]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    seen = set()
    workers = min(workers or default_workers(), len(files))
    try:
        with open(tmp, "w", encoding="utf-8") as f, contextlib.ExitStack() as stack:
            if workers > 1:
                pool = stack.enter_context(multiprocessing.get_context("spawn").Pool(workers))
                # imap keeps the file order, so the corpus does not depend on worker timing
                sentences = pool.imap(corpus_sentences, files, chunksize=8)
            else:
                sentences = map(corpus_sentences, files)
            for doc in tqdm(sentences, total=len(files), desc="built-in corpus", unit="file", delay=1):
                for s in doc:
                    if s not in seen:  # dedupe, keeping the first occurrence
                        seen.add(s)
                        f.write(s + "\n")
        _replace_atomically(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


# ----------------------------------------------------------------------------------------
# Text files -> LM1B-style wrapped rows, stored as a uint16 memmap cache
#
# SPEC §6: every sentence is tokenized and followed by EOS, everything is concatenated in
# file order, cut into chunks of L-2 tokens, and each chunk becomes the row
# [BOS] + chunk + [EOS]; the incomplete tail is dropped, so there is no padding. Files are
# read in byte ranges by worker processes; the main process only packs the returned uint16
# arrays into rows and appends them to the output file, so memory stays bounded for any
# corpus size. A JSON file next to the rows records what they were made from; when the
# sources or the tokenizer change, the cache is rebuilt.

ROWS_FORMAT = 1         # bump when the row layout or the meta file changes
CHUNK_BYTES = 1 << 20   # bytes of text per worker task
_WORKER_TOKENIZER = None


def load_tokenizer(name: str) -> Tokenizer:
    """`bytes`, or the path of a BERT `vocab.txt` (a UserError if it is not one)."""
    if name == "bytes":
        return Tokenizer.bytes()
    if not Path(name).is_file():
        raise UserError(f"--tokenizer: no such file: {name} (give 'bytes' or the path of a "
                        f"BERT vocab.txt)")
    try:
        return Tokenizer.from_vocab(name)
    except (ValueError, OSError) as e:  # UnicodeDecodeError is a ValueError too
        raise UserError(f"--tokenizer {name}: {e}".replace("\n", " ")) from None


def tokenizer_hash(tok: Tokenizer) -> str:
    """A short hash of the tokenizer's full spec (a different vocab gives different rows)."""
    return hashlib.sha256(json.dumps(tok.spec(), sort_keys=True).encode()).hexdigest()[:16]


def expand_inputs(patterns: list[str], flag: str = "--data") -> list[Path]:
    """Expand files and globs (in the order given, each glob sorted), checking they exist."""
    paths = []
    for pattern in patterns:
        if any(c in pattern for c in "*?["):
            matches = [Path(p) for p in sorted(glob.glob(pattern, recursive=True)) if Path(p).is_file()]
            if not matches:
                raise UserError(f"{flag} {pattern!r} matches no file")
        elif not Path(pattern).exists():
            raise UserError(f"{flag}: no such file: {pattern}")
        elif not Path(pattern).is_file():
            raise UserError(f"{flag}: {pattern} is not a file (give text files or a glob)")
        else:
            matches = [Path(pattern)]
        paths += [p.resolve() for p in matches]
    return list(dict.fromkeys(paths))  # dedupe, keep order


def held_out(line: bytes, fraction: float) -> bool:
    """Whether a training line belongs to the held-out validation slice.

    Decided by a hash of the line's content, so it is deterministic and identical lines
    (frequent in LM1B) always land on the same side."""
    h = int.from_bytes(hashlib.blake2b(line, digest_size=8).digest(), "little")
    return h < fraction * 2**64


def _byte_ranges(path: Path, size: int) -> list[tuple[int, int]]:
    """Cut a file into ~CHUNK_BYTES ranges that end at line breaks."""
    ranges, start = [], 0
    with open(path, "rb") as f:
        while start < size:
            f.seek(min(start + CHUNK_BYTES, size))
            f.readline()  # move on to the end of the current line
            end = min(max(f.tell(), start + 1), size)
            ranges.append((start, end))
            start = end
    return ranges


def _init_worker(spec: dict) -> None:
    """Build the tokenizer once per worker process (from its spec: tokenizers are not
    pickled, and a wordpiece tokenizer's word memo then warms up once per worker)."""
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = Tokenizer.from_spec(spec)


def _tokenize_range(task: tuple, tok: Tokenizer | None = None) -> dict:
    """Tokenize the lines of one byte range; each sentence is followed by EOS.

    task = (file index, path, start, end, split, val_fraction) where split is "train",
    "val", or "hash" (the held-out hash decides per line). Lines that are not UTF-8 (or
    contain NUL bytes) are skipped and counted."""
    index, path, start, end, split, fraction = task
    tok = tok or _WORKER_TOKENIZER
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    ids = {"train": array("H"), "val": array("H")}   # uint16, 2 bytes a token
    stats = {"index": index, "bad": 0, "lines": {"train": 0, "val": 0}, "bytes": {"train": 0, "val": 0}}
    for raw in data.split(b"\n"):
        raw = raw.strip()  # also drops the \r of Windows line ends
        if not raw:        # blank lines are not sentences (and not errors)
            continue
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            stats["bad"] += 1
            continue
        if "\x00" in line:  # valid UTF-8, but a sure sign of a binary file
            stats["bad"] += 1
            continue
        side = split if split != "hash" else ("val" if held_out(raw, fraction) else "train")
        ids[side].extend(tok.encode(line))
        ids[side].append(tok.eos_id)
        stats["lines"][side] += 1
        stats["bytes"][side] += len(raw) + 1  # + the newline, which EOS stands for
    stats["ids"] = {side: np.frombuffer(a, dtype=np.uint16) for side, a in ids.items()}
    return stats


class _RowWriter:
    """Packs a token stream into wrapped rows [BOS] + chunk + [EOS] appended to a file."""

    def __init__(self, path: Path, seq_len: int, tok: Tokenizer):
        self.file = open(path, "wb")
        self.seq_len, self.bos, self.eos = seq_len, tok.bos_id, tok.eos_id
        self.carry = np.empty(0, dtype=np.uint16)   # < L-2 tokens waiting for the next row
        self.rows = self.tokens = self.lines = self.bytes = 0

    def add(self, ids: np.ndarray) -> None:
        """Append tokens (sentences with their EOS) and write every row they complete."""
        body = self.seq_len - 2  # L-2 tokens of text between BOS and EOS
        self.tokens += len(ids)
        stream = np.concatenate([self.carry, ids])
        n = len(stream) // body
        if n:
            rows = np.empty((n, self.seq_len), dtype=np.uint16)            # (n, L)
            rows[:, 0], rows[:, -1] = self.bos, self.eos
            rows[:, 1:-1] = stream[: n * body].reshape(n, body)
            self.file.write(rows.tobytes())
            self.rows += n
        self.carry = stream[n * body:].copy()

    def summary(self, filename: str) -> dict:
        """Close the file and describe it; the carried tail (< L-2 tokens) is dropped."""
        self.file.close()
        return {"file": filename, "rows": self.rows, "lines": self.lines, "tokens": self.tokens,
                "text_bytes": self.bytes, "dropped_tail_tokens": len(self.carry)}


def _describe_sources(plan: list[tuple[Path, str]]) -> list[dict]:
    """Path, role, size and modification time of every input: the cache is valid only
    while all of these are unchanged (cheap to check, unlike hashing gigabytes)."""
    out = []
    for path, split in plan:
        st = path.stat()
        out.append({"path": str(path), "split": split, "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


def prepare_rows(plan: list[tuple[Path, str]], tok: Tokenizer, seq_len: int, cache_dir: Path,
                 val_fraction: float = 0.0, workers: int | None = None,
                 verbose: bool = True) -> tuple[dict, dict]:
    """Wrapped rows of the files in `plan`, from the cache when it is up to date.

    plan: (path, split) pairs, split in "train", "val" or "hash" (held-out lines by content
    hash, `val_fraction` of them, go to "val"). Returns ({split: np.memmap (N, L) uint16},
    meta) with a split for every side that received lines. Raises UserError on bad input;
    nothing in the cache is replaced unless the new rows are complete.
    """
    if seq_len < 3:
        raise UserError(f"--seq-len {seq_len} is too small: a row is BOS + at least one token + EOS")
    if tok.vocab_size > 2**16:
        raise UserError(f"vocab of {tok.vocab_size} tokens does not fit the uint16 row cache")
    # Two levels of "same input". The identity (which files, in which role, which tokenizer
    # and L) names the cache folder, so different settings never overwrite each other.
    # The sources' sizes and mtimes decide whether that folder is still fresh: an edited
    # file rebuilds its folder in place instead of leaving stale gigabytes behind.
    identity = {"format": ROWS_FORMAT, "tokenizer": tokenizer_hash(tok), "seq_len": seq_len,
                "val_fraction": val_fraction, "plan": [[str(p), s] for p, s in plan]}
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9.+-]", "_", plan[0][0].name)[:40]
    folder = Path(cache_dir) / f"rows-{stem}-{tok.kind}-L{seq_len}-{key}"
    sources = _describe_sources(plan)
    meta_path = folder / "meta.json"

    meta = _cached_meta(meta_path, sources, seq_len)
    if meta is None:
        meta = _build_rows(folder, plan, sources, tok, seq_len, val_fraction, workers, verbose)
        meta.update(identity=identity)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = meta_path.with_name(f"meta.json.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(meta, indent=1))
        _replace_atomically(tmp, meta_path)  # the meta file is written last: it commits
    elif verbose:
        print(f"data: reusing {folder}")
    # memmaps: rows are read from disk on demand, so LM1B's ~1.6 GB never sits in RAM
    rows = {side: np.memmap(folder / info["file"], dtype=np.uint16, mode="r", shape=(info["rows"], seq_len))
            for side, info in meta["splits"].items() if info["rows"] > 0}
    return rows, meta


def _cached_meta(meta_path: Path, sources: list[dict], seq_len: int) -> dict | None:
    """The meta of an up-to-date cache (same sources, sizes and mtimes; files complete)."""
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        return None
    if meta.get("format") != ROWS_FORMAT or meta.get("sources") != sources:
        return None
    for info in meta["splits"].values():
        f = meta_path.parent / info["file"]
        if not f.is_file() or f.stat().st_size != info["rows"] * seq_len * 2:
            return None
    return meta


def _build_rows(folder, plan, sources, tok, seq_len, val_fraction, workers, verbose) -> dict:
    """Tokenize every byte range of every file (in parallel when the input is large) and
    pack the results, in file order, into `{side}.bin`; returns the meta description."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "meta.json").unlink(missing_ok=True)  # a half-built cache must never look valid
    tasks = [(i, str(p), a, b, split, val_fraction)
             for i, (p, split) in enumerate(plan) for a, b in _byte_ranges(p, sources[i]["size"])]
    sides = sorted({s for _, split in plan for s in (("train", "val") if split == "hash" else (split,))})
    tmp = {side: folder / f"{side}.bin.tmp-{os.getpid()}" for side in sides}
    writers = {side: _RowWriter(tmp[side], seq_len, tok) for side in sides}
    per_file = [{"good": 0, "bad": 0} for _ in plan]
    total = sum(s["size"] for s in sources)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", disable=not verbose, delay=1)

    def consume(stats: dict) -> None:
        """Fold one range's result into the row files and the per-file counts. Ranges are
        consumed strictly in task order, so the rows do not depend on worker timing."""
        per_file[stats["index"]]["bad"] += stats["bad"]
        for side, ids in stats["ids"].items():
            if side in writers and (len(ids) or stats["lines"][side]):
                writers[side].add(ids)
                writers[side].lines += stats["lines"][side]
                writers[side].bytes += stats["bytes"][side]
            per_file[stats["index"]]["good"] += stats["lines"][side]

    try:
        workers = min(workers or default_workers(), len(tasks))
        if workers <= 1 or total <= 2 * CHUNK_BYTES:
            for task in tasks:  # small input: worker start-up would cost more than it saves
                consume(_tokenize_range(task, tok))
                bar.update(task[3] - task[2])
        else:
            # spawn, not fork: forking a process that has started torch's thread pools
            # can deadlock, and spawn behaves the same on Linux, macOS and Windows.
            ctx = multiprocessing.get_context("spawn")
            with ctx.Pool(workers, initializer=_init_worker, initargs=(tok.spec(),)) as pool:
                # Pool.imap would read ahead without limit; a bounded window of pending
                # tasks (2 per worker) keeps memory flat however large the corpus is.
                pending = collections.deque()
                for task in tasks:
                    pending.append((task, pool.apply_async(_tokenize_range, (task,))))
                    while len(pending) >= 2 * workers or (task is tasks[-1] and pending):
                        done, result = pending.popleft()
                        consume(result.get())
                        bar.update(done[3] - done[2])
        bar.close()
        splits = {side: w.summary(f"{side}.bin") for side, w in writers.items()}
        _check_counts(plan, per_file, splits, seq_len, val_fraction)
        # only complete, checked rows replace the cache; the temp files go in `finally`
        for side in sides:
            _replace_atomically(tmp[side], folder / f"{side}.bin")
    finally:
        bar.close()
        for side, w in writers.items():
            w.file.close()
            tmp[side].unlink(missing_ok=True)
    bad = sum(f["bad"] for f in per_file)
    if bad and verbose:
        print(f"data: skipped {bad:,} lines that are not UTF-8 text", file=sys.stderr)
    return {"format": ROWS_FORMAT, "tokenizer": {"kind": tok.kind, "sha256": tokenizer_hash(tok),
            "vocab_size": tok.vocab_size, "bos_id": tok.bos_id, "eos_id": tok.eos_id},
            "seq_len": seq_len, "dtype": "uint16", "val_fraction": val_fraction,
            "sources": sources, "bad_lines": bad, "splits": splits,
            "bad_lines_per_file": {str(p): f["bad"] for (p, _), f in zip(plan, per_file) if f["bad"]}}


def _check_counts(plan, per_file, splits, seq_len, val_fraction) -> None:
    """Turn empty, binary or too-small inputs into messages that say what to do."""
    for (path, _), f in zip(plan, per_file):
        if f["good"] == 0 and f["bad"] == 0:
            raise UserError(f"{path} is empty: give text files with one sentence per line")
        # A few bad lines are skipped (LM1B has some); a file that is mostly not UTF-8 is
        # a binary file or another encoding, and training on its scraps would be silent
        # garbage.
        if f["bad"] > f["good"]:
            raise UserError(f"{path} does not look like text: {f['bad']:,} of its "
                            f"{f['bad'] + f['good']:,} lines are not UTF-8 (give UTF-8 text, "
                            f"one sentence per line)")
    for side, info in splits.items():  # wrapped rows have no padding: a row needs L-2 tokens
        if info["rows"] == 0:
            what = "training text" if side == "train" else "validation text"
            hint = ("give more text or a smaller --seq-len" if side == "train" else
                    "give --val-data, more text, or a larger --val-fraction"
                    if any(s == "hash" for _, s in plan) else "give more validation text")
            raise UserError(f"the {what} has {info['tokens']:,} tokens, but one row of "
                            f"--seq-len {seq_len} needs {seq_len - 2:,} (L-2 tokens plus BOS "
                            f"and EOS): {hint}")


def text_rows(files: list[str], tok: Tokenizer, seq_len: int, cache_dir: Path,
              workers: int | None = None, verbose: bool = True) -> tuple[np.ndarray, float]:
    """All rows of the given text files as one split (what `sample.py --eval FILE` scores),
    and the source text's bytes per token."""
    rows, meta = prepare_rows([(p, "val") for p in expand_inputs(files, "--eval")], tok, seq_len,
                              cache_dir, workers=workers, verbose=verbose)
    return rows["val"], bytes_per_token(meta["splits"]["val"])


# ----------------------------------------------------------------------------------------
# Batches: a seeded shuffle of rows per epoch
#
# The only state of the data stream is its position (epoch, index): the permutation of an
# epoch is a pure function of (seed, epoch), so a resumed run reads exactly the rows the
# interrupted run would have read next, on any number of processes.

class RowStream:
    """Hands out row ids, `take(n)` at a time, epoch after epoch, each epoch shuffled."""

    def __init__(self, num_rows: int, seed: int, epoch: int = 0, index: int = 0):
        self.num_rows, self.seed = num_rows, seed
        self.epoch, self.index = epoch, index
        self._perm_epoch, self._perm = None, None

    def permutation(self, epoch: int) -> np.ndarray:
        """The row order of one epoch (cached: LM1B has millions of rows)."""
        if self._perm_epoch != epoch:
            rng = np.random.default_rng([self.seed, epoch])   # explicit, seeded per epoch
            self._perm, self._perm_epoch = rng.permutation(self.num_rows), epoch
        return self._perm

    def take(self, n: int) -> np.ndarray:
        """The next n row ids (every process takes the whole global batch, then keeps its
        own slice: the position stays the same on all processes)."""
        out = []
        while n > 0:  # a batch may straddle two epochs
            chunk = self.permutation(self.epoch)[self.index:self.index + n]
            out.append(chunk)
            n -= len(chunk)
            self.index += len(chunk)
            if self.index == self.num_rows:
                self.epoch, self.index = self.epoch + 1, 0
        return np.concatenate(out)

    def state_dict(self) -> dict:
        """The data position saved in checkpoints."""
        return {"epoch": self.epoch, "index": self.index}


def step_seed(seed: int, step: int, stream: str) -> int:
    """A 63-bit seed for one named random stream of one optimizer step.

    Every random draw of step t (decode orders, dropout) comes from generators seeded by
    (seed, t), so resuming at step t replays exactly what an uninterrupted run would draw,
    without depending on how many draws earlier steps (or evaluations) made."""
    digest = hashlib.blake2b(f"{seed}/{step}/{stream}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


# ----------------------------------------------------------------------------------------
# Presets and flags
#
# A preset fills every flag the user did not give. `cpu` is the default: a few million
# parameters that learn visibly in ~10 minutes on 2 CPU cores. `lm1b` is the paper's
# recipe (SPEC §6); `lm1b-small` is a shape that trains on one consumer GPU.

PRESETS = {
    "cpu": dict(
        tokenizer="bytes", seq_len=128, n_layer=4, n_head=4, d_model=256,
        # NOTE: no dropout in the CPU demo: it sees less than one epoch, so there is
        # nothing to regularise and dropout would only slow learning.
        dropout=0.0, batch_size=16, global_batch=None, max_steps=500, lr=1e-3,
        warmup_steps=100, weight_decay=0.0, grad_clip=1.0,
        # NOTE: a shorter EMA than the paper's 0.9999, which would average over more
        # steps than the demo runs.
        ema=0.995, eval_every=100, eval_rows=256, eval_orders=1),
    "lm1b": dict(  # SPEC §6: the paper's recipe, 132M parameters with the BERT vocab
        tokenizer=None, seq_len=128, n_layer=12, n_head=12, d_model=768, dropout=0.1,
        batch_size=64, global_batch=512, max_steps=1_000_000, lr=3e-4, warmup_steps=2500,
        weight_decay=0.0, grad_clip=1.0, ema=0.9999, eval_every=10_000, eval_rows=2048,
        eval_orders=1),
    "lm1b-small": dict(  # 56M parameters (BERT vocab); bf16 micro-batches of 64 fit ~10 GB
        tokenizer=None, seq_len=128, n_layer=8, n_head=8, d_model=512, dropout=0.1,
        batch_size=64, global_batch=256, max_steps=200_000, lr=3e-4, warmup_steps=2500,
        weight_decay=0.0, grad_clip=1.0, ema=0.9999, eval_every=5000, eval_rows=2048,
        eval_orders=1),
}
ADAM_BETAS = (0.9, 0.999)  # SPEC §6, the same in every preset
# Flags about this machine or this session: a resumed run takes them from the command line.
SESSION_FLAGS = {"out", "resume", "force", "device", "dtype", "compile", "workers", "cache_dir",
                 "log_every", "prepare_only", "bench", "bench_steps", "bench_repeats"}
# Session flags a resumed run keeps from the checkpoint unless given again (re-tokenizing
# LM1B into a different cache because --cache-dir was not repeated would cost an hour).
KEEP_UNLESS_GIVEN = {"cache_dir", "log_every", "workers"}
# Flags a resumed run may change when given; every other flag must match the checkpoint's run.
RESUME_OVERRIDES = {"max_steps", "eval_every", "eval_rows", "eval_orders"}


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (exit 2) like every other bad input."""

    def error(self, message):
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show '(default: X)' except for flags whose default comes from the preset."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def build_parser(with_defaults: bool = True) -> argparse.ArgumentParser:
    """The command line. `with_defaults=False` leaves out every default, so that parsing
    tells which flags the user actually typed (a resumed run needs to know)."""
    p = OneLineErrorParser(
        description="Train a set diffusion LM (setdiff.py). Without flags: the CPU demo on "
                    "the built-in corpus (docstrings of the installed Python, numpy and torch).",
        formatter_class=_HelpFormatter)

    def add(group, flag, default=None, **kw):
        group.add_argument(flag, default=default if with_defaults else argparse.SUPPRESS, **kw)

    def preset(group, flag, type, help):
        """A flag whose default comes from --preset; the help lists every preset's value."""
        key = flag[2:].replace("-", "_")
        values = ", ".join(f"{name}: {v[key]}" for name, v in PRESETS.items())
        add(group, flag, type=type, help=f"{help} (presets: {values})")

    add(p, "--preset", choices=sorted(PRESETS), default="cpu",
        help="defaults of the flags marked 'presets': the CPU demo, the paper's LM1B recipe, "
             "or a one-GPU version of it")
    g = p.add_argument_group("data")
    add(g, "--data", nargs="+", metavar="FILE_OR_GLOB",
        help="training text, one sentence per line (e.g. LM1B's news.en-*); default: the "
             "built-in corpus")
    add(g, "--val-data", nargs="+", metavar="FILE_OR_GLOB",
        help="validation text; default: a held-out slice of the training lines")
    add(g, "--val-fraction", type=float, default=0.02,
        help="share of training lines held out (chosen by a hash of their content) when "
             "--val-data is not given")
    preset(g, "--tokenizer", str, "'bytes' or the path of a BERT vocab.txt (bert-base-uncased)")
    add(g, "--cache-dir", type=Path, default=default_cache_dir(),
        help="where tokenized rows and the built-in corpus are cached")
    add(g, "--workers", type=int, default=default_workers(),
        help="worker processes for data preparation")
    add(g, "--prepare-only", action="store_true", default=False,
        help="prepare (tokenize and cache) the data, then exit")

    g = p.add_argument_group("model")
    add(g, "--order", choices=["staggered", "ar", "uniform", "block"], default="staggered",
        help="order policy: set diffusion or one of its special cases (SPEC §1)")
    add(g, "--set-size", type=int, default=4, help="d: target set size (staggered, block)")
    add(g, "--max-set-size", type=int,
        help="s: staggered window, default min(2d, L) (SPEC §2)")
    preset(g, "--seq-len", int, "L: tokens per row, BOS and EOS included")
    preset(g, "--n-layer", int, "transformer blocks")
    preset(g, "--n-head", int, "attention heads")
    preset(g, "--d-model", int, "hidden width")
    preset(g, "--dropout", float, "dropout probability")

    g = p.add_argument_group("optimisation")
    preset(g, "--batch-size", int, "rows per forward/backward of one process (micro-batch)")
    preset(g, "--global-batch", int, "rows per optimizer step over all processes, reached by "
           "gradient accumulation; None = --batch-size")
    preset(g, "--max-steps", int, "optimizer steps")
    preset(g, "--lr", float, "AdamW learning rate (betas 0.9, 0.999)")
    preset(g, "--warmup-steps", int, "linear warm-up steps, then a constant learning rate")
    preset(g, "--weight-decay", float, "AdamW weight decay")
    preset(g, "--grad-clip", float, "gradient norm clipping (0 = off)")
    preset(g, "--ema", float, "EMA decay of the weights that are evaluated and saved (0 = off)")

    g = p.add_argument_group("run")
    preset(g, "--eval-every", int, "validate (and save ckpt.pt) every this many steps")
    preset(g, "--eval-rows", int, "validation rows scored per evaluation (0 = all)")
    preset(g, "--eval-orders", int, "K: decode orders sampled per validation row (SPEC §4)")
    add(g, "--log-every", type=int, default=10, help="steps between loss log lines")
    add(g, "--out", type=Path, default=Path("out"),
        help="run directory: ckpt.pt (latest), best.pt (best validation), metrics.jsonl")
    add(g, "--resume", action="store_true", default=False,
        help="continue the run in --out exactly where it stopped")
    add(g, "--force", action="store_true", default=False,
        help="overwrite a different run in --out")
    add(g, "--device", help="cuda, cuda:N, mps or cpu (default: the first of cuda, mps, cpu "
                            "that is available)")
    add(g, "--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
        help="autocast dtype; auto picks bfloat16 where the hardware runs it fast")
    add(g, "--compile", action="store_true", default=False,
        help="torch.compile the training step")
    add(g, "--seed", type=int, default=0,
        help="seed of the weights, data order, decode orders and dropout")
    add(g, "--bench", action="store_true", default=False,
        help="time training steps of set diffusion against a plain AR transformer of the same "
             "size (fp32 and bf16, side by side) instead of training; prints a markdown table")
    add(g, "--bench-steps", type=int, default=5, help="optimizer steps per timed run of --bench")
    add(g, "--bench-repeats", type=int, default=3,
        help="timed runs per variant in --bench (interleaved; the median is reported)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.given = sorted(vars(build_parser(with_defaults=False).parse_args(argv)))
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    # Absolute paths, so that --resume works from any working directory.
    for key in ("data", "val_data"):
        if getattr(args, key):
            setattr(args, key, [os.path.abspath(p) for p in getattr(args, key)])
    if args.tokenizer not in (None, "bytes"):
        args.tokenizer = os.path.abspath(args.tokenizer)
    for key, low in (("max_steps", 1), ("batch_size", 1), ("eval_every", 1), ("log_every", 1),
                     ("eval_rows", 0), ("eval_orders", 1), ("warmup_steps", 0), ("workers", 1),
                     ("bench_steps", 1), ("bench_repeats", 1), ("seq_len", 3), ("n_layer", 1)):
        if getattr(args, key) < low:
            raise UserError(f"--{key.replace('_', '-')} must be at least {low}, got {getattr(args, key)}")
    if args.global_batch is not None and args.global_batch < 1:
        raise UserError(f"--global-batch must be at least 1, got {args.global_batch}")
    return args


# ----------------------------------------------------------------------------------------
# Device, dtype and processes
#
# One code path for 1 process and for N processes under torchrun: each process owns a
# disjoint slice of every global batch, DistributedDataParallel averages the gradients,
# and only rank 0 touches files or the terminal.

class Dist:
    """Rank and world size under torchrun (1 process otherwise).

    torchrun starts N copies of this script and tells each its RANK, WORLD_SIZE and
    LOCAL_RANK (its GPU on this machine) through the environment."""

    def __init__(self):
        self.rank = int(os.environ.get("RANK", 0))
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.master = self.rank == 0

    def print(self, *a, **k):
        """print() on rank 0 only: N processes should not say everything N times."""
        if self.master:
            print(*a, **k, flush=True)


def pick_device(requested: str | None, dist: Dist) -> tuple[torch.device, str]:
    """--device if given (checked), else the first of cuda -> mps -> cpu; and why."""
    if requested:
        try:
            device = torch.device(requested)
        except RuntimeError:
            raise UserError(f"--device {requested!r} is not a device: use cpu, cuda, cuda:N or mps") from None
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", dist.local_rank)  # one GPU per torchrun process
        if device.type == "cuda" and not torch.cuda.is_available():
            raise UserError(f"--device {requested}: CUDA is not available on this machine")
        if device.type == "mps" and not torch.backends.mps.is_available():
            raise UserError(f"--device {requested}: MPS is not available on this machine")
        return device, "requested with --device"
    if torch.cuda.is_available():
        return torch.device("cuda", dist.local_rank), "a CUDA GPU is available"
    if torch.backends.mps.is_available():
        return torch.device("mps"), "an Apple GPU (MPS) is available"
    return torch.device("cpu"), "no GPU found"


def pick_dtype(requested: str, device: torch.device) -> tuple[torch.dtype, str]:
    """Autocast dtype and why. Weights, optimizer state and EMA always stay float32."""
    if requested != "auto":
        return getattr(torch, requested), "requested with --dtype"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "the GPU supports bf16 (SPEC §6 trains with bf16 autocast)"
        return torch.float32, "the GPU has no bf16 (float16 would need loss scaling)"
    if device.type == "cpu":
        # Measured with the cpu preset on a 2-core AVX512-BF16 Xeon: bf16 autocast trained
        # at 0.64x the speed of float32 (1,440 vs 2,300 tokens/s): at this width the casts
        # cost more than the faster matmuls save.
        return torch.float32, "bf16 autocast measured slower than float32 for small models on CPU"
    return torch.float32, "bf16 autocast on MPS is not reliable enough for training"


def autocast(device: torch.device, dtype: torch.dtype):
    """Mixed precision for the forward pass: matmuls in `dtype`, weights stay float32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


class TrainStep(torch.nn.Module):
    """The training loss as a module's forward, so DistributedDataParallel (which hooks
    `forward`) and torch.compile see the whole step. The loss itself is setdiff's."""

    def __init__(self, model: SetDiffusionLM):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        return self.model.loss(x, order)


# ----------------------------------------------------------------------------------------
# Validation: the likelihood bound of SPEC §4 (also what `sample.py --eval` prints)

def bytes_per_token(split: dict) -> float:
    """UTF-8 bytes of the source text per token of a split (newline <-> EOS): 1.0 for the
    bytes tokenizer, ~4-5 for WordPiece on English."""
    return split["text_bytes"] / max(split["tokens"], 1)


def validation_bound(model: SetDiffusionLM, rows: np.ndarray, tok: Tokenizer, num_orders: int = 1,
                     max_rows: int = 0, batch_size: int = 32, seed: int = 0,
                     dtype: torch.dtype = torch.float32, text_bytes_per_token: float = 1.0) -> dict:
    """Perplexity bound and bits per byte of `model` on wrapped rows (N, L).

    The first `max_rows` rows (all if 0) are scored with `num_orders` decode orders each,
    drawn from a generator seeded by `seed`, so every evaluation of a run uses the same
    rows and orders and the numbers are comparable from step to step. Bits per byte divide
    the NLL by the bytes of SOURCE text the rows cover: L-2 tokens of text per row (BOS and
    the row's closing EOS are not text) times the split's bytes per token. NOTE: decoded
    WordPiece text (lower-cased, re-spaced) would miscount the bytes by ~20%."""
    n = len(rows) if max_rows <= 0 else min(max_rows, len(rows))
    x = torch.from_numpy(np.asarray(rows[:n], dtype=np.int64))         # (n, L)
    device = next(model.parameters()).device
    with autocast(device, dtype):
        res = elbo(model, x, num_orders=num_orders, batch_size=batch_size,
                   generator=torch.Generator().manual_seed(seed))
    num_bytes = round(n * (x.shape[1] - 2) * text_bytes_per_token)
    return {"ppl_bound": res.ppl, "nll_per_token": res.nll_per_token,
            "bits_per_byte": res.bits_per_byte(num_bytes), "se": res.se,
            "num_orders": res.num_orders, "tokens_scored": res.tokens, "rows": res.num_seqs,
            "bytes": num_bytes}


def format_bound(m: dict) -> str:
    """One line with everything SPEC §4 asks a reported bound to come with."""
    return (f"ppl <= {m['ppl_bound']:.3f}  ({m['nll_per_token']:.4f} +- {m['se']:.4f} nats/token, "
            f"{m['bits_per_byte']:.4f} bits/byte; {m['rows']} rows, {m['tokens_scored']:,} "
            f"tokens, {m['num_orders']} order{'s' if m['num_orders'] > 1 else ''})")


# ----------------------------------------------------------------------------------------
# The run directory: ckpt.pt (latest), best.pt (best validation), metrics.jsonl

RUN_FILES = ("ckpt.pt", "best.pt", "metrics.jsonl")


def check_out_dir(args) -> dict | None:
    """Refuse to mix two runs in one directory; returns the checkpoint to resume, if any."""
    out = args.out
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file, not a directory")
    if args.resume:
        if not (out / "ckpt.pt").is_file():
            raise UserError(f"--resume: no checkpoint {out / 'ckpt.pt'} to continue from")
        try:
            _, tok, ckpt = load_checkpoint(out / "ckpt.pt")
        except ValueError as e:
            raise UserError(f"--resume: {e}") from None
        if "train_model" not in ckpt or "state" not in ckpt:
            raise UserError(f"--resume: {out / 'ckpt.pt'} has no training state (optimizer, data "
                            f"position): it was not written by train_small.py")
        return ckpt
    held = [f for f in RUN_FILES if (out / f).exists()]
    if held and not args.force:
        raise UserError(f"--out {out} already holds a run ({', '.join(held)}): continue it with "
                        f"--resume, overwrite it with --force, or choose another --out")
    return None


def resumed_args(args, ckpt: dict) -> argparse.Namespace:
    """The checkpoint's settings, plus this session's flags (--device, ...) and the few
    flags a resumed run may change (--max-steps, ...). Any other flag that disagrees with
    the checkpoint is an error rather than a silently different run."""
    saved = dict(ckpt["args"])
    for key in args.given:
        if key not in SESSION_FLAGS | RESUME_OVERRIDES and saved.get(key) != getattr(args, key):
            flag = "--" + key.replace("_", "-")
            raise UserError(f"{flag} {getattr(args, key)} differs from the resumed run's "
                            f"{saved.get(key)}: a resumed run keeps its settings (drop {flag})")
    for key in SESSION_FLAGS | (RESUME_OVERRIDES & set(args.given)):
        if key in args.given or key not in saved or key not in KEEP_UNLESS_GIVEN:
            saved[key] = getattr(args, key)
    return argparse.Namespace(**saved, given=args.given)


def args_for_checkpoint(args) -> dict:
    """Flags as plain JSON-like values (checkpoints are loaded with weights_only=True)."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "given"}


def _step_of(line: str, default: int) -> int:
    """The step of one metrics.jsonl line; a line cut off by a crash counts as `default`."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return default


class MetricsLog:
    """metrics.jsonl: one JSON object per line, rank 0 only."""

    def __init__(self, path: Path, resume_step: int | None):
        self.path = path
        if resume_step is None:
            path.write_text("")
        elif path.exists():  # drop what was logged after the checkpoint we resume from
            kept = [l for l in path.read_text().splitlines() if _step_of(l, resume_step + 1) <= resume_step]
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(l + "\n" for l in kept))
            _replace_atomically(tmp, path)

    def write(self, **record) -> None:
        """Append one record; a line at a time, so a crash loses at most that line."""
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


# ----------------------------------------------------------------------------------------
# Benchmark (--bench): what the two-stream set-causal step costs against plain AR
#
# Both variants run through the SAME SetDiffusionLM modules on the same batch; only the
# layout differs: the set diffusion step feeds 2L tokens (clean | mask stream) with the
# set-causal mask and applies the head to the L mask-stream outputs, the AR step feeds L
# tokens with a causal mask and applies the head to all of them. The 2L sequence sets a
# floor of about 2x on the step time; attention over 2L costs a little more than 2x.

def ar_loss(model: SetDiffusionLM, x: torch.Tensor) -> torch.Tensor:
    """Next-token loss of a plain causal transformer built from the same modules."""
    B, L = x.shape
    positions = torch.arange(L, device=x.device).expand(B, L)            # (B, L)
    causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()[None]
    h = model.run(x, positions, causal)                                    # (B, L, D)
    logits = model.logits(h[:, :-1])                                       # (B, L-1, V)
    return F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())


def saved_activation_bytes(loss_fn) -> int:
    """Bytes of the tensors autograd keeps for the backward pass of one step: a device-
    independent stand-in for peak training memory (CPU has no peak-memory counter)."""
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        key = (t.untyped_storage().data_ptr(), t.dtype)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn().backward()
    return total


def bench(args) -> None:
    """Time optimizer steps of set diffusion vs AR, interleaved, for fp32 and bf16."""
    device, why = pick_device(args.device, Dist())
    if args.tokenizer is None:
        raise UserError(f"--preset {args.preset} needs --tokenizer PATH/vocab.txt, also for --bench")
    tok = load_tokenizer(args.tokenizer)
    cfg = model_config(args, tok)
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randint(0, 256 if tok.kind == "bytes" else tok.vocab_size, (args.batch_size, cfg.seq_len),
                      generator=g)
    x[:, 0] = tok.bos_id
    x = x.to(device)
    dtypes = [torch.float32] + ([torch.bfloat16] if device.type != "mps" else [])
    repeats, steps = args.bench_repeats, args.bench_steps
    print(f"bench: {device} ({why}), {torch.get_num_threads()} torch threads, batch {args.batch_size} x L="
          f"{cfg.seq_len}, {cfg.n_layer} layers x {cfg.d_model} wide, vocab {cfg.vocab_size}, "
          f"order {cfg.order}, {steps} steps x {repeats} repeats (interleaved), compile={args.compile}")
    rows = []
    for dtype in dtypes:
        torch.manual_seed(args.seed)
        variants = {}
        for name in ("set diffusion (2L, set-causal)", "AR (L, causal)"):
            model = SetDiffusionLM(cfg).to(device)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=ADAM_BETAS)
            if name.startswith("set"):
                order = sample_order(cfg, x.shape[0], g, device)
                fn = lambda m=model, o=order: m.loss(x, o)
            else:
                fn = lambda m=model: ar_loss(m, x)
            step_fn = torch.compile(fn) if args.compile else fn
            variants[name] = (model, opt, step_fn)
        times = {name: [] for name in variants}

        def one_step(name):
            model, opt, fn = variants[name]
            with autocast(device, dtype):
                loss = fn()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

        for name in variants:                      # warm-up (and compilation)
            one_step(name)
        for _ in range(repeats):
            for name in variants:                  # interleaved: both see the same noise
                synchronize(device)
                t0 = time.perf_counter()
                for _ in range(steps):
                    one_step(name)
                synchronize(device)
                times[name].append((time.perf_counter() - t0) / steps)
        for name, (model, opt, fn) in variants.items():
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            with autocast(device, dtype):
                mem = saved_activation_bytes(fn)
            if device.type == "cuda":
                print(f"{name}, {dtype}: CUDA peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB")
            med = sorted(times[name])[len(times[name]) // 2]
            rows.append((str(dtype).replace("torch.", ""), name, med, mem))
    print()
    print("| dtype | variant | step time (ms, median) | tokens/s | vs AR | saved activations (MB) |")
    print("|---|---|---|---|---|---|")
    for i in range(0, len(rows), 2):
        ar_time = rows[i + 1][2]
        for dtype, name, t, mem in rows[i:i + 2]:
            print(f"| {dtype} | {name} | {t * 1e3:.1f} | {args.batch_size * cfg.seq_len / t:,.0f} | "
                  f"{t / ar_time:.2f}x | {mem / 2**20:.1f} |")
    print("\ntokens/s counts the L tokens of each row once for both variants.")


# ----------------------------------------------------------------------------------------
# Training

def prepare_data(args, tok: Tokenizer, verbose: bool) -> tuple[dict, dict]:
    """Train/val rows for the flags: --data/--val-data, or the built-in corpus."""
    if args.data:
        train_files = expand_inputs(args.data, "--data")
    else:
        if verbose:
            print("data: built-in corpus (docstrings of the installed Python, numpy and torch)")
        train_files = [builtin_corpus(args.cache_dir, args.workers)]
    if args.val_data:
        plan = [(f, "train") for f in train_files] + \
               [(f, "val") for f in expand_inputs(args.val_data, "--val-data")]
    else:
        if not 0 < args.val_fraction < 1:
            raise UserError(f"--val-fraction must be in (0, 1), got {args.val_fraction}")
        plan = [(f, "hash") for f in train_files]
    rows, meta = prepare_rows(plan, tok, args.seq_len, args.cache_dir, args.val_fraction,
                              args.workers, verbose)
    if verbose:
        for side in ("train", "val"):
            s = meta["splits"][side]
            print(f"data: {side} {s['rows']:,} rows of {args.seq_len} ({s['lines']:,} lines, "
                  f"{s['tokens']:,} tokens)")
    return rows, meta


def learning_rate(args, step: int) -> float:
    """Linear warm-up, then constant (SPEC §6)."""
    return args.lr * min(1.0, (step + 1) / max(args.warmup_steps, 1))


def describe_policy(cfg: Config) -> str:
    """'staggered (d=4, s=8)', 'block (d=4)', 'ar', 'uniform': only the sizes that matter."""
    if cfg.order == "staggered":
        return f"staggered (d={cfg.set_size}, s={cfg.max_set_size})"
    return f"block (d={cfg.set_size})" if cfg.order == "block" else cfg.order


def model_config(args, tok: Tokenizer) -> Config:
    """The model's Config; the special ids come from the tokenizer, never from literals.
    Config checks its own invariants (d <= L, heads divide the width, ...): a violation
    is the user's flag combination, so it becomes a one-line error."""
    try:
        return Config(vocab_size=tok.vocab_size, seq_len=args.seq_len, n_layer=args.n_layer,
                      n_head=args.n_head, d_model=args.d_model, dropout=args.dropout,
                      order=args.order, set_size=args.set_size, max_set_size=args.max_set_size,
                      pad_id=tok.pad_id, bos_id=tok.bos_id, eos_id=tok.eos_id, mask_id=tok.mask_id)
    except ValueError as e:
        raise UserError(str(e)) from None


@torch.no_grad()
def update_ema(ema: SetDiffusionLM, model: SetDiffusionLM, decay: float, step: int) -> None:
    """ema <- d * ema + (1 - d) * weights, after every optimizer step (SPEC §6)."""
    # NOTE: the decay ramps up as min(decay, (1+t)/(10+t)) so that the EMA of a short run
    # is not dominated by its random initialisation; after a few thousand steps it is the
    # paper's plain EMA.
    d = min(decay, (1 + step) / (10 + step))
    for e, p in zip(ema.parameters(), model.parameters()):
        e.lerp_(p.detach(), 1 - d)


def save(path: Path, ema: SetDiffusionLM, model, tok, opt, state: dict, args,
         resumable: bool = True) -> None:
    """Checkpoint = the EMA weights as the model (what validation scores and sample.py
    loads), plus, if `resumable`, everything --resume needs: raw weights and optimizer
    (best.pt leaves them out: they would triple its size and only ckpt.pt is resumed)."""
    extra = dict(train_model=model.state_dict(), optimizer=opt.state_dict()) if resumable else {}
    try:
        save_checkpoint(path, ema, tok, state=dict(state), args=args_for_checkpoint(args), **extra)
    except OSError as e:
        raise UserError(f"could not save {path}: {e.strerror or e} (the previous checkpoint is "
                        f"intact)") from None


def prepare_run(args, verbose: bool):
    """Everything that can fail because of the user's input, before any file is written:
    the run directory, the resumed run's settings, the tokenizer and the data."""
    ckpt = None if args.prepare_only else check_out_dir(args)
    if ckpt is not None:
        args = resumed_args(args, ckpt)
    if args.tokenizer is None:
        raise UserError(f"--preset {args.preset} needs --tokenizer PATH/vocab.txt (the "
                        f"bert-base-uncased vocab, SPEC §6)")
    if ckpt is None:
        tok = load_tokenizer(args.tokenizer)
    else:  # the checkpoint carries its tokenizer: no vocab file needed to resume
        tok = Tokenizer.from_spec(ckpt["tokenizer"])
    rows, meta = prepare_data(args, tok, verbose)
    rows["val_bytes_per_token"] = bytes_per_token(meta["splits"]["val"])
    return args, ckpt, tok, rows


def agree(dist: Dist, error: str | None) -> None:
    """Under torchrun, stop every process when rank 0 found a user error (rank 0 prints it);
    this also holds the other ranks back until rank 0 has prepared the data cache."""
    if dist.world > 1:
        errors = [None] * dist.world
        torch.distributed.all_gather_object(errors, error)
        error = next((e for e in errors if e), None)
    if error:
        raise UserError(error)


def train(args, dist: Dist) -> None:
    error = None
    if dist.master:
        try:
            args, ckpt, tok, rows = prepare_run(args, verbose=True)
        except UserError as e:
            error = str(e)
    agree(dist, error)
    if not dist.master:  # the cache is ready now: the other ranks only open it
        args, ckpt, tok, rows = prepare_run(args, verbose=False)
    if args.prepare_only:
        dist.print(f"data ready in {args.cache_dir}")
        return
    device, why_device = pick_device(args.device, dist)
    dtype, why_dtype = pick_dtype(args.dtype, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32 matmuls for the float32 parts
        torch.backends.cudnn.allow_tf32 = True
    # The global batch G is what the optimizer sees, whatever the number of processes:
    # each process runs micro-batches of `micro` rows, `accum` times, before the gradients
    # are averaged. The same G then gives the same training run on 1 or N processes.
    G = args.global_batch or args.batch_size
    micro = min(args.batch_size, G // dist.world) if G >= dist.world else 0
    if micro < 1 or G % (micro * dist.world):
        raise UserError(f"--global-batch {G} must be a multiple of --batch-size {args.batch_size} "
                        f"times the {dist.world} processes (or of the processes, if smaller)")
    accum = G // (micro * dist.world)
    cfg = model_config(args, tok)

    torch.manual_seed(args.seed)  # the same initial weights on every process
    model = SetDiffusionLM(cfg).to(device)
    # The EMA copy is what gets validated, saved as the checkpoint's model and sampled
    # from; the raw weights are only needed to continue training.
    ema = copy.deepcopy(model).requires_grad_(False) if args.ema > 0 else model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=ADAM_BETAS,
                            weight_decay=args.weight_decay, fused=device.type == "cuda")
    state = {"step": 0, "tokens": 0, "data": {"epoch": 0, "index": 0}, "best": None, "seconds": 0.0}
    if ckpt is not None:
        model.load_state_dict(ckpt["train_model"])
        ema.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        state.update(ckpt["state"])
    del ckpt  # the optimizer state can be as large as the model: do not keep a second copy
    step_module = TrainStep(model)
    if dist.world > 1:
        step_module = torch.nn.parallel.DistributedDataParallel(
            step_module, device_ids=[device.index] if device.type == "cuda" else None)
    if args.compile:
        step_module = torch.compile(step_module)
    train_rows, val_rows = rows["train"], rows["val"]
    stream = RowStream(len(train_rows), args.seed, **state["data"])

    dist.print(f"device: {device} ({why_device}); autocast {str(dtype).replace('torch.', '')} "
               f"({why_dtype})")
    dist.print(f"model: {model.num_params() / 1e6:.2f}M parameters, n_layer {cfg.n_layer}, "
               f"d_model {cfg.d_model}, {cfg.n_head} heads, L={cfg.seq_len}, order {describe_policy(cfg)}")
    dist.print(f"batch: {G} rows/step = {micro} per forward x {accum} accumulation x "
               f"{dist.world} process{'es' if dist.world > 1 else ''}; {G * cfg.seq_len:,} tokens/step")
    if device.type == "cpu":
        dist.print(f"threads: {torch.get_num_threads()} per process (set OMP_NUM_THREADS to "
                   f"change; on a busy machine fewer threads can be faster)")
    if state["step"]:
        dist.print(f"resuming {args.out / 'ckpt.pt'} at step {state['step']:,} "
                   f"(epoch {stream.epoch}, row {stream.index:,})")
    if dist.master:
        args.out.mkdir(parents=True, exist_ok=True)
        if not args.resume:
            for f in ("ckpt.pt", "best.pt"):
                (args.out / f).unlink(missing_ok=True)
        log = MetricsLog(args.out / "metrics.jsonl", state["step"] if args.resume else None)

    def evaluate_and_save(step: int) -> None:
        """Validate the EMA weights, log, and checkpoint (rank 0; the other ranks go on
        and wait for it at the next gradient all-reduce)."""
        if not dist.master:
            return
        m = validation_bound(ema, val_rows, tok, args.eval_orders, args.eval_rows,
                             2 * micro, args.seed, dtype, rows["val_bytes_per_token"])
        log.write(step=step, kind="val", **m)
        is_best = state["best"] is None or m["nll_per_token"] < state["best"]["nll_per_token"]
        if is_best:
            state["best"] = {"step": step, **m}
        tqdm.write(f"step {step:,}: val {format_bound(m)}{'  (best)' if is_best else ''}")
        save(args.out / "ckpt.pt", ema, model, tok, opt, state, args)
        if is_best:
            save(args.out / "best.pt", ema, model, tok, opt, state, args, resumable=False)

    start, start_step = time.perf_counter(), state["step"]
    seconds_before = state["seconds"]
    bar = tqdm(total=args.max_steps, initial=state["step"], disable=not dist.master,
               unit="step", dynamic_ncols=True)
    running, window_start, window_steps = torch.zeros((), device=device), time.perf_counter(), 0
    # Ctrl-C only raises a flag; it is acted on between steps, so a step is never cut in
    # half (e.g. inside opt.step()) and the saved state describes whole steps only.
    interrupted = []
    previous_handler = signal.signal(signal.SIGINT, lambda *_: interrupted.append(True))
    try:
        for step in range(state["step"], args.max_steps):
            # Every random draw of this step is seeded by (seed, step): exact resume.
            torch.manual_seed(step_seed(args.seed, step, f"dropout/{dist.rank}"))
            orders_gen = torch.Generator().manual_seed(step_seed(args.seed, step, "orders"))
            lr = learning_rate(args, step)
            for group in opt.param_groups:
                group["lr"] = lr
            # The global batch, its decode orders, and this process's disjoint share of both:
            # the same rows and orders as a 1-process run, whatever the number of processes.
            # Wrapped rows have no padding, so the orders need no padding mask (SPEC §6).
            ids = stream.take(G).reshape(accum, dist.world, micro)          # (A, W, B)
            orders = sample_order(cfg, G, orders_gen).reshape(accum, dist.world, micro, -1)  # (A, W, B, L)
            for a in range(accum):
                # indexing the memmap reads just these rows from disk
                x = torch.from_numpy(train_rows[ids[a, dist.rank]].astype(np.int64)).to(device)  # (B, L)
                # DDP all-reduces gradients in every backward unless told not to: only the
                # last micro-batch of the step needs it
                sync = a == accum - 1 or dist.world == 1
                with (contextlib.nullcontext() if sync else step_module.no_sync()), autocast(device, dtype):
                    loss = step_module(x, orders[a, dist.rank].to(device)) / accum
                loss.backward()
                running += loss.detach()
            # (DDP has averaged the gradients over processes in the last backward)
            if args.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if ema is not model:
                update_ema(ema, model, args.ema, step)
            state.update(step=step + 1, tokens=state["tokens"] + G * cfg.seq_len,
                         data=stream.state_dict())
            window_steps += 1
            bar.update(1)

            # Reading the loss forces a GPU sync, so it is summed on the device and only
            # read every --log-every steps (averaged over processes for the log).
            if (step + 1) % args.log_every == 0 or step + 1 == args.max_steps:
                if dist.world > 1:
                    torch.distributed.all_reduce(running)
                    running /= dist.world
                loss_avg = running.item() / window_steps
                now = time.perf_counter()
                tok_s = window_steps * G * cfg.seq_len / (now - window_start)
                state["seconds"] = seconds_before + now - start
                bar.set_postfix(loss=f"{loss_avg:.4f}", tok_s=f"{tok_s:,.0f}", lr=f"{lr:.2e}")
                if dist.master:
                    log.write(step=step + 1, kind="train", loss=loss_avg, lr=lr,
                              tokens=state["tokens"], tokens_per_s=tok_s, seconds=state["seconds"])
                running.zero_()
                window_start, window_steps = now, 0
            if (step + 1) % args.eval_every == 0 or step + 1 == args.max_steps:
                t_eval = time.perf_counter()
                evaluate_and_save(step + 1)
                window_start += time.perf_counter() - t_eval  # validation is not training time
            if interrupted:
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        # Ctrl-C: keep the finished steps. `state` describes the last completed step (a
        # half-done step is dropped), so --resume repeats nothing and skips nothing.
        bar.close()  # so that the messages below start on a line of their own
        if dist.master:
            state["seconds"] = seconds_before + time.perf_counter() - start
            save(args.out / "ckpt.pt", ema, model, tok, opt, state, args)
            print(f"\ninterrupted at step {state['step']:,}: saved {args.out / 'ckpt.pt'}; "
                  f"continue with --resume --out {args.out}", file=sys.stderr, flush=True)
        raise
    finally:
        signal.signal(signal.SIGINT, previous_handler)
        bar.close()
    if not dist.master:
        return
    elapsed = time.perf_counter() - start
    trained = state["step"] - start_step
    print(f"done: {state['step']:,} steps, {state['tokens']:,} tokens seen; this session "
          f"{elapsed / 60:.1f} min ({trained * G * cfg.seq_len / max(elapsed, 1e-9):,.0f} tokens/s "
          f"incl. validation), whole run {state['seconds'] / 60:.1f} min")
    if state["best"] is not None:
        print(f"best validation (step {state['best']['step']:,}): {format_bound(state['best'])}")
    print(f"checkpoints: {args.out / 'ckpt.pt'} (latest), {args.out / 'best.pt'} (best)")
    # One unconditional sample from BOS with the default window (set size d for staggered)
    out = generate(ema, batch_size=1, temperature=1.0, top_p=0.9,
                   generator=torch.Generator().manual_seed(args.seed))
    text = tok.decode(out.tokens[0].tolist()).strip().replace("\n", " | ")
    print(f"sample ({out.nfe} network calls, {out.tokens_per_step:.2f} tokens/call): {text}")


# ----------------------------------------------------------------------------------------
# Main: user errors become one line on stderr and exit code 2

def main(argv=None) -> int:
    """Command-line entry point; returns the exit code (0 done, 2 user error, 130 Ctrl-C)."""
    dist = Dist()
    try:
        args = parse_args(argv)
        if dist.world > 1:
            on_gpu = torch.cuda.is_available() and (args.device or "cuda").startswith("cuda")
            backend = "nccl" if on_gpu else "gloo"
            # a long timeout: rank 0 may spend a while preparing a large corpus
            torch.distributed.init_process_group(backend, timeout=datetime.timedelta(hours=1))
        if args.bench:
            bench(args)
        else:
            train(args, dist)
    except UserError as e:
        if dist.master:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:  # the checkpoint is saved; the usual Ctrl-C exit code
        return 130
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
