"""Weight quantization: packed formats (formats.py), quantizing dense weights and models (quantize.py; GPTQ in
gptq.py), and quantized checkpoints written by `tierllm quantize` (saved.py)."""
