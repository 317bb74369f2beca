"""The tables behind the README's figures, then the figures (matplotlib for the drawing only):
runs' metrics.jsonl -> assets/training.png (runs NAME-sSEED: NAME's mean and seed band);
compare.py --json -> assets/frontier.png and the tokens per call each model reaches within 10%
of its quality at one token per call; frontier.py --json -> assets/reasoning.png (accuracy
against tokens per call and tokens/s); checkpoints (.pt) -> assets/orders.png (decode orders).

    python experiments/plot.py assets/runs/*.jsonl assets/compare.json assets/reasoning.json
"""

import json
import re
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "assets"
DOTS = dict(marker="o", ms=3)  # a line's points


def training_curve(path):
    """[(training tokens, validation bits per byte)] of a metrics.jsonl, in step order."""
    lines = Path(path).read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    validations = [r for r in records if r.get("kind") == "val"]
    points = [(r["tokens"], r["bits_per_byte"]) for r in validations]
    return sorted(points)


def seed_bands(runs):
    """Runs NAME-sSEED grouped by NAME -> {NAME: {tokens: [bits per byte, a seed each]}}."""
    bands = {}
    for name, points in runs.items():
        band = bands.setdefault(re.sub(r"-s\d+$", "", name), {})
        for tokens, bits in points:
            band.setdefault(tokens, []).append(bits)
    return bands


def mean_std(seeds):
    """Their mean and standard deviation (nan for one seed: no spread to show)."""
    std = statistics.stdev(seeds) if seeds[1:] else np.nan
    return statistics.mean(seeds), std


def decode_orders(paths, threshold=0.3, first=32):
    """policy -> the (steps, positions) of its `first` positions in a training order (a step
    a slot) and in a greedy sample at the default window and `threshold` (a step a call)."""
    sys.path.insert(0, str(ROOT))
    import torch

    import setdiff

    orders = {}
    for path in paths:
        model, _, _ = setdiff.load_checkpoint(path)
        cfg = model.cfg
        g = torch.Generator().manual_seed(0)
        order = setdiff.sample_order(cfg, 1, g)[0]
        slots = torch.where(order < first)[0]
        out = setdiff.generate(model, threshold=threshold, temperature=0)
        calls = out.reveal_call[0, :first]
        shown = torch.where(calls >= 0)[0]  # not the given position 0
        sample = calls[shown], shown
        orders[setdiff.policy_name(cfg)] = (slots, order[slots]), sample
    return orders


def line_name(r):
    """A sample row's line in the figures: 'model, w=W'."""
    return f"{r['model']}, w={r['window']}"


def frontier(compare):
    """'model, w=W' -> [(tokens per call, judged NLL)] of the samples, by tokens per call."""
    lines = {}
    for r in compare["samples"]:
        name = line_name(r)
        point = (r["tokens_per_call"], r["judge_nll"])
        lines.setdefault(name, []).append(point)
    return {name: sorted(points) for name, points in lines.items()}


def within(compare, slack=1.1):
    """'model, w=W' -> the most tokens per call whose judged NLL is at most `slack` times the
    NLL at one token per call (threshold > 1, recorded as None) with that window."""
    samples = compare["samples"]
    base = {}
    for r in samples:
        if r["threshold"] is None:
            base[line_name(r)] = r["judge_nll"]
    reach = {}
    for r in samples:
        name = line_name(r)
        if r["judge_nll"] <= slack * base[name]:
            reach[name] = max(reach.get(name, 0), r["tokens_per_call"])
    return reach


def print_tables(bands, compare):
    if bands:  # a row per validation: mean +- std over the seeds
        names = " | ".join(bands)
        print(f"| training tokens | {names} |")
        print("|---" * (len(bands) + 1) + "|")
        seen = {t for band in bands.values() for t in band}
        for tokens in sorted(seen):
            cells = [mean_std(band.get(tokens, [np.nan])) for band in bands.values()]
            cells = " | ".join(f"{m:.3f} +- {s:.3f}" for m, s in cells)
            print(f"| {tokens:,} | {cells} |")
    if compare:  # the 10% rule
        print("\n| model, window | most tokens/call at a judged NLL within 10% of 1 token/call's |")
        print("|---|---|")
        for model, tokens in within(compare).items():
            print(f"| {model} | {tokens:.2f} |")


def draw_training(plt, bands):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, band in bands.items():
        tokens = list(band)
        mean, std = np.array(list(map(mean_std, band.values()))).T
        ax.plot(tokens, mean, label=name, marker=".")
        low = mean - std
        ax.fill_between(tokens, low, low + 2 * std, alpha=0.2)
    bound = "validation bound (bits/byte), mean +- std of seeds"
    ax.set(xlabel="training tokens", ylabel=bound)
    return fig, ax, "Validation bound while training", "training.png"


def draw_frontier(plt, compare):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colour = {}  # a colour per model; its larger window (they come in order) dashed
    for name, points in frontier(compare).items():
        model = name.rsplit(", w=", 1)[0]
        style = "--" if model in colour else "-"
        colour.setdefault(model, f"C{len(colour) % 10}")
        speed, nll = zip(*points)
        ax.plot(speed, nll, label=name, color=colour[model], ls=style, **DOTS)
    real = compare["validation"]["judge_nll"]
    ax.axhline(real, color="grey", lw=0.8, label="validation")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter("{x:g}")
    ax.set(xlabel="tokens per call", ylabel="judged NLL (nats/token, AR judge)")
    return fig, ax, "Quality against speed", "frontier.png"


def draw_reasoning(plt, reasoning):
    """One line a model and window: accuracy against tokens per call, and against tokens/s."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    by_call, by_speed = axes
    lines = {}
    for r in reasoning["frontier"]:
        if r["accuracy"] is None:  # the plain decoder: a speed, drawn as a vertical line
            speed = r["tokens_per_s"]
            by_speed.axvline(speed, color="k", ls=":", label=r["model"])
            continue
        lines.setdefault(line_name(r), []).append(r)
    for i, (name, rows) in enumerate(lines.items()):
        colour = f"C{i % 10}"
        accuracy = [r["accuracy"] for r in rows]  # in threshold order
        for ax, key in zip(axes, ("tokens_per_call", "tokens_per_s")):
            speed = [r[key] for r in rows]
            ax.plot(speed, accuracy, label=name, color=colour, **DOTS)
    by_call.set(xlabel="tokens per call", ylabel="exact-match accuracy (%)")
    by_speed.set(xlabel="tokens/s (all test problems in one batch)")
    by_speed.set_title("and against tokens/s")
    return fig, by_call, "Exact-match accuracy against tokens per call", "reasoning.png"


def draw_orders(plt, orders):
    """A panel a policy: position against step, in a training order and a greedy sample."""
    fig, _ = plt.subplots(1, len(orders), figsize=(13, 3.6))
    for ax, name in zip(fig.axes, orders):
        training, sample = orders[name]
        ax.plot(*training, ".", color="grey", label="training order (step: slot)")
        ax.plot(*sample, "x", label="greedy, tau 0.3 (step: call)")
        ax.set(title=name, xlabel="step")
    first = fig.axes[0]
    first.set_ylabel("position")
    return fig, first, first.get_title(), "orders.png"


def draw(runs, compare, reasoning=None, orders=None):
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("drawing needs matplotlib (pip install matplotlib)") from None
    plt.switch_backend("Agg")  # files only, no display
    figures = []
    if runs:
        figures.append(draw_training(plt, runs))
    if compare:
        figures.append(draw_frontier(plt, compare))
    if reasoning:
        figures.append(draw_reasoning(plt, reasoning))
    if orders:
        figures.append(draw_orders(plt, orders))
    for fig, ax, title, name in figures:
        ax.set_title(title)
        for a in fig.axes:
            a.grid(alpha=0.3)
            a.legend(fontsize=7)
        fig.savefig(ASSETS / name, dpi=120, bbox_inches="tight")
        print(f"drawn: {ASSETS / name}")


def main(paths):
    try:
        kinds = (".jsonl", ".json", ".pt")
        if not paths or not all(p.endswith(kinds) for p in paths):
            raise ValueError("give metrics.jsonl, compare/frontier.py .json or checkpoint files")
        runs = {}
        found = {"samples": None, "frontier": None}  # compare.py's, frontier.py's
        ckpts = []
        for path in map(Path, paths):
            if path.suffix == ".pt":
                ckpts.append(path)
            elif path.suffix == ".json":
                data = json.loads(path.read_text())
                found[next(k for k in found if k in data)] = data
            else:  # a run's metrics.jsonl, or a copy of it named for the run
                name = path.parent.name if path.name == "metrics.jsonl" else path.stem
                runs[name] = training_curve(path)
        bands = seed_bands(runs)
        print_tables(bands, found["samples"])
        orders = decode_orders(ckpts)
        draw(bands, found["samples"], found["frontier"], orders)
    except (KeyError, StopIteration) as e:
        print(f"error: not a metrics.jsonl or compare/frontier.py --json ({e!r})", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:  # a missing file, not JSON, no matplotlib
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
