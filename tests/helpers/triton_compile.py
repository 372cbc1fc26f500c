"""Compile the engine's Triton kernels for a Hopper GPU (sm_90) without one: Triton's own
ptxas, on any machine. Run as a script (``python tests/helpers/triton_compile.py``) in a
process where ``TRITON_INTERPRET`` is unset, so that ``@triton.jit`` gives compilable
functions; prints one JSON line per kernel configuration: its name, whether it compiled
(or the error), its shared memory and a few instruction counts of its PTX.

Pointers and integer arguments are declared divisible by 16, as Triton's launcher
specialises them for the shapes of the models benchmarked (a 1B Llama: every size and
stride a multiple of 16), so that the loads vectorise and pipeline as they do there.
"""

from __future__ import annotations

import json
import os
import re
import sys
import warnings

KINDS = {  # argument-name -> type overrides per kernel (pointers default to bfloat16)
    "_linear_kernel": {"part_ptr": "*fp32", "count_ptr": "*i32"},
    "_sum_splits_kernel": {"part_ptr": "*fp32"},
    "_rms_norm_kernel": {"w_ptr": "*fp32", "eps": "fp32"},
    "_rotary_kernel": {"pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
                       "slot_ptr": "*i64"},
    "_silu_and_mul_kernel": {},
    "_store_kv_kernel": {"slot_ptr": "*i64"},
    "paged_attention_kernel": {
        "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "block_tables_ptr": "*i64",
        "seq_lens_ptr": "*i32", "query_start_ptr": "*i32", "tile_seq_ptr": "*i32",
        "tile_first_ptr": "*i32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
        "part_acc_ptr": "*fp32", "part_start_ptr": "*i32", "scale": "fp32"},
    "combine_segments_kernel": {
        "positions_ptr": "*i64", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
        "part_acc_ptr": "*fp32", "part_start_ptr": "*i32"},
}
NOT_DIVISIBLE = {"M"}  # not specialised (do_not_specialize); floats never are
MEMORY_OP = re.compile(r"\b(ld\.global|st\.global|cp\.async\.(ca|cg)|atom\.|red\.)")


def _cases():
    from llmserve.attention import triton_kernels as attn
    from llmserve.layers import triton_linear as lin
    from llmserve.layers import triton_ops as ops

    for pdl, gated in ((True, False), (False, False), (True, True)):
        for splits, in_order, fused in ((6, False, True), (6, False, False), (6, True, False),
                                        (1, False, False)):
            if gated and splits > 1 and not (in_order or fused):
                continue  # a gated product never leaves its parts to _sum_splits_kernel
            yield lin._linear_kernel, dict(
                BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, SPLITS=splits, IN_ORDER=in_order,
                FUSED=fused, GATED=gated, UPCAST=False, PDL=pdl), {"num_warps": 4,
                                                                   "num_stages": 3}
    yield lin._sum_splits_kernel, dict(SPLITS=6, BLOCK=1024, PDL=True), {}
    yield ops._rms_norm_kernel, dict(ADD=True, BLOCK=2048, PDL=True), {}
    for store in (False, True):
        yield ops._rotary_kernel, dict(HALF=32, HEADS=32, HALF_P=32, DIM_P=64, STORE=store,
                                       PDL=True), {}
    yield lin._silu_and_mul_kernel, dict(BLOCK=1024, PDL=True), {}
    yield ops._store_kv_kernel, dict(HEAD_DIM=64, HEADS=8, DIM_P=64, PDL=True), {}
    for split, scaled, windowed, prefetch in ((True, False, False, True),
                                              (False, False, False, True),
                                              (False, False, True, True),
                                              (True, True, False, False),
                                              (False, False, False, False)):
        yield attn.paged_attention_kernel, dict(
            GROUP=4, GROUP_P=4, BLOCK_Q=16, HEAD_DIM=64, HEAD_P=64, BLOCK_SIZE=16, BLOCK_N=64,
            SEGMENT=512, SCALED=scaled, WINDOWED=windowed, SPLIT=split, UPCAST=False,
            PREFETCH=prefetch, PDL=True), {"num_warps": 4}
    yield attn.combine_segments_kernel, dict(HEAD_DIM=64, HEAD_P=64, SEGMENT=512,
                                             WINDOWED=False, PDL=True), {}


def compile_all(arch: int = 90) -> list[dict]:
    import triton
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", arch, 32)
    results = []
    for fn, consts, options in _cases():
        name = fn.__name__
        kinds = dict(KINDS[name])
        if consts.get("SCALED"):  # the scaled cache: fp8 codes
            kinds |= {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"}
        signature, attrs = {}, {}
        for i, arg in enumerate(fn.arg_names):
            if arg in consts:
                signature[arg] = "constexpr"
                continue
            default = "*bf16" if arg.endswith("_ptr") else "i32"
            signature[arg] = kinds.get(arg, default)
            if arg not in NOT_DIVISIBLE and signature[arg] != "fp32":
                attrs[(i,)] = [["tt.divisibility", 16]]
        row = {"kernel": name, **{k: v for k, v in consts.items() if k != "UPCAST"}}
        try:
            src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=consts,
                                            attrs=attrs)
            compiled = triton.compile(src, target=target, options=options)
        except Exception as e:  # reported, not raised: the test names every failure
            row["error"] = f"{type(e).__name__}: {str(e)[-2000:]}"
            results.append(row)
            continue
        ptx = compiled.asm["ptx"]
        memory = MEMORY_OP.search(ptx)
        wait = ptx.find("griddepcontrol.wait")
        ttgir = compiled.asm["ttgir"]
        loop = ttgir.find("scf.for")
        first_load = ttgir.find("tt.load", loop)
        first_dot = ttgir.find("ttng.warp_group_dot ", loop)
        row |= {"shared": compiled.metadata.shared, "cp_async": ptx.count("cp.async."),
                # the first loop's body loads (into registers) before its first product
                "loop_loads_first": loop >= 0 and 0 <= first_load < first_dot,
                "wgmma": ptx.count("wgmma.mma_async"),
                "griddepcontrol_wait": ptx.count("griddepcontrol.wait"),
                # the first global load, store or atomic comes after the wait
                "waits_before_memory": wait >= 0 and (memory is None or wait < memory.start())}
        results.append(row)
    return results


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("run without TRITON_INTERPRET: the interpreter's functions do not compile")
    warnings.filterwarnings("ignore")
    for r in compile_all(int(sys.argv[1]) if len(sys.argv) > 1 else 90):
        print(json.dumps(r), flush=True)
