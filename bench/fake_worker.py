"""A worker with no model, for measuring the gateway alone: the real DEALER loop (worker.proc) around
an engine that answers every running request with one token per step, at once or every
``--step-ms`` milliseconds.

    python -m bench.fake_worker --gateway-address tcp://127.0.0.1:5555 [--step-ms 0]
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

from common.logs import setup_logging
from common.model_source import DEFAULT_MODEL
from common.protocol import Heartbeat, NewRequest, RequestOutput, StepOutputs
from worker.proc import WorkerProc

WORDS = list(range(1000, 1100))  # ordinary word pieces of the default tokenizer


class FakeEngine:
    """The Engine interface (add_request, abort, has_work, step, fail_all, load) without a model."""

    max_model_len = 8192
    max_num_seqs = 4096
    blocks = SimpleNamespace(capacity_tokens=10**7, block_size=16)

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.running: dict[str, list[int]] = {}  # id -> [prompt tokens, tokens left, produced]
        self.steps = 0

    def add_request(self, new: NewRequest) -> None:
        self.running[new.request_id] = [
            len(new.prompt_token_ids),
            new.max_new_tokens,
            0,
        ]

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        return [RequestOutput(i, [], "abort") for i in request_ids if self.running.pop(i, None)]

    def has_work(self) -> bool:
        return bool(self.running)

    def step(self) -> StepOutputs:
        if self.step_s:
            time.sleep(self.step_s)
        self.steps += 1
        outputs = []
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
        return Heartbeat(running=len(self.running), steps=self.steps)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.fake_worker", description=__doc__)
    parser.add_argument("--gateway-address", default="tcp://127.0.0.1:5555")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the name to register under")
    parser.add_argument("--step-ms", type=float, default=0.0)
    args = parser.parse_args()
    setup_logging("fake-worker")
    proc = WorkerProc(
        FakeEngine(args.step_ms / 1000),
        args.gateway_address,
        "fake-worker",
        args.model,
        "none",
        "none",
        1.0,
        5,
    )
    proc.install_signal_handlers()
    proc.run()


if __name__ == "__main__":
    main()
