"""`save.every: auto` in a real loop: the interval it picks from the measured stall, per save mode.

A model of `--mb` MB of float32 parameters + AdamW state trains for `--seconds`, saving
whenever `mgr.should_save(step)` says, with `save.async: off` and then `thread`, and a
declared MTBF of `--mtbf` seconds (short, so that a run of a minute shows several saves).
It prints, per mode: the mean stall the manager measured, the interval Young/Daly gives
(sqrt(2 x stall x MTBF)), the saves taken, and the expected goodput. A cheaper save (async)
is taken more often at the same MTBF.

    python benchmarks/bench_auto_cadence.py --mb 200 --seconds 60 --mtbf 120
    python benchmarks/bench_auto_cadence.py --quick          # smoke test: seconds
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

import statereg


def run(mode: str, mb: int, seconds: float, mtbf: float, root: str) -> dict[str, float]:
    torch.manual_seed(0)
    width = max(8, int((mb * 2**20 / 4) ** 0.5))
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    spec = {"storage": {"url": f"{root}/{mode}"},
            "components": {"model": {"kind": "model"}, "optimizer": {"kind": "optimizer"}},
            "save": {"async": mode, "every": "auto", "mtbf": mtbf, "keep_last": 2}}
    saved = []
    with statereg.CheckpointManager(spec, model=model, optimizer=optimizer) as mgr:
        step = 0
        started = time.perf_counter()
        while time.perf_counter() - started < seconds:
            step += 1
            model(torch.randn(32, width)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            if mgr.should_save(step):
                mgr.save(step)
                saved.append(time.perf_counter() - started)
        report = mgr.cadence
    return {"steps": step, "saves": len(saved), "stall_s": report.stall_s or 0.0,
            "interval_s": report.interval_s, "goodput": report.goodput,
            "first_save_s": saved[0] if saved else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--mtbf", type=float, default=120.0)
    parser.add_argument("--quick", action="store_true", help="tiny and short: a smoke test")
    args = parser.parse_args()
    if args.quick:
        args.mb, args.seconds, args.mtbf = 1, 2.0, 1.0
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as root:
        results = {mode: run(mode, args.mb, args.seconds, args.mtbf, root)
                   for mode in ("off", "thread")}
    print(f"{'mode':8} {'stall s':>8} {'interval s':>10} {'saves':>6} {'goodput':>8}")
    for mode, r in results.items():
        print(f"{mode:8} {r['stall_s']:8.3f} {r['interval_s']:10.2f} {r['saves']:6d} "
              f"{r['goodput']:8.2%}")
    print(json.dumps({"args": vars(args), "results": results}))


if __name__ == "__main__":
    main()
