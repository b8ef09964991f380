#!/usr/bin/env python3
"""Registers, spills and shared memory of CUDA kernels on a chosen card, without a GPU.

Each `NAME.cu` in DIR (written by `transformer-lab doctor --cuda-source DIR`) is compiled as
cubecl's cuda runtime compiles it (NVRTC, `--gpu-architecture=sm_XXa`, the CUDA headers), and
the PTX assembled by `ptxas -v` for that architecture; prints one row per kernel.

Where `cuobjdump` is at hand it also reads the machine code (SASS) of each kernel's innermost
loops, where a kernel spends its time: the multiply-adds (FFMA) in them, the loads from shared
memory (LDS, of any width), and all their instructions. (Where a kernel's loops within a tile
are unrolled in full, its innermost loop is the one over the tiles: the counts are then one
tile's work, branches not taken included.) A unit issues one instruction at a
time and a multiprocessor serves one shared-memory load instruction a cycle, so "instructions a
FFMA" and "FFMA a shared load" say how close a loop can come to the card's arithmetic rate.

Needs NVIDIA's NVRTC, `ptxas` and the CUDA headers: `pip install nvidia-cuda-nvrtc-cu12
nvidia-cuda-nvcc-cu12 nvidia-cuda-runtime-cu12`, and for the loops `nvidia-cuda-cuobjdump` (no
GPU and no driver needed).
"""
import argparse
import ctypes
import glob
import os
import re
import subprocess
import sys
import tempfile


def nvidia_dir(name):
    import nvidia  # the namespace package of NVIDIA's wheels

    for root in nvidia.__path__:
        path = os.path.join(root, name)
        if os.path.isdir(path):
            return path
    sys.exit(f"error: NVIDIA's {name} package is not installed (see --help)")


def compile_ptx(nvrtc, source, arch, include):
    prog = ctypes.c_void_p()
    check(nvrtc, nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source, b"kernel.cu", 0, None, None))
    options = [f"--gpu-architecture={arch}".encode(), f"--include-path={include}".encode(), b"-lineinfo"]
    array = (ctypes.c_char_p * len(options))(*options)
    status = nvrtc.nvrtcCompileProgram(prog, len(options), array)
    if status != 0:
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(log.value.decode())
    size = ctypes.c_size_t()
    check(nvrtc, nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size)))
    ptx = ctypes.create_string_buffer(size.value)
    check(nvrtc, nvrtc.nvrtcGetPTX(prog, ptx))
    return ptx.value


def cuobjdump():
    """NVIDIA's `cuobjdump`, from its Python wheel, or None."""
    import nvidia

    for root in nvidia.__path__:
        found = glob.glob(os.path.join(root, "*", "bin", "cuobjdump"))
        if found:
            return found[0]
    return None


def inner_loops(sass):
    """(FFMA, shared loads, instructions) summed over the innermost loops of `sass` that multiply
    and add: a loop is a backward branch and the instructions from its target to it."""
    code = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            code.append((int(m.group(1), 16), m.group(2).strip()))
    loops = []
    for at, text in code:
        m = re.search(r"\bBRA (0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < at:
            loops.append((int(m.group(1), 16), at))
    innermost = [a for a in loops if not any(b != a and a[0] <= b[0] and b[1] <= a[1] for b in loops)]
    ffma = lds = total = 0
    for start, end in innermost:
        ops = [re.sub(r"^@!?U?P\w+\s+", "", text).split()[0] for at, text in code if start <= at <= end]
        n_ffma = sum(op.split(".")[0] == "FFMA" for op in ops)
        if n_ffma:
            ffma += n_ffma
            lds += sum(op.startswith("LDS") for op in ops)
            total += len(ops)
    return ffma, lds, total


def check(nvrtc, status):
    if status != 0:
        nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(nvrtc.nvrtcGetErrorString(status).decode())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir", help="the folder of NAME.cu files")
    parser.add_argument("--arch", default="sm_90a", help="the card's architecture (sm_90a: H100/H200)")
    args = parser.parse_args()
    nvrtc_lib = glob.glob(os.path.join(nvidia_dir("cuda_nvrtc"), "lib", "libnvrtc.so.*"))
    if not nvrtc_lib:
        sys.exit("error: libnvrtc not found in the cuda_nvrtc package")
    nvrtc = ctypes.CDLL(sorted(nvrtc_lib)[0])
    include = os.path.join(nvidia_dir("cuda_runtime"), "include")
    ptxas = os.path.join(nvidia_dir("cuda_nvcc"), "bin", "ptxas")
    dump = cuobjdump()
    files = sorted(glob.glob(os.path.join(args.dir, "*.cu")))
    if not files:
        sys.exit(f"error: no .cu files in {args.dir}")
    rows = []
    for path in files:
        name = os.path.basename(path)[:-3]
        with open(path, "rb") as f:
            source = f.read()
        ptx = compile_ptx(nvrtc, source, args.arch, include)
        with tempfile.NamedTemporaryFile(suffix=".ptx") as tmp:
            tmp.write(ptx)
            tmp.flush()
            cubin = tmp.name + ".cubin"
            out = subprocess.run([ptxas, f"-arch={args.arch}", "-v", tmp.name, "-o", cubin],
                                 capture_output=True, text=True)
            if out.returncode != 0:
                sys.exit(f"error: ptxas failed on {name}: {out.stderr.strip()}")
            loops = None
            if dump:
                sass = subprocess.run([dump, "-sass", cubin], capture_output=True, text=True, check=True)
                loops = inner_loops(sass.stdout)
            os.remove(cubin)
        info = out.stderr
        num = lambda pattern: int(m.group(1)) if (m := re.search(pattern, info)) else 0
        rows.append((name, num(r"Used (\d+) registers"), num(r"(\d+) bytes stack frame"),
                     num(r"(\d+) bytes spill stores"), num(r"(\d+) bytes spill loads"),
                     num(r"(\d+) bytes smem"), loops))
    width = max(len(r[0]) for r in rows)
    head = f"{'kernel':<{width}}  registers  stack  spill st  spill ld  smem"
    if dump:
        head += "  | inner loops: FFMA  shared loads  instructions  instr/FFMA  FFMA/load"
    print(f"{head}   ({args.arch})")
    for name, regs, stack, st, ld, smem, loops in rows:
        line = f"{name:<{width}}  {regs:>9}  {stack:>5}  {st:>8}  {ld:>8}  {smem:>4}"
        if loops:
            ffma, lds, total = loops
            per_load = f"{ffma / lds:.1f}" if lds else "-"
            line += f"  | {ffma:>17}  {lds:>12}  {total:>12}  {total / max(ffma, 1):>10.2f}  {per_load:>9}"
        print(line)
    if not dump:
        print("(install nvidia-cuda-cuobjdump for the inner loops' instructions)")


if __name__ == "__main__":
    main()
