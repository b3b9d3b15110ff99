"""``python -m bench.gguf_1b [--out DIR] [--types Q4_1,Q8_0]``: the 1B shape as GGUF files that both
llmpool and llama.cpp's llama-server read, for the benchmark's runs at a real size.

The random Llama-3.2-1B-shaped model (bench/random_llama.py) is converted with llama.cpp's own
``convert_hf_to_gguf.py`` (from the copy bench/build_llama_server.sh unpacks; it needs the
``sentencepiece`` and ``gguf`` packages, pyproject's ``bench`` extra) to a bf16 GGUF, then quantized
with its ``llama-quantize``. Then:

    python -m bench --model DIR/llama-1b-Q4_1.gguf --workload chat --start-llama-server .llama.cpp/build/bin/llama-server
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from bench import random_llama

ROOT = Path(__file__).resolve().parent.parent


def llama_cpp_dir() -> Path:
    """The llama.cpp source tree build_llama_server.sh unpacked."""
    found = sorted((ROOT / ".llama.cpp").glob("llama_cpp_python-*/vendor/llama.cpp"))
    if not found:
        raise SystemExit("no llama.cpp sources: run bench/build_llama_server.sh first")
    return found[-1]


def llama_quantize() -> Path:
    """The ``llama-quantize`` of any llama.cpp build here (native or ``ISA=avx2``: the files are the same)."""
    found = sorted((ROOT / ".llama.cpp").glob("build*/bin/llama-quantize"))
    if not found:
        raise SystemExit("no llama-quantize: run bench/build_llama_server.sh first")
    return found[0]


def make(out: Path, types: list[str]) -> list[Path]:
    """The GGUF files of the 1B shape, one per type (made once; later calls find them)."""
    out.mkdir(parents=True, exist_ok=True)
    wanted = [out / f"llama-1b-{t}.gguf" for t in types]
    if all(p.is_file() for p in wanted):
        return wanted
    hf = random_llama.build(out / "hf", "1b")
    source = out / "llama-1b-bf16.gguf"
    if not source.is_file():
        convert = llama_cpp_dir() / "convert_hf_to_gguf.py"
        subprocess.run(
            [sys.executable, str(convert), str(hf), "--outfile", str(source), "--outtype", "bf16"], check=True
        )
    quantize = llama_quantize()
    for kind, target in zip(types, wanted):
        if not target.is_file():
            subprocess.run([str(quantize), str(source), str(target), kind], check=True)
    return wanted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / ".models")
    parser.add_argument("--types", default="Q4_1,Q8_0")
    args = parser.parse_args()
    for path in make(args.out, args.types.split(",")):
        print(path)


if __name__ == "__main__":
    main()
