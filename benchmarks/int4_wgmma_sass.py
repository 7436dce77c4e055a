"""The int4 wgmma GEMM (tierllm/kernels/int4_wgmma.py) compiled for sm90 without a GPU: its K loop's SASS size,
its registers, and which loop instructions wait on a global load's scoreboard.

Why: on an H200 the loop's largest stall (16% of warp samples, benchmarks/results/int4-wgmma-ncu-h200.txt) was the
first dequantizing instruction of each iteration waiting on words loaded three groups earlier. The control bits
say why: ptxas gives every LDG of the loop the same scoreboard (the others hold the cp.async copies' read barriers
and the fence), and a wait on a scoreboard waits until all of its loads have landed, so that wait also waits for
the loads issued just before it, at the end of the previous iteration. This tool shows, per compile, each
instruction that waits on the loads' scoreboard, and the LDGs issued since the wait before it. With the k order
over spans of 256 (two spans per iteration) there are two such waits per iteration, one per span, at its first
scale conversion.

    python benchmarks/int4_wgmma_sass.py [--rows 64] [--split 1] [--gather]

Needs a Triton with Gluon (its bundled nvdisasm reads the cubin); no GPU."""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIGNATURE = [("x_ptr", "*bf16"), ("w_ptr", "*i32"), ("s_ptr", "*fp16"), ("m_ptr", "*fp16"), ("b_ptr", "*bf16"),
             ("y_ptr", "*bf16"), ("ws_ptr", "*fp32"), ("count_ptr", "*i32"), ("M", "i32"), ("N", "i32"),
             ("K", "i32"), ("stride_x", "i32"), ("stride_w", "i32"), ("stride_s", "i32"), ("stride_y", "i32")]


def compile_kernel(rows: int, split: int, gather: bool):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from tierllm.kernels import int4_wgmma
    consts = {"HAS_MINS": True, "HAS_BIAS": False, "MB": rows, "WARPS": int4_wgmma.WARPS, "SPLIT": split,
              "STAGES": int4_wgmma.STAGES, "X_GATHER": gather}
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, kind) in enumerate(SIGNATURE)
             if kind.startswith("*") or name == "K" or name.startswith("stride")}
    source = GluonASTSource(fn=int4_wgmma._w4_wgmma_kernel, signature={**dict(SIGNATURE), **dict.fromkeys(consts,
                            "constexpr")}, constexprs=consts, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": int4_wgmma.WARPS})


def _tool_output(tool: str, args: list[str], cubin: bytes) -> str:
    """Triton's bundled CUDA tool (nvdisasm, cuobjdump) run on the cubin."""
    import triton
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(path), *args, f.name], capture_output=True, text=True, check=True).stdout


def registers(cubin: bytes) -> int:
    return int(re.search(r"REG:(\d+)", _tool_output("cuobjdump", ["-res-usage"], cubin)).group(1))


def decoded(cubin: bytes) -> tuple[list[tuple[int, str, int, int]], dict[str, int]]:
    """(address, instruction, write scoreboard or 7 for none, wait mask) per instruction: Volta-and-later control
    bits, in bits 41-61 of each instruction's second 64-bit word; and the address of each label (`.L_x_N`), which
    nvdisasm prints as branch targets."""
    lines = _tool_output("nvdisasm", ["-hex", "-c"], cubin).splitlines()
    out, labels, pending = [], {}, []
    for i, line in enumerate(lines[:-1]):
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
        first = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);\s*/\* 0x[0-9a-f]+ \*/", line)
        second = re.search(r"/\* (0x[0-9a-f]+) \*/", lines[i + 1])
        if first and second:
            high = int(second.group(1), 16)
            out.append((int(first.group(1), 16), first.group(2).strip(), high >> 46 & 7, high >> 52 & 63))
            labels.update(dict.fromkeys(pending, out[-1][0]))
            pending = []
    return out, labels


def branch_target(text: str, labels: dict[str, int]) -> int | None:
    """A branch's target address, printed as a hex address or as a label."""
    target = re.search(r"BRA (?:`\((\.L_x_\d+)\)|0x([0-9a-f]+))", text)
    if not target:
        return None
    return labels.get(target.group(1)) if target.group(1) else int(target.group(2), 16)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64, help="x rows the kernel is compiled for (MB: 16, 32, 64)")
    parser.add_argument("--split", type=int, default=1)
    parser.add_argument("--gather", action="store_true", help="x gathered by the kernel (else given in its order)")
    args = parser.parse_args(argv)
    compiled = compile_kernel(args.rows, args.split, args.gather)
    code, labels = decoded(compiled.asm["cubin"])
    backs = [(target, address) for address, text, _, _ in code
             if (target := branch_target(text, labels)) is not None and target < address]
    start, end = max(backs, key=lambda b: b[1] - b[0]) if backs else (0, code[-1][0])
    loop = [row for row in code if start <= row[0] <= end]
    load_boards = {board for _, text, board, _ in loop if "LDG.E" in text and board != 7}
    print(f"rows {args.rows} split {args.split} gather {args.gather}: loop {len(loop)} instructions, "
          f"{registers(compiled.asm['cubin'])} registers, the loop's LDGs on scoreboard(s) {sorted(load_boards)}")
    # per wait on the loads' scoreboard: the LDGs issued since the wait before it (cyclically: the loop repeats) and
    # how many instructions before it the newest of them was issued (few: the wait also waits for that load)
    loads = [i for i, (_, text, board, _) in enumerate(loop) if "LDG.E" in text and board in load_boards]
    waits = [i for i, (_, _, _, wait) in enumerate(loop) if any(wait >> b & 1 for b in load_boards)]
    for n, i in enumerate(waits):
        previous = waits[n - 1] if n else waits[-1] - len(loop)
        since = [j for j in loads + [j - len(loop) for j in loads] if previous < j < i]
        newest = f"the newest {i - max(since)} instructions before it" if since else "none"
        print(f"  {loop[i][0]:05x} waits for every load in flight: {len(since)} issued since the previous wait, "
              f"{newest}: {loop[i][1][:50]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
