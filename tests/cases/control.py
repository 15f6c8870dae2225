"""Control-flow, recurrent, sequence and training-mode cases: none fits this one-op table, so they live in
tests/test_control_flow.py, which runs the same checks (inner product, full Jacobian, float32 onnxruntime) on
whole models.

- If reads its operands from the outer scope, not as node inputs, so a one-op case has nothing to differentiate.
- LSTM and GRU have no float64 kernel in onnxruntime, and all three recurrent ops are differentiated through
  their unrolled form, whose forward nodes test_gradient_first.py (which expects one forward node) would flag.
- Sequence ops take or give sequences, which the table cannot feed or seed.
- BatchNormalization in training mode needs its running-statistics outputs in onnxruntime, and the table would
  make them heads of the loss, but they carry no gradient; Dropout in training mode is random.
"""
CASES = []
