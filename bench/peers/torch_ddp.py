#!/usr/bin/env python3
"""PyTorch DDP over Gloo with the same work as bench/bench_reducer.cpp: ResNet-50-shaped
parameters (161 tensors, 25.6 M), a simulated backward that busy-waits per layer in
proportion to its size and produces its gradient, back to front. Reports the step time of
DDP (default settings: 25 MB buckets) and the compute time of the same backward alone, each
with the CPU time all ranks' processes spent per step.

--compute-ms is what the whole backward takes alone: the per-layer busy time is calibrated
until it does, since autograd and AccumulateGrad's copy into .grad cost time of their own
(bench_reducer calibrates its side the same way, so both do the same compute).

Optional peer: exits with status 77 (skipped) when torch is not installed.

    python3 bench/peers/torch_ddp.py [--ranks 2] [--iterations 8] [--compute-ms 52]
                                     [--compute-mode spin|sleep] [--json FILE]
"""
import argparse
import json
import os
import socket
import statistics
import sys
import time

try:
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
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


SLEEP_COMPUTE = False  # --compute-mode sleep: the host thread idles, as under a GPU's kernels
BUDGET_SECONDS = 0.0   # the per-step busy time the layers share (calibrated)


def spin(seconds):
    if SLEEP_COMPUTE:
        time.sleep(seconds)
        return
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


class SimulatedLayer(torch.autograd.Function):
    """Forward passes the activation through; backward busy-waits for the layer's share of
    the compute time and returns its gradient (a ready tensor, as a real kernel would fill)."""

    @staticmethod
    def forward(ctx, x, weight, seconds, gradient):
        ctx.seconds = seconds
        ctx.gradient = gradient
        return x + 0.0

    @staticmethod
    def backward(ctx, grad_output):
        spin(ctx.seconds)
        return grad_output, ctx.gradient, None, None


class Model(torch.nn.Module):
    def __init__(self, sizes):
        super().__init__()
        total = sum(sizes)
        self.weights = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(n)) for n in sizes])
        self.shares = [n / total for n in sizes]
        self.gradients = [torch.full((n,), 1e-3 * (i % 7)) for i, n in enumerate(sizes)]

    def forward(self, x):
        # Declaration order forward, so autograd runs the backward last layer first.
        for weight, share, gradient in zip(self.weights, self.shares, self.gradients):
            x = SimulatedLayer.apply(x, weight, BUDGET_SECONDS * share, gradient)
        return x.sum()


def timed(fn, iterations):
    """Median wall time of fn in ms, and the median CPU time per call of all ranks' processes
    together (every thread of each process: autograd, Gloo's I/O)."""
    times = []
    cpu = []
    for i in range(iterations + 2):
        dist.barrier()
        cpu_start = time.process_time()
        start = time.perf_counter()
        fn()
        if i >= 2:
            times.append((time.perf_counter() - start) * 1e3)
            cpu.append((time.process_time() - cpu_start) * 1e3)
    cpu_all = torch.tensor([statistics.median(cpu)], dtype=torch.float64)
    dist.all_reduce(cpu_all)
    return statistics.median(times), cpu_all.item()


def worker(rank, world, port, args, queue):
    global SLEEP_COMPUTE
    SLEEP_COMPUTE = args.compute_mode == "sleep"
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    sizes = resnet50_shapes()
    x = torch.ones(1, requires_grad=True)

    def calibrate(compute_step):
        """Sets BUDGET_SECONDS so that compute_step (the backward alone) takes --compute-ms:
        rank 0's median decides for every rank. Returns (compute ms, CPU ms, budget ms)."""
        global BUDGET_SECONDS
        BUDGET_SECONDS = args.compute_ms / 1e3
        rounds = 8
        for round_index in range(rounds):
            compute_ms, compute_cpu_ms = timed(compute_step, args.iterations)
            state = torch.tensor([compute_ms, max(0.0, BUDGET_SECONDS + (args.compute_ms - compute_ms) / 1e3)],
                                 dtype=torch.float64)
            dist.broadcast(state, 0)
            met = abs(state[0].item() - args.compute_ms) <= 0.01 * args.compute_ms
            if met or round_index + 1 == rounds or (BUDGET_SECONDS == 0 and state[1].item() == 0):
                return state[0].item(), compute_cpu_ms, BUDGET_SECONDS * 1e3
            BUDGET_SECONDS = state[1].item()

    # Default DDP: gradients set to None each step, so AccumulateGrad hands DDP new tensors,
    # which it copies into its buckets. Its compute alone is the same backward, same mode.
    plain = Model(sizes)

    def compute_step():
        plain.zero_grad(set_to_none=True)
        plain(x).backward()

    compute_ms, compute_cpu_ms, budget_ms = calibrate(compute_step)
    model = Model(sizes)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)

    def ddp_step():
        ddp.zero_grad(set_to_none=True)
        ddp(x).backward()  # returns once DDP's all-reduces have finished

    ddp_ms, ddp_cpu_ms = timed(ddp_step, args.iterations)

    # gradient_as_bucket_view: .grad are views of DDP's buckets (cohort's bucket views do the
    # same) and AccumulateGrad adds into them in place; compute alone in that mode as well.
    plain_views = Model(sizes)
    compute_step_views = lambda: plain_views(x).backward()  # noqa: E731
    plain_views(x).backward()  # .grad exist from here on: later backwards accumulate in place
    view_compute_ms, _, view_budget_ms = calibrate(compute_step_views)
    view_model = Model(sizes)
    ddp_view = torch.nn.parallel.DistributedDataParallel(view_model, bucket_cap_mb=25, gradient_as_bucket_view=True)

    def ddp_view_step():
        ddp_view(x).backward()

    ddp_view_ms, ddp_view_cpu_ms = timed(ddp_view_step, args.iterations)

    whole = torch.ones(sum(sizes))
    raw_ms, _ = timed(lambda: dist.all_reduce(whole), args.iterations)
    if rank == 0:
        queue.put({"torch_version": torch.__version__, "ranks": world, "tensors": len(sizes),
                   "parameters": sum(sizes), "compute_ms": compute_ms, "compute_cpu_ms": compute_cpu_ms,
                   "compute_budget_ms": budget_ms, "ddp_step_ms": ddp_ms, "ddp_step_cpu_ms": ddp_cpu_ms,
                   "bucket_view_compute_ms": view_compute_ms, "bucket_view_compute_budget_ms": view_budget_ms,
                   "ddp_bucket_view_step_ms": ddp_view_ms, "ddp_bucket_view_step_cpu_ms": ddp_view_cpu_ms,
                   "raw_all_reduce_ms": raw_ms})
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--compute-ms", type=float, default=120.0)
    parser.add_argument("--compute-mode", choices=["spin", "sleep"], default="spin")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, args.ranks, port, args, queue)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    # A rank that dies (a port taken between free_port() and the rendezvous, an exception)
    # must end the run, not leave the parent waiting on the queue.
    deadline = time.monotonic() + 600
    result = None
    while result is None:
        try:
            result = queue.get(timeout=1)
        except Exception:  # queue.Empty
            failed = [p for p in procs if p.exitcode not in (None, 0)]
            ended = all(p.exitcode is not None for p in procs)
            if failed or ended or time.monotonic() > deadline:
                for p in procs:
                    p.terminate()
                print("PyTorch DDP peer failed: " +
                      (f"rank exit codes {[p.exitcode for p in procs]}" if failed or ended else "no result in 600 s"))
                sys.exit(1)
    for p in procs:
        p.join()
    print(f"PyTorch {result['torch_version']} DDP over Gloo, {args.ranks} ranks, {result['tensors']} tensors, "
          f"{result['parameters']} parameters")
    for key in ["compute_ms", "compute_budget_ms", "compute_cpu_ms", "ddp_step_ms", "ddp_step_cpu_ms",
                "bucket_view_compute_ms", "bucket_view_compute_budget_ms", "ddp_bucket_view_step_ms",
                "ddp_bucket_view_step_cpu_ms", "raw_all_reduce_ms"]:
        print(f"  {key:26s} {result[key]:8.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
