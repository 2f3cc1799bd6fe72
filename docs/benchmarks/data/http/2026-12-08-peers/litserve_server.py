"""LitServe serving peer_model on OpenAI's embeddings route, its dynamic batching on (up to 32 requests, 10 ms).
`PEER_MODEL_DIR=DIR python litserve_server.py PORT` (its own virtual environment)."""

import sys

import litserve as ls
from litserve.specs import OpenAIEmbeddingSpec


class Embeddings(ls.LitAPI):
    def setup(self, device):
        import peer_model
        self.embed = peer_model.embed

    def predict(self, inputs):   # batched: each request's input, one text (a string, or a list of one)
        return self.embed([text if isinstance(text, str) else text[0] for text in inputs])


if __name__ == "__main__":
    api = Embeddings(max_batch_size=32, batch_timeout=0.01, spec=OpenAIEmbeddingSpec())
    ls.LitServer(api, accelerator="cpu").run(port=int(sys.argv[1]))
