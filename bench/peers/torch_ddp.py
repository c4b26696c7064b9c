#!/usr/bin/env python3
"""PyTorch's side of bench/bench_reducer.cpp: DDP over Gloo with the same work as cohort's
side, ResNet-50-shaped parameters (161 tensors, 25.6 M) and a simulated backward that spends
a per-layer share of a calibrated compute time and produces each layer's gradient, back to
front.

A long-lived peer: bench_reducer starts it once and drives it sample by sample through its
standard input, so that its samples and cohort's alternate in the same A/B rounds
(bench/ab_rounds.hpp) instead of running before or after cohort's. One command a line; each
answer is one line `reply {json}` on standard output (anything else there is a log line):

    mode spin|sleep         the kind of compute, then the calibration of the backward alone
                            (per gradient mode: DDP's default, and bucket views) to
                            --compute-ms; replies with the compute times and the budgets
    sample VARIANT N        N steps of VARIANT (after a warm-up when new); replies with the
                            median step ms and the median CPU ms per step of all ranks
    drop                    frees every variant's model and optimizer
    quit

Variants (bucket views: `.grad` are views of DDP's buckets, as cohort's gradients are its
buffers; DDP's default copies them into its buckets, with its own calibrated compute):
    raw_sum      one dist.all_reduce of every gradient (sum, in place)
    ddp_views    DDP(gradient_as_bucket_view=True): the backward, reduced
    ddp          DDP with default settings: zero_grad(set_to_none=True), the backward
    ddp_adamw    a whole step: zero_grad(), the backward under DDP (bucket views),
                 clip_grad_norm_(1.0), torch.optim.AdamW(lr 1e-4, foreach=True).step()
    ddp_zero     the same with torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)

Without --serve it runs `mode`, then one sample of each variant, and prints the replies.
Exits with status 77 (skipped) when torch is not installed.

    python3 bench/peers/torch_ddp.py [--serve] [--ranks 2] [--compute-ms 120] [--forward-ms 0] [--iterations 4]
"""
import argparse
import datetime
import json
import os
import queue as queue_module
import socket
import statistics
import sys
import time

try:
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from torch.distributed.optim import ZeroRedundancyOptimizer
except ImportError:
    print("torch is not installed: PyTorch DDP peer skipped")
    sys.exit(77)


def resnet50_shapes():
    """torchvision resnet50 parameter sizes in declaration order (conv, bn weight, bn bias, fc)."""
    shapes = []

    def conv(out, inp, k):
        shapes.append(out * inp * k * k)

    def bn(c):
        shapes.extend([c, c])

    conv(64, 3, 7)
    bn(64)
    inp = 64
    for width, blocks in zip([64, 128, 256, 512], [3, 4, 6, 3]):
        for block in range(blocks):
            conv(width, inp, 1)
            bn(width)
            conv(width, width, 3)
            bn(width)
            conv(width * 4, width, 1)
            bn(width * 4)
            if block == 0:
                conv(width * 4, inp, 1)
                bn(width * 4)
            inp = width * 4
    shapes.extend([1000 * 2048, 1000])
    return shapes


class Compute:
    """The simulated backward's busy time: spin (a CPU trainer: the core is busy) or sleep (a
    GPU trainer's host thread, idle while its kernels run); its budget per gradient mode."""
    sleep = False
    budget = {"plain": 0.0, "views": 0.0}  # seconds per step, shared by the layers
    forward = 0.0  # --forward-ms: a simulated forward, seconds per step, in the variants with an optimizer


def spend(seconds):
    if Compute.sleep:
        time.sleep(seconds)
        return
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


class SimulatedLayer(torch.autograd.Function):
    """Forward passes the activation through; backward spends the layer's share of the
    compute budget and returns its gradient (a ready tensor, as a real kernel would fill)."""

    @staticmethod
    def forward(ctx, x, weight, share, gradient, kind):
        if kind == "step":
            spend(Compute.forward * share)
            kind = "views"
        ctx.share = share
        ctx.kind = kind
        ctx.gradient = gradient
        return x + 0.0

    @staticmethod
    def backward(ctx, grad_output):
        spend(Compute.budget[ctx.kind] * ctx.share)
        return grad_output, ctx.gradient, None, None, None


class Model(torch.nn.Module):
    def __init__(self, sizes, kind):
        super().__init__()
        total = sum(sizes)
        self.kind = kind
        self.weights = torch.nn.ParameterList([torch.nn.Parameter(torch.full((n,), 0.01)) for n in sizes])
        self.shares = [n / total for n in sizes]
        self.gradients = [torch.full((n,), 1e-3 * (i % 7)) for i, n in enumerate(sizes)]

    def forward(self, x):
        # Declaration order forward, so autograd runs the backward last layer first.
        for weight, share, gradient in zip(self.weights, self.shares, self.gradients):
            x = SimulatedLayer.apply(x, weight, share, gradient, self.kind)
        return x.sum()


def timed(fn, iterations):
    """Median wall ms of fn over `iterations` calls, every rank starting together, and the
    median CPU ms per call of all ranks' processes together (autograd, Gloo's I/O threads)."""
    times, cpu = [], []
    for _ in range(iterations):
        dist.barrier()
        cpu_start = time.process_time()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
        cpu.append((time.process_time() - cpu_start) * 1e3)
    cpu_all = torch.tensor([statistics.median(cpu)], dtype=torch.float64)
    dist.all_reduce(cpu_all)
    return statistics.median(times), cpu_all.item()


class Peer:
    def __init__(self, args):
        self.args = args
        self.sizes = resnet50_shapes()
        self.x = torch.ones(1, requires_grad=True)
        self.variants = {}

    def calibrate(self, kind, compute_step):
        """Sets the budget of `kind` so that compute_step (the backward alone) takes
        --compute-ms: rank 0's median decides for every rank. Up to 12 rounds, each moving the
        budget by the miss; a round that misses by more than the last keeps the better budget
        (a noisy sample must not throw the calibration off). Returns (compute ms, budget ms)."""
        target = self.args.compute_ms
        Compute.budget[kind] = target / 1e3
        compute_step()  # warm-up
        best = None  # (miss ms, compute ms, budget s)
        for round_index in range(12):
            compute_ms, _ = timed(compute_step, max(4, self.args.iterations))
            state = torch.tensor([compute_ms], dtype=torch.float64)
            dist.broadcast(state, 0)
            compute_ms = state[0].item()
            miss = abs(compute_ms - target)
            if best is None or miss < best[0]:
                best = (miss, compute_ms, Compute.budget[kind])
            if miss <= 0.01 * target:
                break
            Compute.budget[kind] = max(0.0, best[2] + (target - best[1]) / 1e3)
            if Compute.budget[kind] == 0 and best[2] == 0:
                break
        Compute.budget[kind] = best[2]
        return best[1], best[2] * 1e3

    def mode(self, kind):
        Compute.sleep = kind == "sleep"
        self.drop()
        # Default gradients: set to None each step, so AccumulateGrad hands new tensors on.
        plain = Model(self.sizes, "plain")

        def plain_step():
            plain.zero_grad(set_to_none=True)
            plain(self.x).backward()

        compute_ms, budget_ms = self.calibrate("plain", plain_step)
        # Gradients kept from step to step: AccumulateGrad adds into them in place, as under
        # bucket views (and under zero_grad() without set_to_none, the default in 1.13).
        views = Model(self.sizes, "views")
        views(self.x).backward()
        view_compute_ms, view_budget_ms = self.calibrate("views", lambda: views(self.x).backward())
        return {"compute_ms": compute_ms, "compute_budget_ms": budget_ms, "bucket_view_compute_ms": view_compute_ms,
                "bucket_view_compute_budget_ms": view_budget_ms}

    def make(self, name):
        x = self.x
        if name == "raw_sum":
            whole = torch.ones(sum(self.sizes))
            return lambda: dist.all_reduce(whole)
        if name == "ddp":
            ddp = torch.nn.parallel.DistributedDataParallel(Model(self.sizes, "plain"), bucket_cap_mb=25)

            def default_step():
                ddp.zero_grad(set_to_none=True)
                ddp(x).backward()  # returns once DDP's all-reduces have finished
            return default_step
        # The whole steps run the simulated forward (--forward-ms), as bench_reducer's do.
        kind = "views" if name == "ddp_views" else "step"
        ddp = torch.nn.parallel.DistributedDataParallel(Model(self.sizes, kind), bucket_cap_mb=25,
                                                        gradient_as_bucket_view=True)
        if name == "ddp_views":
            return lambda: ddp(x).backward()
        parameters = list(ddp.parameters())
        if name == "ddp_adamw":
            optimizer = torch.optim.AdamW(parameters, lr=1e-4, weight_decay=0.01, foreach=True)
        elif name == "ddp_zero":
            optimizer = ZeroRedundancyOptimizer(parameters, optimizer_class=torch.optim.AdamW,
                                                parameters_as_bucket_view=True, lr=1e-4, weight_decay=0.01,
                                                foreach=True)
        else:
            raise ValueError(f"unknown variant {name}")

        def whole_step():
            optimizer.zero_grad()
            ddp(x).backward()
            torch.nn.utils.clip_grad_norm_(parameters, 1.0)
            optimizer.step()
        return whole_step

    def sample(self, name, iterations):
        if name not in self.variants:
            step = self.make(name)
            step()  # warm-up: buckets built, optimizer state allocated
            step()
            self.variants[name] = step
        ms, cpu_ms = timed(self.variants[name], iterations)
        return {"ms": ms, "cpu_ms": cpu_ms}

    def drop(self):
        self.variants.clear()


def worker(rank, world, port, args, commands, replies):
    Compute.forward = args.forward_ms / 1e3
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # The peer waits between commands while cohort's side runs: a long timeout.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(hours=2))
    peer = Peer(args)
    try:
        while True:
            words = commands.get()
            if words[0] == "quit":
                break
            if words[0] == "mode":
                reply = peer.mode(words[1])
            elif words[0] == "sample":
                reply = peer.sample(words[1], int(words[2]))
            elif words[0] == "drop":
                peer.drop()
                reply = {}
            else:
                reply = {"error": f"unknown command {' '.join(words)}"}
            if rank == 0:
                replies.put(reply)
    except Exception as failure:  # reported to the parent, which answers with it and exits
        replies.put({"error": f"rank {rank}: {failure!r}"})
        raise
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ranks:
    """The peer's rank processes and their command queues; a dead rank ends every wait."""

    def __init__(self, args):
        ctx = mp.get_context("spawn")
        self.replies = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(args.ranks)]
        port = free_port()
        self.procs = [ctx.Process(target=worker, args=(r, args.ranks, port, args, self.commands[r], self.replies))
                      for r in range(args.ranks)]
        for p in self.procs:
            p.start()

    def ask(self, words):
        for q in self.commands:
            q.put(words)
        while True:
            try:
                return self.replies.get(timeout=1)
            except queue_module.Empty:
                failed = [p.exitcode for p in self.procs if p.exitcode not in (None, 0)]
                if failed or all(p.exitcode is not None for p in self.procs):
                    return {"error": f"a rank ended (exit codes {[p.exitcode for p in self.procs]})"}

    def close(self):
        for q in self.commands:
            q.put(["quit"])
        for p in self.procs:
            p.join(timeout=30)
            if p.exitcode is None:
                p.terminate()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", action="store_true", help="take commands on standard input")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=4, help="per calibration round (and per sample alone)")
    parser.add_argument("--compute-ms", type=float, default=120.0)
    parser.add_argument("--forward-ms", type=float, default=0.0)
    parser.add_argument("--compute-mode", choices=["spin", "sleep"], default="spin", help="without --serve")
    args = parser.parse_args()
    ranks = Ranks(args)
    failed = False
    try:
        if args.serve:
            lines = sys.stdin
        else:
            lines = [f"mode {args.compute_mode}"] + [f"sample {v} {args.iterations}" for v in
                                                      ["raw_sum", "ddp", "ddp_views", "ddp_adamw", "ddp_zero"]]
        for line in lines:
            words = line.split()
            if not words:
                continue
            if words[0] == "quit":
                break
            reply = ranks.ask(words)
            reply["torch_version"] = torch.__version__
            print("reply " + json.dumps(reply), flush=True)
            if "error" in reply:
                failed = True
                break
    finally:
        ranks.close()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
