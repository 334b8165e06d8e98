#!/usr/bin/env python3
"""A minimal safetensors reader and writer on torch + struct + json, for lockstep's interop tests.

The `safetensors` package is not installed on the test machines; this follows the format as
safetensors.torch.save_file writes it (tensors sorted by alignment then name, header padded with
spaces to 8 bytes, no gaps) and validates it as safetensors.torch.load_file does.

  safetensors_torch.py write OUT   writes expected() and METADATA to OUT
  safetensors_torch.py check IN    loads IN and compares it with expected() and METADATA

Keep expected() in step with torch_expected() in safetensors_test.cpp.
"""
import json
import struct
import sys

import torch

DTYPES = {
    "F32": torch.float32, "F64": torch.float64, "BF16": torch.bfloat16, "F16": torch.float16,
    "I32": torch.int32, "I64": torch.int64, "U8": torch.uint8, "BOOL": torch.bool,
}
NAMES = {v: k for k, v in DTYPES.items()}
METADATA = {"format": "pt", "note": "from \"torch\"\n\u2713"}


def expected():
    i = torch.arange(24, dtype=torch.float64)
    n = torch.arange(24, dtype=torch.int64)
    return {
        "f32": (i * 0.5 - 3).float().reshape(2, 3, 4),
        "f64": (i / 3).reshape(4, 6),
        "bf16": (i * 0.25 - 2).to(torch.bfloat16).reshape(6, 4),
        "f16": (i * 0.125 - 1).to(torch.float16),
        "i32": (n * -1000 + 7).to(torch.int32).reshape(3, 8),
        "i64": (n - 12 + (1 << 40)).reshape(24, 1),
        "u8": (n * 11 % 256).to(torch.uint8).reshape(4, 6),
        "bool": (n % 3 == 0).reshape(2, 12),
        "scalar": torch.tensor(2.5, dtype=torch.float32),
        "empty": torch.zeros(0, 3, dtype=torch.float16),
    }


def save(tensors, path, metadata):
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header, offset, blobs = {}, 0, []
    if metadata:
        header["__metadata__"] = metadata
    for name in order:
        t = tensors[name].contiguous()
        blob = t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def load(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    assert 8 + n <= len(raw), f"header length {n} exceeds the file"
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    metadata = header.pop("__metadata__", {})
    tensors, end = {}, 0
    for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"]):
        assert set(e) == {"dtype", "shape", "data_offsets"}, f"{name}: fields {sorted(e)}"
        begin, stop = e["data_offsets"]
        assert begin == end, f"{name} starts at {begin}, expected {end}"
        dtype = DTYPES[e["dtype"]]
        numel = 1
        for d in e["shape"]:
            numel *= d
        size = torch.empty(0, dtype=dtype).element_size()
        assert stop - begin == numel * size, f"{name}: {stop - begin} bytes for {e}"
        if numel:
            t = torch.frombuffer(bytearray(data[begin:stop]), dtype=torch.uint8)
            t = t.view(dtype).reshape(e["shape"])
        else:
            t = torch.empty(e["shape"], dtype=dtype)
        tensors[name] = t
        end = stop
    assert end == len(data), f"{len(data) - end} bytes after the last tensor"
    return tensors, metadata


def check(path):
    got, metadata = load(path)
    want = expected()
    problems = []
    if sorted(got) != sorted(want):
        problems.append(f"names {sorted(got)}, expected {sorted(want)}")
    for name in sorted(set(got) & set(want)):
        g, w = got[name], want[name]
        if g.dtype != w.dtype or g.shape != w.shape or not torch.equal(g, w):
            problems.append(f"{name}: got {g.dtype} {list(g.shape)} {g.flatten()[:8].tolist()}, "
                            f"expected {w.dtype} {list(w.shape)} {w.flatten()[:8].tolist()}")
    if metadata != METADATA:
        problems.append(f"metadata {metadata!r}, expected {METADATA!r}")
    for p in problems:
        print(p)
    return 1 if problems else 0


def main(argv):
    if len(argv) != 3 or argv[1] not in ("write", "check"):
        print(__doc__)
        return 2
    if argv[1] == "write":
        save(expected(), argv[2], METADATA)
        return 0
    return check(argv[2])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
