#!/usr/bin/env python3
"""PyTorch 1.x's TCPStore, an older wire protocol, as the peer of cohort's tcp_store.

Run by tests/test_store.cpp to check that cohort names the protocol mismatch instead of
blaming the address (Debian's python3-torch is 1.13):

  torch1_store_peer.py server       hosts a 1.x TCPStore, prints "PORT <n>", serves until
                                    stdin closes (at most 60 s)
  torch1_store_peer.py client PORT  a 1.x client of cohort's server at 127.0.0.1:PORT;
                                    prints "RESULT ok" or "RESULT <the error it got>"
Without a PyTorch 1.x the first line is "SKIP <reason>".
"""

import datetime
import signal
import sys

signal.alarm(60)


def reason_to_skip():
    try:
        import torch
        import torch.distributed  # noqa: F401
    except Exception as failure:
        return f"{sys.executable} cannot import torch.distributed ({failure!r}); apt-get install python3-torch"
    if int(torch.__version__.split(".")[0]) >= 2:
        return f"{sys.executable} has torch {torch.__version__}, which speaks the current protocol"
    return None


def main():
    why = reason_to_skip()
    if why is not None:
        print(f"SKIP {why}", flush=True)
        return 0
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=10)
    if sys.argv[1] == "server":
        store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout, wait_for_workers=False)
        print(f"PORT {store.port}", flush=True)
        sys.stdin.read()
        return 0
    if sys.argv[1] == "client":
        try:
            client = dist.TCPStore("127.0.0.1", int(sys.argv[2]), 2, False, timeout)
            client.set("from-torch-1", "x")
            print("RESULT ok", flush=True)
        except Exception as failure:
            print(f"RESULT {failure}", flush=True)
        return 0
    print(f"unknown mode {sys.argv[1]}", flush=True)
    return 2


if __name__ == "__main__":
    sys.exit(main())
