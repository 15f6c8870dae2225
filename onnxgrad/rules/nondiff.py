"""Ops whose outputs carry no gradient: shapes, masks, indices, random numbers and constants."""
from ..registry import non_differentiable

non_differentiable("Shape", "Size", "Range", "ConstantOfShape", "Constant", "EyeLike",
                   why="produces a constant or a shape")
non_differentiable("Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor",
                   "IsNaN", "IsInf", why="produces a boolean mask")
non_differentiable("ArgMax", "ArgMin", "NonZero", "Sign", "Floor", "Ceil", "Round",
                   why="produces indices or a piecewise-constant value")
non_differentiable("RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Bernoulli",
                   "Multinomial", why="produces random numbers")
non_differentiable("BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot", "Mod",
                   why="integer arithmetic")
non_differentiable("NonMaxSuppression", "Hardmax", why="produces indices or a piecewise-constant value")
