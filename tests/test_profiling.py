"""The one-step profile report (train.profile_step): busy time and time by kernel class."""
import pytest
import torch

from hetpipe.schema.pretrain_config import TrainConfig
from hetpipe.errors import ConfigError
from hetpipe.observe.profiling import kernel_class, profile_step, write_report


def test_kernel_classes_cover_what_a_training_step_launches():
    assert kernel_class("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)") == "communication"
    assert kernel_class("void flash_fwd_kernel<Flash_fwd_kernel_traits<128>>") == "attention"
    assert kernel_class("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNN") == "gemm"
    assert kernel_class("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert kernel_class("Memcpy DtoD (Device -> Device)") == "copies"
    assert kernel_class("void at::native::vectorized_elementwise_kernel<4, silu>") == "other"


def test_report_counts_busy_time_once_and_sums_classes(tmp_path):
    # Two overlapping kernels on different streams (0-40 and 30-60 us) and one
    # later (80-100): busy 80 us of a 200 us step; class sums count overlap twice.
    kernels = [("nvjet_gemm_a", 0.0, 40.0), ("ncclDevKernel_SendRecv", 30.0, 60.0), ("nvjet_gemm_a", 80.0, 100.0)]
    path = tmp_path / "profile_rank1.txt"
    write_report(path, rank=1, step=3, wall_us=200.0, kernels=kernels)
    text = path.read_text()
    assert text.startswith("rank 1, step 3: wall 0.2 ms, GPU busy (any stream) 0.1 ms (40.0 %), 3 kernels\n"
                           "GPU computing (communication kernels left out) 0.1 ms (30.0 %)\n")
    assert "gemm                  0.1 ms   30.0 % of wall" in text
    assert "communication         0.0 ms   15.0 % of wall" in text
    assert "2x  nvjet_gemm_a" in text


def test_profile_step_is_checked_and_a_no_op_without_a_gpu(tmp_path):
    with pytest.raises(ConfigError, match="train.profile_step=0"):
        TrainConfig(profile_step=0)
    if torch.cuda.is_available():
        pytest.skip("a GPU machine profiles for real")
    with profile_step(True, tmp_path, 0, 1):
        pass
    assert not list(tmp_path.iterdir())
