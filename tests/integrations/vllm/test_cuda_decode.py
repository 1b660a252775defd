"""The CUDA backend's decode launch (``qkmla.integrations.vllm.cuda_decode``), checked on the CPU:
what a CUDA graph fixes at capture (the grid, the kernel constants, the buffers) comes from host
integers and a workspace reserved up front, never from a device tensor's values."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("triton")

from qkmla.integrations.vllm.cuda_decode import TritonDecode, decode_splits, workspace_rows  # noqa: E402

H, D_C, D_R, BLOCK = 16, 512, 64, 16


class Recorded:
    """Stands for a Triton kernel: records each launch's grid and constants instead of running."""

    def __init__(self, launches: list, name: str):
        self.launches, self.name = launches, name

    def __getitem__(self, grid):
        def launch(*args, **constants):
            self.launches.append((self.name, grid, {k: v for k, v in constants.items() if k.isupper()}))
        return launch


@pytest.fixture
def recorded(monkeypatch):
    launches: list = []
    decode = TritonDecode(H, D_C, max_batch=8, max_seq_len=4096, sms=132, reserve=False)
    kernels = decode.kernels
    fake = type("Kernels", (), {})()
    fake.__dict__.update({k: getattr(kernels, k) for k in dir(kernels) if not k.startswith("__")})
    fake._mla_decode_split_kernel = Recorded(launches, "split")
    fake._mla_decode_combine_kernel = Recorded(launches, "combine")
    decode.kernels = fake
    return decode, launches


def decode_on(decode, batch: int, table_width: int, max_seq_len: int, fake_mode=None):
    """One decode of ``batch`` queries over a block table ``table_width`` blocks wide."""
    q_lat, q_rope = torch.empty(batch, H, D_C), torch.empty(batch, H, D_R)
    cache = torch.empty(64, BLOCK, D_C + D_R + H)
    return decode(q_lat, q_rope, cache[..., :D_C + D_R], cache[..., D_C + D_R:], torch.empty(batch, table_width,
                  dtype=torch.int32), torch.empty(batch, dtype=torch.int32), max_seq_len, 0.07, False)


def test_the_launch_reads_no_device_value_and_follows_the_longest_sequence(recorded):
    """Under FakeTensorMode (no tensor holds data: reading one, .item() or .tolist(), raises) the
    decode chooses its launch and launches: nothing waits on the device. Its split count follows
    the batch's longest sequence (vLLM's max_seq_len, on the host), not the block table's width
    (vLLM's table spans the longest sequence the model takes): the same launch for tables 4 and
    256 blocks wide, more splits for longer sequences, up to the kernel's tiles."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    decode, launches = recorded
    with FakeTensorMode():
        out = decode_on(decode, 2, 4, 200)
        decode_on(decode, 2, 256, 200)
        decode_on(decode, 2, 256, 4000)
    assert out.shape == (2, H, D_C)
    splits = [constants["NUM_SPLITS"] for name, _, constants in launches if name == "split"]
    block_n = decode.launch(2, 200)["BLOCK_N"]
    assert block_n == 64
    assert splits[0] == splits[1] == decode_splits(2, 1, 200, block_n, 132) == 4  # 200 keys: 4 tiles of 64
    assert splits[2] == decode_splits(2, 1, 4000, block_n, 132) == 32  # 63 tiles, rounded down
    grids = [grid for name, grid, _ in launches if name == "split"]
    assert grids[0] == grids[1] == (2, 1, 4) and grids[2] == (2, 1, 32)
    combine = [constants for name, _, constants in launches if name == "combine"]
    assert [c["NUM_SPLITS"] for c in combine] == splits


def test_split_counts_are_powers_of_two_within_the_tiles_and_fill_the_gpu():
    for batch in (1, 3, 8, 64, 300):
        for length in (1, 31, 32, 33, 1000, 16384):
            s = decode_splits(batch, 1, length, 32, 132)
            assert s & (s - 1) == 0 and 1 <= s <= max(1, -(-length // 32)) and s <= 64
            assert s == 1 or batch * s <= 2 * 132  # no more programs than about two waves
    assert workspace_rows(8, 1, 4096, 32, 132) == max(b * decode_splits(b, 1, 4096, 32, 132) for b in range(1, 9))


def test_buffers_come_from_vllms_workspace_reserved_up_front(recorded, monkeypatch):
    """Built where vLLM has its workspace, the decode reserves the most any decode of up to
    max_num_seqs sequences of up to max_model_len keys asks for (vLLM then locks it, before its
    memory is measured and graphs captured); each decode's buffers are views of it, and a decode at
    the largest batch and length runs with the workspace locked."""
    from vllm.v1.worker import workspace

    decode, launches = recorded
    manager = workspace.WorkspaceManager(torch.device("cpu"))
    monkeypatch.setattr(workspace, "_manager", manager)
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)  # no accelerator here to empty
    decode.reserve()
    reserved = manager._current_workspaces[0]
    assert reserved is not None and reserved.numel() >= decode.most_rows() * H * (D_C + 1) * 4
    manager.lock()
    for batch, length in ((8, 4096), (1, 4096), (8, 1), (3, 700)):
        decode_on(decode, batch, 256, length)
        o_part, lse_part = decode.buffers(batch, decode.launch(batch, length)["num_splits"], "cpu")
        assert o_part.untyped_storage().data_ptr() == reserved.untyped_storage().data_ptr()
    assert manager._current_workspaces[0] is reserved  # never grown
    with pytest.raises(AssertionError, match="Workspace is locked"):  # what an unreserved size would meet
        manager.get_simultaneous(((reserved.numel() + 1,), torch.uint8))


def test_the_launch_configuration_is_settled_before_capture(recorded):
    """A configuration that does not fit moves on to the next at an eager launch (vLLM's profile and
    warm-up runs come first), and stays there: later launches, captured ones included, take it at once."""
    from triton.runtime.errors import OutOfResources

    decode, launches = recorded
    split = decode.kernels._mla_decode_split_kernel
    tried = []

    class TooBigFirst(Recorded):
        def __getitem__(self, grid):
            def launch(*args, **constants):
                tried.append(constants["BLOCK_N"])
                if len(tried) == 1:
                    raise OutOfResources(300000, 232448, "shared memory")
                split[grid](*args, **constants)
            return launch
    decode.kernels._mla_decode_split_kernel = TooBigFirst(launches, "split")
    decode_on(decode, 2, 8, 100)
    decode_on(decode, 2, 8, 100)
    configs = decode.kernels.LAUNCH_CONFIGS
    assert decode.index == 1 and tried == [configs[0][1], configs[1][1], configs[1][1]]
    assert decode.launch(2, 100)["BLOCK_N"] == configs[1][1]
