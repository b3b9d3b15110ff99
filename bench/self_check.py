"""``python -m bench.self_check [MODEL] [--dtype D]``: what the start-up self-check costs.

It builds a worker's runner (the self-check runs inside), timing the check's two halves (the
reference forward, the serving steps), then serves the same work as requests (a 21-token and an
8-token prompt, 3 tokens each) and a 30-token prompt's 32 decode steps, for scale: a machine's
load changes every figure, the ratios much less.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "model",
        nargs="?",
        default="SmolLM2-135M-Instruct",
        help="as for --model (e.g. a folder from bench.random_llama)",
    )
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    from common.model_source import resolve_model
    from common.protocol import NewRequest, SamplingParams
    from worker import selfcheck
    from worker.config import WorkerConfig
    from worker.engine import Engine
    from worker.runner import ModelRunner

    times: dict[str, float] = {}

    def timed(name: str, method: Callable) -> Callable:
        def wrapper(*call_args: object) -> None:
            started = time.perf_counter()
            method(*call_args)
            times[name] = time.perf_counter() - started

        return wrapper

    selfcheck.SelfCheck.__init__ = timed("reference", selfcheck.SelfCheck.__init__)
    selfcheck.SelfCheck.run = timed("serving", selfcheck.SelfCheck.run)
    config = WorkerConfig(dtype=args.dtype, kv_cache_memory="256MiB")
    runner = ModelRunner(resolve_model(args.model), config)
    engine = Engine(runner, config)
    greedy = SamplingParams(temperature=0)
    started = time.perf_counter()
    for name, prompt in (("a", range(1000, 1021)), ("b", range(2000, 2008))):
        engine.add_request(NewRequest(name, list(prompt), 3, greedy, ignore_eos=True))
    while engine.has_work():
        engine.step()
    same_work = time.perf_counter() - started
    engine.add_request(NewRequest("c", list(range(3000, 3030)), 33, greedy, ignore_eos=True))
    steps = []
    while engine.has_work():
        started = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - started)
    print(
        f"{args.model} ({runner.dtype}, weights {runner.quantization}): self-check {times['reference'] + times['serving']:.2f} s "
        f"(reference forward {times['reference']:.2f} s, serving steps {times['serving']:.2f} s); the same two requests served after it "
        f"{same_work:.2f} s; a batch-1 decode step {1000 * statistics.median(steps[1:]):.1f} ms (median)"
    )


if __name__ == "__main__":
    main()
