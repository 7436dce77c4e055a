"""The small kernels around the int4 step kernel (kernels/step_io.py) against their torch references on random
inputs: on CPU through the Triton interpreter (tests/conftest.py sets it when there is no GPU), on CUDA natively."""
import pytest
import torch

from tierllm.kernels import step_io
from tierllm.kernels._dispatch import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter mishandles bf16 storage (tests/kernels/test_triton_kernels.py): bf16 on CUDA only
DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES)
def test_step_input_gathers_the_tokens_row_and_its_positions_rotary_rows(dtype):
    gen = torch.Generator().manual_seed(0)
    embedding = torch.randn(50, 256, generator=gen).to(dtype).to(DEVICE)
    rope = torch.randn(40, 2, 64, generator=gen).to(dtype).to(DEVICE)
    ids, positions = torch.tensor([37], device=DEVICE), torch.tensor([29], device=DEVICE)
    got = (torch.zeros(256, device=DEVICE), torch.zeros(2, 64, device=DEVICE, dtype=dtype))
    want = (torch.zeros(256, device=DEVICE), torch.zeros(2, 64, device=DEVICE, dtype=dtype))
    step_io.step_input_triton(ids, positions, embedding, rope, *got)
    step_io.step_input_ref(ids, positions, embedding, rope, *want)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[0], embedding[37].float()) and torch.equal(got[1], rope[29])


@pytest.mark.parametrize("dtype", DTYPES)
def test_final_norm_of_the_two_parities(dtype):
    gen = torch.Generator().manual_seed(1)
    work = torch.randn(2, 3, 1024, generator=gen).to(DEVICE)          # [parity, layer, width]: z at 256 .. 768
    weight = (1 + 0.2 * torch.randn(512, generator=gen)).to(dtype).to(DEVICE)
    z = work[:, -1, 256:768]
    got = step_io.final_norm_triton(z, weight, 1e-5, dtype)
    want = step_io.final_norm_ref(z, weight, 1e-5, dtype)
    assert got.shape == want.shape == (1, 512) and got.dtype == dtype
    assert ((got.double() - want.double()).norm() / want.double().norm()).item() < 1e-2
