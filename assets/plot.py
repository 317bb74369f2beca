"""Draw the README's figures from the runs' files; matplotlib is needed for the drawing only.

    pip install matplotlib
    python assets/plot.py assets/runs/*.jsonl assets/compare.json

A `.jsonl` file is a run's metrics.jsonl (train_small.py): its validation bound against training
tokens goes into assets/training.png. A `.json` file is what `sample.py --compare --json` wrote:
judged NLL against tokens per call goes into assets/frontier.png, and the tokens per call each
model reaches within 10% of its one-token-per-call quality are printed.
"""
import json, pathlib, sys

HERE = pathlib.Path(__file__).resolve().parent

def training_curve(path) -> list:
    """[(training tokens, validation bits per byte)] of a metrics.jsonl, in step order."""
    lines = [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line.strip()]
    return sorted((r["tokens"], r["bits_per_byte"]) for r in lines if r.get("kind") == "val")

def frontier(compare: dict) -> dict:
    """'model, w=W' -> [(tokens per call, judged NLL)] of the comparison's samples, by tokens per call."""
    lines = {}
    for r in compare["samples"]:
        lines.setdefault(f"{r['model']}, w={r['window']}", []).append((r["tokens_per_call"], r["judge_nll"]))
    return {name: sorted(points) for name, points in lines.items()}

def within(compare: dict, slack: float = 1.1) -> dict:
    """'model, w=W' -> the most tokens per call whose judged NLL is at most `slack` x its NLL at
    one token per call (threshold > 1, recorded as None) with that window."""
    base = {(r["model"], r["window"]): r["judge_nll"] for r in compare["samples"] if r["threshold"] is None}
    return {f"{m}, w={w}": max(r["tokens_per_call"] for r in compare["samples"] if (r["model"], r["window"]) == (m, w)
                               and r["judge_nll"] <= slack * nll) for (m, w), nll in base.items()}

def main(paths: list) -> None:
    run_name = lambda p: p.parent.name if p.name == "metrics.jsonl" else p.stem   # its folder, or a copy's name
    if len([p for p in paths if p.endswith(".json")]) > 1 or not all(p.endswith((".jsonl", ".json")) for p in paths):
        raise ValueError("give metrics.jsonl files and at most one .json file of sample.py --compare --json")
    runs = {run_name(pathlib.Path(p)): training_curve(p) for p in paths if p.endswith(".jsonl")}
    compares = [json.loads(pathlib.Path(p).read_text()) for p in paths if p.endswith(".json")]
    if runs:                                 # the numbers first: a row per validation
        print("| training tokens | " + " | ".join(runs) + " |\n" + "|---" * (len(runs) + 1) + "|")
        for tokens in sorted({t for points in runs.values() for t, _ in points}):
            cells = (f"{dict(points).get(tokens, float('nan')):.3f}" for points in runs.values())
            print(f"| {tokens:,} | " + " | ".join(cells) + " |")
    for compare in compares:
        print("\nthe most tokens per call at a judged NLL within 10% of the one at one token per call:")
        print("\n".join(f"  {name}: {reach:.2f}" for name, reach in within(compare).items()))
    try:
        import matplotlib
    except ImportError:
        raise ValueError("drawing needs matplotlib (pip install matplotlib); nothing else in setdiff does")
    matplotlib.use("Agg")                    # files only, no display
    import matplotlib.pyplot as plt, matplotlib.ticker
    if runs:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name, points in runs.items():
            ax.plot(*zip(*points), label=name, marker=".")
        ax.set(xlabel="training tokens", ylabel="validation bound (bits/byte)", title="Validation bound while training")
        ax.grid(alpha=0.3), ax.legend()
        fig.savefig(HERE / "training.png", dpi=120, bbox_inches="tight")
    for compare in compares:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        colour = {}                                      # a colour per model; its larger window dashed
        for name, points in frontier(compare).items():   # (windows come in increasing order)
            model = name.rsplit(", w=", 1)[0]
            dashed = model in colour
            colour.setdefault(model, f"C{len(colour) % 10}")
            ax.plot(*zip(*points), label=name, marker="o", markersize=3, color=colour[model],
                    linestyle="--" if dashed else "-")
        ax.axhline(compare["validation"]["judge_nll"], color="grey", linewidth=0.8, label="validation text")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set(xlabel="tokens per network call", ylabel="judged NLL (nats/token, AR judge)",
               title="Quality against speed")
        ax.grid(alpha=0.3), ax.legend(fontsize=7)
        fig.savefig(HERE / "frontier.png", dpi=120, bbox_inches="tight")
    print(f"figures written to {HERE}")

if __name__ == "__main__":
    try:
        main(sys.argv[1:] or sys.exit(__doc__))
    except KeyError as e:
        sys.exit(f"error: not a metrics.jsonl or a --compare --json file of setdiff (no field {e})")
    except (OSError, ValueError) as e:       # a missing file, not JSON, no matplotlib
        sys.exit(f"error: {e}")
