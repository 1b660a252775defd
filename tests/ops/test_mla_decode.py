"""The Triton MLA decode kernel against its float32 reference (interpreter on CPU, or a GPU)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from qkmla import QKNormConfig  # noqa: E402
from qkmla.ops.mla_decode import mla_decode_with_kvcache, naive_mla_decode  # noqa: E402
from qkmla.ops.mla_decode.interface import _mla_decode_op  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.cuda  # inputs go to DEVICE: the GPU suite runs this file on a GPU
LENGTHS = (1, 97, 1025, 0)  # odd lengths and a zero-length sequence, in one batch
H, D_C, D_R = 8, 32, 16  # small shapes for the interpreter (GPU: the same kernel, same code path)


def paged_inputs(block_size: int, G: int, S_q: int, scaled: bool, seed: int = 0, dtype=torch.bfloat16):
    """A paged cache with a shuffled block table; every slot no sequence owns is NaN."""
    gen = torch.Generator().manual_seed(seed)
    B = len(LENGTHS)
    per_seq = -(-max(LENGTHS) // block_size) + 1
    n_blocks = B * per_seq + 3  # a few blocks nobody owns
    table = torch.randperm(n_blocks, generator=gen)[:B * per_seq].view(B, per_seq).to(torch.int32)
    kv = torch.full((n_blocks, block_size, D_C + D_R), float("nan"), dtype=dtype)
    scales = torch.full((n_blocks, block_size, G), float("nan"), dtype=dtype)
    for b, n in enumerate(LENGTHS):
        pos = torch.arange(n)
        blk = table[b, pos // block_size].long()
        kv[blk, pos % block_size] = torch.randn(n, D_C + D_R, generator=gen).to(dtype)
        scales[blk, pos % block_size] = (0.5 + torch.rand(n, G, generator=gen)).to(dtype)
    q_lat = (torch.randn(B, S_q, H, D_C, generator=gen) * 0.3).to(dtype)
    q_rope = (torch.randn(B, S_q, H, D_R, generator=gen) * 0.3).to(dtype)
    lens = torch.tensor(LENGTHS, dtype=torch.int32)
    args = [t.to(DEVICE) for t in (q_lat, q_rope, kv, table, lens)]
    return args, (scales.to(DEVICE) if scaled else None)


CASES = [  # (block_size, G, S_q, scaled)
    (16, 1, 1, True), (16, 4, 2, True), (16, H, 1, False), (16, H, 2, True),
    (64, 1, 2, False), (64, 4, 1, True), (64, H, 2, True), (64, 4, 2, False),
]


@pytest.mark.parametrize("block_size,G,S_q,scaled", CASES,
                         ids=[f"page{p}-G{g}-Sq{s}-{'scaled' if c else 'plain'}" for p, g, s, c in CASES])
def test_kernel_matches_reference(block_size, G, S_q, scaled):
    (q_lat, q_rope, kv, table, lens), scales = paged_inputs(block_size, G, S_q, scaled)
    scale = 0.3
    ref, ref_lse = naive_mla_decode(q_lat, q_rope, kv, table, lens, scales, scale)  # float32
    bf16, _ = naive_mla_decode(q_lat, q_rope, kv, table, lens, scales, scale, compute_dtype=torch.bfloat16)
    out, lse = mla_decode_with_kvcache(q_lat, q_rope, kv, table, lens, scales, softmax_scale=scale, num_splits=3,
                                       backend="triton")
    assert out.dtype == q_lat.dtype and lse.dtype == torch.float32
    assert not torch.isnan(out).any()  # no stray read of a NaN slot
    torch_err = (bf16.float() - ref).abs().max()
    kernel_err = (out.float() - ref).abs().max()
    assert torch_err > 0
    assert kernel_err <= 2 * torch_err + 1e-6, (kernel_err, torch_err)
    seen = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[seen], ref_lse[seen], rtol=1e-3, atol=1e-3)
    assert torch.equal(torch.isfinite(lse), seen)  # -inf exactly where no key is visible
    assert out[3].abs().max() == 0  # the zero-length sequence


def test_splits_do_not_change_the_result():
    (q_lat, q_rope, kv, table, lens), scales = paged_inputs(16, 4, 1, True, dtype=torch.float32)
    one, lse1 = mla_decode_with_kvcache(q_lat, q_rope, kv, table, lens, scales, softmax_scale=0.2, num_splits=1,
                                        backend="triton")
    many, lse7 = mla_decode_with_kvcache(q_lat, q_rope, kv, table, lens, scales, softmax_scale=0.2, num_splits=7,
                                         backend="triton")
    torch.testing.assert_close(many, one, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse7, lse1, rtol=1e-5, atol=1e-5)


def test_scaling_is_applied_before_the_rope_score():
    """Scales of 1 give plain MLA; scales of 2 on the content score differ from scaling both."""
    (q_lat, q_rope, kv, table, lens), scales = paged_inputs(16, 4, 1, True, dtype=torch.float32)
    ones = torch.ones_like(scales)
    a, _ = mla_decode_with_kvcache(q_lat, q_rope, kv, table, lens, ones, softmax_scale=0.2, backend="triton")
    b, _ = mla_decode_with_kvcache(q_lat, q_rope, kv, table, lens, None, softmax_scale=0.2, backend="triton")
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    twos, _ = mla_decode_with_kvcache(q_lat, q_rope, kv, table, lens, 2 * ones, softmax_scale=0.2, backend="triton")
    both, _ = mla_decode_with_kvcache(q_lat, q_rope, kv, table, lens, None, softmax_scale=0.4, backend="triton")
    ref, _ = naive_mla_decode(q_lat, q_rope, kv, table, lens, 2 * ones, 0.2)
    torch.testing.assert_close(twos, ref, rtol=1e-4, atol=1e-4)
    assert (twos - both).abs().max() > 1e-3


def test_custom_op_traces_under_torch_compile_and_opcheck():
    (q_lat, q_rope, kv, table, lens), scales = paged_inputs(16, 4, 1, True, dtype=torch.float32)

    def step(q, r):
        out, lse = mla_decode_with_kvcache(q, r, kv, table, lens, scales, softmax_scale=0.2, num_splits=2,
                                           backend="triton")
        return out * 2, lse

    compiled = torch.compile(step, backend="eager", fullgraph=True)
    out, lse = compiled(q_lat, q_rope)
    ref, ref_lse = step(q_lat, q_rope)
    torch.testing.assert_close(out, ref)
    torch.library.opcheck(_mla_decode_op, (q_lat, q_rope, kv, scales, table, lens, 0.2, 2),
                          test_utils=("test_schema", "test_faketensor"))


def test_bad_inputs():
    (q_lat, q_rope, kv, table, lens), scales = paged_inputs(16, 4, 1, True, dtype=torch.float32)
    with pytest.raises(ValueError, match="backend"):
        mla_decode_with_kvcache(q_lat, q_rope, kv, table, lens, scales, softmax_scale=0.2, backend="cuda")
    with pytest.raises(ValueError, match="kv_cache"):
        mla_decode_with_kvcache(q_lat, q_rope, kv[..., :-1], table, lens, scales, softmax_scale=0.2)
    with pytest.raises(ValueError, match="block_table"):
        mla_decode_with_kvcache(q_lat, q_rope, kv, table.float(), lens, scales, softmax_scale=0.2)
    with pytest.raises(ValueError, match="cache_seqlens"):
        mla_decode_with_kvcache(q_lat, q_rope, kv, table, lens[:2], scales, softmax_scale=0.2)
    with pytest.raises(ValueError, match="scale_cache"):
        mla_decode_with_kvcache(q_lat, q_rope, kv, table, lens, scales[..., :3], softmax_scale=0.2)
    with pytest.raises(ValueError, match="powers of two"):
        mla_decode_with_kvcache(q_lat[..., :24], q_rope, kv[..., 8:], table, lens, scales, softmax_scale=0.2,
                                backend="triton")
    on_q_device = r"block_table: expected a tensor on q_lat's device \((cpu|cuda:0)\), got meta"
    with pytest.raises(ValueError, match=on_q_device):
        mla_decode_with_kvcache(q_lat, q_rope, kv, table.to("meta"), lens, scales, softmax_scale=0.2)
    with pytest.raises(ValueError, match="scale_cache: expected a tensor on q_lat's device"):
        mla_decode_with_kvcache(q_lat, q_rope, kv, table, lens, scales.to("meta"), softmax_scale=0.2)


def test_a_launch_that_does_not_fit_in_shared_memory_takes_the_next_configuration(monkeypatch):
    """Triton refuses a launch whose tiles exceed the GPU's shared memory before it runs (an
    H100 refused 128 heads at BLOCK_N 64): the launcher takes the next of LAUNCH_CONFIGS,
    remembers it for the same inputs, and gives the same result."""
    from triton.runtime.errors import OutOfResources

    from qkmla.ops.mla_decode import triton_kernel

    (q_lat, q_rope, kv, table, lens), scales = paged_inputs(16, 4, 2, True, dtype=torch.float32)
    want, want_lse = mla_decode_with_kvcache(q_lat, q_rope, kv, table, lens, scales, softmax_scale=0.3, num_splits=2,
                                             backend="triton")
    kernel, tried = triton_kernel._mla_decode_split_kernel, []

    class SharedMemoryOf:  # refuses BLOCK_N above `most`, as Triton does when the tiles do not fit
        def __init__(self, most):
            self.most = most

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                tried.append(kwargs["BLOCK_N"])
                if kwargs["BLOCK_N"] > self.most:
                    raise OutOfResources(300_000, 232_448, "shared memory")
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(triton_kernel, "_fitting", {})
    monkeypatch.setattr(triton_kernel, "_mla_decode_split_kernel", SharedMemoryOf(32))
    for _ in range(2):
        out, lse = mla_decode_with_kvcache(q_lat, q_rope, kv, table, lens, scales, softmax_scale=0.3, num_splits=2,
                                           backend="triton")
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    assert tried == [64, 32, 32]  # the second call starts at the configuration that fitted
    assert triton_kernel.fitting_config(q_lat, kv, scales, False, "dense") == 1
    monkeypatch.setattr(triton_kernel, "_fitting", {})
    monkeypatch.setattr(triton_kernel, "_mla_decode_split_kernel", SharedMemoryOf(8))
    with pytest.raises(OutOfResources):  # nothing fits: Triton's own error, after every configuration
        mla_decode_with_kvcache(q_lat, q_rope, kv, table, lens, scales, softmax_scale=0.3, backend="triton")


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("qk_norm", ["rms", None])
def test_mla_layer_decodes_through_the_kernel(layout, qk_norm):
    """MLA with decode_backend="triton" gives the explicit path's outputs token by token."""
    from qkmla import MLA, LatentCache, MLAConfig, PagedLayout

    cfg = MLAConfig(hidden_size=64, num_heads=4, num_kv_groups=2, kv_lora_rank=32, qk_nope_head_dim=16,
                    qk_rope_head_dim=16, v_head_dim=16, qk_norm=QKNormConfig(qk_norm, learnable_logit_scale=True),
                    decode_backend="triton")
    mla = MLA(cfg).to(DEVICE).eval()
    x = torch.randn(2, 12, 64, device=DEVICE)
    kw = {"layout": PagedLayout(block_size=16, block_table=torch.tensor([[2], [0]]))} if layout == "paged" else {}
    cache = LatentCache.from_config(cfg, 2, 16, device=DEVICE, fill=float("nan"), **kw)
    with torch.no_grad():
        got = torch.cat([mla(x[:, :8], cache)] + [mla(x[:, t:t + 1], cache) for t in range(8, 12)], 1)
        torch.testing.assert_close(got, mla(x), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="decode_backend"):
        cfg.replace(decode_backend="fast")  # refused when the config is built
    with pytest.raises(ValueError, match="decode_backend: set it in the config"):
        mla.decode_backend = "torch"  # the backend is the config's, not a mutable attribute


@pytest.mark.parametrize("kv_format", ["fp8", "int8", "int4"])
def test_kernel_reads_bf16_queries_over_quantized_rows_within_the_bf16_budget(kv_format):
    """bf16 queries over a quantized cache: the tile is dequantized to bf16 for the dots (on a
    GPU; fp32 in the interpreter). Error against the float32 spec over the same rows: at most
    twice a plain bf16 implementation's, plus one bf16 ulp at the largest output (dequantized
    values are not bf16 numbers, and Triton's CPU interpreter truncates float32 to bf16 where
    a GPU rounds to nearest)."""
    from qkmla.kv_formats import row_format

    (q_lat, q_rope, kv, table, lens), scales = paged_inputs(16, 4, 2, True)
    rows = row_format(kv_format, D_C, D_R)
    packed = rows.encode(kv[..., :D_C].float(), kv[..., D_C:].float())
    packed[torch.isnan(kv[..., 0])] = 0xFF  # the unused slots stay poisoned
    ref, _ = naive_mla_decode(q_lat, q_rope, packed, table, lens, scales, 0.3, kv_format=kv_format)
    bf16, _ = naive_mla_decode(q_lat, q_rope, packed, table, lens, scales, 0.3, compute_dtype=torch.bfloat16,
                               kv_format=kv_format)
    out, lse = mla_decode_with_kvcache(q_lat, q_rope, packed, table, lens, scales, softmax_scale=0.3, num_splits=3,
                                       backend="triton", kv_format=kv_format)
    assert out.dtype == torch.bfloat16 and not torch.isnan(out).any()
    torch_err, kernel_err = (bf16.float() - ref).abs().max(), (out.float() - ref).abs().max()
    ulp = torch.finfo(torch.bfloat16).eps * ref.abs().max()
    assert 0 < kernel_err <= 2 * torch_err + ulp, (kernel_err, torch_err, ulp)
    assert out[3].abs().max() == 0  # the zero-length sequence


def test_custom_op_with_a_quantized_cache_traces_and_opchecks():
    from qkmla.kv_formats import row_format

    (q_lat, q_rope, kv, table, lens), scales = paged_inputs(16, 4, 1, True, dtype=torch.float32)
    packed = row_format("fp8", D_C, D_R).encode(kv[..., :D_C].nan_to_num(), kv[..., D_C:].nan_to_num())

    def step(q, r):
        return mla_decode_with_kvcache(q, r, packed, table, lens, scales, softmax_scale=0.2, num_splits=2,
                                       backend="triton", kv_format="fp8")

    out, lse = torch.compile(step, backend="eager", fullgraph=True)(q_lat, q_rope)
    ref, ref_lse = step(q_lat, q_rope)
    torch.testing.assert_close(out, ref)
    torch.library.opcheck(_mla_decode_op, (q_lat, q_rope, packed, scales, table, lens, 0.2, 2, False, None, "fp8"),
                          test_utils=("test_schema", "test_faketensor"))


def test_the_launch_an_h100_takes_keeps_its_tiles_in_registers(tmp_path):
    """Compiled for sm_90 here by Triton's own ptxas (no GPU needed): for 16 and 128 heads and
    every row format, the first of LAUNCH_CONFIGS that fits an H100's shared memory keeps its
    stack under 2 KiB a thread. Gathering one float32 scale per code value spilled the tile,
    5,480 B a thread at 32 registers (Triton 3.6; 7,056 B with 3.9), and fp8 rows ran 44x slower
    than bf16 rows on an H100. What is left is 0-600 B, and 1.0-1.4 KiB for int8 rows, whose
    644-byte stride is not 16-byte aligned (timed by the GPU suite's configuration sweep)."""
    triton = pytest.importorskip("triton")
    from triton.backends import backends

    if "nvidia" not in backends or not (Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump").exists():
        pytest.skip(f"Triton {triton.__version__} here has no NVIDIA backend with ptxas and cuobjdump")
    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter compiles nothing
    out = tmp_path / "resources.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.kernel_resources", "--out", str(out)],
                       capture_output=True, text=True, env=env, timeout=900, cwd=repo)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["heads"], r["kv_format"]) for r in rows} == {(h, f) for h in (16, 128)
                                                            for f in ("dense", "fp8", "int8", "int4")}
    for row in rows:
        assert row["fits"] and row["shared_bytes"] <= 232_448, row
        assert row["stack_bytes"] <= 2048, row
