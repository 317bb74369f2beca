"""The paper's infilling claim at CPU scale. On the same 8-token spans of the same validation rows
for every model: the span's bound given both sides and given its left side only (the row cut
right after the span); their difference G = left - both is what a model gets from right
context. Then greedy fills by the authors' protocol (all context cached first, one token a step,
the policy's largest window; AR sees the left side only), scored by byte accuracy, exact match
and an AR judge's NLL of the text after the span.

    python experiments/infill.py runs/{ar,block-d4,staggered-d4}/ckpt.pt --judge runs/ar/ckpt.pt
"""

import argparse
import filecmp
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

# `python experiments/infill.py` puts experiments/ on the path, not the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import setdiff  # noqa: E402
from setdiff import require  # noqa: E402

SPAN = 8  # tokens to fill
FIRST = 56  # spans start at 56..59 in turn: every phase of a d = 4 block equally often


def pick_spans(rows: np.ndarray, n: int, eos: int) -> tuple:
    """The first n rows whose span (and 2 tokens either side) holds no sentence break ->
    (rows (n, L) long, span starts (n,))."""
    picked, starts = [], []
    for i in range(len(rows)):
        start = FIRST + len(picked) % 4
        if eos not in rows[i, start - 2 : start + SPAN + 2]:
            picked.append(i)
            starts.append(start)
        if len(picked) == n:
            break
    require(len(picked) == n, f"only {len(picked)} validation rows have a span away from EOS")
    return torch.from_numpy(rows[picked].astype(np.int64)), torch.tensor(starts)


def regions(x: torch.Tensor, starts: torch.Tensor) -> tuple:
    """(n, L) masks of each row's left side, span and right side."""
    pos = torch.arange(x.shape[1])[None, :]
    left = pos < starts[:, None]
    right = pos >= starts[:, None] + SPAN
    return left, ~left & ~right, right


def span_bounds(model, x, starts, args) -> dict:
    """The span's bound (nats/token, +- se) given both sides, and given the left side only."""
    left, span, right = regions(x, starts)
    cut = x.masked_fill(right, model.cfg.pad_id)  # the row cut right after the span
    out = {}
    for side, rows, given in [("both", x, ~span), ("left", cut, left)]:
        g = torch.Generator().manual_seed(args.seed)
        res = setdiff.elbo(model, rows, args.num_orders, 64, g, given=given)
        assert res.tokens_scored == SPAN * len(x)  # the span is scored, and nothing else
        out[side] = res.nll_per_token
        out[side + "_se"] = res.se
    out["gain"] = out["left"] - out["both"]  # what the right context is worth
    return out


def fill(model, x, starts) -> torch.Tensor:
    """Greedy fills (n, SPAN), one token a step from the largest window, the context cached
    first; AR continues the left side (its training orders never show it right context)."""
    cfg = model.cfg
    _, span, _ = regions(x, starts)
    if cfg.order != "ar":
        canvas = x.masked_fill(span, cfg.mask_id)
        out = setdiff.generate(model, infill=canvas, window=setdiff.max_window(cfg), temperature=0)
        return out.tokens.cpu()[span].view(len(x), SPAN)
    fills = torch.empty(len(x), SPAN, dtype=torch.long)
    for start in starts.unique().tolist():  # the prompts of one length at a time
        rows = starts == start
        out = setdiff.generate(model, prompt=x[rows, :start], max_new_tokens=SPAN, temperature=0)
        fills[rows] = out.tokens.cpu()[:, start:]
    return fills


def judged_suffix(judge, x, starts, fills) -> float:
    """The AR judge's NLL (nats/token) of the text after the span, given all before it."""
    _, span, right = regions(x, starts)
    filled = x.masked_scatter(span, fills)
    return setdiff.elbo(judge, filled, 1, 64, given=~right).nll_per_token


def evaluate(args, device) -> dict:
    judge, tok, jckpt = setdiff.load_checkpoint(args.judge, device)
    require(judge.cfg.order == "ar", f"--judge {args.judge} must be an --order ar checkpoint")
    val = jckpt.get("val_rows") or {}
    require(
        os.path.isfile(str(val.get("path"))), f"--judge {args.judge} records no validation rows"
    )
    rows = np.memmap(val["path"], dtype=np.uint16, mode="r", shape=(val["rows"], judge.cfg.seq_len))
    x, starts = pick_spans(rows, args.rows, tok.eos_id)
    truth = x[regions(x, starts)[1]].view(-1, SPAN)  # (n, SPAN)
    res = dict(true_span_judged=judged_suffix(judge.eval(), x, starts, truth), models=[])
    for path in args.ckpt:
        model, mtok, ckpt = setdiff.load_checkpoint(path, device)
        mine = str((ckpt.get("val_rows") or {}).get("path"))  # the same rows, in any cache
        same = os.path.isfile(mine) and filecmp.cmp(mine, val["path"], shallow=False)
        same = same and mtok.spec() == tok.spec()
        require(same, f"{path} was not trained on the data and tokenizer of the judge {args.judge}")
        print(f"model: {path}, {model.cfg.order}", flush=True)
        fills = fill(model.eval(), x, starts)
        hits = fills == truth
        row = dict(model=name(model.cfg), ckpt=str(path)) | span_bounds(model, x, starts, args)
        row |= dict(
            byte_accuracy=hits.double().mean().item(), exact=hits.all(1).double().mean().item()
        )
        res["models"].append(row | dict(judged_suffix=judged_suffix(judge, x, starts, fills)))
    return res


def name(cfg) -> str:
    if cfg.order == "staggered":
        return f"staggered d={cfg.set_size}, s={cfg.max_set_size}"
    return f"block d={cfg.set_size}" if cfg.order == "block" else cfg.order


def print_table(res: dict, args) -> None:
    orders = f"K={args.num_orders} orders a span"
    print(f"\n## Infilling {args.rows} spans of {SPAN} tokens (bounds in nats/token, {orders})\n")
    head = "| model | bound, both sides | bound, left side | G = left - both | byte accuracy "
    print(head + "| exact span | judged NLL after the span |\n" + "|---" * 7 + "|")
    for r in res["models"]:
        cells = [r["model"], f"{r['both']:.3f} +- {r['both_se']:.3f}"]
        cells += [f"{r['left']:.3f} +- {r['left_se']:.3f}", f"{r['gain']:.3f}"]
        cells += [f"{r['byte_accuracy']:.3f}", f"{r['exact']:.3f}", f"{r['judged_suffix']:.3f}"]
        print("| " + " | ".join(cells) + " |")
    print(f"\nthe true span: judged NLL after it {res['true_span_judged']:.3f} (nats/token)")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("ckpt", nargs="+", metavar="CKPT", help="checkpoints of train_small.py")
    add("--judge", required=True, metavar="CKPT", help="an ar checkpoint of the same data")
    add("--rows", type=int, default=512, help="spans, one a validation row (512)")
    add("--num-orders", type=int, default=4, metavar="K", help="decode orders a span (4)")
    add("--seed", type=int, default=0, help="seed of the orders (0)")
    add("--json", metavar="PATH", help="also write the results here")
    add("--device", help="cpu, cuda, cuda:N or mps (default: the first available)")
    add("--threads", type=int, help="CPU threads (default: the cores other work leaves idle)")
    args = p.parse_args(argv)
    try:
        folder = Path(args.json or "x").resolve().parent  # checked before the work
        require(folder.is_dir(), f"--json {args.json}: its folder does not exist")
        require(min(args.rows, args.num_orders) >= 1, "--rows and --num-orders must be at least 1")
        device, _, how = setdiff.runtime(args.device, "float32", args.threads)
        print(how)
        res = evaluate(args, device)
        print_table(res, args)
        if args.json:  # a temporary file, then rename: a failed write keeps the old file
            Path(args.json + ".tmp").write_text(json.dumps(res, indent=1) + "\n")
            os.replace(args.json + ".tmp", args.json)
    except (ValueError, OSError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
