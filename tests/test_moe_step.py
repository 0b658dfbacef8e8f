"""A mixture of experts in the C decode step (c/moe.c, KernelDecoder._moe_steps): the router's
choice, the chosen experts' products through the experts' table and their weighed sum, held to
attnlab.model.moe (the one reference), under every kernel build (tests/kernel_builds.py).

- The ops alone: the router's softmax, top-k and renormalisation against torch's; each chosen
  expert's product equal to the dense product of that expert's matrix (float32,
  int8, blocks, mixed in one table), with every expert no row chose made of NaNs (a product that
  read one would be NaN); the weighed sum against its equation.
- Whole models, GGUF files in llama.cpp's layout (tests/test_formats_moe.py's moe_file) of the three
  families read (llama with experts as Mixtral, qwen2moe with its gated shared expert and top-k
  weights not renormalised, qwen3moe with qk-norm): float32, the decode step is one program whose
  logits are the module path's within 1e-4 (the dense step's tolerance, test_formats_gemma3.py) and
  greedy generation runs in C, no line said, giving the module path's tokens; kept as blocks of
  every kind the dense step multiplies, each step within float32 sums of the module path with every
  block product's input rounded as the kernels round it (test_blocks.py's decode_step_agreement).
- Ties: the C router takes, of equal scores, the lowest expert first; torch.topk promises no order
  for equal values, so the ops' test checks the rule itself on equal scores, and the float
  models' random routers leave no near tie between a token's k-th and (k+1)-th experts (within
  SCORE_GAP): asserted on every token's scores, so that a pick that differs is a mistake. (The block
  models' agreement measure tolerates the rare row-step where rounding turns a choice.)
"""

from __future__ import annotations

import warnings

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from styles import build
from test_blocks import rounded_to_8_bits
from test_formats_moe import GGUF_CASES, moe_file

import attnlab
from attnlab import slower
from attnlab.generate import kernel_decoder, kernels
from attnlab.generate.kernel_decoder import KernelDecoder
from attnlab.generate.kv_cache import KVCache
from attnlab.model.moe import MoE
from attnlab.quant.blocks import BLOCK_TYPES, BlockLinear

# every test here runs once per build this CPU can execute (kernel_builds.py)
pytestmark = pytest.mark.usefixtures("kernel_build")

ARCHS = list(GGUF_CASES)  # llama (Mixtral's layout), qwen2moe, qwen3moe
# the dense step's block kinds (c/common.h's attnlab_block_type), as GGUF names them
KINDS = [t.name for t in BLOCK_TYPES.values()]
# the least gap between a token's k-th and (k+1)-th router scores, relative to the k-th (docstring):
# far above the paths' float32 differences (~1e-6)
SCORE_GAP = 1e-4


# The ops ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("normalize", [True, False])
def test_the_router_is_softmax_top_k_and_renormalised(normalize, seed):
    rows, n_experts, k = 3, 7, 3
    logits = torch.randn(rows, n_experts) * 3
    scores, weights = logits.clone(), torch.empty(rows, k)
    chosen = torch.empty(rows, k, dtype=torch.int64)
    kernels.route_call(scores, weights, chosen, normalize)()
    expected = torch.softmax(logits, -1)
    torch.testing.assert_close(scores, expected)
    top, indices = expected.topk(k)
    assert torch.equal(chosen, indices)
    torch.testing.assert_close(weights, top / top.sum(-1, keepdim=True) if normalize else top)
    # equal scores: the lowest experts first
    scores = torch.zeros(1, n_experts)
    scores[0, 5] = 1.0
    weights, chosen = torch.empty(1, k), torch.empty(1, k, dtype=torch.int64)
    kernels.route_call(scores, weights, chosen, normalize)()
    assert chosen.tolist() == [[5, 0, 1]]


def expert_weights(d_in: int, d_out: int, unchosen: set[int]) -> tuple[list, list]:
    """Five experts of four kinds (float32, int8, Q8_0 and Q4_K blocks in the file's layout, Q4_0
    in the 16-row one) as the decode step multiplies them, and each one's dense product (x ->
    x Wᵀ, the step's own kernel); the experts in `unchosen` made of NaNs."""
    from test_blocks import block_layer

    experts, dense = [], []
    for e in range(5):
        if e % 5 == 0:
            w = torch.randn(d_out, d_in)
            if e in unchosen:
                w.fill_(float("nan"))
            experts.append(kernels.ExpertWeight(w))
            dense.append(lambda x, w=w: kernels.linear(x, w))
        elif e % 5 == 1:
            q = torch.randint(-127, 128, (d_out, d_in), dtype=torch.int8)
            scale = torch.rand(d_out) + (float("nan") if e in unchosen else 0.1)
            experts.append(kernels.ExpertWeight(q, scale))
            dense.append(lambda x, q=q, s=scale: kernels.linear(x, q, scale=s))
        else:
            name = {2: "q8_0", 3: "q4_k", 4: "q4_0"}[e]
            kind = BLOCK_TYPES[name].kernel
            blocks = block_layer(name, d_out, d_in, seed=e).blocks
            if e in unchosen:  # every block's scale d (its first two bytes): a NaN half
                per_block = BLOCK_TYPES[name].nbytes
                view = blocks.view(d_out, -1, per_block)
                view[..., :2] = torch.tensor([0x00, 0x7E], dtype=torch.uint8)
            repacked = e == 4
            stored = kernels.repack16(blocks, kind, d_in) if repacked else blocks
            experts.append(kernels.ExpertWeight(stored, kind=kind, repacked=repacked))
            dense.append(
                lambda x, b=stored, kind=kind, r=repacked: kernels.block_linear(
                    x, b, kind, repacked=r
                )
            )
    return experts, dense


def test_each_chosen_experts_product_is_its_dense_product(seed):
    """y[r, j] = W^(chosen[r, j]) x: the dense product of that expert (its kind's own kernel on the
    same row, same_product); the experts no row chose are NaN and leave no NaN: never read. W_gate
    and W_in read each row of x for every slot, W_out its slot's own row."""
    rows, k, d_in, d_out = 3, 2, 256, 48
    chosen = torch.tensor([[2, 3], [4, 1], [3, 2]])
    unchosen = set(range(5)) - set(chosen.flatten().tolist())
    assert unchosen == {0}
    experts, dense = expert_weights(d_in, d_out, unchosen)
    for x_per_slot in (False, True):
        x = torch.randn(*((rows, k) if x_per_slot else (rows,)), d_in)
        out = torch.full((rows, k, d_out), float("nan"))
        kernels.linear_experts_call(x, experts, chosen, out, x_per_slot)()
        for r in range(rows):
            for j in range(k):
                row = x[r, j] if x_per_slot else x[r]
                same_product(out[r, j], dense[chosen[r, j]](row[None])[0])
    # every kind read through the table: chosen the other way round, expert 0 included
    chosen = torch.tensor([[0, 1]])
    experts, dense = expert_weights(d_in, d_out, {2, 3, 4})
    x, out = torch.randn(1, d_in), torch.empty(1, k, d_out)
    kernels.linear_experts_call(x, experts, chosen, out)()
    same_product(out[0, 0], dense[0](x)[0])
    same_product(out[0, 1], dense[1](x)[0])


def same_product(ours: torch.Tensor, dense: torch.Tensor) -> None:
    """The dense product's values up to float32 sums in another order: the portable build's
    compiler vectorises the same loop its own way where each caller inlines it (the vector builds
    give equal bits)."""
    torch.testing.assert_close(ours, dense, rtol=1e-6, atol=1e-6 * float(dense.abs().max()))


@pytest.mark.parametrize("shared", [False, True])
def test_the_experts_outputs_are_weighed_into_the_residual(shared, seed):
    rows, k, d = 2, 3, 40
    x, y, weights = torch.randn(rows, d), torch.randn(rows, k, d), torch.rand(rows, k)
    s, gate = (torch.randn(rows, d), torch.randn(rows, 1)) if shared else (None, None)
    expected = x + (weights[..., None] * y).sum(1) + (torch.sigmoid(gate) * s if shared else 0)
    kernels.weigh_experts_call(x, y, weights, s, gate)()
    torch.testing.assert_close(x, expected)


# Whole models -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """moe_file(arch, kind) made once per module: (arch, kind) -> path (the K-quants need d_model
    and the experts' width a multiple of 256)."""
    made, folder = {}, tmp_path_factory.mktemp("moe")

    def file(arch: str, kind=Q.F32):
        if (arch, kind) not in made:
            big = kind in (Q.Q4_K, Q.Q5_K, Q.Q6_K)
            made[arch, kind] = moe_file(
                folder / f"{arch}-{kind.name}.gguf",
                arch,
                kind,
                **(dict(d_model=256, width=256) if big else {}),
            )
        return made[arch, kind]

    return file


def apart(scores: torch.Tensor, k: int) -> bool:
    """Whether every row's k-th and (k+1)-th scores (rows, n_experts) are apart by SCORE_GAP of
    the k-th."""
    if k == scores.shape[-1]:  # every expert chosen: no choice to tie
        return True
    top = scores.topk(k + 1).values
    return bool((top[:, k - 1] - top[:, k] > SCORE_GAP * top[:, k - 1]).all())


def program_kinds(step: KernelDecoder) -> list:
    return [c.kind for p in step.run if isinstance(p, kernels.Program) for c in p.calls]


def decodes_as_the_modules(model) -> None:
    """The decode step of `model` is one C program (the router's choice and the experts in it)
    whose logits, step by step, are the module path's within 1e-4; greedy generation runs in C
    and gives the module path's tokens, with no line said."""
    B, T = 2, 8
    step = KernelDecoder(model, KVCache.for_model(model, B, T))
    assert len(step.run) == 1 and step.can_generate_greedy()
    kinds = program_kinds(step)
    layers = model.config.n_layers
    assert kinds.count(kernels.Op.ROUTE) == kinds.count(kernels.Op.WEIGH_EXPERTS) == layers
    assert kinds.count(kernels.Op.LINEAR_EXPERTS) == 3 * layers
    k = model.config.experts_per_token
    # token ids whose routers choose without a near tie anywhere (a tie may go either way in
    # float32 sums of another order: not a difference of the two paths); a few draws find some
    for _ in range(20):
        ids = torch.randint(0, model.config.d_vocab, (B, T))
        scores = []
        hooks = [
            m.hook_expert_weights.register_forward_hook(lambda mod, i, o: scores.append(o))
            for m in model.modules()
            if isinstance(m, MoE)
        ]
        with torch.no_grad():
            expected = model(ids)
        for hook in hooks:
            hook.remove()
        if all(apart(s.reshape(-1, s.shape[-1]), k) for s in scores):
            break
    else:
        pytest.fail("20 draws of token ids each had a near tie in some router's choice")
    for t in range(T):
        logits = step(ids[:, t : t + 1], t, torch.full((B, 1), t))
        torch.testing.assert_close(logits, expected[:, t], rtol=1e-4, atol=1e-4)
    prompt = ids[:1, :5]
    with warnings.catch_warnings():
        warnings.simplefilter("error", slower.SlowerPath)
        fast = model.generate(prompt, 12, temperature=0)
    assert torch.equal(fast, model.generate(prompt, 12, temperature=0, use_kernels=False))


@pytest.mark.parametrize("arch", ARCHS)
def test_a_float_mixture_decodes_as_one_program_with_the_modules_logits(
    arch, files, seed, monkeypatch
):
    monkeypatch.setattr(slower, "_said", set())
    decodes_as_the_modules(attnlab.load(files(arch)))


@pytest.mark.parametrize("int8", [False, True])
def test_a_mixture_with_sandwich_norms_and_int8_experts(int8, seed, monkeypatch):
    """Sandwich norms around the mixture (weighed into a buffer, normed, added) and a shared
    expert, float32 or int8 weights (weight-only: the module path's products of the same values);
    a random model (N(0, 0.3) weights) of ModelConfig's, not a file."""
    monkeypatch.setattr(slower, "_said", set())
    model = build(
        "llama-gqa",
        n_experts=5,
        experts_per_token=2,
        d_shared_expert=24,
        norm_topk_prob=False,
        sandwich_norm=True,
    )
    if int8:
        attnlab.quantize(model, "int8")
    decodes_as_the_modules(model)


def agreement(model, B: int) -> float:
    """The kernel decode step of `model` over 10 positions held to the module path with each block
    product's input rounded as the kernels round it (test_blocks.py's rounded_to_8_bits), run at
    each step on the kernel's own cache: the fraction of row-steps within float32 sums in another
    order (1e-4 of the logits' spread)."""
    step = KernelDecoder(model, KVCache.for_model(model, B, 16))
    assert len(step.run) == 1 and kernels.Op.LINEAR_EXPERTS in program_kinds(step)
    for m in model.modules():
        if isinstance(m, BlockLinear):
            m.register_forward_pre_hook(lambda module, args: rounded_to_8_bits(args[0]))
    emulated = KVCache.for_model(model, B, 16)
    ids = torch.randint(0, model.config.d_vocab, (B, 10))
    exact = []
    for t in range(10):
        for mine, kernels_own in zip(emulated.k + emulated.v, step.cache.k + step.cache.v):
            mine.copy_(kernels_own)
        with torch.no_grad():
            emulation = model(ids[:, t : t + 1], kv_cache=emulated, start_pos=t)[:, 0]
        logits = step(ids[:, t : t + 1], t, torch.full((B, 1), t))
        spread = emulation.std()
        exact += ((logits - emulation).abs().amax(-1) <= 1e-4 * spread).tolist()
    return sum(exact) / len(exact)


@pytest.mark.parametrize(
    "arch, kind, repack",
    [("qwen2moe", kind, True) for kind in KINDS]
    + [("llama", "Q8_0", False), ("qwen3moe", "Q4_K", True), ("qwen3moe", "Q4_K", False)],
)
def test_a_mixture_of_blocks_decodes_as_the_module_path_rounds(
    arch, kind, repack, files, monkeypatch
):
    """Experts kept as blocks of each kind the dense step multiplies (the 16-row layout where this
    build's products are fastest in it, and the file's): the step's logits equal the emulated
    module path's up to float32 sums on most row-steps, as the dense step's
    (test_blocks.py's test_the_kernel_decode_step_of_a_block_model_stays_near_the_float_model: a
    rounding that goes the other way changes its own row-step, about 1 in 200; a wrong expert or
    weight agrees on none)."""
    monkeypatch.setattr(kernel_decoder, "REPACK", repack)
    model = attnlab.load(files(arch, Q[kind]), keep_blocks=True)
    assert isinstance(model.blocks[0].mlp.experts[0].W_in, BlockLinear)
    assert agreement(model, B=2) >= 0.5
