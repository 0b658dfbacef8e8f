"""attnlab's C kernels for a CPU: decoding, a prompt's products and attention, and forward passes
without gradients; compiled at first use and cached per machine, loaded with ctypes.

The package by job, one module each (its docstring says its design choices):
- builds.py: compilers and flags, the cached builds, the CPU's instruction sets, the self-check
  in a child process (the programs of checks/), the build this process runs and its library.
- interface.py: one table of every function the C source exports (name, result and parameter
  types), from which the loader declares them to ctypes; tests/test_kernel_interface.py checks
  it against the C source.
- programs.py: the C enums (Op, BlockKind, Activation), a kernel call with its arguments bound
  (Call), calls run as one C call (Program, `program`).
- products.py: float32, int8 and block products, a prompt's products of many rows, AMX's.
- attention.py: a decode step's attention over the cache, a prompt's causal attention.
- elementwise.py: norms, RoPE, activations, SwiGLU's product, sums, embeddings.
- experts.py: a mixture of experts' router choice, chosen experts' products and their sum.
- policy.py: which numeric path float32 work of many rows takes (AMX, the float32 tiles or
  torch's GEMM) and which layout a decode step streams block matrices in, measured once per
  machine.
- buffers.py: kept scratch, and weights moved into 2 MB pages.
- probe.py: the read bandwidth, measured by the kernels.

Callers use the package (`from attnlab.generate import kernels; kernels.linear(...)`): it holds
the names below. A test that replaces a name replaces it in the module that uses it (the library
of this process: `kernels.builds.library`).
"""

from .attention import (
    attend_call,
    attend_explicit,
    attend_mix,
    attend_rows,
    attend_scores,
    softmax_rows,
)
from .buffers import HUGE_PAGES_FROM, KEPT_SCRATCH_MAX, place_in_huge_pages
from .builds import (
    CPU_SOURCE,
    SOURCE,
    VARIANTS,
    CpuLevel,
    amx_unusable,
    available,
    build,
    build_names,
    cache_dir,
    choose_variant,
    chosen_variant,
    compile_library,
    cpu_levels,
    decision,
    instructions,
    library,
    no_compiler,
    openmp,
    openmp_or_not,
    self_check,
    source_key,
    unavailable,
    usable,
    use_variant,
    variant,
    variants_here,
    why_not_here,
)
from .checks import AMX_CHECK, SELF_CHECK
from .elementwise import (
    activate_call,
    add_call,
    embed_blocks,
    embed_blocks_call,
    embed_call,
    mul_call,
    norm_call,
    rms_norm_parts_rows,
    rms_norm_rows,
    rope_call,
    rope_rows,
    silu_mul_call,
    silu_mul_rows,
    silu_mul_up_rows,
    softcap_call,
    window_mask_call,
)
from .experts import ExpertWeight, linear_experts_call, route_call, weigh_experts_call
from .interface import C_FOLDER, FUNCTIONS, Signature, declare, load
from .policy import (
    DECODE_LAYOUTS,
    FLOAT_ROWS,
    attention_against_torch,
    attention_rows,
    float_products,
    float_rows,
    repack16_against_file,
    repack16_chosen,
    tiles_against_torch,
)
from .probe import read_bandwidth
from .products import (
    REPACKABLE,
    REPACKED,
    ROWS_KINDS,
    block_bytes,
    block_linear,
    block_linear_call,
    block_linear_rows,
    block_linear_rows_many,
    dequantize,
    linear,
    linear_amx,
    linear_amx_many,
    linear_call,
    linear_rows,
    repack16,
    repack16_in_place,
    repack16_vectorised,
    rows_vectorized,
    swiglu_amx,
)
from .programs import (
    ACTIVATIONS,
    Activation,
    BlockKind,
    Call,
    Op,
    OpCall,
    Program,
    independent,
    program,
)

__all__ = [
    "ACTIVATIONS",
    "AMX_CHECK",
    "C_FOLDER",
    "CPU_SOURCE",
    "DECODE_LAYOUTS",
    "FLOAT_ROWS",
    "FUNCTIONS",
    "HUGE_PAGES_FROM",
    "KEPT_SCRATCH_MAX",
    "REPACKABLE",
    "REPACKED",
    "ROWS_KINDS",
    "SELF_CHECK",
    "SOURCE",
    "VARIANTS",
    "Activation",
    "BlockKind",
    "Call",
    "CpuLevel",
    "ExpertWeight",
    "Op",
    "OpCall",
    "Program",
    "Signature",
    "activate_call",
    "add_call",
    "amx_unusable",
    "attend_call",
    "attend_explicit",
    "attend_mix",
    "attend_rows",
    "attend_scores",
    "attention_against_torch",
    "attention_rows",
    "available",
    "block_bytes",
    "block_linear",
    "block_linear_call",
    "block_linear_rows",
    "block_linear_rows_many",
    "build",
    "build_names",
    "cache_dir",
    "choose_variant",
    "chosen_variant",
    "compile_library",
    "cpu_levels",
    "declare",
    "decision",
    "dequantize",
    "embed_blocks",
    "embed_blocks_call",
    "embed_call",
    "float_products",
    "float_rows",
    "independent",
    "instructions",
    "library",
    "linear",
    "linear_amx",
    "linear_amx_many",
    "linear_call",
    "linear_experts_call",
    "linear_rows",
    "load",
    "mul_call",
    "no_compiler",
    "norm_call",
    "openmp",
    "openmp_or_not",
    "place_in_huge_pages",
    "program",
    "read_bandwidth",
    "repack16",
    "repack16_against_file",
    "repack16_chosen",
    "repack16_in_place",
    "repack16_vectorised",
    "rms_norm_parts_rows",
    "rms_norm_rows",
    "rope_call",
    "route_call",
    "rope_rows",
    "rows_vectorized",
    "self_check",
    "silu_mul_call",
    "silu_mul_rows",
    "silu_mul_up_rows",
    "softcap_call",
    "softmax_rows",
    "source_key",
    "swiglu_amx",
    "tiles_against_torch",
    "unavailable",
    "usable",
    "use_variant",
    "variant",
    "variants_here",
    "weigh_experts_call",
    "why_not_here",
    "window_mask_call",
]
