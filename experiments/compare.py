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
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import setdiff  # noqa: E402
from setdiff import require  # noqa: E402

THRESHOLDS = (math.inf, 0.9, 0.7, 0.5, 0.3, 0.2, 0.1, 0.05)


def text_stats(judge, rows):
    """Of rows (n, L), position 0 left out: NLL under the AR judge (nats/token; for the identity
    order the bound is exact), unigram entropy (bits), share of distinct 4-grams inside rows."""
    text = rows[:, 1:]
    counts = torch.bincount(text.flatten()).double()
    counts = counts[counts > 0]
    p = counts / counts.sum()
    entropy = -(p * p.log2()).sum()
    grams = text.unfold(1, 4, 1).reshape(-1, 4)  # (n (L - 4), 4)
    distinct = len(torch.unique(grams, dim=0))
    judged = setdiff.elbo(judge, rows)
    return dict(
        judge_nll=judged.nll_per_token,
        unigram_entropy=float(entropy),
        distinct_4grams=distinct / max(len(grams), 1),
    )


def bound(model, x, bytes_per_token, args):
    """The bound on rows x with --num-orders orders a row (drawn from --seed); bits per byte
    count the source text a whole row scores."""
    g = torch.Generator().manual_seed(args.seed)
    K = args.num_orders
    res = setdiff.elbo(model, x, K, 32, g, progress=True)
    text = len(x) * setdiff.text_per_row(model.cfg)  # tokens
    num_bytes = round(text * bytes_per_token)
    return res.metrics(num_bytes)


def samples(model, judge, args):
    """--samples rows at every window (d and the largest) and threshold, judged; w = 1 has
    one threshold (one token a call)."""
    cfg = model.cfg
    name = setdiff.policy_name(cfg)
    windows = {setdiff.default_window(cfg), setdiff.max_window(cfg)}
    out = []
    for window in sorted(windows):
        thresholds = THRESHOLDS if window > 1 else THRESHOLDS[:1]
        for tau in thresholds:
            g = torch.Generator().manual_seed(args.seed)
            gen = setdiff.generate(
                model,
                batch_size=args.samples,
                window=window,
                threshold=tau,
                temperature=args.temperature,
                top_p=args.top_p,
                generator=g,
            )
            threshold = None if tau > 1 else tau
            row = dict(model=name, window=window, threshold=threshold)
            row["tokens_per_call"] = gen.tokens_per_call
            row["seconds"] = gen.seconds
            stats = text_stats(judge, gen.tokens.cpu())
            out.append(row | stats)
    return out


def validation_rows(args, device):
    """The judge and its validation rows (a memmap), after checking that every checkpoint
    was trained on them with the judge's tokenizer: every check before the work."""
    judge, tok, ckpt = setdiff.load_checkpoint(args.judge, device)
    is_ar = judge.cfg.order == "ar"
    require(is_ar, f"--judge {args.judge} must be an --order ar checkpoint")
    val = ckpt.get("val_rows") or {}
    val_path = str(val.get("path"))
    ok = os.path.isfile(val_path)
    require(ok, f"--judge {args.judge} records no validation rows (a train_small.py checkpoint)")
    for path in args.ckpt:
        _, mine, ckpt = setdiff.load_checkpoint(path, "cpu")
        rows = ckpt.get("val_rows") or {}
        rows = str(rows.get("path"))  # the same rows, in any cache
        same = os.path.isfile(rows) and filecmp.cmp(rows, val_path, shallow=False)
        same = same and mine.spec() == tok.spec()
        require(same, f"{path} was not trained on the data and tokenizer of the judge {args.judge}")
    shape = (val["rows"], judge.cfg.seq_len)
    rows = np.memmap(val_path, dtype=np.uint16, mode="r", shape=shape)
    judge.eval()
    return judge, tok, rows, val["bytes_per_token"]


def compare(args, command, device):
    judge, _, rows, bytes_per_token = validation_rows(args, device)
    # what text looks like, as the samples' reference
    real = rows[: args.samples].astype(np.int64)
    real = torch.from_numpy(real)
    validation = text_stats(judge, real)
    res = dict(command=command, validation=validation)
    res["bounds"] = []
    res["samples"] = []
    print(f"command: {command}\nvalidation rows: {json.dumps(validation)}")
    n = args.eval_rows or len(rows)
    x = rows[:n].astype(np.int64)
    x = torch.from_numpy(x)
    for path in args.ckpt:
        model, _, ckpt = setdiff.load_checkpoint(path, device)
        model.eval()
        name = setdiff.policy_name(model.cfg)
        print(f"model: {path}, {name}", flush=True)
        step = ckpt.get("step")
        row = dict(model=name, ckpt=str(path), step=step)
        row |= bound(model, x, bytes_per_token, args)
        res["bounds"].append(row)
        res["samples"] += samples(model, judge, args)
    return res


def print_tables(res, args):
    first = res["bounds"][0]
    print(f"\n## Validation bound ({first['num_seqs']:,} rows, K={first['num_orders']} orders)\n")
    print("| model | val ppl bound | nats/token +- se | bits/byte | tokens scored |")
    print("|---" * 5 + "|")
    for b in res["bounds"]:
        nll = f"{b['nll_per_token']:.4f} +- {b['se']:.4f}"
        cells = [b["model"], f"{b['ppl']:.3f}", nll]
        cells += [f"{b['bits_per_byte']:.3f}", f"{b['tokens_scored']:,}"]
        line = " | ".join(cells)
        print(f"| {line} |")
    sampling = f"temperature {args.temperature:g}, top-p {args.top_p:g}"
    print(f"\n## {args.samples} unconditional samples ({sampling})\n")
    head = "| model | window | threshold | tokens/call | judged NLL (nats/token) | unigram "
    print(head + "entropy (bits) | distinct 4-grams | seconds |")
    print("|---" * 8 + "|")
    for r in res["samples"]:
        threshold = r["threshold"] or ">1"
        cells = [r["model"], r["window"], threshold, f"{r['tokens_per_call']:.2f}"]
        cells += [f"{r['judge_nll']:.3f}", f"{r['unigram_entropy']:.2f}"]
        cells += [f"{r['distinct_4grams']:.3f}", f"{r['seconds']:.1f}"]
        line = " | ".join(map(str, cells))
        print(f"| {line} |")


def write_json(path, data):
    """A temporary file, then rename: a failed write keeps the old file."""
    text = json.dumps(data, indent=1) + "\n"
    Path(path + ".tmp").write_text(text)
    os.replace(path + ".tmp", path)


def shared_flags(add):
    """The flags of compare.py, infill.py and frontier.py: --json, --device, --threads."""
    add("--json", metavar="PATH", help="also write the results here (for experiments/plot.py)")
    add("--device", help="cpu, cuda, cuda:N or mps (default: the first of cuda, mps, cpu)")
    add("--threads", type=int, help="CPU threads (default: the cores other work leaves idle)")


def setup(args, dtype="float32"):
    """Checks --json's folder before the work -> (device, dtype) of --device, --threads."""
    folder = Path(args.json or "x").resolve().parent
    require(folder.is_dir(), f"--json {args.json}: its folder does not exist")
    device, dtype, how = setdiff.runtime(args.device, dtype, args.threads)
    print(how)
    return device, dtype


def main(argv=None):
    if argv is None:
        argv = sys.argv[1:]
    argv = [str(a) for a in argv]  # paths too
    summary = __doc__.split("\n\n")[0]
    p = argparse.ArgumentParser(description=summary)
    add = p.add_argument
    add("ckpt", nargs="+", metavar="CKPT", help="checkpoints of train_small.py to compare")
    add("--judge", required=True, metavar="CKPT", help="an ar checkpoint of the same data")
    add("--samples", type=int, default=64, metavar="N", help="samples a window and threshold (64)")
    add("--num-orders", type=int, default=4, metavar="K", help="decode orders a row (4)")
    add("--eval-rows", type=int, default=0, metavar="N", help="score the first N rows (0: all)")
    add("--temperature", type=float, default=1.0, help="of the samples (1)")
    add("--top-p", type=float, default=1.0, help="of the samples (1: the model's own distribution)")
    add("--seed", type=int, default=0, help="seed of the samples and the orders (0)")
    add("--dtype", choices=["auto", "float32", "bfloat16"], default="auto", help="autocast (auto)")
    shared_flags(add)
    args = p.parse_args(argv)
    command = shlex.join(["python", "experiments/compare.py", *argv])
    try:
        smallest = min(args.samples, args.num_orders)
        require(smallest >= 1, "--samples, --num-orders: >= 1")
        device, dtype = setup(args, args.dtype)
        with setdiff.autocast(device, dtype):
            res = compare(args, command, device)
        print_tables(res, args)
        if args.json:
            write_json(args.json, res)
    except (ValueError, OSError) as e:  # setdiff raises ValueError for bad input
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
