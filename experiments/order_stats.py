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
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import setdiff  # noqa: E402


def order_stats(cfg: setdiff.Config, num_orders: int = 4000, seed: int = 0) -> tuple:
    """Over sampled orders, for positions i = 16..L-17: P(i - 1 comes before i), P(i - 4..i - 1
    all do), and when i is revealed, E(still masked among i - 16..i - 1) and E(revealed among
    i + 1..i + 4)."""
    L = cfg.seq_len
    setdiff.require(L >= 33, f"order statistics need L >= 33 (16 positions each side), got {L}")
    order = setdiff.sample_order(cfg, num_orders, torch.Generator().manual_seed(seed))
    step = torch.argsort(order, 1)  # (N, L): the step that reveals each position
    i = torch.arange(16, L - 16)

    def before(j: int) -> torch.Tensor:  # (N, n): position i + j is revealed before i
        return (step[:, i + j] < step[:, i]).double()

    left = torch.stack([before(-j) for j in range(1, 17)])  # (16, N, n)
    right = sum(before(j) for j in range(1, 5))  # (N, n)
    stats = (left[0], left[:4].prod(0), (1 - left).sum(0), right)
    return tuple(float(v.mean()) for v in stats)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="a checkpoint, or a released model's folder")
    p.add_argument("--num-orders", type=int, default=4000, help="orders drawn a policy (4000)")
    args = p.parse_args(argv)
    try:
        cfg = setdiff.load_checkpoint(args.ckpt)[0].cfg
        d = cfg.set_size
        names = {"staggered": f"staggered d={d}, s={cfg.max_set_size}", "block": f"block d={d}"}
        cfgs = {names.get(cfg.order, cfg.order): cfg}  # the model's own policy first
        for order in ("ar", "block", "uniform"):
            if order != "block" or 1 < d < cfg.seq_len:  # block d = 1 or L: ar or uniform
                cfgs.setdefault(names.get(order, order), dataclasses.replace(cfg, order=order))
        rows = {name: order_stats(c, args.num_orders) for name, c in cfgs.items()}
    except ValueError as e:  # setdiff raises ValueError for bad input
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    span = f"L={cfg.seq_len}, {args.num_orders:,} orders, positions 16..{cfg.seq_len - 17}"
    print(f"\n## What the order shows position i when i is revealed ({span})\n")
    print(
        "| policy | left neighbour revealed first | all 4 left neighbours first | unrevealed "
        "among the 16 to the left | revealed among the 4 to the right |\n" + "|---" * 5 + "|"
    )
    for name, (prev, prev4, masked, ahead) in rows.items():
        print(f"| {name} | {prev:.3f} | {prev4:.3f} | {masked:.2f} | {ahead:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
