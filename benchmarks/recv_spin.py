"""What a posted NCCL receive costs the other kernels of its GPU while it waits for its sender.

    python benchmarks/recv_spin.py [--max-ctas 0 4 8] [--lanes 2] [--json [PATH]]

A decode worker queues the receives of a hand-off when the prefill worker announces
it, as the prefill starts (``nccl_recv.py``): the receive kernels are then resident
on the decode GPU, polling for bytes, for as long as the prompt computes. This
benchmark measures what that takes from a decode step's kernels. Two processes, one
GPU each (rank 0 sends, rank 1 receives); on the receiver, each kernel of a decode
step at --batch requests and --context tokens (Qwen3-8B shape: the split-KV
attention of one layer, FlashInfer's decode of it (``--kernels flashinfer``), a
4096 x 12288 projection, a 1 GiB copy) is timed

- idle: nothing else on the GPU;
- pending: with one receive posted on each of --lanes communicators (high-priority
  streams, as the transport's), their sender held back until the timing is done.

Each --max-ctas value runs in a fresh pair of processes with ``NCCL_MAX_CTAS`` set
(0: NCCL's default), and also times a hand-off-sized transfer (--mb, one message
per lane, the receives posted first) to show the bandwidth that the cap costs.
Prints a table; ``--json`` writes ``recv_spin_<device>.json``.
"""

from __future__ import annotations

import argparse
import faulthandler
import statistics

import torch
import torch.multiprocessing as mp

from splitserve.workers.kv.transfer.nccl_pair import cap_ctas, communicator, unique_id

try:
    import roofline
except ImportError:  # imported as benchmarks.recv_spin
    from benchmarks import roofline

HIDDEN, QKV, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4096, 12288, 32, 8, 128, 16


def _workloads(batch: int, context: int) -> dict:
    """The kernels timed: name -> a call that queues one of them on the current stream."""
    from splitserve.kernels.triton.decode_attention import decode_attention

    dev, bf16 = torch.device("cuda"), torch.bfloat16
    blocks = -(-context // BLOCK)
    k_cache = torch.randn(batch * blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=bf16, device=dev)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(batch * blocks, device=dev, dtype=torch.int32).view(batch, blocks)
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=bf16, device=dev)
    x = torch.randn(batch, HIDDEN, dtype=bf16, device=dev)
    weights = [torch.randn(HIDDEN, QKV, dtype=bf16, device=dev) for _ in range(4)]  # past L2
    src, dst = (torch.empty(1 << 30, dtype=torch.uint8, device=dev) for _ in range(2))
    turn = iter(range(1 << 62))
    return {
        "attention": lambda: decode_attention(q, k_cache, v_cache, table, lens, HEAD_DIM**-0.5),
        "flashinfer attention": _flashinfer_decode(q, k_cache, v_cache, table, context),
        "projection": lambda: x @ weights[next(turn) % len(weights)],
        "copy 1 GiB": lambda: dst.copy_(src),
    }


def _flashinfer_decode(q, k_cache, v_cache, table, context: int):
    """FlashInfer's decode (the engine's above ``kernels.split_kv_max_batch``), planned
    once for the batch, as a call."""
    import flashinfer

    from splitserve.workers.attention.flashinfer_backend import WORKSPACE_BYTES, tensor_core_decode

    batch, blocks = table.shape
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_tensor_cores=tensor_core_decode(HEADS, KV_HEADS)
    )
    int32 = {"dtype": torch.int32, "device": q.device}
    last = context - (blocks - 1) * BLOCK
    wrapper.plan(
        torch.arange(batch + 1, **int32) * blocks, table.flatten(),
        torch.full((batch,), last, **int32), HEADS, KV_HEADS, HEAD_DIM, BLOCK,
        sm_scale=HEAD_DIM**-0.5, q_data_type=q.dtype, kv_data_type=k_cache.dtype,
    )  # fmt: skip
    return lambda: wrapper.run(q, (k_cache, v_cache))


def _time_us(call) -> float:
    """Median microseconds of one call, waiting on this stream only (a posted receive
    does not end while its sender waits)."""
    return roofline.time_cuda_ms(call, warmup=2, repeat=40, sync_device=False) * 1e3


def _comms(rank: int, lanes: int, ids) -> list:
    """``lanes`` 2-rank communicators, their ids drawn by rank 0 (as the transport's pairs)."""
    comms = []
    for _ in range(lanes):
        if rank == 0:
            ids.put(uid := unique_id())
        else:
            uid = ids.get()
        comms.append(communicator(uid, rank))
    return comms


def _run(rank: int, args, max_ctas: int, ids, go, barrier, results) -> None:
    faulthandler.dump_traceback_later(args.stall_s, exit=True)  # a hang shows where it is
    cap_ctas(max_ctas or None)  # before the communicators, as the transport does
    torch.cuda.set_device(rank)
    import cupy
    from cupy.cuda import nccl

    cupy.cuda.Device(rank).use()
    comms = _comms(rank, args.lanes, ids)
    streams = [torch.cuda.Stream(priority=-1) for _ in comms]
    nbytes = args.mb << 20
    buffers = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in comms]

    def exchange() -> None:
        for comm, stream, buf in zip(comms, streams, buffers, strict=True):
            call = comm.send if rank == 0 else comm.recv
            call(buf.data_ptr(), nbytes, nccl.NCCL_UINT8, 1 - rank, stream.cuda_stream)

    exchange()  # warm both sides' connections
    torch.cuda.synchronize()
    print(f"  rank {rank}: {args.lanes} lanes up (NCCL_MAX_CTAS={max_ctas})", flush=True)
    row = {"max_ctas": max_ctas, "lanes": args.lanes}
    if rank == 1:
        row.update(_time_kernels(args, exchange, go))
    else:
        go.wait()
        exchange()
    torch.cuda.synchronize()
    seconds = _time_transfers(rank, args.repeat, exchange, streams, barrier)
    if rank == 0:
        row["transfer_gbps"] = args.lanes * nbytes / statistics.median(seconds) / 1e9
    results.put((rank, row))


def _time_kernels(args, exchange, go) -> dict:
    """The receiver's kernels timed idle, then with a receive posted on each lane; then
    ``go`` lets the sender send."""
    work = {
        name: call
        for name, call in _workloads(args.batch, args.context).items()
        if name.split()[0] in args.kernels
    }
    idle = {name: _time_us(call) for name, call in work.items()}
    print(f"  receiver: idle {idle}", flush=True)
    exchange()  # posted; the sender waits for ``go``
    pending = {name: _time_us(call) for name, call in work.items()}
    go.set()
    return {"idle_us": idle, "pending_us": pending}


def _time_transfers(rank: int, repeat: int, exchange, streams, barrier) -> list[float]:
    """Seconds of each of ``repeat`` transfers on every lane, the receives posted first
    (the sender's times are the ones reported)."""
    seconds = []
    for _ in range(repeat):
        barrier.wait()
        if rank == 1:
            exchange()
        barrier.wait()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for stream in streams:
            stream.wait_stream(torch.cuda.current_stream())
        if rank == 0:
            exchange()
        for stream in streams:
            torch.cuda.current_stream().wait_stream(stream)
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1000)
    return seconds


def _measure(args, max_ctas: int) -> dict:
    ctx = mp.get_context("spawn")
    ids, results, go, barrier = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Barrier(2)
    procs = [
        ctx.Process(target=_run, args=(rank, args, max_ctas, ids, go, barrier, results))
        for rank in (0, 1)
    ]
    for proc in procs:
        proc.start()
    row = {}
    for _ in procs:
        row.update(results.get(timeout=600)[1])
    for proc in procs:
        proc.join()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-ctas", type=int, nargs="+", default=[0, 4, 8])
    parser.add_argument("--lanes", type=int, default=2)
    parser.add_argument("--batch", type=int, default=96)
    parser.add_argument("--context", type=int, default=2560)
    parser.add_argument("--mb", type=int, default=64, help="bytes of each lane's message")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--kernels", nargs="+", default=["attention", "projection", "copy"])
    parser.add_argument("--stall-s", type=float, default=180, help="a rank stuck this long exits")
    parser.add_argument("--json", nargs="?", const="", default=None)
    args = parser.parse_args()
    device = torch.cuda.get_device_name(0)
    print(
        f"{device}: receiver's kernels, b{args.batch} x {args.context} tokens, {args.lanes} lanes"
    )
    columns = ["NCCL_MAX_CTAS", "kernel", "idle us", "receive pending us", "pending / idle"]
    rows = []
    for max_ctas in args.max_ctas:
        rows.append(row := _measure(args, max_ctas))
        table = [
            [max_ctas or "NCCL's own", name, idle, row["pending_us"][name]]
            + [row["pending_us"][name] / idle]
            for name, idle in row["idle_us"].items()
        ]
        roofline.print_table(columns, table)
        print(f"transfer: {row['transfer_gbps']:.1f} GB/s", flush=True)
    if args.json is not None:
        report = roofline.environment(roofline.command_line("recv_spin.py"))
        path = args.json or f"recv_spin_{roofline.device_slug(device)}.json"
        roofline.write_report(path, {**report, "args": vars(args), "rows": rows})
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
