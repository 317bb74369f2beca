"""The tables behind the README's figures, then the figures (matplotlib for the drawing only):
runs' metrics.jsonl -> assets/training.png; compare.py --json -> assets/frontier.png and the
tokens per call each model reaches within 10% of its quality at one token per call;
frontier.py --json -> assets/reasoning.png (accuracy against tokens per call and tokens/s).

    python experiments/plot.py assets/runs/*.jsonl assets/compare.json assets/reasoning.json
"""

import json
import math
import sys
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "assets"
DOTS = dict(marker="o", ms=3)  # a line's points


def training_curve(path):
    """[(training tokens, validation bits per byte)] of a metrics.jsonl, in step order."""
    lines = Path(path).read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    validations = [r for r in records if r.get("kind") == "val"]
    points = [(r["tokens"], r["bits_per_byte"]) for r in validations]
    return sorted(points)


def frontier(compare):
    """'model, w=W' -> [(tokens per call, judged NLL)] of the samples, by tokens per call."""
    lines = {}
    for r in compare["samples"]:
        name = f"{r['model']}, w={r['window']}"
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
            base[r["model"], r["window"]] = r["judge_nll"]
    reach = {}
    for r in samples:
        key = (r["model"], r["window"])
        if r["judge_nll"] <= slack * base[key]:
            reach[key] = max(reach.get(key, 0), r["tokens_per_call"])
    return {f"{model}, w={w}": tokens for (model, w), tokens in reach.items()}


def print_tables(runs, compare):
    if runs:  # a row per validation
        names = " | ".join(runs)
        print(f"| training tokens | {names} |")
        columns = len(runs) + 1
        print("|---" * columns + "|")
        seen = {t for points in runs.values() for t, _ in points}
        for tokens in sorted(seen):
            values = [dict(points).get(tokens, math.nan) for points in runs.values()]
            cells = " | ".join(f"{v:.3f}" for v in values)
            print(f"| {tokens:,} | {cells} |")
    if compare:  # the 10% rule
        print("\n| model, window | most tokens/call at a judged NLL within 10% of 1 token/call's |")
        print("|---|---|")
        for model, tokens in within(compare).items():
            print(f"| {model} | {tokens:.2f} |")


def draw_training(plt, runs):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in runs.items():
        tokens, bits = zip(*points)
        ax.plot(tokens, bits, label=name, marker=".")
    ax.set(xlabel="training tokens", ylabel="validation bound (bits/byte)")
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
        name = f"{r['model']}, w={r['window']}"
        lines.setdefault(name, []).append(r)
    for i, (name, rows) in enumerate(lines.items()):
        colour = f"C{i % 10}"
        accuracy = [r["accuracy"] for r in rows]  # in threshold order
        for ax, key in zip(axes, ("tokens_per_call", "tokens_per_s")):
            speed = [r[key] for r in rows]
            ax.plot(speed, accuracy, label=name, color=colour, **DOTS)
    by_call.set(xlabel="tokens per call", ylabel="exact-match accuracy (%)")
    by_speed.set(xlabel="tokens/s (all test problems in one batch)")
    by_speed.set_title("and against tokens/s")
    by_speed.grid(alpha=0.3)
    by_speed.legend(fontsize=7)
    return fig, by_call, "Exact-match accuracy against tokens per call", "reasoning.png"


def draw(runs, compare, reasoning=None):
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
    for fig, ax, title, name in figures:
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.savefig(ASSETS / name, dpi=120, bbox_inches="tight")
        print(f"drawn: {ASSETS / name}")


def main(paths):
    try:
        kinds = (".jsonl", ".json")
        if not paths or not all(p.endswith(kinds) for p in paths):
            raise ValueError("give metrics.jsonl files and .json files of compare/frontier.py")
        runs = {}
        for path in map(Path, paths):
            if path.suffix != ".jsonl":
                continue
            folder = path.parent.name
            name = folder if path.name == "metrics.jsonl" else path.stem  # or a copy's name
            runs[name] = training_curve(path)
        found = {"samples": None, "frontier": None}  # compare.py's, frontier.py's
        for p in paths:
            if not p.endswith(".json"):
                continue
            data = json.loads(Path(p).read_text())
            kind = next(k for k in found if k in data)
            found[kind] = data
        print_tables(runs, found["samples"])
        draw(runs, found["samples"], found["frontier"])
    except (KeyError, StopIteration) as e:
        print(f"error: not a metrics.jsonl or compare/frontier.py --json ({e!r})", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:  # a missing file, not JSON, no matplotlib
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
