"""What a decode order shows a position when it is revealed: the order policy of a checkpoint,
and ar, block d and uniform at the same L and d.

    python experiments/order_stats.py --ckpt runs/staggered-d4/ckpt.pt
"""

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

# `python experiments/order_stats.py` puts experiments/ on the path, not the repository root
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import setdiff  # noqa: E402


def order_stats(cfg, num_orders=4000, seed=0):
    """Over sampled orders, for positions i = 16..L-17: P(i - 1 comes before i), P(i - 4..i - 1
    all do), and when i is revealed, E(still masked among i - 16..i - 1) and E(revealed among
    i + 1..i + 4)."""
    L = cfg.seq_len
    setdiff.require(L >= 33, f"order statistics need L >= 33 (16 positions each side), got {L}")
    g = torch.Generator().manual_seed(seed)
    order = setdiff.sample_order(cfg, num_orders, g)
    rank = torch.argsort(order, 1)  # (N, L): each position's place in the order
    i = torch.arange(16, L - 16)

    def before(j):  # (N, n): position i + j is revealed before i
        earlier = rank[:, i + j] < rank[:, i]
        return earlier.double()

    left = [before(-j) for j in range(1, 17)]
    left = torch.stack(left)  # (16, N, n)
    right = sum(before(j) for j in range(1, 5))  # (N, n)
    first = left[0]
    first4 = left[:4].prod(0)
    masked = (1 - left).sum(0)
    stats = (first, first4, masked, right)
    return tuple(float(v.mean()) for v in stats)


def policies(cfg):
    """Name -> Config: the checkpoint's own policy first, then ar, block d (for 1 < d < L:
    block d = 1 or L is ar or uniform) and uniform at the same L and d."""
    cfgs = {setdiff.policy_name(cfg): cfg}
    for order in ("ar", "block", "uniform"):
        if order == "block" and not 1 < cfg.set_size < cfg.seq_len:
            continue
        other = dataclasses.replace(cfg, order=order)
        cfgs.setdefault(setdiff.policy_name(other), other)
    return cfgs


def main(argv=None):
    summary = __doc__.split("\n\n")[0]
    p = argparse.ArgumentParser(description=summary)
    p.add_argument("--ckpt", required=True, help="a checkpoint, or a released model's folder")
    p.add_argument("--num-orders", type=int, default=4000, help="orders drawn a policy (4000)")
    args = p.parse_args(argv)
    try:
        model, _, _ = setdiff.load_checkpoint(args.ckpt)
        cfg = model.cfg
        cfgs = policies(cfg)
        rows = {name: order_stats(c, args.num_orders) for name, c in cfgs.items()}
    except (ValueError, OSError) as e:  # setdiff raises ValueError for bad input
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    span = f"L={cfg.seq_len}, {args.num_orders:,} orders, positions 16..{cfg.seq_len - 17}"
    print(f"\n## What the order shows position i when i is revealed ({span})\n")
    head = "| policy | left neighbour revealed first | all 4 left neighbours first | unrevealed "
    print(head + "among the 16 to the left | revealed among the 4 to the right |")
    print("|---" * 5 + "|")
    for name, (prev, prev4, masked, ahead) in rows.items():
        print(f"| {name} | {prev:.3f} | {prev4:.3f} | {masked:.2f} | {ahead:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
