#!/usr/bin/env python3
"""GGUF files made by llama.cpp's own tools from a Hugging Face model directory: its
converter (``convert_hf_to_gguf.py``) and its quantizer (``llama-quantize``), both taken
from the ``llama-cpp-python`` source package on PyPI (which vendors llama.cpp).

    python tools/gguf_files.py HF_DIR OUT.gguf --type Q4_K_M [--pre gpt-2] [--cache DIR]
    python tools/gguf_files.py --build-quantize [--cache DIR]     # fetch + build only

``--type``: f32, f16, bf16, q8_0 (the converter writes these itself) or any type
``llama-quantize`` knows (Q4_0, Q4_K_M, Q5_K_M, Q6_K, ...: converted to f32 first, then
quantized). ``--split-max-tensors N`` writes split files (``-00001-of-0000N.gguf``; the
converter's types only).

``--pre NAME``: the converter names a BPE tokenizer's pre-tokenizer (``tokenizer.ggml.pre``)
by hashing its output on a probe text against the published tokenizers it knows; a
tokenizer trained locally (tools/make_model.py) matches none, so the caller names the
pre-tokenizer its ``tokenizer.json`` implements (``gpt-2`` for make_model's byte-level
BPE, ``qwen2`` / ``llama-bpe`` for those regexes).

The source package is downloaded once into ``--cache`` (``pip download``), and
``llama-quantize`` built there once (CMake, CPU only, that target only), so later runs
reuse both.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
CONVERTER_TYPES = ("f32", "f16", "bf16", "q8_0")
DEFAULT_CACHE = Path.home() / ".cache" / "edge-tools"

# Run as `python -c` in a child: names the pre-tokenizer instead of the converter's hash
# lookup, then runs the converter as its own __main__ (its vendored gguf-py first on the path).
_CONVERT_WITH_PRE = """
import runpy, sys
src, pre = sys.argv[1], sys.argv[2]
sys.path.insert(0, src)
import conversion.base
if pre:
    conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
sys.argv = [src + "/convert_hf_to_gguf.py", *sys.argv[3:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


class ToolError(RuntimeError):
    """A step failed; the message says which, with the tail of its output."""


def _run(cmd: list[str], what: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-25:])
        raise ToolError(f"{what} failed (exit {proc.returncode}):\n{tail}")


def llama_cpp_source(cache: Path, version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """The llama.cpp tree vendored by llama-cpp-python ``version``, downloaded and
    unpacked into ``cache`` once (the vocabulary test files under models/ included)."""
    root = cache / f"llama_cpp_python-{version}"
    src = root / "vendor" / "llama.cpp"
    if (src / "convert_hf_to_gguf.py").is_file():
        return src
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        _run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={version}", "-d", tmp],
            "pip download llama-cpp-python",
        )
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        unpack = Path(tmp) / "unpacked"
        prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            tar.extractall(unpack, members=members, filter="data")
        shutil.rmtree(root, ignore_errors=True)
        os.replace(unpack / f"llama_cpp_python-{version}", root)
    return src


def quantize_binary(cache: Path, src: Path, jobs: int = 2) -> Path:
    """``llama-quantize`` built from ``src`` (CPU only, that target only) under ``cache``."""
    build = cache / f"build-{src.parent.parent.name}"
    exe = build / "bin" / "llama-quantize"
    if exe.is_file():
        return exe
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    _run(
        ["cmake", "-S", str(src), "-B", str(build), *gen, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF",
         "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
         "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DGGML_OPENMP=OFF"],
        "cmake configure (llama.cpp)",
    )
    _run(["cmake", "--build", str(build), "--target", "llama-quantize", f"-j{jobs}"], "build llama-quantize")
    if not exe.is_file():
        raise ToolError(f"the build did not produce {exe}")
    return exe


def convert(src: Path, hf_dir: Path, out: Path, outtype: str, pre: str | None = None,
            split_max_tensors: int | None = None, vocab_only: bool = False) -> list[Path]:
    """``convert_hf_to_gguf.py`` on ``hf_dir`` -> ``out`` (or its split files; with
    ``vocab_only`` the metadata and tokenizer without tensors)."""
    if outtype not in CONVERTER_TYPES:
        raise ToolError(f"the converter writes {CONVERTER_TYPES}, not {outtype!r}")
    args = [str(hf_dir), "--outfile", str(out), "--outtype", outtype]
    if split_max_tensors:
        args += ["--split-max-tensors", str(split_max_tensors)]
    if vocab_only:
        args.append("--vocab-only")
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    _run([sys.executable, "-c", _CONVERT_WITH_PRE, str(src), pre or "", *args], "convert_hf_to_gguf.py", env=env)
    if split_max_tensors:
        return sorted(out.parent.glob(out.stem + "-0*-of-0*.gguf"))
    return [out]


def quantize(exe: Path, source: Path, out: Path, qtype: str, threads: int = 2) -> Path:
    _run([str(exe), str(source), str(out), qtype, str(threads)], f"llama-quantize {qtype}")
    return out


def make_gguf(hf_dir: Path, out: Path, qtype: str, cache: Path = DEFAULT_CACHE, pre: str | None = None,
              split_max_tensors: int | None = None, jobs: int = 2) -> list[Path]:
    """A GGUF file of ``qtype`` made from ``hf_dir`` by llama.cpp's tools (module docstring)."""
    src = llama_cpp_source(cache)
    out.parent.mkdir(parents=True, exist_ok=True)
    if qtype.lower() in CONVERTER_TYPES:
        return convert(src, hf_dir, out, qtype.lower(), pre, split_max_tensors)
    if split_max_tensors:
        raise ToolError("split files come from the converter's types only")
    exe = quantize_binary(cache, src, jobs)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        f32 = Path(tmp) / "f32.gguf"
        convert(src, hf_dir, f32, "f32", pre)
        quantize(exe, f32, out, qtype, jobs)
    return [out]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("hf_dir", type=Path, nargs="?")
    p.add_argument("out", type=Path, nargs="?")
    p.add_argument("--type", default="f32", help="f32, f16, bf16, q8_0 or a llama-quantize type (Q4_K_M, ...)")
    p.add_argument("--pre", default=None, help="the tokenizer's pre-tokenizer name (tokenizer.ggml.pre)")
    p.add_argument("--split-max-tensors", type=int, default=None)
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help=f"download and build directory ({DEFAULT_CACHE})")
    p.add_argument("--jobs", type=int, default=2, help="build jobs and quantize threads")
    p.add_argument("--build-quantize", action="store_true", help="only fetch the source and build llama-quantize")
    args = p.parse_args(argv)
    try:
        if args.build_quantize:
            print(quantize_binary(args.cache, llama_cpp_source(args.cache), args.jobs))
            return 0
        if args.hf_dir is None or args.out is None:
            p.error("HF_DIR and OUT are required")
        for path in make_gguf(args.hf_dir, args.out, args.type, args.cache, args.pre, args.split_max_tensors, args.jobs):
            print(path)
    except ToolError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
