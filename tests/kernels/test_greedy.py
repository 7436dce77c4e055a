"""The greedy-token kernel (tierllm/kernels/greedy.py) against torch.argmax on random logits: on CPU through the
Triton interpreter, on CUDA natively."""
import pytest
import torch

from tierllm.kernels import greedy
from tierllm.kernels._dispatch import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []))
@pytest.mark.parametrize("vocab", [1000, 4096, 9000])                  # less than, exactly and over two blocks
def test_greedy_tokens_match_argmax(dtype, vocab):
    """Random rows, one with its maximum in the last (ragged) block, one whose maximum is banned, one with the
    maximum twice (the first wins, as torch.argmax), one with a NaN (torch.argmax picks it)."""
    torch.manual_seed(vocab)
    logits = torch.randn(5, vocab, device=DEVICE).to(dtype)
    logits[0, vocab - 3] = 50.0
    top = int(logits[1].float().argmax())
    logits[2, [7, vocab - 5]] = 60.0
    logits[3, vocab // 2] = float("nan")
    banned = [[], [top, 1], [], [], [0]]
    tokens = greedy.greedy_tokens_triton(logits, banned)
    assert tokens.dtype == torch.int64 and tokens.shape == (5,)
    assert torch.equal(tokens, greedy.greedy_tokens_ref(logits, banned))
    assert tokens[0] == vocab - 3 and tokens[1] != top and tokens[2] == 7 and tokens[3] == vocab // 2
    expected = logits.float().argmax(dim=-1)
    assert torch.equal(tokens[[0, 2, 3]], expected[[0, 2, 3]])


def test_greedy_tokens_without_bans_and_on_a_row_slice():
    """No banned ids at all (no table is copied), logits a view of a wider buffer (row stride > vocab)."""
    torch.manual_seed(3)
    buffer = torch.randn(4, 1200, device=DEVICE)
    logits = buffer[:3, :1000]
    assert torch.equal(greedy.greedy_tokens_triton(logits), logits.argmax(dim=-1))
    assert greedy.greedy_tokens_triton(logits[:0]).shape == (0,)


def test_banned_table_copied_once_per_set_and_tokens_written_into_out():
    """A request's banned ids stay the same for every step before its min_tokens: their table is copied to the
    device once and reused (a later set gets its own); `out` receives the tokens in place (the decode graphs'
    token front, runner/cuda_graph.py)."""
    torch.manual_seed(5)
    logits = torch.randn(2, 700, device=DEVICE)
    banned = [[int(logits[0].argmax()), 3], [9]]
    first = greedy._banned_table(tuple(map(tuple, banned)), logits.device)
    assert first is greedy._banned_table(((banned[0][0], 3), (9,)), logits.device)
    assert first.tolist() == [[banned[0][0], 3], [9, -1]]
    out = torch.full((3,), -7, dtype=torch.int64, device=DEVICE)
    tokens = greedy.greedy_tokens(logits, banned, out=out[1:])
    assert tokens.data_ptr() == out[1:].data_ptr()
    assert out[0] == -7 and torch.equal(out[1:], greedy.greedy_tokens_ref(logits, banned))
    assert greedy._banned_table(((1,), (2,)), logits.device).tolist() == [[1], [2]]
