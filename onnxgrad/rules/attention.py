"""Gradient rules: attention (Attention at opset 23, with nonpad_kv_seqlen at 24 and sliding windows at 25) and
RotaryEmbedding (23).

Attention keeps its fused forward kernel and gets a memory-efficient backward: the probabilities P (one
[B, H, Sq, Skv] tensor per layer) are not kept from the forward pass but recomputed from Q and K inside the
backward, as FlashAttention's backward does, so between the passes only Q, K, V and Y stay alive. The
recomputation is tied to the incoming gradient: Q enters the backward through a Concat with dY (and a Split),
so the score product and everything after it depend on dY and no execution order can run them during the
forward pass, where P would stay alive until the backward. The products are Einsums: they read K and V in their
own layout (no transposed copies) and sum the query heads of a grouped-query layer into their shared key and
value head (`bhgqk,bhgqd->bhkd`).

RotaryEmbedding's input gradient is the same op rotating the other way; its cos and sin caches get the
per-position sums of the pair products, added into the cache rows the positions read.
"""
from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto

from ..builder import unbroadcast
from ..registry import rule


# -- Attention -------------------------------------------------------------------------------------------------------
class _Heads:
    """How an Attention node lays out its operands, and the Einsum subscripts that read them in place.

    Q-side tensors (Q, dY, dQ) are viewed with the query heads split into (kv head h, group g) when the layer
    is grouped; K-side tensors (K, V and their gradients) keep their layout: `bhkd` for 4-D inputs and for the
    present key/value of a cache, `bkhd` for 3-D inputs viewed as heads.
    """

    def __init__(self, ctx):
        self.ctx = ctx
        q, k = ctx.I(0), ctx.I(1)
        self.rank = rank = ctx.rank(q)
        if rank == 3:
            self.hq, self.hkv = ctx.attr("q_num_heads"), ctx.attr("kv_num_heads")
            if not self.hq or not self.hkv:
                raise ctx.unsupported("3-D Q, K, V need the q_num_heads and kv_num_heads attributes")
        elif rank == 4:
            self.hq, self.hkv = q.shape[1], k.shape[1]
            if not isinstance(self.hq, int) or not isinstance(self.hkv, int):
                raise ctx.unsupported("the number of heads of Q and K must be static")
        else:
            raise ctx.unsupported(f"Q has rank {rank}; the op takes 3-D or 4-D Q, K, V")
        if self.hq % self.hkv:
            raise ctx.unsupported(f"{self.hq} query heads do not divide into {self.hkv} key/value heads")
        self.group = self.hq // self.hkv
        self.dq = self._head_size(q, self.hq)
        self.cached = ctx.I(4) is not None
        grouped = "hg" if self.group > 1 else "h"
        self.q_sub = f"b{grouped}qd" if rank == 4 else f"bq{grouped}d"
        self.k_sub = "bhkd" if rank == 4 or self.cached else "bkhd"
        self.s_sub = f"b{grouped}qk"
        # Scores are worked on as the Einsums give them ([B, h, g, Sq, Skv] when grouped), unless a mask with a
        # head axis or a qk_matmul_output gradient needs the op's [B, Hq, Sq, Skv].
        mask = ctx.I(3)
        self.flat = self.group == 1 or (mask is not None and ctx.rank(mask) >= 3) or \
            (len(ctx.node.outputs) > 3 and bool(ctx.node.outputs[3].name))
        self.s_rank = 4 if self.flat else 5

    def _head_size(self, v, heads: int):
        last = v.shape[-1] if v.shape is not None else None
        if not isinstance(last, int):
            return None
        return last if self.rank == 4 else last // heads

    def q_view(self, v, like):
        """A Q-side tensor (input layout, shaped like `like` but for the last axis) in the layout of q_sub."""
        ctx = self.ctx
        if self.rank == 3:
            heads = [self.hkv, self.group] if self.group > 1 else [self.hq]
            return ctx.reshape(v, [0, 0, *heads, -1])
        if self.group == 1:
            return v
        return ctx.reshape(v, [0, self.hkv, self.group, ctx.dim(like, 2), -1])

    def q_unview(self, v, like):
        """A tensor in the layout of q_sub back in the input layout of `like`."""
        ctx = self.ctx
        if self.rank == 3:
            return ctx.reshape(v, [0, 0, -1])
        if self.group == 1:
            return v
        return ctx.reshape(v, [0, self.hq, ctx.dim(like, 2), -1])

    def k_view(self, v):
        """A 3-D K or V viewed as [B, Skv, H, D]; 4-D ones as they are."""
        return v if self.rank == 4 else self.ctx.reshape(v, [0, 0, self.hkv, -1])

    def k_as_4d(self, v):
        """K or V as [B, H, Skv, D], the layout of past and present key/value."""
        return v if self.rank == 4 else self.ctx.op.Transpose(self.k_view(v), perm=[0, 2, 1, 3])

    def k_unview(self, g):
        """A K-side gradient (layout k_sub) in the layout of the K and V inputs."""
        ctx = self.ctx
        if self.rank == 4:
            return g
        if self.k_sub == "bhkd":
            g = ctx.op.Transpose(g, perm=[0, 2, 1, 3])
        return ctx.reshape(g, [0, 0, -1])

    def scores_4d(self, s, q):
        """[B, h, g, Sq, Skv] scores (from an Einsum) in the layout the scores are worked on."""
        if not self.flat or self.group == 1:
            return s
        sq = self.ctx.dim(q, 2 if self.rank == 4 else 1)
        return self.ctx.reshape(s, [0, self.hq, sq, -1])

    def scores_grouped(self, s, q):
        """Scores in the layout they are worked on as [B, h, g, Sq, Skv], for an Einsum."""
        if not self.flat or self.group == 1:
            return s
        sq = self.ctx.dim(q, 2 if self.rank == 4 else 1)
        return self.ctx.reshape(s, [0, self.hkv, self.group, sq, -1])

    def einsum(self, a_sub: str, b_sub: str, out_sub: str, a, b):
        return self.ctx.op.Einsum(a, b, equation=f"{a_sub},{b_sub}->{out_sub}")


def _attention_allowed(ctx, heads: _Heads, q, kv_total, past_len):
    """The keys each query may attend as a boolean tensor broadcastable to [B, Hq, Sq, Skv] (None: all), the
    float mask added to the scores (None: none), padded to Skv, and `alive`, [.., Sq, 1], false on rows where
    no key is allowed (their probabilities are 0, as the op defines; None where no row can be)."""
    op = ctx.op
    mask, nonpad = ctx.I(3), ctx.I(6) if ctx.num_inputs > 6 else None
    sq = ctx.dim(q, 2 if heads.rank == 4 else 1)
    skv = ctx.dim(kv_total, 2 if heads.rank == 4 or heads.cached else 1)
    allowed, float_mask = [], None
    if mask is not None:
        padded = mask
        m_len = mask.shape[-1] if mask.shape else None
        if not (isinstance(m_len, int) and isinstance(skv, int) and m_len == skv):
            # a shorter last axis is padded to Skv with "not allowed" (-inf for a float mask)
            width = skv - m_len if isinstance(m_len, int) and isinstance(skv, int) else \
                op.Sub(ctx.make_shape([skv]), op.Shape(mask, start=-1))
            pads = ctx.make_shape([0] * (ctx.rank(mask) * 2 - 1) + [width])
            if mask.elem_type == TensorProto.BOOL:
                padded = op.Cast(op.Pad(op.Cast(mask, to=TensorProto.INT32), pads,
                                        op.const(np.int32(0), TensorProto.INT32)), to=TensorProto.BOOL)
            else:
                padded = op.Pad(mask, pads, ctx.const_like(-np.inf, mask))
        if mask.elem_type == TensorProto.BOOL:
            allowed.append(padded)
        else:
            float_mask = padded
            allowed.append(op.Not(op.IsInf(padded, detect_positive=0)))
    causal = ctx.attr("is_causal", 0)
    left, right = ctx.attr("left_window_size", -1), ctx.attr("right_window_size", -1)
    if nonpad is not None:
        # keys past each sample's valid length are padding; the causal frontier is aligned to that length
        keys = op.Range(ctx.int64(0), ctx.dim_scalar(skv), ctx.int64(1))
        lengths = op.Reshape(nonpad, op.ints([-1] + [1] * (heads.s_rank - 1)))
        allowed.append(op.Less(keys, lengths))
        offset = op.Sub(lengths, op.Reshape(ctx.dim_scalar(sq), op.ints([1])))
    else:
        offset = None if past_len is None else op.Reshape(ctx.dim_scalar(past_len), op.ints([1]))
    if causal or left >= 0 or right >= 0:
        rows = op.Unsqueeze(op.Range(ctx.int64(0), ctx.dim_scalar(sq), ctx.int64(1)), op.ints([1]))
        cols = op.Range(ctx.int64(0), ctx.dim_scalar(skv), ctx.int64(1))
        position = rows if offset is None else op.Add(rows, offset)   # the query's absolute position
        ahead = op.Sub(cols, position)                                  # key index minus query position
        if causal:
            allowed.append(op.LessOrEqual(ahead, op.ints([0])))
        if right >= 0:
            allowed.append(op.LessOrEqual(ahead, op.ints([right])))
        if left >= 0:
            allowed.append(op.GreaterOrEqual(ahead, op.ints([-left])))
    if not allowed:
        return None, None, None
    both = allowed[0]
    for a in allowed[1:]:
        both = op.And(both, a)
    if mask is None and nonpad is None and left < 0 and right < 0:
        return both, None, None   # causal alone: key 0 is before every query (the offset is never negative)
    # int32, not float: the row test reads forward values only and must not be a float as large as the scores
    alive = op.Greater(op.ReduceMax(op.Cast(both, to=TensorProto.INT32), op.ints([-1]), keepdims=1),
                       op.const(np.int32(0), TensorProto.INT32))
    return both, float_mask, alive


@rule("Attention", since=23, wrt=(0, 1, 2, 3, 4, 5),
      limits="static head counts (and head size when scale is not given); qk_matmul_output's gradient in mode 0 "
             "with softcap (the spec and the reference differ)")
def attention(ctx):
    """Y = P V, P = softmax(scale*Q K^T (softcapped) + bias), P recomputed: dV = P^T dY, dP = dY V^T,
    dL = P*(dP - rowsum(dY*Y)), dQ = scale*dL K, dK = scale*dL^T Q (through softcap: dL*(1 - t^2))"""
    op, q, past_k = ctx.op, ctx.I(0), ctx.I(4)
    heads = _Heads(ctx)
    scale, softcap, mode, g_qk = _settings(ctx, heads)
    k_total, v_total = _attended(ctx, heads, 1, 4), _attended(ctx, heads, 2, 5)
    past_len = ctx.dim(past_k, 2) if past_k is not None else None
    qs, gyv, gy = _tied_to_gradient(ctx, heads, scale)
    probs, tanh = _probabilities(ctx, heads, qs, k_total, past_len, softcap)
    g_logits = _softmax_grad(ctx, heads, probs, gyv, gy, v_total, g_qk, mode)
    g_mask = _mask_grad(ctx, heads, g_logits, k_total) if ctx.needs(3) else None
    g_scores = _scores_grad(ctx, heads, g_logits, tanh, g_qk, mode)

    sub_q, sub_k, sub_s = heads.q_sub, heads.k_sub, heads.s_sub
    gq = gk = gv = gpk = gpv = None
    if ctx.needs(0):
        gq = heads.q_unview(op.Mul(heads.einsum(sub_s, sub_k, sub_q, g_scores, k_total),
                                   ctx.const_like(scale, q)), q)
    if ctx.needs(1) or ctx.needs(4) or ctx.GO(1) is not None:
        gk, gpk = _split_cache(ctx, heads, heads.einsum(sub_s, sub_q, sub_k, g_scores, qs), 1, 4)
    if ctx.needs(2) or ctx.needs(5) or ctx.GO(2) is not None:
        gv, gpv = _split_cache(ctx, heads, heads.einsum(sub_s, sub_q, sub_k, heads.scores_grouped(probs, q), gyv),
                               2, 5)
    grads = [gq, gk if ctx.needs(1) else None, gv if ctx.needs(2) else None, g_mask,
             gpk if ctx.needs(4) else None, gpv if ctx.needs(5) else None, None]
    return grads[:ctx.num_inputs]


def _settings(ctx, heads: _Heads):
    """scale (1/sqrt(head size) when not given), softcap, qk_matmul_output_mode and that output's gradient."""
    scale = ctx.attr("scale", None)
    if scale is None:
        if heads.dq is None:
            raise ctx.unsupported("the head size of Q is not static, so the default scale 1/sqrt(head size) is "
                                  "unknown (give the scale attribute or bind the shape)")
        scale = 1.0 / math.sqrt(heads.dq)
    softcap = ctx.attr("softcap", 0.0) or 0.0
    mode = ctx.attr("qk_matmul_output_mode", 0)
    g_qk = ctx.GO(3)
    if g_qk is not None and mode == 0 and softcap > 0:
        raise ctx.unsupported("a gradient through qk_matmul_output in mode 0 with softcap: the spec says the raw "
                              "product, the reference evaluator gives the softcapped one")
    return scale, softcap, mode, g_qk


def _attended(ctx, heads: _Heads, i_in: int, i_past: int):
    """K (input 1) or V (input 2) as the op attends it: the present key/value (output 1 or 2) when a cache is
    concatenated in front."""
    present = ctx.node.outputs[i_in] if len(ctx.node.outputs) > i_in else None
    if ctx.I(i_past) is None:
        return heads.k_view(ctx.I(i_in))
    if present is not None and present.name:
        return present
    return ctx.op.Concat(ctx.I(i_past), heads.k_as_4d(ctx.I(i_in)), axis=2)


def _tied_to_gradient(ctx, heads: _Heads, scale: float):
    """scale * Q and dY in the q_sub layout, Q passed through a Concat with dY and a Split (see the module
    docstring); and dY as it came."""
    op, q = ctx.op, ctx.I(0)
    gy = ctx.GO_or_zeros(0)
    tied = op.Concat(q, gy, axis=-1)
    q_last, gy_last = ctx.dim(q, -1), ctx.dim(ctx.O(0), -1)
    q_tied, gy_tied = op.Split(tied, ctx.make_shape([q_last, gy_last]), axis=-1, outputs=2)
    qs = op.Mul(heads.q_view(q_tied, q), ctx.const_like(scale, q))      # scale * Q, in the q_sub layout
    return qs, heads.q_view(gy_tied, q), gy


def _probabilities(ctx, heads: _Heads, qs, k_total, past_len, softcap: float):
    """P recomputed from scale * Q and K (masked, softcapped, in softmax_precision), and tanh of the softcap (None
    without one)."""
    op, q, mask = ctx.op, ctx.I(0), ctx.I(3)
    t = ctx.elem_type(q)
    logits = scores = heads.scores_4d(heads.einsum(heads.q_sub, heads.k_sub, heads.s_sub, qs, k_total), q)
    tanh = None
    if softcap > 0:
        tanh = op.Tanh(op.Div(scores, ctx.const_like(softcap, q)))
        logits = op.Mul(tanh, ctx.const_like(softcap, q))
    allowed, float_mask, alive = _attention_allowed(ctx, heads, q, k_total, past_len)
    if float_mask is not None:
        logits = op.Add(logits, ctx.cast(float_mask, ctx.elem_type(mask), t))
    if allowed is not None:
        logits = op.Where(allowed, logits, ctx.const_like(-np.inf, q))
    precision = ctx.attr("softmax_precision", None)
    if precision and precision != t:
        probs = op.Cast(op.Softmax(op.Cast(logits, to=precision), axis=-1), to=t)
    else:
        probs = op.Softmax(logits, axis=-1)
    zero = ctx.const_like(0.0, q)
    if alive is not None:
        probs = op.Where(alive, probs, zero)   # rows with no key allowed are 0, not NaN
    return probs, tanh


def _softmax_grad(ctx, heads: _Heads, probs, gyv, gy, v_total, g_qk, mode: int):
    """dL = P * (dP - rowsum(P * dP)) with dP = dY V^T, rowsum(P * dP) = rowsum(dY * Y); a qk_matmul_output
    gradient joins dP in mode 3 (the probabilities) and dL in mode 2 (the masked scores)."""
    op, q = ctx.op, ctx.I(0)
    g_probs = heads.scores_4d(heads.einsum(heads.q_sub, heads.k_sub, heads.s_sub, gyv, v_total), q)
    if g_qk is not None and mode == 3:
        g_probs = op.Add(g_probs, g_qk)
        row = op.ReduceSum(op.Mul(probs, g_probs), op.ints([-1]), keepdims=1)
    else:
        row = op.ReduceSum(heads.q_view(op.Mul(gy, ctx.O(0)), q), op.ints([-1]), keepdims=1)   # in the q_sub layout
        if heads.rank == 3:   # [B, Sq, h, (g,) 1] -> [B, h, (g,) Sq, 1]
            row = op.Transpose(row, perm=[0, 2, 3, 1, 4] if heads.group > 1 else [0, 2, 1, 3])
        row = heads.scores_4d(row, q)
    g_logits = op.Mul(probs, op.Sub(g_probs, row))
    if g_qk is not None and mode == 2:
        g_logits = op.Add(g_logits, g_qk)
    return g_logits


def _mask_grad(ctx, heads: _Heads, g_logits, k_total):
    """The float mask's gradient: dL cut to the mask's length and summed to its shape."""
    op, mask = ctx.op, ctx.I(3)
    g_mask = g_logits
    m_len = mask.shape[-1] if mask.shape else None
    skv = ctx.dim(k_total, 2 if heads.rank == 4 or heads.cached else 1)
    if not (isinstance(m_len, int) and isinstance(skv, int) and m_len == skv):
        g_mask = op.Slice(g_mask, op.ints([0]), op.Shape(mask, start=-1), op.ints([-1]))
    g_mask = unbroadcast(ctx, g_mask, mask, _sized(g_mask, heads.s_rank))
    return ctx.cast(g_mask, ctx.elem_type(ctx.I(0)), ctx.elem_type(mask))


def _scores_grad(ctx, heads: _Heads, g_logits, tanh, g_qk, mode: int):
    """The gradient of scale * Q K^T, in the layout of the Einsums: through softcap (dL*(1 - t^2)), with a
    qk_matmul_output gradient in mode 1 (the softcapped scores) or 0 (the raw product)."""
    op = ctx.op
    g_scores = g_logits
    if g_qk is not None and mode == 1:
        g_scores = op.Add(g_scores, g_qk)
    if tanh is not None:
        g_scores = op.Sub(g_scores, op.Mul(op.Mul(g_scores, tanh), tanh))
    if g_qk is not None and mode == 0:
        g_scores = op.Add(g_scores, g_qk)
    return heads.scores_grouped(g_scores, ctx.I(0))


def _sized(v, rank: int):
    """A rule-built Value with its rank made known to `unbroadcast` (its sizes are not)."""
    v.shape = (None,) * rank
    return v


def _split_cache(ctx, heads: _Heads, g_total, i_in: int, i_past: int):
    """The gradient of K (or V) and of its past cache from the gradient of the key/value the op attended."""
    op = ctx.op
    i_present = i_in  # present_key is output 1 and K input 1; present_value output 2 and V input 2
    g_present = ctx.GO(i_present)
    if g_present is not None:
        g_total = op.Add(g_total, g_present if heads.k_sub == "bhkd" else op.Transpose(g_present, perm=[0, 2, 1, 3]))
    x, past = ctx.I(i_in), ctx.I(i_past)
    if past is None:
        return heads.k_unview(g_total), None
    new_len = ctx.dim(x, 2 if heads.rank == 4 else 1)
    g_past, g_new = op.Split(g_total, ctx.make_shape([ctx.dim(past, 2), new_len]), axis=2, outputs=2)
    if heads.rank == 3:
        g_new = ctx.reshape(op.Transpose(g_new, perm=[0, 2, 1, 3]), [0, 0, -1])
    return g_new, g_past


# -- RotaryEmbedding -------------------------------------------------------------------------------------------------
def _rotary_signs(ctx, x, head_size: int, rotary: int, interleaved: bool, heads: int):
    """+1/-1 along the last axis: -1 on the second element of each rotated pair. Negating the second element
    before and after a rotation by theta rotates by -theta (F R(theta) F = R(-theta), F = diag(1, -1))."""
    half = rotary // 2
    pair = np.ones(head_size)
    if interleaved:
        pair[1:rotary:2] = -1.0
    else:
        pair[half:rotary] = -1.0
    return ctx.const_like(np.tile(pair, heads), x)


@rule("RotaryEmbedding", since=23, wrt=(0, 1, 2),
      limits="the last axis of X must be static")
def rotary_embedding(ctx):
    """y = R(theta) x on each rotated pair: dx = R(-theta) dy = F R(theta) F dy (F negates the pair's second
    element); dcos = sum_h(dy1*x1 + dy2*x2), dsin = sum_h(dy2*x1 - dy1*x2)"""
    op = ctx.op
    x, cos, sin, positions = ctx.I(0), ctx.I(1), ctx.I(2), ctx.I(3)
    gy = ctx.GO(0)
    rank = ctx.rank(x)
    num_heads = ctx.attr("num_heads", 0)
    last = x.shape[-1] if x.shape else None
    if not isinstance(last, int):
        raise ctx.unsupported("the last axis of X must be static")
    if rank == 3:
        if not num_heads:
            raise ctx.unsupported("3-D X needs the num_heads attribute")
        head_size, tiles = last // num_heads, num_heads
    else:
        head_size, tiles = last, 1
    rotary = ctx.attr("rotary_embedding_dim", 0) or head_size
    interleaved = bool(ctx.attr("interleaved", 0))
    attrs = {"interleaved": ctx.attr("interleaved", None), "num_heads": ctx.attr("num_heads", None),
             "rotary_embedding_dim": ctx.attr("rotary_embedding_dim", None)}
    gx = gc = gs = None
    if ctx.needs(0):
        signs = _rotary_signs(ctx, x, head_size, rotary, interleaved, tiles)
        inputs = [op.Mul(gy, signs), cos, sin] + ([positions] if positions is not None else [])
        gx = op.Mul(op.node("RotaryEmbedding", inputs, **attrs), signs)
    if ctx.needs(1) or ctx.needs(2):
        # per-element products in the layout [B, S, H, D] (4-D X is [B, H, S, D]), then the pair halves
        head_axis = 2 if rank == 3 else 1
        as_heads = (lambda v: ctx.reshape(v, [0, 0, num_heads, -1])) if rank == 3 else (lambda v: v)
        half = rotary // 2

        def halves(v):
            if interleaved:
                return (op.Slice(v, op.ints([0]), op.ints([rotary]), op.ints([-1]), op.ints([2])),
                        op.Slice(v, op.ints([1]), op.ints([rotary]), op.ints([-1]), op.ints([2])))
            return (op.Slice(v, op.ints([0]), op.ints([half]), op.ints([-1])),
                    op.Slice(v, op.ints([half]), op.ints([rotary]), op.ints([-1])))

        def per_position(v):   # [B, S, H, r/2] or [B, H, S, r/2] -> [B, S, r/2]
            return op.ReduceSum(v, op.ints([head_axis]), keepdims=0)

        gy1, gy2 = halves(as_heads(gy))
        xh = as_heads(x)
        x1, x2 = halves(xh)
        if ctx.needs(1):
            gc = _rotary_cache_grad(ctx, per_position(op.Add(op.Mul(gy1, x1), op.Mul(gy2, x2))), cos, positions,
                                    half)
        if ctx.needs(2):
            gs = _rotary_cache_grad(ctx, per_position(op.Sub(op.Mul(gy2, x1), op.Mul(gy1, x2))), sin, positions,
                                    half)
    return [gx, gc, gs, None][:ctx.num_inputs]


def _rotary_cache_grad(ctx, per_position, cache, positions, half: int):
    """[B, S, r/2] gradients summed into the cache rows that the positions read (or as they are)."""
    if positions is None:
        return per_position
    op = ctx.op
    rows = op.Reshape(per_position, op.ints([-1, half]))
    summed = ctx.scatter_add_rows(ctx.make_shape([ctx.dim(cache, 0)]), op.Reshape(positions, op.ints([-1])), rows,
                                  cache)
    return ctx.reshape_like(summed, cache)
