"""Each checkpoint's bound on the judge's validation rows, then its samples' quality against
speed: judged by the exact NLL of an AR model of the same data, which alone rewards repetitive
text, so unigram entropy and distinct 4-grams stand beside it. --json: plot.py's data.

    python experiments/compare.py runs/{ar,block-d4}/ckpt.pt --judge runs/ar/ckpt.pt --json c.json
"""

import argparse
import filecmp
import json
import math
import os
import shlex
import sys
from pathlib import Path

import numpy as np
import torch

# `python experiments/compare.py` puts experiments/ on the path, not the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import setdiff  # noqa: E402
from setdiff import require  # noqa: E402

THRESHOLDS = (math.inf, 0.9, 0.7, 0.5, 0.3, 0.2, 0.1, 0.05)


def policy(cfg: setdiff.Config) -> str:
    """A model's name in the tables."""
    if cfg.order == "staggered":
        return f"staggered d={cfg.set_size}, s={cfg.max_set_size}"
    if cfg.order == "block":
        return f"block d={cfg.set_size}"
    return cfg.order


def text_stats(judge, rows: torch.Tensor) -> dict:
    """Of rows (n, L), position 0 left out: NLL under the AR judge (nats/token; for the identity
    order the bound is exact), unigram entropy (bits), share of distinct 4-grams inside rows."""
    counts = torch.bincount(rows[:, 1:].flatten()).double()
    p = counts[counts > 0] / counts.sum()
    grams = rows[:, 1:].unfold(1, 4, 1).reshape(-1, 4)  # (n (L - 4), 4)
    return dict(
        judge_nll=setdiff.elbo(judge, rows).nll_per_token,
        unigram_entropy=float(-(p * p.log2()).sum()),
        distinct_4grams=len(torch.unique(grams, dim=0)) / max(len(grams), 1),
    )


def scores(model, judge, rows, bytes_per_token: float, args) -> tuple:
    """A model's bound on the first --eval-rows rows, then its samples at every window (d and
    the largest) and threshold, judged."""
    cfg = model.cfg
    x = torch.from_numpy(np.asarray(rows[: args.eval_rows or len(rows)], dtype=np.int64))
    g = torch.Generator().manual_seed(args.seed)
    res = setdiff.elbo(model, x, args.num_orders, 32, g, progress=True)
    # bits per byte count the source text: with BOS L - 2 tokens a row (BOS and the row's
    # closing EOS are no text), without BOS L - 1 (position 0 is given)
    text = cfg.seq_len - 2 if cfg.bos_id is not None else cfg.seq_len - 1
    num_bytes = round(len(x) * text * bytes_per_token)
    bound = res.metrics(num_bytes)
    samples = []
    sampling = dict(temperature=args.temperature, top_p=args.top_p)
    w_max = setdiff.max_window(cfg)
    for window in sorted({min(cfg.set_size, w_max) if cfg.order != "uniform" else w_max, w_max}):
        for tau in THRESHOLDS if window > 1 else THRESHOLDS[:1]:  # w = 1: one token a call
            g = torch.Generator().manual_seed(args.seed)
            opts = dict(window=window, threshold=tau, generator=g, **sampling)
            out = setdiff.generate(model, batch_size=args.samples, **opts)
            row = dict(model=policy(cfg), window=window, threshold=None if tau > 1 else tau)
            row |= dict(tokens_per_call=out.tokens_per_step, seconds=out.seconds)
            samples.append(row | text_stats(judge, out.tokens.cpu()))
    return bound, samples


def compare(args, command: str, device) -> dict:
    judge, tok, jckpt = setdiff.load_checkpoint(args.judge, device)
    require(judge.cfg.order == "ar", f"--judge {args.judge} must be an --order ar checkpoint")
    val = jckpt.get("val_rows") or {}
    ok = os.path.isfile(str(val.get("path")))
    require(ok, f"--judge {args.judge} records no validation rows (a train_small.py checkpoint)")
    for path in args.ckpt:  # every check before the work
        _, mtok, ckpt = setdiff.load_checkpoint(path, "cpu")
        mine = str((ckpt.get("val_rows") or {}).get("path"))  # the same rows, in any cache
        same = os.path.isfile(mine) and filecmp.cmp(mine, val["path"], shallow=False)
        same = same and mtok.spec() == tok.spec()
        require(same, f"{path} was not trained on the data and tokenizer of the judge {args.judge}")
    shape = (val["rows"], judge.cfg.seq_len)
    rows = np.memmap(val["path"], dtype=np.uint16, mode="r", shape=shape)
    # what text looks like, as the samples' reference
    real = torch.from_numpy(np.asarray(rows[: args.samples], dtype=np.int64))
    res = dict(command=command, validation=text_stats(judge.eval(), real), bounds=[], samples=[])
    print(f"command: {command}\nvalidation rows: {json.dumps(res['validation'])}")
    for path in args.ckpt:
        model, _, ckpt = setdiff.load_checkpoint(path, device)
        print(f"model: {path}, {policy(model.cfg)}", flush=True)
        bound, samples = scores(model.eval(), judge, rows, val["bytes_per_token"], args)
        res["bounds"].append(
            dict(model=policy(model.cfg), ckpt=str(path), step=ckpt.get("step")) | bound
        )
        res["samples"] += samples
    return res


def print_tables(res: dict, args) -> None:
    first = res["bounds"][0]
    print(f"\n## Validation bound ({first['num_seqs']:,} rows, K={first['num_orders']} orders)\n")
    print("| model | val ppl bound | nats/token +- se | bits/byte | tokens scored |")
    print("|---" * 5 + "|")
    for b in res["bounds"]:
        cells = [b["model"], f"{b['ppl']:.3f}", f"{b['nll_per_token']:.4f} +- {b['se']:.4f}"]
        print("| " + " | ".join(cells) + f" | {b['bits_per_byte']:.3f} | {b['tokens_scored']:,} |")
    sampling = f"temperature {args.temperature:g}, top-p {args.top_p:g}"
    print(f"\n## {args.samples} unconditional samples ({sampling})\n")
    header = "| model | window | threshold | tokens/call | judged NLL (nats/token) | unigram "
    print(header + "entropy (bits) | distinct 4-grams | seconds |\n" + "|---" * 8 + "|")
    for r in res["samples"]:
        cells = [r["model"], r["window"], r["threshold"] or ">1", f"{r['tokens_per_call']:.2f}"]
        cells += [f"{r['judge_nll']:.3f}", f"{r['unigram_entropy']:.2f}"]
        cells += [f"{r['distinct_4grams']:.3f}", f"{r['seconds']:.1f}"]
        print("| " + " | ".join(map(str, cells)) + " |")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("ckpt", nargs="+", metavar="CKPT", help="checkpoints of train_small.py to compare")
    add("--judge", required=True, metavar="CKPT", help="an ar checkpoint of the same data")
    add("--samples", type=int, default=64, metavar="N", help="samples a window and threshold (64)")
    add("--num-orders", type=int, default=4, metavar="K", help="decode orders a row (4)")
    add("--eval-rows", type=int, default=0, metavar="N", help="score the first N rows (0: all)")
    add("--temperature", type=float, default=1.0, help="of the samples (1)")
    add("--top-p", type=float, default=1.0, help="of the samples (1: the model's own distribution)")
    add("--seed", type=int, default=0, help="seed of the samples and the orders (0)")
    add("--json", metavar="PATH", help="also write the results here (for experiments/plot.py)")
    add("--device", help="cpu, cuda, cuda:N or mps (default: the first of cuda, mps, cpu)")
    add("--dtype", choices=["auto", "float32", "bfloat16"], default="auto", help="autocast (auto)")
    add("--threads", type=int, help="CPU threads (default: the cores other work leaves idle)")
    args = p.parse_args(argv)
    try:
        folder = Path(args.json or "x").resolve().parent  # checked before the work
        require(folder.is_dir(), f"--json {args.json}: its folder does not exist")
        require(min(args.samples, args.num_orders) >= 1, "--samples, --num-orders: >= 1")
        device, dtype, how = setdiff.runtime(args.device, args.dtype, args.threads)
        print(how)
        with setdiff.autocast(device, dtype):
            res = compare(args, shlex.join(["python", "experiments/compare.py", *argv]), device)
        print_tables(res, args)
        if args.json:  # a temporary file, then rename: a failed write keeps the old file
            Path(args.json + ".tmp").write_text(json.dumps(res, indent=1) + "\n")
            os.replace(args.json + ".tmp", args.json)
    except (ValueError, OSError) as e:  # setdiff raises ValueError for bad input
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
