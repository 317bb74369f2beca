"""Sample from, score, compare and time set diffusion LMs; the method itself is in setdiff.py.

    python sample.py --ckpt out/best.pt --num-samples 4 --threshold 0.9   # unconditional, fast
    python sample.py --ckpt out/best.pt --prompt "The model" --stop-at-eos --show-order
    python sample.py --ckpt out/best.pt --infill "The [MASK][MASK]t sat on ___12 mat."
    python sample.py --ckpt out/best.pt --eval valid.txt --num-orders 4   # likelihood bound
    python sample.py --ckpt out/best.pt --eval                            # the run's validation split
    python sample.py --compare runs/*/best.pt --judge runs/ar/best.pt --json cmp.json  # results
    python sample.py --ckpt out/best.pt --order-stats                     # what an order shows
    python sample.py --ckpt out/best.pt --bench                           # sampler speed
"""
import argparse, array, collections, dataclasses, datetime, glob, json, os, pathlib, platform, re, shlex, statistics
import sys, time

import numpy as np
import torch
from tqdm import tqdm

from setdiff import (Config, Generation, KVCache, SetDiffusionLM, Tokenizer, autocast, draw_candidates, elbo, generate,
                     load_checkpoint, max_window, pick_device, pick_dtype, sample_order, synchronize, wrap_rows)

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

def build_parser() -> Parser:
    p = Parser(description=__doc__.split("\n")[0], epilog="examples:\n" + __doc__.split("\n\n")[1],
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", metavar="PATH", help="checkpoint written by train_small.py (its EMA weights)")
    m = p.add_mutually_exclusive_group().add_argument
    m("--prompt", metavar="TEXT", help="text to continue (BOS is prepended)")
    m("--infill", metavar="TEXT", help="text with holes to fill: [MASK] one position, ___N a span of N, ___ --span-len")
    m("--eval", nargs="*", metavar="FILE", help="the bound on text files; no FILE: on the run's validation rows")
    m("--compare", nargs="+", metavar="CKPT", help="the results table of these checkpoints, scored by --judge")
    m("--order-stats", action="store_true", help="what --ckpt's orders (and ar, block, uniform) show a position")
    m("--bench", action="store_true", help="time the sampler of --ckpt beside a plain causal decoder")
    g = p.add_argument_group("sampling").add_argument
    g("--num-samples", type=at_least(1), default=1, metavar="N", help="samples to draw (1)")
    g("--batch-size", type=at_least(1), metavar="B", help="rows per network call (all samples; --eval: 32)")
    g("--max-new-tokens", type=at_least(1), metavar="N", help="tokens to generate (default: fill the context)")
    g("--span-len", type=at_least(1), default=8, metavar="N", help="positions of a bare ___ (8)")
    g("--window", type=int, metavar="W", help="queries per call from the leftmost masked (staggered: d, else largest)")
    g("--threshold", type=float, default=float("inf"), metavar="TAU", help="reveal the top one and all >= TAU (inf)")
    g("--temperature", type=float, default=1.0, metavar="T", help="softmax temperature, 0 = greedy (1)")
    g("--top-p", type=float, default=0.9, metavar="P", help="nucleus sampling, 1 = off (0.9)")
    g("--seed", type=int, default=0, metavar="N", help="seed of the samples and of the --eval orders (0)")
    g("--stop-at-eos", action="store_true", help="end a sample at its first generated EOS")
    g("--show-order", action="store_true", help="mark the tokens revealed by network call N: [text]N")
    g = p.add_argument_group("evaluation and comparison").add_argument
    g("--num-orders", type=at_least(1), default=1, metavar="K", help="decode orders a row (1; --compare >= 4)")
    g("--eval-rows", type=at_least(0), default=0, metavar="N", help="score the first N rows (0: all)")
    g("--judge", metavar="CKPT", help="ar checkpoint: its exact likelihood scores the rows of --compare")
    g("--compare-samples", type=at_least(1), default=64, metavar="N", help="samples a model and threshold (64)")
    g("--json", metavar="PATH", help="--compare: also write the results here (the data of the README's figures)")
    g = p.add_argument_group("benchmark and device").add_argument
    g("--bench-repeats", type=at_least(1), default=3, metavar="N", help="interleaved runs a variant (3)")
    g("--bench-batch-sizes", type=at_least(1), nargs="+", default=[1, 16], metavar="B", help="batch sizes (1 16)")
    g("--device", help="cpu, cuda, cuda:N or mps (default: the first of cuda, mps, cpu available)")
    g("--dtype", choices=["auto", "float32", "bfloat16"], default="auto", help="autocast dtype (auto)")
    return p

def load(path, device):
    model, tok, ckpt = load_checkpoint(path, device)
    step = f", step {ckpt['step']:,}" if isinstance(ckpt.get("step"), int) else ""
    print(f"model: {path}{step}: {model.num_params() / 1e6:.2f}M parameters, order {policy(model.cfg)}, "
          f"L={model.cfg.seq_len}, largest window {max_window(model.cfg)}, tokenizer {tok.kind}")
    return model.eval(), tok, ckpt

def policy(cfg: Config) -> str:   # a model's name in tables
    d, s = f" d={cfg.set_size}", f", s={cfg.max_set_size}"
    return cfg.order + {"staggered": d + s, "block": d}.get(cfg.order, "")

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

def decode_order(tok: Tokenizer, ids: list, steps: list) -> str:
    """Each run of neighbouring tokens revealed by one network call marked with the call's number,
    [text]N; given text plain, EOS as \\n. Then the set sizes."""
    out, start = [], 0
    for i in range(1, len(ids) + 1):
        if i < len(ids) and steps[i] == steps[start]:
            continue
        # A run's text is the growth of the decoded prefix, so word-piece spaces land where
        # decode() puts them; a character split between two runs falls back to its own bytes.
        before, through, s = tok.decode(ids[:start]), tok.decode(ids[:i]), steps[start]
        text = through[len(before):] if through.startswith(before) else tok.decode(ids[start:i])
        out += [f"[{text}]{s}" if s >= 0 else text] if s != -2 else []
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
    generator = torch.Generator().manual_seed(args.seed)          # one generator: --seed fixes every sample
    for done in range(0, args.num_samples, args.batch_size or args.num_samples):
        B = min(args.batch_size or args.num_samples, args.num_samples - done)
        out = generate(model, batch_size=B, max_new_tokens=args.max_new_tokens, window=window,
                       threshold=args.threshold, temperature=args.temperature, top_p=args.top_p,
                       generator=generator, stop_at_eos=args.stop_at_eos, **src)
        for b in range(B):
            new, calls = int(out.new_tokens[b]), int(out.steps[b])
            # The rows of a batch share every call: a row's speed is its tokens over the batch's time.
            print(f"--- sample {done + b + 1}/{args.num_samples}: {calls} network calls, "
                  f"{new / max(calls, 1):.2f} tokens/call, {new / out.seconds:,.0f} tokens/s")
            print(tok.decode(out.tokens[b]).rstrip("\n"))
            if args.show_order:
                print(decode_order(tok, out.tokens[b].tolist(), out.reveal_step[b].tolist()))

# ---- Evaluation: the set-factorized bound, as training validation computes it ----------
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
                if line and not re.search("[\0\udc80-\udcff]", line):  # NUL or not UTF-8: binary data
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

def evaluate(args, model, tok, ckpt) -> None:   # the bound of --eval
    rows, per_token = text_rows(args.eval, tok, model.cfg.seq_len) if args.eval else validation_rows(
        ckpt, args.ckpt, "pass --eval FILE ... to score text files")
    res, num_bytes = bound(model, rows, args.num_orders, args, per_token)
    print(f"eval: {' '.join(args.eval) or 'the validation split of the training run'}: {len(rows):,} rows\n"
          f"perplexity bound {res.ppl:.4f} (an upper bound on the true perplexity), {res.bits_per_byte(num_bytes):.4f} "
          f"bits per byte ({num_bytes:,} bytes of source text)\nas in training: val {res.line(num_bytes)}")

# ---- Comparison: quality against speed, one order policy per checkpoint ----------------
# Samples are scored by an AR judge; its score alone rewards degenerate (repetitive) text,
# so the samples' unigram entropy and share of distinct 4-grams stand beside it.
COMPARE_THRESHOLDS = (float("inf"), 0.9, 0.7, 0.5, 0.3, 0.2, 0.1, 0.05)

def text_stats(judge: SetDiffusionLM, rows: torch.Tensor) -> dict:
    """Of rows (n, L), BOS left out: NLL under the AR judge (nats/token; for the identity order the
    bound is exact), unigram entropy (bits) and the share of the 4-grams inside rows that are distinct."""
    p = torch.bincount(rows[:, 1:].flatten()).double()
    p, grams = p[p > 0] / p.sum(), rows[:, 1:].unfold(1, 4, 1).reshape(-1, 4)
    return dict(judge_nll=elbo(judge, rows, num_orders=1).nll_per_token, unigram_entropy=float(-(p * p.log2()).sum()),
                distinct_4grams=len(torch.unique(grams, dim=0)) / max(len(grams), 1))

def compare(args, device, dtype) -> None:
    judge, tok, jckpt = load(args.judge, device) if args.judge else (None, None, None)
    if judge is None or judge.cfg.order != "ar":
        raise ValueError("--compare needs --judge CKPT, a checkpoint trained with --order ar")
    rows, per_token = validation_rows(jckpt, args.judge, "compare checkpoints written by train_small.py")
    if args.json and not pathlib.Path(args.json).resolve().parent.is_dir():   # before, not after, the work
        raise ValueError(f"--json {args.json}: its folder does not exist")
    K, n_gen = max(args.num_orders, 4), args.compare_samples
    real = torch.from_numpy(np.asarray(rows[:n_gen], dtype=np.int64))   # (n, L): what samples should look like
    res_all = dict(command=args.command, validation=text_stats(judge, real), bounds=[], samples=[])
    print(f"command: {args.command}\nvalidation rows: {json.dumps(res_all['validation'])}")
    for path in args.compare:
        model, mtok, ckpt = load(path, device)
        if mtok.spec() != tok.spec() or (ckpt.get("val_rows") or {}).get("path") != jckpt["val_rows"]["path"]:
            raise ValueError(f"{path} was not trained on the data and tokenizer of the judge {args.judge}")
        cfg, name, w_max = model.cfg, policy(model.cfg), max_window(model.cfg)
        res, num_bytes = bound(model, rows, K, args, per_token)
        res_all["bounds"].append(dict(model=name, ckpt=str(path), step=ckpt.get("step"), **res.metrics(num_bytes)))
        for window in sorted({w_max if cfg.order == "uniform" else min(cfg.set_size, w_max), w_max}):  # d, the largest
            for tau in COMPARE_THRESHOLDS[:1] if window == 1 else COMPARE_THRESHOLDS:  # w = 1: 1 token/call
                out = generate(model, batch_size=n_gen, window=window, threshold=tau, top_p=args.top_p,
                               temperature=args.temperature, generator=torch.Generator().manual_seed(args.seed))
                res_all["samples"].append(dict(model=name, window=window, threshold=None if tau > 1 else tau,
                                               tokens_per_call=out.tokens_per_step, seconds=out.seconds,
                                               **text_stats(judge, out.tokens.cpu())))
    print(table(f"Validation bound ({res.num_seqs:,} rows, K={K} orders)", "model | val ppl bound | nats/token +- se | "
                "bits/byte | tokens scored", [(r["model"], f"{r['ppl_bound']:.3f}", f"{r['nll_per_token']:.4f} +- "
                f"{r['se']:.4f}", f"{r['bits_per_byte']:.3f}", f"{r['tokens_scored']:,}") for r in res_all["bounds"]]))
    print(table(f"{n_gen} unconditional samples (temperature {args.temperature:g}, top-p {args.top_p:g})",
                "model | window | threshold | tokens/call | judged NLL (nats/token) | unigram entropy (bits) | "
                "distinct 4-grams | seconds", [(r["model"], r["window"], r["threshold"] or ">1",
                f"{r['tokens_per_call']:.2f}", f"{r['judge_nll']:.3f}", f"{r['unigram_entropy']:.2f}",
                f"{r['distinct_4grams']:.3f}", f"{r['seconds']:.1f}") for r in res_all["samples"]]))
    if args.json:                    # a temp file, then rename: a failed write keeps the old file
        pathlib.Path(args.json + ".tmp").write_text(json.dumps(res_all, indent=1) + "\n")
        os.replace(args.json + ".tmp", args.json)

# ---- What a decode order shows a position when it is revealed ------------------------
def order_stats(cfg: Config, num_orders: int = 4000, seed: int = 0) -> tuple:
    """Over sampled orders, for positions i = 16..L-17: P(i - 1 comes before i), P(i - 4..i - 1 all do),
    and when i is revealed, E(still masked among i - 16..i - 1) and E(revealed among i + 1..i + 4)."""
    if cfg.seq_len < 33:
        raise ValueError(f"--order-stats needs L >= 33 (16 positions on each side), got {cfg.seq_len}")
    step = torch.argsort(sample_order(cfg, num_orders, torch.Generator().manual_seed(seed)), 1)  # (N, L)
    i = torch.arange(16, cfg.seq_len - 16)
    first = lambda j: (step[:, i + j] < step[:, i]).double()     # (N, n): position i + j comes before i
    left = torch.stack([first(-j) for j in range(1, 17)])        # (16, N, n)
    right = sum(first(j) for j in range(1, 5))
    return tuple(float(v.mean()) for v in (left[0], left[:4].prod(0), (1 - left).sum(0), right))

def show_order_stats(args, model, tok, ckpt) -> None:   # --order-stats: the model's policy, ar, block d, uniform
    cfgs = [model.cfg] + [dataclasses.replace(model.cfg, order=o) for o in ("ar", "block", "uniform")]
    rows = {policy(c): order_stats(c) for c in cfgs if c.order != "block" or 1 < c.set_size < c.seq_len}
    L, header = cfgs[0].seq_len, ("policy | left neighbour revealed first | all 4 left neighbours first | unrevealed "
                                  "among the 16 to the left | revealed among the 4 to the right")
    print(table(f"What the order shows position i when i is revealed (L={L}, 4,000 orders, positions 16..{L - 17})",
                header, [(name, *(f"{v:.{3 if k < 2 else 2}f}" for k, v in enumerate(st))) for name, st in rows.items()]))

# ---- Benchmark: sampler speed as ratios measured side by side in one run ---------------
THRESHOLDS = (1.01, 0.9, 0.7, 0.5, 0.3, 0.1)

def machine_line(device, dtype) -> str:
    info = pathlib.Path("/proc/cpuinfo").read_text() if os.path.exists("/proc/cpuinfo") else ""
    cpu = (re.findall(r"model name\s*: (.*)", info) or [platform.processor() or platform.machine()])[0]
    gpu = f", GPU {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""
    return (f"machine: {cpu}, {os.cpu_count()} cores{gpu}; torch {torch.__version__}, {torch.get_num_threads()} "
            f"threads; device {device}, {str(dtype)[6:]}; {datetime.date.today()}")

@torch.inference_mode()
def plain_decoder(model: SetDiffusionLM, B: int, temperature: float, top_p: float, generator) -> Generation:
    """The peer a user would pick instead: a causal decoder with a KV cache, one token per call
    (the usual loop), on the same network and cache buffers; L - 1 new tokens a row."""
    cfg, device, start = model.cfg, next(model.parameters()).device, time.perf_counter()
    cache, rows = KVCache(cfg, B, cfg.seq_len, max_call=1, device=device), torch.full((B, cfg.seq_len), cfg.bos_id)
    x = rows[:, :1].to(device)
    for t in range(cfg.seq_len - 1):
        cache.write_pos = torch.full((B, 1), t, device=device)                # token t goes to slot t
        attn = torch.cat([cache.filled, torch.ones_like(cache.filled[:, :1])], 1)[:, None]  # cache + itself
        h = model.run(x, cache.write_pos, attn, cache)                        # (B, 1, D)
        cache.commit()
        x = draw_candidates(model.logits(h), temperature, top_p, generator)[0]  # (B, 1) token t + 1
        rows[:, t + 1] = x[:, 0]
    synchronize(device)
    m = cfg.seq_len - 1                     # calls = new tokens; position t is revealed by call t - 1
    return Generation(rows, torch.arange(-1, m).expand(B, -1), m, torch.full((B,), m), torch.full((B,), m),
                      time.perf_counter() - start)

def bench(args, device, dtype) -> None:
    """Time full-row generation: every sampler at every batch size, and from which threshold the set
    sampler (it feeds 2 tokens a call even at 1 token per call) overtakes the plain decoder."""
    model = load(args.ckpt, device)[0]
    cfg, w_max, sizes, repeats = model.cfg, max_window(model.cfg), args.bench_batch_sizes, args.bench_repeats
    w4, windows = min(4, w_max), {"d": min(cfg.set_size, w_max), "s": w_max}
    plain, cached, free = "plain causal decoder", f"cached, w={w4}", f"cache-free, w={w4}"
    kw = dict(temperature=args.temperature, top_p=args.top_p)
    generate(model, max_new_tokens=1, **kw)      # checks them before the plain decoder uses them
    variants = {cached: dict(window=w4, temperature=0), free: dict(window=w4, temperature=0, use_cache=False)} | {
        f"w={n}={w}, tau={t:g}": dict(kw, window=w, threshold=t) for n, w in windows.items() for t in THRESHOLDS}
    # Rounds of one run per variant, round 0 only warming up (allocation, kernel choice): a burst of
    # load from elsewhere slows one run of every variant a little, and the median discards it.
    seconds, out = {key: [] for key in ((v, B) for B in sizes for v in [plain, *variants])}, {}
    for round in tqdm(range(repeats + 1), desc="bench rounds"):
        for v, B in seconds:         # a fresh generator per run: every round draws the same tokens
            g = torch.Generator().manual_seed(args.seed)
            out[v, B] = plain_decoder(model, B, generator=g, **kw) if v == plain else generate(
                model, batch_size=B, generator=g, **variants[v])
            seconds[v, B] += [out[v, B].seconds] if round else []
    speed = {key: int(out[key].new_tokens.sum()) / statistics.median(s) for key, s in seconds.items()}
    print(f"# sample.py --bench\ncommand: {args.command}\n{machine_line(device, dtype)}\n{cfg.seq_len - 1} new tokens "
          f"a row; plain and tau rows: temperature {args.temperature:g}, top-p {args.top_p:g}")
    print(table(f"Sampler speed (median of {repeats} interleaved runs after a warm-up)", " | ".join(
        ["sampler"] + [f"batch {B} tokens/call | batch {B} tokens/s" for B in sizes] + [f"tokens/s batch {sizes[-1]} "
        f"over {sizes[0]}"]), [(v, *[f"{out[v, B].tokens_per_step:.2f} | {speed[v, B]:,.0f}" for B in sizes],
                               f"{speed[v, sizes[-1]] / speed[v, sizes[0]]:.2f}x") for v in [plain, *variants]]))
    for B in sizes:
        same = all(torch.equal(getattr(out[cached, B], k), getattr(out[free, B], k)) for k in ("tokens", "reveal_step"))
        print(f"batch {B}, greedy: the KV cache samples {speed[cached, B] / speed[free, B]:.2f}x faster than the "
              f"cache-free reference; identical outputs: {'yes' if same else 'NO'}")
        for n, w in windows.items():  # THRESHOLDS descend: tokens per call grow
            v = next((v for v in variants if v.startswith(f"w={n}=") and speed[v, B] > speed[plain, B]), None)
            print(f"batch {B}, w={n}={w}: " + (f"the set sampler overtakes the plain decoder at {v.split(', ')[1]}, "
                  f"{out[v, B].tokens_per_step:.2f} tokens/call ({speed[v, B] / speed[plain, B]:.2f}x)" if v else
                  "the plain decoder is faster at every threshold"))

# ---- Main: a user error is one line on stderr and exit code 2 --------------------------
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")              # samples may hold any character
    args = build_parser().parse_args(argv)
    args.command = shlex.join(["python", "sample.py", *argv])
    try:
        if args.ckpt is None and not args.compare:
            raise ValueError("give --ckpt PATH, a checkpoint written by train_small.py")
        device, why = pick_device(args.device, int(os.environ.get("LOCAL_RANK", 0)))
        dtype, why_dtype = pick_dtype(device, args.dtype)
        print(f"device: {device} ({why}); {str(dtype)[6:]} ({why_dtype})")
        with autocast(device, dtype):               # every forward pass; the weights stay float32
            if args.compare or args.bench:
                (compare if args.compare else bench)(args, device, dtype)
            else:
                mode = show_order_stats if args.order_stats else sample if args.eval is None else evaluate
                mode(args, *load(args.ckpt, device))
    except (ValueError, OSError) as e:   # setdiff and this file raise ValueError for bad input
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0

if __name__ == "__main__":
    sys.exit(main())
