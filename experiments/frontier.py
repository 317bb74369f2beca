"""The quality/speed frontier on a task with an exact answer. The task: a walk of +1 and -1 steps
mod 10 whose running values are written out before the answer, the way GSM8K solutions write
their intermediate results ("Q:6+1-1+1 A:7 6 7 #7"): each value is the one before, plus one step.
`--write DIR` writes DIR/train.txt and DIR/test.txt, one problem a line, for train_small.py
--data. Given checkpoints, prompt each test question, decode its answer with the set sampler
(greedy; thresholds > 1 down to 0.05; windows d and the largest) and report exact-match accuracy,
tokens per call and tokens/s, beside a plain causal decoder of the same network as AR's speed.

    python experiments/frontier.py --write data/chain
    python experiments/frontier.py runs/chain-{ar,staggered-d4}/ckpt.pt --test data/chain/test.txt
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

STEPS = 8  # operations a problem
THRESHOLDS = (math.inf, 0.9, 0.7, 0.5, 0.3, 0.2, 0.1, 0.05)


def problem(rng):
    """-> (question, answer), e.g. "Q:6+1-1+1+1-1-1+1+1 A:", "7 6 7 8 7 6 7 8 #8": a walk mod 10,
    each running value written out before the next (6+1=7, 7-1=6, ...), then the final one.
    NOTE: steps of +-1 only, because a 1,500-step model learns them: with steps of any digit a
    result is independent of each input alone, and it learned nothing (flat at 1.17 nats/token);
    with steps of 1-3 it reached 28% exact match (all measured)."""
    x = rng.randrange(10)
    question = f"Q:{x}"
    values = []
    for _ in range(STEPS):
        op = rng.choice("+-")
        step = 1 if op == "+" else -1
        x = (x + step) % 10
        question += f"{op}1"
        values.append(str(x))
    answer = " ".join(values) + f" #{x}"
    return question + " A:", answer


def write_task(folder, train=200_000, test=1000, seed=0):
    """train.txt and test.txt, one problem a line, each from its own seeded stream."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    for name, n, stream in (("train.txt", train, seed), ("test.txt", test, seed + 1)):
        rng = random.Random(stream)
        lines = ["".join(problem(rng)) + "\n" for _ in range(n)]
        Path(folder, name).write_text("".join(lines))


def final_answer(text):
    """What follows the last "#" of a decoded answer: the exact-match metric compares these."""
    if "#" not in text:
        return ""
    return text.rsplit("#", 1)[-1].strip()


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
        rows.append([tok.bos_id, *solved, tok.eos_id, *tok.encode(question)])
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
        out = setdiff.generate(model, prompt=prompt, max_new_tokens=A, temperature=0, **sampler)
    texts = [tok.decode(row[P:]) for row in out.tokens.cpu()]
    hits = [final_answer(t) == final_answer(a) for t, (_, a) in zip(texts, pairs)]
    accuracy = 100 * sum(hits) / len(hits)
    if sampler == "plain":
        accuracy = None  # timing only
    speed = len(pairs) * A / out.seconds
    return dict(accuracy=accuracy, tokens_per_call=out.tokens_per_call, tokens_per_s=speed)


def frontier(paths, pairs, device):
    rows = []
    for path in paths:
        model, tok, _ = setdiff.load_checkpoint(path, device)
        model.eval()
        cfg = model.cfg
        name = setdiff.policy_name(cfg)
        print(f"model: {path}, {name}", flush=True)
        if cfg.order == "ar":
            row = dict(model="plain causal decoder", window=1, threshold=None)
            row |= decode_answers(model, tok, pairs, "plain")
            rows.append(row)
        windows = {setdiff.default_window(cfg), setdiff.max_window(cfg)}
        for window in sorted(windows):
            thresholds = THRESHOLDS if window > 1 else THRESHOLDS[:1]
            for tau in thresholds:
                threshold = None if tau > 1 else tau
                row = dict(model=name, window=window, threshold=threshold)
                sampler = dict(window=window, threshold=tau)
                row |= decode_answers(model, tok, pairs, sampler)
                rows.append(row)
    return rows


def print_table(rows, args):
    print(f"\n## Exact-match accuracy against speed ({args.problems} test problems, greedy)\n")
    print("| model | window | threshold | accuracy (%) | tokens/call | tokens/s |")
    print("|---" * 6 + "|")
    for r in rows:
        accuracy = r["accuracy"]
        accuracy = "(timing only)" if accuracy is None else f"{accuracy:.1f}"
        threshold = r["threshold"] or ">1"
        speed = f"{r['tokens_per_call']:.2f} | {r['tokens_per_s']:,.0f}"
        cells = [r["model"], r["window"], threshold, accuracy, speed]
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
        rows = frontier(args.ckpt, pairs, device)
        print_table(rows, args)
        if args.json:
            write_json(args.json, dict(frontier=rows))
    except (ValueError, OSError) as e:  # setdiff raises ValueError for bad input
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
