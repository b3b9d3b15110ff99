"""``python -m worker`` / ``llmpool worker``: load the model and serve the gateway over ZeroMQ."""

from __future__ import annotations

import argparse
import gc
import logging

from common.config import add_flags, from_namespace
from common.logs import setup_logging
from common.model_source import bundle_tokenizer, load_tokenizer, read_chat_template, resolve_model
from worker.config import ALL_WORKER_FLAGS, WorkerConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmpool worker", description=__doc__)
    add_flags(parser, "worker", ALL_WORKER_FLAGS)
    return parser


def main(argv: list[str] | None = None) -> None:
    config = from_namespace(WorkerConfig, build_parser().parse_args(argv))
    setup_logging("worker", config.log_level, config.log_format)
    from worker.build import build_engine  # heavy imports (torch) after argument parsing
    from worker.proc import WorkerProc
    from worker.stepper import StepThread

    source = resolve_model(config.model, config.served_model_name)
    tokenizer = load_tokenizer(source, config.cache_dir)  # cached after the first run (GGUF: about 3 s once)
    bundle = bundle_tokenizer(tokenizer, read_chat_template(config.chat_template, getattr(tokenizer, "chat_template", None)))
    stepper = StepThread()  # steps run off the socket thread, on the thread that loads the model
    engine = stepper.call(build_engine, source, config)
    runner = engine.runner
    proc = WorkerProc(
        engine,
        config.gateway_address,
        config.worker_name,
        source.name,
        str(runner.device),
        str(runner.dtype).removeprefix("torch."),
        config.heartbeat_interval,
        config.heartbeat_liveness,
        config.drain_timeout,
        (config.curve_client_secret_key, config.curve_server_public_key) if config.curve_client_secret_key else None,
        bundle,
        stepper,
    )
    proc.install_signal_handlers()
    # Everything loaded so far (model modules, tokenizer, torch's own objects) lives as long as the
    # process: keep it out of the collector's scans. A full collection walked it all, costing 263 ms
    # over 128 batch-1 decode steps (2 ms a token on average, in pauses of tens of ms); after
    # freezing, 4 ms.
    gc.freeze()
    logging.getLogger(__name__).info("worker ready: %s on %s (%s), %d KV blocks", source.name, runner.device, runner.dtype, runner.num_blocks)
    proc.run()
    if engine.kv_store is not None:
        engine.kv_store.close()


if __name__ == "__main__":
    main()
