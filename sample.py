"""Sample from and score a set diffusion LM; the method itself is in setdiff.py.

    python sample.py --ckpt out/ckpt.pt --num-samples 4                    # unconditional
    python sample.py --ckpt out/ckpt.pt --prompt "The model" --stop-at-eos --show-order
    python sample.py --ckpt out/ckpt.pt --infill "The [MASK][MASK]t sat on ___12 mat."
    python sample.py --ckpt out/ckpt.pt --eval valid.txt --num-orders 4    # likelihood bound
    python sample.py --ckpt out/ckpt.pt --eval                             # its validation rows
    python sample.py --ckpt lm1b-setdlm-smax16/ --prompt "the"             # a released model

Comparisons, benches, order statistics and plots are in experiments/.
"""

import argparse
import array
import collections
import glob
import math
import os
import re
import sys
from dataclasses import dataclass

import numpy as np
import torch

import setdiff
from setdiff import GIVEN, Config, Tokenizer, require
from train_small import line_ids, wrap_rows  # text -> rows, as training builds them


# ---- Command line -----------------------------------------------------------------------------
class Parser(argparse.ArgumentParser):
    def error(self, message):  # a usage error is one line and exit code 2, like any bad input
        self.exit(2, f"error: {message} (see --help)\n")


def at_least(low: int):
    def integer(text: str) -> int:  # argparse names the type after this function
        if int(text) < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {text}")
        return int(text)

    return integer


def build_parser() -> Parser:
    doc = __doc__.split("\n\n")
    p = Parser(
        description=doc[0],
        epilog="examples:\n" + doc[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = p.add_argument
    add("--ckpt", metavar="PATH", help="train_small.py's checkpoint, or a released model's folder")
    mode = p.add_mutually_exclusive_group().add_argument
    mode("--prompt", metavar="TEXT", help="text to continue (after BOS, where the model has one)")
    mode("--infill", metavar="TEXT", help="holes: [MASK] one position, ___N N, ___ --span-len")
    mode("--eval", nargs="*", metavar="FILE", help="the bound on files (none: validation rows)")
    add = p.add_argument_group("sampling").add_argument
    add("--num-samples", type=at_least(1), default=1, metavar="N", help="samples to draw (1)")
    add("--batch-size", type=at_least(1), metavar="B", help="rows a call (min(N, 16); --eval: 32)")
    add("--max-new-tokens", type=at_least(1), metavar="N", help="tokens to write (all: L - P)")
    add("--span-len", type=at_least(1), default=8, metavar="N", help="positions of a bare ___ (8)")
    add("--window", type=int, metavar="W", help="queries a call (d; --infill: the largest window)")
    add("--threshold", type=float, default=math.inf, metavar="TAU", help="top and all >= TAU (inf)")
    add("--temperature", type=float, default=1.0, metavar="T", help="0 = greedy (1)")
    top_p = "nucleus mass, 1 = off: the model's own distribution, the authors' default (1)"
    add("--top-p", type=float, default=1.0, metavar="P", help=top_p)
    add("--seed", type=int, default=0, metavar="N", help="seed of samples and --eval orders (0)")
    add("--stop-at-eos", action="store_true", help="end a sample at its first generated EOS")
    add("--show-order", action="store_true", help="mark the tokens revealed by call N: [text]N")
    add = p.add_argument_group("evaluation").add_argument
    add("--num-orders", type=at_least(1), default=1, metavar="K", help="decode orders a row (1)")
    add("--eval-rows", type=at_least(0), default=0, metavar="N", help="the first N rows (0: all)")
    add = p.add_argument_group("device").add_argument
    add("--device", help="cpu, cuda, cuda:N or mps (default: the first of cuda, mps, cpu)")
    add("--dtype", choices=["auto", "float32", "bfloat16"], default="auto", help="autocast (auto)")
    add("--threads", type=at_least(1), metavar="N", help="CPU threads (the cores left idle)")
    return p


def load(path, device):
    """The model, tokenizer and checkpoint dict, with one line that says what was loaded."""
    # setdiff reads a folder as a released model's; a folder without config.json is neither
    folder_only = os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json"))
    what = "a checkpoint file (train_small.py's ckpt.pt) or a released model's folder"
    require(not folder_only, f"--ckpt {path} is a folder without config.json: give {what}")
    model, tok, ckpt = setdiff.load_checkpoint(path, device)
    cfg = model.cfg
    origin = "released model" if "released" in ckpt else f"step {ckpt.get('step', '?')}"
    print(
        f"model: {path} ({origin}): {model.num_params() / 1e6:.2f}M parameters, order "
        f"{cfg.order} d={cfg.set_size}, L={cfg.seq_len}, largest window "
        f"{setdiff.max_window(cfg)}, tokenizer {tok.kind}"
    )
    return model.eval(), tok, ckpt


# ---- Sampling ---------------------------------------------------------------------------------
HOLE = re.compile(r"\[MASK\]|_{3,}(\d*)")  # [MASK]: one position; ___ or ___N: a span


def infill_ids(text: str, tok: Tokenizer, span_len: int) -> list:
    """Ids of a template, MASK where to fill; the text between holes is encoded piece by piece."""
    parts = HOLE.split(text)  # known, hole, known, ...; a hole is None for [MASK], else its N
    require(len(parts) > 1, "--infill has nothing to fill: mark holes with [MASK] or ___ / ___N")
    ids = tok.encode(parts[0])
    for hole, known in zip(parts[1::2], parts[2::2]):
        if hole is None:
            n = 1
        elif hole:
            n = int(hole)
        else:
            n = span_len
        require(n >= 1, "--infill: ___0 asks for a span of 0 positions")
        ids += [tok.mask_id] * n + tok.encode(known)
    return ids


def sampling_options(args, cfg: Config) -> dict:
    """generate()'s options from the flags, checked here so that a message names the flag
    (setdiff's own messages name its arguments)."""
    T = args.temperature
    require(math.isfinite(T) and T >= 0, f"--temperature must be >= 0 (0: greedy), got {T}")
    require(0 < args.top_p <= 1, f"--top-p must be in (0, 1] (1: off), got {args.top_p}")
    require(not math.isnan(args.threshold), "--threshold must be a number (> 1: one token a call)")
    w_max = setdiff.max_window(cfg)
    seen = f"the {cfg.order} policy met at most {w_max} queries a call in training"
    ok = args.window is None or 1 <= args.window <= w_max
    require(ok, f"--window must be in [1, {w_max}] ({seen}), got {args.window}")
    # (without --window, generate() infills with the largest window, as the paper does)
    same = ("window", "threshold", "temperature", "top_p", "max_new_tokens", "stop_at_eos")
    return {name: getattr(args, name) for name in same}


def start_ids(args, cfg: Config, tok: Tokenizer) -> dict:
    """generate()'s prompt= or infill= from the flags, BOS first where the model has one
    (without BOS, as GPT-2/OWT: the text as it is; unconditional samples start from EOS)."""
    bos = [] if cfg.bos_id is None else [cfg.bos_id]
    L = cfg.seq_len
    room = f"the model's context is L={L} tokens"
    if args.infill is not None:
        # NOTE: infilling writes all context, left AND right, into the cache at step 0, as the
        # authors' infilling script does (CACHE_FULL_INFILL_CONTEXT=true). A staggered model
        # never met that state in training: its orders reveal a position's right context
        # only within the reach s.
        require(args.max_new_tokens is None, "--max-new-tokens: the holes of --infill set it")
        ids = bos + infill_ids(args.infill, tok, args.span_len)
        require(ids[0] != cfg.mask_id, "--infill: this model has no BOS; begin with given text")
        require(len(ids) <= L, f"--infill is {len(ids)} tokens (with BOS) and {room}: shorten it")
        return {"infill": torch.tensor(ids)}
    ids = bos + ([] if args.prompt is None else tok.encode(args.prompt))
    require(cfg.mask_id not in ids, "--prompt contains [MASK]: use --infill to fill holes")
    require(ids or args.prompt is None, "--prompt is empty and this model has no BOS: give text")
    P = max(len(ids), 1)  # unconditional: BOS, or EOS for a model without BOS
    require(P < L, f"--prompt is {P} tokens{' (with BOS)' * bool(bos)} and {room}: shorten it")
    new = args.max_new_tokens or L - P
    require(new <= L - P, f"--max-new-tokens must be at most {L - P} after {P} prompt tokens")
    return {} if args.prompt is None else {"prompt": torch.tensor(ids)}


def decode_order(tok: Tokenizer, ids: list, steps: list) -> str:
    """Each run of neighbouring tokens revealed by one network call marked with the call's
    number, [text]N; given text plain, EOS as \\n. Then the set sizes."""
    pieces = []
    start = 0
    for end in range(1, len(ids) + 1):
        if end < len(ids) and steps[end] == steps[start]:
            continue  # the run of one call goes on
        # A run's text is the growth of the decoded prefix, so WordPiece spaces land where
        # decode() puts them; a character split between two runs falls back to its own bytes.
        before = tok.decode(ids[:start])
        through = tok.decode(ids[:end])
        text = through[len(before) :] if through.startswith(before) else tok.decode(ids[start:end])
        if steps[start] >= 0:
            pieces.append(f"[{text}]{steps[start]}")
        elif steps[start] == GIVEN:
            pieces.append(text)  # ERASED (PAD after a stopping EOS) shows nothing
        start = end
    set_size = collections.Counter(s for s in steps if s >= 0)  # call -> tokens it revealed
    calls = collections.Counter(set_size.values())  # tokens -> calls that revealed that many
    sizes = ", ".join(f"{calls[n]} x {n} token{'s' * (n > 1)}" for n in sorted(calls))
    picture = "".join(pieces).replace("\n", "\\n")
    return f"--- decode order:\n{picture}\n--- network calls revealed: {sizes or 'none'}"


def sample(args, model, tok: Tokenizer) -> None:
    """Draw --num-samples samples in batches of --batch-size rows (bounded memory, whatever
    the number), each printed as soon as its batch is done, with its speed."""
    options = sampling_options(args, model.cfg)
    src = start_ids(args, model.cfg, tok)
    generator = torch.Generator().manual_seed(args.seed)  # one generator: --seed fixes them all
    batch_size = args.batch_size or min(args.num_samples, 16)
    for done in range(0, args.num_samples, batch_size):
        B = min(batch_size, args.num_samples - done)
        out = setdiff.generate(model, batch_size=B, generator=generator, **options, **src)
        for b in range(B):
            new = int(out.new_tokens[b])
            calls = int(out.steps[b])
            # the rows of a batch share every call: a row's speed is over the batch's time
            print(
                f"--- sample {done + b + 1}/{args.num_samples}: {calls} network calls, "
                f"{new / max(calls, 1):.2f} tokens/call, {new / out.seconds:,.0f} tokens/s"
            )
            # strip: a BOS that is also EOS ([CLS] of LM1B), or EOS that starts a GPT-2 document,
            # decodes as a line break
            kept = out.tokens[b][out.reveal_step[b] != setdiff.ERASED]  # not a stopped row's tail
            print(tok.decode(kept).strip("\n"))
            if args.show_order:
                print(decode_order(tok, out.tokens[b].tolist(), out.reveal_step[b].tolist()))
        sys.stdout.flush()  # printed as it goes, also into a pipe


# ---- Evaluation: the set-factorized bound, as training validation computes it -----------------
@dataclass
class EvalRows:
    rows: np.ndarray  # (n, L) uint16
    text_tokens: np.ndarray  # (n,) tokens of source text each row scores
    bytes_per_token: float  # UTF-8 bytes of the source text per token of the stream
    padded: bool = False  # the last row holds the end of the text, then PAD
    unscored: int = 0  # tokens at the end of the text in no row (a model without PAD)


def text_per_row(cfg: Config) -> int:
    """Source-text tokens a whole row scores: with BOS, [BOS] + L-2 tokens + [EOS] (BOS and
    the row's closing EOS are no text); without BOS, L tokens, of which position 0 is given."""
    return cfg.seq_len - 2 if cfg.bos_id is not None else cfg.seq_len - 1


def text_rows(files: list, tok: Tokenizer, cfg: Config) -> EvalRows:
    """Rows of text files as training builds them (each line's ids and EOS, wrapped), the text
    after the last whole row in one more row padded with PAD where the model has PAD."""
    stream = array.array("H")
    num_bytes = 0
    skipped = 0
    for name in (path for pattern in files for path in sorted(glob.glob(pattern)) or [pattern]):
        require(os.path.isfile(name), f"--eval: {name} is missing or not a file")
        require(os.path.getsize(name), f"--eval: {name} is empty")
        with open(name, "rb") as f:
            for raw in map(bytes.strip, f):  # strip: also the \r of Windows line ends
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    line = "\0"  # not UTF-8: skipped as binary data, below
                if "\0" in line:
                    skipped += 1
                elif line:
                    stream.extend(line_ids(tok, line))
                    num_bytes += len(raw) + 1  # and the newline, which EOS stands for
    if skipped:
        print(f"eval: skipped {skipped:,} lines that are not UTF-8 text")
    require(stream, f"--eval: {' '.join(files)} hold no lines of UTF-8 text")
    L = cfg.seq_len
    rows, tail = wrap_rows(np.frombuffer(stream, dtype=np.uint16), L, cfg.bos_id, cfg.eos_id)
    data = EvalRows(rows, np.full(len(rows), text_per_row(cfg)), num_bytes / len(stream))
    if len(tail) and cfg.pad_id is not None:
        # The tail ends with its last line's EOS, so the padded row ends as a text does;
        # padding is never attended to or scored.
        start = [] if cfg.bos_id is None else [cfg.bos_id]
        last = np.full(L, cfg.pad_id, dtype=np.uint16)
        last[: len(start) + len(tail)] = start + tail.tolist()
        data.rows = np.concatenate([rows, last[None]])
        given = 0 if start else 1  # without BOS, the row's first token is given
        data.text_tokens = np.append(data.text_tokens, len(tail) - given)
        data.padded = True
    else:
        data.unscored = len(tail)
    short = f"--eval: {len(stream):,} tokens of text fill no row of L={L} (and no PAD to pad one)"
    require(len(data.rows), short)
    return data


def validation_rows(ckpt: dict, path, cfg: Config) -> EvalRows:
    """The validation rows train_small.py recorded for this run (uint16 (rows, L) on disk)."""
    info = ckpt.get("val_rows")
    hint = "pass --eval FILE ... to score text files"
    ok = isinstance(info, dict) and {"path", "rows", "bytes_per_token"} <= set(info)
    require(ok, f"{path} records no validation rows (train_small.py writes them): {hint}")
    L = cfg.seq_len
    whole = os.path.isfile(info["path"]) and os.path.getsize(info["path"]) >= info["rows"] * L * 2
    require(whole and info["rows"], f"the validation rows of {path} are missing or cut: {hint}")
    rows = np.memmap(info["path"], dtype=np.uint16, mode="r", shape=(info["rows"], L))
    return EvalRows(rows, np.full(len(rows), text_per_row(cfg)), info["bytes_per_token"])


def evaluate(args, model, tok: Tokenizer, ckpt: dict) -> None:
    """--eval: the bound on the first --eval-rows rows, K orders a row drawn from --seed."""
    if args.eval:
        data = text_rows(args.eval, tok, model.cfg)
        name = " ".join(args.eval)
    else:
        data = validation_rows(ckpt, args.ckpt, model.cfg)
        name = "the validation split of the training run"
    n = min(args.eval_rows or len(data.rows), len(data.rows))
    x = torch.from_numpy(np.asarray(data.rows[:n], dtype=np.int64))  # (n, L)
    generator = torch.Generator().manual_seed(args.seed)
    res = setdiff.elbo(model, x, args.num_orders, args.batch_size or 32, generator, progress=True)
    # NOTE: bits per byte count the SOURCE text's bytes (decoded WordPiece text would miscount
    # by ~20%): the rows' text tokens at the stream's bytes per token, exact for whole texts.
    num_bytes = round(float(data.text_tokens[:n].sum()) * data.bytes_per_token)
    padded = " (the last one padded with PAD)" if data.padded and n == len(data.rows) else ""
    print(f"eval: {name}: {n:,} rows{padded}, {num_bytes:,} bytes of source text")
    if data.unscored:
        about = round(data.unscored * data.bytes_per_token)
        print(
            f"not scored: the text's last {data.unscored:,} tokens (~{about:,} bytes), too few "
            "for a whole row; this model has no PAD to fill a shorter one"
        )
    print(f"val {res.line(num_bytes)}; ppl is an upper bound on the true perplexity")


# ---- Main: a user error is one line on stderr and exit code 2 ---------------------------------
def run(args) -> None:
    require(args.ckpt, "give --ckpt PATH: a checkpoint of train_small.py or a released model")
    device, dtype, how = setdiff.runtime(args.device, args.dtype, args.threads)
    print(how)
    model, tok, ckpt = load(args.ckpt, device)
    with setdiff.autocast(device, dtype):  # every forward pass; the weights stay float32
        if args.eval is None:
            sample(args, model, tok)
        else:
            evaluate(args, model, tok, ckpt)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")  # samples may hold any character
    try:
        run(args)
    except (ValueError, OSError) as e:  # setdiff and this file raise ValueError for bad input
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, and the shell's code for SIGINT
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
