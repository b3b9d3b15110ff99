"""``python -m bench.embeddings``: embeddings throughput, and what an embedding load does to chat.

Starts ``llmpool serve`` with two models, one worker each: the default chat model and a random
BERT-base-sized embedder (hidden 768, 12 layers, mean pooling + Normalize, a sentence-transformers
folder written here). Then:

1. texts/s of /v1/embeddings at ``--batches`` inputs per request (one request at a time), each
   input ``--tokens`` token ids long (sent as ids: exactly that many tokens);
2. the chat workload (bench/prompts.py's chat prompts, ``--streams`` concurrent streams) alone, then
   while a client keeps sending embedding requests of ``--load-batch`` inputs: output tokens/s and
   the median inter-token latency, both ways.

The two workers are separate processes sharing the machine's cores. ``--shared`` instead serves
the chat model alone with ``--pooling last`` (one worker that generates and embeds, chat and
embedding rows in the same steps): texts/s on the default model's architecture, and chat beside
embeddings within one worker. On a shared machine, read the ratios, not the absolute figures; the
load average is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench import servers
from bench.load import run_level
from bench.prompts import PROMPTS
from bench.stats import summarize

CHAT_MODEL = "SmolLM2-135M-Instruct"


def build_embedder(folder: Path, layers: int, hidden: int, seed: int = 0) -> Path:
    """A random BERT embedder as a sentence-transformers folder (the worker reads its modules.json)."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast

    torch.manual_seed(seed)
    config = BertConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64, intermediate_size=4 * hidden
    )
    BertModel(config).eval().save_pretrained(folder)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *(chr(c) for c in range(ord("a"), ord("z") + 1))]
    BertTokenizerFast(vocab={token: i for i, token in enumerate(vocab)}).save_pretrained(folder)
    modules = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
    (folder / "modules.json").write_text(
        json.dumps(
            [
                {"idx": i, "name": str(i), "path": p, "type": f"sentence_transformers.models.{t}"}
                for i, (p, t) in enumerate(modules)
            ]
        )
    )
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "2_Normalize").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": hidden, "pooling_mode_mean_tokens": True})
    )
    return folder


VOCAB = 26  # token ids 5..30: in both models' vocabularies (the embedder's letters)


def inputs(count: int, tokens: int, offset: int) -> list[list[int]]:
    return [[5 + (offset + i * 7 + j * 13) % VOCAB for j in range(tokens)] for i in range(count)]


def post(client: httpx.Client, body: dict) -> None:
    response = client.post("/v1/embeddings", json=body)
    if response.status_code != 200:
        raise SystemExit(f"/v1/embeddings answered {response.status_code}: {response.text}")


def texts_per_s(url: str, model: str, batch: int, tokens: int, requests: int) -> float:
    """Inputs per second over ``requests`` sequential requests (after one warm-up)."""
    with httpx.Client(base_url=url, timeout=600) as client:
        post(client, {"model": model, "input": inputs(batch, tokens, 0)})
        start = time.perf_counter()
        for r in range(requests):
            post(client, {"model": model, "input": inputs(batch, tokens, r + 1)})
        return batch * requests / (time.perf_counter() - start)


async def embedding_load(url: str, model: str, batch: int, tokens: int, stop: asyncio.Event) -> int:
    """Embedding requests back to back until ``stop``; returns the inputs embedded."""
    done = 0
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        while not stop.is_set():
            response = await client.post("/v1/embeddings", json={"model": model, "input": inputs(batch, tokens, done)})
            response.raise_for_status()
            done += batch
    return done


async def chat_level(
    url: str, model: str, streams: int, requests: int, max_tokens: int, load_batch: int, tokens: int
) -> tuple[dict, float]:
    """The chat workload's figures, with an embedding load beside it when ``load_batch`` > 0."""
    stop = asyncio.Event()
    load = asyncio.create_task(embedding_load(url, model, load_batch, tokens, stop)) if load_batch else None
    timings, wall = await run_level(url, CHAT_MODEL, PROMPTS, streams, requests, max_tokens)
    stop.set()
    embedded = await load if load is not None else 0
    return summarize(streams, timings, wall), embedded / wall


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.embeddings", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="1,8,64", help="inputs per embeddings request, comma-separated")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per input")
    parser.add_argument(
        "--requests", type=int, default=0, help="requests per batch size (0: enough for about 256 inputs, at least 4)"
    )
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--streams", type=int, default=4, help="concurrent chat streams")
    parser.add_argument("--chat-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--load-batch", type=int, default=8, help="inputs per request of the embedding load beside chat"
    )
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--shared", action="store_true", help="one worker of the chat model that also embeds (--pooling last)"
    )
    args = parser.parse_args()
    model = CHAT_MODEL if args.shared else "embed"
    if args.shared:
        processes, url = servers.start_llmpool(1, ["--pooling", "last", "--dtype", args.dtype], False)
        what = f"{CHAT_MODEL} embedding by its last token (--pooling last), one worker for both"
    else:
        folder = build_embedder(Path(tempfile.mkdtemp(prefix="bench-embed-")) / "embed", args.layers, args.hidden)
        models = f"{CHAT_MODEL}={CHAT_MODEL},embed={folder}"
        processes, url = servers.start_llmpool(2, ["--models", models, "--workers", "1", "--dtype", args.dtype], False)
        what = f"BERT {args.layers} layers x {args.hidden}, its own worker"
    try:
        print(f"load average {os.getloadavg()[0]:.1f}; embedder: {what}; {args.tokens}-token inputs")
        for batch in (int(b) for b in args.batches.split(",") if b):
            requests = args.requests or max(4, 256 // batch)
            print(
                f"batch {batch:>3}: {texts_per_s(url, model, batch, args.tokens, requests):7.1f} texts/s ({requests} requests)"
            )
        rows = {}
        for name, load_batch in (
            ("chat alone", 0),
            (f"chat + embeddings (batch {args.load_batch})", args.load_batch),
            ("chat alone again", 0),
        ):
            row, embedded = asyncio.run(
                chat_level(url, model, args.streams, args.chat_requests, args.max_tokens, load_batch, args.tokens)
            )
            rows[name] = row
            extra = f", embeddings beside: {embedded:.1f} texts/s" if load_batch else ""
            print(
                f"{name}: {row['output_throughput']:.1f} output tok/s, median ITL {row['median_itl_ms']:.1f} ms, "
                f"median TTFT {row['median_ttft_ms']:.0f} ms{extra} (load average {os.getloadavg()[0]:.1f})"
            )
        alone = statistics.mean(r["output_throughput"] for n, r in rows.items() if n.startswith("chat alone"))
        loaded = next(r["output_throughput"] for n, r in rows.items() if "+" in n)
        print(f"chat output tokens/s under the embedding load: {loaded / alone:.2f}x of alone")
    finally:
        servers.stop(processes)


if __name__ == "__main__":
    main()
