#!/usr/bin/python3
"""examples/train_gpt's GPT in PyTorch DDP (Gloo), on the same token files, for comparison.

    /usr/bin/python3 bench/pytorch_gpt.py --data build/gpt-data [--nproc 2] [--amp bf16]
        [--steps 300] [--skip 5] [--threads 1] [--json OUT]
    /usr/bin/python3 bench/pytorch_gpt.py --data build/gpt-data --check CKPT
    python3 bench/pytorch_gpt.py --data DIR --device cuda [--compile] --amp bf16 --n-layer 12
        --n-head 12 --n-embd 768 --block-size 1024 --vocab-size 50304 --batch-size 8 --steps 20

Needs Debian's python3-torch (1.13) and numpy; not part of the build or the tests. One job: the
script re-runs itself once per rank with torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR,
...), each rank on --threads intra-op threads, and prints one JSON line (and writes it to
--json): tokens/s over the steps after the first --skip, the loss, and every rank's peak
resident memory (getrusage's ru_maxrss, as train_gpt reports it). bench/gpt_compare.py runs it
beside train_gpt.
--check CKPT trains nothing: it loads a checkpoint train_gpt wrote (--save) into this model and
prints its validation loss over the windows train_gpt's one-process evaluation reads, which
must be train_gpt's val_loss for the same parameters if the two models compute the same
function (gpt_compare.py checks this before it measures).
--save-init FILE writes the model's initial weights as safetensors under train_gpt's names, and
--no-shuffle reads the windows in file order: with train_gpt --init FILE --no-shuffle and the
same flags, the two train the same model on the same batches, and their per-step losses (in the
JSON's "losses") must agree (bench/gpt_compare.py --losses; scripts/gpu-check.sh on a GPU).
--device cuda (PyTorch 2, one GPU per rank, NCCL between them) runs the same model on the GPU
with F.scaled_dot_product_attention, AdamW fused, and reports the peak of device memory in
tensors (torch.cuda.max_memory_allocated) beside tokens/s; --compile wraps the model in
torch.compile (its first steps compile: keep them in --skip). scripts/gpu-check.sh runs it beside
train_gpt on GPT-2 124M.

The same model as examples/gpt_model.h: token + learned position embeddings, pre-LayerNorm
blocks of causal self-attention (one Linear for q, k, v; F.scaled_dot_product_attention where
the torch has it, else, as in torch 1.13, q k^T * D^-1/2, the causal mask, softmax, @ v) and a
tanh-GELU MLP, a final LayerNorm, the head tied to the token embedding; GPT-2's init (N(0, 0.02),
the two projections into the residual stream at 0.02 / sqrt(2 n_layer), zero biases). The same
training: AdamW (decay on the matrices only, eps 1e-8), linear warmup then cosine to
--min-lr-factor, the gradients' global norm clipped, --amp bf16 as torch.autocast('cpu',
bfloat16) with the loss in f32. The same data: windows of block_size + 1 tokens at a stride of
block_size, shuffled per epoch and dealt round-robin to the ranks as DistributedSampler does
(another permutation than lockstep's Philox one: the same count of tokens per step, not the same
windows).
"""
import argparse
import json
import math
import os
import re
import resource
import socket
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

HEADER_BYTES = 32  # include/lockstep/data/token_file.h, Note [Token file format]


def read_tokens(path):
    """A token file's tokens as a read-only numpy array (u8 or u16), its header checked."""
    with open(path, "rb") as f:
        header = f.read(HEADER_BYTES)
    if len(header) != HEADER_BYTES or header[:8] != b"LSTOKENS":
        sys.exit(f"pytorch_gpt: {path} is not a token file (expected the magic LSTOKENS)")
    version, width = struct.unpack_from("<II", header, 8)
    (count,) = struct.unpack_from("<Q", header, 16)
    (vocab,) = struct.unpack_from("<I", header, 24)
    if version != 1 or width not in (1, 2):
        sys.exit(f"pytorch_gpt: {path}: expected version 1 with 1- or 2-byte tokens, got "
                 f"version {version}, width {width}")
    dtype = np.uint8 if width == 1 else np.uint16
    tokens = np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(count,))
    return tokens, vocab


def lr_factor(step, warmup, max_steps, min_factor):
    """lockstep's optim::warmup_cosine (or cosine_decay without warmup) at `step`."""
    if step < warmup:
        return (step + 1) / warmup
    total, s = max_steps - warmup, step - warmup
    if s >= total:
        return min_factor
    return min_factor + (1 - min_factor) * 0.5 * (1 + math.cos(math.pi * s / total))


def model_vocab(a, data_vocab):
    """train_gpt's: --vocab-size pads the data's vocabulary, 0 keeps it."""
    if a.vocab_size and a.vocab_size < data_vocab:
        sys.exit(f"pytorch_gpt: --vocab-size {a.vocab_size} is below the data's {data_vocab}")
    return a.vocab_size or data_vocab


def build_model(torch, vocab, a):
    nn, F = torch.nn, torch.nn.functional
    C, H, L, T = a.n_embd, a.n_head, a.n_layer, a.block_size
    resid_std = 0.02 / math.sqrt(2 * L)

    def linear(i, o, std):
        lin = nn.Linear(i, o)
        nn.init.normal_(lin.weight, 0.0, std)
        nn.init.zeros_(lin.bias)
        return lin

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = linear(C, 3 * C, 0.02)
            self.c_proj = linear(C, C, resid_std)
            # A plain attribute, not a buffer: DDP would broadcast a buffer before every forward.
            self.future = None

        def forward(self, x):  # (B,T,C)
            B, t, _ = x.shape
            q, k, v = self.c_attn(x).view(B, t, 3, H, C // H).permute(2, 0, 3, 1, 4)  # (B,H,t,D)
            if hasattr(F, "scaled_dot_product_attention"):
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                return self.c_proj(y.transpose(1, 2).contiguous().view(B, t, C))
            if self.future is None:
                self.future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // H))  # (B,H,t,t)
            att = att.masked_fill(self.future[:t, :t], float("-inf")).softmax(dim=-1)
            y = (att @ v).transpose(1, 2).contiguous().view(B, t, C)
            return self.c_proj(y)

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc, self.c_proj = linear(C, 4 * C, 0.02), linear(4 * C, C, resid_std)

        def forward(self, x):
            return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.attn = nn.LayerNorm(C), Attention()
            self.ln_2, self.mlp = nn.LayerNorm(C), Mlp()

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class Gpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, C), nn.Embedding(T, C)
            nn.init.normal_(self.wte.weight, 0.0, 0.02)
            nn.init.normal_(self.wpe.weight, 0.0, 0.02)
            self.h = nn.ModuleList(Block() for _ in range(L))
            self.ln_f = nn.LayerNorm(C)

        def forward(self, idx):  # (B,T) i64 -> (B,T,V)
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for block in self.h:
                x = block(x)
            return F.linear(self.ln_f(x), self.wte.weight)  # tied head

    return Gpt()


class Windows:
    """TokenWindowDataset + DistributedSampler(shuffle, pad) + DataLoader(drop_last): batches of
    (input, target) i64 (B,T), epoch after epoch."""

    def __init__(self, tokens, block, batch, rank, world, seed, shuffle=True):
        self.tokens, self.T, self.B, self.shuffle = tokens, block, batch, shuffle
        self.rank, self.world, self.seed = rank, world, seed
        self.n = (len(tokens) - 1) // block
        self.per_rank = -(-self.n // world)
        if self.per_rank // batch == 0:
            sys.exit(f"pytorch_gpt: {self.n} windows make no batch of {batch} per rank")

    def batches(self):
        import torch
        epoch = 0
        while True:
            perm = (np.random.default_rng(self.seed + epoch).permutation(self.n) if self.shuffle
                    else np.arange(self.n))
            order = np.resize(perm, self.per_rank * self.world)  # padded cyclically
            mine = order[self.rank::self.world]
            for b in range(len(mine) // self.B):
                rows = np.stack([self.tokens[i * self.T:i * self.T + self.T + 1]
                                 for i in mine[b * self.B:(b + 1) * self.B]]).astype(np.int64)
                rows = torch.from_numpy(rows)
                yield rows[:, :-1], rows[:, 1:]
            epoch += 1


def worker(a, out_dir):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(a.threads)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(a.seed)
    tokens, vocab = read_tokens(os.path.join(a.data, "train.tokens"))
    cuda = a.device == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else None
    if cuda:
        torch.cuda.set_device(device)
    gpt = build_model(torch, model_vocab(a, vocab), a)
    if a.save_init and rank == 0:
        save_weights(gpt, a.save_init)
    if cuda:
        gpt = gpt.to(device)
        if a.amp == "none":  # f32 products as f32, as train_gpt's (TF32 is off there too)
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
    model = gpt
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo")
        # Broadcasts rank 0's parameters.
        model = torch.nn.parallel.DistributedDataParallel(gpt, device_ids=[device] if cuda else None)
    if a.compile:
        model = torch.compile(model)
    params = list(gpt.parameters())
    opt = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": a.weight_decay},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=a.lr, betas=(a.beta1, a.beta2), eps=1e-8, **({"fused": True} if cuda else {}))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, a.warmup_steps, a.steps, a.min_lr_factor))
    data = Windows(tokens, a.block_size, a.batch_size, rank, world, a.seed,
                   shuffle=not a.no_shuffle).batches()
    bf16 = a.amp == "bf16"
    times, losses = [], []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        x, y = next(data)
        if cuda:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast(a.device, dtype=torch.bfloat16, enabled=bf16):
            logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]),
                                                 y.reshape(-1))
        loss.backward()
        if a.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, a.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())  # waits for the step (a GPU's too)
        times.append(time.perf_counter() - t0)
    measured = times[a.skip:]
    result = {
        "rank": rank,
        "tokens_per_s": a.batch_size * world * a.block_size * len(measured) / sum(measured),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "losses": losses,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
    }
    if cuda:
        result["peak_device_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def lockstep_name(name):
    """h.0.attn.c_attn.weight -> model.h0.attn.c_attn.weight (train_gpt's checkpoint names)."""
    return "model." + re.sub(r"^h\.(\d+)\.", r"h\1.", name)


def save_weights(gpt, path):
    """The model's parameters as an f32 safetensors file under train_gpt's names."""
    header, blobs, offset = {}, [], 0
    for name, p in gpt.state_dict().items():
        data = p.detach().to("cpu").float().contiguous().numpy().tobytes()
        header[lockstep_name(name)] = {"dtype": "F32", "shape": list(p.shape),
                                       "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for b in blobs:
            f.write(b)


def check(a):
    """--check CKPT: train_gpt's checkpoint (safetensors, f32) loaded into this model, the mean
    loss over the first --eval-batches x --batch-size windows of val.tokens in order: train_gpt's
    val_loss on one process for the same parameters, if the two models compute the same."""
    import torch
    torch.set_num_threads(a.threads)
    with open(a.check, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack_from("<Q", raw, 0)
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    state = {}
    for key, v in header.items():
        if not key.startswith("model."):
            continue
        if v["dtype"] != "F32":
            sys.exit(f"pytorch_gpt: {a.check}: {key} is {v['dtype']}, expected F32")
        b, e = v["data_offsets"]
        # model.h0.attn.c_attn.weight -> h.0.attn.c_attn.weight
        name = re.sub(r"^h(\d+)\.", r"h.\1.", key[len("model."):])
        state[name] = torch.from_numpy(np.frombuffer(data[b:e], dtype=np.float32).copy()
                                       .reshape(v["shape"]))
    tokens, vocab = read_tokens(os.path.join(a.data, "val.tokens"))
    gpt = build_model(torch, model_vocab(a, vocab), a)
    gpt.load_state_dict(state)  # strict: every parameter, no other
    T = a.block_size
    count = min((len(tokens) - 1) // T, a.eval_batches * a.batch_size)
    total = 0.0
    with torch.no_grad():
        for start in range(0, count, a.batch_size):
            idx = range(start, min(count, start + a.batch_size))
            rows = torch.from_numpy(np.stack([tokens[i * T:i * T + T + 1] for i in idx])
                                    .astype(np.int64))
            logits = gpt(rows[:, :-1])
            total += torch.nn.functional.cross_entropy(
                logits.view(-1, logits.shape[-1]), rows[:, 1:].reshape(-1)).item() * len(idx)
    return {"val_loss": total / count, "windows": count}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(a):
    """Runs the ranks, returns rank 0's figures with every rank's peak RSS."""
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        ranks = []
        for r in range(a.nproc):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(a.nproc), LOCAL_RANK=str(r),
                       LOCAL_WORLD_SIZE=str(a.nproc), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), OMP_NUM_THREADS=str(a.threads))
            cmd = [sys.executable, __file__, "--worker", tmp] + sys.argv[1:]
            ranks.append(subprocess.Popen(cmd, env=env))
        codes = [p.wait() for p in ranks]
        if any(codes):
            sys.exit(f"pytorch_gpt: a rank failed (exit codes {codes})")
        per_rank = []
        for r in range(a.nproc):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                per_rank.append(json.load(f))
    out = dict(per_rank[0])
    del out["rank"]
    out["peak_rss_mib"] = [p["peak_rss_mib"] for p in per_rank]
    if "peak_device_mib" in out:
        out["peak_device_mib"] = [p["peak_device_mib"] for p in per_rank]
    import torch
    out.update(torch=torch.__version__, nproc=a.nproc, threads=a.threads, amp=a.amp,
               steps=a.steps, skip=a.skip, device=a.device, compile=a.compile,
               batch_size=a.batch_size, block_size=a.block_size)
    return out


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True,
                    help="directory with train.tokens and val.tokens (train_gpt --prepare)")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    ap.add_argument("--amp", choices=["none", "bf16"], default="none")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: each rank on GPU LOCAL_RANK, NCCL between ranks (PyTorch 2)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--save-init", metavar="FILE",
                    help="write the initial weights here (safetensors, train_gpt's names)")
    ap.add_argument("--no-shuffle", action="store_true",
                    help="the windows in file order (train_gpt --no-shuffle)")
    ap.add_argument("--steps", type=int, default=300,
                    help="optimizer steps (the schedule's length, train_gpt's --max-steps)")
    ap.add_argument("--skip", type=int, default=5, help="first steps left out of tokens/s")
    ap.add_argument("--json", help="also write the result line here")
    ap.add_argument("--check", metavar="CKPT",
                    help="instead of training: train_gpt's checkpoint CKPT's validation loss here")
    ap.add_argument("--eval-batches", type=int, default=8, help="--check's batches")
    # train_gpt's defaults (examples/train_gpt_flags.h).
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--vocab-size", type=int, default=0,
                    help="the model's vocabulary padded beyond the data's (0: the data's)")
    ap.add_argument("--warmup-steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-factor", type=float, default=0.1)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--beta1", type=float, default=0.9)
    ap.add_argument("--beta2", type=float, default=0.95)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.check:
        return a
    if not 0 <= a.skip < a.steps:
        ap.error(f"--skip must be in [0, --steps), got {a.skip}")
    if a.warmup_steps >= a.steps:
        ap.error("--warmup-steps must be below --steps (as train_gpt's below --max-steps)")
    return a


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(parse(sys.argv[3:]), sys.argv[2])
        return
    a = parse(sys.argv[1:])
    out = check(a) if a.check else run_job(a)
    line = json.dumps(out)
    print(line)
    if a.json:
        with open(a.json, "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
