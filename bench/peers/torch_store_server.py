#!/usr/bin/env python3
"""PyTorch's TCPStore server alone, for bench/bench_rendezvous.cpp: hosts one on 127.0.0.1
(a free port), prints "PORT <port>", and serves until its standard input closes. cohort's
clients then run the same start-up key pattern against it as against cohort's server.

    python3 bench/peers/torch_store_server.py [libuv|classic]

Without a PyTorch 2.x the only line is "SKIP <reason>" (the bench then reports the PyTorch
column as not measured).
"""
import datetime
import sys


def main():
    backend = sys.argv[1] if len(sys.argv) > 1 else "libuv"
    try:
        import torch
        import torch.distributed as dist
    except Exception as failure:  # not installed, or broken
        print(f"SKIP python cannot import torch.distributed ({failure!r})", flush=True)
        return 0
    if int(torch.__version__.split(".")[0]) < 2 or not dist.is_available():
        print(f"SKIP torch {torch.__version__} is not a PyTorch 2.x with torch.distributed", flush=True)
        return 0
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=600), wait_for_workers=False,
                          use_libuv=(backend == "libuv"))
    print(f"PORT {store.port} torch {torch.__version__} {backend}", flush=True)
    sys.stdin.read()  # serve until the bench closes our stdin
    return 0


if __name__ == "__main__":
    sys.exit(main())
