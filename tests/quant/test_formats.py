"""Packed layouts (tierllm/quant/formats.py): pack/unpack round trips and quantization error bounds."""
import pytest
import torch

from tierllm.config import QuantConfig
from tierllm.quant.formats import (
    dequantize_int4,
    dequantize_int8,
    pack_int4,
    unpack_int4,
)
from tierllm.quant.quantize import quantize_weight


def test_int4_pack_unpack_round_trip():
    codes = torch.randint(0, 16, (7, 34), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.shape == (7, 17) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), codes)
    assert int(packed[0, 0]) == int(codes[0, 0]) | (int(codes[0, 1]) << 4)     # low nibble = even k


def test_int4_pack_rejects_odd_width():
    with pytest.raises(ValueError, match="even"):
        pack_int4(torch.zeros(2, 3, dtype=torch.uint8))


@pytest.mark.parametrize("quant,max_err", [(QuantConfig(bits=8), 0.5 / 127),
                                           (QuantConfig(bits=4), 0.5 / 15 * 1.01),
                                           (QuantConfig(bits=4, group_size=32, symmetric=True), 0.5 / 7 * 1.01)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_quantization_error_is_half_a_step(quant, max_err):
    w = torch.randn(24, 128, generator=torch.Generator().manual_seed(1))
    packed = quantize_weight(w, quant)
    if quant.bits == 8:
        assert packed["qweight"].dtype == torch.int8 and packed["scales"].shape == (24,)
        back = dequantize_int8(packed["qweight"], packed["scales"], torch.float32)
        spread = w.abs().amax(dim=1, keepdim=True)                               # [N, 1]
    else:
        groups = w.view(24, -1, quant.group_size)
        spread = (groups.abs().amax(-1) if quant.symmetric else groups.amax(-1) - groups.amin(-1))
        spread = spread.repeat_interleave(quant.group_size, dim=1)              # [N, K]
        assert packed["qweight"].shape == (24, 64) and ("mins" in packed) != quant.symmetric
        back = dequantize_int4(packed["qweight"], packed["scales"], packed.get("mins"), quant.group_size,
                               torch.float32)
    # half a quantization step, plus the fp16 rounding of scales and mins
    assert ((back - w).abs() <= spread * max_err + 1e-3 * w.abs().amax()).all()


def test_quant_config_validation():
    assert QuantConfig(bits=4).group_size == 64 and QuantConfig(bits=4).symmetric is False
    assert QuantConfig(bits=8).symmetric is True
    assert QuantConfig.from_any({"bits": 4, "group_size": 128}) == QuantConfig(bits=4, group_size=128)
    assert QuantConfig.from_any("w8a8") == QuantConfig(bits=8, activations="int8")
    for bad, match in [({"bits": 3}, "8 or 4"), ({"bits": 4, "group_size": 48}, "power of two"),
                       ({"bits": 8, "group_size": 64}, "per output channel"), ({"bits": 4, "activations": "int8"}, "W8A8"),
                       ({"bits": 8, "activations": "fp8"}, "activations")]:
        with pytest.raises(ValueError, match=match):
            QuantConfig(**bad)
    with pytest.raises(ValueError, match="unknown QuantConfig fields"):
        QuantConfig.from_any({"bits": 8, "groups": 4})
    with pytest.raises(ValueError, match="does not divide"):
        quantize_weight(torch.randn(4, 96), QuantConfig(bits=4, group_size=64))
