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


def test_int8_error_is_half_a_step():
    w = torch.randn(24, 128, generator=torch.Generator().manual_seed(1))
    packed = quantize_weight(w, QuantConfig(bits=8))
    assert packed["qweight"].dtype == torch.int8 and packed["scales"].shape == (24,)
    back = dequantize_int8(packed["qweight"], packed["scales"], torch.float32)
    step = w.abs().amax(dim=1, keepdim=True) / 127                                     # [N, 1]
    assert ((back - w).abs() <= step * 0.5 * 1.002).all()                               # + fp16 scale rounding


@pytest.mark.parametrize("quant", [QuantConfig(bits=4), QuantConfig(bits=4, group_size=32, symmetric=True)],
                         ids=lambda q: q.name)
def test_int4_fitted_grid_beats_min_max_rounding(quant, monkeypatch):
    from tierllm.quant import quantize

    w = torch.randn(24, 128, generator=torch.Generator().manual_seed(1))

    def squared_error() -> float:
        packed = quantize_weight(w, quant)
        assert packed["qweight"].shape == (24, 64) and ("mins" in packed) != quant.symmetric
        back = dequantize_int4(packed["qweight"], packed["scales"], packed.get("mins"), quant.group_size,
                               torch.float32)
        return ((back - w) ** 2).sum().item()

    fitted = squared_error()
    monkeypatch.setattr(quantize, "_REFINE_STEPS", 0)                                     # min/max grid only
    plain = squared_error()
    assert fitted < plain and plain / w.pow(2).sum().item() < (0.02 if quant.symmetric else 0.01)


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
