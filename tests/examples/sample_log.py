"""What the final model trained on, from the sample logs of train_fashion_mnist's
--test-sample-log (Note [Sample log] in examples/test_sample_log.h).

A run is one restart count of one file (separate `lockstep run` invocations each count from 0, so
each has its own file). Run by run in order, the run's records are kept less those of steps after
the step the next run resumed from (the next run's first step minus 1), which the crash lost.
"""
import collections


def read_records(path):
    out = []
    for line in open(path):
        fields = dict(f.split("=", 1) for f in line.split())
        out.append({k: (v if k == "samples" else int(v)) for k, v in fields.items()})
    return out


def runs_of(paths):
    """The runs in order: file by file, and within a file by restart count."""
    runs = []
    for path in paths:
        by_restart = collections.defaultdict(list)
        for r in read_records(path):
            by_restart[r["restart"]].append(r)
        runs += [by_restart[k] for k in sorted(by_restart)]
    return runs


def kept_records(paths):
    """(the kept records, [(resumed_at, dropped records)] for each run after the first)."""
    runs = runs_of(paths)
    kept, resumes = [], []
    for run, nxt in zip(runs, runs[1:] + [None]):
        resumed_at = min(r["step"] for r in nxt) - 1 if nxt else None
        dropped = [r for r in run if resumed_at is not None and r["step"] > resumed_at]
        kept += [r for r in run if resumed_at is None or r["step"] <= resumed_at]
        if nxt:
            resumes.append((resumed_at, dropped))
    return kept, resumes


def check_epoch(kept, size):
    """Every step once, by every rank of its world; the samples 0..size-1 each exactly once."""
    by_step = collections.defaultdict(list)
    for r in kept:
        by_step[r["step"]].append(r)
    steps = sorted(by_step)
    assert steps == list(range(1, len(steps) + 1)), f"steps {steps}, expected 1..{len(steps)}"
    for step, rs in by_step.items():
        world = rs[0]["world_size"]
        assert sorted(r["rank"] for r in rs) == list(range(world)), f"step {step}: ranks {rs}"
        assert all(r["world_size"] == world and r["epoch"] == 0 for r in rs), f"step {step}: {rs}"
    samples = collections.Counter(int(i) for r in kept for i in r["samples"].split(","))
    twice = sorted(i for i, n in samples.items() if n > 1)
    missing = sorted(set(range(size)) - set(samples))
    assert not twice and not missing and len(samples) == size, (
        f"{len(samples)} distinct samples, {len(twice)} seen more than once (e.g. {twice[:5]}), "
        f"{len(missing)} missing (e.g. {missing[:5]})")
    return by_step
