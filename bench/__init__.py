"""The project's benchmarks: each is ``python -m bench.<name>`` (``python -m bench`` is the main one).

The main run (the streaming API against llama-server and others, at several concurrency levels):
    __main__      flags and the run: workloads, servers, levels, the report
    workloads     what each workload sends, and its defaults
    prompts       the fixed prompt set
    load          the concurrent clients, timing every chunk
    stats         one level's summary, with ``vllm bench serve``'s metric names
    report        the printed tables
    plot          the PNG of throughput and latency against concurrency
    servers       starting and stopping the servers a run measures (ours, llama-server)
    baseline      transformers' ``generate``, one request at a time

One question each:
    served_step       served time per token at one stream against the C++ step (and CPU per token)
    cpu_decode        the CPU decode step alone, against this CPU's memory bandwidth
    one_stream_ttft   one stream's time to first token
    memory            time to first token and memory at long prompts
    contention        one stream while another process loads the CPU
    batch             the chat workload with and without a large batch running
    families          decode time per token of each model family
    accuracy          the fast paths against transformers' ``generate``
    self_check        what the start-up self-check costs
    lora              what LoRA rows cost a decode step
    embeddings        embeddings throughput, and their effect on chat
    vision            TTFT and ITL with an image beside text alone (a random LLaVA, tiny or 1B shape)
    kv_store          what ``--kv-store`` buys and costs
    vision            TTFT and ITL of chat with an image beside text alone (a random LLaVA, tiny or 1B-shaped)
    state_cost        what the state store costs the gateway (SQLite, PostgreSQL)
    state_writes      the state store's writes alone
    parallel          replicas against one worker split over ranks, on CPUs
    fleet             the gateway at scale with model-less workers; fleet_routing: its routing cost
    attention_kernels, gpu_decode   CUDA workers' attention backends and batch-1 decode

Models and helpers:
    random_llama  a random-weight Llama of a real size (``--size 1b``)
    gguf_1b       the 1B shape as GGUF files for both servers
    fake_worker   workers with no model, to measure the gateway alone
"""
