"""KV memory budget: probes (faked), arithmetic, explicit sizes, errors, engine wiring."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from edge.runtime.budget import (
    DEFAULT_RESERVE,
    SHARED_MEMORY_SEQUENCES,
    BudgetError,
    CgroupMemory,
    MemoryInfo,
    cgroup_headroom,
    compute_budget,
    default_budget,
    estimate_activation_bytes,
    kv_block_bytes,
    parse_bytes,
    probe_memory,
    read_meminfo,
)
from edge.model.config import ModelConfig
from edge.runtime.engine import Engine
from edge.model.decoder import Model
from edge.model.random_model import make_model

GiB, MiB = 1 << 30, 1 << 20


def write_meminfo(path: Path, total_kb: int, avail_kb: int) -> Path:
    path.write_text(
        f"MemTotal:       {total_kb} kB\nMemFree:         1234 kB\nMemAvailable:   {avail_kb} kB\n"
        "Buffers:          100 kB\nHugePages_Total:       0\n"
    )
    return path


# -- sizes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("2GiB", 2 * GiB),
        ("512MiB", 512 * MiB),
        ("512 mib", 512 * MiB),
        ("1.5GB", 1_500_000_000),
        ("1.5G", 1_500_000_000),
        ("64k", 64_000),
        ("64Ki", 65536),
        ("1048576", 1048576),
        (" 3 GiB ", 3 * GiB),
        (4096, 4096),
    ],
)
def test_parse_bytes(text, expected: int) -> None:  # noqa: ANN001
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "2xx", "GiB", "-1GiB", "0", "1.2.3G", "2 GiB B", "nan", "inf"])
def test_parse_bytes_rejects_malformed(text: str) -> None:
    with pytest.raises(BudgetError) as exc:
        parse_bytes(text)
    assert repr(text) in str(exc.value)


def test_cli_rejects_malformed_kv_memory(capsys: pytest.CaptureFixture) -> None:
    from edge.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["generate", "--kv-memory", "2xx"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-memory" in err and "malformed memory size '2xx'" in err and "2GiB" in err


# -- probes --------------------------------------------------------------------------


def test_read_meminfo(tmp_path: Path) -> None:
    info = read_meminfo(write_meminfo(tmp_path / "meminfo", 32 * 1024 * 1024, 20 * 1024 * 1024))
    assert info["MemTotal"] == 32 * GiB and info["MemAvailable"] == 20 * GiB
    assert info["HugePages_Total"] == 0


def test_probe_integrated_reads_meminfo(tmp_path: Path) -> None:
    meminfo = write_meminfo(tmp_path / "meminfo", 64 * 1024 * 1024, 50 * 1024 * 1024)
    m = probe_memory("cuda", meminfo=meminfo, cgroup_root=tmp_path / "no-cgroup", integrated=True,
                     mem_get_info=lambda: pytest.fail("a discrete probe on an integrated GPU"))
    assert m == MemoryInfo("integrated", 64 * GiB, 50 * GiB, f"{meminfo} MemAvailable")


def test_probe_discrete_uses_mem_get_info(tmp_path: Path) -> None:
    m = probe_memory("cuda", meminfo=tmp_path / "missing", integrated=False, mem_get_info=lambda: (30 * GiB, 80 * GiB))
    assert m == MemoryInfo("discrete", 80 * GiB, 30 * GiB, "torch.cuda.mem_get_info")


def test_probe_discrete_honours_the_per_process_memory_fraction(tmp_path: Path) -> None:
    """A process limited to 25 % of an 80 GiB GPU, its allocator already holding 4 GiB, may
    size its pool from 16 GiB, not from the device's 70 GiB free; a share above the free
    figure changes nothing."""
    probe = dict(meminfo=tmp_path / "missing", integrated=False, mem_get_info=lambda: (70 * GiB, 80 * GiB))
    m = probe_memory("cuda", process_share=(0.25, 4 * GiB), **probe)
    assert (m.total, m.available) == (80 * GiB, 16 * GiB)
    assert "fraction 0.25" in m.source
    assert probe_memory("cuda", process_share=(0.95, 0), **probe).available == 70 * GiB
    assert probe_memory("cuda", process_share=(0.01, 4 * GiB), **probe).available == 0


@pytest.mark.parametrize("device", ["cuda", "cuda:0"], ids=["default-device", "index-0"])  # ("cuda" would skip it)
def test_probe_discrete_asks_torch_with_a_device_index(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                       device: str) -> None:
    """``torch.cuda.get_per_process_memory_fraction`` refuses an index-less "cuda", which
    is what the default device is: the probe resolves the index first."""
    from types import SimpleNamespace

    from torch._utils import _get_device_index

    asked: list[int] = []

    def fraction(d: object) -> float:
        asked.append(_get_device_index(d, optional=False))  # torch's own check: "cuda" raises
        return 0.5

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(is_integrated=False))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (70 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", fraction)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 0)
    m = probe_memory(device, meminfo=tmp_path / "missing")
    assert asked == [0] and (m.total, m.available) == (80 * GiB, 40 * GiB)


@pytest.mark.cuda
def test_probe_the_default_gpu() -> None:
    m = probe_memory("cuda")
    assert m.kind in ("discrete", "integrated") and 0 < m.available <= m.total


V2_ROOT = "0::/\n"
V1_ROOT = "9:name=systemd:/\n4:memory:/\n2:cpu,cpuacct:/\n0::/\n"


def proc_cgroup(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "proc-self-cgroup"
    p.write_text(text)
    return p


def cgroup_dir(root: Path, rel: str, **files: int | str) -> Path:
    d = root / rel.strip("/") if rel.strip("/") else root
    d.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        (d / name.replace("_", ".", 1)).write_text(f"{value}\n")
    return d


def test_probe_cpu_takes_the_lower_cgroup_headroom(tmp_path: Path) -> None:
    meminfo = write_meminfo(tmp_path / "meminfo", 32 * 1024 * 1024, 20 * 1024 * 1024)
    cg = tmp_path / "cg"
    cgroup_dir(cg, "/", memory_max=8 * GiB, memory_current=3 * GiB)
    v2 = proc_cgroup(tmp_path, V2_ROOT)
    m = probe_memory("cpu", meminfo=meminfo, cgroup_root=cg, proc_cgroup=v2)
    assert (m.kind, m.total, m.available) == ("cpu", 8 * GiB, 5 * GiB) and "cgroup v2 /" in m.source
    (cg / "memory.max").write_text("max\n")  # unlimited: MemAvailable
    assert probe_memory("cpu", meminfo=meminfo, cgroup_root=cg, proc_cgroup=v2).available == 20 * GiB
    v1 = tmp_path / "v1"
    cgroup_dir(v1, "memory", memory_limit_in_bytes=4 * GiB, memory_usage_in_bytes=1 * GiB)
    v1_proc = proc_cgroup(tmp_path, V1_ROOT)
    assert probe_memory("cpu", meminfo=meminfo, cgroup_root=v1, proc_cgroup=v1_proc).available == 3 * GiB
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1 "no limit"
    assert probe_memory("cpu", meminfo=meminfo, cgroup_root=v1, proc_cgroup=v1_proc).available == 20 * GiB


def test_cgroup_is_the_process_own_not_the_root(tmp_path: Path) -> None:
    """A systemd service on the host: /proc/self/cgroup names its cgroup; the root cgroup has no
    limit (or a larger one); the slice above the service may bind too."""
    cg = tmp_path / "cg"
    cgroup_dir(cg, "/", memory_max=100 * GiB, memory_current=10 * GiB)
    svc = cgroup_dir(cg, "system.slice/edge.service", memory_max=6 * GiB, memory_current=4 * GiB)
    (svc / "memory.stat").write_text(f"anon {3 * GiB}\nfile {GiB}\ninactive_file {GiB}\nactive_file 0\n")
    own = proc_cgroup(tmp_path, "0::/system.slice/edge.service\n")
    c = cgroup_headroom(cg, own)
    # The page cache the kernel reclaims first is not counted as used.
    assert c == CgroupMemory(limit=6 * GiB, headroom=3 * GiB, path="/system.slice/edge.service", version=2)
    cgroup_dir(cg, "system.slice", memory_max=5 * GiB, memory_current=int(4.5 * GiB))  # the slice binds harder
    assert cgroup_headroom(cg, own) == CgroupMemory(5 * GiB, GiB // 2, "/system.slice/edge.service", 2)
    # v1: the memory hierarchy's own line, not the others; hierarchical inactive file pages.
    v1 = tmp_path / "v1"
    cgroup_dir(v1, "memory")
    d = cgroup_dir(v1, "memory/system.slice/edge.service", memory_limit_in_bytes=2 * GiB,
                   memory_usage_in_bytes=GiB)
    (d / "memory.stat").write_text(f"inactive_file 1\ntotal_inactive_file {GiB // 4}\n")
    own_v1 = proc_cgroup(tmp_path, "5:cpu,cpuacct:/other\n4:memory:/system.slice/edge.service\n0::/\n")
    assert cgroup_headroom(v1, own_v1) == CgroupMemory(2 * GiB, 2 * GiB - 3 * GiB // 4, "/system.slice/edge.service", 1)
    # In a container the own path may be absent from the mount: its root is the container's cgroup.
    assert cgroup_headroom(cg, proc_cgroup(tmp_path, "0::/docker/abc\n")).limit == 100 * GiB
    assert cgroup_headroom(cg, tmp_path / "no-proc-file").limit == 100 * GiB


def test_probe_without_meminfo_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "meminfo").write_text("MemTotal: 100 kB\n")
    with pytest.raises(BudgetError, match="MemAvailable.*kv_blocks= or kv_memory="):
        probe_memory("cpu", meminfo=tmp_path / "meminfo", cgroup_root=None)


# -- arithmetic ----------------------------------------------------------------------

BLOCK = 2 * MiB  # e.g. 36 layers x 16 tokens x 8 kv heads x 128 x 2 (K, V) x 2 bytes ~ 2.25 MiB


def test_integrated_budget() -> None:
    mem = MemoryInfo("integrated", 64 * GiB, 40 * GiB, "fake meminfo")
    b = compute_budget(block_bytes=BLOCK, page_size=16, max_seq_len=4096, memory=mem, weights=16 * GiB,
                       activations=1 * GiB, graphs=100 * MiB)
    expect = (int(40 * GiB * 0.9) - GiB - 100 * MiB) // BLOCK
    assert b.num_blocks == expect and b.kv_bytes == expect * BLOCK and not b.capped
    assert b.tokens == expect * 16 and b.full_sequences == pytest.approx(expect / 256)
    text = b.describe()
    for piece in ("integrated", "fake meminfo", "total 64.0 GiB", "available 40.0 GiB x 0.9", "weights 16.0 GiB",
                  "activations 1.0 GiB", "graphs 100.0 MiB", f"{expect} blocks", f"{expect * 16} tokens"):
        assert piece in text, piece
    assert b.as_dict()["tokens"] == expect * 16


def test_discrete_budget_and_utilization() -> None:
    mem = MemoryInfo("discrete", 80 * GiB, 60 * GiB, "torch.cuda.mem_get_info")
    half = compute_budget(block_bytes=BLOCK, page_size=16, max_seq_len=8192, memory=mem, activations=2 * GiB,
                          utilization=0.5)
    assert half.num_blocks == (30 * GiB - 2 * GiB) // BLOCK
    assert half.kind == "discrete"
    with pytest.raises(BudgetError, match="utilization"):
        compute_budget(block_bytes=BLOCK, page_size=16, max_seq_len=8192, memory=mem, utilization=1.5)


def test_cap_only_when_asked() -> None:
    mem = MemoryInfo("cpu", 64 * GiB, 40 * GiB)
    b = compute_budget(block_bytes=BLOCK, page_size=16, max_seq_len=256, memory=mem, max_blocks=4 * 16)
    assert b.num_blocks == 64 and b.capped and "(capped at 4 sequences)" in b.describe()


def test_explicit_sizes() -> None:
    mem = MemoryInfo("integrated", 64 * GiB, 40 * GiB)
    b = compute_budget(block_bytes=BLOCK, page_size=16, max_seq_len=1024, memory=mem, kv_blocks=100)
    assert (b.num_blocks, b.kind, b.source) == (100, "explicit", "kv_blocks=100")
    b = compute_budget(block_bytes=BLOCK, page_size=16, max_seq_len=1024, memory=mem, kv_memory="1GiB")
    assert b.num_blocks == 512 and b.kv_bytes == GiB and "kv_memory=1.0 GiB" in b.source
    # Explicit sizes need no probe.
    b = compute_budget(block_bytes=BLOCK, page_size=16, max_seq_len=1024, kv_memory=3 * GiB)
    assert b.num_blocks == 1536
    with pytest.raises(BudgetError, match="not both"):
        compute_budget(block_bytes=BLOCK, page_size=16, max_seq_len=1024, kv_blocks=64, kv_memory="1GiB")
    with pytest.raises(BudgetError, match="malformed memory size '1 gigabyte'"):
        compute_budget(block_bytes=BLOCK, page_size=16, max_seq_len=1024, kv_memory="1 gigabyte")
    with pytest.raises(BudgetError, match="positive integer"):
        compute_budget(block_bytes=BLOCK, page_size=16, max_seq_len=1024, kv_blocks=0)


def test_explicit_size_above_available_warns(caplog: pytest.LogCaptureFixture) -> None:
    mem = MemoryInfo("integrated", 8 * GiB, 1 * GiB, "fake")
    with caplog.at_level(logging.WARNING, logger="edge.runtime.budget"):
        b = compute_budget(block_bytes=BLOCK, page_size=16, max_seq_len=1024, memory=mem, kv_memory="4GiB")
    assert b.num_blocks == 2048
    assert "only 921.6 MiB of integrated memory looks free" in caplog.text


def test_too_small_for_one_sequence_names_the_figures() -> None:
    mem = MemoryInfo("integrated", 8 * GiB, 3 * GiB, "/proc/meminfo MemAvailable")
    with pytest.raises(BudgetError) as exc:
        compute_budget(block_bytes=BLOCK, page_size=16, max_seq_len=32768, memory=mem, weights=5 * GiB,
                       activations=512 * MiB)
    msg = str(exc.value)
    for piece in ("one full-context sequence", "available 3.0 GiB", "of 8.0 GiB", "utilization 0.9",
                  "activations 512.0 MiB", "max_seq_len 32768 needs 2048 blocks", "4.0 GiB", "weights already loaded: 5.0 GiB"):
        assert piece in msg, piece
    with pytest.raises(BudgetError, match=r"kv_memory 16.0 MiB holds 8 blocks .* needs 2048 blocks = 4.0 GiB"):
        compute_budget(block_bytes=BLOCK, page_size=16, max_seq_len=32768, kv_memory="16MiB")
    with pytest.raises(BudgetError, match=r"kv_blocks=100 \(1600 tokens\) cannot hold .* needs 2048 blocks"):
        compute_budget(block_bytes=BLOCK, page_size=16, max_seq_len=32768, kv_blocks=100)


def test_block_bytes_and_activation_estimate() -> None:
    cfg = ModelConfig.from_dict(
        {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
         "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}
    )
    assert kv_block_bytes(cfg, 16, torch.bfloat16) == 2 * 36 * 16 * 8 * 128 * 2  # 2.25 MiB
    small = estimate_activation_bytes(cfg, 64, 1024, torch.bfloat16)
    big = estimate_activation_bytes(cfg, 512, 4096, torch.bfloat16)
    assert 16 * MiB < small < big < 4 * GiB
    assert estimate_activation_bytes(cfg, 512, 4096, torch.bfloat16, dequant_elements=1 << 24) > big + (1 << 24) * 6


# -- the engine ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    path = make_model(tmp_path_factory.mktemp("budget-model"), preset="tiny", seed=0, num_hidden_layers=2)
    cfg = ModelConfig.from_pretrained(path)
    return Model.load(path, cfg, torch.device("cpu"), torch.float32, 512)


def engine(model: Model, **kw) -> Engine:  # noqa: ANN003
    return Engine(model, None, Path("."), page_size=16, max_seq_len=512, prefill_chunk=64, **kw)


def test_engine_sizes_the_pool_from_faked_memory(model: Model, caplog: pytest.LogCaptureFixture) -> None:
    block = kv_block_bytes(model.cfg, 16, torch.float32)
    act = estimate_activation_bytes(model.cfg, 64, 512, torch.float32)
    avail = int((act + 40 * block) / 0.9) + 1  # room for 40 blocks after activations
    with caplog.at_level(logging.INFO, logger="edge.runtime.engine"):
        e = engine(model, memory_info=MemoryInfo("cpu", 4 * GiB, avail, "fake"))
    assert e.kv.pool.num_blocks == 40 == e.budget.num_blocks
    assert e.kv.pool.block_bytes() == block == e.budget.block_bytes
    assert e.budget.weights == model.weight_bytes() and e.budget.activations == act
    assert "KV budget [cpu, fake]" in caplog.text and "40 blocks x 16 tokens = 640 tokens" in caplog.text
    assert e.info()["kv_budget"]["num_blocks"] == 40
    assert len(e.generate([5, 6, 7], max_tokens=5, ignore_eos=True).token_ids) == 5


def test_engine_cpu_default_is_capped(model: Model) -> None:
    e = engine(model, memory_info=MemoryInfo("cpu", 64 * GiB, 40 * GiB))
    assert e.kv.pool.num_blocks == SHARED_MEMORY_SEQUENCES * 512 // 16 and e.budget.capped
    e = engine(model)  # the real probe of this machine
    assert e.budget.kind == "cpu" and e.kv.pool.num_blocks >= 512 // 16


def test_engine_explicit_and_errors(model: Model) -> None:
    block = kv_block_bytes(model.cfg, 16, torch.float32)
    assert engine(model, kv_blocks=50).kv.pool.num_blocks == 50
    assert engine(model, kv_memory=f"{40 * block}").kv.pool.num_blocks == 40
    assert engine(model, num_blocks=3).kv.pool.num_blocks == 3  # exact, unchecked (logical-OOM tests)
    with pytest.raises(BudgetError, match="one full-context sequence"):
        engine(model, memory_info=MemoryInfo("cpu", GiB, 10 * MiB, "fake"))
    with pytest.raises(BudgetError, match="kv_blocks=10 .*needs 32 blocks"):
        engine(model, kv_blocks=10)
    with pytest.raises(ValueError, match="not both"):
        engine(model, num_blocks=40, kv_blocks=40)
    assert engine(model, kv_cache="contiguous").budget is None


# -- boards: unified memory with a cap and a reserve --------------------------------------


def preset_cfg(preset: str) -> ModelConfig:
    from edge.model.random_model import model_config

    return ModelConfig.from_dict(model_config(preset=preset))


def board_budget(preset: str, total: float, available: float, activations: float, graphs: float,
                 reserve: int | str | None = None, max_seq_len: int = 4096):  # noqa: ANN201
    block = kv_block_bytes(preset_cfg(preset), 16, torch.bfloat16)
    mem = MemoryInfo("integrated", int(total * GiB), int(available * GiB), "fake meminfo")
    b = default_budget(mem, block_bytes=block, page_size=16, max_seq_len=max_seq_len, reserve=reserve,
                       activations=int(activations * GiB), graphs=int(graphs * GiB))
    return b, block


def test_agx_orin_64gb_is_capped_at_four_contexts() -> None:
    # qwen3-8b bf16 loaded (16.4 GB): 42 GiB still available of the 61.4 GiB L4T reports.
    b, block = board_budget("qwen3-8b", 61.4, 42, activations=0.9, graphs=0.1)
    assert block == 36 * 16 * 8 * 128 * 2 * 2  # 2.25 MiB
    assert b.capped and b.num_blocks == SHARED_MEMORY_SEQUENCES * 4096 // 16 and b.full_sequences == 4
    assert b.kv_bytes == 1024 * block == int(2.25 * GiB)  # not the ~37 GiB the headroom allows
    assert b.headroom == int(42 * GiB * 0.9) - int(0.9 * GiB) - int(0.1 * GiB) and b.reserve == DEFAULT_RESERVE
    long, _ = board_budget("qwen3-8b", 61.4, 42, activations=0.9, graphs=0.1, max_seq_len=32768)
    assert long.capped and long.full_sequences == 4 and long.kv_bytes == 18 * GiB
    text = b.describe()
    for piece in ("integrated", "reserve 1.5 GiB", "headroom 36.8 GiB", "KV 2.2 GiB (capped at 4 sequences)"):
        assert piece in text, (piece, text)


def test_orin_nx_16gb_keeps_the_reserve_free() -> None:
    # qwen3-8b int8 (8.8 GiB) on the 15.3 GiB board: 4 GiB left.
    b, block = board_budget("qwen3-8b", 15.3, 4.0, activations=0.6, graphs=0.1)
    assert not b.capped
    assert b.num_blocks == (int(4.0 * GiB) - DEFAULT_RESERVE - int(0.6 * GiB) - int(0.1 * GiB)) // block
    left = int(4.0 * GiB) - b.kv_bytes - int(0.6 * GiB) - int(0.1 * GiB)
    assert DEFAULT_RESERVE <= left < DEFAULT_RESERVE + block
    # With no reserve, utilization bounds the headroom instead, and the cap the pool.
    none, _ = board_budget("qwen3-8b", 15.3, 4.0, activations=0.6, graphs=0.1, reserve="0")
    assert none.headroom == int(4.0 * GiB * 0.9) - int(0.6 * GiB) - int(0.1 * GiB) and none.capped


def test_orin_nano_8gb_reserve_and_its_error() -> None:
    # qwen3-1.7b bf16 (3.8 GiB with its embedding) on the 7.3 GiB board: 2.5 GiB left.
    b, block = board_budget("qwen3-1.7b", 7.3, 2.5, activations=0.4, graphs=0.05)
    assert block == 28 * 16 * 8 * 128 * 2 * 2  # 1.75 MiB: 448 MiB per 4096-token context
    assert b.num_blocks == (int(2.5 * GiB) - DEFAULT_RESERVE - int(0.4 * GiB) - int(0.05 * GiB)) // block
    assert 1 < b.full_sequences < 2
    with pytest.raises(BudgetError) as exc:
        board_budget("qwen3-1.7b", 7.3, 2.5, activations=0.4, graphs=0.05, reserve="2GiB")
    for piece in ("less the reserve 2.0 GiB", "lower --memory-reserve", "needs 256 blocks"):
        assert piece in str(exc.value), piece


def test_discrete_gpu_has_no_cap_and_no_reserve() -> None:
    mem = MemoryInfo("discrete", 80 * GiB, 60 * GiB)
    b = default_budget(mem, block_bytes=BLOCK, page_size=16, max_seq_len=4096, reserve="8GiB")
    assert not b.capped and b.reserve == 0 and b.num_blocks == int(60 * GiB * 0.9) // BLOCK


def test_board_service_under_memory_max(tmp_path: Path) -> None:
    """The 16 GB board with the unit's MemoryMax=8G: the service's own cgroup bounds the pool."""
    meminfo = write_meminfo(tmp_path / "meminfo", int(15.3 * 1024 * 1024), 12 * 1024 * 1024)
    cg = tmp_path / "cg"
    cgroup_dir(cg, "system.slice/edge.service", memory_max=8 * GiB, memory_current=5 * GiB)
    own = proc_cgroup(tmp_path, "0::/system.slice/edge.service\n")
    mem = probe_memory("cuda", meminfo=meminfo, cgroup_root=cg, proc_cgroup=own, integrated=True)
    assert (mem.kind, mem.total, mem.available) == ("integrated", 8 * GiB, 3 * GiB)
    assert "cgroup v2 /system.slice/edge.service limit 8.0 GiB" in mem.source
    b = default_budget(mem, block_bytes=BLOCK, page_size=16, max_seq_len=4096, activations=256 * MiB)
    assert b.num_blocks == (3 * GiB - DEFAULT_RESERVE - 256 * MiB) // BLOCK and not b.capped


def test_engine_on_integrated_memory_logs_the_whole_budget(model: Model, caplog: pytest.LogCaptureFixture) -> None:
    block = kv_block_bytes(model.cfg, 16, torch.float32)
    act = estimate_activation_bytes(model.cfg, 64, 512, torch.float32)
    avail = GiB + act + 40 * block  # after a 1 GiB reserve: room for 40 blocks
    with caplog.at_level(logging.INFO, logger="edge.runtime.engine"):
        e = engine(model, memory_info=MemoryInfo("integrated", 8 * GiB, avail, "fake"), memory_reserve="1GiB")
    assert e.budget.num_blocks == 40 and e.budget.reserve == GiB and not e.budget.capped
    assert "reserve 1.0 GiB" in caplog.text and "40 blocks" in caplog.text
    big = engine(model, memory_info=MemoryInfo("integrated", 64 * GiB, 40 * GiB, "fake"))
    assert big.budget.capped and big.kv.pool.num_blocks == SHARED_MEMORY_SEQUENCES * 512 // 16


def test_cli_reserve_flag(capsys: pytest.CaptureFixture) -> None:
    from edge.cli import build_parser, main

    assert build_parser().parse_args(["generate", "--memory-reserve", "0"]).memory_reserve == 0
    assert build_parser().parse_args(["serve", "--memory-reserve", "2GiB"]).memory_reserve == 2 * GiB
    with pytest.raises(SystemExit):
        main(["generate", "--memory-reserve", "-1GiB"])
    assert "--memory-reserve" in capsys.readouterr().err
