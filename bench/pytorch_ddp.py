#!/usr/bin/python3
"""PyTorch's DDP (Gloo) on the same models and settings as bench/ddp.cpp, for comparison.

    /usr/bin/python3 bench/pytorch_ddp.py [--models mlp,cnn] [--batch 64] [--steps 40]
                                          [--warmup 5] [--rounds 5]

Needs Debian's python3-torch; not part of the build or the tests. Each configuration runs as
fresh processes (this script re-runs itself per rank with torchrun's variables); rounds rotate
the order, and the table shows medians over rounds, as bench/ddp.cpp does. Data are random
tensors of Fashion-MNIST's shape (speed does not depend on the pixels).
"""
import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

CONFIGS = [  # name, processes, threads per process, DataParallel-free
    ("1 process, 1 thread", 1, 1),
    ("DDP, 2 processes x 1 thread", 2, 1),
]


def build(kind, torch):
    nn = torch.nn
    if kind == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024),
                             nn.ReLU(), nn.Linear(1024, 10))
    return nn.Sequential(nn.Conv2d(1, 32, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 3),
                         nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(1600, 128), nn.ReLU(),
                         nn.Linear(128, 10))


def worker(kind, batch, warmup, steps, out):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    world = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    model = build(kind, torch)
    if world > 1:
        dist.init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(int(os.environ["RANK"]))
    batches = [(torch.randn(batch, 1, 28, 28, generator=g), torch.randint(0, 10, (batch,), generator=g))
               for _ in range(16)]
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(i):
        x, y = batches[i % len(batches)]
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    for i in range(warmup):
        step(i)
    if world > 1:
        dist.barrier()
    t0 = time.perf_counter()
    for i in range(steps):
        step(warmup + i)
    secs = time.perf_counter() - t0
    if int(os.environ["RANK"]) == 0:
        with open(out, "w") as f:
            f.write(f"{steps * batch * world / secs} {secs / steps * 1e3}\n")
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(cfg, kind, args):
    _, procs, threads = cfg
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.txt")
        port = free_port()
        ranks = []
        for r in range(procs):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(procs), LOCAL_RANK=str(r),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       OMP_NUM_THREADS=str(threads))
            ranks.append(subprocess.Popen([sys.executable, __file__, "--worker", kind,
                                           str(args.batch), str(args.warmup), str(args.steps),
                                           out], env=env))
        if any(p.wait() != 0 for p in ranks):
            sys.exit(f"pytorch_ddp: the job '{cfg[0]}' ({kind}) failed")
        with open(out) as f:
            sps, ms = map(float, f.read().split())
    return sps, ms


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        kind, batch, warmup, steps, out = sys.argv[2:7]
        worker(kind, int(batch), int(warmup), int(steps), out)
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="mlp,cnn")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    import torch
    print(f"PyTorch {torch.__version__} DDP (gloo), batch {args.batch} per process, "
          f"{os.cpu_count()} cores, median of {args.rounds} rounds")
    for kind in args.models.split(","):
        res = {c[0]: [] for c in CONFIGS}
        eff = []
        for r in range(args.rounds):
            got = {}
            for k in range(len(CONFIGS)):
                cfg = CONFIGS[(k + r) % len(CONFIGS)]
                got[cfg[0]] = run_config(cfg, kind, args)
            for name, v in got.items():
                res[name].append(v)
            eff.append(got[CONFIGS[1][0]][0] / (2 * got[CONFIGS[0][0]][0]))
        print(f"\n{kind}")
        for name, v in res.items():
            print(f"{name:38s} samples/s {statistics.median(x[0] for x in v):8.0f}  "
                  f"step ms {statistics.median(x[1] for x in v):7.2f}")
        print(f"scaling efficiency (DDP 2 procs / (2 x 1 proc)): {statistics.median(eff):.2f}")


if __name__ == "__main__":
    main()
