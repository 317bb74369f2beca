"""Sample from, score, compare and time set diffusion LMs; the method itself is in setdiff.py.

    python sample.py --ckpt out/best.pt --num-samples 4 --threshold 0.9   # unconditional, fast
    python sample.py --ckpt out/best.pt --prompt "The model" --stop-at-eos --show-order
    python sample.py --ckpt out/best.pt --infill "The [MASK][MASK]t sat on ___12 mat."
    python sample.py --ckpt out/best.pt --eval valid.txt --num-orders 4   # likelihood bound
    python sample.py --ckpt out/best.pt --eval                            # the run's validation split
    python sample.py --compare runs/*/best.pt --judge runs/cmp-ar/best.pt # the results table
    python sample.py --bench                                              # sampler speed
"""
import argparse, array, collections, datetime, glob, os, pathlib, platform, re, shlex, statistics, sys

import numpy as np
import torch
from tqdm import tqdm

from setdiff import (Config, SetDiffusionLM, Tokenizer, autocast, elbo, generate, load_checkpoint,
                     max_window, pick_device, pick_dtype, wrap_rows)

# ---- Command line ----------------------------------------------------------------------
class Parser(argparse.ArgumentParser):
    def error(self, message):  # a usage error is one line and exit code 2, like any bad input
        self.exit(2, f"error: {message} (see --help)\n")

def at_least(low: int):
    def integer(text: str) -> int:  # argparse names the type after this function
        if int(text) < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {text}")
        return int(text)
    return integer

# The random model --bench times without --ckpt: train_small.py's CPU preset shape, or a toy.
BENCH_SHAPES = {"cpu": dict(seq_len=128, n_layer=4, n_head=4, d_model=256, set_size=4, max_set_size=None),
                "tiny": dict(seq_len=32, n_layer=1, n_head=2, d_model=32, set_size=4, max_set_size=None)}

def build_parser() -> Parser:
    p = Parser(description=__doc__.split("\n")[0], epilog="examples:\n" + __doc__.split("\n\n")[1],
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", metavar="PATH", help="checkpoint written by train_small.py (its EMA weights)")
    m = p.add_mutually_exclusive_group().add_argument
    m("--prompt", metavar="TEXT", help="text to continue (BOS is prepended)")
    m("--infill", metavar="TEXT", help="holes to fill, the rest is kept: [MASK] is one position (a byte or "
      "a word piece), ___ a span of --span-len positions, ___N a span of N")
    m("--eval", nargs="*", metavar="FILE", help="the bound on text files, or with no FILE on the run's validation "
      "split (its log line again with its --eval-rows, --num-orders, --seed, --batch-size 2 x micro-batch)")
    m("--compare", nargs="+", metavar="CKPT", help="the results table of these checkpoints, scored by --judge")
    m("--bench", action="store_true", help="time the sampler on --ckpt or on a random model")
    g = p.add_argument_group("sampling").add_argument
    g("--num-samples", type=at_least(1), default=1, metavar="N", help="samples to draw (1)")
    g("--batch-size", type=at_least(1), metavar="B", help="rows per network call (all samples; --eval: 32)")
    g("--max-new-tokens", type=at_least(1), metavar="N", help="tokens to generate (default: fill the context)")
    g("--span-len", type=at_least(1), default=8, metavar="N", help="positions of a bare ___ (8)")
    g("--window", type=int, metavar="W", help="masked positions predicted per call, from the leftmost; at most "
      "the largest window of the policy (default: d for staggered generation, else the largest)")
    g("--threshold", type=float, default=float("inf"), metavar="TAU", help="reveal the most confident "
      "candidate and all with probability >= TAU (default inf: one per call)")
    g("--temperature", type=float, default=1.0, metavar="T", help="softmax temperature, 0 = greedy (1)")
    g("--top-p", type=float, default=0.9, metavar="P", help="nucleus sampling, 1 = off (0.9)")
    g("--seed", type=int, default=0, metavar="N", help="seed of the samples and of the --eval orders (0)")
    g("--stop-at-eos", action="store_true", help="end a sample at its first generated EOS")
    g("--no-cache", action="store_true", help="the cache-free reference sampler (slow; same greedy tokens)")
    g("--show-order", action="store_true", help="mark the tokens revealed by network call N: [text]N")
    g = p.add_argument_group("evaluation and comparison").add_argument
    g("--num-orders", type=at_least(1), default=1, metavar="K", help="decode orders a row (1; --compare >= 4)")
    g("--eval-rows", type=at_least(0), default=0, metavar="N", help="score the first N rows (0: all)")
    g("--judge", metavar="CKPT", help="ar checkpoint: its exact likelihood scores the rows of --compare")
    g("--compare-samples", type=at_least(1), default=64, metavar="N", help="samples a model and threshold (64)")
    g = p.add_argument_group("benchmark").add_argument
    g("--bench-repeats", type=at_least(1), default=3, metavar="N", help="interleaved runs a variant (3)")
    g("--bench-batch-sizes", type=at_least(1), nargs="+", default=[1, 16], metavar="B", help="batch sizes (1 16)")
    g("--bench-tiny", action="store_true", help="a seconds-long smoke run on a toy model")
    for name, default in BENCH_SHAPES["cpu"].items():
        g("--" + name.replace("_", "-"), type=at_least(1), help=f"{name} of the random model ({default or '2d'})")
    g = p.add_argument_group("device").add_argument
    g("--device", help="cpu, cuda, cuda:N or mps (default: the first of cuda, mps, cpu available)")
    g("--dtype", choices=["auto", "float32", "bfloat16"], default="auto", help="autocast dtype (auto)")
    return p

def load(path, device):
    model, tok, ckpt = load_checkpoint(path, device)
    step = f", step {ckpt['step']:,}" if isinstance(ckpt.get("step"), int) else ""
    print(f"model: {path}{step}: {model.num_params() / 1e6:.2f}M parameters, order {policy(model.cfg)}, "
          f"L={model.cfg.seq_len}, largest window {max_window(model.cfg)}, tokenizer {tok.kind}")
    return model.eval(), tok, ckpt

def policy(cfg: Config) -> str:
    return cfg.order + (f" d={cfg.set_size}" if cfg.order in ("staggered", "block") else "")

def table(title: str, header: str, rows: list) -> str:
    return "\n".join([f"\n## {title}\n", f"| {header} |", "|---" * (header.count("|") + 1) + "|"]
                     + ["| " + " | ".join(map(str, row)) + " |" for row in rows])

# ---- Sampling --------------------------------------------------------------------------
HOLE = re.compile(r"\[MASK\]|_{3,}(\d*)")   # [MASK]: one position; ___ or ___N: a span

def infill_ids(text: str, tok: Tokenizer, span_len: int) -> list:
    """Ids of a template, MASK where to fill; the text between holes is encoded piece by piece."""
    parts = HOLE.split(text)           # known, hole, known, ...; a hole is None for [MASK], else its N
    ids = tok.encode(parts[0])
    for hole, known in zip(parts[1::2], parts[2::2]):
        if (n := 1 if hole is None else int(hole or span_len)) < 1:
            raise ValueError("--infill: ___0 asks for a span of 0 positions")
        ids += [tok.mask_id] * n + tok.encode(known)
    if len(parts) == 1:
        raise ValueError("--infill has nothing to fill: mark positions with [MASK] (one each) or ___ / ___N")
    return ids

COLOURS = ("\033[30;46m", "\033[30;43m", "\033[30;42m", "\033[30;45m", "\033[30;44m", "\033[30;41m")

def decode_order(tok: Tokenizer, ids: list, steps: list, colour: bool) -> str:
    """Each run of neighbouring tokens revealed by one network call marked with the call's number,
    [text]N (a colour per call on a terminal); given text plain, EOS as \\n. Then the set sizes."""
    out, start = [], 0
    for i in range(1, len(ids) + 1):
        if i < len(ids) and steps[i] == steps[start]:
            continue
        # A run's text is the growth of the decoded prefix, so word-piece spaces land where
        # decode() puts them; a character split between two runs falls back to its own bytes.
        before, through, s = tok.decode(ids[:start]), tok.decode(ids[:i]), steps[start]
        text = through[len(before):] if through.startswith(before) else tok.decode(ids[start:i])
        if s >= 0:
            text = f"{COLOURS[s % len(COLOURS)]}{text}\033[0m\033[2m{s}\033[0m" if colour else f"[{text}]{s}"
        out += [text] if s != -2 else []
        start = i
    hist = collections.Counter(collections.Counter(s for s in steps if s >= 0).values())  # set size -> calls
    sizes = ", ".join(f"{hist[n]} x {n} token{'s' * (n > 1)}" for n in sorted(hist)) or "none"
    return "--- decode order:\n" + "".join(out).replace("\n", "\\n") + f"\n--- network calls revealed: {sizes}"

def sample(args, model: SetDiffusionLM, tok: Tokenizer, ckpt) -> None:
    """Draw --num-samples samples, --batch-size rows per network call, each printed with its speed."""
    window, src = args.window, {}
    if args.infill is not None:
        # The known tokens on both sides are cached in the first call and never change. The
        # paper infills with the largest window: holes with right context are easy to fill together.
        src = {"infill": torch.tensor(infill_ids(args.infill, tok, args.span_len))}
        window = max_window(model.cfg) if window is None else window
    elif args.prompt is not None:                     # BOS first, as in every training row
        src = {"prompt": torch.tensor([tok.bos_id] + tok.encode(args.prompt))}
    colour = args.show_order and sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    generator = torch.Generator().manual_seed(args.seed)          # one generator: --seed fixes every sample
    for done in range(0, args.num_samples, args.batch_size or args.num_samples):
        B = min(args.batch_size or args.num_samples, args.num_samples - done)
        out = generate(model, batch_size=B, max_new_tokens=args.max_new_tokens, window=window,
                       threshold=args.threshold, temperature=args.temperature, top_p=args.top_p,
                       generator=generator, use_cache=not args.no_cache, stop_at_eos=args.stop_at_eos, **src)
        for b in range(B):
            new, calls = int(out.new_tokens[b]), int(out.steps[b])
            # The rows of a batch share every call: a row's speed is its tokens over the batch's time.
            print(f"--- sample {done + b + 1}/{args.num_samples}: {calls} network calls, "
                  f"{new / max(calls, 1):.2f} tokens/call, {new / out.seconds:,.0f} tokens/s")
            print(tok.decode(out.tokens[b]).rstrip("\n"))
            if args.show_order:
                print(decode_order(tok, out.tokens[b].tolist(), out.reveal_step[b].tolist(), colour))
        if B > 1:
            print(f"=== batch of {B}: {out.nfe} network calls, {int(out.new_tokens.sum()):,} tokens in "
                  f"{out.seconds:.2f} s = {int(out.new_tokens.sum()) / out.seconds:,.0f} tokens/s")

# ---- Evaluation: the set-factorized bound, as training validation computes it ----------
BINARY = re.compile("[\0\udc80-\udcff]")   # NUL, or a byte that is not UTF-8 (surrogateescape)

def text_rows(files: list, tok: Tokenizer, L: int) -> tuple:
    """LM1B wrapped rows of text files (each line a sentence followed by EOS), and the source text's
    UTF-8 bytes per token, a line's newline counted as one byte (EOS stands for it)."""
    stream, num_bytes = array.array("H"), 0
    for name in (path for pattern in files for path in sorted(glob.glob(pattern)) or [pattern]):
        if not os.path.isfile(name) or not os.path.getsize(name):
            raise ValueError(f"--eval: {name} is " + ("empty" if os.path.isfile(name) else "missing or not a file"))
        with open(name, "rb") as f:
            for raw in map(bytes.strip, f):              # strip: also the \r of Windows line ends
                line = raw.decode("utf-8", "surrogateescape")
                if line and not BINARY.search(line):      # else binary data, not a sentence
                    stream.extend(tok.encode(line) + [tok.eos_id])
                    num_bytes += len(raw) + 1
    rows, _ = wrap_rows(np.frombuffer(stream, dtype=np.uint16), L, tok.bos_id, tok.eos_id)
    if not len(rows):
        raise ValueError(f"--eval: {len(stream):,} tokens of UTF-8 text, but one row of L={L} needs {L - 2}")
    return rows, num_bytes / len(stream)

def validation_rows(ckpt: dict, path, hint: str) -> tuple:
    """The validation rows train_small.py cached for this run (uint16, (rows, L)), bytes per token."""
    info, L = ckpt.get("val_rows"), ckpt["config"]["seq_len"]
    if not isinstance(info, dict) or not {"path", "rows", "bytes_per_token"} <= set(info):
        raise ValueError(f"{path} does not record its validation rows: {hint}")
    if not os.path.isfile(info["path"]) or os.path.getsize(info["path"]) < max(info["rows"], 1) * L * 2:
        raise ValueError(f"the validation rows of {path} ({info['path']}) are missing or cut: {hint}")
    return np.memmap(info["path"], dtype=np.uint16, mode="r", shape=(info["rows"], L)), info["bytes_per_token"]

def bound(model, rows, num_orders: int, args, bytes_per_token: float) -> tuple:
    """(Elbo, bytes of source text) of the first --eval-rows rows; the orders come from --seed."""
    x = torch.from_numpy(np.asarray(rows[:args.eval_rows or len(rows)], dtype=np.int64))   # (n, L)
    res = elbo(model, x, num_orders, args.batch_size or 32, torch.Generator().manual_seed(args.seed))
    # NOTE: bits per byte count the SOURCE text: L-2 tokens a row (BOS and the row's closing
    # EOS are not text) at its bytes per token. Decoded WordPiece text would miscount by ~20%.
    return res, round(len(x) * (x.shape[1] - 2) * bytes_per_token)

def evaluate(args, model, tok, ckpt) -> None:
    if args.eval:
        rows, per_token = text_rows(args.eval, tok, model.cfg.seq_len)
    else:
        rows, per_token = validation_rows(ckpt, args.ckpt, "pass --eval FILE ... to score text files")
    res, num_bytes = bound(model, rows, args.num_orders, args, per_token)
    m = res.metrics(num_bytes)
    print(f"eval: {' '.join(args.eval) or 'the validation split of the training run'}: {m['rows']:,} of "
          f"{len(rows):,} rows, {m['tokens_scored']:,} tokens scored (not BOS), decode orders per row: "
          f"{m['num_orders']}\nperplexity bound {m['ppl_bound']:.4f} (an upper bound on the true perplexity), "
          f"{m['bits_per_byte']:.4f} bits per byte ({num_bytes:,} bytes of source text)\nas in training: "
          f"val {res.line(num_bytes)}")

# ---- Comparison: quality against speed, one order policy per checkpoint ----------------
# Samples are scored by an AR judge; its score alone rewards degenerate (repetitive) text,
# so the samples' unigram entropy stands beside it.
COMPARE_THRESHOLDS = (float("inf"), 0.9, 0.7, 0.5, 0.3)   # weak models are rarely above 0.7

def entropy_bits(counts: torch.Tensor) -> float:    # of the distribution proportional to counts
    p = counts[counts > 0].double() / counts.sum()
    return float(-(p * p.log2()).sum())

def unigram_entropy(rows: torch.Tensor) -> float:   # bits; of the token frequencies, BOS left out
    return entropy_bits(torch.bincount(rows[:, 1:].flatten()))

def judge_ppl(judge: SetDiffusionLM, rows: torch.Tensor) -> float:
    return elbo(judge, rows, num_orders=1).ppl      # AR: for the identity order the bound is exact

def compare(args, device) -> None:
    judge, tok, jckpt = load(args.judge, device) if args.judge else (None, None, None)
    if judge is None or judge.cfg.order != "ar":
        raise ValueError("--compare needs --judge CKPT, a checkpoint trained with --order ar")
    rows, per_token = validation_rows(jckpt, args.judge, "compare checkpoints written by train_small.py")
    K, L, n_fill, n_gen = max(args.num_orders, 4), judge.cfg.seq_len, min(64, len(rows)), args.compare_samples
    real = torch.from_numpy(np.asarray(rows[:max(n_fill, n_gen)], dtype=np.int64))   # (n, L)
    span = torch.arange(L * 3 // 8, L * 5 // 8)                 # the middle quarter of each row
    print(f"command: {args.command}\nvalidation text: judge ppl {judge_ppl(judge, real[:n_gen]):.2f}, "
          f"unigram entropy {unigram_entropy(real[:n_gen]):.2f} bits")
    bounds, gens, fills = [], [], []
    for path in args.compare:
        model, mtok, ckpt = load(path, device)
        if mtok.spec() != tok.spec() or (ckpt.get("val_rows") or {}).get("path") != jckpt["val_rows"]["path"]:
            raise ValueError(f"{path} was not trained on the data and tokenizer of the judge {args.judge}")
        cfg, name = model.cfg, policy(model.cfg)
        res, num_bytes = bound(model, rows, K, args, per_token)
        bounds.append((name, f"{res.ppl:.3f}", f"{res.nll_per_token:.4f} +- {res.se:.4f}",
                       f"{res.bits_per_byte(num_bytes):.3f}", K, f"{res.tokens:,}"))
        window = args.window or (cfg.set_size if cfg.order == "staggered" else max_window(cfg))
        for tau in COMPARE_THRESHOLDS[:1] if cfg.order == "ar" else COMPARE_THRESHOLDS:  # AR: 1 token/call
            out = generate(model, batch_size=n_gen, window=window, threshold=tau, top_p=args.top_p,
                           temperature=args.temperature, generator=torch.Generator().manual_seed(args.seed))
            x = out.tokens.cpu()
            gens.append((name, window, ">1" if tau > 1 else tau, f"{out.tokens_per_step:.2f}",
                         f"{judge_ppl(judge, x):.2f}", f"{unigram_entropy(x):.2f}", f"{out.seconds:.1f}"))
        x = generate(model, infill=real[:n_fill].index_fill(1, span, cfg.mask_id), window=max_window(cfg),
                     temperature=0.0).tokens.cpu()
        accuracy = (x[:, span] == real[:n_fill, span]).double().mean().item()
        fills.append((name, max_window(cfg), f"{accuracy:.3f}", f"{judge_ppl(judge, x):.2f}"))
    print(table(f"Validation bound ({res.num_seqs:,} rows, K={K} orders)",
                "model | val ppl bound | nats/token +- se | bits/byte | orders | tokens scored", bounds))
    print(table(f"{n_gen} unconditional samples (temperature {args.temperature:g}, top-p {args.top_p:g})",
                "model | window | threshold | tokens/call | judge ppl | unigram entropy (bits) | seconds", gens))
    print(table(f"Greedy infilling of positions {span[0]}..{span[-1]} of {n_fill} rows (originals: judge ppl "
                f"{judge_ppl(judge, real[:n_fill]):.2f})", "model | infill window | accuracy | judge ppl", fills))

# ---- Benchmark: sampler speed as ratios measured side by side in one run ---------------
# NOTE: SetDiffusionLM zero-initialises its head: an untrained model gives every token 1/V and no
# threshold below 1 would reveal a second token. A random head of std HEAD_SCALE / sqrt(width) makes
# confidences vary; its tokens per call show the mechanism, not what a trained model reaches.
HEAD_SCALE = 8.0
THRESHOLDS = (1.01, 0.9, 0.7, 0.5)

def random_model(args, device) -> SetDiffusionLM:
    shape = {k: getattr(args, k) or v for k, v in BENCH_SHAPES["tiny" if args.bench_tiny else "cpu"].items()}
    tok = Tokenizer.bytes()
    cfg = Config(vocab_size=tok.vocab_size, dropout=0.0, order="staggered", pad_id=tok.pad_id,
                 bos_id=tok.bos_id, eos_id=tok.eos_id, mask_id=tok.mask_id, **shape)
    torch.manual_seed(args.seed)
    model = SetDiffusionLM(cfg)
    torch.nn.init.normal_(model.head.weight, std=HEAD_SCALE / cfg.d_model ** 0.5)
    return model.to(device).eval()

def machine_line(device, dtype) -> str:
    info = pathlib.Path("/proc/cpuinfo").read_text() if os.path.exists("/proc/cpuinfo") else ""
    cpu = (re.findall(r"model name\s*: (.*)", info) or [platform.processor() or platform.machine()])[0]
    gpu = f", GPU {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""
    return (f"machine: {cpu}, {os.cpu_count()} cores{gpu}; torch {torch.__version__}, {torch.get_num_threads()} "
            f"threads; device {device}, {str(dtype)[6:]}; {datetime.date.today()}")

def bench(args, device, dtype) -> None:
    """Time full-row unconditional generation: every sampler variant at every batch size."""
    model = load(args.ckpt, device)[0] if args.ckpt else random_model(args, device)
    cfg, w_max = model.cfg, max_window(model.cfg)
    w4, windows = min(4, w_max), {"d": min(cfg.set_size, w_max), "s": w_max}
    sizes, repeats = ([1, 2], 1) if args.bench_tiny else (args.bench_batch_sizes, args.bench_repeats)
    cached, free, greedy = f"cached, w={w4}", f"cache-free, w={w4}", dict(window=w4, temperature=0)
    variants = {cached: greedy, free: dict(greedy, use_cache=False)} | {
        f"w={n}={w}, tau={t:g}": dict(window=w, threshold=t, temperature=args.temperature, top_p=args.top_p)
        for n, w in windows.items() for t in THRESHOLDS}
    # Rounds of one run per variant, round 0 only warming up (allocation, kernel choice): a burst of
    # load from elsewhere slows one run of every variant a little, and the median discards it.
    seconds, out = {key: [] for key in ((v, B) for B in sizes for v in variants)}, {}
    for round in tqdm(range(repeats + 1), desc="bench rounds", disable=args.bench_tiny):
        for v, B in seconds:         # a fresh generator per run: every round draws the same tokens
            out[v, B] = generate(model, batch_size=B, generator=torch.Generator().manual_seed(args.seed),
                                 **variants[v])
            seconds[v, B] += [out[v, B].seconds] if round else []
    speed = {key: int(out[key].new_tokens.sum()) / statistics.median(s) for key, s in seconds.items()}
    print(f"# sample.py --bench: {args.ckpt or 'random model, untrained, with a random head (HEAD_SCALE)'}\n"
          f"command: {args.command}\n{machine_line(device, dtype)}\nmodel: {model.num_params() / 1e6:.2f}M, "
          f"{cfg.n_layer} layers x {cfg.d_model}, L={cfg.seq_len}, {policy(cfg)} s={cfg.max_set_size}; "
          f"{cfg.seq_len - 1} new tokens a row; tau rows: temperature {args.temperature:g}, top-p {args.top_p:g}")
    lo, hi = sizes[0], sizes[-1]
    print(table(f"Sampler speed (median of {repeats} interleaved runs after a warm-up)",
                " | ".join(["sampler"] + [f"batch {B} tokens/call | batch {B} tokens/s" for B in sizes]
                           + [f"tokens/s batch {hi} over {lo}"]),
                [(v, *[f"{out[v, B].tokens_per_step:.2f} | {speed[v, B]:,.0f}" for B in sizes],
                  f"{speed[v, hi] / speed[v, lo]:.2f}x") for v in variants]))
    for B in sizes:
        a, b = out[cached, B], out[free, B]
        same = torch.equal(a.tokens, b.tokens) and torch.equal(a.reveal_step, b.reveal_step)
        print(f"batch {B}, greedy: the KV cache samples {speed[cached, B] / speed[free, B]:.2f}x faster than the "
              f"cache-free reference; identical outputs: {'yes' if same else 'NO'}")

# ---- Main: a user error is one line on stderr and exit code 2 --------------------------
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")              # samples may hold any character
    args = build_parser().parse_args(argv)
    args.command = shlex.join(["python", "sample.py", *argv])
    try:
        if args.ckpt is None and not (args.bench or args.compare):
            raise ValueError("give --ckpt PATH (a checkpoint written by train_small.py), or --bench")
        device, why = pick_device(args.device, int(os.environ.get("LOCAL_RANK", 0)))
        dtype, why_dtype = pick_dtype(device, args.dtype)
        print(f"device: {device} ({why}); {str(dtype)[6:]} ({why_dtype})")
        with autocast(device, dtype):               # every forward pass; the weights stay float32
            if args.compare:
                compare(args, device)
            elif args.bench:
                bench(args, device, dtype)
            else:
                model, tok, ckpt = load(args.ckpt, device)
                (sample if args.eval is None else evaluate)(args, model, tok, ckpt)
    except (ValueError, OSError) as e:   # setdiff and this file raise ValueError for bad input
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0

if __name__ == "__main__":
    sys.exit(main())
