"""Accuracy against speed, and infilling, on a task with an exact answer. The task: a walk on the
digits 0-9 whose steps are "+" (add one, mod 10) or "r" (reflect, x -> 9 - x), the answer every
running value ("Q:6r+rrrrrr A:34545454": 6 r 3, 3 + 4, 4 r 5, ...). A value is one look-up from
the value before and its step, so a causal model writes one value a call with ease; revealing
several values in one call asks one forward pass to compose several steps, which do not commute,
so no count of the steps gives the value. `--write DIR` writes DIR/train.txt and DIR/test.txt,
one problem a line, for train_small.py --data. Given checkpoints: (1) every test question's
answer decoded greedily by the set sampler (thresholds > 1 down to 0.05; windows d and the
largest): exact-match accuracy, tokens per call and tokens/s, beside a plain causal decoder of
the same network as AR's speed; (2) infilling: the middle 4 steps of every question hidden, the
rest of the problem and the answer given, filled at the default infill window one token a call
(AR continues the left side), with and without a repetition penalty of 1.2: a fill is right when
its steps walk to the given answer.

    python experiments/frontier.py --write data/walk
    python experiments/frontier.py runs/walk-{ar,staggered-d4}/ckpt.pt --test data/walk/test.txt
"""

import argparse
import math
import random
import sys
from pathlib import Path

import torch

# `python experiments/frontier.py` puts experiments/ on the path, not the repository root
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import plain_decoder  # noqa: E402  (experiments/bench.py: the plain causal decoder)
from compare import setup, shared_flags, write_json  # noqa: E402

import setdiff  # noqa: E402
from setdiff import require  # noqa: E402

STEPS = 8  # steps a problem; a character, and a byte token, each
HIDDEN = slice(5, 9)  # the characters of the question hidden for infilling: steps 3-6 of 8
THRESHOLDS = (math.inf, 0.9, 0.7, 0.5, 0.3, 0.2, 0.1, 0.05)
PENALTIES = (1.0, 1.2)  # infilling: none, and the authors' infill table's


def walk(start, steps):
    """The running values of a walk from the digit `start`, as one string of digits."""
    x = start
    values = ""
    for step in steps:
        if step == "+":
            x = (x + 1) % 10
        else:
            x = 9 - x
        values += str(x)
    return values


def problem(rng):
    """-> (question, answer), e.g. "Q:6r+rrrrrr A:", "34545454".
    NOTE: "+" and "r" do not commute, so a value is not a count of the steps before it (a
    count, of "+1" and "-1" steps, many values at once are easy); and a value tells which of two
    values comes next (steps of any digit leave the next value unknown without the step, which
    a small model learns slowly). experiments/README.md has the measurements."""
    x = rng.randrange(10)
    choices = [rng.choice("+r") for _ in range(STEPS)]
    steps = "".join(choices)
    return f"Q:{x}{steps} A:", walk(x, steps)


def write_task(folder, train=200_000, test=1000, seed=0):
    """train.txt and test.txt, one problem a line, each from its own seeded stream."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    files = (("train.txt", train, seed), ("test.txt", test, seed + 1))
    for name, n, stream in files:
        rng = random.Random(stream)
        lines = ["".join(problem(rng)) + "\n" for _ in range(n)]
        Path(folder, name).write_text("".join(lines))


def read_test(path):
    """[(question, answer)] of a test file written by write_task."""
    pairs = []
    for line in Path(path).read_text().splitlines():
        question, sep, answer = line.partition(" A:")
        ok = sep and question.startswith("Q:")
        require(ok, f"--test {path}: {line!r} is not a problem")
        pairs.append((question + sep, answer))
    return pairs


def prompts(tok, pairs):
    """(n, P) ids: BOS, one solved problem (the previous test problem), EOS and the question: a
    training row holds problems separated by EOS, and one problem rarely starts right at BOS."""
    shots = pairs[-1:] + pairs[:-1]  # the solved example of each question
    rows = []
    for shot, (question, _) in zip(shots, pairs):
        solved = tok.encode("".join(shot))
        asked = tok.encode(question)
        rows.append([tok.bos_id, *solved, tok.eos_id, *asked])
    return torch.tensor(rows)  # the fixed format gives every prompt one length


def decode_answers(model, tok, pairs, sampler):
    """Accuracy (%), tokens per call and tokens/s of one sampler on every test problem, in one
    batch; `sampler` is generate()'s options, or "plain" (the causal decoder: its speed)."""
    A = len(pairs[0][1])
    prompt = prompts(tok, pairs)
    P = prompt.shape[1]
    require(P + A <= model.cfg.seq_len, f"test problems of {P + A} tokens do not fit L")
    if sampler == "plain":
        out = plain_decoder(model, prompt, A)
    else:
        sampler |= dict(max_new_tokens=A, temperature=0)
        out = setdiff.generate(model, prompt=prompt, **sampler)
    answers = out.tokens.cpu()[:, P:]
    hits = []
    for mine, (_, right) in zip(answers, pairs):
        hits.append(tok.decode(mine) == right)
    accuracy = 100 * sum(hits) / len(hits)
    if sampler == "plain":
        accuracy = None  # timing only
    speed = len(pairs) * A / out.seconds
    return dict(accuracy=accuracy, tokens_per_call=out.tokens_per_call, tokens_per_s=speed)


def sweep(model, tok, pairs):
    """decode_answers at every window (d and the largest) and threshold; the plain decoder's
    speed beside an AR model."""
    cfg = model.cfg
    name = setdiff.policy_name(cfg)
    rows = []
    if cfg.order == "ar":
        row = dict(model="plain causal decoder", window=1, threshold=None)
        rows.append(row | decode_answers(model, tok, pairs, "plain"))
    windows = {setdiff.default_window(cfg), setdiff.max_window(cfg)}
    for window in sorted(windows):
        thresholds = THRESHOLDS if window > 1 else THRESHOLDS[:1]
        for tau in thresholds:
            threshold = None if tau > 1 else tau
            row = dict(model=name, window=window, threshold=threshold)
            sampler = dict(window=window, threshold=tau)
            rows.append(row | decode_answers(model, tok, pairs, sampler))
    return rows


def infill_rows(tok, pairs):
    """-> ids (n, T): the prompts of prompts() followed by their answers, and hidden (n, T):
    the positions of the question's middle steps (HIDDEN)."""
    prompt = prompts(tok, pairs)
    answer_ids = [tok.encode(answer) for _, answer in pairs]
    answers = torch.tensor(answer_ids)
    ids = torch.cat([prompt, answers], 1)  # a character a token: the bytes tokenizer
    question = prompt.shape[1] - len(pairs[0][0])  # where every question starts
    pos = torch.arange(ids.shape[1]) - question  # in the question
    hidden = (pos >= HIDDEN.start) & (pos < HIDDEN.stop)
    return ids, hidden.expand_as(ids)


def right_fills(pairs, fills):
    """Which fills (strings of len(HIDDEN) characters) walk to the given answer: the question
    with its hidden steps replaced, walked again."""
    right = []
    for (question, answer), fill in zip(pairs, fills):
        text = question[: HIDDEN.start] + fill + question[HIDDEN.stop :]
        steps = text[3 : 3 + STEPS]
        legal = len(text) == len(question)
        legal = legal and set(steps) <= set("+r")
        walked = walk(int(text[2]), steps)
        right.append(legal and walked == answer)
    return right


def infill(model, tok, pairs):
    """A row per repetition penalty: the share of fills that walk to the answer (%), and of
    fills equal to the hidden steps (%). Greedy, one token a call; a set model at the default
    infill window with all the context cached first, AR from the left side alone (its training
    orders never show it right context)."""
    cfg = model.cfg
    ids, hidden = infill_rows(tok, pairs)
    start = int(hidden[0].nonzero()[0])  # the first hidden position, the same in every row
    truth = [question[HIDDEN] for question, _ in pairs]
    rows = []
    for penalty in PENALTIES:
        greedy = dict(temperature=0, repetition_penalty=penalty)
        width = HIDDEN.stop - HIDDEN.start
        if cfg.order == "ar":
            left = ids[:, :start]
            out = setdiff.generate(model, prompt=left, max_new_tokens=width, **greedy)
        else:
            holes = ids.masked_fill(hidden, cfg.mask_id)
            out = setdiff.generate(model, infill=holes, **greedy)
        filled = out.tokens.cpu()[:, start : start + width]
        fills = [tok.decode(row) for row in filled]
        right = right_fills(pairs, fills)
        same = [fill == steps for fill, steps in zip(fills, truth)]
        row = dict(model=setdiff.policy_name(cfg), repetition_penalty=penalty)
        row["window"] = setdiff.default_window(cfg, infill=True)
        row["accuracy"] = 100 * sum(right) / len(right)
        row["exact_steps"] = 100 * sum(same) / len(same)
        rows.append(row)
    return rows


def evaluate(paths, pairs, device):
    out = dict(frontier=[], infill=[])
    for path in paths:
        model, tok, _ = setdiff.load_checkpoint(path, device)
        model.eval()
        bytes_only = f"{path}: the task's problems are bytes; train it with the bytes tokenizer"
        require(tok.kind == "bytes", bytes_only)
        print(f"model: {path}, {setdiff.policy_name(model.cfg)}", flush=True)
        out["frontier"] += sweep(model, tok, pairs)
        out["infill"] += infill(model, tok, pairs)
    return out


def print_tables(res, args):
    print(f"\n## Exact-match accuracy against speed ({args.problems} test problems, greedy)\n")
    print("| model | window | threshold | accuracy (%) | tokens/call | tokens/s |")
    print("|---" * 6 + "|")
    for r in res["frontier"]:
        accuracy = r["accuracy"]
        accuracy = "(timing only)" if accuracy is None else f"{accuracy:.1f}"
        threshold = r["threshold"] or ">1"
        speed = f"{r['tokens_per_call']:.2f} | {r['tokens_per_s']:,.0f}"
        cells = [r["model"], r["window"], threshold, accuracy, speed]
        line = " | ".join(map(str, cells))
        print(f"| {line} |")
    print("\n## Infilling the middle 4 steps (greedy, one token a call)\n")
    head = "| model | window | repetition penalty | fills that walk to the answer (%) "
    print(head + "| the same steps (%) |")
    print("|---" * 5 + "|")
    for r in res["infill"]:
        cells = [r["model"], r["window"], r["repetition_penalty"]]
        cells += [f"{r['accuracy']:.1f}", f"{r['exact_steps']:.1f}"]
        line = " | ".join(map(str, cells))
        print(f"| {line} |")


def main(argv=None):
    summary = __doc__.split("\n\n")[0]
    p = argparse.ArgumentParser(description=summary)
    add = p.add_argument
    add("ckpt", nargs="*", metavar="CKPT", help="checkpoints trained on the task's train.txt")
    add("--write", metavar="DIR", help="write the task: DIR/train.txt and DIR/test.txt")
    add("--test", metavar="FILE", help="the test problems (DIR/test.txt)")
    add("--problems", type=int, default=1000, help="test problems decoded (1000)")
    shared_flags(add)
    argv = None if argv is None else [str(a) for a in argv]  # paths too
    args = p.parse_args(argv)
    try:
        if args.write:
            write_task(args.write)
            print(f"wrote {args.write}/train.txt and {args.write}/test.txt")
            return 0
        given = args.ckpt and args.test
        require(given, "give checkpoints and --test FILE (or --write DIR)")
        device, _ = setup(args)
        pairs = read_test(args.test)[: args.problems]
        res = evaluate(args.ckpt, pairs, device)
        print_tables(res, args)
        if args.json:
            write_json(args.json, res)
    except (ValueError, OSError) as e:  # setdiff raises ValueError for bad input
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
