#!/usr/bin/python3
"""examples/train_gpt against the same GPT in PyTorch DDP (bench/pytorch_gpt.py), in one run.

    /usr/bin/python3 bench/gpt_compare.py --build build/release --data build/gpt-data
        [--steps 25] [--skip 5] [--rounds 3] [--threads 1] [--only L2f,P2f] [--json OUT]

Rows: lockstep on 1 process (f32, bf16) and on 2 (`lockstep run --standalone --nproc-per-node
2`: f32, bf16, each also with --zero 1), PyTorch 1.13 on 1 process (f32) and with DDP over Gloo
on 2 (f32, bf16). Every row is a fresh job of --steps optimizer steps of train_gpt's default
model and data settings (4 layers, 4 heads, 128 dims, block 128, batch 16 per rank, AdamW,
gradient clipping), each process on --threads intra-op threads (OMP_NUM_THREADS too). --rounds
rounds each run every row once, the order rotated by one row per round, so that every row sees
the machine's load at every position; the table shows medians over the rounds. First, a model
check: pytorch_gpt.py --check must find train_gpt's validation loss for a checkpoint train_gpt
saved after 30 steps (within 2e-6 nats, Note [Model check]), else the run stops.

Not part of the build or the tests; needs Debian's python3-torch and a built train_gpt and
`lockstep` (e.g. `make build gpt-data`). On the project's 2-core VM the defaults take about 15
minutes, most of it PyTorch's bf16 row (about 5 s a step there: that CPU has no bf16 GEMM
instructions, and torch 1.13's fallback is slow).

tokens/s counts the steps after the first --skip, each step's time from its batch to its
zeroed gradients (train_gpt's metrics file for lockstep; the same span in pytorch_gpt.py); the
evaluation and start-up are outside it. MFU is train_gpt's (Note [MFU] in examples/train_gpt.cpp:
the model FLOPs per token times tokens/s over the GEMM peak train_gpt measures at start), here
from the tokens/s after --skip. Peak RSS is each rank's getrusage ru_maxrss at the end (train_gpt's
"peak RSS per rank" line; pytorch_gpt.py the same call). lockstep/PyTorch divides the medians
at the same settings; the --zero 1 rows divide by PyTorch's plain DDP row.
"""
import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

# key, library, processes, amp, zero (2: --zero 1 --zero-reduce-scatter), the PyTorch row it is
# compared with
ROWS = [
    ("L1f", "lockstep", 1, "none", 0, "P1f"),
    ("L1b", "lockstep", 1, "bf16", 0, None),
    ("L2f", "lockstep", 2, "none", 0, "P2f"),
    ("L2b", "lockstep", 2, "bf16", 0, "P2b"),
    ("L2fz", "lockstep", 2, "none", 1, "P2f"),
    ("L2bz", "lockstep", 2, "bf16", 1, "P2b"),
    ("L2fr", "lockstep", 2, "none", 2, "P2f"),
    ("L2br", "lockstep", 2, "bf16", 2, "P2b"),
    ("P1f", "pytorch", 1, "none", 0, None),
    ("P2f", "pytorch", 2, "none", 0, None),
    ("P2b", "pytorch", 2, "bf16", 0, None),
]

# train_gpt's defaults (examples/train_gpt_flags.h), which pytorch_gpt.py's defaults repeat.
BLOCK, BATCH, N_LAYER, N_EMBD = 128, 16, 4, 128


def label(row):
    _, lib, procs, amp, zero, _ = row
    name = "lockstep" if lib == "lockstep" else "PyTorch 1.13"
    where = "1 process" if procs == 1 else "2 processes"
    if procs > 1 and lib == "pytorch":
        where = "DDP gloo, " + where
    flags = ["", ", --zero 1", ", --zero 1 --zero-reduce-scatter"][zero]
    return f"{name}, {where}, {'bf16' if amp == 'bf16' else 'f32'}{flags}"


def run(cmd, env, what):
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        sys.stdout.write(p.stdout)
        sys.exit(f"gpt_compare: {what} failed (exit code {p.returncode}): {' '.join(cmd)}")
    return p.stdout


def search(pattern, text, what):
    m = re.search(pattern, text, re.M)
    if not m:
        sys.stdout.write(text)
        sys.exit(f"gpt_compare: no {what} in train_gpt's output (pattern {pattern})")
    return m


def run_lockstep(row, a, env, warmup):
    _, _, procs, amp, zero, _ = row
    exe = os.path.join(a.build, "examples", "train_gpt")
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        cmd = [exe, "--data", a.data, "--max-steps", str(a.steps), "--warmup-steps", str(warmup),
               "--eval-every", str(a.steps), "--threads", str(a.threads), "--amp", amp,
               "--zero", str(min(zero, 1)), "--metrics", metrics]
        if zero == 2:
            cmd.append("--zero-reduce-scatter")
        if a.lockstep_backend:
            cmd += ["--backend", a.lockstep_backend]
        if procs > 1:
            cmd = [os.path.join(a.build, "tools", "lockstep"), "run", "--standalone",
                   "--nproc-per-node", str(procs)] + cmd
        out = run(cmd, env, label(row))
        steps = [json.loads(line) for line in open(metrics)]
    steps = [s for s in steps if s["kind"] == "train"]
    if len(steps) != a.steps:
        sys.exit(f"gpt_compare: {label(row)}: {len(steps)} train records, expected {a.steps}")
    measured = steps[a.skip:]
    # A step of B x procs windows of BLOCK tokens took B x procs / samples_per_s seconds.
    tokens_per_s = BLOCK * len(measured) / sum(1.0 / s["samples_per_s"] for s in measured)
    params = int(search(r"params=(\d+)", out, "parameter count").group(1))
    peak = float(search(r"GEMM peak ([0-9.]+) GFLOP/s", out, "GEMM peak").group(1)) * 1e9
    rss = search(r"peak RSS per rank:((?: [0-9.]+)+) MiB", out, "peak RSS line").group(1)
    flops_per_token = 6.0 * params + 12.0 * N_LAYER * BLOCK * N_EMBD  # Gpt::flops_per_token
    backend = search(r"backend=(\S+)", out, "backend").group(1)
    return {"tokens_per_s": tokens_per_s, "mfu": flops_per_token * tokens_per_s / peak,
            "backend": backend,
            "peak_rss_mib": [float(x) for x in rss.split()], "last_loss": steps[-1]["loss"]}


def run_pytorch(row, a, env, warmup):
    _, _, procs, amp, _, _ = row
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        run([a.python, os.path.join(HERE, "pytorch_gpt.py"), "--data", a.data, "--nproc",
             str(procs), "--threads", str(a.threads), "--amp", amp, "--steps", str(a.steps),
             "--skip", str(a.skip), "--warmup-steps", str(warmup), "--json", out], env, label(row))
        with open(out) as f:
            r = json.load(f)
    return {"tokens_per_s": r["tokens_per_s"], "mfu": None, "peak_rss_mib": r["peak_rss_mib"],
            "last_loss": r["last_loss"]}


# Note [Model check]
# The check trains 30 steps first: near GPT-2's init every attention row is nearly uniform and
# every activation small, so a model with another attention scale or GELU computes the same loss
# to 1e-6. After 30 steps (validation loss 3.12 on fortunes) the same function agrees to 1e-7
# (f32, one thread, another summation order), D^-1 in place of D^-1/2 moves the loss by 3e-4 and
# erf GELU in place of tanh GELU by 3e-6; the tolerance, 2e-6, catches both.
CHECK_STEPS, CHECK_TOLERANCE = 30, 2e-6


def check_same_model(a, env):
    """train_gpt trains CHECK_STEPS steps and saves; pytorch_gpt.py loads that checkpoint and must
    compute train_gpt's validation loss for it: the two models are the same function (f32)."""
    with tempfile.TemporaryDirectory() as tmp:
        ckpt, metrics = os.path.join(tmp, "ck.safetensors"), os.path.join(tmp, "m.jsonl")
        run([os.path.join(a.build, "examples", "train_gpt"), "--data", a.data, "--max-steps",
             str(CHECK_STEPS), "--warmup-steps", "5", "--eval-every", str(CHECK_STEPS),
             "--threads", str(a.threads), "--save", ckpt, "--metrics", metrics], env,
            "train_gpt's run for the model check")
        ours = [json.loads(l) for l in open(metrics)]
        ours = [r["test_loss"] for r in ours if r["kind"] == "eval"][-1]
        out = run([a.python, os.path.join(HERE, "pytorch_gpt.py"), "--data", a.data, "--threads",
                   str(a.threads), "--check", ckpt], env, "pytorch_gpt.py --check")
    theirs = json.loads(out.strip().splitlines()[-1])["val_loss"]
    if abs(ours - theirs) > CHECK_TOLERANCE:
        sys.exit(f"gpt_compare: the models differ: train_gpt's checkpoint has validation loss "
                 f"{ours:.8f} in train_gpt, {theirs:.8f} in pytorch_gpt.py (Note [Model check])")
    print(f"model check: train_gpt's checkpoint after {CHECK_STEPS} steps, validation loss "
          f"{ours:.8f} in train_gpt, {theirs:.8f} in pytorch_gpt.py (difference "
          f"{abs(ours - theirs):.1e}, at most {CHECK_TOLERANCE:.0e}: the same function)",
          flush=True)


def median_rss(runs):
    return [statistics.median(r["peak_rss_mib"][i] for r in runs)
            for i in range(len(runs[0]["peak_rss_mib"]))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build/release",
                    help="build tree with examples/train_gpt and tools/lockstep")
    ap.add_argument("--data", default="build/gpt-data", help="train_gpt --prepare's directory")
    ap.add_argument("--steps", type=int, default=25, help="optimizer steps per job")
    ap.add_argument("--skip", type=int, default=5, help="first steps left out of tokens/s")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    ap.add_argument("--only", help="comma-separated row keys: " + ",".join(r[0] for r in ROWS))
    ap.add_argument("--lockstep-backend", default="", help="train_gpt --backend (default: its own)")
    ap.add_argument("--python", default="/usr/bin/python3", help="the Python with torch 1.13")
    ap.add_argument("--json", help="write every run's figures here")
    ap.add_argument("--no-model-check", action="store_true",
                    help="skip the check that both compute the same function (Note [Model check])")
    a = ap.parse_args()
    if not 0 <= a.skip < a.steps:
        ap.error(f"--skip must be in [0, --steps), got {a.skip}")
    if a.steps < 2:
        ap.error("--steps must be at least 2 (train_gpt's warmup must be below its steps)")
    rows = ROWS
    if a.only:
        keys = a.only.split(",")
        unknown = set(keys) - {r[0] for r in ROWS}
        if unknown:
            ap.error(f"unknown --only rows {sorted(unknown)}")
        rows = [r for r in ROWS if r[0] in keys]
    warmup = min(30, a.steps - 1)  # train_gpt's default warmup where the run is long enough
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    torch_version = subprocess.run([a.python, "-c", "import torch; print(torch.__version__)"],
                                   stdout=subprocess.PIPE, text=True).stdout.strip()
    started = datetime.datetime.now(datetime.timezone.utc)
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                if l.startswith("model name")), platform.processor())
    print(f"gpt_compare {started:%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores ({cpu}), PyTorch "
          f"{torch_version}; {a.steps} steps per job, tokens/s over steps {a.skip + 1}-{a.steps}, "
          f"{a.threads} thread(s) per process, median of {a.rounds} rounds", flush=True)

    if not a.no_model_check:
        check_same_model(a, env)

    results = {r[0]: [] for r in rows}
    for rnd in range(a.rounds):
        for k in range(len(rows)):
            row = rows[(k + rnd) % len(rows)]
            fn = run_lockstep if row[1] == "lockstep" else run_pytorch
            res = fn(row, a, env, warmup)
            results[row[0]].append(res)
            print(f"  round {rnd + 1}: {label(row):45s} tokens/s {res['tokens_per_s']:8.0f}",
                  flush=True)

    med = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in results.items()}
    print("\n| job | tokens/s | MFU | peak RSS per rank (MiB) | rank 0 last-step loss "
          "| lockstep/PyTorch |")
    print("|---|---:|---:|---|---:|---:|")
    verdict = []
    for row in rows:
        key, runs, vs = row[0], results[row[0]], row[5]
        mfus = [r["mfu"] for r in runs if r["mfu"] is not None]
        mfu = f"{100 * statistics.median(mfus):.1f}%" if mfus else "-"
        rss = " / ".join(f"{x:.0f}" for x in median_rss(runs))
        loss = statistics.median(r["last_loss"] for r in runs)
        ratio = "-"
        if vs in med:
            per_round = [l["tokens_per_s"] / p["tokens_per_s"] for l, p in zip(runs, results[vs])]
            ratio = (f"{med[key] / med[vs]:.2f}x ({min(per_round):.2f}-{max(per_round):.2f} "
                     f"by round)")
            if row[2] == 2 and row[4] == 0:
                r = med[key] / med[vs]
                verdict.append(f"{'bf16' if row[3] == 'bf16' else 'f32'} {r:.2f}x "
                               f"({'met' if r >= 1.5 else 'not met'})")
        print(f"| {label(row)} | {med[key]:.0f} | {mfu} | {rss} | {loss:.3f} | {ratio} |")
    backends = sorted({r["backend"] for row in rows if row[1] == "lockstep" and row[2] > 1
                       for r in results[row[0]]})
    if backends:
        print(f"\nlockstep's 2-process rows ran over its {'/'.join(backends)} backend, PyTorch's "
              f"over gloo; {a.threads} intra-op thread(s) per process "
              f"(OMP_NUM_THREADS={a.threads})")
    if verdict:
        print(f"lockstep >= 1.5x PyTorch's tokens/s at 2 processes: {', '.join(verdict)}")
    elapsed = datetime.datetime.now(datetime.timezone.utc) - started
    print(f"(the whole comparison took {elapsed.total_seconds() / 60:.1f} minutes)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"started": started.isoformat(), "steps": a.steps, "skip": a.skip,
                       "rounds": a.rounds, "threads": a.threads, "torch": torch_version,
                       "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
