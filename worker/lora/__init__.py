"""LoRA adapters served beside the base model (``--lora``, ``/v1/load_lora_adapter``): their files
(``adapter.py``), which are registered and which resident (``registry.py``). A step's rows of each
adapter get that adapter's low-rank product added after every adapted projection of the native
forward (worker/models/llama.py); rows of the base model and of other adapters share the step."""
