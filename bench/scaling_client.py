"""The load generator of `bench scaling`: streams spread over several client processes, each with its own gRPC
channel, so that the client is not what limits a fast cluster.

One process reading every stream over one channel costs ~40 us of CPU per token (grpc's Python client), which
caps it near 25,000 tok/s: less than two H200 replicas of Qwen3-0.6B deliver. ClientPool starts N processes
(spawned: no fork after Ray and gRPC are up) once for a whole sweep; run() hands each a share of the prompts (every
N-th one) and of the concurrency, lets them open their channels (a ModelInfo call each), starts them together and
gathers the per-request timings, the tokens and each process's CPU time over the run. The busiest process's CPU
share of the wall time (client_cpu_max) says whether the client kept up: near 1.0 it was the bottleneck.

    python -m shardserve.bench.scaling_client --address 127.0.0.1:50051 --procs 1,4   # any server, e.g. serve_fake
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import time
from multiprocessing.connection import Connection, wait


def _serve_jobs(conn: Connection) -> None:
    """A client process: for each job (address, prompts, max_tokens, concurrency, final_only), open a channel, say
    "ready", wait for "go", send every prompt, send per-request results back; None ends it."""
    while (job := conn.recv()) is not None:
        try:
            conn.send(("done", asyncio.run(_run_job(conn, *job))))
        except Exception as e:  # a request that failed (a gRPC status): said, and the process takes the next job
            conn.send(("error", f"{type(e).__name__}: {e}"))


async def _run_job(conn: Connection, address: str, prompts: list[list[int]], max_tokens: int,
                   concurrency: int, final_only: bool) -> dict:
    from shardserve.client.clients import AsyncClient

    results: list = [None] * len(prompts)
    slots = asyncio.Semaphore(max(1, concurrency))
    async with AsyncClient(address, timeout=3600) as client:
        await client.model_info()  # the channel is open before the clock starts
        conn.send(("ready", None))
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # "go"
        cpu0 = time.process_time()

        async def one(i: int) -> None:
            async with slots:
                start = time.perf_counter()
                first = None
                stream = client.stream(prompts[i], temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                       final_only=final_only)
                async for delta in stream:
                    if delta.token_ids and first is None and not final_only:
                        first = time.perf_counter()
                results[i] = (stream.result.token_ids, None if first is None else first - start,
                              time.perf_counter() - (first or start))
                conn.send(("tick", 1))

        await asyncio.gather(*(one(i) for i in range(len(prompts))))
        return dict(results=results, cpu_s=time.process_time() - cpu0)


def _drain(conn: Connection) -> None:
    """Reads a client process's messages until its job's end (done or error), dropping them."""
    while conn.recv()[0] not in ("done", "error"):
        pass


class ClientPool:
    def __init__(self, num_procs: int) -> None:
        ctx = mp.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs = []
        for _ in range(num_procs):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve_jobs, args=(child,), daemon=True, name="shardserve-bench-client")
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def __enter__(self) -> ClientPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            try:
                conn.send(None)
            except OSError:
                pass
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()

    def run(self, address: str, prompts: list[list[int]], max_tokens: int, concurrency: int,
            on_done=lambda n: None, final_only: bool = False) -> dict:
        """Sends every prompt (greedy, ignore_eos) with `concurrency` in flight over all the processes, streamed
        token by token or (final_only) answered in one message each; returns wall_s, tokens (per prompt, in
        order), ttft_s and tpot_s lists (streamed only), and the client's CPU: client_cpu_s (all processes),
        client_cpu_max (the busiest one's share of the wall time)."""
        n = len(self.conns)
        shares = [list(range(k, len(prompts), n)) for k in range(n)]
        active = [k for k in range(n) if shares[k]]
        for k in active:
            conc = concurrency // n + (1 if k < concurrency % n else 0)
            self.conns[k].send((address, [prompts[i] for i in shares[k]], max_tokens, conc, final_only))
        ready, failed = [], None
        for k in active:
            try:
                self._expect(k, "ready", on_done)
                ready.append(k)
            except RuntimeError as e:
                failed = failed or e
        if failed is not None:  # the ready ones run their share (the pool stays in step), then the error is raised
            for k in ready:
                self.conns[k].send("go")
            for k in ready:
                _drain(self.conns[k])
            raise failed
        start = time.perf_counter()
        for k in active:
            self.conns[k].send("go")
        done: dict[int, dict] = {}
        pending = {self.conns[k]: k for k in active}
        while pending:
            for conn in wait(list(pending)):
                kind, value = conn.recv()
                if kind == "tick":
                    on_done(value)
                elif kind == "done":
                    done[pending.pop(conn)] = value
                elif kind == "error":
                    k = pending.pop(conn)
                    for other in pending:  # the rest finish their share: their processes stay usable
                        _drain(other)
                    raise RuntimeError(f"client process {k}: a request failed: {value}")
        wall = time.perf_counter() - start
        tokens: list = [None] * len(prompts)
        ttft, tpot = [], []
        for k in active:
            for i, (ids, first_s, rest_s) in zip(shares[k], done[k]["results"]):
                tokens[i] = ids
                if first_s is not None:
                    ttft.append(first_s)
                    if len(ids) > 1:
                        tpot.append(rest_s / (len(ids) - 1))
        cpu = [done[k]["cpu_s"] for k in active]
        return dict(wall_s=wall, tokens=tokens, ttft_s=ttft, tpot_s=tpot, client_procs=len(active),
                    client_cpu_s=sum(cpu), client_cpu_max=max(cpu) / wall)

    def _expect(self, k: int, what: str, on_done) -> None:
        while True:
            if not self.procs[k].is_alive() and not self.conns[k].poll():
                raise RuntimeError(f"client process {k} exited (code {self.procs[k].exitcode})")
            if not self.conns[k].poll(1.0):
                continue
            kind, value = self.conns[k].recv()
            if kind == what:
                return
            if kind == "tick":
                on_done(value)
            elif kind == "error":
                raise RuntimeError(f"client process {k}: {value}")


def main() -> None:
    """Measures the client alone against a running server: output tok/s and client CPU per token, per --procs."""
    import random

    parser = argparse.ArgumentParser(description="the scaling benchmark's client against a running server")
    parser.add_argument("--address", required=True)
    parser.add_argument("--procs", default="1,4", help="client process counts to try, e.g. 1,2,4")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 30000) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    for procs in (int(p) for p in args.procs.split(",")):
        with ClientPool(procs) as pool:
            r = pool.run(args.address, prompts, args.output_len, len(prompts))
        out = sum(len(t) for t in r["tokens"])
        print(f"{procs} client process(es): {out / r['wall_s']:,.0f} output tok/s, client CPU "
              f"{r['client_cpu_s'] / out * 1e6:.1f} us/token, busiest process {r['client_cpu_max']:.0%} of a core",
              flush=True)


if __name__ == "__main__":
    main()
