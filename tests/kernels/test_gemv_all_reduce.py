"""The fused row-parallel GEMV + all-reduce kernel (kernels/gemv_all_reduce.py) on one device, one rank at a time:
the peers are simulated by buffers prepared as their kernels would leave them (their partials in this rank's
slots, their signals raised). On CPU through the Triton interpreter; on one GPU natively. Two real ranks on two
GPUs: tests/gpu/test_tp_gpu.py."""
import pytest
import torch

from tierllm.kernels._dispatch import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LOW_PRECISION = [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])   # interpreter: no bf16


class SimulatedGroup:
    """Every rank's buffer in this process, and rank `rank`'s kernel state."""

    def __init__(self, world: int, rank: int):
        from tierllm.kernels import gemv_all_reduce as g

        self.g, self.world, self.rank = g, world, rank
        self.buffers = [torch.zeros(g.buffer_words(world), dtype=torch.int64, device=DEVICE) for _ in range(world)]
        status = torch.zeros(1, dtype=torch.int32)
        self.state = {"bases": torch.tensor([b.data_ptr() for b in self.buffers], dtype=torch.int64, device=DEVICE),
                      "counter": torch.zeros(2, dtype=torch.int32, device=DEVICE),
                      "status": status.pin_memory() if DEVICE == "cuda" else status, "rank": rank, "world": world,
                      "timeout_ns": 10 ** 10, "configs": {}}

    def slot(self, owner: int, parity: int, sender: int, m: int, n: int) -> torch.Tensor:
        """Rank `owner`'s slot for `sender`'s part: [m, n] flagged words (a view)."""
        slots = self.buffers[owner].view(2, self.world, self.g.MAX_ROWS, self.g.MAX_COLS)
        return slots[parity, sender, :m, :n]

    def peers_send(self, call: int, partials: list) -> None:
        """What the peers' kernels do before this rank looks: their parts of call `call`, flagged, in its slots."""
        for peer in range(self.world):
            if peer != self.rank:
                self.slot(self.rank, call % 2, peer, *partials[peer].shape).copy_(
                    self.g.flagged(partials[peer], call + 1))


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("world,rank", [(2, 0), (2, 1), (3, 1), (4, 2)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("m,n,k", [(3, 42, 160), (1, 300, 64)])    # partial last tiles and K chunks
def test_rank_adds_its_peers_parts_sends_its_own_and_flips_parity(dtype, world, rank, with_bias, m, n, k):
    from tierllm.kernels.gemv_all_reduce import gemv_all_reduce_, gemv_all_reduce_ref

    group = SimulatedGroup(world, rank)
    torch.manual_seed(world * 10 + rank)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    weight = (torch.randn(n, k, device=DEVICE) / 8).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype) if with_bias else None
    residual = torch.randn(m, n, device=DEVICE).to(dtype)
    mine = x.float() @ weight.float().t()                                   # [m, n]: this rank's partial
    for call in range(3):                                                   # parities 0, 1, 0
        partials = [torch.randn(m, n, device=DEVICE) * 4 for _ in range(world)]
        partials[rank] = mine
        group.peers_send(call, partials)
        before = residual.clone()
        assert gemv_all_reduce_(x, weight, bias, residual, **group.state) is residual
        expected = gemv_all_reduce_ref(partials, bias, before)
        tolerance = 2 * expected.float().abs().max().item() * torch.finfo(dtype).eps   # an ulp or two
        assert (residual.float() - expected.float()).abs().max().item() <= tolerance
        for dest in range(world):                                           # its part reached every rank
            sent = group.slot(dest, call % 2, rank, m, n)
            assert torch.equal(sent >> 32, torch.full_like(sent, call + 1))                 # this call's flag
            assert torch.allclose(sent.to(torch.int32).view(torch.float32), mine, rtol=1e-5, atol=1e-5)
        assert group.state["counter"].tolist() == [call + 1, 0]
        assert group.state["status"].item() == 0


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _zero_clock():
        return tl.zeros([], tl.int64)


def test_graph_tuning_times_the_twin_on_a_scratch_residual(monkeypatch):
    """TIERLLM_GEMV_TUNER=graph: each config's EXCHANGE=False twin is timed (here: run on both weight copies, a
    made-up time; on CPU through the interpreter) on a scratch residual, the fastest is remembered per shape, and
    the real call adds the ranks' sum into the residual once."""
    from tierllm.kernels import gemv_all_reduce as g
    from tierllm.kernels import graph_tuning

    m, n, k = 1, 40, 96
    group = SimulatedGroup(2, 0)
    torch.manual_seed(14)
    x = torch.randn(m, k, device=DEVICE).half()
    weight = (torch.randn(n, k, device=DEVICE) / 8).half()
    configs = g._WHOLE_K_CONFIGS
    fastest = configs[2]
    timed = []

    def fake_seconds(launch, copies):
        for copy in copies:
            launch(copy)
        timed.append(launch)
        return 0.5 if len(timed) - 1 == configs.index(fastest) else 1.0

    monkeypatch.setenv("TIERLLM_GEMV_TUNER", "graph")
    monkeypatch.setattr(g, "is_interpreted", lambda: False)
    monkeypatch.setattr(graph_tuning, "graph_seconds", fake_seconds)
    monkeypatch.setattr(graph_tuning, "weight_copies", lambda w: [w, w.clone()])
    if DEVICE == "cpu":                        # the real call's deadline reads %globaltimer: no PTX in the interpreter
        monkeypatch.setattr(g, "_globaltimer", _zero_clock)
    partials = [x.float() @ weight.float().t(), torch.randn(m, n, device=DEVICE) * 4]
    group.peers_send(0, partials)
    residual = torch.randn(m, n, device=DEVICE).half()
    expected = g.gemv_all_reduce_ref(partials, None, residual)
    g.gemv_all_reduce_(x, weight, None, residual, **group.state)
    assert len(timed) == len(configs)
    assert group.state["configs"] == {(n, k, 1, x.dtype): fastest}
    tolerance = 2 * expected.float().abs().max().item() * torch.finfo(torch.float16).eps
    assert (residual.float() - expected.float()).abs().max().item() <= tolerance


@pytest.mark.skipif(DEVICE != "cuda", reason="compiles each of the tuner's configs: GPU only")
@pytest.mark.parametrize("k", [2000, 5000])                 # whole-K configs (K <= WHOLE_K), then chunked ones
def test_every_tuning_config_sums_the_ranks_parts(k):
    """Each config the fused kernel's tuners may pick, forced through the per-shape config cache, on rank 1 of 2."""
    from tierllm.kernels import gemv_all_reduce as g

    m, n = 1, 300
    torch.manual_seed(k)
    x = torch.randn(m, k, device=DEVICE).to(torch.bfloat16)
    weight = (torch.randn(n, k, device=DEVICE) / 8).to(torch.bfloat16)
    configs = g._WHOLE_K_CONFIGS if k <= g.WHOLE_K else g._CONFIGS
    for config in configs:
        group = SimulatedGroup(2, 1)
        group.state["configs"][(n, k, 1, x.dtype)] = config
        partials = [torch.randn(m, n, device=DEVICE) * 4, x.float() @ weight.float().t()]
        group.peers_send(0, partials)
        residual = torch.randn(m, n, device=DEVICE).to(torch.bfloat16)
        expected = g.gemv_all_reduce_ref(partials, None, residual)
        g.gemv_all_reduce_(x, weight, None, residual, **group.state)
        tolerance = 2 * expected.float().abs().max().item() * torch.finfo(torch.bfloat16).eps
        assert (residual.float() - expected.float()).abs().max().item() <= tolerance, config


@pytest.mark.timeout(60)
def test_a_peer_that_never_sends_ends_the_wait_once_the_status_is_raised():
    """The watchdog's abort (distributed/driver.py): kernels waiting for a dead rank give up and return."""
    from tierllm.kernels.gemv_all_reduce import STATUS_ABORTED, gemv_all_reduce_

    group = SimulatedGroup(2, 0)
    x = torch.randn(1, 64, device=DEVICE).half()
    weight = torch.randn(8, 64, device=DEVICE).half()
    residual = torch.zeros(1, 8, device=DEVICE).half()
    group.state["status"][0] = STATUS_ABORTED                      # raised before the peer's part came
    gemv_all_reduce_(x, weight, None, residual, **group.state)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert group.state["status"].item() == STATUS_ABORTED


def test_flagged_words_carry_the_value_bits_under_the_epoch():
    from tierllm.kernels.gemv_all_reduce import flagged

    values = torch.tensor([1.5, -2.25, 0.0, -0.0, 3e38])
    words = flagged(values, 7)
    assert torch.equal(words >> 32, torch.full_like(words, 7))
    assert torch.equal(words.to(torch.int32).view(torch.float32).view(torch.int32), values.view(torch.int32))


@pytest.mark.skipif(DEVICE != "cuda", reason="programmatic dependent launch needs a GPU (the interpreter runs none)")
@pytest.mark.parametrize("splits", ["many", "one"])
def test_a_decode_layer_chained_by_pdl_in_a_cuda_graph_equals_its_plain_launches(splits, monkeypatch):
    """A tensor-parallel decode layer's kernels as the engine chains them with programmatic dependent launch (each
    lets the next launch as it starts and waits for its predecessor before reading): the norm QKV GEMV, rotary with
    the cache write, the decode attention (split kernel, merge kernel), o_proj's fused all-reduce (its programs
    load their first weight chunk before they wait), the norm gate/up GEMV and down_proj's fused all-reduce.
    Replayed in a CUDA graph with a fresh residual each time, every output (and the caches) must be bit for bit
    the same kernels' launched one after the other without PDL: a kernel that read its input before its producer
    finished would differ. One rank (world 1: it sends to itself and gathers). `splits`: the attention ends with
    its merge kernel, or with the split kernel alone (block tables one tile long)."""
    from tierllm.kernels._dispatch import pdl_launch
    from tierllm.kernels.decode_attention import paged_decode_attention_triton
    from tierllm.kernels.gemv import gemv_triton
    from tierllm.kernels.gemv_all_reduce import gemv_all_reduce_
    from tierllm.kernels.rotary import rotary_and_cache_write_triton

    torch.manual_seed(5)
    assert pdl_launch(torch.empty(1, device=DEVICE)), "this GPU or Triton has no programmatic dependent launch"
    group = SimulatedGroup(1, 0)
    heads, head_dim, block_size, blocks = 16, 128, 16, 64
    n, inter = heads * head_dim, 3072
    width, context = (32, 300) if splits == "many" else (4, 50)         # blocks per table: 4 x 16 = one tile
    caches = [torch.randn(blocks, block_size, heads, head_dim, device=DEVICE).bfloat16() for _ in range(2)]
    tables = torch.randperm(blocks, device=DEVICE)[None, :width].int()          # [1, width]
    context_lens = torch.tensor([context], device=DEVICE)
    slot = (tables[0, (context - 1) // block_size].long() * block_size + (context - 1) % block_size).view(1)
    angles = torch.rand(1, head_dim // 2, device=DEVICE) * 6
    cos, sin = (f(torch.cat([angles, angles], dim=-1)).bfloat16() for f in (torch.cos, torch.sin))   # [1, d]
    w_qkv = (torch.randn(3 * n, n, device=DEVICE) / n ** 0.5).bfloat16()
    w_o = (torch.randn(n, n, device=DEVICE) / n ** 0.5).bfloat16()
    w_gate_up = (torch.randn(2 * inter, n, device=DEVICE) / n ** 0.5).bfloat16()
    w_down = (torch.randn(n, inter, device=DEVICE) / inter ** 0.5).bfloat16()
    norms = [torch.rand(n, device=DEVICE).bfloat16() + 0.5 for _ in range(2)]
    residual = torch.randn(1, n, device=DEVICE).bfloat16()

    def layer(res, k_cache, v_cache):
        qkv = gemv_triton(res, w_qkv, norm_weight=norms[0], pdl=True)             # [1, 3n]
        q, k, v = (part.view(1, heads, head_dim) for part in qkv.split(n, dim=1))
        rotary_and_cache_write_triton(q, k, v, cos, sin, k_cache, v_cache, slot)
        attention = paged_decode_attention_triton(q, k_cache, v_cache, tables, context_lens, 0.1)
        gemv_all_reduce_(attention.view(1, n), w_o, None, res, **group.state)
        hidden = gemv_triton(res, w_gate_up, norm_weight=norms[1], gated=True, pdl=True)
        gemv_all_reduce_(hidden, w_down, None, res, **group.state)
        return qkv, attention, hidden

    layer(residual.clone(), *(c.clone() for c in caches))                  # tuned before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = layer(residual, *caches)
    for _ in range(6):
        residual.copy_(torch.randn_like(residual))
        plain_residual, plain_caches = residual.clone(), [c.clone() for c in caches]
        graph.replay()
        with monkeypatch.context() as plain:
            plain.setenv("TIERLLM_PDL", "0")
            expected = layer(plain_residual, *plain_caches)
        torch.cuda.synchronize()
        assert torch.equal(residual, plain_residual)
        for got, want in zip(outputs + tuple(caches), expected + tuple(plain_caches)):
            assert torch.equal(got, want)
    assert group.state["status"].item() == 0
