"""CPU-only checks of the CUDA kernel sources: every instantiation compiles with NVRTC
for sm_87 (Jetson Orin) and sm_90 (H100/H200) without errors or warnings, every kernel
waits for its predecessor where launches may overlap (sm_90) and carries no such
instruction for Orin, the disk cache works, and a missing cuda-python gives a helpful
KernelsUnavailable."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from edge.kernels import nvrtc
from edge.kernels.nvrtc import KernelCompileError, KernelsUnavailable

ARCHS = ("sm_87", "sm_90")
READ_FLOOR = Path(__file__).resolve().parent.parent / "tools" / "kernels" / "read_floor.cu"

# (source, defines) for every kernel instantiation the wrappers can ask for.
VARIANTS = [
    *[
        ("paged_decode.cu", {"CFG_DTYPE": dt, "CFG_HEAD_DIM": d})
        for dt in (1, 2, 3)
        for d in (64, 128)
    ],
    *[
        ("paged_decode_tc.cu", {"CFG_DTYPE": dt, "CFG_HEAD_DIM": d})
        for dt in (1, 2)
        for d in (64, 128)
    ],
    *[
        ("paged_prefill.cu", {"CFG_DTYPE": dt, "CFG_HEAD_DIM": d})
        for dt in (1, 2)
        for d in (64, 128)
    ],
    # The int8-KV programs (pools of int8 codes and float32 scales, queries of any dtype).
    *[
        ("paged_decode.cu", {"CFG_DTYPE": dt, "CFG_HEAD_DIM": d, "CFG_KV_INT8": 1})
        for dt in (1, 2, 3)
        for d in (64, 128)
    ],
    *[
        (src, {"CFG_DTYPE": dt, "CFG_HEAD_DIM": d, "CFG_KV_INT8": 1})
        for src in ("paged_decode_tc.cu", "paged_prefill.cu")
        for dt in (1, 2)
        for d in (64, 128)
    ],
    ("kv_write.cu", {}),
    (str(READ_FLOOR), {}),  # tools/bench.py kernels --floor
    ("fused.cu", {}),  # every fused norm / qk_norm_rope / silu_mul instantiation
    ("int8_gemv.cu", {}),
    (
        "int8_gemv.cu",
        {"CFG_INT8_WARPS": 8, "CFG_INT8_UNROLL_R1": 8, "CFG_INT8_MIN_BLOCKS": 2},
    ),
    ("int4_gemv.cu", {}),  # float16 scales, the default tuning
    ("int8_mma.cu", {}),  # the verify step's int8 linears on tensor cores, every mode
    ("int8_mma.cu", {"CFG_INT8_MMA_UNROLL": 1, "CFG_INT8_MMA_NORM_UNROLL": 4}),  # Int8Tuning.for_sms(16)
    ("int8_mma.cu", {"CFG_INT8_MMA_WARPS": 4, "CFG_INT8_MMA_UNROLL": 1, "CFG_INT8_MMA_NORM_UNROLL": 4}),  # its norm mode
    ("dequant.cu", {}),  # every int4 / int8 prefill expansion
    (
        "int4_gemv.cu",
        {"CFG_INT4_SCALE": 2, "CFG_INT4_WARPS": 4, "CFG_INT4_UNROLL": 2, "CFG_INT4_DIRECT_UNROLL": 1,
         "CFG_INT4_MIN_BLOCKS": 0},
    ),
    ("int4_gemv.cu", {"CFG_INT4_SKIP_MATH": 1}),  # tools/bench_int4.py gemv --sweep
    ("int4_gemv.cu", {"CFG_INT4_PREFETCH": 4}),
]
# Tuning variants of the decode kernel that tools/bench.py may select.
TUNINGS = [
    ("paged_decode.cu", {"CFG_DECODE_STAGES": 2, "CFG_DECODE_STAGE_BYTES": 8192}),
    ("paged_decode.cu", {"CFG_DECODE_STAGES": 4, "CFG_DECODE_STAGE_BYTES": 4096}),
    ("paged_decode.cu", {"CFG_DECODE_QACC_REGS": 128, "CFG_DECODE_MIN_BLOCKS": 2}),
    ("paged_decode_tc.cu", {"CFG_TC_WARPS": 1, "CFG_TC_STAGES": 4}),
    ("paged_decode_tc.cu", {"CFG_TC_WARPS": 2, "CFG_TC_STAGES": 1}),
    ("paged_decode_tc.cu", {"CFG_TC_WARPS": 4, "CFG_TC_STAGES": 2}),
    ("paged_decode_tc.cu", {"CFG_TC_WARPS": 4, "CFG_TC_STAGES": 4, "CFG_TC_MIN_BLOCKS": 1}),
    ("paged_decode_tc.cu", {"CFG_TC_WARPS": 8, "CFG_TC_STAGES": 3}),
    ("paged_decode_tc.cu", {"CFG_TC_WARPS": 4, "CFG_TC_STAGES": 3, "CFG_KV_INT8": 1}),
    ("paged_decode_tc.cu", {"CFG_TC_WARPS": 8, "CFG_TC_STAGES": 4, "CFG_KV_INT8": 1}),
    (
        "paged_decode_tc.cu",
        {"CFG_TC_WARPS": 4, "CFG_TC_STAGES": 1, "CFG_TC_MIN_BLOCKS": 3},
    ),
]


def _nvrtc_or_skip() -> None:
    try:
        nvrtc.check_available()
    except KernelsUnavailable as exc:
        pytest.skip(f"NVRTC toolchain not installed: {exc}")


def _vid(v) -> str:
    src, defs = v
    return Path(src).name.replace(".cu", "") + "".join(
        f"-{k.replace('CFG_', '').lower()}{val}" for k, val in defs.items()
    )


def _compile(source: str, arch: str, defines: dict) -> tuple[bytes, str]:
    """(cubin, PTX) of one NVRTC compilation for a real arch, with the options the
    production path builds (nvrtc.compile_cubin: cuda.core's ProgramOptions), so one
    compile serves both checks. Any log output fails, as it does there."""
    rt = nvrtc._nvrtc_module()
    path = Path(source) if Path(source).is_absolute() else nvrtc.KERNEL_DIR / source
    opts = nvrtc.core().ProgramOptions(
        name=source, arch=arch, std=nvrtc.STD, include_path=[str(nvrtc.KERNEL_DIR), *nvrtc.cuda_include_dirs()],
        define_macro=list(nvrtc._normalize_defines(defines)) or None,
    ).as_bytes("nvrtc")
    err, prog = rt.nvrtcCreateProgram(path.read_bytes(), source.encode(), 0, [], [])
    assert int(err) == 0, err
    try:
        (err,) = rt.nvrtcCompileProgram(prog, len(opts), list(opts))
        _, log_size = rt.nvrtcGetProgramLogSize(prog)
        # NVRTC writes into the buffers it is given: bytearrays (a bytes object is immutable,
        # and b" " * 1 is the interpreter's shared b" ", which an empty log would overwrite).
        log = bytearray(log_size)
        rt.nvrtcGetProgramLog(prog, log)
        text = log.decode(errors="replace").replace("\x00", "").strip()
        assert int(err) == 0 and not text, f"{source} ({arch}, {defines}):\n{text}"
        _, size = rt.nvrtcGetCUBINSize(prog)
        cubin = bytearray(size)
        (err,) = rt.nvrtcGetCUBIN(prog, cubin)
        assert int(err) == 0, err
        _, size = rt.nvrtcGetPTXSize(prog)
        ptx = bytearray(size)
        (err,) = rt.nvrtcGetPTX(prog, ptx)
        assert int(err) == 0, err
        return bytes(cubin), ptx.decode(errors="replace")
    finally:
        rt.nvrtcDestroyProgram(prog)


def _tuning_jobs(arch: str, tuning: tuple[str, dict]) -> list[tuple]:
    source, knobs = tuning
    return [("both", source, arch, _key({"CFG_DTYPE": dtype, "CFG_HEAD_DIM": 128, **knobs}))
            for dtype in ((2,) if "_tc" in source else (2, 3))]


def _smem_jobs(warps: int, stages: int) -> list[tuple]:
    # float16 and bfloat16 stage 2-byte elements alike: both at the default tuning, bf16 elsewhere.
    codes = (1, 2) if (warps, stages) == (8, 2) else (2,)
    # int8 KV (bf16 only): stages of codes and scales, entry points suffixed _q8.
    return [("ptx", "paged_decode_tc.cu", "sm_87",
             _key({"CFG_DTYPE": code, "CFG_HEAD_DIM": d, "CFG_TC_WARPS": warps, "CFG_TC_STAGES": stages}
                  | ({"CFG_KV_INT8": 1} if q8 else {})))
            for code in codes for d in (64, 128) for q8 in ((False, True) if code == 2 else (False,))]


def _key(defines: dict) -> tuple[tuple[str, object], ...]:
    return tuple(defines.items())


def _variant_job(arch: str, variant: tuple[str, dict]) -> tuple:
    """sm_87 (the product's target): cubin and PTX; sm_90: the PTX its overlap check reads."""
    return ("both" if arch == "sm_87" else "ptx", variant[0], arch, _key(variant[1]))


def _jobs_of(test: str, params: dict) -> list[tuple]:
    if test == "test_kernel_compiles_cleanly_and_waits_for_its_predecessor":
        return [_variant_job(params["arch"], params["variant"])]
    if test == "test_decode_tunings_compile":
        return _tuning_jobs(params["arch"], params["tuning"])
    if test == "test_decode_tc_asks_for_the_shared_memory_the_host_passes":
        return _smem_jobs(params["warps"], params["stages"])
    return []


def _run(job: tuple):
    kind, source, arch, defines = job
    return _compile(source, arch, dict(defines)) if kind == "both" else _ptx(source, arch, dict(defines))


@pytest.fixture(scope="module")
def compiled(request: pytest.FixtureRequest):
    """The NVRTC compiles of this module's selected tests, started at once on every core
    (NVRTC releases the GIL): each test then checks its own result, so a failure still
    names its variant, and the module takes the wall time of its compiles spread over
    the cores instead of their sum."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    _nvrtc_or_skip()
    jobs: dict[tuple, None] = {}
    for item in request.session.items:
        if item.module is request.module and hasattr(item, "callspec"):
            jobs.update(dict.fromkeys(_jobs_of(item.originalname, item.callspec.params)))
    pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="nvrtc")
    futures = {job: pool.submit(_run, job) for job in jobs}
    yield lambda job: (futures[job] if job in futures else pool.submit(_run, job)).result()
    pool.shutdown(wait=True, cancel_futures=True)


def _sm90_variants() -> list[tuple[str, dict]]:
    """One instantiation per source and K/V form for sm_90: the griddepcontrol code is the
    same macro in every instantiation of a kernel, and every instantiation already
    compiles (more strictly: less shared memory, fewer registers) for sm_87."""
    seen: dict[tuple[str, bool], tuple[str, dict]] = {}
    for src, defines in VARIANTS:
        seen.setdefault((src, "CFG_KV_INT8" in defines), (src, defines))
    return list(seen.values())


ARCH_VARIANTS = [("sm_87", v) for v in VARIANTS] + [("sm_90", v) for v in _sm90_variants()]


@pytest.mark.parametrize(("arch", "variant"), ARCH_VARIANTS, ids=[f"{a}-{_vid(v)}" for a, v in ARCH_VARIANTS])
def test_kernel_compiles_cleanly_and_waits_for_its_predecessor(arch, variant, compiled):
    """Every instantiation compiles for Orin without a warning, and each kernel for sm_90. The decode graph
    launches every kernel overlapped on sm_90 (nvrtc.overlapped): a kernel without
    griddepcontrol.wait would read its inputs before they are written, so on sm_90 each
    entry waits and lets the next kernel start; Orin (sm_87) has no such instruction.
    For sm_87 a cubin and its PTX from one compilation; for sm_90 the PTX."""
    if arch == "sm_87":
        cubin, ptx = compiled(_variant_job(arch, variant))
        assert cubin[:4] == b"\x7fELF"
        assert "griddepcontrol" not in ptx
        return
    source = variant[0]
    ptx = compiled(_variant_job(arch, variant))
    entries = ptx.split(".entry ")[1:]
    assert entries
    for body in entries:
        name = body.split("(", 1)[0]
        assert "griddepcontrol.wait" in body, f"{source}: {name} never waits for the previous kernel"
        assert "griddepcontrol.launch_dependents" in body, f"{source}: {name} never lets the next kernel start"


@pytest.mark.parametrize("arch", ARCHS)
def test_the_checked_compile_is_the_production_compile(arch, tmp_path, monkeypatch):
    """_compile builds the options as nvrtc.compile_cubin does: the same cubin, bit for bit."""
    _nvrtc_or_skip()
    monkeypatch.setenv("EDGE_CACHE_DIR", str(tmp_path))
    defines = {"CFG_DTYPE": 2, "CFG_HEAD_DIM": 64}
    assert _compile("paged_prefill.cu", arch, defines)[0] == nvrtc.compile_cubin(
        "paged_prefill.cu", arch, defines, use_cache=False)


def _ptx(source: str, arch: str, defines: dict) -> str:
    """PTX of a kernel source (raw NVRTC: cuda.core's PTX path asks the driver)."""
    rt = nvrtc._nvrtc_module()
    err, prog = rt.nvrtcCreateProgram((nvrtc.KERNEL_DIR / source).read_bytes(), source.encode(), 0, [], [])
    assert int(err) == 0, err
    opts = [f"--gpu-architecture=compute_{arch[3:]}", f"--std={nvrtc.STD}", f"-I{nvrtc.KERNEL_DIR}"]
    opts += [f"-I{d}" for d in nvrtc.cuda_include_dirs()] + [f"-D{k}={v}" for k, v in defines.items()]
    try:
        (err,) = rt.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        assert int(err) == 0, err
        err, size = rt.nvrtcGetPTXSize(prog)
        buf = bytearray(size)
        (err,) = rt.nvrtcGetPTX(prog, buf)
        assert int(err) == 0, err
        return buf.decode(errors="replace")
    finally:
        rt.nvrtcDestroyProgram(prog)


@pytest.mark.parametrize("arch", ["sm_87"])  # the tunings are Orin's; sm_87 is the stricter target
@pytest.mark.parametrize(
    "tuning",
    TUNINGS,
    ids=lambda t: (
        t[0].replace(".cu", "") + "-" + "-".join(str(v) for v in t[1].values())
    ),
)
def test_decode_tunings_compile(arch, tuning, compiled):
    for job in _tuning_jobs(arch, tuning):
        cubin, _ = compiled(job)
        assert cubin[:4] == b"\x7fELF"


@pytest.mark.parametrize(
    # The corners of the tunings' range, and the default (8, 2) in every dtype.
    "warps,stages", [(8, 1), (8, 2), (8, 4), (4, 3), (2, 4), (1, 4)]
)
def test_decode_tc_asks_for_the_shared_memory_the_host_passes(warps, stages, compiled):
    """The tensor-core decode kernel's pipeline lives in dynamic shared memory whose size
    the host works out (paged_cuda.tc_smem_bytes) and the kernel traps below: the two
    formulas must agree for every entry point (the verify step's pairs of row tiles
    have stages of half the keys), dtype, head_dim and tuning."""
    import re

    import torch

    from edge.kernels import paged_cuda

    dtypes = {1: torch.float16, 2: torch.bfloat16}
    for job in _smem_jobs(warps, stages):
        defines = dict(job[3])
        dtype, d = dtypes[defines["CFG_DTYPE"]], defines["CFG_HEAD_DIM"]
        ptx = compiled(job)
        entries = re.split(r"\.visible \.entry ", ptx)[1:]
        names = sorted(e.split("(")[0] for e in entries)
        # Pairs of row tiles split the warps: an even count only (DecodeTuning says so).
        pairs = ["paged_verify_tc_pair", "paged_verify_tc_pair_rope"] if warps % 2 == 0 else []
        q8 = defines.get("CFG_KV_INT8") == 1
        want = ["paged_decode_tc", "paged_decode_tc_rope", "paged_verify_tc", "paged_verify_tc_rope", *pairs]
        assert names == sorted(n + ("_q8" if q8 else "") for n in want), names
        for entry in entries:
            name = entry.split("(")[0]
            reg = re.search(r"mov\.u32 (%r\d+), %dynamic_smem_size;", entry).group(1)
            op, n = re.search(rf"setp\.(gt|ge|lt)\.u32\s+%p\d+, {re.escape(reg)}, (\d+);", entry).groups()
            needed = int(n) + 1 if op == "gt" else int(n)
            tiles = 2 if "_pair" in name else 1
            assert needed == paged_cuda.tc_smem_bytes(dtype, d, warps, stages, tiles, q8), (name, dtype, d)


@pytest.mark.parametrize(
    "per_sm,optin,want,want64,want_q8",
    [
        (233472, 232448, 3, 3, 4),  # H100 / H200: 228 KB an SM
        (167936, 166912, 2, 3, 4),  # Orin (sm_87): 164 KB an SM
        (102400, 101376, 1, 2, 2),  # 100 KB an SM (sm_86 / sm_89)
    ],
)
def test_decode_tc_stages_follow_the_shared_memory_of_the_device(
    monkeypatch, per_sm, optin, want, want64, want_q8
):
    """One 8-warp CTA of 128-key bf16 stages (68 KB a stage at head_dim 128, 36 KB at
    64) holds each SM, so a pipeline allowed 3 stages is as deep as the SM's shared
    memory allows; the default allows two. 4-warp CTAs (34 KB / 18 KB a stage) are
    sized for two an SM, and come to the same depths. Int8 stages (37 KB at 128) may go
    twice as deep: four by default where they fit."""
    import torch

    from edge.kernels import paged_cuda

    smem = (per_sm, optin, 1024)
    tune = paged_cuda.DecodeTuning
    assert paged_cuda.tc_stages(tune(), smem, torch.bfloat16, 128) == min(want, 2)
    assert paged_cuda.tc_stages(tune(tc_max_stages=3), smem, torch.bfloat16, 128) == want
    assert paged_cuda.tc_stages(tune(tc_max_stages=3), smem, torch.bfloat16, 64) == want64
    assert paged_cuda.tc_stages(tune(tc_warps=4, tc_max_stages=3), smem, torch.bfloat16, 128) == want
    assert paged_cuda.tc_stages(tune(tc_warps=4, tc_max_stages=3), smem, torch.bfloat16, 64) == want64
    assert paged_cuda.tc_stages(tune(tc_stages=4), smem, torch.bfloat16, 128) == 4  # a tuning wins
    assert paged_cuda.tc_stages(tune(), smem, torch.bfloat16, 128, q8=True) == want_q8
    assert paged_cuda.tc_stages(tune(tc_stages=3), smem, torch.bfloat16, 128, q8=True) == 3


def test_verify_row_tiles_in_pairs_need_an_even_warp_count():
    """A verify CTA's pair of row tiles takes half its warps each: 1 or 2 tiles, and 2
    only where the warps split evenly (the kernel has no pair entry points otherwise)."""
    import pytest

    from edge.kernels import paged_cuda

    assert paged_cuda.DecodeTuning().verify_tiles == 2
    assert paged_cuda.DecodeTuning(tc_warps=1, verify_tiles=1).verify_tiles == 1
    for bad in ({"verify_tiles": 3}, {"verify_tiles": 0}, {"tc_warps": 1}, {"tc_warps": 1, "verify_tiles": 2}):
        with pytest.raises(ValueError, match="verify_tiles"):
            paged_cuda.DecodeTuning(**bad)


def test_split_mergers_only_when_the_whole_grid_is_resident():
    """Mergers wait for every split of their KV head, so they run only when every CTA of
    the launch is resident at once; a larger grid gets 0: the last CTA to arrive merges
    alone, waiting for nobody."""
    from edge.kernels import paged_cuda

    def _plan(mergers: int = 8) -> paged_cuda._DecodePlan:  # as _DecodePlan builds it under a tuning
        p = object.__new__(paged_cuda._DecodePlan)
        p.ctas, p.wave = 8, 264  # 8 KV heads; 2 CTAs an SM x 132 SMs
        p.merge_cap = paged_cuda.DecodeTuning(mergers=mergers).mergers
        return p

    plan = _plan()
    assert plan.mergers(32, 1) == 8
    assert plan.mergers(33, 1) == 8  # 264 CTAs: exactly one wave
    assert plan.mergers(16, 1) == 8  # at most one per 2 splits
    assert _plan(16).mergers(16, 1) == 8
    assert plan.mergers(8, 1) == 1  # short launches: one merger is faster
    assert plan.mergers(34, 1) == 0  # 272 CTAs: some would wait for a slot
    assert plan.mergers(32, 2) == 0  # tokens multiply the grid
    assert _plan(1).mergers(32, 1) == 1


def test_disk_cache_roundtrip(tmp_path, monkeypatch):
    _nvrtc_or_skip()
    monkeypatch.setenv("EDGE_CACHE_DIR", str(tmp_path))
    a = nvrtc.compile_cubin("kv_write.cu", "sm_87")
    files = list((tmp_path / "kernels").glob("kv_write-sm_87-*.cubin"))
    assert len(files) == 1 and files[0].read_bytes() == a
    assert not list((tmp_path / "kernels").glob("*.tmp"))
    assert nvrtc.compile_cubin("kv_write.cu", "sm_87") == a  # served from the cache
    # The key covers arch and options.
    k87 = nvrtc.cache_key(
        "paged_decode.cu", "sm_87", {"CFG_DTYPE": 2, "CFG_HEAD_DIM": 128}
    )
    assert k87 != nvrtc.cache_key(
        "paged_decode.cu", "sm_90", {"CFG_DTYPE": 2, "CFG_HEAD_DIM": 128}
    )
    assert k87 != nvrtc.cache_key(
        "paged_decode.cu", "sm_87", {"CFG_DTYPE": 1, "CFG_HEAD_DIM": 128}
    )


def test_warnings_are_errors(tmp_path, monkeypatch):
    _nvrtc_or_skip()
    monkeypatch.setenv("EDGE_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "warn.cu").write_text(
        'extern "C" __global__ void k(float* x) { int unused; x[threadIdx.x] = 1.f; }\n'
    )
    (tmp_path / "bad.cu").write_text(
        'extern "C" __global__ void k(float* x) { x[0] = undefined_name; }\n'
    )
    monkeypatch.setattr(nvrtc, "KERNEL_DIR", tmp_path)
    with pytest.raises(KernelCompileError, match="warning"):
        nvrtc.compile_cubin("warn.cu", "sm_87")
    with pytest.raises(KernelCompileError, match="undefined_name"):
        nvrtc.compile_cubin("bad.cu", "sm_87")
    assert not (tmp_path / "cache" / "kernels").exists() or not list(
        (tmp_path / "cache" / "kernels").iterdir()
    )


def test_bad_arch_rejected():
    with pytest.raises(ValueError):
        nvrtc.compile_cubin("kv_write.cu", "87")


@pytest.fixture
def fresh_discovery():
    nvrtc._reset_for_tests()
    yield
    nvrtc._reset_for_tests()


def test_missing_cuda_python_raises_kernels_unavailable(monkeypatch, fresh_discovery):
    for name in (
        "cuda",
        "cuda.core",
        "cuda.core.experimental",
        "cuda.bindings",
        "cuda.bindings.nvrtc",
    ):
        monkeypatch.setitem(
            sys.modules, name, None
        )  # makes `import name` raise ImportError
    with pytest.raises(KernelsUnavailable) as info:
        nvrtc.core()
    msg = str(info.value)
    assert "cuda-python" in msg and "cuda.core" in msg and "pip install" in msg
    with pytest.raises(KernelsUnavailable):
        nvrtc.compile_cubin("kv_write.cu", "sm_87")
    with pytest.raises(KernelsUnavailable):
        nvrtc.check_available()

    import torch

    from edge.runtime.backend import BackendUnavailable, select_backend
    from edge.model.config import ModelConfig

    cfg = ModelConfig("qwen3", 64, 64, 128, 1, 2, 1, 32, 1e-6, 1e6, 64, True, False, True)
    with pytest.raises(BackendUnavailable, match="kernels cannot be used.*--kernels reference"):
        select_backend(cfg, torch.device("cuda"), torch.bfloat16, kernels="auto")


def test_missing_headers_named(monkeypatch, fresh_discovery, tmp_path):
    try:
        nvrtc.core()
    except KernelsUnavailable as exc:
        pytest.skip(str(exc))
    monkeypatch.setattr(
        nvrtc, "_header_dir_candidates", lambda: [("test", str(tmp_path / "nowhere"))]
    )
    with pytest.raises(KernelsUnavailable, match="cuda_fp16.h"):
        nvrtc.cuda_include_dirs()


def test_launches_overlap_only_on_sm90_and_in_the_overlapped_launcher(monkeypatch):
    try:
        nvrtc.core()
    except KernelsUnavailable as exc:
        pytest.skip(str(exc))
    from edge.kernels.launcher import Launcher

    try:
        nvrtc.core().LaunchConfig(grid=(1,), block=(32,), programmatic_stream_serialization=True)
        has_attr = True
    except TypeError:  # an older cuda.core: launches stay serialised
        has_attr = False
    supported = {}
    try:
        for arch in ("sm_87", "sm_90"):
            nvrtc.overlap_supported.cache_clear()
            monkeypatch.setattr(nvrtc, "device_arch", lambda index: arch)
            supported[arch] = nvrtc.overlap_supported(0)
            plain = Launcher(0, sms=16)
            assert not plain.overlap and plain.overlapped().overlap is supported[arch]
            assert plain.overlapped().counts is plain.counts  # siblings share counts and kernels
    finally:
        nvrtc.overlap_supported.cache_clear()
    assert supported == {"sm_87": False, "sm_90": has_attr}
    cfg = nvrtc.launch_config((2,), (64,), 0, has_attr)
    assert getattr(cfg, "programmatic_stream_serialization", False) is has_attr


def test_no_gpu_is_backend_unavailable():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    from edge.runtime.backend import BackendUnavailable, select_backend
    from edge.model.config import ModelConfig

    cfg = ModelConfig("qwen3", 64, 64, 128, 1, 2, 1, 32, 1e-6, 1e6, 64, True, False, True)
    with pytest.raises(BackendUnavailable, match="GPU"):
        select_backend(cfg, torch.device("cuda"), torch.bfloat16)
    # The operator's explicit choice is not an error.
    assert select_backend(cfg, torch.device("cuda"), torch.bfloat16, kernels="reference").kind == "reference"


def test_launcher_scratch_is_per_stream_grows_and_keeps_what_it_replaced(monkeypatch):
    """Kernel scratch buffers (split partials, argmax slots) are one set per launcher and
    stream: a stream gets its own back while they fit, a larger request replaces them
    (the old ones stay alive for graphs that captured them), concurrent first uses from
    several threads make one set, and another launcher (engine) has its own."""
    import threading

    from edge.kernels.launcher import Launcher

    stream = {"handle": 11}
    monkeypatch.setattr(nvrtc, "current_stream_handle", lambda dev: stream["handle"])
    monkeypatch.setattr(nvrtc, "overlap_supported", lambda dev: False)
    launcher = Launcher(0, sms=16)
    made: list[int] = []

    def get(n: int, lau: Launcher = launcher) -> list[int]:
        def make(old):
            made.append(n)
            return [0] * max(n, 2 * len(old) if old else 0)

        return lau.scratch("t", lambda cur: len(cur) >= n, make)

    a = get(4)
    assert get(3) is a and len(a) == 4
    b = get(5)
    assert b is not a and len(b) == 8 and launcher._s.retired == [a]
    assert get(5, launcher.overlapped()) is b
    assert get(5, Launcher(0, sms=16)) is not b
    stream["handle"] = 12
    c = get(2)
    assert c is not b and len(c) == 2
    stream["handle"] = 13
    made.clear()
    got: list[list[int]] = []
    threads = [threading.Thread(target=lambda: got.append(get(6))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and all(g is got[0] for g in got)


def test_launcher_asks_the_occupancy_once_per_configuration(monkeypatch):
    """Resident CTAs an SM holds (the resident-CTA grids of the quantized GEMVs) come from
    one driver query per (kernel, threads, shared bytes), shared with the overlapped
    sibling; another launcher asks again."""
    from edge.kernels.launcher import Launcher

    asked: list[tuple] = []

    def occupancy(kernel, threads, device, default, shmem):
        asked.append((kernel, threads, shmem))
        return 3 if shmem else 5

    monkeypatch.setattr(nvrtc, "max_active_blocks", occupancy)
    monkeypatch.setattr(nvrtc, "overlap_supported", lambda dev: False)
    launcher, k1, k2 = Launcher(0, sms=16), object(), object()
    assert launcher.resident_per_sm(k1, 128, 4096) == 3 and launcher.resident_per_sm(k1, 128) == 5
    assert launcher.overlapped().resident_per_sm(k1, 128, 4096) == 3
    assert launcher.resident_per_sm(k2, 128, 4096) == 3 and launcher.resident_per_sm(k1, 256, 4096) == 3
    assert len(asked) == 4
    Launcher(0, sms=16).resident_per_sm(k1, 128, 4096)
    assert len(asked) == 5
