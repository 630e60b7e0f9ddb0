"""titan_integration.fla_cpu: the plain-torch stand-ins for flash-linear-attention's Gated DeltaNet ops that Qwen3.5
trains with in CPU mode. fla itself is not installed here (its kernels are triton, GPU only): the closed form is
checked against fla 0.5.2's token-by-token reference (``naive_recurrent_gated_delta_rule``, transcribed below),
values and gradients, and against the delta rule's defining properties: what a step writes is read back, the gate
decays the state, documents do not see each other, grouped value heads are repeated key heads, and the autograd
Functions TorchTitan registers compute what the plain functions compute, gradients included."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from titan_integration import fla_cpu  # noqa: E402  (importing it installs nothing)


def _inputs(B=2, T=9, H=2, K=4, V=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, H, K, generator=g), torch.randn(B, T, H, K, generator=g)
    v = torch.randn(B, T, H, V, generator=g)
    gate = F.logsigmoid(torch.randn(B, T, H, generator=g))
    beta = torch.rand(B, T, H, generator=g)
    return q, k, v, gate, beta


def _naive_recurrent(q, k, v, beta, g, scale, h):
    """fla/ops/gated_delta_rule/naive.py's naive_recurrent_gated_delta_rule (fla 0.5.2), one token at a time."""
    q, k, v, beta, g = (x.transpose(1, 2).float() for x in (q, k, v, beta, g))
    outs = []
    for i in range(q.shape[2]):
        h = h * g[:, :, i].exp()[..., None, None]
        b_v = (v[:, :, i] - (h * k[:, :, i][..., None]).sum(-2)) * beta[:, :, i][..., None]
        h = h + k[:, :, i].unsqueeze(-1) * b_v.unsqueeze(-2)
        outs.append(torch.einsum("bhd,bhdm->bhm", q[:, :, i] * scale, h))
    return torch.stack(outs, 2).transpose(1, 2), h


def test_closed_form_matches_fla_naive_recurrence_values_and_gradients():
    q, k, v, g, beta = _inputs(B=1, T=70, H=2, K=8, V=5, seed=3)
    h0 = torch.randn(1, 2, 8, 5, generator=torch.Generator().manual_seed(4))
    xs = [t.clone().requires_grad_() for t in (q, k, v, g, beta, h0)]
    ys = [t.clone().requires_grad_() for t in (q, k, v, g, beta, h0)]
    o, ht = fla_cpu.chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True)
    o_ref, ht_ref = _naive_recurrent(ys[0], ys[1], ys[2], ys[4], ys[3], 8**-0.5, ys[5])
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ht, ht_ref, rtol=1e-4, atol=1e-4)
    (o.square().sum() + ht.sum()).backward()
    (o_ref.square().sum() + ht_ref.sum()).backward()
    for a, b in zip(xs, ys):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-3, atol=1e-3)


def test_delta_rule_reads_back_what_it_wrote():
    """beta = 1, no decay, unit keys: after step t the state maps k_t to v_t exactly, so q_t = k_t reads v_t."""
    q, k, v, _, _ = _inputs()
    zeros, ones = torch.zeros(v.shape[:3]), torch.ones(v.shape[:3])
    o, _ = fla_cpu.chunk_gated_delta_rule(k, k, v, zeros, ones, scale=1.0, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o, v, rtol=1e-5, atol=1e-5)
    o_raw, _ = fla_cpu.chunk_gated_delta_rule(k, k, v, zeros, ones, scale=1.0)  # without the l2 norm it does not
    assert not torch.allclose(o_raw, v, atol=1e-2)


def test_gate_decays_the_state_and_scale_defaults_to_rsqrt_k():
    q, k, v, _, _ = _inputs(T=5)
    B, T, H, K, V = *q.shape, v.shape[-1]
    h0 = torch.randn(B, H, K, V)
    gate = torch.full((B, T, H), 0.5).log()
    o, ht = fla_cpu.chunk_gated_delta_rule(
        q, k, v, gate, torch.zeros(B, T, H), initial_state=h0, output_final_state=True
    )
    want = torch.stack([torch.einsum("bhk,bhkv->bhv", q[:, t] * K**-0.5, h0) * 0.5 ** (t + 1) for t in range(T)], 1)
    torch.testing.assert_close(o, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ht, h0 * 0.5**T)
    assert fla_cpu.chunk_gated_delta_rule(q, k, v, gate, torch.zeros(B, T, H))[1] is None


def test_varlen_documents_are_independent_and_grouped_heads_repeat():
    q, k, v, g, beta = _inputs()
    B, T = q.shape[:2]
    h0 = torch.randn(B, q.shape[2], q.shape[3], v.shape[3])
    o, ht = fla_cpu.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    flat = [x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta)]
    cu = torch.tensor([0, T, 2 * T])
    o2, ht2 = fla_cpu.chunk_gated_delta_rule(*flat, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert torch.equal(o2.reshape(o.shape), o) and torch.equal(ht2, ht)
    v4, g4, b4 = torch.randn(B, T, 4, 3), g.repeat_interleave(2, 2), beta.repeat_interleave(2, 2)
    og, _ = fla_cpu.chunk_gated_delta_rule(q, k, v4, g4, b4)
    oe, _ = fla_cpu.chunk_gated_delta_rule(q.repeat_interleave(2, 2), k.repeat_interleave(2, 2), v4, g4, b4)
    assert torch.equal(og, oe)
    with pytest.raises(ValueError, match="multiple"):
        fla_cpu.chunk_gated_delta_rule(q, k, torch.randn(B, T, 3, 3), g, beta)


def test_autograd_functions_match_the_functions():
    xs = [t.requires_grad_() for t in _inputs()]
    ys = [t.detach().clone().requires_grad_() for t in xs]
    # ChunkGatedDeltaRuleFunction.apply(q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first,
    # cu_seqlens, cu_seqlens_cpu, use_qk_l2norm_in_kernel): fla's positional order
    o1, _ = fla_cpu.ChunkGatedDeltaRuleFunction.apply(*xs, None, None, False, False, None, None, True)
    o2, _ = fla_cpu.chunk_gated_delta_rule(*ys, use_qk_l2norm_in_kernel=True)
    o1.square().sum().backward()
    o2.square().sum().backward()
    assert torch.equal(o1, o2) and all(torch.equal(a.grad, b.grad) for a, b in zip(xs, ys))
    q, k, v, g, beta = (t.detach() for t in xs)
    o3, _ = fla_cpu.FusedRecurrentFunction.apply(q, k, v, g, None, None, beta, None, None, None, None, False, True)
    assert torch.equal(o3, o2.detach())


def test_causal_conv1d_is_causal_per_document_with_silu():
    T, D, W = 7, 5, 4
    x = torch.randn(1, 2 * T, D, requires_grad=True)
    w = torch.randn(D, W, requires_grad=True)
    cu = torch.tensor([0, T, 2 * T])
    y, state = fla_cpu.causal_conv1d(x, w, activation="silu", cu_seqlens=cu)
    assert state is None
    want = []
    for s, e in [(0, T), (T, 2 * T)]:  # y_t = silu(sum_j w[:, j] * x_{t - (W - 1) + j}), zeros before the document
        seg = x[0, s:e]
        rows = [sum(w[:, j] * seg[t - (W - 1) + j] for j in range(W) if t - (W - 1) + j >= 0) for t in range(e - s)]
        want.append(F.silu(torch.stack(rows)))
    torch.testing.assert_close(y[0], torch.cat(want))
    y2, _ = fla_cpu.CausalConv1dFunction.apply(x, w, None, None, None, False, "silu", cu)
    assert torch.equal(y, y2)
    with pytest.raises(ValueError, match="activation"):
        fla_cpu.causal_conv1d(x, w, activation="relu")
