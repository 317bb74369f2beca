"""Sample from and score a set diffusion LM; the method itself is in setdiff.py.

    python sample.py --ckpt out/ckpt.pt --num-samples 4                    # unconditional
    python sample.py --ckpt out/ckpt.pt --prompt "The model" --stop-at-eos --show-order
    python sample.py --ckpt out/ckpt.pt --infill "The [MASK][MASK]t sat on ___12 mat."
    python sample.py --ckpt out/ckpt.pt --eval valid.txt --num-orders 4    # likelihood bound
    python sample.py --ckpt out/ckpt.pt --eval                             # its validation rows
    python sample.py --ckpt lm1b-setdlm-smax16/ --prompt "the"             # a released model
    python sample.py --ckpt wp/best.pt --export my-setdlm/    # a BERT/GPT-2 vocab model, as released

Comparisons, benches, order statistics and plots are in experiments/.
"""

import sys

try:  # Ctrl-C while torch loads (a second or more) ends as it does later: a line, exit 130
    import argparse
    import array
    import collections
    import glob
    import inspect
    import math
    import os
    import re
    import signal
    from dataclasses import dataclass

    import numpy as np
    import torch

    import setdiff
    from setdiff import GIVEN, Config, Tokenizer, require
except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    sys.exit(130)


# ---- Command line -----------------------------------------------------------------------------
class Parser(argparse.ArgumentParser):
    """argparse whose usage errors read like every other error of the script."""

    def error(self, message):  # a usage error is one line and exit code 2, like any bad input
        self.exit(2, f"error: {message} (see --help)\n")


def at_least(low: int, below=math.inf):
    """An argparse type: an integer of at least `low` (and below `below`)."""

    def integer(text: str) -> int:  # argparse names the type after this function
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {text}")
        if value >= below:
            raise argparse.ArgumentTypeError(f"must be below {below}, got {text}")
        return value

    return integer


def build_parser() -> Parser:
    """The flags; generate() checks the sampling ones, and its messages name them."""
    raw = argparse.RawDescriptionHelpFormatter  # keeps the examples' lines
    p = Parser(description=__doc__, formatter_class=raw)
    p.add_argument("--ckpt", help="train_small.py's checkpoint, or a released model's folder")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--prompt", help="text to continue (after BOS, where the model has one)")
    mode.add_argument("--infill", help="holes: [MASK] one position, ___N N, ___ --span-len")
    files = "text files: a sentence a line (GPT-2: <|endoftext|> lines end texts; none: val rows)"
    mode.add_argument("--eval", nargs="*", help=files)
    export = "write the model as a released SetDLM folder DIR (new or empty); no sampling"
    mode.add_argument("--export", metavar="DIR", help=export)
    p.add_argument("--num-samples", type=at_least(1), default=1, help="samples to draw (1)")
    p.add_argument("--batch-size", type=at_least(1), help="rows a call (min(N, 16); --eval: 32)")
    p.add_argument("--max-new-tokens", type=at_least(1), help="tokens to write (all: L - P)")
    p.add_argument("--span-len", type=at_least(1), default=8, help="positions of a bare ___ (8)")
    window = "span from the first MASK (the policy's d, uniform L; --infill: the largest)"
    p.add_argument("--window", type=int, help=window)
    tau = "confidence tau: a call reveals its top query and all >= tau (inf: the top only)"
    p.add_argument("--threshold", type=float, default=math.inf, help=tau)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (1)")
    top_p = "nucleus mass, 1 = off: the model's own distribution, the authors' default (1)"
    p.add_argument("--top-p", type=float, default=1.0, help=top_p)
    penalty = "divides a seen token's positive logit (multiplies a negative one); 1 = off (1)"
    p.add_argument("--repetition-penalty", type=float, default=1.0, help=penalty)
    seeds = at_least(0, 2**64)  # torch.Generator's seeds
    p.add_argument("--seed", type=seeds, default=0, help="of samples and --eval orders (0)")
    p.add_argument("--stop-at-eos", action="store_true", help="end at the first EOS it generates")
    ancestral = "the bound's model: one position a call, in an order drawn from the policy"
    p.add_argument("--ancestral", action="store_true", help=ancestral)
    compiled = (
        "torch.compile every call after the first (a CUDA graph on a GPU): same tokens. For a"
        " GPU: on a CPU it costs, 0.94-0.99x eager at batch 1 and 0.3-0.4x at batch 16, after"
        " 10-45 s compiling each set size met (experiments/README.md)"
    )
    p.add_argument("--compile", action="store_true", help=compiled)
    p.add_argument("--show-order", action="store_true", help="mark what call N revealed: [text]N")
    p.add_argument("--num-orders", type=at_least(1), default=1, help="--eval: orders a row (1)")
    p.add_argument("--eval-rows", type=at_least(0), default=0, help="--eval: first rows (0: all)")
    p.add_argument("--device", help="cpu, cuda, cuda:N or mps (default: first of cuda, mps, cpu)")
    dtypes = ["auto", "float32", "bfloat16"]
    p.add_argument("--dtype", choices=dtypes, default="auto", help="autocast (auto)")
    p.add_argument("--threads", type=at_least(1), help="CPU threads (the cores left idle)")
    return p


def load(path, device):
    """The model, tokenizer and checkpoint dict, with one line that says what was loaded."""
    model, tok, ckpt = setdiff.load_checkpoint(path, device)
    cfg = model.cfg
    origin = f"step {ckpt.get('step', '?')}"
    if "released" in ckpt:
        origin = "released model"
    size = f"{model.num_params() / 1e6:.2f}M parameters"
    policy = f"order {setdiff.policy_name(cfg)}, L={cfg.seq_len}"
    windows = f"largest window {setdiff.max_window(cfg)}"
    print(f"model: {path} ({origin}): {size}, {policy}, {windows}, tokenizer {tok.kind}")
    return model, tok, ckpt  # in eval mode


# ---- Sampling ---------------------------------------------------------------------------------
HOLE = re.compile(r"\[MASK\]|_{3,}(\d*)")  # [MASK]: one position; ___ or ___N: a span


def infill_ids(text: str, tok: Tokenizer, span_len: int, L: int) -> list:
    """Ids of a template, MASK where to fill; the text between holes is encoded piece by piece.
    Each hole is compared with the context L before it is built (___1000000000000 would fill
    the memory); generate() checks the whole row, BOS included."""
    parts = HOLE.split(text)  # known, hole, known, ...; a hole is None for [MASK], else its N
    require(len(parts) > 1, "--infill has nothing to fill: mark holes with [MASK] or ___ / ___N")
    ids = tok.encode(parts[0])
    for hole, known in zip(parts[1::2], parts[2::2]):
        flag = "--infill"
        if hole is None:
            n = 1
        elif hole:
            n = int(hole)
        else:
            n = span_len
            flag = "--span-len"  # a bare ___
        require(n >= 1, "--infill: ___0 asks for a span of 0 positions")
        P = len(ids)
        after = f"after {P} tokens of --infill"
        too_long = f"{flag}: a hole of {n} positions {after} overflows the context L={L}"
        require(n <= L - P, too_long)
        ids += [tok.mask_id] * n + tok.encode(known)
    return ids


def decode_order(tok: Tokenizer, ids: list, calls: list) -> str:
    """Each run of neighbouring tokens revealed by one call marked with the call's number,
    [text]N; given text plain, EOS as \\n. Then the set sizes."""
    pieces = []
    start = 0
    for end in range(1, len(ids) + 1):
        if end < len(ids) and calls[end] == calls[start]:
            continue  # the run of one call goes on
        # A run's text is the growth of the decoded prefix, so WordPiece spaces land where
        # decode() puts them; a character split between two runs falls back to its own bytes.
        before = tok.decode(ids[:start])
        through = tok.decode(ids[:end])
        text = tok.decode(ids[start:end])
        if through.startswith(before):
            text = through[len(before) :]
        if calls[start] >= 0:
            pieces.append(f"[{text}]{calls[start]}")
        elif calls[start] == GIVEN:
            pieces.append(text)  # ERASED (PAD after a stopping EOS) shows nothing
        start = end
    set_size = collections.Counter(c for c in calls if c >= 0)  # call -> tokens it revealed
    count = collections.Counter(set_size.values())  # tokens -> calls that revealed that many
    sizes = [f"{count[n]} x {n} token{'s' * (n > 1)}" for n in sorted(count)]
    picture = "".join(pieces).replace("\n", "\\n")
    summary = ", ".join(sizes) or "none"
    return f"--- decode order:\n{picture}\n--- calls revealed: {summary}"


# generate()'s arguments that sample() makes from its flags itself: text -> ids, rows a batch
MADE_HERE = {"prompt", "infill", "batch_size"}


def generate_options(args) -> dict:
    """Every flag named as an argument of setdiff.generate, passed on as given (generate checks
    them): a new argument of generate needs its flag here, nothing else. Flag and argument have
    one name, so no list has to be kept in step."""
    names = set(inspect.signature(setdiff.generate).parameters) - MADE_HERE
    flags = vars(args)
    return {name: flags[name] for name in names & flags.keys()}


def sample(args, model, tok: Tokenizer):
    """Draw --num-samples samples in batches of --batch-size rows (bounded memory, whatever
    the number), each printed as soon as its batch is done, with its speed."""
    options = generate_options(args)
    # generate() puts BOS first where the model has one (without BOS, as GPT-2/OWT,
    # unconditional samples start from EOS)
    if args.infill is not None:
        # NOTE: infilling writes all context, left AND right, into the cache at call 0, as the
        # authors' infilling script does (CACHE_FULL_INFILL_CONTEXT=true). A staggered model
        # never met that state in training: its orders reveal a position's right context
        # only within the reach s.
        ids = infill_ids(args.infill, tok, args.span_len, model.cfg.seq_len)
        options["infill"] = torch.tensor(ids)
    elif args.prompt is not None:
        options["prompt"] = torch.tensor(tok.encode(args.prompt))
    generator = torch.Generator().manual_seed(args.seed)  # one generator: --seed fixes them all
    n = args.num_samples
    batch_size = args.batch_size or min(n, 16)
    for done in range(0, n, batch_size):
        B = min(batch_size, n - done)
        out = setdiff.generate(model, batch_size=B, generator=generator, **options)
        for b in range(B):
            new = int(out.new_tokens[b])
            calls = int(out.row_calls[b])
            per_call = new / calls  # every row has a MASK: at least one call
            # the rows of a batch share every call: a row's speed is over the batch's time
            speed = f"{per_call:.2f} tokens/call, {new / out.seconds:,.0f} tokens/s"
            print(f"--- sample {done + b + 1}/{n}: {calls} calls, {speed}")
            reveal_call = out.reveal_call[b]
            kept = out.tokens[b][reveal_call != setdiff.ERASED]  # not a stopped row's tail
            # strip: a BOS that is also EOS ([CLS] of LM1B), or EOS that starts a GPT-2
            # document, decodes as a line break
            print(tok.decode(kept).strip("\n"))
            if args.show_order:
                print(decode_order(tok, out.tokens[b].tolist(), reveal_call.tolist()))
        sys.stdout.flush()  # printed as it goes, also into a pipe


# ---- Evaluation: the set-factorized bound, as training validation computes it -----------------
@dataclass
class EvalRows:
    """Rows to score, and how much source text they hold (for bits per byte)."""

    rows: np.ndarray  # (n, L) uint16
    text_tokens: np.ndarray  # (n,) tokens of source text each row scores
    bytes_per_token: float  # UTF-8 bytes of the source text per token of the stream


def text_rows(files: list, tok: Tokenizer, cfg: Config) -> EvalRows:
    """Rows of text files as training builds them (each document's ids and EOS, wrapped), the
    text after the last whole row in one more row padded with PAD where the model has PAD."""
    names = []
    for pattern in files:
        names += sorted(glob.glob(pattern)) or [pattern]
    stream = array.array("H")
    num_bytes = 0
    skipped = 0
    for name in names:
        require(os.path.isfile(name), f"--eval: {name} is missing or not a file")
        with open(name, "rb") as f:
            docs, lines, bad = setdiff.documents(tok, f.read())
        setdiff.check_text("--eval", name, lines, bad)  # training's refusal: some text in each
        skipped += bad
        for doc in docs:
            stream.extend(setdiff.document_ids(tok, doc))
            num_bytes += len(doc.encode()) + 1  # and the newline or break that EOS stands for
    if skipped:
        print(f"eval: skipped {skipped:,} lines that are not UTF-8 text")
    L = cfg.seq_len
    rows, tail = setdiff.wrap_rows(stream, L, cfg.bos_id, cfg.eos_id)
    text_tokens = np.full(len(rows), setdiff.text_per_row(cfg))
    bytes_per_token = num_bytes / max(len(stream), 1)  # no document: refused below
    if len(tail) and cfg.pad_id is None:
        about = round(len(tail) * bytes_per_token)
        left = f"the text's last {len(tail):,} tokens (~{about:,} bytes)"
        print(f"not scored: {left}, too few for a whole row; this model has no PAD to pad one")
    elif len(tail):
        # The tail ends with its last document's EOS, so the padded row ends as a text does;
        # padding is never attended to or scored.
        start = [] if cfg.bos_id is None else [cfg.bos_id]
        last = start + tail.tolist()
        last += [cfg.pad_id] * (L - len(last))
        rows = np.concatenate([rows, [last]])
        given = 0 if start else 1  # without BOS, the row's first token is given
        text_tokens = np.append(text_tokens, len(tail) - given)
        print("eval: the text after the last whole row is one more row, padded with PAD")
    short = f"--eval: {len(stream):,} tokens of text fill no row of L={L} (and no PAD to pad one)"
    require(len(rows), short)
    return EvalRows(rows, text_tokens, bytes_per_token)


def validation_rows(ckpt: dict, path, cfg: Config) -> EvalRows:
    """The validation rows train_small.py recorded for this run (uint16 (rows, L) on disk)."""
    info = ckpt.get("val_rows")  # train_small.py's {path, rows, bytes_per_token}
    hint = "pass --eval FILE ... to score text files"
    require(info, f"{path} records no validation rows (train_small.py writes them): {hint}")
    L = cfg.seq_len
    n = info["rows"]
    rows_file = info["path"]
    whole = os.path.isfile(rows_file) and os.path.getsize(rows_file) >= n * L * 2
    require(whole and n, f"the validation rows of {path} are missing or cut: {hint}")
    rows = np.memmap(rows_file, dtype=np.uint16, mode="r", shape=(n, L))
    text_tokens = np.full(n, setdiff.text_per_row(cfg))
    return EvalRows(rows, text_tokens, info["bytes_per_token"])


def evaluate(args, model, tok: Tokenizer, ckpt: dict):
    """--eval: the bound on the first --eval-rows rows, K orders a row drawn from --seed."""
    if args.eval:
        data = text_rows(args.eval, tok, model.cfg)
        name = " ".join(args.eval)
    else:
        data = validation_rows(ckpt, args.ckpt, model.cfg)
        name = "the validation split of the training run"
    total = len(data.rows)
    n = min(args.eval_rows or total, total)
    x = torch.from_numpy(np.asarray(data.rows[:n], dtype=np.int64))  # (n, L)
    generator = torch.Generator().manual_seed(args.seed)
    batch_size = args.batch_size or 32
    res = setdiff.elbo(model, x, args.num_orders, batch_size, generator, progress=True)
    # NOTE: bits per byte count the SOURCE text's bytes (decoded WordPiece text would miscount
    # by ~20%): the rows' text tokens at the stream's bytes per token, exact for whole texts.
    text_tokens = float(data.text_tokens[:n].sum())
    num_bytes = round(text_tokens * data.bytes_per_token)
    print(f"eval: {name}: {n:,} rows, {num_bytes:,} bytes of source text")
    print(f"val {res.line(num_bytes)}; ppl is an upper bound on the true perplexity")


# ---- Export: the authors' released format -----------------------------------------------------
def export(args):
    """--export: the model, read on the CPU, written as the authors' released SetDLM folders are
    (setdiff.save_released refuses what that format cannot express)."""
    require(args.export, "--export '': give the name of the folder to write")
    model, tok, _ = setdiff.load_checkpoint(args.ckpt)
    names = setdiff.save_released(model, tok, args.export)
    written = ", ".join(names)
    print(f"exported {args.ckpt} to {args.export} as a released SetDLM folder: {written}")


# ---- Main: a user error is one line on stderr and exit code 2 ---------------------------------
def sample_or_score(args):
    """Load the model named by --ckpt, then sample from it or, with --eval, score text (with
    --export, write it in the authors' released format instead)."""
    require(args.ckpt, "give --ckpt PATH: a checkpoint of train_small.py or a released model")
    if args.export is not None:
        export(args)
        return
    device, dtype, how = setdiff.runtime(args.device, args.dtype, args.threads)
    print(how)
    model, tok, ckpt = load(args.ckpt, device)
    with setdiff.autocast(device, dtype):  # every forward pass; the weights stay float32
        if args.eval is None:
            sample(args, model, tok)
        else:
            evaluate(args, model, tok, ckpt)


def main(argv=None) -> int:
    """The script: exit code 0, 2 for a user error (one line on stderr), 130 on Ctrl-C."""
    args = build_parser().parse_args(argv)
    try:
        sample_or_score(args)
    except (ValueError, OSError) as e:  # setdiff and this file raise ValueError for bad input
        message = " ".join(str(e).split())
        print(f"error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, and the shell's code for SIGINT
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.stdout.reconfigure(errors="replace")  # samples may hold any character
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # a closed pipe (| head) ends us as any tool
    sys.exit(main())
