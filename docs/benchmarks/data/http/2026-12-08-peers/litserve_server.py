"""LitServe serving peer_model on OpenAI's embeddings route, its dynamic batching on (up to PEER_BATCH requests, 32
by default, for 10 ms; 1: off).
`PEER_MODEL_DIR=DIR python litserve_server.py PORT` (its own virtual environment)."""

import os
import sys

import litserve as ls
from litserve.specs import OpenAIEmbeddingSpec


class Embeddings(ls.LitAPI):
    def setup(self, device):
        import peer_model
        self.embed = peer_model.embed

    def predict(self, inputs):   # a request's input, a list of one text; batched: a list of them
        return self.embed([text if isinstance(text, str) else text[0] for text in inputs])


if __name__ == "__main__":
    batch = int(os.environ.get("PEER_BATCH", "32"))
    api = Embeddings(max_batch_size=batch, batch_timeout=0.01 if batch > 1 else 0.0, spec=OpenAIEmbeddingSpec())
    ls.LitServer(api, accelerator="cpu").run(port=int(sys.argv[1]), generate_client_file=False)
