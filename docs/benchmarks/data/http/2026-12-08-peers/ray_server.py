"""Ray Serve serving peer_model on OpenAI's embeddings route: one replica behind a FastAPI ingress, `serve.batch`
(up to 32 requests, 10 ms; PEER_BATCH=1: none), up to 128 requests in flight on the replica (the default, 5, would
cap a batch at 5), and both cores for the replica (Ray sets a replica of one CPU to one torch thread).
`PEER_MODEL_DIR=DIR python ray_server.py PORT` (its own virtual environment); SIGTERM shuts Ray down."""

import os
import signal
import sys
import threading

import ray
from fastapi import FastAPI
from ray import serve

app = FastAPI()


@serve.deployment(num_replicas=1, max_ongoing_requests=128, ray_actor_options={"num_cpus": 2})
@serve.ingress(app)
class Embeddings:
    def __init__(self) -> None:
        import peer_model
        self.embed, self.batched = peer_model.embed, peer_model.BATCH > 1

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.01)
    async def batch(self, texts: list[str]) -> list[list[float]]:
        return self.embed(texts)

    @app.post("/v1/embeddings")
    async def embeddings(self, body: dict) -> dict:
        text = body["input"][0]
        vector = await self.batch(text) if self.batched else self.embed([text])[0]
        return {"object": "list", "model": body.get("model", ""),
                "data": [{"object": "embedding", "index": 0, "embedding": vector}]}


if __name__ == "__main__":
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    ray.init(include_dashboard=False, runtime_env={"env_vars": {
        "PYTHONPATH": sys.path[0], **{k: v for k, v in os.environ.items() if k.startswith("PEER_")}}})
    serve.start(http_options={"host": "127.0.0.1", "port": int(sys.argv[1])})
    serve.run(Embeddings.bind(), route_prefix="/")
    stop.wait()
    serve.shutdown()
    ray.shutdown()
