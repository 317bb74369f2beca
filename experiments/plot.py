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


def training_curve(path) -> list:
    """[(training tokens, validation bits per byte)] of a metrics.jsonl, in step order."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return sorted((r["tokens"], r["bits_per_byte"]) for r in records if r.get("kind") == "val")


def frontier(compare: dict) -> dict:
    """'model, w=W' -> [(tokens per call, judged NLL)] of the samples, by tokens per call."""
    lines = {}
    for r in compare["samples"]:
        name = f"{r['model']}, w={r['window']}"
        lines.setdefault(name, []).append((r["tokens_per_call"], r["judge_nll"]))
    return {name: sorted(points) for name, points in lines.items()}


def within(compare: dict, slack: float = 1.1) -> dict:
    """'model, w=W' -> the most tokens per call whose judged NLL is at most `slack` times the
    NLL at one token per call (threshold > 1, recorded as None) with that window."""
    samples = compare["samples"]
    base = {(r["model"], r["window"]): r["judge_nll"] for r in samples if r["threshold"] is None}
    reach = {}
    for r in samples:
        key = (r["model"], r["window"])
        if r["judge_nll"] <= slack * base[key]:
            reach[key] = max(reach.get(key, 0), r["tokens_per_call"])
    return {f"{model}, w={w}": tokens for (model, w), tokens in reach.items()}


def print_tables(runs: dict, compare: dict | None) -> None:
    if runs:  # a row per validation
        print("| training tokens | " + " | ".join(runs) + " |\n" + "|---" * (len(runs) + 1) + "|")
        for tokens in sorted({t for points in runs.values() for t, _ in points}):
            cells = [f"{dict(points).get(tokens, math.nan):.3f}" for points in runs.values()]
            print(f"| {tokens:,} | " + " | ".join(cells) + " |")
    if compare:  # the 10% rule
        print("\n| model, window | most tokens/call at a judged NLL within 10% of 1 token/call's |")
        print("|---|---|\n" + "\n".join(f"| {m} | {t:.2f} |" for m, t in within(compare).items()))


def draw(runs: dict, compare: dict | None, reasoning: dict | None = None) -> None:
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("drawing needs matplotlib (pip install matplotlib)") from None
    plt.switch_backend("Agg")  # files only, no display
    figures = []
    if runs:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name, points in runs.items():
            ax.plot(*zip(*points), label=name, marker=".")
        ax.set(xlabel="training tokens", ylabel="validation bound (bits/byte)")
        figures.append((fig, ax, "Validation bound while training", "training.png"))
    if compare:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        colour = {}  # a colour per model; its larger window (they come in order) dashed
        for name, points in frontier(compare).items():
            model = name.rsplit(", w=", 1)[0]
            style = "--" if model in colour else "-"
            colour.setdefault(model, f"C{len(colour) % 10}")
            ax.plot(*zip(*points), label=name, marker="o", ms=3, color=colour[model], ls=style)
        ax.axhline(compare["validation"]["judge_nll"], color="grey", lw=0.8, label="validation")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter("{x:g}")
        ax.set(xlabel="tokens per network call", ylabel="judged NLL (nats/token, AR judge)")
        figures.append((fig, ax, "Quality against speed", "frontier.png"))
    if reasoning:  # one line a model and window: accuracy against tokens per call, tokens/s
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
        lines = {}
        for r in reasoning["frontier"]:
            if r["accuracy"] is None:  # the plain decoder: a speed, drawn as a vertical line
                axes[1].axvline(r["tokens_per_s"], color="k", ls=":", label=r["model"])
                continue
            lines.setdefault(f"{r['model']}, w={r['window']}", []).append(r)
        for i, (name, rows) in enumerate(lines.items()):
            for ax, key in zip(axes, ("tokens_per_call", "tokens_per_s")):
                points = [(r[key], r["accuracy"]) for r in rows]  # in threshold order
                ax.plot(*zip(*points), label=name, marker="o", ms=3, color=f"C{i % 10}")
        axes[0].set(xlabel="tokens per network call", ylabel="exact-match accuracy (%)")
        axes[1].set(xlabel="tokens/s (all test problems in one batch)")
        axes[1].set_title("and against tokens/s")
        axes[1].grid(alpha=0.3)
        axes[1].legend(fontsize=7)
        figures.append(
            (fig, axes[0], "Exact-match accuracy against tokens per call", "reasoning.png")
        )
    for fig, ax, title, name in figures:
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.savefig(ASSETS / name, dpi=120, bbox_inches="tight")
        print(f"drawn: {ASSETS / name}")


def main(paths: list) -> int:
    try:
        if not paths or not all(p.endswith((".jsonl", ".json")) for p in paths):
            raise ValueError("give metrics.jsonl files and .json files of compare/frontier.py")
        runs = {}
        for p in (Path(p) for p in paths if p.endswith(".jsonl")):  # its folder, or a copy's name
            runs[p.parent.name if p.name == "metrics.jsonl" else p.stem] = training_curve(p)
        found = {"samples": None, "frontier": None}  # compare.py's, frontier.py's
        for data in (json.loads(Path(p).read_text()) for p in paths if p.endswith(".json")):
            found[next(k for k in found if k in data)] = data
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
