import numpy as np

from gradcheck import Case, distinct, positive



def _axes(*values):
    return np.array(values, dtype=np.int64)


def _forms(op, **kw):
    """Every axes form of an op: the attribute at opset 13, the input at 18 (ReduceSum: the input at both)."""
    cases = []
    for opset in (13, 18):
        tag = f"{op}-{opset}"
        if op == "ReduceSum" or opset >= 18:
            def given(*axes, **attrs):
                return [(2, 3, 2), _axes(*axes)], attrs
        else:
            def given(*axes, **attrs):
                return [(2, 3, 2)], {"axes": list(axes), **attrs}
        for inputs, attrs, name in [
            (*given(1), "axis1-keep"),
            (*given(1, keepdims=0), "axis1-drop"),
            (*given(-1, 0, keepdims=0), "neg-axes-drop"),
            (*given(-2, keepdims=1), "neg-axis-keep"),
        ]:
            cases.append(Case(op, inputs, attrs, id=f"{tag}-{name}", opset=opset, **kw))
        cases.append(Case(op, [(2, 3)], {}, id=f"{tag}-all-keep", opset=opset, **kw))
        cases.append(Case(op, [(2, 3)], {"keepdims": 0}, id=f"{tag}-all-drop", opset=opset, **kw))
        if op == "ReduceSum" or opset >= 18:
            cases.append(Case(op, [(2, 3), _axes()], {"keepdims": 0}, id=f"{tag}-empty-axes-all", opset=opset,
                              **kw))
            cases.append(Case(op, [(2, 3), _axes()], {"noop_with_empty_axes": 1}, id=f"{tag}-noop-empty",
                              opset=opset, **kw))
            cases.append(Case(op, [(2, 3)], {"noop_with_empty_axes": 1, "keepdims": 0}, id=f"{tag}-noop-absent",
                              opset=opset, **kw))
    return cases


def _fixed(array):
    """A sampler that returns this array (for ties and zeros, which random samplers avoid)."""
    return lambda rng, shape: np.asarray(array, dtype=np.float64).reshape(shape)


TIES_MAX = [[1.0, 1.0, -0.5], [0.3, -0.7, 0.3]]   # two-way ties: central differences split them evenly too
TIES_MIN = [[-1.0, -1.0, 0.5], [0.3, -0.7, -0.7]]

CASES = [
    *_forms("ReduceSum"),
    *_forms("ReduceMean"),
    *_forms("ReduceSumSquare"),
    *_forms("ReduceL1"),
    *_forms("ReduceL2"),
    *_forms("ReduceLogSum", sampler=positive),
    *_forms("ReduceLogSumExp"),
    *_forms("ReduceMax", sampler=distinct),
    *_forms("ReduceMin", sampler=distinct),
    *_forms("ReduceProd"),
    Case("ReduceSum", [(2, 3), _axes(1)], {"keepdims": 0}, opset=23, id="ReduceSum-23"),
    Case("ReduceMax", [(2, 3), _axes(-1)], {"keepdims": 0}, opset=20, sampler=distinct, id="ReduceMax-20"),
    Case("ReduceMin", [(2, 3), _axes(0)], opset=20, sampler=distinct, id="ReduceMin-20"),
    Case("ReduceSum", [(), _axes()], {"keepdims": 0}, id="ReduceSum-rank0"),
    Case("ReduceMean", [(1, 3, 1), _axes(0, 2)], {"keepdims": 0}, id="ReduceMean-size1-axes"),
    Case("ReduceMax", [(2, 3)], {"axes": [1], "keepdims": 0}, opset=13, sampler=_fixed(TIES_MAX),
         id="ReduceMax-13-ties"),
    Case("ReduceMax", [(2, 3), _axes(1)], sampler=_fixed(TIES_MAX), id="ReduceMax-18-ties"),
    Case("ReduceMin", [(2, 3), _axes(-1)], {"keepdims": 0}, sampler=_fixed(TIES_MIN), id="ReduceMin-18-ties"),
    Case("ReduceL2", [(2, 3), _axes(1)], sampler=_fixed([[0.0, 0.0, 0.0], [0.5, -1.0, 1.2]]),
         id="ReduceL2-zero-slice"),
    Case("ReduceProd", [(2, 3), _axes(1)], sampler=_fixed([[0.0, 0.7, -1.2], [0.9, -1.1, 0.8]]),
         id="ReduceProd-one-zero"),
    Case("ReduceProd", [(2, 3)], {"axes": [-1], "keepdims": 0}, opset=13,
         sampler=_fixed([[0.0, 0.0, 1.3], [0.0, 0.6, -0.9]]), id="ReduceProd-13-two-zeros"),
    Case("ReduceProd", [(2, 3), _axes()], {"noop_with_empty_axes": 1},
         sampler=_fixed([[0.0, 0.7, -1.2], [0.9, 0.0, 0.8]]), id="ReduceProd-noop-zeros"),
]
