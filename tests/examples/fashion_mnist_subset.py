"""Writes the first samples of the installed Fashion-MNIST as plain IDX files, for the example
tests whose point is not the data: equalities between runs (sharded against plain DDP, resumed
against straight, emulated GPUs against the CPU), a stop, a shape of batches. Each process of
train_fashion_mnist decompresses and scales its whole train split before its first step (about
1.2 of its 1.8 s with no evaluation); a run of 30 steps on 3 ranks reads under 6000 samples.

Usage: python3 fashion_mnist_subset.py OUT_DIR N_TRAIN [N_TEST] [SOURCE_DIR]
(N_TEST defaults to the whole test split, 10000; SOURCE_DIR to the Debian package's directory.)
The files are the source's bytes: the IDX header with the count made N, then the first N items.
"""
import gzip
import os
import struct
import sys

out, n_train = sys.argv[1], int(sys.argv[2])
n_test = int(sys.argv[3]) if len(sys.argv) > 3 else 10000
src = sys.argv[4] if len(sys.argv) > 4 else "/usr/share/datasets/fashion-mnist"
os.makedirs(out, exist_ok=True)
for split, n in (("train", n_train), ("t10k", n_test)):
    for kind, item in (("images-idx3", 28 * 28), ("labels-idx1", 1)):
        name = f"{split}-{kind}-ubyte"
        path = os.path.join(src, name)
        f = open(path, "rb") if os.path.exists(path) else gzip.open(path + ".gz", "rb")
        with f:
            magic = f.read(4)
            ndim = magic[3]
            dims = struct.unpack(f">{ndim}I", f.read(4 * ndim))
            assert 0 < n <= dims[0], f"{name}: asked for {n} of its {dims[0]} items"
            data = f.read(n * item)
            assert len(data) == n * item, f"{name}: short read"
        with open(os.path.join(out, name), "wb") as g:
            g.write(magic + struct.pack(f">{ndim}I", n, *dims[1:]) + data)
