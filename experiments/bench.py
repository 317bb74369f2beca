"""Time the set sampler beside a plain causal decoder with a KV cache: full rows at every
batch size, greedy with and without the cache, then every threshold with the windows d and s.

    python experiments/bench.py --ckpt runs/staggered-d4/ckpt.pt --batch-sizes 1 16
"""

import argparse
import copy
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

# `python experiments/bench.py` puts experiments/ on the path, not the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import setdiff  # noqa: E402

THRESHOLDS = (1.01, 0.9, 0.7, 0.5, 0.3, 0.1)
PLAIN = "plain causal decoder"
MAX_SPREAD = 1.5  # a sampler's slowest / fastest timed run beyond which nothing is concluded


@torch.inference_mode()
def plain_decoder(model, prompt, new_tokens: int, temperature=0.0, top_p=1.0, generator=None):
    """The peer a user would pick instead: a causal decoder with a KV cache on the same network
    and cache, the prompt (B, P) in one causal call, then one token a call. For timing only:
    a set model predicts from MASK queries, not from the last token."""
    cfg = model.cfg
    device = next(model.parameters()).device
    B, P = prompt.shape
    start = time.perf_counter()
    cache = setdiff.KVCache(cfg, B, P + new_tokens, max_call=P, device=device)
    rows = torch.cat([prompt.to(device), prompt.new_zeros(B, new_tokens).to(device)], 1)
    causal = torch.ones(P, P, dtype=torch.bool, device=device).tril()
    attn = torch.cat([cache.filled[:, None].expand(B, P, -1), causal.expand(B, P, P)], 2)
    positions = torch.arange(P, device=device).expand(B, P)
    for t in range(P - 1, P - 1 + new_tokens):  # token t is stored at slot t
        h = model.run(rows[:, positions[0]], positions, attn, cache)  # (B, n, D)
        cache.store(positions, torch.ones_like(positions, dtype=torch.bool))
        token, _ = setdiff.draw_candidates(model.logits(h[:, -1:]), temperature, top_p, generator)
        rows[:, t + 1] = token[:, 0]
        positions = torch.full((B, 1), t + 1, device=device)
        attn = torch.cat([cache.filled, positions.new_ones(B, 1, dtype=torch.bool)], 1)[:, None]
    setdiff.synchronize(device)
    reveal_step = torch.arange(-P, new_tokens).clamp(min=-1).expand(B, -1)  # call t: P + t
    steps = torch.full((B,), new_tokens)
    return setdiff.Generation(rows, reveal_step, new_tokens, steps, time.perf_counter() - start)


def variants(cfg: setdiff.Config, sampling: dict) -> dict:
    """Sampler name -> generate() options; the first two are greedy, with and without cache."""
    w_max = setdiff.max_window(cfg)
    w4 = min(4, w_max)
    greedy = dict(window=w4, temperature=0)
    out = {f"cached, w={w4}": greedy, f"cache-free, w={w4}": greedy | dict(use_cache=False)}
    for name, w in {"d": min(cfg.set_size, w_max), "s": w_max}.items():
        for tau in THRESHOLDS:
            out[f"w={name}={w}, tau={tau:g}"] = dict(window=w, threshold=tau, **sampling)
    return out


def cache_is_exact(model, batch_size: int, window: int) -> bool:
    """Cached and cache-free greedy sampling give the same tokens and reveal steps, checked on
    a float64 copy (outside autocast): in float32 a near-tie of two candidates can flip one
    reveal, as seen on a weakly trained checkpoint, a false alarm about the cache."""
    exact = copy.deepcopy(model).double()
    if next(exact.parameters()).device.type == "mps":  # MPS has no float64
        exact = exact.cpu()
    greedy = dict(batch_size=batch_size, window=window, temperature=0)
    cached = setdiff.generate(exact, **greedy)
    free = setdiff.generate(exact, use_cache=False, **greedy)
    same_tokens = torch.equal(cached.tokens, free.tokens)
    return same_tokens and torch.equal(cached.reveal_step, free.reveal_step)


def timed_rounds(model, samplers: dict, sizes: list, repeats: int, plain: dict) -> dict:
    """(sampler, batch size) -> (tokens per call, tokens/s of the median run, slowest/fastest).
    Round 0 only warms up (allocation, kernel choice); a burst of load from elsewhere then
    slows one run of every sampler a little, and the median discards it."""
    keys = [(name, B) for B in sizes for name in [PLAIN, *samplers]]
    L = model.cfg.seq_len
    seconds = {key: [] for key in keys}
    last = {}
    for r in tqdm(range(repeats + 1), desc="bench rounds", leave=False):
        round_start = time.perf_counter()
        for name, B in keys:
            g = torch.Generator().manual_seed(0)  # fresh: every round draws the same tokens
            if name == PLAIN:  # from the token generate() starts a row with
                first = model.cfg.eos_id if model.cfg.bos_id is None else model.cfg.bos_id
                prompt = torch.full((B, 1), first)
                last[name, B] = plain_decoder(model, prompt, L - 1, generator=g, **plain)
            else:
                last[name, B] = setdiff.generate(model, batch_size=B, generator=g, **samplers[name])
            seconds[name, B].append(last[name, B].seconds)
        if r == 0:
            rest = (time.perf_counter() - round_start) * repeats
            tqdm.write(f"warm-up round done: the {repeats} timed rounds take about {rest:.0f} s")
    timings = {}
    for key, (_, *timed) in seconds.items():
        speed = int(last[key].new_tokens.sum()) / statistics.median(timed)
        timings[key] = (last[key].tokens_per_step, speed, max(timed) / min(timed))
    return timings


def conclusions(B: int, samplers: dict, timings: dict) -> list:
    """What the table shows at batch size B: the cache's speed-up, and from which threshold
    (tau descends: tokens per call grow) each window overtakes the plain decoder; a warning
    instead where the repeats of a sampler that a line rests on disagree."""
    cached, free = list(samplers)[:2]
    groups = {"greedy": [cached, free]}
    for w in ("d", "s"):
        names = [name for name in samplers if name.startswith(f"w={w}=")]
        groups[names[0].split(", ")[0]] = names  # "w=d=4": the window's name and size
    lines = []
    for label, names in groups.items():
        tpc = {name: timings[name, B][0] for name in [PLAIN, *names]}
        speed = {name: timings[name, B][1] for name in tpc}
        worst = max(timings[name, B][2] for name in tpc)
        first = next((name for name in names if speed[name] > speed[PLAIN]), None)
        if worst > MAX_SPREAD:
            text = f"the repeats disagree (slowest/fastest {worst:.2f} > {MAX_SPREAD}): nothing "
            text += "to conclude; rerun on an idle machine or with more --repeats"
        elif label == "greedy":
            text = f"the KV cache runs at {speed[cached] / speed[free]:.2f}x the cache-free speed"
        elif first is None:
            text = "the plain decoder is faster at every threshold"
        else:
            text = f"the set sampler overtakes the plain decoder at {first.split(', ')[1]}, "
            text += f"{tpc[first]:.2f} tokens/call ({speed[first] / speed[PLAIN]:.2f}x)"
        lines.append(f"batch {B}, {label}: {text}")
    return lines


def bench(args, command: str) -> None:
    device, dtype, how = setdiff.runtime(args.device, args.dtype, args.threads)
    print(f"# experiments/bench.py\ncommand: {command}\ntorch {torch.__version__}\n{how}")
    setdiff.require(min(args.batch_sizes + [args.repeats]) >= 1, "--repeats, --batch-sizes >= 1")
    model = setdiff.load_checkpoint(args.ckpt, device)[0].eval()
    sampling = dict(temperature=args.temperature, top_p=args.top_p)  # of the plain and tau rows
    setdiff.sampler_window(model.cfg, None, 1.0, **sampling)  # checked before the plain decoder
    samplers = variants(model.cfg, sampling)
    sizes = args.batch_sizes
    print(f"{len(samplers) + 1} samplers x batch sizes {sizes}: a warm-up + {args.repeats} rounds")
    with setdiff.autocast(device, dtype):
        timings = timed_rounds(model, samplers, sizes, args.repeats, sampling)
    exact = cache_is_exact(model, sizes[-1], samplers[next(iter(samplers))]["window"])
    note = f"temperature {args.temperature:g}, top-p {args.top_p:g}"
    print(f"{model.cfg.seq_len - 1} new tokens a row; plain and tau rows: {note}")
    print(f"\n## Sampler speed (median of {args.repeats} interleaved runs after a warm-up)\n")
    cells = [f"batch {B} tokens/call | batch {B} tokens/s" for B in sizes]
    print(f"| sampler | {' | '.join(cells)} | tokens/s {sizes[-1]} over {sizes[0]} |")
    print("|---" * (2 * len(sizes) + 2) + "|")
    for name in [PLAIN, *samplers]:
        row = [timings[name, B] for B in sizes]
        cells = [f"{tpc:.2f} | {speed:,.0f}" for tpc, speed, _ in row]
        print(f"| {name} | {' | '.join(cells)} | {row[-1][1] / row[0][1]:.2f}x |")
    print(f"\ncached = cache-free (greedy, float64, batch {sizes[-1]}): {'yes' if exact else 'NO'}")
    for B in sizes:
        print("\n".join(conclusions(B, samplers, timings)))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = p.add_argument
    add("--ckpt", required=True, help="train_small.py's checkpoint, or a released model's folder")
    add("--repeats", type=int, default=3, metavar="N", help="timed rounds after the warm-up (3)")
    add("--batch-sizes", type=int, nargs="+", default=[1, 16], metavar="B", help="(1 16)")
    add("--temperature", type=float, default=1.0, help="of the plain and tau rows (1)")
    add("--top-p", type=float, default=1.0, help="of the plain and tau rows (1: off)")
    add("--device", help="cpu, cuda, cuda:N or mps (default: the first of cuda, mps, cpu)")
    add("--dtype", choices=["auto", "float32", "bfloat16"], default="auto", help="autocast (auto)")
    add("--threads", type=int, help="CPU threads (default: the cores other work leaves idle)")
    args = p.parse_args(argv)
    try:
        bench(args, shlex.join(["python", "experiments/bench.py", *argv]))
    except (ValueError, OSError) as e:  # setdiff raises ValueError for bad input
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
