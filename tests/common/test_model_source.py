"""Where converted GGUF files are cached: one folder per file, whatever name serves it."""

import os

from common.model_source import ModelSource


def test_one_gguf_file_served_under_two_names_shares_its_conversion_cache(tmp_path):
    (tmp_path / "model.Q4_1.gguf").write_bytes(b"GGUF" + bytes(60))
    alpha, beta = (ModelSource(name, str(tmp_path), "model.Q4_1.gguf") for name in ("alpha", "beta"))
    folder = alpha.cache_dir("/cache", "weights-bfloat16")
    assert folder == beta.cache_dir("/cache", "weights-bfloat16")
    assert folder.parent.name.startswith("model.Q4_1-") and folder.name == "weights-bfloat16"
    os.utime(tmp_path / "model.Q4_1.gguf", ns=(0, 0))  # a replaced file is converted again
    assert alpha.cache_dir("/cache", "weights-bfloat16") != folder
    assert ModelSource("plain", str(tmp_path)).cache_dir("/cache", "tokenizer") is None  # not GGUF: nothing converted
