#!/usr/bin/env python3
"""PyTorch eager on the same GPU, measured as bench/cuda/cuda_bench.cpp measures lockstep.

GEMM TFLOP/s (4096^3 and 8192^3, bf16 and f32 with TF32), device-to-device copy bandwidth, and
the training step of the Fashion-MNIST MLP and CNN (examples/fashion_mnist_models.h, the same
layers and initial shapes) with SGD(momentum 0.9) on synthetic batches already on the GPU, f32
and bf16 autocast. Each figure is the mean over timed repetitions after warm-up ones, between two
CUDA events. Writes one JSON object (stdout, or --json FILE).

    python3 bench/pytorch_cuda.py [--json FILE] [--quick]
"""
import argparse
import json
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


def time_ms(fn, warmup, reps):
    for _ in range(warmup):
        fn()
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / reps


def gemm(size, dtype, quick):
    tf32 = dtype == torch.float32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    g = torch.Generator(device="cuda").manual_seed(size)
    a = torch.randn(size, size, device="cuda", dtype=dtype, generator=g)
    b = torch.randn(size, size, device="cuda", dtype=dtype, generator=g)
    ms = time_ms(lambda: torch.matmul(a, b), 3, 3 if quick else 10)
    torch.backends.cuda.matmul.allow_tf32 = False
    tflops = 2.0 * size**3 / (ms * 1e-3) / 1e12
    print(f"torch gemm {size}^3 {dtype}: {tflops:.1f} TFLOP/s", file=sys.stderr)
    return {"m": size, "n": size, "k": size,
            "dtype": "bf16" if dtype == torch.bfloat16 else "f32", "tf32": tf32,
            "torch_ms": ms, "torch_tflops": tflops}


def copy(quick):
    n = 1 << 28
    src = torch.zeros(n, device="cuda")
    dst = torch.empty(n, device="cuda")
    ms = time_ms(lambda: dst.copy_(src), 3, 5 if quick else 20)
    gbs = 2.0 * n * 4 / (ms * 1e-3) / 1e9
    print(f"torch copy 1 GiB: {gbs:.0f} GB/s", file=sys.stderr)
    return {"bytes": n * 4, "torch_gbs": gbs}


def model(kind):
    if kind == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 1024), nn.ReLU(),
                             nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    return nn.Sequential(nn.Conv2d(1, 32, 3), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(1600, 128), nn.ReLU(), nn.Linear(128, 10))


def train(kind, batch, amp, quick):
    torch.manual_seed(0)
    m = model(kind).cuda()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn(batch, 1, 28, 28, device="cuda")
    y = torch.randint(0, 10, (batch,), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            loss = F.cross_entropy(m(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    ms = time_ms(step, 10, 20 if quick else 200)
    sps = batch / (ms * 1e-3)
    print(f"torch train {kind} batch {batch} {'amp bf16' if amp else 'f32'}: {ms:.3f} ms/step, "
          f"{sps:.0f} samples/s", file=sys.stderr)
    return {"model": kind, "batch": batch, "dtype": "amp_bf16" if amp else "f32",
            "ms_per_step": ms, "samples_per_s": sps}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("pytorch_cuda.py: torch sees no GPU", file=sys.stderr)
        return 3
    torch.backends.cudnn.benchmark = False  # as lockstep: no autotuning pass
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "gemm": [gemm(s, dt, args.quick) for s in (4096, 8192)
                    for dt in (torch.bfloat16, torch.float32)],
           "copy": copy(args.quick),
           "train": [train(k, b, amp, args.quick) for k in ("mlp", "cnn") for b in (64, 512)
                     for amp in (False, True)]}
    text = json.dumps(out, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
