"""The paper's infilling claim at CPU scale. On the same 8-token spans of the same validation rows
for every model: the span's bound given both sides and given its left side only (the row cut
right after the span); their difference G = left - both is what a model gets from right
context. Then greedy fills by the authors' protocol (all context cached first, one token a call,
the policy's largest window: the default infill window; AR sees the left side only), with each
--repetition-penalty, scored by byte accuracy, exact match, an AR judge's NLL of the text after
the span and the share of filled bytes that repeat the byte before them (a model-free measure).

    python experiments/infill.py runs/{ar,block-d4,staggered-d4}/ckpt.pt --judge runs/ar/ckpt.pt
"""

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

# `python experiments/infill.py` puts experiments/ on the path, not the repository root
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from compare import setup, shared_flags, validation_rows, write_json  # noqa: E402  (the judge and its rows)

import setdiff  # noqa: E402
from setdiff import require  # noqa: E402

SPAN = 8  # tokens to fill
FIRST = 56  # spans start at 56..59 in turn: every phase of a d = 4 block equally often


def pick_spans(rows, n, eos):
    """The first n rows whose span (and 2 tokens either side) holds no sentence break ->
    (rows (n, L) long, span starts (n,))."""
    picked = []
    starts = []
    for i in range(len(rows)):
        start = FIRST + len(picked) % 4
        near = rows[i, start - 2 : start + SPAN + 2]
        if eos not in near:
            picked.append(i)
            starts.append(start)
        if len(picked) == n:
            break
    found = len(picked)
    require(found == n, f"only {found} validation rows have a span away from EOS")
    x = rows[picked].astype(np.int64)
    return torch.from_numpy(x), torch.tensor(starts)


def regions(x, starts):
    """(n, L) masks of each row's left side, span and right side."""
    pos = torch.arange(x.shape[1])[None, :]
    start = starts[:, None]
    left = pos < start
    right = pos >= start + SPAN
    span = ~left & ~right
    return left, span, right


def span_bounds(model, x, starts, args):
    """The span's bound (nats/token, +- se) given both sides, and given the left side only."""
    left, span, right = regions(x, starts)
    cut = x.masked_fill(right, model.cfg.pad_id)  # the row cut right after the span
    out = {}
    for side, rows, given in [("both", x, ~span), ("left", cut, left)]:
        g = torch.Generator().manual_seed(args.seed)
        K = args.num_orders
        res = setdiff.elbo(model, rows, K, 64, g, given=given)
        assert res.tokens_scored == SPAN * len(x)  # the span is scored, and nothing else
        out[side] = res.nll_per_token
        out[side + "_se"] = res.se
    out["gain"] = out["left"] - out["both"]  # what the right context is worth
    return out


def fill(model, x, starts, repetition_penalty):
    """Greedy fills (n, SPAN), one token a call from the largest window, the context cached
    first; AR continues the left side (its training orders never show it right context)."""
    cfg = model.cfg
    _, span, _ = regions(x, starts)
    n = len(x)
    greedy = dict(temperature=0, repetition_penalty=repetition_penalty)
    if cfg.order != "ar":
        holes = x.masked_fill(span, cfg.mask_id)
        w = setdiff.max_window(cfg)
        out = setdiff.generate(model, infill=holes, window=w, **greedy)
        filled = out.tokens.cpu()
        return filled[span].view(n, SPAN)
    fills = torch.empty(n, SPAN, dtype=torch.long)
    for start in starts.unique().tolist():  # the prompts of one length at a time
        rows = starts == start
        prompt = x[rows, :start]
        out = setdiff.generate(model, prompt=prompt, max_new_tokens=SPAN, **greedy)
        fills[rows] = out.tokens.cpu()[:, start:]
    return fills


def repeats(x, starts, fills):
    """The share of the span's tokens equal to the token before them (greedy decoding's stutter:
    "aaaa", "    ")."""
    _, span, _ = regions(x, starts)
    filled = x.masked_scatter(span, fills)
    same = filled[:, 1:] == filled[:, :-1]  # (n, L - 1): token t equals token t - 1
    same = same[span[:, 1:]].double()
    return same.mean().item()


def judged_suffix(judge, x, starts, fills):
    """The AR judge's NLL (nats/token) of the text after the span, given all before it."""
    _, span, right = regions(x, starts)
    filled = x.masked_scatter(span, fills)
    res = setdiff.elbo(judge, filled, 1, 64, given=~right)
    return res.nll_per_token


def evaluate(args, device):
    judge, tok, rows, _ = validation_rows(args, device)  # every run checked first
    x, starts = pick_spans(rows, args.rows, tok.eos_id)
    _, span, _ = regions(x, starts)
    truth = x[span].view(-1, SPAN)  # (n, SPAN)
    true_span = judged_suffix(judge, x, starts, truth)
    stutter = repeats(x, starts, truth)
    res = dict(true_span_judged=true_span, true_span_repeats=stutter)
    res["models"] = []
    for path in args.ckpt:
        model, _, _ = setdiff.load_checkpoint(path, device)
        model.eval()
        pad = model.cfg.pad_id  # span_bounds cuts a row after its span with PAD
        no_pad = f"{path} has no PAD, which infill.py needs to cut a row after its span"
        require(pad is not None, no_pad)
        name = setdiff.policy_name(model.cfg)
        print(f"model: {path}, {name}", flush=True)
        bounds = span_bounds(model, x, starts, args)
        for penalty in args.repetition_penalty:
            fills = fill(model, x, starts, penalty)
            hits = fills == truth
            row = dict(model=name, ckpt=path, repetition_penalty=penalty) | bounds
            row["byte_accuracy"] = hits.double().mean().item()
            exact = hits.all(1).double()
            row["exact"] = exact.mean().item()
            row["judged_suffix"] = judged_suffix(judge, x, starts, fills)
            row["repeats"] = repeats(x, starts, fills)
            res["models"].append(row)
    return res


def print_table(res, args):
    orders = f"K={args.num_orders} orders a span"
    print(f"\n## Infilling {args.rows} spans of {SPAN} tokens (bounds in nats/token, {orders})\n")
    head = "| model | bound, both sides | bound, left side | G = left - both | penalty | byte "
    print(head + "accuracy | exact span | judged NLL after the span | repeats |")
    print("|---" * 9 + "|")
    for r in res["models"]:
        both = f"{r['both']:.3f} +- {r['both_se']:.3f}"
        left = f"{r['left']:.3f} +- {r['left_se']:.3f}"
        cells = [r["model"], both, left, f"{r['gain']:.3f}", f"{r['repetition_penalty']:g}"]
        cells += [f"{r['byte_accuracy']:.3f}", f"{r['exact']:.3f}", f"{r['judged_suffix']:.3f}"]
        line = " | ".join(cells + [f"{r['repeats']:.3f}"])
        print(f"| {line} |")
    judged = f"judged NLL after it {res['true_span_judged']:.3f} (nats/token)"
    print(f"\nthe true span: {judged}, repeats {res['true_span_repeats']:.3f}")


def main(argv=None):
    summary = __doc__.split("\n\n")[0]
    p = argparse.ArgumentParser(description=summary)
    add = p.add_argument
    add("ckpt", nargs="+", metavar="CKPT", help="checkpoints of train_small.py")
    add("--judge", required=True, metavar="CKPT", help="an ar checkpoint of the same data")
    add("--rows", type=int, default=512, help="spans, one a validation row (512)")
    add("--num-orders", type=int, default=4, metavar="K", help="decode orders a span (4)")
    add("--seed", type=int, default=0, help="seed of the orders (0)")
    penalty = "of the fills, each in turn; 1 = off, the authors' infill table: 1.2 (1 1.2)"
    add("--repetition-penalty", type=float, nargs="+", default=[1.0, 1.2], help=penalty)
    shared_flags(add)
    args = p.parse_args(argv)
    try:
        smallest = min(args.rows, args.num_orders)
        require(smallest >= 1, "--rows and --num-orders must be at least 1")
        device, _ = setup(args)
        res = evaluate(args, device)
        print_table(res, args)
        if args.json:
            write_json(args.json, res)
    except (ValueError, OSError) as e:  # setdiff raises ValueError for bad input
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
