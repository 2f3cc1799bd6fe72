"""Goodput of a multiplexed stream whose server cannot keep up (docs/design/hops.md, "Expired frames").

    python -m academus.loadgen.probes.stream_backlog [--cost-ms 2] [--rate 1000] [--duration 10] [--timeout 1]

One grpc.aio server serving the Multiplex service (shared/runtime/multiplex.py) with a handler that holds the
event loop for --cost-ms of CPU a call, as a saturated gateway's Python does; one client writing frames
on one Calls stream on an open-loop schedule (--rate a second, evenly spaced) for --duration seconds,
each with --timeout. Run twice on the same schedule: frames stamped with their send time (`sent_s`, as
`MultiplexChannel` sends them) and unstamped (the server then counts each frame's deadline from its
arrival, as before the stamp existed). A reply after the frame's timeout counts as the caller saw it:
DEADLINE_EXCEEDED. The server runs in a process of its own. Reported per arm: answered in time, late,
refused by the server (by code) and the median wait for such a refusal, handler runs, and the in-time
answers by the second they were sent in.
`--pushback-caps 1000,50` adds one stamped arm a cap whose client honours the refusals' pushback hints as
the gateway does a scheduler's (ACADEMUS_HONOUR_PUSHBACK): nothing is sent until the hint has passed, and
what falls due meanwhile is refused at the client (`held_off`). The server's hint is the frame's wait,
capped at that many ms (`multiplex.MAX_PUSHBACK_MS`, 50, set for the arm's server process). Each refusal
renews the hold-off, as in the gateway; `--once-caps 50` adds arms whose client reacts once a round trip
instead: a refusal of a frame sent before the hold-off began leaves it as it is (as TCP cuts its window once
per window of losses).
The last line printed is the JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import multiprocessing
import statistics

import grpc

from academus.loadgen.grpc_floor import spin
from academus.shared.runtime import multiplex
from academus.shared.runtime.errors import pushback_ms
from academus.shared.runtime.multiplex import CALLS_METHOD, CODES, serve_multiplexed
from academus.v1 import multiplex_pb2

METHOD = "/academus.backlog.Burn/Call"


async def serve(cost_s: float, conn) -> None:
    """The server process: serves until the parent asks, then sends back how many calls its handler ran."""
    runs = 0

    async def handler(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        nonlocal runs
        runs += 1
        spin(cost_s)
        return request

    server = grpc.aio.server()
    serve_multiplexed(server, lambda s: s.add_registered_method_handlers(
        "academus.backlog.Burn", {"Call": grpc.unary_unary_rpc_method_handler(handler)}))
    conn.send(server.add_insecure_port("127.0.0.1:0"))
    await server.start()
    await asyncio.get_running_loop().run_in_executor(None, conn.recv)
    await server.stop(0)
    conn.send(runs)


def server_process(cost_s: float, conn, pushback_cap_ms: int = multiplex.MAX_PUSHBACK_MS) -> None:
    multiplex.MAX_PUSHBACK_MS = pushback_cap_ms   # the policy this arm measures, in its own process
    asyncio.run(serve(cost_s, conn))


class ClientHoldOff:
    """A client's reaction to pushback hints: nothing is sent until the latest hint has passed. Each refusal
    renews it (the gateway's rule); `once_a_round_trip`, only a refusal of a frame sent since the hold-off
    began does: the others were in the backlog the first refusal reported."""

    def __init__(self, once_a_round_trip: bool = False) -> None:
        self.once_a_round_trip = once_a_round_trip
        self.since = self.until = -math.inf

    def refused(self, hint_ms: int, sent_at: float, now: float) -> None:
        if not (self.once_a_round_trip and sent_at < self.since):
            self.since, self.until = now, max(self.until, now + hint_ms / 1e3)

    def open(self, now: float) -> bool:
        return self.until <= now


async def send_schedule(port: int, stamped: bool, rate: float, duration_s: float, timeout_s: float,
                        honour_pushback: bool = False, once_a_round_trip: bool = False) -> dict:
    """The client: frames on one Calls stream on schedule; each reply sorted by what its caller saw. A
    client honouring pushback sends nothing due before a refusal's hint has passed; `once_a_round_trip`,
    a refusal of a frame sent before the hold-off began does not renew it."""
    loop = asyncio.get_running_loop()
    total = int(rate * duration_s)
    due = [i / rate for i in range(total)]
    outcome: collections.Counter[str] = collections.Counter()
    in_time_at: list[float] = []
    refused_after: list[float] = []   # how long a refused frame's caller waited for the refusal
    hold = ClientHoldOff(once_a_round_trip)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        calls = channel.stream_stream(CALLS_METHOD, request_serializer=multiplex_pb2.CallFrame.SerializeToString,
                                      response_deserializer=multiplex_pb2.ReplyFrame.FromString)()
        start = loop.time()

        async def write() -> None:
            for i, at in enumerate(due):
                await asyncio.sleep(max(start + at - loop.time(), 0))
                if not hold.open(loop.time()):
                    outcome["held_off"] += 1
                    continue
                # stamped with the schedule's time: a write held up by flow control is late already
                await calls.write(multiplex_pb2.CallFrame(id=i, method=METHOD, payload=b"x", timeout_s=timeout_s,
                                                          sent_s=start + at if stamped else 0.0))
            await calls.done_writing()   # the server ends the stream once it has answered: frames held off
            # last are never answered, so the reader must not wait for them

        async def read() -> None:
            while sum(outcome.values()) < total:
                reply = await calls.read()
                if reply is grpc.aio.EOF:
                    return
                waited = loop.time() - start - due[reply.id]
                if reply.code:
                    outcome[f"refused_{CODES[reply.code].name}"] += 1
                    refused_after.append(waited)
                    hint = pushback_ms((t.key, t.value) for t in reply.trailers)
                    if honour_pushback and hint:
                        hold.refused(hint, start + due[reply.id], loop.time())
                elif waited > timeout_s:
                    outcome["late"] += 1
                else:
                    outcome["in_time"] += 1
                    in_time_at.append(start + due[reply.id])

        writer = asyncio.ensure_future(write())
        try:
            await asyncio.wait_for(read(), duration_s + 10 * timeout_s + 30)
        except TimeoutError:
            outcome["unanswered"] = total - sum(outcome.values())
        writer.cancel()
        calls.cancel()
    per_second = collections.Counter(int(t - start) for t in in_time_at)
    return {"stamped": stamped, "honour_pushback": honour_pushback, "once_a_round_trip": once_a_round_trip,
            "sent": total, **dict(outcome),
            "median_wait_for_refusal_s": round(statistics.median(refused_after), 3) if refused_after else None,
            "in_time_per_s_sent": [per_second.get(s, 0) for s in range(int(duration_s))]}


def run_arm(stamped: bool, cost_s: float, rate: float, duration_s: float, timeout_s: float,
            pushback_cap_ms: int | None = None, once_a_round_trip: bool = False) -> dict:
    """One arm on a fresh server process (its own loop and core, as a gateway has); with `pushback_cap_ms`,
    the client honours the hints, which that server caps there."""
    spawn = multiprocessing.get_context("spawn")
    ours, theirs = spawn.Pipe()
    cap = multiplex.MAX_PUSHBACK_MS if pushback_cap_ms is None else pushback_cap_ms
    server = spawn.Process(target=server_process, args=(cost_s, theirs, cap))
    server.start()
    try:
        result = asyncio.run(send_schedule(ours.recv(), stamped, rate, duration_s, timeout_s,
                                           honour_pushback=pushback_cap_ms is not None,
                                           once_a_round_trip=once_a_round_trip))
        ours.send("stop")
        return result | {"handler_runs": ours.recv(), "pushback_cap_ms": cap}
    finally:
        server.join(30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="academus.loadgen.probes.stream_backlog", description=__doc__.split("\n")[0])
    p.add_argument("--cost-ms", type=float, default=2.0, help="CPU ms the handler holds the loop a call")
    p.add_argument("--rate", type=float, default=1000.0, help="frames a second (open loop)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of sending")
    p.add_argument("--timeout", type=float, default=1.0, help="each frame's timeout (s)")
    p.add_argument("--pushback-caps", type=lambda v: [int(c) for c in v.split(",")], default=[],
                   help="comma-separated ms: a stamped arm a cap, its client honouring the hints")
    p.add_argument("--once-caps", type=lambda v: [int(c) for c in v.split(",")], default=[],
                   help="the same, its client reacting once a round trip")
    args = p.parse_args(argv)
    arms = [run_arm(stamped, args.cost_ms / 1e3, args.rate, args.duration, args.timeout)
            for stamped in (True, False)]
    arms += [run_arm(True, args.cost_ms / 1e3, args.rate, args.duration, args.timeout, cap)
             for cap in args.pushback_caps]
    arms += [run_arm(True, args.cost_ms / 1e3, args.rate, args.duration, args.timeout, cap, once_a_round_trip=True)
             for cap in args.once_caps]
    summary = {"cost_ms": args.cost_ms, "rate": args.rate, "duration_s": args.duration, "timeout_s": args.timeout,
               "capacity_rps": round(1e3 / args.cost_ms, 1), "arms": arms,
               "in_time_stamped_vs_unstamped": round(arms[0].get("in_time", 0) / max(arms[1].get("in_time", 0), 1), 2)}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
