"""Per-rank storage requests and bytes of one load on the S3 test server (moto), for
benchmarks/results/journal.md ("Loads read each stored byte once"). Run from the repository root:

    .venv/bin/python tests/distributed/read_once_figures.py --ranks 1 2 4

The checkpoint is test_read_once.py's: a `replicated` model and a `global` AdamW state,
saved by one process with four data files per component. Each rank loads it through a
relay port of its own (tests/s3_request_log.py), which logs every request and the body
bytes it returned between the rank's marks around `load()`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import fsspec  # noqa: E402
import torch  # noqa: E402
from harness import run_ranks  # noqa: E402
from s3_request_log import RequestLog, mark  # noqa: E402
from storage_servers import new_bucket, s3_options, start_server  # noqa: E402
from test_read_once import _net, _save_two_steps, _spec  # noqa: E402

import statereg  # noqa: E402


def load_marked(rank: int, world: int, url: str, per_rank: list[dict]) -> None:
    options = per_rank[rank]
    endpoint = options["client_kwargs"]["endpoint_url"]
    model = _net(seed=rank + 7)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    with statereg.CheckpointManager(_spec(url, options), model=model, optimizer=opt) as mgr:
        mark(endpoint, "load")
        mgr.load(step=1)
        mark(endpoint, "loaded")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server("moto_server", ["-m", "moto.server", "-H", "127.0.0.1", "-p",
                                              "{port}"], Path(tmp), "/moto-api/")
        try:
            fs = fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False,
                                   **s3_options(server.endpoint))
            url = f"s3://{new_bucket(fs)}/run"
            _save_two_steps(url, s3_options(server.endpoint))
            data = sum(info["size"] for path, info in
                       fs.find(url.removeprefix("s3://") + "/step_00000001", detail=True).items()
                       if path.endswith(".distcp"))
            print(f"statereg from {Path(statereg.__file__).parent}; data files of step 1: "
                  f"{data} bytes")
            print("ranks  rank  requests  data GETs  other requests  bytes read")
            for ranks in args.ranks:
                log = RequestLog(server.endpoint, ranks)
                per_rank = [s3_options(e) for e in log.endpoints]
                run_ranks(ranks, load_marked, Path(tmp), url, per_rank)
                total = 0
                for rank in range(ranks):
                    requests = log.logs[rank].between("load", "loaded")
                    gets = [r for r in requests if r.is_object_read
                            and r.path.endswith(".distcp")]
                    read = sum(r.body_bytes for r in requests)
                    total += read
                    print(f"{ranks:5d}  {rank:4d}  {len(requests):8d}  {len(gets):9d}  "
                          f"{len(requests) - len(gets):14d}  {read:10d}")
                print(f"{ranks:5d}   all  {'':8s}  {'':9s}  {'':14s}  {total:10d} "
                      f"({total / data:.3f} x the data)")
                log.close()
        finally:
            server.stop()


if __name__ == "__main__":
    main()
