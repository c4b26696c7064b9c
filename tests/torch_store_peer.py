#!/usr/bin/env python3
"""PyTorch's TCPStore as the peer of cohort's tcp_store, run by tests/test_store.cpp.

  torch_store_peer.py master   hosts two TCPStore servers (the libuv backend and, where this
                               torch has it, the classic one), prints "PORTS <libuv> <classic>",
                               then plays its part of the exchange with cohort's client on each.
  torch_store_peer.py client PORT
                               prints "READY", then is a TCPStore client of cohort's server at
                               127.0.0.1:PORT.
Without a PyTorch 2.x the first line is "SKIP <reason>" instead (then the test skips).

Prints "OK" and exits 0 when every check held; otherwise prints what failed and exits 1.
The C++ side of each exchange is in test_store.cpp (look for the same key names).
"""

import datetime
import signal
import sys
import threading

signal.alarm(60)  # never outlive a hung exchange


def current_torch_or_reason():
    """None when a PyTorch 2.x with torch.distributed is importable, else why not."""
    try:
        import torch
        import torch.distributed
    except Exception as failure:  # not installed, or broken
        return f"python3 cannot import torch.distributed ({failure!r}); pip install torch"
    major = int(torch.__version__.split(".")[0])
    if major < 2:
        return (f"python3 has torch {torch.__version__}; Debian's python3-torch 1.x speaks an "
                f"older TCPStore numbering and does not count (pip install torch)")
    if not torch.distributed.is_available():
        return f"torch {torch.__version__} was built without torch.distributed"
    return None


SKIP_REASON = current_torch_or_reason()
if SKIP_REASON is None:
    import torch.distributed as dist  # noqa: E402

TIMEOUT = datetime.timedelta(seconds=20)


def expect(condition, what):
    if not condition:
        raise AssertionError(what)


def master_exchange(store, name):
    # Before the port is announced: values the cohort client reads.
    store.wait(["cpp/a"])
    expect(store.get("cpp/a") == b"hello", f"{name}: cpp/a is {store.get('cpp/a')!r}")
    store.set("py/late", "late")
    store.wait(["cpp/done"])
    expect(int(store.get("counter")) == 7, f"{name}: counter is {store.get('counter')!r}")
    expect(store.get("cas") == b"one", f"{name}: cas is {store.get('cas')!r}")
    expect(store.get("cpp/binary") == bytes(range(256)), f"{name}: binary value garbled")
    expect(not store.check(["cpp/deleted"]), f"{name}: cpp/deleted still present")


def run_master():
    stores = {
        name: dist.TCPStore("127.0.0.1", 0, None, True, TIMEOUT, wait_for_workers=False,
                            use_libuv=use_libuv)
        for name, use_libuv in (("libuv", True), ("classic", False))
    }
    for store in stores.values():
        store.set("py/x", "from-python")
        store.add("counter", 2)
    print(f"PORTS {stores['libuv'].port} {stores['classic'].port}", flush=True)

    failures = []

    def play(name):
        try:
            master_exchange(stores[name], name)
        except Exception as failure:  # reported below; the C++ side sees the exit status
            failures.append(f"{name}: {failure!r}")

    threads = [threading.Thread(target=play, args=(name,)) for name in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        print("FAILED " + "; ".join(failures), flush=True)
        return 1
    print("OK", flush=True)
    return 0


def run_client(port):
    store = dist.TCPStore("127.0.0.1", port, None, False, TIMEOUT)
    expect(store.get("cpp/x") == b"from-cpp", f"cpp/x is {store.get('cpp/x')!r}")
    store.set("py/a", "1")
    expect(store.add("n", 3) == 7, "add on n (cohort set 4) did not return 7")
    expect(store.check(["cpp/x"]), "check(cpp/x) is false")
    expect(not store.check(["cpp/x", "nope"]), "check(cpp/x, nope) is true")
    expect(store.compare_set("cas", "", "v") == b"v", "compare_set on an absent key")
    expect(store.compare_set("cas", "v", "w") == b"w", "compare_set with the right value")
    expect(store.compare_set("cas", "zz", "q") == b"w", "compare_set with a wrong value")
    store.wait(["cpp/late"])  # cohort sets it after it has seen py/a
    expect(store.get("cpp/late") == b"late", "cpp/late")
    try:
        store.wait(["never"], datetime.timedelta(milliseconds=200))
        raise AssertionError("wait for a key nobody sets returned")
    except AssertionError:
        raise
    except Exception:
        pass  # the timeout we asked for; the connection must still be in step:
    store.set("after-timeout", "1")
    expect(store.get("after-timeout") == b"1", "connection out of step after a wait timeout")
    expect(store.delete_key("py/a"), "delete_key(py/a) is false")
    expect(not store.delete_key("py/a"), "second delete_key(py/a) is true")
    expect(store.num_keys() >= 5, f"num_keys is {store.num_keys()}")
    store.append("app", "ab")
    store.append("app", "cd")
    expect(store.get("app") == b"abcd", f"append gave {store.get('app')!r}")
    store.multi_set(["m1", "m2"], ["a", "b"])
    expect(store.multi_get(["m1", "m2"]) == [b"a", b"b"], "multi_get")
    store.set("py/done", "1")
    print("OK", flush=True)
    return 0


def main():
    # The first line tells the C++ side whether to go on; importing torch takes seconds, so
    # this script checks the version rather than a second python3 process.
    if SKIP_REASON is not None:
        print(f"SKIP {SKIP_REASON}", flush=True)
        return 0
    if sys.argv[1] == "client":
        print("READY", flush=True)
    try:
        if sys.argv[1] == "master":
            return run_master()
        if sys.argv[1] == "client":
            return run_client(int(sys.argv[2]))
        print(f"unknown mode {sys.argv[1]}", flush=True)
        return 2
    except Exception as failure:
        print(f"FAILED {failure!r}", flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
