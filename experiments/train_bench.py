"""Time an optimizer step of set diffusion against plain AR on the same modules and batch: set
diffusion feeds 2L tokens (the clean stream | the mask stream) with the set-causal mask, AR feeds
L tokens with a causal mask, so about 2x is the floor. Prints a table, fp32 and bf16.

    python experiments/train_bench.py --threads 1
    python experiments/train_bench.py --n-layer 12 --n-head 12 --d-model 768 --vocab-size 30522
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# `python experiments/train_bench.py` puts experiments/ on the path, not the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import setdiff  # noqa: E402

STEPS = 5  # optimizer steps a timed run
REPEATS = 3  # timed runs of each variant, interleaved


def ar_loss(model, x):
    """Next-token loss of a plain causal transformer made of the model's modules."""
    positions = torch.arange(x.shape[1], device=x.device)[None]  # (1, L): the same in every row
    causal = positions.T >= positions  # (L, L): query i sees the keys j <= i
    logits = model(x, positions, causal[None])[:, :-1]  # (B, L-1, V)
    logits = logits.flatten(0, 1).float()  # (B*(L-1), V)
    targets = x[:, 1:].flatten()  # (B*(L-1),)
    return F.cross_entropy(logits, targets)


def bench(cfg, batch_size: int, device, dtype) -> dict:
    """Variant -> median seconds an optimizer step takes. The repeats of the two variants are
    interleaved, so that both meet the same machine noise; repeat 0 warms up."""
    # ids below the special ids: a row with PAD would take the padded-mask path
    x = torch.randint(0, cfg.pad_id, (batch_size, cfg.seq_len), device=device)
    order = setdiff.sample_order(cfg, batch_size, device=device)
    model = setdiff.SetDiffusionLM(cfg).to(device)  # one model for both variants
    opt = torch.optim.AdamW(model.parameters())  # its step is timed too
    variants = {
        "set diffusion (2L, set-causal)": (setdiff.set_factorized_loss, x, order),
        "AR (L, causal)": (ar_loss, x),
    }
    times = {name: [] for name in variants}
    for repeat in range(REPEATS + 1):
        steps = STEPS if repeat else 1
        for name, (loss_fn, *inputs) in variants.items():
            setdiff.synchronize(device)
            start = time.perf_counter()
            for _ in range(steps):
                with setdiff.autocast(device, dtype):
                    loss = loss_fn(model, *inputs)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            setdiff.synchronize(device)
            seconds = (time.perf_counter() - start) / steps
            times[name].append(seconds)
    return {name: statistics.median(t[1:]) for name, t in times.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = p.add_argument
    add("--n-layer", type=int, default=4, help="transformer blocks (4)")
    add("--n-head", type=int, default=4, help="attention heads (4)")
    add("--d-model", type=int, default=256, help="hidden width (256)")
    add("--vocab-size", type=int, default=260, help="V: 260 (bytes), 30522 (BERT's vocab.txt)")
    add("--batch-size", type=int, default=16, help="rows a step (16)")
    add("--threads", type=int, help="CPU threads (default: the cores other work leaves)")
    shape = vars(p.parse_args(argv))
    B = shape.pop("batch_size")
    threads = shape.pop("threads")
    # the other flags are Config fields; its L is every preset's 128, and its special ids
    # (256-259) serve any V >= 260
    try:  # a bad flag is one line and exit code 2, as in every script
        cfg = setdiff.Config(**shape, dropout=0.0)
        device, _, how = setdiff.runtime(None, "float32", threads)  # fp32, bf16 below
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"bench: {how}; batch {B} x L={cfg.seq_len}")
    print("| dtype | variant | ms/step (median) | tokens/s | vs AR |")
    print("|---|---|---|---|---|")
    dtypes = [torch.float32, torch.bfloat16]
    if device.type == "mps":
        dtypes = [torch.float32]  # no bf16 autocast there
    for dtype in dtypes:
        median = bench(cfg, B, device, dtype)
        for name, seconds in median.items():
            ms = seconds * 1e3
            tok_s = B * cfg.seq_len / seconds
            ratio = seconds / median["AR (L, causal)"]
            print(f"| {str(dtype)[6:]} | {name} | {ms:.1f} | {tok_s:,.0f} | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
