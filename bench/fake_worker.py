"""Workers with no model, for measuring the gateway alone: the real worker process loop (worker/proc.py)
around engines that answer every running request with one token per step, at once or every
``--step-ms`` milliseconds.

``--count M`` hosts M such workers in this one process (1,024 worker processes don't fit on a small
machine): each is a WorkerProc of its own (its name, engine, stepping thread and one DEALER per
gateway of ``--gateway-address``, comma-separated) whose loop runs on a thread. So each registers
(``Ready``, with its tokenizer's digest), heartbeats with its load, answers ``DescribeModel`` with
the default model's tokenizer files (``ModelInfo``), runs requests, drains on SIGTERM and
re-registers when a gateway goes silent, exactly as a real worker does.

    python -m bench.fake_worker --gateway-address tcp://127.0.0.1:5555 [--step-ms 0]
    python -m bench.fake_worker --gateway-address tcp://127.0.0.1:5555,tcp://127.0.0.1:5556 --count 256
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import msgspec
import zmq

from common.logs import setup_logging
from common.model_source import DEFAULT_MODEL, TokenizerBundle
from common.protocol import Heartbeat, ModelInfo, NewRequest, RequestOutput, StepOutputs
from worker.proc import WorkerProc

log = logging.getLogger(__name__)

WORDS = list(range(1000, 1100))  # ordinary word pieces of the default tokenizer


class FakeEngine:
    """The engine a WorkerProc steps (its ``Stepped`` protocol), without a model."""

    max_model_len = 8192
    max_num_seqs = 4096
    blocks = SimpleNamespace(capacity_tokens=10**7, block_size=16)

    def __init__(self, step_s: float, token_s: float = 0.0) -> None:
        self.step_s = step_s
        self.token_s = token_s  # and this much more per running request: a speed that does not grow with the batch
        self.running: dict[str, list[int]] = {}  # id -> [prompt tokens, tokens left, produced]
        self.refused: list[RequestOutput] = []  # requests that did not decode, answered at the next step
        self.steps = 0

    def add_request(self, new: NewRequest) -> None:
        self.running[new.request_id] = [
            len(new.prompt_token_ids),
            new.max_new_tokens,
            0,
        ]

    def reject(self, request_id: str, error: str, num_prompt_tokens: int = 0, bad_request: bool = False) -> None:
        self.refused.append(RequestOutput(request_id, [], "error", num_prompt_tokens, error=error, bad_request=bad_request))

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        return [RequestOutput(i, [], "abort") for i in request_ids if self.running.pop(i, None)]

    def has_work(self) -> bool:
        return bool(self.running or self.refused)

    def step(self) -> StepOutputs:
        if self.step_s or self.token_s:
            time.sleep(self.step_s + self.token_s * len(self.running))
        self.steps += 1
        outputs, self.refused = self.refused, []
        for request_id, state in list(self.running.items()):
            state[1] -= 1
            state[2] += 1
            done = state[1] == 0
            outputs.append(
                RequestOutput(
                    request_id,
                    [WORDS[state[2] % len(WORDS)]],
                    "length" if done else None,
                    state[0],
                    state[2],
                    seq=state[2] - 1,  # one output per step: the gateway checks they arrive without a gap
                )
            )
            if done:
                del self.running[request_id]
        return StepOutputs(outputs, batch_size=len(outputs), num_tokens=len(outputs))

    def fail_all(self, message: str) -> list[RequestOutput]:
        failed = [RequestOutput(i, [], "error", error=message) for i in self.running]
        self.running.clear()
        return failed

    def load(self) -> Heartbeat:
        capacity = self.blocks.capacity_tokens // self.blocks.block_size
        return Heartbeat(running=len(self.running), steps=self.steps, free_blocks=capacity, total_blocks=capacity)


def build_model_info(model: str = DEFAULT_MODEL) -> ModelInfo:
    """The model's tokenizer as a worker describes it (common.model_source's bundle). Loads the real
    tokenizer (seconds): build once."""
    from common.config import CACHE_DIR
    from common.model_source import bundle_tokenizer, load_tokenizer, read_chat_template, resolve_model

    tokenizer = load_tokenizer(resolve_model(model), CACHE_DIR.env_default())
    bundle = bundle_tokenizer(tokenizer, read_chat_template(None, getattr(tokenizer, "chat_template", None)))
    return ModelInfo(model, bundle.digest, bundle.packed, bundle.chat_template)


def load_model_info(path: str | None, model: str) -> ModelInfo:
    """A ModelInfo saved by ``save_model_info`` (so a fleet of processes builds it once), or a fresh one."""
    if path and Path(path).is_file():
        return msgspec.msgpack.decode(Path(path).read_bytes(), type=ModelInfo)
    info = build_model_info(model)
    if path:
        Path(path).write_bytes(msgspec.msgpack.encode(info))
    return info


def fake_worker(name: str, args: argparse.Namespace, addresses: list[str], info: ModelInfo | None) -> WorkerProc:
    """One model-less worker: the real socket loop (worker/proc.py) around a FakeEngine."""
    return WorkerProc(
        FakeEngine(args.step_ms / 1000, args.token_ms / 1000),
        ",".join(addresses),
        name,
        args.model,
        "none",
        "none",
        args.heartbeat_interval,
        args.heartbeat_liveness,
        tokenizer=TokenizerBundle(info.files, info.chat_template or "", info.tokenizer_digest) if info else None,
    )


def run_fleet(procs: list[WorkerProc], interval: float) -> None:
    """Each worker's loop on a thread of its own, started over one heartbeat interval so that their
    heartbeats spread as independent workers' would; SIGTERM or SIGINT drains them all."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: [proc.drain() for proc in procs])
    threads = [threading.Thread(target=proc.run, name=proc.name, daemon=True) for proc in procs]
    for thread in threads:
        thread.start()
        time.sleep(interval / len(threads))
    for thread in threads:
        thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.fake_worker", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gateway-address", default="tcp://127.0.0.1:5555", help="comma-separated: every worker connects to each")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the name to register under")
    parser.add_argument("--step-ms", type=float, default=0.0)
    parser.add_argument("--token-ms", type=float, default=0.0, help="step time grows by this per running request")
    parser.add_argument("--count", type=int, default=1, help="simulated workers in this process, each its own worker loop on a thread")
    parser.add_argument("--name", default="fake-worker", help="worker name (a fleet's are NAME-0, NAME-1, ...)")
    parser.add_argument("--heartbeat-interval", type=float, default=1.0)
    parser.add_argument("--heartbeat-liveness", type=int, default=5)
    parser.add_argument("--model-info", help="fleet: a file caching the tokenizer's ModelInfo (built on first use)")
    parser.add_argument("--no-model-info", action="store_true", help="fleet: don't build or send the tokenizer's files")
    args = parser.parse_args()
    setup_logging("fake-worker")
    addresses = [a.strip() for a in args.gateway_address.split(",") if a.strip()]
    info = None if args.no_model_info else load_model_info(args.model_info, args.model)
    if args.count == 1:
        proc = fake_worker(args.name, args, addresses, info)
        proc.install_signal_handlers()
        proc.run()
        return
    # Three sockets per gateway link (the DEALER and its handshake monitor's pair), all in one context.
    zmq.Context.instance().set(zmq.MAX_SOCKETS, 3 * args.count * len(addresses) + 64)
    log.info("%d simulated workers connecting to %s", args.count, ", ".join(addresses))
    run_fleet([fake_worker(f"{args.name}-{i}", args, addresses, info) for i in range(args.count)], args.heartbeat_interval)


if __name__ == "__main__":
    main()
