"""What a stream message costs, whatever it holds (shared/runtime/multiplex.py, `CallFrame.batch`): one grpc.aio
server echoing a bidirectional stream of `Calls` messages, one client writing --frames frames of --bytes
each, k frames to a message, and reading the replies, one message each way. Both ends share this process,
so its CPU is what the frames cost at both ends together.

    python -m academus.loadgen.probes.frame_batches [--frames 20000] [--bytes 300] [--per-message 1 2 4 8]

The last line printed is the JSON: per k, CPU and wall microseconds a frame.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import grpc

from academus.v1 import multiplex_pb2

METHOD = "/academus.bench.Echo/Calls"


async def echo(requests, context):
    """Each frame's reply, in one message for each message read, as the Multiplex server batches them."""
    async for message in requests:
        replies = [multiplex_pb2.ReplyFrame(id=f.id, payload=f.payload) for f in message.batch or (message,)]
        yield replies[0] if len(replies) == 1 else multiplex_pb2.ReplyFrame(batch=replies)


async def one_arm(frames: int, size: int, per_message: int) -> dict[str, float]:
    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(echo, request_deserializer=multiplex_pb2.CallFrame.FromString,
                                                    response_serializer=multiplex_pb2.ReplyFrame.SerializeToString)
    service, method = METHOD.strip("/").split("/")
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(service, {method: handler})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    messages = frames // per_message
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream(METHOD, request_serializer=multiplex_pb2.CallFrame.SerializeToString,
                                     response_deserializer=multiplex_pb2.ReplyFrame.FromString)()

        async def read() -> None:
            for _ in range(messages):
                await call.read()

        cpu, wall = time.process_time(), time.perf_counter()
        reader = asyncio.ensure_future(read())
        payload = b"x" * size
        for i in range(messages):
            batch = [multiplex_pb2.CallFrame(id=i * per_message + j, method=METHOD, payload=payload, sent_s=1.0)
                     for j in range(per_message)]
            await call.write(batch[0] if per_message == 1 else multiplex_pb2.CallFrame(batch=batch))
        await reader
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        await call.done_writing()
    await server.stop(None)
    sent = messages * per_message
    return {"cpu_us_a_frame": round(cpu * 1e6 / sent, 1), "wall_us_a_frame": round(wall * 1e6 / sent, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m academus.loadgen.probes.frame_batches", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frames", type=int, default=20000)
    p.add_argument("--bytes", type=int, default=300, help="a frame's payload")
    p.add_argument("--per-message", type=int, nargs="+", default=[1, 2, 4, 8])
    args = p.parse_args(argv)
    arms = {str(k): asyncio.run(one_arm(args.frames, args.bytes, k)) for k in args.per_message}
    for k, arm in arms.items():
        print(f"{k} a message: {arm['cpu_us_a_frame']} us of CPU a frame, {arm['wall_us_a_frame']} us of wall")
    print(json.dumps({"frames": args.frames, "bytes": args.bytes, "per_message": arms}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
