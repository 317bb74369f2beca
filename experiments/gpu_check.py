"""The first minutes on a GPU, measured rather than debugged: the CUDA tests; train_small's own
training step of --preset lm1b, eager and compiled (seconds, tokens/s, peak memory, MFU, dense and
over live pairs; a profile of the compiled step's kernels and host time); the row
loader against a 0.2 s step; the sampler on the 132M network beside a plain KV-cached causal
decoder, eager and compiled (tokens/s, share of the memory-bandwidth bound, compile seconds);
the cache's exactness on CUDA. Sized for minutes on an H100-class GPU. One table; the
rows go to --json after every part, so that a run cut short keeps what it measured, and a part
that fails becomes an error row while the others still run. --dry-run: every part on the CPU
with tiny shapes, a check of this script (its numbers measure nothing).

    python experiments/gpu_check.py --json assets/gpu-check.json
    python experiments/gpu_check.py --dry-run --json /tmp/gpu-check.json   # the CPU, tiny shapes
"""

import argparse
import functools
import itertools
import math
import re
import shlex
import statistics
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import numpy as np
import torch

# `python experiments/gpu_check.py` puts experiments/ on the path, not the repository root
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import bench  # noqa: E402  (experiments/bench.py: the plain decoder, the cache's check)
from compare import write_json  # noqa: E402

import setdiff  # noqa: E402
import train_small  # noqa: E402
from setdiff import require  # noqa: E402

SPECIALS = "[PAD] [UNK] [CLS] [SEP] [MASK]".split()  # a BERT vocab.txt's, first
STEP = 0.2  # seconds: the loader's yardstick, an lm1b step at about 40% MFU on an H100
WINDOW = 4  # the sampler's w: d of the lm1b preset
# dense bf16 FLOP/s by a name inside the device's; the first match wins (H100 PCIe before H100)
PEAK_BF16 = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "A100": 312e12}
HBM_BYTES = {"H100 PCIe": 2.0e12, "H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12}  # per second
# What differs between the GPU run and --dry-run; `flags` go to train_small after
# --preset lm1b --device DEVICE.
MODES = {
    "gpu": dict(
        device="cuda",
        flags="",
        vocab=30522,  # BERT's
        tests="on_cuda",
        backend="inductor",
        sizes=[1, 64],
        repeats=5,
        memmap_rows=1 << 22,  # LM1B's ~0.8B tokens make millions of rows: a 1 GiB memmap
        timeout=180,  # seconds for the tests
    ),
    "dry": dict(
        device="cpu",
        flags="--threads 1 --n-layer 2 --n-head 2 --d-model 64 --seq-len 32 "
        "--batch-size 2 --global-batch 4",
        vocab=300,
        tests="on_cpu",
        backend="eager",  # dynamo's tracing without inductor's code generation, slow on a CPU
        sizes=[1, 4],
        repeats=2,
        memmap_rows=1 << 12,
        timeout=120,
    ),
}


def forward_flops(cfg, rows) -> dict:
    """FLOPs of the forward passes of one training step of `rows` rows, by part: 2 x weights x
    tokens for the matmuls (a multiply and an add per weight and token), through the blocks
    for all 2L tokens (clean | mask stream), through the head for the L mask-stream tokens
    only (queries=L); attention's scores q.k and weighted sums of v over all 2L x 2L pairs
    (SDPA with an explicit mask computes the masked ones too). Embedding lookups are free."""
    D = cfg.d_model
    T = 2 * cfg.seq_len
    weights = 12 * D * D  # a block's: qkv 3D^2, proj D^2, MLP 8D^2
    blocks = 2 * cfg.n_layer * weights * rows * T
    head = 2 * D * cfg.vocab_size * rows * cfg.seq_len
    attention = 2 * 2 * cfg.n_layer * rows * T * T * D
    return dict(blocks=blocks, head=head, attention=attention)


def device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def peak_flops(name: str, table=PEAK_BF16) -> float:
    """The device's entry in `table` (FLOP/s, or HBM_BYTES's bytes/s); NaN where unknown."""
    for key, peak in table.items():
        if key in name:
            return peak
    return math.nan  # an unknown device: no MFU


def made_up_data(folder, vocab_size, lines):
    """A BERT-style vocab.txt (the specials, then made-up four-letter words) and a corpus of
    20-word sentences of those words: train_small's own tokenizer and rows then run."""
    letters = itertools.product(string.ascii_lowercase, repeat=4)
    letters = itertools.islice(letters, vocab_size - len(SPECIALS))
    words = ["".join(w) for w in letters]
    vocab = "\n".join([*SPECIALS, *words])
    (folder / "vocab.txt").write_text(vocab + "\n")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(len(words), (lines, 20), generator=g)
    picked = ids.tolist()
    sentences = [" ".join(words[i] for i in row) for row in picked]
    (folder / "corpus.txt").write_text("\n".join(sentences) + "\n")


def median_seconds(work, device, warmup, repeats) -> float:
    """Median seconds of work(i) over the calls i >= warmup; queued GPU work is waited for."""
    seconds = []
    for i in range(warmup + repeats):
        setdiff.synchronize(device)
        start = time.perf_counter()
        work(i)
        setdiff.synchronize(device)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[warmup:])


# ---- The parts: each -> rows of the table --------------------------------------------------
def pytest_counts(key, timeout) -> list:
    """The device-parametrized tests of one device, in a subprocess: pytest's summary counts."""
    cmd = [sys.executable, "-m", "pytest", "-q", "test_setdiff.py", "-k", key]
    cmd += ["-p", "no:cacheprovider"]  # leave the --lf record of other runs alone
    start = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    seconds = time.perf_counter() - start
    lines = out.stdout.strip().splitlines() or [""]
    summary = re.findall(r"(\d+) (\w+)", lines[-1])  # "3 passed, 1 error, 40 deselected in 9s"
    counts = {word.removesuffix("s"): int(n) for n, word in summary}
    variant = f"-k {key}"
    row = dict(part="tests", variant=variant, seconds=seconds, returncode=out.returncode)
    for word in ("passed", "failed", "skipped", "errors", "deselected"):
        row[word] = counts.get(word.removesuffix("s"), 0)
    failing = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    row["failing"] = failing  # in the JSON, not the table
    return [row]


@functools.cache  # once for both variants
def training_run(flags: tuple):
    args, given = train_small.parse_args(list(flags))
    return train_small.setup(args, given)


def train_speed(flags, backend, repeats) -> list:
    """train_small's train_step of its lm1b run, eager (backend None) or compiled: a step's
    median seconds after two warm-up steps (the first compiles), tokens/s, peak memory, MFU."""
    run = training_run(flags)
    variant = "eager"
    if backend:
        run.net = torch.compile(run.net, backend=backend)
        variant = f"compiled ({backend})"
    cuda = run.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(run.device)

    def one_step(i):
        # the loss read as the training loop reads it: one sync a step
        float(train_small.train_step(run, run.step))
        run.step += 1

    seconds = median_seconds(one_step, run.device, 2, repeats)
    peak = math.nan
    if cuda:
        peak = torch.cuda.max_memory_allocated(run.device) / 2**30
    parts = forward_flops(run.cfg, run.G)
    flops = 3 * sum(parts.values())  # backward ~ 2 forwards
    peak_per_s = peak_flops(device_name(run.device))
    mfu = flops / seconds / peak_per_s
    # the same count over the live (query, key) pairs only: a quarter of the 2L x 2L
    mask = setdiff.set_causal_mask(run.cfg.seq_len)
    live = mask.double().mean().item()
    live_flops = flops - 3 * (1 - live) * parts["attention"]
    speed = run.G * run.cfg.seq_len / seconds  # data tokens, as train_small reports them
    row = dict(part="train", variant=variant, seconds=seconds, tokens_per_s=speed)
    row |= dict(peak_gib=peak, mfu=mfu, mfu_live_pairs=live_flops / seconds / peak_per_s)
    rows = [row | dict(tflop_per_step=flops / 1e12)]
    if backend:  # what the compiled step's time goes to
        profile = kernel_profile(one_step, cuda, seconds)
        rows.append(dict(part="profile", variant=variant, seconds=seconds) | profile)
    return rows


def kernel_profile(work, cuda, seconds, top=8) -> dict:
    """One more call of `work` under torch.profiler: the top kernels by device time (in
    --dry-run, the CPU's operators by their own time), each with its share of all kernels' time,
    and host_s: a step's `seconds` beyond its kernels, the time the device waits for the host."""
    kinds = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        kinds.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=kinds) as prof:
        work(-1)
    busy = busy_seconds(prof.key_averages(), cuda)
    total = sum(busy.values())
    names = sorted(busy, key=busy.get, reverse=True)[:top]
    shares = {name: busy[name] / total for name in names}
    return dict(kernel_s=total, host_s=seconds - total, top_kernels=shares)


def busy_seconds(events, cuda) -> dict:
    """Seconds by name, each kernel once: on a GPU the device's kernels only (not the operator
    that launched one, whose device time is its kernels', nor a user annotation spanning
    them); on the CPU each operator's own time."""
    busy = {}
    for event in events:
        on_device = event.device_type != torch.autograd.DeviceType.CPU
        own = event.self_cpu_time_total
        if cuda:
            own = event.self_device_time_total
        if cuda and (event.is_user_annotation or not on_device):
            continue
        busy[event.key] = own / 1e6  # seconds
    return busy


def loader_speed(folder, args, cfg, device, n, repeats):
    """What train_step does before the network, step by step: the rows of its micro-batches
    (batch_rows, the memmap's rows, int64, to the device) and the decode orders (drawn on the
    CPU, then moved); seconds a step against the 0.2 s of an lm1b step."""
    shape = (n, cfg.seq_len)
    rows = np.memmap(folder / "rows.bin", np.uint16, "w+", shape=shape)
    rows[:] = cfg.mask_id  # every page written, as a prepared memmap's
    G = args.global_batch
    accum = G // args.batch_size

    def fetch_rows(step):  # step 0 also draws the epoch's permutation: warm-up
        ids = train_small.batch_rows(0, step, G, n)
        for part in ids.reshape(accum, -1):
            x = rows[part].astype(np.int64)
            setdiff.upload(torch.from_numpy(x), device)  # as train_step does

    def draw_orders(step):
        generator = torch.Generator().manual_seed(step)
        orders = setdiff.sample_order(cfg, G, generator)
        for order in orders.reshape(accum, -1, cfg.seq_len):
            setdiff.upload(order, device)

    out = []
    for name, work in (("rows", fetch_rows), ("orders", draw_orders)):
        seconds = median_seconds(work, device, 1, repeats)
        ratio = STEP / seconds
        row = dict(part="loader", variant=name, seconds=seconds)
        out.append(row | dict(times_faster=ratio, fast_enough=ratio >= 10))
    return out


def sampler_model(cfg, device):
    """The network of the run's shape, random weights but a peaked head: its confidences then
    pass tau = 0.1 as a trained model's do, so that tau 0.1 reveals several tokens a call."""
    torch.manual_seed(0)  # the weights, as train_small seeds them
    with torch.device(device):
        model = setdiff.SetDiffusionLM(cfg)
    g = torch.Generator(device).manual_seed(0)
    head = model.head.weight
    torch.nn.init.normal_(head, std=1.0, generator=g)
    return model.eval()


def sampler_speed(cfg, device, dtype, sizes, repeats, backend) -> list:
    """Full rows at each batch size, one token a call and tau = 0.1, beside bench.py's plain
    decoder, eager (backend None) or compiled: bench's own interleaved rounds (a warm-up, then
    the median of `repeats`), each with its share of the memory-bandwidth bound."""
    compile = backend or False
    model = sampler_model(cfg, device)
    samplers = {}
    for tau in (math.inf, 0.1):
        options = dict(window=WINDOW, threshold=tau, compile=compile)
        samplers[f"w={WINDOW}, tau={tau:g}"] = options
    plain = dict(temperature=1.0, top_p=1.0, compile=compile)  # generate's defaults
    counts = {}
    with setdiff.autocast(device, dtype):
        for B in sizes:  # compiled: what two runs each compile, record and replay
            for name in [bench.PLAIN, *samplers] if compile else []:
                work = functools.partial(bench.sample, model, name, B, samplers, plain)
                counts[name, B] = graph_counts(work)
        timings = bench.timed_rounds(model, samplers, sizes, repeats, plain)
    how = f"compiled ({backend})" if compile else "eager"
    hbm = peak_flops(device_name(device), HBM_BYTES)
    rows = []
    for (name, B), timing in timings.items():
        per_call, speed, spread, warmup = timing
        call_bytes = bytes_a_call(model, B, dtype)
        bound = B * per_call * hbm / call_bytes  # tokens/s if a call took its reads' time
        row = dict(part="sampler", variant=f"{how} {name}, batch {B}", tokens_per_s=speed)
        row |= dict(of_bandwidth_bound=speed / bound, tokens_per_call=per_call)
        row |= dict(spread=spread, compile_s=warmup if compile else 0.0)
        rows.append(row | counts.get((name, B), {}))
    return rows


def graph_counts(work) -> dict:
    """work() run twice -> each run's graphs dynamo compiled, CUDA graphs captured (recorded)
    and replayed, inductor's cudagraph skips and partitions (a graph run without CUDA graphs,
    or split around an op that cannot be captured), and its network calls. A static engine's
    second run compiles and records nothing, and replays each compiled call. compile_s: the
    first run's seconds beyond the second's."""
    counts = {}
    seconds = []
    for run in (1, 2):
        before = dynamo_counts()
        with counted("capture_begin") as captures, counted("replay") as replays:
            out = work()
        seconds.append(out.seconds)
        for name, count in dynamo_counts().items():
            counts[f"{name}_run{run}"] = count - before[name]
        counts[f"captures_run{run}"] = captures.call_count
        counts[f"replays_run{run}"] = replays.call_count
        counts[f"calls_run{run}"] = out.calls
    return counts | dict(compile_s=seconds[0] - seconds[1])  # the first run's compiles


def counted(name):
    """torch.cuda.CUDAGraph's method `name`, counted (a mock's call_count) as it runs."""
    graph = torch.cuda.CUDAGraph
    method = getattr(graph, name)
    return mock.patch.object(graph, name, autospec=True, side_effect=method)


def dynamo_counts() -> dict:
    """Graphs dynamo compiled, and inductor's cudagraph skips and partitions, so far."""
    counters = torch._dynamo.utils.counters
    inductor = counters["inductor"]
    counts = dict(graphs=counters["stats"]["unique_graphs"])
    counts["cudagraph_skips"] = inductor["cudagraph_skips"]
    counts["cudagraph_partitions"] = inductor["cudagraph_partitions"]
    return counts


def bytes_a_call(model, batch_size, dtype) -> int:
    """The bytes a sampler call reads at the least: every weight once and the KV cache over its
    L slots (keys and values, every layer), at the compute dtype's size."""
    cfg = model.cfg
    size = torch.finfo(dtype).bits // 8
    cache = 2 * cfg.n_layer * batch_size * cfg.seq_len * cfg.d_model
    return (model.num_params() + cache) * size


def cache_exact(cfg, device, batch_size) -> list:
    model = sampler_model(cfg, device)
    exact = bench.cache_is_exact(model, batch_size, WINDOW)  # greedy, float64, on the device
    variant = f"cached = cache-free, batch {batch_size}"
    return [dict(part="cache", variant=variant, exact=exact)]


def run_part(name, work, *inputs) -> list:
    """A part's rows, or one error row: a failing part must not cost the others their minutes."""
    try:
        return work(*inputs)
    except Exception as e:
        error = f"{type(e).__name__}: {setdiff.one_line(e)}"
        return [dict(part=name, variant="error", error=error)]


def cell(key, value) -> str:
    if isinstance(value, float):
        return f"{key} {value:.4g}"  # 4 digits: a measurement, not more
    return f"{key} {value}"


def print_table(rows) -> None:
    print("\n| part | variant | seconds | tokens/s | more |\n|---|---|---|---|---|")
    shown = ("part", "variant", "seconds", "tokens_per_s", "failing")
    for row in rows:
        seconds = "-"  # a part that measures no time, or no tokens
        speed = "-"
        if "seconds" in row:
            seconds = f"{row['seconds']:.4g}"
        if "tokens_per_s" in row:
            speed = f"{row['tokens_per_s']:,.0f}"
        more = []
        for key, value in row.items():
            if key not in shown:
                more.append(cell(key, value))
        cells = [row["part"], row["variant"], seconds, speed, ", ".join(more)]
        print(f"| {' | '.join(cells)} |")


def train_flags(folder, mode):
    """train_small.py's flags: --preset lm1b (dry: tiny shapes) on the made-up data."""
    flags = ["--preset", "lm1b", "--device", mode["device"], *mode["flags"].split()]
    flags += ["--tokenizer", str(folder / "vocab.txt"), "--data", str(folder / "corpus.txt")]
    flags += ["--out", str(folder / "run"), "--cache-dir", str(folder / "cache")]
    flags += ["--workers", "1", "--dtype", "bfloat16"]
    return flags + ["--val-fraction", "0.5"]  # a validation row from little text


def measure(folder, mode, json_path, header):
    """Every part, in order; the rows so far to --json after each."""
    flags = train_flags(folder, mode)
    train_args, _ = train_small.parse_args(flags)
    lines = train_args.global_batch * train_args.seq_len // 4  # rows for several steps
    made_up_data(folder, mode["vocab"], lines)
    tok = train_small.load_tokenizer(train_args.tokenizer)
    cfg = train_small.model_config(train_args, tok)
    device, dtype, _ = setdiff.runtime(train_args.device, train_args.dtype, train_args.threads)
    sizes = mode["sizes"]
    repeats = mode["repeats"]
    parts = [  # the compiled step last: its compilation is the slowest and likeliest to fail
        ("tests", pytest_counts, mode["tests"], mode["timeout"]),
        ("train", train_speed, tuple(flags), None, repeats),
        ("loader", loader_speed, folder, train_args, cfg, device, mode["memmap_rows"], repeats),
        ("sampler", sampler_speed, cfg, device, dtype, sizes, repeats, None),
        ("sampler", sampler_speed, cfg, device, dtype, sizes, repeats, mode["backend"]),
        ("cache", cache_exact, cfg, device, sizes[-1]),
        ("train", train_speed, tuple(flags), mode["backend"], repeats),
    ]
    start = time.perf_counter()
    rows = []
    for part, work, *inputs in parts:
        rows += run_part(part, work, *inputs)
        seconds = time.perf_counter() - start
        write_json(json_path, header | dict(seconds=seconds, rows=rows))
    return rows


def check(args, command) -> int:
    no_gpu = "no CUDA GPU here: run with --dry-run to check every part on the CPU"
    require(args.dry_run or torch.cuda.is_available(), no_gpu)
    train_small.check_folder("--json", Path(args.json).parent)  # before the work
    mode = MODES["dry" if args.dry_run else "gpu"]
    device = torch.device(mode["device"])
    name = device_name(device)
    cuda = torch.version.cuda
    version = torch.__version__
    print(f"# experiments/gpu_check.py\ncommand: {command}\n{name}; torch {version}, CUDA {cuda}")
    header = dict(command=command, device=name, torch=version, cuda=cuda)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as folder:
        rows = measure(Path(folder), mode, args.json, header)
    print_table(rows)
    print(f"\n{time.perf_counter() - start:.0f} s; the rows are in {args.json}")
    failed = [row for row in rows if row["variant"] == "error"]
    return int(bool(failed))  # 1: a part failed


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    argv = [str(a) for a in argv]  # paths too
    summary = __doc__.split("\n\n")[0]
    p = argparse.ArgumentParser(description=summary)
    add = p.add_argument
    add("--json", default="gpu_check.json", help="rows, after every part (gpu_check.json)")
    add("--dry-run", action="store_true", help="every part on the CPU with tiny shapes")
    args = p.parse_args(argv)
    command = shlex.join(["python", "experiments/gpu_check.py", *argv])
    try:
        return check(args, command)
    except (ValueError, OSError) as e:  # setdiff raises ValueError for bad input
        print(f"error: {setdiff.one_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
