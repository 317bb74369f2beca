"""The tables behind the README's results, then its figures (matplotlib for the drawing only).
Files of runs are named for the run, NAME-sSEED, and a table gives each model's mean +- the
standard deviation over its seeds (nan: one seed), then each seed's value:
runs' metrics.jsonl -> the validation bound while training, assets/training.png;
compare.py --json of a run (frontier-NAME-sSEED.json) -> judged NLL and distinct 4-grams against
tokens per call, assets/frontier.png, and the most tokens per call within 10% of a model's quality
at one token a call; frontier.py --json (task-NAME-sSEED.json) -> accuracy against tokens per call
(and tokens/s), assets/task.png, the best accuracy at or above given tokens per call, and the
task's infilling; infill.py --json (infill-gen-NAME-sSEED.json) -> infilling English; checkpoints (.pt)
-> decode orders, assets/orders.png.

    python experiments/plot.py assets/runs/*.jsonl assets/frontier-*.json assets/task-*.json
"""

import json
import re
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "assets"
DOTS = dict(marker="o", ms=3)  # a line's points
KINDS = {"samples": "frontier", "frontier": "task", "models": "infill"}  # a JSON key -> its kind
SPEEDS = (1.5, 2.0, 2.5, 3.0, 3.5, 4.0)  # tokens per call at which tasks compare accuracy


def training_curve(path):
    """[(training tokens, validation bits per byte)] of a metrics.jsonl, in step order."""
    lines = Path(path).read_text().splitlines()
    points = []
    for line in lines:
        record = json.loads(line) if line.strip() else {}
        if record.get("kind") == "val":
            points.append((record["tokens"], record["bits_per_byte"]))
    return sorted(points)


def model_of(run):
    """A run's name without its seed: "staggered-d4-s1" -> "staggered-d4"."""
    return re.sub(r"-s\d+$", "", run)


def seed_bands(runs):
    """Runs NAME-sSEED grouped by NAME -> {NAME: {tokens: [bits per byte, a seed each]}}."""
    bands = {}
    for name, points in runs.items():
        band = bands.setdefault(model_of(name), {})
        for tokens, bits in points:
            band.setdefault(tokens, []).append(bits)
    return bands


def mean_std(seeds):
    """Their mean and standard deviation (nan for one seed: no spread to show; nan in, nan out)."""
    seeds = np.asarray(seeds, dtype=float)
    std = np.nan
    if len(seeds) > 1:
        std = seeds.std(ddof=1)
    return seeds.mean(), std


def spread(values, digits=2):
    """'mean +- std (each seed, ...)'."""
    mean, std = mean_std(values)
    each = ", ".join(f"{v:.{digits}f}" for v in values)
    return f"{mean:.{digits}f} +- {std:.{digits}f} ({each})"


def by_setting(results, key):
    """{run: JSON} -> {(model, window, threshold): [its row of each seed]}, the rows of `key`;
    the model is the policy's table name, the same for every seed."""
    rows = {}
    for run in sorted(results):
        for r in results[run][key]:
            knob = r.get("threshold", r.get("repetition_penalty"))  # a sampler's or infill's
            setting = (r["model"], r.get("window"), knob)
            rows.setdefault(setting, []).append(r)
    return rows


def within(samples, key, slack=0.1):
    """'model, w=W' -> the most tokens per call whose `key` (judge_nll, distinct_4grams) is
    within `slack` of its value at one token a call (threshold > 1, recorded as None) with that
    window: judged NLL at most (1 + slack) times it, distinct 4-grams within slack of it."""
    base = {}
    for r in samples:
        if r["threshold"] is None:
            base[f"{r['model']}, w={r['window']}"] = r[key]
    reach = {}
    for r in samples:
        name = f"{r['model']}, w={r['window']}"
        change = r[key] / base[name] - 1
        if key != "judge_nll":  # fewer distinct 4-grams (repetition) or more (noise)
            change = abs(change)
        if change <= slack:
            most = max(reach.get(name, 0), r["tokens_per_call"])
            reach[name] = most
    return reach


def best_at(rows, speed):
    """The best accuracy of a run's settings that reveal at least `speed` tokens a call (nan:
    none does)."""
    fast = [r for r in rows if r["tokens_per_call"] >= speed]
    kept = [r["accuracy"] for r in fast]
    return max(kept, default=np.nan)


def table(head, lines):
    print("\n| " + " | ".join(head) + " |")
    print("|---" * len(head) + "|")
    for cells in lines:
        line = " | ".join(map(str, cells))
        print(f"| {line} |")


def seed_cells(rows, keys, digits=2):
    """spread() of each key over the seeds' rows."""
    cells = []
    for key in keys:
        values = [r[key] for r in rows]
        cells.append(spread(values, digits))
    return cells


def training_table(bands):
    """A row per validation: each model's mean +- std over its seeds."""
    seen = {t for band in bands.values() for t in band}
    lines = []
    for tokens in sorted(seen):
        cells = [f"{tokens:,}"]
        for band in bands.values():
            seeds = band.get(tokens, [np.nan])
            cells.append("{:.3f} +- {:.3f}".format(*mean_std(seeds)))
        lines.append(cells)
    table(["training tokens", *bands], lines)


def frontier_tables(frontier):
    """Each setting's quality and speed, then each model and window's 10% rule."""
    keys = ("tokens_per_call", "judge_nll", "distinct_4grams")
    settings = by_setting(frontier, "samples")
    lines = []
    for (model, w, tau), rows in settings.items():
        cells = seed_cells(rows, keys, 3)
        lines.append([model, w, tau or ">1", *cells])
    table(["model", "window", "threshold", *keys], lines)
    reach = {}  # "model, w=W" -> [{quality: tokens per call} of each seed]
    for run in sorted(frontier):
        samples = frontier[run]["samples"]
        for key in keys[1:]:
            for name, tokens in within(samples, key).items():
                model = reach.setdefault(name, {})
                model.setdefault(key, []).append(tokens)
    lines = []
    for name, seeds in reach.items():
        cells = [spread(seeds[key]) for key in keys[1:]]
        lines.append([name, *cells])
    table(["model, window", "within 10%: of judged NLL", "of distinct 4-grams"], lines)


def task_tables(task):
    """Each setting's accuracy and speed; the best accuracy at or above SPEEDS; infilling."""
    lines = []
    settings = by_setting(task, "frontier")
    for (model, w, tau), rows in settings.items():
        cells = [model, w, tau or ">1", "(timing only)"]  # the plain causal decoder's
        if rows[0]["accuracy"] is not None:
            cells[3:] = seed_cells(rows, ["accuracy"], 1)
        cells += seed_cells(rows, ["tokens_per_call"])
        cells += seed_cells(rows, ["tokens_per_s"], 0)
        lines.append(cells)
    table(["model", "window", "threshold", "accuracy (%)", "tokens/call", "tokens/s"], lines)
    models = {}  # NAME -> each seed's rows
    for run in sorted(task):
        rows = task[run]["frontier"]
        models.setdefault(model_of(run), []).append(rows)
    lines = []
    for name, seeds in models.items():
        cells = [name]
        for speed in SPEEDS:
            best = [best_at(rows, speed) for rows in seeds]
            cells.append(spread(best, 1))
        lines.append(cells)
    table(["best accuracy (%) at tokens/call >=", *map(str, SPEEDS)], lines)
    lines = []
    settings = by_setting(task, "infill")
    for (model, w, penalty), rows in settings.items():
        cells = seed_cells(rows, ["accuracy", "exact_steps"], 1)
        lines.append([model, w, penalty, *cells])
    head = ["model", "window", "repetition penalty", "fills that walk to the answer (%)"]
    table(head + ["the hidden steps (%)"], lines)


def infill_table(infill):
    keys = ("gain", "byte_accuracy", "exact", "judged_suffix", "repeats")
    lines = []
    settings = by_setting(infill, "models")
    for (model, _, penalty), rows in settings.items():
        cells = seed_cells(rows, keys, 3)
        lines.append([model, penalty, *cells])
    table(["model", "repetition penalty", *keys], lines)


def print_tables(bands, found):
    if bands:
        training_table(bands)
    if found["frontier"]:
        frontier_tables(found["frontier"])
    if found["task"]:
        task_tables(found["task"])
    if found["infill"]:
        infill_table(found["infill"])


def draw_training(plt, bands):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, band in bands.items():
        band = dict(sorted(band.items()))  # by training tokens
        tokens = list(band)
        stats = [mean_std(seeds) for seeds in band.values()]
        mean, std = np.array(stats).T
        ax.plot(tokens, mean, label=name, marker=".")
        low = mean - std
        ax.fill_between(tokens, low, low + 2 * std, alpha=0.2)
    bound = "validation bound (bits/byte), mean +- std of seeds"
    ax.set(xlabel="training tokens", ylabel=bound)
    return fig, ax, "Validation bound while training", "training.png"


def draw_bands(axes, results, key, ys):
    """A line a model and window through its settings' means (x: tokens per call, in threshold
    order), a band of +- one standard deviation over the seeds for each y key."""
    colour = {}  # a colour per model; its larger window (they come in order) dashed
    lines = {}
    settings = by_setting(results, key)
    for (model, w, _), rows in settings.items():
        lines.setdefault((model, w), []).append(rows)
    for (model, w), seeds in lines.items():
        style = "--" if model in colour else "-"
        colour.setdefault(model, f"C{len(colour) % 10}")
        x = []  # each setting's mean tokens per call
        for rows in seeds:
            per_call = [r["tokens_per_call"] for r in rows]
            x.append(np.mean(per_call))
        look = dict(color=colour[model], ls=style)
        for ax, y in zip(axes, ys):
            bands = []
            for rows in seeds:
                bands.append(mean_std([r[y] for r in rows]))
            mean, std = np.array(bands).T
            ax.plot(x, mean, label=f"{model}, w={w}", **look, **DOTS)
            low = mean - std
            high = mean + std
            ax.fill_between(x, low, high, color=look["color"], alpha=0.15)


def draw_frontier(plt, frontier):
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    draw_bands(axes, frontier, "samples", ("judge_nll", "distinct_4grams"))
    real = next(iter(frontier.values()))["validation"]
    for ax, y in zip(axes, ("judge_nll", "distinct_4grams")):
        grey = dict(color="grey", lw=0.8)
        ax.axhline(real[y], label="validation rows", **grey)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter("{x:g}")
    axes[0].set(xlabel="tokens per call", ylabel="judged NLL (nats/token, AR judge)")
    axes[1].set(xlabel="tokens per call", ylabel="share of distinct 4-grams")
    return fig, axes[0], "Quality against speed, English bytes", "frontier.png"


def draw_task(plt, task):
    """Accuracy against tokens per call, the set samplers' (the plain decoder is timing only)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    timed = {}
    for run, res in task.items():
        rows = res["frontier"]
        sampled = [r for r in rows if r["accuracy"] is not None]
        timed[run] = dict(frontier=sampled)
    draw_bands([ax], timed, "frontier", ("accuracy",))
    ax.set(xlabel="tokens per call", ylabel="exact-match accuracy (%)")
    ax.set_ylim(-2, 102)
    return fig, ax, "Accuracy against tokens per call on the walk task", "task.png"


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


def draw_orders(plt, orders):
    """A panel a policy: position against step, in a training order and a greedy sample."""
    size = (13, 3.6)
    fig, _ = plt.subplots(1, len(orders), figsize=size)
    for ax, name in zip(fig.axes, orders):
        training, sample = orders[name]
        ax.plot(*training, ".", color="grey", label="training order (step: slot)")
        ax.plot(*sample, "x", label="greedy, tau 0.3 (step: call)")
        ax.set(title=name, xlabel="step")
    first = fig.axes[0]
    first.set_ylabel("position")
    return fig, first, first.get_title(), "orders.png"


def draw(bands, found, orders=None):
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("drawing needs matplotlib (pip install matplotlib)") from None
    plt.switch_backend("Agg")  # files only, no display
    figures = []
    if bands:
        figures.append(draw_training(plt, bands))
    if found["frontier"]:
        figures.append(draw_frontier(plt, found["frontier"]))
    if found["task"]:
        figures.append(draw_task(plt, found["task"]))
    if orders:
        figures.append(draw_orders(plt, orders))
    for fig, ax, title, name in figures:
        ax.set_title(title)
        for a in fig.axes:
            a.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.savefig(ASSETS / name, dpi=120, bbox_inches="tight")
        print(f"drawn: {ASSETS / name}")


def main(paths):
    try:
        kinds = (".jsonl", ".json", ".pt")
        known = all(p.endswith(kinds) for p in paths)
        if not paths or not known:
            raise ValueError("give metrics.jsonl, compare/frontier/infill.py .json or .pt files")
        runs = {}
        found = {kind: {} for kind in KINDS.values()}  # kind -> {run: its JSON}
        ckpts = []
        for path in map(Path, paths):
            if path.suffix == ".pt":
                ckpts.append(path)
            elif path.suffix == ".json":
                data = json.loads(path.read_text())
                kind = KINDS[next(k for k in KINDS if k in data)]
                run = path.stem.removeprefix("infill-gen-").removeprefix(f"{kind}-")
                found[kind][run] = data
            else:  # a run's metrics.jsonl, or a copy of it named for the run
                name = path.parent.name if path.name == "metrics.jsonl" else path.stem
                runs[name] = training_curve(path)
        bands = seed_bands(runs)
        print_tables(bands, found)
        orders = decode_orders(ckpts)
        draw(bands, found, orders)
    except (KeyError, StopIteration) as e:
        print(f"error: not a metrics.jsonl or a script's --json ({e!r})", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:  # a missing file, not JSON, no matplotlib
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
