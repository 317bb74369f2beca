"""Time the set sampler beside a plain causal decoder with a KV cache: full rows at every
batch size, greedy with and without the cache, then every threshold with the windows d and s.

    python experiments/bench.py --ckpt runs/staggered-d4/ckpt.pt --batch-sizes 1 16
"""

import argparse
import copy
import functools
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

# `python experiments/bench.py` puts experiments/ on the path, not the repository root
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import setdiff  # noqa: E402

THRESHOLDS = (1.01, 0.9, 0.7, 0.5, 0.3, 0.1)
PLAIN = "plain causal decoder"
MAX_SPREAD = 1.5  # a sampler's slowest / fastest timed run beyond which nothing is concluded


def causal_mask(cache, n):
    """(B, n, T + n): each of a call's n consecutive tokens sees the cached ones and the call's
    tokens up to itself."""
    filled = cache.filled  # (B, T)
    B, T = filled.shape
    slot = torch.arange(n, device=filled.device)
    causal = slot[None, :] <= slot[:, None]  # (n, n)
    causal = causal.expand(B, n, n)
    cached = filled[:, None].expand(B, n, T)
    return torch.cat([cached, causal], 2)


@torch.inference_mode()
def plain_decoder(
    model, prompt, new_tokens, temperature=0.0, top_p=1.0, generator=None, compile=False
):
    """The peer a user would pick instead: a causal decoder with a KV cache on the same network
    and cache, the prompt (B, P) in one causal call, then one token a call (`compile`: compiled
    as generate() compiles its calls). For timing only: a set model predicts from
    MASK queries, not from the last token."""
    device = next(model.parameters()).device
    B, P = prompt.shape
    start = time.perf_counter()
    T = P + new_tokens
    slots = P + 1  # the prompt's call, and a spare slot
    cache = setdiff.KVCache(model.cfg, B, T, max_call=slots, device=device)
    blank = torch.zeros(B, new_tokens, dtype=torch.long)
    rows = torch.cat([prompt, blank], 1).to(device)
    # a run's uniforms drawn at once, as generate's
    u = torch.rand(T, B, 1, generator=generator, dtype=torch.float64)
    u = setdiff.upload(u, device)
    sampling = (temperature, top_p)
    last = torch.full((B, 1), P - 1, device=device)  # the position of the call's last token
    positions = torch.arange(P, device=device).expand(B, P)
    plain_call(model, rows, cache, last, u, sampling, positions)  # the first call: the prompt
    step = plain_call
    if compile:  # True, or a torch.compile backend's name
        setdiff.fixed_addresses(cache)
        for t in (rows, last, u):
            torch._dynamo.mark_static_address(t)
        backend = "inductor" if compile is True else compile
        step = compiled_plain_call(backend)
    for _ in range(new_tokens - 1):  # the token at position p is stored at slot p
        step(model, rows, cache, last, u, sampling)
    setdiff.synchronize(device)
    seconds = time.perf_counter() - start
    calls = torch.arange(-P, new_tokens)  # call c reveals token P + c; the prompt is given
    calls = calls.clamp(min=setdiff.GIVEN)
    reveal_call = calls.expand(B, -1)
    row_calls = torch.full((B,), new_tokens)
    return setdiff.Generation(rows, reveal_call, new_tokens, row_calls, seconds)


@functools.cache  # one compile a process: its graphs serve every later run
def compiled_plain_call(backend):
    """plain_call compiled: a graph per batch size and row length, at most 64."""
    return setdiff.compiled(plain_call, backend, 64)


def plain_call(model, rows, cache, last, u, sampling, positions=None):
    """One causal call of the tokens of rows (B, T) at `positions` (B, n) (None: at `last`),
    the last at `last` (B, 1): the token after it is drawn and written, and `last` moves on."""
    if positions is None:
        positions = last
    tokens = rows.gather(1, positions)
    attn = causal_mask(cache, tokens.shape[1])
    logits = model(tokens, positions, attn, cache, queries=1)  # (B, 1, V): the last token's
    cache.store(positions, positions >= 0)  # every token of the call
    temperature, top_p = sampling
    draws = None  # greedy
    if temperature > 0:
        draws = u[last[0]][0]  # (B, 1); a tensor index: no host read
    if top_p == 1:
        top_p = None  # not truncated
    token, _ = setdiff.draw_candidates(logits, temperature, top_p, draws)  # (B, 1)
    last += 1
    rows.scatter_(1, last, token)


def variants(cfg, sampling, compile=False):
    """Sampler name -> generate() options; the first two are greedy, with and without cache
    (never compiled: compile=True compiles the cached sampler)."""
    largest = setdiff.max_window(cfg)
    w4 = min(4, largest)
    greedy = dict(window=w4, temperature=0)
    out = {f"cached, w={w4}": greedy | dict(compile=compile)}
    out[f"cache-free, w={w4}"] = greedy | dict(use_cache=False)
    d = setdiff.default_window(cfg)
    windows = {"d": d, "s": largest}
    for label, w in windows.items():
        for tau in THRESHOLDS:
            name = f"w={label}={w}, tau={tau:g}"
            options = dict(window=w, threshold=tau, compile=compile)
            out[name] = options | sampling
    return out


def cache_is_exact(model, batch_size, window):
    """Cached and cache-free greedy sampling give the same tokens and reveal calls, checked on
    a float64 copy (outside autocast): in float32 a near-tie of two candidates can flip one
    reveal, as seen on a weakly trained checkpoint, a false alarm about the cache."""
    exact = copy.deepcopy(model)
    device = next(exact.parameters()).device
    if device.type == "mps":  # MPS has no float64
        exact = exact.cpu()
    exact = exact.double()
    greedy = dict(batch_size=batch_size, window=window, temperature=0)
    cached = setdiff.generate(exact, **greedy)
    free = setdiff.generate(exact, use_cache=False, **greedy)
    same_tokens = torch.equal(cached.tokens, free.tokens)
    same_calls = torch.equal(cached.reveal_call, free.reveal_call)
    return same_tokens and same_calls


def sample(model, name, B, samplers, plain):
    """One run of a sampler on B full rows; every run draws the same tokens (a fresh seed)."""
    g = torch.Generator().manual_seed(0)
    if name != PLAIN:
        options = samplers[name]
        return setdiff.generate(model, batch_size=B, generator=g, **options)
    cfg = model.cfg
    first = cfg.eos_id if cfg.bos_id is None else cfg.bos_id  # the token generate() starts with
    prompt = torch.full((B, 1), first)
    new_tokens = cfg.seq_len - 1
    return plain_decoder(model, prompt, new_tokens, generator=g, **plain)


def timed_rounds(model, samplers, sizes, repeats, plain):
    """(sampler, batch size) -> (tokens per call, tokens/s of the median run, slowest/fastest,
    seconds the warm-up run took beyond the median: compiling, where compiled). Round 0 only
    warms up (allocation, kernel choice); a burst of load from elsewhere then slows one run of
    every sampler a little, and the median discards it."""
    names = [PLAIN, *samplers]
    keys = [(name, B) for B in sizes for name in names]
    seconds = {key: [] for key in keys}
    last = {}
    rounds = range(repeats + 1)
    for r in tqdm(rounds, desc="bench rounds", leave=False):
        round_start = time.perf_counter()
        for name, B in keys:
            out = sample(model, name, B, samplers, plain)
            seconds[name, B].append(out.seconds)
            last[name, B] = out
        if r == 0:
            rest = (time.perf_counter() - round_start) * repeats
            tqdm.write(f"warm-up round done: the {repeats} timed rounds take about {rest:.0f} s")
    timings = {}
    for key, runs in seconds.items():
        timed = runs[1:]  # after the warm-up
        out = last[key]
        new_tokens = int(out.new_tokens.sum())
        median = statistics.median(timed)
        spread = max(timed) / min(timed)
        warmup = runs[0] - median
        speed = new_tokens / median
        timings[key] = (out.tokens_per_call, speed, spread, warmup)
    return timings


def verdict(label, names, timings):
    """What one group of samplers shows: `timings` name -> (tokens/call, tokens/s, spread)."""
    plain_speed = timings[PLAIN][1]
    speed = {name: timings[name][1] for name in names}
    spreads = [timings[name][2] for name in [PLAIN, *names]]
    worst = max(spreads)
    if worst > MAX_SPREAD:
        spread = f"slowest/fastest {worst:.2f} > {MAX_SPREAD}"
        advice = "rerun on an idle machine or with more --repeats"
        return f"the repeats disagree ({spread}): nothing to conclude; {advice}"
    if label == "greedy":
        cached, free = names
        ratio = speed[cached] / speed[free]
        return f"the KV cache runs at {ratio:.2f}x the cache-free speed"
    faster = [name for name in names if speed[name] > plain_speed]
    if not faster:
        return "the plain decoder is faster at every threshold"
    first = faster[0]  # tau descends: tokens per call grow
    tau = first.split(", ")[1]
    tokens_per_call = timings[first][0]
    gain = speed[first] / plain_speed
    where = f"{tau}, {tokens_per_call:.2f} tokens/call ({gain:.2f}x)"
    return f"the set sampler overtakes the plain decoder at {where}"


def conclusions(B, samplers, timings):
    """What the table shows at batch size B: the cache's speed-up, and from which threshold
    each window overtakes the plain decoder; a warning instead where the repeats of a sampler
    that a line rests on disagree."""
    names = list(samplers)
    groups = {"greedy": names[:2]}
    for name in names[2:]:
        label = name.split(", ")[0]  # "w=d=4": the window's name and size
        groups.setdefault(label, []).append(name)
    mine = {}
    for (name, b), timing in timings.items():
        if b == B:
            mine[name] = timing
    lines = []
    for label, group in groups.items():
        text = verdict(label, group, mine)
        lines.append(f"batch {B}, {label}: {text}")
    return lines


def print_table(samplers, sizes, timings):
    cells = [f"batch {B} tokens/call | batch {B} tokens/s" for B in sizes]
    print(f"| sampler | {' | '.join(cells)} | tokens/s {sizes[-1]} over {sizes[0]} |")
    columns = 2 * len(sizes) + 2
    print("|---" * columns + "|")
    for name in [PLAIN, *samplers]:
        row = [timings[name, B] for B in sizes]
        cells = [f"{tpc:.2f} | {speed:,.0f}" for tpc, speed, *_ in row]
        ratio = row[-1][1] / row[0][1]
        print(f"| {name} | {' | '.join(cells)} | {ratio:.2f}x |")


def bench(args, command):
    where = (args.device, args.dtype, args.threads)
    device, dtype, how = setdiff.runtime(*where)
    print(f"# experiments/bench.py\ncommand: {command}\ntorch {torch.__version__}\n{how}")
    sizes = args.batch_sizes
    repeats = args.repeats
    smallest = min(sizes + [repeats])
    setdiff.require(smallest >= 1, "--repeats, --batch-sizes >= 1")
    model, _, _ = setdiff.load_checkpoint(args.ckpt, device)
    model.eval()
    cfg = model.cfg
    sampling = dict(temperature=args.temperature, top_p=args.top_p)  # of the plain and tau rows
    setdiff.sampler_window(cfg, None, 1.0, **sampling)  # checked before the plain decoder
    samplers = variants(cfg, sampling, args.compile)
    print(f"{len(samplers) + 1} samplers x batch sizes {sizes}: a warm-up + {args.repeats} rounds")
    with setdiff.autocast(device, dtype):
        plain = sampling | dict(compile=args.compile)
        timings = timed_rounds(model, samplers, sizes, repeats, plain)
    greedy = next(iter(samplers.values()))
    exact = cache_is_exact(model, sizes[-1], greedy["window"])
    note = f"temperature {args.temperature:g}, top-p {args.top_p:g}"
    print(f"{cfg.seq_len - 1} new tokens a row; plain and tau rows: {note}")
    print(f"\n## Sampler speed (median of {args.repeats} interleaved runs after a warm-up)\n")
    print_table(samplers, sizes, timings)
    print(f"\ncached = cache-free (greedy, float64, batch {sizes[-1]}): {'yes' if exact else 'NO'}")
    for B in sizes:
        lines = conclusions(B, samplers, timings)
        print("\n".join(lines))


def main(argv=None):
    if argv is None:
        argv = sys.argv[1:]
    argv = [str(a) for a in argv]  # paths too
    summary = __doc__.split("\n")[0]
    p = argparse.ArgumentParser(description=summary)
    add = p.add_argument
    add("--ckpt", required=True, help="train_small.py's checkpoint, or a released model's folder")
    add("--repeats", type=int, default=3, help="timed rounds after the warm-up (3)")
    sizes = dict(type=int, nargs="+", default=[1, 16], metavar="B")
    add("--batch-sizes", help="(1 16)", **sizes)
    add("--temperature", type=float, default=1.0, help="of the plain and tau rows (1)")
    add("--top-p", type=float, default=1.0, help="of the plain and tau rows (1: off)")
    add("--device", help="cpu, cuda, cuda:N or mps (default: the first of cuda, mps, cpu)")
    dtypes = ["auto", "float32", "bfloat16"]
    add("--dtype", choices=dtypes, default="auto", help="autocast (auto)")
    add("--threads", type=int, help="CPU threads (default: the cores other work leaves idle)")
    add("--compile", action="store_true", help="torch.compile the plain and the cached calls")
    args = p.parse_args(argv)
    command = shlex.join(["python", "experiments/bench.py", *argv])
    try:
        bench(args, command)
    except (ValueError, OSError) as e:  # setdiff raises ValueError for bad input
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
