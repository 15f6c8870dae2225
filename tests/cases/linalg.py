import numpy as np

from gradcheck import Case

CASES = [
    # MatMul: vectors, matrices, one batched side, both batched with broadcasting either way
    Case("MatMul", [(3,), (3,)], id="MatMul-dot"),
    Case("MatMul", [(3,), (3, 2)], id="MatMul-vec-mat"),
    Case("MatMul", [(2, 3), (3,)], id="MatMul-mat-vec"),
    Case("MatMul", [(3,), (2, 3, 2)], id="MatMul-vec-batched"),
    Case("MatMul", [(2, 2, 3), (3,)], id="MatMul-batched-vec"),
    Case("MatMul", [(2, 3), (3, 4)], id="MatMul-2d"),
    Case("MatMul", [(2, 2, 3), (3, 2)], id="MatMul-batched-a"),
    Case("MatMul", [(2, 1, 2, 3), (3, 2)], id="MatMul-4d-a"),
    Case("MatMul", [(2, 3), (2, 3, 2)], id="MatMul-batched-b"),
    Case("MatMul", [(2, 2, 3), (2, 3, 2)], id="MatMul-batched-same"),
    Case("MatMul", [(1, 2, 3), (2, 3, 2)], id="MatMul-bcast-a-size1"),
    Case("MatMul", [(2, 2, 3), (1, 3, 2)], id="MatMul-bcast-b-size1"),
    Case("MatMul", [(2, 1, 2, 3), (3, 3, 2)], id="MatMul-bcast-both"),
    Case("MatMul", [(2, 2, 2, 3), (2, 3, 2)], id="MatMul-bcast-b-lead"),
    Case("MatMul", [(2, 2, 3), (2, 2, 3, 2)], id="MatMul-bcast-a-lead"),
    Case("MatMul", [(2, 3), np.full((3, 2), 0.5)], id="MatMul-const-b"),
    Case("MatMul", [np.full((2, 2, 3), 0.5), (1, 3, 2)], id="MatMul-const-a-bcast-b"),
    Case("MatMul", [(2, 3), (3, 2)], opset=13, id="MatMul-13"),
    Case("MatMul", [(2, 2, 3), (1, 3, 2)], opset=13, id="MatMul-13-batched"),
    # Gemm: every transpose pair, alpha and beta, and every shape C broadcasts from
    *[Case("Gemm", [(3, 2) if ta else (2, 3), (4, 3) if tb else (3, 4), (2, 4)],
           {"transA": ta, "transB": tb}, id=f"Gemm-tA{ta}-tB{tb}") for ta in (0, 1) for tb in (0, 1)],
    *[Case("Gemm", [(3, 2) if ta else (2, 3), (4, 3) if tb else (3, 4), (4,)],
           {"transA": ta, "transB": tb, "alpha": 0.7, "beta": -1.3}, id=f"Gemm-tA{ta}-tB{tb}-alpha-beta")
      for ta in (0, 1) for tb in (0, 1)],
    Case("Gemm", [(2, 3), (3, 4)], id="Gemm-no-c"),
    Case("Gemm", [(2, 3), (3, 4), ()], {"beta": 0.5}, id="Gemm-c-scalar"),
    Case("Gemm", [(2, 3), (3, 4), (1,)], id="Gemm-c-1"),
    Case("Gemm", [(2, 3), (3, 4), (4,)], id="Gemm-c-N"),
    Case("Gemm", [(2, 3), (3, 4), (1, 4)], id="Gemm-c-1N"),
    Case("Gemm", [(2, 3), (3, 4), (2, 1)], {"transA": 0, "beta": 2.0}, id="Gemm-c-M1"),
    Case("Gemm", [(2, 3), (3, 4), (1, 1)], id="Gemm-c-11"),
    Case("Gemm", [(3, 2), (4, 3), (2, 4)], {"transA": 1, "transB": 1, "alpha": 2.0}, opset=13, id="Gemm-13"),
    Case("Gemm", [(2, 3), np.full((4, 3), 0.5), np.zeros(4)], {"transB": 1}, id="Gemm-const-weights"),
    Case("Gemm", [np.full((2, 3), 0.5), (3, 4), (2, 1)], {"alpha": 0.5}, id="Gemm-only-b-c"),
]
