"""KV memory budget: probes (faked), arithmetic, explicit sizes, errors, engine wiring."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from edge.budget import (
    CPU_DEFAULT_SEQUENCES,
    BudgetError,
    MemoryInfo,
    compute_budget,
    estimate_activation_bytes,
    kv_block_bytes,
    parse_bytes,
    probe_memory,
    read_meminfo,
)
from edge.config import ModelConfig
from edge.engine import Engine
from edge.model import Model
from edge.random_model import make_model

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


def test_probe_cpu_takes_the_lower_cgroup_headroom(tmp_path: Path) -> None:
    meminfo = write_meminfo(tmp_path / "meminfo", 32 * 1024 * 1024, 20 * 1024 * 1024)
    cg = tmp_path / "cg"
    cg.mkdir()
    (cg / "memory.max").write_text(f"{8 * GiB}\n")
    (cg / "memory.current").write_text(f"{3 * GiB}\n")
    m = probe_memory("cpu", meminfo=meminfo, cgroup_root=cg)
    assert (m.kind, m.total, m.available) == ("cpu", 8 * GiB, 5 * GiB) and "cgroup" in m.source
    (cg / "memory.max").write_text("max\n")  # unlimited: MemAvailable
    assert probe_memory("cpu", meminfo=meminfo, cgroup_root=cg).available == 20 * GiB
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{4 * GiB}\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text(f"{1 * GiB}\n")
    assert probe_memory("cpu", meminfo=meminfo, cgroup_root=v1).available == 3 * GiB
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1 "no limit"
    assert probe_memory("cpu", meminfo=meminfo, cgroup_root=v1).available == 20 * GiB


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
    assert b.num_blocks == 64 and b.capped and "(capped)" in b.describe()


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
    with caplog.at_level(logging.WARNING, logger="edge.budget"):
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
    with caplog.at_level(logging.INFO, logger="edge.engine"):
        e = engine(model, memory_info=MemoryInfo("cpu", 4 * GiB, avail, "fake"))
    assert e.kv.pool.num_blocks == 40 == e.budget.num_blocks
    assert e.kv.pool.block_bytes() == block == e.budget.block_bytes
    assert e.budget.weights == model.weight_bytes() and e.budget.activations == act
    assert "KV budget [cpu, fake]" in caplog.text and "40 blocks x 16 tokens = 640 tokens" in caplog.text
    assert e.info()["kv_budget"]["num_blocks"] == 40
    assert len(e.generate([5, 6, 7], max_tokens=5, ignore_eos=True).token_ids) == 5


def test_engine_cpu_default_is_capped(model: Model) -> None:
    e = engine(model, memory_info=MemoryInfo("cpu", 64 * GiB, 40 * GiB))
    assert e.kv.pool.num_blocks == CPU_DEFAULT_SEQUENCES * 512 // 16 and e.budget.capped
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
