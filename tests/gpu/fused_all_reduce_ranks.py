"""Run by tests/gpu/test_tp_gpu.py under `torchrun --nproc-per-node N` (N GPUs): the fused GEMV + all-reduce
(kernels/gemv_all_reduce.py) on real ranks against the GEMV, NCCL's all-reduce and the residual add, eager and
replayed in a CUDA graph; every rank must get the same bits. Prints FUSED_OK on success."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tierllm.distributed.parallel_state import destroy_parallel_state, init_parallel_state
from tierllm.kernels import gemv
from tierllm.kernels.residual_add import add_rounded_


def _inputs(rank: int, m: int, n: int, k: int, dtype, with_bias: bool, seed: int):
    """This rank's x and weight shard; the bias and residual are the same on every rank."""
    own = torch.Generator("cuda").manual_seed(seed * 100 + rank)
    shared = torch.Generator("cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=own).to(dtype)
    weight = (torch.randn(n, k, device="cuda", generator=own) / k ** 0.5).to(dtype)
    bias = torch.randn(n, device="cuda", generator=shared).to(dtype) if with_bias else None
    residual = torch.randn(m, n, device="cuda", generator=shared).to(dtype)
    return x, weight, bias, residual


def _reference(x, weight, bias, residual, group):
    summed = gemv.linear(x, weight, None, torch.float32)                    # [m, n] fp32 partial
    dist.all_reduce(summed, group=group)
    return add_rounded_(residual.clone(), summed, bias)


def _check(got, expected, group, what: str) -> None:
    tolerance = 4 * expected.float().abs().max().item() * torch.finfo(expected.dtype).eps
    error = (got.float() - expected.float()).abs().max().item()
    assert error <= tolerance, f"{what}: max error {error} > {tolerance}"
    copies = [torch.empty_like(got) for _ in range(dist.get_world_size(group))]
    dist.all_gather(copies, got.contiguous(), group=group)
    assert all(torch.equal(c, copies[0]) for c in copies), f"{what}: ranks differ"


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    state = init_parallel_state(rank, world, torch.device("cuda", int(os.environ["LOCAL_RANK"])), 60.0,
                                all_reduce="fused")
    fused = state.fused_all_reduce
    assert fused is not None, "the fused all-reduce fell back to NCCL (see the warning)"
    cases = [(1, 5120, 2560, False, torch.bfloat16), (3, 4096, 1376, True, torch.float16),
             (8, 100, 72, True, torch.bfloat16)]
    for seed, (m, n, k, with_bias, dtype) in enumerate(cases):
        x, weight, bias, residual = _inputs(rank, m, n, k, dtype, with_bias, seed)
        expected = _reference(x, weight, bias, residual, state.group)
        got = fused(x, weight, bias, residual.clone())
        _check(got, expected, state.group, f"eager {dtype} {(m, n, k)}")
    # Two layers captured in one CUDA graph and replayed: the parity flips on the device across replays. As in the
    # engine, programmatic dependent launch chains each layer's kernels: the fused o_proj, a norm gate/up GEMV
    # launched early behind it (it lets the next kernel in early in turn), the fused down_proj launched early behind
    # that, and the next norm GEMV. The replays must equal the same kernels launched plainly (TIERLLM_PDL=0), bit
    # for bit, on every rank (the eager cases above check the fused kernel against NCCL's all-reduce).
    x, weight, bias, residual = _inputs(rank, 2, 4096, 1024, torch.bfloat16, True, 7)
    shared = torch.Generator("cuda").manual_seed(8)
    w_gate_up = (torch.randn(2 * 1536, 4096, device="cuda", generator=shared) / 64).to(torch.bfloat16)
    w_next = (torch.randn(1024, 4096, device="cuda", generator=shared) / 64).to(torch.bfloat16)
    w_down = (torch.randn(4096, 1536, device="cuda", generator=torch.Generator("cuda").manual_seed(9 + rank))
              / 40).to(torch.bfloat16)
    norm_weight = torch.rand(4096, device="cuda", generator=shared).to(torch.bfloat16) + 0.5

    def layer(static):
        fused(x, weight, bias, static)
        hidden = gemv.gemv_triton(static, w_gate_up, norm_weight=norm_weight, gated=True, pdl=True)
        fused(hidden, w_down, None, static)
        return hidden, gemv.gemv_triton(static, w_next, norm_weight=norm_weight, pdl=True)

    def plain_layers(start):
        saved = os.environ.get("TIERLLM_PDL")
        os.environ["TIERLLM_PDL"] = "0"
        try:
            plain = start.clone()
            return plain, layer(plain) + layer(plain)
        finally:
            if saved is None:
                del os.environ["TIERLLM_PDL"]
            else:
                os.environ["TIERLLM_PDL"] = saved

    static = residual.clone()
    layer(static)                                                             # tuned and warm before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = layer(static) + layer(static)
    start = residual.clone()
    for replay in range(5):
        static.copy_(start)
        graph.replay()
        plain, expected = plain_layers(start)
        assert torch.equal(static, plain), f"replay {replay}: the residual differs from plain launches'"
        for got, want in zip(outputs, expected):
            assert torch.equal(got, want), f"replay {replay}: a PDL kernel did not read its producer's result"
        _check(static, plain, state.group, f"graph replay {replay}")               # and every rank's bits agree
        start = static.clone()
    assert fused.failure() is None
    torch.cuda.synchronize()
    dist.barrier()
    destroy_parallel_state(state)
    print("FUSED_OK", rank, flush=True)


if __name__ == "__main__":
    main()
