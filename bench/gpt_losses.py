#!/usr/bin/python3
"""train_gpt and the same GPT in PyTorch (bench/pytorch_gpt.py), step for step: the same
initial weights and the same batches, then the two lists of per-step losses side by side.

    python3 bench/gpt_losses.py --train-gpt build/release/examples/train_gpt --data DIR
        [--device cpu|cuda] [--steps 10] [--rtol 1e-4] [--json OUT] [-- MODEL FLAGS...]

pytorch_gpt.py initializes the model (GPT-2's init from its seed), writes the weights under
train_gpt's names (--save-init) and trains --steps steps on the windows in file order
(--no-shuffle); train_gpt starts from that file (--init) on the same windows (--no-shuffle),
with the same model, optimizer and schedule flags (those after `--`, given to both; both take
train_gpt's defaults otherwise). In f32, with TF32 off on a GPU, the losses must agree within
--rtol relative at every step; the exit status is 1 where they do not. One process each
(--device cuda: GPU 0). Needs torch (Debian's python3-torch for the CPU, PyTorch 2 for
--device cuda) and a built train_gpt; not part of the tests.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    argv = sys.argv[1:]
    model = []
    if "--" in argv:
        model = argv[argv.index("--") + 1:]
        argv = argv[:argv.index("--")]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--train-gpt", required=True, help="the train_gpt program")
    ap.add_argument("--data", required=True, help="train_gpt --prepare's directory")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rtol", type=float, default=1e-4)
    ap.add_argument("--python", default=sys.executable, help="the Python with torch")
    ap.add_argument("--json", help="also write the result here")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init.safetensors")
        torch_json = os.path.join(tmp, "torch.json")
        metrics = os.path.join(tmp, "metrics.jsonl")
        common = ["--data", a.data, "--device", a.device, "--no-shuffle"] + model
        torch_cmd = [a.python, os.path.join(HERE, "pytorch_gpt.py"), *common, "--steps",
                     str(a.steps), "--skip", "0", "--save-init", init, "--json", torch_json]
        lockstep_cmd = [a.train_gpt, *common, "--max-steps", str(a.steps), "--eval-every",
                        str(a.steps), "--eval-batches", "1", "--init", init, "--metrics", metrics]
        for what, cmd in (("pytorch_gpt.py", torch_cmd), ("train_gpt", lockstep_cmd)):
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"gpt_losses: {what} failed (exit {done.returncode}): {' '.join(cmd)}\n"
                         f"{done.stdout[-3000:]}{done.stderr[-3000:]}")
        theirs = json.load(open(torch_json))["losses"]
        ours = [json.loads(line)["loss"] for line in open(metrics)
                if json.loads(line).get("kind") == "train"]
    if len(ours) != len(theirs) or not ours:
        sys.exit(f"gpt_losses: {len(ours)} train_gpt steps against {len(theirs)} of PyTorch")
    rel = [abs(x - y) / abs(y) for x, y in zip(ours, theirs)]
    result = {"device": a.device, "steps": a.steps, "model_flags": model, "rtol": a.rtol,
              "lockstep": ours, "pytorch": theirs, "max_rel_diff": max(rel),
              "agree": max(rel) <= a.rtol}
    for i, (x, y, r) in enumerate(zip(ours, theirs, rel), 1):
        print(f"step {i:3d}  lockstep {x:.7f}  pytorch {y:.7f}  relative difference {r:.2e}")
    print(json.dumps({k: v for k, v in result.items() if k not in ("lockstep", "pytorch")}))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f)
    sys.exit(0 if result["agree"] else 1)


if __name__ == "__main__":
    main()
