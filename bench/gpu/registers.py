#!/usr/bin/env python3
"""Registers, spills and shared memory of CUDA kernels on a chosen card, without a GPU.

Each `NAME.cu` in DIR (written by `transformer-lab doctor --cuda-source DIR`) is compiled as
cubecl's cuda runtime compiles it (NVRTC, `--gpu-architecture=sm_XXa`, the CUDA headers), and
the PTX assembled by `ptxas -v` for that architecture; prints one row per kernel.

Needs NVIDIA's NVRTC, `ptxas` and the CUDA headers: `pip install nvidia-cuda-nvrtc-cu12
nvidia-cuda-nvcc-cu12 nvidia-cuda-runtime-cu12` (no GPU and no driver needed).
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
            out = subprocess.run([ptxas, f"-arch={args.arch}", "-v", tmp.name, "-o", os.devnull],
                                 capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"error: ptxas failed on {name}: {out.stderr.strip()}")
        info = out.stderr
        num = lambda pattern: int(m.group(1)) if (m := re.search(pattern, info)) else 0
        rows.append((name, num(r"Used (\d+) registers"), num(r"(\d+) bytes stack frame"),
                     num(r"(\d+) bytes spill stores"), num(r"(\d+) bytes spill loads"),
                     num(r"(\d+) bytes smem")))
    width = max(len(r[0]) for r in rows)
    print(f"{'kernel':<{width}}  registers  stack  spill st  spill ld  smem ({args.arch})")
    for name, regs, stack, st, ld, smem in rows:
        print(f"{name:<{width}}  {regs:>9}  {stack:>5}  {st:>8}  {ld:>8}  {smem:>5}")


if __name__ == "__main__":
    main()
