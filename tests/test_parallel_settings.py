"""init_distributed switches TF32 on for fp32 matmuls and convolutions (they only take effect on CUDA)."""
import torch

from tests.utils import world_of_one


def test_init_distributed_enables_tf32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    with world_of_one():
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
