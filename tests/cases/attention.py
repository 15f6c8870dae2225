"""Attention (opsets 23-25) and RotaryEmbedding (23) cases.

Attention's cases cover the forms torch.onnx and the spec write: 4-D and 3-D operands, grouped-query heads,
causal and sliding-window masks, boolean and float masks (a float mask is a bias, differentiated; a short one is
padded), a past key/value cache, softcap, softmax_precision, nonpad_kv_seqlen (opset 24) and the
qk_matmul_output modes. RotaryEmbedding has no float64 kernel, so its cases run in float32.
"""
import numpy as np

from gradcheck import Case

CAUSAL_2x3 = np.array([[True, True, False], [True, True, True]])


def _angles(*shape, step=1.0):
    """cos and sin caches of the given shape."""
    a = np.arange(int(np.prod(shape))).reshape(shape) * step
    return np.cos(a), np.sin(a)


CASES = [
    # Attention, 4-D [B, H, S, D]
    Case("Attention", [(1, 2, 3, 4), (1, 2, 3, 4), (1, 2, 3, 4)], id="Attention-4d", opset=23),
    Case("Attention", [(2, 2, 3, 2), (2, 2, 4, 2), (2, 2, 4, 3)], {"scale": 0.7}, id="Attention-cross-scale-dv",
         opset=23),
    Case("Attention", [(1, 4, 3, 2), (1, 2, 3, 2), (1, 2, 3, 2)], {"is_causal": 1}, id="Attention-gqa-causal",
         opset=23),
    Case("Attention", [(1, 4, 2, 2), (1, 1, 3, 2), (1, 1, 3, 2)], id="Attention-mqa", opset=23),
    Case("Attention", [(1, 2, 2, 2), (1, 2, 3, 2), (1, 2, 3, 2), CAUSAL_2x3], id="Attention-bool-mask", opset=23),
    Case("Attention", [(1, 2, 2, 2), (1, 2, 3, 2), (1, 2, 3, 2), (1, 2, 2, 3)], id="Attention-float-mask-grad",
         opset=23),
    Case("Attention", [(2, 2, 2, 2), (2, 2, 3, 2), (2, 2, 3, 2), (2, 1, 2, 3)], id="Attention-float-mask-broadcast",
         opset=23),
    Case("Attention", [(1, 2, 3, 2), (1, 2, 3, 2), (1, 2, 3, 2)], {"softcap": 2.0}, id="Attention-softcap",
         opset=23),
    Case("Attention", [(1, 2, 3, 2), (1, 2, 3, 2), (1, 2, 3, 2), (3, 3)], {"softcap": 1.5, "is_causal": 1},
         id="Attention-softcap-mask-causal", opset=23),
    Case("Attention", [(1, 2, 2, 2), (1, 2, 2, 2), (1, 2, 2, 2), None, (1, 2, 3, 2), (1, 2, 3, 2)],
         {"is_causal": 1}, outputs=3, output_names=["out0", "present_key", "present_value"],
         id="Attention-past-causal", opset=23),
    Case("Attention", [(1, 2, 3, 2), (1, 2, 3, 2), (1, 2, 3, 2)], {"softmax_precision": 11},
         id="Attention-softmax-precision", opset=23, dtype=np.float32, tol=2e-3),
    Case("Attention", [(1, 2, 2, 2), (1, 2, 3, 2), (1, 2, 3, 2)], {"qk_matmul_output_mode": 3}, outputs=4,
         output_names=["out0", "", "", "qk"], id="Attention-qk-probs", opset=23),
    Case("Attention", [(1, 2, 2, 2), (1, 2, 3, 2), (1, 2, 3, 2), (2, 3)], {"qk_matmul_output_mode": 2}, outputs=4,
         output_names=["out0", "", "", "qk"], id="Attention-qk-biased", opset=23),
    Case("Attention", [(1, 2, 2, 2), (1, 2, 3, 2), (1, 2, 3, 2)], {"qk_matmul_output_mode": 1, "softcap": 2.0},
         outputs=4, output_names=["out0", "", "", "qk"], id="Attention-qk-softcapped", opset=23),
    Case("Attention", [(1, 2, 2, 2), (1, 2, 3, 2), (1, 2, 3, 2)], outputs=4, output_names=["out0", "", "", "qk"],
         id="Attention-qk-raw", opset=23),
    # grouped-query heads work on [B, h, g, Sq, Skv] scores, unless a mask has a head axis or qk is an output
    Case("Attention", [(1, 4, 2, 2), (1, 2, 3, 2), (1, 2, 3, 2), (2, 3)], id="Attention-gqa-mask-2d", opset=23),
    Case("Attention", [(1, 4, 2, 2), (1, 2, 3, 2), (1, 2, 3, 2), (1, 4, 2, 3)], id="Attention-gqa-mask-heads",
         opset=23),
    Case("Attention", [(1, 4, 2, 2), (1, 2, 3, 2), (1, 2, 3, 2)], {"qk_matmul_output_mode": 3, "is_causal": 1},
         outputs=4, output_names=["out0", "", "", "qk"], id="Attention-gqa-qk-probs", opset=23),
    Case("Attention", [(2, 4, 2, 2), (2, 2, 3, 2), (2, 2, 3, 2), None, None, None, np.array([3, 1])],
         id="Attention-gqa-nonpad", opset=24),
    # Attention, 3-D [B, S, H*D] with head-count attributes
    Case("Attention", [(1, 3, 4), (1, 3, 4), (1, 3, 4)], {"q_num_heads": 2, "kv_num_heads": 2}, id="Attention-3d",
         opset=23),
    Case("Attention", [(2, 3, 4), (2, 2, 2), (2, 2, 4)], {"q_num_heads": 2, "kv_num_heads": 1, "is_causal": 1},
         id="Attention-3d-gqa-dv", opset=23),
    Case("Attention", [(1, 2, 4), (1, 2, 4), (1, 2, 4), None, (1, 2, 1, 2), (1, 2, 1, 2)],
         {"q_num_heads": 2, "kv_num_heads": 2, "is_causal": 1}, outputs=3,
         output_names=["out0", "present_key", "present_value"], id="Attention-3d-past", opset=23),
    Case("Attention", [(1, 2, 8), (1, 3, 4), (1, 3, 4), CAUSAL_2x3], {"q_num_heads": 4, "kv_num_heads": 2},
         id="Attention-3d-gqa-bool-mask", opset=23),
    # opset 24: keys past each sample's nonpad_kv_seqlen are padding
    Case("Attention", [(2, 2, 2, 2), (2, 2, 3, 2), (2, 2, 3, 2), None, None, None, np.array([2, 3])],
         id="Attention-nonpad", opset=24),

    # RotaryEmbedding (float32 only)
    Case("RotaryEmbedding", [(1, 2, 3, 4), *_angles(1, 3, 2)], id="Rotary-4d", opset=23, dtype=np.float32, tol=2e-3),
    Case("RotaryEmbedding", [(1, 3, 8), *_angles(4, 2, step=0.3), np.array([[0, 2, 3]])],
         {"num_heads": 2, "interleaved": 1}, id="Rotary-3d-interleaved-positions", opset=23, dtype=np.float32,
         tol=2e-3),
    Case("RotaryEmbedding", [(1, 2, 2, 6), *_angles(1, 2, 2)], {"rotary_embedding_dim": 4}, id="Rotary-partial",
         opset=23, dtype=np.float32, tol=2e-3),
    Case("RotaryEmbedding", [(1, 2, 2, 4), (1, 2, 2), (1, 2, 2)], id="Rotary-cache-grads", opset=23,
         dtype=np.float32, tol=2e-3),
    Case("RotaryEmbedding", [(1, 2, 2, 4), (3, 2), (3, 2), np.array([[2, 0]])], {"interleaved": 1},
         id="Rotary-cache-grads-positions", opset=23, dtype=np.float32, tol=2e-3),
]

# Forms onnxruntime 1.31 runs differently from the spec or not at all, checked against the onnx reference
# evaluator by tests/test_opset23.py: a mask shorter than the keys (refused), nonpad_kv_seqlen with is_causal (its
# float64 path aligns the causal frontier top-left), sliding windows (opset 25 attributes refused), and a query row
# with no key allowed (NaN instead of the zero row).
REFERENCE_CASES = [
    Case("Attention", [(1, 2, 2, 2), (1, 2, 3, 2), (1, 2, 3, 2), (2, 2)], id="Attention-short-mask-padded",
         opset=23),
    Case("Attention", [(2, 2, 2, 2), (2, 2, 3, 2), (2, 2, 3, 2), None, None, None, np.array([2, 3])],
         {"is_causal": 1}, id="Attention-nonpad-causal", opset=24),
    Case("Attention", [(1, 2, 4, 2), (1, 2, 4, 2), (1, 2, 4, 2)], {"left_window_size": 1, "right_window_size": 1},
         id="Attention-window", opset=25),
    Case("Attention", [(1, 2, 4, 2), (1, 2, 4, 2), (1, 2, 4, 2)], {"left_window_size": 2, "is_causal": 1},
         id="Attention-window-causal", opset=25),
    Case("Attention", [(1, 1, 2, 2), (1, 1, 3, 2), (1, 1, 3, 2), np.array([[True, False, True], [False] * 3])],
         id="Attention-masked-row", opset=23),
    Case("Attention", [(1, 2, 2, 2), (1, 2, 3, 2), (1, 2, 3, 2), (1, 1, 2, 3)],
         {"left_window_size": 0, "is_causal": 1}, id="Attention-window-float-mask", opset=25),
]
